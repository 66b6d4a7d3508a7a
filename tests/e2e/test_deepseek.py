"""DeepSeek-V2 / V3 (models/deepseek.py) against HF transformers (f32): Multi-head
Latent Attention over the latent KV layout (one row per token per layer), q whole
(V2-Lite) or low-rank (V3), YaRN's mscale, the group-limited routing (V2 greedy /
group-limited softmax, V3 sigmoid with its correction bias) with shared experts and dense
first layers; the engine modes (chunked prefill, prefix-cache hits, preemption); each
attention backend; tensor and expert parallel; the research loop's forwards."""
import numpy as np
import pytest
from jaxserve import SamplingParams
from hf_reference import HFReference, assert_greedy_match
from test_gpt_oss import _hf_logprobs
from test_parity_hf import make_llm, prompts
from test_phi3 import check_greedy, check_prompt_logprobs

pytestmark = pytest.mark.slow

# One group of two experts of four: the top two experts overall are often not both in
# the best group, so the limit changes the choice (with topk_group >= top_k it never would).
V2_GROUPED = dict(topk_method="group_limited_greedy", n_group=4, topk_group=1)


def _model(tiny_models, arch="deepseek_v3", **kw):
    return tiny_models(arch, layers=3, **kw)


@pytest.mark.parametrize("arch, kw", [("deepseek_v2", {}), ("deepseek_v2", V2_GROUPED), ("deepseek_v3", {})],
                         ids=["v2_lite", "v2_grouped", "v3"])
def test_deepseek_matches_hf(tiny_models, arch, kw):
    """Prompts past YaRN's trained length (64, V3); the KV page is the latent's size."""
    path = _model(tiny_models, arch, **kw)
    llm = make_llm(path)
    runner = llm.llm_engine.model_runner
    arch_cfg = runner.arch
    assert arch_cfg.dense_layers == 1 and arch_cfg.sparse_layers == 2
    # One latent (32) and one rope key (8) per token per layer, float32: 3 * 40 * 4 bytes,
    # not 2 * heads * head dim (a GQA cache of the expanded keys would be 4 heads of 24 + 24).
    from jaxserve.runner.kv_cache import bytes_per_block
    assert runner.kv_cache.shape[-2:] == (1, 40)
    assert bytes_per_block(arch_cfg, 16, np.float32) // 16 == 3 * 40 * 4
    check_greedy(path, llm, prompts(1, [5, 17, 70, 3]))
    check_prompt_logprobs(path, llm, prompts(5, [80])[0])


def test_deepseek_trainer_logprobs_match_hf(tiny_models):
    """The research loop's two forwards (the paged kernel over one sequence, the dense
    differentiable one over the latent rows) give HF's logprobs, and the gradient
    reaches the latent projections."""
    import jax
    import jax.numpy as jnp

    path = _model(tiny_models)
    llm = make_llm(path)
    ids = prompts(6, [40])[0]
    want = _hf_logprobs(path, ids)
    np.testing.assert_allclose(llm.sequence_logprobs(ids)[0], want, atol=1e-4)
    fn = llm.get_logprobs_fn()
    np.testing.assert_allclose(np.asarray(fn(llm.get_params(), jnp.asarray(ids, jnp.int32))), want, atol=1e-4)
    grads = jax.grad(lambda p: fn(p, jnp.asarray(ids, jnp.int32)).sum())(llm.get_params())
    assert float(jnp.abs(grads["layers"]["kv_b_proj"][...]).sum()) > 0


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_deepseek_every_attention_backend(tiny_models, backend):
    """The latent rows through the reference and the Pallas (TPU kernel, interpreted)
    attention and KV write; the default (native) is the test above."""
    path = _model(tiny_models)
    llm = make_llm(path, attention_backend=backend, max_model_len=128)
    check_greedy(path, llm, prompts(2, [9, 30]), max_tokens=8)


def test_deepseek_chunked_prefill_prefix_cache_and_preemption(tiny_models):
    path = _model(tiny_models)
    shared = prompts(8, [40])[0]
    ps = [shared + q for q in prompts(9, [9, 21])] + prompts(10, [35, 6])
    llm = make_llm(path, max_num_batched_tokens=16, long_prefill_token_threshold=8, num_gpu_blocks_override=10)
    hf = HFReference(path)
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    for p, o in zip(ps, outs):
        ref, margins = hf.greedy(p, 20)
        assert_greedy_match(o.outputs[0].token_ids, ref, margins, f"len {len(p)}")
    assert llm.llm_engine.scheduler.num_preemptions > 0
    # One after the other: the second request's shared prefix is read from the latent rows.
    llm = make_llm(path, max_num_batched_tokens=16, long_prefill_token_threshold=8)
    llm.generate([{"prompt_token_ids": ps[0]}], sp, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": ps[1]}], sp, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 32 and again.outputs[0].token_ids == outs[1].outputs[0].token_ids


@pytest.mark.devices(4)
def test_deepseek_tensor_and_expert_parallel_match_one_device(tiny_models):
    """tp 2 (heads split, the latent cache whole on each device) and expert parallel 2
    give the one-device tokens and logprobs."""
    path = _model(tiny_models)
    ps = [{"prompt_token_ids": p} for p in prompts(11, [5, 23, 40])]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    res = []
    for tp, ep in [(1, False), (2, False), (2, True)]:
        llm = make_llm(path, tensor_parallel_size=tp, enable_expert_parallel=ep, max_model_len=128)
        if tp > 1:  # every device holds the whole latent cache
            shard = llm.llm_engine.model_runner.kv_cache.addressable_shards[0].data
            assert shard.shape[-2:] == (1, 40)
        out = llm.generate(ps, sp, use_tqdm=False)
        res.append([(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                              o.outputs[0].token_ids)]) for o in out])
    for other in res[1:]:
        for (toks, lps), (toks1, lps1) in zip(other, res[0]):
            assert toks == toks1
            np.testing.assert_allclose(lps, lps1, atol=1e-4)


def test_deepseek_without_dense_layers_and_unsupported_variants(tiny_models):
    """first_k_dense_replace 0: every layer MoE (one stack, one scan); what is not
    supported fails at start with the config field named."""
    import json

    from models.config import ModelArchConfig

    path = tiny_models("deepseek_v2", layers=2, first_k_dense_replace=0)
    llm = make_llm(path)
    assert llm.llm_engine.model_runner.arch.dense_layers == 0
    check_greedy(path, llm, prompts(3, [7, 25]), max_tokens=8)

    src = _model(tiny_models)
    cfg = json.loads((src / "config.json").read_text())
    for change, words in [({"moe_layer_freq": 2}, "moe_layer_freq"),
                          ({"first_k_dense_replace": 9}, "first_k_dense_replace")]:
        with pytest.raises(ValueError, match=words):
            ModelArchConfig.from_hf_dict({**cfg, **change})


def test_deepseek_fp8_block_scaled_checkpoint(tiny_models, tmp_path):
    """DeepSeek-V3's checkpoint format (every projection, experts and MLA's included, as
    float8_e4m3fn in 16 x 16 blocks with a float32 scale each: the test's packer, in
    models/packed_formats.py) serves the tokens and logprobs HF gives for the same
    rounded weights as floats."""
    from models.packed_formats import write_int4_folder
    from safetensors import safe_open

    src = _model(tiny_models)
    write_int4_folder(src, tmp_path / "fp8", "fp8-block", group_size=16, float_dst=tmp_path / "float")
    with safe_open(str(tmp_path / "fp8" / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.experts.3.gate_proj.weight_scale_inv" in names
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv" in names
    llm = make_llm(tmp_path / "fp8")
    check_greedy(tmp_path / "float", llm, prompts(14, [6, 33]))
    check_prompt_logprobs(tmp_path / "float", llm, prompts(15, [40])[0])
