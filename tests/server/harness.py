"""Helpers for the server tests: a real uvicorn in a background thread, polling."""
from __future__ import annotations

import socket
import threading
import time

# The tiny engine: small budgets keep the warm-up to a handful of programs.
TINY_ENGINE_ARGS = {"max_model_len": 256, "max_num_seqs": 16, "max_num_batched_tokens": 128,
                    "kv_cache_memory": 4 << 20, "block_size": 16, "enable_prefix_caching": True}


class RunningServer:
    """uvicorn serving ``app`` on a pre-bound free port, in a daemon thread."""

    def __init__(self, app, **config) -> None:
        """config: more uvicorn.Config keywords (TLS: ssl_certfile, ...; then the url is https)."""
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"{'https' if config.get('ssl_certfile') else 'http'}://127.0.0.1:{self.port}"
        self.app = app
        # Keep-alive 60 s, not uvicorn's 5: in the soak at 512 clients (client, server and
        # engine in one process, one GIL) the loop lags by seconds, and httpx reused a
        # connection the server was closing as idle (ReadError; none with 60 s).
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=60, **config))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
