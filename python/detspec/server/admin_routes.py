"""What vLLM's and SGLang's clients ask a server about itself, besides generating: the model
list and one model's card (``GET /v1/models``, ``GET /v1/models/{model}``: the ``openai``
client's ``models.list()`` and ``models.retrieve(name)``), SGLang's ``GET /health_generate``
(a real one-token generation), ``GET /get_model_info`` and ``GET /get_server_info`` (also under
SGLang's newer names ``/model_info`` and ``/server_info``), with SGLang's field names where
detspec has the information. ``/health`` and vLLM's ``/ping`` are in ``app``;
``/abort_request`` is beside ``/generate`` in ``native_routes``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from fastapi.responses import Response

import detspec
from detspec.outputs import RequestOutput
from detspec.sampling_params import SamplingParams
from detspec.server import protocol as P
from detspec.server.errors import ERROR_RESPONSES, RETRY_AFTER, ApiError

if TYPE_CHECKING:
    from detspec.server.serving import OpenAIServer

# The server's settings and model paths: behind the API key, as in SGLang (the health checks
# are not).
INFO_PATHS = ("/get_model_info", "/model_info", "/get_server_info", "/server_info")

logger = logging.getLogger("detspec.server")

# How long /health_generate waits for its token (SGLang's HEALTH_CHECK_TIMEOUT default).
HEALTH_GENERATE_TIMEOUT_S = 20.0


def model_cards(server: OpenAIServer) -> list[P.ModelCard]:
    """``/v1/models``' cards: each served name of the base model, then each loaded LoRA
    adapter (vLLM lists an adapter as a model whose parent is the base model)."""
    engine = server.engine
    defaults = server.defaults
    suffix = defaults.fingerprint_suffix()

    def card(name: str, root: str, fingerprint: str, parent: str | None) -> P.ModelCard:
        return P.ModelCard(
            id=name,
            created=server.created,
            owned_by="detspec",
            root=root,
            parent=parent,
            max_model_len=server.max_model_len,
            fingerprint=fingerprint + suffix,
            deterministic_by_default=defaults.deterministic_by_default,
            default_seed=defaults.default_seed if defaults.deterministic_by_default else None,
            weight_version=engine.weight_version,
        )

    base = [card(name, engine.model, engine.fingerprint, None) for name in server.model_names]
    adapters = [
        card(name, info["path"], engine.lora_fingerprint(name), server.model_names[0])
        for name, info in engine.list_loras().items()
    ]
    return base + adapters


def build_admin_router(server: OpenAIServer) -> APIRouter:
    """The routes above, on ``server``."""
    router = APIRouter()
    engine = server.engine
    hf_config = _hf_config(engine.model)

    @router.get("/v1/models", response_model=P.ModelList, responses=ERROR_RESPONSES)
    async def models() -> P.ModelList:
        return P.ModelList(data=model_cards(server))

    # `:path`: a served name may hold slashes (`org/model`), as Hugging Face names do.
    @router.get("/v1/models/{model:path}", response_model=P.ModelCard, responses=ERROR_RESPONSES)
    async def retrieve_model(model: str) -> P.ModelCard:
        cards = model_cards(server)
        for c in cards:
            if c.id == model:
                return c
        served = ", ".join(c.id for c in cards)
        raise ApiError(404, f"The model `{model}` does not exist (served: {served}).", "model")

    @router.get("/health_generate", responses=ERROR_RESPONSES)
    async def health_generate() -> Response:
        await _one_token(server)
        return Response(status_code=200)

    @router.get("/get_model_info", response_model=P.ModelInfoResponse)
    @router.get("/model_info", response_model=P.ModelInfoResponse, include_in_schema=False)
    async def get_model_info() -> P.ModelInfoResponse:
        model_type = hf_config.get("model_type")
        architectures = hf_config.get("architectures")
        return P.ModelInfoResponse(
            model_path=engine.model,
            tokenizer_path=engine.model if server.tokenizer is not None else None,
            weight_version=server.weight_version_name(),
            model_type=model_type if isinstance(model_type, str) else None,
            architectures=architectures if isinstance(architectures, list) else None,
            served_model_name=server.model_names[0],
            served_model_names=list(server.model_names),
            max_model_len=server.max_model_len,
            fingerprint=server.fingerprint,
            preferred_sampling_params=preferred_sampling_params(server.defaults.sampling),
        )

    @router.get("/get_server_info", response_model=P.ServerInfoResponse)
    @router.get("/server_info", response_model=P.ServerInfoResponse, include_in_schema=False)
    async def get_server_info() -> P.ServerInfoResponse:
        config = server.config
        return P.ServerInfoResponse(
            model_path=engine.model,
            tokenizer_path=engine.model if server.tokenizer is not None else None,
            served_model_name=server.model_names[0],
            served_model_names=list(server.model_names),
            context_length=server.max_model_len,
            max_model_len=server.max_model_len,
            vocab_size=server.vocab_size,
            dtype=engine.dtype,
            kv_cache_dtype=engine.kv_cache_dtype,
            max_running_requests=config.max_num_seqs,
            max_queued_requests=config.max_waiting_requests,
            max_request_bytes=config.max_request_bytes,
            enable_lora=engine.enable_lora,
            lora_paths={name: info["path"] for name, info in engine.list_loras().items()},
            tool_call_parser=config.tool_call_parser,
            enable_auto_tool_choice=config.enable_auto_tool_choice,
            reasoning_parser=config.reasoning_parser,
            determinism=server.determinism,
            enable_deterministic_inference=server.defaults.deterministic_by_default,
            deterministic_by_default=server.defaults.deterministic_by_default,
            default_seed=server.defaults.default_seed,
            fingerprint=server.fingerprint,
            weight_version=server.weight_version_name(),
            num_weight_updates=engine.weight_version,
            is_paused=engine.is_paused,
            version=detspec.__version__,
        )

    return router


async def _one_token(server: OpenAIServer) -> None:
    """Generates one token (greedy, from token id 0, as SGLang's check does) or raises a 503
    saying why not. It goes to the engine directly: a probe is neither admitted against the
    waiting-queue limit nor counted in the request metrics, and, being a request of its own,
    it changes no other request's output (a deterministic one's bits never depend on the
    batch)."""
    engine = server.engine
    if server.draining:
        raise ApiError(503, "the server is shutting down", None, headers=RETRY_AFTER)
    if engine.is_paused:  # the probe would wait for /continue_generation
        raise ApiError(
            503,
            "generation is paused (POST /continue_generation resumes it)",
            None,
            headers=RETRY_AFTER,
        )
    rid = f"health_generate-{uuid.uuid4().hex}"

    async def run() -> RequestOutput | None:
        last = None
        params = SamplingParams(max_tokens=1, temperature=0.0)  # checked by the engine too
        stream = engine.generate([0], params, request_id=rid)
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            async for out in stream:
                last = out
        return last

    try:
        # A timeout cancels `run`, which closes the stream: the engine aborts the probe.
        out = await asyncio.wait_for(run(), HEALTH_GENERATE_TIMEOUT_S)
    except TimeoutError:
        raise ApiError(
            503, f"no token generated within {HEALTH_GENERATE_TIMEOUT_S:g} s", None
        ) from None
    except Exception as e:  # the engine failed or stopped: unhealthy, whatever the error
        logger.warning("/health_generate: the one-token generation failed: %s", e)
        raise ApiError(503, f"the one-token generation failed: {e}", None) from None
    reason = out.outputs[0].finish_reason if out is not None and out.outputs else None
    if reason not in ("length", "stop"):
        raise ApiError(503, f"the one-token generation ended with finish reason {reason}")


def _hf_config(model_dir: str) -> dict[str, Any]:
    """The model's ``config.json`` (empty when unreadable: the info routes then say None)."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def preferred_sampling_params(defaults: dict[str, float | int]) -> str | None:
    """SGLang's ``preferred_sampling_params`` (JSON text, in its native names): the defaults a
    request that leaves these fields unset gets (the generation config's), None without any."""
    if not defaults:
        return None
    names = {"max_tokens": "max_new_tokens"}
    return json.dumps({names.get(k, k): v for k, v in sorted(defaults.items())})
