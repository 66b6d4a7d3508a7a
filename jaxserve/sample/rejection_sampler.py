"""Verification of draft tokens (speculative decoding), inside the jitted step.

Each request has S = k + 1 logits rows: the target model's distributions at its
last token and at each of its d <= k draft tokens (rows past d repeat the last one
and are never used). Row j decides the token at output position output_pos + j:

- greedy rows accept draft j while it equals the target argmax; the first mismatch
  emits the argmax instead, and when all d drafts hold, row d's argmax is a bonus:
  the argmax decoding without speculation takes at the same positions (bitwise the
  same logits, and so tokens and logprobs, in batch-invariant mode).
- random rows accept draft j with probability p_j(draft) (the drafts are one-hot
  proposals, as vLLM treats n-gram and draft-model guesses), else emit a token drawn
  from p_j with the draft removed and renormalised; all accepted: a bonus draw from
  p_d. Either way each emitted token is distributed as p_j, the target's own
  distribution after temperature, min-p, top-k and top-p.

The draw at row j uses the key fold_in(key(seed), output_pos + j), the plain
sampler's key for that output position, so a request without drafts samples exactly
as the plain sampler does; acceptance tests use a second, independent stream.
Penalties, min_tokens masks and grammar masks apply to every row alike, which is
exact because the scheduler gives no drafts to requests they would differ for.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.sample.metadata import SamplingMetadata
from jaxserve.sample.sampler import (
    SAMPLER_TILE_ROWS, argmax_ids, compute_logprobs, inverse_cdf_draw, process_logits, temper_and_filter,
    uniform_per_row,
)
from models import batch_invariance

# Salt of the acceptance test's random stream (independent of the draws').
_ACCEPT_SALT = 0x5BD1E995


def rejection_sample(logits, draft_token_ids, num_draft_tokens, md: SamplingMetadata, *, greedy_only: bool,
                     use_penalties: bool, num_logprobs: int):
    """logits [R*S, V] f32 (request i's rows at i*S .. i*S + k), draft_token_ids [R, k]
    int32, num_draft_tokens [R] int32, md: [R] rows ->
    (tokens [R, S] int32: the emitted tokens, -1 after them; num_emitted [R] int32 in
    1..d+1; logprob ids [R*S, n+1], logprobs [R*S, n+1], ranks [R*S]: row i*S + j for
    request i's j-th emitted token). In batch-invariant mode the requests go by fixed
    tiles (models/batch_invariance.py), as the plain sampler's rows do, so a seeded
    request's accepts and draws do not depend on the requests beside it."""
    kw = dict(greedy_only=greedy_only, use_penalties=use_penalties)
    if not batch_invariance.active():
        tokens, emitted, raw = _verify(logits, draft_token_ids, num_draft_tokens, md, **kw)
        return tokens, emitted, *compute_logprobs(raw, jnp.maximum(tokens.reshape(-1), 0), num_logprobs)
    r, k = draft_token_ids.shape
    s, v = k + 1, logits.shape[-1]

    def tile(lg, drafts, num_drafts, tmd):
        tokens, emitted, raw = _verify(lg.reshape(-1, v), drafts, num_drafts, tmd, **kw)
        return tokens, emitted, raw.reshape(len(drafts), s, v)

    tokens, emitted, raw = batch_invariance.map_rows(
        tile, logits.reshape(r, s, v), draft_token_ids, num_draft_tokens, md, tile=SAMPLER_TILE_ROWS)
    # The logprobs by the plain sampler's tiles of rows (compute_logprobs), so that a
    # verified token's logprob is bitwise the one decoding without drafts gives.
    return tokens, emitted, *compute_logprobs(raw.reshape(r * s, v), jnp.maximum(tokens.reshape(-1), 0), num_logprobs)


def _verify(logits, draft_token_ids, num_draft_tokens, md: SamplingMetadata, *, greedy_only: bool,
            use_penalties: bool):
    """rejection_sample of one set of requests, as they come, before the logprobs:
    (tokens [R, S], num_emitted [R], raw: the grammar-masked logits [R*S, V])."""
    r, k = draft_token_ids.shape
    s = k + 1
    per_row = jax.tree.map(lambda x: jnp.repeat(x, s, axis=0), md)
    col = jnp.tile(jnp.arange(s, dtype=jnp.int32), r)  # [R*S]: position within the request
    drafts = jnp.concatenate([draft_token_ids, jnp.full((r, 1), -1, jnp.int32)], axis=1).reshape(-1)
    has_draft = col < jnp.repeat(num_draft_tokens, s)
    positions = per_row.output_pos + col

    raw, logits = process_logits(logits, per_row, use_penalties=use_penalties)
    greedy_tokens = argmax_ids(logits)
    if greedy_only:
        accept, target = drafts == greedy_tokens, greedy_tokens
    else:
        is_greedy, tempered = temper_and_filter(logits, per_row)
        probs = jax.nn.softmax(tempered, axis=-1)
        safe_drafts = jnp.maximum(drafts, 0)
        p_draft = jnp.take_along_axis(probs, safe_drafts[:, None], axis=-1)[:, 0]
        accept_random = p_draft >= uniform_per_row(per_row.seeds ^ jnp.uint32(_ACCEPT_SALT), positions)
        # The token emitted where the draft is rejected (or the bonus): p without the draft.
        vocab = jnp.arange(probs.shape[1], dtype=jnp.int32)
        q = jnp.where(has_draft[:, None] & (vocab[None, :] == safe_drafts[:, None]), 0.0, probs)
        drawn = inverse_cdf_draw(q, uniform_per_row(per_row.seeds, positions))
        accept = jnp.where(is_greedy, drafts == greedy_tokens, accept_random)
        target = jnp.where(is_greedy, greedy_tokens, drawn)
    accept = (accept & has_draft).reshape(r, s)
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # leading accepts
    cols = jnp.arange(s, dtype=jnp.int32)[None, :]
    tokens = jnp.where(cols < num_accepted[:, None], drafts.reshape(r, s),
                       jnp.where(cols == num_accepted[:, None], target.reshape(r, s), -1))
    return tokens, num_accepted + 1, raw
