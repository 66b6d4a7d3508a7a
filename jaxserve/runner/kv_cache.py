"""KV cache sizing (measured from device memory) and allocation with its sharding."""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxserve.core.kv_cache_groups import KVCacheLayout, make_kv_cache_layout
from jaxserve.core.kv_cache_utils import get_max_concurrency
from models.config import ModelArchConfig
from pallas_kernels.backend import kv_cache_partition

logger = logging.getLogger("jaxserve")

# Without device memory statistics (the CPU backend) the cache gets this much in all
# (simulated CPU devices share the host's memory) unless kv_cache_memory says otherwise.
CPU_DEFAULT_KV_CACHE_BYTES = 1 << 30


def kv_cache_layout(c: ModelArchConfig, *, free_window_blocks: bool = True) -> KVCacheLayout:
    """The model's KV cache groups (core/kv_cache_groups.py). ``free_window_blocks``
    False (a draft model shares the pages, and its layers do not slide): one group of
    every layer, no block is given back."""
    if not free_window_blocks:
        return make_kv_cache_layout(c.num_hidden_layers)
    return make_kv_cache_layout(c.num_hidden_layers, c.sliding_window, c.sliding_window_layers)


def kv_cache_shape(c: ModelArchConfig, num_blocks: int, block_size: int, slots: int | None = None) -> tuple[int, ...]:
    """[L, P, S, 2K, H]: K and V interleaved on axis 3 (K: the model's KV heads after
    replication for tensor parallelism); MLA's latent layout [L, P, S, 1, R + H_rope]
    (ModelArchConfig.kv_cache_rows). With data parallelism P is every rank's pages.
    L is the layout's ``slots`` per block (default: one per layer)."""
    return (slots or c.num_hidden_layers, num_blocks, block_size, *c.kv_cache_rows)


def bytes_per_block(c: ModelArchConfig, block_size: int, dtype, slots: int | None = None) -> int:
    """One block of one rank, all its devices together (a latent cache: on each device,
    every device holding all of it)."""
    return int(np.prod(kv_cache_shape(c, 1, block_size, slots))) * jnp.dtype(dtype).itemsize


def devices_per_block(c: ModelArchConfig, tensor_parallel_size: int) -> int:
    """How many devices a block's bytes are split over: the tp devices (KV heads), or 1
    for MLA's latent cache, which every device of a rank holds whole."""
    return 1 if c.latent_kv else tensor_parallel_size


def determine_num_blocks(
    c: ModelArchConfig,
    *,
    block_size: int,
    dtype,
    max_model_len: int,
    gpu_memory_utilization: float,
    kv_cache_memory: int | None,
    num_gpu_blocks_override: int | None,
    device: jax.Device,
    tensor_parallel_size: int = 1,
    num_devices: int = 1,
    draft: ModelArchConfig | None = None,
    layout: KVCacheLayout | None = None,
    max_num_batched_tokens: int | None = None,
) -> int:
    """Blocks per data-parallel rank (null block included) that fit the budget of one
    device (``kv_cache_memory`` is per device, as vLLM's; a device holds 1/tp of each
    of its rank's blocks); ValueError if one max_model_len sequence does not fit
    (naming the longest length that would). ``num_devices``: the mesh's, sharing the
    CPU default budget. ``draft``: a draft model (speculative decoding) whose KV shares
    the pages: a page then costs both models' bytes. ``layout``: the KV cache groups (a
    block is ``layout.slots_per_block`` layers' pages, and one request holds blocks in
    every group; default: one group of every layer)."""
    layout = layout or kv_cache_layout(c, free_window_blocks=False)
    max_num_batched_tokens = max_num_batched_tokens or max_model_len
    per_block = bytes_per_block(c, block_size, dtype, layout.slots_per_block)
    if draft is not None:
        per_block += bytes_per_block(draft, block_size, dtype)
    per_device_block = per_block / devices_per_block(c, tensor_parallel_size)
    if num_gpu_blocks_override is not None:
        num_blocks = num_gpu_blocks_override
    else:
        if kv_cache_memory is not None:
            budget = kv_cache_memory
        else:
            stats = device.memory_stats() if hasattr(device, "memory_stats") else None
            if stats and "bytes_limit" in stats:
                budget = int(stats["bytes_limit"] * gpu_memory_utilization) - stats.get("bytes_in_use", 0)
            else:
                budget = CPU_DEFAULT_KV_CACHE_BYTES // num_devices
        num_blocks = max(int(budget // per_device_block), 0)

        def fits(tokens: int) -> bool:
            return layout.blocks_held(tokens, block_size, max_num_batched_tokens) <= num_blocks - 1

        usable_tokens = max_model_len
        if not fits(max_model_len):  # the longest length that fits, for the message
            lo, hi = 0, max_model_len
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
            usable_tokens = lo
            raise ValueError(
                f"The KV cache budget ({budget / 2**30:.2f} GiB) holds {max(usable_tokens, 0)} tokens, fewer than "
                f"max_model_len={max_model_len}. Estimated maximum model length: {max(usable_tokens, 0)}. "
                "Lower max_model_len or raise gpu_memory_utilization / kv_cache_memory."
            )
    if layout.num_groups == 1 and layout.groups[0].sliding_window is None:
        concurrency = get_max_concurrency(num_blocks - 1, block_size, max_model_len)
    else:  # every group holds blocks: a request's share is what it holds in all of them
        concurrency = (num_blocks - 1) / layout.blocks_held(max_model_len, block_size, max_num_batched_tokens)
    logger.info(
        "KV cache per rank: %d blocks of %d tokens, %d group(s) of layers (%.1f MiB per device); max concurrency at %d "
        "tokens: %.2fx", num_blocks, block_size, layout.num_groups,
        num_blocks * per_device_block / 2**20, max_model_len, concurrency,
    )
    return num_blocks


def kv_cache_sharding(mesh, c: ModelArchConfig) -> NamedSharding:
    """Pages (axis 1) split over 'data' (each rank its own), KV heads (axis 3) over
    'model', as attention expects; a latent cache (MLA, ``c.latent_kv``) whole on every 'model' device."""
    return NamedSharding(mesh, kv_cache_partition(c.latent_kv))


def allocate_kv_cache(c: ModelArchConfig, num_blocks: int, block_size: int, dtype, mesh,
                      slots: int | None = None) -> jax.Array:
    """Every rank's ``num_blocks`` pages: [L, DP * num_blocks, S, 2K, H] (L: ``slots``,
    default one per layer); rank r's block b is global page r * num_blocks + b, i.e. its
    local page b."""
    shape = kv_cache_shape(c, num_blocks * mesh.shape["data"], block_size, slots)
    return _zeros(shape, jnp.dtype(dtype), kv_cache_sharding(mesh, c))()


@functools.lru_cache(maxsize=16)
def _zeros(shape: tuple[int, ...], dtype, sharding):
    """The program that makes a zeroed cache, made once per cache: waking from sleep
    re-allocates the cache without compiling."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
