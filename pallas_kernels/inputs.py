"""Argument checks and set-up shared by the kernel wrappers (tpu.py, gpu.py, kv_cache_update.py).

Only static (shape / dtype / Python value) checks: they run once per trace, never on device.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.storage import BF16_BITS, to_bf16_bits


def rows_per_kv_head(kv_cache) -> int:
    """How many cache rows each KV head has on axis -2: 2 (its K row, then its V row) in
    the [.., S, 2K, H] layout; 1 in the latent layout [.., S, 1, H] of Multi-head Latent
    Attention (DeepSeek), whose one row per token is both the key and the value (the
    value is its first kv_lora_rank entries: the model drops the rest of the output).
    A regular cache always has an even, nonzero row count, so one row means latent."""
    return 1 if kv_cache.shape[-2] == 1 else 2


def new_cache_rows(k, v):
    """The rows a token writes: K and V interleaved [T, 2K, H], or the latent k [T, 1, H]
    alone when ``v`` is None (rows_per_kv_head)."""
    t, kh, h = k.shape
    return k if v is None else jnp.stack([k, v], axis=2).reshape(t, 2 * kh, h)


def validate_inputs(q, kv_cache, kv_lens, page_indices, cu_q_lens, *, sliding_window=None, soft_cap=None):
    """Static shape / dtype checks of ragged paged attention's arguments (ValueError on mismatch)."""
    t, n, h = q.shape
    if kv_cache.ndim not in (4, 5):
        raise ValueError(f"kv_cache must be [P, S, 2K, H] (or stacked [L, P, S, 2K, H]), got {kv_cache.shape}")
    _, _, two_k, hk = kv_cache.shape[-4:]
    if hk != h:
        raise ValueError(f"head_dim of q ({h}) and kv_cache ({hk}) differ")
    if two_k % 2 and two_k != 1:
        raise ValueError(f"kv_cache axis 2 must hold 2K interleaved rows (or 1 latent row), got {two_k}")
    k_heads = two_k // rows_per_kv_head(kv_cache)
    if n % k_heads:
        raise ValueError(f"{n} query heads are not a multiple of {k_heads} kv heads")
    r = page_indices.shape[0]
    if kv_lens.shape != (r,) or cu_q_lens.shape != (r + 1,):
        raise ValueError(
            f"kv_lens {kv_lens.shape} / cu_q_lens {cu_q_lens.shape} do not match page_indices {page_indices.shape}"
        )
    for name, a in (("kv_lens", kv_lens), ("page_indices", page_indices), ("cu_q_lens", cu_q_lens)):
        if a.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {a.dtype}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if soft_cap is not None and soft_cap == 0:
        raise ValueError("soft_cap must not be 0")


def to_cache_dtype(x, dtype):
    """New K/V rows in the cache's dtype. float8 (e4m3fn) has no infinity: a value past
    its range would become NaN, so it saturates at the largest finite value instead."""
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits == 8:
        big = float(jnp.finfo(dtype).max)
        x = jnp.clip(x.astype(jnp.float32), -big, big)
    if jnp.dtype(dtype) == BF16_BITS:  # a bf16 cache stored as bit patterns (storage.py)
        return to_bf16_bits(x.astype(jnp.bfloat16))
    return x.astype(dtype)


def compute_dtype(kv, like):
    """K/V read from an 8-bit cache, widened for the products (``like``: q's dtype);
    wider caches are used as they are."""
    return kv.astype(like) if jnp.dtype(kv.dtype).itemsize == 1 else kv


def layer_index(kv_cache, layer):
    """The layer of a stacked cache as the int32 [1] operand the kernels read (0 when not stacked).

    ``layer`` must be given exactly when ``kv_cache`` is stacked [L, P, S, 2K, H]: the
    kernels then read ``kv_cache[layer]`` in place (ValueError otherwise).
    """
    if (layer is None) != (kv_cache.ndim == 4):
        raise ValueError("pass `layer` exactly when kv_cache is stacked [L, P, S, 2K, H]")
    return jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
