"""The OpenAI-compatible FastAPI app on one ``AsyncLLM`` (what ``detspec serve`` runs).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or SSE ending in
``data: [DONE]``), ``GET /health`` (and vLLM's ``/ping``), ``GET /metrics``, ``GET /version``,
``POST /tokenize``, ``POST /detokenize``; ``POST /v1/responses`` in ``responses_routes``;
``echo`` and ``GET /tokenizer_info`` in ``scoring_routes``, the RL control routes in
``rl_routes``, SGLang's native ``POST /generate`` and ``POST /abort_request`` in
``native_routes``, ``GET /v1/models[/{model}]`` and SGLang's ``/health_generate``,
``/get_model_info``, ``/get_server_info`` in ``admin_routes``, server-wide determinism in
``defaults`` (docs/serving.md lists them all).

The rooms: ``errors`` (OpenAI's error body, exception handlers), ``middleware`` (API key,
size limit), ``serving`` (validation, admission, generation, response bodies), ``jobs`` (a
request's engine requests), ``shaping`` (the fields every response body shares),
``streaming`` (fan-in, disconnects, SSE), ``score_batcher`` (coalesced prompt scoring),
``chat`` (template rendering), ``logprobs`` (their shapes), ``protocol`` (request and
response models), ``structured`` (output constraints), ``tools`` and ``tool_parsers`` (tool
calls), ``reasoning`` (a thinking model's reasoning split). ``serve`` runs the app under
uvicorn; ``run_batch`` answers a batch file through it in process.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response

import detspec
from detspec.async_llm import AsyncLLM
from detspec.server import protocol as P
from detspec.server.admin_routes import build_admin_router
from detspec.server.embedding_routes import build_embedding_router
from detspec.server.errors import ERROR_RESPONSES, ApiError, add_exception_handlers, error_body
from detspec.server.lora_routes import build_lora_router
from detspec.server.metrics import CONTENT_TYPE
from detspec.server.middleware import GuardMiddleware, RequestIdMiddleware
from detspec.server.native_routes import build_native_router
from detspec.server.responses_routes import build_responses_router
from detspec.server.rl_routes import build_rl_router
from detspec.server.scoring_routes import build_scoring_router, echo_completions
from detspec.server.serving import OpenAIServer, ServerConfig


def build_app(
    engine: AsyncLLM,
    config: ServerConfig | None = None,
    on_shutdown: Callable[[], None] | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine``. The engine is shut down with the app (lifespan
    end) unless ``on_shutdown`` replaces that."""
    config = config or ServerConfig()
    server = OpenAIServer(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        server.draining = True
        if on_shutdown is not None:
            on_shutdown()
        else:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(
        title="detspec OpenAI-compatible server",
        version=detspec.__version__,
        lifespan=lifespan,
    )
    app.state.server = server
    add_exception_handlers(app, server.metrics.error)

    @app.get("/health")
    # vLLM's (SageMaker's) name for it; out of the schema, as /health's alias (a POST
    # without parameters has nothing for a schema-driven fuzzer to make invalid).
    @app.api_route("/ping", methods=["GET", "POST"], include_in_schema=False)
    async def health() -> Response:
        return Response(status_code=503 if server.draining else 200)

    @app.get("/version", response_model=P.VersionResponse)
    async def version() -> P.VersionResponse:
        return P.VersionResponse(version=detspec.__version__, fingerprint=server.fingerprint)

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await asyncio.to_thread(server.metrics.render)
        return Response(body, media_type=CONTENT_TYPE)

    @app.post("/v1/completions", response_model=P.CompletionResponse, responses=ERROR_RESPONSES)
    async def completions(req: P.CompletionRequest, request: Request) -> Response:
        server.check_logprobs(logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs)
        if req.echo:  # prompt scoring: scoring_routes builds on serving, not the reverse
            return await echo_completions(server, req, request)
        return await server.completions(req, request)

    @app.post(
        "/v1/chat/completions",
        response_model=P.ChatCompletionResponse,
        responses=ERROR_RESPONSES,
    )
    async def chat_completions(req: P.ChatCompletionRequest, request: Request) -> Response:
        server.check_logprobs(top_logprobs=req.top_logprobs, prompt_logprobs=req.prompt_logprobs)
        return await server.chat(req, request)

    @app.post("/tokenize", response_model=P.TokenizeResponse, responses=ERROR_RESPONSES)
    async def tokenize(
        req: P.TokenizeCompletionRequest | P.TokenizeChatRequest,
    ) -> P.TokenizeResponse:
        return await server.tokenize(req)

    @app.post("/detokenize", response_model=P.DetokenizeResponse, responses=ERROR_RESPONSES)
    async def detokenize(req: P.DetokenizeRequest) -> P.DetokenizeResponse:
        return await server.detokenize(req)

    app.include_router(build_admin_router(server))
    app.include_router(build_scoring_router(server))
    app.include_router(build_rl_router(server))
    app.include_router(build_native_router(server))
    app.include_router(build_lora_router(server))
    app.include_router(build_embedding_router(server))
    app.include_router(build_responses_router(server))
    app.add_middleware(GuardMiddleware, api_key=config.api_key, max_bytes=config.max_request_bytes)
    # Added after the guard, so outside it: a browser's preflight carries no API key.
    if config.cors is not None:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.cors.allow_origins,
            allow_methods=config.cors.allow_methods,
            allow_headers=config.cors.allow_headers,
            allow_credentials=config.cors.allow_credentials,
        )
    if config.request_id_headers:
        app.add_middleware(RequestIdMiddleware)
    return app


__all__ = ["ApiError", "OpenAIServer", "ServerConfig", "build_app", "error_body"]
