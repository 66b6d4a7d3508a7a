"""Attention backend dispatch: one ragged paged-attention callable per (backend, platform).

The runner calls ``get_attention_fn(backend, jax.default_backend(), interpret=...)`` while
tracing its jitted step; every returned callable has the reference's signature::

    fn(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *,
       sm_scale, sliding_window=None, soft_cap=None, layer=None) -> o

(``layer``: kv_cache is stacked [L, P, S, 2K, H] and layer ``layer`` is read in place.)
"""
from __future__ import annotations

import functools

import jax

from pallas_kernels import reference

BACKENDS = ("auto", "reference", "pallas")
_PLATFORM_ALIASES = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "cpu": "cpu"}


def _platform(platform: str | None) -> str:
    name = (platform or jax.default_backend()).lower()
    if name not in _PLATFORM_ALIASES:
        raise ValueError(f"unknown platform {platform!r}; expected one of {sorted(_PLATFORM_ALIASES)}")
    return _PLATFORM_ALIASES[name]


def resolve_backend(backend: str = "auto", platform: str | None = None) -> tuple[str, str]:
    """(backend, platform) after resolving "auto" and platform aliases."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; allowed values: {', '.join(BACKENDS)}")
    plat = _platform(platform)
    if backend == "auto":
        backend = "pallas" if plat in ("tpu", "gpu") else "reference"
    return backend, plat


def get_attention_fn(backend: str = "auto", platform: str | None = None, interpret=False):
    """Ragged paged attention for ``backend`` on ``platform`` (default: jax.default_backend()).

    "auto": pallas on tpu / gpu (cuda, rocm), reference on cpu. "reference": plain jnp.
    "pallas": the Mosaic TPU kernel on tpu, the Triton-style kernel on gpu, and on cpu
    the TPU kernel in interpret mode (the legacy interpreter unless ``interpret`` is a
    ``pltpu.InterpretParams``), so the whole engine can run the pallas path on CPU.
    ``interpret`` is passed through on tpu / gpu (True runs the kernels interpreted).
    """
    backend, plat = resolve_backend(backend, platform)
    if backend == "reference":
        return reference.ragged_paged_attention
    if plat == "gpu":
        from pallas_kernels import gpu

        return functools.partial(gpu.ragged_paged_attention, interpret=bool(interpret))
    from pallas_kernels import tpu

    if plat == "cpu" and not interpret:
        interpret = True
    return functools.partial(tpu.ragged_paged_attention, interpret=interpret)
