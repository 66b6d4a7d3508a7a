"""One call from a checkpoint folder to a model placed on the mesh."""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp

from flax import nnx
from jax.sharding import Mesh

from models import packed_formats
from models.base import MODEL
from models.checkpoint import is_orbax_checkpoint, restore_orbax
from models.config import ModelArchConfig
from models.quantization import (KV_SCALE_TENSORS, check_quantization, checkpoint_transform, matmul_weight_names,
                                 quantized_names, quantizer, read_checkpoint_quantization, read_kv_cache_scales)
from models.registry import get_model_class
from models.rope import longrope_settings
from models.sharding import arch_for_tensor_parallel, place_variables
from models.weights import SafetensorsCheckpoint, stream_safetensors

logger = logging.getLogger("jaxserve")


def load_model(model_path: str | Path, *, mesh: Mesh, dtype, progress: bool = True, scan_layers: bool = True,
               expert_parallel: bool = False, quantization: str | None = None, param_dtype=None,
               hf_overrides: dict | None = None, max_model_len: int | None = None):
    """Returns (ModelArchConfig, graphdef, state). The arch is the EFFECTIVE one for the
    mesh's tensor-parallel size (models/sharding.py: padded vocabulary, replicated KV
    heads; ``vocab_size`` stays the real vocabulary). Params come in ``dtype``, each
    read from the safetensors files (or restored from an orbax folder) straight into
    the sharding its model file declares: no host copy of the whole model is made.
    ``expert_parallel``: MoE experts whole per 'model' device (ValueError for a dense model).
    ``quantization``: "int8" stores the projections as int8 with per-channel scales
    (models/quantization.py), quantized on the devices as each param arrives.
    ``param_dtype``: the matmul weights' dtype when not ``dtype`` (bf16 weights under
    float32 activations; ``models.quantization.matmul``), read from the checkpoint in it.
    ``hf_overrides``: applied on top of config.json (vLLM's ``--hf-overrides``).
    ``max_model_len``: the engine's (LongRoPE picks its factors by it; None: the model's
    max_position_embeddings)."""
    check_quantization(quantization)
    arch = ModelArchConfig.from_pretrained(model_path, hf_overrides)
    arch = dataclasses.replace(arch, rope_scaling=longrope_settings(
        arch.rope_scaling, max_model_len or arch.max_position_embeddings))
    model_cls = get_model_class(arch.architecture)
    arch = arch_for_tensor_parallel(arch, mesh.shape[MODEL], model_cls, expert_parallel=expert_parallel)
    hf_cfg = json.loads((Path(model_path) / "config.json").read_text())
    packed_formats.check_platform(packed_formats.packed_method(hf_cfg.get("quantization_config")),
                                  jax.default_backend())
    stored = read_checkpoint_quantization(hf_cfg)
    if stored is not None:
        arch, params = _read_prequantized(model_path, arch, model_cls, stored, quantization, mesh=mesh, dtype=dtype,
                                          progress=progress, param_dtype=param_dtype)
    else:
        arch, params = _read_params(model_path, arch, model_cls, quantization, mesh=mesh, dtype=dtype,
                                    progress=progress, param_dtype=param_dtype)
    if not is_orbax_checkpoint(model_path):
        arch = dataclasses.replace(arch, kv_cache_scales=read_kv_cache_scales(SafetensorsCheckpoint(model_path)))
    # The module is built around the placed arrays (make_param keeps them as they are):
    # its graph costs no memory, and only the computed variables (rope) are placed here.
    model = model_cls(arch, params, dtype=dtype, param_dtype=param_dtype, scan_layers=scan_layers, mesh=mesh)
    del params
    graphdef, state = nnx.split(model)
    return arch, graphdef, place_variables(state, mesh)


def _narrow_dtypes(weight_map, dtype, param_dtype, quantized: bool) -> dict:
    """The params read in ``param_dtype`` instead of ``dtype`` (see load_model); none when
    quantizing (the quantizer reads them in ``dtype``) except the embedding and lm_head."""
    if param_dtype is None or jnp.dtype(param_dtype) == jnp.dtype(dtype):
        return {}
    names = set(matmul_weight_names(weight_map))
    if quantized:
        names -= set(quantized_names(weight_map))
    return dict.fromkeys(names, param_dtype)


def _read_params(model_path, arch, model_cls, quantization, *, mesh, dtype, progress, param_dtype=None):
    """(arch, params) of a plain checkpoint (safetensors or orbax), quantized at load when asked."""
    arch = dataclasses.replace(arch, quantization=quantization)
    transform = quantizer(model_cls.weight_map(arch), mesh, quantization) if quantization else None
    if is_orbax_checkpoint(model_path):
        # Restored in dtype; the model converts the matmul weights to param_dtype.
        params = restore_orbax(model_path, arch, model_cls, mesh, dtype)
        if transform is not None:
            for name in list(params):
                params.update(transform(name, params.pop(name)))
    else:
        params = stream_safetensors(model_path, arch, model_cls, mesh, dtype, progress=progress, transform=transform,
                                    extra_ignored=(KV_SCALE_TENSORS,),
                                    param_dtypes=_narrow_dtypes(model_cls.weight_map(arch), dtype, param_dtype,
                                                                bool(quantization)))
    return arch, params


def _read_prequantized(model_path, arch, model_cls, stored, quantization, *, mesh, dtype, progress,
                       param_dtype=None):
    """(arch, params) of a compressed-tensors checkpoint: int8 weights stay int8 (weight-only, their scales
    applied after each product); fp8 weights stay fp8 on GPU / TPU and are dequantized
    into ``dtype`` on CPU (XLA:CPU has no fp8 arithmetic to gain from), with a warning.
    Activation scales (W8A8's input_scale) are not used: activations stay in ``dtype``."""
    if quantization not in (None, stored.method):
        raise ValueError(f"quantization={quantization!r}: the checkpoint is already quantized "
                         f"(compressed-tensors {stored.method}); leave quantization unset")
    if is_orbax_checkpoint(model_path):
        raise ValueError("an orbax folder of a pre-quantized checkpoint is not supported; serve the safetensors")
    keep = stored.method == "int8" or jax.default_backend() != "cpu"
    if not keep:
        logger.warning("%s: fp8 weights are dequantized to %s at load on CPU", model_path, jnp.dtype(dtype).name)
    arch = dataclasses.replace(arch, quantization=stored.method if keep else None)
    wm = model_cls.weight_map(arch)
    ckpt = SafetensorsCheckpoint(model_path)
    transform, dtypes = checkpoint_transform(ckpt, wm, arch, mesh, dtype)
    dtypes = _narrow_dtypes(wm, dtype, param_dtype, keep) | dtypes
    params = stream_safetensors(model_path, arch, model_cls, mesh, dtype, progress=progress, transform=transform,
                                param_dtypes=dtypes, extra_ignored=(r".*\.weight_scale", r".*\.input_scale", KV_SCALE_TENSORS))
    return arch, params
