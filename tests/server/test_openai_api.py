"""The OpenAI-compatible server end to end: a real uvicorn on 127.0.0.1, driven by the
official `openai` client and raw httpx (docs/vllm_behaviours.md §9–§10: API-01..API-18, CL-05/06)."""
from __future__ import annotations

import asyncio
import json
import re
import sys

import httpx
import openai
import pytest

from server.app import build_app
from tests.server.harness import RunningServer, wait_until

MODEL = "tiny"
MAX_MODEL_LEN = 256
PROMPT = "w5 w6 w7 w8"  # word-level tokenizer: 4 tokens, no BOS
GREEDY = {"temperature": 0.0}
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_async_llm):
    srv = RunningServer(build_app(tiny_async_llm, MODEL, max_model_len=MAX_MODEL_LEN))
    srv.async_llm = tiny_async_llm
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def sse_events(lines) -> list:
    """Raw SSE lines -> parsed JSON events, checking the framing and the final [DONE]."""
    events, done = [], False
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        assert not done, "nothing may follow [DONE]"
        if data == "[DONE]":
            done = True
            continue
        events.append(json.loads(data))
    assert done, "the stream must end with data: [DONE]"
    return events


def stream_post(http, path: str, body: dict) -> list:
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    return sse_events(raw.split("\n"))


def metric(text: str, name: str, **labels) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([^\s{]+)(?:\{([^}]*)\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
            found = True
    assert found, f"metric {name} {labels} not exported"
    return total


def assert_engine_idle(server, timeout: float = 10.0) -> None:
    assert wait_until(lambda: server.async_llm.get_stats().num_unfinished_requests == 0, timeout), \
        server.async_llm.get_stats()


# ----------------------------------------------------------------------------- basics
def test_models_health_version(http):
    r = http.get("/v1/models")
    assert r.status_code == 200
    card = r.json()["data"][0]
    assert r.json()["object"] == "list"
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "jaxserve"
    assert card["root"] and card["max_model_len"] == MAX_MODEL_LEN and isinstance(card["created"], int)
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]


def test_completion(client, http):
    res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, extra_body=NO_EOS, **GREEDY)
    assert res.id.startswith("cmpl-") and res.object == "text_completion" and res.model == MODEL
    assert len(res.choices) == 1
    choice = res.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length" and choice.logprobs is None
    assert choice.text
    assert res.usage.prompt_tokens == 4 and res.usage.completion_tokens == 5 and res.usage.total_tokens == 9
    # The same prompt as token ids gives the same greedy text.
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    res2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, extra_body=NO_EOS, **GREEDY)
    assert res2.choices[0].text == choice.text
    # model may be omitted (raw request)
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0, **NO_EOS})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == choice.text
    body = r.json()
    assert body["choices"][0]["stop_reason"] is None and "prompt_logprobs" in body["choices"][0]


def test_completion_default_max_tokens_is_16(client):
    res = client.completions.create(model=MODEL, prompt=PROMPT, extra_body=NO_EOS, **GREEDY)
    assert res.usage.completion_tokens == 16 and res.choices[0].finish_reason == "length"


def test_batch_prompts(client):
    prompts = [PROMPT, "w9 w10", PROMPT]
    res = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, extra_body=NO_EOS, **GREEDY)
    assert [c.index for c in res.choices] == [0, 1, 2]
    assert res.choices[0].text == res.choices[2].text
    assert res.usage.prompt_tokens == 4 + 2 + 4 and res.usage.completion_tokens == 12
    ids = [[5, 6, 7, 8], [9, 10]]
    res2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, extra_body=NO_EOS, **GREEDY)
    assert [c.text for c in res2.choices] == [res.choices[0].text, res.choices[1].text]


def test_batch_prompts_streamed(http):
    events = stream_post(http, "/v1/completions", {"model": MODEL, "prompt": [PROMPT, "w9 w10"], "max_tokens": 4,
                                                   "temperature": 0, "stream": True, **NO_EOS})
    texts = {0: "", 1: ""}
    for e in events:
        assert len(e["choices"]) == 1
        texts[e["choices"][0]["index"]] += e["choices"][0]["text"]
    finishes = [e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1]
    assert all(texts.values())


# ----------------------------------------------------------------------------- streaming
def test_completion_streaming_matches_non_streamed(client, http):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, extra_body=NO_EOS, **GREEDY)
    events = stream_post(http, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 12,
                                                   "temperature": 0, "stream": True, **NO_EOS})
    ids = {e["id"] for e in events}
    assert len(ids) == 1 and all(e["object"] == "text_completion" and e["model"] == MODEL for e in events)
    assert len({e["created"] for e in events}) == 1
    assert "".join(e["choices"][0]["text"] for e in events) == full.choices[0].text
    finish = [i for i, e in enumerate(events) if e["choices"][0]["finish_reason"] is not None]
    assert finish == [len(events) - 1] and events[-1]["choices"][0]["finish_reason"] == "length"
    assert all(e.get("usage") is None for e in events)
    # The official client too.
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, stream=True,
                                            extra_body=NO_EOS, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text


def test_stream_include_usage(client):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}, extra_body=NO_EOS, **GREEDY))
    *content, last = chunks
    assert last.choices == [] and last.usage.prompt_tokens == 4 and last.usage.completion_tokens == 6
    assert last.usage.total_tokens == 10
    assert all(c.usage is None for c in content)
    assert content[-1].choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, stream=True,
                                            stream_options={"include_usage": False}, extra_body=NO_EOS, **GREEDY))
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


def test_stream_continuous_usage(http):
    events = stream_post(http, "/v1/completions", {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True, **NO_EOS,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert all(e.get("usage") for e in events)
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert counts == sorted(counts) and len(set(counts)) == len(counts) and counts[-1] == 8
    assert all(e["usage"]["prompt_tokens"] == 4 for e in events)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == 12


def test_stream_options_without_stream_is_400(http):
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}]})):
        r = http.post(path, json={"model": MODEL, **body, "stream": False, "stream_options": {"include_usage": True}})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "stream_options"


# ----------------------------------------------------------------------------- sampling
def test_n_and_seed(client):
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "extra_body": NO_EOS}
    res = client.completions.create(n=3, seed=7, **kw)
    assert [c.index for c in res.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in res.choices)
    assert len({c.text for c in res.choices}) == 3
    assert res.usage.completion_tokens == 24 and res.usage.prompt_tokens == 4
    again = client.completions.create(n=3, seed=7, **kw)
    assert [c.text for c in again.choices] == [c.text for c in res.choices]
    a = client.completions.create(seed=1, **kw).choices[0].text
    b = client.completions.create(seed=1, **kw).choices[0].text
    c = client.completions.create(seed=2, **kw).choices[0].text
    assert a == b and a != c


def test_n_streamed(http):
    events = stream_post(http, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "n": 3,
                                                   "temperature": 1.0, "seed": 3, "stream": True, **NO_EOS})
    assert {e["choices"][0]["index"] for e in events} == {0, 1, 2}
    assert sorted(e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"]) == [0, 1, 2]


def test_stop_string(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, extra_body=NO_EOS, **GREEDY)
    words = base.choices[0].text.split()
    stop = words[2]
    cut = base.choices[0].text[: base.choices[0].text.index(" " + stop)] if f" {stop}" in base.choices[0].text else None
    res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, stop=[stop], extra_body=NO_EOS,
                                    **GREEDY)
    ch = res.choices[0]
    assert ch.finish_reason == "stop" and ch.model_extra["stop_reason"] == stop
    assert stop not in ch.text
    assert cut is None or ch.text.rstrip() == cut.rstrip()


def test_vllm_extras_accepted(client):
    res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.8, seed=0, extra_body={
        "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2, "ignore_eos": True, "min_tokens": 6,
        "logprobs": None, "unknown_field_is_ignored": 1})
    assert res.usage.completion_tokens == 6


# ----------------------------------------------------------------------------- logprobs
def test_completion_logprobs(client, http):
    res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=0, extra_body=NO_EOS, **GREEDY)
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(len(t) == 1 for t in lp.top_logprobs)
    assert [t.strip() for t in lp.tokens] == res.choices[0].text.split()
    res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=5, extra_body=NO_EOS, **GREEDY)
    lp = res.choices[0].logprobs
    assert all(len(t) in (5, 6) for t in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    for stream in (False, True):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "logprobs": 21, "stream": stream})
        assert r.status_code == 400 and "20" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "logprobs"
    assert http.get("/health").status_code == 200


def test_echo_with_logprobs(client):
    res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, logprobs=1,
                                    extra_body=NO_EOS, **GREEDY)
    ch = res.choices[0]
    assert ch.text.startswith(PROMPT)
    lp = ch.logprobs
    assert len(lp.tokens) == 4 + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None for v in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)


def test_streamed_logprobs_equal_full_logprobs(http):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "logprobs": 2, **GREEDY, **NO_EOS}
    full = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    events = stream_post(http, "/v1/completions", {**body, "stream": True})
    # (text_offset is left out: the word-level test tokenizer decodes tokens without the
    # spaces the text has, so per-chunk and whole-text offsets differ, as they would in vLLM.)
    keys = ("tokens", "token_logprobs", "top_logprobs")
    streamed = {key: [x for e in events for x in e["choices"][0]["logprobs"][key]] for key in keys}
    assert len(full["tokens"]) == 5 and streamed == {key: full[key] for key in keys}


def test_echo_top_logprobs_are_top_k_plus_chosen(http):
    """With prompt_logprobs=5 > logprobs=1, each echoed prompt position still lists the
    top 1 plus the prompt token when that is not the top one, as in vLLM. The prompt
    ends with the model's own greedy continuation, whose tokens are rank 1."""
    greedy = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3,
                                                 **GREEDY, **NO_EOS}).json()["choices"][0]["text"]
    prompt = PROMPT + greedy
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "echo": True,
                                           "logprobs": 1, "prompt_logprobs": 5, **GREEDY, **NO_EOS}).json()
    choice = r["choices"][0]
    ids = [int(w[1:]) for w in prompt.split()]  # word-level tokenizer: "w{i}" is id i
    ranks = [choice["prompt_logprobs"][i][str(ids[i])]["rank"] for i in range(1, len(ids))]
    tops = choice["logprobs"]["top_logprobs"]
    assert ranks[-3:] == [1, 1, 1]
    assert tops[0] is None and [len(t) for t in tops[1:len(ids)]] == [1 if rank == 1 else 2 for rank in ranks]


def test_echo_without_generation(http):
    """echo with max_tokens=0 (vLLM's scoring idiom): the prompt and its logprobs only."""
    for stream in (False, True):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1, **NO_EOS}
        if stream:
            events = stream_post(http, "/v1/completions",
                                 {**body, "stream": True, "stream_options": {"include_usage": True}})
            text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
            tokens = [t for e in events if e["choices"] and e["choices"][0]["logprobs"]
                      for t in e["choices"][0]["logprobs"]["tokens"]]
            usage = events[-1]["usage"]
        else:
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choice, usage = r.json()["choices"][0], r.json()["usage"]
            text, tokens = choice["text"], choice["logprobs"]["tokens"]
            assert choice["finish_reason"] == "length"
        assert text == PROMPT and tokens == PROMPT.split(" ")
        assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == 4
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_prompt_logprobs(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 1,
                                           "temperature": 0})
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == 4 and plp[0] is None
    assert all(1 <= len(d) <= 2 for d in plp[1:])
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
    assert r.json()["choices"][0]["prompt_logprobs"] is None


# ----------------------------------------------------------------------------- chat
MESSAGES = [{"role": "system", "content": "w20 w21"}, {"role": "user", "content": "w5 w6 w7"}]


def test_chat(client, http):
    res = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=5,
                                         extra_body=NO_EOS, **GREEDY)
    assert res.id.startswith("chatcmpl-") and res.object == "chat.completion"
    ch = res.choices[0]
    assert ch.message.role == "assistant" and ch.message.content and ch.finish_reason == "length"
    n_prompt = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()["count"]
    assert res.usage.prompt_tokens == n_prompt and res.usage.completion_tokens == 5
    assert res.usage.total_tokens == n_prompt + 5
    # max_tokens (deprecated) works the same; a follow-up turn works.
    res2 = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, extra_body=NO_EOS, **GREEDY)
    assert res2.choices[0].message.content == ch.message.content
    follow = MESSAGES + [{"role": "assistant", "content": ch.message.content}, {"role": "user", "content": "w9"}]
    res3 = client.chat.completions.create(model=MODEL, messages=follow, max_tokens=3, extra_body=NO_EOS, **GREEDY)
    assert res3.usage.prompt_tokens > n_prompt
    # Content as a list of text parts behaves like a string; a custom role is accepted.
    parts = [{"role": "system", "content": "w20 w21"},
             {"role": "user", "content": [{"type": "text", "text": "w5 w6 w7"}]}]
    res4 = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=5, extra_body=NO_EOS, **GREEDY)
    assert res4.choices[0].message.content == ch.message.content
    r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "extra": 1,
                                                "messages": [{"role": "custom", "content": "w5", "x": 1}]})
    assert r.status_code == 200


def test_chat_default_max_tokens_is_rest_of_context(client):
    res = client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=NO_EOS, **GREEDY)
    assert res.usage.prompt_tokens + res.usage.completion_tokens == MAX_MODEL_LEN
    assert res.choices[0].finish_reason == "length"


def test_chat_streaming(client, http):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, extra_body=NO_EOS, **GREEDY)
    events = stream_post(http, "/v1/chat/completions", {
        "model": MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "stream": True, **NO_EOS,
        "stream_options": {"include_usage": True}})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events) and len({e["id"] for e in events}) == 1
    *content, usage = events
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    assert usage["usage"]["prompt_tokens"] == full.usage.prompt_tokens
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in content) == full.choices[0].message.content
    finish = [i for i, e in enumerate(content) if e["choices"][0]["finish_reason"]]
    assert finish == [len(content) - 1]
    assert content[-1]["choices"][0]["finish_reason"] == full.choices[0].finish_reason
    assert all("role" not in e["choices"][0]["delta"] for e in content[1:])
    # The official client.
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, stream=True,
                                                 extra_body=NO_EOS, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content


def test_chat_n_streamed(http):
    events = stream_post(http, "/v1/chat/completions", {
        "model": MODEL, "messages": MESSAGES, "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 5,
        "stream": True, **NO_EOS})
    for idx in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == idx]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content") or "" for c in mine)
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]


def test_chat_logprobs(client, http):
    res = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, logprobs=False, **GREEDY)
    assert res.choices[0].logprobs is None
    res = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, logprobs=True,
                                         top_logprobs=0, extra_body=NO_EOS, **GREEDY)
    content = res.choices[0].logprobs.content
    assert len(content) == 4 and all(c.top_logprobs == [] for c in content)
    res = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, logprobs=True,
                                         top_logprobs=5, extra_body=NO_EOS, **GREEDY)
    content = res.choices[0].logprobs.content
    assert all(len(c.top_logprobs) == 5 for c in content)
    # Greedy: the sampled token is the top one.
    assert all(c.token == c.top_logprobs[0].token and c.logprob == c.top_logprobs[0].logprob for c in content)
    assert [c.token.strip() for c in content] == res.choices[0].message.content.split()
    # Streamed, the same logprobs, chunk by chunk.
    events = stream_post(http, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 4,
                                                        "logprobs": True, "top_logprobs": 5, "stream": True,
                                                        **NO_EOS, **GREEDY})
    streamed = [c for e in events if e["choices"] and e["choices"][0].get("logprobs")
                for c in e["choices"][0]["logprobs"]["content"]]
    assert [(c["token"], c["logprob"], len(c["top_logprobs"])) for c in streamed] == [
        (c.token, c.logprob, len(c.top_logprobs)) for c in content]
    for stream in (False, True):
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "logprobs": True,
                                                    "top_logprobs": 21, "stream": stream})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    assert http.get("/health").status_code == 200


# ----------------------------------------------------------------------------- errors
def _error(r, status: int, param: str | None = None, contains: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["code"] == status
    if param is not None:
        assert err["param"] == param, err
    if contains is not None:
        assert contains in err["message"], err
    return err


@pytest.mark.parametrize("body, param, contains", [
    ({"temperature": 3.0}, "temperature", "[0, 2]"),
    ({"top_p": 0.0}, "top_p", "(0, 1]"),
    ({"top_k": -5}, "top_k", None),
    ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty", None),
    ({"min_p": 1.5}, "min_p", "[0, 1]"),
    ({"max_tokens": 0}, "max_tokens", None),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", None),
    ({"n": 2, "temperature": 0}, "n", "greedy"),
    ({"max_tokens": 1000}, "max_tokens", "256"),
    ({"max_tokens": 253}, "max_tokens", "256"),  # 4 prompt tokens + 253 > 256
    ({"seed": 2**64}, "seed", "less_than_equal"),
    ({"seed": -(2**64)}, "seed", "greater_than_equal"),
    ({"prompt": ""}, "prompt", "non-empty"),
    ({"prompt": []}, "prompt", "non-empty"),
    ({"prompt": [5, 999999]}, "prompt", "out of vocabulary"),
    ({"prompt": [5, -1]}, "prompt", "greater than or equal to 0"),
    ({"prompt": None}, "prompt", None),
    ({"stop": [""]}, "stop", None),
    ({"best_of": 3}, "best_of", None),
    ({"suffix": "w9"}, "suffix", None),
    ({"logit_bias": {"-5": 1}}, "logit_bias", "non-negative"),
    ({"logit_bias": {"999999": 1}}, "logit_bias", "out of vocabulary"),
    ({"logit_bias": {"w5": 1}}, "logit_bias", "integer token ids"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
    ({"allowed_token_ids": [5, 999999]}, "allowed_token_ids", "out of vocabulary"),
    ({"bad_words": [" "]}, "bad_words", "non-empty"),
    ({"temperature": "hot"}, "temperature", None),
])
def test_completion_400s(http, body, param, contains):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, **body})
    err = _error(r, 400, param, contains)
    assert err["type"] == "BadRequestError"


def test_prompt_too_long_is_400(http):
    long_prompt = " ".join(f"w{3 + i % 500}" for i in range(300))
    err = _error(http.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt, "max_tokens": 1}), 400)
    assert "256" in err["message"]
    msgs = [{"role": "user", "content": long_prompt}]
    err = _error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs}), 400)
    assert "256" in err["message"]


def test_chat_400s(http):
    base = {"model": MODEL, "messages": MESSAGES}
    _error(http.post("/v1/chat/completions", json={**base, "max_completion_tokens": 300}), 400,
           "max_completion_tokens", "256")
    _error(http.post("/v1/chat/completions", json={**base, "temperature": -1}), 400, "temperature")
    _error(http.post("/v1/chat/completions", json={**base, "top_logprobs": 3}), 400, "top_logprobs")
    _error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": []}), 400, "messages")
    _error(http.post("/v1/chat/completions", json={"model": MODEL}), 400, "messages")
    _error(http.post("/v1/chat/completions", json={**base, "response_format": {"type": "json_schema"}}), 400,
           "response_format")
    parts = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    _error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": parts}), 400, "messages")


def test_unknown_model_is_404(client, http):
    err = _error(http.post("/v1/completions", json={"model": "gpt-4", "prompt": PROMPT}), 404, "model")
    assert err["type"] == "NotFoundError" and "`gpt-4` does not exist" in err["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10_000)
    assert "256" in str(ei.value)


def test_wrong_content_type(http):
    r = http.post("/v1/completions", content=b"prompt=w5", headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert 400 <= r.status_code < 500 and "error" in r.json()
    assert http.get("/health").status_code == 200


# ----------------------------------------------------------------------------- tokenization
def test_tokenize_detokenize(http):
    r = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert r["tokens"] == [5, 6, 7, 8] and r["count"] == 4 and r["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"model": MODEL, "tokens": [5, 6, 7, 8]}).json()["prompt"] == PROMPT
    _error(http.post("/detokenize", json={"tokens": [10**7]}), 400, "tokens")
    _error(http.post("/tokenize", json={"model": "nope", "prompt": "w5"}), 404, "model")


# ----------------------------------------------------------------------------- load, disconnects, metrics
def test_64_concurrent_requests(server):
    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(i):
            prompt = " ".join(f"w{3 + (i * 7 + j) % 500}" for j in range(3 + i % 20))
            if i % 2:
                res = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0.5,
                                                      seed=i, extra_body=NO_EOS)
                return res.usage.completion_tokens
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0.5,
                                                     seed=i, stream=True, stream_options={"include_usage": True},
                                                     extra_body=NO_EOS)
            usage = None
            async for chunk in stream:
                usage = chunk.usage or usage
            return usage.completion_tokens

        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await client.close()

    assert asyncio.run(run()) == [10] * 64
    assert_engine_idle(server)


def test_stream_disconnect_aborts(server, http):
    before = metric(http.get("/metrics").text, "jaxserve:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 240, "temperature": 0, "stream": True, **NO_EOS}
    with httpx.Client(base_url=server.url, timeout=30) as c, c.stream("POST", "/v1/completions", json=body) as r:
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                got += 1
                if got == 3:
                    break
    # The connection is closed: the engine drops the request well before its 240 tokens.
    assert_engine_idle(server, timeout=5)
    assert wait_until(lambda: metric(http.get("/metrics").text, "jaxserve:request_success_total",
                                     finished_reason="abort") == before + 1, 5)
    res = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3})
    assert res.status_code == 200


def test_batch_stream_disconnect_aborts_every_prompt(server, http):
    before = metric(http.get("/metrics").text, "jaxserve:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": [PROMPT, "w9 w10", "w11"], "max_tokens": 240, "temperature": 0,
            "stream": True, **NO_EOS}
    with httpx.Client(base_url=server.url, timeout=30) as c, c.stream("POST", "/v1/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 6:
                break
    assert_engine_idle(server, timeout=5)
    assert wait_until(lambda: metric(http.get("/metrics").text, "jaxserve:request_success_total",
                                     finished_reason="abort") == before + 3, 5)


def test_non_streaming_timeouts_abort(server, http):
    """API-18: clients that time out abort their requests; the server keeps serving."""
    before = metric(http.get("/metrics").text, "jaxserve:request_success_total", finished_reason="abort")

    async def run():
        # 0.1 s: well short of 20 x 240 tokens (0.5 s was not, on a warm engine); a request
        # cut off before it reached the engine is counted as aborted all the same.
        async with httpx.AsyncClient(base_url=server.url, timeout=0.1) as c:
            async def one(i):
                with pytest.raises(httpx.TimeoutException):
                    await c.post("/v1/chat/completions", json={
                        "model": MODEL, "messages": [{"role": "user", "content": f"w{5 + i}"}],
                        "max_tokens": 240, "min_tokens": 240, "temperature": 0})
            await asyncio.gather(*(one(i) for i in range(20)))

    asyncio.run(run())
    assert_engine_idle(server, timeout=5)
    assert wait_until(lambda: metric(http.get("/metrics").text, "jaxserve:request_success_total",
                                     finished_reason="abort") == before + 20, 5)
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3}, timeout=5)
    assert r.status_code == 200


def test_abort_before_the_engine_counts(server, http):
    """A request aborted before the engine thread added it (a client gone at once) is
    still counted as an aborted request: none goes missing from the metrics."""
    from jaxserve import SamplingParams
    from jaxserve.engine.async_llm import AddRequest

    llm = server.async_llm
    before = metric(http.get("/metrics").text, "jaxserve:request_success_total", finished_reason="abort")

    async def run():
        stream = llm._open_stream("closed-early", 1, None, [5, 6, 7])
        stream.closed = True  # as the caller's abort does before the command is applied
        llm._unregister(stream)
        llm._post(AddRequest(stream, None, [5, 6, 7], SamplingParams(max_tokens=4)))

    asyncio.run(run())
    assert wait_until(lambda: metric(http.get("/metrics").text, "jaxserve:request_success_total",
                                     finished_reason="abort") == before + 1, 5)
    assert_engine_idle(server, timeout=5)


def test_metrics_move(http):
    def scrape():
        return http.get("/metrics").text

    m0 = scrape()
    assert "# TYPE jaxserve:time_to_first_token_seconds histogram" in m0
    for name in ("jaxserve:num_requests_running", "jaxserve:num_requests_waiting", "jaxserve:kv_cache_usage_perc",
                 "jaxserve:gpu_prefix_cache_hit_rate"):
        metric(m0, name)
    prompt = " ".join(f"w{100 + i}" for i in range(40))  # two full 16-token blocks to hit next time
    for _ in range(2):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 5, **NO_EOS})
        assert r.status_code == 200
    m1 = scrape()
    assert metric(m1, "jaxserve:prompt_tokens_total") >= metric(m0, "jaxserve:prompt_tokens_total") + 80
    assert metric(m1, "jaxserve:generation_tokens_total") >= metric(m0, "jaxserve:generation_tokens_total") + 10
    length = {"finished_reason": "length"}
    assert metric(m1, "jaxserve:request_success_total", **length) >= \
        metric(m0, "jaxserve:request_success_total", **length) + 2
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds",
                 "request_time_per_output_token_seconds", "inter_token_latency_seconds", "request_prompt_tokens",
                 "request_generation_tokens"):
        assert metric(m1, f"jaxserve:{hist}_count") >= metric(m0, f"jaxserve:{hist}_count") + 2, hist
    assert metric(m1, "jaxserve:prefix_cache_hits_total") >= metric(m0, "jaxserve:prefix_cache_hits_total") + 32
    assert metric(m1, "jaxserve:prefix_cache_queries_total") >= metric(m0, "jaxserve:prefix_cache_queries_total") + 80
    assert metric(m1, "jaxserve:num_requests_running") == 0


# ----------------------------------------------------------------------------- a second app: API key
def test_api_key(server):
    app = build_app(server.async_llm, MODEL, api_key="s3cret", max_model_len=MAX_MODEL_LEN,
                    enable_prompt_tokens_details=True)
    srv = RunningServer(app)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            _error(c.get("/v1/models"), 401)
            _error(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
            assert c.get("/health").status_code == 200  # only /v1 routes need the key
            ok = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="s3cret", max_retries=0)
            assert ok.models.list().data[0].id == MODEL
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=f"{srv.url}/v1", api_key="nope", max_retries=0).models.list()
            # With --enable-prompt-tokens-details a repeated prompt reports cached tokens (whole blocks).
            prompt = " ".join(f"w{200 + i}" for i in range(37))
            usage = [ok.completions.create(model=MODEL, prompt=prompt, max_tokens=2).usage for _ in range(2)]
            cached = usage[1].prompt_tokens_details.cached_tokens
            assert cached == 32
    finally:
        srv.stop()


# ----------------------------------------------------------------------------- a third app: generation config
def test_generation_config_defaults(server):
    """Fields a request leaves out come from the model's generation config (here greedy,
    4 tokens), before OpenAI's defaults; the request's own values win."""
    srv = RunningServer(build_app(server.async_llm, MODEL, max_model_len=MAX_MODEL_LEN,
                                  default_sampling_params={"temperature": 0.0, "max_tokens": 4}))
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], **NO_EOS}
            plain = c.post("/v1/chat/completions", json=chat).json()
            greedy = c.post("/v1/chat/completions", json={**chat, "temperature": 0, "max_tokens": 4}).json()
            assert plain["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
            assert plain["usage"]["completion_tokens"] == 4 and plain["choices"][0]["finish_reason"] == "length"
            longer = c.post("/v1/chat/completions", json={**chat, "max_tokens": 6}).json()
            assert longer["usage"]["completion_tokens"] == 6
            # Completions keep OpenAI's max_tokens default of 16; temperature comes from the config.
            comp = {"model": MODEL, "prompt": PROMPT, **NO_EOS}
            texts = {c.post("/v1/completions", json=comp).json()["choices"][0]["text"] for _ in range(2)}
            assert len(texts) == 1
            assert c.post("/v1/completions", json=comp).json()["usage"]["completion_tokens"] == 16
    finally:
        srv.stop()


# ----------------------------------------------------------------------------- the benchmark client
def test_bench_serving_client(server):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serving.py"
    spec = importlib.util.spec_from_file_location("bench_serving", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up
    spec.loader.exec_module(bench)
    result = asyncio.run(bench.benchmark(base_url=server.url, model=None, num_prompts=6, input_len=12,
                                         output_len=5, max_concurrency=3, seed=0))
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == 30 and result["total_input_tokens"] == 6 * 12
    assert result["mean_ttft_ms"] > 0 and result["mean_tpot_ms"] > 0 and result["output_throughput"] > 0
    assert_engine_idle(server)


def test_token_controls_over_http(client):
    """logit_bias (OpenAI's field; string token ids), allowed_token_ids and bad_words
    (vLLM's, as extra_body) change greedy outputs as they must."""
    base = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=NO_EOS)
    plain = client.completions.create(**base).choices[0].text.split()
    forced = client.completions.create(**base | {"logit_bias": {"9": 1e6}}).choices[0].text  # clamped to 100
    assert forced.split() == ["w9"] * 8
    allowed = client.completions.create(**base | {"extra_body": NO_EOS | {"allowed_token_ids": [11, 12]}})
    assert set(allowed.choices[0].text.split()) <= {"w11", "w12"}
    banned = client.completions.create(**base | {"extra_body": NO_EOS | {"bad_words": [plain[0]]}}).choices[0].text
    assert plain[0] not in banned.split() and banned.split() != plain
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5"}], max_tokens=4,
                                          temperature=0, logit_bias={"13": 100}, extra_body=NO_EOS)
    assert chat.choices[0].message.content.split() == ["w13"] * 4
