"""The Mosaic TPU kernel against the reference, run by the Pallas TPU interpreters: what
only this kernel has (the shared contract, run for both kernels, is in test_kernel_contract.py).

Most cases use the fast legacy interpreter (``interpret=True``); a few small ones run
under ``pltpu.InterpretParams`` (simulated DMAs and semaphores: out-of-bounds copies,
races and reads of uninitialised VMEM, which is NaN-filled, are caught).
"""
import jax
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu
from rpa_cases import CASES, assert_matches_case, case_batch, make_batch, reference_attention

CHECKED = pltpu.InterpretParams(detect_races=True)


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


def test_tpu_kernel_inside_jit_with_traced_num_seqs():
    name = "prefill_mha_h64_p32"
    b = case_batch(name)
    f = jax.jit(lambda *a: tpu.ragged_paged_attention(*a, interpret=True, num_queries_per_block=16,
                                                      **CASES[name].attn_kwargs))
    assert_matches_case(name, f(*b.args()))
