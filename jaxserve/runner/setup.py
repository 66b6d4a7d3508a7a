"""The runner's set-up policy as small named functions: the device mesh, loading the
target model, the speculative proposers, and how many KV cache blocks fit. (The dtypes
are runner/dtypes.py's, the buckets runner/bucketing.py's, the attention spec
pallas_kernels/backend.py's.)"""
from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh

from jaxserve.config import EngineConfig
from jaxserve.core.kv_cache_groups import KVCacheLayout
from jaxserve.runner.kv_cache import determine_num_blocks
from models.config import ModelArchConfig
from models.loader import load_model

logger = logging.getLogger("jaxserve")


def make_mesh(tensor_parallel_size: int, data_parallel_size: int = 1) -> Mesh:
    """The ('data', 'model') mesh over the first dp * tp devices (all processes' devices
    in a multi-host run; jax.make_mesh orders them by the TPU topology)."""
    devices = jax.devices()
    n = tensor_parallel_size * data_parallel_size
    if n > len(devices):
        raise ValueError(
            f"data_parallel_size * tensor_parallel_size = {data_parallel_size} * {tensor_parallel_size} = {n} "
            f"exceeds the {len(devices)} available devices"
        )
    # Auto axes: the partitioner propagates shardings (jax.make_mesh's default axis types
    # changed across versions; Explicit would demand an out_sharding on every gather).
    return jax.make_mesh((data_parallel_size, tensor_parallel_size), ("data", "model"),
                         axis_types=(AxisType.Auto, AxisType.Auto), devices=devices[:n])


def local_device(mesh: Mesh) -> jax.Device:
    """A mesh device of this process (multi-host: only those report memory stats)."""
    return next(d for d in mesh.devices.flat if d.process_index == jax.process_index())


def load_target_model(config: EngineConfig, model_path: str, mesh: Mesh, dtype, param_dtype, *, progress: bool):
    """The served model placed on ``mesh``: (ModelArchConfig, graphdef, state), as
    models.loader.load_model, with the engine's model and parallel settings."""
    mc, pc = config.model_config, config.parallel_config
    t0 = time.perf_counter()
    loaded = load_model(model_path, mesh=mesh, dtype=dtype, progress=progress, scan_layers=mc.scan_layers,
                        expert_parallel=pc.enable_expert_parallel, quantization=mc.quantization,
                        param_dtype=param_dtype, hf_overrides=mc.hf_overrides,
                        max_model_len=config.scheduler_config.max_model_len)
    if jnp.dtype(param_dtype) != jnp.dtype(dtype):
        logger.info("Matmul weights in %s, activations and KV cache in %s (weight_dtype=%s)",
                    jnp.dtype(param_dtype).name, jnp.dtype(dtype).name, mc.weight_dtype)
    logger.info("Loaded %s (%s) in %.1f s", model_path, loaded[0].architecture, time.perf_counter() - t0)
    return loaded


def make_ngram_proposer(config: EngineConfig):
    """The n-gram proposer (host) of speculative_config.method == "ngram", else None."""
    spec = config.speculative_config
    if spec is None or spec.method != "ngram":
        return None
    from jaxserve.spec_decode.ngram_proposer import NgramProposer

    return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max,
                         config.scheduler_config.max_model_len)


def load_draft_model(runner, *, progress: bool):
    """The draft-model proposer (device) of speculative_config.method == "draft_model",
    loaded onto ``runner``'s mesh after its target; else None."""
    spec = runner.config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    from jaxserve.spec_decode.draft_model import DraftModelProposer

    t0 = time.perf_counter()
    draft = DraftModelProposer(runner, spec.model, spec.num_speculative_tokens, progress=progress)
    logger.info("Loaded the draft model %s (%s) in %.1f s", spec.model, draft.arch.architecture,
                time.perf_counter() - t0)
    return draft


def kv_cache_blocks(config: EngineConfig, arch: ModelArchConfig, mesh: Mesh, kv_dtype, layout: KVCacheLayout,
                    draft_arch: ModelArchConfig | None = None) -> int:
    """KV cache blocks per data-parallel rank (each rank's scheduler hands out ids in
    [0, num_blocks)): what the engine's memory settings leave room for on one device
    (runner/kv_cache.py's determine_num_blocks)."""
    sc, cc, pc = config.scheduler_config, config.cache_config, config.parallel_config
    return determine_num_blocks(
        arch, block_size=cc.block_size, dtype=kv_dtype, max_model_len=sc.max_model_len,
        gpu_memory_utilization=cc.gpu_memory_utilization, kv_cache_memory=cc.kv_cache_memory,
        num_gpu_blocks_override=cc.num_gpu_blocks_override, device=local_device(mesh),
        tensor_parallel_size=pc.tensor_parallel_size, num_devices=mesh.size, draft=draft_arch,
        layout=layout, max_num_batched_tokens=sc.max_num_batched_tokens,
    )
