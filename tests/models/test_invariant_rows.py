"""Batch-invariant mode's pieces (models/batch_invariance.py): a row's product, norm and
log-softmax do not depend on how many rows share the call or where the row sits."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.sample.sampler import compute_logprobs
from models import batch_invariance
from models.llama import rms_norm
from models.quantization import invariant_matmul, matmul, native_products

RNG = np.random.default_rng(0)
ROWS = (1, 2, 5, 64, 65, 130, 4100)


def _row_everywhere(fn, width, *, invariant=True, native=False):
    """fn's result for one row placed at several positions among 0..4099 other rows
    (jitted once per row count) -> list of results, the first computed alone."""
    target = jnp.asarray(RNG.standard_normal(width), jnp.float32)

    def traced(x):
        with native_products(native, invariant):
            return fn(x)

    f = jax.jit(traced)
    got = []
    for m in ROWS:
        x = jnp.asarray(RNG.standard_normal((m, width)), jnp.float32)
        pos = m // 2
        got.append(np.asarray(f(x.at[pos].set(target)))[pos])
    return got


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_products_per_row(dtype, transposed):
    w = jnp.asarray(RNG.standard_normal((96, 576) if transposed else (576, 96)) * 0.05, dtype)
    got = _row_everywhere(lambda x: matmul(x, w, transposed=transposed), 576)
    for g in got[1:]:
        np.testing.assert_array_equal(g, got[0])
    # The same product as the default mode's, to rounding.
    x = jnp.asarray(RNG.standard_normal((7, 576)), jnp.float32)
    np.testing.assert_allclose(invariant_matmul(x, w, transposed=transposed), matmul(x, w, transposed=transposed),
                               rtol=1e-5, atol=1e-5)


def test_native_products_per_row():
    from pallas_kernels import cpu_matmul

    if not cpu_matmul._registered():
        pytest.skip("no AVX512-BF16 here: the tile path above covers this CPU")
    w = jnp.asarray(RNG.standard_normal((576, 192)) * 0.05, jnp.bfloat16)
    got = _row_everywhere(lambda x: matmul(x, w), 576, native=True)
    for g in got[1:]:
        np.testing.assert_array_equal(g, got[0])


def test_rms_norm_and_logprobs_per_row():
    w = jnp.asarray(RNG.standard_normal(576), jnp.float32)
    for got in (_row_everywhere(lambda x: rms_norm(x, w, 1e-5), 576),
                _row_everywhere(lambda x: compute_logprobs(x * 4, jnp.zeros(len(x), jnp.int32), 2)[1], 1000)):
        for g in got[1:]:
            np.testing.assert_array_equal(g, got[0])


def test_rowwise_is_the_function_outside_the_mode():
    x = jnp.asarray(RNG.standard_normal((3, 5, 7)), jnp.float32)
    assert not batch_invariance.active()
    np.testing.assert_array_equal(batch_invariance.rowwise(jax.nn.softmax, x), jax.nn.softmax(x))
    with batch_invariance.invariant(True):
        tiled = batch_invariance.rowwise(jax.nn.softmax, x)
    assert tiled.shape == x.shape
    np.testing.assert_allclose(tiled, jax.nn.softmax(x), rtol=1e-6)
