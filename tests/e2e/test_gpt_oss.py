"""GPT-OSS (models/gpt_oss.py) against HF transformers (f32): attention sinks, sliding /
full layers alternating, YaRN past the trained length, MoE with router and expert biases
and the clamped SwiGLU; the engine modes (chunked prefill, prefix-cache hits,
preemption); each attention backend; tensor and expert parallel."""
import numpy as np
import pytest
from jaxserve import SamplingParams
from hf_reference import HFReference, assert_greedy_match
from test_parity_hf import make_llm, prompts
from test_phi3 import check_greedy, check_prompt_logprobs

pytestmark = pytest.mark.slow


def test_gpt_oss_matches_hf(tiny_models):
    """Prompts past the window (8) and past YaRN's trained length (64)."""
    path = tiny_models("gpt_oss", kv_heads=2)
    llm = make_llm(path)
    arch = llm.llm_engine.model_runner.arch
    assert arch.attention_sinks and arch.sliding_window_layers == (True, False)
    check_greedy(path, llm, prompts(1, [5, 17, 70, 3]))
    check_prompt_logprobs(path, llm, prompts(5, [80])[0])


def _hf_logprobs(path, ids):
    ref = HFReference(path).logits(ids)
    ref = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    return np.array([ref[i, ids[i + 1]] for i in range(len(ids) - 1)])


def check_trainer_logprobs(path, param: str):
    """The research loop's two forwards (the paged kernel over one sequence, and the
    dense differentiable one) give HF's logprobs, and the gradient reaches ``param``."""
    import jax
    import jax.numpy as jnp

    llm = make_llm(path)
    ids = prompts(6, [40])[0]
    want = _hf_logprobs(path, ids)
    np.testing.assert_allclose(llm.sequence_logprobs(ids)[0], want, atol=1e-4)
    fn = llm.get_logprobs_fn()
    np.testing.assert_allclose(np.asarray(fn(llm.get_params(), jnp.asarray(ids, jnp.int32))), want, atol=1e-4)
    grads = jax.grad(lambda p: fn(p, jnp.asarray(ids, jnp.int32)).sum())(llm.get_params())
    assert float(jnp.abs(grads["layers"][param][...]).sum()) > 0


def test_gpt_oss_trainer_logprobs_match_hf(tiny_models):
    """The two forwards carry the sinks too."""
    check_trainer_logprobs(tiny_models("gpt_oss", kv_heads=2), "sinks")


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_gpt_oss_every_attention_backend(tiny_models, backend):
    """The sinks and the alternating windows through the reference and the Pallas
    (TPU kernel, interpreted) attention; the default (native) is the test above."""
    path = tiny_models("gpt_oss", kv_heads=2)
    llm = make_llm(path, attention_backend=backend, max_model_len=128)
    check_greedy(path, llm, prompts(2, [9, 30]), max_tokens=8)


def check_engine_modes(path, num_blocks: int):
    """Chunked prefill (16 tokens a step) with preemption (``num_blocks`` pages) gives HF's
    tokens; a second request's shared prefix (40 tokens) is a cache hit with the same tokens."""
    shared = prompts(8, [40])[0]
    ps = [shared + q for q in prompts(9, [9, 21])] + prompts(10, [35, 6])
    llm = make_llm(path, max_num_batched_tokens=16, long_prefill_token_threshold=8, num_gpu_blocks_override=num_blocks)
    hf = HFReference(path)
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    for p, o in zip(ps, outs):
        ref, margins = hf.greedy(p, 20)
        assert_greedy_match(o.outputs[0].token_ids, ref, margins, f"len {len(p)}")
    assert llm.llm_engine.scheduler.num_preemptions > 0
    # One request after the other (a cache that keeps both): the second one's shared
    # prefix is a hit (in every KV group), and its tokens stay HF's.
    llm = make_llm(path, max_num_batched_tokens=16, long_prefill_token_threshold=8)
    llm.generate([{"prompt_token_ids": ps[0]}], sp, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": ps[1]}], sp, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 32 and again.outputs[0].token_ids == outs[1].outputs[0].token_ids


def check_parallel_matches_one_device(path, check_runner=None):
    """tp 2 and tp 2 with expert parallel give the one-device tokens and logprobs;
    ``check_runner(runner)`` looks at each parallel runner."""
    ps = [{"prompt_token_ids": p} for p in prompts(11, [5, 23, 40])]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    res = []
    for tp, ep in [(1, False), (2, False), (2, True)]:
        llm = make_llm(path, tensor_parallel_size=tp, enable_expert_parallel=ep, max_model_len=128)
        if tp > 1 and check_runner is not None:
            check_runner(llm.llm_engine.model_runner)
        out = llm.generate(ps, sp, use_tqdm=False)
        res.append([(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                              o.outputs[0].token_ids)]) for o in out])
    for other in res[1:]:
        for (toks, lps), (toks1, lps1) in zip(other, res[0]):
            assert toks == toks1
            np.testing.assert_allclose(lps, lps1, atol=1e-4)


def test_gpt_oss_chunked_prefill_prefix_cache_and_preemption(tiny_models):
    check_engine_modes(tiny_models("gpt_oss", kv_heads=2), num_blocks=12)


@pytest.mark.devices(4)
def test_gpt_oss_tensor_and_expert_parallel_match_one_device(tiny_models):
    """tp 2 (heads, sinks and expert columns split; the interleaved gate / up read per
    device) and expert parallel 2 give the one-device tokens and logprobs."""
    check_parallel_matches_one_device(tiny_models("gpt_oss", kv_heads=2))


@pytest.mark.parametrize("kept", [False, True], ids=["decoded", "kept_mxfp4"])
def test_gpt_oss_mxfp4_experts_give_the_dequantized_models_tokens(tiny_models, tmp_path, kept):
    """OpenAI's format (experts as MXFP4 blocks and scales, written here by the test's
    own packer) loads, and serves the tokens and logprobs HF gives for the same experts
    as floats: decoded at load (the CPU's default), or kept as their e2m1 codes with a
    float32 power of two per 32 input rows, dequantized inside the step a layer at a
    time (TPU / GPU's default; ``quantization="mxfp4"`` on CPU), through the compiled
    steps."""
    from hf_factory import write_mxfp4_gpt_oss
    from test_int4_checkpoints import _served_params

    src = tiny_models("gpt_oss", kv_heads=2)
    write_mxfp4_gpt_oss(src, tmp_path / "float", tmp_path / "mxfp4")
    llm = make_llm(tmp_path / "mxfp4", **({"quantization": "mxfp4", "enforce_eager": False} if kept else {}))
    if kept:
        params = _served_params(llm, by_name=True)
        assert str(params["experts_gate"].dtype) == "uint8" and params["experts_gate"].shape[-3:] == (8, 64, 32)
        assert params["experts_gate_scale"].shape[-3:] == (8, 2, 32)  # [E, in / 32, out]
        assert params["experts_down_scale"].shape[-3:] == (8, 1, 64) and "experts_down_zero" not in params
        assert params["q_proj"].dtype == np.float32  # attention stays as the checkpoint has it
    check_greedy(tmp_path / "float", llm, prompts(12, [6, 33]))
    check_prompt_logprobs(tmp_path / "float", llm, prompts(13, [40])[0])


@pytest.mark.devices(2)
def test_gpt_oss_mxfp4_experts_kept_expert_parallel(tiny_models, tmp_path):
    """Expert parallel 2 with the experts kept as MXFP4: each device holds its experts'
    codes and scales whole; HF's tokens. Split by the mlp dim instead (tp 2), each
    device's 16 of down_proj's 32 input rows are no whole MXFP4 group: a clear error."""
    from hf_factory import write_mxfp4_gpt_oss

    write_mxfp4_gpt_oss(tiny_models("gpt_oss", kv_heads=2), tmp_path / "float", tmp_path / "mxfp4")
    llm = make_llm(tmp_path / "mxfp4", quantization="mxfp4", tensor_parallel_size=2, enable_expert_parallel=True)
    check_greedy(tmp_path / "float", llm, prompts(14, [12, 40]))
    del llm
    with pytest.raises(ValueError, match="experts_down's 16 input rows per device are not whole groups of 32"):
        make_llm(tmp_path / "mxfp4", quantization="mxfp4", tensor_parallel_size=2)
