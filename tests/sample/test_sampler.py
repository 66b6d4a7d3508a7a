"""Sampler unit tests on fake logits (SA-01..SA-12, LP-01)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.sample.metadata import SamplingMetadata
from jaxserve.sample.sampler import (ARGMAX_CHUNK, CDF_CHUNK, apply_penalties, apply_top_k_top_p_min_p, argmax_ids,
                                     inverse_cdf_draw, sample, sample_from)

V = 64


def md(r=1, **kw):
    base = dict(temperature=np.ones(r, np.float32), top_k=np.zeros(r, np.int32), top_p=np.ones(r, np.float32),
                min_p=np.zeros(r, np.float32), presence_penalty=np.zeros(r, np.float32),
                frequency_penalty=np.zeros(r, np.float32), repetition_penalty=np.ones(r, np.float32),
                seeds=np.arange(r, dtype=np.uint32), output_pos=np.zeros(r, np.int32),
                stop_ids_masked=np.full((r, 4), -1, np.int32), token_history=np.zeros((r, 1), np.int32),
                prompt_lens=np.zeros(r, np.int32), total_lens=np.zeros(r, np.int32),
                allowed_token_bitmask=np.full((r, (V + 31) // 32), -1, np.int32))
    base.update({k: v if isinstance(v, jax.Array) else np.asarray(v) for k, v in kw.items()})
    return SamplingMetadata(**base)


def test_greedy_is_argmax():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, V)), jnp.float32)
    s, *_ = sample(logits, md(4, temperature=np.zeros(4, np.float32)), greedy_only=True, use_penalties=False,
                   num_logprobs=0)
    assert np.array_equal(np.asarray(s), np.argmax(np.asarray(logits), -1))


@pytest.mark.parametrize("v", [ARGMAX_CHUNK * 3, ARGMAX_CHUNK * 3 + 77, 50])
def test_argmax_ids_is_jnp_argmax(v):
    """The two-level argmax (chunk maxima, then inside the first best chunk) = jnp.argmax:
    ties to the lowest id (also across chunks), an all -inf row gives 0, +inf wins, a
    vocabulary that is not a multiple of the chunk (padded with -inf); a row with NaN gets
    a valid id."""
    rng = np.random.default_rng(v)
    x = rng.standard_normal((8, v)).astype(np.float32)
    x[1, [5, v - 1]] = 9.0  # a tie far apart: the lower id
    x[2, v - 1] = 9.0  # the maximum in the padded last chunk
    x[3, [v // 2, v - 2]] = np.nan
    x[4] = -np.inf
    x[5, :] = 1.0  # all tied
    x[6, v // 3] = np.inf
    got = np.asarray(jax.jit(argmax_ids)(jnp.asarray(x)))
    rows = [0, 1, 2, 4, 5, 6, 7]
    np.testing.assert_array_equal(got[rows], np.argmax(x[rows], axis=-1))
    assert got[1] == 5 and got[2] == v - 1 and got[4] == 0 and got[5] == 0 and got[6] == v // 3
    assert 0 <= got[3] < v


def test_min_tokens_masks_only_stop_ids():  # SA-01
    logits = jnp.full((1, V), 1e-2).at[0, 5].set(10.0)
    s, *_ = sample(logits, md(1, temperature=np.zeros(1, np.float32), stop_ids_masked=[[5, 7, -1, -1]]),
                   greedy_only=True, use_penalties=False, num_logprobs=0)
    assert int(s[0]) != 5


def _hist(prompt, output, width=16):
    h = np.zeros((1, width), np.int32)
    toks = prompt + output
    h[0, : len(toks)] = toks
    return dict(token_history=h, prompt_lens=[len(prompt)], total_lens=[len(toks)])


def test_presence_and_frequency_penalty():  # SA-02, SA-03
    logits = jnp.full((1, V), 1e-2)
    out = np.asarray(apply_penalties(logits, md(1, presence_penalty=[2.0], **_hist([9], [3, 3, 4]))))
    assert out[0, 3] == out[0, 4] == pytest.approx(1e-2 - 2.0)
    assert out[0, 9] == pytest.approx(1e-2)  # prompt tokens are not presence-penalised
    out = np.asarray(apply_penalties(logits, md(1, frequency_penalty=[2.0], **_hist([9], [3, 3, 4]))))
    assert np.argmin(out[0]) == 3 and out[0, 3] == pytest.approx(1e-2 - 4.0)
    out = np.asarray(apply_penalties(logits, md(1, frequency_penalty=[-2.0], **_hist([9], [3, 3, 4]))))
    assert np.argmax(out[0]) == 3


def test_repetition_penalty_counts_prompt_and_output():  # SA-04
    logits = jnp.asarray(np.linspace(-1, 1, V)[None], jnp.float32)
    out = np.asarray(apply_penalties(logits, md(1, repetition_penalty=[1.9], **_hist([2, 60], [61]))))
    ref = np.asarray(logits)
    assert out[0, 2] == pytest.approx(ref[0, 2] * 1.9)  # negative logit: multiplied
    assert out[0, 60] == pytest.approx(ref[0, 60] / 1.9) and out[0, 61] == pytest.approx(ref[0, 61] / 1.9)
    assert out[0, 30] == pytest.approx(ref[0, 30])


def test_min_p():  # SA-05
    logits = jnp.full((1, V), 0.01).at[0, 7].set(10.0)
    out = np.asarray(apply_top_k_top_p_min_p(logits, md(1, min_p=[0.1])))
    assert np.isfinite(out[0, 7]) and np.isneginf(np.delete(out[0], 7)).all()
    assert np.isfinite(np.asarray(apply_top_k_top_p_min_p(logits, md(1)))).all()


def test_top_k_top_p():  # SA-09, SA-10
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((3, V)), jnp.float32)
    out = np.asarray(apply_top_k_top_p_min_p(logits, md(3, top_k=[1, 5, 0], top_p=[1.0, 1.0, 0.01])))
    assert np.isfinite(out[0]).sum() == 1 and np.isfinite(out[0, np.argmax(logits[0])])
    assert np.isfinite(out[1]).sum() == 5
    assert np.isfinite(out[2]).sum() == 1  # tiny p still keeps the top token
    both = np.asarray(apply_top_k_top_p_min_p(logits, md(3, top_k=[5, 5, 5], top_p=[0.5, 0.5, 0.5])))
    top5 = np.isfinite(out[1])
    assert (np.isfinite(both[1]) <= top5).all()


def test_seeded_rows_independent_of_batch():  # SA-12
    rng = np.random.default_rng(2)
    row = rng.standard_normal(V).astype(np.float32)
    alone = jnp.asarray(row[None])
    batch = jnp.asarray(np.stack([rng.standard_normal(V).astype(np.float32), row, row]))
    draws_alone, draws_batch = [], []
    for pos in range(20):
        s1, *_ = sample(alone, md(1, seeds=[42], output_pos=[pos]), greedy_only=False, use_penalties=False,
                        num_logprobs=0)
        s2, *_ = sample(batch, md(3, seeds=[7, 42, 43], output_pos=[0, pos, pos]), greedy_only=False,
                        use_penalties=False, num_logprobs=0)
        draws_alone.append(int(s1[0]))
        draws_batch.append((int(s2[1]), int(s2[2])))
    assert draws_alone == [a for a, _ in draws_batch]
    assert [a for a, _ in draws_batch] != [b for _, b in draws_batch]


def test_sampling_follows_distribution():
    logits = jnp.log(jnp.asarray([[0.7, 0.2, 0.1] + [1e-9] * (V - 3)], jnp.float32))
    f = jax.jit(lambda pos: sample(logits, md(1, seeds=[3], output_pos=pos[None]), greedy_only=False,
                                   use_penalties=False, num_logprobs=0)[0][0])
    counts = np.bincount([int(f(jnp.int32(i))) for i in range(2000)], minlength=V)
    assert counts[0] / 2000 == pytest.approx(0.7, abs=0.05) and counts[1] / 2000 == pytest.approx(0.2, abs=0.04)


def test_logprobs_contain_sampled_and_ranks():  # LP-01
    logits = jnp.asarray(np.random.default_rng(4).standard_normal((2, V)), jnp.float32)
    s, ids, lps, ranks = sample(logits, md(2, temperature=[0.0, 1.0]), greedy_only=False, use_penalties=False,
                                num_logprobs=5)
    lp = np.asarray(jax.nn.log_softmax(logits))
    ids, lps, ranks = map(np.asarray, (ids, lps, ranks))
    assert ids.shape == (2, 6) and ids[0, 0] == int(s[0]) and ranks[0] == 1
    assert np.allclose(lps[1, 1:], np.sort(lp[1])[::-1][:5], atol=1e-6)
    assert ranks[1] == 1 + (lp[1] > lp[1, int(s[1])]).sum()


def _reference_keep(row, k, p, min_p):
    """vLLM's filter order on one row, with a full sort: min-p, top-k, top-p (renormalised)."""
    v = row.shape[0]
    probs = np.exp(row - row.max())
    probs /= probs.sum()
    keep = np.ones(v, bool)
    if min_p > 0:
        keep &= probs >= min_p * probs.max()
    if 0 < k < v:
        keep &= row >= np.sort(np.where(keep, row, -np.inf))[::-1][k - 1]
    if p < 1:
        q = np.where(keep, probs, 0.0)
        q /= q.sum()
        order = np.argsort(-row, kind="stable")
        cum_before = np.cumsum(q[order]) - q[order]
        kept = (cum_before < p) & keep[order]
        kept[0] = True
        keep &= row >= row[order][kept].min()
    return keep


@pytest.mark.parametrize("k,p,min_p", [(0, 0.3, 0.0), (0, 0.9, 0.0), (40, 0.5, 0.0), (0, 0.5, 0.02),
                                       (0, 1.0, 0.02), (4096, 1.0, 0.0), (5000, 0.8, 0.0), (100, 0.7, 0.01)])
def test_filters_match_full_sort_reference(k, p, min_p):  # SA-05, SA-09, SA-10
    """V = 4096 > the 1024 candidates: top-p is normalised over the whole vocabulary
    when top-k is off, top_k >= V means off, min-p applies first over all tokens."""
    v = 4096
    logits = 3 * np.random.default_rng(3).standard_normal((1, v)).astype(np.float32)
    ref = _reference_keep(logits[0].astype(np.float64), k, p, min_p)
    if p < 1:
        assert ref.sum() <= 1024  # the nucleus fits in the candidates: the exact case
    out = np.asarray(apply_top_k_top_p_min_p(jnp.asarray(logits), md(1, top_k=[k], top_p=[p], min_p=[min_p])))
    assert np.array_equal(np.isfinite(out[0]), ref)


def test_flat_distribution_min_p_keeps_more_than_the_candidates():
    # 2000 distinct logits in [1, 1.5]: p / p_max >= exp(-0.5) > 0.5; the rest at 0: exp(-1.5) < 0.5.
    logits = jnp.zeros((1, 4096), jnp.float32).at[0, :2000].set(jnp.linspace(1.0, 1.5, 2000))
    out = np.asarray(apply_top_k_top_p_min_p(logits, md(1, min_p=[0.5])))
    assert np.isfinite(out[0]).sum() == 2000


@pytest.mark.parametrize("u", [0.0, 0.5, 1.0 - 2.0**-24])
def test_draw_never_picks_a_masked_token(monkeypatch, u):
    """Every token but the best (V - 1) is masked by top-k 1; draws at both ends of
    [0, 1), where an off-by-one in the inverse CDF would pick token 0, must pick it."""
    monkeypatch.setattr(jax.random, "uniform", lambda key, *a, **k: jnp.float32(u))
    logits = jnp.asarray(np.linspace(-1, 1, V)[None].repeat(4, 0), jnp.float32)
    s, *_ = sample(logits, md(4, top_k=np.ones(4, np.int32)), greedy_only=False, use_penalties=False, num_logprobs=0)
    assert (np.asarray(s) == V - 1).all()


def _pack(allowed_rows, v=V):
    """[[token ids]] -> packed [R, ceil(V/32)] int32 masks (the layout xgrammar / llguidance write)."""
    bits = np.zeros((len(allowed_rows), ((v + 31) // 32) * 32), np.uint8)
    for i, ids in enumerate(allowed_rows):
        bits[i, ids] = 1
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


@pytest.mark.parametrize("greedy", [True, False])
def test_grammar_bitmask_masks_before_everything(greedy):
    """Only allowed tokens are drawn; forbidden ones have logprob -inf; an all-ones row is untouched."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((3, V)) * 3, jnp.float32)
    allowed = [[5, 33, 63], [0], list(range(V))]
    mask = _pack(allowed)
    assert (mask[2] == -1).all()
    temp = np.zeros(3, np.float32) if greedy else np.ones(3, np.float32)
    for seed in range(20):
        m = md(3, temperature=temp, allowed_token_bitmask=mask, seeds=np.full(3, seed, np.uint32))
        s, ids, lps, _ = sample(logits, m, greedy_only=greedy, use_penalties=False, num_logprobs=4)
        s = np.asarray(s)
        assert s[0] in allowed[0] and s[1] == 0
        if greedy:
            assert s[0] == max(allowed[0], key=lambda t: float(logits[0, t]))
            assert s[2] == int(np.argmax(np.asarray(logits[2])))
        lps, ids = np.asarray(lps), np.asarray(ids)
        # Top logprobs of row 1: the one allowed token at 0.0, the rest -inf.
        assert lps[1, 0] == 0.0 and np.isneginf(lps[1, 2:]).all()
        assert set(ids[0, 1:4].tolist()) == set(allowed[0])


def test_plain_variant_samples_the_same_tokens():
    """The plain sampler (no row wants logprobs, none has a grammar) skips the grammar
    mask and the logprobs but draws exactly the tokens of the full one: greedy, seeded
    random with top-k / top-p, min_tokens bans and penalties alike."""
    from jaxserve.runner.input_batch import CachedRequestState, InputBatch
    from jaxserve.sampling_params import SamplingParams

    r, v = 6, 300
    ib = InputBatch(r, 32, 2, v)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=3, top_k=20),
              SamplingParams(temperature=1.0, seed=4, top_p=0.7), SamplingParams(temperature=0, min_tokens=2,
                                                                                stop_token_ids=[5]),
              SamplingParams(temperature=0.5, seed=9, repetition_penalty=1.3, presence_penalty=0.5),
              SamplingParams(temperature=0)]
    for i, sp in enumerate(params):
        ib.add_request(CachedRequestState(str(i), [1, 5, 7, 9], sp, sp.seed or 0), 0, ([],))
    rows = np.arange(r)
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((r, v)) * 3, jnp.float32)
    for pen in (False, True):
        md = ib.make_sampling_metadata(rows, use_penalties=pen)
        for greedy in (True, False):
            full = sample(logits, md, greedy_only=greedy, use_penalties=pen, num_logprobs=3)
            plain = sample(logits, md, greedy_only=greedy, use_penalties=pen, num_logprobs=3, plain=True)
            np.testing.assert_array_equal(np.asarray(plain[0]), np.asarray(full[0]))
            assert plain[1].shape == (r, 1) and full[1].shape == (r, 4)


@pytest.mark.parametrize("v", [CDF_CHUNK * 4, CDF_CHUNK * 4 + 45, 100])
def test_inverse_cdf_draw_is_the_full_running_total(v):
    """The two-level draw (chunk totals, then inside the picked chunk) picks what one
    running total over the whole vocabulary picks: the first token whose running total
    reaches u * total. Never a zero-weight token: not at u = 1 (rounding in the chunk
    totals), not in the padded tail, not in a row with a single allowed token."""
    rng = np.random.default_rng(v)
    w = rng.random((16, v)).astype(np.float32) * (rng.random((16, v)) < 0.3)
    w[0] = 0.0
    w[0, v - 1] = 2.0  # the only allowed token is the last one
    w[1] = 0.0
    w[1, 3] = 1.0
    w[2, : v // 2] = 0.0  # the first half is masked
    u = rng.random(16).astype(np.float32)
    u[[0, 1, 2, 3]] = 1.0
    u[4] = 1e-9
    got = np.asarray(jax.jit(inverse_cdf_draw)(jnp.asarray(w), jnp.asarray(u)))
    cdf = np.cumsum(w.astype(np.float64), axis=-1)
    want = np.minimum((cdf < (u[:, None] * cdf[:, -1:])).sum(-1), v - 1)
    assert (w[np.arange(16), got] > 0).all()
    assert got[0] == v - 1 and got[1] == 3
    # float32 chunk totals against a float64 running total: equal except where u lands on
    # a boundary within rounding.
    close = np.abs(cdf[np.arange(16), want] - u * cdf[:, -1]) > 1e-4 * cdf[:, -1]
    np.testing.assert_array_equal(got[close], want[close])


def test_sample_from_fast_path_matches_sample():
    """sample_from (the lm_head inside the sampler's branches, and lm_head + argmax alone
    for a greedy, plain step without bans) gives sample's outputs: greedy plain, greedy
    with a min_tokens ban (the general path), random rows, logprobs wanted."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((4, V)) * 3, jnp.float32)
    top = int(np.argmax(np.asarray(logits)[0]))
    cases = [(md(4, temperature=np.zeros(4, np.float32)), True, True),
             (md(4, temperature=np.zeros(4, np.float32), stop_ids_masked=[[top, -1, -1, -1]] + [[-1] * 4] * 3),
              True, True),
             (md(4, temperature=[0.0, 1.0, 0.7, 1.0], top_p=[1.0, 1.0, 0.9, 1.0]), False, True),
             (md(4, temperature=[1.0, 1.0, 1.0, 1.0]), False, False),
             (md(4, temperature=np.zeros(4, np.float32)), True, False)]
    f = jax.jit(lambda lg, m, g, p: sample_from(lambda: lg, m, greedy_only=g, use_penalties=False, num_logprobs=2,
                                                 plain=p))
    for m, greedy, plain in cases:
        want = sample(logits, m, greedy_only=greedy, use_penalties=False, num_logprobs=2, plain=jnp.asarray(plain))
        got = f(logits, m, jnp.asarray(greedy), jnp.asarray(plain))
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    banned = f(logits, cases[1][0], jnp.asarray(True), jnp.asarray(True))[0]
    assert int(banned[0]) != top


def test_logit_bias_adds_exactly_the_bias():  # SA-06
    from jaxserve.sample.sampler import apply_logit_bias

    logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, V)), jnp.float32)
    ids = np.array([[5, 63, -1], [-1, -1, -1], [0, -1, -1]], np.int32)
    vals = np.array([[2.5, -100, 7], [9, 9, 9], [100, 0, 0]], np.float32)
    out = np.asarray(apply_logit_bias(logits, md(3, logit_bias_ids=ids, logit_bias_values=vals)))
    want = np.asarray(logits).copy()
    want[0, 5] += 2.5
    want[0, 63] -= 100
    want[2, 0] += 100
    np.testing.assert_array_equal(out, want)
    # No row biased: the logits as they came (and md without the arrays too).
    none = md(3, logit_bias_ids=np.full((3, 3), -1, np.int32), logit_bias_values=vals)
    np.testing.assert_array_equal(np.asarray(apply_logit_bias(logits, none)), np.asarray(logits))
    assert apply_logit_bias(logits, md(3)) is logits
    # A +100 bias decides a greedy draw, on the fast path's step too.
    tokens = sample_from(lambda: logits, md(3, temperature=np.zeros(3, np.float32), logit_bias_ids=ids,
                                            logit_bias_values=vals),
                         greedy_only=True, use_penalties=False, num_logprobs=0, plain=True)[0]
    assert int(tokens[2]) == 0


def test_token_mask_packing_and_bad_word_tails():  # SA-07, SA-08
    from jaxserve.runner.input_batch import CachedRequestState, InputBatch, pack_token_mask
    from jaxserve.sampling_params import SamplingParams

    allowed = np.zeros(V, np.bool_)
    allowed[[0, 7, 31, 32, 63]] = True
    np.testing.assert_array_equal(pack_token_mask(allowed, 2), _pack([[0, 7, 31, 32, 63]])[0])
    ib = InputBatch(2, 32, 4, V)
    sp = SamplingParams(allowed_token_ids=[3, 4, 5, 9]).replace(_bad_words_token_ids=((4,), (5, 9)))
    i = ib.add_request(CachedRequestState("r", [1, 2], sp, 0), 0, ([0],))

    def allowed_now():
        bits = ib.token_mask(i).view(np.uint32)
        return [t for t in range(V) if (bits[t // 32] >> np.uint32(t % 32)) & 1]

    assert allowed_now() == [3, 5, 9]  # 4 banned always; 9 only after a 5
    ib.token_ids[i, 2] = 5
    ib.num_tokens[i] = 3
    assert allowed_now() == [3, 5]
    ib.remove_request("r")
    assert not ib.token_masks and not ib.bad_word_seqs
