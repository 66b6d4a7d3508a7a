"""Peer heartbeats and the watchdog that ends a process whose peer went silent.

Failure model, jaxserve's layer (docs/design.md §5: a dead peer ends the others with an
error, never a hang; cluster.py describes JAX's own layer, and either is enough for
the 60 s bound). The step channel (step_channel.py) sends steps over direct TCP
connections, so a follower sees a dead leader at once as a closed connection; on top
of that every process keeps a heartbeat in the JAX key-value store, and a watchdog
thread ends the process with os._exit(PEER_LOST_EXIT_CODE) and a clear log line once
a peer has been silent for `peer_timeout_s`. It does not depend on how
jax.distributed was initialised (someone else may have called it with the 100 s
default) and it gives a message that names the lost process. The watchdog runs in
its own thread because the main thread may be blocked in a device computation
waiting for the dead peer (jaxlib releases the GIL while it waits).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("jaxserve")

# Exit status of a process whose peer died (or whose leader went away without
# closing the channel). Distinct from 1 (a Python error) and 134 (JAX's own
# abort) so that logs and supervisors can tell which layer ended the process.
PEER_LOST_EXIT_CODE = 75


class PeerLostError(RuntimeError):
    """A peer process died, became unreachable or went away without closing."""


class PeerWatchdog:
    """One process's heartbeat in the key-value store, and a watch on its peers' ones.

    Every process writes <ns>/hb/<pid> = "<beat>:<acked seq>" every
    `heartbeat_interval_s` from a background thread, so an idle leader (no steps for
    hours) still looks alive; the acked sequence number is also how the leader sees
    that its followers took the end of the stream. A second thread ends the process
    (os._exit(PEER_LOST_EXIT_CODE)) when a watched peer's value has not changed for
    `peer_timeout_s`: the leader watches every follower, a follower the leader.
    Staleness is measured on the observer's own monotonic clock, so clocks need not
    agree. With exit_on_peer_loss=False it only sets ``lost`` (the reason), which the
    step channel turns into PeerLostError.
    """

    def __init__(self, client, ns: str, process_id: int, peers: list[int], *, is_leader: bool,
                 peer_timeout_s: float, heartbeat_interval_s: float, exit_on_peer_loss: bool,
                 acked: Callable[[], int]) -> None:
        """client: the JAX key-value store client; ns: the channel's key prefix;
        acked: the last sequence number this process has fully handled."""
        self._client = client
        self.ns = ns
        self.process_id = process_id
        self.peers = peers
        self.is_leader = is_leader
        self.peer_timeout_s = peer_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self._exit_on_peer_loss = exit_on_peer_loss
        self._acked = acked
        self.lost: str | None = None  # set by the watchdog: why a peer is lost
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._hb_values: dict[int, str] = {}
        self._last_seen: dict[int, float] = {}
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start beating and watching. Call it when every process is ready (after the
        channel's start barrier): before that a peer may legitimately have been busy
        for minutes (loading, compiling)."""
        now = time.monotonic()
        self._last_seen = {p: now for p in self.peers}
        self.write(0)
        self._threads = [
            threading.Thread(target=self._heartbeat_loop, name="jaxserve-mh-heartbeat", daemon=True),
            threading.Thread(target=self._watchdog_loop, name="jaxserve-mh-watchdog", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def write(self, beat: int) -> None:
        """This process's heartbeat value (beat -1: the last one, the stream ended)."""
        self._client.key_value_set(f"{self.ns}/hb/{self.process_id}", f"{beat}:{self._acked()}",
                                   allow_overwrite=True)

    def read(self) -> dict[int, tuple[str, int]]:
        """Every process's heartbeat: pid -> (value, acked sequence number)."""
        out = {}
        for key, value in self._client.key_value_dir_get(f"{self.ns}/hb"):
            try:
                pid = int(key.rsplit("/", 1)[1])
                out[pid] = (value, int(value.split(":")[1]))
            except (IndexError, ValueError):
                continue
        return out

    def stop(self) -> None:
        """Stop both threads (and wait for them, unless called from one of them)."""
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5.0)

    def _heartbeat_loop(self) -> None:
        beat = 0
        while not self._stop.wait(self.heartbeat_interval_s):
            beat += 1
            try:
                self.write(beat)
                beats = self.read()
            except Exception as e:  # noqa: BLE001 - any RPC failure means the same here
                # The store lives in the leader: on a follower this means the
                # leader is gone. The watchdog decides; just stop refreshing.
                if not self._stop.is_set():
                    logger.debug("heartbeat RPC failed: %s", e)
                continue
            now = time.monotonic()
            with self._lock:
                for p in self.peers:
                    if p in beats and beats[p][0] != self._hb_values.get(p):
                        self._hb_values[p] = beats[p][0]
                        self._last_seen[p] = now

    def _watchdog_loop(self) -> None:
        # Separate from the heartbeat thread: if a heartbeat RPC hangs (a
        # vanished host), staleness still grows and this thread still fires.
        period = min(1.0, self.heartbeat_interval_s / 2)
        while not self._stop.wait(period):
            now = time.monotonic()
            with self._lock:
                stale = {p: now - t for p, t in self._last_seen.items() if now - t > self.peer_timeout_s}
            if not stale:
                continue
            role = "follower" if self.is_leader else "leader"
            who = ", ".join(f"process {p} (silent {s:.0f}s)" for p, s in sorted(stale.items()))
            msg = (f"multi-host: lost {role} {who}: no heartbeat for more than "
                   f"{self.peer_timeout_s:.0f}s; this process (process {self.process_id}) "
                   f"cannot continue without it")
            self.lost = msg
            if self._exit_on_peer_loss:
                logger.critical("%s; exiting with status %d", msg, PEER_LOST_EXIT_CODE)
                # Also straight to stderr: logging may be unconfigured, and
                # os._exit skips every flush.
                os.write(2, f"{msg}; exiting with status {PEER_LOST_EXIT_CODE}\n".encode())
                os._exit(PEER_LOST_EXIT_CODE)
            return
