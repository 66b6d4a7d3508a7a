"""Attention backend dispatch: "auto" resolved once into an AttentionSpec
(``resolve_attention_spec``), and the whole per-layer attention for (spec, mesh).

``build_attention`` is what a model step calls per layer: write the new tokens' K/V,
then ragged paged attention, under ``shard_map`` when the mesh splits heads::

    attention(q [T, N, H], k [T, K, H], v [T, K, H], kv_cache [L, P, S, 2K, H], layer, md,
              sinks=None) -> (o [T, N, H], kv_cache)

(``md``: the step's AttentionMetadata: slot_mapping [T, G], seq_lens, query_start_loc,
block_tables [R, G, Pmax], num_seqs; G: the KV cache groups.) ``get_attention_fn`` is the kernel alone; every kernel has the
reference's signature::

    fn(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *,
       sm_scale, sliding_window=None, soft_cap=None, layer=None, sinks=None, keys_ahead=None) -> o

(``layer``: kv_cache is stacked [L, P, S, 2K, H] and layer ``layer`` is read in place;
``sinks``: [N] float32 attention sinks, one logit per query head in every softmax's
denominator, reference.sink_factor; ``keys_ahead``: [T] int32, token t also sees the
next keys_ahead[t] keys of its request past its own position, all written in this
step (Gemma 3's images); the sliding window's start stays the token's own position
minus the window, as HF's AND(window, OR(causal, image)).)
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pallas_kernels import cpu, reference
from pallas_kernels.attention_metadata import AttentionMetadata
from pallas_kernels.storage import AttentionSpec, kv_storage_dtype

BACKENDS = ("auto", "reference", "pallas", "native")
# The KV cache [L, P, S, 2K, H] is split by pages (axis 1) over the mesh's 'data' axis
# (each data-parallel rank owns a slice of pages, its block ids local to the slice) and
# by KV heads (axis 3) over 'model'; tokens [T, N, H] split the same way (a rank's tokens,
# a device's heads), so each device attends on its own.
KV_CACHE_PARTITION = P(None, "data", None, "model", None)
# MLA's latent cache [L, P, S, 1, R + H_rope] has one row per token, read by every query
# head: each 'model' device holds all of it (and writes the same rows), attending with its own heads.
LATENT_KV_CACHE_PARTITION = P(None, "data", None, None, None)
_HEADS_PARTITION = P("data", "model", None)
_ROWS_PARTITION = P("data")  # every attention-metadata array: one rank's rows each
_PLATFORM_ALIASES = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "cpu": "cpu"}


def kv_cache_partition(latent_kv: bool = False) -> P:
    """The KV cache's partitioning over the mesh: KV_CACHE_PARTITION, or
    LATENT_KV_CACHE_PARTITION for MLA's latent rows."""
    return LATENT_KV_CACHE_PARTITION if latent_kv else KV_CACHE_PARTITION


def _platform(platform: str | None) -> str:
    name = (platform or jax.default_backend()).lower()
    if name not in _PLATFORM_ALIASES:
        raise ValueError(f"unknown platform {platform!r}; expected one of {sorted(_PLATFORM_ALIASES)}")
    return _PLATFORM_ALIASES[name]


def resolve_backend(backend: str = "auto", platform: str | None = None) -> tuple[str, str]:
    """(backend, platform) after resolving "auto" and platform aliases.

    "auto": pallas on tpu / gpu; on cpu the native kernel (pallas_kernels/cpu.py) where it
    builds, else the reference. "native" is CPU-only and must build (ValueError otherwise)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; allowed values: {', '.join(BACKENDS)}")
    plat = _platform(platform)
    if backend == "auto":
        if plat in ("tpu", "gpu"):
            backend = "pallas"
        else:
            backend = "native" if cpu.available() else "reference"
    elif backend == "native":
        if plat != "cpu":
            raise ValueError(f"attention backend 'native' runs on the CPU only, not on {plat}; use auto or pallas")
        if not cpu.available():
            raise ValueError("attention backend 'native' needs the CPU kernel, which did not build here (no C++ "
                             "compiler, or its build failed: see the log); use auto or reference")
    return backend, plat


def resolve_attention_spec(backend: str = "auto", platform: str | None = None, kv_dtype=jnp.float32, *,
                           interpret=None, batch_invariant: bool = False) -> AttentionSpec:
    """The engine's AttentionSpec: ``backend`` resolved (resolve_backend), the KV pages of
    ``kv_dtype`` and what they are stored as (storage.kv_storage_dtype), scales 1.0
    (AttentionSpec.with_kv_scales adds a checkpoint's). ``interpret`` (default: on CPU)
    runs the Pallas kernels interpreted. ``batch_invariant``: the kernels in their one
    fixed configuration (``_attention_fn``); the reference has none (its dense products
    change order with the batch's shape). ValueError for a combination no kernel runs."""
    backend, plat = resolve_backend(backend, platform)
    if batch_invariant and backend == "reference":
        raise ValueError("batch_invariant needs the native CPU attention kernel or the Pallas kernels; the "
                         "reference attention backend is not batch-invariant (attention_backend=auto picks one)")
    kv_dtype = jnp.dtype(kv_dtype)
    spec = AttentionSpec(backend=backend, platform=plat, kv_dtype=kv_dtype,
                         kv_storage_dtype=kv_storage_dtype(kv_dtype, plat, backend),
                         interpret=plat == "cpu" if interpret is None else interpret,
                         batch_invariant=batch_invariant)
    if spec.quantized_kv and plat == "tpu" and backend == "pallas":
        raise ValueError("kv_cache_dtype=fp8 is not supported by the TPU attention kernel on hardware yet "
                         "(it runs on GPU, on CPU and in interpret mode); use kv_cache_dtype=auto")
    return spec


def get_attention_fn(backend: str = "auto", platform: str | None = None, interpret=False):
    """Ragged paged attention for ``backend`` on ``platform`` (default: jax.default_backend()).

    "auto": pallas on tpu / gpu (cuda, rocm), native on cpu (reference where it does not
    build). "reference": plain jnp. "native": the CPU kernel (pallas_kernels/cpu.py), with
    the reference for dtypes it does not take (a float16 cache, say).
    "pallas": the Mosaic TPU kernel on tpu, the Triton-style kernel on gpu, and on cpu
    the TPU kernel in interpret mode (the legacy interpreter unless ``interpret`` is a
    ``pltpu.InterpretParams``), so the whole engine can run the pallas path on CPU.
    ``interpret`` is passed through on tpu / gpu (True runs the kernels interpreted).
    """
    return _attention_fn(*resolve_backend(backend, platform), interpret)


def _attention_fn(backend: str, plat: str, interpret, batch_invariant: bool = False):
    """get_attention_fn of a resolved backend and platform. ``batch_invariant``: each
    kernel in one configuration for every step (no decode / prefill dispatch, no split of
    the keys by the batch's size), so that a query's result never depends on the other
    queries of its step: the native kernel's one score order, the GPU kernel's one row
    block and no split-K, the TPU kernel's one query block (its KV block is fixed per engine)."""
    if backend == "reference":
        return reference.ragged_paged_attention
    if backend == "native":
        return functools.partial(native_or_reference, fixed_order=True) if batch_invariant else native_or_reference
    fixed = {}
    if plat == "gpu":
        from pallas_kernels import gpu

        if batch_invariant:
            fixed = dict(rows_per_block=gpu.INVARIANT_ROWS, kv_splits=1)
        return functools.partial(gpu.ragged_paged_attention, interpret=bool(interpret), **fixed)
    from pallas_kernels import tpu

    if plat == "cpu" and not interpret:
        interpret = True
    if batch_invariant:
        fixed = dict(num_queries_per_block=tpu.INVARIANT_QUERIES)
    return functools.partial(tpu.ragged_paged_attention, interpret=interpret, **fixed)


def native_or_reference(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale: float,
                        sliding_window: int | None = None, soft_cap: float | None = None, layer=None,
                        fixed_order: bool = False, sinks=None, keys_ahead=None):
    """The "native" backend's kernel: the CPU kernel where it takes q's and the cache's
    dtypes and head dim (pallas_kernels/cpu.py), the reference otherwise (an error in
    batch-invariant mode, ``fixed_order``, which the reference cannot keep)."""
    common = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, layer=layer, sinks=sinks,
                  keys_ahead=keys_ahead)
    if cpu.supports(q, kv_cache):
        return cpu.ragged_paged_attention(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                                          fixed_order=fixed_order, **common)
    if fixed_order:
        raise ValueError(f"batch_invariant: the CPU attention kernel does not take q {q.dtype} {q.shape} with a "
                         f"{kv_cache.dtype} cache, and the reference is not batch-invariant")
    return reference.ragged_paged_attention(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, **common)


def get_kv_write_fn(backend: str = "auto", platform: str | None = None, interpret=False):
    """The KV-cache write for ``backend`` on ``platform``: the Pallas DMA kernel with
    the TPU kernel (on cpu in interpret mode, as get_attention_fn), the reference
    scatter everywhere else (XLA updates the donated cache in place on CPU and GPU)."""
    return _kv_write_fn(*resolve_backend(backend, platform), interpret)


def _kv_write_fn(backend: str, plat: str, interpret):
    """get_kv_write_fn of a resolved backend and platform."""
    if backend in ("reference", "native") or plat == "gpu":
        return reference.write_kv_cache
    from pallas_kernels import kv_cache_update

    return functools.partial(kv_cache_update.write_kv_cache, interpret=interpret or plat == "cpu")


def build_attention(spec: AttentionSpec, mesh: Mesh | None, *, sm_scale: float, sliding_window: int | None = None,
                    sliding_window_layers: tuple[bool, ...] | None = None, soft_cap: float | None = None,
                    layer_group: tuple[int, ...] | None = None, layer_slot: tuple[int, ...] | None = None,
                    latent_kv: bool = False) -> Callable:
    """The per-layer attention of a model step (see the module docstring), with the
    kernel and KV write of ``spec`` (resolve_attention_spec).

    The KV write comes first, per layer, so a request later in the batch sees blocks an
    earlier request of the same step just filled (prefix dedup). On a mesh of more than
    one device both run under shard_map, each device on its own rank's tokens and pages
    and its own heads: a Pallas kernel has no partitioning
    rule, and left to GSPMD its operands, the whole stacked cache included, would be
    gathered onto every device.

    ``sliding_window_layers`` (Gemma's interleaved layers): which layers use
    ``sliding_window``; the others attend to the whole context. A traced ``layer`` (under
    the layer scan) picks between the two kernels with ``lax.switch`` (both compiled,
    one runs); None: every layer uses ``sliding_window``.

    ``spec.k_scale`` / ``spec.v_scale``: per-tensor scales of a float8 cache (stored = value /
    scale, saturating). Dequantizing is folded into the kernels' existing products: the
    scores' scale becomes sm_scale * k_scale and the output is multiplied by v_scale,
    so the kernels only widen the 8-bit rows they load.

    ``layer_group`` / ``layer_slot`` (KV cache groups, jaxserve/core/kv_cache_groups.py):
    model layer l reads and writes slot ``layer_slot[l]`` of the cache [slots, P, S, 2K, H]
    through group ``layer_group[l]``'s block table and slots (``md.block_tables`` [R, G, Pmax],
    ``md.slot_mapping`` [T, G]). None: one group, layer l in slot l.

    ``latent_kv`` (Multi-head Latent Attention): the cache is [L, P, S, 1, R + H_rope] and
    the attention is called with k = each token's latent row [T, 1, R + H_rope] and v None:
    that row is both the key and the value of every query head (q: [T, N, R + H_rope], the
    absorbed queries), so o is [T, N, R + H_rope] and the model keeps its first R entries.
    The rows are replicated over 'model' (LATENT_KV_CACHE_PARTITION), the heads split."""
    attend = _attention_fn(spec.backend, spec.platform, spec.interpret, spec.batch_invariant)
    write = _kv_write_fn(spec.backend, spec.platform, spec.interpret)
    k_scale, v_scale = spec.k_scale, spec.v_scale
    if sliding_window is None or sliding_window_layers is None or all(sliding_window_layers):
        windows = None
    elif not any(sliding_window_layers):
        windows, sliding_window = None, None
    else:
        windows = tuple(bool(w) for w in sliding_window_layers)

    def run(window, q, kv_cache, layer, md, sinks):
        # A sink is a logit: k_scale (a float8 cache's, folded into sm_scale) does not touch it.
        ahead = {} if md.keys_ahead is None else {"keys_ahead": md.keys_ahead}
        o = attend(q, kv_cache, md.seq_lens, md.block_tables, md.query_start_loc, md.num_seqs.reshape(()),
                   sm_scale=sm_scale * k_scale, sliding_window=window, soft_cap=soft_cap, layer=layer,
                   sinks=sinks, **ahead)
        return o if v_scale == 1.0 else (o * v_scale).astype(o.dtype)

    def lookup(table, layer):
        """table[layer] for a Python int layer (unrolled) or a traced one (the layer scan)."""
        return table[layer] if isinstance(layer, int) else jnp.asarray(table, jnp.int32)[layer]

    if latent_kv and k_scale != v_scale:
        raise ValueError(f"a latent (MLA) KV cache stores one row for the key and the value: one scale, not "
                         f"k_scale={k_scale} and v_scale={v_scale}")

    def local(q, k, v, kv_cache, layer, md, sinks=None):
        if k_scale != 1.0 or v_scale != 1.0:
            k, v = k / k_scale, None if v is None else v / v_scale
        group = 0 if layer_group is None else lookup(layer_group, layer)
        slot = layer if layer_slot is None else lookup(layer_slot, layer)
        md = dataclasses.replace(md, slot_mapping=md.slot_mapping[:, group], block_tables=md.block_tables[:, group])
        kv_cache = write(kv_cache, k, v, md.slot_mapping, layer=slot)
        if windows is None:
            o = run(sliding_window, q, kv_cache, slot, md, sinks)
        elif isinstance(layer, int):
            o = run(sliding_window if windows[layer] else None, q, kv_cache, slot, md, sinks)
        else:
            kind = jnp.asarray(windows, jnp.int32)[layer]
            o = jax.lax.switch(kind, [functools.partial(run, None), functools.partial(run, sliding_window)],
                               q, kv_cache, slot, md, sinks)
        return o, kv_cache

    if mesh is None or mesh.size == 1:
        return local
    heads = _HEADS_PARTITION
    cache = kv_cache_partition(latent_kv)
    # A latent row (MLA) is every head's: whole on each 'model' device; v is None.
    kv = (P("data", None, None), None) if latent_kv else (heads, heads)
    mapped = {}

    def sharded(q, k, v, kv_cache, layer, md, sinks=None):
        # One shard_map per (sinks, keys_ahead) present: the specs follow the arguments'
        # tree (sinks [N] split over 'model' as the query heads are; keys_ahead per token).
        kind = (sinks is not None, md.keys_ahead is not None)
        if kind not in mapped:
            md_specs = AttentionMetadata(*(_ROWS_PARTITION,) * 5, keys_ahead=_ROWS_PARTITION if kind[1] else None)
            specs = (heads, *kv, cache, P(), md_specs) + ((P("model"),) if kind[0] else ())
            mapped[kind] = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(heads, cache), check_vma=False)
        return mapped[kind](q, k, v, kv_cache, layer, md, *((sinks,) if kind[0] else ()))

    return sharded
