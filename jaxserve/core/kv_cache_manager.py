"""KVCacheManager: which blocks each request owns, prefix-cache lookups, allocation."""
from __future__ import annotations

from collections import defaultdict

from jaxserve.core.block_pool import BlockPool
from jaxserve.core.kv_cache_utils import KVCacheBlock, PrefixCacheStats, cdiv


class KVCacheManager:
    """Maps request ids to their block lists (``req_to_blocks``) on top of a BlockPool.

    Invariant: a request's i-th block holds tokens [i*block_size, (i+1)*block_size);
    ``num_cached_block[req]`` of them are hashed (full and registered for reuse).

    ``sliding_window`` (a model whose every layer attends to the last W tokens only, as
    vLLM's SlidingWindowManager): a block whose tokens all lie W or more positions
    before the next token to compute is never read again, so it goes back to the pool
    (still hashed, for prefix hits) and the request's list holds the null block in its
    place. A long request then holds about W / block_size + 1 blocks, not its context.
    """

    def __init__(self, num_gpu_blocks: int, block_size: int, max_model_len: int, enable_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching)
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Hand out the counters since the last call and start new ones."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def get_computed_blocks(self, request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request.

        Capped at ``num_tokens - 1`` tokens: the last token is always recomputed,
        since its logits are needed. Requests asking for prompt logprobs skip the
        cache (they need every prompt position's logits).
        Returns (blocks, num_computed_tokens); takes no references.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_cache_hit_length = request.num_tokens - 1
        max_blocks = max_cache_hit_length // self.block_size
        computed: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed.append(block)
        return computed, len(computed) * self.block_size

    def record_prefix_cache_hit(self, request, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (called once per admission, not per retry)."""
        if self.enable_caching:
            self.prefix_cache_stats.record(request.num_tokens, num_hit_tokens, request.num_preemptions > 0)

    def allocate_slots(
        self,
        request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` (+ lookahead) after the computed tokens.

        ``new_computed_blocks`` are cache hits (from get_computed_blocks) covering
        ``num_new_computed_tokens`` tokens. Returns the newly allocated blocks, or
        None when the pool is short, in which case nothing changed (no references
        taken, nothing cached).
        """
        if num_new_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0")
        new_computed_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks[request.request_id]
        self.remove_skipped_blocks(req_blocks, request.num_computed_tokens)
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = min(num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_required_blocks = cdiv(num_tokens_need_slot, self.block_size)
        num_new_blocks = num_required_blocks - len(req_blocks) - len(new_computed_blocks)
        # Cache hits sitting in the free queue count against the free blocks: touching
        # them takes them out of the queue.
        num_evictable_computed = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_evictable_computed:
            if not req_blocks:
                self.req_to_blocks.pop(request.request_id, None)
            return None

        if new_computed_blocks:
            assert self.enable_caching
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            # Hash the blocks that these tokens fill. Only tokens that are already known
            # (prompt + sampled) can be hashed; the KV itself is written by this step,
            # before any later request of the same step reads it (per-layer write, then attend).
            num_full = min(num_computed_tokens + num_new_tokens, request.num_tokens) // self.block_size
            num_cached = self.num_cached_block.get(request.request_id, 0)
            self.block_pool.cache_full_blocks(request, req_blocks, num_cached, num_full)
            self.num_cached_block[request.request_id] = max(num_cached, num_full)
        return new_blocks

    def remove_skipped_blocks(self, blocks: list[KVCacheBlock], num_computed_tokens: int) -> None:
        """Sliding window: give back the blocks no query from ``num_computed_tokens`` on can
        see (the token at position p attends to keys p - W + 1 .. p), newest first."""
        if self.sliding_window is None:
            return
        first_needed = num_computed_tokens - self.sliding_window + 1
        num_skipped = min(max(first_needed, 0) // self.block_size, len(blocks))
        freed = []
        for i in range(num_skipped - 1, -1, -1):
            if blocks[i].is_null:
                break  # everything before was freed by an earlier step
            freed.append(blocks[i])
            blocks[i] = self.block_pool.null_block
        self.block_pool.free_blocks(freed)

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds (the null block standing in for freed ones excluded)."""
        return sum(not b.is_null for b in self.req_to_blocks.get(request_id, []))

    def free(self, request) -> None:
        """Release the request's blocks, tail first (so the prefix head is evicted last).

        Blocks past the request's computed tokens lose their hash first. allocate_slots
        hashes a block when the step that fills it is scheduled; a step undone before it
        ran (a victim of priority preemption already scheduled in the same step) never
        wrote it, and a later prefix hit must not read it. In every other case the
        computed tokens cover all hashed blocks and this drops nothing."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
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
        blocks = self.req_to_blocks.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if not blocks or len(blocks) <= keep:
            return
        tail = blocks[keep:]
        del blocks[keep:]
        if self.enable_caching:
            self.block_pool.uncache_blocks(tail)
        self.block_pool.free_blocks(reversed(tail))
        if self.num_cached_block.get(request.request_id, 0) > keep:
            self.num_cached_block[request.request_id] = keep

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        ok = self.block_pool.reset_prefix_cache()
        if ok:
            self.prefix_cache_stats.reset = True
        return ok

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()
