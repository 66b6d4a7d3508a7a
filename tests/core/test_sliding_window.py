"""KVCacheManager with a sliding window (vLLM's SlidingWindowManager): blocks every
future query is past are given back, the request keeps the null block in their place,
and a long request holds a bounded number of blocks."""
from factories import make_request, run_step

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.kv_cache_groups import KVCacheGroupSpec, make_kv_cache_layout
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.kv_cache_utils import cdiv
from jaxserve.core.sched.scheduler import Scheduler


def test_blocks_behind_the_window_are_freed_and_stay_cached():
    m = KVCacheManager(11, 16, 8192, enable_caching=True, layout=make_kv_cache_layout(1, 20))
    r = make_request("0", 64)
    m.allocate_slots(r, 64)
    r.num_computed_tokens = 64
    free_before = m.get_num_free_blocks()
    m.allocate_slots(r, 1)  # the token at 64 sees keys 45..64: blocks 0 and 1 (0..31) are behind
    [blocks] = m.req_to_blocks["0"]
    assert [b.is_null for b in blocks] == [True, True, False, False, False]
    assert m.num_held_blocks("0") == 3
    assert m.get_num_free_blocks() == free_before - 1 + 2
    # Freed, but their hashes stay: a request with the same prefix still hits them. Its
    # next token (48) reads keys 29..48, so block 0 is not needed: the null block instead.
    r2 = make_request("1", 64)
    [hit], n = m.get_computed_blocks(r2)
    assert n == 48 and [b.block_id for b in hit] == [0, 2, 3]
    m.free(r)  # the null entries are skipped
    assert m.get_num_free_blocks() == 10


def test_window_boundary_is_exact():
    """The token at position p reads keys p - W + 1 .. p: a block is freed only once its
    last token is before that."""
    m = KVCacheManager(11, 16, 8192, enable_caching=False, layout=make_kv_cache_layout(1, 17))
    r = make_request("0", 32, hasher=False)
    m.allocate_slots(r, 32)
    r.num_computed_tokens = 32  # next token 32 sees 16..32: block 0 (0..15) is behind
    m.allocate_slots(r, 1)
    assert [b.is_null for b in m.req_to_blocks["0"][0]] == [True, False, False]
    m2 = KVCacheManager(11, 16, 8192, enable_caching=False, layout=make_kv_cache_layout(1, 18))
    r2 = make_request("1", 32, hasher=False)
    m2.allocate_slots(r2, 32)
    r2.num_computed_tokens = 32  # 15..32: token 15 of block 0 is still needed
    m2.allocate_slots(r2, 1)
    assert not any(b.is_null for b in m2.req_to_blocks["1"][0])


def test_long_decode_holds_bounded_blocks():
    """200 decode steps on 11 blocks of 16 (160 tokens of cache): without the window this
    request could not even fit; with a window of 32 it holds at most 4 blocks."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=4, max_model_len=1024),
                      CacheConfig(block_size=16, enable_prefix_caching=True), 11, check_invariants=True,
                      kv_cache_layout=make_kv_cache_layout(1, 32))
    sched.add_request(make_request("0", 40, max_tokens=200, ignore_eos=True))
    held = []
    while sched.requests:
        run_step(sched)
        if "0" in sched.requests:
            held.append(sched.kv_cache_manager.num_held_blocks("0"))
    assert len(held) == 199 and max(held) <= cdiv(32, 16) + 2


def test_layout_groups_of_mixed_layers():
    """Gemma 3's five local layers to one global: groups as large as the global layers'
    count; Gemma 2's alternation: two groups of half the layers; uniform models: one."""
    layout = make_kv_cache_layout(12, 8, tuple(i % 6 != 5 for i in range(12)))
    assert layout.slots_per_block == 2
    assert [(g.layers, g.sliding_window) for g in layout.groups] == [
        ((5, 11), None), ((0, 1), 8), ((2, 3), 8), ((4, 6), 8), ((7, 8), 8), ((9, 10), 8)]
    assert layout.layer_group[11] == 0 and layout.layer_slot[11] == 1
    assert layout.layer_group[6] == 3 and layout.layer_slot[6] == 1
    gemma2 = make_kv_cache_layout(4, 8, (True, False, True, False))
    assert gemma2.slots_per_block == 2 and [g.layers for g in gemma2.groups] == [(1, 3), (0, 2)]
    assert make_kv_cache_layout(4).groups == (KVCacheGroupSpec((0, 1, 2, 3)),)
    assert make_kv_cache_layout(4, 8).groups == (KVCacheGroupSpec((0, 1, 2, 3), 8),)
    # A short last group (7 local layers in groups of 2) leaves one slot unused.
    odd = make_kv_cache_layout(9, 8, tuple(i not in (3, 8) for i in range(9)))
    assert [len(g.layers) for g in odd.groups] == [2, 2, 2, 2, 1]
    # Blocks held: the whole context in the global group, window + chunk in each local one.
    assert gemma2.blocks_held(1000, 16, 32) == 63 + min(63, cdiv(8 + 32, 16) + 2)


def hybrid_manager(num_blocks=40, caching=True):
    """Gemma 2's layout, 4 layers, window 20: one global group, one local group."""
    return KVCacheManager(num_blocks, 16, 8192, enable_caching=caching,
                          layout=make_kv_cache_layout(4, 20, (True, False, True, False)))


def test_hybrid_groups_free_only_the_local_blocks():
    m = hybrid_manager()
    r = make_request("0", 64)
    new = m.allocate_slots(r, 64)
    assert [len(g) for g in new] == [4, 4] and m.get_num_free_blocks() == 39 - 8
    r.num_computed_tokens = 64
    m.allocate_slots(r, 1)  # the token at 64 sees keys 45..64: the local group drops blocks 0, 1
    full, local = m.req_to_blocks["0"]
    assert not any(b.is_null for b in full)
    assert [b.is_null for b in local] == [True, True, False, False, False]
    assert m.num_held_blocks("0", 0) == 5 and m.num_held_blocks("0", 1) == 3
    assert m.get_num_free_blocks() == 39 - 10 + 2
    ids = m.get_block_ids("0")
    assert len(ids) == 2 and len(ids[0]) == len(ids[1]) == 5 and ids[1][:2] == [0, 0]
    m.free(r)
    assert m.get_num_free_blocks() == 39


def test_hybrid_prefix_hit_needs_every_group():
    """A hit covers blocks cached in the global group and, in the local group, the blocks
    the next token's window reads; the same tokens' blocks are separate per group."""
    m = hybrid_manager()
    r = make_request("0", 80)
    m.allocate_slots(r, 80)
    r.num_computed_tokens = 80
    m.free(r)
    r2 = make_request("1", 80)
    (full, local), n = m.get_computed_blocks(r2)
    assert n == 64  # 79 // 16 blocks: the last token is recomputed
    assert len(full) == len(local) == 4 and not any(b.is_null for b in full)
    assert [b.is_null for b in local] == [True, True, False, False]  # 64 reads 45..64
    assert {b.block_id for b in full}.isdisjoint(b.block_id for b in local if not b.is_null)
    # The local group's block 2 evicted: the hit stops where the window last had its blocks.
    m.block_pool._maybe_evict_cached_block(local[2])
    (full, local), n = m.get_computed_blocks(r2)
    assert n == 32 and [b.is_null for b in local] == [False, False]  # 32 reads 13..32: blocks 0, 1
    # The global group's block 1 evicted: nothing past it can hit.
    m.block_pool._maybe_evict_cached_block(full[1])
    assert m.get_computed_blocks(r2)[1] == 16


def test_hybrid_scheduler_long_decode_and_parity_of_lists():
    """A long decode under the scheduler with a hybrid layout: the global group holds the
    context, the local group a bounded number of blocks, and the block accounting adds up
    every step (check_invariants)."""
    layout = make_kv_cache_layout(4, 32, (True, False, True, False))
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=4, max_model_len=1024),
                      CacheConfig(block_size=16, enable_prefix_caching=True), 40, check_invariants=True,
                      kv_cache_layout=layout)
    sched.add_request(make_request("0", 40, max_tokens=200, ignore_eos=True))
    held = []
    while sched.requests:
        so, _ = run_step(sched)
        for ids in so.scheduled_cached_reqs.new_block_ids:
            assert len(ids) == 2 and len(ids[0]) == len(ids[1])
        if "0" in sched.requests:
            held.append((sched.kv_cache_manager.num_held_blocks("0", 0), sched.kv_cache_manager.num_held_blocks("0", 1)))
    assert len(held) == 199
    assert held[-1][0] == cdiv(239, 16) and max(h[1] for h in held) <= cdiv(32, 16) + 2
