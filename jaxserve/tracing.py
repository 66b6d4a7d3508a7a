"""OpenTelemetry traces of requests (vLLM's ``--otlp-traces-endpoint``).

Each request that ends (finished, aborted or failed) becomes one ``llm_request`` span
(SpanKind.SERVER) from its arrival to its last output, with vLLM's attribute names
(``SpanAttributes``) and three child spans that show where the time went: ``queued``
(arrival -> first scheduled), ``prefill`` (-> first token) and ``decode`` (-> the end).
The caller's W3C trace context (``traceparent`` / ``tracestate`` headers) is the parent,
so the span joins the client's trace. A request of ``n`` choices is one span per choice,
as in vLLM. Neither the prompt nor the output is recorded.

The engine thread only queues each finished request's numbers (``record``); a thread of
the tracer builds the spans (measured: 5 us a request on the engine thread, 0.3 ms on
the tracer's), and the SDK's batch processor exports them over OTLP on its own thread.
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` is ``grpc`` (vLLM's default; ``grpc://`` or
``http://`` host:port, port 4317) or ``http/protobuf`` (the URL, usually
port 4318; ``/v1/traces`` is added when the URL has no path); ``OTEL_SERVICE_NAME``
names the service (default ``jaxserve``). Needs the ``otel`` extra
(``pip install 'jaxserve[otel]'``): opentelemetry-sdk and the OTLP exporters.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")
INSTALL_HINT = "pip install 'jaxserve[otel]' (opentelemetry-sdk and its OTLP exporters)"


class SpanAttributes:
    """vLLM's span attribute names (vllm/tracing), so dashboards built for it read ours."""

    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_CACHED_TOKENS = "gen_ai.usage.cached_tokens"
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


def otel_available() -> bool:
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        return False
    return True


def trace_headers_of(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The W3C trace-context headers of an HTTP request (None when it has none)."""
    found = {h: headers[h] for h in TRACE_HEADERS if h in headers}
    return found or None


def make_exporter(endpoint: str, protocol: str | None = None):
    """An OTLP span exporter for ``endpoint`` (``protocol``: grpc or http/protobuf;
    default: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else grpc)."""
    protocol = (protocol or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            target = endpoint.removeprefix("grpc://")
            secure = target.startswith("https://")
            return OTLPSpanExporter(endpoint=target, insecure=not secure)
        if protocol == "http/protobuf":
            from urllib.parse import urlsplit

            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            url = endpoint if "://" in endpoint else f"http://{endpoint}"
            if urlsplit(url).path in ("", "/"):
                url = url.rstrip("/") + "/v1/traces"
            return OTLPSpanExporter(endpoint=url)
    except ImportError as e:
        raise ValueError(f"otlp_traces_endpoint: the OTLP {protocol} exporter is not installed: {INSTALL_HINT}") from e
    raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be 'grpc' or 'http/protobuf', got {protocol!r}")


class RequestTracer:
    """Builds and exports the request spans. ``exporter``: any SpanExporter (tests);
    default: OTLP to ``endpoint`` (make_exporter)."""

    def __init__(self, endpoint: str, *, model: str = "", exporter=None) -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.sdk.resources import SERVICE_NAME, Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind, Status, StatusCode
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:
            raise ValueError(f"otlp_traces_endpoint needs OpenTelemetry: {INSTALL_HINT}") from e
        self._kind, self._status, self._code = SpanKind, Status, StatusCode
        self._in_context = trace.set_span_in_context
        self._propagator = TraceContextTextMapPropagator()
        self.model = model
        resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", "jaxserve")})
        # Our own provider, not the global one: the application may trace with its own.
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(exporter or make_exporter(endpoint)))
        self.tracer = self.provider.get_tracer("jaxserve")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="jaxserve-tracer", daemon=True)
        self._thread.start()

    def record(self, **request) -> None:
        """One finished request (``_build``'s arguments); returns at once."""
        self._queue.put(request)

    def _run(self) -> None:
        while (request := self._queue.get()) is not None:
            try:
                self._build(**request)
            except Exception:  # noqa: BLE001 — a bad span must not stop the ones after it
                logger.exception("request %s: its trace span could not be built", request.get("request_id"))

    def _build(self, *, request_id: str, params: Any, trace_headers: Mapping[str, str] | None,
               num_prompt_tokens: int, num_generation_tokens: int, num_cached_tokens: int,
               arrival_time: float, scheduled_time: float | None, first_token_time: float | None,
               end_time: float, finish_reason: str | None, error: str | None = None) -> None:
        """One finished request (times: time.monotonic() seconds)."""
        A = SpanAttributes
        # Monotonic -> wall clock (ns), through one reading of both clocks.
        offset = time.time_ns() - time.monotonic_ns()

        def ns(t: float) -> int:
            return int(t * 1e9) + offset

        context = self._propagator.extract(trace_headers) if trace_headers else None
        attrs: dict[str, Any] = {
            A.GEN_AI_RESPONSE_MODEL: self.model, A.GEN_AI_REQUEST_ID: request_id,
            A.GEN_AI_USAGE_PROMPT_TOKENS: num_prompt_tokens,
            A.GEN_AI_USAGE_COMPLETION_TOKENS: num_generation_tokens,
            A.GEN_AI_USAGE_CACHED_TOKENS: num_cached_tokens,
            A.GEN_AI_LATENCY_E2E: end_time - arrival_time,
        }
        for name, field in ((A.GEN_AI_REQUEST_MAX_TOKENS, "max_tokens"), (A.GEN_AI_REQUEST_TOP_P, "top_p"),
                            (A.GEN_AI_REQUEST_TEMPERATURE, "temperature"), (A.GEN_AI_REQUEST_N, "n")):
            value = getattr(params, field, None)
            if value is not None:
                attrs[name] = value
        if finish_reason is not None:
            attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] = [finish_reason]
        if scheduled_time is not None:
            attrs[A.GEN_AI_LATENCY_TIME_IN_QUEUE] = scheduled_time - arrival_time
            attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = end_time - scheduled_time
        if first_token_time is not None:
            attrs[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = first_token_time - arrival_time
            attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = end_time - first_token_time
            if scheduled_time is not None:
                attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = first_token_time - scheduled_time
        span = self.tracer.start_span("llm_request", context=context, kind=self._kind.SERVER,
                                      attributes=attrs, start_time=ns(arrival_time))
        # The phases, as children: what a trace viewer draws as the request's timeline.
        phases = [("queued", arrival_time, scheduled_time)]
        if scheduled_time is not None:
            phases.append(("prefill", scheduled_time, first_token_time or end_time))
        if first_token_time is not None:
            phases.append(("decode", first_token_time, end_time))
        parent = self._in_context(span)
        for name, start, stop in phases:
            child = self.tracer.start_span(name, context=parent, start_time=ns(start))
            child.end(end_time=ns(stop if stop is not None else end_time))
        if error is not None:
            span.set_status(self._status(self._code.ERROR, error))
        span.end(end_time=ns(end_time))

    def shutdown(self) -> None:
        """Build and export what is queued, then stop the threads."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self.provider.shutdown()
