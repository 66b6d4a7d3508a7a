"""PC-01..PC-17: the KV cache manager with prefix caching (docs/vllm_behaviours.md §2).

Setup as vLLM's tests: block_size 16, 11 blocks (block 0 is the null block).
Free-queue placement choice (PC-03 [VER]): blocks freed without a hash go to the
*head* of the queue (newest vLLM), hashed blocks to the tail, a request's blocks tail first.
"""
from factories import make_request

from jaxserve.core.kv_cache_manager import KVCacheManager


def ids(blocks):
    return [b.block_id for b in blocks]


def free_ids(m):
    return ids(m.block_pool.free_block_queue.get_all_free_blocks())


def mgr(caching=True, num_blocks=11):
    return KVCacheManager(num_blocks, 16, 8192, enable_caching=caching)


def common(n=48):
    return list(range(n))


def schedule(m, req):
    """What the scheduler does on admission. Returns group 0's blocks (one group here)."""
    computed, n = m.get_computed_blocks(req)
    blocks = m.allocate_slots(req, req.num_tokens - n, n, computed)
    if blocks is not None:
        req.num_computed_tokens = req.num_tokens
    return computed[0], n, blocks if blocks is None else blocks[0]


def test_prefill_hit_and_eviction_order():  # PC-01, PC-02, PC-03, PC-04
    m = mgr()
    r0 = make_request("0", common() + [100 + i for i in range(7)])
    computed, n, blocks = schedule(m, r0)
    assert (computed, n) == ([], 0)
    assert ids(blocks) == [1, 2, 3, 4]
    pool = m.block_pool
    assert all(pool.blocks[i].block_hash is not None and pool.blocks[i].ref_cnt == 1 for i in (1, 2, 3))
    assert pool.blocks[4].block_hash is None

    r1 = make_request("1", common() + [200 + i for i in range(5)])
    computed, n, blocks = schedule(m, r1)
    assert n == 48 and ids(computed) == [1, 2, 3]
    assert ids(blocks) == [5]
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 2, 2]
    assert m.get_num_free_blocks() == 5

    m.free(r0)
    m.free(r1)
    assert m.get_num_free_blocks() == 10
    assert free_ids(m) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    # PC-04: hits after the owners freed the blocks.
    r2 = make_request("2", common() + [300 + i for i in range(7)])
    computed, n, blocks = schedule(m, r2)
    assert n == 48 and ids(computed) == [1, 2, 3] and ids(blocks) == [5]
    assert m.get_num_free_blocks() == 6

    # PC-05: exhaust the pool: a 160-token request takes every block in queue order.
    m.free(r2)
    r3 = make_request("3", [999] * 160)
    computed, n, blocks = schedule(m, r3)
    assert n == 0
    assert ids(blocks) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    # Every old hash was evicted with its block: the map holds exactly r3's 10 blocks.
    assert m.block_pool.cached_block_hash_to_block == {
        h: {b.block_id: b} for h, b in zip(r3.block_hashes, blocks, strict=True)
    }
    assert all(r2.block_hashes[i] not in m.block_pool.cached_block_hash_to_block for i in range(3))


def test_lru_touch():  # PC-06
    m = mgr()
    r0 = make_request("0", 87)
    _, _, b0 = schedule(m, r0)
    assert ids(b0) == [1, 2, 3, 4, 5, 6]
    r1 = make_request("1", [5000 + i for i in range(48)])
    _, _, b1 = schedule(m, r1)
    assert ids(b1) == [7, 8, 9]
    m.free(r0)
    m.free(r1)
    assert free_ids(m) == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]
    r2 = make_request("2", [1000 + i for i in range(32)] + [1, 2, 3])
    computed, n, blocks = schedule(m, r2)
    assert n == 32 and ids(computed) == [1, 2]
    assert ids(blocks) == [6]
    assert m.get_num_free_blocks() == 7


def test_hash_cleared_on_partial_reuse():  # PC-07
    m = mgr(num_blocks=3)
    r0 = make_request("0", 16)
    schedule(m, r0)
    m.free(r0)
    assert m.block_pool.blocks[1].block_hash is not None
    r1 = make_request("1", [7] * 20)  # needs 2 blocks: free queue is [2, 1]
    _, _, blocks = schedule(m, r1)
    assert ids(blocks) == [2, 1]
    assert m.block_pool.blocks[1].block_hash is None


def test_computed_blocks_not_evicted():  # PC-08
    m = mgr(num_blocks=3)
    r0 = make_request("0", 16)
    schedule(m, r0)
    m.free(r0)
    r1 = make_request("1", 17)
    computed, n, blocks = schedule(m, r1)
    assert ids(computed) == [1] and n == 16 and ids(blocks) == [2]


def test_prefix_caching_disabled():  # PC-09
    m = mgr(caching=False)
    r0 = make_request("0", 48)
    schedule(m, r0)
    assert all(b.block_hash is None for b in m.block_pool.blocks)
    m.free(r0)
    r1 = make_request("1", 48)
    assert m.get_computed_blocks(r1) == ([[]], 0)
    big = make_request("2", 16 * 11)
    assert m.allocate_slots(big, big.num_tokens) is None
    assert m.get_num_free_blocks() == 10 and not m.req_to_blocks


def test_prompt_logprobs_skip_cache_read():  # PC-10
    m = mgr()
    r0 = make_request("0", 48)
    schedule(m, r0)
    r1 = make_request("1", 48, prompt_logprobs=1)
    computed, n, blocks = schedule(m, r1)
    assert n == 0 and ids(blocks) == [4, 5, 6]
    bucket = m.block_pool.cached_block_hash_to_block[r0.block_hashes[0]]
    assert sorted(bucket) == [1, 4]
    m.free(r0)
    m.free(r1)
    # Evicting one duplicate keeps the other findable.
    m.block_pool._maybe_evict_cached_block(m.block_pool.blocks[1])
    assert m.block_pool.get_cached_block(r0.block_hashes[0]).block_id == 4


def test_failed_allocation_leaks_nothing():  # PC-11
    m = mgr()
    r0 = make_request("0", 48)
    schedule(m, r0)
    m.free(r0)
    refs_before = [b.ref_cnt for b in m.block_pool.blocks]
    queue_before = free_ids(m)
    r1 = make_request("1", 48 + 16 * 8)  # 3 hits + 8 new blocks > 10 free
    computed, n, blocks = schedule(m, r1)
    assert n == 48 and blocks is None
    assert [b.ref_cnt for b in m.block_pool.blocks] == refs_before
    assert free_ids(m) == queue_before
    assert "1" not in m.req_to_blocks


def test_reset_prefix_cache():  # PC-12
    m = mgr()
    r0 = make_request("0", 48)
    schedule(m, r0)
    assert m.reset_prefix_cache() is False
    assert m.block_pool.cached_block_hash_to_block
    m.free(r0)
    assert m.reset_prefix_cache() is True
    assert not m.block_pool.cached_block_hash_to_block
    assert all(b.block_hash is None for b in m.block_pool.blocks)


def test_decode_allocation():  # PC-13
    m = mgr()
    r0 = make_request("0", 55)
    schedule(m, r0)
    r0.append_output_token_ids([1, 2, 3, 4])
    assert m.allocate_slots(r0, 4) == [[]]
    r0.num_computed_tokens += 4
    assert m.block_pool.blocks[4].block_hash is None
    r0.append_output_token_ids([5] * 19)
    [new] = m.allocate_slots(r0, 19)
    assert ids(new) == [5]
    assert m.block_pool.blocks[4].block_hash == r0.block_hashes[3]


def test_hit_capped_below_prompt_len():  # PC-14
    m = mgr()
    schedule(m, make_request("0", 33))
    assert m.get_computed_blocks(make_request("a", 17))[1] == 16
    assert m.get_computed_blocks(make_request("b", 33))[1] == 32
    assert m.get_computed_blocks(make_request("c", 32))[1] == 16
