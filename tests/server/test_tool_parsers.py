"""Tool-call parsers (server/tool_parsers): whole outputs, and the same outputs streamed
in deltas of 1, 3 and 7 characters, whose deltas must add up to the whole result."""
from __future__ import annotations

import json

import pytest

from server.tool_parsers import (
    TOOL_PARSERS,
    JsonArrayToolStreamer,
    NamedToolStreamer,
    get_tool_parser,
)
from server.tool_parsers.json_stream import CallScanner, JsonError

WEATHER = {"city": "Paris", "unit": "celsius"}
NESTED = {"q": "a \"quoted\" \\ back\nslash \u00e9\u4e2d \U0001F600", "n": [1, -2.5, 1e3, True, None, {}],
          "deep": {"x": [], "y": {"z": "é"}}}


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


def stream(streamer, text: str, size: int):
    """Feed ``text`` in deltas of ``size`` characters; join what comes out."""
    content, calls = "", {}
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    outs = [streamer.feed(p, final=False) for p in pieces] + [streamer.feed("", final=True)]
    for out in outs:
        content += out.content
        for d in out.tool_calls:
            i = d["index"]
            if i not in calls:
                assert set(d) == {"index", "id", "type", "function"}, d  # the first delta names the call
                assert d["type"] == "function" and d["id"].startswith("chatcmpl-tool-")
                calls[i] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}, d
            calls[i]["arguments"] += d["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content or None, [calls[i] for i in sorted(calls)]


def check_streaming(make_streamer, text: str, extracted) -> None:
    """Streamed in deltas of 1, 3, 7 characters (and whole), the same calls and content."""
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in extracted.tool_calls]
    for size in (1, 2, 3, 7, max(len(text), 1)):
        content, calls = stream(make_streamer(), text, size)
        assert [(c["name"], c["arguments"]) for c in calls] == want, size
        assert len({c["id"] for c in calls}) == len(calls)
        assert content == (extracted.content or None), (size, content, extracted.content)


def check_parser(name: str, text: str, calls, content, tools=None) -> None:
    """``name``'s parser finds ``calls`` ([(name, arguments dict)]) and ``content`` in
    ``text``, with canonical JSON arguments, whole and streamed (``tools``: the request's)."""
    parser = get_tool_parser(name)()
    got = parser.extract_tool_calls(text, tools)
    assert got.tools_called
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got.tool_calls] == calls
    # arguments are canonical JSON, as vLLM's json.dumps(..., ensure_ascii=False)
    assert [c["function"]["arguments"] for c in got.tool_calls] == [dumps(a) for _, a in calls]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in got.tool_calls)
    assert got.content == content
    check_streaming(lambda: parser.streamer(tools), text, got)


def check_no_calls(name: str, text: str, *, stream: bool = True, tools=None) -> None:
    """No call in ``text``: all of it is content, whole and (unless a header went out
    before the call broke) streamed."""
    parser = get_tool_parser(name)()
    got = parser.extract_tool_calls(text, tools)
    assert not got.tools_called and got.tool_calls == [] and got.content == text
    if stream:
        check_streaming(parser.streamer, text, got)


# ----------------------------------------------------------------------------- hermes
def hermes_call(name, args, pretty=False) -> str:
    body = json.dumps({"name": name, "arguments": args}, indent=2 if pretty else None)
    return f"<tool_call>\n{body}\n</tool_call>"


HERMES_CASES = [
    # (output, [(name, arguments dict)], content)
    (hermes_call("get_weather", WEATHER), [("get_weather", WEATHER)], None),
    (hermes_call("get_weather", WEATHER) + "\n" + hermes_call("search", NESTED, pretty=True),
     [("get_weather", WEATHER), ("search", NESTED)], None),
    ("Let me check the weather.\n\n" + hermes_call("get_weather", WEATHER),
     [("get_weather", WEATHER)], "Let me check the weather."),
    ("Sure.\n" + hermes_call("f", {}) + "\nDone, now the second:\n" + hermes_call("g", {"a": [1, 2]}) + "\n",
     [("f", {}), ("g", {"a": [1, 2]})], "Sure.\n\nDone, now the second:"),
    # keys in another order, extra keys, a missing closing tag
    ('<tool_call>{"arguments": {"x": 1}, "id": 7, "name": "f"}', [("f", {"x": 1})], None),
    # no arguments at all: {}
    ('<tool_call>{"name": "ping"}</tool_call>', [("ping", {})], None),
]


@pytest.mark.parametrize("text, calls, content", HERMES_CASES)
def test_hermes_extract_and_stream(text, calls, content):
    check_parser("hermes", text, calls, content)


@pytest.mark.parametrize("text", [
    "Just an answer, no tools.",
    "A tag-like < thing and <tool but not a call.  \n",
    "",
    '<tool_call>{"name": get_weather}</tool_call>',  # malformed JSON: returned as content
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    "<tool_call>not json at all</tool_call> trailing",
    '<tool_call>{"name": "f", "arguments": {"a": 1}',  # cut off mid-call
])
def test_hermes_no_calls_is_content(text):
    # A cut-off call has streamed its name already: checked whole only.
    check_no_calls("hermes", text, stream="<tool_call>{\"name\": \"f\"" not in text)


def test_hermes_valid_call_then_malformed_one():
    """A malformed call ends the parsing: it and what follows are content."""
    text = hermes_call("f", {"a": 1}) + "\n<tool_call>{\"name\": oops}</tool_call>"
    got = get_tool_parser("hermes")().extract_tool_calls(text)
    assert [c["function"]["name"] for c in got.tool_calls] == ["f"]
    assert got.content == '<tool_call>{"name": oops}</tool_call>'


def test_hermes_streams_argument_fragments():
    """Long string arguments arrive while they are written, not only at the end."""
    parser = get_tool_parser("hermes")()
    s = parser.streamer()
    text = hermes_call("write", {"code": "x" * 40})
    fragments = [d["function"]["arguments"] for i in range(len(text))
                 for d in s.feed(text[i], final=False).tool_calls if d["function"]["arguments"]]
    assert len(fragments) > 30 and "".join(fragments) == dumps({"code": "x" * 40})


def test_hermes_keeps_special_tokens():
    parser = get_tool_parser("hermes")()
    assert parser.skip_special_tokens(True) is False


# ----------------------------------------------------------------------------- llama3_json
LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', [("get_weather", WEATHER)], None),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     [("get_weather", WEATHER)], None),
    ('<|python_tag|>{"name": "a", "parameters": {"q": 1}}; {"name": "b", "arguments": {"r": [true]}}',
     [("a", {"q": 1}), ("b", {"r": [True]})], None),
    ('  {"name": "a", "parameters": ' + json.dumps(NESTED) + '};<|python_tag|>{"name": "b", "parameters": {}}\n',
     [("a", NESTED), ("b", {})], None),
    ('{"name": "a", "parameters": {}}\nThat is all.', [("a", {})], "That is all."),
]


@pytest.mark.parametrize("text, calls, content", LLAMA_CASES)
def test_llama3_json_extract_and_stream(text, calls, content):
    check_parser("llama3_json", text, calls, content)


@pytest.mark.parametrize("text", [
    "The weather in Paris is sunny.",
    "Call {\"name\": \"a\", \"parameters\": {}} later",  # text before the JSON: not a call
    '{"parameters": {"q": }, "name": "a"}',  # malformed (before the name is known)
    '{"parameters": {}}',  # no name
    "<|python_tag|>print('hi')",  # code, not JSON
    "   ",
])
def test_llama3_json_no_calls_is_content(text):
    check_no_calls("llama3_json", text)


# ----------------------------------------------------------------------------- tool_choice required / named
def test_required_array():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}},\n {"name": "ping", ' \
           '"parameters": {}}]'
    got = JsonArrayToolStreamer().extract(text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got.tool_calls] == [
        ("get_weather", dumps(WEATHER)), ("ping", "{}")]
    assert got.content is None
    check_streaming(JsonArrayToolStreamer, text, got)
    for bad in ("not json", "[", '[{"name": 1}]', "{}"):
        got = JsonArrayToolStreamer().extract(bad)
        assert not got.tools_called and got.content == bad


def test_named_function():
    text = '{"city": "Paris"}'
    got = NamedToolStreamer("get_weather").extract(text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got.tool_calls] == [("get_weather", text)]
    check_streaming(lambda: NamedToolStreamer("get_weather"), text, got)


# ----------------------------------------------------------------------------- registry, scanner
def test_registry():
    assert set(TOOL_PARSERS) >= {"hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder",
                                 "deepseek_v3", "deepseek_v31"}
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


@pytest.mark.parametrize("bad", ['[1]', '{"name": "f",}', '{"name": "f" "x": 1}', '{"name": "f", "a": tru}',
                                 '{"name": "f", "a": 01}', '{"name": "f", "a": "\\x"}', '{"name": "f"]'])
def test_call_scanner_rejects_invalid_json(bad):
    with pytest.raises(JsonError):
        scanner = CallScanner()
        scanner.feed(bad)
        assert scanner.done


def test_call_scanner_stops_after_the_object():
    scanner = CallScanner()
    used, events = scanner.feed('{"name": "f", "arguments": {"a": 10}} tail')
    assert scanner.done and used == len('{"name": "f", "arguments": {"a": 10}}')
    assert events == [("name", "f"), ("args", "{"), ("args", '"a"'), ("args", ": "), ("args", "10"), ("args", "}")]


# ----------------------------------------------------------------------------- mistral
MISTRAL_CASES = [
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
     [("get_weather", WEATHER)], None),
    ('[TOOL_CALLS] [{"name": "a", "arguments": ' + json.dumps(NESTED) + '}, {"name": "b", "arguments": {}}]',
     [("a", NESTED), ("b", {})], None),
    ('Checking.[TOOL_CALLS]get_weather{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]ping{}',
     [("get_weather", WEATHER), ("ping", {})], "Checking."),
    ('[TOOL_CALLS]search[ARGS]' + json.dumps(NESTED, ensure_ascii=False), [("search", NESTED)], None),
    ('[TOOL_CALLS]f{"s": "a } brace"}\nDone.', [("f", {"s": "a } brace"})], "Done."),
]


@pytest.mark.parametrize("text, calls, content", MISTRAL_CASES)
def test_mistral_extract_and_stream(text, calls, content):
    check_parser("mistral", text, calls, content)
    assert get_tool_parser("mistral")().skip_special_tokens(True) is False


@pytest.mark.parametrize("text", [
    "No tools needed.",
    "[TOOL_CALLS]get_weather{\"city\": Paris}",  # malformed arguments
    "[TOOL_CALLS]not a call at all",
    "[TOOL_CALLS][{\"name\": oops}]",
    "[TOOL_CALLS]f[1, 2]",  # arguments that are not an object
])
def test_mistral_malformed_is_content(text):
    check_no_calls("mistral", text)


# ----------------------------------------------------------------------------- pythonic
PYTHONIC_CASES = [
    ('[get_weather(city="Paris", unit="celsius")]', [("get_weather", WEATHER)], None),
    ("<|python_start|>[get_weather(city='Paris', unit='celsius'), ping()]<|python_end|>",
     [("get_weather", WEATHER), ("ping", {})], None),
    ('  [search(q="a ] bracket", n=[1, -2.5, True, None], deep={"x": {"y": "é"}})]\nThat is all.',
     [("search", {"q": "a ] bracket", "n": [1, -2.5, True, None], "deep": {"x": {"y": "é"}}})], "That is all."),
]


@pytest.mark.parametrize("text, calls, content", PYTHONIC_CASES)
def test_pythonic_extract_and_stream(text, calls, content):
    check_parser("pythonic", text, calls, content)


@pytest.mark.parametrize("text", [
    "The answer is 4.",
    "[1, 2, 3]",  # a list, not of calls
    "[get_weather(city=Paris)]",  # not a literal
    "[f('positional')]",  # positional arguments
    "[get_weather(city='Paris'",  # cut off
    "   ",
])
def test_pythonic_malformed_is_content(text):
    check_no_calls("pythonic", text)


# ----------------------------------------------------------------------------- qwen3_coder
def qwen_call(name, params, *, wrap=True, close_params=True) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n" + ("</parameter>\n" if close_params else "")
                   for k, v in params)
    call = f"<function={name}>\n{body}</function>"
    return f"<tool_call>\n{call}\n</tool_call>" if wrap else call


QWEN_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "scale": {"type": "number"}, "tags": {"type": "array"}, "opts": {"type": "object"},
        "note": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]
TYPED = qwen_call("get_weather", [("city", "Paris"), ("days", "3"), ("metric", "True"), ("scale", "2.5"),
                                  ("tags", '["a", "b"]'), ("opts", "{'deep': True}"), ("note", "null"),
                                  ("extra", "42")])
QWEN_CASES = [
    ("I'll check.\n" + qwen_call("get_weather", [("city", "Paris")]), [("get_weather", {"city": "Paris"})],
     "I'll check."),
    (TYPED, [("get_weather", {"city": "Paris", "days": 3, "metric": True, "scale": 2.5, "tags": ["a", "b"],
                              "opts": {"deep": True}, "note": None, "extra": "42"})], None),
    # a multi-line string value keeps its inner newlines; a value with < in it is text
    (qwen_call("get_weather", [("city", "line one\n  line <two>")]),
     [("get_weather", {"city": "line one\n  line <two>"})], None),
    # two calls, one without parameters; a value that does not parse as its type stays text
    (qwen_call("ping", []) + "\n" + qwen_call("get_weather", [("days", "three")]),
     [("ping", {}), ("get_weather", {"days": "three"})], None),
    # no <tool_call> wrapper, no </parameter> (both tolerated), text after the calls
    (qwen_call("get_weather", [("city", "Oslo"), ("days", "2")], wrap=False, close_params=False) + "\nDone.",
     [("get_weather", {"city": "Oslo", "days": 2})], "Done."),
]


@pytest.mark.parametrize("text, calls, content", QWEN_CASES)
def test_qwen3_coder_extract_and_stream(text, calls, content):
    check_parser("qwen3_coder", text, calls, content, tools=QWEN_TOOLS)
    assert get_tool_parser("qwen3_coder")().skip_special_tokens(True) is False


def test_qwen3_coder_without_tools_keeps_strings():
    check_parser("qwen3_coder", qwen_call("f", [("n", "3")]), [("f", {"n": "3"})], None)


def test_qwen3_coder_streams_each_parameter():
    streamer = get_tool_parser("qwen3_coder")().streamer(QWEN_TOOLS)
    head = streamer.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar")
    assert head.tool_calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    first = streamer.feed("is\n</parameter>\n<parameter=days>\n")
    assert first.tool_calls[0]["function"]["arguments"] == '{"city": "Paris"'
    last = streamer.feed("4\n</parameter>\n</function>\n</tool_call>", final=True)
    assert last.tool_calls[0]["function"]["arguments"] == ', "days": 4}'


@pytest.mark.parametrize("text, stream", [
    ("Plain text with a < sign and <tool_call in words", True),
    ("<tool_call>\nnot a function\n</tool_call>", True),
    ("<tool_call>\n<function=>\n</function>", True),  # no name
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis", False),  # cut off in a value
    ("<tool_call>\n<function=get_weather>\nstray text\n</function>", False),
    ("<tool_call>", True),
])
def test_qwen3_coder_malformed_is_content(text, stream):
    check_no_calls("qwen3_coder", text, stream=stream, tools=QWEN_TOOLS)


def test_qwen3_coder_valid_call_then_cut_off_one():
    text = qwen_call("ping", []) + "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPa"
    got = get_tool_parser("qwen3_coder")().extract_tool_calls(text, QWEN_TOOLS)
    assert [c["function"]["name"] for c in got.tool_calls] == ["ping"]
    assert got.content == "<tool_call>\n<function=get_weather>\n<parameter=city>\nPa"


# ----------------------------------------------------------------------------- deepseek_v3
B, E = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
CB, CE, SEP = ("<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>",
               "<\uff5ctool\u2581sep\uff5c>")


def ds_v3(name, args) -> str:
    return f"{CB}function{SEP}{name}\n```json\n{dumps(args)}\n```{CE}"


def ds_v31(name, args) -> str:
    return f"{CB}{name}{SEP}{dumps(args)}{CE}"


DEEPSEEK_CASES = [
    ("Let me look." + B + ds_v3("get_weather", WEATHER) + E, [("get_weather", WEATHER)], "Let me look."),
    (B + ds_v3("get_weather", WEATHER) + "\n" + ds_v3("search", NESTED) + E,
     [("get_weather", WEATHER), ("search", NESTED)], None),
    (B + ds_v31("get_weather", WEATHER) + ds_v31("ping", {}) + E + " After.",
     [("get_weather", WEATHER), ("ping", {})], "After."),
    (B + ds_v31("get_weather", WEATHER)[: -len(CE)], [("get_weather", WEATHER)], None),  # ended at a stop token
]


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v31"])
@pytest.mark.parametrize("text, calls, content", DEEPSEEK_CASES)
def test_deepseek_extract_and_stream(name, text, calls, content):
    check_parser(name, text, calls, content)
    assert get_tool_parser(name)().skip_special_tokens(True) is False


@pytest.mark.parametrize("text", [
    "Just an answer.",
    B + CB + "function" + SEP + "get_weather\n```json\n{\"city\": Paris}\n```" + CE + E,  # bad JSON
    B + CB + "get_weather" + CE + E,  # no separator
    B + "stray" + E,
    B,
])
def test_deepseek_malformed_is_content(text):
    check_no_calls("deepseek_v3", text)
