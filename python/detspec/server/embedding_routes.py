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

vLLM's scoring routes for an embedding model (a bi-encoder) run on the same embeddings:
``POST /score`` (``/v1/score``) answers the cosine similarity of each pair (``text_1`` and
``text_2``, or vLLM's other names for them: ``queries`` and ``documents``/``items``,
``data_1`` and ``data_2``; one against many, or pairwise), ``POST /rerank`` (``/v1/rerank``,
``/v2/rerank``: Jina's and Cohere's shape) ranks ``documents`` by it against ``query``. The
similarity is summed exactly (``math.fsum``), so a deterministic score is a function of the
two embeddings' bits only. On a single-label sequence classifier (a cross-encoder) the same
routes score each pair as one sequence (the texts joined by the tokenizer's pair template):
the classifier's probability.

``POST /classify`` (``/v1/classify``) is vLLM's classification API for a sequence classifier
(a ``*ForSequenceClassification`` checkpoint: reward models, classifiers), through
``AsyncLLM.classify``: per input the ``probs`` over the labels, the most probable ``label``,
``num_classes``, and (detspec's addition) the raw ``logits``, a reward model's reward. A body
in SGLang's shape (``text`` or ``input_ids``) is answered in SGLang's: per input
``{"embedding": logits, "meta_info"}``.
``POST /pooling`` (vLLM's pooling API) answers the raw output per input: a classifier's
logits (a reward model's reward), or an embedding model's embedding. A
conversation in ``messages`` (rendered with the chat template, no generation prompt unless
``add_generation_prompt``) is classified as one input, as a reward model scores a response.
"""

from __future__ import annotations

import base64
import math
import struct
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter
from pydantic import Field, model_validator

from detspec.errors import InvalidRequestError
from detspec.server import protocol as P
from detspec.server.errors import ERROR_RESPONSES, ApiError

if TYPE_CHECKING:
    from detspec.outputs import ClassificationRequestOutput
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


# one input (a string or token ids) or a list of them
_ScoreInputs = str | list[P.TokenId] | list[str | list[P.TokenId]]


class _ScoringFields(P.OpenAIBaseModel):
    model: str | None = None
    user: str | None = None
    add_special_tokens: bool = True
    deterministic: bool | None = None


class ScoreRequest(_ScoringFields):
    """vLLM's ``/score`` body: the two sides under any of vLLM's names for them."""

    text_1: _ScoreInputs | None = None
    text_2: _ScoreInputs | None = None
    queries: _ScoreInputs | None = None
    documents: _ScoreInputs | None = None
    items: _ScoreInputs | None = None
    data_1: _ScoreInputs | None = None
    data_2: _ScoreInputs | None = None

    @model_validator(mode="after")
    def _one_pair(self) -> ScoreRequest:
        given = [n for n in _PAIRS if all(getattr(self, f) is not None for f in n)]
        sent = {f for n in _PAIRS for f in n if getattr(self, f) is not None}
        if len(given) != 1 or sent != set(given[0]):
            names = ", ".join(f"{a} and {b}" for a, b in _PAIRS)
            raise ValueError(f"send one pair of inputs to score: {names}")
        return self

    def pair_names(self) -> tuple[str, str]:
        """The names of the pair sent (the validator saw to it that there is one)."""
        return next(n for n in _PAIRS if all(getattr(self, f) is not None for f in n))


_PAIRS = (
    ("text_1", "text_2"),
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
)


class RerankRequest(_ScoringFields):
    """Jina's and Cohere's rerank body, as vLLM takes it (``top_n`` 0: every document)."""

    query: str | list[P.TokenId]
    documents: list[str | list[P.TokenId]]
    top_n: int = Field(default=0, ge=0)
    return_documents: bool = True


class ClassificationRequest(_ScoringFields):
    """vLLM's ``/classify`` body: ``input`` (a list may mix strings and token ids), or one
    conversation in ``messages`` rendered with the chat template (what a reward model scores:
    the prompt and the response to judge); or SGLang's, for its reward-model route: ``text``
    (a string or strings) or ``input_ids`` (ids or lists of them)."""

    input: _ScoreInputs | None = None
    messages: list[P.ChatMessage] | None = None
    add_generation_prompt: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    text: str | list[str] | None = None
    input_ids: list[P.TokenId] | list[list[P.TokenId]] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> ClassificationRequest:
        sent = [f for f in _CLASSIFY_INPUTS if getattr(self, f) is not None]
        if len(sent) != 1:
            raise ValueError(f"send one of {', '.join(_CLASSIFY_INPUTS)}")
        return self

    def sglang(self) -> bool:
        """Whether the body is SGLang's (``text`` or ``input_ids``), answered in its shape."""
        return self.text is not None or self.input_ids is not None


_CLASSIFY_INPUTS = ("input", "messages", "text", "input_ids")


class PoolingRequest(ClassificationRequest):
    """vLLM's ``/pooling`` body: ``classify``'s inputs, and ``encoding_format``."""

    encoding_format: Literal["float", "base64"] = "float"


def build_embedding_router(server: OpenAIServer) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/embeddings", responses=ERROR_RESPONSES)
    async def embeddings(req: EmbeddingRequest) -> dict[str, Any]:
        model = server.check_model(req.model)
        inputs = _texts(req.input, "input")
        ids = await _token_ids(server, inputs, ["input"] * len(inputs), req.add_special_tokens)
        vectors, accounting = await _embed(
            server,
            req.model,
            ids,
            req.deterministic,
            "input",
            pooling=req.pooling,
            dimensions=req.dimensions,
            normalize=req.normalize,
        )
        data = [
            {"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
            for i, v in enumerate(vectors)
        ]
        return {
            "object": "list",
            "data": data,
            "model": model,
            **accounting,
        }

    async def score(req: ScoreRequest) -> dict[str, Any]:
        model = server.check_model(req.model)
        first, second = req.pair_names()
        lefts, rights = _texts(getattr(req, first), first), _texts(getattr(req, second), second)
        if len(lefts) != 1 and len(lefts) != len(rights):
            raise ApiError(
                400,
                f"{first} has {len(lefts)} inputs and {second} {len(rights)}: send one "
                f"{first} for every {second}, or a single {first}",
                first,
            )
        scores, accounting = await _pair_scores(
            server, req.model, lefts, rights, (first, second), req.deterministic,
            req.add_special_tokens,
        )  # fmt: skip
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return {**_listing("score", model, data), **accounting}

    async def rerank(req: RerankRequest) -> dict[str, Any]:
        model = server.check_model(req.model)
        docs = _texts(req.documents, "documents")
        scores, accounting = await _pair_scores(
            server, req.model, [req.query], docs, ("query", "documents"), req.deterministic,
            req.add_special_tokens,
        )  # fmt: skip
        scored = [(s, i) for i, s in enumerate(scores)]
        scored.sort(key=lambda si: (-si[0], si[1]))  # best first; ties by position
        if req.top_n > 0:
            scored = scored[: req.top_n]
        results = [
            {
                "index": i,
                "relevance_score": sc,
                "document": (
                    {"text": docs[i]} if req.return_documents and isinstance(docs[i], str) else None
                ),
            }
            for sc, i in scored
        ]
        return {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": model,
            "results": results,
            **accounting,
        }

    async def classify(req: ClassificationRequest) -> dict[str, Any] | list[dict[str, Any]]:
        model = server.check_model(req.model)
        ids = await _classified_ids(server, req)
        outs, accounting = await _classify(server, req.model, ids, req.deterministic, "input")
        if req.sglang():
            # SGLang's reward-model answer: per input the raw output as `embedding`; one
            # object for a single string (or flat ids), else a list.
            items = [
                {
                    "embedding": o.outputs.logits,
                    "meta_info": {
                        "id": o.request_id,
                        "prompt_tokens": len(p),
                        "fingerprint": accounting["fingerprint"],
                    },
                }
                for o, p in zip(outs, ids, strict=True)
            ]
            single = isinstance(req.text, str) or (
                req.input_ids is not None and all(isinstance(x, int) for x in req.input_ids)
            )
            return items[0] if single else items
        data = [
            {
                "index": i,
                "label": o.outputs.label,
                "probs": o.outputs.probs,
                "num_classes": len(o.outputs.probs),
                "logits": o.outputs.logits,
            }
            for i, o in enumerate(outs)
        ]
        return {**_listing("classify", model, data), **accounting}

    @router.post("/pooling", responses=ERROR_RESPONSES)
    async def pooling(req: PoolingRequest) -> dict[str, Any]:
        """A reward model's raw output (a classifier's logits), or an embedding model's
        embedding, as vLLM's pooling API answers for each kind."""
        model = server.check_model(req.model)
        ids = await _classified_ids(server, req)
        if server.engine.labels is None:
            rows, accounting = await _embed(server, req.model, ids, req.deterministic, "input")
        else:
            outs, accounting = await _classify(server, req.model, ids, req.deterministic, "input")
            rows = [o.outputs.logits for o in outs]
        data = [
            {"index": i, "object": "pooling", "data": _encode(v, req.encoding_format)}
            for i, v in enumerate(rows)
        ]
        return {**_listing("pool", model, data), **accounting}

    for path in ("/classify", "/v1/classify"):
        router.add_api_route(path, classify, methods=["POST"], responses=ERROR_RESPONSES)
    for path in ("/score", "/v1/score"):
        router.add_api_route(path, score, methods=["POST"], responses=ERROR_RESPONSES)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        router.add_api_route(path, rerank, methods=["POST"], responses=ERROR_RESPONSES)
    return router


async def _embed(
    server: OpenAIServer,
    model: str | None,
    ids: list[list[int]],
    deterministic: bool | None,
    param: str,
    *,
    pooling: str = "last",
    dimensions: int | None = None,
    normalize: bool = True,
) -> tuple[list[list[float]], dict[str, Any]]:
    """The embeddings of checked inputs (``_token_ids``) and the response's usage and
    fingerprint; an engine error names ``param`` where it names no field of its own."""
    if deterministic is None:
        deterministic = server.defaults.deterministic_by_default
    try:
        outs = await server.engine.embed(
            ids,
            pooling=pooling,
            dimensions=dimensions,
            normalize=normalize,
            deterministic=deterministic,
            lora_request=server.lora_of(model),
        )
    except InvalidRequestError as e:
        raise ApiError(400, str(e), e.param or param) from None
    return [o.outputs.embedding for o in outs], _accounting(server, ids, outs[0].fingerprint)


async def _pair_scores(
    server: OpenAIServer,
    model: str | None,
    lefts: list[str | list[int]],
    rights: list[str | list[int]],
    names: tuple[str, str],
    deterministic: bool | None,
    add_special_tokens: bool,
) -> tuple[list[float], dict[str, Any]]:
    """The score of each pair (``lefts[i]``, or the single left, with ``rights[i]``) and the
    response's usage and fingerprint. An embedding model (a bi-encoder): the cosine of the two
    embeddings. A sequence classifier of one label (a cross-encoder): its probability for the
    pair as one sequence, the texts joined by the tokenizer's pair template (token ids: the
    two concatenated)."""
    labels = server.engine.labels
    if labels is None:
        params = [names[0]] * len(lefts) + [names[1]] * len(rights)
        ids = await _token_ids(server, lefts + rights, params, add_special_tokens)
        vectors, accounting = await _embed(server, model, ids, deterministic, names[0])
        vl, vr = vectors[: len(lefts)], vectors[len(lefts) :]
        scores = [cosine(vl[i if len(vl) > 1 else 0], v) for i, v in enumerate(vr)]
        return scores, accounting
    if len(labels) != 1:
        raise ApiError(
            400,
            f"this model classifies into {len(labels)} labels: scoring pairs needs a "
            "cross-encoder (one label) or an embedding model",
            "model",
        )
    joined: list[str | list[int]] = []
    for i, right in enumerate(rights):
        left = lefts[i if len(lefts) > 1 else 0]
        if isinstance(left, str) and isinstance(right, str):
            joined.append(await server.encode_pair(left, right, add_special_tokens))
        elif isinstance(left, list) and isinstance(right, list):
            joined.append(left + right)
        else:
            raise ApiError(400, "send both sides of a pair as text or both as token ids", names[1])
    ids = await _token_ids(server, joined, [names[1]] * len(joined), add_special_tokens)
    outs, accounting = await _classify(server, model, ids, deterministic, names[1])
    return [o.outputs.probs[0] for o in outs], accounting


async def _classified_ids(server: OpenAIServer, req: ClassificationRequest) -> list[list[int]]:
    """A classification request's inputs as checked token ids: each of ``input``, or the one
    conversation in ``messages`` rendered with the chat template."""
    if req.messages is not None:
        rendered = await server.render_chat(
            req.messages, req.add_generation_prompt, req.chat_template_kwargs
        )
        return await _token_ids(server, [rendered], ["messages"], False)
    field = next(f for f in ("input", "text", "input_ids") if getattr(req, f) is not None)
    inputs = _texts(getattr(req, field), field)
    return await _token_ids(server, inputs, [field] * len(inputs), req.add_special_tokens)


async def _classify(
    server: OpenAIServer,
    model: str | None,
    ids: list[list[int]],
    deterministic: bool | None,
    param: str,
) -> tuple[list[ClassificationRequestOutput], dict[str, Any]]:
    """The classifications of checked inputs and the response's usage and fingerprint; an
    engine error names ``param`` where it names no field of its own."""
    if deterministic is None:
        deterministic = server.defaults.deterministic_by_default
    try:
        outs = await server.engine.classify(
            ids, deterministic=deterministic, lora_request=server.lora_of(model)
        )
    except InvalidRequestError as e:
        raise ApiError(400, str(e), e.param or param) from None
    return outs, _accounting(server, ids, outs[0].fingerprint)


async def _token_ids(
    server: OpenAIServer, inputs: list[str | list[int]], params: list[str], add_special_tokens: bool
) -> list[list[int]]:
    """Each input tokenized (or its ids) and checked: not empty, within the context, in the
    vocabulary; an error names the input's field (``params``) and, where the field has
    several, its position."""
    counts = {p: params.count(p) for p in params}
    seen: dict[str, int] = {}
    ids: list[list[int]] = []
    for x, field_name in zip(inputs, params, strict=True):
        k = seen[field_name] = seen.get(field_name, -1) + 1
        param = field_name if counts[field_name] == 1 else f"{field_name}[{k}]"
        p = await server.encode(x, add_special_tokens) if isinstance(x, str) else list(x)
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
        ids.append(p)
    return ids


def _accounting(server: OpenAIServer, ids: list[list[int]], fingerprint: str) -> dict[str, Any]:
    """The tail of these routes' responses: the inputs' prompt tokens and the server's
    fingerprint of the numbers (the engine's ``fingerprint`` and the server's suffix)."""
    n = sum(len(p) for p in ids)
    usage = {"prompt_tokens": n, "total_tokens": n}
    return {"usage": usage, "fingerprint": fingerprint + server.defaults.fingerprint_suffix()}


def _listing(kind: str, model: str, data: list[dict[str, Any]]) -> dict[str, Any]:
    """The head of vLLM's list responses (``/score``, ``/classify``)."""
    return {
        "id": f"{kind}-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
    }


def cosine(a: list[float], b: list[float]) -> float:
    """The cosine similarity of two vectors, each sum exactly rounded (``math.fsum``): the
    same value whatever the summation order, so it depends on the vectors' bits alone."""
    norm = math.sqrt(math.fsum(x * x for x in a) * math.fsum(y * y for y in b))
    return math.fsum(x * y for x, y in zip(a, b, strict=True)) / norm if norm else 0.0


def _texts(value: Any, param: str) -> list[str | list[int]]:
    """A field's inputs: a string, token ids, or a list of either."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise ApiError(400, f"{param} is an empty list", param)
    if all(isinstance(x, int) for x in value):
        return [list(value)]
    return list(value)


def _encode(values: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return values
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
