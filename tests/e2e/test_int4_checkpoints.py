"""AWQ, GPTQ (act-order) and compressed-tensors W4A16 checkpoints (models/packed_formats.py),
written by the reference packers from a tiny model's float weights: jaxserve serves the
tokens and logprobs HF gives for the same rounded weights as floats, at tp 1 and 2;
each decoder is checked against the format's layout written out independently here."""
import numpy as np
import pytest
from hf_factory import INT4_FORMATS, write_int4_checkpoint
from test_parity_hf import make_llm, prompts
from test_phi3 import check_greedy, check_prompt_logprobs

from models import packed_formats as pf

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("fmt", list(INT4_FORMATS))
def test_int4_checkpoint_serves_the_dequantized_models_tokens(tiny_models, tmp_path, fmt):
    src = tiny_models("llama", kv_heads=2)
    write_int4_checkpoint(src, fmt, tmp_path / "float", tmp_path / fmt)
    llm = make_llm(tmp_path / fmt)
    check_greedy(tmp_path / "float", llm, prompts(21, [7, 30]))
    check_prompt_logprobs(tmp_path / "float", llm, prompts(22, [25])[0])


@pytest.mark.devices(2)
def test_int4_checkpoint_tensor_parallel(tiny_models, tmp_path):
    """Each device reads its columns / rows of the decoded projections."""
    src = tiny_models("llama", kv_heads=2)
    write_int4_checkpoint(src, "gptq", tmp_path / "float", tmp_path / "gptq")
    check_greedy(tmp_path / "float", make_llm(tmp_path / "gptq", tensor_parallel_size=2), prompts(23, [12, 40]))


def test_decoders_follow_the_formats():
    """The decoders against the layouts as their projects describe them, written here
    without models/packed_formats.py's helpers."""
    rng = np.random.default_rng(0)
    out_f, in_f, g = 16, 64, 32
    q = rng.integers(0, 16, (in_f, out_f))  # [in, out]
    z = rng.integers(0, 16, (in_f // g, out_f))
    s = rng.uniform(0.01, 0.1, (in_f // g, out_f)).astype(np.float16)
    want = ((q - z[np.arange(in_f) // g]) * s.astype(np.float32)[np.arange(in_f) // g]).T

    def words(values, order):  # eight values per int32 along the last axis, value order[i] in nibble i
        v = values.reshape(*values.shape[:-1], -1, 8)
        return sum(v[..., order[i]].astype(np.int64) << (4 * i) for i in range(8)).astype(np.uint32).view(np.int32)

    # AutoAWQ GEMM: columns packed 8 per word in the order 0 2 4 6 1 3 5 7 (its reverse: 0 4 1 5 2 6 3 7).
    awq = pf.decode_awq(words(q, (0, 2, 4, 6, 1, 3, 5, 7)), words(z, (0, 2, 4, 6, 1, 3, 5, 7)), s)
    np.testing.assert_allclose(awq, want, rtol=1e-6)
    # GPTQ v1: rows packed 8 per word in order; zeros packed along out, stored minus one.
    qweight = words(q.T, tuple(range(8))).T
    gptq = pf.decode_gptq(qweight, words((z - 1) & 0xF, tuple(range(8))), s, np.arange(in_f) // g, zero_offset=1)
    np.testing.assert_allclose(gptq, want, rtol=1e-6)
    # compressed-tensors pack-quantized: [out, in] int4 offset by 8, packed along in in order.
    sym = rng.integers(-8, 8, (out_f, in_f))
    scale = rng.uniform(0.01, 0.1, (out_f, in_f // g)).astype(np.float16)
    w4 = pf.decode_pack_quantized(words(sym + 8, tuple(range(8))), scale)
    np.testing.assert_allclose(w4, sym * scale.astype(np.float32)[:, np.arange(in_f) // g], rtol=1e-6)


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "awq", "bits": 3, "group_size": 128}, "awq with bits=3 is not supported"),
    ({"quant_method": "gptq", "bits": 8}, "gptq with bits=8 is not supported"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "awq version='gemv' is not supported"),
    ({"quant_method": "aqlm"}, "quant_method='aqlm' is not supported"),
])
def test_unsupported_quantized_formats_fail_at_start(tiny_models, tmp_path, qc, message):
    import json
    import shutil

    path = tmp_path / "m"
    shutil.copytree(tiny_models("llama", kv_heads=2), path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"quantization_config": qc}))
    with pytest.raises(ValueError, match=message):
        make_llm(path)


def test_fp8_block_layout_follows_the_format():
    """fp8 block-scaled (HF FineGrainedFP8 / DeepSeek-V3): scale_inv [ceil(out / b0),
    ceil(in / b1)] multiplies each block, written out independently of the decoder; the
    rounding stays within e4m3's relative step."""
    import ml_dtypes

    from models.packed_formats import decode_fp8_block, pack_fp8_block

    rng = np.random.default_rng(4)
    w = rng.standard_normal((40, 72)).astype(np.float32) * np.linspace(0.1, 3.0, 72)
    parts, values = pack_fp8_block(w, (16, 32))
    assert parts["weight"].dtype == ml_dtypes.float8_e4m3fn and parts["weight_scale_inv"].shape == (3, 3)
    q, s = parts["weight"].astype(np.float32), parts["weight_scale_inv"]
    want = np.empty_like(w)
    for i in range(40):
        for j in range(72):
            want[i, j] = q[i, j] * s[i // 16, j // 32]
    np.testing.assert_array_equal(decode_fp8_block(parts["weight"], s, (16, 32)), want)
    np.testing.assert_array_equal(values, want)
    assert np.all(np.abs(values - w) <= 2 ** -3 * np.abs(w) + 1e-6 * np.abs(w).max())


def _served_params(llm, by_name: bool = False) -> dict:
    """The served params by path ("layers/q_proj"), or ``by_name`` by their last part."""
    from flax import nnx

    state = llm.llm_engine.model_runner.state
    key = (lambda path: str(path[-1])) if by_name else (lambda path: "/".join(map(str, path)))
    return {key(path): v.get_value() for path, v in nnx.to_flat_state(state) if isinstance(v, nnx.Param)}


@pytest.mark.parametrize("fmt", list(INT4_FORMATS))
def test_int4_weights_kept_as_int4_give_the_dequantized_models_tokens(tiny_models, tmp_path, fmt):
    """--quantization naming the checkpoint's format keeps its projections as int4 codes
    with float32 group scales and zeros (TPU / GPU's default), dequantized inside each
    product: HF's tokens and logprobs on the same rounded weights, also through the
    ahead-of-time compiled steps (not eager)."""
    src = tiny_models("llama", kv_heads=2)
    write_int4_checkpoint(src, fmt, tmp_path / "float", tmp_path / fmt)
    llm = make_llm(tmp_path / fmt, quantization=pf.quantization_name(fmt), enforce_eager=fmt != "w4a16")
    params = _served_params(llm)
    q = next(v for k, v in params.items() if k.endswith("q_proj"))
    assert str(q.dtype) == "uint8" and q.shape[-2:] == (64, 64)  # one code per byte on CPU (loader._read_int4)
    scale = next(v for k, v in params.items() if k.endswith("q_proj_scale"))
    assert scale.dtype == np.float32 and scale.shape[-2:] == (2, 64)  # groups of 32 input rows
    assert any(k.endswith("q_proj_gidx") for k in params) == (fmt == "gptq")  # act-order
    check_greedy(tmp_path / "float", llm, prompts(21, [7, 30]))
    check_prompt_logprobs(tmp_path / "float", llm, prompts(22, [25])[0])
    with pytest.raises(ValueError, match="int4"):
        llm.update_weights(tmp_path / "float")
    with pytest.raises(ValueError, match="sleep level 2"):
        llm.sleep(level=2)


@pytest.mark.devices(2)
@pytest.mark.parametrize("fmt", ["w4a16", "gptq"])
def test_int4_weights_kept_as_int4_tensor_parallel(tiny_models, tmp_path, fmt):
    """Each device holds its rows' whole groups (o_proj / down_proj split by input rows)
    or, under act-order, every group's scales."""
    src = tiny_models("llama", kv_heads=2)
    write_int4_checkpoint(src, fmt, tmp_path / "float", tmp_path / fmt)
    llm = make_llm(tmp_path / fmt, quantization=pf.quantization_name(fmt), tensor_parallel_size=2)
    check_greedy(tmp_path / "float", llm, prompts(23, [12, 40]))


def test_int4_weight_stays_int4_in_the_program():
    """The step's parameter is the uint4 array: the float weight exists only inside the
    product's computation."""
    import jax
    import jax.numpy as jnp

    from models.quantization import linear

    codes = jnp.asarray(np.random.default_rng(0).integers(0, 16, (96, 160)), jnp.uint4)
    scale, zero = jnp.ones((3, 160), jnp.float32), jnp.full((3, 160), 8.0, jnp.float32)
    f = jax.jit(lambda x, c, s, z: linear(x, {"w": c, "w_scale": s, "w_zero": z}, "w"))
    x = jnp.ones((8, 96))
    hlo = f.lower(x, codes, scale, zero).compile().as_text()
    assert "u4[96,160]" in hlo[hlo.index("ENTRY"):].splitlines()[0]
    want = x @ ((np.asarray(codes, np.float32) - 8.0))
    np.testing.assert_allclose(f(x, codes, scale, zero), want, rtol=1e-6)


def test_kept_format_name_must_match_the_checkpoint(tiny_models, tmp_path):
    """--quantization awq / mxfp4 needs a checkpoint in that format; fp8 on a plain
    checkpoint still quantizes at load, per channel."""
    src = tiny_models("llama", kv_heads=2)
    write_int4_checkpoint(src, "gptq", tmp_path / "float", tmp_path / "gptq")
    for name in ("awq", "mxfp4"):
        with pytest.raises(ValueError, match="names a packed checkpoint format, but the checkpoint is not packed"):
            make_llm(src, quantization=name)
        with pytest.raises(ValueError, match="the checkpoint is gptq"):
            make_llm(tmp_path / "gptq", quantization=name)
    llm = make_llm(src, quantization="fp8")
    assert llm.llm_engine.model_runner.arch.quantization == "fp8"
    q = next(v for k, v in _served_params(llm).items() if k.endswith("q_proj_scale"))
    assert q.ndim == 2  # [L, out]: one scale per output channel


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
@pytest.mark.parametrize("kept", [False, True], ids=["decoded", "kept_int4"])
def test_int4_phi3_fused_projections(tiny_models, tmp_path, fmt, kept):
    """Phi-3's fused qkv_proj and gate_up_proj in int4 (AWQ packs the fused output
    columns, GPTQ the input rows under act-order): decoded at load, or kept as int4 and
    sliced into q / k / v and gate / up on their output columns, HF's tokens and logprobs
    on the same rounded weights."""
    src = tiny_models("phi3", kv_heads=2)
    write_int4_checkpoint(src, fmt, tmp_path / "float", tmp_path / fmt)
    llm = make_llm(tmp_path / fmt, **({"quantization": pf.quantization_name(fmt)} if kept else {}))
    if kept:
        params = _served_params(llm)
        q = next(v for k, v in params.items() if k.endswith("q_proj"))
        assert str(q.dtype) == "uint8"
    check_greedy(tmp_path / "float", llm, prompts(24, [9, 30]))
    check_prompt_logprobs(tmp_path / "float", llm, prompts(25, [20])[0])


@pytest.mark.parametrize("arch, fmt", [("qwen3_moe", "awq"), ("qwen3_moe", "gptq"), ("qwen3_moe", "w4a16"),
                                       ("deepseek_v3", "awq")])
def test_int4_moe_experts_kept_as_int4(tiny_models, tmp_path, arch, fmt):
    """A MoE checkpoint whose experts are int4 too (as AWQ / GPTQ MoE checkpoints ship):
    the experts stay int4 codes with their group scales ([L, E, in, out] uint8 on CPU)
    and are dequantized inside the step, a layer at a time; decoded at load on CPU by
    default. Both give HF's tokens and logprobs on the same rounded weights. DeepSeek-V3:
    its routed and shared experts, its dense first layer and MLA's q projections."""
    # DeepSeek: q_lora_rank 32 (the tests' 24 is no whole group of 32 rows).
    src = tiny_models(arch, **({"q_lora_rank": 32} if arch == "deepseek_v3" else {}))
    write_int4_checkpoint(src, fmt, tmp_path / "float", tmp_path / fmt)
    for kept in (True, False):
        llm = make_llm(tmp_path / fmt, **({"quantization": pf.quantization_name(fmt)} if kept else {}))
        if kept:
            params = _served_params(llm)
            gate = next(v for k, v in params.items() if k.endswith("experts_gate"))
            assert str(gate.dtype) == "uint8" and gate.ndim == 4
            assert any(k.endswith("experts_down_scale") for k in params)
        check_greedy(tmp_path / "float", llm, prompts(26, [9, 30]))
        check_prompt_logprobs(tmp_path / "float", llm, prompts(27, [20])[0])


@pytest.mark.devices(2)
def test_int4_moe_experts_kept_as_int4_expert_parallel(tiny_models, tmp_path):
    """Expert parallel 2: each device holds its experts' int4 codes, scales and (act-order)
    row groups whole; HF's tokens on the same rounded weights."""
    src = tiny_models("qwen3_moe")
    write_int4_checkpoint(src, "gptq", tmp_path / "float", tmp_path / "gptq")
    llm = make_llm(tmp_path / "gptq", quantization="gptq", tensor_parallel_size=2, enable_expert_parallel=True)
    gate = next(v for k, v in _served_params(llm).items() if k.endswith("experts_gate"))
    assert gate.sharding.spec[1] == "model"  # [L, E, in, out]: split by experts
    check_greedy(tmp_path / "float", llm, prompts(28, [12, 40]))


def test_kept_fp8_and_e2m1_codes_decode_as_the_reader_does():
    """The step's dequantization of fp8 blocks and MXFP4 codes gives the reader's decoded
    floats exactly, and the compiled program's parameters stay float8 / uint4."""
    import jax
    import jax.numpy as jnp

    from models.quantization import dequantize_groups, e2m1_values, linear

    np.testing.assert_array_equal(np.asarray(e2m1_values(jnp.arange(16, dtype=jnp.uint8))), pf._FP4_VALUES)
    rng = np.random.default_rng(3)
    w = rng.normal(size=(48, 64)).astype(np.float32)  # [out, in]
    parts, decoded = pf.pack_fp8_block(w, (16, 32))
    scales = pf.fp8_group_scales(parts["weight_scale_inv"], (16, 32), 48)  # [out, in / 32]
    got = dequantize_groups(jnp.asarray(parts["weight"].T), jnp.asarray(scales.T), None, None, jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), decoded.T)
    blocks, exps, values = pf.pack_mxfp4(w)
    codes = pf.mxfp4_codes(blocks.reshape(48, 2, 16)).T  # [in, out]
    got = dequantize_groups(jnp.asarray(codes), jnp.asarray(pf.mxfp4_scales(exps).T), None, None, jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), values.T)
    x = jnp.ones((8, 64))
    for c, s in [(jnp.asarray(parts["weight"].T), scales.T), (jnp.asarray(codes, jnp.uint4), pf.mxfp4_scales(exps).T)]:
        f = jax.jit(lambda x, c, s: linear(x, {"w": c, "w_scale": s}, "w"))
        entry = f.lower(x, c, jnp.asarray(s)).compile().as_text()
        entry = entry[entry.index("ENTRY"):].splitlines()[0]
        assert ("f8e4m3fn[64,48]" if c.dtype == jnp.float8_e4m3fn else "u4[64,48]") in entry, entry

