"""Host arrays onto (possibly multi-process) shardings."""
from __future__ import annotations

import jax
import numpy as np


def global_array(x: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """Place a host array that every process holds in full onto `sharding`.

    Each process copies only the slices its own devices need, with no
    communication (measured: ~0.1 ms for an int32[8192] replicated over 2
    processes x 4 CPU devices). jax.device_put(x, sharding) also works for a
    sharding that spans processes, but it first runs
    multihost_utils.assert_equal on x (a jitted cross-process all-gather,
    compiled per shape and dtype): ~5 ms and one hidden collective per input
    per step, which also deadlocks unless every process makes the same call.
    Nothing checks that the processes passed equal arrays: that is what
    replaying the same step messages guarantees. Works unchanged with one
    process.
    """
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])
