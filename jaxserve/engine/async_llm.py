"""AsyncLLM: the engine for the server. One background thread owns the LLMEngine and
runs its step loop; asyncio callers talk to it through a thread-safe inbox of commands
(AddRequest, AbortRequest) and get outputs back on per-request asyncio queues.

Threads:
- the engine thread is the only one that touches the LLMEngine (scheduler, runner,
  output processor, detokenizers). It sleeps on a condition while there is no work.
- callers (usually one asyncio event loop) validate and tokenize requests in their own
  context with a separate tokenizer, so bad requests raise ValueError / TypeError there
  (HTTP 400) and never reach the engine.
- outputs are handed over with ``loop.call_soon_threadsafe``, once per step and loop,
  to each request's RequestStream (request_stream.py).

Abort (vLLM's semantics): ``abort(request_id)`` ends the caller's stream at once; the
engine thread applies the abort between steps, so a request's KV blocks are freed only
after the step that may still be writing them has finished (with async scheduling, after
it was dispatched: the device runs steps in order, so a later step that reuses the blocks
writes after it).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Mapping

from jaxserve.config import DEFAULT_ITERATION_TIMEOUT_S, EngineConfig
from jaxserve.core.kv_cache_utils import PrefixCachingMetrics
from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.core import combine_stats, pause_mode
from jaxserve.engine.exceptions import EngineDeadError, EngineOverloadedError, EngineStepError
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.request_stream import _ABORTED, RequestStream, deliver
from jaxserve.engine.stats import EngineStats, FinishedRequestStats, IterationStats, RankStats, StatLogger
from jaxserve.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from jaxserve.pooling_params import PoolingParams
from jaxserve.runner.compilation_cache import enable_compilation_cache
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("jaxserve")


def default_max_num_waiting_requests(config: EngineConfig, engine: LLMEngine) -> int:
    """How many sequences may wait (beyond those running) before requests get 503s: one
    per KV cache block, at least twice max_num_seqs. Sized from the cache because it is
    what admits waiting requests; a queue far longer than the cache drains in a few
    rounds only adds latency (and memory), while a burst of short requests still fits
    (a block holds block_size tokens, so the bound is generous for short prompts)."""
    blocks = engine.model_runner.num_blocks * config.parallel_config.data_parallel_size
    return max(2 * config.scheduler_config.max_num_seqs, blocks)


# ----------------------------------------------------------------------------- inbox commands
@dataclass(frozen=True, slots=True)
class AddRequest:
    """Caller -> engine thread: add a request, already tokenized and validated."""

    stream: RequestStream
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    lora_request: object = None  # jaxserve.lora.LoRARequest, read and checked by the caller already
    token_type_ids: list[int] | None = None  # a pooling pair's (LLMEngine.prepare_pooling)
    trace_headers: dict[str, str] | None = None  # the caller's trace context (tracing)
    mm: object = None  # its images (jaxserve.multimodal.inputs.MultiModalPrompt), preprocessed by the caller


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Caller -> engine thread: abort the engine request ``stream`` was added as."""

    stream: RequestStream


@dataclass(frozen=True, slots=True)
class EngineCall:
    """Caller -> engine thread: run ``fn(engine)`` between steps and set ``future`` to
    its result (or error). ``when_idle``: only once no request holds KV (the running
    ones finish first; new ones wait while ``hold`` is set on the engine core)."""

    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future
    when_idle: bool = False
    hold: str | None = None


EngineCommand = AddRequest | AbortRequest | EngineCall


# ----------------------------------------------------------------------------- AsyncLLM
class AsyncLLM:
    """Asynchronous front of an LLMEngine whose loop runs in a background thread."""

    def __init__(self, config: EngineConfig, *, progress: bool = True, engine: LLMEngine | None = None,
                 stat_loggers: list[StatLogger] | None = None, start: bool = True,
                 max_num_waiting_requests: int | None = None, max_queued_outputs: int | None = 4096,
                 iteration_timeout_s: float | None = DEFAULT_ITERATION_TIMEOUT_S) -> None:
        """max_num_waiting_requests: sequences allowed to wait beyond those that can run
        (max_num_seqs per rank); more is EngineOverloadedError (None: the default,
        ``default_max_num_waiting_requests``; 0 or less: no bound). max_queued_outputs:
        unread outputs per request before it is aborted (None: no bound).
        iteration_timeout_s: a step running longer kills the engine (None: never)."""
        self.config = config
        self.engine = engine if engine is not None else LLMEngine(config, progress=progress)
        self.model_config = config.model_config
        self.max_model_len = config.scheduler_config.max_model_len
        # The engine thread detokenizes with the engine's tokenizer; callers tokenize with
        # their own copy (HF fast tokenizers are not safe to share across threads).
        self.tokenizer = copy.deepcopy(self.engine.tokenizer)
        self.input_processor = copy.copy(self.engine.input_processor)
        self.input_processor.tokenizer = self.tokenizer
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])

        self._cond = threading.Condition()
        self._inbox: deque[EngineCommand] = deque()  # guarded by _cond
        self._deferred: list[EngineCall] = []  # engine thread: calls waiting for the engine to be idle
        self._shutdown = False
        self._warned_trace_headers = False
        self._dead_error: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}  # guarded by _streams_lock
        self._streams_lock = threading.Lock()
        self._stats = EngineStats()
        self._prefix_metrics = PrefixCachingMetrics()
        self._prefix_queries = 0
        self._prefix_hits = 0
        if max_num_waiting_requests is None:
            max_num_waiting_requests = default_max_num_waiting_requests(config, self.engine)
        sc, pc = config.scheduler_config, config.parallel_config
        # Sequences (n > 1 counts n) in flight before new requests are turned away.
        self.max_num_waiting_requests = max_num_waiting_requests
        self.max_in_flight = (sc.max_num_seqs * pc.data_parallel_size + max_num_waiting_requests
                              if max_num_waiting_requests > 0 else None)
        self.max_queued_outputs = max_queued_outputs
        self.iteration_timeout_s = iteration_timeout_s
        self._in_flight = 0  # sequences of the registered streams; guarded by _streams_lock
        self._step_started: float | None = None  # monotonic start of the step running now
        self._thread = threading.Thread(target=self._run_engine_loop, name="jaxserve-engine", daemon=True)
        self._watchdog = threading.Thread(target=self._watch_steps, name="jaxserve-watchdog", daemon=True)
        if start:
            self._thread.start()
            if iteration_timeout_s is not None:
                self._watchdog.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, *, progress: bool = True, compilation_cache: bool = True,
                         stat_loggers: list[StatLogger] | None = None, **kwargs) -> "AsyncLLM":
        """Build the engine from EngineArgs (vLLM's names), as ``jaxserve serve`` does;
        ``kwargs``: the front's own limits (max_num_waiting_requests, ...)."""
        if compilation_cache:
            enable_compilation_cache()
        return cls(engine_args.create_engine_config(progress=progress), progress=progress, stat_loggers=stat_loggers,
                   **kwargs)

    # ------------------------------------------------------------------ state
    @property
    def errored(self) -> bool:
        return self._dead_error is not None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self.errored

    def check_capacity(self, num_seqs: int) -> None:
        """EngineOverloadedError if ``num_seqs`` more sequences would exceed the bound on
        requests in flight (checked again when a request registers; this lets a server
        answer 503 before a stream starts). ValueError if ``num_seqs`` alone is more than
        the engine ever takes at once: retrying could never help, so it is a client error."""
        limit = self.max_in_flight
        if limit is not None and num_seqs > limit:
            raise ValueError(f"the request asks for {num_seqs} sequences (prompts x n); this server takes at most "
                             f"{limit} at once: split the request")
        if limit is not None and self._in_flight + num_seqs > limit:
            raise EngineOverloadedError(
                f"the server is overloaded: {self._in_flight} sequences in flight, at most {limit} "
                f"({self.max_num_waiting_requests} waiting); retry later")

    def check_health(self) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(f"the engine loop is dead: {self._dead_error!r}")

    def get_tokenizer(self):
        return self.tokenizer

    def get_stats(self) -> EngineStats:
        return self._stats

    # ------------------------------------------------------------------ inputs
    def process_inputs(self, prompt, params: SamplingParams, *, add_special_tokens: bool = True):
        """Tokenize and validate in the caller's context: returns (text, token_ids).

        prompt: str, list of token ids, {"prompt": str} or {"prompt_token_ids": [...]}.
        Raises ValueError / TypeError for a bad request."""
        if isinstance(prompt, (list, tuple)):
            prompt = {"prompt_token_ids": list(prompt)}
        text, ids = self.input_processor.tokenize(prompt, add_special_tokens=add_special_tokens)
        self.input_processor.validate(ids, params)
        self.input_processor.resolve_params(len(ids), params)
        return text, ids

    # ------------------------------------------------------------------ generate / abort
    async def generate(self, prompt, sampling_params: SamplingParams, request_id: str, *, priority: int = 0,
                       cache_salt: str | None = None, add_special_tokens: bool = True,
                       output_kind: RequestOutputKind = RequestOutputKind.DELTA,
                       lora_request=None, trace_headers: Mapping[str, str] | None = None,
                       mm=None) -> AsyncIterator[RequestOutput]:
        """Yields RequestOutputs as the engine produces them; the last has finished=True.

        DELTA (the default): each output holds only what is new (for n > 1, one
        choice per output, told apart by CompletionOutput.index). FINAL_ONLY: one
        output at the end. Validation errors are raised on the first iteration, before
        the request reaches the engine. Closing or cancelling the iterator aborts the
        request. ``trace_headers``: the caller's W3C trace context (traceparent /
        tracestate), the parent of the request's span under --otlp-traces-endpoint.
        Images: a prompt dict's ``multi_modal_data`` (preprocessed on a worker thread), or
        ``mm``, a MultiModalPrompt the caller made (the server's) with ``prompt`` the
        expanded token ids."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        self.check_health()
        text, ids = self.process_inputs(prompt, sampling_params, add_special_tokens=add_special_tokens)
        if mm is None and isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            ids, mm = await asyncio.to_thread(self.input_processor.process_images, prompt, ids)
            self.input_processor.validate(ids, sampling_params)
        if lora_request is not None:
            # Read and checked here (off the event loop on first use), not in the engine thread.
            await self.add_lora(lora_request)
        params = sampling_params.replace(output_kind=output_kind)
        stream = self._open_stream(request_id, params.n, text, ids)
        self._post(AddRequest(stream, text, ids, params, priority, cache_salt, lora_request,
                              trace_headers=self._trace_headers(trace_headers), mm=mm))
        finished = False
        seen_finished: set[int] = set()  # choices whose finish the caller has been given
        try:
            while True:
                item = await stream.queue.get()
                items = [item]
                while not stream.queue.empty():
                    items.append(stream.queue.get_nowait())
                for out in self._merge(items, stream, seen_finished):
                    if isinstance(out, BaseException):
                        finished = True
                        raise out
                    finished = out.finished
                    seen_finished.update(c.index for c in out.outputs if c.finish_reason is not None)
                    yield out
                    if finished:
                        return
        finally:
            stream.closed = True
            self._unregister(stream)
            if not finished:
                # Cancelled or closed by the caller (client disconnect): stop the request.
                # The abort names this stream, so a late close cannot hit a newer request
                # that reuses the id.
                self._post(AbortRequest(stream))

    def _trace_headers(self, headers: Mapping[str, str] | None) -> dict[str, str] | None:
        """The trace context to keep (None without tracing: a client's traceparent is
        then noted once in the log, as vLLM does)."""
        if not headers:
            return None
        if self.engine.output_processor.tracer is None:
            if not self._warned_trace_headers:
                self._warned_trace_headers = True
                logger.warning("a request came with a trace context (traceparent) but tracing is off: "
                               "start with --otlp-traces-endpoint to record spans")
            return None
        return dict(headers)

    def _open_stream(self, request_id: str, n: int, text, ids: list[int]) -> RequestStream:
        """A registered RequestStream of ``n`` sequences for a new request (generate,
        encode): ValueError for an id in use, the capacity checks, the health check."""
        stream = RequestStream(request_id, asyncio.get_running_loop(), n, text, ids,
                               max_queued=self.max_queued_outputs, on_overflow=self._on_overflow)
        with self._streams_lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self.check_capacity(n)
            self._streams[request_id] = stream
            self._in_flight += stream.n
        if self._dead_error is not None:  # died between the check above and registration
            stream.closed = True
            self._unregister(stream)
            self.check_health()
        return stream

    async def encode(self, prompt, pooling_params: PoolingParams, request_id: str, *, priority: int = 0,
                     add_special_tokens: bool = True,
                     trace_headers: Mapping[str, str] | None = None) -> PoolingRequestOutput:
        """A pooling request's output (docs/pooling.md): ``prompt`` a str, token ids,
        a prompt dict, or a (text_1, text_2) pair for a cross-encoder. Validation errors
        are raised here, before the request reaches the engine; cancelling the call
        aborts the request."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        self.check_health()
        if isinstance(prompt, list):
            prompt = {"prompt_token_ids": prompt}
        text, ids, params, types = self.engine.prepare_pooling(
            prompt, pooling_params, add_special_tokens=add_special_tokens, tokenizer=self.tokenizer,
            input_processor=self.input_processor)
        stream = self._open_stream(request_id, 1, text, ids)
        self._post(AddRequest(stream, text, ids, params, priority, token_type_ids=types,
                              trace_headers=self._trace_headers(trace_headers)))
        finished = False
        try:
            item = await stream.queue.get()
            finished = True
            if item is _ABORTED:
                raise asyncio.CancelledError(f"request {request_id} was aborted")
            if isinstance(item, BaseException):
                raise item
            return item
        finally:
            stream.closed = True
            self._unregister(stream)
            if not finished:
                self._post(AbortRequest(stream))

    @classmethod
    def _merge(cls, items: list, stream: RequestStream, seen_finished: set[int]):
        """Pending items -> what to yield. Outputs queued before an abort or an error
        are kept, then the abort output (every choice not yet finished ends with
        "abort") or the error ends the stream; consecutive DELTA outputs of one choice
        are merged (a slow reader gets fewer, larger deltas, as in vLLM's
        RequestOutputCollector)."""
        pending: list[RequestOutput] = []
        for item in items:
            if item is _ABORTED or isinstance(item, BaseException):
                outs = cls._coalesce(pending)
                if item is _ABORTED:
                    done = set(seen_finished)
                    for o in outs:
                        done.update(c.index for c in o.outputs if c.finish_reason is not None)
                    item = cls._abort_output(stream, done)
                return outs + [item]
            pending.append(item)
        return cls._coalesce(pending)

    @staticmethod
    def _coalesce(items: list[RequestOutput]) -> list[RequestOutput]:
        merged: list[RequestOutput] = []
        for out in items:
            prev = merged[-1] if merged else None
            if (prev is not None and not prev.finished and len(prev.outputs) == 1 and len(out.outputs) == 1
                    and prev.outputs[0].index == out.outputs[0].index and prev.outputs[0].finish_reason is None):
                a, b = prev.outputs[0], out.outputs[0]
                a.text += b.text
                a.token_ids = a.token_ids + b.token_ids
                if a.logprobs is not None and b.logprobs is not None:
                    a.logprobs = a.logprobs + b.logprobs
                a.cumulative_logprob = b.cumulative_logprob
                a.finish_reason, a.stop_reason = b.finish_reason, b.stop_reason
                prev.finished = out.finished
                prev.num_cached_tokens = out.num_cached_tokens
                prev.metrics = out.metrics
            else:
                merged.append(out)
        return merged

    @staticmethod
    def _abort_output(stream: RequestStream, done: set[int]) -> RequestOutput:
        """Final output of a stream the caller aborted: every choice not in ``done`` ends with "abort"."""
        open_indices = [i for i in range(stream.n) if i not in done] or [0]
        return RequestOutput(
            stream.request_id, stream.prompt, stream.prompt_token_ids, None,
            [CompletionOutput(index=i, text="", token_ids=[], cumulative_logprob=None, logprobs=None,
                              finish_reason="abort") for i in open_indices],
            finished=True)

    def abort(self, request_id: str | list[str]) -> None:
        """Abort requests (safe from any thread). Their streams end at once with a final
        "abort" output; the engine frees them between steps. Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            with self._streams_lock:
                stream = self._streams.pop(rid, None)
                if stream is not None:
                    self._in_flight -= stream.n
            if stream is not None and not stream.closed:
                try:
                    running = asyncio.get_running_loop()
                except RuntimeError:
                    running = None
                if running is stream.loop:
                    stream.queue.put_nowait(_ABORTED)
                else:
                    try:
                        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, _ABORTED)
                    except RuntimeError:  # the loop is closed: nobody is listening
                        pass
            if stream is not None:
                self._post(AbortRequest(stream))

    # ------------------------------------------------------------------ LoRA adapters (docs/lora.md)
    async def add_lora(self, lora_request) -> bool:
        """Read and check a LoRA adapter unless it is loaded (on a worker thread: the
        event loop never waits on the files); True when it was read now."""
        return await asyncio.to_thread(self.engine.engine_core.add_lora, lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        return self.engine.engine_core.remove_lora(lora_id)

    async def list_loras(self) -> set[int]:
        return self.engine.engine_core.list_loras()

    # ------------------------------------------------------------------ the research loop (docs/research_loop.md)
    async def _call(self, fn: Callable[[LLMEngine], Any], *, when_idle: bool = False, hold: str | None = None):
        """``fn(engine)`` on the engine thread between steps (see EngineCall)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:  # checked and posted at once: a dying engine fails what it holds
            if self._dead_error is not None or self._shutdown:
                raise EngineDeadError(f"the engine is dead: {self._dead_error!r}")
            self._inbox.append(EngineCall(fn, future, when_idle, hold))
            self._cond.notify()
        return await asyncio.wrap_future(future)

    async def update_weights(self, weights) -> dict:
        """LLM.update_weights's: new requests wait while the running ones finish on the
        old weights, then the weights change and the prefix cache is reset."""
        return await self._call(lambda e: e.engine_core.update_weights(weights), when_idle=True, hold="update")

    async def sleep(self, level: int = 1) -> dict:
        """Free the KV cache (1) or the weights too (2) once the running requests have
        finished; new requests wait until wake_up(). Returns the bytes freed."""
        return await self._call(lambda e: e.engine_core.sleep(level), when_idle=True, hold="update")

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call(lambda e: e.engine_core.wake_up(tags))

    def is_sleeping(self) -> bool:
        return self.engine.engine_core.is_sleeping

    def is_paused(self) -> bool:
        return self.engine.engine_core.is_paused

    @property
    def weights_version(self) -> int:
        return self.engine.model_runner.weights_version

    async def reset_prefix_cache(self) -> bool:
        return await self._call(lambda e: e.engine_core.reset_prefix_cache())

    async def pause_generation(self, mode: str = "abort", *, wait_for_inflight_requests: bool | None = None,
                               clear_cache: bool = True) -> None:
        """LLM.pause_generation's: hold new requests until resume_generation(); "abort"
        (the default) ends every unfinished request now with finish_reason "abort",
        "wait" lets the running ones finish; returns once none runs."""
        mode = pause_mode(mode, wait_for_inflight_requests)
        await self._call(lambda e: None, hold="pause")
        if mode == "abort":
            with self._streams_lock:
                ids = list(self._streams)
            self.abort(ids)
        await self._call(lambda e: e.engine_core.reset_prefix_cache() if clear_cache else None, when_idle=True)

    async def resume_generation(self) -> None:
        await self._call(lambda e: e.engine_core.release("pause"))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine loop; pending requests fail with EngineDeadError."""
        with self._cond:
            self._shutdown = True
            self._cond.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            # A dead engine's thread may be stuck in the step that killed it: do not wait for it.
            self._thread.join(timeout if self._dead_error is None else 1.0)
        if not self._thread.is_alive():  # a step still running keeps the followers needed
            self.engine.engine_core.shutdown()
        tracer = self.engine.output_processor.tracer
        if tracer is not None:
            tracer.shutdown()  # export the spans still queued
        if self._dead_error is None:
            self._dead_error = EngineDeadError("the engine was shut down")
        self._fail_all_streams(EngineDeadError("the engine was shut down"))
        self._fail_pending_calls(EngineDeadError("the engine was shut down"))

    # ------------------------------------------------------------------ engine thread
    def _post(self, cmd: EngineCommand) -> None:
        with self._cond:
            self._inbox.append(cmd)
            self._cond.notify()

    def _run_engine_loop(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    while (not self._inbox and not self._shutdown and not self._deferred
                           and not engine.has_unfinished_requests()):
                        self._cond.wait()
                    if self._shutdown:
                        return
                    cmds = list(self._inbox)
                    self._inbox.clear()
                cmds, self._deferred = self._deferred + cmds, []
                iteration = IterationStats()
                for cmd in cmds:
                    self._apply(cmd, iteration)
                by_loop: dict = {}
                if engine.has_unfinished_requests():
                    steps_before = engine.num_steps
                    self._step_started = time.monotonic()
                    outputs = engine.step_with_states()
                    self._step_started = None
                    if self._dead_error is not None:
                        return  # the watchdog gave up on this step: its requests have failed
                    by_loop = self._collect(outputs, iteration)
                    if not outputs and engine.num_steps == steps_before:
                        # Work exists but nothing could be scheduled: wait for an inbox
                        # change instead of spinning (for as long as it takes while the
                        # engine holds new requests: only a command changes that).
                        core = engine.engine_core
                        held = core._holds and core.is_idle() and not self._deferred
                        with self._cond:
                            if not self._inbox and not self._shutdown:
                                self._cond.wait(None if held else 0.005)
                # Stats first, so a caller that has seen its final output also sees it counted.
                self._publish_stats(iteration)
                self._deliver(by_loop)
        except BaseException as e:  # noqa: BLE001 — any failure kills the engine
            # Which request a failed step was about is unknown (the KV cache it was given
            # is gone too): every request in flight fails with the error, and the engine
            # is dead (the server exits non-zero so that a supervisor restarts it).
            logger.exception("The engine loop failed; the engine is dead")
            self._dead_error = e
            self._fail_all_streams(EngineStepError(f"the engine failed: {e!r}"))
            self._fail_pending_calls(EngineDeadError(f"the engine is dead: {e!r}"))

    def _apply(self, cmd: EngineCommand, iteration: IterationStats) -> None:
        if isinstance(cmd, AddRequest):
            stream = cmd.stream
            if stream.closed:  # aborted before it reached the engine: still an aborted request in the metrics
                iteration.finished_requests.append(FinishedRequestStats(
                    "abort", time.monotonic() - stream.arrival_time, len(stream.prompt_token_ids), 0, None, None))
                return
            try:
                if isinstance(cmd.params, PoolingParams):
                    self.engine.add_tokenized_pooling_request(stream.request_id, cmd.prompt, cmd.prompt_token_ids,
                                                              cmd.params, priority=cmd.priority, stream=stream,
                                                              token_type_ids=cmd.token_type_ids,
                                                              arrival_time=stream.arrival_time,
                                                              trace_headers=cmd.trace_headers)
                else:
                    self.engine.add_tokenized_request(stream.request_id, cmd.prompt, cmd.prompt_token_ids,
                                                      cmd.params, priority=cmd.priority, cache_salt=cmd.cache_salt,
                                                      stream=stream, lora_request=cmd.lora_request,
                                                      arrival_time=stream.arrival_time,
                                                      trace_headers=cmd.trace_headers, mm=cmd.mm)
            except (ValueError, TypeError) as e:
                self._send(stream, e)
        elif isinstance(cmd, EngineCall):
            core = self.engine.engine_core
            if cmd.hold is not None:
                core.hold(cmd.hold)
            # Calls run in the order they came: once one waits for the engine to be idle,
            # the later ones wait behind it (a wake_up never overtakes its sleep).
            if self._deferred or (cmd.when_idle and not core.is_idle()):
                self._deferred.append(cmd)  # tried again after the next step
                return
            try:
                if cmd.future.set_running_or_notify_cancel():  # False: the caller gave up
                    try:
                        result = cmd.fn(self.engine)
                    except Exception as e:  # noqa: BLE001 — the caller gets it
                        cmd.future.set_exception(e)
                    else:
                        cmd.future.set_result(result)
            finally:
                if cmd.hold is not None and cmd.hold != "pause":
                    core.release(cmd.hold)
        elif isinstance(cmd, AbortRequest):
            stream = cmd.stream
            # Only the engine request this stream was added as: the id may since have
            # been reused by a newer request.
            ids = self.engine.engine_request_ids(stream.request_id)
            if not ids or self.engine.output_processor.request_states[ids[0]].stream is not stream:
                return
            for _, out in self.engine.abort_request(stream.request_id):
                self._account(stream, out, time.monotonic(), iteration)
        else:
            raise AssertionError(f"unknown command {cmd!r}")

    @staticmethod
    def _send(stream: RequestStream, item) -> None:
        try:
            stream.loop.call_soon_threadsafe(deliver, [(stream, item)])
        except RuntimeError:  # loop closed
            stream.closed = True

    def _collect(self, outputs, iteration: IterationStats) -> dict:
        """Account a step's outputs; group them by the event loop that awaits them."""
        now = time.monotonic()
        by_loop: dict = {}
        for st, out in outputs:
            stream = st.stream
            if not isinstance(stream, RequestStream):
                continue
            if not isinstance(out, BaseException):
                self._account(stream, out, now, iteration)
            if not stream.closed:
                by_loop.setdefault(stream.loop, []).append((stream, out))
        return by_loop

    def _deliver(self, by_loop: dict) -> None:
        """One call_soon_threadsafe per event loop and step."""
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(deliver, items)
            except RuntimeError:  # loop closed: nobody is listening any more
                for stream, _ in items:
                    stream.closed = True
                    self.engine.abort_request(stream.request_id)

    def _account(self, stream: RequestStream, out: RequestOutput, now: float, it: IterationStats) -> None:
        """Per-request timing for the metrics (engine thread)."""
        if isinstance(out, PoolingRequestOutput):  # one output, at the end of its prompt
            e2e = now - stream.arrival_time
            it.num_prompt_tokens += len(stream.prompt_token_ids)
            it.finished_requests.append(FinishedRequestStats("stop", e2e, len(stream.prompt_token_ids), 0, e2e, None))
            return
        for c in out.outputs:
            n_new = len(c.token_ids)
            if n_new:
                if stream.first_token_time is None:
                    stream.first_token_time = now
                    it.time_to_first_tokens.append(now - stream.arrival_time)
                    it.num_prompt_tokens += len(stream.prompt_token_ids)
                elif c.index in stream.last_output_time:
                    it.inter_token_latencies.append(now - stream.last_output_time[c.index])
                stream.last_output_time[c.index] = now
                stream.num_generation_tokens += n_new
                it.num_generation_tokens += n_new
        if out.finished:
            ttft = None if stream.first_token_time is None else stream.first_token_time - stream.arrival_time
            e2e = now - stream.arrival_time
            per_choice = stream.num_generation_tokens / max(stream.n, 1)
            tpot = (e2e - ttft) / (per_choice - 1) if ttft is not None and per_choice > 1 else None
            reason = next((c.finish_reason for c in reversed(out.outputs) if c.finish_reason), "abort")
            it.finished_requests.append(FinishedRequestStats(
                reason, e2e, len(stream.prompt_token_ids), stream.num_generation_tokens, ttft, tpot))

    def _publish_stats(self, iteration: IterationStats) -> None:
        engine = self.engine
        per_rank = engine.engine_core.make_rank_stats()
        s = combine_stats(per_rank)
        pcs = s.prefix_cache_stats
        self._prefix_metrics.observe(pcs)
        iteration.spec_decoding = s.spec_decoding_stats
        self._prefix_queries += pcs.queries
        self._prefix_hits += pcs.hits
        self._stats = EngineStats(
            num_running_reqs=s.num_running_reqs, num_waiting_reqs=s.num_waiting_reqs,
            num_unfinished_requests=max(len(engine.output_processor.request_states),
                                        s.num_running_reqs + s.num_waiting_reqs),
            kv_cache_usage=s.kv_cache_usage, prefix_cache_queries=self._prefix_queries,
            prefix_cache_hits=self._prefix_hits, prefix_cache_hit_rate=self._prefix_metrics.hit_rate,
            num_preemptions=s.num_preemptions, num_steps=engine.num_steps,
            ranks=tuple(RankStats(r.num_running_reqs, r.num_waiting_reqs, r.kv_cache_usage) for r in per_rank),
            running_lora_adapters=tuple(sorted(s.running_lora_adapters)),
            waiting_lora_adapters=tuple(sorted(s.waiting_lora_adapters)), max_loras=s.max_loras,
        )
        for lg in self.stat_loggers:
            try:
                lg.record(self._stats, iteration)
            except Exception:  # noqa: BLE001 — metrics must never kill the engine
                logger.exception("stat logger %r failed", lg)

    def _unregister(self, stream: RequestStream) -> None:
        with self._streams_lock:
            if self._streams.get(stream.request_id) is stream:
                del self._streams[stream.request_id]
                self._in_flight -= stream.n

    def _on_overflow(self, stream: RequestStream) -> None:
        """(On the stream's event loop.) Its reader stalled: forget it, abort its request."""
        logger.warning("request %s: its reader stalled (%d outputs unread); aborting it", stream.request_id,
                       stream.max_queued)
        self._unregister(stream)
        self._post(AbortRequest(stream))

    def _watch_steps(self) -> None:
        """Watchdog thread: a step running past iteration_timeout_s (a hung device, a
        deadlock) kills the engine, so every request ends instead of waiting for ever."""
        period = min(1.0, self.iteration_timeout_s / 4)
        while not self._shutdown and self._dead_error is None:
            time.sleep(period)
            started = self._step_started
            if started is not None and time.monotonic() - started > self.iteration_timeout_s:
                error = TimeoutError(f"an engine step has run for more than {self.iteration_timeout_s:g} s")
                logger.error("%s; the engine is dead", error)
                self._dead_error = error
                self._fail_all_streams(EngineStepError(f"the engine failed: {error}"))
                self._fail_pending_calls(EngineDeadError(f"the engine is dead: {error}"))
                return

    def _fail_pending_calls(self, error: BaseException) -> None:
        """Every EngineCall not run yet fails with ``error`` (the engine died or shut down)."""
        with self._cond:
            calls = self._deferred + [c for c in self._inbox if isinstance(c, EngineCall)]
            self._deferred = []
        for call in calls:
            if call.future.set_running_or_notify_cancel():
                call.future.set_exception(error)

    def _fail_all_streams(self, error: BaseException) -> None:
        with self._streams_lock:
            streams = list(self._streams.values())
            self._streams.clear()
            self._in_flight = 0
        for stream in streams:
            if not stream.closed:
                self._send(stream, error)

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

