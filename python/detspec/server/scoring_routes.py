"""Prompt scoring over HTTP: ``/v1/completions`` with ``echo`` (OpenAI's way of returning the
prompt's logprobs, what lm-evaluation-harness and most likelihood-based eval stacks send),
``max_tokens: 0`` to score without generating, and ``GET /tokenizer_info`` so that clients
(lm-eval's remote tokenizer) tokenize exactly as the server does.

Echoed logprobs are computed like ``LLM.prompt_logprobs(prompts, k, deterministic=...)``:

* a deterministic request's are the verify-path values, bit for bit ``LLM.score`` and
  ``SamplingParams(prompt_logprobs=k)`` (whatever else the server is doing);
* a plain request's come from the fast path. Concurrent scoring requests are coalesced into
  one engine call (``score_batcher.ScoreBatcher``, the scoring twin of continuous batching),
  so their bits depend on what they were batched with, as a plain generation's do.

This module builds on ``serving`` (like ``rl_routes``), never the other way: ``app`` sends a
``/v1/completions`` request with ``echo`` here instead of to ``OpenAIServer.completions``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from detspec.errors import InvalidRequestError
from detspec.outputs import CompletionOutput, RequestOutput
from detspec.server import protocol as P
from detspec.server.errors import ApiError
from detspec.server.jobs import Job, completion_prompts
from detspec.server.score_batcher import PromptLogprobs, ScoreBatcher
from detspec.server.shaping import dvr_metrics, usage
from detspec.server.streaming import ClientGone, until_disconnect
from detspec.server.structured import constraint_invalid, request_constraints, single

if TYPE_CHECKING:
    from detspec.server.serving import OpenAIServer

# --------------------------------------------------------------------------- tokenizer info


def tokenizer_info(model_dir: str, server: OpenAIServer) -> dict[str, Any]:
    """vLLM's ``/tokenizer_info``: the special tokens and the chat template from the model
    directory (``tokenizer_config.json``, ``chat_template.jinja``; the server's
    ``--chat-template`` instead where given), which lm-eval reads to use the server's
    tokenizer (``/tokenize``, ``/detokenize``) instead of loading its own."""
    cfg: dict[str, Any] = {}
    path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)

    def special(name: str) -> str | None:
        v = cfg.get(name)
        if isinstance(v, dict):  # AddedToken serialised as a dict
            v = v.get("content")
        return v if isinstance(v, str) else None

    eos = special("eos_token")
    eos_ids = server.engine.eos_token_ids
    if eos is None and eos_ids and server.tokenizer is not None:
        eos = server.decode_token(eos_ids[0])
    template = server.config.chat_template or cfg.get("chat_template")
    jinja = os.path.join(model_dir, "chat_template.jinja")
    if not isinstance(template, str) and os.path.exists(jinja):
        with open(jinja, encoding="utf-8") as f:
            template = f.read()
    return {
        "tokenizer_class": cfg.get("tokenizer_class", "PreTrainedTokenizerFast"),
        "eos_token": eos,
        "bos_token": special("bos_token"),
        "pad_token": special("pad_token"),
        "unk_token": special("unk_token"),
        "eos_token_ids": eos_ids,
        "chat_template": template if isinstance(template, str) else None,
        "model_max_length": server.max_model_len,
        "vocab_size": server.vocab_size,
        "add_bos_token": bool(cfg.get("add_bos_token", False)),
    }


def build_scoring_router(server: OpenAIServer) -> APIRouter:
    router = APIRouter()

    @router.get("/tokenizer_info")
    async def _tokenizer_info() -> dict[str, Any]:
        if server.tokenizer is None:
            raise ApiError(404, "this model has no tokenizer", None)
        return await asyncio.to_thread(tokenizer_info, server.engine.model, server)

    return router


# --------------------------------------------------------------------------- echo


async def echo_completions(
    server: OpenAIServer, req: P.CompletionRequest, request: Request
) -> Response:
    """``/v1/completions`` with ``echo: true``: every choice's text starts with its prompt; with
    ``logprobs`` its ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``
    cover the prompt's tokens (the first one's logprob and top logprobs null) and then the
    completion's."""
    server.defaults.apply(req)
    generate = req.max_tokens != 0
    if not generate:  # nothing is sampled: a seed is not needed for reproducibility
        req = req.model_copy(update={"temperature": 0.0})
    model = server.check_model(req.model)
    server.common_checks(req)
    if req.suffix is not None:
        raise ApiError(400, "suffix is not supported", "suffix")
    constraint = single(request_constraints(req))
    prompts = completion_prompts(req.prompt)
    base = f"cmpl-{uuid.uuid4().hex}"
    jobs: list[Job] = []
    texts: list[str | None] = []
    for i, pr in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        ids = await server.encode(pr, req.add_special_tokens) if isinstance(pr, str) else list(pr)
        rid = f"{base}-{i}"
        if generate:
            jobs.append(
                server.job(
                    req, i, rid, ids, param, req.max_tokens, "max_tokens", req.logprobs, constraint
                )
            )
        else:
            if not ids:
                raise ApiError(400, f"{param} is empty", param)
            _check_scorable(server, ids, param)
            # The parameters are validated; nothing is generated.
            params = server.sampling_params(req, 1, req.logprobs, constraint)
            job = Job(
                i,
                rid,
                ids,
                params,
                constraint=constraint,
                lora=server.lora_of(req.model),
                cache_salt=req.cache_salt,
            )
            server.validate(None, params, param, job)
            jobs.append(job)
        texts.append(pr if isinstance(pr, str) else None)

    async def work() -> tuple[dict[int, RequestOutput], list[PromptLogprobs | None]]:
        # The prompts are scored first: the scoring forward leaves their KV pages in the
        # prefix cache, so the generation after it does not compute them again.
        plps = await _score_prompts(server, req, jobs)
        last = await server.last_outputs(jobs) if generate else {}
        return last, plps

    await server.attach_prompt_logprobs(jobs, req.prompt_logprobs)
    if req.stream:
        return await _stream_echo(server, req, request, jobs, texts, base, model, generate)
    try:
        last, plps = await until_disconnect(request, work())
    except ClientGone:
        return Response(status_code=499)
    except InvalidRequestError as e:
        raise constraint_invalid(e, constraint) from None

    choices: list[dict[str, Any]] = []
    completion_tokens = 0
    for job, text, plp in zip(jobs, texts, plps, strict=True):
        prompt_text = _prompt_text(server, job, text)
        outs: Sequence[Any] = last[job.index].outputs if generate else [None] * job.params.n
        for ci, c in enumerate(outs):
            index = job.index * job.params.n + ci
            completion = c.text if c is not None else ""
            if c is not None:
                completion_tokens += len(c.token_ids)
            logprobs = None
            if req.logprobs is not None and plp is not None:
                logprobs = _echo_logprobs(
                    server, job.prompt_ids, plp, req.logprobs, req.return_tokens_as_token_ids
                )
                if c is not None:
                    tail = server.logprobs.completion(
                        c.logprobs or [],
                        req.logprobs,
                        len(prompt_text),
                        req.return_tokens_as_token_ids,
                    )
                    for key in logprobs:
                        logprobs[key].extend(tail[key])
            choice: dict[str, Any] = {
                "index": index,
                "text": prompt_text + completion,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason if c is not None else "length",
                "stop_reason": c.stop_reason if c is not None else None,
            }
            if req.return_token_ids:
                choice["prompt_token_ids"] = job.prompt_ids
                choice["token_ids"] = list(c.token_ids) if c is not None else []
            if job.prompt_logprobs is not None:
                choice["prompt_logprobs"] = job.prompt_logprobs
            if c is not None:
                choice["dvr_metrics"] = dvr_metrics(last[job.index], job.params)
            choices.append(choice)
    body = {
        "id": base,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": server.fingerprint_of(jobs[0]),
        "choices": choices,
        "usage": usage(
            sum(len(j.prompt_ids) for j in jobs),
            completion_tokens,
            sum(o.num_cached_tokens for o in last.values()) if generate else None,
        ),
    }
    return JSONResponse(P.CompletionResponse(**body).model_dump(exclude_unset=True))


async def _score_prompts(
    server: OpenAIServer, req: P.CompletionRequest, jobs: list[Job]
) -> list[PromptLogprobs | None]:
    """Each job's prompt logprobs at the request's ``logprobs`` (None without it), from the
    score batcher: the verify path's for a deterministic request."""
    batcher: ScoreBatcher = server.score_batcher
    det, k = bool(req.deterministic), req.logprobs
    if k is None:
        return [None] * len(jobs)
    return list(
        await asyncio.gather(
            *(batcher.prompt_logprobs(j.prompt_ids, k, det, j.lora, j.cache_salt) for j in jobs)
        )
    )


def _prompt_text(server: OpenAIServer, job: Job, text: str | None) -> str:
    """What an echo repeats: the prompt as sent, or its ids decoded."""
    if text is not None:
        return text
    return server.tokenizer.decode(job.prompt_ids, False) if server.tokenizer else ""


async def _stream_echo(
    server: OpenAIServer,
    req: P.CompletionRequest,
    request: Request,
    jobs: list[Job],
    texts: list[str | None],
    base: str,
    model: str,
    generate: bool,
) -> Response:
    """A streamed ``echo``, as vLLM streams it: each choice's first chunk begins with its
    prompt and, with ``logprobs``, the prompt tokens' logprobs (scored as the unstreamed echo
    scores them, before generating); the completion streams after it. With ``max_tokens: 0``
    that first chunk is the whole choice."""
    try:
        plps = await until_disconnect(request, _score_prompts(server, req, jobs))
    except ClientGone:
        return Response(status_code=499)
    except InvalidRequestError as e:
        raise jobs[0].invalid(e) from None
    for job, text, plp in zip(jobs, texts, plps, strict=True):
        job.echo = _prompt_text(server, job, text)
        if plp is not None and req.logprobs is not None:
            as_ids = req.return_tokens_as_token_ids
            job.echo_logprobs = _echo_logprobs(server, job.prompt_ids, plp, req.logprobs, as_ids)
    outputs = None if generate else _nothing_generated(jobs, server.fingerprint_of(jobs[0]))
    return await server.respond(req, request, jobs, base, model, chat=False, outputs=outputs)


async def _nothing_generated(
    jobs: list[Job], fingerprint: str
) -> AsyncIterator[tuple[Job, RequestOutput]]:
    """Each job's output with no tokens, finished at its length limit (``max_tokens: 0``)."""
    for job in jobs:
        empty = [
            CompletionOutput(
                i,
                "",
                [],
                None,
                [] if job.params.logprobs is not None else None,
                finish_reason="length",
            )
            for i in range(job.params.n)
        ]
        yield job, RequestOutput(job.rid, None, job.prompt_ids, empty, True, fingerprint)


def _check_scorable(server: OpenAIServer, ids: list[int], param: str) -> None:

    bad = next((t for t in ids if t >= server.vocab_size), None)
    if bad is not None:
        raise ApiError(
            400,
            f"{param} contains token id {bad}, outside the vocabulary (size {server.vocab_size})",
            param,
        )
    if len(ids) > server.max_model_len:
        raise ApiError(
            400,
            f"{param}: the prompt has {len(ids)} tokens, over this model's maximum context "
            f"length (max_model_len={server.max_model_len})",
            param,
        )


def _echo_logprobs(
    server: OpenAIServer, ids: list[int], plp: PromptLogprobs, k: int, as_ids: bool
) -> dict[str, list[Any]]:
    """OpenAI's completion logprobs over the prompt: the first token's logprob and top
    logprobs are null (nothing predicts it)."""
    first = server.logprobs.name(ids[0], as_ids)
    rest = server.logprobs.completion(
        [d for d in plp[1:] if d is not None], k, len(server.decode_token(ids[0])), as_ids
    )
    return {
        "tokens": [first, *rest["tokens"]],
        "token_logprobs": [None, *rest["token_logprobs"]],
        "top_logprobs": [None, *rest["top_logprobs"]],
        "text_offset": [0, *rest["text_offset"]],
    }
