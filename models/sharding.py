"""The tensor-parallel layout (docs/design.md §5): which tp sizes a model supports, the
effective architecture a model is built with at a given tp, and how each axis of a
served param maps back onto the checkpoint's (tp=1) axis.

At tp devices the vocabulary is padded to a multiple of tp (zero rows), and when tp is
larger than the KV heads each KV head is replicated tp / K times, so every device holds
whole query heads and whole KV heads of its own (vLLM does the same).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from models.base import MODEL, dim_size
from models.config import ModelArchConfig
from models.registry import get_model_class

PADDED_VOCAB = "padded_vocab_size"  # the dim of the embedding / lm_head rows
KV_HEADS = "num_key_value_heads"  # a factor of every dim that counts KV heads


def checkpoint_arch(arch: ModelArchConfig) -> ModelArchConfig:
    """The architecture as the checkpoint stores it (tp=1: no padding, no replicas)."""
    return dataclasses.replace(arch, padded_vocab_size=arch.vocab_size, kv_head_replicas=1,
                               num_key_value_heads=arch.num_key_value_heads // arch.kv_head_replicas)


def _tensor_parallel_problem(arch: ModelArchConfig, tp: int, model_cls) -> str | None:
    """Why ``tp`` does not fit the (checkpoint) architecture, or None when it does."""
    n, k = arch.num_attention_heads, arch.num_key_value_heads
    if n % tp:
        return f"does not divide num_attention_heads={n}"
    if tp <= k and k % tp:
        return f"does not divide num_key_value_heads={k}"
    if tp > k and tp % k:
        return f"is not a multiple of num_key_value_heads={k} (KV heads are replicated only whole)"
    for w in model_cls.weight_map(arch).values():
        for dim, axis in zip(w.dims, w.partition):
            # The vocabulary gets padded and KV heads replicated; every other split must divide.
            if axis != MODEL or dim == PADDED_VOCAB or KV_HEADS in dim.split("*"):
                continue
            if dim_size(arch, dim) % tp:
                return f"does not divide {dim}={dim_size(arch, dim)}"
    return None


def valid_tensor_parallel_sizes(arch: ModelArchConfig, model_cls=None) -> list[int]:
    """Every tp the model supports (each divides num_attention_heads)."""
    model_cls = model_cls or get_model_class(arch.architecture)
    arch = checkpoint_arch(arch)
    return [tp for tp in range(1, arch.num_attention_heads + 1) if _tensor_parallel_problem(arch, tp, model_cls) is None]


def arch_for_tensor_parallel(arch: ModelArchConfig, tp: int, model_cls=None, *,
                             expert_parallel: bool | None = None) -> ModelArchConfig:
    """The architecture the model is built with on ``tp`` devices: padded_vocab_size a
    multiple of tp; num_key_value_heads = K * r with r = kv_head_replicas = tp / K when
    tp > K (query head n then reads new KV head n // (N / (K r)), which is old head
    n // (N / K): GQA groups are unchanged). ValueError naming the config field and the
    valid sizes when tp does not fit. ``expert_parallel`` (None: as ``arch`` says): MoE
    experts whole per device, so tp must divide num_experts instead of their mlp dim."""
    model_cls = model_cls or get_model_class(arch.architecture)
    arch = checkpoint_arch(arch)
    if expert_parallel is not None:
        if expert_parallel and not arch.num_experts:
            raise ValueError(f"enable_expert_parallel needs a mixture-of-experts model; {arch.architecture} "
                             "has no experts")
        arch = dataclasses.replace(arch, expert_parallel=expert_parallel)
    problem = "must be at least 1" if tp < 1 else _tensor_parallel_problem(arch, tp, model_cls)
    if problem:
        valid = ", ".join(map(str, valid_tensor_parallel_sizes(arch, model_cls)))
        layout = " with enable_expert_parallel" if arch.expert_parallel else ""
        raise ValueError(f"tensor_parallel_size={tp} {problem}; valid sizes for this model{layout}: {valid}")
    for w in model_cls.weight_map(arch).values():  # padding is defined for a whole axis only
        assert all(d == PADDED_VOCAB or PADDED_VOCAB not in d for d in w.dims), w
    k = arch.num_key_value_heads
    replicas = tp // k if tp > k else 1
    vision = arch.vision
    if vision is not None and tp > 1 and not vision.num_heads % tp and not vision.intermediate_size % tp:
        # A vision tower's heads and MLP columns split too (Megatron-style; else replicated).
        vision = dataclasses.replace(vision, tensor_parallel=True)
    return dataclasses.replace(arch, padded_vocab_size=-(-arch.vocab_size // tp) * tp,
                               num_key_value_heads=k * replicas, kv_head_replicas=replicas, vision=vision)


def source_indices(dim: str, arch: ModelArchConfig, start: int, stop: int) -> np.ndarray:
    """For indices [start, stop) of an axis of size ``dim`` in the effective ``arch``: the
    index on the checkpoint's axis, or -1 where the served param is zero padding.
    The padded vocabulary's extra rows are padding; on a dim with a num_key_value_heads
    factor, new KV head j is checkpoint head j // kv_head_replicas (the factors after it,
    e.g. head_dim, are the block that moves with the head). Returns int64 [stop - start]."""
    j = np.arange(start, stop, dtype=np.int64)
    if dim == PADDED_VOCAB:
        return np.where(j < arch.vocab_size, j, -1)
    factors = dim.split("*")
    r = arch.kv_head_replicas
    if r == 1 or KV_HEADS not in factors:
        return j
    at = factors.index(KV_HEADS)
    inner = math.prod(getattr(arch, f) for f in factors[at + 1:])
    new_heads = arch.num_key_value_heads
    outer, rest = np.divmod(j, new_heads * inner)
    head, within = np.divmod(rest, inner)
    return (outer * (new_heads // r) + head // r) * inner + within


def place_variables(state: nnx.State, mesh: Mesh) -> nnx.State:
    """The variables that are not params (rope inv_freq: computed by the model, not
    read from the checkpoint) go on the mesh by their partition spec, replicated when they carry none, with
    their own dtype. Built from host values with make_array_from_callback, so it works
    in every process of a multi-controller run."""
    specs = nnx.get_partition_spec(state)

    def place(var: nnx.Variable, spec: nnx.Variable) -> nnx.Variable:
        if isinstance(var, nnx.Param):  # read from the checkpoint straight into its sharding
            return var
        host = np.asarray(var.get_value())
        sharding = NamedSharding(mesh, spec.get_value())
        return var.replace(jax.make_array_from_callback(host.shape, sharding, lambda index: host[index]))

    return jax.tree.map(place, state, specs, is_leaf=lambda x: isinstance(x, nnx.Variable))
