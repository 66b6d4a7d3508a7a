"""Block hashes, KV cache blocks and the doubly linked free-block queue."""
from __future__ import annotations

import hashlib
import os
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

BlockHash = bytes


def cdiv(a: int, b: int) -> int:
    """Ceiling division of integers: how many size-``b`` blocks hold ``a`` items."""
    return -(-a // b)


def _sha256(obj: Any) -> bytes:
    # pickle of ints / tuples / bytes / str is deterministic across processes and hosts.
    return hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()


def _init_none_hash() -> BlockHash:
    # The parent hash of block 0. Fixed unless PYTHONHASHSEED is set, so identical
    # content hashes identically in every process (and every host of a pod).
    seed = os.environ.get("PYTHONHASHSEED")
    return _sha256(("jaxserve-none-hash", seed)) if seed else _sha256("jaxserve-none-hash")


NONE_HASH: BlockHash = _init_none_hash()


def hash_block_tokens(
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple | None = None,
    hash_fn: Callable[[Any], bytes] = _sha256,
) -> BlockHash:
    """hash(parent, tokens of this block, extra keys); the parent of block 0 is NONE_HASH."""
    if parent_block_hash is None:
        parent_block_hash = NONE_HASH
    return hash_fn((parent_block_hash, tuple(curr_block_token_ids), extra_keys))


def generate_block_hash_extra_keys(request, start_token_idx: int, end_token_idx: int | None = None) -> tuple | None:
    """Extra keys of the block [start_token_idx, end_token_idx): the LoRA adapter (every block,
    as vLLM: ("lora", id, name, path); the id, unlike vLLM's key, so that an adapter
    unloaded and loaded again under its name, which gets a new id, never meets KV
    computed with its old weights), the hash of every image whose placeholder tokens
    the block holds (the placeholders are the same token for any image; as vLLM's
    mm extra keys), and the cache salt, which goes into block 0 only (every later hash
    depends on it through the chain)."""
    lora = getattr(request, "lora_request", None)
    keys = () if lora is None else (("lora", lora.lora_int_id, lora.lora_name, lora.lora_path),)
    mm = getattr(request, "mm", None)
    if mm is not None and end_token_idx is not None:
        keys += tuple(("mm", f.mm_hash) for f in mm.features
                      if f.offset < end_token_idx and f.end > start_token_idx)
    if start_token_idx == 0 and request.cache_salt:
        keys += (request.cache_salt,)
    return keys or None


def get_request_block_hasher(block_size: int, hash_fn: Callable[[Any], bytes] = _sha256):
    """Returns f(request) -> hashes of the full blocks not hashed yet (incremental)."""

    def request_block_hasher(request) -> list[BlockHash]:
        start = len(request.block_hashes) * block_size
        tokens = request.all_token_ids
        prev = request.block_hashes[-1] if request.block_hashes else None
        out: list[BlockHash] = []
        while start + block_size <= len(tokens):
            block_tokens = tokens[start : start + block_size]
            extra = generate_block_hash_extra_keys(request, start, start + block_size)
            prev = hash_block_tokens(prev, block_tokens, extra, hash_fn)
            out.append(prev)
            start += block_size
        return out

    return request_block_hasher


class KVCacheBlock:
    """One page of the KV cache. ``ref_cnt`` counts the requests using it; a block
    with ref_cnt 0 sits in the free queue and may still hold a (lazily evicted) hash."""

    __slots__ = ("block_id", "ref_cnt", "_block_hash", "group", "prev_free_block", "next_free_block", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self._block_hash: BlockHash | None = None
        self.group = 0  # the KV cache group whose tokens the hash describes (set with the hash)
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    def incr_ref(self) -> None:
        self.ref_cnt += 1

    def decr_ref(self) -> None:
        assert self.ref_cnt > 0, f"block {self.block_id} ref_cnt would go negative"
        self.ref_cnt -= 1

    @property
    def block_hash(self) -> BlockHash | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHash) -> None:
        assert self._block_hash is None, f"block {self.block_id} already has a hash"
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        self._block_hash = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hashed={self._block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order (head = evicted first), as a doubly linked list
    threaded through the blocks themselves, so removing a block from the middle (a
    cache hit on a free block) is O(1). Two sentinels avoid edge cases."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(-1)
        self.fake_free_list_tail = KVCacheBlock(-1)
        prev = self.fake_free_list_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        first = self.fake_free_list_head.next_free_block
        if first is self.fake_free_list_tail or first is None:
            raise ValueError("No free blocks available")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"Asked for {n} free blocks, only {self.num_free_blocks} available")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"remove() called on a block not in the free queue: {block}")
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_before(self.fake_free_list_tail, block)

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put blocks at the head, keeping their given order."""
        anchor = self.fake_free_list_head.next_free_block
        assert anchor is not None
        for block in blocks:
            self._insert_before(anchor, block)

    def _insert_before(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        assert block.prev_free_block is None and block.next_free_block is None, f"{block} already queued"
        prev = anchor.prev_free_block
        assert prev is not None
        prev.next_free_block = block
        block.prev_free_block = prev
        block.next_free_block = anchor
        anchor.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        out = []
        cur = self.fake_free_list_head.next_free_block
        while cur is not None and cur is not self.fake_free_list_tail:
            out.append(cur)
            cur = cur.next_free_block
        return out


@dataclass
class PrefixCacheStats:
    """Counters since the last reset: requests looked up, tokens queried, tokens hit."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    reset: bool = False

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


class PrefixCachingMetrics:
    """Hit rate over the most recent ``max_recent_requests`` requests (KV-10)."""

    def __init__(self, max_recent_requests: int = 1000) -> None:
        self.max_recent_requests = max_recent_requests
        self.aggregated_requests = 0
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0
        self.query_queue: list[tuple[int, int, int]] = []

    def observe(self, stats: PrefixCacheStats) -> None:
        if stats.reset:
            self.reset()
        if stats.requests == 0:
            return
        self.query_queue.append((stats.requests, stats.queries, stats.hits))
        self.aggregated_requests += stats.requests
        self.aggregated_query_total += stats.queries
        self.aggregated_query_hit += stats.hits
        while self.aggregated_requests > self.max_recent_requests and len(self.query_queue) > 1:
            r, q, h = self.query_queue.pop(0)
            self.aggregated_requests -= r
            self.aggregated_query_total -= q
            self.aggregated_query_hit -= h

    def reset(self) -> None:
        self.aggregated_requests = self.aggregated_query_total = self.aggregated_query_hit = 0
        self.query_queue.clear()

    @property
    def hit_rate(self) -> float:
        if self.aggregated_query_total == 0:
            return 0.0
        return self.aggregated_query_hit / self.aggregated_query_total


def get_max_concurrency(num_blocks: int, block_size: int, max_model_len: int) -> float:
    """How many max_model_len sequences fit in the cache at once (full attention)."""
    return (num_blocks * block_size) / max_model_len
