"""The kernels lower for real hardware without it (a CI check, no TPU / GPU needed).

``jax.jit(f).trace(...).lower(lowering_platforms=...)`` runs the Pallas -> Mosaic TPU
and Pallas -> Triton lowerings in Python, inside an abstract mesh of a TPU / NVIDIA
device kind. What this does NOT check: Mosaic's own compiler passes (vector layouts,
tiling of unaligned slices) run in libtpu, and Triton -> PTX runs in XLA:GPU, both at
compile time on the device; those need ``benchmarks/gpu_check.sh`` or a TPU.
"""
import warnings

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import backend, gpu, kv_cache_update, tpu

TPU_KIND = "TPU v5 lite"
GPU_KIND = "NVIDIA H100 80GB HBM3"


def _abstract_args(t, n, k, h, page_size, dtype, r=64, num_pages=1024, pages_per_seq=128):
    return (
        jax.ShapeDtypeStruct((t, n, h), dtype),
        jax.ShapeDtypeStruct((num_pages, page_size, 2 * k, h), dtype),
        jax.ShapeDtypeStruct((r,), jnp.int32),
        jax.ShapeDtypeStruct((r, pages_per_seq), jnp.int32),
        jax.ShapeDtypeStruct((r + 1,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )


def _lower(fn, args, platform, device_kind):
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",),
        abstract_device=jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1, platform=platform),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Pallas Triton, JAX >= 0.11
        with jax.sharding.use_abstract_mesh(mesh):
            return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


# (T, N, K, H, S): an 8B model's heads (32 / 8 x 128) for a prefill bucket (both
# decode and prefill variants) and a decode-only bucket (one variant).
SHAPES = [(256, 32, 8, 128, 16), (8, 32, 8, 128, 16)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["prefill_bucket", "decode_bucket"])
def test_tpu_kernel_lowers_for_tpu(shape, dtype):
    t = shape[0]

    def f(*a):
        return tpu.ragged_paged_attention(*a, sm_scale=0.088, sliding_window=512, soft_cap=50.0)

    text = _lower(f, _abstract_args(*shape, dtype), "tpu", TPU_KIND)
    assert text.count("tpu_custom_call") == (2 if t > 8 else 1)


def test_kv_cache_update_lowers_for_tpu():
    args = (
        jax.ShapeDtypeStruct((1024, 16, 16, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((300, 8, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((300, 8, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((300,), jnp.int32),
    )
    assert _lower(kv_cache_update.write_kv_cache, args, "tpu", TPU_KIND).count("tpu_custom_call") == 1
    stacked = (jax.ShapeDtypeStruct((4, *args[0].shape), jnp.bfloat16), *args[1:], jax.ShapeDtypeStruct((), jnp.int32))

    def write_layer(cache, k, v, slots, layer):
        return kv_cache_update.write_kv_cache(cache, k, v, slots, layer=layer)

    assert _lower(write_layer, stacked, "tpu", TPU_KIND).count("tpu_custom_call") == 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [SHAPES[0], (16, 9, 3, 64, 16), (64, 8, 2, 96, 32)],
                         ids=["llama8b", "smollm", "head_dim_96"])
def test_gpu_kernel_lowers_for_cuda(shape, dtype):
    def f(*a):
        return gpu.ragged_paged_attention(*a, sm_scale=0.088, sliding_window=512, soft_cap=50.0)

    text = _lower(f, _abstract_args(*shape, dtype), "cuda", GPU_KIND)
    assert text.count("__gpu$xla.gpu.triton") == 2  # decode (split-K) and prefill variants


@pytest.mark.parametrize("platform, kind, marker", [("tpu", TPU_KIND, "tpu_custom_call"),
                                                    ("cuda", GPU_KIND, "__gpu$xla.gpu.triton")])
def test_auto_backend_lowers_inside_a_jitted_step(platform, kind, marker):
    attn = backend.get_attention_fn("auto", platform)

    def step(*a):
        return attn(*a, sm_scale=0.125) * 2.0

    assert marker in _lower(step, _abstract_args(8, 8, 2, 128, 16, jnp.bfloat16), platform, kind)


def test_stacked_cache_lowers_for_tpu_and_cuda():
    t, n, k, h, s = SHAPES[0]
    args = list(_abstract_args(t, n, k, h, s, jnp.bfloat16))
    args[1] = jax.ShapeDtypeStruct((4, *args[1].shape), jnp.bfloat16)  # [L, P, S, 2K, H]
    args.append(jax.ShapeDtypeStruct((), jnp.int32))

    def f_tpu(*a):
        return tpu.ragged_paged_attention(*a[:-1], layer=a[-1], sm_scale=0.088)

    def f_gpu(*a):
        return gpu.ragged_paged_attention(*a[:-1], layer=a[-1], sm_scale=0.088)

    assert _lower(f_tpu, args, "tpu", TPU_KIND).count("tpu_custom_call") == 2
    assert _lower(f_gpu, args, "cuda", GPU_KIND).count("__gpu$xla.gpu.triton") == 2


def test_keys_ahead_lowers_for_tpu_and_cuda():
    """Gemma 3's keys_ahead (a per-token int32 input) in both Pallas kernels."""
    t, n, k, h, s = SHAPES[0]
    args = [*_abstract_args(t, n, k, h, s, jnp.bfloat16), jax.ShapeDtypeStruct((t,), jnp.int32)]

    def f_tpu(*a):
        return tpu.ragged_paged_attention(*a[:-1], keys_ahead=a[-1], sm_scale=0.088, sliding_window=512)

    def f_gpu(*a):
        return gpu.ragged_paged_attention(*a[:-1], keys_ahead=a[-1], sm_scale=0.088, sliding_window=512)

    assert _lower(f_tpu, args, "tpu", TPU_KIND).count("tpu_custom_call") == 2
    assert _lower(f_gpu, args, "cuda", GPU_KIND).count("__gpu$xla.gpu.triton") == 2
