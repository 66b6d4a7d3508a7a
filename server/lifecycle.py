"""The server process's life: graceful shutdown on SIGTERM, and exit on engine death.

- SIGTERM / SIGINT: uvicorn stops listening; requests that arrive on connections
  already open get a 503 (``install_draining``); requests in flight may finish for up
  to ``shutdown_timeout`` seconds, then uvicorn cancels them (which aborts their engine
  requests); the engine shuts down; exit code 0.
- A dead engine (a step failed or hung: AsyncLLM.errored): in-flight requests have
  already failed, /health answers 503; the server then stops and the process exits
  with code 1, so that a supervisor (systemd, Kubernetes) restarts it, as vLLM does.
"""
from __future__ import annotations

import asyncio
import logging
import signal

from fastapi import FastAPI, Request

from server.errors import APIError

logger = logging.getLogger("jaxserve.server")

# How often the server checks whether the engine died.
ENGINE_CHECK_PERIOD_S = 0.5


def install_draining(app: FastAPI) -> None:
    """Once ``app.state.draining`` is set (shutdown began), /v1 requests get a 503."""
    app.state.draining = False

    @app.middleware("http")
    async def _refuse_while_draining(request: Request, call_next):
        if app.state.draining and request.url.path.startswith("/v1"):
            return APIError("The server is shutting down; retry on another replica.", 503,
                            headers={"Connection": "close", "Retry-After": "1"}).to_json_response()
        return await call_next(request)


def serve(app: FastAPI, async_llm, *, host: str, port: int, log_level: str = "info",
          shutdown_timeout: float = 30.0, timeout_keep_alive: float = 5.0,
          engine_check_period: float = ENGINE_CHECK_PERIOD_S, ssl: dict | None = None) -> int:
    """Run uvicorn until SIGTERM / SIGINT (exit code 0) or the engine's death (1).
    ``ssl``: uvicorn's TLS keywords (server/cli_serve.py ssl_settings), HTTPS when given."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if not app.state.draining:
                logger.info("Shutting down: no new requests; %s s for those in flight", shutdown_timeout)
            app.state.draining = True
            super().handle_exit(sig, frame)
            # uvicorn re-raises a captured signal after its graceful shutdown (the process
            # then dies of SIGTERM, status -15); a drained SIGTERM is a clean exit (0).
            captured = getattr(self, "_captured_signals", None)
            if sig == signal.SIGTERM and captured:
                captured[:] = [s for s in captured if s != signal.SIGTERM]

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=timeout_keep_alive,
                            timeout_graceful_shutdown=shutdown_timeout, **(ssl or {}))
    server = Server(config)
    exit_code = 0

    async def watch_engine() -> None:
        nonlocal exit_code
        while not server.should_exit:
            if async_llm.errored:
                logger.error("The engine is dead (%r); stopping the server (exit code 1)", async_llm.dead_error)
                exit_code = 1
                app.state.draining = True
                server.should_exit = True
                return
            await asyncio.sleep(engine_check_period)

    async def main() -> None:
        watcher = asyncio.create_task(watch_engine())
        try:
            await server.serve()
        finally:
            watcher.cancel()

    try:
        asyncio.run(main())
    finally:
        async_llm.shutdown()
    return exit_code
