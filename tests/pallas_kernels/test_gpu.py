"""The Triton-style GPU kernel against the reference.

On CPU the kernel runs under the Pallas interpreter (``interpret=True``); on a GPU
machine (``benchmarks/gpu_check.sh``) the same tests run it compiled.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gpu
from rpa_cases import CASES, assert_matches_case, case_batch, make_batch, reference_attention

INTERPRET = jax.default_backend() != "gpu"


# Default configuration: decode / prefill dispatch (both variants are compiled).
@pytest.mark.parametrize("name", ["decode_gqa4_h128_p16", "mixed_gqa8_h64_p64_window_cap", "smollm_heads_9_3_h64_cap"])
def test_gpu_kernel_matches_reference(name):
    out = gpu.ragged_paged_attention(*case_batch(name).args(), interpret=INTERPRET, **CASES[name].attn_kwargs)
    assert_matches_case(name, out)


@pytest.mark.parametrize(
    "name, rows, splits",
    [
        ("prefill_mha_h64_p32", 64, 1),
        ("chunked_long_mha_p64_bf16_window", 32, 3),  # split-K on a prefill chunk too
        ("decode_gqa4_p32_bf16_window", 16, 4),
        ("mixed_gqa4_h128_p16_bf16", 16, 2),
        ("decode_gqa4_h128_p16", 16, 1),
        ("smollm_heads_9_3_h64_cap", 16, 5),  # more splits than kv blocks: empty splits
    ],
)
def test_gpu_kernel_single_config(name, rows, splits):
    out = gpu.ragged_paged_attention(
        *case_batch(name).args(), interpret=INTERPRET, rows_per_block=rows, kv_splits=splits,
        **CASES[name].attn_kwargs,
    )
    assert_matches_case(name, out)


def test_gpu_kernel_head_dim_not_a_power_of_two():
    b = make_batch([(4, 30), (1, 50), (0, 2), (9, 9)], num_heads=6, num_kv_heads=2, head_dim=48)
    out = gpu.ragged_paged_attention(*b.args(), sm_scale=0.15, interpret=INTERPRET, rows_per_block=16, kv_splits=2)
    np.testing.assert_allclose(np.asarray(out), np.asarray(reference_attention(*b.args(), sm_scale=0.15)),
                               atol=2e-5, rtol=2e-5)


def test_gpu_kernel_ignores_rows_past_num_seqs():
    name = "mixed_gqa4_h128_p16_bf16"
    b = case_batch(name)
    r = len(b.seqs)
    out = gpu.ragged_paged_attention(
        b.q, b.kv_cache, b.kv_lens.at[r:].set(10**5), b.page_indices.at[r:].set(-7), b.cu_q_lens.at[r + 1:].set(0),
        b.num_seqs, interpret=INTERPRET, rows_per_block=16, kv_splits=2, **CASES[name].attn_kwargs,
    )
    assert_matches_case(name, out)


def test_default_kv_splits_fill_the_gpu_only_when_needed():
    assert gpu.default_kv_splits(num_seqs_max=256, k_heads=8, max_kv_blocks=128) == 1
    assert gpu.default_kv_splits(num_seqs_max=4, k_heads=8, max_kv_blocks=128) == 16
    assert gpu.default_kv_splits(num_seqs_max=4, k_heads=8, max_kv_blocks=3) == 4


def test_gpu_kernel_empty_step_gives_zeros():
    name = "mixed_gqa4_h128_p16_bf16"
    b = case_batch(name)
    out = gpu.ragged_paged_attention(
        b.q, b.kv_cache, b.kv_lens, b.page_indices, b.cu_q_lens, b.num_seqs * 0, interpret=INTERPRET,
        rows_per_block=16, kv_splits=2, **CASES[name].attn_kwargs,
    )
    np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)


def test_gpu_kernel_reads_a_stacked_cache_in_place():
    name = "smollm_heads_9_3_h64_cap"
    b = case_batch(name)
    stacked = jnp.stack([b.kv_cache * 0.5, b.kv_cache, b.kv_cache * 2.0])  # [L, P, S, 2K, H]
    out = gpu.ragged_paged_attention(
        b.q, stacked, b.kv_lens, b.page_indices, b.cu_q_lens, b.num_seqs, layer=jnp.int32(1), interpret=INTERPRET,
        rows_per_block=16, kv_splits=5, **CASES[name].attn_kwargs,
    )
    assert_matches_case(name, out)
