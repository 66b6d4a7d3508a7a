"""New values for some or all of a loaded model's params, read from HF-named tensors:
the reading half of ``update_weights`` (the research loop; the other half, putting
them into the served state, is jaxserve/runner/weight_update.py).

The tensors come from a mapping of HF checkpoint names to arrays (``ArrayCheckpoint``)
or from a safetensors folder (models/weights.py's SafetensorsCheckpoint); both are read
by the loader's own shard readers (``read_param``), so an updated param is cast,
transposed, padded and sharded exactly as loading it would have been.

``plan_update`` checks every name and shape before anything is read and says which
params the tensors cover: a param whole, or, for a stacked per-layer param, some of its
layers (every tensor of each layer it names: all of a MoE layer's experts).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from models.config import ModelArchConfig
from models.sharding import checkpoint_arch
from models.weights import checkpoint_tensors, ignored_tensors, read_param


@dataclass(frozen=True)
class _Shape:
    shape: tuple[int, ...]


class ArrayCheckpoint:
    """A mapping of HF checkpoint names to arrays, read as a checkpoint folder is.

    Values: numpy arrays or ``jax.Array`` of any float dtype (a jax.Array is brought to
    the host once here: this path reads tensors as a checkpoint, in HF's layout; a
    trainer that holds the engine's own param pytree hands that over instead, with no
    copy: jaxserve/runner/weight_update.py)."""

    def __init__(self, arrays: Mapping) -> None:
        if not isinstance(arrays, Mapping):
            raise TypeError(f"weights: a mapping of checkpoint names to arrays, got {type(arrays).__name__}")
        self.model_dir = "the weights given"
        self.arrays: dict[str, np.ndarray] = {}
        self.tensors: dict[str, _Shape] = {}
        for name, value in arrays.items():
            if not isinstance(name, str):
                raise TypeError(f"weights: names must be str (HF checkpoint names), got {name!r}")
            dtype = getattr(value, "dtype", None)
            if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
                raise ValueError(f"weights[{name!r}]: dtype {dtype} is not a float dtype (float32, bfloat16, "
                                 f"float16, ...)")
            if isinstance(value, jax.Array) and not value.is_fully_addressable:
                raise ValueError(f"weights[{name!r}]: a jax.Array spread over other processes; pass the engine's "
                                 f"param pytree (LLM.get_params() structure) or a folder instead")
            self.arrays[name] = np.asarray(value)
            self.tensors[name] = _Shape(tuple(self.arrays[name].shape))

    def dtype(self, name: str) -> np.dtype:
        return self.arrays[name].dtype

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return self.arrays[name][index]


@dataclass(frozen=True)
class ParamUpdate:
    """One param an update covers: whole (``layers`` None), or these layers of a
    stacked per-layer param (ascending)."""

    name: str
    layers: tuple[int, ...] | None = None


def plan_update(ckpt, arch: ModelArchConfig, model_cls, extra_ignored: tuple[str, ...] = ()) -> list[ParamUpdate]:
    """The params ``ckpt``'s tensors cover (``arch``: the served, effective architecture).
    ValueError naming the tensor for: a name the model does not have (the model's
    harmless extras, e.g. a tied lm_head copy or saved rotary buffers, are skipped), a
    shape other than the checkpoint's, or some but not all tensors of one layer of a
    param. Reads no data."""
    stored = checkpoint_arch(arch)
    ignored = ignored_tensors(arch, model_cls, extra_ignored)
    expected = checkpoint_tensors(arch, model_cls)
    weight_map = model_cls.weight_map(stored)
    given: dict[str, set[tuple[int, ...]]] = {}
    unknown = []
    for hf_name, info in ckpt.tensors.items():
        if hf_name not in expected:
            if not ignored.fullmatch(hf_name):
                unknown.append(hf_name)
            continue
        for name, idx, want in expected[hf_name]:  # a fused tensor feeds several params
            if tuple(info.shape) != want:
                raise ValueError(f"update_weights: {hf_name!r} has shape {tuple(info.shape)}; this model's is {want}")
            given.setdefault(name, set()).add(idx)
    if unknown:
        example = next(iter(expected))
        raise ValueError(f"update_weights: {unknown[0]!r} is not a parameter of this {arch.architecture} model "
                         f"({len(unknown)} unknown name(s); the names are the HF checkpoint's, e.g. {example!r})")
    plan = []
    for name, idxs in given.items():
        w = weight_map[name]
        every = [idx for idx, _ in w.tensor_names(stored)]
        if len(idxs) == len(every):
            plan.append(ParamUpdate(name))
            continue
        layers = tuple(sorted({idx[0] for idx in idxs}))
        missing = [idx for idx in every if idx[0] in layers and idx not in idxs]
        if missing:
            raise ValueError(f"update_weights: {w.tensor_name(stored, missing[0])!r} is missing: "
                             f"a partial update gives every tensor of each layer it changes")
        plan.append(ParamUpdate(name, layers))
    return plan


def read_update(ckpt, plan: list[ParamUpdate], arch: ModelArchConfig, model_cls, mesh: Mesh,
                dtypes: Mapping[str, object]) -> dict[str, jax.Array]:
    """{param name: new value} for each ParamUpdate, read in ``dtypes[name]`` and placed
    as loading places it: [L, ...] whole, [len(layers), ...] for some layers."""
    weight_map = model_cls.weight_map(arch)
    return {u.name: read_param(ckpt, weight_map[u.name], arch, mesh, dtypes[u.name], u.layers) for u in plan}
