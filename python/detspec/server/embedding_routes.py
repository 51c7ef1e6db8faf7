"""``POST /v1/embeddings``: OpenAI's embeddings API on a decoder model (vLLM's embedding
models: Qwen3-Embedding, e5-mistral, gte-Qwen), through ``AsyncLLM.embed``.

``input`` is a string, a list of strings, a list of token ids or a list of them; ``dimensions``
keeps the first values (Matryoshka) before normalising; ``encoding_format`` ``float`` or
``base64`` (the float32 bytes, little-endian: what the ``openai`` client asks for by default,
and exact). detspec's extras: ``pooling`` (``last``, the default, or ``mean``), ``normalize``
(default true), ``deterministic`` (unset: the server's default) and ``add_special_tokens``.
A deterministic embedding is computed on the verify-path kernels and pooled and normalised in
a fixed order: the same bits whatever else the server runs. An adapter's name in ``model``
embeds with that LoRA adapter. The response carries the ``fingerprint`` of its numbers.
"""

from __future__ import annotations

import base64
import struct
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter
from pydantic import Field

from detspec.errors import InvalidRequestError
from detspec.server import protocol as P
from detspec.server.errors import ERROR_RESPONSES, ApiError

if TYPE_CHECKING:
    from detspec.server.serving import OpenAIServer


class EmbeddingRequest(P.OpenAIBaseModel):
    input: str | list[str] | list[P.TokenId] | list[list[P.TokenId]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # detspec's and vLLM's extras
    pooling: Literal["last", "mean"] = "last"
    normalize: bool = True
    add_special_tokens: bool = True
    deterministic: bool | None = None


def build_embedding_router(server: OpenAIServer) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/embeddings", responses=ERROR_RESPONSES)
    async def embeddings(req: EmbeddingRequest) -> dict[str, Any]:
        model = server.check_model(req.model)
        inputs = _inputs(req.input)
        ids = [
            await server.encode(x, req.add_special_tokens) if isinstance(x, str) else list(x)
            for x in inputs
        ]
        for i, p in enumerate(ids):
            param = "input" if len(ids) == 1 else f"input[{i}]"
            if not p:
                raise ApiError(400, f"{param} is empty", param)
            if len(p) > server.max_model_len:
                raise ApiError(
                    400,
                    f"{param} has {len(p)} tokens, over this model's maximum context length "
                    f"(max_model_len={server.max_model_len})",
                    param,
                )
            server.validate(p, None, param)
        deterministic = (
            server.defaults.deterministic_by_default
            if req.deterministic is None
            else req.deterministic
        )
        lora = server.lora_of(req.model)
        try:
            outs = await server.engine.embed(
                ids,
                pooling=req.pooling,
                dimensions=req.dimensions,
                normalize=req.normalize,
                deterministic=deterministic,
                lora_request=lora,
            )
        except InvalidRequestError as e:
            raise ApiError(400, str(e), e.param or "input") from None
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": _encode(o.outputs.embedding, req.encoding_format),
            }
            for i, o in enumerate(outs)
        ]
        tokens = sum(len(p) for p in ids)
        return {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "fingerprint": outs[0].fingerprint + server.defaults.fingerprint_suffix(),
        }

    return router


def _inputs(value: Any) -> list[str | list[int]]:
    """The inputs, one per embedding."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise ApiError(400, "input is an empty list", "input")
    if all(isinstance(x, int) for x in value):
        return [list(value)]
    return list(value)


def _encode(values: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return values
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
