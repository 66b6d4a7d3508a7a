"""Two local processes x 4 CPU devices, one mesh over all 8, driven by the step channel.

Each test starts tests/distributed/mh_worker.py twice (process 0 = leader,
process 1 = follower) with its own environment: the pytest process has already
initialised JAX with 8 local devices, and jax.distributed must be initialised
before any device use, so the multi-process runs cannot live in this process.
"""
from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from procs import Proc, free_port

from jaxserve.distributed import cluster
from jaxserve.distributed.watchdog import PEER_LOST_EXIT_CODE

WORKER = Path(__file__).with_name("mh_worker.py")

pytestmark = pytest.mark.slow


@pytest.fixture
def pair(tmp_path):
    procs: list[Proc] = []

    def start(scenario: str, **opts) -> tuple[Proc, Proc]:
        port = free_port()
        procs.extend(Proc(f"p{pid}", [str(WORKER), str(pid), str(port), scenario] +
                          [f"{k}={v}" for k, v in opts.items()], tmp_path) for pid in (0, 1))
        return procs[0], procs[1]

    yield start
    for p in procs:  # never leave a process behind, whatever failed
        p.kill()


@pytest.mark.timeout(120)
def test_clean_run_idle_leader_and_shutdown(pair):
    # Short channel timeouts, so the 6 s idle pause spans two peer timeouts:
    # an idle leader must stay alive on heartbeats alone.
    leader, follower = pair("clean", steps=5, idle_s=6, peer_timeout_s=3,
                            heartbeat_interval_s=0.5, gc_msgs=300)
    assert leader.wait(90) == 0, leader.err[-3000:]
    assert follower.wait(30) == 0, follower.err[-3000:]
    for p in (leader, follower):
        assert all(f"STEP {i}\n" in p.out for i in range(10)), p.out
    assert "LEADER DONE" in leader.out
    assert "FOLLOWER DONE 310" in follower.out  # 10 matmul steps + 300 no-ops
    # Nothing is stored per step: the address plus one heartbeat per process.
    held = int(leader.out.split("HELD ")[1].split()[0])
    assert held <= 3, held


# A follower killed under the default timeouts (the 60 s bound) is
# tests/distributed/test_multihost_engine.py's, through the whole engine.


@pytest.mark.timeout(120)
def test_frozen_follower_ends_leader_blocked_in_collective(pair):
    # SIGSTOP keeps the follower's sockets open, so the leader's collective
    # does not fail: it blocks, as it would on TPU interconnect. Only the
    # watchdog thread can end the leader (JAX's heartbeat, 30 s, is the
    # backstop). A short channel timeout keeps the test quick.
    leader, follower = pair("forever", peer_timeout_s=6)
    leader.wait_for("STEP 3\n", 60)
    follower.wait_for("STEP 3\n", 10)
    follower.popen.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    rc = leader.wait(60)
    elapsed = time.monotonic() - t0
    print(f"leader exited {rc} {elapsed:.1f}s after the follower froze")
    assert rc == PEER_LOST_EXIT_CODE, (rc, leader.err[-3000:])
    assert elapsed < 20, elapsed
    assert "lost follower process 1" in leader.err, leader.err[-3000:]


@pytest.mark.timeout(120)
def test_leader_killed_mid_run_ends_follower(pair):
    leader, follower = pair("forever")
    follower.wait_for("STEP 3\n", 60)
    leader.popen.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    rc = follower.wait(70)
    elapsed = time.monotonic() - t0
    print(f"follower exited {rc} {elapsed:.1f}s after the leader was killed")
    assert rc != 0
    assert elapsed < 60, elapsed
    # Whichever layer notices first: JAX's client (the coordination service
    # died with the leader) or the channel.
    assert ("JAX distributed service detected fatal errors" in follower.err
            or "multi-host" in follower.err), follower.err[-3000:]


@pytest.mark.timeout(120)
def test_leader_exit_without_close_fails_follower(pair):
    leader, follower = pair("noclose", steps=3)
    rc = follower.wait(60)
    assert rc == PEER_LOST_EXIT_CODE, (rc, follower.err[-3000:])
    assert "exited without closing the step channel" in follower.err
    assert leader.wait(30) == 0, leader.err[-3000:]


def test_single_process_needs_no_distributed(monkeypatch):
    # No flags and no launcher variables: a plain run must not start a
    # coordination service.
    for var in ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri",
                "TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES"):
        monkeypatch.delenv(var, raising=False)
    assert cluster._detect_cluster() is None
    monkeypatch.setattr(cluster, "_initialized", False)
    cluster.initialize_distributed()
    assert not cluster._jax_distributed_initialized()
    assert cluster.is_leader() and not cluster.is_multihost()


def test_cluster_detection_needs_more_than_one_process(monkeypatch):
    slurm = {"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "1",
             "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    assert cluster._detect_cluster() is None  # srun with one task: single process
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert cluster._detect_cluster() == "slurm"
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setenv("OMPI_MCA_orte_hnp_uri", "1.0;tcp://10.0.0.1:1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    assert cluster._detect_cluster() is None
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    assert cluster._detect_cluster() == "ompi"
