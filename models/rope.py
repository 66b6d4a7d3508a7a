"""Rotary position embeddings (HF's rotate-half layout), incl. linear, llama3, YaRN
(GPT-OSS, DeepSeek) and LongRoPE (Phi-3) scaling, and partial rotary (the first ``partial_rotary_factor`` of
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
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, dim, theta, scaling)
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
    raise ValueError(f"rope_type {rope_type!r} is not supported (default, linear, llama3, yarn, longrope)")


def _yarn_inv_freq(inv_freq, dim: int, theta: float, scaling: dict) -> np.ndarray:
    """YaRN (arXiv 2309.00071), as HF computes it: the frequencies that turn fewer than
    ``beta_slow`` times over the trained length are interpolated (divided by ``factor``),
    those that turn more than ``beta_fast`` times kept, a linear ramp over the dims between
    (its ends rounded outwards unless ``truncate`` is false)."""
    factor = scaling.get("factor")
    if not factor:
        raise ValueError("rope_scaling: yarn needs factor (or max_position_embeddings / "
                         "original_max_position_embeddings)")
    original = scaling.get("original_max_position_embeddings")
    if not original:
        raise ValueError("rope_scaling: yarn needs original_max_position_embeddings (the trained length)")
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
    return (inv_freq / factor * (1 - keep) + inv_freq * keep).astype(np.float32)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term, 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def longrope_settings(scaling: dict, max_model_len: int) -> dict:
    """``scaling`` with LongRoPE's factor set chosen for an engine of ``max_model_len``
    (vLLM's rule): the long factors when a sequence may pass the trained length
    (``original_max_position_embeddings``), else the short ones. A choice per
    position would change the rotation of keys already in the KV cache."""
    if scaling.get("rope_type") != "longrope":
        return scaling
    return scaling | {"use_long_factor": max_model_len > scaling["original_max_position_embeddings"]}


def rope_attention_factor(scaling: dict, max_position_embeddings: int) -> float:
    """The factor LongRoPE and YaRN multiply cos / sin by (HF's attention_factor; 1.0 for
    the others)."""
    if scaling.get("rope_type") not in ("longrope", "yarn"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if scaling["rope_type"] == "yarn":
        factor = scaling["factor"]
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        return yarn_mscale(factor)
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_freqs(positions, inv_freq, mrope_section: tuple[int, ...] = ()):
    """The rotation angles [T, R/2]. positions: [T] int32, or M-RoPE's [3, T]
    (temporal, height, width; Qwen2-VL), where frequency j turns with the axis whose
    ``mrope_section`` block (sizes summing to R/2) holds j."""
    if positions.ndim == 1:
        return positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    assert sum(mrope_section) == inv_freq.shape[0], (mrope_section, inv_freq.shape)
    axis = np.repeat(np.arange(len(mrope_section)), mrope_section)  # [R/2]: each frequency's axis
    picked = positions.astype(jnp.float32)[axis]  # [R/2, T]
    return picked.T * inv_freq[None, :]


def apply_rope(x, positions, inv_freq, scale: float = 1.0, mrope_section: tuple[int, ...] = ()):
    """x: [T, heads, H]; positions: [T] int32 (or [3, T] with ``mrope_section``:
    ``rope_freqs``); inv_freq: [R/2] (R <= H: the first R dims rotate, the rest pass
    through); ``scale`` multiplies cos and sin (LongRoPE). Rotate-half layout."""
    freqs = rope_freqs(positions, inv_freq, mrope_section)  # [T, R/2]
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
