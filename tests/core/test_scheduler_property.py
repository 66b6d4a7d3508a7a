"""Random add / step / abort sequences against a fake runner; block accounting
invariants are asserted after every schedule() and update (check_invariants=True)."""
from factories import assert_scheduler_empty, make_request, make_scheduler, run_step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.request import RequestStatus

op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 70), st.integers(1, 12), st.integers(0, 3), st.booleans()),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 40)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op, max_size=60),
    num_blocks=st.integers(6, 24),
    budget=st.integers(8, 96),
    caching=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority"]),
    threshold=st.sampled_from([0, 8]),
)
def test_random_ops_keep_block_accounting(ops, num_blocks, budget, caching, policy, threshold):
    s = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=4,
                       max_model_len=80, enable_prefix_caching=caching, policy=policy,
                       long_prefill_token_threshold=threshold)
    usable_tokens = (num_blocks - 1) * 16
    n = 0
    for o in ops:
        if o[0] == "add":
            _, plen, max_tokens, prefix_id, prio = o
            # Shared prefixes exercise cache hits; cap so one request always fits alone.
            plen = min(plen, usable_tokens - max_tokens, 80)
            if plen < 1:
                continue
            prompt = [prefix_id] * (plen // 2) + [100 + n + i for i in range(plen - plen // 2)]
            s.add_request(make_request(n, prompt, max_tokens=max_tokens, ignore_eos=True,
                                       priority=int(prio), arrival_time=float(n)))
            n += 1
        elif o[0] == "step":
            run_step(s)
        else:
            s.finish_requests(str(o[1]), RequestStatus.FINISHED_ABORTED)
    for _ in range(2000):
        if not s.has_requests():
            break
        run_step(s)
    assert_scheduler_empty(s)
