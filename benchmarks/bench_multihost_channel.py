"""Step-channel latency between two local processes (issue 10, multi-host).

Starts itself twice (process 0 = leader, 1 = follower) on CPU with 4 devices
each. The leader publishes pickled SchedulerOutputs of about 5 KB and 100 KB
at a serving-like pace (one every `--gap-ms`); the follower records the
delay from publish() to receive() returning, on the host's monotonic clock
(both processes share it). Also times placing a host input onto a sharding
that spans both processes: jax.device_put (which checks the value is equal
on every process, a cross-process collective) against global_array
(jaxserve/distributed/arrays.py).

usage: python benchmarks/bench_multihost_channel.py [--steps 200] [--gap-ms 20]
"""
from __future__ import annotations

import argparse
import os
import pickle
import socket
import subprocess
import sys
import time

import numpy as np


def _scheduler_output(n_cached: int, new_prompt_lens: list[int], rng):
    from jaxserve.core.sched.output import (
        CachedRequestData,
        NewRequestData,
        SchedulerOutput,
    )
    from jaxserve.sampling_params import SamplingParams

    new = [NewRequestData(req_id=f"cmpl-{i:032x}", prompt_token_ids=rng.integers(0, 150_000, n).tolist(),
                          sampling_params=SamplingParams(), block_ids=list(range(n // 16 + 1)),
                          num_computed_tokens=0)
           for i, n in enumerate(new_prompt_lens)]
    cached = CachedRequestData(req_ids=[f"cmpl-{1000 + i:032x}" for i in range(n_cached)],
                               resumed_from_preemption=[False] * n_cached,
                               new_block_ids=[[i] if i % 16 == 0 else [] for i in range(n_cached)],
                               num_computed_tokens=[100 + i for i in range(n_cached)])
    sched = {r.req_id: len(r.prompt_token_ids) for r in new} | {r: 1 for r in cached.req_ids}
    return SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                           num_scheduled_tokens=sched, total_num_scheduled_tokens=sum(sched.values()),
                           finished_req_ids=set())


def _pct(xs, q):
    return float(np.percentile(np.asarray(xs) * 1e3, q))


def worker(pid: int, port: int, steps: int, gap_s: float) -> None:
    from jaxserve.distributed import cluster, step_channel
    from jaxserve.distributed.arrays import global_array

    cluster.initialize_distributed(f"127.0.0.1:{port}", 2, pid)
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(0)
    payloads = {"5KB": _scheduler_output(48, [300], rng), "100KB": _scheduler_output(48, [8000, 8000], rng)}
    channel = step_channel.StepChannel("bench/steps")
    client = step_channel._kv_client()
    for name, obj in payloads.items():
        size = len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        if pid == 0:
            pub = []
            for _ in range(steps):
                t = time.monotonic()
                channel.publish((t, obj))
                pub.append(time.monotonic() - t)
                time.sleep(gap_s)
            delays = pickle.loads(client.blocking_key_value_get_bytes(f"bench/result/{name}", 60_000))
            print(f"{name} (pickled {size} B): publish p50 {_pct(pub, 50):.2f} ms p99 {_pct(pub, 99):.2f} ms; "
                  f"publish->receive p50 {_pct(delays, 50):.2f} ms p99 {_pct(delays, 99):.2f} ms")
        else:
            delays = []
            for _ in range(steps):
                t_sent, _obj = channel.receive()
                delays.append(time.monotonic() - t_sent)
            client.key_value_set_bytes(f"bench/result/{name}", pickle.dumps(delays))

    # Host input -> a replicated sharding over both processes' devices.
    mesh = Mesh(np.array(jax.devices()).reshape(1, -1), ("data", "model"))
    sharding = NamedSharding(mesh, P())
    for shape in ((256,), (8192,)):
        x = np.arange(np.prod(shape), dtype=np.int32).reshape(shape)
        for label, put in (("jax.device_put", lambda x=x: jax.device_put(x, sharding)),
                           ("global_array", lambda x=x: global_array(x, sharding))):
            put().block_until_ready()  # compile whatever it compiles
            times = []
            for _ in range(50):
                t = time.perf_counter()
                put().block_until_ready()
                times.append(time.perf_counter() - t)
            if pid == 0:
                print(f"place int32{list(shape)} with {label}: p50 {_pct(times, 50):.3f} ms")
    if pid == 0:
        channel.close()
    else:
        assert channel.receive() is step_channel.SHUTDOWN


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--gap-ms", type=float, default=20.0)
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker, args.port, args.steps, args.gap_ms / 1e3)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.abspath(__file__), "--steps", str(args.steps), "--gap-ms", str(args.gap_ms),
           "--port", str(port), "--worker"]
    procs = [subprocess.Popen(cmd + [str(pid)], env=env, stderr=subprocess.DEVNULL if pid else None)
             for pid in (0, 1)]
    rcs = [p.wait(600) for p in procs]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import commit_line, machine_line

    print(machine_line())
    print(commit_line())
    if any(rcs):
        sys.exit(f"workers exited {rcs}")


if __name__ == "__main__":
    main()
