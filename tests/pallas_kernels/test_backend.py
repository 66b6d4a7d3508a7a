"""Backend dispatch: names, platform mapping, and the pallas path end to end on CPU."""
import functools
import inspect

import jax
import pytest

from pallas_kernels import backend, gpu, reference, tpu
from rpa_cases import CASES, assert_matches_case, case_batch


def _target(fn):
    return (fn.func, fn.keywords) if isinstance(fn, functools.partial) else (fn, {})


@pytest.mark.parametrize(
    "name, platform, expected",
    [
        ("auto", "cpu", "reference"),
        ("auto", "tpu", "pallas"),
        ("auto", "gpu", "pallas"),
        ("auto", "cuda", "pallas"),
        ("reference", "tpu", "reference"),
        ("pallas", "cpu", "pallas"),
    ],
)
def test_resolve_backend(name, platform, expected):
    assert backend.resolve_backend(name, platform)[0] == expected


def test_dispatch_targets():
    assert backend.get_attention_fn("auto", "cpu") is reference.ragged_paged_attention
    assert backend.get_attention_fn("reference", "cuda") is reference.ragged_paged_attention
    assert _target(backend.get_attention_fn("pallas", "tpu")) == (tpu.ragged_paged_attention, {"interpret": False})
    assert _target(backend.get_attention_fn("auto", "cuda")) == (gpu.ragged_paged_attention, {"interpret": False})
    assert _target(backend.get_attention_fn("pallas", "gpu", interpret=True)) == (
        gpu.ragged_paged_attention, {"interpret": True})
    # On CPU the pallas backend is the TPU kernel, interpreted even when not asked to be.
    assert _target(backend.get_attention_fn("pallas", "cpu")) == (tpu.ragged_paged_attention, {"interpret": True})


def test_default_platform_is_jax_default_backend():
    expected = "pallas" if jax.default_backend() in ("tpu", "gpu") else "reference"
    assert backend.resolve_backend()[0] == expected


@pytest.mark.parametrize("name", ["flash", "Pallas", "", "triton"])
def test_unknown_backend_lists_allowed_values(name):
    with pytest.raises(ValueError, match="auto, reference, pallas"):
        backend.get_attention_fn(name, "cpu")


def test_unknown_platform_is_rejected():
    with pytest.raises(ValueError, match="platform"):
        backend.get_attention_fn("auto", "metal")


def test_pallas_backend_runs_on_cpu_inside_a_jitted_step():
    name = "smollm_heads_9_3_h64_cap"
    attn = backend.get_attention_fn("pallas", "cpu")
    kw = CASES[name].attn_kwargs

    @jax.jit
    def step(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs):
        return attn(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, **kw)

    assert_matches_case(name, step(*case_batch(name).args()))


@pytest.mark.parametrize("name, platform", [("reference", "cpu"), ("pallas", "cpu"), ("pallas", "tpu"), ("pallas", "gpu")])
def test_every_backend_takes_the_reference_keywords(name, platform):
    params = inspect.signature(backend.get_attention_fn(name, platform)).parameters
    assert list(params)[:6] == ["q", "kv_cache", "kv_lens", "page_indices", "cu_q_lens", "num_seqs"]
    assert {"sm_scale", "sliding_window", "soft_cap", "layer"} <= set(params)
