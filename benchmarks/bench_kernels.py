"""Ragged paged attention: kernel vs reference per shape, against the device's copy ceiling.

    python benchmarks/bench_kernels.py            # 8B-model heads (32 / 8 x 128), bf16
    python benchmarks/bench_kernels.py --small    # tiny shapes, runs on CPU in seconds

For each shape and backend it prints the median time of a jitted call, the bytes the
step must move at least (the KV of every request once, plus q and o), the achieved
bandwidth and attention FLOP/s (4*N*H per query-key pair actually attended), and the
bandwidth as a fraction of a measured copy ceiling (``x + 1`` over a large buffer:
read + write). On CPU the "pallas" backend is the TPU kernel under the Pallas
interpreter: its timings there say nothing about hardware, the run is a smoke test.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import commit_line, machine_line  # noqa: E402
from pallas_kernels import backend  # noqa: E402


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
    name: str
    seqs: tuple  # ((q_len, kv_len), ...)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int


def full_shapes() -> list[Shape]:
    heads = dict(num_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
    shapes = []
    for r in (64, 256):
        for ctx in (1024, 8192):
            shapes.append(Shape(name=f"decode r={r} ctx={ctx}", seqs=((1, ctx),) * r, **heads))
    shapes.append(Shape(name="prefill 4x1024", seqs=((1024, 1024),) * 4, **heads))
    shapes.append(Shape(name="chunked 8x512 @4096", seqs=((512, 4096),) * 8, **heads))
    shapes.append(Shape(name="mixed 2048 + 128 decodes @2048", seqs=((2048, 2048),) + ((1, 2048),) * 128, **heads))
    return shapes


def small_shapes() -> list[Shape]:
    heads = dict(num_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    return [
        Shape(name="decode r=8 ctx=128", seqs=((1, 128),) * 8, **heads),
        Shape(name="prefill 2x64", seqs=((64, 64),) * 2, **heads),
        Shape(name="mixed 48 + 6 decodes @96", seqs=((48, 96),) + ((1, 96),) * 6, **heads),
    ]


def build_inputs(shape: Shape, dtype, seed: int = 0):
    """Device arrays for one step: shuffled page tables over a cache sized to fit."""
    rng = np.random.default_rng(seed)
    s = shape.page_size
    n_pages = [pl.cdiv(kv, s) for _, kv in shape.seqs]
    r = len(shape.seqs)
    pmax = max(n_pages)
    num_pages = 1 + sum(n_pages)
    perm = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    page_indices = np.zeros((r, pmax), np.int32)
    pos = 0
    for i, n in enumerate(n_pages):
        page_indices[i, :n] = perm[pos : pos + n]
        pos += n
    cu = np.concatenate([[0], np.cumsum([q for q, _ in shape.seqs])]).astype(np.int32)
    t = int(cu[-1])
    k0, k1 = jax.random.split(jax.random.key(seed))
    q = jax.random.normal(k0, (t, shape.num_heads, shape.head_dim), dtype)
    kv_cache = jax.random.normal(k1, (num_pages, s, 2 * shape.num_kv_heads, shape.head_dim), dtype)
    kv_lens = jnp.asarray([kv for _, kv in shape.seqs], jnp.int32)
    return (q, kv_cache, kv_lens, jnp.asarray(page_indices), jnp.asarray(cu), jnp.asarray(r, jnp.int32))


def min_bytes(shape: Shape, dtype) -> int:
    item = jnp.dtype(dtype).itemsize
    kv = sum(kv for _, kv in shape.seqs) * 2 * shape.num_kv_heads * shape.head_dim * item
    t = sum(q for q, _ in shape.seqs)
    return kv + 2 * t * shape.num_heads * shape.head_dim * item


def attention_flops(shape: Shape) -> int:
    pairs = sum(sum(kv - q + i + 1 for i in range(q)) for q, kv in shape.seqs)
    return 4 * pairs * shape.num_heads * shape.head_dim


def reference_gather_bytes(shape: Shape) -> int:
    """Peak of the reference's per-token page gather (f32), to skip what cannot fit."""
    t = sum(q for q, _ in shape.seqs)
    pmax = max(pl.cdiv(kv, shape.page_size) for _, kv in shape.seqs)
    return 3 * t * min(8, pmax) * shape.page_size * 2 * shape.num_kv_heads * shape.head_dim * 4


def time_fn(fn, args, iters: int, rounds: int = 5) -> float:
    """Median over rounds of the mean time per call, with ``iters`` calls dispatched
    back to back and one sync per round (a sync per call would count dispatch and
    synchronisation latency, tens of microseconds, against kernels that take ~0.1 ms)."""
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(iters)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) / iters)
        del outs
    return statistics.median(times)


def copy_ceiling(nbytes: int, iters: int) -> float:
    """Bytes/s of ``x + 1`` (one read, one write) over an nbytes buffer."""
    x = jnp.zeros((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    return 2 * x.nbytes / time_fn(f, (x,), iters)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bf16, f32 with --small")
    p.add_argument("--backends", default="reference,pallas")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--interpret", action="store_true", help="run the pallas kernels interpreted")
    p.add_argument("--max-reference-gib", type=float, default=16.0,
                   help="skip the reference where its page gather would exceed this")
    args = p.parse_args(argv)

    platform = jax.default_backend()
    dtype = jnp.dtype(args.dtype or ("float32" if args.small else "bfloat16"))
    iters = args.iters or (3 if args.small or platform == "cpu" else 20)
    shapes = small_shapes() if args.small else full_shapes()
    ceiling = copy_ceiling((32 if args.small else 1024) * 2**20, iters)
    dev = jax.devices()[0]
    print(machine_line())
    print(commit_line())
    print(f"device: {dev.device_kind} ({platform}), jax {jax.__version__}, dtype {dtype.name}")
    print(f"copy ceiling: {ceiling / 1e9:.1f} GB/s")
    if platform == "cpu" and "pallas" in args.backends:
        print("note: pallas on cpu = TPU kernel under the interpreter (smoke test, not a speed figure)")
    header = f"{'shape':34s} {'backend':9s} {'ms':>9s} {'GB/s':>8s} {'%copy':>6s} {'GFLOP/s':>9s} {'max|d|':>8s}"
    print(header)
    print("-" * len(header))
    for shape in shapes:
        inputs = build_inputs(shape, dtype)
        scale = 1.0 / math.sqrt(shape.head_dim)
        nbytes, flops = min_bytes(shape, dtype), attention_flops(shape)
        outputs = {}
        for name in args.backends.split(","):
            if name == "reference" and reference_gather_bytes(shape) > args.max_reference_gib * 2**30:
                print(f"{shape.name:34s} {name:9s} {'skipped (reference gather too large)':>40s}")
                continue
            attn = backend.get_attention_fn(name, platform, interpret=args.interpret)
            fn = jax.jit(lambda *a, attn=attn: attn(*a, sm_scale=scale))
            try:
                dt = time_fn(fn, inputs, iters)
            except Exception as e:  # keep going: one failing backend must not hide the rest
                print(f"{shape.name:34s} {name:9s} FAILED: {type(e).__name__}: {str(e)[:200]}")
                continue
            outputs[name] = fn(*inputs)
            diff = ""
            if name != "reference" and "reference" in outputs:
                d = jnp.max(jnp.abs(outputs[name].astype(jnp.float32) - outputs["reference"].astype(jnp.float32)))
                diff = f"{float(d):.2e}"
            bw = nbytes / dt
            print(f"{shape.name:34s} {name:9s} {dt * 1e3:9.3f} {bw / 1e9:8.1f} {100 * bw / ceiling:6.1f} "
                  f"{flops / dt / 1e9:9.1f} {diff:>8s}")
        del inputs, outputs


if __name__ == "__main__":
    main()
