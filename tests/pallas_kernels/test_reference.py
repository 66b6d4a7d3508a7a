"""The jnp reference (the oracle of every kernel) against a naive float64 loop."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference
from rpa_cases import CASES, case_batch, make_batch, naive_attention, reference_attention


@pytest.fixture(params=["split", "one_pass"])
def path(request, monkeypatch):
    """Both ways the reference attends: this step's tokens and the prefix apart (prefill-
    sized steps), or one paged pass. Forced by the size threshold; a fresh jit of each."""
    import jax

    monkeypatch.setattr(reference, "_SPLIT_TOKENS", 0 if request.param == "split" else 10**9)
    jax.clear_caches()
    fn = jax.jit(reference.ragged_paged_attention, static_argnames=("sm_scale", "sliding_window", "soft_cap"))

    def attend(*args, **kw):
        with jax.default_matmul_precision("highest"):
            return fn(*args, **kw)

    yield attend
    jax.clear_caches()


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_matches_naive_loop(name, path):
    case = CASES[name]
    b = case_batch(name)
    expected = naive_attention(b, **case.attn_kwargs)
    out = np.asarray(path(*b.args(), **case.attn_kwargs).astype(jnp.float32))
    if case.dtype == jnp.bfloat16:
        np.testing.assert_allclose(out, expected, atol=3e-2, rtol=3e-2)
    else:
        np.testing.assert_allclose(out, expected, atol=2e-6, rtol=1e-5)
    t_valid = sum(q for q, _ in b.seqs)
    assert np.all(out[t_valid:] == 0.0) and not np.isnan(out).any()


def test_reference_ignores_rows_past_num_seqs():
    b = make_batch([(2, 9), (1, 20)], pad_tokens=5, pad_seqs=3)
    out = reference_attention(*b.args(), sm_scale=0.1)
    out2 = reference_attention(
        b.q, b.kv_cache, b.kv_lens.at[2:].set(1000), b.page_indices.at[2:].set(0), b.cu_q_lens.at[3:].set(1),
        b.num_seqs, sm_scale=0.1,
    )
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out2))


def test_write_kv_cache_scatters_interleaved_rows():
    rng = np.random.default_rng(0)
    cache = jnp.zeros((4, 8, 6, 16), jnp.float32)
    k = jnp.asarray(rng.standard_normal((5, 3, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((5, 3, 16)), jnp.float32)
    slots = jnp.asarray([8, 9, 31, 17, 0], jnp.int32)
    out = np.asarray(reference.write_kv_cache(cache, k, v, slots))
    for t, slot in enumerate(np.asarray(slots)):
        np.testing.assert_array_equal(out[slot // 8, slot % 8, 0::2], np.asarray(k[t]))
        np.testing.assert_array_equal(out[slot // 8, slot % 8, 1::2], np.asarray(v[t]))
    assert np.count_nonzero(np.abs(out).sum(axis=(2, 3))) == 5


def _attend_counting(monkeypatch, helper, b, kw, **budgets):
    """The reference on batch ``b`` with ``budgets`` patched in, jitted afresh, checked
    against the naive loop; returns what ``helper`` (a chunk-size function) returned at
    trace time."""
    import jax

    for k, v in budgets.items():
        monkeypatch.setattr(reference, k, v)
    chunks = []
    real = getattr(reference, helper)
    monkeypatch.setattr(reference, helper, lambda *a: chunks.append(real(*a)) or chunks[-1])
    jax.clear_caches()  # traces of the same function are shared across jit objects
    fn = jax.jit(reference.ragged_paged_attention, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
    with jax.default_matmul_precision("highest"):
        out = np.asarray(fn(*b.args(), **kw))
    np.testing.assert_allclose(out, naive_attention(b, **kw), atol=2e-6, rtol=1e-5)
    return chunks


# Decode-sized batches (no more tokens than rows): 7 tokens of 7 rows, 32 KiB pages; 11
# tokens of 14 rows, multi-token requests, a window, 32 KiB pages, a garbage page table.
_DECODE = dict(seqs=[(1, 5), (1, 33), (0, 9), (1, 300), (1, 16)], num_heads=8, num_kv_heads=2, head_dim=128)
_WINDOW = dict(seqs=[(5, 20), (1, 9), (3, 3), (0, 4), (1, 150)], pad_seqs=9, pad_tokens=1, head_dim=128,
               garbage_page_table=True)


@pytest.mark.parametrize("pair_bytes, expected", [(1, 1), (3 << 16, 4), (1 << 30, None)])
@pytest.mark.parametrize("batch, window", [(_DECODE, None), (_WINDOW, 40)])
def test_reference_decode_with_fewer_pairs_per_iteration(monkeypatch, batch, window, pair_bytes, expected):
    """Decode-sized steps gather (token, page) pairs, as many per iteration as
    pairs_per_chunk allows; the result must not depend on it (a token's pairs span
    iterations)."""
    b = make_batch(**batch)
    assert b.q.shape[0] <= b.page_indices.shape[0]
    kw = dict(sm_scale=0.125, sliding_window=window, soft_cap=None)
    if expected is None:  # no byte limit: 4 pairs per token, to a power of two (16 and 32 here)
        expected = 1 << (4 * b.q.shape[0]).bit_length() - 1
    assert _attend_counting(monkeypatch, "pairs_per_chunk", b, kw, _PAIR_BYTES=pair_bytes) == [expected]


@pytest.mark.parametrize("chunk_bytes", [1, 1 << 20])  # 1 page, then 2-4 pages per iteration
def test_reference_with_fewer_pages_per_iteration(monkeypatch, chunk_bytes):
    """Blocks of queries gather fewer pages per loop iteration when many blocks share
    one (pages_per_chunk); the result must not depend on it."""
    name = "prefill_mha_h64_p32"
    chunks = _attend_counting(monkeypatch, "pages_per_chunk", case_batch(name), CASES[name].attn_kwargs,
                              _CHUNK_BYTES=chunk_bytes, _SPLIT_TOKENS=10**9)
    assert chunks == [1 if chunk_bytes == 1 else 2]


def test_pages_per_chunk():
    # 64 decode rows x 16 tokens x 6 rows x 64 dims x 4 bytes = 1.5 MiB per page: 2 pages fit 4 MiB.
    assert reference.pages_per_chunk(64, 16, 6, 64, pmax=128) == 2
    assert reference.pages_per_chunk(1, 16, 6, 64, pmax=128) == 8  # capped at _PAGES_PER_CHUNK
    assert reference.pages_per_chunk(1, 16, 6, 64, pmax=3) == 2  # and at the table width
    assert reference.pages_per_chunk(512, 16, 16, 128, pmax=128) == 1  # never below one page


def test_pairs_per_chunk():
    # SmolLM2: 16 x 6 x 64 x 4 bytes = 24 KiB per page; 64 pairs fit 2 MiB.
    assert reference.pairs_per_chunk(64, 16, 6, 64) == 64
    assert reference.pairs_per_chunk(8, 16, 6, 64) == 32  # 4 per token
    assert reference.pairs_per_chunk(1, 16, 6, 64) == 4
    assert reference.pairs_per_chunk(64, 16, 16, 128) == 16  # 128 KiB pages
    assert reference.pairs_per_chunk(64, 64, 64, 256) == 1  # never below one pair


@pytest.mark.parametrize("window", [None, 10])
def test_reference_long_steps_many_tiles_and_groups(window, path):
    """More tiles than one group holds (tiles of this step's tokens) and more blocks than
    one group (prefix blocks); a window shorter than a tile run: the reach bound."""
    seqs = [(600, 600), (1, 50), (40, 300), (1, 1), (70, 90)] + [(1, 20 + 7 * i) for i in range(12)]
    b = make_batch(seqs, num_heads=4, num_kv_heads=2, head_dim=32, page_size=16)
    kw = dict(sm_scale=32**-0.5, sliding_window=window)
    out = np.asarray(path(*b.args(), **kw))
    np.testing.assert_allclose(out, naive_attention(b, **kw), atol=2e-6, rtol=1e-5)


def test_reference_decode_sized_step_with_multi_token_requests():
    """No more tokens than rows (the one-pass path): requests of several queries still
    see exactly the keys up to their own positions."""
    b = make_batch([(5, 20), (1, 9), (3, 3), (0, 4)], pad_seqs=10, pad_tokens=2)
    assert b.q.shape[0] <= b.page_indices.shape[0]
    kw = dict(sm_scale=0.125, sliding_window=4)
    np.testing.assert_allclose(np.asarray(reference_attention(*b.args(), **kw)), naive_attention(b, **kw),
                               atol=2e-6, rtol=1e-5)
