"""RequestStream: the hand-over point between AsyncLLM's engine thread and the event
loop of one request's caller, and ``deliver``, which runs on that loop.

Its own module because three engine modules name it: AsyncLLM creates streams, the
LLMEngine and its OutputProcessor carry them beside each request (the engine thread
records timings on them). Here, below all three, none of them imports another for it.
"""
from __future__ import annotations

import asyncio
import time

from jaxserve.engine.exceptions import StreamOverflowError

_ABORTED = object()  # queue sentinel: the caller aborted the request


class RequestStream:
    """Per-request hand-over point between the engine thread and one event loop.

    The engine thread only reads ``closed`` and the timing fields it owns; everything
    that touches ``queue`` runs on ``loop``."""

    __slots__ = ("request_id", "loop", "queue", "closed", "n", "prompt", "prompt_token_ids", "arrival_time",
                 "first_token_time", "last_output_time", "num_generation_tokens", "max_queued", "on_overflow")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, n: int, prompt, prompt_token_ids, *,
                 max_queued: int | None = None, on_overflow=None) -> None:
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False  # set by the caller side (finished, aborted, failed)
        self.n = n
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.arrival_time = time.monotonic()
        # Engine-thread bookkeeping for metrics.
        self.first_token_time: float | None = None
        self.last_output_time: dict[int, float] = {}
        self.num_generation_tokens = 0
        # A caller that stops reading (a stalled client) must not hold its request, and
        # the memory of its outputs, for ever: past max_queued unread outputs it is aborted.
        self.max_queued = max_queued
        self.on_overflow = on_overflow


def deliver(items: list) -> None:
    """Runs on the event loop: put each (stream, item) on its queue; a stream whose
    reader fell more than max_queued outputs behind gets a StreamOverflowError and its
    request is aborted."""
    for stream, item in items:
        if stream.closed:
            continue
        if stream.max_queued is not None and stream.queue.qsize() >= stream.max_queued:
            stream.closed = True
            stream.queue.put_nowait(StreamOverflowError(
                f"request {stream.request_id}: more than {stream.max_queued} outputs unread; aborted"))
            if stream.on_overflow is not None:
                stream.on_overflow(stream)
            continue
        stream.queue.put_nowait(item)
