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
from models.base import MODEL, dim_size
from models.checkpoint import is_orbax_checkpoint, restore_orbax
from models.config import ModelArchConfig
from models.quantization import (GIDX, KEPT_METHODS, KV_SCALE_TENSORS, SCALE, ZERO, check_quantization,
                                 checkpoint_transform, matmul_weight_names, quantized_names,
                                 quantizer, read_checkpoint_quantization, read_kv_cache_scales)
from models.registry import get_model_class
from models.rope import longrope_settings
from models.sharding import arch_for_tensor_parallel, checkpoint_arch, place_variables
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
    packed = packed_formats.packed_method(hf_cfg.get("quantization_config"))
    keep = _keeps_packed(packed, quantization, jax.default_backend())
    if not keep:
        packed_formats.check_platform(packed, jax.default_backend())
    stored = read_checkpoint_quantization(hf_cfg)
    if keep:
        arch, params = _read_kept(model_path, arch, model_cls, packed, mesh=mesh, dtype=dtype, progress=progress,
                                  param_dtype=param_dtype)
    elif stored is not None:
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


def _keeps_packed(packed: str | None, quantization: str | None, platform: str) -> bool:
    """Whether a packed checkpoint (AWQ, GPTQ, pack-quantized, fp8 blocks, MXFP4) is
    served with its weights kept as stored (models/quantization.py: dequantized inside
    each product): always on TPU / GPU, on CPU when ``quantization`` names its format
    (vLLM's --quantization awq / gptq / compressed-tensors / fp8 / mxfp4); otherwise the
    CPU decodes it to floats at load (as fast there, measured by
    benchmarks/bench_quantization.py, with no dequantization per step). ValueError for a
    format name that is not the checkpoint's. (fp8 on a plain checkpoint is quantization
    at load, per channel.)"""
    own = packed_formats.KEPT_QUANTIZATION.get(packed)  # the name of the checkpoint's format
    if quantization is not None and quantization == own:
        return True
    if quantization in KEPT_METHODS:
        raise ValueError(f"quantization={quantization!r} names a packed checkpoint format, but the checkpoint is "
                         f"{own or 'not packed'}")
    return packed is not None and quantization is None and platform != "cpu"


def _read_kept(model_path, arch, model_cls, packed: str, *, mesh, dtype, progress, param_dtype=None):
    """(arch, params) of a packed checkpoint served as stored: each projection the
    checkpoint packs is read as its codes (int4 / e2m1: uint4, uint8 on CPU; fp8: float8
    e4m3), float32 group scales, int4's zeros and, under act-order, each input row's group
    (``quantization.group_scaled_weights``); the rest as floats."""
    ckpt = SafetensorsCheckpoint(model_path)
    group, act_order = ckpt.group_layout()
    ckpt.add_code_views(act_order)
    kind = packed_formats.KEPT_KIND[packed]
    arch = dataclasses.replace(arch, quantization=kind, group_size=group, act_order=act_order)
    stored = checkpoint_arch(arch)
    wm, stored_wm = model_cls.weight_map(arch), model_cls.weight_map(stored)
    kept = lambda n: all(t + "#codes" in ckpt.tensors for _, t in stored_wm[n].tensor_names(stored))
    # Every projection int8 would take, MoE experts included (models/moe.py expert_stacks).
    names = tuple(n for n in quantized_names(wm) if kept(n))
    for n in names:
        d_in, p_in = wm[n].dims[-2], wm[n].partition[-2]
        local = dim_size(arch, d_in) // (mesh.shape[p_in] if p_in else 1)
        if group and not act_order and local % group:
            raise ValueError(f"{model_path}: {n}'s {local} input rows per device are not whole groups of {group}; "
                             "use a tensor-parallel size that splits them into whole groups")
    arch = dataclasses.replace(arch, grouped_params=names)
    logger.info("%s: %d projections kept as %s (groups of %s%s)", model_path, len(names), kind,
                group or "all rows", ", act-order" if act_order else "")
    dtypes = _narrow_dtypes(wm, dtype, param_dtype, quantized=True)
    codes = jnp.float8_e4m3fn if kind == "fp8-block" else jnp.uint8
    for n in names:
        dtypes |= {n: codes, n + SCALE: jnp.float32, n + ZERO: jnp.float32, n + GIDX: jnp.int32}
    # 4-bit codes are read as uint8 and narrowed to uint4 on TPU / GPU, on the devices: a
    # uint4 array made from host buffers has one code per byte, not the packed layout the
    # compiled step expects. On CPU they stay uint8: XLA:CPU's runtime keeps even a jit's
    # uint4 output one code per byte while its ahead-of-time compiled step asks for packed
    # codes (a layout mismatch at the first call), and the CPU gains nothing from packing.
    to_uint4 = {}

    def narrow(name, value):
        if name not in names:
            return {name: value}
        if value.sharding not in to_uint4:
            to_uint4[value.sharding] = jax.jit(lambda a: a.astype(jnp.uint4), out_shardings=value.sharding)
        return {name: to_uint4[value.sharding](value)}

    params = stream_safetensors(model_path, arch, model_cls, mesh, dtype, progress=progress, param_dtypes=dtypes,
                                extra_ignored=(KV_SCALE_TENSORS,), ckpt=ckpt,
                                transform=narrow if codes == jnp.uint8 and jax.default_backend() != "cpu" else None)
    return arch, params


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
