"""Matmul weights in a narrower dtype than the activations (``weight_dtype``): the
product's form, the scan-safe bit patterns, and what ``auto`` resolves to."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner import dtypes
from models.quantization import matmul, scan_safe


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((5, 24)), jnp.float32),
            jnp.asarray(rng.standard_normal((24, 40)), jnp.float32))


def test_bf16_weight_rounds_the_input_and_accumulates_in_f32():
    x, w = _arrays()
    wb = w.astype(jnp.bfloat16)
    out = matmul(x, wb)
    assert out.dtype == jnp.float32 and out.shape == (5, 40)
    want = np.asarray(x.astype(jnp.bfloat16), np.float32) @ np.asarray(wb, np.float32)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    # The transposed form ([out, in], a tied lm_head) is the same product.
    np.testing.assert_allclose(np.asarray(matmul(x, wb.T, transposed=True)), np.asarray(out), rtol=1e-6, atol=1e-6)
    # One row (padded to 4 on CPU) and a bare vector give that row of the product.
    for one in (x[:1], x[0]):
        got = matmul(one, wb)
        assert got.shape == one.shape[:-1] + (40,)
        np.testing.assert_allclose(np.asarray(got).reshape(-1), want[0], rtol=1e-5, atol=1e-5)
    # bf16 activations keep their dtype (the product still accumulates in f32).
    assert matmul(x.astype(jnp.bfloat16), wb).dtype == jnp.bfloat16


def test_same_dtype_float32_is_the_plain_product():
    x, w = _arrays(1)
    np.testing.assert_array_equal(np.asarray(matmul(x, w)), np.asarray(x @ w))
    np.testing.assert_array_equal(np.asarray(matmul(x, w.T, transposed=True)), np.asarray(x @ w))


def test_scan_safe_round_trip_is_bit_exact_and_leaves_other_dtypes():
    x, w = _arrays(2)
    tree = {"w": w.astype(jnp.bfloat16), "norm": x, "q": jnp.ones((3,), jnp.int8)}
    bits = scan_safe(tree)
    assert bits["w"].dtype == jnp.uint16 and bits["norm"].dtype == jnp.float32 and bits["q"].dtype == jnp.int8
    back = scan_safe(bits, restore=True)
    assert back["w"].dtype == jnp.bfloat16
    bits_of = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint16))
    np.testing.assert_array_equal(bits_of(back["w"]), bits_of(tree["w"]))
    np.testing.assert_array_equal(np.asarray(bits["w"]), bits_of(tree["w"]))


def test_scan_over_bit_patterns_matches_scan_over_bf16():
    rng = np.random.default_rng(3)
    stack = jnp.asarray(rng.standard_normal((4, 16, 16)) * 0.2, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((3, 16)), jnp.float32)

    def run(weights, restore):
        def body(h, w):
            return jnp.tanh(matmul(h, scan_safe(w, restore=True) if restore else w)), None
        return jax.lax.scan(body, x, weights)[0]

    np.testing.assert_array_equal(np.asarray(jax.jit(run, static_argnums=1)(scan_safe(stack), True)),
                                  np.asarray(jax.jit(run, static_argnums=1)(stack, False)))


@pytest.mark.parametrize("native", [True, False])
def test_auto_picks_bf16_weights_only_on_a_cpu_that_multiplies_bf16(monkeypatch, native):
    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: native)
    want = jnp.bfloat16 if native else jnp.float32
    assert dtypes.resolve_weight_dtype("auto", "auto", "cpu") == want
    assert dtypes.resolve_dtype("auto", "cpu") == jnp.float32  # the activations stay float32
    # An explicit dtype means it for the weights too; an explicit weight_dtype wins.
    assert dtypes.resolve_weight_dtype("auto", "float32", "cpu") == jnp.float32
    assert dtypes.resolve_weight_dtype("bfloat16", "float32", "cpu") == jnp.bfloat16
    assert dtypes.resolve_weight_dtype("float32", "auto", "cpu") == jnp.float32
    # Accelerators: bf16 throughout under auto.
    assert dtypes.resolve_weight_dtype("auto", "auto", "gpu") == jnp.bfloat16


def test_bad_weight_dtype_is_refused_naming_the_field():
    from jaxserve.config import ModelConfig

    with pytest.raises(ValueError, match="weight_dtype"):
        ModelConfig(model="/nonexistent", weight_dtype="int4")
    with pytest.raises(ValueError, match="weight_dtype"):
        dtypes.resolve_weight_dtype("int4", "auto", "cpu")


def test_cpu_flag_detection_reads_proc_cpuinfo(tmp_path, monkeypatch):
    import builtins

    real_open = builtins.open
    for flags, want in (("fpu avx2 avx512f amx_bf16 amx_tile", True), ("fpu avx2 avx512f avx512_bf16", True),
                        ("fpu avx2 fma", False)):
        info = tmp_path / "cpuinfo"
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        monkeypatch.setattr(builtins, "open", lambda p, *a, **k: real_open(info if p == "/proc/cpuinfo" else p, *a, **k))
        dtypes.cpu_has_native_bf16.cache_clear()
        try:
            assert dtypes.cpu_has_native_bf16() is want
        finally:
            monkeypatch.setattr(builtins, "open", real_open)
            dtypes.cpu_has_native_bf16.cache_clear()
