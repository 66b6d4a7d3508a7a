"""What a model file declares (see models/README.md), and the helpers that read it.

A model class serves the HF ``architectures`` it lists, reads its own config.json
fields (``from_hf_config``), names its checkpoint tensors (``weight_map``) and
partitions its params: each ``Weight`` carries a partitioning over the mesh axes
('data', 'model'), which ``make_param`` puts on the ``nnx.Param`` as its
``out_sharding`` metadata. The checkpoint readers (models/weights.py,
models/checkpoint.py) and the tensor-parallel layout (models/sharding.py) read these
declarations and know nothing about any one architecture.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelArchConfig

MODEL = "model"  # the mesh axis tensor parallelism shards over


@dataclass(frozen=True)
class Weight:
    """One parameter as the checkpoint stores it and as we shard it."""

    # Checkpoint tensor name. "{i}" is the layer index (layers stacked on a new axis 0),
    # "{e}" the expert index (experts stacked on the next axis): one param gathers many
    # checkpoint tensors.
    hf_name: str
    dims: tuple[str, ...]  # ModelArchConfig field giving each axis's size; "a*b" is a product
    sharding: tuple[str | None, ...] | None = None  # mesh axis per axis; None: replicated
    transpose: bool = False  # HF Linear weights are [out, in]; ours are [in, out]
    # A slice of a fused checkpoint tensor (Phi-3's qkv_proj, gate_up_proj): the stored
    # tensor's output axis (the first with ``transpose``, else the last, after any
    # stacked axes) has ``fused_rows`` entries and our output index j is its entry
    # row_offset + j * fused_stride: a block (stride 1) or every stride-th entry
    # (GPT-OSS's interleaved gate / up columns). Offsets and sizes are dims
    # expressions on the checkpoint's (tp = 1) arch; None: the whole tensor.
    row_offset: str | None = None
    fused_rows: str | None = None
    fused_stride: int = 1
    # The checkpoint layer of stacked index 0 (a dims expression): DeepSeek's MoE layers
    # are stacked from layer first_k_dense_replace on. None: 0.
    layer_offset: str | None = None

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf_name

    @property
    def stacked(self) -> tuple[str, ...]:
        """The placeholders stacked on the leading axes, in axis order ("i", then "e")."""
        return tuple(k for k in ("i", "e") if "{" + k + "}" in self.hf_name)

    def tensor_name(self, config: ModelArchConfig, idx: tuple[int, ...]) -> str:
        """The checkpoint name of the tensor at ``idx`` on the stacked axes."""
        names = dict(zip(self.stacked, idx))
        if self.layer_offset is not None and "i" in names:
            names["i"] += dim_size(config, self.layer_offset)
        return self.hf_name.format(**names)

    def tensor_names(self, config: ModelArchConfig) -> list[tuple[tuple[int, ...], str]]:
        """(index on the stacked axes, checkpoint name) of every tensor this param reads."""
        sizes = self.shape(config)[:len(self.stacked)]
        return [(idx, self.tensor_name(config, idx)) for idx in itertools.product(*(range(n) for n in sizes))]

    @property
    def partition(self) -> tuple[str | None, ...]:
        return self.sharding if self.sharding is not None else (None,) * len(self.dims)

    def shape(self, config: ModelArchConfig) -> tuple[int, ...]:
        return tuple(dim_size(config, d) for d in self.dims)


def dim_size(config: ModelArchConfig, dim: str) -> int:
    """The size ``dim`` names: ModelArchConfig fields and integers, products ("a*b") and
    sums of them ("a*b+2*c*b", a fused tensor's rows), optionally divided by an integer
    ("hidden_size//128": int4 scale groups)."""
    dim, _, divisor = dim.partition("//")
    size = sum(math.prod(int(f) if f.isdigit() else getattr(config, f) for f in term.split("*"))
               for term in dim.split("+"))
    return size // int(divisor) if divisor else size


def make_param(name: str, value, weight: Weight, config: ModelArchConfig, dtype) -> nnx.Param:
    """The param with its partitioning as metadata. ``value`` is normally the array the
    loader already placed on the mesh (models/loader.py), kept as it is when it has
    ``dtype`` (None: its own dtype); a numpy array is converted. Never sharded eagerly: placement is the
    loader's."""
    shape = weight.shape(config)
    assert tuple(value.shape) == shape, f"{name}: expected {shape}, got {value.shape}"
    if dtype is None:  # int8 weights and their float32 scales keep their own dtype
        dtype = value.dtype
    if not (isinstance(value, jax.Array) and value.dtype == dtype):
        value = jnp.asarray(value, dtype)
    return nnx.Param(value, out_sharding=weight.partition, eager_sharding=False)


class CausalLM(nnx.Module):
    """The declarations every model class makes (the decoder itself is the subclass's)."""

    architectures: ClassVar[tuple[str, ...]] = ()  # HF ``architectures`` names served

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArchConfig:
        """config.json -> ModelArchConfig (ValueError for what the model does not support)."""
        raise NotImplementedError

    @classmethod
    def weight_map(cls, config: ModelArchConfig) -> dict[str, Weight]:
        """Our param name -> how the checkpoint stores it and how it is sharded."""
        raise NotImplementedError

    @classmethod
    def ignored_hf_tensors(cls, config: ModelArchConfig) -> tuple[str, ...]:
        """Regexes of checkpoint tensors that may be left unread (any other unread tensor
        is an error: the checkpoint does math the model would skip)."""
        return (r".*rotary_emb\.inv_freq",)  # saved rotary buffers
