"""The Mosaic TPU kernel against the reference, run by the Pallas TPU interpreters.

Most cases use the fast legacy interpreter (``interpret=True``); a few small ones run
under ``pltpu.InterpretParams`` (simulated DMAs and semaphores: out-of-bounds copies,
races and reads of uninitialised VMEM, which is NaN-filled, are caught).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu
from rpa_cases import CASES, assert_matches_case, case_batch, make_batch, reference_attention

CHECKED = pltpu.InterpretParams(detect_races=True)


# Default block sizes: the decode / prefill dispatch (lax.cond on max q_len) compiles
# both variants, so only a few cases take this (slower to compile) path.
# (test_backend runs the default path on smollm_heads_9_3_h64_cap.)
@pytest.mark.parametrize("name", ["decode_gqa4_h128_p16", "mixed_gqa8_h64_p64_window_cap"])
def test_tpu_kernel_matches_reference(name):
    out = tpu.ragged_paged_attention(*case_batch(name).args(), interpret=True, **CASES[name].attn_kwargs)
    assert_matches_case(name, out)


@pytest.mark.parametrize(
    "name, bq, pages",
    [
        ("prefill_mha_h64_p32", 16, None),
        ("chunked_long_mha_p64_bf16_window", 32, None),
        ("decode_gqa4_p32_bf16_window", 8, 1),
        # The decode-sized block on prefill data and the other way round, single-page
        # kv blocks, and a block size that divides neither T nor the requests.
        ("mixed_gqa8_h64_p64_window_cap", 8, 1),
        ("decode_gqa4_h128_p16", 32, 3),
        ("mixed_gqa4_h128_p16_bf16", 5, 2),
    ],
)
def test_tpu_kernel_single_block_config(name, bq, pages):
    out = tpu.ragged_paged_attention(
        *case_batch(name).args(), interpret=True, num_queries_per_block=bq, num_kv_pages_per_block=pages,
        **CASES[name].attn_kwargs,
    )
    assert_matches_case(name, out)


@pytest.mark.parametrize("name", ["smollm_heads_9_3_h64_cap", "decode_gqa4_p32_bf16_window"])
def test_tpu_kernel_under_checked_interpreter(name):
    out = tpu.ragged_paged_attention(*case_batch(name).args(), interpret=CHECKED, **CASES[name].attn_kwargs)
    assert_matches_case(name, out)


def test_tpu_kernel_never_reads_unused_page_table_entries():
    # Unused entries (past each request's pages, rows past num_seqs) are out of range:
    # the checked interpreter raises on any DMA from them.
    b = make_batch([(3, 40), (1, 17), (0, 5), (9, 9)], garbage_page_table=True, pad_seqs=2)
    out = tpu.ragged_paged_attention(*b.args(), sm_scale=0.125, interpret=CHECKED, num_queries_per_block=8,
                                     num_kv_pages_per_block=2)
    np.testing.assert_allclose(np.asarray(out), np.asarray(reference_attention(*b.args(), sm_scale=0.125)),
                               atol=2e-5, rtol=2e-5)


def test_checked_interpreter_catches_out_of_range_page():
    # The check above is only worth something if a bad DMA really fails.
    b = make_batch([(3, 40), (1, 17), (0, 5), (9, 9)], garbage_page_table=True, pad_seqs=2)
    bad = b.page_indices.at[1, 0].set(10**6)
    with pytest.raises(Exception, match="(?i)out-of-bounds"):
        out = tpu.ragged_paged_attention(
            b.q, b.kv_cache, b.kv_lens, bad, b.cu_q_lens, b.num_seqs, sm_scale=0.125, interpret=CHECKED,
            num_queries_per_block=8, num_kv_pages_per_block=2,
        )
        jax.block_until_ready(out)


def test_tpu_kernel_ignores_rows_past_num_seqs():
    name = "mixed_gqa4_h128_p16_bf16"
    b = case_batch(name)
    r = len(b.seqs)
    out = tpu.ragged_paged_attention(
        b.q, b.kv_cache, b.kv_lens.at[r:].set(10**5), b.page_indices.at[r:].set(-7), b.cu_q_lens.at[r + 1:].set(0),
        b.num_seqs, interpret=True, num_queries_per_block=5, num_kv_pages_per_block=2, **CASES[name].attn_kwargs,
    )
    assert_matches_case(name, out)


def test_tpu_kernel_inside_jit_with_traced_num_seqs():
    name = "prefill_mha_h64_p32"
    b = case_batch(name)
    f = jax.jit(lambda *a: tpu.ragged_paged_attention(*a, interpret=True, num_queries_per_block=16,
                                                      **CASES[name].attn_kwargs))
    assert_matches_case(name, f(*b.args()))


def test_tpu_kernel_empty_step_gives_zeros():
    name = "mixed_gqa4_h128_p16_bf16"
    b = case_batch(name)
    out = tpu.ragged_paged_attention(
        b.q, b.kv_cache, b.kv_lens, b.page_indices, b.cu_q_lens, b.num_seqs * 0, interpret=True,
        num_queries_per_block=5, num_kv_pages_per_block=2, **CASES[name].attn_kwargs,
    )
    np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)


def test_tpu_kernel_reads_a_stacked_cache_in_place():
    name = "smollm_heads_9_3_h64_cap"
    b = case_batch(name)
    stacked = jnp.stack([b.kv_cache * 0.5, b.kv_cache, b.kv_cache * 2.0])  # [L, P, S, 2K, H]
    out = tpu.ragged_paged_attention(
        b.q, stacked, b.kv_lens, b.page_indices, b.cu_q_lens, b.num_seqs, layer=jnp.int32(1), interpret=CHECKED,
        num_queries_per_block=16, **CASES[name].attn_kwargs,
    )
    assert_matches_case(name, out)
    with pytest.raises(ValueError, match="layer"):
        tpu.ragged_paged_attention(*b.args(), layer=0, interpret=True, **CASES[name].attn_kwargs)
