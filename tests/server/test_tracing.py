"""OpenTelemetry request traces (--otlp-traces-endpoint; jaxserve/tracing.py).

The span builder over an in-memory exporter (vLLM's attribute names, the caller's trace
context as the parent, the queued / prefill / decode children); then the whole path:
a server over a tiny model exporting to an OTLP/HTTP collector run by the test, whose
protobuf requests are decoded and checked against the responses (tokens, ids, the
client's traceparent), and the offline LLM."""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("opentelemetry.sdk.trace", reason="the otel extra is part of the test extras")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from jaxserve.config import ObservabilityConfig  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402
from jaxserve.tracing import RequestTracer, SpanAttributes, make_exporter, trace_headers_of  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def test_span_attributes_parent_and_phases():
    exporter = InMemorySpanExporter()
    tracer = RequestTracer("unused:4317", model="m", exporter=exporter)
    t0 = time.monotonic() - 1.0
    tracer.record(request_id="chatcmpl-1", params=SamplingParams(temperature=0.5, top_p=0.9, max_tokens=7),
                  trace_headers={"traceparent": TRACEPARENT}, num_prompt_tokens=11, num_generation_tokens=7,
                  num_cached_tokens=4, arrival_time=t0, scheduled_time=t0 + 0.1, first_token_time=t0 + 0.3,
                  end_time=t0 + 0.9, finish_reason="length")
    tracer.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"llm_request", "queued", "prefill", "decode"}
    root = spans["llm_request"]
    a = root.attributes
    A = SpanAttributes
    assert a[A.GEN_AI_REQUEST_ID] == "chatcmpl-1" and a[A.GEN_AI_RESPONSE_MODEL] == "m"
    assert (a[A.GEN_AI_USAGE_PROMPT_TOKENS], a[A.GEN_AI_USAGE_COMPLETION_TOKENS]) == (11, 7)
    assert a[A.GEN_AI_REQUEST_TEMPERATURE] == 0.5 and a[A.GEN_AI_REQUEST_TOP_P] == 0.9
    assert a[A.GEN_AI_REQUEST_MAX_TOKENS] == 7 and a[A.GEN_AI_REQUEST_N] == 1
    assert a[A.GEN_AI_LATENCY_TIME_IN_QUEUE] == pytest.approx(0.1)
    assert a[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] == pytest.approx(0.3)
    assert a[A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] == pytest.approx(0.2)
    assert a[A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] == pytest.approx(0.6)
    assert a[A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] == pytest.approx(0.8)
    assert a[A.GEN_AI_LATENCY_E2E] == pytest.approx(0.9)
    assert tuple(a[A.GEN_AI_RESPONSE_FINISH_REASONS]) == ("length",)
    # the client's trace: same trace id, its span as the parent; the phases are children
    assert format(root.context.trace_id, "032x") == TRACE_ID and format(root.parent.span_id, "016x") == PARENT_ID
    assert abs((root.end_time - root.start_time) / 1e9 - 0.9) < 1e-3
    for name in ("queued", "prefill", "decode"):
        assert spans[name].parent.span_id == root.context.span_id
    assert spans["queued"].end_time == spans["prefill"].start_time
    assert spans["prefill"].end_time == spans["decode"].start_time
    assert abs(spans["decode"].start_time - root.start_time - 0.3e9) < 1e3


def test_aborted_before_scheduling_and_without_context():
    exporter = InMemorySpanExporter()
    tracer = RequestTracer("unused:4317", exporter=exporter)
    t0 = time.monotonic()
    tracer.record(request_id="r", params=SamplingParams(), trace_headers=None, num_prompt_tokens=3,
                  num_generation_tokens=0, num_cached_tokens=0, arrival_time=t0, scheduled_time=None,
                  first_token_time=None, end_time=t0 + 0.01, finish_reason="abort", error="boom")
    tracer.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"llm_request", "queued"}
    assert spans["llm_request"].parent is None
    assert SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN not in spans["llm_request"].attributes
    assert spans["llm_request"].status.description == "boom"


def test_config_and_exporter_errors(monkeypatch):
    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        ObservabilityConfig(otlp_traces_endpoint=" ")
    with pytest.raises(ValueError, match="grpc' or 'http/protobuf"):
        make_exporter("localhost:4317", "thrift")
    monkeypatch.setattr("jaxserve.tracing.otel_available", lambda: False)
    with pytest.raises(ValueError, match=r"jaxserve\[otel\]"):
        ObservabilityConfig(otlp_traces_endpoint="localhost:4317")
    assert trace_headers_of({"traceparent": TRACEPARENT, "x": "y"}) == {"traceparent": TRACEPARENT}
    assert trace_headers_of({}) is None


def test_exporters_for_both_protocols():
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    assert isinstance(make_exporter("grpc://localhost:4317"), Grpc)
    http = make_exporter("http://localhost:4318", "http/protobuf")
    assert isinstance(http, Http) and http._endpoint == "http://localhost:4318/v1/traces"


# ----------------------------------------------------------------------------- end to end
class Collector:
    """An OTLP/HTTP collector: decodes each POST /v1/traces (protobuf) into spans."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans: list = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest.FromString(body)
                for rs in req.resource_spans:
                    service = {kv.key: kv.value.string_value for kv in rs.resource.attributes}["service.name"]
                    for ss in rs.scope_spans:
                        collector.spans += [(service, s) for s in ss.spans]
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def requests(self) -> list:
        return [(svc, s) for svc, s in self.spans if s.name == "llm_request"]

    def close(self) -> None:
        self.server.shutdown()


def attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = getattr(v, v.WhichOneof("value"))
    return out


@pytest.mark.slow
def test_server_and_offline_requests_are_traced(tiny_model_dir, monkeypatch):
    from starlette.testclient import TestClient

    from jaxserve import LLM
    from jaxserve.engine.arg_utils import EngineArgs
    from jaxserve.engine.async_llm import AsyncLLM
    from server.app import build_app
    from tests.server.harness import TINY_ENGINE_ARGS

    collector = Collector()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "jaxserve-test")
    args = TINY_ENGINE_ARGS | {"enforce_eager": True, "otlp_traces_endpoint": collector.url}
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_model_dir), served_model_name="tiny", **args),
                                       progress=False)
    try:
        with TestClient(build_app(engine, "tiny")) as client:
            chat = client.post("/v1/chat/completions", headers={"traceparent": TRACEPARENT}, json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0.7,
                "ignore_eos": True}).json()
            comp = client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 3, "n": 2,
                                                       "ignore_eos": True}).json()
    finally:
        engine.shutdown()  # flushes the exporter
    spans = collector.requests()
    assert len(spans) == 3, [attrs(s) for _, s in spans]  # the chat, and one per completion choice
    assert all(service == "jaxserve-test" for service, _ in spans)
    [chat_span] = [s for s in (sp for _, sp in spans) if s.trace_id.hex() == TRACE_ID]
    a = attrs(chat_span)
    assert chat_span.parent_span_id.hex() == PARENT_ID
    assert a["gen_ai.usage.prompt_tokens"] == chat["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.completion_tokens"] == chat["usage"]["completion_tokens"] == 5
    assert a["gen_ai.response.model"] == "tiny" and a["gen_ai.request.temperature"] == pytest.approx(0.7)
    assert a["gen_ai.request.max_tokens"] == 5
    for key in ("time_in_queue", "time_to_first_token", "time_in_model_prefill", "time_in_model_decode", "e2e"):
        assert a[f"gen_ai.latency.{key}"] >= 0, key
    assert a["gen_ai.latency.e2e"] >= a["gen_ai.latency.time_to_first_token"] >= a["gen_ai.latency.time_in_queue"]
    others = [attrs(s) for _, s in spans if s is not chat_span]
    assert sorted(o["gen_ai.usage.completion_tokens"] for o in others) == [3, 3]
    assert all(o["gen_ai.request.n"] == 2 and o["gen_ai.usage.prompt_tokens"] == comp["usage"]["prompt_tokens"]
               for o in others)
    children = [s for _, s in collector.spans if s.trace_id == chat_span.trace_id and s.name != "llm_request"]
    assert sorted(s.name for s in children) == ["decode", "prefill", "queued"]
    assert all(s.parent_span_id == chat_span.span_id for s in children)

    # offline: the same spans, no parent
    collector.spans.clear()
    llm = LLM(str(tiny_model_dir), progress=False, **args)
    llm.generate(["x y"], SamplingParams(max_tokens=2, ignore_eos=True))
    llm.llm_engine.output_processor.tracer.shutdown()
    [(_, span)] = collector.requests()
    assert attrs(span)["gen_ai.usage.completion_tokens"] == 2 and not span.parent_span_id
    collector.close()
