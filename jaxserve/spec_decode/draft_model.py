"""Draft-model proposer: a smaller model with the target's tokenizer guesses the next
k tokens of every request, as its own jitted program on the target's mesh, after the
target's step and its verification.

KV cache. The draft model has its own KV arrays with the target's page count and
block size, indexed by the target's block tables: a request's block b holds the
draft's KV for the same positions as the target's. The draft runs in lockstep with the
target: each step it feeds every scheduled request's tokens from where its own KV ends
(``InputBatch.draft_num_computed``) up to the request's committed tokens (a prefill
chunk; or the tokens just accepted and emitted), so the draft KV of every committed
position is written in the step that commits it (prefix-cache blocks hold both). The
last position gives draft token 1; k - 1 single-token passes give the rest, writing
KV at the next k - 1 positions (the scheduler allocates them as lookahead; the next
step feeds those positions again with the tokens that were actually accepted).

Shapes. The first pass feeds at most the target's T tokens plus one per request (the
emitted token); it is padded to a draft token bucket (the target's buckets plus one of
max_num_batched_tokens + max_num_seqs). The loop is [Rmax] tokens per rank, fixed, so
one program per draft bucket covers the first pass and the loop (k is static).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.core.kv_cache_utils import cdiv
from jaxserve.runner.bucketing import BucketTable
from jaxserve.runner.kv_cache import allocate_kv_cache, kv_cache_sharding
from jaxserve.runner.program_key import DraftKey
from jaxserve.runner.programs import traced_products
from jaxserve.sample.sampler import argmax_ids
from models.config import attention_settings
from models.loader import load_model
from pallas_kernels.attention_metadata import AttentionMetadata
from pallas_kernels.backend import build_attention


class DraftModelProposer:
    def __init__(self, runner, model_path: str, num_speculative_tokens: int, *, progress: bool = True) -> None:
        self.k = num_speculative_tokens
        self.runner = runner
        self.arch, self.graphdef, self.state = load_model(model_path, mesh=runner.mesh, dtype=runner.dtype,
                                                          param_dtype=runner.param_dtype, progress=progress,
                                                          scan_layers=runner.config.model_config.scan_layers)
        if self.arch.vocab_size != runner.vocab_size:
            raise ValueError(f"speculative_config.model: the draft model's vocabulary ({self.arch.vocab_size}) "
                             f"differs from the target's ({runner.vocab_size}); it needs the same tokenizer")
        # The target's spec (kernel, page storage) without its checkpoint's KV scales: the
        # draft model writes its pages unscaled.
        self.attention = build_attention(runner.attention_spec.with_kv_scales(None), runner.mesh,
                                         **attention_settings(self.arch))
        self.kv_cache = None  # allocate_kv_cache() once the runner knows its page count
        largest = runner.max_num_tokens + runner.max_num_reqs
        self.buckets = BucketTable(sorted(set(runner.token_buckets) | {cdiv(largest, 16) * 16}))
        self._build()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        r = self.runner
        self.kv_cache = allocate_kv_cache(self.arch, num_blocks, r.block_size, r.kv_storage_dtype, r.mesh)

    def _build(self) -> None:
        r = self.runner
        graphdef, dp, rmax, k, bs = self.graphdef, r.dp, r.max_num_reqs, self.k, r.block_size
        attention, max_model_len = self.attention, r.max_model_len

        def propose(state, kv_cache, input_ids, positions, md, last_index, next_pos, active):
            """First pass over the fed tokens, then k - 1 one-token passes; returns
            (drafts [DP*Rmax, k] int32, kv_cache). last_index [DP*Rmax]: each request's
            last fed token in its rank's [T]; next_pos [DP*Rmax]: the position of draft
            token 1; active [DP*Rmax]: rows that want drafts (others write nowhere)."""
            model = nnx.merge(graphdef, state)
            hidden, kv_cache = model(input_ids, positions, kv_cache, md, attention)
            by_rank = hidden.reshape(dp, -1, hidden.shape[-1])
            last = jnp.take_along_axis(by_rank, last_index.reshape(dp, -1, 1), axis=1).reshape(-1, hidden.shape[-1])
            token = argmax_ids(model.compute_logits(last))
            drafts = [token]
            # One token per request per pass: the same metadata shape every time.
            cu = jnp.tile(jnp.arange(rmax + 1, dtype=jnp.int32), dp)
            rows = jnp.arange(dp * rmax)
            for j in range(k - 1):
                pos = next_pos + j
                live = active & (pos < max_model_len)
                # One KV cache group with a draft model (the runner's layout): table 0.
                page = md.block_tables[rows, 0, jnp.minimum(pos // bs, md.block_tables.shape[2] - 1)]
                slot = jnp.where(live, page * bs + pos % bs, 0)[:, None]  # 0: the null block's first slot
                step_md = AttentionMetadata(slot_mapping=slot, seq_lens=jnp.where(live, pos + 1, 1),
                                            query_start_loc=cu, block_tables=md.block_tables, num_seqs=md.num_seqs)
                hidden, kv_cache = model(token, jnp.where(live, pos, 0), kv_cache, step_md, attention)
                token = argmax_ids(model.compute_logits(hidden))
                drafts.append(token)
            return jnp.stack(drafts, axis=1), kv_cache

        # Registered with the runner's programs (DraftKey): compiled by its warm-up, run by
        # its _run, counted with the others.
        # Traced with the engine's products: in batch-invariant mode a draft (and so a
        # seeded request's accepts and draws) must not depend on the other rows either.
        propose = traced_products(r.mesh, r.config.model_config.batch_invariant)(propose)
        self.jitted = jax.jit(propose, donate_argnums=(1,), out_shardings=(r._replicated, kv_cache_sharding(r.mesh, self.arch)))

    # ------------------------------------------------------------------ inputs
    def inputs(self, t: int):
        """Zeroed inputs of draft bucket ``t`` (every rank's one after the other)."""
        r = self.runner
        dp, rmax = r.dp, r.max_num_reqs
        md = r.empty_attention_metadata(t)
        return (np.zeros(dp * t, np.int32), np.zeros(dp * t, np.int32), md, np.zeros(dp * rmax, np.int32),
                np.zeros(dp * rmax, np.int32), np.zeros(dp * rmax, np.bool_))

    def propose(self, steps) -> list[dict[str, list[int]]]:
        """After the target step's bookkeeping: feed each rank's scheduled requests up to
        their committed tokens, then draft k tokens for those that emitted some this
        step. ``steps``: the runner's RankSteps (``done`` set by the bookkeeping).
        Returns each rank's {req_id: drafts}."""
        r = self.runner
        dp, rmax, bs = r.dp, r.max_num_reqs, r.block_size
        counts, feeds = [], []
        for rank, step in enumerate(steps):
            ib = r.input_batches[rank]
            rows = step.rows
            if len(rows) == 0:
                counts.append(0)
                feeds.append(None)
                continue
            start = ib.draft_num_computed[rows]
            # Committed tokens: a mid-prefill row's computed ones, else all (with those emitted).
            end = np.where(step.done, ib.num_tokens[rows], step.num_computed + step.num_scheduled)
            feeds.append((start, end))
            counts.append(int((end - start).sum()))
        t = self.buckets(max(max(counts), 1))
        input_ids, positions, md, last_index, next_pos, active = self.inputs(t)
        for rank, (step, feed) in enumerate(zip(steps, feeds)):
            if feed is None:
                continue
            ib = r.input_batches[rank]
            rows, (start, end) = step.rows, feed
            n = (end - start).astype(np.int32)
            num_reqs = len(rows)
            tok = slice(rank * t, (rank + 1) * t)
            cu = md.query_start_loc[rank * (rmax + 1):(rank + 1) * (rmax + 1)]
            ib.fill_ragged(rows, start, n, bs, cu, input_ids[tok], positions[tok], md.slot_mapping[tok])
            row = slice(rank * rmax, rank * rmax + num_reqs)
            md.seq_lens[row] = end
            md.block_tables[row] = ib.block_table[rows]
            md.num_seqs[rank] = num_reqs
            last_index[row] = cu[1:num_reqs + 1] - 1
            next_pos[row] = end
            active[row] = step.done
            ib.draft_num_computed[rows] = end
        args = r._put((input_ids, positions, md, last_index, next_pos, active))
        drafts, self.kv_cache = r._run(DraftKey(t), self.state, self.kv_cache, *args)
        drafts = np.asarray(jax.device_get(drafts))
        out = []
        for rank, step in enumerate(steps):
            if step.done is None:  # a rank with nothing scheduled
                out.append({})
                continue
            ib = r.input_batches[rank]
            base = rank * rmax
            out.append({step.req_ids[i]: drafts[base + i].tolist() for i in np.flatnonzero(step.done)
                        if ib.num_tokens[step.rows[i]] < r.max_model_len})
        return out
