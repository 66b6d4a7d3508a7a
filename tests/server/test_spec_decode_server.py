"""Speculative decoding behind the OpenAI server: the same greedy text as without it,
streamed deltas that join to it, and the spec decode counters on /metrics."""
from __future__ import annotations

import httpx
import pytest

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.async_llm import AsyncLLM
from server.app import build_app
from tests.server.harness import TINY_ENGINE_ARGS, RunningServer
from tests.server.test_openai_api import metric


@pytest.fixture(scope="module")
def spec_server(tiny_model_dir):
    # Eager: compiles only what the test runs (the warm-up of every program is tested offline).
    llm = AsyncLLM.from_engine_args(EngineArgs(
        model=str(tiny_model_dir), **TINY_ENGINE_ARGS, enforce_eager=True,
        # adaptive_drafts off: compiling on demand makes the first verified steps look slow.
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                            "adaptive_drafts": False}), progress=False)
    srv = RunningServer(build_app(llm, "tiny"))
    yield srv
    srv.stop()
    llm.shutdown()


def test_same_text_streamed_and_counted(tiny_async_llm, spec_server):
    plain = RunningServer(build_app(tiny_async_llm, "tiny"))
    body = {"model": "tiny", "prompt": "w5 w6 w7 w8 w5 w6 w7 w8 w5 w6", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True}
    try:
        want = httpx.post(f"{plain.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    finally:
        plain.stop()
    with httpx.Client(base_url=spec_server.url, timeout=60) as http:
        got = http.post("/v1/completions", json=body).json()["choices"][0]
        assert got["text"] == want and got["finish_reason"] == "length"
        pieces = []
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    pieces.append(httpx.Response(200, content=line[6:]).json()["choices"][0]["text"])
        assert "".join(pieces) == want
        text = http.get("/metrics").text
        drafts = metric(text, "jaxserve:spec_decode_num_drafts_total")
        accepted = metric(text, "jaxserve:spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and accepted > 0
        assert metric(text, "jaxserve:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
