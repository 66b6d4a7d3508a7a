"""One process of a two-process multi-controller run, driven by the step channel.

Started by tests/distributed/test_multihost.py (never imported by pytest). The
leader publishes numpy inputs; every process runs the same jitted matmul whose
mesh spans the devices of all processes and checks the replicated result
against numpy. Prints "STEP <i>" after each step so the test can tell when the
run is under way (and kill a process mid-run).

usage: mh_worker.py PROCESS_ID PORT SCENARIO [key=value ...]
  scenarios: clean (N steps, an idle pause, N more, close),
             forever (leader publishes until killed), noclose (leader returns
             without closing the channel)
"""
from __future__ import annotations

import logging
import sys
import time

import numpy as np


def main() -> int:
    pid, port, scenario = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    opts = dict(a.split("=", 1) for a in sys.argv[4:])
    steps = int(opts.get("steps", 8))
    idle_s = float(opts.get("idle_s", 0))
    peer_timeout_s = float(opts.get("peer_timeout_s", 20))
    hb_s = float(opts.get("heartbeat_interval_s", 1))
    gc_msgs = int(opts.get("gc_msgs", 0))
    logging.basicConfig(level=logging.INFO, format=f"[p{pid}] %(levelname)s %(message)s")

    from jaxserve.distributed import cluster, step_channel
    from jaxserve.distributed.arrays import global_array

    cluster.initialize_distributed(f"127.0.0.1:{port}", 2, pid)
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    assert jax.process_count() == 2 and jax.device_count() == 8, (jax.process_count(), jax.device_count())
    mesh = Mesh(np.array(jax.devices()).reshape(1, 8), ("data", "model"))
    rng = np.random.default_rng(0)  # same weights on every process
    w_host = rng.standard_normal((16, 64), dtype=np.float32)
    w = global_array(w_host, NamedSharding(mesh, P(None, "model")))
    replicated = NamedSharding(mesh, P())
    matmul = jax.jit(lambda x, w: jnp.tanh(x @ w), out_shardings=replicated)

    def execute(msg):
        i, x_host = msg
        if i == "noop":
            return
        y = jax.device_get(matmul(global_array(x_host, replicated), w))
        np.testing.assert_allclose(y, np.tanh(x_host @ w_host), rtol=1e-4, atol=1e-4)
        print(f"STEP {i}", flush=True)

    channel = step_channel.StepChannel("test/steps", peer_timeout_s=peer_timeout_s, heartbeat_interval_s=hb_s)
    if pid != 0:
        n = step_channel.run_follower(execute, channel)
        print(f"FOLLOWER DONE {n}", flush=True)
        return 0

    def step(i):
        msg = (i, np.random.default_rng(i).standard_normal((4, 16), dtype=np.float32))
        channel.publish(msg)
        execute(msg)  # the leader runs the same step itself

    i = 0
    if scenario == "forever":
        while True:
            step(i)
            i += 1
    for i in range(steps):
        step(i)
    if idle_s:
        time.sleep(idle_s)  # no steps: heartbeats alone must keep everyone alive
        for i in range(steps, 2 * steps):
            step(i)
    if gc_msgs:
        # Many non-computing messages back to back: the store must not hold
        # anything per step (only the rendezvous address and heartbeats).
        for k in range(gc_msgs):
            channel.publish(("noop", k))
        held = len(step_channel._kv_client().key_value_dir_get_bytes(channel.ns))
        print(f"HELD {held}", flush=True)
    if scenario == "noclose":
        print("LEADER EXITING WITHOUT CLOSE", flush=True)
        return 0
    channel.close()
    print("LEADER DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
