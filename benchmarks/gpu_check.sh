#!/usr/bin/env bash
# GPU check of the Pallas attention kernels, for a lent GPU machine (Python 3.12,
# JAX >= 0.11 with CUDA, no network). Run from anywhere:
#
#     bash benchmarks/gpu_check.sh            # logs also go to $OUT (default /tmp/gpu_check)
#
# 1. the GPU kernel tests, compiled for the GPU (tests/pallas_kernels/test_gpu.py and
#    test_kernel_contract.py detect the GPU and run the Triton kernel for real, skipping
#    the contract's TPU cases, against the reference run on
#    the same GPU with f32 matmuls at full precision), plus the reference, dispatch
#    and lowering tests; without pytest, a built-in equivalent of the kernel tests;
# 2. the kernel benchmark (8B-model heads, bf16): time, GB/s vs the copy ceiling,
#    FLOP/s, and the max difference to the reference for every shape.
# Exit status: non-zero if the tests failed (the benchmark is informative only).
# GPU_CHECK_ALLOW_CPU=1 dry-runs the script on a CPU machine (kernels interpreted,
# benchmark with --small): it checks the script, not the GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
# Tests and benchmark run one after another; do not let either grab 75% up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
# tests/conftest.py pins the CPU unless JAX_PLATFORMS is set; an empty value lets JAX
# pick the GPU, so the kernel tests compile the Triton kernel for real.
export JAX_PLATFORMS="${JAX_PLATFORMS:-}"
# The Triton backend warns of its deprecation (JAX >= 0.11) at every lowering.
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore::DeprecationWarning}

{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; } | tee "$OUT/env.txt"
$PY - <<'PYEOF' 2>&1 | tee -a "$OUT/env.txt"
import os, sys, jax
print("python", sys.version.split()[0], "jax", jax.__version__, "backend", jax.default_backend(), jax.devices())
if jax.default_backend() != "gpu" and os.environ.get("GPU_CHECK_ALLOW_CPU") != "1":
    sys.exit("no GPU visible to JAX: nothing to check here")
PYEOF
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 2

status=0
if $PY -c "import pytest" 2>/dev/null; then
  $PY -c "import jax; print('tests run on', jax.default_backend())" 2>&1 | tee "$OUT/tests.txt"
  timeout -k 10 180 $PY -m pytest -q -p no:cacheprovider -o addopts="" \
      tests/pallas_kernels/test_gpu.py tests/pallas_kernels/test_kernel_contract.py \
      tests/pallas_kernels/test_reference.py \
      tests/pallas_kernels/test_backend.py tests/pallas_kernels/test_lowering.py \
      2>&1 | tee -a "$OUT/tests.txt"
  status=${PIPESTATUS[0]}
else
  echo "pytest not installed: running the built-in kernel check" | tee "$OUT/tests.txt"
  timeout -k 10 180 $PY - <<'PYEOF' 2>&1 | tee -a "$OUT/tests.txt"
import sys, traceback
import jax
sys.path.insert(0, "tests/pallas_kernels")
from pallas_kernels import gpu
from rpa_cases import CASES, assert_matches_case, case_batch
failed = 0
for name in sorted(CASES):
    for kw in ({}, {"rows_per_block": 16, "kv_splits": 3}, {"rows_per_block": 64, "kv_splits": 1}):
        try:
            out = gpu.ragged_paged_attention(*case_batch(name).args(), interpret=jax.default_backend() != "gpu",
                                             **kw, **CASES[name].attn_kwargs)
            assert_matches_case(name, out)
            print("ok  ", name, kw)
        except Exception:
            failed += 1
            print("FAIL", name, kw)
            traceback.print_exc()
print(f"{failed} failed")
sys.exit(1 if failed else 0)
PYEOF
  status=${PIPESTATUS[0]}
fi

bench_args=("$@")
[ "${GPU_CHECK_ALLOW_CPU:-0}" = 1 ] && bench_args+=(--small)
# Test and benchmark limits (180 + 270 s) stay inside one 600 s device command.
timeout -k 10 270 $PY benchmarks/bench_kernels.py "${bench_args[@]}" 2>&1 | tee "$OUT/bench.txt"
echo "tests exit status: $status (logs in $OUT)"
exit "$status"
