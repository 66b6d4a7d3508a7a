"""The ASGI middleware that applies server/limits.py's limits before any route runs:
the API key, then the request body's size and media type, and the OpenAPI schema that
documents the answers (400 with the error envelope, 413, 401).

Authentication (with --api-key, vLLM's rules plus the tokenizer routes): every path
under /v1, /tokenize, /detokenize and /tokenizer_info, and the research loop's routes
(WEIGHT_ROUTES) need
``Authorization: Bearer <key>`` (HTTP 401 with the error envelope otherwise; the
scheme is case-insensitive). vLLM leaves the tokenizer routes open (its security
guide lists them as unprotected); jaxserve does not, since they run client input
through the tokenizer and the chat template. /health, /metrics, /version and the
OpenAPI docs stay open unless --protect-all-routes. OPTIONS (CORS preflight) is
never checked. Both the given and the expected key are hashed (SHA-256) before
``secrets.compare_digest``, so the comparison time says nothing about the key, not
even its length.
"""
from __future__ import annotations

import hashlib
import secrets

from server.errors import APIError
from server.limits import ServerLimits
from server.protocol import ErrorResponse

# Paths outside /v1 that the API key guards too (vLLM leaves them open).
# The research loop's routes (server/weight_routes.py) change what every client gets.
WEIGHT_ROUTES = frozenset({"/update_weights_from_disk", "/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache",
                           "/pause", "/resume", "/is_paused"})
PROTECTED_EXTRA_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info"}) | WEIGHT_ROUTES


def install_limits(app, limits: ServerLimits | None = None, *, api_key: str | None = None) -> None:
    """Add the limits middleware (authentication, body size and media type) to ``app``.
    Call it before the middlewares that must see a request first (HEAD -> GET)."""
    limits = limits or ServerLimits()
    if limits.protect_all_routes and not api_key:
        raise ValueError("--protect-all-routes requires --api-key")
    app.state.limits = limits
    app.add_middleware(LimitsMiddleware, limits=limits, api_key=api_key)
    _document_errors(app, limits, api_key)


def _document_errors(app, limits: ServerLimits, api_key: str | None) -> None:
    """The OpenAPI schema tells what the server answers: FastAPI documents a 422 for a
    body that does not validate, but the server answers 400 with the error envelope
    (vLLM's and OpenAI's), 413 for a body over the limit and 401 without the key."""
    generate = app.openapi

    def openapi():
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(error_schema.pop("$defs", {}))
        components["ErrorResponse"] = error_schema
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        envelope = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
        for path, item in schema.get("paths", {}).items():
            for operation in item.values():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                if "requestBody" in operation:
                    responses["400"] = {"description": "Bad request: the body or a field (``param``)", **envelope}
                    if limits.max_request_body_bytes:
                        responses["413"] = {"description": "Body over --max-request-body-bytes", **envelope}
                if api_key and (limits.protect_all_routes or path.startswith("/v1")
                                or path in PROTECTED_EXTRA_PATHS):
                    responses["401"] = {"description": "A valid API key is required", **envelope}
        return schema

    app.openapi = openapi


# ----------------------------------------------------------------------------- middleware
def _error(message: str, status: int, param: str | None = None, headers: dict[str, str] | None = None):
    response = APIError(message, status, param).to_json_response()
    for k, v in (headers or {}).items():
        response.headers[k] = v
    return response


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class LimitsMiddleware:
    """Pure ASGI (streams and disconnects pass through untouched): authentication,
    then the body's size and media type. A body is read here, counted as it arrives,
    and handed to the app whole; later receive() calls (disconnect) go to the server."""

    def __init__(self, app, limits: ServerLimits, api_key: str | None = None) -> None:
        self.app = app
        self.limits = limits
        self._key_digest = hashlib.sha256(api_key.encode()).digest() if api_key else None

    # ------------------------------------------------------------------ auth
    def _protected(self, scope) -> bool:
        if self.limits.protect_all_routes:
            return True
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        return path.startswith("/v1") or (path.rstrip("/") or "/") in PROTECTED_EXTRA_PATHS

    def _authorized(self, headers) -> bool:
        """``Authorization: Bearer <key>``, or Anthropic's ``x-api-key: <key>`` (its SDK's)."""
        value = next((v for k, v in headers if k.lower() == b"authorization"), b"")
        api_key = next((v for k, v in headers if k.lower() == b"x-api-key"), b"")
        scheme, _, token = value.strip().partition(b" ")
        # Always hash and compare both: the time taken does not depend on what was sent.
        bearer = secrets.compare_digest(hashlib.sha256(token.strip()).digest(), self._key_digest)
        header = secrets.compare_digest(hashlib.sha256(api_key.strip()).digest(), self._key_digest)
        return (bearer and scheme.lower() == b"bearer") or (header and bool(api_key.strip()))

    # ------------------------------------------------------------------ ASGI
    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope.get("headers", ())
        if (self._key_digest is not None and scope.get("method") != "OPTIONS" and self._protected(scope)
                and not self._authorized(headers)):
            return await _error("Unauthorized: a valid API key is required (Authorization: Bearer <key>).", 401,
                                headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        length = content_type = None
        chunked = False
        for k, v in headers:
            k = k.lower()
            if k == b"content-length":
                length = v
            elif k == b"content-type":
                content_type = v.decode("latin-1")
            elif k == b"transfer-encoding":
                chunked = b"chunked" in v.lower()
        limit = self.limits.max_request_body_bytes
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1
            if declared < 0:
                return await _error("Invalid Content-Length header.", 400)(scope, receive, send)
            if limit and declared > limit:
                return await self._too_large(scope, receive, send, limit)
        else:
            declared = 0
        if not declared and not chunked:
            return await self.app(scope, receive, send)
        if content_type is not None and not _is_json(content_type):
            return await _error(f"Unsupported Content-Type {content_type!r}: request bodies must be JSON "
                                "(Content-Type: application/json).", 400)(scope, receive, send)
        # Read the body here, counting (a chunked body has no Content-Length to check).
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if limit and size > limit:
                return await self._too_large(scope, receive, send, limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _too_large(scope, receive, send, limit: int) -> None:
        response = _error(f"Request body too large: the limit is {limit} bytes (--max-request-body-bytes).", 413)
        # The rest of the body is not read: close the connection rather than drain it.
        response.headers["Connection"] = "close"
        await response(scope, receive, send)

