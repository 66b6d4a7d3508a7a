"""Placing a model's params on the mesh by the partitioning they carry (DESIGN §5),
and the tensor-parallel check derived from that partitioning."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from models.base import MODEL, dim_size
from models.config import ModelArchConfig
from models.registry import get_model_class


def check_tensor_parallel(arch: ModelArchConfig, tp: int, model_cls=None) -> None:
    """Every axis the model splits over 'model' must divide by tp, and so must the
    attention and KV heads (attention runs per device on its own heads). ValueError
    naming the config field."""
    model_cls = model_cls or get_model_class(arch.architecture)
    dims = {"num_attention_heads": arch.num_attention_heads, "num_key_value_heads": arch.num_key_value_heads}
    for w in model_cls.weight_map(arch).values():
        for dim, axis in zip(w.dims, w.partition):
            if axis == MODEL:
                dims.setdefault(dim, dim_size(arch, dim))
    for name, value in dims.items():
        if value % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide {name}={value}")


def shard_params(state: nnx.State, mesh: Mesh, dtype) -> nnx.State:
    """Each variable placed with the partition spec it carries (``nnx.get_partition_spec``;
    replicated when it carries none). Floating nnx.Params are cast to ``dtype``; other
    variables (rope inv_freq) keep theirs."""
    specs = nnx.get_partition_spec(state)

    def place(var: nnx.Variable, spec: nnx.Variable) -> nnx.Variable:
        x = var.get_value()
        if isinstance(var, nnx.Param) and jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(dtype)
        return var.replace(jax.device_put(x, NamedSharding(mesh, spec.get_value())))

    return jax.tree.map(place, state, specs, is_leaf=lambda x: isinstance(x, nnx.Variable))
