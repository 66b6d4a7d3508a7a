"""The FastAPI app: OpenAI-compatible routes over one AsyncLLM."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import jaxserve
from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.tracing import trace_headers_of
from server.errors import APIError, engine_dead, internal_error, parse_body
from server.lifecycle import install_draining
from server.limits import ServerLimits
from server.lora_routes import LoRARegistry, install_lora_routes, runtime_lora_updating
from server.metrics import PrometheusStatLogger
from server.middleware import install_limits
from server.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from server.serving_chat import OpenAIServingChat
from server.serving_completion import OpenAIServingCompletion
from server.serving_messages import CountTokensRequest, MessagesRequest, OpenAIServingMessages, anthropic_error
from server.serving_engine import TRACE_HEADERS
from server.serving_pooling import ROUTES, OpenAIServingPooling
from server.serving_responses import OpenAIServingResponses, ResponsesRequest
from server.serving_tokenization import OpenAIServingTokenization
from server.tool_parsers import get_tool_parser
from server.weight_routes import install_weight_routes, weight_updates_enabled

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


class RequestIdHeader:
    """ASGI middleware: a request's ``X-Request-Id`` header comes back on its response
    (whatever the route or status, streams included)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = next((v for k, v in scope.get("headers", ()) if k.lower() == b"x-request-id"), None)
        if rid is None:
            return await self.app(scope, receive, send)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"]
                message = {**message, "headers": headers + [(b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class HeadAsGet:
    """ASGI middleware: HEAD is answered on every GET route (200 and the GET's headers,
    no body), as load balancers and health checkers expect."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def send_headers_only(message):
            if message["type"] == "http.response.body":
                if message.get("more_body"):
                    return
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, send_headers_only)


def load_chat_template(chat_template: str | None) -> str | None:
    """--chat-template: a file's path, or the Jinja template itself."""
    if chat_template is None:
        return None
    if os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as f:
            return f.read()
    if any(c in chat_template for c in "{}\n"):
        return chat_template
    raise ValueError(f"--chat-template {chat_template!r} is neither a file nor a Jinja template")


_DROP = object()


def _json_ready(value, *, token_dicts: bool = False):
    """Tokenizer init kwargs as JSON, as tokenizer_config.json writes them: an AddedToken
    is its text (``token_dicts``: its dict of content / special / ...); values JSON
    cannot hold (objects) are dropped."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        items = ((str(k), _json_ready(v, token_dicts=token_dicts)) for k, v in value.items())
        return {k: v for k, v in items if v is not _DROP}
    if isinstance(value, (list, tuple)):
        return [v for v in (_json_ready(x, token_dicts=token_dicts) for x in value) if v is not _DROP]
    content = getattr(value, "content", None)
    if isinstance(content, str):  # tokenizers.AddedToken
        state = value.__getstate__() if token_dicts and hasattr(value, "__getstate__") else None
        return _json_ready(state) if isinstance(state, dict) else content
    return _DROP


def tokenizer_info(tokenizer, chat_template: str | None) -> dict[str, Any]:
    """GET /tokenizer_info (vLLM's shape): the tokenizer's init config (its
    tokenizer_config.json) without file paths, plus ``tokenizer_class`` and the chat
    template (--chat-template, else the tokenizer's)."""
    config = dict(getattr(tokenizer, "init_kwargs", None) or {})
    for key in ("vocab_file", "merges_file", "tokenizer_file"):
        config.pop(key, None)
    added = config.pop("added_tokens_decoder", None)
    config = _json_ready(config)
    if added is not None:
        config["added_tokens_decoder"] = _json_ready(added, token_dicts=True)
    config["tokenizer_class"] = type(tokenizer).__name__
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template:
        config["chat_template"] = template
    return config


@dataclasses.dataclass(frozen=True)
class CORSSettings:
    """--allowed-origins / --allowed-methods / --allowed-headers / --allow-credentials (vLLM's defaults)."""

    allowed_origins: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


def build_app(async_llm: AsyncLLM, served_model_name: str, *, api_key: str | None = None,
              max_model_len: int | None = None, enable_prompt_tokens_details: bool = False,
              disable_log_requests: bool = True,
              default_sampling_params: dict[str, Any] | None = None,
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None, chat_template: str | None = None,
              enable_tokenizer_info_endpoint: bool = False, limits: ServerLimits | None = None,
              enable_weight_updates: bool = False, lora_modules: list | None = None,
              cors: CORSSettings | None = None, root_path: str = "", disable_fastapi_docs: bool = False) -> FastAPI:
    """An OpenAI-compatible app over ``async_llm``. With ``api_key``, every /v1 route
    needs ``Authorization: Bearer <api_key>`` (HTTP 401 otherwise). Sampling fields a
    request leaves out come from ``default_sampling_params`` (default: the model's
    generation config, ``ModelConfig.get_diff_sampling_param()``), then OpenAI's defaults.

    Tools: ``tool_call_parser`` (server/tool_parsers) reads the model's tool calls;
    ``enable_auto_tool_choice`` (which needs it) allows tool_choice="auto". The
    reasoning parser defaults to the engine's (--reasoning-parser). ``chat_template``
    (a path or the template) replaces the tokenizer's. ``enable_tokenizer_info_endpoint``
    adds GET /tokenizer_info. ``limits`` (server/limits.py): body size, --protect-all-routes,
    --trust-request-chat-template. ``enable_weight_updates`` (or VLLM_SERVER_DEV_MODE=1):
    the research loop's routes (server/weight_routes.py). ``lora_modules``
    (server/lora_routes.py LoRAModulePath): adapters served from the start (needs an
    engine with LoRA on); VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 adds the load / unload routes.
    ``cors``: the CORS policy (vLLM's default: any origin, method and header, no
    credentials); ``root_path``: the path prefix a proxy serves the app under;
    ``disable_fastapi_docs``: no /docs, /redoc or /openapi.json."""
    max_model_len = max_model_len or async_llm.max_model_len
    if default_sampling_params is None:
        default_sampling_params = async_llm.model_config.get_diff_sampling_param()
    if enable_auto_tool_choice and not tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    tokenizer = async_llm.get_tokenizer()
    tool_parser = get_tool_parser(tool_call_parser)(tokenizer) if tool_call_parser else None
    if reasoning_parser is None:
        so_config = getattr(getattr(async_llm, "config", None), "structured_outputs_config", None)
        reasoning_parser = getattr(so_config, "reasoning_parser", None)
    reasoner = None
    if reasoning_parser:
        from jaxserve.reasoning import get_reasoning_parser

        reasoner = get_reasoning_parser(reasoning_parser)(tokenizer)
    chat_template = load_chat_template(chat_template)
    lora_registry = None
    if getattr(getattr(async_llm, "config", None), "lora_config", None) is not None:
        lora_registry = LoRARegistry(async_llm, served_model_name)
        lora_registry.load_at_start(lora_modules or [])
    elif lora_modules:
        raise ValueError("--lora-modules needs --enable-lora")
    docs = dict(openapi_url=None, docs_url=None, redoc_url=None) if disable_fastapi_docs else {}
    app = FastAPI(title="jaxserve", version=jaxserve.__version__, root_path=root_path, **docs)
    install_draining(app)  # 503 on /v1 once a graceful shutdown began (server/lifecycle.py)
    kwargs = {"max_model_len": max_model_len, "enable_prompt_tokens_details": enable_prompt_tokens_details,
              "default_sampling_params": default_sampling_params, "chat_template": chat_template,
              "limits": limits or ServerLimits(), "lora_registry": lora_registry}
    serving_completion = OpenAIServingCompletion(async_llm, served_model_name, **kwargs)
    serving_chat = OpenAIServingChat(async_llm, served_model_name, tool_parser=tool_parser,
                                     enable_auto_tools=enable_auto_tool_choice, reasoning_parser=reasoner, **kwargs)
    serving_tokenization = OpenAIServingTokenization(async_llm, served_model_name, **kwargs)
    serving_pooling = OpenAIServingPooling(async_llm, served_model_name, **kwargs)
    pooler = getattr(async_llm.model_config, "pooler_config", None)
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
            # The first field name (not "body", an index or a union member's tag).
            loc = [x for x in errors[0].get("loc", ()) if isinstance(x, str) and x.isidentifier() and x != "body"]
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

    # ------------------------------------------------------------------ auth, body size / type
    install_limits(app, kwargs["limits"], api_key=api_key)

    # ------------------------------------------------------------------ routes
    def respond(result):
        if result is None:  # the client went away
            return Response(status_code=499)
        if hasattr(result, "__aiter__"):
            return SSEResponse(result, media_type="text/event-stream")
        return JSONResponse(result if isinstance(result, dict) else result.model_dump())

    async def generate(kind: str, create, request, raw_request: Request):
        """A generation route's body: log the request, run ``create(request, raw_request)``
        (cancelled if the client disconnects first) and respond with its response or SSE
        stream."""
        if is_sleeping():
            raise APIError("The engine is asleep (sleep mode); POST /wake_up first", 503)
        if pooler is not None and kind in ("completion", "chat", "messages", "responses"):
            raise APIError(f"this is a pooling model ({pooler.task}): it does not generate text; use "
                           f"{ROUTES[pooler.task]}", 400)
        if not disable_log_requests:
            logger.info("%s request: %s", kind, request.model_dump_json(exclude_unset=True)[:1000])
        TRACE_HEADERS.set(trace_headers_of(raw_request.headers))
        return respond(await _with_cancellation(create(request, raw_request), raw_request))

    def is_sleeping() -> bool:
        return bool(getattr(async_llm, "is_sleeping", lambda: False)())

    def weights_version() -> int:
        return getattr(async_llm, "weights_version", 0)

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
        card = ModelCard(id=served_model_name, created=created, root=model_root, max_model_len=max_model_len,
                         weights_version=weights_version())
        adapters = lora_registry.cards() if lora_registry is not None else []
        return JSONResponse(ModelList(data=[card, *adapters]).model_dump())

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request):
        return await generate("completion", serving_completion.create_completion, request, raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request):
        return await generate("chat", serving_chat.create_chat_completion, request, raw_request)

    # OpenAI's Responses API (server/serving_responses.py).
    serving_responses = OpenAIServingResponses(serving_chat)

    @app.post("/v1/responses")
    async def responses(request: ResponsesRequest, raw_request: Request):
        return await generate("responses", serving_responses.create_response, request, raw_request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return JSONResponse(serving_responses.retrieve(response_id))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return JSONResponse(await serving_responses.cancel(response_id))

    # Anthropic's Messages API (server/serving_messages.py): its own error envelope.
    serving_messages = OpenAIServingMessages(serving_chat)

    async def anthropic_body(raw_request: Request, model):
        try:
            body = await raw_request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"The body is not valid JSON: {e}", 400) from None
        return parse_body(model, body)

    @app.post("/v1/messages")
    async def messages(raw_request: Request):
        try:
            request = await anthropic_body(raw_request, MessagesRequest)
            return await generate("messages", serving_messages.create_message, request, raw_request)
        except APIError as e:
            return anthropic_error(e)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(raw_request: Request):
        try:
            return JSONResponse(await serving_messages.count_tokens(
                await anthropic_body(raw_request, CountTokensRequest)))
        except APIError as e:
            return anthropic_error(e)

    async def pool(kind: str, create, request, raw_request: Request):
        """A pooling route's body: generate()'s, with ``create(request)``."""
        return await generate(kind, lambda r, _raw: create(r), request, raw_request)

    @app.post("/v1/embeddings")
    async def embeddings(request: EmbeddingRequest, raw_request: Request):
        return await pool("embeddings", serving_pooling.create_embedding, request, raw_request)

    @app.post("/pooling")
    async def pooling(request: PoolingRequest, raw_request: Request):
        return await pool("pooling", serving_pooling.create_pooling, request, raw_request)

    @app.post("/classify")
    async def classify(request: ClassificationRequest, raw_request: Request):
        return await pool("classify", serving_pooling.create_classify, request, raw_request)

    @app.post("/score")
    @app.post("/v1/score")
    async def score(request: ScoreRequest, raw_request: Request):
        return await pool("score", serving_pooling.create_score, request, raw_request)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(request: RerankRequest, raw_request: Request):
        return await pool("rerank", serving_pooling.create_rerank, request, raw_request)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest):
        return JSONResponse(serving_tokenization.create_tokenize(request).model_dump())

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        return JSONResponse(serving_tokenization.create_detokenize(request).model_dump())

    @app.get("/metrics")
    async def metrics():
        stat_logger.set_gauges(async_llm.get_stats())
        stat_logger.gauge_weights_version.set(weights_version())
        return Response(generate_latest(stat_logger.registry), media_type=CONTENT_TYPE_LATEST)

    if enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def get_tokenizer_info():
            return JSONResponse(tokenizer_info(serving_tokenization.tokenizer, chat_template))

    if weight_updates_enabled(enable_weight_updates):
        install_weight_routes(app, async_llm)
    if lora_registry is not None and runtime_lora_updating():
        install_lora_routes(app, lora_registry)

    # Outermost last: HEAD becomes GET before anything else sees it; CORS answers a
    # browser's preflight (OPTIONS) before authentication, and adds its headers to every answer.
    app.add_middleware(RequestIdHeader)
    app.add_middleware(HeadAsGet)
    cors = cors or CORSSettings()
    app.add_middleware(CORSMiddleware, allow_origins=cors.allowed_origins, allow_methods=cors.allowed_methods,
                       allow_headers=cors.allowed_headers, allow_credentials=cors.allow_credentials)
    return app

