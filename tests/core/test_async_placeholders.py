"""Async scheduling in the scheduler: step N + 1 is scheduled before step N's output
is back, counting N's tokens as there (Request.num_output_placeholders)."""
from factories import EOS, assert_scheduler_empty, make_request, make_scheduler

from jaxserve.outputs import ModelRunnerOutput
from jaxserve.request import FinishReason, RequestStatus


def output(so, scheduler, token=7, tokens=None):
    """The runner's output for ``so``: a token for every request whose scheduled tokens
    reach its end (the ones counted as placeholders), none mid-prefill."""
    req_ids = list(so.num_scheduled_tokens)
    tokens = tokens or {}
    sampled = []
    for r in req_ids:
        req = scheduler.requests.get(r)
        at_end = req is not None and so.num_scheduled_tokens[r] > 0 and req.num_output_placeholders > 0
        sampled.append([tokens.get(r, token)] if at_end else [])
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


def test_decode_is_scheduled_again_before_its_token_is_back():
    s = make_scheduler(async_scheduling=True)
    r = make_request(0, 20, max_tokens=10)
    s.add_request(r)
    so1 = s.schedule()  # the prefill: it samples the first output token
    assert so1.num_scheduled_tokens == {"0": 20} and r.num_output_placeholders == 1
    out1 = output(so1, s)
    so2 = s.schedule()  # the first decode, fed with the token in flight
    assert so2.num_scheduled_tokens == {"0": 1} and r.num_computed_tokens == 21
    assert r.num_output_placeholders == 2 and r.num_tokens == 20
    out2 = output(so2, s)
    s.update_from_output(so1, out1)
    assert r.num_output_placeholders == 1 and r.num_tokens == 21
    so3 = s.schedule()
    assert so3.num_scheduled_tokens == {"0": 1} and so3.scheduled_cached_reqs.num_computed_tokens == [21]
    s.update_from_output(so2, out2)
    assert r.output_token_ids == [7, 7]


def test_no_token_past_max_tokens_is_scheduled():
    """The step that samples the last token (max_tokens) is the request's last: the one
    after does not schedule it, and the same steps run as without async scheduling."""
    def steps(async_scheduling):
        s = make_scheduler(async_scheduling=async_scheduling)
        s.add_request(make_request(0, 20, max_tokens=4))
        s.add_request(make_request(1, 5, max_tokens=2))
        scheduled, pending, finished = [], None, {}
        while s.has_unfinished_requests() or pending is not None:
            so = s.schedule()
            if so.total_num_scheduled_tokens:
                scheduled.append(dict(so.num_scheduled_tokens))
            out = output(so, s) if async_scheduling else None
            if not async_scheduling:
                for o in s.update_from_output(so, output_sync(so, s)):
                    finished.setdefault(o.request_id, []).extend(o.new_token_ids)
                continue
            if pending is not None:
                for o in s.update_from_output(*pending):
                    finished.setdefault(o.request_id, []).extend(o.new_token_ids)
            pending = (so, out) if so.total_num_scheduled_tokens else None
        assert_scheduler_empty(s)
        return scheduled, finished

    def output_sync(so, s):
        req_ids = list(so.num_scheduled_tokens)
        sampled = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in req_ids]
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)

    sync_steps, sync_tokens = steps(False)
    async_steps, async_tokens = steps(True)
    assert async_steps == sync_steps and len(async_steps) == 4
    assert async_tokens == sync_tokens == {"0": [7] * 4, "1": [7] * 2}


def test_a_stop_token_drops_the_token_computed_in_flight():
    s = make_scheduler(async_scheduling=True)
    r = make_request(0, 10, max_tokens=10)
    s.add_request(r)
    so1 = s.schedule()
    out1 = output(so1, s, token=EOS)
    so2 = s.schedule()  # scheduled before the EOS is known
    out2 = output(so2, s, token=9)
    outs = s.update_from_output(so1, out1)
    assert [(o.request_id, o.finish_reason) for o in outs] == [("0", FinishReason.STOP)]
    assert s.update_from_output(so2, out2) == []  # finished: the in-flight token is dropped
    assert r.output_token_ids == [EOS]
    so3 = s.schedule()
    assert so3.finished_req_ids == {"0"} and so3.total_num_scheduled_tokens == 0
    assert_scheduler_empty(s)


def test_preempted_request_keeps_its_in_flight_token_and_recomputes_it():
    """Step 2, scheduled while step 1 runs, preempts a request that step 1 samples for.
    Step 1's token is still appended, and the request resumes with it, recomputing
    prompt + output (no placeholder left)."""
    s = make_scheduler(num_blocks=11, async_scheduling=True)  # 10 blocks of 16
    r0 = make_request(0, 80, max_tokens=100)
    r1 = make_request(1, [2000 + i for i in range(80)], max_tokens=100)
    s.add_request(r0)
    s.add_request(r1)
    so1 = s.schedule()  # both prefills: 5 blocks each, a token each in flight
    out1 = output(so1, s)
    so2 = s.schedule()  # r0's decode needs a 6th block: r1 is preempted
    assert so2.preempted_req_ids == {"1"} and r1.status == RequestStatus.PREEMPTED
    assert r1.num_output_placeholders == 0 and r1.num_computed_tokens == 0
    assert so2.num_scheduled_tokens == {"0": 1}
    out2 = output(so2, s)
    s.update_from_output(so1, out1)
    assert r1.output_token_ids == [7] and r1.num_output_placeholders == 0 and r0.num_output_placeholders == 1
    s.update_from_output(so2, out2)
    assert r0.output_token_ids == [7, 7]
    s.finish_requests("0", RequestStatus.FINISHED_ABORTED)
    so3 = s.schedule()  # r1 resumes: its 80 prompt tokens and its output token (some cached)
    assert so3.scheduled_cached_reqs.req_ids == ["1"] and so3.scheduled_cached_reqs.resumed_from_preemption == [True]
    assert r1.num_computed_tokens == 81 and r1.num_output_placeholders == 1
