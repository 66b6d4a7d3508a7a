"""Backend dispatch: names, platform mapping, and the pallas path end to end on CPU."""
import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import backend, cpu, gpu, reference, tpu
from rpa_cases import CASES, assert_matches_case, case_batch

# This machine's CPU default: the native kernel where it builds (CI has g++).
CPU_AUTO = "native" if cpu.available() else "reference"


def spec(name, platform, *, interpret=False, k_scale=1.0, v_scale=1.0):
    """The AttentionSpec build_attention takes: ``name`` resolved on ``platform``, the KV
    scales as given (whatever the cache's dtype)."""
    resolved = backend.resolve_attention_spec(name, platform, jnp.float32, interpret=interpret)
    return dataclasses.replace(resolved, k_scale=k_scale, v_scale=v_scale)


def _target(fn):
    return (fn.func, fn.keywords) if isinstance(fn, functools.partial) else (fn, {})


@pytest.mark.parametrize(
    "name, platform, expected",
    [
        ("auto", "cpu", CPU_AUTO),
        ("native", "cpu", "native"),
        ("auto", "tpu", "pallas"),
        ("auto", "gpu", "pallas"),
        ("auto", "cuda", "pallas"),
        ("reference", "tpu", "reference"),
        ("pallas", "cpu", "pallas"),
    ],
)
def test_resolve_backend(name, platform, expected):
    assert backend.resolve_backend(name, platform)[0] == expected


def test_attention_spec_resolves_backend_storage_and_scales_once():
    """One spec per engine: the backend resolved, the pages' storage (a bf16 cache as its
    bit patterns under the CPU kernels only), interpret on CPU, and a checkpoint's KV
    scales used by an 8-bit cache only."""
    bf16 = backend.resolve_attention_spec("reference", "cpu", jnp.bfloat16)
    assert (bf16.backend, bf16.kv_dtype, bf16.kv_storage_dtype, bf16.interpret) == (
        "reference", jnp.bfloat16, jnp.uint16, True)
    assert backend.resolve_attention_spec("pallas", "cpu", jnp.bfloat16).kv_storage_dtype == jnp.bfloat16
    gpu_spec = backend.resolve_attention_spec("auto", "cuda", jnp.bfloat16)
    assert (gpu_spec.backend, gpu_spec.platform, gpu_spec.kv_storage_dtype, gpu_spec.interpret) == (
        "pallas", "gpu", jnp.bfloat16, False)
    assert backend.resolve_attention_spec("auto", "cpu").backend == CPU_AUTO
    fp8 = backend.resolve_attention_spec("reference", "cpu", jnp.float8_e4m3fn)
    assert fp8.quantized_kv and fp8.kv_storage_dtype == jnp.float8_e4m3fn
    assert (fp8.with_kv_scales((0.5, 2.0)).k_scale, fp8.with_kv_scales((0.5, 2.0)).v_scale) == (0.5, 2.0)
    assert (fp8.with_kv_scales(None).k_scale, bf16.with_kv_scales((0.5, 2.0)).v_scale) == (1.0, 1.0)
    with pytest.raises(ValueError, match="kv_cache_dtype=fp8"):
        backend.resolve_attention_spec("pallas", "tpu", jnp.float8_e4m3fn)


def test_dispatch_targets():
    cpu_auto = backend.native_or_reference if CPU_AUTO == "native" else reference.ragged_paged_attention
    assert backend.get_attention_fn("auto", "cpu") is cpu_auto
    assert backend.get_attention_fn("reference", "cpu") is reference.ragged_paged_attention
    assert backend.get_attention_fn("reference", "cuda") is reference.ragged_paged_attention
    assert _target(backend.get_attention_fn("pallas", "tpu")) == (tpu.ragged_paged_attention, {"interpret": False})
    assert _target(backend.get_attention_fn("auto", "cuda")) == (gpu.ragged_paged_attention, {"interpret": False})
    assert _target(backend.get_attention_fn("pallas", "gpu", interpret=True)) == (
        gpu.ragged_paged_attention, {"interpret": True})
    # On CPU the pallas backend is the TPU kernel, interpreted even when not asked to be.
    assert _target(backend.get_attention_fn("pallas", "cpu")) == (tpu.ragged_paged_attention, {"interpret": True})


def test_default_platform_is_jax_default_backend():
    expected = "pallas" if jax.default_backend() in ("tpu", "gpu") else CPU_AUTO
    assert backend.resolve_backend()[0] == expected


@pytest.mark.parametrize("name", ["flash", "Pallas", "", "triton"])
def test_unknown_backend_lists_allowed_values(name):
    with pytest.raises(ValueError, match="auto, reference, pallas, native"):
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


@pytest.mark.parametrize("name, platform", [("reference", "cpu"), ("pallas", "cpu"), ("pallas", "tpu"), ("pallas", "gpu"),
                                            ("native", "cpu")])
def test_every_backend_takes_the_reference_keywords(name, platform):
    params = inspect.signature(backend.get_attention_fn(name, platform)).parameters
    assert list(params)[:6] == ["q", "kv_cache", "kv_lens", "page_indices", "cu_q_lens", "num_seqs"]
    assert {"sm_scale", "sliding_window", "soft_cap", "layer"} <= set(params)


def test_kv_write_dispatch():
    from pallas_kernels import kv_cache_update

    assert backend.get_kv_write_fn("auto", "cpu") is reference.write_kv_cache
    assert backend.get_kv_write_fn("native", "cpu") is reference.write_kv_cache
    assert backend.get_kv_write_fn("pallas", "gpu") is reference.write_kv_cache  # XLA's scatter is in place
    assert _target(backend.get_kv_write_fn("pallas", "tpu")) == (kv_cache_update.write_kv_cache, {"interpret": False})
    assert _target(backend.get_kv_write_fn("pallas", "cpu")) == (kv_cache_update.write_kv_cache, {"interpret": True})


def scan_layers(attention, q, k, v, md, cache):
    """A jitted scan of ``attention`` over the layers of k, v [L, T, K, H], as a model step
    runs it: (the cache after every layer's write, o [L, T, N, H])."""
    @jax.jit
    def step(cache):
        def body(cache, xs):
            k, v, layer = xs
            o, cache = attention(q, k, v, cache, layer, md)
            return cache, o

        return jax.lax.scan(body, cache, (k, v, jnp.arange(k.shape[0])))

    return step(cache)


def test_built_attention_writes_then_attends():
    """build_attention's per-layer function (KV write + kernel) gives the same output and
    cache with the pallas path (interpreted) and the native CPU kernel as with the
    reference, inside a jitted scan."""
    import dataclasses

    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.attention_metadata import AttentionMetadata

    rng = np.random.default_rng(0)
    L, P, S, K, H, N = 2, 8, 16, 2, 64, 4
    cache = jnp.asarray(rng.standard_normal((L, P, S, 2 * K, H)), jnp.float32)
    # Request 0 decodes its 20th token (pages 1, 2); request 1 prefills 5 tokens (page 3).
    # Three padded tokens write the null page 0.
    slots = np.array([1 * S + 3, 3 * S, 3 * S + 1, 3 * S + 2, 3 * S + 3, 3 * S + 4, 0, 0], np.int32)
    tables = np.array([[1, 2], [3, 0], [0, 0]], np.int32)
    md = AttentionMetadata(slot_mapping=jnp.asarray(slots[:, None]), seq_lens=jnp.asarray([20, 5, 0], jnp.int32),
                           query_start_loc=jnp.asarray([0, 1, 6, 6], jnp.int32),
                           block_tables=jnp.asarray(tables[:, None]), num_seqs=jnp.asarray([2], jnp.int32))
    q = jnp.asarray(rng.standard_normal((8, N, H)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((L, 8, K, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((L, 8, K, H)), jnp.float32)

    def run(name):
        attention = backend.build_attention(spec(name, "cpu"), None, sm_scale=H ** -0.5)
        cache_out, o = scan_layers(attention, q, k, v, md, cache)
        return np.asarray(cache_out), np.asarray(o)

    ref_cache, ref_o = run("reference")
    for name in ("pallas", "native"):
        cache_out, o = run(name)
        np.testing.assert_array_equal(cache_out[:, 1:], ref_cache[:, 1:])  # the pallas write skips the null page
        np.testing.assert_allclose(o[:, :6], ref_o[:, :6], rtol=2e-5, atol=2e-5)
    assert not np.array_equal(ref_cache[:, 3], np.asarray(cache)[:, 3])  # the new tokens were written

    # Two KV cache groups of one layer each, sharing one slot of a cache of 2P pages:
    # layer 1's group has its own block table (pages P.. hold what slot 1 held), so each
    # layer reads and writes exactly the pages of the one-group run.
    grouped_md = dataclasses.replace(
        md, slot_mapping=jnp.asarray(np.stack([slots, np.where(slots > 0, slots + P * S, 0)], axis=1)),
        block_tables=jnp.asarray(np.stack([tables, np.where(tables > 0, tables + P, 0)], axis=1)))
    grouped_cache = jnp.concatenate([cache[0], cache[1]])[None]  # [1, 2P, S, 2K, H]
    for name in ("reference", "pallas", "native"):
        attention = backend.build_attention(spec(name, "cpu"), None, sm_scale=H ** -0.5, layer_group=(0, 1),
                                            layer_slot=(0, 0))
        cache_out, o = (np.asarray(a) for a in scan_layers(attention, q, k, v, grouped_md, grouped_cache))
        np.testing.assert_allclose(o[:, :6], ref_o[:, :6], rtol=2e-5, atol=2e-5)
        np.testing.assert_array_equal(cache_out[0, 1:P], ref_cache[0, 1:])
        np.testing.assert_array_equal(cache_out[0, P + 1:], ref_cache[1, 1:])


@pytest.mark.parametrize("variant", ["fp8", "fp8_scaled", "windows"])
def test_built_attention_fp8_cache_and_per_layer_windows(variant):
    """An fp8 (e4m3) cache, written saturating and widened by the kernels, with per-tensor
    k / v scales folded into the products; and per-layer windows (Gemma) under the layer
    scan. The TPU kernel (interpreted) and the GPU kernel (interpreted) match the
    reference, and so does the native CPU kernel; fp8 stays close to the f32 cache's output."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.attention_metadata import AttentionMetadata

    rng = np.random.default_rng(1)
    L, P, S, K, H, N, T = 2, 8, 16, 2, 64, 4, 8
    fp8 = variant.startswith("fp8")
    dtype = jnp.float8_e4m3fn if fp8 else jnp.float32
    cache = jnp.zeros((L, P, S, 2 * K, H), dtype)
    # Request 0 prefills 30 tokens over pages 1, 2 (keys 0..29, a window of 8 bites);
    # request 1 prefills 5 tokens in page 3.
    slots = np.array([1 * S + i for i in range(16)] + [2 * S + i for i in range(14)] +
                     [3 * S + i for i in range(5)] + [0], np.int32)
    T = len(slots)
    md = AttentionMetadata(slot_mapping=jnp.asarray(slots[:, None]), seq_lens=jnp.asarray([30, 5, 0], jnp.int32),
                           query_start_loc=jnp.asarray([0, 30, 35, 35], jnp.int32),
                           block_tables=jnp.asarray([[[1, 2]], [[3, 0]], [[0, 0]]], jnp.int32),
                           num_seqs=jnp.asarray([2], jnp.int32))
    q = jnp.asarray(rng.standard_normal((T, N, H)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((L, T, K, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((L, T, K, H)) * (30 if variant == "fp8_scaled" else 1), jnp.float32)
    kw, scales = dict(sm_scale=H ** -0.5), {}
    if variant == "fp8_scaled":
        scales = dict(k_scale=0.5, v_scale=3.0)  # v up to ~130: stored at most ~45 (e4m3's max is 448)
    if variant == "windows":
        kw |= dict(sliding_window=8, sliding_window_layers=(True, False), soft_cap=5.0)

    def run(name, platform, cache=cache):
        attention = backend.build_attention(spec(name, platform, interpret=True, **scales), None, **kw)
        return [np.asarray(a.astype(jnp.float32)) for a in scan_layers(attention, q, k, v, md, cache)]

    ref_cache, ref_o = run("reference", "cpu")
    for name, platform in (("pallas", "cpu"), ("pallas", "gpu"), ("native", "cpu")):
        cache_out, o = run(name, platform)
        np.testing.assert_array_equal(cache_out[:, 1:], ref_cache[:, 1:])
        np.testing.assert_allclose(o[:, :35], ref_o[:, :35], rtol=2e-5, atol=2e-5)
    if fp8:
        _, o32 = run("reference", "cpu", cache=jnp.zeros(cache.shape, jnp.float32))
        err = np.abs(ref_o[:, :35] - o32[:, :35]).max() / np.abs(o32[:, :35]).max()
        assert 0 < err < 0.1, err  # e4m3 keeps 3 mantissa bits
    else:  # the window changes layer 0 only
        no_window = dict(kw, sliding_window=None)
        kw.clear()
        kw.update(no_window)
        _, o_full = run("reference", "cpu")
        assert not np.allclose(o_full[0, :30], ref_o[0, :30]) and np.allclose(o_full[1], ref_o[1], atol=1e-6)
