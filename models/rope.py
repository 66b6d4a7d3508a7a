"""Rotary position embeddings (HF's rotate-half layout), incl. linear, llama3 and
LongRoPE (Phi-3) scaling, and partial rotary (the first ``partial_rotary_factor`` of
each head rotates, the rest passes)."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def rope_inv_freq(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """Inverse frequencies [R/2] of the R = head_dim * partial_rotary_factor rotated
    dims (float32 on the host, as HF computes them)."""
    dim = int(head_dim * scaling.get("partial_rotary_factor", 1.0))
    exponents = np.arange(0, dim, 2, dtype=np.float32) / dim
    inv_freq = 1.0 / (theta ** exponents)
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "longrope":
        # One set of factors for every position (vLLM's choice: long ones when the engine
        # may run past the trained length; see longrope_settings), not HF's per-forward switch.
        factors = np.asarray(scaling["long_factor" if scaling.get("use_long_factor") else "short_factor"], np.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_scaling: longrope factors have {factors.size} entries; the rotated dims "
                             f"need {inv_freq.size}")
        return (1.0 / (factors * theta ** exponents)).astype(np.float32)
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    raise ValueError(f"rope_type {rope_type!r} is not supported (default, linear, llama3, longrope)")


def longrope_settings(scaling: dict, max_model_len: int) -> dict:
    """``scaling`` with LongRoPE's factor set chosen for an engine of ``max_model_len``
    (vLLM's rule): the long factors when a sequence may pass the trained length
    (``original_max_position_embeddings``), else the short ones. A choice per
    position would change the rotation of keys already in the KV cache."""
    if scaling.get("rope_type") != "longrope":
        return scaling
    return scaling | {"use_long_factor": max_model_len > scaling["original_max_position_embeddings"]}


def rope_attention_factor(scaling: dict, max_position_embeddings: int) -> float:
    """The factor LongRoPE multiplies cos / sin by (HF's attention_factor; 1.0 for the others)."""
    if scaling.get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def apply_rope(x, positions, inv_freq, scale: float = 1.0):
    """x: [T, heads, H]; positions: [T] int32; inv_freq: [R/2] (R <= H: the first R dims
    rotate, the rest pass through); ``scale`` multiplies cos and sin (LongRoPE).
    Rotate-half layout."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, R/2]
    cos = jnp.cos(freqs)[:, None, :]
    sin = jnp.sin(freqs)[:, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    xf = x.astype(jnp.float32)
    rotary = 2 * inv_freq.shape[0]
    xr, passed = (xf, None) if rotary == x.shape[-1] else (xf[..., :rotary], xf[..., rotary:])
    x1, x2 = jnp.split(xr, 2, axis=-1)
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin] + ([passed] if passed is not None else [])
    return jnp.concatenate(parts, axis=-1).astype(x.dtype)
