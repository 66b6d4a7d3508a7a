"""models/bert.py's segment_attention against dense masked attention: requests that
straddle query blocks, padding past the last request, windows shorter than the step."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.bert import segment_attention


def dense(q, k, v, lengths, scale):
    out = np.zeros_like(q)
    start = 0
    for n in lengths:
        s = slice(start, start + n)
        scores = np.einsum("qnh,knh->nqk", q[s], k[s]) * scale
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[s] = np.einsum("nqk,knh->qnh", p, v[s])
        start += n
    return out


@pytest.mark.parametrize("t,lengths,max_len", [
    (1024, [300, 1, 255, 200, 180], 300),  # blocks of 256: requests cross block edges
    (600, [100, 100, 100, 7], 128),         # a step not a multiple of the block, padding after
    (16, [3, 9], 16),
])
def test_matches_dense(t, lengths, max_len):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((t, 2, 8)).astype(np.float32) for _ in range(3))
    rmax = 8
    cu = np.full(rmax + 1, sum(lengths), np.int32)
    cu[0] = 0
    cu[1:len(lengths) + 1] = np.cumsum(lengths)
    fn = jax.jit(lambda q, k, v, cu, n: segment_attention(q, k, v, cu, n, max_len=max_len, scale=0.3))
    got = np.asarray(fn(q, k, v, jnp.asarray(cu), jnp.int32(len(lengths))))
    n = sum(lengths)
    np.testing.assert_allclose(got[:n], dense(q, k, v, lengths, 0.3)[:n], atol=1e-5)
    assert not np.any(got[n:])  # padding attends to nothing
