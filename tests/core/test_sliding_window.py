"""KVCacheManager with a sliding window (vLLM's SlidingWindowManager): blocks every
future query is past are given back, the request keeps the null block in their place,
and a long request holds a bounded number of blocks."""
from factories import make_request, run_step

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.kv_cache_utils import cdiv
from jaxserve.core.sched.scheduler import Scheduler


def test_blocks_behind_the_window_are_freed_and_stay_cached():
    m = KVCacheManager(11, 16, 8192, enable_caching=True, sliding_window=20)
    r = make_request("0", 64)
    m.allocate_slots(r, 64)
    r.num_computed_tokens = 64
    free_before = m.get_num_free_blocks()
    m.allocate_slots(r, 1)  # the token at 64 sees keys 45..64: blocks 0 and 1 (0..31) are behind
    blocks = m.req_to_blocks["0"]
    assert [b.is_null for b in blocks] == [True, True, False, False, False]
    assert m.num_held_blocks("0") == 3
    assert m.get_num_free_blocks() == free_before - 1 + 2
    # Freed, but their hashes stay: a request with the same prefix still hits them.
    r2 = make_request("1", 64)
    hit, n = m.get_computed_blocks(r2)
    assert n == 48 and [b.block_id for b in hit[:2]] == [1, 2]
    m.free(r)  # the null entries are skipped
    assert m.get_num_free_blocks() == 10


def test_window_boundary_is_exact():
    """The token at position p reads keys p - W + 1 .. p: a block is freed only once its
    last token is before that."""
    m = KVCacheManager(11, 16, 8192, enable_caching=False, sliding_window=17)
    r = make_request("0", 32, hasher=False)
    m.allocate_slots(r, 32)
    r.num_computed_tokens = 32  # next token 32 sees 16..32: block 0 (0..15) is behind
    m.allocate_slots(r, 1)
    assert [b.is_null for b in m.req_to_blocks["0"]] == [True, False, False]
    m2 = KVCacheManager(11, 16, 8192, enable_caching=False, sliding_window=18)
    r2 = make_request("1", 32, hasher=False)
    m2.allocate_slots(r2, 32)
    r2.num_computed_tokens = 32  # 15..32: token 15 of block 0 is still needed
    m2.allocate_slots(r2, 1)
    assert not any(b.is_null for b in m2.req_to_blocks["1"])


def test_long_decode_holds_bounded_blocks():
    """200 decode steps on 11 blocks of 16 (160 tokens of cache): without the window this
    request could not even fit; with a window of 32 it holds at most 4 blocks."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=4, max_model_len=1024),
                      CacheConfig(block_size=16, enable_prefix_caching=True), 11, check_invariants=True,
                      sliding_window=32)
    sched.add_request(make_request("0", 40, max_tokens=200, ignore_eos=True))
    held = []
    while sched.requests:
        run_step(sched)
        if "0" in sched.requests:
            held.append(sched.kv_cache_manager.num_held_blocks("0"))
    assert len(held) == 199 and max(held) <= cdiv(32, 16) + 2
