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
import logging
import sys

from jaxserve.engine.arg_utils import EngineArgs

logger = logging.getLogger("jaxserve")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to an argparse subparsers object: the engine's flags
    (EngineArgs, vLLM's names) plus the server's own."""
    p = subparsers.add_parser(
        "serve", help="Start the OpenAI-compatible API server.",
        description="Start the OpenAI-compatible API server (vLLM's argument names).")
    EngineArgs.add_cli_args(p)
    server = p.add_argument_group("server arguments")
    server.add_argument("--host", default="127.0.0.1", help="Host to bind (default: %(default)s).")
    server.add_argument("--port", type=int, default=8000, help="Port to bind (default: %(default)s).")
    server.add_argument("--api-key", default=None, help="Require `Authorization: Bearer KEY` on /v1 routes.")
    server.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="Report usage.prompt_tokens_details.cached_tokens.")
    server.add_argument("--disable-log-requests", action="store_true", help="Do not log each request.")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.set_defaults(func=run_serve)
    return p


def run_serve(args: argparse.Namespace) -> None:
    """Build the engine from the flags, warm it up, serve until interrupted."""
    import uvicorn

    from jaxserve.engine.async_llm import AsyncLLM
    from server.app import build_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    async_llm = AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args))
    config = async_llm.config
    logger.info("Engine ready in %.1f s (warm-up %.1f s)", async_llm.engine.startup_seconds,
                async_llm.engine.warmup_seconds)
    app = build_app(async_llm, config.model_config.served_model_name, api_key=args.api_key,
                    max_model_len=config.scheduler_config.max_model_len,
                    enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                    disable_log_requests=args.disable_log_requests)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                    timeout_keep_alive=5)
    finally:
        async_llm.shutdown()


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
