"""`jaxserve serve`: argparse setup and the entry point that starts the server.

jaxserve/cli.py wires it in::

    from server.cli_serve import add_serve_parser, run_serve
    add_serve_parser(subparsers)          # sets args.func = run_serve
    ...
    args.func(args)

``python -m server.cli_serve [serve] [MODEL] [options]`` runs it standalone.
"""
from __future__ import annotations

import argparse
import json
import logging
import ssl
import sys

from jaxserve.config import DEFAULT_ITERATION_TIMEOUT_S
from jaxserve.engine.arg_utils import EngineArgs
from server.limits import add_limits_args, limits_from_args
from server.lora_routes import parse_lora_modules

logger = logging.getLogger("jaxserve")


def _tool_parsers() -> list[str]:
    from server.tool_parsers import TOOL_PARSERS

    return sorted(TOOL_PARSERS)


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from e
    if not (isinstance(value, list) and all(isinstance(x, str) for x in value)):
        raise argparse.ArgumentTypeError('must be a JSON list of strings, e.g. \'["http://localhost:3000"]\'')
    return value


def ssl_settings(args: argparse.Namespace) -> dict:
    """uvicorn's TLS keywords from the flags ({} without --ssl-certfile: plain HTTP)."""
    if not args.ssl_certfile:
        return {}
    return dict(ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                ssl_cert_reqs=args.ssl_cert_reqs)


def check_serve_args(args: argparse.Namespace) -> None:
    """Flag combinations that cannot start (ValueError, before the engine loads)."""
    if getattr(args, "enable_auto_tool_choice", False) and not getattr(args, "tool_call_parser", None):
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    if getattr(args, "lora_modules", None):
        if not getattr(args, "enable_lora", False):
            raise ValueError("--lora-modules needs --enable-lora")
        parse_lora_modules(args.lora_modules)


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to an argparse subparsers object: the engine's flags
    (EngineArgs, vLLM's names) plus the server's own."""
    p = subparsers.add_parser(
        "serve", help="Start the OpenAI-compatible API server.",
        description="Start the OpenAI-compatible API server (vLLM's argument names).")
    EngineArgs.add_cli_args(p)
    # A server answers sooner and compiles its larger steps while it serves.
    p.set_defaults(background_warmup=True)
    server = p.add_argument_group("server arguments")
    server.add_argument("--host", default="127.0.0.1", help="Host to bind (default: %(default)s).")
    server.add_argument("--port", type=int, default=8000, help="Port to bind (default: %(default)s).")
    server.add_argument("--api-key", default=None, help="Require `Authorization: Bearer KEY` on /v1 routes.")
    server.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="Report usage.prompt_tokens_details.cached_tokens.")
    server.add_argument("--disable-log-requests", action="store_true", help="Do not log each request.")
    server.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="LoRA adapters served from the start (with --enable-lora), each name=path or a JSON "
                             'object {"name", "path", "base_model_name"}; a request selects one by its model field.')
    server.add_argument("--chat-template", default=None,
                        help="A Jinja chat template (a file's path, or the template itself) replacing the "
                             "tokenizer's; a request's chat_template still wins.")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='Allow tool_choice="auto": the model decides whether to call tools, and its output '
                             "is parsed with --tool-call-parser (required with it).")
    server.add_argument("--tool-call-parser", default=None, choices=_tool_parsers(),
                        help="The model's tool-call format, to turn its output into tool_calls: hermes "
                             "(Qwen2.5 / Qwen3 / Hermes <tool_call> JSON), llama3_json (Llama 3.x JSON).")
    server.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                        help="Serve GET /tokenizer_info (the tokenizer's config and chat template).")
    server.add_argument("--enable-weight-updates", action="store_true",
                        help="Serve the research loop's routes: POST /update_weights_from_disk, /sleep, /wake_up, "
                             "/reset_prefix_cache, /pause, /resume, GET /is_sleeping, /is_paused (under --api-key "
                             "when set; VLLM_SERVER_DEV_MODE=1 does the same).")
    add_limits_args(server)
    server.add_argument("--max-num-waiting-requests", type=int, default=None,
                        help="Sequences that may wait beyond those running before requests get 503 + Retry-After "
                             "(default: one per KV cache block, at least 2 x max_num_seqs; 0: no bound).")
    server.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="On SIGTERM, seconds requests in flight may take to finish before they are aborted "
                             "(default: %(default)s).")
    server.add_argument("--engine-iteration-timeout", type=float, default=DEFAULT_ITERATION_TIMEOUT_S,
                        help="A step running longer kills the engine: requests fail, the server exits 1 "
                             "(default: %(default)s s; 0: never).")
    server.add_argument("--timeout-keep-alive", type=float, default=5.0,
                        help="Seconds an idle keep-alive connection stays open (vLLM's default: %(default)s). A client "
                             "that reuses one just as the server closes it sees a connection error; under heavy "
                             "load (a slow event loop) that grows likelier, and a longer timeout avoids it.")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    server.add_argument("--allowed-origins", type=_json_list, default=["*"],
                        help='CORS: origins allowed, a JSON list (default: \'["*"]\').')
    server.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS: methods allowed (JSON list).")
    server.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS: headers allowed (JSON list).")
    server.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies, auth).")
    server.add_argument("--ssl-keyfile", default=None, help="TLS: the private key file (serves HTTPS).")
    server.add_argument("--ssl-certfile", default=None, help="TLS: the certificate file.")
    server.add_argument("--ssl-ca-certs", default=None, help="TLS: CA certificates to verify client certificates with.")
    server.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE),
                        help="TLS: whether client certificates are required (Python's ssl.CERT_*: 0 none, "
                             "1 optional, 2 required; default: %(default)s).")
    server.add_argument("--root-path", default="",
                        help="The path prefix a proxy serves the app under (FastAPI's root_path).")
    server.add_argument("--disable-fastapi-docs", action="store_true",
                        help="No /docs, /redoc or /openapi.json.")
    p.set_defaults(func=run_serve)
    return p


def run_serve(args: argparse.Namespace) -> None:
    """Build the engine from the flags, warm it up, serve until interrupted."""
    from jaxserve.engine.async_llm import AsyncLLM
    from server.app import CORSSettings, build_app
    from server.lifecycle import serve

    try:
        check_serve_args(args)
    except ValueError as e:
        raise SystemExit(f"jaxserve serve: error: {e}") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    async_llm = AsyncLLM.from_engine_args(
        EngineArgs.from_cli_args(args), max_num_waiting_requests=args.max_num_waiting_requests,
        iteration_timeout_s=args.engine_iteration_timeout or None)
    config = async_llm.config
    logger.info("Engine ready in %.1f s (warm-up %.1f s)", async_llm.engine.startup_seconds,
                async_llm.engine.warmup_seconds)
    try:
        lora_modules = parse_lora_modules(args.lora_modules)
    except ValueError as e:
        raise SystemExit(f"jaxserve serve: error: {e}") from None
    app = build_app(async_llm, config.model_config.served_model_name, api_key=args.api_key, lora_modules=lora_modules,
                    limits=limits_from_args(args),
                    max_model_len=config.scheduler_config.max_model_len,
                    enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                    disable_log_requests=args.disable_log_requests,
                    enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                    reasoning_parser=config.structured_outputs_config.reasoning_parser,
                    chat_template=args.chat_template,
                    enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                    enable_weight_updates=args.enable_weight_updates,
                    cors=CORSSettings(args.allowed_origins, args.allowed_methods, args.allowed_headers,
                                      args.allow_credentials),
                    root_path=args.root_path, disable_fastapi_docs=args.disable_fastapi_docs)
    code = serve(app, async_llm, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                 shutdown_timeout=args.shutdown_timeout, timeout_keep_alive=args.timeout_keep_alive,
                 ssl=ssl_settings(args))
    if code:
        raise SystemExit(code)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "serve":
        argv = ["serve", *argv]
    parser = argparse.ArgumentParser(prog="jaxserve")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
