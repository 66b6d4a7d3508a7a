"""bf16 products of a few rows on a CPU with AVX512-BF16, as native code: an XLA FFI
custom call (csrc/bf16_matmul_cpu.cc). The weight is [in, out], or [out, in] (a tied
embedding as the lm_head: ``transposed``).

``models.quantization.matmul`` multiplies float32 activations by bf16 weights (the
default on such a CPU): x rounded to bf16, float32 accumulation. XLA:CPU runs that
product well at prefill sizes but at 64 rows and fewer (decode) one core does most of
it: on a 2-core Zen 4 VM, 65-85 GFLOP/s at 8 rows and 170-275 at 64, against 170-240
and 300-380 here (each thread takes whole blocks of 64 output columns). Used for at most
MAX_ROWS rows, on one device (the custom call is not partitioned), when the CPU has
AVX512-BF16 but no AMX and the kernel builds (``enabled``); XLA's dot otherwise. A row's result
does not depend on the other rows or on their number (k runs in one fixed order).

The library is compiled and cached like the attention kernel's (pallas_kernels/cpu.py).
``JAXSERVE_NATIVE_MATMUL=0`` turns it off (for comparisons).
"""
from __future__ import annotations

import functools
import logging
import math
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu import build_library, cpu_flags, register_library
from pallas_kernels.storage import BF16_BITS

SOURCE = pathlib.Path(__file__).parent / "csrc" / "bf16_matmul_cpu.cc"
TARGET = "jaxserve_bf16_matmul_cpu_v2"
_SYMBOL = "JaxserveBf16MatmulCpu"
# Up to here the kernel was faster than XLA's dot at SmolLM2's shapes (2-core Zen 4:
# ~1.1-1.3x at 128 rows, even at 256, behind at 2048).
MAX_ROWS = 128
# A transposed weight [N, K] (the tied lm_head) goes through per-(row, column) dot
# products, which beat XLA's product only at the fewest rows (49152 x 576 on the same VM:
# 3.6 vs 5.2 ms at 1 row, 5.8 vs 5.0 at 8, 17.8 vs 14.7 at 64). Batch-invariant mode
# takes it for every row count (XLA in fixed 64-row tiles took 14 ms at 1 row).
MAX_TRANSPOSED_ROWS = 4


def preferred_on(flags) -> bool:
    """Whether the kernel is the faster product on a CPU with these /proc/cpuinfo flags:
    AVX512-BF16 without AMX (Zen 4). With AMX XLA's dot runs on AMX and beat the kernel
    at 8-128 rows on a 2-core Sapphire Rapids VM (SmolLM2's 576 x 1536: 148 vs 194 us at
    8 rows, 391 vs 1358 us at 128; only 1 row favoured the kernel, 108 vs 147 us). There,
    in the engine, the kernel also moved a tiny llama's prompt logprobs by 4.4e-3 from a
    float64 emulation of the same bf16 products where XLA's were within 4e-7, with the
    MLP's [32, 64] x [64, 128] products alone to blame although each such product, also
    under a layer scan, matched exactly in isolation: not root-caused, and not seen on
    Zen 4 (tests/e2e/test_native_matmul.py)."""
    return "avx512_bf16" in flags and "amx_bf16" not in flags


@functools.cache
def enabled() -> bool:
    """Whether products go through the kernel in this process: a CPU backend, a CPU it is
    preferred on (``preferred_on``), the library built and registered with XLA, and not
    turned off by JAXSERVE_NATIVE_MATMUL=0."""
    if os.environ.get("JAXSERVE_NATIVE_MATMUL", "1") == "0" or jax.default_backend() != "cpu":
        return False
    return preferred_on(cpu_flags()) and _registered()


@functools.cache
def _registered() -> bool:
    """Build (once per machine), load and register the kernel (once per process)."""
    if "avx512_bf16" not in cpu_flags():
        return False
    what, fallback = "the CPU bf16 matmul kernel", "XLA's dot instead"
    return register_library(build_library(SOURCE, "bf16_matmul_cpu", what, fallback), _SYMBOL, TARGET, what, fallback)


def takes(x, w, transposed: bool, any_rows: bool = False) -> bool:
    """Whether ``matmul_bf16`` takes this product: float32 x of at most MAX_ROWS rows (any
    number with ``any_rows``: batch-invariant mode), a bf16 (or bit-pattern) weight [in,
    out] (``transposed``: [out, in])."""
    rows = math.prod(x.shape[:-1])
    limit = MAX_TRANSPOSED_ROWS if transposed else MAX_ROWS
    return (x.dtype == jnp.float32 and w.ndim == 2
            and jnp.dtype(w.dtype) in (jnp.dtype(jnp.bfloat16), BF16_BITS) and (any_rows or rows <= limit))


def matmul_bf16(x, w, transposed: bool = False):
    """x [..., K] float32 @ w [K, N] bf16 (or its uint16 bit patterns; ``transposed``: w
    is [N, K]) -> [..., N] float32, x rounded to bf16, float32 accumulation: XLA's
    ``dot_general(x.astype(bf16), w, preferred_element_type=float32)``, as one native call."""
    if not _registered():
        raise RuntimeError("the CPU bf16 matmul kernel is not available (it needs AVX512-BF16 and a C++ compiler)")
    n, k = w.shape if transposed else w.shape[::-1]
    x2 = x.reshape(-1, k)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32))
    return call(x2, w, transposed=np.int32(transposed)).reshape(x.shape[:-1] + (n,))


if __name__ == "__main__":
    # `make install` builds the kernel ahead, so the first server start does not wait for it.
    logging.basicConfig(level=logging.INFO)
    print(f"CPU bf16 matmul kernel: {'built' if enabled() else 'not used on this machine (XLA dot instead)'}")
