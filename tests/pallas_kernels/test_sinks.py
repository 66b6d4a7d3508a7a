"""Attention sinks (GPT-OSS: a learned logit per query head in every softmax's
denominator) in every kernel: the reference's three paths, the native CPU kernel, and the
GPU and TPU Pallas kernels interpreted, against the float64 loop."""
import functools

import jax.numpy as jnp
import numpy as np
import pytest

from rpa_cases import KERNELS, make_batch, naive_attention, run_kernel

# decode-sized (T <= R: the (token, page) pairs), mixed (one pass over the pages), and a
# step of >= 512 tokens (this step's tiles and the cached prefix, merged).
BATCHES = {
    "decode": dict(seqs=((1, 40), (1, 7), (1, 130), (1, 1)), pad_tokens=0, pad_seqs=3),
    "mixed_window": dict(seqs=((7, 40), (1, 70), (20, 20), (0, 0), (33, 99)), window=24),
    "split_prefill": dict(seqs=((300, 340), (230, 230), (1, 50))),
}


@functools.lru_cache(maxsize=None)
def _batch(name):
    spec = BATCHES[name]
    kw = {k: v for k, v in spec.items() if k in ("pad_tokens", "pad_seqs")}
    return make_batch(spec["seqs"], num_heads=6, num_kv_heads=2, head_dim=64, page_size=16, seed=7, **kw)


# The split path is the reference's own; the kernels take one step shape each way.
PAIRS = [(k, n) for k in KERNELS for n in BATCHES if k == "reference" or n != "split_prefill"]


@pytest.mark.parametrize("kernel, name", PAIRS)
def test_sinks_match_naive(kernel, name):
    b = _batch(name)
    # Large and small sinks: one dominating the keys, one negligible, the rest in between.
    sinks = np.array([4.0, -9.0, 0.5, 1.5, -0.3, 12.0], np.float32)
    kw = dict(sm_scale=64 ** -0.5, sliding_window=BATCHES[name].get("window"))
    out, plain = run_kernel(kernel, b, **kw, sinks=jnp.asarray(sinks)), run_kernel(kernel, b, **kw)
    t = sum(q for q, _ in b.seqs)
    np.testing.assert_allclose(out[:t], naive_attention(b, **kw, sinks=sinks)[:t], atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(out[t:], 0.0)
    # The sinks only ever shrink a row's output (they attend to nothing), and by a factor per head.
    assert np.all(np.abs(out[:t]) <= np.abs(plain[:t]) + 1e-6)
    assert not np.allclose(out[:t], plain[:t])
