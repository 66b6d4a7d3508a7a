"""Multi-head Latent Attention's cache layout (DeepSeek): one row per token, [P, S, 1, H],
that is both the key and the value of every query head (inputs.rows_per_kv_head). Every
kernel (the reference's three paths, the native CPU kernel, the GPU and TPU Pallas
kernels interpreted) against the float64 loop, and both KV writes."""
import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu, kv_cache_update, reference
from rpa_cases import KERNELS, make_batch, naive_attention, run_kernel

# decode-sized (the (token, page) pairs), mixed with a window (one pass over the pages),
# and a step of >= 512 tokens (this step's tiles and the cached prefix, merged).
BATCHES = {
    "decode": dict(seqs=((1, 40), (1, 7), (1, 130), (1, 1)), pad_tokens=0, pad_seqs=3),
    "mixed": dict(seqs=((7, 40), (1, 70), (20, 20), (0, 0), (33, 99))),
    "split_prefill": dict(seqs=((300, 340), (230, 230), (1, 50))),
}
HEAD_DIM = 80  # kv_lora_rank 64 + the rope key's 16


@functools.lru_cache(maxsize=None)
def _batch(name):
    spec = BATCHES[name]
    kw = {k: v for k, v in spec.items() if k in ("pad_tokens", "pad_seqs")}
    return make_batch(spec["seqs"], num_heads=4, head_dim=HEAD_DIM, page_size=16, seed=3, latent=True, **kw)


PAIRS = [(k, n) for k in KERNELS for n in BATCHES if k == "reference" or n != "split_prefill"]


@pytest.mark.parametrize("kernel, name", PAIRS)
def test_latent_cache_matches_naive(kernel, name):
    if kernel == "native" and not cpu.available():
        pytest.skip("the native CPU kernel did not build here")
    b = _batch(name)
    assert b.kv_cache.shape[-2] == 1
    kw = dict(sm_scale=0.1)
    out = run_kernel(kernel, b, **kw)
    t = sum(q for q, _ in b.seqs)
    np.testing.assert_allclose(out[:t], naive_attention(b, **kw)[:t], atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(out[t:], 0.0)


@pytest.mark.parametrize("write", ["reference", "pallas"])
def test_latent_write_is_one_row_per_token(write):
    fn = reference.write_kv_cache if write == "reference" else functools.partial(
        kv_cache_update.write_kv_cache, interpret=True)
    cache = jnp.zeros((2, 4, 8, 1, 16), jnp.float32)  # [L, P, S, 1, H]
    latent = jnp.arange(3 * 16, dtype=jnp.float32).reshape(3, 1, 16) + 1
    slots = jnp.array([8, 9, 30], jnp.int32)
    out = np.asarray(fn(cache, latent, None, slots, layer=jnp.int32(1)))
    np.testing.assert_array_equal(out[1, 1, 0, 0], np.asarray(latent[0, 0]))
    np.testing.assert_array_equal(out[1, 1, 1, 0], np.asarray(latent[1, 0]))
    np.testing.assert_array_equal(out[1, 3, 6, 0], np.asarray(latent[2, 0]))
    assert np.count_nonzero(out[0]) == 0 and np.count_nonzero(out[1]) == 3 * 16


@pytest.mark.parametrize("head_dim", [576, 300], ids=["deepseek_576", "padded_300"])
@pytest.mark.parametrize("name", ["decode", "mixed"])
def test_native_kernel_takes_deepseek_latent_rows(head_dim, name):
    """DeepSeek-V3's latent rows (kv_lora_rank 512 + the rope key's 64) in the native
    kernel, not the reference fallback; 300 runs zero-padded in the 320-wide variant."""
    assert cpu.supports(jnp.zeros((1, 4, head_dim), jnp.float32), jnp.zeros((2, 16, 1, head_dim), jnp.float32))
    spec = BATCHES[name]
    kw = {k: v for k, v in spec.items() if k in ("pad_tokens", "pad_seqs")}
    b = make_batch(spec["seqs"], num_heads=4, head_dim=head_dim, page_size=16, seed=5, latent=True, **kw)
    out = run_kernel("native", b, sm_scale=0.05)
    t = sum(q for q, _ in b.seqs)
    np.testing.assert_allclose(out[:t], naive_attention(b, sm_scale=0.05)[:t], atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(out[t:], 0.0)
