"""One call from a checkpoint folder to a model placed on the mesh."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from flax import nnx
from jax.sharding import Mesh

from models.base import MODEL
from models.checkpoint import is_orbax_checkpoint, restore_orbax
from models.config import ModelArchConfig
from models.quantization import check_quantization, quantizer
from models.registry import get_model_class
from models.sharding import arch_for_tensor_parallel, place_variables
from models.weights import stream_safetensors


def load_model(model_path: str | Path, *, mesh: Mesh, dtype, progress: bool = True, scan_layers: bool = True,
               expert_parallel: bool = False, quantization: str | None = None):
    """Returns (ModelArchConfig, graphdef, state). The arch is the EFFECTIVE one for the
    mesh's tensor-parallel size (models/sharding.py: padded vocabulary, replicated KV
    heads; ``vocab_size`` stays the real vocabulary). Params come in ``dtype``, each
    read from the safetensors files (or restored from an orbax folder) straight into
    the sharding its model file declares: no host copy of the whole model is made.
    ``expert_parallel``: MoE experts whole per 'model' device (ValueError for a dense model).
    ``quantization``: "int8" stores the projections as int8 with per-channel scales
    (models/quantization.py), quantized on the devices as each param arrives."""
    check_quantization(quantization)
    arch = ModelArchConfig.from_pretrained(model_path)
    model_cls = get_model_class(arch.architecture)
    arch = arch_for_tensor_parallel(arch, mesh.shape[MODEL], model_cls, expert_parallel=expert_parallel)
    arch = dataclasses.replace(arch, quantization=quantization)
    transform = quantizer(model_cls.weight_map(arch), mesh) if quantization else None
    if is_orbax_checkpoint(model_path):
        params = restore_orbax(model_path, arch, model_cls, mesh, dtype)
        if transform is not None:
            for name in list(params):
                params.update(transform(name, params.pop(name)))
    else:
        params = stream_safetensors(model_path, arch, model_cls, mesh, dtype, progress=progress, transform=transform)
    # The module is built around the placed arrays (make_param keeps them as they are):
    # its graph costs no memory, and only the computed variables (rope) are placed here.
    model = model_cls(arch, params, dtype=dtype, scan_layers=scan_layers, mesh=mesh)
    del params
    graphdef, state = nnx.split(model)
    return arch, graphdef, place_variables(state, mesh)
