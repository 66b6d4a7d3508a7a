"""Speculative decoding in the scheduler: drafts scheduled after a request's last token
(within the budget and max_model_len), rejected ones rolled back with the blocks held
only for them, several tokens per step with stop rules applied token by token,
per-position stats, and the cases where a request does not speculate."""
from factories import EOS, assert_scheduler_empty, make_request

from jaxserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from jaxserve.core.sched.scheduler import Scheduler
from jaxserve.outputs import ModelRunnerOutput
from jaxserve.request import RequestStatus


def make(k=3, *, num_blocks=20, max_num_batched_tokens=8192, max_model_len=8192, **spec):
    return Scheduler(SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len),
                     CacheConfig(block_size=16), num_blocks, check_invariants=True,
                     speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=k, **spec))


def step(s, tokens: dict, drafts: dict | None = None):
    """One step where request r samples tokens[r] (default [7] once its prefill is
    done) and the runner proposes drafts[r] next."""
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = []
    for r in ids:
        req = s.requests[r]
        prefill_done = req.num_computed_tokens >= req.num_tokens  # counts drafts too
        sampled.append(list(tokens.get(r, [7])) if prefill_done else [])
    out = ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled, draft_token_ids=drafts or {})
    return so, s.update_from_output(so, out)


def test_drafts_scheduled_accepted_and_rolled_back():
    s = make(k=4)
    req = make_request("a", 14, max_tokens=50)
    s.add_request(req)
    step(s, {}, {"a": [1, 2, 3, 4]})  # prefill 14; first token 7; drafts for the next step
    assert req.spec_token_ids == [1, 2, 3, 4] and req.num_computed_tokens == 14
    free_before = s.kv_cache_manager.get_num_free_blocks()
    so, outs = step(s, {"a": [1, 2, 9]}, {"a": [5]})  # two drafts held, the third rejected (9 instead)
    assert so.num_scheduled_tokens["a"] == 5 and so.scheduled_spec_decode_tokens == {"a": [1, 2, 3, 4]}
    assert outs[0].new_token_ids == [1, 2, 9]
    # Computed: the 14 prompt tokens + 7, 1, 2 (9 is the next step's input); 1 block holds them.
    assert req.num_computed_tokens == 17 and req.num_tokens == 18
    assert s.kv_cache_manager.num_blocks("a") == 2  # positions 14..18 needed a 2nd block, and 17 stays
    assert s.kv_cache_manager.get_num_free_blocks() == free_before - 1
    assert req.spec_token_ids == [5]
    st = s.spec_stats_total
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (1, 4, 2)
    assert st.num_accepted_tokens_per_pos == [1, 1, 0, 0]


def test_rejected_drafts_give_back_their_blocks():
    s = make(k=4)
    req = make_request("a", 14, max_tokens=50)
    s.add_request(req)
    step(s, {}, {"a": [1, 2, 3, 4]})
    free_before = s.kv_cache_manager.get_num_free_blocks()
    step(s, {"a": [9]})  # every draft rejected: positions 15.. were only drafts
    assert req.num_computed_tokens == 15 and s.kv_cache_manager.num_blocks("a") == 1
    assert s.kv_cache_manager.get_num_free_blocks() == free_before
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    s.schedule()
    assert_scheduler_empty(s)


def test_drafts_cut_by_budget_and_max_model_len():
    s = make(k=4, max_num_batched_tokens=3)
    req = make_request("a", 2, max_tokens=50)
    s.add_request(req)
    step(s, {}, {"a": [1, 2, 3, 4]})
    so, _ = step(s, {"a": [1, 2, 3]})
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2]}  # 1 + 2 drafts fill the budget of 3
    s = make(k=4, max_model_len=20)
    req = make_request("b", 15, max_tokens=50)
    s.add_request(req)
    step(s, {}, {"b": [1, 2, 3, 4]})  # 16 tokens; positions 15..19 remain
    so, outs = step(s, {"b": [1, 2, 3, 4, 5]})
    assert so.scheduled_spec_decode_tokens == {"b": [1, 2, 3, 4]}
    # 16 + 5 would pass max_model_len: the run is cut at 20 tokens and the request ends.
    assert outs[0].new_token_ids == [1, 2, 3, 4] and req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_stop_inside_an_accepted_run():
    s = make(k=4)
    a, b = make_request("a", 5, max_tokens=50), make_request("b", 5, max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    step(s, {}, {"a": [1, 2, 3, 4], "b": [1, 2, 3, 4]})
    _, outs = step(s, {"a": [1, EOS, 3, 4, 5], "b": [1, 2, 3, 4, 5]})
    by_id = {o.request_id: o for o in outs}
    assert by_id["a"].new_token_ids == [1, EOS] and a.status == RequestStatus.FINISHED_STOPPED
    assert by_id["b"].new_token_ids == [1, 2] and b.status == RequestStatus.FINISHED_LENGTH_CAPPED  # 7, 1, 2
    s.schedule()
    assert_scheduler_empty(s)


def test_who_does_not_speculate():
    s = make(k=2)
    reqs = [make_request("plain", 5), make_request("pen", 5, presence_penalty=0.5),
            make_request("rep", 5, repetition_penalty=1.2), make_request("min", 5, min_tokens=3)]
    for r in reqs:
        s.add_request(r)
    drafts = {r.request_id: [1, 2] for r in reqs}
    step(s, {}, drafts)
    assert [r.spec_token_ids for r in reqs] == [[1, 2], [], [], []]
    step(s, {}, drafts)
    step(s, {}, drafts)
    assert reqs[3].spec_token_ids == [1, 2]  # past min_tokens


def test_preemption_drops_drafts():
    s = make(k=2, num_blocks=3)  # 2 usable blocks
    a, b = make_request("a", 16, max_tokens=50), make_request("b", 14, max_tokens=50)
    s.add_request(a)
    s.add_request(b)
    step(s, {}, {"a": [1, 2], "b": [1, 2]})
    so, _ = step(s, {"a": [1, 2, 3]})  # a needs a 2nd block: b (the last) is preempted
    assert "b" in so.preempted_req_ids and b.spec_token_ids == [] and b.status == RequestStatus.PREEMPTED


def test_switches_off_where_it_does_not_pay():
    s = make(k=4, disable_by_batch_size=1)
    for r in ("a", "b"):
        s.add_request(make_request(r, 5, max_tokens=50))
    step(s, {}, {"a": [1, 2], "b": [1, 2]})
    so, _ = step(s, {})
    assert so.scheduled_spec_decode_tokens == {}  # 2 running > 1
    s = make(k=4, min_acceptance=0.5, acceptance_window=8)
    req = make_request("a", 5, max_tokens=50)
    s.add_request(req)
    step(s, {}, {"a": [1, 2, 3, 4]})
    step(s, {"a": [9]}, {"a": [1, 2, 3, 4]})  # 0 of 4 accepted
    assert req.spec_token_ids == [1, 2, 3, 4]
    step(s, {"a": [9]}, {"a": [1, 2, 3, 4]})  # 0 of 8: below half over the window
    assert req.spec_disabled and req.spec_token_ids == []
