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
