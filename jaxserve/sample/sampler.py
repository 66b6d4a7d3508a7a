"""The sampler, run inside the jitted step on logits [R, V].

Order as vLLM: the grammar mask (structured outputs) first; logprobs from those
logits (so a token the grammar forbids has logprob -inf); then min_tokens masking, penalties,
temperature, min-p / top-k / top-p; then a draw. Each row's random key is
fold_in(key(seed), output_pos), so a seeded request draws the same tokens
whatever else is in the batch (and after a preemption).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.sample.metadata import SamplingMetadata
from models import batch_invariance

_NEG_INF = -jnp.inf
TOP_K_CANDIDATES = 1024


def apply_grammar_bitmask(logits, bitmask):
    """logits [R, V], bitmask [R, ceil(V/32)] int32 packed (bit t % 32 of word t // 32
    = token t allowed) -> logits with the forbidden tokens at -inf. All-ones rows (no
    constraint) are unchanged. Unpacked by broadcasting each word over its 32 tokens
    ([R, W, 32]), which fuses with the lm_head's output: a gather of the word for every
    token (``take`` over [R, V]) made the greedy sampler ~2x slower at [64, 49152] on
    XLA:CPU, whether or not any row had a grammar."""
    r, v = logits.shape
    w = bitmask.shape[1]
    bits = jnp.right_shift(bitmask[:, :, None], jnp.arange(32, dtype=jnp.int32)) & 1  # [R, W, 32]
    padded = jnp.pad(logits, ((0, 0), (0, w * 32 - v))).reshape(r, w, 32)
    return jnp.where(bits != 0, padded, _NEG_INF).reshape(r, w * 32)[:, :v]


def apply_min_tokens(logits, md: SamplingMetadata):
    """Bans each row's stop ids while it is below min_tokens (``stop_ids_masked`` [R, M],
    -1 = none). A comparison of every token with the row's M ids, which fuses into one
    pass over [R, V]; a scatter of -inf into the logits copied the whole [R, V] first."""
    vocab = jnp.arange(logits.shape[1], dtype=jnp.int32)
    banned = jnp.any(vocab[None, :, None] == md.stop_ids_masked[:, None, :], axis=-1)
    return jnp.where(banned, _NEG_INF, logits)


def apply_logit_bias(logits, md: SamplingMetadata):
    """Adds each row's logit_bias (``logit_bias_ids`` [R, K], -1 = none) to its logits.
    A scatter into [R, V] copies the logits, so it runs only when some row has a bias
    (md without the arrays, as some callers build it: unchanged)."""
    if md.logit_bias_ids is None:
        return logits
    r, v = logits.shape
    ids = jnp.where(md.logit_bias_ids >= 0, md.logit_bias_ids, v)  # out of range: dropped

    def add():
        return logits.at[jnp.arange(r)[:, None], ids].add(md.logit_bias_values, mode="drop")

    return jax.lax.cond(jnp.any(md.logit_bias_ids >= 0), add, lambda: logits)


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


ARGMAX_CHUNK = 256


def argmax_ids(x):
    """argmax over the last axis of [R, V] as int32 ids; ties go to the lowest id. A row
    with NaN gets some id in [0, V) (XLA:CPU's max reduction may drop a NaN; making it win
    made lm_head + argmax ~1.4x slower).

    In two levels: the maximum of each chunk of ARGMAX_CHUNK ids, the first chunk holding
    the row's maximum, then the argmax inside that chunk alone. XLA:CPU's single
    (value, index) reduction over the vocabulary is slow: ~10x slower at [64, 49152].
    Not a max then a min over the matching ids: XLA fused that with the lm_head, ~1.7x
    slower than the two levels."""
    r, v = x.shape
    c = min(ARGMAX_CHUNK, v)
    n = -(-v // c)
    if n * c != v:  # padded with -inf: never the first maximum (ties go to the lowest id)
        x = jnp.pad(x, ((0, 0), (0, n * c - v)), constant_values=-jnp.inf)
    chunks = x.reshape(r, n, c)
    best = jnp.argmax(jnp.max(chunks, axis=-1), axis=-1)  # [R]
    inside = jnp.argmax(jnp.take_along_axis(chunks, best[:, None, None], axis=1)[:, 0], axis=-1)
    return (best * c + inside).astype(jnp.int32)


def apply_top_k_top_p_min_p(logits, md: SamplingMetadata):
    """Mask everything outside each row's kept set with -inf (logits already tempered).

    Order as vLLM: min-p over the whole vocabulary (p >= min_p * p_max, i.e. logit >=
    max + log(min_p): exact, O(V)), then top-k, then top-p over what is left,
    renormalised. top-k / top-p look at the TOP_K_CANDIDATES most likely tokens
    (lax.top_k instead of a full-vocabulary sort, which costs ~1 s on [64, 49152] on
    a CPU): exact when top_k is off, >= V or <= TOP_K_CANDIDATES, and the top-p
    nucleus fits in the candidates; otherwise the kept set is cut at the candidates."""
    v = logits.shape[1]
    min_p = md.min_p[:, None]
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    logits = jnp.where((min_p <= 0.0) | (logits >= row_max + jnp.log(jnp.maximum(min_p, 1e-38))), logits, _NEG_INF)

    kc = min(TOP_K_CANDIDATES, v)
    cand, _ = jax.lax.top_k(logits, kc)  # [R, kc] descending
    rank = jnp.arange(kc)[None, :]
    k = md.top_k[:, None]
    k_off = (k <= 0) | (k >= v)
    in_k = k_off | (rank < k)
    # The distribution top-p sees is what min-p and top-k left, renormalised: its total
    # runs over the whole (min-p-masked) vocabulary when top-k is off.
    cand_k = jnp.where(in_k, cand, _NEG_INF)
    lse = jnp.where(k_off, jax.nn.logsumexp(logits, axis=-1, keepdims=True),
                    jax.nn.logsumexp(cand_k, axis=-1, keepdims=True))
    probs = jnp.exp(cand_k - lse)
    # Smallest prefix whose mass reaches p; the top token always stays.
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_k & ((cum_before < md.top_p[:, None]) | (rank == 0))
    # The threshold is the smallest kept logit; ties at the threshold are all kept.
    threshold = jnp.min(jnp.where(keep, cand, jnp.inf), axis=-1, keepdims=True)
    # Rows with only min-p keep every survivor, beyond the candidates too.
    cut = ~k_off | (md.top_p[:, None] < 1.0)
    return jnp.where(cut & (logits < threshold), _NEG_INF, logits)


# Rows per fixed-shape tile of the sampler in batch-invariant mode (models/batch_invariance.py).
SAMPLER_TILE_ROWS = 8


def compute_logprobs(logits, sampled, num_logprobs: int):
    """Raw log-softmax: (ids [R, k+1], logprobs [R, k+1], rank of sampled [R]).
    Column 0 is the sampled token. In batch-invariant mode per fixed tile of rows: the
    log-softmax's sum over the vocabulary then has one order whatever R."""
    if batch_invariance.active():
        return batch_invariance.map_rows(lambda lg, s: _logprobs(lg, s, num_logprobs), logits, sampled,
                                         tile=SAMPLER_TILE_ROWS)
    return _logprobs(logits, sampled, num_logprobs)


def _logprobs(logits, sampled, num_logprobs: int):
    """compute_logprobs of one set of rows, as they come."""
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


def temper(logits, md: SamplingMetadata):
    """-> (is_greedy [R], logits [R, V] divided by the temperature (greedy rows: by 1))."""
    is_greedy = md.temperature <= 0.0
    return is_greedy, logits / jnp.where(is_greedy, 1.0, md.temperature)[:, None]


def filtering_rows(md: SamplingMetadata):
    """[R] bool: the rows that use min-p, top-k or top-p."""
    return (md.top_k > 0) | (md.top_p < 1.0) | (md.min_p > 0.0)


def temper_and_filter(logits, md: SamplingMetadata):
    """``temper``, then min-p / top-k / top-p applied to the rows that use them."""
    is_greedy, tempered = temper(logits, md)
    return is_greedy, jnp.where(filtering_rows(md)[:, None], apply_top_k_top_p_min_p(tempered, md), tempered)


def uniform_per_row(seeds, positions):
    """[R] uniforms in (0, 1] from key(seed) folded with the output position. Not 0:
    inverse_cdf_draw would then pick token 0 even when it is masked."""
    return 1.0 - jax.vmap(lambda s, p: jax.random.uniform(jax.random.fold_in(jax.random.key(s), p)))(seeds, positions)


CDF_CHUNK = 256


def inverse_cdf_draw(weights, u):
    """weights [R, V] >= 0 (need not sum to 1), u [R] in (0, 1] -> [R] int32: the first
    token whose running total reaches u * the row's total (it has positive weight).

    In two levels, like argmax_ids: the running total of the chunks' sums picks the
    chunk, then the running total inside that chunk alone picks the token. XLA:CPU's
    cumsum over the whole vocabulary was most of the random draw's time (~3x slower
    at [64, 49152])."""
    r, v = weights.shape
    c = min(CDF_CHUNK, v)
    n = -(-v // c)
    if n * c != v:
        weights = jnp.pad(weights, ((0, 0), (0, n * c - v)))
    chunks = weights.reshape(r, n, c)
    sums = jnp.sum(chunks, axis=-1)  # [R, n]
    running = jnp.cumsum(sums, axis=-1)
    target = u * running[:, -1]
    # The last chunk with weight bounds the pick: rounding may leave every running total
    # of the chunks below the target.
    last_chunk = n - 1 - jnp.argmax((sums > 0)[:, ::-1], axis=-1)
    chunk = jnp.minimum(jnp.sum(running < target[:, None], axis=-1), last_chunk)
    inside = jnp.take_along_axis(chunks, chunk[:, None, None], axis=1)[:, 0]  # [R, c]
    before = jnp.take_along_axis(running - sums, chunk[:, None], axis=1)[:, 0]
    last = c - 1 - jnp.argmax((inside > 0)[:, ::-1], axis=-1)
    drawn = jnp.minimum(jnp.sum(before[:, None] + jnp.cumsum(inside, axis=-1) < target[:, None], axis=-1), last)
    return (chunk * c + drawn).astype(jnp.int32)


def process_logits(logits, md: SamplingMetadata, *, use_penalties: bool, grammar: bool = True):
    """The steps before any draw, in vLLM's order -> (raw: logits masked by the grammar
    and the token controls (allowed_token_ids, bad_words), whose log-softmax the logprobs
    report; processed: with logit_bias, min_tokens bans and penalties)."""
    raw = apply_grammar_bitmask(logits, md.allowed_token_bitmask) if grammar else logits
    logits = apply_min_tokens(apply_logit_bias(raw, md), md)
    if use_penalties:
        logits = apply_penalties(logits, md)
    return raw, logits


def _when(pred, if_true, if_false):
    """if_true() if pred else if_false(). A Python bool picks while tracing (a program
    per value); a traced bool scalar at run time (lax.cond: both branches compiled
    into one program, only the taken one runs)."""
    if isinstance(pred, bool):
        return if_true() if pred else if_false()
    return jax.lax.cond(pred, if_true, if_false)


def _placeholders(sampled, width: int):
    """The logprob outputs of a plain step: ids = the sampled token [R, width], logprobs 0,
    ranks 1."""
    r = len(sampled)
    return jnp.broadcast_to(sampled[:, None], (r, width)), jnp.zeros((r, width), jnp.float32), jnp.ones_like(sampled)


def sample(logits, md: SamplingMetadata, *, greedy_only, use_penalties: bool, num_logprobs: int, plain=False):
    """logits: [R, V] f32 -> (sampled [R] int32, logprob ids [R, k+1], logprobs [R, k+1], ranks [R]).

    ``greedy_only``: every row is greedy (the random draw is skipped). ``plain``: no row
    wants logprobs or has a grammar: the log-softmax and its top-k are skipped and the
    logprob outputs are placeholders (ids = sampled, logprobs 0, ranks 1). Both are
    Python bools (one program per value; a static plain also skips the grammar mask and
    gives [R, 1] placeholders) or traced bool scalars (one program for every case, the
    work skipped at run time). In batch-invariant mode the rows go by fixed tiles
    (models/batch_invariance.py): every sum over the vocabulary (log-softmax, top-p's
    total, the draw's cumulative weights) then has one order whatever R, and a seeded
    row draws the same token alone or in any batch."""
    kw = dict(greedy_only=greedy_only, use_penalties=use_penalties, num_logprobs=num_logprobs, plain=plain)
    if batch_invariance.active():
        return batch_invariance.map_rows(lambda lg, m: _sample(lg, m, **kw), logits, md, tile=SAMPLER_TILE_ROWS)
    return _sample(logits, md, **kw)


def _sample(logits, md: SamplingMetadata, *, greedy_only, use_penalties: bool, num_logprobs: int, plain):
    """``sample`` of one set of rows, as they come."""
    # Each branch starts again from the logits (lax.cond materializes what crosses into
    # a branch: passing the processed [R, V] in cost the greedy path 5-10 ms at R = 64).
    # A plain batch's masks are all ones, so masking it too changes nothing.
    def masked():
        return logits if plain is True else apply_grammar_bitmask(logits, md.allowed_token_bitmask)

    def draw(greedy: bool):
        _, processed = process_logits(masked(), md, use_penalties=use_penalties, grammar=False)
        greedy_tokens = argmax_ids(processed)
        if greedy:
            return greedy_tokens
        # Inverse-CDF draw: one uniform number per row (cheaper than Gumbel noise over
        # the vocabulary), from a key that depends only on the request's seed and position.
        u = uniform_per_row(md.seeds, md.output_pos)

        def random_draw(filtered: bool):
            is_greedy, tempered = (temper_and_filter if filtered else temper)(processed, md)
            # Unnormalized weights: the draw scales u by the row's total (no division).
            tokens = inverse_cdf_draw(jnp.exp(tempered - jnp.max(tempered, axis=-1, keepdims=True)), u)
            return jnp.where(is_greedy, greedy_tokens, tokens)

        # The filters' top-k over the vocabulary is most of a filtered draw's time (~30 ms
        # at [64, 49152] on a 2-core CPU): skipped when no row filters.
        return jax.lax.cond(jnp.any(filtering_rows(md)), lambda: random_draw(True), lambda: random_draw(False))

    sampled = _when(greedy_only, lambda: draw(True), lambda: draw(False))

    if plain is True:
        return sampled, *_placeholders(sampled, 1)
    return sampled, *_when(plain, lambda: _placeholders(sampled, num_logprobs + 1),
                           lambda: compute_logprobs(masked(), sampled, num_logprobs))


def sample_from(logits_fn, md: SamplingMetadata, *, greedy_only, use_penalties: bool, num_logprobs: int, plain):
    """``sample`` with the logits computed inside: ``logits_fn() -> [R, V]`` (the lm_head).
    A step that is greedy and plain, with no min_tokens ban and no penalties, runs the
    lm_head and the argmax alone, fused, with the [R, V] logits never written out: lax.cond
    materializes what crosses into a branch, so the lm_head runs inside each branch (one
    runs). At R = 64 on a 2-core CPU that step cost ~1.5x the lm_head with the general
    path, and ~1.1x with this one. Same outputs as ``sample``."""
    def general():
        return sample(logits_fn(), md, greedy_only=greedy_only, use_penalties=use_penalties,
                      num_logprobs=num_logprobs, plain=plain)

    if use_penalties or greedy_only is False or plain is False:
        return general()
    width = 1 if plain is True else num_logprobs + 1

    def fast():
        sampled = argmax_ids(logits_fn())
        return sampled, *_placeholders(sampled, width)

    no_bans = ~jnp.any(md.stop_ids_masked >= 0)
    if md.logit_bias_ids is not None:
        no_bans = no_bans & ~jnp.any(md.logit_bias_ids >= 0)
    return jax.lax.cond(jnp.logical_and(jnp.logical_and(greedy_only, plain), no_bans), fast, general)
