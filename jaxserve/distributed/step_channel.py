"""The step channel: the leader's per-step messages to the followers, in order, and
the followers' loop that replays them.

One leader decides, followers replay. Process 0 (the leader) owns the scheduler, the
API server and the detokenizer; every engine step it publishes the step's
SchedulerOutput on a StepChannel, and every other process (a follower) receives it
and replays it through its own ModelRunner (run_follower), which keeps its own copy
of the batch state by applying the same diffs. Followers never decide anything, so
all processes enter the same programs in the same order.

A dead peer ends the others with an error, never a hang: the channel's part is the
TCP connection (a follower sees a dead leader at once) and the heartbeats and
watchdog of watchdog.py; cluster.py describes JAX's own layer.

Private API: the channel uses the JAX distributed runtime's key-value store and
coordinator address through `jax._src.distributed.global_state` (there is no public
handle on them in jax 0.10): `_kv_client` and `_coordinator_host` below.
"""
from __future__ import annotations

import atexit
import logging
import os
import pickle
import secrets
import socket
import struct
import time
from collections.abc import Callable
from typing import Any, Self

import jax

from jaxserve.distributed.watchdog import PEER_LOST_EXIT_CODE, PeerLostError, PeerWatchdog

logger = logging.getLogger("jaxserve")


class LeaderAbortedError(PeerLostError):
    """The leader is exiting without close() (it failed); it is still alive,
    waiting in JAX's shutdown barrier, so followers should exit normally."""


def _kv_client():
    # Private: the key-value store of the coordination service that
    # jax.distributed.initialize started. jax 0.10 has no public accessor.
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("StepChannel needs jax.distributed; call initialize_distributed() first")
    return client


def _coordinator_host() -> str:
    # Private: the host every follower already reaches (it runs the JAX
    # coordination service), so the leader's step socket is reachable there too.
    from jax._src import distributed

    addr = distributed.global_state.coordinator_address or "127.0.0.1:0"
    return addr.rsplit(":", 1)[0].strip("[]")


class _Shutdown:
    """Singleton returned by StepChannel.receive() when the leader closed."""

    _instance: _Shutdown | None = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "SHUTDOWN"

    def __reduce__(self):  # keep it a singleton across pickling
        return (_Shutdown, ())


SHUTDOWN = _Shutdown()

# Frame: sequence number, tag, payload length; then the pickled payload.
_HEADER = struct.Struct("!QcI")
_TAG_STEP = b"S"
_TAG_SHUTDOWN = b"Q"  # the leader closed normally: followers exit 0
_TAG_ABORT = b"A"  # the leader is exiting without close(): followers fail

_channel_count = 0


class StepChannel:
    """Leader -> followers broadcast of per-step messages, in order.

    Create one on every process (same `name`), after initialize_distributed,
    in the same order on every process. Construction is a rendezvous: it
    returns once every follower is connected, so slow starters (weight loading)
    are not mistaken for dead ones.

    Leader: publish(obj) per step, close() at the end. Follower: receive()
    until it returns SHUTDOWN (or use run_follower).

    Transport. Steps travel over one TCP connection from the leader to each
    follower (TCP keeps the order; a sequence number in every frame checks
    it). The JAX key-value store was the first design, but its gRPC client
    compresses every value (jax.distributed hard-wires use_compression=True)
    and costs ~1 ms per call: measured here, publish -> receive took 2.4 ms
    for a 5 KB SchedulerOutput and 15 ms for a 72 KB one, comparable to a
    whole step. The store still carries everything off the hot path: the
    leader's address and a one-time token (the rendezvous), and heartbeats.
    Nothing is stored per step, so nothing grows. Messages are pickles; the
    token means only processes that can read the cluster's own key-value store
    can connect, and the leader stops accepting once all followers are in.

    Heartbeats and the watchdog (watchdog.py's PeerWatchdog): every process
    writes a heartbeat, with the last message it handled, to the key-value store;
    a process whose watched peer (the leader watches every follower, a follower
    the leader) stays silent for `peer_timeout_s` ends with PEER_LOST_EXIT_CODE.
    A follower also notices a dead leader at once by the connection closing.
    """

    def __init__(
        self,
        name: str = "jaxserve/steps",
        *,
        peer_timeout_s: float = 20.0,
        heartbeat_interval_s: float = 1.0,
        start_timeout_s: float = 600.0,
        port: int = 0,
        exit_on_peer_loss: bool = True,
    ) -> None:
        """port: the leader's listening port (0 = any free one; fix it where a
        firewall only opens known ports). exit_on_peer_loss=False makes the
        watchdog only mark the channel lost (publish/receive then raise
        PeerLostError) instead of ending the process: for tests, since a
        leader blocked in a collective cannot be rescued that way."""
        if peer_timeout_s < 3 * heartbeat_interval_s:
            raise ValueError("peer_timeout_s must be at least 3 heartbeat intervals")
        global _channel_count
        _channel_count += 1
        self._client = _kv_client()
        self.ns = f"{name.rstrip('/')}/{_channel_count}"
        self.process_id = jax.process_index()
        self.num_processes = jax.process_count()
        self.is_leader = self.process_id == 0
        self.peer_timeout_s = peer_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self._seq = 0  # leader: last published; follower: last received
        self._acked = 0  # follower: last message fully handled
        self._closed = False
        self._peers = list(range(1, self.num_processes)) if self.is_leader else [0]
        self._watchdog = PeerWatchdog(self._client, self.ns, self.process_id, self._peers,
                                      is_leader=self.is_leader, peer_timeout_s=peer_timeout_s,
                                      heartbeat_interval_s=heartbeat_interval_s,
                                      exit_on_peer_loss=exit_on_peer_loss, acked=self._acked_seq)
        self._socks: dict[int, socket.socket] = {}  # leader: follower pid -> connection
        self._sock: socket.socket | None = None  # follower: connection to the leader
        self._rbuf = bytearray()
        timeout_ms = int(start_timeout_s * 1000)
        if self.is_leader:
            self._accept_followers(port, start_timeout_s)
        else:
            self._connect_leader(start_timeout_s)
        # Everyone starts heartbeating together; before this a peer may
        # legitimately have been busy for minutes (loading, compiling).
        self._client.wait_at_barrier(f"{self.ns}/start", timeout_ms)
        self._watchdog.start()
        if self.is_leader:
            # Runs before jax's own exit hook (atexit is LIFO and jax
            # registered at import): see _atexit.
            atexit.register(self._atexit)

    # ---- rendezvous -----------------------------------------------------

    def _accept_followers(self, port: int, timeout_s: float) -> None:
        token = secrets.token_hex(16)
        if socket.has_dualstack_ipv6():
            server = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True,
                                          backlog=self.num_processes)
        else:
            server = socket.create_server(("", port), backlog=self.num_processes)
        with server:
            self._client.key_value_set(f"{self.ns}/addr",
                                       f"{_coordinator_host()}|{server.getsockname()[1]}|{token}")
            deadline = time.monotonic() + timeout_s
            while len(self._socks) < len(self._peers):
                server.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    missing = sorted(set(self._peers) - set(self._socks))
                    raise PeerLostError(f"followers {missing} did not connect within {timeout_s:.0f}s") from None
                try:
                    conn.settimeout(10.0)
                    hello = self._recv_exact_from(conn, 4 + len(token)).decode()
                    pid, their_token = int(hello[:4]), hello[4:]
                except (OSError, ValueError, UnicodeDecodeError):
                    conn.close()
                    continue
                if their_token != token or pid not in self._peers or pid in self._socks:
                    logger.warning("step channel: rejected a connection that is not a follower")
                    conn.close()
                    continue
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small frames go now
                self._socks[pid] = conn

    def _connect_leader(self, timeout_s: float) -> None:
        host, port, token = self._client.blocking_key_value_get(
            f"{self.ns}/addr", int(timeout_s * 1000)).split("|")
        self._sock = socket.create_connection((host, int(port)), timeout=30.0)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.sendall(f"{self.process_id:04d}{token}".encode())

    @staticmethod
    def _recv_exact_from(conn: socket.socket, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = conn.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("connection closed")
            buf += chunk
        return bytes(buf)

    # ---- leader ---------------------------------------------------------

    def publish(self, obj: Any) -> int:
        """Leader: broadcast one step's message; returns its sequence number."""
        if not self.is_leader:
            raise RuntimeError("only process 0 publishes")
        if self._closed:
            raise RuntimeError("StepChannel is closed")
        if self._watchdog.lost is not None:
            raise PeerLostError(self._watchdog.lost)
        return self._send(_TAG_STEP, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def _send(self, tag: bytes, payload: bytes) -> int:
        self._seq += 1
        frame = _HEADER.pack(self._seq, tag, len(payload)) + payload
        for pid, conn in self._socks.items():
            try:
                # Blocks only if the follower stops reading for a whole socket
                # buffer: backpressure, which lockstep implies anyway.
                conn.sendall(frame)
            except OSError as e:
                raise PeerLostError(f"lost the connection to follower process {pid}: {e}") from e
        return self._seq

    def close(self, *, timeout_s: float | None = None) -> None:
        """Leader: send SHUTDOWN and wait until every follower has taken it
        (PeerLostError if one does not within timeout_s, default
        peer_timeout_s). Follower: stop the heartbeat (receive() already did
        when it returned SHUTDOWN)."""
        if self._closed:
            return
        if not self.is_leader:
            self._watchdog.stop()
            self._close_sockets()
            self._closed = True
            return
        pending = self._finish(_TAG_SHUTDOWN, self.peer_timeout_s if timeout_s is None else timeout_s)
        if pending:
            raise PeerLostError(f"followers {pending} did not acknowledge the shutdown")

    def _finish(self, tag: bytes, timeout_s: float) -> list:
        """Send the end-of-stream message and wait for every follower's ack.

        The watchdog keeps running meanwhile, so a follower that died is
        still reported (and this process ended) after peer_timeout_s instead
        of being waited on. Returns the followers that did not acknowledge."""
        self._closed = True
        try:
            seq = self._send(tag, b"")
        except PeerLostError as e:
            logger.error("%s", e)
            seq = self._seq
        deadline = time.monotonic() + timeout_s
        pending = set(self._peers)
        while pending and time.monotonic() < deadline and self._watchdog.lost is None:
            acks = self._watchdog.read()
            pending = {p for p in pending if acks.get(p, (None, 0))[1] < seq}
            if pending:
                time.sleep(0.02)
        self._watchdog.stop()
        self._close_sockets()
        if not pending:
            try:
                self._client.key_value_delete(self.ns)  # address and heartbeats
            except Exception as e:  # noqa: BLE001 - the store is local to the leader; best effort
                logger.warning("could not clear %s from the key-value store: %s", self.ns, e)
        return sorted(pending)

    def _atexit(self) -> None:
        """The leader is exiting (an exception, or no close()): end the followers.

        Why not just return: after this, JAX's own exit hook runs
        jax.distributed.shutdown(), a barrier over every process. Followers
        that took the abort join it and everybody leaves promptly. A follower
        that is dead or stuck in a collective never joins, and the barrier
        would wait until JAX's heartbeat or shutdown timeout; so then this
        process ends itself, now, with a clear message."""
        if self._closed:
            return
        logger.error("leader exiting without StepChannel.close(): aborting the followers")
        try:
            pending: list = self._finish(_TAG_ABORT, self.peer_timeout_s + 2 * self.heartbeat_interval_s)
        except Exception as e:  # noqa: BLE001 - exiting anyway; say why below
            pending = [f"? ({e})"]
        if pending:
            msg = (f"multi-host: followers {pending} did not acknowledge the leader's abort; "
                   f"exiting with status {PEER_LOST_EXIT_CODE} without waiting for them")
            logger.critical(msg)
            os.write(2, (msg + "\n").encode())
            os._exit(PEER_LOST_EXIT_CODE)

    # ---- follower -------------------------------------------------------

    def receive(self) -> Any:
        """Follower: the next message in publish order; SHUTDOWN when the
        leader closed. Raises PeerLostError if the leader is gone, and
        LeaderAbortedError if it exited without close()."""
        if self.is_leader:
            raise RuntimeError("process 0 publishes, it does not receive")
        if self._closed:
            raise RuntimeError("StepChannel is closed")
        # The previous message is done once the caller asks for the next one.
        self._acked = self._seq
        seq, tag, length = _HEADER.unpack(self._read(_HEADER.size))
        payload = self._read(length)
        if seq != self._seq + 1:
            raise PeerLostError(f"step channel out of order: got message {seq} after {self._seq}")
        self._seq = seq
        if tag == _TAG_STEP:
            return pickle.loads(payload)
        # End of stream: stop our heartbeat first, then acknowledge, so the
        # leader never waits on (or watches) a heartbeat that is about to stop.
        self._acked = seq
        self._watchdog.stop()
        self._watchdog.write(-1)
        self._close_sockets()
        self._closed = True
        if tag == _TAG_SHUTDOWN:
            return SHUTDOWN
        raise LeaderAbortedError("the leader exited without closing the step channel")

    def _read(self, n: int) -> bytes:
        # Short socket timeouts so that, while idle, the watchdog's verdict is
        # still seen when it is told not to end the process.
        assert self._sock is not None
        self._sock.settimeout(min(1.0, self.heartbeat_interval_s))
        buf = self._rbuf
        while len(buf) < n:
            if self._watchdog.lost is not None:
                raise PeerLostError(self._watchdog.lost)
            try:
                chunk = self._sock.recv(max(n - len(buf), 1 << 16))
            except TimeoutError:
                continue
            except OSError as e:
                raise PeerLostError(f"lost the connection to the leader: {e}") from e
            if not chunk:
                raise PeerLostError("the leader closed the step connection (the leader process ended)")
            buf += chunk
        out = bytes(buf[:n])
        del buf[:n]
        return out

    def _acked_seq(self) -> int:
        # What this process's heartbeat reports as handled: the leader, all it sent.
        return self._seq if self.is_leader else self._acked

    def _close_sockets(self) -> None:
        for conn in [*self._socks.values(), *([self._sock] if self._sock else [])]:
            try:
                conn.close()
            except OSError:
                pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None or not self.is_leader:
            self.close()
        else:
            self._atexit()  # the leader failed: followers must fail too


def run_follower(execute: Callable[[Any], Any], channel: StepChannel, *,
                 exit_on_error: bool = True) -> int:
    """Follower loop: execute(msg) for each published message until SHUTDOWN.

    Returns the number of messages executed. Errors, with exit_on_error:
    * the leader aborted (LeaderAbortedError): it is alive and waiting in
      JAX's shutdown barrier, so exit normally, SystemExit(PEER_LOST_EXIT_CODE),
      and let this process join that barrier;
    * anything else (a lost leader, an exception in execute): log why and
      os._exit (PEER_LOST_EXIT_CODE for a lost leader, else 1). Unwinding
      normally would park this process in JAX's shutdown barrier with its
      heartbeat still running, while the leader waits in a collective this
      process will never join: the end would come from JAX's timeouts instead.
    """
    steps = 0
    try:
        while True:
            msg = channel.receive()
            if msg is SHUTDOWN:
                channel.close()
                return steps
            execute(msg)
            steps += 1
    except BaseException as e:
        if not exit_on_error:
            raise
        lost = isinstance(e, PeerLostError)
        code = PEER_LOST_EXIT_CODE if lost else 1
        logger.critical("multi-host follower %d stopping after %d steps: %s", channel.process_id,
                        steps, e, exc_info=not lost)
        os.write(2, f"multi-host follower {channel.process_id} failed: "
                    f"{type(e).__name__}: {e}; exiting with status {code}\n".encode())
        if isinstance(e, LeaderAbortedError):
            raise SystemExit(code) from None
        os._exit(code)
