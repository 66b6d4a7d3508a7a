"""The Triton-style GPU kernel against the reference: what only this kernel has (the
shared contract, run for both kernels, is in test_kernel_contract.py).

On CPU the kernel runs under the Pallas interpreter (``interpret=True``); on a GPU
machine (``benchmarks/gpu_check.sh``) the same tests run it compiled.
"""
import jax
import numpy as np

from pallas_kernels import gpu
from rpa_cases import make_batch, reference_attention

INTERPRET = jax.default_backend() != "gpu"


def test_gpu_kernel_head_dim_not_a_power_of_two():
    b = make_batch([(4, 30), (1, 50), (0, 2), (9, 9)], num_heads=6, num_kv_heads=2, head_dim=48)
    out = gpu.ragged_paged_attention(*b.args(), sm_scale=0.15, interpret=INTERPRET, rows_per_block=16, kv_splits=2)
    np.testing.assert_allclose(np.asarray(out), np.asarray(reference_attention(*b.args(), sm_scale=0.15)),
                               atol=2e-5, rtol=2e-5)


def test_default_kv_splits_fill_the_gpu_only_when_needed():
    assert gpu.default_kv_splits(num_seqs_max=256, k_heads=8, max_kv_blocks=128) == 1
    assert gpu.default_kv_splits(num_seqs_max=4, k_heads=8, max_kv_blocks=128) == 16
    assert gpu.default_kv_splits(num_seqs_max=4, k_heads=8, max_kv_blocks=3) == 4
