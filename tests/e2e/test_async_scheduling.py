"""Async scheduling (vLLM's --async-scheduling) end to end on a tiny random Llama: the
same tokens, logprobs and finish reasons as the synchronous engine, with step N + 1
scheduled while step N runs, and nothing compiled after the warm-up."""
import json

import jsonschema
import numpy as np
import pytest
from compile_counter import count_compiles

from jaxserve import LLM, SamplingParams, StructuredOutputsParams
from jaxserve.engine.arg_utils import EngineArgs

pytestmark = pytest.mark.slow

SETTINGS = dict(max_model_len=160, max_num_seqs=8, max_num_batched_tokens=64, compilation_cache=False,
                progress=False, token_buckets=[1, 16, 64], request_buckets=[1, 8])


@pytest.fixture(scope="module")
def model_path(tiny_models):
    return tiny_models("llama", tokenizer="bytes")


@pytest.fixture(scope="module")
def engines(model_path):
    """(synchronous, async) engines; 24 blocks of 16 tokens each, so that a full batch
    of long requests preempts."""
    return tuple(LLM(str(model_path), num_gpu_blocks_override=24, async_scheduling=a, **SETTINGS)
                 for a in (False, True))


def ids(seed, n):
    return np.random.default_rng(seed).integers(3, 250, n).tolist()


def params(rng, i):
    return SamplingParams(
        temperature=[0.0, 0.8][i % 2], top_p=[1.0, 0.9][i % 3 == 0], max_tokens=int(rng.integers(4, 40)),
        seed=100 + i, presence_penalty=[0.0, 0.5][i % 4 == 1], logprobs=[None, 2][i % 3 == 1],
        prompt_logprobs=[None, 1][i % 5 == 2], min_tokens=[0, 3][i % 4 == 3], stop_token_ids=[7, 11, 13],
        n=[1, 2][i % 6 == 5])


def summary(outputs):
    """Token ids, finish and stop reasons, and the ids of every logprobs entry (exact);
    the logprob values apart (a step of another size may round differently)."""
    def ids(entries):
        return None if entries is None else [None if d is None else sorted(d) for d in entries]

    def values(entries):
        return [] if entries is None else [v.logprob for d in entries if d is not None for v in d.values()]

    exact = [[(c.token_ids, c.finish_reason, c.stop_reason, ids(c.logprobs)) for c in o.outputs]
             + [ids(o.prompt_logprobs)] for o in outputs]
    return exact, [values(c.logprobs) for o in outputs for c in o.outputs] + [values(o.prompt_logprobs)
                                                                          for o in outputs]


def test_same_outputs_as_the_synchronous_engine(engines):
    """Greedy and seeded sampling, penalties, min_tokens, stop tokens (a request may end
    on a token while its next step is already scheduled), max_tokens, logprobs, prompt
    logprobs, n = 2, and preemption (12 requests of up to 150 tokens in 24 blocks)."""
    sync, asyn = engines
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(3, 110, 12)]
    prompts = [{"prompt_token_ids": ids(i, n)} for i, n in enumerate(lengths)]
    sps = [params(rng, i) for i in range(len(prompts))]
    expected = sync.generate(prompts, sps, use_tqdm=False)
    preemptions = asyn.llm_engine.engine_core.scheduler.num_preemptions
    got = asyn.generate(prompts, sps, use_tqdm=False)
    (got_exact, got_values), (want_exact, want_values) = summary(got), summary(expected)
    assert got_exact == want_exact
    for g, w in zip(got_values, want_values):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    assert {c.finish_reason for o in expected for c in o.outputs} == {"stop", "length"}
    assert asyn.llm_engine.engine_core.scheduler.num_preemptions > preemptions
    assert not asyn.llm_engine.has_unfinished_requests()


def test_the_next_step_is_scheduled_before_the_outputs_are_back(engines):
    """Call order of one request's decode: schedule N + 1 comes before update N, and no
    extra step runs for max_tokens."""
    sync, asyn = engines
    calls = []
    sched = asyn.llm_engine.engine_core.scheduler
    real_schedule, real_update = sched.schedule, sched.update_from_output

    def schedule():
        so = real_schedule()
        calls.append(("S", so.total_num_scheduled_tokens))
        return so

    def update(so, out):
        calls.append(("U", so.total_num_scheduled_tokens))
        return real_update(so, out)

    def steps(llm):
        before = llm.llm_engine.num_steps
        out = llm.generate([{"prompt_token_ids": ids(1, 10)}], SamplingParams(temperature=0, max_tokens=4,
                                                                                ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        return llm.llm_engine.num_steps - before

    sched.schedule, sched.update_from_output = schedule, update
    try:
        num_steps = steps(asyn)
    finally:
        del sched.schedule, sched.update_from_output
    assert num_steps == steps(sync)  # the prefill, 3 decodes, and the one that drops the request
    # Schedule N + 1, then update N. After the third decode's schedule the fourth token
    # is in flight (max_tokens): nothing is scheduled; then the step that tells the
    # runner the request finished, and its (empty) update.
    assert calls == [("S", 10), ("S", 1), ("U", 10), ("S", 1), ("U", 1), ("S", 1), ("U", 1), ("S", 0), ("U", 1),
                     ("S", 0), ("S", 0), ("U", 0)], calls


def test_no_compilation_after_warmup(engines):
    _, asyn = engines
    rng = np.random.default_rng(1)
    with count_compiles(asyn.llm_engine.model_runner) as compiled:
        for batch in ([5], [1, 60, 7], [30] * 8):
            asyn.generate([{"prompt_token_ids": ids(n, n)} for n in batch],
                          [params(rng, i) for i in range(len(batch))], use_tqdm=False)
    assert compiled == [0, 0], f"(backend compiles, new variants) after warm-up: {compiled}"


def test_constrained_requests_run_one_step_at_a_time(engines):
    """A grammar is advanced by a step's tokens before the next mask: with a constrained
    request in the engine, steps are not overlapped, and its output validates; the free
    requests beside it get the synchronous engine's tokens."""
    sync, asyn = engines
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    sps = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
           SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema)),
           SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)]
    prompts = ["alpha beta", "give json", "gamma"]
    expected = sync.generate(prompts, sps, use_tqdm=False)
    got = asyn.generate(prompts, sps, use_tqdm=False)
    jsonschema.validate(json.loads(got[1].outputs[0].text), schema)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_async_scheduling_flag_and_its_limits(model_path):
    args = EngineArgs.from_cli_args(EngineArgs.add_cli_args(__import__("argparse").ArgumentParser()).parse_args(
        ["--model", str(model_path), "--async-scheduling"]))
    assert args.create_engine_config(progress=False).scheduler_config.async_scheduling
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineArgs(model=str(model_path), async_scheduling=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2}).create_engine_config(
            progress=False)
