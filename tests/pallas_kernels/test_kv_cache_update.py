"""The Pallas KV-cache write kernel against reference.write_kv_cache (pages >= 1)."""
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import kv_cache_update, reference


@pytest.mark.parametrize(
    "interpret, num_tokens, dtype",
    [(True, 300, jnp.float32), (True, 37, jnp.bfloat16), (pltpu.InterpretParams(detect_races=True), 21, jnp.float32)],
    ids=["legacy_multi_block", "legacy_bf16", "checked"],
)
def test_write_kv_cache_matches_reference(interpret, num_tokens, dtype):
    rng = np.random.default_rng(num_tokens)
    num_pages, page_size, k_heads, head_dim = 40, 16, 2, 64
    cache = jnp.asarray(rng.standard_normal((num_pages, page_size, 2 * k_heads, head_dim)), dtype)
    k = jnp.asarray(rng.standard_normal((num_tokens, k_heads, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((num_tokens, k_heads, head_dim)), dtype)
    slots = rng.permutation(np.arange(page_size, num_pages * page_size))[:num_tokens].astype(np.int32)
    slots[-4:] = [0, 3, 0, 5]  # padded tokens write the null page (skipped by the kernel)
    slots = jnp.asarray(slots)
    expected = np.asarray(reference.write_kv_cache(cache, k, v, slots).astype(jnp.float32))
    out = kv_cache_update.write_kv_cache(jnp.array(cache), k, v, slots, interpret=interpret)
    out = np.asarray(out.astype(jnp.float32))
    np.testing.assert_array_equal(out[1:], expected[1:])
    np.testing.assert_array_equal(out[0], np.asarray(cache[0].astype(jnp.float32)))


def test_write_kv_cache_into_a_stacked_cache():
    rng = np.random.default_rng(1)
    cache = jnp.asarray(rng.standard_normal((3, 10, 16, 4, 64)), jnp.float32)  # [L, P, S, 2K, H]
    k = jnp.asarray(rng.standard_normal((7, 2, 64)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((7, 2, 64)), jnp.float32)
    slots = jnp.asarray(rng.permutation(np.arange(16, 160))[:7].astype(np.int32))
    expected = np.asarray(reference.write_kv_cache(cache, k, v, slots, layer=2))
    out = kv_cache_update.write_kv_cache(jnp.array(cache), k, v, slots, layer=jnp.int32(2),
                                         interpret=pltpu.InterpretParams(detect_races=True))
    np.testing.assert_array_equal(np.asarray(out), expected)
