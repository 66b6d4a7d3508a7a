"""Weight-only quantization: the projection weights stored as int8 (``--quantization
int8``) or float8 e4m3 (``fp8``) with one float32 scale per output channel (symmetric,
per-channel), quantized at load from the checkpoint's bf16 / f32 weights, on the device,
param by param; or read as stored from a pre-quantized HF ``compressed-tensors``
checkpoint (int8 / fp8 weights, channel or tensor scales).

A quantized param ``name`` [..., in, out] becomes int8 ``name`` plus float32
``name + "_scale"`` [..., out] (the ``in`` axis dropped, the rest sharded as the
weight). A projection is then ``(x @ int8.astype(x.dtype)) * scale``: the scale is per
output column, so applying it after the product is exact algebra, and XLA fuses the
convert into the dot's operand on TPU / GPU (the HLO is checked in the tests).

What stays in the serving dtype: the embedding and lm_head (they set every logit), the
norms, biases, the MoE router (routing decisions flip on small errors) and Qwen2-MoE's
shared-expert gate.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models import batch_invariance, packed_formats
from models.base import Weight, dim_size
from models.config import ModelArchConfig
from models.sharding import checkpoint_arch, source_indices
from pallas_kernels import cpu_matmul
from pallas_kernels.storage import from_bf16_bits, to_bf16_bits

QUANTIZATION_METHODS = ("int8", "fp8")  # quantized at load (fp8 on an fp8-block checkpoint: kept)
# --quantization values that name a packed checkpoint's format: its weights kept as stored.
INT4_METHODS = tuple(packed_formats.INT4_QUANTIZATION.values())
KEPT_METHODS = INT4_METHODS + ("mxfp4",)
# ModelArchConfig.quantization of a model served with a packed checkpoint's weights as stored:
# codes (int4 with zero points, fp8 values, e2m1) with a float32 scale per group of input rows.
GROUP_SCALED = ("int4", "fp8-block", "mxfp4")
WEIGHT_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
SCALE = "_scale"
ZERO = "_zero"  # an int4 weight's zero points, [..., G, out]
GIDX = "_gidx"  # an act-order int4 weight's group of each input row, [..., in]
# Per-layer projections that are never quantized (see the module docstring).
_KEEP = ("router", "shared_expert_gate", "kv_b_proj")  # kv_b_proj: MLA reads it as a tensor
_EXPERTS = ("experts_gate", "experts_up", "experts_down")  # models/moe.py's expert weights


def quantized_names(weight_map: dict[str, Weight]) -> list[str]:
    """The params int8 quantization stores as int8: every per-layer projection (an HF
    Linear weight, [..., in, out]; GPT-OSS's experts, stored [E, in, out] already) except
    those in _KEEP."""
    return [n for n, w in weight_map.items()
            if w.per_layer and len(w.dims) >= 3 and (w.transpose or n in _EXPERTS) and n not in _KEEP
            and not n.endswith((SCALE, ZERO))]  # an int4 weight's group scales and zeros


def matmul_weight_names(weight_map: dict[str, Weight]) -> list[str]:
    """The params a ``weight_dtype`` narrower than the serving dtype stores narrow: the
    projections int8 quantization takes, plus the embedding and lm_head (a matmul each:
    the lookup reads rows of the table, the tied head multiplies by it)."""
    return quantized_names(weight_map) + [n for n in ("embed_tokens", "lm_head") if n in weight_map]


def scale_weight(w: Weight) -> Weight:
    """The declaration of a quantized param's scale: its dims and sharding without the
    ``in`` axis (second to last). Never read from a checkpoint (computed at load)."""
    drop = len(w.dims) - 2
    part = w.partition
    return dataclasses.replace(w, hf_name=w.hf_name + "#scale", dims=w.dims[:drop] + w.dims[drop + 1:],
                               sharding=part[:drop] + part[drop + 1:], transpose=False)


def group_scaled_weights(w: Weight, arch: ModelArchConfig) -> dict[str, Weight]:
    """The params a projection ``w`` [..., in, out] kept as stored is served as, by
    suffix: its codes ("", the same layout: uint4 (uint8 on CPU) int4 or e2m1 codes, or
    float8 e4m3), ``SCALE`` (float32 [..., G, out]) and, for int4, ``ZERO`` (the same)
    and, under act-order, ``GIDX`` (int32 [..., in]), each read from the checkpoint's
    code views (models/weights.py: add_code_views). The groups are split like the ``in``
    axis where each device holds whole groups of its rows; else (one group, act-order)
    whole."""
    *lead, d_in, d_out = w.dims
    *lead_part, p_in, p_out = w.partition
    g = arch.group_size
    group_dim = f"{d_in}//{g}" if g else "1"
    p_group = p_in if g and not arch.act_order else None
    groups = dataclasses.replace(w, dims=(*lead, group_dim, d_out), sharding=(*lead_part, p_group, p_out))
    out = {"": dataclasses.replace(w, hf_name=w.hf_name + "#codes"),
           SCALE: dataclasses.replace(groups, hf_name=w.hf_name + "#scales")}
    if arch.quantization == "int4":
        out[ZERO] = dataclasses.replace(groups, hf_name=w.hf_name + "#zeros")
    if arch.act_order:
        out[GIDX] = Weight(w.hf_name + "#gidx", (*lead, d_in), (*lead_part, p_in), layer_offset=w.layer_offset)
    return out


def checkpoint_weight_map(model_cls, arch: ModelArchConfig) -> dict[str, Weight]:
    """What the model reads from its checkpoint: ``model_cls.weight_map(arch)``, with each
    of ``arch.grouped_params`` read as its parts (``group_scaled_weights``)."""
    wm = model_cls.weight_map(arch)
    if arch.quantization not in GROUP_SCALED:
        return wm
    out = {}
    for n, w in wm.items():
        parts = group_scaled_weights(w, arch) if n in arch.grouped_params else {"": w}
        out |= {n + suffix: part for suffix, part in parts.items()}
    return out


def param_map(model_cls, arch: ModelArchConfig) -> dict[str, Weight]:
    """Every param the model holds: ``checkpoint_weight_map``, plus a scale per param
    quantized at load (int8 / fp8)."""
    wm = checkpoint_weight_map(model_cls, arch)
    if arch.quantization not in QUANTIZATION_METHODS:
        return wm
    return wm | {n + SCALE: scale_weight(wm[n]) for n in quantized_names(wm)}


def check_quantization(method: str | None) -> None:
    if method is not None and method not in QUANTIZATION_METHODS + KEPT_METHODS:
        raise ValueError(f"quantization={method!r} is not supported; allowed values: "
                         f"{', '.join(QUANTIZATION_METHODS + KEPT_METHODS)} (or none)")


def e2m1_values(codes):
    """MXFP4's 4-bit float codes (uint4 / uint8: sign bit 3, exponent bits 2-1, mantissa
    bit 0) -> their values, float32: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. In
    integer arithmetic (four times each value, one conversion), which fuses into the
    product's operand where a table lookup would be a gather."""
    c = codes.astype(jnp.int32)
    e, m = (c >> 1) & 3, c & 1
    quarters = jnp.where(e == 0, m << 1, (2 + m) << e)
    return jnp.where(c & 8, -0.25, 0.25) * quarters.astype(jnp.float32)


def dequantize_groups(codes, scale, zero, gidx, dtype):
    """A weight kept as stored (``GROUP_SCALED``) in ``dtype``: codes [in, out] (uint4 /
    uint8 int4 codes with ``zero``, uint4 / uint8 e2m1 codes without, or float8 values),
    scale and zero float32 [G, out], gidx None (groups of in / G consecutive rows) or
    int32 [in] (each row's group) -> [in, out] = (value - zero) * scale, computed in
    float32 as the checkpoint reader decodes it (the same values as the float view).
    Inside the step's jit, XLA can fuse this into the dot's operand on TPU / GPU (not
    measured on hardware yet), and the weights stay as stored in memory either way."""
    e2m1 = zero is None and not jnp.issubdtype(codes.dtype, jnp.floating)
    q = e2m1_values(codes) if e2m1 else codes.astype(jnp.float32)
    if gidx is not None:
        w = (q - zero[gidx]) * scale[gidx]
    else:
        groups, (n_in, n_out) = scale.shape[-2], codes.shape[-2:]
        q = q.reshape(groups, n_in // groups, n_out)
        w = (q if zero is None else q - zero[:, None]) * scale[:, None]
        w = w.reshape(n_in, n_out)
    return w.astype(dtype)


def quantize_int8(w):
    """w [..., in, out] -> (int8 [..., in, out], float32 scale [..., out]): per output
    channel, symmetric, round to nearest; |q| <= 127 so the range is symmetric."""
    wf = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(wf), axis=-2)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(wf / scale[..., None, :]), -127, 127).astype(jnp.int8)
    return q, scale


def quantize_fp8(w):
    """w [..., in, out] -> (float8 e4m3 [..., in, out], float32 scale [..., out]): per
    output channel, the column's largest magnitude mapped to e4m3's largest (448)."""
    wf = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(wf), axis=-2)
    top = float(jnp.finfo(jnp.float8_e4m3fn).max)
    scale = jnp.where(amax > 0, amax / top, 1.0)
    return jnp.clip(wf / scale[..., None, :], -top, top).astype(jnp.float8_e4m3fn), scale


_QUANTIZE = {"int8": quantize_int8, "fp8": quantize_fp8}


def quantizer(weight_map: dict[str, Weight], mesh: Mesh, method: str = "int8"):
    """``transform(name, array) -> {name: array}`` for the loader: a quantized param
    comes back as its int8 array and scale, each in its declared sharding (computed on
    the devices, no host copy); any other param as it is."""
    names = set(quantized_names(weight_map))
    jitted = {}

    def transform(name: str, value: jax.Array) -> dict[str, jax.Array]:
        if name not in names:
            return {name: value}
        w = weight_map[name]
        if name not in jitted:
            out = (NamedSharding(mesh, P(*w.partition)), NamedSharding(mesh, P(*scale_weight(w).partition)))
            jitted[name] = jax.jit(_QUANTIZE[method], out_shardings=out)
        q, scale = jitted[name](value)
        return {name: q, name + SCALE: scale}

    return transform


_NARROW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# How matmul may multiply, set by whoever traces the model's programs (they know the mesh
# and the engine's mode): the native CPU kernel for small products
# (pallas_kernels/cpu_matmul.py; not partitioned, so one device only), and batch-invariant
# products (docs/batch_invariance.md).
_NATIVE_PRODUCTS = contextvars.ContextVar("native_products", default=False)


@contextlib.contextmanager
def native_products(enabled: bool, batch_invariant: bool = False, mesh=None):
    """While tracing inside, ``matmul`` sends float32 x bf16 products of few rows to the
    native CPU kernel when ``enabled`` (a CPU with AVX512-BF16, one device, or with
    ``mesh`` a data-parallel mesh whose 'data' axis splits the rows: batch-invariant mode);
    ``batch_invariant``: the model code in batch-invariant mode (models/batch_invariance.py),
    every product computing each row the same way whatever the rows around it
    (``invariant_matmul``)."""
    token = _NATIVE_PRODUCTS.set(enabled)
    try:
        # The mesh (dp > 1, tp = 1): each device multiplies and tiles its own rank's rows.
        with batch_invariance.invariant(batch_invariant, mesh):
            yield
    finally:
        _NATIVE_PRODUCTS.reset(token)


def matmul(x, w, *, transposed: bool = False):
    """x [..., in] @ w [in, out] (``transposed``: w is [out, in]) -> [..., out] in x's
    dtype. A 16-bit float on either side multiplies in that dtype with float32
    accumulation and output (one rounding, to x's dtype, at the end): bf16 weights under
    float32 activations (``weight_dtype``) round x to bf16 first. That is the form AMX /
    AVX512-BF16 run natively: on an AMX CPU XLA:CPU's bf16 dot with a float32 result ran
    ~3x float32's FLOP/s at SmolLM2's shapes (64-256 rows), and a bf16 result (which it
    emulates) slower than float32. TPU / GPU
    accumulate in float32 either way. The transposed form is one dot_general: a
    transpose before the product cost XLA:CPU a copy of the whole table (lm_head
    [64, 576] x [49152, 576]: ~10x slower). Under batch-invariant products
    (``native_products``) it is ``invariant_matmul``."""
    if batch_invariance.active():
        return invariant_matmul(x, w, transposed=transposed, native=_NATIVE_PRODUCTS.get())
    if x.dtype not in _NARROW and w.dtype not in _NARROW:
        return x @ (w.T if transposed else w)
    if _NATIVE_PRODUCTS.get() and cpu_matmul.takes(x, w, transposed):
        # The same product (x rounded to bf16, float32 accumulation), 1.3-3x XLA's rate at
        # decode sizes on a 2-core CPU (pallas_kernels/cpu_matmul.py).
        return cpu_matmul.matmul_bf16(x, w, transposed)
    xs = x
    one_row = math.prod(x.shape[:-1]) == 1 and jax.default_backend() == "cpu"
    if one_row:
        # One row is a vector-matrix product to XLA:CPU, which widens the whole weight to
        # float32 for it on every call (and skips x's rounding): the lm_head was ~15x
        # slower than the same row padded to 4.
        xs = jnp.pad(x.reshape(1, -1), ((0, 3), (0, 0)))
    out = _product(xs, w, transposed)
    if one_row:
        out = out[:1].reshape(x.shape[:-1] + out.shape[-1:])
    return out.astype(x.dtype)


def _product(x, w, transposed: bool):
    """One dot_general of x [..., in] and w: in the narrow dtype of either side with
    float32 accumulation and result, or in float32."""
    low = w.dtype if w.dtype in _NARROW else x.dtype
    contract = (((x.ndim - 1,), (1 if transposed else 0,)), ((), ()))
    return jax.lax.dot_general(x.astype(low), w.astype(low), contract, preferred_element_type=jnp.float32)


def invariant_matmul(x, w, *, transposed: bool = False, native: bool = False):
    """``matmul``'s product, computed so that a row's result depends only on that row
    and w: never on how many rows share the call nor where the row sits among them.

    XLA's GEMMs pick their blocking, and so each output's summation order, from the
    shape (XLA:CPU's float32 product of 576 x 576 changed a row's last bits between 2
    and 64 rows; one row is a different routine again). Here every product has one
    shape: the rows go through ``lax.map`` in tiles of batch_invariance.TILE_ROWS (zero
    padded), each tile the same [tile, in] x w dot. Where the native CPU kernel takes the product
    (``native``: bf16 weights on an AVX512-BF16 CPU) it is used for every row count
    instead: it sums each row in one fixed order by construction (cpu_matmul.py)."""
    if native and cpu_matmul.takes(x, w, transposed, any_rows=True):
        rows = math.prod(x.shape[:-1])
        mesh = batch_invariance.rank_mesh(rows)
        if mesh is None:
            return cpu_matmul.matmul_bf16(x, w, transposed).astype(x.dtype)
        # A custom call has no partitioning rule: each device runs it on its rank's rows.
        local = jax.shard_map(functools.partial(cpu_matmul.matmul_bf16, transposed=transposed), mesh=mesh,
                              in_specs=(P("data"), P()), out_specs=P("data"), check_vma=False)
        out = local(x.reshape(rows, x.shape[-1]), w)
        return out.reshape(x.shape[:-1] + out.shape[-1:]).astype(x.dtype)
    out = batch_invariance.map_rows(lambda xt: _product(xt, w, transposed), x.reshape(-1, x.shape[-1]))
    return out.reshape(x.shape[:-1] + out.shape[-1:]).astype(x.dtype)


def scan_safe(tree, restore: bool = False):
    """A tree's bfloat16 arrays as their uint16 bit patterns (``restore``: back to
    bfloat16), for weights sliced by lax.scan on CPU (the convention and its reason:
    pallas_kernels/storage.py). The bit patterns are stored so (DecoderLayers): a bitcast
    before the loop would copy the whole array per call. Other arrays pass as they are."""
    return jax.tree.map(from_bf16_bits if restore else to_bf16_bits, tree)


def linear(x, lw: dict, name: str):
    """x @ lw[name] (``matmul``), dequantizing an int8 / fp8 weight by its per-column scale
    after the product; plus the LoRA adapters' update when the layer carries their buffers
    (models/lora.py: lw[name + "_lora_a"] [in, S*R], lw[name + "_lora_b"] [S*R, out],
    the step's per-token slot mask lw["_lora_mask"] [T, S*R] and lw["_lora_on"], whether
    any token has an adapter)."""
    w = lw[name]
    scale = lw.get(name + SCALE)
    if scale is None:
        y = matmul(x, w)
    elif scale.ndim == w.ndim:  # kept as stored, with group scales
        y = matmul(x, dequantize_groups(w, scale, lw.get(name + ZERO), lw.get(name + GIDX), x.dtype))
    else:
        wide = w.astype(x.dtype)
        product = invariant_matmul(x, wide, native=False) if batch_invariance.active() else x @ wide
        y = (product * scale).astype(x.dtype)
    a = lw.get(name + "_lora_a")
    if a is None:
        return y
    b, mask = lw[name + "_lora_b"], lw["_lora_mask"]

    def with_adapters():
        # The adapters are in the weights' dtype (bf16 weights: bf16 adapters, the same
        # products) or, under a quantized base, in the activations'.
        return y + matmul(matmul(x, a) * mask, b)

    return jax.lax.cond(lw["_lora_on"], with_adapters, lambda: y)


# ---------------------------------------------------------------- pre-quantized checkpoints
@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """What a compressed-tensors ``quantization_config`` says about the weights."""

    method: str  # "int8" or "fp8": the stored weight dtype
    strategy: str  # "channel" (a scale per output row) or "tensor" (one scale)


# Per-layer KV cache scales of a compressed-tensors checkpoint with a kv_cache_scheme
# (llm-compressor writes self_attn.k_scale / v_scale; older exports k_proj.output_scale).
KV_SCALE_TENSORS = r"model\.layers\.\d+\.self_attn\.(?:[kv]_scale|[kv]_proj\.output_scale)"


def read_kv_cache_scales(ckpt) -> tuple[float, float] | None:
    """(k_scale, v_scale) for a float8 KV cache from the checkpoint's per-layer scales, or
    None when it has none. Our cache has one scale per tensor for all layers (folded into
    the kernels' products), so each is the largest layer's: stored = value / scale never
    saturates where the checkpoint's calibration said a layer's values reach."""
    found: dict[str, list[float]] = {"k": [], "v": []}
    pattern = re.compile(KV_SCALE_TENSORS)
    for name in ckpt.tensors:
        if pattern.fullmatch(name):
            kind = name.rsplit(".", 2)[-2][0] if name.endswith("output_scale") else name.rsplit(".", 1)[-1][0]
            value = ckpt.read(name, tuple(slice(None) for _ in ckpt.tensors[name].shape))
            found[kind].append(float(np.max(np.asarray(value, np.float32))))
    if not found["k"] and not found["v"]:
        return None
    if not found["k"] or not found["v"]:
        raise ValueError("the checkpoint has KV cache scales for only one of k and v")
    k, v = max(found["k"]), max(found["v"])
    if not (np.isfinite(k) and np.isfinite(v) and k > 0 and v > 0):
        raise ValueError(f"the checkpoint's KV cache scales must be finite and positive, got k={k}, v={v}")
    return k, v


def _check_kv_cache_scheme(scheme: dict) -> None:
    """A compressed-tensors ``kv_cache_scheme``: float8, one scale per tensor, symmetric
    (what ``--kv-cache-dtype fp8`` stores); anything else is a ValueError."""
    kind, bits = scheme.get("type"), scheme.get("num_bits")
    strategy, symmetric = scheme.get("strategy", "tensor"), bool(scheme.get("symmetric", True))
    if kind != "float" or bits != 8 or strategy != "tensor" or not symmetric:
        raise ValueError(f"quantization_config.kv_cache_scheme: type={kind} num_bits={bits} strategy={strategy} "
                         f"symmetric={symmetric} is not supported (8-bit float, tensor, symmetric)")


def read_checkpoint_quantization(cfg: dict) -> CheckpointQuantization | None:
    """config.json's ``quantization_config`` (compressed-tensors), or None when the weights
    are plain (a config with only a ``kv_cache_scheme`` has plain weights). ValueError for
    the schemes not served: groups / blocks, asymmetric weights (zero points), packed
    int4, other quantizers (GPTQ, AWQ, bitsandbytes)."""
    qc = cfg.get("quantization_config")
    if not qc:
        return None
    if packed_formats.packed_method(qc):
        return None  # MXFP4 / AWQ / GPTQ / W4A16: decoded by the checkpoint reader (models/packed_formats.py)
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(f"quantization_config.quant_method={method!r} is not supported (compressed-tensors "
                         "int8 / fp8 / pack-quantized int4, awq, gptq, mxfp4)")
    fmt = qc.get("format")
    if fmt not in ("int-quantized", "float-quantized", "naive-quantized"):
        raise ValueError(f"quantization_config.format={fmt!r} is not supported (int-quantized, float-quantized, "
                         "naive-quantized)")
    groups = list((qc.get("config_groups") or {}).values())
    if qc.get("kv_cache_scheme"):
        _check_kv_cache_scheme(qc["kv_cache_scheme"])
        if not any(g.get("weights") for g in groups):
            return None
    schemes = {(g["weights"].get("type"), g["weights"].get("num_bits"), g["weights"].get("strategy"),
                bool(g["weights"].get("symmetric", True))) for g in groups if g.get("weights")}
    if len(schemes) != 1:
        raise ValueError(f"quantization_config: exactly one weight scheme is supported, got {sorted(schemes)}")
    kind, bits, strategy, symmetric = schemes.pop()
    if bits != 8 or kind not in ("int", "float") or strategy not in ("channel", "tensor") or not symmetric:
        raise ValueError(f"quantization_config: weights type={kind} num_bits={bits} strategy={strategy} "
                         f"symmetric={symmetric} are not supported (8-bit int / float, channel or tensor, symmetric)")
    targets = {t for g in groups for t in g.get("targets", [])}
    if targets - {"Linear"}:
        raise ValueError(f"quantization_config: targets {sorted(targets)} are not supported (Linear)")
    return CheckpointQuantization("int8" if kind == "int" else "fp8", strategy)


def stored_quantized(weight_map: dict[str, Weight], ckpt) -> set[str]:
    """The params whose checkpoint tensors are stored quantized (they come with a
    ``weight_scale``; compressed-tensors leaves its ``ignore`` list, e.g. lm_head, as is)."""
    return {n for n, w in weight_map.items()
            if w.hf_name.endswith(".weight") and _scale_name(w.hf_name.format(i=0, e=0)) in ckpt.tensors}


def _scale_name(tensor: str) -> str:
    return tensor[: -len(".weight")] + ".weight_scale"


def checkpoint_scales(ckpt, name: str, w: Weight, arch: ModelArchConfig, mesh: Mesh) -> jax.Array:
    """The float32 scale [..., out] of a stored-quantized param, read from its tensors'
    ``weight_scale`` ([out, 1] per channel, or one value per tensor), laid out as served
    (KV heads replicated / split like the weight's output axis)."""
    sw = scale_weight(w)
    stored = checkpoint_arch(arch)
    out_dim = w.dims[-1]
    src = source_indices(out_dim, arch, 0, dim_size(arch, out_dim))
    rows = []
    for _, tensor in w.tensor_names(stored):
        s = ckpt.read(_scale_name(tensor), tuple(slice(None) for _ in ckpt.tensors[_scale_name(tensor)].shape))
        s = np.asarray(s, np.float32).reshape(-1)
        s = np.broadcast_to(s, (dim_size(stored, out_dim),)) if s.size == 1 else s
        rows.append(s[src])
    host = np.stack(rows).reshape(sw.shape(arch))
    sharding = NamedSharding(mesh, P(*sw.partition))
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def checkpoint_transform(ckpt, weight_map: dict[str, Weight], arch: ModelArchConfig, mesh: Mesh, dtype):
    """The loader's per-param transform for a compressed-tensors checkpoint. A param stored
    quantized stays so (with its scale) when ``arch.quantization`` is set and the param is
    one that is served quantized; any other stored-quantized param (e.g. a quantized MoE
    router, or fp8 on CPU) is dequantized into ``dtype``. Projections the checkpoint left
    unquantized are quantized at load like ``--quantization``."""
    stored = stored_quantized(weight_map, ckpt)
    served = set(quantized_names(weight_map)) if arch.quantization else set()
    quantize = quantizer(weight_map, mesh, arch.quantization) if arch.quantization else None

    def transform(name: str, value: jax.Array) -> dict[str, jax.Array]:
        if name in stored:
            scale = checkpoint_scales(ckpt, name, weight_map[name], arch, mesh)
            if name in served:
                return {name: value, name + SCALE: scale}
            deq = jax.jit(lambda q, s: (q.astype(jnp.float32) * s[..., None, :]).astype(dtype),
                          out_shardings=value.sharding)
            return {name: deq(value, scale)}
        if name in served:
            return quantize(name, value)
        return {name: value}

    return transform, {n: WEIGHT_DTYPES[arch.quantization] for n in stored & served}
