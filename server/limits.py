"""What the server accepts from a client it does not trust: request size, shape and
authentication.

Two layers, one place per check:

- the ASGI middleware (server/middleware.py, ``install_limits``), before any route
  runs: the API key (constant-time) and the request body's size (HTTP 413, whether
  the client sends a Content-Length or a chunked body) and media type (HTTP 400
  unless JSON);
- the request models (server/protocol.py), with the bounds below: no string holds a
  lone surrogate, no JSON value nests deeper than ``MAX_JSON_DEPTH``, lists of stop
  strings, prompts, messages and tools have a maximum length. A violation is an
  HTTP 400 whose ``param`` names the field (server/app.py's RequestValidationError
  handler).

Limits that depend on the engine (n <= max_num_seqs, prompt + max_tokens <=
max_model_len, logprobs <= max_logprobs, token ids in the vocabulary) are checked
by the serving code and the engine's InputProcessor. Who needs the API key, and how
it is compared, is server/middleware.py's.

Flags (``add_limits_args``; ``limits_from_args`` turns them into a ``ServerLimits``):

--max-request-body-bytes N   largest request body (default 32 MiB; 0: no limit).
--protect-all-routes         with --api-key, every route needs the key (metrics,
                             health, version and the OpenAPI docs too).
--trust-request-chat-template  accept a request's own ``chat_template`` (vLLM's flag;
                             off by default: a client's Jinja runs in the server's
                             event loop, and a nested loop or a huge string holds it
                             for seconds or minutes).
--allowed-media-domains H..  hosts an http(s) image_url may come from (default any).
--allowed-local-media-path D  a folder file:// image URLs may read (default none).
"""
from __future__ import annotations

from dataclasses import dataclass

# ----------------------------------------------------------------------------- bounds
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20
# JSON containers (objects / arrays) nested inside one request field: message content,
# tool definitions, response_format / structured_outputs / guided_json schemas,
# chat_template_kwargs, tool_choice. 32 holds a schema of ~14 nested objects (each
# object level is "properties" + the property); OpenAI allows 5 for structured outputs.
# Deeper values overflow Python's recursion in deepcopy / json / the grammar compilers.
MAX_JSON_DEPTH = 32
# Stop strings are matched against every new piece of text of every running request:
# their number and length are the cost per token (OpenAI allows 4).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
# Prompts in one /v1/completions request (each becomes an engine request).
MAX_PROMPTS = 1024
# Messages of one chat request: the chat template loops over them in the event loop.
MAX_MESSAGES = 4096
# Tools of one chat request (OpenAI's limit).
MAX_TOOLS = 128
# Token ids the engine's int32 arrays hold (top_k, token ids).
INT32_MAX = 2**31 - 1

@dataclass(frozen=True)
class ServerLimits:
    """The server's configurable limits (the flags of ``add_limits_args``)."""

    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES  # 0: no limit
    protect_all_routes: bool = False
    trust_request_chat_template: bool = False
    # Image parts' URLs (jaxserve/multimodal/media.py): the hosts http(s) images may come
    # from (None: any), the folder local files may come from (None: none).
    allowed_media_domains: tuple[str, ...] | None = None
    allowed_local_media_path: str | None = None

    def __post_init__(self) -> None:
        if self.max_request_body_bytes < 0:
            raise ValueError("--max-request-body-bytes must be >= 0 (0: no limit)")


def add_limits_args(parser_group) -> None:
    """The limit flags, on an argparse parser or argument group."""
    parser_group.add_argument(
        "--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="Largest request body in bytes; a larger one (by Content-Length, or counted as a chunked body "
             "arrives) is answered HTTP 413 before it is parsed. 0: no limit (default: %(default)s, 32 MiB).")
    parser_group.add_argument(
        "--protect-all-routes", action="store_true",
        help="With --api-key, require the key on every route: /health, /metrics, /version and the OpenAPI "
             "docs too (by default they stay open, as in vLLM, for probes and scrapers).")
    parser_group.add_argument(
        "--trust-request-chat-template", action="store_true",
        help="Accept a chat_template given in a request (vLLM's flag). Off by default: a client's template "
             "runs in the server's event loop and can hold it for minutes.")
    parser_group.add_argument(
        "--allowed-media-domains", nargs="+", default=None,
        help="Vision-language models: the only hosts an http(s) image_url may be fetched from (default: any).")
    parser_group.add_argument(
        "--allowed-local-media-path", default=None,
        help="Vision-language models: a folder whose files an image_url may name (file://...; default: none).")


def limits_from_args(args) -> ServerLimits:
    """argparse namespace -> ServerLimits (flags that are absent keep their defaults).
    ValueError for flags that cannot start (call it before the engine loads)."""
    defaults = ServerLimits()
    limits = ServerLimits(
        max_request_body_bytes=getattr(args, "max_request_body_bytes", defaults.max_request_body_bytes),
        protect_all_routes=getattr(args, "protect_all_routes", defaults.protect_all_routes),
        trust_request_chat_template=getattr(args, "trust_request_chat_template",
                                            defaults.trust_request_chat_template),
        allowed_media_domains=(tuple(d.lower() for d in args.allowed_media_domains)
                               if getattr(args, "allowed_media_domains", None) else None),
        allowed_local_media_path=getattr(args, "allowed_local_media_path", None))
    if limits.protect_all_routes and not getattr(args, "api_key", None):
        raise ValueError("--protect-all-routes requires --api-key")
    return limits
