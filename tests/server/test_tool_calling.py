"""Structured outputs, tool calling and reasoning through the server code, over a fake
engine whose "model" writes scripted text (tests/server/fake_engine.py): what the
request maps to (StructuredOutputsParams), the 400s and their ``param``, and the
messages / stream deltas made of the model's output. Milliseconds each."""
from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from jaxserve.sampling_params import StructuredOutputsParams
from server.app import build_app
from server.errors import APIError
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.structured import (
    resolve_tool_choice,
    structured_outputs_from_request,
    tool_call_array_schema,
    tool_constraint,
)
from tests.server.fake_engine import FakeEngine

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                                 "parameters": SCHEMA}}
PING_TOOL = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER_TOOL, PING_TOOL]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat_req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MESSAGES, **kw)


def comp_req(**kw) -> CompletionRequest:
    return CompletionRequest(prompt="hi", **kw)


def api_error(fn, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as ei:
        fn(*args, **kwargs)
    assert ei.value.status == 400
    return ei.value


# ----------------------------------------------------------------------------- request -> StructuredOutputsParams
@pytest.mark.parametrize("make", [chat_req, comp_req])
def test_response_format_mapping(make):
    c = structured_outputs_from_request(make(response_format={"type": "json_object"}))
    assert c.params == StructuredOutputsParams(json_object=True) and c.param == "response_format"
    c = structured_outputs_from_request(make(response_format={
        "type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}))
    assert c.params == StructuredOutputsParams(json=SCHEMA) and c.param == "response_format"
    assert structured_outputs_from_request(make(response_format={"type": "text"})) is None
    assert structured_outputs_from_request(make()) is None
    # structured_outputs may add options to a response_format constraint
    c = structured_outputs_from_request(make(response_format={"type": "json_object"},
                                             structured_outputs={"disable_any_whitespace": True}))
    assert c.params == StructuredOutputsParams(json_object=True, disable_any_whitespace=True)


@pytest.mark.parametrize("body, contains", [
    ({"response_format": {"type": "json_schema"}}, "'json_schema' field must be provided"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    ({"response_format": {"type": "xml"}}, "xml"),
    ({"response_format": {"type": "structural_tag", "format": {}}}, "not supported"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}}, "only one"),
])
def test_response_format_errors(body, contains):
    err = api_error(structured_outputs_from_request, chat_req(**body))
    assert err.param == "response_format" and contains in err.message


def test_structured_outputs_and_guided_fields():
    c = structured_outputs_from_request(comp_req(structured_outputs={"regex": "[a-z]+", "unknown_option": 1}))
    assert c.params == StructuredOutputsParams(regex="[a-z]+") and c.param == "structured_outputs"
    c = structured_outputs_from_request(chat_req(structured_outputs={"choice": ["a", "b"],
                                                                     "disable_any_whitespace": True}))
    assert c.params == StructuredOutputsParams(choice=["a", "b"], disable_any_whitespace=True)
    for field, key, value in [("guided_json", "json", SCHEMA), ("guided_regex", "regex", "a|b"),
                              ("guided_choice", "choice", ["x"]), ("guided_grammar", "grammar", 'root ::= "a"')]:
        c = structured_outputs_from_request(comp_req(**{field: value, "guided_decoding_backend": "xgrammar"}))
        assert c.params == StructuredOutputsParams(**{key: value}) and c.param == field
    # structured_outputs wins over the older guided_* fields (vLLM)
    c = structured_outputs_from_request(chat_req(structured_outputs={"regex": "a"}, guided_json=SCHEMA))
    assert c.params.regex == "a"
    assert structured_outputs_from_request(chat_req(structured_outputs={})) is None


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"structured_outputs": {"json": 5}}, "structured_outputs"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
])
def test_structured_outputs_errors(body, param):
    assert api_error(structured_outputs_from_request, comp_req(**body)).param == param


# ----------------------------------------------------------------------------- tool_choice
def test_resolve_tool_choice():
    assert resolve_tool_choice(chat_req(), auto_enabled=False) == ("none", None)
    assert resolve_tool_choice(chat_req(tools=TOOLS, tool_choice="none"), auto_enabled=False) == ("none", None)
    assert resolve_tool_choice(chat_req(tools=TOOLS), auto_enabled=True) == ("auto", None)  # default with tools
    assert resolve_tool_choice(chat_req(tools=TOOLS, tool_choice="required"), auto_enabled=False) == \
        ("required", None)
    named = {"type": "function", "function": {"name": "ping"}}
    assert resolve_tool_choice(chat_req(tools=TOOLS, tool_choice=named), auto_enabled=False) == ("named", "ping")


@pytest.mark.parametrize("body, param, contains", [
    ({"tools": TOOLS}, "tool_choice", ('"auto" tool choice requires --enable-auto-tool-choice and '
                                       "--tool-call-parser to be set")),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "Invalid value for `tool_choice`"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "does not match any of the specified `tools`"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "Correct usage"),
    ({"tools": [], "tool_choice": "none"}, "tools", "must not be an empty array"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}], "tool_choice": "none"}, "tools", "name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}], "tool_choice": "none"},
     "tools", "parameters"),
])
def test_tool_choice_errors(body, param, contains):
    err = api_error(resolve_tool_choice, chat_req(**body), auto_enabled=False)
    assert err.param == param and contains in err.message


def test_required_and_named_schemas():
    defs_tool = {"type": "function", "function": {"name": "put", "parameters": {
        "type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}},
        "$defs": {"Item": {"type": "object", "properties": {"id": {"type": "integer"}}}}}}}
    schema = tool_call_array_schema(TOOLS + [defs_tool])
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["items"]["type"] == "object"
    variants = schema["items"]["anyOf"]
    assert [v["properties"]["name"] for v in variants] == [
        {"type": "string", "enum": ["get_weather"]}, {"type": "string", "enum": ["ping"]},
        {"type": "string", "enum": ["put"]}]
    assert variants[0]["properties"]["parameters"] == SCHEMA and variants[0]["required"] == ["name", "parameters"]
    assert variants[1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert "$defs" not in variants[2]["properties"]["parameters"]
    assert schema["$defs"] == {"Item": {"type": "object", "properties": {"id": {"type": "integer"}}}}
    assert "$defs" in defs_tool["function"]["parameters"]  # the request's tools are left as they were
    c = tool_constraint(TOOLS, "required", None)
    assert c.params.json == tool_call_array_schema(TOOLS) and c.param == "tools"
    c = tool_constraint(TOOLS, "named", "get_weather")
    assert c.params.json == SCHEMA
    assert "maxItems" not in schema and tool_call_array_schema(TOOLS, parallel=False)["maxItems"] == 1


# ----------------------------------------------------------------------------- through the app (fake engine)
def make_client(engine: FakeEngine, **kwargs) -> TestClient:
    return TestClient(build_app(engine, "m", **kwargs))


def sse_events(r) -> list[dict]:
    assert r.status_code == 200, r.text
    lines = [ln[len("data: "):] for ln in r.text.split("\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def joined_stream(events: list[dict]) -> dict:
    """Accumulate chat deltas like a client: content, reasoning and tool calls by index."""
    out = {"content": "", "reasoning_content": "", "reasoning": "", "tool_calls": {}, "finish_reason": None}
    for e in events:
        for ch in e["choices"]:
            d = ch["delta"]
            for key in ("content", "reasoning_content", "reasoning"):
                out[key] += d.get(key) or ""
            for tc in d.get("tool_calls") or []:
                call = out["tool_calls"].setdefault(tc["index"], {"name": None, "id": None, "arguments": ""})
                if "id" in tc:
                    assert call["id"] is None and tc["type"] == "function"
                    call["id"], call["name"] = tc["id"], tc["function"]["name"]
                call["arguments"] += tc["function"].get("arguments") or ""
            if ch["finish_reason"] is not None:
                out["finish_reason"] = ch["finish_reason"]
    out["tool_calls"] = [out["tool_calls"][i] for i in sorted(out["tool_calls"])]
    return out


def post_chat(client, **body):
    return client.post("/v1/chat/completions", json={"messages": MESSAGES, **body})


def test_constraints_reach_the_engine():
    engine = FakeEngine(['{"city": "Paris"}'])
    client = make_client(engine)
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    assert post_chat(client, response_format=rf).status_code == 200
    assert engine.seen_params[-1].structured_outputs == StructuredOutputsParams(json=SCHEMA)
    r = client.post("/v1/completions", json={"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}})
    assert r.status_code == 200 and engine.seen_params[-1].structured_outputs.choice == ["a", "b"]
    r = client.post("/v1/completions", json={"prompt": "x", "guided_regex": "a+", "guided_decoding_backend": "x"})
    assert r.status_code == 200 and engine.seen_params[-1].structured_outputs.regex == "a+"
    assert post_chat(client, response_format={"type": "text"}).status_code == 200
    assert engine.seen_params[-1].structured_outputs is None


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ({"guided_json": {"type": "nope"}}, "guided_json"),
    ({"tools": TOOLS, "tool_choice": "required"}, "tools"),
])
def test_engine_grammar_errors_name_the_field(body, param):
    """The engine rejects the grammar (InputProcessor.validate): a 400 naming the field the client used."""
    engine = FakeEngine()
    engine.validate_error = "structured_outputs.json: the parser says no"
    r = post_chat(make_client(engine), **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "the parser says no" in r.json()["error"]["message"]


def test_tool_choice_400s_through_the_app():
    client = make_client(FakeEngine())
    r = post_chat(client, tools=TOOLS)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert r.json()["error"]["message"] == \
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = post_chat(client, tools=TOOLS, tool_choice=named, response_format={"type": "json_object"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = post_chat(client, response_format={"type": "json_schema"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


HERMES_OUT = ['Checking.\n<tool_call>\n{"name": "get_weather", ', '"arguments": {"city": ',
              '"Paris"}}\n</tool_call>\n<tool_call>{"name": "ping", "arguments": {}}</tool_call>']


def test_auto_tool_choice_hermes():
    engine = FakeEngine(HERMES_OUT)
    client = make_client(engine, enable_auto_tool_choice=True, tool_call_parser="hermes")
    body = {"tools": TOOLS, "tool_choice": "auto"}
    r = post_chat(client, **body)
    assert r.status_code == 200, r.text
    params = engine.seen_params[-1]
    assert params.structured_outputs is None and params.skip_special_tokens is False
    choice = r.json()["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and msg["content"] == "Checking."
    assert [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        ("function", "get_weather", '{"city": "Paris"}'), ("function", "ping", "{}")]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in msg["tool_calls"])
    # tools without tool_choice mean "auto"
    assert post_chat(client, tools=TOOLS).json()["choices"][0]["finish_reason"] == "tool_calls"
    # streamed: the deltas add up to the same message
    got = joined_stream(sse_events(post_chat(client, stream=True, **body)))
    assert got["content"] == "Checking." and got["finish_reason"] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in got["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}'), ("ping", "{}")]
    # parallel_tool_calls=false keeps the first call
    msg = post_chat(client, parallel_tool_calls=False, **body).json()["choices"][0]["message"]
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    got = joined_stream(sse_events(post_chat(client, stream=True, parallel_tool_calls=False, **body)))
    assert [c["name"] for c in got["tool_calls"]] == ["get_weather"]
    # tool_choice="none" leaves the text alone
    msg = post_chat(client, tools=TOOLS, tool_choice="none").json()["choices"][0]["message"]
    assert msg["content"] == "".join(HERMES_OUT) and msg["tool_calls"] == []


def test_cut_off_output_keeps_length():
    """Calls made, but the output was cut off: finish_reason stays "length" (streamed or not)."""
    client = make_client(FakeEngine(HERMES_OUT, finish_reason="length"), enable_auto_tool_choice=True,
                         tool_call_parser="hermes")
    choice = post_chat(client, tools=TOOLS).json()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["message"]["tool_calls"]) == 2
    assert joined_stream(sse_events(post_chat(client, tools=TOOLS, stream=True)))["finish_reason"] == "length"


def test_auto_tool_choice_plain_answer():
    engine = FakeEngine(["The weather ", "is fine. "])
    client = make_client(engine, enable_auto_tool_choice=True, tool_call_parser="llama3_json")
    r = post_chat(client, tools=TOOLS)
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "The weather is fine. " and choice["message"]["tool_calls"] == []
    assert choice["finish_reason"] == "stop"
    got = joined_stream(sse_events(post_chat(client, tools=TOOLS, stream=True)))
    assert got["content"] == "The weather is fine. " and got["tool_calls"] == [] and got["finish_reason"] == "stop"


def test_required_tool_choice():
    out = ['[{"name": "get_weather", "parameters": {"city": "Paris"}}', ', {"name": "ping", "parameters": {}}]']
    engine = FakeEngine(out)
    client = make_client(engine)  # "required" needs no --enable-auto-tool-choice (vLLM)
    r = post_chat(client, tools=TOOLS, tool_choice="required")
    assert r.status_code == 200, r.text
    assert engine.seen_params[-1].structured_outputs.json == tool_call_array_schema(TOOLS)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}'), ("ping", "{}")]
    got = joined_stream(sse_events(post_chat(client, tools=TOOLS, tool_choice="required", stream=True)))
    assert [(c["name"], c["arguments"]) for c in got["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}'), ("ping", "{}")]
    assert got["finish_reason"] == "tool_calls" and got["content"] == ""
    post_chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert engine.seen_params[-1].structured_outputs.json["maxItems"] == 1


def test_named_tool_choice():
    engine = FakeEngine(['{"city": ', '"Paris"}'])
    client = make_client(engine)
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = post_chat(client, tools=TOOLS, tool_choice=named)
    assert engine.seen_params[-1].structured_outputs.json == SCHEMA
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"  # OpenAI's (and vLLM's) for a named function
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}')]
    got = joined_stream(sse_events(post_chat(client, tools=TOOLS, tool_choice=named, stream=True)))
    assert [(c["name"], c["arguments"]) for c in got["tool_calls"]] == [("get_weather", '{"city": "Paris"}')]


def test_tool_history_reaches_the_template():
    engine = FakeEngine()
    client = make_client(engine)
    seen = {}
    template = engine.tokenizer.apply_chat_template

    def spy(messages, **kw):
        seen["messages"], seen["tools"] = messages, kw.get("tools")
        return template(messages, **kw)

    engine.tokenizer.apply_chat_template = spy
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.post("/v1/chat/completions", json={"messages": history, "tools": TOOLS, "tool_choice": "none"})
    assert r.status_code == 200, r.text
    assistant, tool = seen["messages"][1:]
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # a dict for the template
    assert tool == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    assert seen["tools"] == TOOLS
    bad = [history[0], {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]
    r = client.post("/v1/chat/completions", json={"messages": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


# ----------------------------------------------------------------------------- reasoning
THINKING = ["<thi", "nk>\nLet me", " think.</th", "ink>\n\nIt is ", "sunny."]


def test_reasoning_split():
    client = make_client(FakeEngine(THINKING, reasoning_parser="qwen3"))
    msg = post_chat(client).json()["choices"][0]["message"]
    assert msg["reasoning_content"] == msg["reasoning"] == "Let me think."
    assert msg["content"] == "It is sunny."
    got = joined_stream(sse_events(post_chat(client, stream=True)))
    assert got["reasoning_content"] == got["reasoning"] == "Let me think."
    assert got["content"] == "It is sunny." and got["finish_reason"] == "stop"
    msg = post_chat(client, include_reasoning=False).json()["choices"][0]["message"]
    assert msg["reasoning_content"] is None and msg["content"] == "It is sunny."
    got = joined_stream(sse_events(post_chat(client, include_reasoning=False, stream=True)))
    assert got["reasoning_content"] == "" and got["content"] == "It is sunny."


def test_reasoning_then_tool_call():
    """Tool calls are parsed from the content only; a call inside the thinking is not one."""
    out = ['<think>maybe <tool_call>{"name": "ping", "arguments": {}}</tool_call>?', "</think>",
           '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>']
    client = make_client(FakeEngine(out, reasoning_parser="qwen3"), enable_auto_tool_choice=True,
                         tool_call_parser="hermes")
    msg = post_chat(client, tools=TOOLS).json()["choices"][0]["message"]
    assert msg["reasoning_content"].startswith("maybe <tool_call>") and msg["content"] is None
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    got = joined_stream(sse_events(post_chat(client, tools=TOOLS, stream=True)))
    assert got["reasoning_content"] == msg["reasoning_content"] and got["content"] == ""
    assert [(c["name"], c["arguments"]) for c in got["tool_calls"]] == [("get_weather", '{"city": "Paris"}')]


HARMONY = ["<|channel|>analysis<|mess", "age|>The user wants", " the weather.<|end|><|start|>assistant",
           "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
           '{"city":', ' "Paris"}']  # the output stops before <|call|> (a stop token)


def test_gpt_oss_reasoning_and_tool_calls():
    """--reasoning-parser openai_gptoss --tool-call-parser openai: the analysis channel is the
    reasoning, the function message a tool call; the special tokens are kept in the text."""
    engine = FakeEngine(HARMONY, reasoning_parser="openai_gptoss")
    client = make_client(engine, enable_auto_tool_choice=True, tool_call_parser="openai")
    choice = post_chat(client, tools=TOOLS).json()["choices"][0]
    assert engine.seen_params[-1].skip_special_tokens is False
    msg = choice["message"]
    assert msg["reasoning_content"] == "The user wants the weather." and msg["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}')]
    assert choice["finish_reason"] == "tool_calls"
    got = joined_stream(sse_events(post_chat(client, tools=TOOLS, stream=True)))
    assert got["reasoning_content"] == "The user wants the weather." and got["content"] == ""
    assert [(c["name"], c["arguments"]) for c in got["tool_calls"]] == [("get_weather", '{"city": "Paris"}')]
    # a final answer, without tools: the final channel is the content
    engine.script = HARMONY[:3] + ["<|channel|>final<|message|>It is ", "sunny."]
    msg = post_chat(client).json()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("The user wants the weather.", "It is sunny.")
    got = joined_stream(sse_events(post_chat(client, stream=True)))
    assert (got["reasoning_content"], got["content"]) == ("The user wants the weather.", "It is sunny.")


# ----------------------------------------------------------------------------- small endpoints
def test_request_id_head_and_tokenizer_info():
    engine = FakeEngine(["ok"])
    client = make_client(engine, chat_template="{{ 'custom' }}")
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES}, headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123" and r.json()["id"] == "chatcmpl-abc-123"
    r = client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123" and r.json()["id"] == "cmpl-abc-123"
    assert len(set(engine.seen_request_ids)) == 2  # the engine's ids stay unique
    r = client.post("/v1/completions", json={"prompt": "x", "request_id": "mine"})
    assert r.json()["id"] == "cmpl-mine" and "x-request-id" not in r.headers
    assert client.get("/nope", headers={"X-Request-Id": "e"}).headers["x-request-id"] == "e"
    for path in ("/health", "/version", "/v1/models"):
        r = client.head(path)
        assert r.status_code == 200 and r.content == b"", path
    assert client.head("/v1/models", headers={"X-Request-Id": "h"}).headers["x-request-id"] == "h"
    assert client.get("/tokenizer_info").status_code == 404
    client = make_client(engine, chat_template="{{ 'custom' }}", enable_tokenizer_info_endpoint=True)
    info = client.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == "FakeTokenizer" and info["model_max_length"] == 512
    assert info["chat_template"] == "{{ 'custom' }}" and "tokenizer_object" not in info
    assert client.head("/tokenizer_info").status_code == 200


def test_build_app_flag_checks(tmp_path):
    with pytest.raises(ValueError, match="--tool-call-parser"):
        build_app(FakeEngine(), "m", enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser"):
        build_app(FakeEngine(), "m", tool_call_parser="nope")
    with pytest.raises(ValueError, match="chat-template"):
        build_app(FakeEngine(), "m", chat_template="/no/such/template.jinja")
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    engine = FakeEngine()
    seen = {}
    engine.tokenizer.apply_chat_template = lambda messages, **kw: seen.setdefault("t", kw["chat_template"]) or "x"
    make_client(engine, chat_template=str(path)).post("/v1/chat/completions", json={"messages": MESSAGES})
    assert seen["t"] == path.read_text()


@pytest.mark.parametrize("parser, script", [
    ("mistral", ['[TOOL_CALLS]get_weather', '{"city": ', '"Paris"}']),
    ("pythonic", ['[get_weather(ci', 'ty="Paris")]']),
    ("qwen3_coder", ['<tool_call>\n<function=get_we', 'ather>\n<parameter=city>\nPar', 'is\n</parameter>\n',
                     '</function>\n</tool_call>']),
    ("deepseek_v3", ['<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n',
                     '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>']),
    ("deepseek_v31", ['<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": ',
                      '"Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>']),
])
def test_more_parsers_through_chat(parser, script):
    """--tool-call-parser mistral / pythonic / qwen3_coder / deepseek: the model's calls as
    tool_calls, whole and streamed."""
    client = make_client(FakeEngine(script), enable_auto_tool_choice=True, tool_call_parser=parser)
    body = {"model": "m", "messages": MESSAGES, "tools": TOOLS}
    msg = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert msg["finish_reason"] == "tool_calls"
    want = [("get_weather", {"city": "Paris"})]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in msg["message"]["tool_calls"]] == want
    joined = joined_stream(sse_events(client.post("/v1/chat/completions", json=body | {"stream": True})))
    assert [(c["name"], json.loads(c["arguments"])) for c in joined["tool_calls"]] == want


def test_qwen3_coder_types_arguments_by_the_request_schema():
    """The request's tool schema reaches the parser: an integer parameter is a JSON number."""
    tool = {"type": "function", "function": {"name": "forecast", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
    script = ['<tool_call>\n<function=forecast>\n<parameter=city>\n42\n</parameter>\n',
              '<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>']
    client = make_client(FakeEngine(script), enable_auto_tool_choice=True, tool_call_parser="qwen3_coder")
    body = {"model": "m", "messages": MESSAGES, "tools": [tool]}
    msg = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "42", "days": 3}
    joined = joined_stream(sse_events(client.post("/v1/chat/completions", json=body | {"stream": True})))
    assert json.loads(joined["tool_calls"][0]["arguments"]) == {"city": "42", "days": 3}
