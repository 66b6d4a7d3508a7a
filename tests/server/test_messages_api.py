"""Anthropic's Messages API (server/serving_messages.py): the `anthropic` SDK against a
real engine (plain, streamed, count_tokens, x-api-key, errors in Anthropic's envelope;
the tool-use round trip and output_config's JSON schema need a model that can spell
JSON: tests/server/test_server_default_model.py), and over the scripted fake
engine the shapes a tiny random model never writes: a parsed tool call as a tool_use
block and input_json_delta events, reasoning as a thinking block, stop sequences."""
from __future__ import annotations

import json

import anthropic
import pytest
from starlette.testclient import TestClient

from server.app import build_app
from tests.server.fake_engine import FakeEngine
from tests.server.harness import RunningServer

WEATHER = {"name": "get_weather", "description": "Weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
USER = [{"role": "user", "content": "w5 w6 w7"}]


@pytest.fixture(scope="module")
def server(tiny_async_llm):
    srv = RunningServer(build_app(tiny_async_llm, "tiny", api_key="k"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0, timeout=60)


def test_plain_and_streamed(client):
    greedy = {"temperature": 0, "ignore_eos": True}  # the SDK sends sampling fields in extra_body only
    msg = client.messages.create(model="tiny", max_tokens=6, messages=USER, system="w9 w10", extra_body=greedy)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 6 and msg.usage.input_tokens > 3
    with client.messages.stream(model="tiny", max_tokens=6, messages=USER, system="w9 w10",
                                extra_body=greedy) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == msg.content[0].text  # greedy: the same text, streamed
    assert final.usage.output_tokens == 6 and final.usage.input_tokens == msg.usage.input_tokens
    assert final.stop_reason == "max_tokens"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert client.messages.count_tokens(model="tiny", messages=USER, system="w9 w10").input_tokens == \
        msg.usage.input_tokens


def test_errors_in_anthropics_envelope(client, server):
    with pytest.raises(anthropic.BadRequestError) as e:  # an image: this server runs text models
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=4, messages=USER,
                               tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert "runs none" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", max_tokens=4, messages=USER)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=4, messages=USER)
    import httpx

    r = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": "k"}, json={"model": "tiny", "messages": USER})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]


# ----------------------------------------------------------------------------- scripted outputs
def fake_client(engine, **kw):
    return TestClient(build_app(engine, "m", **kw))


def events(r) -> list[tuple[str, dict]]:
    assert r.status_code == 200, r.text
    out = []
    for block in r.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        out.append((lines["event"], data))
    return out


HERMES = ['Checking.\n<tool_call>\n{"name": "get_weather", ', '"arguments": {"city": ', '"Paris"}}\n</tool_call>']


def test_parsed_tool_call_as_tool_use():
    c = fake_client(FakeEngine(HERMES), enable_auto_tool_choice=True, tool_call_parser="hermes")
    body = {"model": "m", "max_tokens": 50, "messages": USER, "tools": [WEATHER]}
    msg = c.post("/v1/messages", json=body).json()
    assert [b["type"] for b in msg["content"]] == ["text", "tool_use"]
    assert msg["content"][1]["input"] == {"city": "Paris"} and msg["stop_reason"] == "tool_use"
    ev = events(c.post("/v1/messages", json=body | {"stream": True}))
    starts = [d["content_block"]["type"] for k, d in ev if k == "content_block_start"]
    assert starts == ["text", "tool_use"]
    partial = "".join(d["delta"]["partial_json"] for k, d in ev
                      if k == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris"}
    assert [k for k, _ in ev][-2:] == ["message_delta", "message_stop"]
    assert ev[-2][1]["delta"]["stop_reason"] == "tool_use"
    # Stops and starts pair up, in order.
    marks = [(k, d["index"]) for k, d in ev if k in ("content_block_start", "content_block_stop")]
    assert marks == [("content_block_start", 0), ("content_block_stop", 0), ("content_block_start", 1),
                     ("content_block_stop", 1)]


def test_reasoning_as_thinking_and_stop_sequences():
    engine = FakeEngine(["<think>", "pondering", "</think>", "The answer."], reasoning_parser="qwen3")
    c = fake_client(engine)
    msg = c.post("/v1/messages", json={"model": "m", "max_tokens": 20, "messages": USER}).json()
    assert msg["content"][0] == {"type": "thinking", "thinking": "pondering", "signature": ""}
    assert msg["content"][1]["type"] == "text" and msg["stop_reason"] == "end_turn"
    ev = events(c.post("/v1/messages", json={"model": "m", "max_tokens": 20, "messages": USER, "stream": True}))
    deltas = [d["delta"]["type"] for k, d in ev if k == "content_block_delta"]
    assert deltas[0] == "thinking_delta" and "text_delta" in deltas
    # A turn's system prompt, tool results and thinking reach the chat template.
    turns = [{"role": "user", "content": "q"},
             {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"},
                                               {"type": "tool_use", "id": "t1", "name": "get_weather",
                                                "input": {"city": "Oslo"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "cold"}]}]
    c.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": turns, "system": "be brief",
                                 "stop_sequences": ["END"]})
    params = engine.seen_params[-1]
    assert params.stop == ["END"] and params.max_tokens == 5
