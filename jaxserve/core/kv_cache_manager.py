"""KVCacheManager: which blocks each request owns, prefix-cache lookups, allocation."""
from __future__ import annotations

from jaxserve.core.block_pool import BlockPool
from jaxserve.core.kv_cache_groups import KVCacheLayout
from jaxserve.core.kv_cache_utils import KVCacheBlock, PrefixCacheStats, cdiv


class KVCacheManager:
    """Maps request ids to their block lists (``req_to_blocks``) on top of a BlockPool.

    A request holds one block list per KV cache group (``layout``, see
    core/kv_cache_groups.py; one group unless the model mixes local and global
    layers), all of the same length. Invariant: a request's i-th block of each group
    holds tokens [i*block_size, (i+1)*block_size); ``num_cached_block[req]`` of them
    are hashed (full and registered for reuse, per group).

    A sliding-window group (vLLM's SlidingWindowManager): a block whose tokens all lie
    W or more positions before the next token to compute is never read again, so it
    goes back to the pool (still hashed, for prefix hits) and the list holds the null
    block in its place. A long request then holds about W / block_size + 1 blocks of
    such a group, not its context. Without a layout: one full-attention group.
    """

    def __init__(self, num_gpu_blocks: int, block_size: int, max_model_len: int, enable_caching: bool = True,
                 layout: KVCacheLayout | None = None) -> None:
        self.block_size = block_size
        # Each group's window (None: full attention); the layers themselves are the runner's.
        self.windows = tuple(g.sliding_window for g in layout.groups) if layout is not None else (None,)
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[list[KVCacheBlock]]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def empty_blocks(self) -> list[list[KVCacheBlock]]:
        return [[] for _ in self.windows]

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Hand out the counters since the last call and start new ones."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def _first_needed_block(self, window: int | None, num_computed_tokens: int) -> int:
        """The first block a query at position ``num_computed_tokens`` (or later) reads."""
        if window is None:
            return 0
        return max(num_computed_tokens - window + 1, 0) // self.block_size

    def get_computed_blocks(self, request) -> tuple[list[list[KVCacheBlock]], int]:
        """Longest run of cached full blocks at the start of the request, per group.

        A full-attention group needs every block of the run cached; a sliding group
        only the blocks the next query's window reads (it gets the null block for the
        others). The run is the longest on which every group agrees. Capped at
        ``num_tokens - 1`` tokens: the last token is always recomputed, since its
        logits are needed. Requests asking for prompt logprobs skip the cache (they
        need every prompt position's logits).
        Returns (blocks per group, num_computed_tokens); takes no references.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return self.empty_blocks(), 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[:max_blocks]
        pool = self.block_pool
        n = len(hashes)
        for g, window in enumerate(self.windows):
            if window is None:
                k = 0
                while k < n and pool.get_cached_block(hashes[k], g) is not None:
                    k += 1
                n = k
        sliding = [g for g, w in enumerate(self.windows) if w is not None]

        def window_cached(n: int) -> bool:
            return all(pool.get_cached_block(hashes[i], g) is not None
                       for g in sliding
                       for i in range(n - 1, self._first_needed_block(self.windows[g], n * self.block_size) - 1, -1))

        while n > 0 and sliding and not window_cached(n):
            n -= 1
        computed = []
        for g, window in enumerate(self.windows):
            lo = self._first_needed_block(window, n * self.block_size)
            computed.append([pool.null_block] * lo + [pool.get_cached_block(h, g) for h in hashes[lo:n]])
        return computed, n * self.block_size

    def record_prefix_cache_hit(self, request, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (called once per admission, not per retry)."""
        if self.enable_caching:
            self.prefix_cache_stats.record(request.num_tokens, num_hit_tokens, request.num_preemptions > 0)

    def allocate_slots(
        self,
        request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[list[KVCacheBlock]] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[list[KVCacheBlock]] | None:
        """Make room for ``num_new_tokens`` (+ lookahead) after the computed tokens.

        ``new_computed_blocks`` are cache hits (from get_computed_blocks, per group)
        covering ``num_new_computed_tokens`` tokens. Returns the newly allocated blocks
        per group, or None when the pool is short, in which case nothing changed (no
        references taken, nothing cached).
        """
        if num_new_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0")
        new_computed_blocks = new_computed_blocks or self.empty_blocks()
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id)
        if req_blocks is not None:
            for g, window in enumerate(self.windows):
                self.remove_skipped_blocks(req_blocks[g], request.num_computed_tokens, window)
        held = len(req_blocks[0]) if req_blocks is not None else 0
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = min(num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_required_blocks = cdiv(num_tokens_need_slot, self.block_size)
        per_group = max(num_required_blocks - held - len(new_computed_blocks[0]), 0)
        # Cache hits sitting in the free queue count against the free blocks: touching
        # them takes them out of the queue.
        num_evictable_computed = sum(1 for blocks in new_computed_blocks for b in blocks
                                     if b.ref_cnt == 0 and not b.is_null)
        if per_group * self.num_groups > self.block_pool.get_num_free_blocks() - num_evictable_computed:
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[req_id] = self.empty_blocks()
        new_blocks = []
        for g in range(self.num_groups):
            if new_computed_blocks[g]:
                assert self.enable_caching
                self.block_pool.touch(new_computed_blocks[g])
                req_blocks[g].extend(new_computed_blocks[g])
            new_blocks.append(self.block_pool.get_new_blocks(per_group))
            req_blocks[g].extend(new_blocks[g])

        if self.enable_caching:
            # Hash the blocks that these tokens fill. Only tokens that are already known
            # (prompt + sampled) can be hashed; the KV itself is written by this step,
            # before any later request of the same step reads it (per-layer write, then attend).
            num_full = min(num_computed_tokens + num_new_tokens, request.num_tokens) // self.block_size
            num_cached = self.num_cached_block.get(req_id, 0)
            for g in range(self.num_groups):
                self.block_pool.cache_full_blocks(request, req_blocks[g], num_cached, num_full, g)
            self.num_cached_block[req_id] = max(num_cached, num_full)
        return new_blocks

    def remove_skipped_blocks(self, blocks: list[KVCacheBlock], num_computed_tokens: int,
                              window: int | None) -> None:
        """Sliding window: give back the blocks no query from ``num_computed_tokens`` on can
        see (the token at position p attends to keys p - W + 1 .. p), newest first."""
        if window is None:
            return
        num_skipped = min(self._first_needed_block(window, num_computed_tokens), len(blocks))
        freed = []
        for i in range(num_skipped - 1, -1, -1):
            if blocks[i].is_null:
                break  # everything before was freed by an earlier step
            freed.append(blocks[i])
            blocks[i] = self.block_pool.null_block
        self.block_pool.free_blocks(freed)

    def num_held_blocks(self, request_id: str, group: int | None = None) -> int:
        """Blocks the request holds, in ``group`` or in all (the null block standing in
        for freed ones excluded)."""
        lists = self.req_to_blocks.get(request_id, [])
        if group is not None:
            lists = lists[group:group + 1]
        return sum(not b.is_null for blocks in lists for b in blocks)

    def num_blocks(self, request_id: str) -> int:
        """Positions the request's block lists cover (freed ones included)."""
        lists = self.req_to_blocks.get(request_id)
        return len(lists[0]) if lists else 0

    def free(self, request) -> None:
        """Release the request's blocks, tail first (so the prefix head is evicted last).

        Blocks past the request's computed tokens lose their hash first. allocate_slots
        hashes a block when the step that fills it is scheduled; a step undone before it
        ran (a victim of priority preemption already scheduled in the same step) never
        wrote it, and a later prefix hit must not read it. In every other case the
        computed tokens cover all hashed blocks and this drops nothing."""
        lists = self.req_to_blocks.pop(request.request_id, [])
        for blocks in lists:
            if self.enable_caching:
                self.block_pool.uncache_blocks(blocks[request.num_computed_tokens // self.block_size:])
            self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request.request_id, None)

    def free_tail(self, request, num_tokens: int) -> None:
        """Give back the request's blocks past those that ``num_tokens`` tokens need
        (speculative decoding: blocks held only for draft tokens that were rejected, or
        for a draft model's lookahead). The runner's block table follows: it keeps
        cdiv(num_computed_tokens (+ 1 with a draft model), block_size) blocks of a
        request before appending the next step's."""
        lists = self.req_to_blocks.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if not lists or len(lists[0]) <= keep:
            return
        for blocks in lists:
            tail = blocks[keep:]
            del blocks[keep:]
            if self.enable_caching:
                self.block_pool.uncache_blocks(tail)
            self.block_pool.free_blocks(reversed(tail))
        if self.num_cached_block.get(request.request_id, 0) > keep:
            self.num_cached_block[request.request_id] = keep

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one list per group."""
        lists = self.req_to_blocks.get(request_id)
        if lists is None:
            return tuple([] for _ in self.windows)
        return tuple([b.block_id for b in blocks] for blocks in lists)

    def reset_prefix_cache(self) -> bool:
        ok = self.block_pool.reset_prefix_cache()
        if ok:
            self.prefix_cache_stats.reset = True
        return ok

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()
