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

``trainable=True`` gives the trainer's version (the research loop, docs/research_loop.md):
``fn(params, token_ids)`` with ``params`` the engine's params alone (``get_params()``'s
structure, the rest of the state added inside), differentiable: a dense causal attention
over the one sequence (``causal_attention``; the paged kernels and the reference's
dynamic loops have no gradient) and XLA's products, so its numbers agree with the
engine's up to rounding, not bitwise.
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
from models.moe import differentiable_experts
from models.quantization import native_products
from pallas_kernels.backend import build_attention


def make_sequence_logprobs(runner, *, trainable: bool = False) -> Callable:
    """``fn(state, token_ids [T]) -> [T - 1]`` for ``runner``'s model (see the module
    docstring; ``trainable``: ``fn(params, token_ids)``, differentiable). One device's
    program: a tensor-parallel engine's sharded weights are refused (ValueError);
    data-parallel ranks hold the whole model and are fine."""
    if runner.mesh.shape["model"] > 1:
        raise ValueError("sequence logprobs run the model on one device: tensor_parallel_size must be 1")
    arch, layout, block = runner.arch, runner.kv_cache_layout, runner.block_size
    groups, pmax = layout.num_groups, runner.max_blocks_per_req
    if trainable:
        return _trainable_logprobs(runner)
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


def causal_attention(sm_scale: float, sliding_window: int | None = None, sliding_window_layers=None,
                     soft_cap: float | None = None, latent_kv: bool = False) -> Callable:
    """The model's ``attention_fn`` for one whole sequence, dense and differentiable:
    q [T, N, H], k / v [T, K, H] -> o [T, N, H] (grouped-query heads; causal; a window of
    ``sliding_window`` keys on the layers ``sliding_window_layers`` marks, all when None;
    Gemma's score soft cap; GPT-OSS's ``sinks`` [N], one more logit per head in each
    softmax; MLA's ``latent_kv``: k [T, 1, R + H_rope] is the value as well, v None). No KV
    cache: the one passed through comes back as it is."""
    windows = None if sliding_window is None or sliding_window_layers is None else tuple(
        bool(w) for w in sliding_window_layers)

    def attention(q, k, v, kv_cache, layer, md, sinks=None):
        v = k if v is None else v
        t, n, h = q.shape
        kh = k.shape[1]
        qf = q.astype(jnp.float32).reshape(t, kh, n // kh, h)
        s = jnp.einsum("tkgh,skh->kgts", qf, k.astype(jnp.float32)) * sm_scale
        if soft_cap:
            s = soft_cap * jnp.tanh(s / soft_cap)
        pos = jnp.arange(t)
        mask = pos[None, :] <= pos[:, None]  # [query, key]
        if sliding_window is not None:
            near = pos[None, :] > pos[:, None] - sliding_window
            if windows is not None:  # only some layers slide (layer: an int, or traced in the scan)
                near = near | ~jnp.asarray(windows)[layer]
            mask = mask & near
        s = jnp.where(mask, s, -jnp.inf)
        if sinks is None:
            p = jax.nn.softmax(s, axis=-1)
        else:  # the sink joins the softmax and is dropped after it
            sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(kh, n // kh, 1, 1), s.shape[:-1] + (1,))
            p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
        o = jnp.einsum("kgts,skh->tkgh", p, v.astype(jnp.float32))
        return o.reshape(t, n, h).astype(q.dtype), kv_cache

    return attention


def _trainable_logprobs(runner) -> Callable:
    """``fn(params, token_ids [T]) -> [T - 1]``, differentiable (see the module docstring)."""
    attention = causal_attention(**attention_settings(runner.arch))
    graphdef = runner.graphdef
    rest = nnx.filter_state(runner.state, nnx.Not(nnx.Param))  # the rope tables: constants

    def forward(params, token_ids):
        t = token_ids.shape[0]
        positions = jnp.arange(t, dtype=jnp.int32)
        model = nnx.merge(graphdef, nnx.merge_state(rest, params))
        # XLA's products and ragged_dot experts: the native kernel and the CPU experts' tile loop have no gradient.
        with native_products(False), differentiable_experts():
            hidden, _ = model(token_ids, positions, jnp.zeros((1,), jnp.float32), None, attention)
            logits = model.compute_logits(hidden)
        lse = jax.nn.logsumexp(logits[:-1], axis=-1)
        return jnp.take_along_axis(logits[:-1], token_ids[1:, None], axis=-1)[:, 0] - lse

    return jax.jit(forward)
