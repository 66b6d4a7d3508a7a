"""The research loop's routes over a real engine and uvicorn (server/weight_routes.py):
off unless enabled, under --api-key, weight updates from disk (the version in
/v1/models and /metrics), sleep (503 while asleep) / wake, pause (abort, wait) / resume."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from safetensors.numpy import load_file

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.async_llm import AsyncLLM
from server.app import build_app
from tests.server.harness import TINY_ENGINE_ARGS, RunningServer, wait_until

pytestmark = pytest.mark.slow
KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    from tests.models.hf_factory import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny_llama_other"), seed=1)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    llm = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_model_dir), **TINY_ENGINE_ARGS), progress=False)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def http(engine):
    srv = RunningServer(build_app(engine, "tiny", api_key=KEY, enable_weight_updates=True))
    with httpx.Client(base_url=srv.url, timeout=60, headers=AUTH) as c:
        yield c
    srv.stop()


def greedy(http, max_tokens=6) -> str:
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "w5 w6 w7", "max_tokens": max_tokens,
                                           "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_routes_are_off_unless_enabled(tiny_async_llm):
    srv = RunningServer(build_app(tiny_async_llm, "tiny"))
    try:
        assert httpx.post(srv.url + "/sleep").status_code == 404
        assert httpx.get(srv.url + "/is_sleeping").status_code == 404
    finally:
        srv.stop()


def test_the_routes_need_the_key(http):
    for method, path in [("post", "/sleep"), ("get", "/is_sleeping"), ("post", "/update_weights_from_disk"),
                         ("post", "/pause"), ("post", "/resume"), ("post", "/reset_prefix_cache")]:
        r = getattr(httpx, method)(str(http.base_url) + path)
        assert r.status_code == 401, (path, r.text)


def test_update_weights_from_disk_and_the_version(http, engine, tiny_model_dir, other_model):
    before = greedy(http)
    r = http.post("/update_weights_from_disk", json={"model_path": str(other_model)})
    assert r.status_code == 200 and r.json()["success"], r.text
    version = r.json()["weights_version"]
    assert http.get("/v1/models").json()["data"][0]["weights_version"] == version
    assert f'jaxserve:weights_version{{model_name="tiny"}} {float(version)}' in http.get("/metrics").text
    assert greedy(http) != before
    # Back, through the async API with a name -> array dict.
    info = asyncio.run(engine.update_weights(load_file(str(tiny_model_dir / "model.safetensors"))))
    assert info["version"] == version + 1 and greedy(http) == before
    assert http.post("/reset_prefix_cache").json() == {"success": True}
    for body, param in [({"model_path": str(tiny_model_dir / "nope")}, "model_path"), ({}, "model_path")]:
        r = http.post("/update_weights_from_disk", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = http.post("/update_weights_from_disk", json={"model_path": str(tiny_model_dir / "nope")})
    assert r.json()["success"] is False and "is not a folder" in r.json()["message"]  # SGLang's fields too

    # A caller that gives up (cancelled before the engine ran it) leaves the engine well.
    async def give_up():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.update_weights(str(other_model)), timeout=1e-6)

    asyncio.run(give_up())
    greedy(http)  # still serving (a 200), on whichever weights the call left
    assert not engine.errored
    assert http.post("/sleep", params={"level": 3}).status_code == 400
    assert http.post("/pause", params={"mode": "keep"}).status_code == 400


def test_sleep_answers_503_until_wake_up(http):
    before = greedy(http)
    r = http.post("/sleep", params={"level": 1})
    assert r.status_code == 200 and r.json()["freed_bytes"]["kv_cache"] > 0, r.text
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "w5", "max_tokens": 2})
    assert r.status_code == 503 and "asleep" in r.json()["error"]["message"]
    assert http.post("/wake_up").json() == {"is_sleeping": False}
    assert greedy(http) == before


def _stream(http, max_tokens: int, out: dict, key: str) -> None:
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    out[key] = events[-1]["choices"][0]["finish_reason"]


def test_pause_abort_wait_and_resume(http, engine):
    for query, reason in (({}, "abort"), ({"mode": "wait"}, "length"),
                          ({"wait_for_inflight_requests": "true", "clear_cache": "false"}, "length")):
        out = {}
        worker = threading.Thread(target=_stream, args=(http, 200, out, "first"))
        worker.start()
        assert wait_until(lambda: engine.engine.engine_core.num_running() > 0, 30)
        r = http.post("/pause", params=query)
        assert r.status_code == 200 and http.get("/is_paused").json() == {"is_paused": True}
        worker.join(60)
        assert out["first"] == reason
        # Held while paused: a new request starts only after /resume.
        later = threading.Thread(target=_stream, args=(http, 4, out, "later"))
        later.start()
        time.sleep(0.5)
        assert "later" not in out and later.is_alive()
        assert http.post("/resume").json() == {"is_paused": False}
        later.join(60)
        assert out["later"] == "length"
