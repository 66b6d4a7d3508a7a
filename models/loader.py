"""One call from a checkpoint folder to a model placed on the mesh."""
from __future__ import annotations

import contextlib
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from models.base import MODEL
from models.config import ModelArchConfig
from models.registry import get_model_class
from models.sharding import check_tensor_parallel, shard_params
from models.weights import load_hf_weights


def load_model(model_path: str | Path, *, mesh: Mesh, dtype, progress: bool = True, scan_layers: bool = True):
    """Returns (ModelArchConfig, graphdef, state): params in ``dtype``, each placed on
    ``mesh`` with the sharding its model file declares."""
    arch = ModelArchConfig.from_pretrained(model_path)
    model_cls = get_model_class(arch.architecture)
    check_tensor_parallel(arch, mesh.shape[MODEL], model_cls)
    weights = load_hf_weights(model_path, arch, model_cls, progress=progress)
    # Built on the host in float32 (the params only carry their partitioning), then each
    # param is placed with its sharding: no full copy per device.
    on_host = jax.default_device(jax.devices("cpu")[0]) if jax.default_backend() != "cpu" else contextlib.nullcontext()
    with on_host:
        model = model_cls(arch, weights, dtype=jnp.float32, scan_layers=scan_layers)
    del weights
    graphdef, state = nnx.split(model)
    return arch, graphdef, shard_params(state, mesh, dtype)
