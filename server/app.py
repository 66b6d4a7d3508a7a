"""The FastAPI app: OpenAI-compatible routes over one AsyncLLM."""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import jaxserve
from jaxserve.engine.async_llm import AsyncLLM
from server.errors import APIError, engine_dead, internal_error
from server.metrics import PrometheusStatLogger
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from server.serving_chat import OpenAIServingChat
from server.serving_completion import OpenAIServingCompletion
from server.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger("jaxserve.server")


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, so a client that
    disconnects mid-stream aborts its engine request at once (not when the iterator is
    garbage-collected)."""

    media_type = "text/event-stream"

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def _listen_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _with_cancellation(coro, request: Request):
    """Run a handler; cancel it if the client disconnects first (aborting its requests).
    Returns None when cancelled."""
    handler = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_listen_for_disconnect(request))
    try:
        done, _ = await asyncio.wait([handler, watcher], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        handler.cancel()
        watcher.cancel()
        raise
    if handler in done:
        watcher.cancel()
        return handler.result()
    handler.cancel()
    await asyncio.gather(handler, return_exceptions=True)
    logger.info("client disconnected: request cancelled")
    return None


def build_app(async_llm: AsyncLLM, served_model_name: str, *, api_key: str | None = None,
              max_model_len: int | None = None, enable_prompt_tokens_details: bool = False,
              disable_log_requests: bool = True,
              default_sampling_params: dict[str, Any] | None = None) -> FastAPI:
    """An OpenAI-compatible app over ``async_llm``. With ``api_key``, every /v1 route
    needs ``Authorization: Bearer <api_key>`` (HTTP 401 otherwise). Sampling fields a
    request leaves out come from ``default_sampling_params`` (default: the model's
    generation config, ``ModelConfig.get_diff_sampling_param()``), then OpenAI's defaults."""
    max_model_len = max_model_len or async_llm.max_model_len
    if default_sampling_params is None:
        default_sampling_params = async_llm.model_config.get_diff_sampling_param()
    app = FastAPI(title="jaxserve", version=jaxserve.__version__)
    kwargs = dict(max_model_len=max_model_len, enable_prompt_tokens_details=enable_prompt_tokens_details,
                  default_sampling_params=default_sampling_params)
    serving_completion = OpenAIServingCompletion(async_llm, served_model_name, **kwargs)
    serving_chat = OpenAIServingChat(async_llm, served_model_name, **kwargs)
    serving_tokenization = OpenAIServingTokenization(async_llm, served_model_name, **kwargs)
    stat_logger = PrometheusStatLogger(served_model_name, max_model_len)
    async_llm.stat_loggers.append(stat_logger)
    created = int(time.time())
    model_root = async_llm.model_config.model
    app.state.async_llm = async_llm
    app.state.stat_logger = stat_logger
    app.state.served_model_name = served_model_name

    # ------------------------------------------------------------------ errors
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.to_json_response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        param = None
        if errors:
            loc = [str(x) for x in errors[0].get("loc", ()) if x != "body"]
            param = loc[0] if loc else None
        message = json.dumps([{"type": e.get("type"), "loc": list(e.get("loc", ())), "msg": e.get("msg")}
                              for e in errors], default=str)
        return APIError(message, 400, param).to_json_response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return APIError(str(exc.detail), exc.status_code).to_json_response()

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception):
        logger.exception("unhandled error")
        return internal_error(exc).to_json_response()

    # ------------------------------------------------------------------ auth
    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def _authenticate(request: Request, call_next):
            if request.method != "OPTIONS" and request.url.path.startswith("/v1"):
                got = request.headers.get("Authorization", "").encode()
                if not secrets.compare_digest(got, expected):
                    return APIError("Unauthorized: a valid API key is required.", 401).to_json_response()
            return await call_next(request)

    # ------------------------------------------------------------------ routes
    def respond(result):
        if result is None:  # the client went away
            return Response(status_code=499)
        if hasattr(result, "__aiter__"):
            return SSEResponse(result, media_type="text/event-stream")
        return JSONResponse(result.model_dump())

    async def generate(kind: str, create, request, raw_request: Request):
        """A generation route's body: log the request, run ``create(request)`` (cancelled
        if the client disconnects first) and respond with its response or SSE stream."""
        if not disable_log_requests:
            logger.info("%s request: %s", kind, request.model_dump_json(exclude_unset=True)[:1000])
        return respond(await _with_cancellation(create(request), raw_request))

    @app.get("/health")
    async def health():
        if async_llm.errored:
            return engine_dead().to_json_response()
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": jaxserve.__version__}

    @app.get("/v1/models")
    async def models():
        card = ModelCard(id=served_model_name, created=created, root=model_root, max_model_len=max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request):
        return await generate("completion", serving_completion.create_completion, request, raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request):
        return await generate("chat", serving_chat.create_chat_completion, request, raw_request)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeChatRequest | TokenizeCompletionRequest):
        return JSONResponse(serving_tokenization.create_tokenize(request).model_dump())

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        return JSONResponse(serving_tokenization.create_detokenize(request).model_dump())

    @app.get("/metrics")
    async def metrics():
        stat_logger.set_gauges(async_llm.get_stats())
        return Response(generate_latest(stat_logger.registry), media_type=CONTENT_TYPE_LATEST)

    return app
