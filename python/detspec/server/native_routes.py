"""SGLang's native generation API, ``POST /generate``: what RL stacks built on SGLang (slime,
AReaL and others) send a rollout server instead of OpenAI's routes, with token ids in and
out and the sampled tokens' logprobs beside them.

Request: ``text`` or ``input_ids`` (one prompt or a batch), ``sampling_params`` (one object
for all prompts or one per prompt: ``max_new_tokens``, ``min_new_tokens``, ``temperature``,
``top_p``, ``top_k``, ``min_p``, the penalties, ``stop``, ``stop_token_ids``, ``ignore_eos``,
``skip_special_tokens``, ``no_stop_trim``, ``spaces_between_special_tokens``, ``n``,
``json_schema``, ``regex``, ``sampling_seed``, ``logit_bias``), ``return_logprob``,
``logprob_start_len`` (prompt logprobs from that position; -1: none), ``top_logprobs_num``,
``return_text_in_logprobs``, ``stream``, ``rid``, and detspec's ``deterministic``. Fields
SGLang has and detspec cannot honour are accepted at their neutral value only, and unknown
fields are refused (as on the OpenAI routes: a field that would change the output must never
be dropped silently).

Response: per output ``{"text", "output_ids", "meta_info"}``, a list for a batch or ``n`` >
1; ``meta_info`` has ``id``, ``finish_reason`` (``{"type": "stop", "matched": token id or
stop string}``, ``{"type": "length", "length": n}``, ``{"type": "abort"}``),
``prompt_tokens``, ``completion_tokens``, ``weight_version``, and with ``return_logprob``
``output_token_logprobs`` / ``input_token_logprobs`` (``[logprob, token id, text or null]``
per position; the first prompt token's logprob null) and, with ``top_logprobs_num``, the
``*_top_logprobs``; detspec adds ``fingerprint`` and ``dvr_metrics``. ``stream: true``
sends cumulative outputs as ``data: {...}`` events (each with its ``index``), ending in
``data: [DONE]``.

``POST /abort_request`` (SGLang's ``{"rid": ..., "abort_all": false}``) aborts the running
``/generate`` request of that ``rid`` (each prompt's engine request carries its rid); it ends
with ``{"type": "abort"}`` and what it had generated. ``abort_all`` aborts every request of
every route. An unknown rid is a 200 that changes nothing, as in SGLang.

A request is translated into the OpenAI completion request it means and goes through the same
validation, server-wide defaults (``--deterministic-by-default``), admission and generation
as ``/v1/completions``; an error names the field of this API (``sampling_params.
max_new_tokens``, not ``max_tokens``). Prompt logprobs are computed first and their pages
reused by the generation, as with ``echo``. This module builds on ``serving``, never the
other way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field

from detspec.errors import DetspecError
from detspec.outputs import CompletionOutput, RequestOutput
from detspec.server import protocol as P
from detspec.server.errors import ERROR_RESPONSES, ApiError, stream_error_body
from detspec.server.jobs import InFlight, Job
from detspec.server.logprobs import json_logprob, split_logprobs
from detspec.server.score_batcher import PromptLogprobs
from detspec.server.serving import failed
from detspec.server.shaping import dvr_metrics
from detspec.server.streaming import first_output, until_disconnect
from detspec.server.structured import request_constraints, single

if TYPE_CHECKING:
    from detspec.server.serving import OpenAIServer

NATIVE_PATHS = ("/generate", "/abort_request")


class NativeSamplingParams(P.OpenAIBaseModel):
    """SGLang's ``sampling_params`` (its defaults)."""

    max_new_tokens: int = Field(default=128, ge=0, le=2**31 - 1)
    min_new_tokens: int = Field(default=0, ge=0, le=2**31 - 1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, le=2**31 - 1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[P.TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = Field(default=1, ge=1, le=256)
    json_schema: str | None = None
    regex: str | None = None
    sampling_seed: P.Int64 | None = None
    logit_bias: dict[str, Any] | None = None
    # Keep the stop string (or the stop token's text) at the end of `text` (vLLM's
    # include_stop_str_in_output); `output_ids` are the same either way.
    no_stop_trim: bool = False
    # A slow (Python) tokenizer's option; the fast tokenizer detspec runs (as SGLang's
    # default ones) puts no spaces between special tokens either way.
    spaces_between_special_tokens: bool = True


class GenerateRequest(P.OpenAIBaseModel):
    text: str | list[str] | None = None
    input_ids: list[P.TokenId] | list[list[P.TokenId]] | None = None
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] | None = None
    return_logprob: bool = False
    logprob_start_len: int = Field(default=-1, ge=-1, le=2**31 - 1)
    top_logprobs_num: int = Field(default=0, ge=0)
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    deterministic: bool | None = Field(
        default=None,
        description="bitwise-reproducible output (detspec); unset: the server's default",
    )
    # Accepted at their neutral values only.
    return_hidden_states: Literal[False] = False
    return_routed_experts: Literal[False] = False
    image_data: None = None
    custom_logit_processor: None = None
    # SGLang's adapter field: the name of a loaded LoRA adapter (--lora-modules,
    # /load_lora_adapter), one for every prompt or one per prompt.
    lora_path: str | list[str | None] | None = None


class AbortRequest(P.OpenAIBaseModel):
    """SGLang's ``AbortReq``: the request of one ``rid``, or every request."""

    rid: str | None = None
    abort_all: bool = False


# OpenAI field (what serving's checks and the engine name) -> this API's.
_NATIVE_NAMES = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "seed": "sampling_seed",
    "structured_outputs.json": "json_schema",
    "structured_outputs.regex": "regex",
}


def build_native_router(server: OpenAIServer) -> APIRouter:
    router = APIRouter()
    inflight = InFlight(server.engine)

    @router.post("/generate", responses=ERROR_RESPONSES)
    async def generate(req: GenerateRequest, request: Request) -> Response:
        server.check_logprobs(top_logprobs_num=req.top_logprobs_num)
        return await _generate(server, req, request, inflight)

    @router.post("/abort_request", responses=ERROR_RESPONSES)
    async def abort_request(req: AbortRequest | None = None) -> JSONResponse:
        req = req or AbortRequest()
        rids = await inflight.abort(req.rid, req.abort_all)
        if req.abort_all:
            message = f"aborted {len(rids)} running request(s)"
        elif rids:
            message = f"aborted the request with rid {req.rid!r}"
        else:
            message = f"no running /generate request has rid {req.rid!r}: nothing aborted"
        return JSONResponse({"success": True, "message": message, "rids": rids})

    return router


# --------------------------------------------------------------------------- request


def _prompts(req: GenerateRequest) -> tuple[list[str | list[int]], bool, str]:
    """The prompts, whether the request is a batch, and the field they came from."""
    if (req.text is None) == (req.input_ids is None):
        raise ApiError(400, "give exactly one of `text` and `input_ids`", "input_ids")
    if req.text is not None:
        texts = [req.text] if isinstance(req.text, str) else list(req.text)
        return list(texts), not isinstance(req.text, str), "text"
    ids = req.input_ids or []
    if ids and isinstance(ids[0], list):
        return [list(p) for p in ids], True, "input_ids"  # type: ignore[union-attr]
    return [list(ids)], False, "input_ids"  # type: ignore[arg-type]


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    """A field given once for every prompt, or as a list of one per prompt."""
    if isinstance(value, list):
        if len(value) != n:
            raise ApiError(400, f"{name} has {len(value)} entries for {n} prompts", name)
        return value
    return [value] * n


def _native_param(param: str | None, index: int | None) -> str | None:
    """The name of this API's field behind an OpenAI field name."""
    if param is None:
        return None
    if param in ("prompt", "model") or param.startswith("prompt["):
        return param
    name = _NATIVE_NAMES.get(param, param)
    if name.split(".")[0].split("[")[0] in NativeSamplingParams.model_fields:
        where = "sampling_params" if index is None else f"sampling_params[{index}]"
        return f"{where}.{name}"
    return name


@contextmanager
def _renamed(index: int | None) -> Iterator[None]:
    """Re-raises an ``ApiError`` naming this API's field instead of the OpenAI one."""
    try:
        yield
    except ApiError as e:
        native = _native_param(e.param, index)
        if native != e.param:
            e.message = f"{e.message} (field `{native}` here)"
            e.args = (e.message,)
            e.param = native
        raise


def _completion_request(
    req: GenerateRequest, sp: NativeSamplingParams, ids: list[int]
) -> P.CompletionRequest:
    """The OpenAI completion request ``sp`` means for the prompt ``ids``."""
    structured: dict[str, Any] = {}
    if sp.json_schema is not None:
        structured["json"] = sp.json_schema
    if sp.regex is not None:
        structured["regex"] = sp.regex
    fields: dict[str, Any] = {
        "prompt": ids,
        "max_tokens": sp.max_new_tokens,
        "min_tokens": sp.min_new_tokens,
        # Nothing is sampled without new tokens: no seed is needed to reproduce it.
        "temperature": sp.temperature if sp.max_new_tokens > 0 else 0.0,
        "top_p": sp.top_p,
        "top_k": sp.top_k,
        "min_p": sp.min_p,
        "frequency_penalty": sp.frequency_penalty,
        "presence_penalty": sp.presence_penalty,
        "repetition_penalty": sp.repetition_penalty,
        "stop": sp.stop,
        "include_stop_str_in_output": sp.no_stop_trim,
        "stop_token_ids": sp.stop_token_ids,
        "ignore_eos": sp.ignore_eos,
        "skip_special_tokens": sp.skip_special_tokens,
        "n": sp.n,
        "seed": sp.sampling_seed,
        "logit_bias": sp.logit_bias,
        "deterministic": req.deterministic,
        "logprobs": req.top_logprobs_num if req.return_logprob else None,
    }
    if structured:
        fields["structured_outputs"] = P.StructuredOutputs(**structured)
    return P.CompletionRequest(**fields)


# --------------------------------------------------------------------------- generation


async def _generate(
    server: OpenAIServer, req: GenerateRequest, request: Request, inflight: InFlight
) -> Response:
    prompts, batch, prompt_field = _prompts(req)
    if not prompts:
        raise ApiError(400, f"{prompt_field} is an empty list", prompt_field)
    given = req.sampling_params or NativeSamplingParams()
    sps: list[NativeSamplingParams] = _per_prompt(given, len(prompts), "sampling_params")
    rids = _per_prompt(req.rid, len(prompts), "rid")
    loras = _per_prompt(req.lora_path, len(prompts), "lora_path")
    base = uuid.uuid4().hex
    jobs: list[Job] = []
    for i, (pr, sp) in enumerate(zip(prompts, sps, strict=True)):
        param = prompt_field if not batch else f"{prompt_field}[{i}]"
        ids = await server.encode(pr) if isinstance(pr, str) else pr
        if not ids:
            raise ApiError(400, f"{param} is empty", param)
        rid = rids[i] if rids[i] is not None else f"{base}-{i}"
        with _renamed(i if isinstance(req.sampling_params, list) else None):
            jobs.append(_job(server, req, sp, i, rid, ids, param, loras[i]))
    generating = [j for j in jobs if sps[j.index].max_new_tokens > 0]
    start = time.perf_counter()
    # Abortable by rid from here on (while the prompts are scored too); the run's `watch`
    # lets go of them when it ends, this function when no run began.
    inflight.add(generating)
    run = inflight.watch(generating, server.run(generating)) if generating else None
    agen = run if req.stream else None
    streaming = False
    try:
        inputs = await until_disconnect(request, _input_logprobs(server, req, jobs))
        shape = _Shaper(server, req, sps, inputs, start)
        if req.stream:
            # Admission and the first output before the response starts, so that their
            # errors are HTTP errors rather than a broken stream.
            first = await until_disconnect(request, first_output(agen)) if agen else None
            streaming = True
            return _stream(shape, jobs, generating, (agen, first))
        last = await until_disconnect(request, _last_outputs(run))
    except BaseException as e:
        if run is not None:
            await run.aclose()  # type: ignore[attr-defined]
        with _renamed(None):
            return failed(e, jobs[0])
    finally:
        if not streaming:
            inflight.remove(generating)
    items = []
    for job in jobs:
        out = last.get(job.index)
        for c in out.outputs if out is not None else [None] * job.params.n:
            items.append(shape.item(job, out, c))
    return JSONResponse(items if batch or len(items) > 1 else items[0])


async def _last_outputs(
    run: AsyncIterator[tuple[Job, RequestOutput]] | None,
) -> dict[int, RequestOutput]:
    """Runs a generation to the end; the last output of each job, by ``Job.index``."""
    last: dict[int, RequestOutput] = {}
    if run is None:
        return last
    async with contextlib.aclosing(run):  # type: ignore[type-var]
        async for job, out in run:
            last[job.index] = out
    return last


def _job(
    server: OpenAIServer,
    req: GenerateRequest,
    sp: NativeSamplingParams,
    index: int,
    rid: str,
    ids: list[int],
    param: str,
    lora: str | None,
) -> Job:
    """One prompt's engine request, checked as ``/v1/completions`` checks it; ``lora``: the
    adapter it runs with (its name is the OpenAI request's ``model``)."""
    if lora is not None and server.lora_of(lora) is None:
        raise ApiError(
            400,
            f"no LoRA adapter named `{lora}` is loaded (loaded: "
            f"{', '.join(server.engine.list_loras()) or 'none'})",
            "lora_path",
        )
    creq = _completion_request(req, sp, ids)
    if lora is not None:
        creq.model = lora
    server.defaults.apply(creq)
    server.common_checks(creq)
    constraint = single(request_constraints(creq))
    if sp.max_new_tokens > 0:
        return server.job(
            creq, index, rid, ids, param, sp.max_new_tokens, "max_tokens", creq.logprobs,
            constraint,
        )  # fmt: skip
    # Only the prompt's logprobs: the parameters are checked; nothing is generated.
    params = server.sampling_params(creq, 1, creq.logprobs, constraint)
    job = Job(index, rid, ids, params, constraint=constraint, lora=lora)
    server.validate(ids, params, param, job)
    return job


async def _input_logprobs(
    server: OpenAIServer, req: GenerateRequest, jobs: list[Job]
) -> list[PromptLogprobs | None]:
    """Each prompt's logprobs when asked for (``logprob_start_len`` >= 0), computed before the
    generation so that it reads their KV pages."""
    if not req.return_logprob or req.logprob_start_len < 0:
        return [None] * len(jobs)
    return list(
        await asyncio.gather(
            *(
                server.score_batcher.prompt_logprobs(
                    j.prompt_ids, req.top_logprobs_num, bool(j.params.deterministic), j.lora
                )
                for j in jobs
            )
        )
    )


def _stream(
    shape: _Shaper,
    jobs: list[Job],
    generating: list[Job],
    generation: tuple[AsyncIterator[tuple[Job, RequestOutput]] | None, Any],
) -> StreamingResponse:
    """Cumulative outputs as ``data:`` events (each with its output's ``index``), then
    ``data: [DONE]``; ``generation``: the started generation of ``generating`` and its first
    output."""
    agen, first = generation
    offsets = {j.index: sum(x.params.n for x in jobs[: j.index]) for j in jobs}

    def event(job: Job, out: RequestOutput | None, c: CompletionOutput | None) -> str:
        index = offsets[job.index] + (c.index if c is not None else 0)
        return f"data: {json.dumps({'index': index, **shape.item(job, out, c)})}\n\n"

    async def body() -> AsyncIterator[str]:
        for job in jobs:  # prompts only scored: one event per output
            if job not in generating:
                for _ in range(job.params.n):
                    yield event(job, None, None)
        if agen is not None:
            try:
                for job, out in [first] if first is not None else []:
                    for c in out.outputs:
                        yield event(job, out, c)
                async for job, out in agen:
                    for c in out.outputs:
                        yield event(job, out, c)
            except DetspecError as e:
                yield f"data: {json.dumps(stream_error_body(e))}\n\n"
            finally:
                await agen.aclose()  # type: ignore[attr-defined]
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


# --------------------------------------------------------------------------- response


@dataclass
class _Shaper:
    """Shapes one request's outputs as SGLang does: the server, the request, each prompt's
    sampling parameters and prompt logprobs, and when the request started."""

    server: OpenAIServer
    req: GenerateRequest
    sps: list[NativeSamplingParams]
    inputs: list[PromptLogprobs | None]
    start: float

    def item(
        self, job: Job, out: RequestOutput | None, c: CompletionOutput | None
    ) -> dict[str, Any]:
        """One output (``c`` None: the prompt was only scored)."""
        ids = list(c.token_ids) if c is not None else []
        meta: dict[str, Any] = {
            "id": job.rid if job.params.n == 1 or c is None else f"{job.rid}-{c.index}",
            "finish_reason": _finish_reason(c),
            "prompt_tokens": len(job.prompt_ids),
            "completion_tokens": len(ids),
            "cached_tokens": out.num_cached_tokens if out is not None else 0,
            "e2e_latency": time.perf_counter() - self.start,
            "weight_version": self.server.weight_version_name(),
            "fingerprint": self.server.fingerprint_of(job),
        }
        if out is not None:
            meta["dvr_metrics"] = dvr_metrics(out, job.params).model_dump()
        if self.req.return_logprob:
            tokens, tops = self.triples((c.logprobs or []) if c is not None else [])
            in_tokens, in_tops = self.prompt_triples(job)
            meta["output_token_logprobs"] = tokens
            meta["input_token_logprobs"] = in_tokens
            if self.req.top_logprobs_num > 0:
                meta["output_top_logprobs"] = tops
                meta["input_top_logprobs"] = in_tops
        return {"text": self.text(job, c), "output_ids": ids, "meta_info": meta}

    def prompt_triples(self, job: Job) -> tuple[list[list[Any]], list[list[list[Any]] | None]]:
        """The prompt's logprobs from ``logprob_start_len`` (none when it is -1); the first
        prompt token has none (nothing predicts it)."""
        entries = self.inputs[job.index]
        if entries is None:
            return [], []
        first = max(self.req.logprob_start_len, 0)
        tokens: list[list[Any]] = []
        tops: list[list[list[Any]] | None] = []
        for tok, e in zip(job.prompt_ids[first:], entries[first:], strict=True):
            if e is None:
                tokens.append([None, tok, self.name(tok)])
                tops.append(None)
            else:
                (t,), (tt,) = self.triples([e])
                tokens.append(t)
                tops.append(tt)
        return tokens, tops

    def triples(
        self, lps: list[dict[int, Any]]
    ) -> tuple[list[list[Any]], list[list[list[Any]] | None]]:
        """SGLang's ``[logprob, token id, text or null]`` per position, and the top
        ``top_logprobs_num`` of each position as such triples."""
        tokens: list[list[Any]] = []
        tops: list[list[list[Any]] | None] = []
        for d in lps:
            tok, lp, top = split_logprobs(d, self.req.top_logprobs_num)
            tokens.append([json_logprob(lp), tok, self.name(tok)])
            tops.append([[json_logprob(tlp), t, self.name(t)] for t, tlp in top])
        return tokens, tops

    def name(self, tok: int) -> str | None:
        return self.server.decode_token(tok) if self.req.return_text_in_logprobs else None

    def text(self, job: Job, c: CompletionOutput | None) -> str:
        """The output text; with ``no_stop_trim`` the stop that ended it stays at its end (a
        stop string is kept by the engine, ``include_stop_str_in_output``; a stop token's
        text is added here)."""
        if c is None:
            return ""
        if not self.sps[job.index].no_stop_trim or c.finish_reason != "stop":
            return c.text
        if isinstance(c.stop_reason, str):
            return c.text
        tokenizer = self.server.tokenizer
        if c.token_ids and tokenizer is not None:  # a stop token: its text, if shown
            return c.text + tokenizer.decode([c.token_ids[-1]], job.params.skip_special_tokens)
        return c.text


def _finish_reason(c: CompletionOutput | None) -> dict[str, Any] | None:
    """SGLang's finish reason; None while the output is still growing (a stream)."""
    if c is None or c.finish_reason == "length":
        return {"type": "length", "length": len(c.token_ids) if c is not None else 0}
    if c.finish_reason == "stop":
        matched = c.stop_reason
        if matched is None and c.token_ids:  # an end-of-sequence token
            matched = c.token_ids[-1]
        return {"type": "stop", "matched": matched}
    if c.finish_reason is None:
        return None
    return {"type": c.finish_reason}
