"""The contract both attention kernels keep (GPU: Triton-style, TPU: Mosaic), against the reference.

Each test runs once per kernel. On CPU both run under the Pallas interpreters (the TPU one,
where marked, under ``pltpu.InterpretParams``: simulated DMAs and semaphores, races and
out-of-bounds copies caught); on a GPU machine (``benchmarks/gpu_check.sh``) the GPU kernel
runs compiled and the TPU cases are skipped. Tests of one kernel's own machinery stay in
test_gpu.py and test_tpu.py.
"""
import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import gpu, tpu
from rpa_cases import CASES, assert_matches_case, case_batch

ON_GPU = jax.default_backend() == "gpu"
CHECKED = pltpu.InterpretParams(detect_races=True)


@dataclasses.dataclass(frozen=True)
class Kernel:
    fn: Callable
    interpret: object  # how the kernel runs here (TPU: always an interpreter)
    small: dict  # a forced block configuration for the edge-case tests
    stacked: dict  # how the stacked-cache test runs it


KERNELS = {
    "gpu": Kernel(
        gpu.ragged_paged_attention,
        interpret=not ON_GPU,
        small=dict(rows_per_block=16, kv_splits=2),
        stacked=dict(interpret=not ON_GPU, rows_per_block=16, kv_splits=5),
    ),
    "tpu": Kernel(
        tpu.ragged_paged_attention,
        interpret=True,
        small=dict(num_queries_per_block=5, num_kv_pages_per_block=2),
        stacked=dict(interpret=CHECKED, num_queries_per_block=16),
    ),
}
_SKIP_TPU_ON_GPU = pytest.mark.skipif(ON_GPU, reason="a GPU check runs the GPU kernel only")


def per_kernel(cases: dict) -> list:
    """pytest params (kernel, name[, config]) from {kernel: [name or (name, config), ...]},
    with ids ``kernel-name[-config values]``; the TPU ones are skipped on a GPU."""
    params = []
    for kernel, rows in cases.items():
        marks = [_SKIP_TPU_ON_GPU] if kernel == "tpu" else []
        for row in rows:
            row = row if isinstance(row, tuple) else (row,)
            name, *config = row
            parts = [kernel, name, *(str(v) for c in config for v in c.values())]
            params.append(pytest.param(kernel, *row, marks=marks, id="-".join(parts)))
    return params


# Default configuration: the decode / prefill dispatch (lax.cond on max q_len) compiles
# both variants, so only a few cases take this (slower to compile) path.
# (test_backend runs the TPU default path on smollm_heads_9_3_h64_cap.)
@pytest.mark.parametrize("kernel, name", per_kernel({
    "gpu": ["decode_gqa4_h128_p16", "mixed_gqa8_h64_p64_window_cap", "smollm_heads_9_3_h64_cap"],
    "tpu": ["decode_gqa4_h128_p16", "mixed_gqa8_h64_p64_window_cap"],
}))
def test_kernel_matches_reference(kernel, name):
    k = KERNELS[kernel]
    out = k.fn(*case_batch(name).args(), interpret=k.interpret, **CASES[name].attn_kwargs)
    assert_matches_case(name, out)


# One forced block configuration per call (no dispatch).
@pytest.mark.parametrize("kernel, name, config", per_kernel({
    "gpu": [
        ("prefill_mha_h64_p32", dict(rows_per_block=64, kv_splits=1)),
        ("chunked_long_mha_p64_bf16_window", dict(rows_per_block=32, kv_splits=3)),  # split-K on a prefill chunk too
        ("decode_gqa4_p32_bf16_window", dict(rows_per_block=16, kv_splits=4)),
        ("mixed_gqa4_h128_p16_bf16", dict(rows_per_block=16, kv_splits=2)),
        ("decode_gqa4_h128_p16", dict(rows_per_block=16, kv_splits=1)),
        ("smollm_heads_9_3_h64_cap", dict(rows_per_block=16, kv_splits=5)),  # more splits than kv blocks
    ],
    "tpu": [
        ("prefill_mha_h64_p32", dict(num_queries_per_block=16, num_kv_pages_per_block=None)),
        ("chunked_long_mha_p64_bf16_window", dict(num_queries_per_block=32, num_kv_pages_per_block=None)),
        ("decode_gqa4_p32_bf16_window", dict(num_queries_per_block=8, num_kv_pages_per_block=1)),
        # The decode-sized block on prefill data and the other way round, single-page
        # kv blocks, and a block size that divides neither T nor the requests.
        ("mixed_gqa8_h64_p64_window_cap", dict(num_queries_per_block=8, num_kv_pages_per_block=1)),
        ("decode_gqa4_h128_p16", dict(num_queries_per_block=32, num_kv_pages_per_block=3)),
        ("mixed_gqa4_h128_p16_bf16", dict(num_queries_per_block=5, num_kv_pages_per_block=2)),
    ],
}))
def test_kernel_single_block_config(kernel, name, config):
    k = KERNELS[kernel]
    out = k.fn(*case_batch(name).args(), interpret=k.interpret, **config, **CASES[name].attn_kwargs)
    assert_matches_case(name, out)


BOTH = [pytest.param("gpu", id="gpu"), pytest.param("tpu", marks=[_SKIP_TPU_ON_GPU], id="tpu")]


@pytest.mark.parametrize("kernel", BOTH)
def test_kernel_ignores_rows_past_num_seqs(kernel):
    k = KERNELS[kernel]
    name = "mixed_gqa4_h128_p16_bf16"
    b = case_batch(name)
    r = len(b.seqs)
    out = k.fn(
        b.q, b.kv_cache, b.kv_lens.at[r:].set(10**5), b.page_indices.at[r:].set(-7), b.cu_q_lens.at[r + 1:].set(0),
        b.num_seqs, interpret=k.interpret, **k.small, **CASES[name].attn_kwargs,
    )
    assert_matches_case(name, out)


@pytest.mark.parametrize("kernel", BOTH)
def test_kernel_empty_step_gives_zeros(kernel):
    k = KERNELS[kernel]
    name = "mixed_gqa4_h128_p16_bf16"
    b = case_batch(name)
    out = k.fn(
        b.q, b.kv_cache, b.kv_lens, b.page_indices, b.cu_q_lens, b.num_seqs * 0, interpret=k.interpret,
        **k.small, **CASES[name].attn_kwargs,
    )
    np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)


@pytest.mark.parametrize("kernel", BOTH)
def test_kernel_reads_a_stacked_cache_in_place(kernel):
    k = KERNELS[kernel]
    name = "smollm_heads_9_3_h64_cap"
    b = case_batch(name)
    stacked = jnp.stack([b.kv_cache * 0.5, b.kv_cache, b.kv_cache * 2.0])  # [L, P, S, 2K, H]
    out = k.fn(
        b.q, stacked, b.kv_lens, b.page_indices, b.cu_q_lens, b.num_seqs, layer=jnp.int32(1), **k.stacked,
        **CASES[name].attn_kwargs,
    )
    assert_matches_case(name, out)
    with pytest.raises(ValueError, match="layer"):
        k.fn(*b.args(), layer=0, interpret=k.interpret, **CASES[name].attn_kwargs)
