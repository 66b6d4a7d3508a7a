"""The sampler, run inside the jitted step on logits [R, V].

Order as vLLM: logprobs from the raw logits; then min_tokens masking, penalties,
temperature, min-p / top-k / top-p; then a draw. Each row's random key is
fold_in(key(seed), output_pos), so a seeded request draws the same tokens
whatever else is in the batch (and after a preemption).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.sample.metadata import SamplingMetadata

_NEG_INF = -jnp.inf


def apply_min_tokens(logits, md: SamplingMetadata):
    r = logits.shape[0]
    rows = jnp.broadcast_to(jnp.arange(r)[:, None], md.stop_ids_masked.shape)
    cols = jnp.where(md.stop_ids_masked >= 0, md.stop_ids_masked, logits.shape[1])  # out of range: dropped
    return logits.at[rows, cols].set(_NEG_INF, mode="drop")


def apply_penalties(logits, md: SamplingMetadata):
    """Presence / frequency on output tokens; repetition on prompt and output tokens."""
    r, v = logits.shape
    pos = jnp.arange(md.token_history.shape[1])[None, :]
    in_prompt = pos < md.prompt_lens[:, None]
    in_output = (pos >= md.prompt_lens[:, None]) & (pos < md.total_lens[:, None])
    rows = jnp.broadcast_to(jnp.arange(r)[:, None], md.token_history.shape)
    out_counts = jnp.zeros((r, v), jnp.int32).at[rows, md.token_history].add(in_output.astype(jnp.int32))
    prompt_seen = jnp.zeros((r, v), jnp.bool_).at[rows, md.token_history].max(in_prompt)
    seen = prompt_seen | (out_counts > 0)
    rep = md.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - md.frequency_penalty[:, None] * out_counts
    logits = logits - md.presence_penalty[:, None] * (out_counts > 0)
    return logits


def apply_top_k_top_p_min_p(logits, md: SamplingMetadata):
    """Mask everything outside each row's kept set with -inf (logits already tempered)."""
    v = logits.shape[1]
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # descending
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    rank = jnp.arange(v)[None, :]
    keep = jnp.ones_like(sorted_logits, dtype=jnp.bool_)
    k = md.top_k[:, None]
    keep &= (k <= 0) | (rank < k)
    # top-p: keep the smallest prefix whose mass reaches p (the top token always stays).
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= (cum_before < md.top_p[:, None]) | (rank == 0)
    keep &= probs >= md.min_p[:, None] * probs[:, :1]
    # The threshold is the smallest kept logit; ties at the threshold are all kept.
    threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= threshold, logits, _NEG_INF)


def compute_logprobs(logits, sampled, num_logprobs: int):
    """Raw log-softmax: (ids [R, k+1], logprobs [R, k+1], rank of sampled [R]).
    Column 0 is the sampled token."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    sampled_lp = jnp.take_along_axis(lp, sampled[:, None], axis=-1)
    rank = jnp.sum(lp > sampled_lp, axis=-1).astype(jnp.int32) + 1
    if num_logprobs > 0:
        top_lp, top_ids = jax.lax.top_k(lp, num_logprobs)
        ids = jnp.concatenate([sampled[:, None], top_ids.astype(jnp.int32)], axis=-1)
        lps = jnp.concatenate([sampled_lp, top_lp], axis=-1)
    else:
        ids, lps = sampled[:, None], sampled_lp
    return ids, lps, rank


def sample(logits, md: SamplingMetadata, *, greedy_only: bool, use_penalties: bool, num_logprobs: int):
    """logits: [R, V] f32 -> (sampled [R] int32, logprob ids [R, k+1], logprobs [R, k+1], ranks [R])."""
    raw = logits
    logits = apply_min_tokens(logits, md)
    if use_penalties:
        logits = apply_penalties(logits, md)
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if greedy_only:
        sampled = greedy_tokens
    else:
        is_greedy = md.temperature <= 0.0
        temp = jnp.where(is_greedy, 1.0, md.temperature)
        tempered = apply_top_k_top_p_min_p(logits / temp[:, None], md)

        def draw(seed, pos, row):
            key = jax.random.fold_in(jax.random.key(seed), pos)
            return jnp.argmax(row + jax.random.gumbel(key, row.shape, jnp.float32))

        random_tokens = jax.vmap(draw)(md.seeds, md.output_pos, tempered).astype(jnp.int32)
        sampled = jnp.where(is_greedy, greedy_tokens, random_tokens)
    ids, lps, ranks = compute_logprobs(raw, sampled, num_logprobs)
    return sampled, ids, lps, ranks
