"""Ragged paged attention for the CPU as native code: an XLA FFI custom call.

The kernel (csrc/ragged_paged_attention_cpu.cc) keeps reference.py's signature and
semantics; it exists because XLA:CPU runs the reference's small batched products at
10-20 GFLOP/s (decode attention was 81% of a 64-request step). It is compiled on this
machine, once, with the system C++ compiler and ``-march=native``, into a cache keyed
by the source, the compiler, the flags and the CPU's feature flags
(``$JAXSERVE_KERNEL_CACHE``, default ``~/.cache/jaxserve/kernels``); ``make install``
builds it ahead (``python -m pallas_kernels.cpu``). Where no compiler is found or the
build fails, ``available()`` is False and the backend falls back to the reference.

Cache dtypes: float32, bfloat16 (or its uint16 bit patterns, storage.py), 8-bit floats
(widened through a 256-entry table, exactly as ``astype(float32)``). q: float32 or bfloat16.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.inputs import layer_index, validate_inputs
from pallas_kernels.storage import BF16_BITS

logger = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).parent / "csrc" / "ragged_paged_attention_cpu.cc"
TARGET = "jaxserve_ragged_paged_attention_cpu_v2"
_SYMBOL = "JaxserveRaggedPagedAttentionCpu"
_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-std=c++17", "-shared", "-fPIC", "-w")
_CACHE_F32, _CACHE_BF16, _CACHE_BYTE_LUT = 0, 1, 2
MAX_HEAD_DIM = 576  # the kernel's kMaxHeadVectors * 16 (DeepSeek's latent rows: 512 + 64)


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def cpu_flags() -> frozenset[str]:
    """This machine's CPU feature flags (Linux x86: /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("JAXSERVE_KERNEL_CACHE")
    if root:
        return pathlib.Path(root)
    return pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "jaxserve" / "kernels"


def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def library_path() -> pathlib.Path | None:
    """The compiled kernel for this machine, built now if missing (None: no compiler, or
    the build failed; the reason is logged)."""
    return build_library(SOURCE, "rpa_cpu", "the CPU attention kernel", "falling back to the reference kernel")


def build_library(source: pathlib.Path, stem: str, what: str, fallback: str) -> pathlib.Path | None:
    """``source`` compiled into a shared library for this machine, in the cache (built now
    if missing; None: no compiler, or the build failed, logged with ``fallback``, what the
    caller does instead)."""
    cxx = _compiler()
    if cxx is None:
        logger.warning("no C++ compiler found (set CXX) for %s: %s", what, fallback)
        return None
    include = jax.ffi.include_dir()
    key = hashlib.sha256("\0".join([source.read_text(), cxx, _compiler_version(cxx), " ".join(_FLAGS), include,
                                    jax.__version__, " ".join(sorted(cpu_flags()))]).encode()).hexdigest()[:20]
    out = _cache_dir() / f"{stem}_{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: concurrent builders (pytest workers, two
    # servers) each produce a whole file, and the last rename wins.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *_FLAGS, "-isystem", include, str(source), "-o", tmp]
    print(f"jaxserve: compiling {what} ({pathlib.Path(cxx).name})...", file=sys.stderr, flush=True)
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as e:
        res = None
        err = str(e)
    else:
        err = res.stderr[-2000:]
    if res is None or res.returncode != 0:
        os.unlink(tmp)
        logger.warning("building %s failed (%s): %s\n%s", what, " ".join(cmd), fallback, err)
        return None
    os.replace(tmp, out)
    return out


def register_library(path: pathlib.Path | None, symbol: str, target: str, what: str, fallback: str) -> bool:
    """Load a built library (``build_library``) and register its FFI handler ``symbol`` with
    XLA as ``target``; False (logged with ``fallback``) when it was not built or fails to load."""
    if path is None:
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (OSError, AttributeError) as e:
        logger.warning("loading %s from %s failed (%s): %s", what, path, e, fallback)
        return False
    return True


@functools.cache
def available() -> bool:
    """Whether the native kernel is built, loaded and registered with XLA (once per process)."""
    return register_library(library_path(), _SYMBOL, TARGET, "the CPU attention kernel",
                            "falling back to the reference kernel")


def supports(q, kv_cache) -> bool:
    """Whether the kernel takes these arrays' dtypes and head dim (else: the reference)."""
    return (jnp.dtype(q.dtype) in (jnp.float32, jnp.bfloat16) and _cache_kind(kv_cache.dtype) is not None
            and q.shape[-1] <= MAX_HEAD_DIM)


def _cache_kind(dtype) -> int | None:
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return _CACHE_F32
    if dtype in (jnp.bfloat16, BF16_BITS):
        return _CACHE_BF16
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1:
        return _CACHE_BYTE_LUT
    return None


def _byte_table(dtype) -> jax.Array:
    """[256] float32: the value of each of an 8-bit float type's bit patterns (zeros for
    other caches). Computed in the program from an iota: a constant array would be hoisted
    into a hidden argument, and the executable cache does not save such programs."""
    if _cache_kind(dtype) != _CACHE_BYTE_LUT:
        return jnp.zeros((256,), jnp.float32)
    return jax.lax.bitcast_convert_type(jnp.arange(256, dtype=jnp.uint8), dtype).astype(jnp.float32)


def ragged_paged_attention(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None, layer=None,
                           fixed_order: bool = False, sinks=None, keys_ahead=None):
    """reference.ragged_paged_attention's contract, as one native call (see the module docstring).
    ``fixed_order`` (batch-invariant mode): a query's scores are summed in one order
    whatever its request's query count (decode, speculative verify, prefill chunk); the
    default picks the faster order per item, which moves results by rounding.

    q: [T, N, H]; kv_cache: [P, S, 2K, H] (or [L, P, S, 2K, H] with ``layer``); kv_lens [R],
    page_indices [R, Pmax], cu_q_lens [R+1] int32; num_seqs int32 scalar; sinks: None or
    [N] float32 (reference.sink_factor); keys_ahead: None or [T] int32 (the reference's).
    Returns o [T, N, H].
    """
    validate_inputs(q, kv_cache, kv_lens, page_indices, cu_q_lens, sliding_window=sliding_window, soft_cap=soft_cap)
    kind = _cache_kind(kv_cache.dtype)
    if not supports(q, kv_cache):
        raise ValueError(f"the CPU kernel takes q in float32 / bfloat16, a float32, bfloat16 or 8-bit float cache and "
                         f"head_dim <= {MAX_HEAD_DIM}, got q {q.dtype} {q.shape}, kv_cache {kv_cache.dtype}")
    if not available():
        raise RuntimeError("the CPU attention kernel is not available (no C++ compiler, or its build failed)")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, kv_cache, kv_lens, page_indices, cu_q_lens, jnp.reshape(num_seqs, (1,)).astype(jnp.int32),
                layer_index(kv_cache, layer), _byte_table(kv_cache.dtype),
                jnp.zeros((1,), jnp.float32) if sinks is None else jnp.asarray(sinks, jnp.float32).reshape(-1),
                jnp.zeros((1,), jnp.int32) if keys_ahead is None else jnp.asarray(keys_ahead, jnp.int32).reshape(-1),
                sm_scale=np.float32(sm_scale), sliding_window=np.int64(sliding_window or 0),
                soft_cap=np.float32(soft_cap or 0.0), cache_kind=np.int32(kind), fixed_order=np.int32(bool(fixed_order)),
                has_sinks=np.int32(sinks is not None), has_ahead=np.int32(keys_ahead is not None))


if __name__ == "__main__":
    # `make install` builds the kernel ahead, so the first server start does not wait for it.
    logging.basicConfig(level=logging.INFO)
    print(f"CPU attention kernel: {library_path() if available() else 'not available (reference kernel instead)'}")
