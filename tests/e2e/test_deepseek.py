"""DeepSeek-V2 / V3 (models/deepseek.py) against HF transformers (f32): Multi-head
Latent Attention over the latent KV layout (one row per token per layer), q whole
(V2-Lite) or low-rank (V3), YaRN's mscale, the group-limited routing (V2 greedy /
group-limited softmax, V3 sigmoid with its correction bias) with shared experts and dense
first layers; the engine modes (chunked prefill, prefix-cache hits, preemption); each
attention backend; tensor and expert parallel; the research loop's forwards."""
import numpy as np
import pytest
from test_gpt_oss import check_engine_modes, check_parallel_matches_one_device, check_trainer_logprobs
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
    """The research loop's two forwards (the dense differentiable one over the latent
    rows) give HF's logprobs, and the gradient reaches the latent projections."""
    check_trainer_logprobs(_model(tiny_models), "kv_b_proj")


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_deepseek_every_attention_backend(tiny_models, backend):
    """The latent rows through the reference and the Pallas (TPU kernel, interpreted)
    attention and KV write; the default (native) is the test above."""
    path = _model(tiny_models)
    llm = make_llm(path, attention_backend=backend, max_model_len=128)
    check_greedy(path, llm, prompts(2, [9, 30]), max_tokens=8)


def test_deepseek_chunked_prefill_prefix_cache_and_preemption(tiny_models):
    check_engine_modes(_model(tiny_models), num_blocks=10)


@pytest.mark.devices(4)
def test_deepseek_tensor_and_expert_parallel_match_one_device(tiny_models):
    """tp 2 (heads split, the latent cache whole on each device) and expert parallel 2
    give the one-device tokens and logprobs."""
    def whole_latent_cache(runner):
        assert runner.kv_cache.addressable_shards[0].data.shape[-2:] == (1, 40)

    check_parallel_matches_one_device(_model(tiny_models), whole_latent_cache)


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


@pytest.mark.parametrize("kept", [False, True], ids=["decoded", "kept_fp8"])
def test_deepseek_fp8_block_scaled_checkpoint(tiny_models, tmp_path, kept):
    """DeepSeek-V3's checkpoint format (every projection, experts and MLA's included, as
    float8_e4m3fn in 16 x 16 blocks with a float32 scale each: the test's packer, in
    models/packed_formats.py) serves the tokens and logprobs HF gives for the same
    rounded weights as floats: decoded at load (the CPU's default), or kept as fp8
    values with their block scales and dequantized inside the step (TPU / GPU's
    default; ``quantization="fp8"`` on CPU), through the compiled steps."""
    from models.packed_formats import write_int4_folder
    from safetensors import safe_open
    from test_int4_checkpoints import _served_params

    src = _model(tiny_models)
    write_int4_folder(src, tmp_path / "fp8", "fp8-block", group_size=16, float_dst=tmp_path / "float")
    with safe_open(str(tmp_path / "fp8" / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.experts.3.gate_proj.weight_scale_inv" in names
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv" in names
    llm = make_llm(tmp_path / "fp8", **({"quantization": "fp8", "enforce_eager": False} if kept else {}))
    if kept:
        params = _served_params(llm, by_name=True)
        for name, groups in [("experts_gate", 4), ("kv_a_proj", 4), ("o_proj", 6), ("shared_down", 2)]:
            assert str(params[name].dtype) == "float8_e4m3fn", name
            assert params[name + "_scale"].shape[-2] == groups and name + "_zero" not in params
        # q_b_proj's 24 input rows (q_lora_rank) are no whole 16-row blocks: served decoded.
        assert params["q_b_proj"].dtype == np.float32
        assert params["kv_b_proj"].dtype == np.float32  # MLA reads it as a tensor
        with pytest.raises(ValueError, match="fp8-block"):
            llm.update_weights(tmp_path / "float")
    check_greedy(tmp_path / "float", llm, prompts(14, [6, 33]))
    check_prompt_logprobs(tmp_path / "float", llm, prompts(15, [40])[0])
