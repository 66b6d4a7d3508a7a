"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}``, where code
is the integer HTTP status (as vLLM sends it)."""
from __future__ import annotations

import re
from http import HTTPStatus

from fastapi.responses import JSONResponse

from jaxserve.engine.exceptions import EngineDeadError, EngineOverloadedError, EngineStepError, StreamOverflowError
from jaxserve.outputs import RequestFailedError
from server.protocol import ErrorInfo, ErrorResponse

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """Raised by the serving code; the app turns it into the error envelope."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, err_type: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.headers = headers
        self.status = int(status)
        self.param = param
        self.type = err_type or _TYPES.get(self.status) or HTTPStatus(self.status).phrase.replace(" ", "") + "Error"

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.status))

    def to_json_response(self) -> JSONResponse:
        return JSONResponse(self.to_response().model_dump(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(message, 400, param)


def engine_dead(message: str = "The engine is dead.") -> APIError:
    return APIError(message, 503)


def internal_error(e: BaseException) -> APIError:
    return APIError(f"Internal server error: {e!r}", 500)


def engine_error(e: BaseException) -> APIError:
    """What a failure while serving a request is to the client: an APIError as it is,
    a dead engine 503, anything else 500."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineOverloadedError):
        return APIError(str(e), 503, headers={"Retry-After": str(e.retry_after)})
    if isinstance(e, EngineStepError):  # a step failed under this request: the error, then the engine is dead
        return APIError(f"Internal server error: {e}", 500)
    if isinstance(e, RequestFailedError) and e.client_error:  # e.g. a grammar that validates but cannot compile
        return bad_request(str(e))
    if isinstance(e, StreamOverflowError):
        return APIError(str(e), 408)
    if isinstance(e, EngineDeadError):
        return engine_dead(f"The engine is dead: {e}")
    return internal_error(e)


def error_event(e: BaseException) -> str:
    """The SSE event that reports ``e`` in a stream whose status (200) is already sent."""
    return f"data: {engine_error(e).to_response().model_dump_json()}\n\n"


def guess_param(message: str, fields) -> str | None:
    """The request field an engine ValueError is about: the first known field name
    that appears as a word in the message (messages start with the field's name)."""
    for word in re.findall(r"[A-Za-z_]+", message):
        if word in fields:
            return word
    return None


def parse_body(model, body):
    """A request body validated by the pydantic ``model`` outside FastAPI's own
    validation (the routes that answer in another envelope); a 400 naming the first bad field."""
    from pydantic import ValidationError

    try:
        return model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        raise bad_request(f"{loc}: {first.get('msg')}", loc.split(".")[0] or None) from None
