"""The pooling routes over a real engine and uvicorn (server/serving_pooling.py, vLLM's
shapes): /v1/embeddings through the OpenAI client (float and base64), dimensions,
truncate_prompt_tokens and usage; /pooling; /classify; /score and /rerank (all three
paths) ordered as HF's cross-encoder orders them (a decoder's and BERT's, with token types); the generate <-> pooling route
mismatches and bad inputs as 400s."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.async_llm import AsyncLLM
from server.app import build_app
from tests.server.harness import TINY_ENGINE_ARGS, RunningServer

pytestmark = pytest.mark.slow
ARGS = TINY_ENGINE_ARGS | {"dtype": "float32", "enforce_eager": True}


def serve(path, **kw):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(path), **(ARGS | kw)), progress=False)
    srv = RunningServer(build_app(engine, "m"))
    return engine, srv


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    from tests.models.pooling_factory import make_pooling_model

    path = make_pooling_model(tmp_path_factory.mktemp("srv_emb"), "qwen3", is_matryoshka=True)
    engine, srv = serve(path)
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield path, srv, c
    srv.stop()
    engine.shutdown()


# A causal LM as a reranker from two lm_head rows (Qwen3-Reranker's recipe, tokens of the word vocabulary).
TOKEN_RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["w7", "w9"],
                  "method": "from_2_way_softmax"}


@pytest.fixture(scope="module", params=["llama", "bert", "qwen3-tokens"])
def reranker(tmp_path_factory, request):
    """A decoder cross-encoder, BERT's (the pair's token types reach the model), and a
    causal LM served as one through --hf-overrides classifier_from_token."""
    from tests.models.hf_factory import make_tiny_hf_model
    from tests.models.pooling_factory import make_pooling_model

    folder = tmp_path_factory.mktemp("srv_ce")
    if request.param == "qwen3-tokens":
        path = make_tiny_hf_model(folder, "qwen3")
        engine, srv = serve(path, hf_overrides=TOKEN_RERANKER)
    else:
        path = make_pooling_model(folder, request.param, "classifier", num_labels=1)
        # An encoder takes a whole prompt per step: the step holds max_model_len tokens.
        engine, srv = serve(path, **({"max_num_batched_tokens": 256} if request.param == "bert" else {}))
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield path, c, request.param
    srv.stop()
    engine.shutdown()


def hf_last_hidden(path, text):
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).float().eval()
    with torch.no_grad():
        h = model(torch.tensor([tok(text)["input_ids"]])).last_hidden_state[0, -1].numpy()
    return h


def test_embeddings_openai_client(embedder):
    import openai

    path, srv, _ = embedder
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    texts = ["w5 w6 w7", "w9 w10 w11 w12 w13"]
    res = client.embeddings.create(model="m", input=texts)
    assert [d.index for d in res.data] == [0, 1] and res.model == "m"
    assert res.usage.prompt_tokens == res.usage.total_tokens == 8
    want = hf_last_hidden(path, texts[1])
    np.testing.assert_allclose(res.data[1].embedding, want / np.linalg.norm(want), atol=1e-5)
    # Asked for explicitly, the client hands base64 over as the string it got.
    b64 = client.embeddings.create(model="m", input=texts, encoding_format="base64")
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(b64.data[1].embedding), "<f4"), res.data[1].embedding,
                               atol=1e-7)
    short = client.embeddings.create(model="m", input=texts[1], dimensions=16)
    assert len(short.data[0].embedding) == 16


def test_embedding_request_shapes_and_errors(embedder):
    _, _, http = embedder
    r = http.post("/v1/embeddings", json={"input": [5, 6, 7], "encoding_format": "base64"})
    assert r.status_code == 200
    vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), "<f4")
    assert vec.shape == (64,) and abs(np.linalg.norm(vec) - 1) < 1e-5
    r = http.post("/v1/embeddings", json={"input": [[5, 6], [7, 8, 9]]})
    assert len(r.json()["data"]) == 2
    r = http.post("/v1/embeddings", json={"input": "w5 " * 300, "truncate_prompt_tokens": 10})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 10
    r = http.post("/pooling", json={"input": "w5 w6"})
    assert r.json()["data"][0]["object"] == "pooling" and len(r.json()["data"][0]["data"]) == 64
    r = http.post("/score", json={"text_1": "w5 w6", "text_2": ["w5 w6", "w7 w8 w9"]})
    scores = [d["score"] for d in r.json()["data"]]
    assert abs(scores[0] - 1) < 1e-5 and scores[1] < 1
    for body, status, needle in [
        ({"input": "w5 " * 300}, 400, "longer than the maximum model length"),
        ({"input": "w5", "dimensions": 65}, 400, "at most the model's 64"),
        ({"input": "w5", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
        ({"input": []}, 400, "must not be empty"),
        ({"input": [1, 99999]}, 400, "out of vocabulary"),
    ]:
        r = http.post("/v1/embeddings", json=body)
        assert r.status_code == status and needle in r.json()["error"]["message"], r.text
    r = http.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2})
    assert r.status_code == 400 and "/v1/embeddings" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w5"}]})
    assert r.status_code == 400 and "pooling model" in r.json()["error"]["message"]
    r = http.post("/classify", json={"input": "w5"})
    assert r.status_code == 400 and "/v1/embeddings" in r.json()["error"]["message"]
    assert http.get("/v1/models").json()["data"][0]["id"] == "m"


def test_rerank_and_score_order_as_hf(reranker):
    import torch
    import transformers

    path, http, kind = reranker
    tok = transformers.AutoTokenizer.from_pretrained(path)
    query, docs = "w5 w6 w7", ["w8 w9", "w10 w11 w12 w13", "w14", "w15 w16 w17 w18 w19 w20"]
    with torch.no_grad():
        if kind == "qwen3-tokens":  # P("w9") of the softmax over the logits of "w7" and "w9"
            hf = transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()
            want = [float(torch.softmax(hf(**tok(query, text_pair=d, return_tensors="pt")).logits[0, -1, [7, 9]],
                                        0)[1]) for d in docs]
        else:
            hf = transformers.AutoModelForSequenceClassification.from_pretrained(path).float().eval()
            want = [float(torch.sigmoid(hf(**tok(query, text_pair=d, return_tensors="pt")).logits[0, 0]))
                    for d in docs]
    r = http.post("/score", json={"text_1": query, "text_2": docs})
    np.testing.assert_allclose([d["score"] for d in r.json()["data"]], want, atol=1e-5)
    for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = http.post(route, json={"query": query, "documents": docs, "top_n": 3})
        results = r.json()["results"]
        assert [x["index"] for x in results] == np.argsort(want)[::-1][:3].tolist()
        assert results[0]["document"]["text"] == docs[results[0]["index"]]
    r = http.post("/classify", json={"input": ["w5 w6", "w7"]})
    assert r.json()["data"][0]["num_classes"] == 1 and r.json()["data"][0]["label"] == "LABEL_0"
    r = http.post("/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text_1"
    r = http.post("/v1/embeddings", json={"input": "w5"})
    assert r.status_code == 400 and "/classify" in r.json()["error"]["message"]


def test_generative_model_refuses_pooling_routes(tiny_async_llm):
    srv = RunningServer(build_app(tiny_async_llm, "tiny"))
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            for route, body in [("/v1/embeddings", {"input": "w5"}), ("/classify", {"input": "w5"}),
                                ("/rerank", {"query": "w5", "documents": ["w6"]})]:
                r = c.post(route, json=body)
                assert r.status_code == 400 and "/v1/completions" in r.json()["error"]["message"], r.text
    finally:
        srv.stop()
