"""SC-01..SC-18 and PC-15..PC-17 at scheduler level (docs/vllm_behaviours.md §2-3)."""
import pytest
from factories import EOS, assert_scheduler_empty, make_request, make_scheduler, run_step

from jaxserve.outputs import ModelRunnerOutput
from jaxserve.request import FinishReason, RequestStatus


def sched_tokens(so):
    return [so.num_scheduled_tokens[r] for r in so.num_scheduled_tokens]


def drain(s, token=7, max_steps=1000):
    for _ in range(max_steps):
        if not s.has_requests():
            return
        run_step(s, token)
    raise AssertionError("did not finish")


def test_add_and_abort():  # SC-01
    s = make_scheduler()
    reqs = [make_request(i, 10) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    assert [r.request_id for r in s.waiting] == ["0", "1", "2"]
    s.finish_requests("1", RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in s.waiting] == ["0", "2"]
    assert s.get_num_unfinished_requests() == 2
    with pytest.raises(ValueError):
        s.add_request(make_request("0", 5))


def test_schedule_all():  # SC-02
    s = make_scheduler(num_blocks=100)
    for i in range(10):
        s.add_request(make_request(i, [i] * 10, prompt_logprobs=5))
    so = s.schedule()
    assert len(so.scheduled_new_reqs) == 10 and len(s.waiting) == 0
    assert [r.request_id for r in s.running] == [str(i) for i in range(10)]
    assert all(n == 10 for n in so.num_scheduled_tokens.values())


def test_chunked_prefill_concurrent_partial():  # SC-03, SC-04
    s = make_scheduler(num_blocks=1000, max_num_batched_tokens=1024, long_prefill_token_threshold=400)
    for i in range(3):
        s.add_request(make_request(i, [i] * 800))
    so, outs = run_step(s)
    assert sched_tokens(so) == [400, 400, 224]
    assert outs == [] and all(r.status == RequestStatus.RUNNING for r in s.running)
    so, outs = run_step(s)
    assert sched_tokens(so) == [400, 400, 224]
    assert [o.request_id for o in outs] == ["0", "1"]
    so, _ = run_step(s)
    assert sched_tokens(so) == [1, 1, 352]


def test_fcfs_no_skip_without_chunked_prefill():  # SC-05
    kw = dict(num_blocks=1000, max_num_batched_tokens=1024, max_num_seqs=3, max_model_len=1024)
    s = make_scheduler(enable_chunked_prefill=False, **kw)
    for i, n in enumerate([800, 800, 10, 10]):
        s.add_request(make_request(i, [i] * n))
    assert len(s.schedule().scheduled_new_reqs) == 1
    s = make_scheduler(enable_chunked_prefill=True, **kw)
    for i, n in enumerate([800, 800, 10, 10]):
        s.add_request(make_request(i, [i] * n))
    assert len(s.schedule().scheduled_new_reqs) == 2


def _finish(s, req, tokens):
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    out = ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [list(tokens) if r == req.request_id else [] for r in ids])
    return s.update_from_output(so, out)


def test_stop_rules():  # SC-06
    s = make_scheduler()
    eos_req = make_request("eos", 5)
    stop_req = make_request("stop", 5, stop_token_ids=[42])
    len_req = make_request("len", 5, max_tokens=2)
    ign_req = make_request("ign", 5, ignore_eos=True, max_tokens=3)
    for r in (eos_req, stop_req, len_req, ign_req):
        s.add_request(r)
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    # Several tokens per request in one output, as speculative decoding would give.
    toks = {"eos": [EOS, 5], "stop": [3, 42, 9], "len": [1, 2, 3], "ign": [EOS, EOS, 4, 5]}
    outs = {o.request_id: o for o in s.update_from_output(
        so, ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [toks[r] for r in ids]))}
    assert eos_req.status == RequestStatus.FINISHED_STOPPED and eos_req.output_token_ids == [EOS]
    assert outs["eos"].finish_reason == FinishReason.STOP and outs["eos"].stop_reason is None
    assert stop_req.output_token_ids == [3, 42] and stop_req.stop_reason == 42
    assert outs["stop"].new_token_ids == [3, 42]
    assert len_req.status == RequestStatus.FINISHED_LENGTH_CAPPED and len_req.output_token_ids == [1, 2]
    assert ign_req.output_token_ids == [EOS, EOS, 4] and ign_req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_scheduler_empty(s)


def test_min_tokens_and_max_model_len():  # SC-07
    s = make_scheduler()
    r = make_request("r", 5, min_tokens=3, stop_token_ids=[42], max_tokens=10)
    s.add_request(r)
    _finish(s, r, [EOS, 42])
    assert r.status == RequestStatus.RUNNING and r.output_token_ids == [EOS, 42]
    _finish(s, r, [42])
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 42
    s = make_scheduler(max_model_len=8)
    r = make_request("m", 6, max_tokens=100)
    s.add_request(r)
    drain(s)
    assert r.num_tokens == 8 and r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_prompt_longer_than_model_rejected():
    s = make_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len=8"):
        s.add_request(make_request("r", 9))
    # A prompt of exactly max_model_len fits: it yields one token (CL-01, newest V1).
    r = make_request("ok", 8)
    s.add_request(r)
    drain(s)
    assert r.num_output_tokens == 1 and r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_preemption_and_resume():  # SC-08, SC-09
    s = make_scheduler(num_blocks=11)
    r0 = make_request("0", 80, max_tokens=100, ignore_eos=True)
    r1 = make_request("1", [9] * 80, max_tokens=100, ignore_eos=True)
    s.add_request(r0)
    s.add_request(r1)
    run_step(s)
    assert s.kv_cache_manager.get_num_free_blocks() == 0
    # r0 needs a 6th block at its 81st token... it has 80 tokens + 1 sampled = 81.
    so, _ = run_step(s)
    assert so.preempted_req_ids == {"1"}
    assert r1.status == RequestStatus.PREEMPTED and r1.num_computed_tokens == 0
    assert list(s.waiting)[0] is r1
    assert r1.num_preemptions == 1 and r1.output_token_ids == [7]
    assert s.kv_cache_manager.get_block_ids("1") == ([],)
    # Finish r0; then r1 resumes by recomputing prompt + its generated token.
    s.finish_requests("0", RequestStatus.FINISHED_ABORTED)
    so, _ = run_step(s)
    assert so.scheduled_cached_reqs.req_ids == ["1"]
    assert so.scheduled_cached_reqs.resumed_from_preemption == [True]
    # r1's freed blocks went back tail first and r0's new block evicted that tail, so
    # 4 of its 5 prompt blocks still hit: 81 - 64 tokens are recomputed.
    assert so.num_scheduled_tokens["1"] == 81 - 64
    assert len(so.scheduled_cached_reqs.new_block_ids[0][0]) == 6
    s.finish_requests("1", RequestStatus.FINISHED_ABORTED)
    assert_scheduler_empty(s)


def test_preempted_resume_recomputes_everything_without_cache():  # SC-09 (30 + 2 tokens)
    s = make_scheduler(num_blocks=5, enable_prefix_caching=False)
    r0 = make_request("0", 30, max_tokens=100, ignore_eos=True)
    r1 = make_request("1", [3] * 31, max_tokens=100, ignore_eos=True)
    s.add_request(r0)
    s.add_request(r1)
    run_step(s)
    run_step(s)
    run_step(s)  # r1 computes position 32 -> needs a 3rd block: the last added (r1) is preempted
    assert r1.status == RequestStatus.PREEMPTED
    s.finish_requests("0", RequestStatus.FINISHED_ABORTED)
    so, _ = run_step(s)
    assert so.num_scheduled_tokens["1"] == 33 and r1.all_token_ids[-1] == 7


def test_priority_ordering():  # SC-10, SC-12
    s = make_scheduler(policy="priority", max_num_seqs=2, num_blocks=100)
    for i, p in enumerate([2, 0, 1, 0]):
        s.add_request(make_request(i, 10, priority=p, arrival_time=float(i)))
    so = s.schedule()
    assert [r.req_id for r in so.scheduled_new_reqs] == ["1", "3"]
    assert [r.request_id for r in s.waiting] == ["2", "0"]


def test_priority_preemption_victim():  # SC-11
    s = make_scheduler(policy="priority", num_blocks=11)
    hi = make_request("hi", 80, priority=0, arrival_time=1.0, ignore_eos=True, max_tokens=50)
    lo = make_request("lo", [5] * 80, priority=5, arrival_time=0.0, ignore_eos=True, max_tokens=50)
    s.add_request(lo)
    s.add_request(hi)
    run_step(s)
    so, _ = run_step(s)
    assert so.preempted_req_ids == {"lo"} and hi.status == RequestStatus.RUNNING


def test_preempted_request_stopping_on_an_in_flight_token():  # SC-08
    """Step 1 is scheduled, then step 2 is scheduled before step 1's output is back and
    preempts request 1; step 1's output then stops request 1 (EOS). It must leave the
    waiting queue, not crash on the running list."""
    s = make_scheduler(num_blocks=11)
    r0 = make_request(0, 80, max_tokens=100)
    r1 = make_request(1, [2000 + i for i in range(80)], max_tokens=100)
    s.add_request(r0)
    s.add_request(r1)
    so1 = s.schedule()
    r0.append_output_token_ids([5])  # r0 now needs a 6th block: r1 is preempted
    so2 = s.schedule()
    assert so2.preempted_req_ids == {"1"} and r1.status == RequestStatus.PREEMPTED
    outs = s.update_from_output(so1, ModelRunnerOutput(["0", "1"], {"0": 0, "1": 1}, [[], [EOS]]))
    assert [(o.request_id, o.finish_reason) for o in outs] == [("1", FinishReason.STOP)]
    assert r1.status == RequestStatus.FINISHED_STOPPED and r1 not in list(s.waiting) and "1" not in s.requests


def test_undone_victim_leaves_no_hash_on_unwritten_blocks():
    """Priority preemption of a request already scheduled in the same step undoes its
    step: the blocks that step would have filled (hashed when allocated) were never
    written, so they must not stay in the prefix cache for the victim's resume."""
    s = make_scheduler(policy="priority", num_blocks=9, long_prefill_token_threshold=32)
    lo = make_request("lo", 96, priority=1, arrival_time=0.0, ignore_eos=True)
    hi = make_request("hi", [7] * 48, priority=0, arrival_time=1.0, ignore_eos=True)
    s.add_request(lo)
    run_step(s)  # lo: tokens 0-31 (blocks 1, 2)
    s.add_request(hi)
    run_step(s)  # lo: 32-63 (3, 4); hi: 0-31 (5, 6)
    # lo takes blocks 7 and 8 for 64-95; hi then needs one for 32-47: lo is undone and
    # freed tail first, so hi reuses 8 and block 7 stays free, hashed but never written.
    so, _ = run_step(s)
    assert so.preempted_req_ids == {"lo"} and "lo" not in so.num_scheduled_tokens
    assert s.kv_cache_manager.get_block_ids("hi") == ([5, 6, 8],)
    [blocks], hit_tokens = s.kv_cache_manager.get_computed_blocks(lo)
    assert hit_tokens == 64 and [b.block_id for b in blocks] == [1, 2, 3, 4]
    assert s.kv_cache_manager.block_pool.blocks[7].block_hash is None
    drain(s)
    assert_scheduler_empty(s)


def test_no_leak_after_many_requests():  # SC-13
    s = make_scheduler(num_blocks=30, max_num_batched_tokens=64)
    for i in range(12):
        s.add_request(make_request(i, [i % 3] * (10 + i * 7), max_tokens=1 + i % 5, ignore_eos=True))
    drain(s)
    assert_scheduler_empty(s)
    assert not s.finished_req_ids or s.schedule() and not s.finished_req_ids


def test_stats():  # SC-14
    s = make_scheduler(num_blocks=100, max_num_batched_tokens=100)
    for i in range(3):
        s.add_request(make_request(i, [i] * 50))
    s.schedule()
    st = s.make_stats()
    assert (st.num_running_reqs, st.num_waiting_reqs) == (2, 1)


def test_dedup_in_one_step():  # PC-15
    s = make_scheduler(num_blocks=100)
    s.add_request(make_request("a", [4] * 100))
    s.add_request(make_request("b", [4] * 100))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 100, "b": 4}


def test_multi_turn_hits():  # PC-16
    s = make_scheduler(num_blocks=100)
    first = make_request("t1", 40, max_tokens=10, ignore_eos=True)
    s.add_request(first)
    drain(s)
    second = make_request("t2", first.all_token_ids + [1, 2, 3])
    s.add_request(second)
    so = s.schedule()
    assert so.num_scheduled_tokens["t2"] == second.num_tokens % 16


def test_prefix_cache_stats():  # PC-17
    s = make_scheduler(num_blocks=100)
    s.add_request(make_request("a", 32))
    s.add_request(make_request("b", 48))
    s.schedule()
    st = s.make_stats().prefix_cache_stats
    assert (st.requests, st.queries, st.hits) == (2, 80, 32)
    off = make_scheduler(num_blocks=100, enable_prefix_caching=False)
    off.add_request(make_request("a", 32))
    off.schedule()
    st = off.make_stats().prefix_cache_stats
    assert (st.requests, st.queries, st.hits) == (0, 0, 0)


def test_concurrent_partial_prefill_e2e():  # SC-18
    s = make_scheduler(num_blocks=100, max_num_batched_tokens=6, long_prefill_token_threshold=2)
    reqs = [make_request(i, [i] * 9, max_tokens=3, ignore_eos=True) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    drain(s)
    assert all(r.num_output_tokens == 3 for r in reqs)
    assert_scheduler_empty(s)


def test_abort_running_then_reuse_id():  # SC-17
    s = make_scheduler(num_blocks=100)
    for i in range(3):
        s.add_request(make_request(i, 10, max_tokens=5))
    run_step(s)
    s.finish_requests("1", RequestStatus.FINISHED_ABORTED)
    assert len(s.running) == 2 and s.has_finished_requests()
    so, _ = run_step(s)
    assert "1" in so.finished_req_ids
    s.add_request(make_request("1", 10))
    drain(s)
    assert_scheduler_empty(s)
