"""Factories for ragged paged-attention test batches and a naive float64 oracle."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import cpu, gpu, reference, tpu


@dataclasses.dataclass(frozen=True, kw_only=True)
class Batch:
    q: jnp.ndarray  # [T, N, H]
    kv_cache: jnp.ndarray  # [P, S, 2K, H]
    kv_lens: jnp.ndarray  # [R] int32
    page_indices: jnp.ndarray  # [R, Pmax] int32
    cu_q_lens: jnp.ndarray  # [R+1] int32
    num_seqs: jnp.ndarray  # [] int32
    seqs: tuple  # ((q_len, kv_len), ...) of the valid rows

    def args(self):
        return (self.q, self.kv_cache, self.kv_lens, self.page_indices, self.cu_q_lens, self.num_seqs)


def make_batch(
    seqs,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    page_size: int = 16,
    dtype=jnp.float32,
    pad_tokens: int = 3,
    pad_seqs: int = 2,
    spare_pages: int = 3,
    extra_pages_per_seq: int = 1,
    garbage_page_table: bool = False,
    seed: int = 0,
    latent: bool = False,
) -> Batch:
    """A batch of requests ``seqs = [(q_len, kv_len), ...]`` over a shuffled paged cache.

    Unused cache slots (page 0, spare pages, the tail of each last page) hold NaN; page
    tables use a random permutation of pages; padded tokens and rows past num_seqs hold
    junk that must not matter. ``garbage_page_table`` fills unused page-table entries
    with out-of-range page ids (a kernel must never fetch them). ``latent``: MLA's
    layout, one row per slot that is both key and value (num_kv_heads is ignored).
    """
    rng = np.random.default_rng(seed)
    seqs = tuple((int(a), int(b)) for a, b in seqs)
    n_pages = [pl.cdiv(kv, page_size) for _, kv in seqs]
    pmax = max([1, *n_pages]) + extra_pages_per_seq
    num_pages = 1 + sum(n_pages) + spare_pages
    perm = rng.permutation(np.arange(1, num_pages))
    rows = 1 if latent else 2 * num_kv_heads
    cache = np.full((num_pages, page_size, rows, head_dim), np.nan, np.float32)
    r = len(seqs) + pad_seqs
    page_indices = rng.integers(0, num_pages, size=(r, pmax)).astype(np.int32)
    if garbage_page_table:
        page_indices = rng.integers(10**6, 2 * 10**6, size=(r, pmax)).astype(np.int32)
    pos = 0
    for i, (_, kv) in enumerate(seqs):
        pages = perm[pos : pos + n_pages[i]]
        pos += n_pages[i]
        page_indices[i, : len(pages)] = pages
        for j in range(kv):
            cache[pages[j // page_size], j % page_size] = rng.standard_normal((rows, head_dim))
    q_lens = [a for a, _ in seqs]
    cu = np.zeros(r + 1, np.int32)
    cu[1 : len(seqs) + 1] = np.cumsum(q_lens)
    t_valid = int(cu[len(seqs)])
    # Rows past num_seqs: plausible-looking junk (monotone offsets, random lengths).
    cu[len(seqs) + 1 :] = t_valid + rng.integers(0, 3, size=pad_seqs).cumsum()
    kv_lens = np.zeros(r, np.int32)
    kv_lens[: len(seqs)] = [kv for _, kv in seqs]
    kv_lens[len(seqs) :] = rng.integers(1, pmax * page_size + 1, size=pad_seqs)
    t = t_valid + pad_tokens
    q = rng.standard_normal((t, num_heads, head_dim)).astype(np.float32)
    return Batch(
        q=jnp.asarray(q, dtype),
        kv_cache=jnp.asarray(cache, dtype),
        kv_lens=jnp.asarray(kv_lens),
        page_indices=jnp.asarray(page_indices),
        cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.asarray(len(seqs), jnp.int32),
        seqs=seqs,
    )


def naive_attention(batch: Batch, *, sm_scale, sliding_window=None, soft_cap=None, sinks=None,
                    keys_ahead=None) -> np.ndarray:
    """Float64 loop over requests and tokens: the oracle of the reference. ``sinks`` [N]:
    one more logit per head in each softmax, with no value (HF's GPT-OSS attention);
    ``keys_ahead`` [T]: token t sees keys up to its position + keys_ahead[t] (Gemma 3's
    images), its window still starting from its own position."""
    q = np.asarray(batch.q, np.float64)
    cache = np.asarray(jnp.asarray(batch.kv_cache, jnp.float32), np.float64)
    page_indices = np.asarray(batch.page_indices)
    cu = np.asarray(batch.cu_q_lens)
    t, n, h = q.shape
    _, page_size, two_k, _ = cache.shape
    pair = 1 if two_k == 1 else 2  # one latent row: the key and the value
    k_heads = two_k // pair
    groups = n // k_heads
    out = np.zeros((t, n, h))
    for r, (q_len, kv_len) in enumerate(batch.seqs):
        slots = [(page_indices[r, j // page_size], j % page_size) for j in range(kv_len)]
        keys = np.stack([cache[p, o, 0::pair] for p, o in slots]) if slots else np.zeros((0, k_heads, h))
        vals = np.stack([cache[p, o, pair - 1::pair] for p, o in slots]) if slots else np.zeros((0, k_heads, h))
        for i in range(q_len):
            tok = cu[r] + i
            pos = kv_len - q_len + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            if pos < lo:
                continue
            hi = pos + (0 if keys_ahead is None else int(keys_ahead[tok]))
            for head in range(n):
                kh = head // groups
                s = keys[lo : hi + 1, kh] @ q[tok, head] * sm_scale
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                top = s.max() if sinks is None else max(s.max(), float(sinks[head]))
                p = np.exp(s - top)
                denom = p.sum() + (0.0 if sinks is None else np.exp(float(sinks[head]) - top))
                out[tok, head] = p @ vals[lo : hi + 1, kh] / denom
    return out


# Every kernel with the reference's signature: the Pallas ones interpreted.
KERNELS = {
    "reference": reference.ragged_paged_attention,
    "native": cpu.ragged_paged_attention,
    "gpu": functools.partial(gpu.ragged_paged_attention, interpret=True),
    "tpu": functools.partial(tpu.ragged_paged_attention, interpret=True),
}


def run_kernel(kernel: str, batch: Batch, **kw) -> np.ndarray:
    """KERNELS[kernel] on ``batch`` (jitted; ``kw``: its keyword arguments, arrays
    included) with f32 matmuls in full precision, as numpy."""
    with jax.default_matmul_precision("highest"):
        return np.asarray(jax.jit(lambda *a: KERNELS[kernel](*a, **kw))(*batch.args()))


# The reference, jitted (eager dispatch of its loop costs seconds per call).
_reference_jit = jax.jit(reference.ragged_paged_attention, static_argnames=("sm_scale", "sliding_window", "soft_cap"))


def reference_attention(*args, **kwargs):
    """The reference with f32 matmuls in full precision (GPUs default to TF32)."""
    with jax.default_matmul_precision("highest"):
        return _reference_jit(*args, **kwargs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    seqs: tuple  # ((q_len, kv_len), ...)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: object = jnp.float32
    sliding_window: int | None = None
    soft_cap: float | None = None

    @property
    def attn_kwargs(self):
        return dict(sm_scale=self.head_dim**-0.5, sliding_window=self.sliding_window, soft_cap=self.soft_cap)


# Shared by the reference, TPU and GPU tests. Together: decode-only, prefill-only, mixed
# and chunked batches, zero-length rows, sequences over many pages (more than one kv
# block), GQA 1/2/3/4/8, head dims 64/128, page sizes 16/32/64, f32 and bf16,
# sliding window and soft cap.
CASES = {
    "decode_gqa4_h128_p16": Case(
        seqs=((1, 5), (1, 33), (0, 9), (1, 300), (1, 16)), num_heads=8, num_kv_heads=2, head_dim=128, page_size=16),
    "prefill_mha_h64_p32": Case(
        seqs=((12, 12), (30, 30), (1, 1), (45, 45)), num_heads=2, num_kv_heads=2, head_dim=64, page_size=32),
    "mixed_gqa8_h64_p64_window_cap": Case(
        seqs=((7, 40), (1, 70), (20, 20), (0, 0), (33, 99), (1, 200)), num_heads=8, num_kv_heads=1, head_dim=64,
        page_size=64, sliding_window=24, soft_cap=7.5),
    "mixed_gqa4_h128_p16_bf16": Case(
        seqs=((1, 50), (17, 80), (0, 3), (40, 40), (1, 1)), num_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
        dtype=jnp.bfloat16),
    "chunked_long_mha_p64_bf16_window": Case(
        seqs=((70, 700), (1, 129)), num_heads=4, num_kv_heads=4, head_dim=64, page_size=64, dtype=jnp.bfloat16,
        sliding_window=256),
    "smollm_heads_9_3_h64_cap": Case(
        seqs=((5, 21), (1, 64), (16, 16)), num_heads=9, num_kv_heads=3, head_dim=64, page_size=16, soft_cap=20.0),
    "decode_gqa4_p32_bf16_window": Case(
        seqs=((1, 100), (1, 7), (1, 260)), num_heads=4, num_kv_heads=1, head_dim=64, page_size=32, dtype=jnp.bfloat16,
        sliding_window=50),
}


def tolerance(dtype):
    """(atol, rtol) against the reference, as in JAX's own kernel tests."""
    return (3e-2, 3e-2) if jnp.dtype(dtype) == jnp.bfloat16 else (2e-5, 2e-5)


@functools.lru_cache(maxsize=None)
def case_batch(name: str) -> Batch:
    c = CASES[name]
    return make_batch(
        c.seqs, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        page_size=c.page_size, dtype=c.dtype, seed=sum(map(ord, name)),
    )


@functools.lru_cache(maxsize=None)
def case_expected(name: str) -> np.ndarray:
    """The reference output of a case (float32 numpy), computed once per session."""
    out = reference_attention(*case_batch(name).args(), **CASES[name].attn_kwargs)
    return np.asarray(out.astype(jnp.float32))


def assert_matches_case(name: str, out) -> None:
    """Kernel output vs the reference; padded tokens exactly zero; no NaN."""
    b = case_batch(name)
    out = np.asarray(jnp.asarray(out).astype(jnp.float32))
    assert out.shape == b.q.shape
    assert not np.isnan(out).any()
    t_valid = sum(q for q, _ in b.seqs)
    np.testing.assert_array_equal(out[t_valid:], 0.0)
    atol, rtol = tolerance(CASES[name].dtype)
    np.testing.assert_allclose(out, case_expected(name), atol=atol, rtol=rtol)
