"""A failing engine loop: the engine is marked dead, in-flight requests fail with the
error (an SSE error event with code 500, then [DONE]), /health and new requests
answer 503 (API-01, API-19; issue 14)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.engine.exceptions import EngineDeadError
from jaxserve.sampling_params import SamplingParams
from server.app import build_app
from tests.server.harness import TINY_ENGINE_ARGS, RunningServer, wait_until


@pytest.fixture(scope="module")
def doomed(tiny_model_dir):
    # Its own engine (this test kills it); the compilation cache makes the warm-up cheap.
    llm = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_model_dir), **TINY_ENGINE_ARGS), progress=False)
    srv = RunningServer(build_app(llm, "tiny"))
    yield llm, srv
    srv.stop()
    llm.shutdown()


def test_engine_death(doomed):
    llm, srv = doomed
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 200, "ignore_eos": True, "stream": True}
        events = []
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 2:
                    def boom():
                        raise RuntimeError("device lost")

                    llm.engine.engine_core.step = boom
        assert events[-1] == "data: [DONE]"
        err = json.loads(events[-2][len("data: "):])["error"]
        assert err["code"] == 500 and "device lost" in err["message"]
        assert llm.errored and isinstance(llm.dead_error, RuntimeError)

        r = http.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        for path, payload in (("/v1/completions", {"prompt": "w5"}),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}]})):
            r = http.post(path, json={"model": "tiny", **payload})
            assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"

    async def gen():
        async for _ in llm.generate("w5", SamplingParams(max_tokens=2), "after-death"):
            pass

    with pytest.raises(EngineDeadError):
        asyncio.run(gen())
    assert wait_until(lambda: not llm._thread.is_alive(), 5)
