"""KV-01..KV-13: blocks, free queue, hashing, metrics (docs/vllm_behaviours.md §1)."""
import subprocess
import sys

import pytest
from factories import make_request

from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.kv_cache_utils import (
    NONE_HASH, FreeKVCacheBlockQueue, KVCacheBlock, PrefixCacheStats, PrefixCachingMetrics,
    get_max_concurrency, get_request_block_hasher, hash_block_tokens,
)


def ids(blocks):
    return [b.block_id for b in blocks]


def test_kv_cache_block():  # KV-01
    b = KVCacheBlock(0)
    assert b.ref_cnt == 0 and b.block_hash is None
    b.incr_ref(); b.incr_ref(); b.decr_ref()
    assert b.ref_cnt == 1
    b.block_hash = b"h"
    assert b.block_hash == b"h"
    b.reset_hash()
    assert b.block_hash is None


def test_free_queue_operations():  # KV-02, KV-03, KV-05
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 5
    assert q.fake_free_list_head.next_free_block is blocks[0]
    assert q.fake_free_list_tail.prev_free_block is blocks[4]
    assert q.popleft() is blocks[0]
    q.remove(blocks[2])
    assert blocks[1].next_free_block is blocks[3] and blocks[3].prev_free_block is blocks[1]
    q.append(blocks[0])
    assert ids(q.get_all_free_blocks()) == [1, 3, 4, 0]
    q.popleft_n(4)
    with pytest.raises(ValueError, match="No free blocks"):
        q.popleft()


def test_free_queue_n_ops():  # KV-04
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks[:2])
    q.append_n([blocks[4], blocks[3]])
    assert ids(q.get_all_free_blocks()) == [0, 1, 4, 3]
    popped = q.popleft_n(3)
    assert ids(popped) == [0, 1, 4]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in popped)
    assert q.popleft_n(0) == []
    q.prepend_n([blocks[5], blocks[2]])
    assert ids(q.get_all_free_blocks()) == [5, 2, 3]


def test_hash_chain():  # KV-06
    hasher = get_request_block_hasher(3)
    req = make_request("r", [1, 2, 3, 4, 5, 6], block_size=3, hasher=False)
    req._block_hasher = hasher
    req.update_block_hashes()
    assert len(req.block_hashes) == 2
    assert req.block_hashes[0] == hash_block_tokens(NONE_HASH, (1, 2, 3))
    assert req.block_hashes[1] == hash_block_tokens(req.block_hashes[0], (4, 5, 6))
    other = make_request("o", [9, 2, 3, 4, 5, 6], block_size=3)
    assert all(a != b for a, b in zip(req.block_hashes, other.block_hashes))


def test_only_full_blocks_hashed():  # KV-07
    req = make_request("r", 55)
    assert len(req.block_hashes) == 3
    req.append_output_token_ids([1] * 8)
    assert len(req.block_hashes) == 3
    req.append_output_token_ids(1)
    assert len(req.block_hashes) == 4


def test_none_hash_is_stable_across_processes():  # KV-08
    code = "from jaxserve.core.kv_cache_utils import NONE_HASH; print(NONE_HASH.hex())"
    env = {"PATH": "", "PYTHONPATH": ":".join(sys.path)}
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env).stdout for _ in range(2)}
    assert outs == {NONE_HASH.hex() + "\n"}
    seeded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**env, "PYTHONHASHSEED": "7"}).stdout
    assert seeded.strip() != NONE_HASH.hex()


def test_cache_salt():  # KV-09
    a = make_request("a", 32, cache_salt="s1")
    b = make_request("b", 32, cache_salt="s2")
    c = make_request("c", 32, cache_salt="s1")
    d = make_request("d", 32)
    assert a.block_hashes == c.block_hashes
    assert a.block_hashes[0] != b.block_hashes[0] and a.block_hashes[1] != b.block_hashes[1]
    assert d.block_hashes[0] != a.block_hashes[0]
    m = KVCacheManager(11, 16, 8192)
    m.allocate_slots(a, 32)
    assert m.get_computed_blocks(make_request("x", 33, cache_salt="s2"))[1] == 0
    assert m.get_computed_blocks(make_request("y", 33, cache_salt="s1"))[1] == 32


def test_prefix_caching_metrics():  # KV-10
    m = PrefixCachingMetrics(max_recent_requests=5)
    m.observe(PrefixCacheStats(requests=1, queries=20, hits=9))
    assert m.hit_rate == pytest.approx(0.45)
    m.observe(PrefixCacheStats(requests=4, queries=80, hits=16))
    assert m.hit_rate == pytest.approx(0.25)
    m.observe(PrefixCacheStats(requests=1, queries=10, hits=2))
    assert m.hit_rate == pytest.approx(0.2)
    m.observe(PrefixCacheStats(requests=0, queries=0, hits=0))
    assert m.hit_rate == pytest.approx(0.2)
    m.reset()
    assert m.hit_rate == 0.0


def test_max_concurrency():  # KV-11
    assert get_max_concurrency(1536, 16, 16384) == pytest.approx(1.5)


def test_allocate_with_lookahead():  # KV-13
    m = KVCacheManager(11, 4, 8192)
    req = make_request("r", 3, block_size=4)
    [blocks] = m.allocate_slots(req, 3, num_lookahead_tokens=2)
    assert len(blocks) == 2
