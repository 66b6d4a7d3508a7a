"""The engine's programs use the native bf16 product (pallas_kernels/cpu_matmul.py) on one
device of a CPU with AVX512-BF16, and give what XLA's product gives."""
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from pallas_kernels import cpu_matmul
from pallas_kernels.cpu import cpu_flags

pytestmark = pytest.mark.skipif(not cpu_matmul.preferred_on(cpu_flags()),
                                reason="the engine uses the kernel on AVX512-BF16 CPUs without AMX; "
                                       "tests/pallas_kernels/test_cpu_matmul.py checks it is off elsewhere")


def _llm(path, **kw):
    return LLM(str(path), weight_dtype="bfloat16", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
               kv_cache_memory=4 << 20, compilation_cache=False, progress=False, enforce_eager=True, **kw)


def test_decode_programs_use_it_and_match_xla(tiny_models, monkeypatch):
    path = tiny_models("llama", kv_heads=2)
    ps = [{"prompt_token_ids": np.random.default_rng(i).integers(3, 500, 5 + 7 * i).tolist()} for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    llm = _llm(path)
    runner = llm.llm_engine.model_runner
    assert cpu_matmul.TARGET in runner.lower_model_step(8).as_text()  # a decode bucket
    native = llm.generate(ps, sp, use_tqdm=False)
    del llm
    monkeypatch.setattr(cpu_matmul, "enabled", lambda: False)
    llm = _llm(path)
    assert cpu_matmul.TARGET not in llm.llm_engine.model_runner.lower_model_step(8).as_text()
    xla = llm.generate(ps, sp, use_tqdm=False)
    for a, b in zip(native, xla):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in la:
                assert abs(la[t].logprob - lb[t].logprob) < 1e-4


@pytest.mark.devices(2)  # fails, not skips, with fewer (tests/conftest.py)
def test_not_used_when_the_mesh_has_several_devices(tiny_models):
    """A custom call is not partitioned: with tensor parallelism XLA's dot serves."""
    llm = _llm(tiny_models("llama", kv_heads=2), tensor_parallel_size=2)
    assert cpu_matmul.TARGET not in llm.llm_engine.model_runner.lower_model_step(8).as_text()
