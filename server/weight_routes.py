"""The research loop's routes (vLLM's and SGLang's names), served with
``--enable-weight-updates`` (or vLLM's ``VLLM_SERVER_DEV_MODE=1``) and behind
``--api-key`` when one is set (server/middleware.py: WEIGHT_ROUTES):

    POST /update_weights_from_disk  {"model_path": folder}  -> {"success", "message", "weights_version", ...}
    POST /sleep?level=1|2            -> {"freed_bytes": {"weights", "kv_cache"}}
    POST /wake_up[?tags=weights&tags=kv_cache]
    GET  /is_sleeping                -> {"is_sleeping": bool}
    POST /reset_prefix_cache         -> {"success": bool}
    POST /pause?mode=abort|wait (or vLLM's wait_for_inflight_requests=false|true; clear_cache=true),
    POST /resume, GET /is_paused -> {"is_paused": bool}

While the engine is asleep, the generation routes answer 503 (server/app.py).
"""
from __future__ import annotations

import os

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.engine.core import pause_mode
from jaxserve.runner.weight_update import check_sleep_level
from jaxserve.engine.exceptions import EngineDeadError
from server.errors import APIError, bad_request, engine_dead


def weight_updates_enabled(flag: bool) -> bool:
    """--enable-weight-updates, or vLLM's development-mode switch."""
    return flag or os.environ.get("VLLM_SERVER_DEV_MODE", "0") == "1"


class UpdateWeightsFromDiskRequest(BaseModel):
    model_path: str


def install_weight_routes(app: FastAPI, async_llm: AsyncLLM) -> None:
    async def control(call):
        """A control call's errors as the API's: a bad value is a 400, a state that does
        not allow the call (e.g. waking with weights that cannot be re-read) a 409, a dead
        engine a 503; anything else (a device error) the 500 of the app's handler."""
        try:
            return await call
        except (ValueError, TypeError, FileNotFoundError) as e:
            raise bad_request(str(e)) from None
        except EngineDeadError as e:
            raise engine_dead(f"The engine is dead: {e}") from None
        except RuntimeError as e:
            if type(e) is not RuntimeError:  # a JAX / XLA runtime error is not a conflict
                raise
            raise APIError(str(e), 409) from None

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: UpdateWeightsFromDiskRequest):
        try:
            if not os.path.isdir(request.model_path):
                raise bad_request(f"model_path: {request.model_path!r} is not a folder on the server", "model_path")
            info = await control(async_llm.update_weights(request.model_path))
        except APIError as e:
            # SGLang's clients read "success" / "message"; vLLM's the error envelope: both.
            body = e.to_response().model_dump() | {"success": False, "message": e.message}
            return JSONResponse(body, status_code=e.status)
        return {"success": True, "message": f"weights updated from {request.model_path}",
                "weights_version": info["version"], "num_params": info["num_params"], "seconds": info["seconds"]}

    @app.post("/sleep")
    async def sleep(level: int = Query(1)):
        try:
            check_sleep_level(level)
        except ValueError as e:
            raise bad_request(str(e), "level") from None
        freed = await control(async_llm.sleep(level))
        return {"freed_bytes": freed}

    @app.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(None)):
        await control(async_llm.wake_up(tags))
        return {"is_sleeping": async_llm.is_sleeping()}

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": async_llm.is_sleeping()}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        return {"success": await control(async_llm.reset_prefix_cache())}

    @app.post("/pause")
    async def pause(mode: str = Query("abort"), wait_for_inflight_requests: bool | None = Query(None),
                    clear_cache: bool = Query(True)):
        try:
            pause_mode(mode)
        except ValueError as e:
            raise bad_request(str(e), "mode") from None
        await control(async_llm.pause_generation(mode, wait_for_inflight_requests=wait_for_inflight_requests,
                                                 clear_cache=clear_cache))
        return {"is_paused": True}

    @app.post("/resume")
    async def resume():
        await control(async_llm.resume_generation())
        return {"is_paused": False}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": async_llm.is_paused()}
