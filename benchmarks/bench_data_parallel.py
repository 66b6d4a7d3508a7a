"""Data parallelism: one SPMD program for all ranks (what jaxserve does) against one
program per rank (two engines, each on its own device), on simulated CPU devices.

Measures what the choice changes: programs compiled and warm-up time, and the
host's cost per step (one dispatch and one device_get for all ranks, or one per
rank). The simulated devices share this machine's cores, so the compute itself
does not scale here; on TPU each rank has its own chips.

    python benchmarks/bench_data_parallel.py [--model DIR] [--requests 32] [--input-len 64] [--output-len 32]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
from common import commit_line, engine_kwargs, machine_line, parse_engine_args  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    # The engine's flags; the batch is --requests, and the comparison sets the ranks.
    args, engine_args = parse_engine_args(ap, fixed=("max_num_seqs", "data_parallel_size"),
                                          max_model_len=256, max_num_batched_tokens=256)

    import jax

    from jaxserve import LLM, SamplingParams
    from jaxserve.runner import model_runner

    print(machine_line(), commit_line(), sep="\n")
    print("cpu:", next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                       "?"), "| avx512_bf16" if "avx512_bf16" in open("/proc/cpuinfo").read() else "| no avx512_bf16")
    engine_kw = dict(engine_kwargs(engine_args, max_num_seqs=args.requests), compilation_cache=False, progress=False)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 30000, args.input_len).tolist()} for _ in range(args.requests)]
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    def drive(engines, share):
        """Add each engine its share of the requests, step all engines in turn until done."""
        for e, part in zip(engines, share):
            for i, p in part:
                e.add_request(str(i), p, sp)
        t0, steps = time.perf_counter(), 0
        while any(e.has_unfinished_requests() for e in engines):
            for e in engines:
                if e.has_unfinished_requests():
                    e.step()
                    steps += 1
        return time.perf_counter() - t0, steps

    indexed = list(enumerate(prompts))
    # One SPMD program, both ranks.
    t0 = time.perf_counter()
    llm = LLM(**{**engine_kw, "data_parallel_size": 2})
    eng = llm.llm_engine
    start = time.perf_counter() - t0
    dt, steps = drive([eng], [indexed])
    print(f"SPMD dp=2:        start-up {start:5.1f} s (warm-up {eng.warmup_seconds:5.1f} s), "
          f"{eng.num_compiled_programs} programs; {args.requests * args.output_len / dt:6.1f} tok/s, "
          f"{steps} engine steps, {1000 * dt / steps:6.1f} ms per step")
    del llm, eng

    # One program per rank: two engines, the second on device 1.
    make_mesh = model_runner.make_mesh
    engines, start = [], 0.0
    for rank in range(2):
        model_runner.make_mesh = lambda tp, dp, r=rank: jax.make_mesh(
            (1, 1), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=[jax.devices()[r]])
        t0 = time.perf_counter()
        engines.append(LLM(**engine_kw).llm_engine)
        start += time.perf_counter() - t0
    model_runner.make_mesh = make_mesh
    dt, steps = drive(engines, [indexed[0::2], indexed[1::2]])
    rounds = steps / 2
    print(f"per-rank programs: start-up {start:5.1f} s (warm-up {sum(e.warmup_seconds for e in engines):5.1f} s), "
          f"{sum(e.num_compiled_programs for e in engines)} programs; {args.requests * args.output_len / dt:6.1f} "
          f"tok/s, {steps} engine steps, {1000 * dt / rounds:6.1f} ms per round of both ranks")


if __name__ == "__main__":
    main()
