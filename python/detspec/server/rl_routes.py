"""RL weight sync and flow control over HTTP, under SGLang's endpoint names (what slime, verl
and other trainers drive a rollout server with), with vLLM's names as aliases where they
differ.

=====================================  ==========================  ============================
route                                  SGLang                      vLLM
=====================================  ==========================  ============================
POST /update_weights_from_disk         same                        (``/update_weights``, prime-rl)
POST /update_weights_from_tensor       same (body: safetensors)    --
POST /pause_generation                 same                        POST /pause
POST /continue_generation              same                        POST /resume
GET  /is_paused                        --                          same
POST /flush_cache                      same                        POST /reset_prefix_cache
POST /release_memory_occupation        same                        POST /sleep
POST /resume_memory_occupation         same                        POST /wake_up
GET  /get_weight_version               same                        --
=====================================  ==========================  ============================

Every route needs the API key when the server has one. Success is ``200`` with
``{"success": true, "message": ..., "fingerprint": ..., "weight_version": ...}``; a refused
call is a 4xx with ``{"success": false, "message": ..., "error": {message, type, param,
code}}`` naming what was wrong, and changes nothing.

``/update_weights_from_tensor`` takes the bytes of a safetensors file as its body
(``Content-Type: application/octet-stream``; ``safetensors.torch.save(state_dict)`` or
``safetensors.numpy.save``), tensors named by Hugging Face parameter names, float32 / bfloat16
/ float16; options go in the query string (``in_flight=finish|abort``,
``abort_all_requests=true``, ``weight_version=LABEL``). The request-size limit does not apply
to it (the API key does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from detspec.errors import DetspecError, EngineStoppedError, InvalidRequestError, ModelLoadError
from detspec.server import protocol as P

if TYPE_CHECKING:
    from detspec.server.serving import OpenAIServer

# The upload route the request-size limit does not apply to.
WEIGHT_UPLOAD_PATHS = ("/update_weights_from_tensor",)
# Every route of this module (the API key applies to them all).
RL_PATHS = (
    "/update_weights_from_disk",
    "/update_weights_from_tensor",
    "/update_weights",
    "/pause_generation",
    "/continue_generation",
    "/pause",
    "/resume",
    "/is_paused",
    "/flush_cache",
    "/reset_prefix_cache",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/get_weight_version",
)

InFlightMode = Literal["finish", "abort"]
# SGLang: abort / retract / in_place; vLLM: abort / wait / keep.
PauseModeName = Literal["abort", "in_place", "retract", "wait", "keep"]
_PAUSE_MODES = {"abort": "abort", "wait": "wait", "keep": "keep", "in_place": "keep"}
_RELEASABLE = ("kv_cache",)
_KNOWN_TAGS = ("kv_cache", "weights", "cuda_graph")


class UpdateWeightsFromDiskRequest(P.OpenAIBaseModel):
    model_path: str = Field(description="a safetensors checkpoint directory (HF layout)")
    load_format: str | None = None
    in_flight: InFlightMode | None = None
    abort_all_requests: bool = False
    allow_partial: bool = Field(
        default=False,
        description="apply a checkpoint that holds only some parameters (default: refuse it, "
        "naming a missing one)",
    )
    flush_cache: bool = True
    weight_version: str | None = None
    # SGLang fields with nothing to do here (accepted at any value).
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int | None = None


class PrimeUpdateWeightsRequest(P.OpenAIBaseModel):
    """prime-rl's ``/update_weights``."""

    weight_dir: str
    in_flight: InFlightMode | None = None


class PauseRequest(P.OpenAIBaseModel):
    mode: PauseModeName = "abort"


class EmptyRequest(P.OpenAIBaseModel):
    pass


class MemoryRequest(P.OpenAIBaseModel):
    tags: list[str] | None = None


class _Refused(Exception):
    def __init__(self, status: int, message: str, param: str | None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _fail(status: int, message: str, param: str | None) -> JSONResponse:
    from detspec.server.errors import error_body

    body: dict[str, Any] = {"success": False, "message": message}
    body.update(error_body(status, message, param))
    return JSONResponse(body, status_code=status)


def _engine_error(e: DetspecError, default_param: str | None) -> JSONResponse:
    msg = str(e)
    if isinstance(e, InvalidRequestError | ModelLoadError):
        return _fail(400, msg, e.param or default_param)
    if isinstance(e, EngineStoppedError):
        return _fail(503, msg, None)
    return _fail(500, msg, None)


def build_rl_router(server: OpenAIServer) -> APIRouter:
    """The routes above, on ``server``'s engine."""
    router = APIRouter()
    engine = server.engine

    def ok(message: str, **extra: Any) -> JSONResponse:
        return JSONResponse(
            {
                "success": True,
                "message": message,
                "fingerprint": server.fingerprint,
                "weight_version": engine.weight_version,
                "is_paused": engine.is_paused,
                **extra,
            }
        )

    def in_flight_of(in_flight: str | None, abort_all: bool) -> str:
        if in_flight is not None and abort_all and in_flight != "abort":
            raise _Refused(
                400, 'abort_all_requests=true contradicts in_flight="finish"', "in_flight"
            )
        return "abort" if abort_all else (in_flight or "finish")

    async def from_disk(
        path: str, in_flight: str, complete: bool, label: str | None
    ) -> JSONResponse:
        try:
            await engine.update_weights_from_disk(path, in_flight=in_flight, complete=complete)
        except DetspecError as e:
            return _engine_error(e, "model_path")
        server.weight_version_label = label
        return ok(f"weights updated from {path}", num_paused_requests=0)

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(
        req: UpdateWeightsFromDiskRequest,
    ) -> JSONResponse:
        if req.load_format not in (None, "auto", "safetensors"):
            return _fail(
                400,
                f"load_format {req.load_format!r} is not supported (safetensors checkpoints)",
                "load_format",
            )
        try:
            in_flight = in_flight_of(req.in_flight, req.abort_all_requests)
        except _Refused as r:
            return _fail(r.status, r.message, r.param)
        return await from_disk(req.model_path, in_flight, not req.allow_partial, req.weight_version)

    @router.post("/update_weights")
    async def update_weights(req: PrimeUpdateWeightsRequest) -> JSONResponse:
        return await from_disk(req.weight_dir, req.in_flight or "finish", True, None)

    @router.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(
        request: Request,
        in_flight: Annotated[InFlightMode | None, Query()] = None,
        abort_all_requests: Annotated[bool, Query()] = False,
        weight_version: Annotated[str | None, Query()] = None,
    ) -> JSONResponse:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/octet-stream":
            return _fail(
                400,
                "send the tensors as the bytes of a safetensors file with Content-Type "
                f"application/octet-stream (got {ctype or 'none'!r})",
                "Content-Type",
            )
        try:
            mode = in_flight_of(in_flight, abort_all_requests)
        except _Refused as r:
            return _fail(r.status, r.message, r.param)
        data = await request.body()
        if not data:
            return _fail(400, "the body is empty: send a safetensors buffer", "body")
        try:
            await engine.update_weights_from_safetensors(data, in_flight=mode)
        except DetspecError as e:
            return _engine_error(e, "body")
        server.weight_version_label = weight_version
        return ok("weights updated from the request's tensors", num_bytes=len(data))

    async def pause(mode: str) -> JSONResponse:
        try:
            await engine.pause(_PAUSE_MODES.get(mode, "keep"))
        except DetspecError as e:
            return _engine_error(e, "mode")
        return ok(f"generation paused (mode {mode})")

    async def resume() -> JSONResponse:
        try:
            await engine.resume()
        except DetspecError as e:
            return _engine_error(e, None)
        return ok("generation continues")

    @router.post("/pause_generation")
    async def pause_generation(req: PauseRequest | None = None) -> JSONResponse:
        return await pause((req or PauseRequest()).mode)

    @router.post("/pause")
    async def pause_vllm(
        mode: Annotated[PauseModeName, Query()] = "abort",
    ) -> JSONResponse:
        return await pause(mode)

    @router.post("/continue_generation")
    async def continue_generation(req: EmptyRequest | None = None) -> JSONResponse:
        return await resume()

    @router.post("/resume")
    async def resume_vllm() -> JSONResponse:
        return await resume()

    @router.get("/is_paused")
    async def is_paused() -> dict[str, Any]:
        return {"is_paused": engine.is_paused}

    async def flush() -> JSONResponse:
        try:
            n = await engine.reset_prefix_cache()
        except DetspecError as e:
            return _engine_error(e, None)
        return ok("Cache flushed.", num_cached_pages_freed=n)

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> JSONResponse:
        return await flush()

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        return await flush()

    def check_tags(tags: list[str] | None) -> None:
        for i, t in enumerate(tags or []):
            if t not in _KNOWN_TAGS:
                raise _Refused(
                    400, f"unknown tag {t!r} (known: {', '.join(_KNOWN_TAGS)})", f"tags[{i}]"
                )
            if t not in _RELEASABLE:
                raise _Refused(
                    400,
                    f"tag {t!r} cannot be released by this engine (it releases: kv_cache)",
                    f"tags[{i}]",
                )

    async def release(tags: list[str] | None) -> JSONResponse:
        try:
            check_tags(tags)
        except _Refused as r:
            return _fail(r.status, r.message, r.param)
        if not engine.is_paused:
            return _fail(
                409,
                "pause generation before releasing memory (POST /pause_generation)",
                "tags",
            )
        try:
            await engine.release_memory()
            nbytes, _ = await engine.kv_memory()
        except DetspecError as e:
            return _engine_error(e, "tags")
        return ok("released: kv_cache", released=list(_RELEASABLE), kv_cache_bytes=nbytes)

    async def resume_mem(tags: list[str] | None) -> JSONResponse:
        try:
            check_tags(tags)
            await engine.resume_memory()
            nbytes, _ = await engine.kv_memory()
        except _Refused as r:
            return _fail(r.status, r.message, r.param)
        except DetspecError as e:
            return _engine_error(e, "tags")
        return ok("resumed: kv_cache", resumed=list(_RELEASABLE), kv_cache_bytes=nbytes)

    @router.post("/release_memory_occupation")
    async def release_memory_occupation(
        req: MemoryRequest | None = None,
    ) -> JSONResponse:
        return await release((req or MemoryRequest()).tags)

    @router.post("/resume_memory_occupation")
    async def resume_memory_occupation(
        req: MemoryRequest | None = None,
    ) -> JSONResponse:
        return await resume_mem((req or MemoryRequest()).tags)

    @router.post("/sleep")
    async def sleep(
        level: Annotated[int, Query(ge=1, le=2)] = 1,
    ) -> JSONResponse:
        """vLLM's sleep: finishes the requests in flight, pauses, releases the KV cache."""
        paused = await pause("wait")
        if paused.status_code != 200:
            return paused
        return await release(None)

    @router.post("/wake_up")
    async def wake_up(
        tags: Annotated[list[str] | None, Query()] = None,
    ) -> JSONResponse:
        """vLLM's wake_up: allocates the KV cache again and continues generation."""
        resumed = await resume_mem(tags)
        if resumed.status_code != 200:
            return resumed
        return await resume()

    @router.get("/is_sleeping")
    async def is_sleeping() -> dict[str, Any]:
        _, released = await engine.kv_memory()
        return {"is_sleeping": released}

    @router.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {
            "weight_version": server.weight_version_name(),
            "num_updates": engine.weight_version,
            "fingerprint": server.fingerprint,
        }

    return router
