"""The native CPU kernel (pallas_kernels/cpu.py): the reference's contract, its build and its fallbacks."""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import backend, cpu, reference
from rpa_cases import CASES, assert_matches_case, case_batch, make_batch, naive_attention


def test_kernel_builds_here():
    # Every machine of the project's kind has g++: the CPU default depends on this build.
    assert cpu.available(), "the CPU attention kernel did not build (see the warning logged above)"
    assert backend.resolve_backend("auto", "cpu")[0] == "native"


def _native(*args, **kwargs):
    return jax.jit(lambda *a: cpu.ragged_paged_attention(*a, **kwargs))(*args)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name):
    """Every shared case: decode, prefill, mixed and chunked batches, zero-length rows,
    GQA 1-8, head dims 64 / 128, pages of 16-64, f32 and bf16, windows, soft cap; NaN in
    every unused slot and junk rows past num_seqs."""
    assert_matches_case(name, _native(*case_batch(name).args(), **CASES[name].attn_kwargs))


def test_matches_naive_loop_odd_shapes():
    """Head dim 40 (not a multiple of 16: padded vectors), pages of 8, GQA 5, out-of-range
    page-table entries everywhere a request has no page, against the float64 loop."""
    b = make_batch(((3, 30), (1, 9), (20, 20), (1, 1)), num_heads=10, num_kv_heads=2, head_dim=40, page_size=8,
                   garbage_page_table=True)
    kw = dict(sm_scale=40 ** -0.5, sliding_window=11, soft_cap=4.0)
    out = np.asarray(_native(*b.args(), **kw))
    t = sum(q for q, _ in b.seqs)
    np.testing.assert_allclose(out[:t], naive_attention(b, **kw)[:t], atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(out[t:], 0.0)


@pytest.mark.parametrize("window, soft_cap", [(None, None), (40, 3.0)])
def test_many_requests_against_the_naive_loop(window, soft_cap):
    """Enough work items (decode rows, a long chunked prefill, a prefix hit) that each
    reads the slots of all its KV heads at once, bf16 queries and cache: the float64 loop."""
    seqs = [(1, n) for n in (5, 80, 17, 300, 64, 1, 129, 33, 250, 16)] + [(40, 140), (23, 23), (0, 7)]
    b = make_batch(seqs, num_heads=12, num_kv_heads=4, head_dim=64, page_size=16, seed=5)
    kw = dict(sm_scale=0.125, sliding_window=window, soft_cap=soft_cap)
    out = np.asarray(_native(*b.args(), **kw))
    t = sum(q for q, _ in seqs)
    np.testing.assert_allclose(out[:t], naive_attention(b, **kw)[:t], atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(out[t:], 0.0)
    bf = _native(b.q.astype(jnp.bfloat16), b.kv_cache.astype(jnp.bfloat16), *b.args()[2:], **kw)
    assert bf.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(bf.astype(jnp.float32))[:t], naive_attention(b, **kw)[:t], atol=3e-2,
                               rtol=3e-2)


def test_stacked_cache_in_a_layer_scan():
    """[L, P, S, 2K, H] with a traced layer index: each layer reads its own slab in place."""
    name = "smollm_heads_9_3_h64_cap"
    b = case_batch(name)
    kw = CASES[name].attn_kwargs
    stacked = jnp.stack([b.kv_cache * 0.5, b.kv_cache, b.kv_cache * 2.0])

    @jax.jit
    def step(q):
        def body(_, layer):
            return None, cpu.ragged_paged_attention(q, stacked, *b.args()[2:], layer=layer, **kw)

        return jax.lax.scan(body, None, jnp.arange(3))[1]

    out = np.asarray(step(b.q))
    for layer in range(3):
        expected = reference.ragged_paged_attention(b.q, stacked[layer], *b.args()[2:], **kw)
        np.testing.assert_allclose(out[layer], np.asarray(expected), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("cache_dtype", ["bf16_bits", jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_narrow_caches_read_as_the_reference_widens_them(cache_dtype):
    """A bf16 cache, as bf16 or as the CPU runner's uint16 bit patterns, and 8-bit float
    caches (widened through a 256-entry table): the reference on the same cache."""
    name = "mixed_gqa8_h64_p64_window_cap"
    b = case_batch(name)
    kw = CASES[name].attn_kwargs
    if cache_dtype == "bf16_bits":
        cache = jax.lax.bitcast_convert_type(b.kv_cache.astype(jnp.bfloat16), jnp.uint16)
        ref_cache = b.kv_cache.astype(jnp.bfloat16)
    else:
        cache = ref_cache = b.kv_cache.astype(cache_dtype)
    out = _native(b.q, cache, *b.args()[2:], **kw)
    expected = reference.ragged_paged_attention(b.q, ref_cache.astype(jnp.float32), *b.args()[2:], **kw)
    t = sum(q for q, _ in b.seqs)
    np.testing.assert_allclose(np.asarray(out)[:t], np.asarray(expected)[:t], atol=2e-5, rtol=2e-5)


def test_a_row_does_not_depend_on_its_batch():
    """A request's decode output is bit-identical alone and among others (no cross-row
    reduction, and tiles are aligned to key positions, not to the batch). Ten requests
    make items of all KV heads; one alone is split per head (too few items for the
    threads): the same arithmetic either way."""
    seqs = ((1, 50), (1, 300), (1, 17), (1, 129), (1, 1), (1, 64), (1, 65), (1, 200), (1, 33), (1, 16))
    kw = dict(sm_scale=0.125)
    together = make_batch(seqs, num_heads=9, num_kv_heads=3, head_dim=64, page_size=16, seed=3)
    out = np.asarray(_native(*together.args(), **kw))
    for r in range(len(seqs)):
        alone = dict(zip(("q", "kv_cache", "kv_lens", "page_indices", "cu_q_lens", "num_seqs"), together.args()))
        alone["page_indices"] = together.page_indices[r:r + 1]
        alone["kv_lens"] = together.kv_lens[r:r + 1]
        alone["q"] = together.q[r:r + 1]
        alone["cu_q_lens"] = jnp.asarray([0, 1], jnp.int32)
        alone["num_seqs"] = jnp.asarray(1, jnp.int32)
        np.testing.assert_array_equal(np.asarray(_native(*alone.values(), **kw))[0], out[r])


def test_unsupported_dtypes_fall_back_to_the_reference():
    """The native backend hands a float16 cache (or head_dim > 576) to the reference."""
    name = "decode_gqa4_h128_p16"
    b = case_batch(name)
    kw = CASES[name].attn_kwargs
    f16 = b.kv_cache.astype(jnp.float16)
    assert not cpu.supports(b.q, f16) and cpu.supports(b.q, b.kv_cache)
    out = jax.jit(lambda *a: backend.native_or_reference(*a, **kw))(b.q, f16, *b.args()[2:])
    expected = reference.ragged_paged_attention(b.q, f16, *b.args()[2:], **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
    with pytest.raises(ValueError, match="head_dim <= 576"):
        cpu.ragged_paged_attention(jnp.zeros((1, 1, 592)), jnp.zeros((2, 16, 2, 592)), *b.args()[2:], **kw)


def test_no_compiler_means_the_reference(monkeypatch, tmp_path, caplog):
    """Without a C++ compiler (or when the build fails) nothing is cached, a warning says
    why, "auto" on CPU resolves to the reference and an explicit "native" is refused."""
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="pallas_kernels.cpu"):
        assert cpu.library_path() is None
    assert "falling back to the reference kernel" in caplog.text
    assert list(tmp_path.iterdir()) == []  # no half-written library left behind
    monkeypatch.setattr(cpu, "available", lambda: False)
    assert backend.resolve_backend("auto", "cpu")[0] == "reference"
    with pytest.raises(ValueError, match="native.*did not build"):
        backend.resolve_backend("native", "cpu")
    with pytest.raises(ValueError, match="CPU only"):
        backend.resolve_backend("native", "tpu")


def test_build_is_cached_per_source_and_machine(monkeypatch, tmp_path):
    """One build per (source, compiler, flags, CPU flags): the second call reuses it."""
    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path))
    first = cpu.library_path()
    assert first is not None and first.parent == tmp_path
    mtime = first.stat().st_mtime_ns
    assert cpu.library_path() == first and first.stat().st_mtime_ns == mtime
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"sse2"}))  # another machine
    assert cpu.library_path() != first
