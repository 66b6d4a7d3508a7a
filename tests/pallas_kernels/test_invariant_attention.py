"""Batch-invariant attention (backend._attention_fn with batch_invariant): a query's output
is bitwise the same whether it is decoded alone (1 token), verified with speculated
tokens (a few), prefilled in one chunk or another, or computed among other requests.
The native kernel runs here; the Pallas TPU and GPU kernels under the interpreter."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import backend
from rpa_cases import make_batch

KV_LEN = 40
# (first query position, query count) of the same request: a prefill in one chunk, two
# other chunkings, speculative verification (5) and decode (1), at positions on both
# sides of the 16-key tiles and pages (the interpreted kernels take ~0.2 s a call).
SPLITS = {"prefill": [(0, KV_LEN)], "chunks of 24": [(0, 24), (24, 16)],
          "chunks of 16": [(0, 16), (16, 16), (32, 8)],
          "verify": [(0, 5), (13, 5), (30, 5), (35, 5)], "decode": [(p, 1) for p in (0, 1, 15, 16, 17, 32, 39)]}
FNS = {
    "native": lambda: backend._attention_fn("native", "cpu", False, batch_invariant=True),
    "tpu-interpret": lambda: backend._attention_fn("pallas", "cpu", True, batch_invariant=True),
    "gpu-interpret": lambda: backend._attention_fn("pallas", "gpu", True, batch_invariant=True),
}


def _outputs(fn, batch, q, splits, others):
    """Rows of the request's queries computed in ``splits`` (NaN where none is), each call
    with ``others`` decoding requests of ``batch`` after it (their rows ignored)."""
    rows = np.full(q.shape, np.nan, np.float32)
    for first, count in splits:
        lens = [first + count] + [int(batch.kv_lens[i]) for i in range(1, 1 + others)]
        queries = jnp.concatenate([q[first:first + count], batch.q[KV_LEN:KV_LEN + others]])
        tables = batch.page_indices[:1 + others]
        cu = jnp.asarray(np.concatenate([[0], np.cumsum([count] + [1] * others)]), jnp.int32)
        out = fn(queries, batch.kv_cache, jnp.asarray(lens, jnp.int32), tables, cu,
                 jnp.asarray(1 + others, jnp.int32), sm_scale=0.125)
        rows[first:first + count] = np.asarray(out)[:count]
    return rows


@pytest.mark.parametrize("name", list(FNS))
def test_a_query_does_not_depend_on_its_step(name):
    # Request 0 holds KV_LEN keys; four more decode beside it in some calls.
    batch = make_batch(((KV_LEN, KV_LEN), (1, 40), (1, 90), (1, 17), (1, 29)), num_heads=6, num_kv_heads=2,
                       head_dim=64, page_size=16, seed=4)
    q = batch.q[:KV_LEN]
    fn = FNS[name]()
    want = _outputs(fn, batch, q, SPLITS["prefill"], 0)
    assert np.isfinite(want).all()
    for split, parts in SPLITS.items():
        for others in (0, 4):
            if split == "prefill" and others == 0:
                continue
            got = _outputs(fn, batch, q, parts, others)
            done = np.isfinite(got).all(axis=(1, 2))
            np.testing.assert_array_equal(got[done], want[done], err_msg=f"{split}, {others}")


def test_the_native_default_order_depends_on_the_step():
    """Without the fixed order the native kernel picks its score order by the item's
    rows (decode: per-key dot products; a prefill chunk: broadcast-FMAs), so the same
    query's bits differ: what batch-invariant mode exists to remove."""
    batch = make_batch(((KV_LEN, KV_LEN),), num_heads=6, num_kv_heads=2, head_dim=64, page_size=16, seed=4)
    fn = backend._attention_fn("native", "cpu", False)
    q = batch.q[:KV_LEN]
    prefill = _outputs(fn, batch, q, SPLITS["prefill"], 0)
    decode = _outputs(fn, batch, q, SPLITS["decode"], 0)
    done = np.isfinite(decode).all(axis=(1, 2))
    np.testing.assert_allclose(decode[done], prefill[done], rtol=1e-5, atol=1e-5)
    assert not np.array_equal(decode[done], prefill[done])


def test_the_reference_backend_is_refused():
    with pytest.raises(ValueError, match="batch_invariant needs"):
        backend.resolve_attention_spec("reference", "cpu", batch_invariant=True)
