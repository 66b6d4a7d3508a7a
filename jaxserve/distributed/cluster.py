"""Joining a JAX multi-controller cluster: launcher detection, initialize_distributed,
and which process this is (is_multihost / is_leader).

JAX's multi-controller model runs the same jitted programs on every process, each
process feeding the devices it owns; jax.distributed.initialize must run before
anything touches a device. Process 0 is the leader (step_channel.py says what it
does); a single-process run is its own leader.

Failure model, JAX's layer (docs/design.md §5: a dead peer ends the others with an
error, never a hang; watchdog.py is the other, independent layer, and either is
enough for the 60 s bound): the coordination service (hosted inside process 0)
expects a heartbeat from every process. Measured on jax 0.10.2 (CPU, gloo):

- a SIGKILLed follower is declared dead after about `heartbeat_timeout_s` (9 s with
  a 10 s timeout); the service then propagates the error and the client in every
  surviving process aborts it (LOG(FATAL) -> SIGABRT, exit status 134, "Terminating
  process because the JAX distributed service detected fatal errors"), even while
  its main thread is blocked inside a cross-process collective (gloo itself just
  blocks);
- a SIGKILLed leader takes the service with it: followers see the socket close and
  abort within ~0.2 s.

JAX's default heartbeat timeout is 100 s, too long, so initialize_distributed passes
a shorter one.

Private API: whether jax.distributed is initialised is read through
`jax._src.distributed.global_state` (no public query in jax 0.10), and cluster
detection reuses JAX's TPU detectors: `_jax_distributed_initialized` and
`_detect_cluster` below.
"""
from __future__ import annotations

import logging
import os

import jax

logger = logging.getLogger("jaxserve")

# Heartbeat timeout handed to the JAX coordination service. The step channel's
# own watchdog (default 20 s) normally fires first with a clearer message; this
# is the backstop, still well inside the 60 s guarantee.
DEFAULT_JAX_HEARTBEAT_TIMEOUT_S = 30

_initialized = False


def _jax_distributed_initialized() -> bool:
    # Private: jax.distributed has no public "is initialised" query in 0.10.
    from jax._src import distributed

    return distributed.global_state.client is not None


def _int_env(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def _detect_cluster() -> str | None:
    """Name of a JAX cluster-detection method when the environment is a
    multi-process cluster, else None.

    Calling jax.distributed.initialize() with no arguments is only safe when
    the environment really describes several processes: JAX would otherwise
    start a coordination service for a one-process "cluster" (binding a port)
    or, for Kubernetes, query the API server. So each known launcher is only
    accepted when its own variables say there is more than one process:

    * SLURM (srun): all the variables JAX reads are set and SLURM_NTASKS > 1;
    * Open MPI (mpirun): OMPI_MCA_orte_hnp_uri is set and OMPI_COMM_WORLD_SIZE > 1;
    * Cloud TPU on GKE: TPU_PROCESS_ADDRESSES / TPU_WORKER_HOSTNAMES lists
      more than one host, or MEGASCALE_NUM_SLICES > 1;
    * Cloud TPU VM (GCE): the metadata server lists more than one worker in
      the slice (JAX's own detector, queried only on a TPU VM).

    Kubernetes (non-TPU) and mpi4py detection are never automatic: a plain pod
    is usually a single-process server; pass coordinator flags instead.
    """
    env = os.environ
    slurm_vars = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS",
                  "SLURM_PROCID", "SLURM_LOCALID")
    if all(v in env for v in slurm_vars) and (_int_env("SLURM_NTASKS") or 1) > 1:
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in env and (_int_env("OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return "ompi"
    try:
        # Private: computed once at jax import time from the machine's identity.
        from jax._src.cloud_tpu_init import running_in_cloud_tpu_vm
    except ImportError:  # pragma: no cover - layout change in a future jax
        running_in_cloud_tpu_vm = False
    if not running_in_cloud_tpu_vm:
        return None
    hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES")
    if hosts is not None:
        many = len([h for h in hosts.split(",") if h]) > 1
        return "gketpu" if many or (_int_env("MEGASCALE_NUM_SLICES") or 1) > 1 else None
    if env.get("TPU_SKIP_MDS_QUERY") is not None:
        return None
    try:
        from jax._src.clusters.cloud_tpu_cluster import GceTpuCluster

        if GceTpuCluster.is_env_present() and GceTpuCluster.get_process_count() > 1:
            return "gcetpu"
    except Exception as e:  # noqa: BLE001 - metadata server unreachable: treat as one host
        logger.warning("TPU VM cluster detection failed (%s); assuming a single process", e)
    return None


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: list[int] | None = None,
    cluster_detection_method: str | None = None,
    heartbeat_timeout_s: int = DEFAULT_JAX_HEARTBEAT_TIMEOUT_S,
    initialization_timeout_s: int = 300,
    shutdown_timeout_s: int = 60,
) -> None:
    """Join the JAX multi-controller cluster if this run is multi-process.

    Must run before anything touches a device (jax.devices(), any array);
    JAX raises RuntimeError otherwise. Idempotent: the first call decides,
    later calls (and calls after someone else initialised jax.distributed)
    do nothing.

    Rule: initialise when any of coordinator_address / num_processes /
    process_id / cluster_detection_method is given (missing ones are filled
    in by JAX's cluster detection), or when JAX_COORDINATOR_ADDRESS is set, or
    when _detect_cluster() recognises a multi-process launcher. num_processes
    == 1 always means a plain single-process run.
    """
    global _initialized
    if _initialized or _jax_distributed_initialized():
        _initialized = True
        return
    if num_processes == 1:
        _initialized = True
        return
    explicit = (coordinator_address, num_processes, process_id, cluster_detection_method)
    if all(a is None for a in explicit) and not os.environ.get("JAX_COORDINATOR_ADDRESS"):
        cluster_detection_method = _detect_cluster()
        if cluster_detection_method is None:
            _initialized = True  # single process: nothing to join
            return
        logger.info("multi-process cluster detected (%s)", cluster_detection_method)

    # Multi-process CPU programs need a cross-process collectives backend; gloo
    # is jax 0.10's default, but an environment that turned it off would only
    # fail later, at the first cross-process computation. Irrelevant on TPU/GPU.
    if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")

    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        cluster_detection_method=cluster_detection_method,
        initialization_timeout=initialization_timeout_s,
        heartbeat_timeout_seconds=heartbeat_timeout_s,
        shutdown_timeout_seconds=shutdown_timeout_s,
    )
    _initialized = True
    logger.info("jax.distributed: process %d of %d, %d local / %d global devices",
                jax.process_index(), jax.process_count(),
                jax.local_device_count(), jax.device_count())


def is_multihost() -> bool:
    """True when more than one process takes part in the computation."""
    return jax.process_count() > 1


def is_leader() -> bool:
    """True on process 0 (also in a single-process run)."""
    return jax.process_index() == 0
