"""The serving dtypes: the activations' (``--dtype``), the matmul weights'
(``--weight-dtype``) and the KV cache's (``--kv-cache-dtype``), resolved for the platform
and, on a CPU, for what it multiplies natively."""
from __future__ import annotations

import functools

import jax.numpy as jnp

_TABLE = {"float32": jnp.float32, "float": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
          "half": jnp.float16}
# /proc/cpuinfo flags of x86 CPUs that multiply bf16 in hardware (AMX tiles on Sapphire
# Rapids and later; AVX512-BF16's dot products on Cooper Lake and Zen 4 and later).
_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def resolve_dtype(dtype: str | None, platform: str):
    """The activations' (and KV cache's) dtype: auto is float32 on CPU, bfloat16 elsewhere."""
    if dtype in ("auto", None):
        return jnp.float32 if platform == "cpu" else jnp.bfloat16
    if dtype not in _TABLE:
        raise ValueError(f"dtype must be one of auto, {', '.join(_TABLE)}; got {dtype!r}")
    return _TABLE[dtype]


def resolve_kv_cache_dtype(cache_dtype: str | None, dtype):
    """The K/V values' dtype: the activations' ``dtype`` (auto), bfloat16, or float8 e4m3
    (fp8: written saturating, widened by the attention kernel as it loads them). How the
    pages store it is the attention spec's (pallas_kernels/storage.py)."""
    return {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn, "bfloat16": jnp.bfloat16}.get(cache_dtype, dtype)


def resolve_weight_dtype(weight_dtype: str | None, dtype: str | None, platform: str):
    """The matmul weights' dtype (models.quantization.matmul_weight_names). auto: the
    activations', except under dtype=auto on a CPU with native bf16 products, where the
    weights are bf16 and the activations float32 (each product rounds its input to bf16
    and accumulates in float32: 3-5x the float32 matmul rate there, see
    models.quantization.matmul)."""
    if weight_dtype not in ("auto", None):
        if weight_dtype not in _TABLE:
            raise ValueError(f"weight_dtype must be one of auto, {', '.join(_TABLE)}; got {weight_dtype!r}")
        return _TABLE[weight_dtype]
    if dtype in ("auto", None) and platform == "cpu" and cpu_has_native_bf16():
        return jnp.bfloat16
    return resolve_dtype(dtype, platform)


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this machine's CPU multiplies bf16 in hardware (Linux x86: /proc/cpuinfo)."""
    from pallas_kernels.cpu import cpu_flags

    return not cpu_flags().isdisjoint(_BF16_FLAGS)
