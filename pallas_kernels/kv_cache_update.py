"""Paged KV-cache write for TPU (Pallas / Mosaic): the new tokens' K/V by slot mapping.

Same contract as :func:`pallas_kernels.reference.write_kv_cache` (a jnp scatter, the
default everywhere), except that page 0 - the null page padded tokens point at - is
not written: nothing valid reads it, and skipping it saves the padded tokens' DMAs and
the write-write races between them.

The cache is aliased input -> output (``input_output_aliases``) and stays in HBM; the
slot mapping is scalar-prefetched; each program takes a block of tokens whose
interleaved ``[2K, H]`` rows arrive in VMEM by the normal block pipeline and leave by
one DMA per token into ``cache[slot // S, slot % S]``. All DMAs of a block are started
before the first wait, so they overlap.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.inputs import layer_index, new_cache_rows, to_cache_dtype

_TOKENS_PER_BLOCK = 128


def _kernel(slots_ref, layer_ref, new_ref, cache_in, cache_out, sem, *, num_tokens: int):
    del cache_in  # aliased with cache_out
    bt = new_ref.shape[0]
    num_pages, page_size = cache_out.shape[-4:-2]
    base = pl.program_id(0) * bt

    def copy(i):
        slot = slots_ref[jnp.minimum(base + i, num_tokens - 1)]
        page = slot // page_size
        live = (base + i < num_tokens) & (page > 0) & (page < num_pages)
        page = jnp.where(live, page, 0)
        if len(cache_out.shape) == 5:  # stacked over layers
            dst = cache_out.at[layer_ref[0], page, pl.ds(slot % page_size, 1)]
        else:
            dst = cache_out.at[page, pl.ds(slot % page_size, 1)]
        return live, pltpu.make_async_copy(new_ref.at[pl.ds(i, 1)], dst, sem)

    def start(i, _):
        live, c = copy(i)
        pl.when(live)(c.start)

    def wait(i, _):
        live, c = copy(i)
        pl.when(live)(c.wait)

    lax.fori_loop(0, bt, start, None)
    lax.fori_loop(0, bt, wait, None)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0,))
def write_kv_cache(kv_cache, k, v, slot_mapping, *, layer=None, interpret=False):
    """Write new tokens' K/V into the paged cache in place.

    kv_cache: [P, S, 2K, H], or [L, P, S, 2K, H] with ``layer`` (int32 scalar) for a
    cache stacked over layers (donated); k, v: [T, K, H] (the latent layout: k [T, 1, H],
    v None, as reference.write_kv_cache); slot_mapping: [T] int32
    (slot = page * S + offset; slots in page 0 or out of range are skipped).
    Returns the updated cache.
    """
    layer = layer_index(kv_cache, layer)
    page_size, two_k, head_dim = kv_cache.shape[-3:]
    t = k.shape[0]
    new = to_cache_dtype(new_cache_rows(k, v), kv_cache.dtype)
    bt = min(_TOKENS_PER_BLOCK, t)
    t_pad = pl.cdiv(t, bt) * bt
    if t_pad != t:
        new = jnp.pad(new, ((0, t_pad - t), (0, 0), (0, 0)))
    return pl.pallas_call(
        functools.partial(_kernel, num_tokens=t),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(t_pad // bt,),
            in_specs=[
                pl.BlockSpec((bt, two_k, head_dim), lambda i, *_: (i, 0, 0)),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
        input_output_aliases={3: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="write_kv_cache",
    )(slot_mapping.astype(jnp.int32), layer, new, kv_cache)
