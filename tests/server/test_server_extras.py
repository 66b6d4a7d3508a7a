"""The server's smaller features over the tiny model and a real uvicorn: constrained
requests accepted or rejected with the right ``param``, HEAD on GET routes, the
X-Request-Id echo, /tokenizer_info and usage.prompt_tokens_details (streamed or not).
The tiny random model writes garbage, so what a constrained output looks like is the
engine's tests' business; here only what the server does with the request."""
from __future__ import annotations

import json

import httpx
import pytest
from starlette.testclient import TestClient

from server.app import build_app
from tests.server.harness import RunningServer

MODEL = "tiny"
MAX_MODEL_LEN = 256
MESSAGES = [{"role": "user", "content": "w5 w6 w7"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.fixture(scope="module")
def server(tiny_async_llm):
    srv = RunningServer(build_app(tiny_async_llm, MODEL, max_model_len=MAX_MODEL_LEN, enable_prompt_tokens_details=True,
                                  enable_tokenizer_info_endpoint=True))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def sse(r) -> list[dict]:
    assert r.status_code == 200, r.text
    lines = [ln[len("data: "):] for ln in r.text.split("\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def error_param(r) -> str | None:
    assert r.status_code == 400, r.text
    return r.json()["error"]["param"]


# ----------------------------------------------------------------------------- structured outputs
def test_constrained_requests_are_accepted(http):
    """Every way of asking for a constraint reaches the engine (200); the vocabulary of the
    tiny word-level model holds the words w5 / w6, so these constraints can be met."""
    base = {"model": MODEL, "max_tokens": 3, "temperature": 0}
    for extra in ({"structured_outputs": {"choice": ["w5", "w6"]}},
                  {"structured_outputs": {"regex": "w[0-9]+"}},
                  {"guided_choice": ["w5", "w6"], "guided_decoding_backend": "xgrammar"},
                  {"response_format": {"type": "text"}}):
        r = http.post("/v1/completions", json={**base, "prompt": "w5 w6", **extra})
        assert r.status_code == 200, (extra, r.text)
        r = http.post("/v1/chat/completions", json={**base, "messages": MESSAGES, **extra})
        assert r.status_code == 200, (extra, r.text)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs"),  # the engine's parser rejects it
    ({"guided_regex": "(("}, "guided_regex"),
])
def test_bad_constraints_are_400(http, path, extra, param):
    body = {"model": MODEL, "max_tokens": 2, **extra}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": "w5"})
    assert error_param(http.post(path, json=body)) == param


def test_tool_choice_400s(http):
    base = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    r = http.post("/v1/chat/completions", json={**base, "tools": TOOLS, "tool_choice": "auto"})
    assert error_param(r) == "tool_choice"
    assert "--enable-auto-tool-choice and --tool-call-parser" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={**base, "tools": TOOLS,
                                                "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert error_param(r) == "tool_choice"
    r = http.post("/v1/chat/completions", json={**base, "tools": TOOLS, "tool_choice": "none"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"] == []


# ----------------------------------------------------------------------------- small endpoints
def test_head_routes(http):
    for path in ("/health", "/version", "/v1/models", "/metrics", "/tokenizer_info"):
        r = http.head(path)
        assert r.status_code == 200 and r.content == b"", path
        if path != "/health":  # the GET's headers, without its body
            assert r.headers["content-type"] and int(r.headers["content-length"]) > 0, path
    assert http.head("/v1/completions").status_code == 405


def test_request_id_echo(http):
    h = {"X-Request-Id": "req-42"}
    assert http.get("/v1/models", headers=h).headers["x-request-id"] == "req-42"
    assert "x-request-id" not in http.get("/v1/models").headers
    r = http.post("/v1/chat/completions", headers=h, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2})
    assert r.headers["x-request-id"] == "req-42" and r.json()["id"] == "chatcmpl-req-42"
    r = http.post("/v1/completions", headers=h, json={"model": MODEL, "prompt": "w5", "max_tokens": 2, "stream": True})
    assert r.headers["x-request-id"] == "req-42" and {e["id"] for e in sse(r)} == {"cmpl-req-42"}
    r = http.post("/v1/completions", headers=h, json={"model": MODEL, "prompt": "w5", "max_tokens": 100000})
    assert r.status_code == 400 and r.headers["x-request-id"] == "req-42"


def test_tokenizer_info(http, server, tiny_async_llm):
    info = http.get("/tokenizer_info").json()
    tok = tiny_async_llm.get_tokenizer()
    assert info["tokenizer_class"] == type(tok).__name__
    assert info["chat_template"] == tok.chat_template
    assert info["eos_token"] == "</s>" and "vocab_file" not in info
    assert info["added_tokens_decoder"]["2"]["content"] == "</s>" and info["added_tokens_decoder"]["2"]["special"]
    with TestClient(build_app(tiny_async_llm, MODEL, max_model_len=MAX_MODEL_LEN)) as c:
        assert c.get("/tokenizer_info").status_code == 404
        assert c.head("/tokenizer_info").status_code == 404


# ----------------------------------------------------------------------------- prompt_tokens_details
def test_prompt_tokens_details(http, tiny_async_llm):
    """--enable-prompt-tokens-details: cached_tokens (whole 16-token blocks) on chat and
    completions, streamed (the usage chunk) or not."""
    words = " ".join(f"w{300 + i}" for i in range(40))
    chat = {"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": 2}
    comp = {"model": MODEL, "prompt": words, "max_tokens": 2}
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    first = http.post("/v1/chat/completions", json=chat).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    http.post("/v1/completions", json=comp)  # its prompt differs (no chat template): cache it too
    usages = [http.post("/v1/chat/completions", json=chat).json()["usage"],
              sse(http.post("/v1/chat/completions", json={**chat, **stream}))[-1]["usage"],
              http.post("/v1/completions", json=comp).json()["usage"],
              sse(http.post("/v1/completions", json={**comp, **stream}))[-1]["usage"]]
    for u in usages:
        cached = u["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0 and cached % 16 == 0 and cached < u["prompt_tokens"], u
    # Off (the default): no prompt_tokens_details.
    with TestClient(build_app(tiny_async_llm, MODEL, max_model_len=MAX_MODEL_LEN)) as c:
        assert c.post("/v1/completions", json=comp).json()["usage"]["prompt_tokens_details"] is None
        last = sse(c.post("/v1/completions", json={**comp, **stream}))[-1]
        assert "prompt_tokens_details" not in last["usage"]
