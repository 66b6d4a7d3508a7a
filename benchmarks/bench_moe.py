"""MoE feed-forward: the grouped expert matmul on CPU, and the expert-parallel exchanges.

    python benchmarks/bench_moe.py                 # both parts, a Qwen3-MoE-like layer scaled down
    python benchmarks/bench_moe.py --part grouped  # one device: ragged_dot vs the tiled loop
    python benchmarks/bench_moe.py --part ep       # 8 simulated CPU devices: TP vs EP exchanges

Part "grouped": one MoE layer (router, top-k, experts) on one device, with the experts
as ``jax.lax.ragged_dot`` (XLA:CPU lowers it to a product with every group) and as
``tiled_expert_mlp`` (the CPU path in models/moe.py).

Part "ep": the same layer on 8 host devices (``--xla_force_host_platform_device_count``)
laid out as tensor parallel (experts split by their mlp dim), expert parallel with the
all-reduce exchange ("allgather") and with the token all-to-all ("alltoall"). Host
devices share this machine's cores and memory, so this compares the exchanges' data
movement and per-device work, not interconnect speed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def timed(fn, *args, repeats=5):
    fn(*args).block_until_ready()  # compile
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def layer_weights(e, d, f, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return (rng.normal(0, 1, (d, e)).astype(np.float32), rng.normal(0, 0.05, (e, d, f)).astype(np.float32),
            rng.normal(0, 0.05, (e, d, f)).astype(np.float32), rng.normal(0, 0.05, (e, f, d)).astype(np.float32))


def part_grouped(args) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from models import moe

    router, gate, up, down = map(jnp.asarray, layer_weights(args.experts, args.hidden, args.expert_dim))
    k = args.top_k

    def layer(x, router, gate, up, down, mlp):
        w, experts = moe.route(x @ router, k, True)
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.bincount(flat, length=args.experts).astype(jnp.int32)
        xs = jnp.repeat(x, k, axis=0)[order]
        out = jnp.zeros_like(xs).at[order].set(mlp(xs, sizes, gate, up, down))
        return jnp.sum(out.reshape(x.shape[0], k, -1) * w[..., None], axis=1)

    def ragged(xs, sizes, gate, up, down):
        h = jax.nn.silu(jax.lax.ragged_dot(xs, gate, sizes)) * jax.lax.ragged_dot(xs, up, sizes)
        return jax.lax.ragged_dot(h, down, sizes)

    def tiled(xs, sizes, gate, up, down):
        return moe.tiled_expert_mlp(xs, sizes, (gate, up, down))

    ws = (router, gate, up, down)  # arguments, not constants (XLA would fold them at compile time)
    run_tiled = jax.jit(lambda x, *w: layer(x, *w, tiled))
    run_ragged = jax.jit(lambda x, *w: layer(x, *w, ragged))

    print(f"\n## grouped expert MLP, one device: E={args.experts} top-{k} D={args.hidden} F={args.expert_dim}")
    print("| tokens | ragged_dot (ms) | tiled (ms) | speedup | expert GFLOP/s (tiled) |")
    print("|---|---|---|---|---|")
    for t in args.tokens:
        x = jnp.asarray(np.random.default_rng(t).normal(0, 1, (t, args.hidden)).astype(np.float32))
        tt = timed(run_tiled, x, *ws)
        flops = 2 * 3 * t * k * args.hidden * args.expert_dim
        if t * k * args.experts * args.hidden * 4 <= args.max_dense_bytes:
            tr = timed(run_ragged, x, *ws)
            a, b = run_ragged(x, *ws), run_tiled(x, *ws)
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)
            rtxt, sp = f"{tr * 1e3:.1f}", f"{tr / tt:.1f}x"
        else:
            rtxt, sp = "(skipped: dense fallback > --max-dense-bytes)", "-"
        print(f"| {t} | {rtxt} | {tt * 1e3:.1f} | {sp} | {flops / tt / 1e9:.1f} |", flush=True)


def part_ep(args) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from models.moe import moe_block

    n = len(jax.devices())
    mesh = jax.make_mesh((1, n), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    router, gate, up, down = layer_weights(args.experts, args.hidden, args.expert_dim)
    put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
    layouts = {
        "tensor parallel": (False, "allgather", [put(gate, None, None, "model"), put(up, None, None, "model"),
                                                 put(down, None, "model", None)]),
        "EP allgather": (True, "allgather", [put(w, "model", None, None) for w in (gate, up, down)]),
        "EP alltoall": (True, "alltoall", [put(w, "model", None, None) for w in (gate, up, down)]),
    }
    print(f"\n## MoE layer on {n} host devices: E={args.experts} top-{args.top_k} D={args.hidden} "
          f"F={args.expert_dim}")
    print("| tokens | " + " | ".join(f"{name} (ms)" for name in layouts) + " | collectives in HLO |")
    print("|---|" + "---|" * len(layouts) + "---|")
    for t in args.tokens:
        x = put(np.random.default_rng(t).normal(0, 1, (t, args.hidden)).astype(np.float32), "data", None)
        row, outs, ops = [], [], []
        for name, (ep, strategy, w) in layouts.items():
            fn = jax.jit(lambda x, r, g, u, d, ep=ep, s=strategy: moe_block(
                x, r, (g, u, d), top_k=args.top_k, normalize=True, mesh=mesh, expert_parallel=ep, strategy=s))
            row.append(timed(fn, x, put(router), *w))
            outs.append(np.asarray(fn(x, put(router), *w)))
            hlo = fn.lower(x, put(router), *w).compile().as_text()
            ops.append("+".join(c for c in ("all-reduce", "all-to-all", "all-gather") if f" {c}(" in hlo
                                or f"{c}-start" in hlo) or "none")
        for o in outs[1:]:
            np.testing.assert_allclose(o, outs[0], rtol=1e-3, atol=1e-3)  # f32 sums in another order
        print(f"| {t} | " + " | ".join(f"{s * 1e3:.1f}" for s in row) + f" | {', '.join(ops)} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("grouped", "ep", "all"), default="all")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--expert-dim", type=int, default=384)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--max-dense-bytes", type=int, default=2 << 30,
                    help="skip ragged_dot when its dense fallback's [E, T k, D] operand is larger")
    args = ap.parse_args()
    if args.part in ("ep", "all"):
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    from common import commit_line, cpu_line, machine_line

    print(machine_line())
    print(cpu_line())
    print(commit_line())
    if args.part in ("grouped", "all"):
        part_grouped(args)
    if args.part in ("ep", "all"):
        part_ep(args)


if __name__ == "__main__":
    main()
