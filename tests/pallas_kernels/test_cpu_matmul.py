"""The native bf16 product for few rows (pallas_kernels/cpu_matmul.py): XLA's product, row
by row independent of the batch, and where it is (not) used."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.quantization import matmul, native_products
from pallas_kernels import cpu_matmul
from pallas_kernels.cpu import cpu_flags
from pallas_kernels.storage import to_bf16_bits

HAS_BF16 = "avx512_bf16" in cpu_flags()
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="the kernel needs AVX512-BF16 (this CPU has none: XLA's dot "
                                                     "serves, covered by test_not_used_without_avx512_bf16)")


def _xla(x, w):
    return jax.lax.dot_general(x.astype(jnp.bfloat16), w, (((x.ndim - 1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)


def _inputs(m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32).astype(jnp.bfloat16)
    return x, w


@needs_bf16
def test_enabled_on_this_cpu():
    """On where it is preferred (AVX512-BF16 without AMX); built either way."""
    assert cpu_matmul._registered(), "the bf16 matmul kernel did not build (see the warning logged above)"
    assert cpu_matmul.enabled() == cpu_matmul.preferred_on(cpu_flags())
    assert not cpu_matmul.preferred_on({"avx512_bf16", "amx_bf16"}) and cpu_matmul.preferred_on({"avx512_bf16"})


@needs_bf16
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("m,k,n", [(1, 3, 5), (7, 33, 70), (64, 576, 960), (13, 1536, 576), (6, 64, 64),
                                   (128, 577, 129), (5, 2, 1000), (9, 95, 67)])
def test_matches_xla_product(m, k, n, transposed):
    """Odd K (the last pair padded; transposed: a tail of fewer than 32 k), N not a
    multiple of the 64-column blocks, M not a multiple of the row tiles: XLA's product of
    x rounded to bf16, within float32 rounding of the accumulation order, and exact
    against float64 to that rounding. ``transposed``: w given as [N, K] (the tied lm_head)."""
    x, w = _inputs(m, k, n)
    got = np.asarray(jax.jit(lambda x, w: cpu_matmul.matmul_bf16(x, w, transposed))(x, w.T if transposed else w))
    want = np.asarray(jax.jit(_xla)(x, w))
    exact = np.asarray(x.astype(jnp.bfloat16), np.float64) @ np.asarray(w, np.float64)
    scale = np.abs(np.asarray(x.astype(jnp.bfloat16), np.float64)) @ np.abs(np.asarray(w, np.float64))
    tol = 2 * k * np.finfo(np.float32).eps * scale + 1e-30
    assert (np.abs(got - exact) <= tol).all() and (np.abs(want - exact) <= tol).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=float(tol.max()))


@needs_bf16
def test_bits_and_leading_axes():
    """The weight as its uint16 bit patterns (the CPU layer scan's storage) gives the
    same result; x [..., K] keeps its leading axes."""
    x, w = _inputs(12, 40, 72)
    x3 = x.reshape(3, 4, 40)
    got = jax.jit(cpu_matmul.matmul_bf16)(x3, to_bf16_bits(w))
    assert got.shape == (3, 4, 72)
    np.testing.assert_array_equal(np.asarray(got).reshape(12, 72), np.asarray(jax.jit(cpu_matmul.matmul_bf16)(x, w)))


@needs_bf16
@pytest.mark.parametrize("transposed", [False, True])
def test_a_row_does_not_depend_on_the_batch(transposed):
    """Row i alone, among 63 others, or among 127: bitwise the same (k in one fixed order)."""
    x, w = _inputs(128, 576, 960, seed=3)
    if transposed:
        w = w.T
    f = jax.jit(lambda x, w: cpu_matmul.matmul_bf16(x, w, transposed))
    full = np.asarray(f(x, w))
    np.testing.assert_array_equal(np.asarray(f(x[:64], w)), full[:64])
    for i in (0, 5, 63, 127):
        np.testing.assert_array_equal(np.asarray(f(x[i:i + 1], w))[0], full[i])


@needs_bf16
def test_matmul_uses_it_only_where_asked_and_small():
    """models.quantization.matmul: the custom call under native_products(True) for float32
    x bf16 of at most MAX_ROWS rows (MAX_TRANSPOSED_ROWS with the weight transposed: the
    tied lm_head); XLA's dot for more rows, float32 weights, or outside native_products."""
    def hlo(x, w, native, transposed=False):
        def f(x, w):
            with native_products(native):
                return matmul(x, w, transposed=transposed)
        return jax.jit(f).lower(x, w).as_text()

    x, w = _inputs(cpu_matmul.MAX_ROWS, 64, 96)
    assert cpu_matmul.TARGET in hlo(x, w, True)
    assert cpu_matmul.TARGET not in hlo(x, w, False)
    big, _ = _inputs(cpu_matmul.MAX_ROWS + 1, 64, 96)
    assert cpu_matmul.TARGET not in hlo(big, w, True)
    assert cpu_matmul.TARGET not in hlo(x, w.T, True, transposed=True)
    few, _ = _inputs(cpu_matmul.MAX_TRANSPOSED_ROWS, 64, 96)
    assert cpu_matmul.TARGET in hlo(few, w.T, True, transposed=True)
    assert cpu_matmul.TARGET not in hlo(x, w.astype(jnp.float32), True)


def test_not_used_without_avx512_bf16(monkeypatch):
    """Without AVX512-BF16 (an AVX2-only CPU) or with JAXSERVE_NATIVE_MATMUL=0 the kernel
    is never enabled (XLA's dot serves), whatever else holds."""
    monkeypatch.setattr(cpu_matmul, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    cpu_matmul.enabled.cache_clear()
    try:
        assert not cpu_matmul.enabled()
        monkeypatch.setattr(cpu_matmul, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
        monkeypatch.setenv("JAXSERVE_NATIVE_MATMUL", "0")
        cpu_matmul.enabled.cache_clear()
        assert not cpu_matmul.enabled()
    finally:
        cpu_matmul.enabled.cache_clear()
