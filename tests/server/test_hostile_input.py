"""Hostile input against a real uvicorn on 127.0.0.1 (the tiny model): every malformed,
oversized, out-of-range or un-encodable request is an HTTP 4xx with the OpenAI error
envelope naming the field, never a 5xx; and the API key guards what it should.

The table is grouped by input class; the module prints one line at the end:
"hostile inputs: N tried (class: n, ...), 5xx seen: 0".
"""
from __future__ import annotations

import collections
import json
from dataclasses import dataclass, field

import httpx
import pytest

from server.app import build_app
from server.limits import (
    MAX_JSON_DEPTH,
    MAX_MESSAGES,
    MAX_PROMPTS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOOLS,
    ServerLimits,
)
from tests.server.harness import TINY_ENGINE_ARGS, RunningServer

MODEL = "tiny"
MAX_MODEL_LEN = 256
BODY_LIMIT = 256 << 10  # the test server's --max-request-body-bytes
KEY = "s3cret-key"
CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
COMPLETION = {"model": MODEL, "prompt": "w5 w6 w7", "max_tokens": 2}
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "get_weather",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}

pytestmark = pytest.mark.filterwarnings("ignore:temperature .* is below")

TRIED: collections.Counter = collections.Counter()
FIVE_XX: list[str] = []


@dataclass
class Case:
    """One request and what it must get. ``raw``: the body's bytes as sent (JSON the
    client library would not write); else ``body`` as JSON. ``param``: the envelope's
    param (``...``: not checked)."""

    name: str
    path: str
    body: object = None
    status: int = 400
    param: object = ...
    raw: bytes | str | None = None
    headers: dict = field(default_factory=dict)


def cmpl(**fields) -> dict:
    return {**COMPLETION, **fields}


def chat(**fields) -> dict:
    return {**CHAT_BODY, **fields}


def raw_with(base: dict, key: str, literal: str) -> str:
    """``base`` as JSON with ``key`` set to a literal JSON can't hold (NaN, a lone surrogate)."""
    text = json.dumps({k: v for k, v in base.items() if k != key})
    return text[:-1] + f', "{key}": {literal}}}'


def nested(depth: int, leaf=1):
    """``depth`` levels of arrays / objects around ``leaf``."""
    v = leaf
    for i in range(depth):
        v = [v] if i % 2 else {"k": v}
    return v


INT_FIELDS_CMPL = ["n", "max_tokens", "logprobs", "top_k", "seed", "priority", "min_tokens", "prompt_logprobs",
                   "best_of"]
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
INT_FIELDS_CHAT = ["n", "max_tokens", "max_completion_tokens", "top_logprobs", "top_k", "seed", "priority"]


def _cases() -> dict[str, list[Case]]:
    c: dict[str, list[Case]] = collections.defaultdict(list)

    # ------------------------------------------------------------------ body size / media type / JSON
    big = json.dumps(cmpl(padding="x" * BODY_LIMIT))
    for path in (CMPL, CHAT, "/tokenize", "/detokenize"):
        c["body_size"].append(Case(f"{path} over the limit", path, raw=big, status=413, param=None))
    c["body_size"].append(Case("just under the limit is served", CMPL, status=200,
                               raw=json.dumps(cmpl(padding="x" * (BODY_LIMIT - 200)))))
    for path in (CMPL, CHAT, "/tokenize", "/detokenize"):
        malformed = [
            ("malformed JSON", b'{"model": '), ("empty body", b""), ("JSON array", b"[1, 2]"),
            ("JSON string", b'"hello"'), ("JSON null", b"null"), ("invalid UTF-8", b'{"prompt": "\xff\xfe"}'),
            ("trailing garbage", b'{"prompt": "w5"} xx'), ("deep JSON", b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
        ]
        for name, raw in malformed:
            c["malformed_json"].append(Case(f"{path} {name}", path, raw=raw, param=None))
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                      "application/xml"):
            c["content_type"].append(Case(f"{path} {ctype}", path, raw=json.dumps(COMPLETION), param=None,
                                          headers={"content-type": ctype}))
    c["content_type"].append(Case("application/json; charset=utf-8 is served", CMPL, status=200,
                                  raw=json.dumps(COMPLETION), headers={"content-type": "application/json; charset=utf-8"}))

    # ------------------------------------------------------------------ wrong JSON types, mixed arrays
    # (pydantic's lax mode reads true as 1 and "yes" as true, as vLLM's models do: not wrong types here)
    wrong = ["hot", [], {}, [1], "1.5.2"]
    for f in INT_FIELDS_CMPL + FLOAT_FIELDS:
        for v in wrong:
            c["wrong_type"].append(Case(f"completion {f}={v!r}", CMPL, cmpl(**{f: v}), param=f))
    for f in INT_FIELDS_CHAT:
        c["wrong_type"].append(Case(f"chat {f}='x'", CHAT, chat(**{f: "x"}), param=f))
    for f, v in [("prompt", [1, "a"]), ("prompt", [[1], "a"]), ("prompt", [["a"]]), ("prompt", {"a": 1}),
                 ("prompt", None), ("prompt", 5), ("prompt", [1.5]), ("stop", [1]), ("stop", ["a", None]),
                 ("stop", 5), ("stop_token_ids", ["a"]), ("stop_token_ids", 3), ("logit_bias", [1]),
                 ("stream", "maybe"), ("stream_options", "x"), ("echo", "x"), ("response_format", "json"),
                 ("structured_outputs", [1]), ("guided_choice", "a"), ("model", 5), ("user", []),
                 ("suffix", 1), ("ignore_eos", "x")]:
        c["wrong_type"].append(Case(f"completion {f}={v!r}", CMPL, cmpl(**{f: v}), param=f))
    for f, v in [("messages", [1]), ("messages", "hi"), ("messages", [None]), ("messages", [{"role": 1}]),
                 ("messages", [{"content": "no role"}]), ("messages", [{"role": "user", "content": 5}]),
                 ("messages", [{"role": "user", "content": [1]}]), ("messages", [{"role": "user", "content": [{}]}]),
                 ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
                 ("messages", [{"role": "assistant", "tool_calls": "x"}]),
                 ("messages", [{"role": "assistant", "tool_calls": [{"function": {"name": 5}}]}]),
                 ("messages", [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1"}}]}]),
                 ("messages", []), ("messages", None),
                 ("tools", "x"), ("tools", [1]), ("tools", [{"type": "function"}]), ("tools", []),
                 ("tools", [{"type": "function", "function": {"name": 5}}]),
                 ("tools", [{"type": "function", "function": {"name": "f", "parameters": [1]}}]),
                 ("tool_choice", 5), ("tool_choice", "sometimes"), ("logprobs", "x"), ("top_logprobs", [1]),
                 ("chat_template_kwargs", [1]), ("add_generation_prompt", "x")]:
        c["wrong_type"].append(Case(f"chat {f}={json.dumps(v)[:40]}", CHAT, chat(**{f: v}), param=f))
    c["wrong_type"] += [
        Case("tokenize prompt=5", "/tokenize", {"prompt": 5}, param=...),
        Case("tokenize messages=[1]", "/tokenize", {"messages": [1]}, param=...),
        Case("detokenize tokens='a'", "/detokenize", {"tokens": "a"}, param="tokens"),
        Case("detokenize tokens=[1.5]", "/detokenize", {"tokens": [1.5]}, param="tokens"),
        Case("detokenize tokens=[[1]]", "/detokenize", {"tokens": [[1]]}, param="tokens"),
    ]

    # ------------------------------------------------------------------ NaN / Infinity (Python's JSON reads them)
    for f in INT_FIELDS_CMPL + FLOAT_FIELDS:
        for lit in ("NaN", "Infinity", "-Infinity", "1e400"):
            c["non_finite"].append(Case(f"completion {f}={lit}", CMPL, raw=raw_with(COMPLETION, f, lit), param=f))
    for f in INT_FIELDS_CHAT + FLOAT_FIELDS:
        c["non_finite"].append(Case(f"chat {f}=NaN", CHAT, raw=raw_with(CHAT_BODY, f, "NaN"), param=f))
    c["non_finite"] += [
        Case("logit_bias value NaN", CMPL, raw=raw_with(COMPLETION, "logit_bias", '{"5": NaN}'), param="logit_bias"),
        Case("schema minimum NaN", CMPL, param="guided_json",
             raw=raw_with(COMPLETION, "guided_json", '{"type": "number", "minimum": NaN}')),
        Case("chat_template_kwargs Infinity", CHAT, param="chat_template_kwargs",
             raw=raw_with(CHAT_BODY, "chat_template_kwargs", '{"x": Infinity}')),
        Case("extra field NaN", CMPL, raw=raw_with(COMPLETION, "my_extension", "NaN"), param=None),
    ]

    # ------------------------------------------------------------------ huge / out-of-range integers
    for f in INT_FIELDS_CMPL:
        for v in (2**70, -(2**70), 2**63):
            c["huge_int"].append(Case(f"completion {f}={v}", CMPL, cmpl(**{f: v}), param=f))
    for f in INT_FIELDS_CHAT:
        c["huge_int"].append(Case(f"chat {f}=2**70", CHAT, chat(**{f: 2**70}), param=f))
    c["huge_int"] += [
        Case("top_k=2**40 (int32 overflow)", CMPL, cmpl(top_k=2**40), param="top_k"),
        Case("top_k=2**31", CMPL, cmpl(top_k=2**31), param="top_k"),
        Case("stop_token_ids=[2**40] with min_tokens", CMPL, cmpl(stop_token_ids=[2**40], min_tokens=1),
             param="stop_token_ids"),
        Case("stop_token_ids=[2**70]", CMPL, cmpl(stop_token_ids=[2**70]), param="stop_token_ids"),
        Case("stop_token_ids out of vocab", CMPL, cmpl(stop_token_ids=[100000], min_tokens=1), param="stop_token_ids"),
        Case("stop_token_ids=[-1]", CMPL, cmpl(stop_token_ids=[-1]), param="stop_token_ids"),
        Case("prompt ids [2**70]", CMPL, cmpl(prompt=[2**70]), param="prompt"),
        Case("prompt ids [2**40]", CMPL, cmpl(prompt=[2**40]), param="prompt"),
        Case("prompt ids out of vocab", CMPL, cmpl(prompt=[5, 100000]), param="prompt"),
        Case("prompt ids [-1]", CMPL, cmpl(prompt=[-1]), param="prompt"),
        Case("batch prompt ids [[1], [2**40]]", CMPL, cmpl(prompt=[[5], [2**40]]), param="prompt"),
        Case("detokenize [2**70]", "/detokenize", {"tokens": [2**70]}, param="tokens"),
        Case("detokenize [2**40]", "/detokenize", {"tokens": [2**40]}, param="tokens"),
        Case("detokenize [-1]", "/detokenize", {"tokens": [-1]}, param="tokens"),
        Case("schema maxLength 2**70", CMPL, cmpl(guided_json={"type": "string", "maxLength": 2**70}),
             param="guided_json"),
        Case("max_tokens 10**30 (chat)", CHAT, chat(max_tokens=10**30), param="max_tokens"),
    ]

    # ------------------------------------------------------------------ bounds
    many_messages = [{"role": "user", "content": "w5"}] * (MAX_MESSAGES + 1)
    c["bounds"] += [
        Case("n=0", CMPL, cmpl(n=0), param="n"),
        Case("n=-1", CHAT, chat(n=-1), param="n"),
        Case("n over max_num_seqs", CMPL, cmpl(n=TINY_ENGINE_ARGS["max_num_seqs"] + 1, temperature=1), param="n"),
        Case("chat n over max_num_seqs", CHAT, chat(n=TINY_ENGINE_ARGS["max_num_seqs"] + 1, temperature=1),
             param="n"),
        Case("n at max_num_seqs is served", CMPL, cmpl(n=TINY_ENGINE_ARGS["max_num_seqs"], temperature=1, max_tokens=1),
             status=200),
        Case("n=2 greedy", CMPL, cmpl(n=2, temperature=0), param="n"),
        Case("best_of != n", CMPL, cmpl(best_of=3), param="best_of"),
        Case("logprobs over max_logprobs", CMPL, cmpl(logprobs=21), param="logprobs"),
        Case("logprobs=-1 (whole vocab)", CMPL, cmpl(logprobs=-1), param="logprobs"),
        Case("prompt_logprobs over max", CMPL, cmpl(prompt_logprobs=21), param="prompt_logprobs"),
        Case("top_logprobs over max", CHAT, chat(logprobs=True, top_logprobs=21), param="top_logprobs"),
        Case("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), param="top_logprobs"),
        Case("top_logprobs=-1", CHAT, chat(logprobs=True, top_logprobs=-1), param=...),
        Case("too many stop strings", CMPL, cmpl(stop=["x"] * (MAX_STOP_STRINGS + 1)), param="stop"),
        Case("chat: too many stop strings", CHAT, chat(stop=["x"] * (MAX_STOP_STRINGS + 1)), param="stop"),
        Case("stop string too long", CMPL, cmpl(stop=["x" * (MAX_STOP_STRING_CHARS + 1)]), param="stop"),
        Case("single stop string too long", CHAT, chat(stop="x" * (MAX_STOP_STRING_CHARS + 1)), param="stop"),
        Case("empty stop string", CMPL, cmpl(stop=[""]), param="stop"),
        Case("max stop strings is served", CMPL, cmpl(stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS),
             status=200),
        Case("max_tokens over max_model_len", CMPL, cmpl(max_tokens=MAX_MODEL_LEN + 1), param="max_tokens"),
        Case("max_tokens=-1", CMPL, cmpl(max_tokens=-1), param="max_tokens"),
        Case("max_completion_tokens over", CHAT, chat(max_completion_tokens=10**6), param="max_completion_tokens"),
        Case("min_tokens over max_tokens", CMPL, cmpl(min_tokens=5), param="min_tokens"),
        Case("prompt too long", CMPL, cmpl(prompt=" ".join(["w5"] * MAX_MODEL_LEN)), param="prompt"),
        Case("prompt ids too long", CMPL, cmpl(prompt=[5] * (MAX_MODEL_LEN + 1)), param="prompt"),
        Case("chat prompt too long", CHAT, chat(messages=[{"role": "user", "content": "w5 " * MAX_MODEL_LEN}]),
             param="messages"),
        Case("too many prompts", CMPL, cmpl(prompt=["w5"] * (MAX_PROMPTS + 1)), param="prompt"),
        Case("too many prompt id lists", CMPL, cmpl(prompt=[[5]] * (MAX_PROMPTS + 1)), param="prompt"),
        Case("empty prompt", CMPL, cmpl(prompt=""), param="prompt"),
        Case("empty prompt list", CMPL, cmpl(prompt=[]), param="prompt"),
        Case("too many messages", CHAT, chat(messages=many_messages), param="messages"),
        Case("too many tools", CHAT, chat(tools=[TOOL] * (MAX_TOOLS + 1)), param="tools"),
        Case("logit_bias key not an id", CMPL, cmpl(logit_bias={"five": 1.0}), param="logit_bias"),
        Case("suffix unsupported", CMPL, cmpl(suffix="x"), param="suffix"),
        Case("temperature 3", CMPL, cmpl(temperature=3), param="temperature"),
        Case("top_p 0", CMPL, cmpl(top_p=0), param="top_p"),
        Case("top_k -2", CMPL, cmpl(top_k=-2), param="top_k"),
        Case("min_p 1.5", CMPL, cmpl(min_p=1.5), param="min_p"),
        Case("presence_penalty 5", CMPL, cmpl(presence_penalty=5), param="presence_penalty"),
        Case("frequency_penalty -5", CHAT, chat(frequency_penalty=-5), param="frequency_penalty"),
        Case("repetition_penalty 0", CMPL, cmpl(repetition_penalty=0), param="repetition_penalty"),
        Case("repetition_penalty 1e300 (inf in float32)", CMPL, cmpl(repetition_penalty=1e300),
             param="repetition_penalty"),
        Case("repetition_penalty 1e-300 (0 in float32)", CHAT, chat(repetition_penalty=1e-300),
             param="repetition_penalty"),
        Case("temperature 5e-324 is served (raised to 0.01)", CMPL, cmpl(temperature=5e-324), status=200),
        Case("seed -2**63 is served", CMPL, cmpl(seed=-(2**63)), status=200),
        # The word-level vocabulary cannot spell JSON: the grammar masks every token and the
        # engine stops the request; its logprob (NaN) must still be JSON (found by the fuzzer).
        Case("logprobs of a token no grammar allows", CMPL, cmpl(guided_json={}, logprobs=0), status=200),
        Case("chat logprobs of a token no grammar allows", CHAT, status=200,
             body=chat(response_format={"type": "json_object"}, logprobs=True, top_logprobs=2)),
        Case("streamed logprobs of a token no grammar allows", CMPL, status=200,
             body=cmpl(guided_json={}, logprobs=1, stream=True, echo=True, prompt_logprobs=1)),
        Case("seed 2**64", CMPL, cmpl(seed=2**64), param="seed"),
        Case("unknown model", CMPL, cmpl(model="gpt-4"), status=404, param="model"),
        Case("stream_options without stream", CMPL, cmpl(stream_options={"include_usage": True}),
             param="stream_options"),
        Case("request chat_template refused", CHAT,
             chat(chat_template="{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"),
             param="chat_template"),
        Case("tokenize: request chat_template refused", "/tokenize",
             {"messages": CHAT_BODY["messages"], "chat_template": "{{ 'x' * 10**9 }}"}, param="chat_template"),
        Case("chat_template_kwargs overriding an argument", CHAT, chat(chat_template_kwargs={"tokenize": True}),
             param="messages"),
    ]
    for depth_field, make in [
        ("messages", lambda v: chat(messages=[{"role": "user", "content": [{"type": "text", "text": "w5", "x": v}]}])),
        ("tools", lambda v: chat(tools=[{"type": "function", "function": {"name": "f", "parameters": v}}],
                                 tool_choice="required")),
        ("response_format", lambda v: chat(response_format={"type": "json_schema", "json_schema": {"schema": v}})),
        ("structured_outputs", lambda v: cmpl(structured_outputs={"json": v})),
        ("guided_json", lambda v: cmpl(guided_json=v)),
        ("chat_template_kwargs", lambda v: chat(chat_template_kwargs={"x": v})),
        ("tool_choice", lambda v: chat(tools=[TOOL], tool_choice={"type": "function", "function": v})),
    ]:
        path = CHAT if "messages" in make(1) else CMPL
        c["depth"].append(Case(f"{depth_field} nested {MAX_JSON_DEPTH + 1} deep", path, make(nested(MAX_JSON_DEPTH)),
                               param=depth_field))
        c["depth"].append(Case(f"{depth_field} nested 900 deep", path, make(nested(900)), param=depth_field))
    c["depth"] += [
        Case("deep schema of arrays (200 levels)", CMPL, param="response_format",
             body=cmpl(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": json.loads(
                 '{"type": "array", "items": ' * 200 + '{"type": "string"}' + "}" * 200)}})),
        Case("extra field nested 900 deep", CMPL, cmpl(my_extension=nested(900)), param=None),
        Case("tokenize messages nested", "/tokenize",
             {"messages": [{"role": "user", "content": [{"type": "text", "text": "w5", "x": nested(40)}]}]},
             param="messages"),
        Case("schema of 12 nested objects is served", CMPL, status=200,
             body=cmpl(max_tokens=1, guided_json=_nested_object_schema(12))),
    ]

    # ------------------------------------------------------------------ unicode
    for where, key, base, path in [("prompt", "prompt", COMPLETION, CMPL), ("model", "model", COMPLETION, CMPL),
                                   ("user", "user", COMPLETION, CMPL), ("stop", "stop", COMPLETION, CMPL),
                                   ("guided_regex", "guided_regex", COMPLETION, CMPL),
                                   ("cache_salt", "cache_salt", COMPLETION, CMPL),
                                   ("request_id", "request_id", COMPLETION, CMPL),
                                   ("chat stop", "stop", CHAT_BODY, CHAT)]:
        for lone in ("\\ud800", "\\udfff", "w5 \\udc00 w6"):
            c["unicode"].append(Case(f"{where} lone surrogate {lone}", path, raw=raw_with(base, key, f'"{lone}"'),
                                     param=key))
    c["unicode"] += [
        Case("prompt list lone surrogate", CMPL, raw=raw_with(COMPLETION, "prompt", '["w5", "\\ud800"]'),
             param="prompt"),
        Case("stop list lone surrogate", CMPL, raw=raw_with(COMPLETION, "stop", '["a", "\\udbff"]'), param="stop"),
        Case("echo lone surrogate", CMPL, raw=raw_with({**COMPLETION, "echo": True}, "prompt", '"\\ud800"'),
             param="prompt"),
        Case("chat content lone surrogate", CHAT, param="messages",
             raw=raw_with(CHAT_BODY, "messages", '[{"role": "user", "content": "\\ud800"}]')),
        Case("chat content part lone surrogate", CHAT, param="messages",
             raw=raw_with(CHAT_BODY, "messages", '[{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]')),
        Case("chat role lone surrogate", CHAT, param="messages",
             raw=raw_with(CHAT_BODY, "messages", '[{"role": "\\ud800", "content": "w5"}]')),
        Case("tool name lone surrogate", CHAT, param="tools",
             raw=raw_with(CHAT_BODY, "tools", '[{"type": "function", "function": {"name": "\\ud800"}}]')),
        Case("tool_choice lone surrogate", CHAT, param="tool_choice",
             raw=raw_with({**CHAT_BODY, "tools": [TOOL]}, "tool_choice", '"\\ud800"')),
        Case("chat_template_kwargs key lone surrogate", CHAT, param="chat_template_kwargs",
             raw=raw_with(CHAT_BODY, "chat_template_kwargs", '{"\\ud800": 1}')),
        Case("extra field lone surrogate", CMPL, raw=raw_with(COMPLETION, "\\ud800", "1"), param=None),
        Case("tokenize lone surrogate", "/tokenize", raw='{"prompt": "\\ud800"}', param="prompt"),
        Case("tokenize chat lone surrogate", "/tokenize", raw='{"messages": [{"role": "user", "content": "\\udfff"}]}',
             param="messages"),
        Case("X-Request-Id header non-ASCII", CMPL, COMPLETION, status=200, headers={"x-request-id": "r\u00e9q\u202e".encode()}),
    ]
    weird = ["w5 \u202e\u202b w6", "w5\u0000w6", "e\u0301\u0301\u0301", "\u200b\ufeff\u2028", "\U0001f600 \U00010000",
             "\ufffd", "\u0000"]
    for text in weird:
        label = text.encode("unicode_escape").decode()
        c["unicode"] += [
            Case(f"prompt {label}", CMPL, cmpl(prompt=text), status=200),
            Case(f"stop {label}", CMPL, cmpl(stop=[text]), status=200),
            Case(f"chat content {label}", CHAT, chat(messages=[{"role": "user", "content": text}]), status=200),
            Case(f"tokenize {label}", "/tokenize", {"prompt": text}, status=200),
            Case(f"named tool {label}", CHAT, status=200,
                 body=chat(max_tokens=1, tools=[{"type": "function", "function": {"name": text}}],
                           tool_choice={"type": "function", "function": {"name": text}})),
        ]
    return c


def _nested_object_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


CASES = _cases()


@pytest.fixture(scope="module")
def server(tiny_async_llm, request):
    app = build_app(tiny_async_llm, MODEL, max_model_len=MAX_MODEL_LEN,
                    limits=ServerLimits(max_request_body_bytes=BODY_LIMIT))
    srv = RunningServer(app)
    srv.async_llm = tiny_async_llm
    yield srv
    srv.stop()
    total = sum(TRIED.values())
    by_class = ", ".join(f"{k}: {v}" for k, v in sorted(TRIED.items()))
    line = f"hostile inputs: {total} tried ({by_class}), 5xx seen: {len(FIVE_XX)}"
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n{line}")


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def send(http, case: Case) -> httpx.Response:
    if case.raw is not None:
        raw = case.raw.encode() if isinstance(case.raw, str) else case.raw
        headers = {"content-type": "application/json", **case.headers}
        return http.post(case.path, content=raw, headers=headers)
    return http.post(case.path, json=case.body, headers=case.headers)


def check(resp: httpx.Response, case: Case, cls: str) -> str | None:
    """None when ``resp`` is what ``case`` expects, else why not."""
    TRIED[cls] += 1
    if resp.status_code >= 500:
        FIVE_XX.append(f"{cls}/{case.name}: {resp.status_code} {resp.text[:300]}")
    if resp.status_code != case.status:
        return f"{case.name}: status {resp.status_code}, expected {case.status}: {resp.text[:300]}"
    if case.status == 200:
        return None
    body = resp.json()
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
        return f"{case.name}: not the error envelope: {body}"
    want_type = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestEntityTooLargeError"}[case.status]
    if err["code"] != case.status or err["type"] != want_type or not err["message"]:
        return f"{case.name}: envelope {err}"
    if case.param is not ... and err["param"] != case.param:
        return f"{case.name}: param {err['param']!r}, expected {case.param!r} ({err['message'][:200]})"
    return None


@pytest.mark.parametrize("cls", sorted(CASES))
def test_hostile_input(server, http, cls):
    failures = []
    for case in CASES[cls]:
        try:
            resp = send(http, case)
        except httpx.HTTPError as e:  # the server closed on us (e.g. an unread body): say which case
            failures.append(f"{case.name}: {e!r}")
            continue
        problem = check(resp, case, cls)
        if problem:
            failures.append(problem)
    assert not server.async_llm.errored, "a hostile request killed the engine"
    assert not failures, "\n".join(failures)


def test_chunked_body_over_the_limit(server, http):
    """No Content-Length: the body is counted as it streams in."""
    def chunks():
        yield b'{"model": "tiny", "prompt": "w5", "padding": "'
        for _ in range(2 * BODY_LIMIT // 4096):
            yield b"x" * 4096
        yield b'"}'

    resp = http.post(CMPL, content=chunks(), headers={"content-type": "application/json"})
    TRIED["body_size"] += 1
    assert "content-length" not in resp.request.headers
    assert resp.status_code == 413, resp.text
    assert resp.json()["error"]["type"] == "RequestEntityTooLargeError"
    # A small chunked body is served.
    resp = http.post(CMPL, content=iter([json.dumps(COMPLETION).encode()]), headers={"content-type": "application/json"})
    TRIED["body_size"] += 1
    assert resp.status_code == 200, resp.text


def test_lying_content_length(server):
    """A Content-Length over the limit is refused before the body is read."""
    import socket

    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 999999999999\r\n\r\n{")
        s.settimeout(10)
        head = s.recv(4096).decode("latin-1")
    TRIED["body_size"] += 1
    assert head.startswith("HTTP/1.1 413"), head


def test_server_still_serves(server, http):
    """After everything above, an ordinary request still gets its tokens."""
    resp = http.post(CMPL, json=cmpl(max_tokens=3, ignore_eos=True))
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
    assert not FIVE_XX, "\n".join(FIVE_XX)


# ----------------------------------------------------------------------------- auth
@pytest.fixture(scope="module")
def keyed(tiny_async_llm):
    srv = RunningServer(build_app(tiny_async_llm, MODEL, api_key=KEY, max_model_len=MAX_MODEL_LEN,
                                  enable_tokenizer_info_endpoint=True))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed_all(tiny_async_llm):
    srv = RunningServer(build_app(tiny_async_llm, MODEL, api_key=KEY, max_model_len=MAX_MODEL_LEN,
                                  limits=ServerLimits(protect_all_routes=True)))
    yield srv
    srv.stop()


def _unauthorized(resp: httpx.Response, what: str) -> None:
    TRIED["auth"] += 1
    assert resp.status_code == 401, (what, resp.status_code, resp.text)
    if resp.request.method != "HEAD":
        err = resp.json()["error"]
        assert err["type"] == "AuthenticationError" and err["code"] == 401, what
    assert resp.headers.get("www-authenticate") == "Bearer", what


def test_api_key_guards_v1_and_tokenizer_routes(keyed):
    good = {"Authorization": f"Bearer {KEY}"}
    bad_headers = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                   {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Bearer {KEY[:-1]}"},
                   {"Authorization": "Bearer"}, {"Authorization": f"Token {KEY}"}]
    routes = [("GET", "/v1/models", None), ("HEAD", "/v1/models", None), ("POST", CMPL, COMPLETION),
              ("POST", CHAT, CHAT_BODY), ("GET", "/v1/no-such-route", None), ("POST", CMPL, {"broken": True}),
              ("POST", "/tokenize", {"prompt": "w5"}), ("POST", "/detokenize", {"tokens": [5]}),
              ("GET", "/tokenizer_info", None), ("GET", "/tokenize/", None)]
    with httpx.Client(base_url=keyed.url, timeout=60) as c:
        for method, path, body in routes:
            for headers in bad_headers:
                _unauthorized(c.request(method, path, json=body, headers=headers), f"{method} {path} {headers}")
        # A body over the limit from a client without the key: 401 (the body is never read).
        _unauthorized(c.post(CMPL, content=b"x" * 1000, headers={"content-type": "text/plain"}), "unauthenticated body")
        # The key opens them; the scheme is case-insensitive.
        for headers in (good, {"Authorization": f"bearer {KEY}"}):
            assert c.get("/v1/models", headers=headers).status_code == 200
            assert c.head("/v1/models", headers=headers).status_code == 200
            assert c.post(CMPL, json=COMPLETION, headers=headers).status_code == 200
            assert c.post("/tokenize", json={"prompt": "w5"}, headers=headers).status_code == 200
            assert c.post("/detokenize", json={"tokens": [5]}, headers=headers).status_code == 200
            assert c.get("/tokenizer_info", headers=headers).status_code == 200
        assert c.get("/v1/no-such-route", headers=good).status_code == 404
        # CORS preflight is never checked; health, metrics and version stay open (as in vLLM).
        assert c.options("/v1/models").status_code != 401
        for path in ("/health", "/metrics", "/version"):
            assert c.get(path).status_code == 200, path
            assert c.head(path).status_code == 200, path


def test_protect_all_routes(keyed_all):
    good = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=keyed_all.url, timeout=60) as c:
        for path in ("/health", "/metrics", "/version", "/v1/models", "/openapi.json", "/docs"):
            _unauthorized(c.get(path), path)
            _unauthorized(c.head(path), f"HEAD {path}")
            assert c.get(path, headers=good).status_code == 200, path


def test_protect_all_routes_needs_a_key(tiny_async_llm):
    with pytest.raises(ValueError, match="requires --api-key"):
        build_app(tiny_async_llm, MODEL, max_model_len=MAX_MODEL_LEN, limits=ServerLimits(protect_all_routes=True))


def test_limits_flags():
    import argparse

    from server.limits import (
        DEFAULT_MAX_REQUEST_BODY_BYTES,
        add_limits_args,
        limits_from_args,
    )

    parser = argparse.ArgumentParser()
    add_limits_args(parser.add_argument_group("limits"))
    assert limits_from_args(parser.parse_args([])) == ServerLimits()
    assert ServerLimits().max_request_body_bytes == DEFAULT_MAX_REQUEST_BODY_BYTES == 32 << 20
    args = parser.parse_args(["--max-request-body-bytes", "1000", "--protect-all-routes",
                              "--trust-request-chat-template"])
    with pytest.raises(ValueError, match="requires --api-key"):
        limits_from_args(args)
    args.api_key = "k"
    assert limits_from_args(args) == ServerLimits(max_request_body_bytes=1000, protect_all_routes=True,
                                                  trust_request_chat_template=True)
    with pytest.raises(ValueError):
        ServerLimits(max_request_body_bytes=-1)


def test_openapi_documents_the_error_envelope(http):
    """The schema clients (and the fuzzer) read says 400 with the envelope, not FastAPI's 422."""
    schema = http.get("/openapi.json").json()
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    for path in (CMPL, CHAT, "/tokenize", "/detokenize"):
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses and {"400", "413"} <= set(responses), path
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
