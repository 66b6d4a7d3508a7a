"""Per-token logprobs of whole sequences with the engine's own model code and params,
in one forward over each sequence: what a trainer computes for the tokens it was given
(docs/batch_invariance.md, "Trainer agreement").

No scheduler, no block manager, no shared page pool: a sequence's K/V go into a buffer
of its own, position p at slot p (with KV cache groups, group g's pages after group
g - 1's), and the step's attention kernel reads it as consecutive pages. That keeps the
kernel, so with ``batch_invariant`` every number is the one the engine computed for the
same row while it sampled (the products and the row-wise reductions are per-row
invariant, the kernel's scores have one order): the logprobs are bitwise those the
engine returned. Without it they agree up to rounding (and bf16's near-ties).

The returned function is ``fn(state, token_ids [T] int32) -> logprobs [T - 1] float32``
(jitted; one compile per length T): logprob of token i + 1 given tokens 0..i, from the
raw logits, as the engine's logprobs are. ``state`` is the runner's parameter pytree
(``ModelRunner.state``) or one of the same structure and shardings, e.g. a trainer's.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.runner.kv_cache import kv_cache_shape
from jaxserve.runner.programs import traced_products
from jaxserve.sample.sampler import compute_logprobs
from models.config import attention_settings
from pallas_kernels.attention_metadata import AttentionMetadata
from pallas_kernels.backend import build_attention


def make_sequence_logprobs(runner) -> Callable:
    """``fn(state, token_ids [T]) -> [T - 1]`` for ``runner``'s model (see the module
    docstring). One device's program: a tensor-parallel engine's sharded weights are
    refused (ValueError); data-parallel ranks hold the whole model and are fine."""
    if runner.mesh.shape["model"] > 1:
        raise ValueError("sequence logprobs run the model on one device: tensor_parallel_size must be 1")
    arch, layout, block = runner.arch, runner.kv_cache_layout, runner.block_size
    groups, pmax = layout.num_groups, runner.max_blocks_per_req
    attention = build_attention(runner.attention_spec, None, **attention_settings(arch),
                                layer_group=layout.layer_group, layer_slot=layout.layer_slot)
    batch_invariant = runner.config.model_config.batch_invariant
    graphdef, storage_dtype = runner.graphdef, runner.kv_storage_dtype

    def forward(state, token_ids):
        t = token_ids.shape[0]
        pages = -(-t // block)
        positions = jnp.arange(t, dtype=jnp.int32)
        # Group g's pages are g * pages ... (g + 1) * pages - 1, in order.
        first = jnp.arange(groups, dtype=jnp.int32) * pages
        tables = first[:, None] + jnp.arange(pmax, dtype=jnp.int32)[None, :]
        tables = jnp.where(jnp.arange(pmax)[None, :] < pages, tables, 0)
        md = AttentionMetadata(slot_mapping=positions[:, None] + first[None, :] * block,
                               seq_lens=jnp.array([t], jnp.int32), query_start_loc=jnp.array([0, t], jnp.int32),
                               block_tables=tables[None], num_seqs=jnp.array([1], jnp.int32))
        kv_cache = jnp.zeros(kv_cache_shape(arch, groups * pages, block, layout.slots_per_block), storage_dtype)
        model = nnx.merge(graphdef, state)
        hidden, _ = model(token_ids, positions, kv_cache, md, attention)
        logits = model.compute_logits(hidden)
        targets = jnp.concatenate([token_ids[1:], token_ids[:1]])
        _, logprobs, _ = compute_logprobs(logits, targets, 0)
        return logprobs[:-1, 0]

    # The products of a one-device program (the engine's step decides them the same way).
    return jax.jit(traced_products(None, batch_invariant)(forward))
