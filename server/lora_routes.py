"""LoRA adapters in the server (vLLM's behaviour and names): a request's ``model``
field names an adapter (server/serving_engine.py ``check_model``), ``/v1/models`` lists
the adapters with the base model as their ``parent``, ``--lora-modules name=path ...``
loads adapters at start, and with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (vLLM's
switch) two routes load and unload them while serving:

    POST /v1/load_lora_adapter   {"lora_name", "lora_path", "load_inplace": false}
    POST /v1/unload_lora_adapter {"lora_name"}

Both answer 200 with vLLM's plain-text "Success: ..." line. A missing field, a name in
use (or the base model's), a bad adapter (no such folder, a rank above
--max-lora-rank, modules the model cannot adapt, another model's shapes,
modules_to_save) is a 400 with the OpenAI error body; unloading an unknown name a 404.
(vLLM 0.32 answers a missing folder with 404 and other load failures with 500; a bad
adapter is the client's input, so 400 here.)

Unloading removes the name at once (a new request naming it is a 404) and the host
copy; requests already running with the adapter finish with it (they hold its
LoRARequest, and its device slot is reused only once no step needs it).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time

from fastapi import FastAPI
from fastapi.responses import Response
from pydantic import BaseModel

from jaxserve.lora.request import LoRARequest
from server.errors import APIError, bad_request
from server.protocol import ModelCard

logger = logging.getLogger("jaxserve.server")

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating() -> bool:
    """vLLM's switch for the load / unload routes."""
    return os.environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")


@dataclasses.dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(items: list[str] | None) -> list[LoRAModulePath]:
    """--lora-modules as vLLM reads it: ``name=path``, or a JSON object
    ``{"name", "path", "base_model_name"}`` per item (ValueError naming the item)."""
    out = []
    for item in items or ():
        if "=" in item and "," not in item:
            name, path = item.split("=", 1)
            if not name or not path:
                raise ValueError(f"Invalid --lora-modules item {item!r}: expected name=path")
            out.append(LoRAModulePath(name, path))
            continue
        try:
            value = json.loads(item)
        except json.JSONDecodeError:
            raise ValueError(f"Invalid JSON format for --lora-modules: {item}") from None
        try:
            out.append(LoRAModulePath(**value))
        except TypeError as e:
            raise ValueError(f"Invalid fields for --lora-modules: {item} - {e}") from None
    return out


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = ""
    lora_int_id: int | None = None


class LoRARegistry:
    """The adapters the server knows by name (vLLM's OpenAIServingModels.lora_requests);
    each load gets a new id, so KV cached under an adapter's old weights is never reused."""

    def __init__(self, async_llm, served_model_name: str) -> None:
        self.async_llm = async_llm
        self.served_model_name = served_model_name
        self.adapters: dict[str, LoRARequest] = {}
        self.created: dict[str, int] = {}
        self._next_id = 1
        self._lock = asyncio.Lock()  # one load / unload at a time

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)

    def cards(self) -> list[ModelCard]:
        return [ModelCard(id=name, created=self.created[name], root=lora.lora_path,
                          parent=lora.base_model_name or self.served_model_name)
                for name, lora in self.adapters.items()]

    async def load(self, name: str, path: str, *, load_inplace: bool = False,
                   base_model_name: str | None = None) -> LoRARequest:
        if not name or not path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.", "lora_name" if not name else
                              "lora_path")
        if name == self.served_model_name:
            raise bad_request(f"The lora adapter '{name}' conflicts with a served base model.", "lora_name")
        async with self._lock:
            old = self.adapters.get(name)
            if old is not None and not load_inplace:
                raise bad_request(f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                  "adapter in place, set 'load_inplace' to True.", "lora_name")
            lora = LoRARequest(name, self._next_id, path, base_model_name=base_model_name)
            try:
                await self.async_llm.add_lora(lora)
            except ValueError as e:
                raise bad_request(str(e), "lora_path") from None
            self._next_id += 1
            self.adapters[name] = lora
            self.created[name] = int(time.time())
            if old is not None:
                await self.async_llm.remove_lora(old.lora_int_id)
        logger.info("LoRA adapter %r loaded from %s (id %d)", name, path, lora.lora_int_id)
        return lora

    def load_at_start(self, modules: list[LoRAModulePath]) -> None:
        """--lora-modules: each adapter read and checked before the server starts
        (ValueError naming the first bad one)."""
        for m in modules:
            if m.name in self.adapters or m.name == self.served_model_name:
                raise ValueError(f"--lora-modules: the name {m.name!r} is used twice")
            lora = LoRARequest(m.name, self._next_id, m.path, base_model_name=m.base_model_name)
            try:
                self.async_llm.engine.engine_core.add_lora(lora)
            except ValueError as e:
                raise ValueError(f"--lora-modules {m.name}: {e}") from None
            self._next_id += 1
            self.adapters[m.name] = lora
            self.created[m.name] = int(time.time())

    async def unload(self, name: str) -> None:
        if not name:
            raise bad_request("'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
        async with self._lock:
            lora = self.adapters.pop(name, None)
            if lora is None:
                raise APIError(f"The lora adapter '{name}' cannot be found.", 404, "lora_name", "NotFoundError")
            self.created.pop(name, None)
            await self.async_llm.remove_lora(lora.lora_int_id)
        logger.info("LoRA adapter %r unloaded", name)


def install_lora_routes(app: FastAPI, registry: LoRARegistry) -> None:
    logger.warning("LoRA dynamic loading & unloading is enabled in the API server (%s). This should ONLY be used "
                   "for local development!", RUNTIME_LORA_ENV)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest):
        await registry.load(request.lora_name, request.lora_path, load_inplace=request.load_inplace)
        return Response(f"Success: LoRA adapter '{request.lora_name}' added successfully.", status_code=200)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest):
        await registry.unload(request.lora_name)
        return Response(f"Success: LoRA adapter '{request.lora_name}' removed successfully.", status_code=200)
