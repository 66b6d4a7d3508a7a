"""dtype is selectable: bf16 params and KV cache run end to end."""
import jax.numpy as jnp
from hf_reference import HFReference

from jaxserve import LLM, SamplingParams


def test_bfloat16_runs_and_agrees_on_clear_choices(tiny_models):
    path = tiny_models("llama", kv_heads=2)
    llm = LLM(str(path), dtype="bfloat16", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
              kv_cache_memory=4 << 20, compilation_cache=False, progress=False, enforce_eager=True)
    runner = llm.llm_engine.model_runner
    assert runner.kv_cache.dtype == jnp.bfloat16
    assert runner.state["layers"]["q_proj"][...].dtype == jnp.bfloat16
    prompt = list(range(10, 40))
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    ref, margins = HFReference(path).greedy(prompt, 4)
    # bf16 rounding can only flip choices whose f32 margin is small.
    for i, m in enumerate(margins):
        if m < 0.5:
            break
        assert out[i] == ref[i]


def test_fp8_kv_cache_end_to_end(tiny_models):
    """kv_cache_dtype=fp8: e4m3 pages (4x the f32 pages in the same memory), the reference
    and the pallas kernel (interpreted) give the same tokens, and clear choices agree with
    the f32 cache; prompt logprobs stay close."""
    import numpy as np

    path = tiny_models("llama", kv_heads=2)
    prompt = list(range(10, 40))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    res = {}
    for name, kw in (("f32", {}), ("fp8", dict(kv_cache_dtype="fp8")),
                     ("fp8-pallas", dict(kv_cache_dtype="fp8", attention_backend="pallas"))):
        llm = LLM(str(path), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory=4 << 20,
                  compilation_cache=False, progress=False, enforce_eager=True, **kw)
        runner = llm.llm_engine.model_runner
        assert runner.kv_cache.dtype == (jnp.float8_e4m3fn if "fp8" in name else jnp.float32)
        out = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
        lps = np.array([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])
        res[name] = (runner.num_blocks, out.outputs[0].token_ids, lps)
    assert res["fp8"][0] >= 4 * (res["f32"][0] - 1)
    assert res["fp8"][1] == res["fp8-pallas"][1]
    np.testing.assert_allclose(res["fp8"][2], res["fp8-pallas"][2], atol=1e-4)
    assert 0 < np.abs(res["fp8"][2] - res["f32"][2]).max() < 0.1
    ref, margins = HFReference(path).greedy(prompt, 6)
    for i, m in enumerate(margins):
        if m < 0.5:
            break
        assert res["fp8"][1][i] == ref[i]
