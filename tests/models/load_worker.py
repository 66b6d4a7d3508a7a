"""A load_model run in a fresh process, for tests/models/test_streaming_load.py (never
imported by pytest): peak RSS has to be measured in a process of its own, and
jax.distributed must be initialised before anything touches a device.

usage:
  load_worker.py rss MODEL_DIR DTYPE
      prints one JSON line: RSS before loading, peak RSS, bytes of the loaded params
  load_worker.py multiprocess MODEL_DIR PROCESS_ID PORT EXPECTED_NPZ
      one of two processes x 4 CPU devices, tp=8 over all of them; checks every
      addressable shard against EXPECTED_NPZ (the served params from a one-process
      load) and prints one JSON line: bytes this process read from the checkpoint
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def rss_bytes(field: str = "VmRSS") -> int:
    """VmRSS: resident now; VmHWM: the peak. Not getrusage's ru_maxrss: Linux carries it
    over exec, so a child forked from a big pytest process starts at the parent's size."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field}")


def rss(model_dir: str, dtype: str) -> None:
    import time

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from models.loader import load_model

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    jnp.zeros(4).block_until_ready()  # the runtime's own memory belongs to the baseline
    before = rss_bytes()
    t0 = time.perf_counter()
    _arch, _graphdef, state = load_model(model_dir, mesh=mesh, dtype=getattr(jnp, dtype), progress=False)
    leaves = jax.tree.leaves(state)
    jax.block_until_ready(leaves)
    seconds = time.perf_counter() - t0
    peak = rss_bytes("VmHWM")
    print(json.dumps({"before": before, "peak": peak, "after": rss_bytes(), "seconds": seconds,
                      "params_bytes": sum(x.nbytes for x in leaves)}), flush=True)


def multiprocess(model_dir: str, pid: int, port: str, expected: str) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=60)
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import Mesh

    from models import weights
    from models.loader import load_model

    assert jax.process_count() == 2 and jax.device_count() == 8
    read = [0]
    original = weights.SafetensorsCheckpoint.read

    def counting_read(self, name, index):
        out = original(self, name, index)
        read[0] += out.nbytes
        return out

    weights.SafetensorsCheckpoint.read = counting_read
    mesh = Mesh(np.array(jax.devices()).reshape(1, 8), ("data", "model"))
    arch, _graphdef, state = load_model(model_dir, mesh=mesh, dtype=jnp.float32, progress=False)
    want = np.load(expected)
    checked = 0
    for keys, var in nnx.to_flat_state(nnx.state(state, nnx.Param)):
        x = var[...]
        assert not x.is_fully_addressable
        for shard in x.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want["/".join(map(str, keys))][shard.index])
            checked += 1
    print(json.dumps({"read_bytes": read[0], "shards_checked": checked,
                      "kv_heads": arch.num_key_value_heads}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "rss":
        rss(sys.argv[2], sys.argv[3])
    else:
        multiprocess(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
