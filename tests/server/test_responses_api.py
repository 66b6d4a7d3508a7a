"""OpenAI's Responses API (server/serving_responses.py): the `openai` SDK against a real
engine (plain, streamed with its typed events, store / GET / previous_response_id,
background + cancel, errors), and over the scripted fake engine the shapes a tiny
random model never writes (a parsed function call, streamed argument deltas, a
reasoning item). The function-tool round trip and text.format json_schema on a model
that spells JSON are in tests/server/test_server_default_model.py."""
from __future__ import annotations

import json
import time

import openai
import pytest
from starlette.testclient import TestClient

from server.app import build_app
from tests.server.fake_engine import FakeEngine
from tests.server.harness import RunningServer

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def client(tiny_async_llm):
    srv = RunningServer(build_app(tiny_async_llm, "tiny"))
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
    srv.stop()


def test_plain_and_streamed(client):
    r = client.responses.create(model="tiny", input="w5 w6 w7", instructions="w9", max_output_tokens=4,
                                temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 4
    assert r.output[0].type == "message" and r.output_text
    stream = client.responses.create(model="tiny", input="w5 w6 w7", instructions="w9", max_output_tokens=4,
                                     temperature=0, stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.usage.input_tokens == r.usage.input_tokens


def test_store_get_and_previous_response(client):
    first = client.responses.create(model="tiny", input="w5 w6", max_output_tokens=3, temperature=0)
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    follow = client.responses.create(model="tiny", input="w8", previous_response_id=first.id, max_output_tokens=3,
                                     temperature=0)
    # The follow-up's prompt holds the first turn and its answer.
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert follow.previous_response_id == first.id
    unstored = client.responses.create(model="tiny", input="w5", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_background_and_cancel(client):
    done = client.responses.create(model="tiny", input="w5", max_output_tokens=3, background=True)
    assert done.status in ("queued", "in_progress")
    for _ in range(200):
        polled = client.responses.retrieve(done.id)
        if polled.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert polled.status == "incomplete" and polled.usage.output_tokens == 3
    long = client.responses.create(model="tiny", input="w5", max_output_tokens=240, background=True)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):  # only a running background response can be cancelled
        client.responses.cancel(done.id)


def test_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="w5", tools=[{"type": "web_search"}])
    assert "runs none" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="w5", previous_response_id="resp_nope")


# ----------------------------------------------------------------------------- scripted outputs
HERMES = ['Checking.\n<tool_call>\n{"name": "get_weather", ', '"arguments": {"city": ', '"Paris"}}\n</tool_call>']


def sse(r) -> list[dict]:
    assert r.status_code == 200, r.text
    out = []
    for block in r.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append(json.loads(lines["data"]))
        assert out[-1]["type"] == lines["event"]
    return out


def test_function_call_items_and_stream():
    c = TestClient(build_app(FakeEngine(HERMES), "m", enable_auto_tool_choice=True, tool_call_parser="hermes"))
    body = {"model": "m", "input": "weather?", "tools": [WEATHER]}
    r = c.post("/v1/responses", json=body).json()
    assert [i["type"] for i in r["output"]] == ["message", "function_call"]
    assert json.loads(r["output"][1]["arguments"]) == {"city": "Paris"} and r["output"][1]["name"] == "get_weather"
    ev = sse(c.post("/v1/responses", json=body | {"stream": True}))
    args = "".join(e["delta"] for e in ev if e["type"] == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}
    done = [e for e in ev if e["type"] == "response.output_item.done"]
    assert [d["item"]["type"] for d in done] == ["message", "function_call"]
    assert ev[-1]["type"] == "response.completed" and len(ev[-1]["response"]["output"]) == 2
    # The call's output goes back as an input item: a tool message after the call.
    engine = FakeEngine(["It is sunny."])
    c2 = TestClient(build_app(engine, "m"))
    call_id = r["output"][1]["call_id"]
    follow = c2.post("/v1/responses", json={"model": "m", "input": [
        {"role": "user", "content": "weather?"}, r["output"][1],
        {"type": "function_call_output", "call_id": call_id, "output": "sunny"}], "tools": [WEATHER],
        "tool_choice": "none"}).json()
    assert follow["output"][0]["content"][0]["text"] == "It is sunny."


def test_reasoning_item():
    c = TestClient(build_app(FakeEngine(["<think>", "pondering", "</think>", "Yes."], reasoning_parser="qwen3"), "m"))
    r = c.post("/v1/responses", json={"model": "m", "input": "q"}).json()
    assert r["output"][0]["type"] == "reasoning" and r["output"][0]["content"][0]["text"] == "pondering"
    ev = sse(c.post("/v1/responses", json={"model": "m", "input": "q", "stream": True}))
    kinds = [e["type"] for e in ev]
    assert "response.reasoning_text.delta" in kinds and kinds.index("response.reasoning_text.done") < \
        kinds.index("response.output_text.delta")
