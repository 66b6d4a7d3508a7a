"""BlockPool: every KV cache block, the free queue and the prefix-cache hash map."""
from __future__ import annotations

from typing import Iterable, Sequence

from jaxserve.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock


class BlockPool:
    """Owns the blocks. Block 0 is the null block: never allocated, used as the
    scratch page for padded slots and for page-table padding.

    A block is in exactly one of: the free queue (ref_cnt 0), or in use (ref_cnt > 0).
    A free block may keep its hash (lazy eviction): it stays findable in
    ``cached_block_hash_to_block`` until it is handed out again.
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool) -> None:
        assert num_gpu_blocks >= 2, "need the null block plus at least one usable block"
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # Several blocks can carry the same hash (e.g. requests that skip the cache
        # read, PC-10), so the map is hash -> {block_id: block}.
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> KVCacheBlock | None:
        """A block of KV cache group ``group`` holding ``block_hash``'s tokens, if any (the
        same tokens hash alike in every group, but each group's pages are its own layers')."""
        blocks = self.cached_block_hash_to_block.get(block_hash)
        if not blocks:
            return None
        for block in blocks.values():
            if block.group == group:
                return block
        return None

    def cache_full_blocks(
        self,
        request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        group: int = 0,
    ) -> None:
        """Give blocks[num_cached_blocks:num_full_blocks] (of KV cache group ``group``) the
        request's block hashes; null entries (a sliding group's freed blocks) are skipped."""
        if num_cached_blocks >= num_full_blocks:
            return
        assert len(request.block_hashes) >= num_full_blocks, "hash missing for a full block"
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:  # a cache hit: already hashed
                continue
            block_hash = request.block_hashes[i]
            block.block_hash = block_hash
            block.group = group
            self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop blocks from the head of the free queue; a popped block loses its old hash."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ret = self.free_block_queue.popleft_n(num_blocks)
        for block in ret:
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0
            block.incr_ref()
        return ret

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        block_hash = block.block_hash
        if block_hash is None:
            return False
        bucket = self.cached_block_hash_to_block.get(block_hash)
        if bucket is not None:
            bucket.pop(block.block_id, None)
            if not bucket:
                del self.cached_block_hash_to_block[block_hash]
        block.reset_hash()
        return True

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop these blocks' hashes now: their contents are not (or no longer) what the hash says."""
        for block in blocks:
            self._maybe_evict_cached_block(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block.is_null:  # a sliding group's placeholder for a block behind the window
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.incr_ref()

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the order given (callers pass a request's
        blocks tail first, so a prefix's tail is evicted before its head). Blocks that reach
        ref_cnt 0 and hold no hash are worthless to keep and go to the *head* of the queue;
        hashed ones go to the tail (LRU)."""
        unhashed: list[KVCacheBlock] = []
        hashed: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.decr_ref()
            if block.ref_cnt == 0:
                (hashed if block.block_hash is not None else unhashed).append(block)
        if unhashed:
            self.free_block_queue.prepend_n(unhashed)
        self.free_block_queue.append_n(hashed)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Refused (False) while any block is in use."""
        num_used_blocks = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used_blocks != 1:  # only the null block
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.reset_hash()
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks in use (0.0 .. 1.0)."""
        total = self.num_gpu_blocks - 1
        return 1.0 - self.get_num_free_blocks() / total
