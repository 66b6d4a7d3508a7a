"""LoRA adapters in the server over a real engine and uvicorn (server/lora_routes.py):
the model field selects an adapter (the OpenAI client too), /v1/models lists them
with their parent, --lora-modules loads them at start, the runtime load / unload
routes (only with VLLM_ALLOW_RUNTIME_LORA_UPDATING) and their errors, an unload
while a request streams with the adapter, and the lora_requests_info gauge."""
from __future__ import annotations

import json
import threading

import httpx
import pytest

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.async_llm import AsyncLLM
from server.app import build_app
from server.cli_serve import check_serve_args
from server.lora_routes import LoRAModulePath, parse_lora_modules
from tests.server.harness import TINY_ENGINE_ARGS, RunningServer

pytestmark = pytest.mark.slow
PROMPT = "w5 w6 w7 w8"


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """Two random adapters of the tiny model: name -> (folder, HF model with it merged)."""
    from tests.models.lora_factory import make_peft_adapter

    d = tmp_path_factory.mktemp("server_loras")
    return {name: (d / name, make_peft_adapter(tiny_model_dir, d / name, r=8, alpha=16, seed=seed))
            for name, seed in (("sql", 1), ("chat", 2))}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    llm = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_model_dir), enable_lora=True, max_loras=2,
                                               max_lora_rank=8, enforce_eager=True, **TINY_ENGINE_ARGS),
                                    progress=False)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def http(engine, adapters):
    import os

    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"
    try:
        app = build_app(engine, "tiny", lora_modules=[LoRAModulePath("sql", str(adapters["sql"][0]))])
    finally:
        del os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
    srv = RunningServer(app)
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c
    srv.stop()


def complete(http, model, max_tokens=8, **kw):
    return http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                              "temperature": 0, "ignore_eos": True, **kw})


def hf_text(merged, tokenizer_dir, max_tokens=8) -> str:
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = merged.generate(ids, max_new_tokens=max_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:])


def test_model_field_selects_the_adapter(http, adapters, tiny_model_dir):
    r = complete(http, "sql")
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "sql"
    assert r.json()["choices"][0]["text"].split() == hf_text(adapters["sql"][1], tiny_model_dir).split()
    base = complete(http, "tiny").json()
    assert base["model"] == "tiny" and base["choices"][0]["text"] != r.json()["choices"][0]["text"]
    chat = http.post("/v1/chat/completions", json={"model": "sql", "messages": [{"role": "user", "content": "w9"}],
                                                   "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["model"] == "sql", chat.text
    models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert models["sql"]["parent"] == "tiny" and models["sql"]["root"] == str(adapters["sql"][0])
    assert models["tiny"]["parent"] is None
    assert complete(http, "nope").status_code == 404


def test_openai_client_selects_an_adapter(http):
    import openai

    client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="none")
    out = client.completions.create(model="sql", prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.model == "sql" and out.choices[0].text == complete(http, "sql").json()["choices"][0]["text"]


def test_load_and_unload_at_run_time(http, adapters, tmp_path):
    load = lambda **body: http.post("/v1/load_lora_adapter", json=body)  # noqa: E731
    r = load(lora_name="chat", lora_path=str(adapters["chat"][0]))
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'chat' added successfully."
    chat = complete(http, "chat")
    assert chat.status_code == 200 and chat.json()["choices"][0]["text"] != complete(http, "sql").json()[
        "choices"][0]["text"]
    errors = [
        (load(lora_name="", lora_path="/x"), 400, "Both 'lora_name' and 'lora_path' must be provided."),
        (load(lora_name="tiny", lora_path=str(adapters["chat"][0])), 400, "conflicts with a served base model"),
        (load(lora_name="chat", lora_path=str(adapters["chat"][0])), 400, "has already been loaded"),
        (load(lora_name="x", lora_path=str(tmp_path / "none")), 400, "No adapter found for"),
    ]
    (tmp_path / "r16").mkdir()
    (tmp_path / "r16" / "adapter_config.json").write_text(json.dumps(
        {"r": 16, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    errors.append((load(lora_name="x", lora_path=str(tmp_path / "r16")), 400, "greater than max_lora_rank 8"))
    for r, status, message in errors:
        assert r.status_code == status and message in r.json()["error"]["message"], r.text
        assert r.json()["error"]["code"] == status
    # In place: the name serves the other adapter's weights.
    assert load(lora_name="chat", lora_path=str(adapters["sql"][0]), load_inplace=True).status_code == 200
    assert complete(http, "chat").json()["choices"][0]["text"] == complete(http, "sql").json()["choices"][0]["text"]
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'chat' removed successfully."
    assert complete(http, "chat").status_code == 404
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
    assert http.post("/v1/unload_lora_adapter", json={}).status_code == 400
    assert "chat" not in {m["id"] for m in http.get("/v1/models").json()["data"]}


def test_unload_while_a_request_streams_with_the_adapter(http, adapters):
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "tmp", "lora_path": str(adapters["chat"][0])}
                     ).status_code == 200
    expected = complete(http, "tmp", max_tokens=200).json()["choices"][0]["text"]
    text, started = [], threading.Event()

    def stream():
        with http.stream("POST", "/v1/completions", json={"model": "tmp", "prompt": PROMPT, "max_tokens": 200,
                                                          "temperature": 0, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "tmp"}).status_code == 200
    received_before = len(text)
    t.join(60)
    assert received_before < 200  # the unload did come in the middle of the stream
    assert "".join(text) == expected
    assert complete(http, "tmp").status_code == 404


def test_lora_metric(http):
    complete(http, "sql")
    lines = [x for x in http.get("/metrics").text.splitlines() if x.startswith("jaxserve:lora_requests_info{")]
    assert lines and all('max_lora="2"' in x for x in lines), lines


def test_routes_are_off_without_the_switch(engine):
    srv = RunningServer(build_app(engine, "tiny"))
    try:
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
        assert r.status_code == 404
    finally:
        srv.stop()


def test_lora_modules_flag(tiny_async_llm):
    assert parse_lora_modules(["a=/p/a", '{"name": "b", "path": "/p/b", "base_model_name": "m"}']) == [
        LoRAModulePath("a", "/p/a"), LoRAModulePath("b", "/p/b", "m")]
    with pytest.raises(ValueError, match="Invalid JSON format for --lora-modules"):
        parse_lora_modules(["{not json"])
    with pytest.raises(ValueError, match="Invalid fields for --lora-modules"):
        parse_lora_modules(['{"name": "b", "where": "/p"}'])
    import argparse

    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        check_serve_args(argparse.Namespace(lora_modules=["a=/p"], enable_lora=False))
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        build_app(tiny_async_llm, "tiny", lora_modules=[LoRAModulePath("a", "/p")])
