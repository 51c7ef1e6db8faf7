"""LoRA adapters at run time (``detspec serve --enable-lora``), under vLLM's and SGLang's names.

=================================  ===============================  =========================
route                              vLLM                             SGLang
=================================  ===============================  =========================
POST /v1/load_lora_adapter         same (``lora_name``,             ``/load_lora_adapter``
                                   ``lora_path``, ``load_inplace``)  (accepted here too)
POST /v1/unload_lora_adapter       same (``lora_name``)             ``/unload_lora_adapter``
=================================  ===============================  =========================

A loaded adapter is a model: requests name it in ``model`` (``/generate``: ``lora_path``),
``/v1/models`` lists it with the base model as its ``parent``. ``load_inplace: true`` replaces
an adapter of the same name (an RL trainer's new weights each step): requests submitted after
run the new one, those in flight finish on theirs. Success is ``200`` with ``{"success": true,
"message": ..., "loaded_adapters": {name: path}}`` (SGLang's shape, whose ``message`` is
vLLM's text); a refused call is a 4xx naming the field and changes nothing.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import Field

from detspec.errors import DetspecError
from detspec.server import protocol as P
from detspec.server.errors import ERROR_RESPONSES, ApiError

if TYPE_CHECKING:
    from detspec.server.serving import OpenAIServer

# Every route of this module (the API key applies to them all; /v1/* already is).
LORA_PATHS = ("/load_lora_adapter", "/unload_lora_adapter")


class LoadLoraRequest(P.OpenAIBaseModel):
    lora_name: str = Field(min_length=1, description="the name requests give as `model`")
    lora_path: str = Field(min_length=1, description="a PEFT adapter directory")
    load_inplace: bool = Field(default=False, description="replace a loaded adapter of this name")
    # SGLang's: keep the adapter resident (every adapter here stays until unloaded).
    pinned: bool = False


class UnloadLoraRequest(P.OpenAIBaseModel):
    lora_name: str = Field(min_length=1)
    # vLLM's; adapters are known by name here.
    lora_int_id: int | None = None


def build_lora_router(server: OpenAIServer) -> APIRouter:
    router = APIRouter()
    engine = server.engine

    def require_lora() -> None:
        if not engine.enable_lora:
            raise ApiError(
                400,
                "LoRA adapters are off for this server: start it with --enable-lora",
                "lora_name",
            )

    def ok(message: str) -> JSONResponse:
        loaded = {name: info["path"] for name, info in engine.list_loras().items()}
        return JSONResponse({"success": True, "message": message, "loaded_adapters": loaded})

    async def load(req: LoadLoraRequest) -> JSONResponse:
        require_lora()
        if req.lora_name in server.model_names:
            raise ApiError(400, f"`{req.lora_name}` is the base model's served name", "lora_name")
        try:
            await asyncio.to_thread(
                engine.load_lora,
                req.lora_name,
                os.path.expanduser(req.lora_path),
                replace=req.load_inplace,
            )
        except DetspecError as e:
            raise _refused(e, "lora_path") from None
        return ok(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload(req: UnloadLoraRequest) -> JSONResponse:
        require_lora()
        try:
            await asyncio.to_thread(engine.unload_lora, req.lora_name)
        except DetspecError as e:
            raise _refused(e, "lora_name") from None
        return ok(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    for path in ("/v1/load_lora_adapter", "/load_lora_adapter"):
        router.add_api_route(path, load, methods=["POST"], responses=ERROR_RESPONSES)
    for path in ("/v1/unload_lora_adapter", "/unload_lora_adapter"):
        router.add_api_route(path, unload, methods=["POST"], responses=ERROR_RESPONSES)
    return router


def _refused(e: DetspecError, default_param: str) -> ApiError:
    """A 400 naming the field at fault: the engine names a config field or tensor of the
    adapter (`lora_path`'s), `lora_name` or `max_loras`."""
    param: Any = getattr(e, "param", None)
    if param not in ("lora_name", "max_loras"):
        param = default_param
    return ApiError(400, str(e), param)
