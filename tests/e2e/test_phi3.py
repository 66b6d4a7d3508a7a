"""Phi-3 (models/phi3.py) against HF transformers (f32): fused qkv / gate_up read as
row blocks, LongRoPE with both factor sets, partial rotary, sliding window, and the
engine modes (chunked prefill, prefix-cache hits, preemption)."""
import numpy as np
import pytest
from hf_reference import HFReference, assert_greedy_match
from test_parity_hf import make_llm, prompts, run

from jaxserve import SamplingParams

pytestmark = pytest.mark.slow

# LongRoPE on a tiny model: trained length 64, served up to 512; 8 factors (head_dim 16).
_rng = np.random.default_rng(3)
LONGROPE = dict(max_pos=512, original_max_position_embeddings=64, rope_scaling={
    "rope_type": "longrope", "short_factor": _rng.uniform(1.0, 2.0, 8).round(3).tolist(),
    "long_factor": _rng.uniform(2.0, 8.0, 8).round(3).tolist()})


def check_greedy(path, llm, ps, max_tokens=12):
    hf = HFReference(path)
    for p, o in zip(ps, run(llm, ps, max_tokens)):
        ref, margins = hf.greedy(p, max_tokens)
        assert_greedy_match(o, ref, margins, f"len {len(p)}")


def check_prompt_logprobs(path, llm, p):
    ref = HFReference(path).logits(p)
    ref_lp = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    got = [out.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))]
    np.testing.assert_allclose(got, [ref_lp[i - 1, p[i]] for i in range(1, len(p))], atol=1e-4)


def test_phi3_fused_projections_match_hf(tiny_models):
    path = tiny_models("phi3", kv_heads=2)
    llm = make_llm(path)
    check_greedy(path, llm, prompts(1, [5, 17, 40, 3]))
    check_prompt_logprobs(path, llm, prompts(5, [30])[0])


def test_longrope_long_factors_past_the_trained_length(tiny_models):
    """max_model_len 256 > 64: the long factors and the attention factor on every
    position, as HF runs a sequence longer than 64."""
    path = tiny_models("phi3", kv_heads=2, **LONGROPE)
    llm = make_llm(path, max_model_len=256)
    assert llm.llm_engine.model_runner.arch.rope_scaling["use_long_factor"] is True
    ps = prompts(2, [70, 100])
    check_greedy(path, llm, ps)
    check_prompt_logprobs(path, llm, ps[0])


def test_longrope_short_factors_within_the_trained_length(tiny_models):
    path = tiny_models("phi3", kv_heads=2, **LONGROPE)
    llm = make_llm(path, max_model_len=64, max_num_batched_tokens=64)
    assert llm.llm_engine.model_runner.arch.rope_scaling["use_long_factor"] is False
    check_greedy(path, llm, prompts(4, [20, 45]))


def test_partial_rotary_and_sliding_window_under_chunking_and_preemption(tiny_models):
    """Phi-4-mini's partial rotary (half of each head here) with a window of 8 tokens,
    through chunked prefill, a prefix-cache hit and preemption."""
    path = tiny_models("phi3", kv_heads=2, partial_rotary_factor=0.5, sliding_window=8)
    shared = prompts(8, [40])[0]
    ps = [shared + q for q in prompts(9, [9, 21])] + prompts(10, [35, 6])
    llm = make_llm(path, max_num_batched_tokens=16, long_prefill_token_threshold=8, num_gpu_blocks_override=6)
    check_greedy(path, llm, ps, max_tokens=20)
    assert llm.llm_engine.scheduler.num_preemptions > 0
