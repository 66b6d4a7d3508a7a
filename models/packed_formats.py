"""Checkpoint formats whose weights are decoded as they are read: each packed group of
tensors is presented by ``SafetensorsCheckpoint`` (models/weights.py) as the one float
tensor HF's dequantized model holds, so the model files, the tensor-parallel reads and
weight updates see a plain checkpoint.

- **MXFP4** (OCP microscaling; GPT-OSS's experts): ``X_blocks`` uint8 [..., R, G, 16]
  (two e2m1 codes per byte, low nibble first) and ``X_scales`` uint8 [..., R, G] (a
  power-of-two exponent, bias 127, per 32 values) -> ``X`` [..., G * 32, R] in bfloat16
  (HF's layout of the dequantized experts; exact: the values have 2-bit mantissas).
- **AWQ** (AutoAWQ GEMM, ``quant_method: awq``): ``X.qweight`` int32 [in, out / 8] (eight
  4-bit values per int32 along out, in AWQ's order 0 2 4 6 1 3 5 7), ``X.qzeros`` int32
  [in / g, out / 8] (the same packing), ``X.scales`` [in / g, out] -> ``X.weight``
  [out, in] = ((q - z) * s).T.
- **GPTQ** (AutoGPTQ / GPTQModel, ``quant_method: gptq``): ``X.qweight`` int32 [in / 8,
  out] (packed along in, in order), ``X.qzeros`` int32 [in / g, out / 8] (zero - 1 in the
  v1 ``checkpoint_format``, the zero itself in v2), ``X.scales`` [in / g, out], ``X.g_idx``
  [in] (act-order: each input row's group) -> ``X.weight`` [out, in].
- **compressed-tensors pack-quantized** (W4A16, symmetric): ``X.weight_packed`` int32
  [out, in / 8] (int4 along in, offset by 8, in order), ``X.weight_scale`` [out, in / g]
  (or [out, 1]: channel), ``X.weight_shape`` -> ``X.weight``.
- **fp8 block-scaled** (DeepSeek-V3's, HF's FineGrainedFP8: ``quant_method: fp8`` with
  ``weight_block_size`` [b0, b1]): ``X.weight`` float8_e4m3fn [out, in] and
  ``X.weight_scale_inv`` float32 [ceil(out / b0), ceil(in / b1)] -> ``X.weight`` =
  value * the scale of its block.

They are decoded on the host (float32; MXFP4 in bfloat16, exact), so on CPU the model then
runs at the float model's speed with the quantized model's values
(benchmarks/bench_quantization.py measures both). Or the weights are kept as stored, the
default on TPU / GPU: each projection's codes (int4: ``Int4Parts``, unpacked but not
decoded; fp8: the e4m3 values; MXFP4: the e2m1 codes) with a float32 scale per group of
input rows and output column (fp8: its block's; MXFP4: its power of two), dequantized
inside each product by models/quantization.py (``dequantize_groups``).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import ml_dtypes

_FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       np.float32)
MXFP4_BLOCK = 32  # values per shared exponent
PACK_QUANTIZED = "compressed-tensors/pack-quantized"
INT4_FORMATS = ("awq", "gptq", PACK_QUANTIZED)  # the formats an int4-served model keeps as int4
# vLLM's --quantization name of each: asking for it keeps the weights in int4 on any platform.
INT4_QUANTIZATION = {"awq": "awq", "gptq": "gptq", PACK_QUANTIZED: "compressed-tensors"}
# Every format that can be kept as stored, with the --quantization name that asks for it
# (vLLM's: fp8 for block-scaled fp8, mxfp4) and the kind of codes it keeps
# (ModelArchConfig.quantization; models/quantization.py GROUP_SCALED).
KEPT_QUANTIZATION = INT4_QUANTIZATION | {"fp8": "fp8", "mxfp4": "mxfp4"}
KEPT_KIND = dict.fromkeys(INT4_FORMATS, "int4") | {"fp8": "fp8-block", "mxfp4": "mxfp4"}
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column _AWQ_ORDER[i] of its eight


def packed_method(qc: dict | None) -> str | None:
    """The format of ``quantization_config`` if it is one decoded at read (mxfp4, fp8 with
    weight_block_size, awq, gptq, compressed-tensors/pack-quantized), else None. ValueError for a packed format's variant not supported (bits, layout)."""
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "mxfp4":
        return method
    if method == "fp8":
        block = qc.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(int(b) > 0 for b in block)):
            raise ValueError(f"quantization_config: fp8 with weight_block_size={block!r} is not supported "
                             "(block-scaled [b0, b1], as DeepSeek-V3 ships)")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config: fp8 fmt={qc.get('fmt')!r} is not supported (e4m3)")
        return method
    if method in ("awq", "gptq"):
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise ValueError(f"quantization_config: {method} with bits={bits} is not supported (4-bit only)")
        if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
            raise ValueError(f"quantization_config: awq version={qc.get('version')!r} is not supported (gemm)")
        if method == "gptq" and qc.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization_config: gptq checkpoint_format={qc.get('checkpoint_format')!r} is not "
                             "supported (gptq, gptq_v2)")
        return method
    if method == "compressed-tensors" and qc.get("format") == "pack-quantized":
        for group in (qc.get("config_groups") or {}).values():
            w = group.get("weights") or {}
            if w.get("num_bits") != 4 or w.get("type") != "int" or w.get("strategy") not in ("group", "channel"):
                raise ValueError(f"quantization_config: pack-quantized weights num_bits={w.get('num_bits')} "
                                 f"type={w.get('type')} strategy={w.get('strategy')} are not supported (4-bit int, "
                                 "group or channel)")
            if not w.get("symmetric", True):
                raise ValueError("quantization_config: pack-quantized with zero points (asymmetric) is not "
                                 "supported (symmetric only)")
            if group.get("input_activations"):
                raise ValueError("quantization_config: pack-quantized with quantized activations is not supported "
                                 "(W4A16 only)")
        return PACK_QUANTIZED
    return None


def check_platform(method: str | None, platform: str) -> None:
    """A packed checkpoint decoded to floats at load (to be quantized again, e.g. int8):
    only on CPU; TPU / GPU keep its weights as stored."""
    if method is not None and platform != "cpu":
        raise ValueError(f"{method} checkpoints are decoded to floats at load on CPU only; on TPU / GPU they are "
                         f"served as stored: leave --quantization unset or name the checkpoint's format "
                         f"({KEPT_QUANTIZATION[method]})")


def unpack_int4(packed: np.ndarray, axis: int, order=tuple(range(8))) -> np.ndarray:
    """int32 words holding eight 4-bit values each (nibble i: element order[i] of its
    eight along ``axis``) -> their unsigned values (uint8), ``axis`` 8 times longer."""
    words = packed.astype(np.uint32)
    nibbles = [(words >> (4 * i)) & 0xF for i in range(8)]
    by_position = [nibbles[order.index(j)] for j in range(8)]
    out = np.stack(by_position, axis=axis + 1 if axis >= 0 else axis)
    shape = list(packed.shape)
    shape[axis] *= 8
    return out.reshape(shape).astype(np.uint8)


def mxfp4_codes(blocks: np.ndarray) -> np.ndarray:
    """blocks uint8 [R, G, 16] -> their e2m1 codes, uint8 [R, G * 32] (low nibble first)."""
    return np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(blocks.shape[0], -1)


def mxfp4_scales(scales: np.ndarray) -> np.ndarray:
    """e8m0 exponents uint8 [R, G] -> the powers of two they stand for, float32 [R, G]."""
    return np.ldexp(np.float32(1), scales.astype(np.int32) - 127).astype(np.float32)


def decode_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [R, G, 16], scales uint8 [R, G] -> float32 [R, G * 32]."""
    values = _FP4_VALUES[mxfp4_codes(blocks)].reshape(*blocks.shape[:-1], MXFP4_BLOCK)
    return (values * mxfp4_scales(scales)[..., None]).reshape(blocks.shape[0], -1)


def _per_element(block_scales, block, shape) -> np.ndarray:
    """Per-block scales [ceil(out / b0), ceil(in / b1)] spread over ``shape`` [out, in]."""
    full = np.repeat(np.repeat(np.asarray(block_scales, np.float32), block[0], 0), block[1], 1)
    return full[:shape[0], :shape[1]]


def fp8_group_scales(scale_inv, block, out: int) -> np.ndarray:
    """Per-block scales [ceil(out / b0), G] -> each output row's scale per group of b1
    input columns, float32 [out, G] (the layout of an int4 projection's group scales)."""
    return np.repeat(np.asarray(scale_inv, np.float32), block[0], axis=0)[:out]


def decode_fp8_block(weight, scale_inv, block) -> np.ndarray:
    """fp8 [out, in] and its per-block scales [ceil(out / b0), ceil(in / b1)] -> float32 [out, in]."""
    return weight.astype(np.float32) * _per_element(scale_inv, block, weight.shape)


def pack_fp8_block(w_out_in: np.ndarray, block):
    """An HF Linear weight [out, in] -> ({weight: float8_e4m3fn, weight_scale_inv: float32
    per block}, the float32 [out, in] they decode to): each block scaled so its largest
    magnitude is e4m3's 448, rounded to nearest."""
    w = np.asarray(w_out_in, np.float32)
    out, inp = w.shape
    b0, b1 = block
    rows, cols = -(-out // b0), -(-inp // b1)
    padded = np.zeros((rows * b0, cols * b1), np.float32)
    padded[:out, :inp] = w
    amax = np.abs(padded.reshape(rows, b0, cols, b1)).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    q = (w / _per_element(scale, block, w.shape)).astype(ml_dtypes.float8_e4m3fn)
    parts = {"weight": np.ascontiguousarray(q), "weight_scale_inv": scale}
    return parts, decode_fp8_block(q, scale, block)


@dataclasses.dataclass
class Int4Parts:
    """One int4 projection in the HF Linear layout, unpacked but not decoded: the weight
    is ``(codes - zeros[:, g]) * scales[:, g]`` with ``g`` each input column's group
    (``g_idx``; None: consecutive blocks of in / G columns)."""

    codes: np.ndarray  # uint8 [out, in], values 0..15
    zeros: np.ndarray  # float32 [out, G]
    scales: np.ndarray  # float32 [out, G]
    g_idx: np.ndarray | None = None  # int32 [in] (GPTQ act-order), or None

    def groups(self) -> np.ndarray:
        """Each input column's group, int64 [in]."""
        return row_groups(self.g_idx, self.codes.shape[1], self.scales.shape[1])

    def decode(self) -> np.ndarray:
        """float32 [out, in]."""
        g = self.groups()
        return (self.codes.astype(np.float32) - self.zeros[:, g]) * self.scales[:, g]


def row_groups(g_idx, n_in: int, n_groups: int) -> np.ndarray:
    """Each of ``n_in`` input rows' group, int64 [in]: ``g_idx`` (act-order), or for None
    consecutive blocks of n_in / n_groups rows."""
    return np.arange(n_in) // (n_in // n_groups) if g_idx is None else np.asarray(g_idx, np.int64)


def in_order(g_idx, n_groups: int) -> bool:
    """Whether GPTQ's ``g_idx`` [in] is consecutive blocks of in / n_groups rows (no act-order)."""
    return bool(np.array_equal(np.asarray(g_idx), row_groups(None, len(g_idx), n_groups)))


# Each format in two halves: its codes (the bulk: unpacked only where the codes are wanted)
# and its groups' (zeros [out, G], scales [out, G], g_idx [in] or None).
def awq_codes(qweight) -> np.ndarray:
    return np.ascontiguousarray(unpack_int4(qweight, axis=1, order=_AWQ_ORDER).T)  # [in, out] -> [out, in]


def awq_groups(qzeros, scales):
    z = unpack_int4(qzeros, axis=1, order=_AWQ_ORDER).astype(np.float32)  # [in / g, out]
    return np.ascontiguousarray(z.T), np.ascontiguousarray(np.asarray(scales, np.float32).T), None


def gptq_codes(qweight) -> np.ndarray:
    return np.ascontiguousarray(unpack_int4(qweight, axis=0).T)  # packed along in


def gptq_groups(qzeros, scales, g_idx, zero_offset: int):
    """``zero_offset`` 1 for the v1 format (zeros stored minus one); ``g_idx`` None or in
    order (no act-order) gives consecutive groups."""
    z = unpack_int4(qzeros, axis=1).astype(np.float32) + zero_offset  # [groups, out]
    # (v1 zeros wrap: a stored 0xF for zero 0 reads 16 minus one; the + 1 is mod 16.)
    z = np.where(z > 15, z - 16, z) if zero_offset else z
    if g_idx is not None and in_order(g_idx, z.shape[0]):
        g_idx = None
    return (np.ascontiguousarray(z.T), np.ascontiguousarray(np.asarray(scales, np.float32).T),
            None if g_idx is None else np.asarray(g_idx, np.int32))


def pack_quantized_codes(packed, shape=None) -> np.ndarray:
    """Signed int4 values in [-8, 7] stored offset by 8 (the zero point)."""
    q = unpack_int4(packed, axis=1)  # [out, in (padded to 8)]
    return np.ascontiguousarray(q if shape is None else q[:, :int(shape[1])])


def pack_quantized_groups(scale):
    """Symmetric: one scale per group of in (or per row), the zero point 8."""
    s = np.asarray(scale, np.float32)
    return np.full(s.shape, 8.0, np.float32), s, None


def decode_awq(qweight, qzeros, scales) -> np.ndarray:
    """AWQ -> float32 [out, in] (HF Linear layout)."""
    return Int4Parts(awq_codes(qweight), *awq_groups(qzeros, scales)).decode()


def decode_gptq(qweight, qzeros, scales, g_idx, zero_offset: int) -> np.ndarray:
    """GPTQ -> float32 [out, in]."""
    return Int4Parts(gptq_codes(qweight), *gptq_groups(qzeros, scales, g_idx, zero_offset)).decode()


def decode_pack_quantized(packed, scale, shape=None) -> np.ndarray:
    """compressed-tensors pack-quantized -> float32 [out, in]."""
    return Int4Parts(pack_quantized_codes(packed, shape), *pack_quantized_groups(scale)).decode()


# ---------------------------------------------------------------- reference packers
# The inverse of the decoders, from float weights, following each format's layout: what
# the tests and benchmarks/bench_quantization.py write checkpoints with (no torch, no
# AutoAWQ / GPTQ run: round-to-nearest, not their calibrated search).

def pack_int4(values: np.ndarray, axis: int, order=tuple(range(8))) -> np.ndarray:
    """unpack_int4's inverse: values in [0, 15] -> int32 words, ``axis`` 8 times shorter."""
    v = np.moveaxis(np.asarray(values, np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)
    words = np.zeros(v.shape[:-1], np.uint32)
    for i, element in enumerate(order):
        words |= v[..., element] << (4 * i)
    return np.ascontiguousarray(np.moveaxis(words.view(np.int32), -1, axis))


def quantize_groups(w_in_out: np.ndarray, group_size: int, symmetric: bool, rows=None):
    """w [in, out] -> (q uint8 [in, out] in [0, 15], zeros [groups, out] uint8, scales
    [groups, out] float32) by round to nearest, per group of input rows (``rows``: each
    row's group, act-order; default consecutive blocks)."""
    w = np.asarray(w_in_out, np.float32)
    n_in = w.shape[0]
    rows = np.arange(n_in) // group_size if rows is None else np.asarray(rows)
    groups = int(rows.max()) + 1
    lo = np.stack([w[rows == g].min(axis=0) for g in range(groups)])
    hi = np.stack([w[rows == g].max(axis=0) for g in range(groups)])
    if symmetric:
        scales = np.maximum(np.maximum(-lo, hi) / 7.5, 1e-8)
        zeros = np.full_like(scales, 8.0)
    else:
        scales = np.maximum((hi - lo) / 15.0, 1e-8)
        zeros = np.clip(np.round(-lo / scales), 0, 15)
    q = np.clip(np.round(w / scales[rows]) + zeros[rows], 0, 15)
    return q.astype(np.uint8), zeros.astype(np.uint8), scales.astype(np.float32)


def pack_mxfp4(w_out_in: np.ndarray):
    """A float array [..., out, in] (in a multiple of 32) -> (blocks uint8 [..., out, in /
    32, 16], scales uint8 [..., out, in / 32], the float32 [..., out, in] they decode to):
    per 32 values the power of two that fits the largest magnitude to 6, each value
    rounded to the nearest e2m1 magnitude with its sign."""
    *lead, out, inp = w_out_in.shape
    groups = np.asarray(w_out_in, np.float32).reshape(*lead, out, inp // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = np.abs(groups).max(axis=-1, keepdims=True)
    exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), 0).astype(np.int32)
    scaled = groups / np.exp2(exp)
    codes = (np.abs(scaled[..., None] - _FP4_VALUES[:8]).argmin(axis=-1) + 8 * (scaled < 0)).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # low nibble first
    values = (_FP4_VALUES[codes] * np.exp2(exp)).reshape(*lead, out, inp)
    # C order: safetensors' numpy writer stores the buffer as it lies, strides ignored.
    scales = np.ascontiguousarray((exp[..., 0] + 127).astype(np.uint8))
    return np.ascontiguousarray(blocks), scales, values


def pack_awq(w_out_in: np.ndarray, group_size: int):
    """An HF Linear weight [out, in] -> (AWQ tensors {qweight, qzeros, scales (float16)},
    the float32 [out, in] they decode to)."""
    q, z, s = quantize_groups(np.asarray(w_out_in).T, group_size, symmetric=False)
    s = np.ascontiguousarray(s.astype(np.float16))
    parts = {"qweight": pack_int4(q, 1, _AWQ_ORDER), "qzeros": pack_int4(z, 1, _AWQ_ORDER), "scales": s}
    return parts, decode_awq(parts["qweight"], parts["qzeros"], s)


def pack_gptq(w_out_in: np.ndarray, group_size: int, act_order: bool, seed: int = 0):
    """An HF Linear weight [out, in] -> (GPTQ v1 tensors {qweight, qzeros (zero - 1),
    scales (float16), g_idx}, the float32 [out, in] they decode to). ``act_order``: the
    rows' groups follow a random permutation (GPTQ's desc_act order)."""
    n_in = w_out_in.shape[1]
    rank = np.random.default_rng(seed).permutation(n_in) if act_order else np.arange(n_in)
    g_idx = (rank // group_size).astype(np.int32)
    q, z, s = quantize_groups(np.asarray(w_out_in).T, group_size, symmetric=False, rows=g_idx)
    s = np.ascontiguousarray(s.astype(np.float16))
    stored_zeros = (z.astype(np.int32) - 1) & 0xF
    parts = {"qweight": pack_int4(q, 0), "qzeros": pack_int4(stored_zeros, 1), "scales": s, "g_idx": g_idx}
    return parts, decode_gptq(parts["qweight"], parts["qzeros"], s, g_idx, zero_offset=1)


def pack_w4a16(w_out_in: np.ndarray, group_size: int):
    """An HF Linear weight [out, in] -> (compressed-tensors pack-quantized tensors
    {weight_packed, weight_scale (float16), weight_shape}, the float32 [out, in] they
    decode to); symmetric, signed int4 offset by 8."""
    q, _, s = quantize_groups(np.asarray(w_out_in).T, group_size, symmetric=True)
    q = np.clip(q.astype(np.int32), 0, 15)  # already offset by the zero point 8
    s = np.ascontiguousarray(s.T.astype(np.float16))  # [out, groups]
    shape = np.array(w_out_in.shape, np.int64)
    parts = {"weight_packed": pack_int4(q.T, 1), "weight_scale": s, "weight_shape": shape}
    return parts, decode_pack_quantized(parts["weight_packed"], s, shape)


def int4_quantization_config(fmt: str, group_size: int) -> dict:
    """config.json's quantization_config of a folder ``write_int4_folder`` writes
    (``group_size``: fp8-block's block edge)."""
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": True, "sym": False,
                "checkpoint_format": "gptq"}
    if fmt == "w4a16":
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 4, "type": "int", "strategy": "group", "group_size": group_size, "symmetric": True}}}}
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [group_size, group_size]}
    raise ValueError(f"packed format {fmt!r}: expected awq, gptq, w4a16 or fp8-block")


def quantization_name(fmt: str) -> str:
    """The --quantization value that keeps a ``write_int4_folder`` format (awq, gptq,
    w4a16, fp8-block) as stored."""
    return KEPT_QUANTIZATION[packed_method(int4_quantization_config(fmt, 32))]


def write_int4_folder(src, dst, fmt: str, group_size: int = 128, float_dst=None) -> None:
    """A float32 single-file safetensors folder ``src`` with every decoder projection
    (``model.layers.N.{self_attn,mlp}.[...].*_proj.weight``: MoE experts and shared
    experts too) rounded to int4 in ``fmt`` (awq,
    gptq with act-order, w4a16) by the reference packers, or to fp8 in blocks of
    ``group_size`` square ("fp8-block", the experts' and MLA's projections too, as
    DeepSeek-V3 ships), written to ``dst``; with ``float_dst``, the same rounded model as
    float32 too (a reference for HF)."""
    import json
    import re
    import shutil
    from pathlib import Path

    from safetensors.numpy import load_file, save_file

    src, dst = Path(src), Path(dst)
    pack = {"awq": lambda w: pack_awq(w, group_size), "gptq": lambda w: pack_gptq(w, group_size, act_order=True),
            "w4a16": lambda w: pack_w4a16(w, group_size),
            "fp8-block": lambda w: pack_fp8_block(w, (group_size, group_size))}[fmt]
    names = (r"model\.layers\.\d+\.(self_attn|mlp)\.([\w.]+\.)?\w+_proj(_with_mqa)?\.weight" if fmt == "fp8-block"
             else r"model\.layers\.\d+\.(self_attn|mlp)\.([\w.]+\.)?\w+_proj\.weight")
    tensors = load_file(str(src / "model.safetensors"))
    floats, packed = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if re.fullmatch(names, name):
            parts, values = pack(w)
            floats[name] = np.ascontiguousarray(values.astype(w.dtype))  # safetensors writes buffers as they lie
            del packed[name]
            packed.update({f"{name[:-len('.weight')]}.{k}": v for k, v in parts.items()})
    for out, ts in ((dst, packed), (float_dst, floats)):
        if out is not None:
            shutil.copytree(src, out, dirs_exist_ok=True)
            save_file(ts, str(Path(out) / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(cfg | {"quantization_config": int4_quantization_config(
        fmt, group_size)}, indent=2))
