"""--background-warmup: the engine serves as soon as the programs of its smallest bucket
and of 16 tokens are compiled, within them (longer prompts in more chunks, a 3-token
step in the 16 bucket), compiles nothing on demand, and once the background thread is
done serves full steps in every bucket, again compiling nothing."""
import threading

import numpy as np
import pytest
from compile_counter import count_compiles

from jaxserve import LLM, SamplingParams
from jaxserve.runner.compilation_manager import CompilationManager

pytestmark = pytest.mark.slow

# float32: the engine serving from the smaller compiled buckets must give the reference
# engine's logprobs (1e-4); with bf16 matmul weights (dtype auto on an AVX512-BF16 CPU)
# a step padded to another bucket rounds differently (2e-3 on an AMD EPYC VM).
SETTINGS = dict(max_model_len=160, max_num_seqs=8, max_num_batched_tokens=64, compilation_cache=False,
                progress=False, token_buckets=[1, 4, 16, 32, 64], request_buckets=[1, 8], dtype="float32")


def summary(outputs):
    """(token ids and finish reasons exactly, logprob values): a step of another size
    may round differently."""
    exact = [(c.token_ids, c.finish_reason, [sorted(d) for d in c.logprobs]) for o in outputs for c in o.outputs]
    values = [v.logprob for o in outputs for c in o.outputs for d in c.logprobs for v in d.values()]
    return exact, np.array(values)


def test_serves_within_the_compiled_steps_then_all_of_them(tiny_models, monkeypatch):
    path = str(tiny_models("llama", tokenizer="bytes"))
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 250, n).tolist()} for n in (100, 40, 3, 70, 16, 33)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    want, want_values = summary(LLM(path, **SETTINGS).generate(prompts, sp))

    # The background stages wait until the test lets them go; every program compiles (the
    # reference engine's saved executables are not read: test_executable_cache.py loads them).
    gate, real = threading.Event(), CompilationManager._warm_up_stage

    def gated(self, stage, w, desc):
        if desc is None:
            gate.wait(300)
        return real(self, stage, w, desc)

    monkeypatch.setattr(CompilationManager, "_warm_up_stage", gated)
    monkeypatch.setattr(CompilationManager, "_executable_cache", lambda self: None)
    llm = LLM(path, background_warmup=True, **SETTINGS)
    try:
        check_serving_while_warming_up(llm, gate, prompts, sp, want, want_values)
    finally:
        gate.set()


def check_serving_while_warming_up(llm, gate, prompts, sp, want, want_values):
    runner = llm.llm_engine.engine_core.model_runner
    # The first stage: steps of 1 and 16 tokens, their prompt logprobs, every sampler
    # (16 tokens can hold 8 requests); the 4 bucket comes last.
    assert runner.ready_tokens == 16 and runner.num_compiled_programs == 8
    sizes, buckets = [], []
    dispatch = runner.dispatch

    def recording_dispatch(outputs):
        sizes.append(max(so.total_num_scheduled_tokens for so in outputs))
        inflight = dispatch(outputs)
        if inflight is not None:
            buckets.append(inflight.step.model_key.num_tokens)
        return inflight

    runner.dispatch = recording_dispatch
    # Three decoding requests: steps of 3 tokens, in the 16 bucket while 4's is not compiled.
    few = [{"prompt_token_ids": [5, 6, 7]}] * 3
    with count_compiles(runner) as compiles:
        got, values = summary(llm.generate(prompts, sp))
        llm.generate(few, SamplingParams(max_tokens=4, ignore_eos=True))
    assert compiles == [0, 0]
    assert max(sizes) == 16 and 3 in sizes and set(buckets) == {1, 16} and not runner.wait_for_warmup(0)
    assert got == want
    np.testing.assert_allclose(values, want_values, atol=1e-4)

    gate.set()
    assert runner.wait_for_warmup(600)
    assert runner.ready_tokens == 64 and runner.num_compiled_programs == 14
    sizes.clear()
    buckets.clear()
    with count_compiles(runner) as compiles:
        got, values = summary(llm.generate(prompts, sp))
        llm.generate(few, SamplingParams(max_tokens=4, ignore_eos=True))
    assert compiles == [0, 0]
    assert max(sizes) > 32 and 4 in buckets
    assert got == want
    np.testing.assert_allclose(values, want_values, atol=1e-4)


def test_everything_compiles_first_where_steps_cannot_be_capped(tiny_models):
    """Without chunked prefill a whole prompt must fit in one step: no background."""
    llm = LLM(str(tiny_models("llama", tokenizer="bytes")), background_warmup=True, enable_chunked_prefill=False,
              **{**SETTINGS, "max_num_batched_tokens": 160, "token_buckets": [1, 16, 160]})
    runner = llm.llm_engine.engine_core.model_runner
    assert runner.wait_for_warmup(0) and runner.ready_tokens == 160 and runner.num_compiled_programs == 10
