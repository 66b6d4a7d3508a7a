"""Rejection sampling keeps the target distribution (speculative decoding).

For a fixed target distribution and a fixed draft token, the tokens emitted at a
position over many seeds must follow the target: chi-square against the expected
counts, with enough samples that an always-accept or never-accept sampler (or one
that draws the recovered token from the unmodified distribution) fails by a mile."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chisquare

from jaxserve.runner.input_batch import InputBatch
from jaxserve.sample.rejection_sampler import rejection_sample
from jaxserve.sample.sampler import sample

V = 12
N = 6000  # requests (one row each), one seed per request


def metadata(n, *, temperature=1.0, top_k=0, top_p=1.0):
    ib = InputBatch(n, 8, 1, V)
    ib.temperature[:] = temperature
    ib.top_k[:] = top_k
    ib.top_p[:] = top_p
    ib.seeds[:] = np.arange(n, dtype=np.uint32) * 7919 + 1
    return ib.make_sampling_metadata(np.arange(n), use_penalties=False)


def target_probs(logits, temperature=1.0, top_k=0):
    x = logits.astype(np.float64) / temperature
    if top_k:
        x = np.where(x >= np.sort(x)[-top_k], x, -np.inf)
    p = np.exp(x - x.max())
    return p / p.sum()


@pytest.mark.parametrize("draft,top_k", [(0, 0), (5, 0), (11, 0), (3, 4)], ids=["likely", "mid", "rare", "top_k"])
def test_first_position_follows_target(draft, top_k):
    rng = np.random.default_rng(0)
    base = rng.normal(0, 1.5, V).astype(np.float32)
    base[0] += 2.0  # token 0 likely; token 11 made rare
    base[11] -= 3.0
    k = 2
    logits = np.tile(base, (N * (k + 1), 1))
    drafts = np.full((N, k), draft, np.int32)
    md = metadata(N, top_k=top_k)
    tokens, emitted, *_ = jax.jit(lambda lg, d, nd, m: rejection_sample(
        lg, d, nd, m, greedy_only=False, use_penalties=False, num_logprobs=0))(
        jnp.asarray(logits), jnp.asarray(drafts), jnp.full(N, k, jnp.int32), md)
    tokens, emitted = np.asarray(tokens), np.asarray(emitted)
    p = target_probs(base, top_k=top_k)
    counts = np.bincount(tokens[:, 0], minlength=V)
    keep = p > 0
    assert counts[~keep].sum() == 0  # never a token outside the kept set
    _, pvalue = chisquare(counts[keep], p[keep] / p[keep].sum() * counts.sum())
    assert pvalue > 1e-3, (counts, p * N)
    # Position 1 among the requests whose first draft held: the same target again.
    held = tokens[:, 0] == draft
    assert 0 < held.sum() < N or p[draft] in (0.0, 1.0)
    c1 = np.bincount(tokens[held, 1], minlength=V)
    if held.sum() > 500:
        _, pvalue = chisquare(c1[keep], p[keep] / p[keep].sum() * c1.sum())
        assert pvalue > 1e-3, (c1, p * held.sum())
    # Emitted counts: accepted drafts + 1, tokens after them -1.
    assert np.all(emitted >= 1) and np.all(emitted <= k + 1)
    assert np.all(tokens[np.arange(k + 1)[None, :] >= emitted[:, None]] == -1)


def test_without_drafts_it_is_the_plain_sampler():
    """A row with no drafts draws exactly what the plain sampler draws (same key)."""
    rng = np.random.default_rng(1)
    n, k = 64, 3
    logits = rng.normal(0, 2, (n, V)).astype(np.float32)
    md = metadata(n, temperature=0.7)
    plain, *_ = jax.jit(lambda lg, m: sample(lg, m, greedy_only=False, use_penalties=False, num_logprobs=0))(
        jnp.asarray(logits), md)
    rows = np.repeat(logits, k + 1, axis=0)
    tokens, emitted, *_ = jax.jit(lambda lg, m: rejection_sample(
        lg, jnp.full((n, k), -1, jnp.int32), jnp.zeros(n, jnp.int32), m, greedy_only=False, use_penalties=False,
        num_logprobs=0))(jnp.asarray(rows), md)
    assert np.array_equal(np.asarray(tokens)[:, 0], np.asarray(plain)) and np.all(np.asarray(emitted) == 1)


def test_greedy_accepts_exactly_the_argmax_run():
    logits = np.full((3 * 4, V), -5.0, np.float32)
    argmax = [[3, 4, 5, 6], [3, 4, 5, 6], [1, 1, 1, 1]]
    for r in range(3):
        for j in range(4):
            logits[r * 4 + j, argmax[r][j]] = 5.0
    drafts = np.array([[3, 4, 5], [3, 9, 5], [2, 1, 1]], np.int32)
    md = metadata(3, temperature=0.0)
    tokens, emitted, *_ = jax.jit(lambda lg, d, m: rejection_sample(
        lg, d, jnp.array([3, 3, 2], jnp.int32), m, greedy_only=True, use_penalties=False, num_logprobs=0))(
        jnp.asarray(logits), jnp.asarray(drafts), md)
    assert np.asarray(tokens).tolist() == [[3, 4, 5, 6], [3, 4, -1, -1], [1, -1, -1, -1]]
    assert np.asarray(emitted).tolist() == [4, 2, 1]
