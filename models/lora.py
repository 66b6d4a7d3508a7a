"""LoRA on the decoder's projections: which params an adapter may target, and the
device buffers that hold ``max_loras`` adapters at once.

An adapter's update of a projection W [in, out] is ``scale * (x @ A^T) @ B^T`` (PEFT's
A [r, in], B [out, r]). All slots of one projection sit side by side in two buffers per
projection, stacked over the layers like the weights (models/llama.py):
``a`` [L, in, S*R] and ``b`` [L, S*R, out] (S = max_loras slots, R = max_lora_rank;
the scale folded into b, smaller ranks zero padded). A step multiplies every token by
all slots' A at once and zeroes the columns of the slots it does not use (a per-token
0/1 mask [T, S*R]: slot k owns columns [k*R, (k+1)*R)), then by B
(models/quantization.py ``linear``). That is a dense product of S*R columns, which
XLA:CPU runs as fast as a grouped one (ragged_dot lowers to a dense product per group
there, models/moe.py), needs no sort of the tokens, and keeps every shape fixed: loading
an adapter is a copy into its slot's columns, never a compile. A step with no adapter
token skips both products (``lax.cond``).

Tensor parallelism follows the base weight: a column-parallel projection (q/k/v/gate/
up: output split) keeps A whole and splits B by its output; a row-parallel one (o/down:
input split) splits A by its input rows and keeps B whole (the [T, S*R] partial products
are summed across devices, as vLLM's row-parallel LoRA does).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from models.base import MODEL, dim_size
from models.config import ModelArchConfig
from models.sharding import source_indices

# Our projection names that adapters may target (PEFT names the module: DeepSeek's
# kv_a_proj is its kv_a_proj_with_mqa). DeepSeek's MLA: q_a_proj, q_b_proj and kv_a_proj
# are plain products before the latent; kv_b_proj is absorbed into the queries and the
# output, and so are its adapters (models/deepseek.py KvBAdapter: the same buffers, a
# column-parallel projection split by heads). DeepSeek's dense first layers' MLP
# (dense_gate / dense_up / dense_down) is a stack of its own, not adapted.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj")
# Suffixes of the per-layer names in the weights dict a layer sees (``lw``).
LORA_A, LORA_B = "_lora_a", "_lora_b"
LORA_MASK, LORA_ON = "_lora_mask", "_lora_on"


@dataclasses.dataclass(frozen=True)
class LoRATarget:
    """One projection adapters may change."""

    name: str  # our param name, e.g. "q_proj"
    module: str  # its HF module path inside a layer, e.g. "self_attn.q_proj"
    in_dim: str  # ModelArchConfig dims (models/base.py Weight.dims)
    out_dim: str
    row_parallel: bool  # split by input rows under tp (o_proj, down_proj)
    # A block of a fused module (Phi-3's qkv_proj, gate_up_proj): the adapter's B has
    # ``fused_rows`` rows and this projection's are [row_offset, row_offset + out) (dims
    # expressions, models/base.py Weight); A is the module's, shared by its blocks.
    fused_rows: str | None = None
    row_offset: str | None = None
    # The base weight is whole on every device (DeepSeek's q_a_proj, kv_a_proj): so are A and B.
    replicated: bool = False

    def shapes(self, arch: ModelArchConfig, slots: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(a, b) buffer shapes: [L, in, slots*rank], [L, slots*rank, out]."""
        layers, d_in, d_out = arch.num_hidden_layers, dim_size(arch, self.in_dim), dim_size(arch, self.out_dim)
        return (layers, d_in, slots * rank), (layers, slots * rank, d_out)

    def partitions(self) -> tuple[tuple, tuple]:
        """(a, b) partition specs over the ('data', 'model') mesh."""
        if self.replicated:
            return (None, None, None), (None, None, None)
        if self.row_parallel:
            return (None, MODEL, None), (None, None, None)
        return (None, None, None), (None, None, MODEL)

    def out_source(self, arch: ModelArchConfig) -> np.ndarray:
        """For each output column of the served projection, the checkpoint's column
        (KV heads replicated under tp repeat theirs; models/sharding.py)."""
        return source_indices(self.out_dim, arch, 0, dim_size(arch, self.out_dim))


def lora_targets(model_cls, arch: ModelArchConfig) -> dict[str, LoRATarget]:
    """The projections of ``model_cls`` adapters may target, by name. MoE experts (the
    [L, E, ...] params) and the embeddings are not among them."""
    out = {}
    for name, w in model_cls.weight_map(arch).items():
        if (name in LORA_TARGETS and w.stacked == ("i",) and len(w.dims) == 3 and w.transpose
                and w.fused_stride == 1):
            module = w.hf_name.split("{i}.", 1)[1].removesuffix(".weight")
            out[name] = LoRATarget(name, module, w.dims[1], w.dims[2], w.partition[1] == MODEL,
                                   fused_rows=w.fused_rows, row_offset=w.row_offset,
                                   replicated=MODEL not in w.partition)
    return out


def lora_mask(slots, num_slots: int, rank: int, dtype):
    """slots [T] int32 (0: no adapter, k >= 1: slot k) -> [T, num_slots*rank] 0/1 in
    ``dtype``: token t keeps the columns of its own slot."""
    owner = jnp.arange(num_slots * rank, dtype=jnp.int32) // rank + 1
    return (owner[None, :] == slots[:, None]).astype(dtype)
