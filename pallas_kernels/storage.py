"""How the KV pages and the stacked layer weights are stored on the device, written once:
``AttentionSpec``, the resolved attention set-up that the runner, the draft model and
the attention backend all take, and the CPU's convention of keeping bfloat16 arrays as
their uint16 bit patterns (backend.resolve_attention_spec builds the spec).

Why bit patterns: XLA:CPU has no bfloat16 dynamic-slice, gather or scatter (its float
normalization widens them), so a bf16 array that the layer loop slices, gathers from or
scatters into is widened to float32 whole, once per call, outside the loop: a bf16 KV
cache was ~10x slower per layer at 64 decode rows, SmolLM2's stacked [30, 576, 1536]
weight ~4x slower over its 30 products. As uint16 the loop moves
the bits, and only what it reads is bitcast back to bfloat16. No model or cache has
uint16 values of its own, so the dtype alone says an array holds bit patterns; the
native CPU kernel (csrc/) reads them itself.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# The stored dtype of a bfloat16 array kept as its bit patterns.
BF16_BITS = jnp.dtype(jnp.uint16)


def to_bf16_bits(x):
    """A bfloat16 array as its uint16 bit patterns (same shape); other dtypes as they are."""
    return jax.lax.bitcast_convert_type(x, BF16_BITS) if x.dtype == jnp.bfloat16 else x


def from_bf16_bits(x):
    """uint16 bit patterns back to the bfloat16 array (same shape); other dtypes as they are."""
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == BF16_BITS else x


def kv_storage_dtype(kv_dtype, platform: str, backend: str) -> np.dtype:
    """What the KV pages of ``kv_dtype`` are stored as: a bfloat16 cache as bit patterns
    on CPU, where the layer loop gathers from it and scatters into it (the reference and
    native kernels read them; the pallas path, interpreted on CPU, keeps bfloat16)."""
    kv_dtype = jnp.dtype(kv_dtype)
    if kv_dtype == jnp.bfloat16 and platform == "cpu" and backend in ("reference", "native"):
        return BF16_BITS
    return kv_dtype


def stacked_weights_as_bits(platform: str, scan_layers: bool, param_dtype, dtype) -> bool:
    """Whether the stacked layer weights are stored as bit patterns: bfloat16 weights
    under float32 activations, sliced by the layer scan on CPU (models/llama.py)."""
    return (scan_layers and platform == "cpu" and param_dtype is not None
            and jnp.dtype(param_dtype) == jnp.bfloat16 and jnp.dtype(dtype) == jnp.float32)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The attention set-up of an engine, resolved once (backend.resolve_attention_spec):
    which kernel, and how the KV pages it reads are stored."""

    backend: str  # "reference", "native" or "pallas" ("auto" resolved for this machine)
    platform: str  # "cpu", "gpu" or "tpu"
    kv_dtype: np.dtype  # the K/V values' dtype: the model's, bfloat16 or float8 e4m3
    kv_storage_dtype: np.dtype  # the cache arrays' dtype: kv_dtype, or BF16_BITS (kv_storage_dtype())
    # Per-tensor scales of an 8-bit cache (stored = value / scale, saturating); 1.0 otherwise.
    k_scale: float = 1.0
    v_scale: float = 1.0
    interpret: Any = False  # run the Pallas kernels interpreted (True on CPU; or a pltpu.InterpretParams)
    # Batch-invariant mode (docs/batch_invariance.md): one kernel configuration and one
    # reduction order for every step, so a query's result depends on its own keys only.
    batch_invariant: bool = False

    @property
    def quantized_kv(self) -> bool:
        """Whether the cache holds 8-bit floats (written saturating, widened as loaded)."""
        return self.kv_dtype.itemsize == 1

    def with_kv_scales(self, scales: tuple[float, float] | None) -> AttentionSpec:
        """The spec with a checkpoint's KV scales (kv_cache_scheme), which only an 8-bit
        cache uses; None or any other cache: 1.0."""
        k_scale, v_scale = (scales or (1.0, 1.0)) if self.quantized_kv else (1.0, 1.0)
        return dataclasses.replace(self, k_scale=k_scale, v_scale=v_scale)
