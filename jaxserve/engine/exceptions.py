"""The errors the engine's asynchronous front (AsyncLLM) gives its callers.

They live below AsyncLLM, its streams and the server, so every one of them can name
them without importing the engine loop (server/errors.py maps each to an HTTP status).
"""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop failed (or was shut down); no request can be served any more."""


class EngineStepError(EngineDeadError):
    """What a request in flight gets when a step fails (or stalls past the iteration
    timeout) without saying which request is at fault: the error itself (HTTP 500).
    The engine is dead afterwards (new requests: EngineDeadError, HTTP 503)."""


class EngineOverloadedError(RuntimeError):
    """Too many requests waiting: retry later (HTTP 503 with Retry-After)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class StreamOverflowError(RuntimeError):
    """The caller stopped reading: more outputs queued than allowed, so the request was aborted."""
