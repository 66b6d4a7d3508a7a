"""Weight-only int8 quantization (``--quantization int8``): the projection weights are
stored as int8 with one float32 scale per output channel (symmetric, per-channel),
quantized at load from the checkpoint's bf16 / f32 weights, on the device, param by
param.

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

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.base import Weight
from models.config import ModelArchConfig

QUANTIZATION_METHODS = ("int8",)
SCALE = "_scale"
# Per-layer projections that are never quantized (see the module docstring).
_KEEP = ("router", "shared_expert_gate")


def quantized_names(weight_map: dict[str, Weight]) -> list[str]:
    """The params int8 quantization stores as int8: every per-layer projection (an HF
    Linear weight, [..., in, out]) except those in _KEEP."""
    return [n for n, w in weight_map.items() if w.per_layer and w.transpose and len(w.dims) >= 3 and n not in _KEEP]


def scale_weight(w: Weight) -> Weight:
    """The declaration of a quantized param's scale: its dims and sharding without the
    ``in`` axis (second to last). Never read from a checkpoint (computed at load)."""
    drop = len(w.dims) - 2
    part = w.partition
    return dataclasses.replace(w, hf_name=w.hf_name + "#scale", dims=w.dims[:drop] + w.dims[drop + 1:],
                               sharding=part[:drop] + part[drop + 1:], transpose=False)


def param_map(model_cls, arch: ModelArchConfig) -> dict[str, Weight]:
    """Every param the model holds: ``model_cls.weight_map(arch)``, plus a scale per
    quantized param when ``arch.quantization`` is set."""
    wm = model_cls.weight_map(arch)
    if not arch.quantization:
        return wm
    return wm | {n + SCALE: scale_weight(wm[n]) for n in quantized_names(wm)}


def check_quantization(method: str | None) -> None:
    if method is not None and method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={method!r} is not supported; allowed values: "
                         f"{', '.join(QUANTIZATION_METHODS)} (or none)")


def quantize_int8(w):
    """w [..., in, out] -> (int8 [..., in, out], float32 scale [..., out]): per output
    channel, symmetric, round to nearest; |q| <= 127 so the range is symmetric."""
    wf = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(wf), axis=-2)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(wf / scale[..., None, :]), -127, 127).astype(jnp.int8)
    return q, scale


def quantizer(weight_map: dict[str, Weight], mesh: Mesh):
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
            jitted[name] = jax.jit(quantize_int8, out_shardings=out)
        q, scale = jitted[name](value)
        return {name: q, name + SCALE: scale}

    return transform


def linear(x, lw: dict, name: str):
    """x @ lw[name], dequantizing an int8 weight by its per-column scale after the product."""
    w = lw[name]
    scale = lw.get(name + SCALE)
    if scale is None:
        return x @ w
    return ((x @ w.astype(x.dtype)) * scale).astype(x.dtype)
