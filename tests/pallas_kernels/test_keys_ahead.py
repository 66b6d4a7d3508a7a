"""keys_ahead (Gemma 3: an image's tokens attend to the whole image, on sliding layers
too) in every kernel: the reference's three paths, the native CPU kernel, and the GPU and
TPU Pallas kernels interpreted, against the float64 loop."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference
from rpa_cases import KERNELS, make_batch, naive_attention, run_kernel

# (seqs, window, images as (request, first token within the step, length)): the images
# lie within each request's tokens of this step. Decode-sized (T <= R: the (token, page)
# pairs, a request of 3 tokens among single ones), mixed (one pass over the pages; an
# image longer than the window, one at the end of a chunk), and a step of >= 512 tokens
# (this step's tiles and the cached prefix: an image across tile boundaries).
BATCHES = {
    "decode": dict(seqs=((1, 40), (3, 7), (1, 130), (1, 1)), images=((1, 0, 3),), pad_tokens=0, pad_seqs=4),
    "mixed_window": dict(seqs=((27, 40), (1, 70), (20, 20), (0, 0), (40, 99)), window=8,
                         images=((0, 3, 16), (2, 14, 6), (4, 0, 5), (4, 10, 30))),
    "mixed": dict(seqs=((27, 40), (1, 70), (20, 20)), images=((0, 3, 16), (2, 0, 20))),
    "split_prefill": dict(seqs=((300, 340), (230, 230), (1, 50)), window=48,
                          images=((0, 20, 70), (0, 250, 50), (1, 100, 64))),
}


@functools.lru_cache(maxsize=None)
def _batch(name):
    spec = BATCHES[name]
    kw = {k: v for k, v in spec.items() if k in ("pad_tokens", "pad_seqs")}
    b = make_batch(spec["seqs"], num_heads=4, num_kv_heads=2, head_dim=32, page_size=16, seed=11, **kw)
    ahead = np.zeros(b.q.shape[0], np.int32)
    cu = np.asarray(b.cu_q_lens)
    for r, first, n in spec["images"]:
        assert first + n <= spec["seqs"][r][0]
        start = cu[r] + first
        ahead[start:start + n] = np.arange(n - 1, -1, -1)
    return b, ahead


KERNEL_CASES = [(k, n) for k in KERNELS if k != "reference" for n in BATCHES if n != "split_prefill"]


def check(kernel, name):
    b, ahead = _batch(name)
    kw = dict(sm_scale=32 ** -0.5, sliding_window=BATCHES[name].get("window"))
    out, plain = run_kernel(kernel, b, **kw, keys_ahead=jnp.asarray(ahead)), run_kernel(kernel, b, **kw)
    t = sum(q for q, _ in b.seqs)
    np.testing.assert_allclose(out[:t], naive_attention(b, **kw, keys_ahead=ahead)[:t], atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(out[t:], 0.0)
    # Tokens with nothing ahead (text, each image's last token) are the causal result.
    still = ahead[:t] == 0
    np.testing.assert_allclose(out[:t][still], plain[:t][still], atol=1e-6, rtol=1e-6)
    assert not np.allclose(out[:t][~still], plain[:t][~still])


@pytest.mark.parametrize("split", [True, False], ids=["split", "one_pass"])
@pytest.mark.parametrize("name", sorted(BATCHES))
def test_reference_keys_ahead_match_naive(name, split, monkeypatch):
    """Both ways the reference attends (this step's tiles + the prefix, or one pass over
    the pages), forced by its size threshold; decode-sized steps take the pairs either way."""
    monkeypatch.setattr(reference, "_SPLIT_TOKENS", 0 if split else 10 ** 9)
    jax.clear_caches()
    try:
        check("reference", name)
    finally:
        jax.clear_caches()


@pytest.mark.parametrize("kernel, name", KERNEL_CASES)
def test_kernel_keys_ahead_match_naive(kernel, name):
    check(kernel, name)
