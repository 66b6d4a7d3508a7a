"""The pooling routes (docs/pooling.md), vLLM's shapes: POST /v1/embeddings, /pooling,
/classify, /score (/v1/score) and /rerank (/v1/rerank, /v2/rerank), over AsyncLLM.encode.
Each input of a request is one engine request; they run together."""
from __future__ import annotations

import asyncio
import base64
import time
from pathlib import Path

import numpy as np

from jaxserve.pooling_params import PoolingParams
from models.config import read_hf_config
from server.errors import APIError, bad_request, engine_error, guess_param
from server.protocol import (ClassificationRequest, EmbeddingRequest, PoolingRequest, RerankRequest, ScoreRequest,
                             random_uuid)
from server.serving_engine import TRACE_HEADERS, OpenAIServing

# The route each kind of model answers, for the 400 a wrong route gets.
ROUTES = {"embed": "/v1/embeddings (or /pooling, /score, /rerank)",
          "classify": "/classify (or /pooling; /score and /rerank with one label)"}


def as_inputs(value) -> list:
    """An API ``input`` -> engine prompts: a text, texts, token ids or lists of them."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise bad_request("input must not be empty", "input")
    if all(isinstance(v, int) for v in value):
        return [{"prompt_token_ids": value}]
    return [v if isinstance(v, str) else {"prompt_token_ids": v} for v in value]


def encode_vector(x: np.ndarray, fmt: str):
    """A vector as the API sends it: floats, or base64 of its little-endian float32 bytes (OpenAI's)."""
    if fmt == "base64":
        return base64.b64encode(np.asarray(x, "<f4").tobytes()).decode()
    return np.asarray(x, np.float32).tolist()


class OpenAIServingPooling(OpenAIServing):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        mc = self.engine_client.model_config
        self.pooler = getattr(mc, "pooler_config", None)
        folder = Path(str(getattr(mc, "model", "")))
        cfg = (read_hf_config(folder, getattr(mc, "hf_overrides", None))
               if self.pooler is not None and (folder / "config.json").is_file() else {})
        labels = {int(k): v for k, v in (cfg.get("id2label") or {}).items()}
        n = getattr(self.pooler, "num_labels", len(labels))
        # A classifier made of lm_head rows (classifier_from_token) has its own number of
        # labels: HF's default names then, as vLLM's config update gives them.
        self.id2label = labels if len(labels) == n else {i: f"LABEL_{i}" for i in range(n)}

    def check_task(self, task: str, route: str) -> None:
        """400 naming the route to use when this model does not serve ``task``."""
        if self.pooler is None:
            raise bad_request(f"{route}: this model generates text (runner generate); use /v1/completions or "
                              f"/v1/chat/completions")
        ok = {"embed": self.pooler.task == "embed", "classify": self.pooler.task == "classify",
              "score": self.pooler.task == "embed" or self.pooler.num_labels == 1, "encode": True}[task]
        if not ok:
            raise bad_request(f"{route}: this is a {self.pooler.task} model; use {ROUTES[self.pooler.task]}")

    async def _encode_all(self, prompts: list, params: PoolingParams, request, fields) -> list:
        """Run every prompt; a bad input is a 400 naming its field, as generation's are."""
        self.check_model(request.model)
        base = f"{random_uuid()}"
        try:
            return await asyncio.gather(*(
                self.engine_client.encode(p, params, f"{base}-{i}", priority=request.priority,
                                          add_special_tokens=request.add_special_tokens,
                                          trace_headers=TRACE_HEADERS.get())
                for i, p in enumerate(prompts)))
        except (ValueError, TypeError) as e:
            raise bad_request(str(e), guess_param(str(e), fields)) from e
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 — the engine's failures, as the other routes map them
            raise engine_error(e) from e

    def _params(self, request, **kw) -> PoolingParams:
        try:
            return PoolingParams(truncate_prompt_tokens=request.truncate_prompt_tokens, **kw)
        except ValueError as e:
            raise bad_request(str(e), guess_param(str(e), type(request).model_fields)) from e

    def _response(self, kind: str, data: list, outs) -> dict:
        n = sum(len(o.prompt_token_ids) for o in outs)
        return {"id": f"{kind}-{random_uuid()}", "object": "list", "created": int(time.time()),
                "model": self.served_model_name, "data": data,
                "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}}

    async def create_embedding(self, request: EmbeddingRequest) -> dict:
        self.check_task("embed", "/v1/embeddings")
        params = self._params(request, task="embed", dimensions=request.dimensions, normalize=request.normalize)
        outs = await self._encode_all(as_inputs(request.input), params, request, EmbeddingRequest.model_fields)
        data = [{"index": i, "object": "embedding", "embedding": encode_vector(o.outputs.data, request.encoding_format)}
                for i, o in enumerate(outs)]
        return self._response("embd", data, outs)

    async def create_pooling(self, request: PoolingRequest) -> dict:
        self.check_task("encode", "/pooling")
        outs = await self._encode_all(as_inputs(request.input), self._params(request, task="encode"), request,
                                      PoolingRequest.model_fields)
        data = [{"index": i, "object": "pooling", "data": encode_vector(o.outputs.data, request.encoding_format)}
                for i, o in enumerate(outs)]
        return self._response("pool", data, outs)

    async def create_classify(self, request: ClassificationRequest) -> dict:
        self.check_task("classify", "/classify")
        params = self._params(request, task="classify", use_activation=request.use_activation)
        outs = await self._encode_all(as_inputs(request.input), params, request, ClassificationRequest.model_fields)
        data = []
        for i, o in enumerate(outs):
            probs = o.outputs.data.tolist()
            best = int(np.argmax(probs))
            data.append({"index": i, "label": self.id2label.get(best, str(best)), "probs": probs,
                         "num_classes": len(probs)})
        return self._response("classify", data, outs)

    async def scores(self, text_1: list[str], text_2: list[str], request, fields) -> tuple[list[float], list]:
        """Scores of the pairs (text_1[i], text_2[i]) (LLM.score's rules: a cross-encoder
        reads each pair as one input; an embedding model takes the cosine)."""
        if self.pooler.task == "classify":
            params = self._params(request, task="score", use_activation=getattr(request, "use_activation", None))
            outs = await self._encode_all(list(zip(text_1, text_2)), params, request, fields)
            return [float(o.outputs.data[0]) for o in outs], outs
        params = self._params(request, task="score", normalize=True)
        outs = await self._encode_all(text_1 + text_2, params, request, fields)
        n = len(text_1)
        return [float(np.dot(a.outputs.data, b.outputs.data)) for a, b in zip(outs[:n], outs[n:])], outs

    async def create_score(self, request: ScoreRequest) -> dict:
        self.check_task("score", "/score")
        t1 = [request.text_1] if isinstance(request.text_1, str) else list(request.text_1)
        t2 = [request.text_2] if isinstance(request.text_2, str) else list(request.text_2)
        if not t1 or not t2:
            raise bad_request("text_1 and text_2 need at least one text each", "text_1" if not t1 else "text_2")
        if len(t1) == 1:
            t1 = t1 * len(t2)
        if len(t1) != len(t2):
            raise bad_request(f"text_1 has {len(t1)} texts and text_2 {len(t2)}: send one text_1, or as many as "
                              f"text_2", "text_1")
        scores, outs = await self.scores(t1, t2, request, ScoreRequest.model_fields)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return self._response("score", data, outs)

    async def create_rerank(self, request: RerankRequest) -> dict:
        self.check_task("score", "/rerank")
        if not request.documents:
            raise bad_request("documents must not be empty", "documents")
        scores, outs = await self.scores([request.query] * len(request.documents), list(request.documents), request,
                                         RerankRequest.model_fields)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if request.top_n > 0:
            order = order[:request.top_n]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": request.documents[i]}} if request.return_documents else {})}
                   for i in order]
        n = sum(len(o.prompt_token_ids) for o in outs)
        return {"id": f"rerank-{random_uuid()}", "model": self.served_model_name, "usage": {"total_tokens": n},
                "results": results}
