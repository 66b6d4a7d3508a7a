"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (schemathesis):
every operation gets bodies that fit the schema (positive) and bodies that break it
(negative), sent to a real uvicorn on 127.0.0.1 over the tiny model. No response may
be a 5xx, and the engine must survive.

The default run is short and deterministic (a fixed number of examples per operation
and mode, derandomized). A longer, random run:

    JAXSERVE_FUZZ_EXAMPLES=2000 .venv/bin/pytest -q -s tests/server/test_fuzz_openapi.py

(JAXSERVE_FUZZ_EXAMPLES set: that many examples per operation and mode, a new random
seed each run). A 5xx is reported with the curl command that reproduces it.
"""
from __future__ import annotations

import collections
import os
import time

import pytest

schemathesis = pytest.importorskip("schemathesis")
requests = pytest.importorskip("requests")

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable

from server.app import build_app
from server.limits import ServerLimits
from tests.server.harness import RunningServer

MODEL = "tiny"
MAX_MODEL_LEN = 256
EXAMPLES = int(os.environ.get("JAXSERVE_FUZZ_EXAMPLES", "30"))
LONG_RUN = "JAXSERVE_FUZZ_EXAMPLES" in os.environ
# Generated bodies keep their max_tokens small (the tiny model on CPU is ~ms per token;
# the bounds themselves are the hostile-input tests' job).
MAX_TOKENS_CAP = 4


@pytest.fixture(scope="module")
def server(tiny_async_llm):
    srv = RunningServer(build_app(tiny_async_llm, MODEL, max_model_len=MAX_MODEL_LEN,
                                  limits=ServerLimits(max_request_body_bytes=1 << 20)))
    srv.async_llm = tiny_async_llm
    yield srv
    srv.stop()


def _tame(case) -> None:
    """Keep a generated generation request cheap: max_tokens capped, and (half the
    time, positive bodies only) the served model's name instead of a random one, so
    that more bodies get past the model check into the engine."""
    body = case.body
    if not isinstance(body, dict) or case.path not in ("/v1/completions", "/v1/chat/completions"):
        return
    capped = False
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > MAX_TOKENS_CAP:
            body[key] = MAX_TOKENS_CAP
        capped = capped or v is not None
    if not capped and case.path == "/v1/chat/completions":
        body["max_tokens"] = MAX_TOKENS_CAP  # chat's default is the rest of the context
    if isinstance(body.get("model"), str) and len(body["model"]) % 2:
        body["model"] = MODEL


def test_fuzz_openapi(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    session = requests.Session()
    statuses: collections.Counter = collections.Counter()
    five_xx: list[str] = []
    skipped_negative: list[str] = []
    examples = 0
    t0 = time.monotonic()
    operations = [op.ok() for op in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    for op in operations:
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            if mode is schemathesis.GenerationMode.NEGATIVE and op.method.upper() == "GET":
                continue  # no body, no parameters: nothing to break

            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=not LONG_RUN,
                      suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                nonlocal examples
                examples += 1
                _tame(case)
                resp = case.call(base_url=server.url, session=session, timeout=60)
                statuses[resp.status_code] += 1
                if resp.status_code >= 500:
                    five_xx.append(f"{resp.status_code} {resp.text[:300]}\n  {case.as_curl_command()[:2000]}")

            try:
                run()
            except Unsatisfiable:
                # Nothing of the operation can be broken (no body in its schema, e.g. the
                # Messages routes, which validate their own; a free-form path id).
                if mode is not schemathesis.GenerationMode.NEGATIVE:
                    raise
                skipped_negative.append(f"{op.method.upper()} {op.path}")
    elapsed = time.monotonic() - t0
    requests_sent = sum(statuses.values())
    print(f"\nfuzz: {len(operations)} operations, {examples} examples, {requests_sent} requests in {elapsed:.1f} s, "
          f"statuses {dict(sorted(statuses.items()))}, 5xx: {len(five_xx)}; no negative case for "
          f"{skipped_negative or 'none'}")
    # Only operations without a body schema may lack negative cases.
    assert not set(skipped_negative) & {"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses"}
    assert not server.async_llm.errored, "a fuzzed request killed the engine"
    assert not five_xx, "\n".join(five_xx[:20])
    # The server still serves after the fuzzing.
    resp = session.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "w5 w6", "max_tokens": 2})
    assert resp.status_code == 200
