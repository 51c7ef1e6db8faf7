"""The OpenAI-compatible FastAPI app on one ``AsyncLLM`` (what ``detspec serve`` runs).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or SSE ending in
``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``, ``GET /version``,
``POST /tokenize``, ``POST /detokenize``; ``echo`` and ``GET /tokenizer_info`` in
``scoring_routes``, the RL control routes in ``rl_routes``, server-wide determinism in
``defaults`` (docs/serving.md lists them all).

Floats go out exactly: logprobs are the engine's f32 values as Python floats and
``json.dumps`` writes the shortest repr that reads back to the same double, so a client
recovers the f32 bit for bit.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import detspec
from detspec.async_llm import AsyncLLM
from detspec.errors import DetspecError, InvalidRequestError
from detspec.outputs import RequestOutput
from detspec.sampling_params import SamplingParams
from detspec.scoring import prompt_logprobs_to_py
from detspec.server import protocol as P
from detspec.server.defaults import DEFAULT_SEED, RequestDefaults
from detspec.server.metrics import CONTENT_TYPE, ServerMetrics
from detspec.server.rl_routes import RL_PATHS, WEIGHT_UPLOAD_PATHS, build_rl_router
from detspec.server.scoring_routes import (
    ScoreBatcher,
    build_scoring_router,
    check_max_tokens,
    echo_completions,
)

logger = logging.getLogger("detspec.server")

# vLLM's stand-in for a -inf logprob (JSON has no infinity).
NEG_INF_LOGPROB = -9999.0
# Paths that need the API key when one is set (vLLM protects /v1; the tokenizer routes too).
_PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize", "/tokenizer_info", *RL_PATHS)
# Chat-template variables that are arguments of apply_chat_template itself.
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "add_generation_prompt", "tokenize"})


@dataclass
class ServerConfig:
    """Server settings (engine settings go to ``AsyncLLM``)."""

    served_model_names: list[str] = field(default_factory=lambda: ["detspec"])
    api_key: str | None = None
    max_waiting_requests: int | None = None
    max_request_bytes: int = 16 * 1024 * 1024
    max_num_seqs: int = 256
    # The engine's determinism mode; None: read it from the engine's fingerprint.
    determinism: str | None = None
    # Requests that do not say `deterministic` are deterministic; sampled ones without a
    # seed get default_seed (server/defaults.py).
    deterministic_by_default: bool = False
    default_seed: int = DEFAULT_SEED


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or _ERROR_TYPES.get(status, "invalid_request_error")
        self.headers = headers


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    503: "service_unavailable",
    500: "internal_server_error",
}


def error_body(
    status: int, message: str, param: str | None = None, type_: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": type_ or _ERROR_TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": status,
        }
    }


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(
        error_body(err.status, err.message, err.param, err.type),
        status_code=err.status,
        headers=err.headers,
    )


def _param_from_message(msg: str) -> str | None:
    """The parameter an engine error names (``invalid parameter `x`: ...``)."""
    if msg.startswith("invalid parameter `"):
        return msg.split("`", 2)[1]
    return None


def _invalid(e: InvalidRequestError, default_param: str | None = None) -> ApiError:
    msg = str(e)
    return ApiError(400, msg, _param_from_message(msg) or default_param)


def _loc_to_param(loc: Sequence[Any]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``messages[0].role``; skips union tags."""
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, int):
            if parts:
                parts[-1] += f"[{item}]"
            continue
        s = str(item)
        if "[" in s or s[:1].isupper() or s in ("str", "int", "float", "bool", "list", "dict"):
            continue  # a union member's tag (list[int], ChatContentPart, ...)
        parts.append(s)
    return ".".join(parts) or None


# --------------------------------------------------------------------------- ASGI middleware


class _GuardMiddleware:
    """API key (constant-time comparison) and request-size limit, before anything parses
    the body."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_bytes = max_bytes

    async def _reject(self, send: Send, status: int, msg: str, param: str | None) -> None:
        headers = [(b"content-type", b"application/json")]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        body = json.dumps(error_body(status, msg, param)).encode()
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        path: str = scope.get("path", "")
        if self.api_key is not None and path.startswith(_PROTECTED_PREFIXES):
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            ok = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)
            if not ok:
                await self._reject(
                    send,
                    401,
                    "missing or incorrect API key in the `Authorization` header "
                    "(expected `Bearer <key>`)",
                    "Authorization",
                )
                return
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                n = -1
            if n < 0:
                await self._reject(send, 400, "invalid Content-Length header", "Content-Length")
                return
            if n > self.max_bytes and path not in WEIGHT_UPLOAD_PATHS:
                await self._reject(send, 413, self._too_large(n), "body")
                return
            await self.app(scope, receive, send)
            return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        # Chunked body: read it up to the limit, then replay it to the app.
        buffered: list[Message] = []
        total = 0
        while True:
            msg = await receive()
            buffered.append(msg)
            if msg["type"] != "http.request":
                break
            total += len(msg.get("body", b""))
            if total > self.max_bytes and path not in WEIGHT_UPLOAD_PATHS:
                await self._reject(send, 413, self._too_large(total), "body")
                return
            if not msg.get("more_body", False):
                break

        async def replay() -> Message:
            if buffered:
                return buffered.pop(0)
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self, n: int) -> str:
        return (
            f"request body of {n} bytes is over the server's limit of {self.max_bytes} bytes "
            "(--max-request-bytes)"
        )


# --------------------------------------------------------------------------- helpers


def server_stopped(e: BaseException) -> bool:
    return "shut down" in str(e)


class _ClientGone(Exception):
    pass


async def _until_disconnect(request: Request, aw: Awaitable[Any]) -> Any:
    """Awaits ``aw`` unless the client disconnects first; then cancels it (which aborts the
    engine requests it runs) and raises ``_ClientGone``."""
    task = asyncio.ensure_future(aw)

    async def watch() -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise _ClientGone()


def _lp(x: float) -> float:
    return x if x > -math.inf else NEG_INF_LOGPROB


def _token_bytes(s: str) -> list[int]:
    return list(s.encode("utf-8", errors="replace"))


@dataclass
class _Job:
    """One prompt of a request (one engine request, ``n`` completions)."""

    index: int
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class _ChoiceState:
    """What has been sent of one choice while streaming."""

    __slots__ = ("text_len", "ntok", "started", "done")

    def __init__(self) -> None:
        self.text_len = 0
        self.ntok = 0
        self.started = False
        self.done = False


# --------------------------------------------------------------------------- the server


class OpenAIServer:
    """Request handling shared by the routes: validation, admission, generation, shaping."""

    @property
    def fingerprint(self) -> str:
        """The engine's current fingerprint (it moves when the weights are updated), with
        ``+det-default-seed<N>`` under --deterministic-by-default."""
        return self.engine.fingerprint + self.defaults.fingerprint_suffix()

    def __init__(self, engine: AsyncLLM, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.model_names = list(config.served_model_names)
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len = int(engine._engine.max_model_len())
        self.vocab_size = int(engine._engine.vocab_size())
        self.defaults = RequestDefaults(config.deterministic_by_default, config.default_seed)
        self.determinism = config.determinism or ("off" if "-off-" in self.fingerprint else "on")
        if self.defaults.deterministic_by_default and self.determinism == "off":
            raise ValueError(
                "--deterministic-by-default needs a deterministic engine: start it with "
                "--determinism dvr or batch_invariant"
            )
        self.score_batcher = ScoreBatcher(engine)
        self.created = int(time.time())
        self.inflight_seqs = 0
        self.draining = False
        self._decode_cache: dict[int, str] = {}
        self.metrics = ServerMetrics(
            self.model_names[0], self.queue_counts, engine.kv_stats, engine.stats
        )

    # ---------------------------------------------------------------- bookkeeping

    def queue_counts(self) -> tuple[int, int]:
        """(running, waiting) sequences: the engine runs at most ``max_num_seqs`` at once;
        the rest of what the server has submitted waits."""
        running = min(self.inflight_seqs, self.config.max_num_seqs)
        return running, self.inflight_seqs - running

    def _admit(self, nseqs: int) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down", None, headers={"Retry-After": "1"})
        limit = self.config.max_waiting_requests
        if limit is not None:
            waiting = max(0, self.inflight_seqs + nseqs - self.config.max_num_seqs)
            if waiting > limit:
                raise ApiError(
                    503,
                    f"the waiting queue is full: {waiting} sequences would wait, over the "
                    f"limit of {limit} (--max-waiting-requests); retry later",
                    None,
                    headers={"Retry-After": "1"},
                )
        self.inflight_seqs += nseqs

    def check_model(self, name: str | None) -> str:
        if name is None:
            return self.model_names[0]
        if name not in self.model_names:
            raise ApiError(
                404,
                f"The model `{name}` does not exist (served: {', '.join(self.model_names)}).",
                "model",
            )
        return name

    def decode_token(self, t: int) -> str:
        s = self._decode_cache.get(t)
        if s is None:
            s = self.tokenizer.decode([t], skip_special_tokens=False) if self.tokenizer else ""
            if len(self._decode_cache) < 1_000_000:
                self._decode_cache[t] = s
        return s

    # ---------------------------------------------------------------- validation

    def _common_checks(self, req: P._SamplingFields) -> None:
        if req.deterministic and self.determinism == "off":
            raise ApiError(
                400,
                "deterministic=true, but this server runs with --determinism off; start it "
                "with --determinism dvr or batch_invariant",
                "deterministic",
            )
        if req.logit_bias:
            raise ApiError(400, "logit_bias is not supported by this engine", "logit_bias")
        if req.best_of is not None and req.best_of != req.n:
            raise ApiError(400, "best_of other than n is not supported", "best_of")
        if req.response_format is not None and req.response_format.get("type") != "text":
            raise ApiError(
                400,
                "response_format other than {'type': 'text'} is not supported",
                "response_format",
            )
        if req.stream_options is not None and not req.stream:
            raise ApiError(
                400, "stream_options can only be given when stream=true", "stream_options"
            )
        if req.stop_token_ids:
            bad = [t for t in req.stop_token_ids if t >= self.vocab_size]
            if bad:
                raise ApiError(
                    400,
                    f"stop_token_ids contains token id {bad[0]}, outside the vocabulary "
                    f"(size {self.vocab_size})",
                    "stop_token_ids",
                )
        temperature = 1.0 if req.temperature is None else req.temperature
        if req.deterministic and temperature > 0 and req.seed is None:
            raise ApiError(
                400,
                "a deterministic request that samples (temperature > 0) needs a `seed`: "
                "without one its output cannot be reproduced",
                "seed",
            )

    def _check_prompt_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise ApiError(400, f"{param} is empty", param)
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise ApiError(
                400,
                f"{param} contains token id {bad}, outside the vocabulary (size {self.vocab_size})",
                param,
            )
        if len(ids) >= self.max_model_len:
            raise ApiError(
                400,
                f"{param}: the prompt has {len(ids)} tokens, which leaves no room to generate "
                f"within this model's maximum context length (max_model_len={self.max_model_len})",
                param,
            )

    def _max_tokens(self, requested: int | None, prompt_len: int, param: str) -> int:
        room = self.max_model_len - prompt_len
        if requested is None:
            return room
        if requested > room:
            raise ApiError(
                400,
                f"{param}={requested} plus the prompt's {prompt_len} tokens is over this "
                f"model's maximum context length (max_model_len={self.max_model_len})",
                param,
            )
        return requested

    def _sampling_params(
        self, req: P._SamplingFields, max_tokens: int, logprobs: int | None
    ) -> SamplingParams:
        try:
            return SamplingParams(
                n=req.n,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=0 if req.top_k is None else req.top_k,
                min_p=0.0 if req.min_p is None else req.min_p,
                seed=req.seed,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=(
                    1.0 if req.repetition_penalty is None else req.repetition_penalty
                ),
                deterministic=req.deterministic,
            )
        except InvalidRequestError as e:
            raise _invalid(e) from None

    async def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(
                400, "this model has no tokenizer: send the prompt as token ids", "prompt"
            )
        try:
            return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)
        except InvalidRequestError as e:
            raise _invalid(e, "prompt") from None

    async def render_chat(
        self,
        messages: list[P.ChatMessage],
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
    ) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: chat is unavailable", "messages")
        kwargs = dict(template_kwargs or {})
        clash = _RESERVED_TEMPLATE_KWARGS & kwargs.keys()
        if clash:
            raise ApiError(
                400, f"chat_template_kwargs may not set {sorted(clash)}", "chat_template_kwargs"
            )
        conv = []
        for m in messages:
            if isinstance(m.content, list):
                content = "".join(part.text for part in m.content)
            else:
                content = m.content or ""
            d: dict[str, Any] = {"role": m.role, "content": content}
            if m.name is not None:
                d["name"] = m.name
            conv.append(d)
        tok = self.tokenizer
        try:
            ids = await asyncio.to_thread(
                tok.apply_chat_template, conv, add_generation_prompt, True, **kwargs
            )
        except InvalidRequestError as e:
            raise _invalid(e, "messages") from None
        return list(ids)  # type: ignore[arg-type]

    async def _prompt_logprobs(self, ids: list[int], k: int) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs``: None for the first token, then per position the
        prompt token's logprob (and rank) plus the top ``k``: the engine's numbers, bit for
        bit those of ``LLM.generate`` and ``LLM.score`` (verify-path kernels)."""
        (raw,) = await asyncio.to_thread(self.engine._engine.prompt_logprobs, [ids], k)

        def as_json(entry: dict[int, Any]) -> dict[str, Any]:  # Logprob objects -> JSON
            return {
                str(t): {
                    "logprob": _lp(x.logprob),
                    "rank": x.rank,
                    "decoded_token": x.decoded_token,
                }
                for t, x in entry.items()
            }

        return [
            None if e is None else as_json(e) for e in prompt_logprobs_to_py(raw, self.decode_token)
        ]

    # ---------------------------------------------------------------- generation

    async def _stream_job(self, job: _Job) -> AsyncIterator[RequestOutput]:
        """One engine request, with its metrics."""
        m = self.metrics
        start = time.perf_counter()
        last = start
        first = True
        ntok = 0
        m.prompt_tokens.inc(len(job.prompt_ids))
        m.prompt_len.observe(len(job.prompt_ids))
        if job.params.deterministic:
            m.deterministic_requests.inc()
        out: RequestOutput | None = None
        stream = self.engine.generate(job.prompt_ids, job.params, request_id=job.rid)
        try:
            async with contextlib.aclosing(stream):
                async for out in stream:
                    now = time.perf_counter()
                    total = sum(len(c.token_ids) for c in out.outputs)
                    new = total - ntok
                    if new > 0:
                        if first:
                            m.ttft.observe(now - start)
                            first = False
                        else:
                            for _ in range(new):
                                m.itl.observe((now - last) / new)
                        m.generation_tokens.inc(new)
                        ntok = total
                        last = now
                    yield out
        finally:
            if out is not None and out.finished:
                m.e2e.observe(time.perf_counter() - start)
                m.gen_len.observe(ntok)
                for c in out.outputs:
                    m.request_finished(c.finish_reason)
                if job.params.deterministic:
                    m.verify_passes_per_request.observe(out.metrics.get("num_verify_passes", 0))
            else:  # the client left, or the engine failed or stopped: aborted
                for _ in range(job.params.n):
                    m.request_finished("abort")

    async def _merged(self, jobs: list[_Job]) -> AsyncIterator[tuple[_Job, RequestOutput]]:
        """Outputs of several engine requests as they come. Closing it (or cancelling its
        consumer) aborts every unfinished one."""
        nseqs = sum(j.params.n for j in jobs)
        self._admit(nseqs)
        try:
            if len(jobs) == 1:
                async with contextlib.aclosing(self._stream_job(jobs[0])) as stream:
                    async for out in stream:
                        yield jobs[0], out
                return
            q: asyncio.Queue[tuple[_Job, RequestOutput | BaseException | None]] = asyncio.Queue()

            async def pump(job: _Job) -> None:
                try:
                    async with contextlib.aclosing(self._stream_job(job)) as stream:
                        async for out in stream:
                            await q.put((job, out))
                    await q.put((job, None))
                except asyncio.CancelledError:
                    raise
                except BaseException as e:
                    await q.put((job, e))

            tasks = [asyncio.ensure_future(pump(j)) for j in jobs]
            try:
                left = len(jobs)
                while left:
                    job, item = await q.get()
                    if item is None:
                        left -= 1
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        yield job, item
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self.inflight_seqs -= nseqs

    async def _first(
        self, agen: AsyncIterator[tuple[_Job, RequestOutput]]
    ) -> tuple[_Job, RequestOutput] | None:
        try:
            return await agen.__anext__()
        except StopAsyncIteration:
            return None

    # ---------------------------------------------------------------- shaping

    def _dvr(self, out: RequestOutput, params: SamplingParams) -> dict[str, Any]:
        mt = out.metrics
        return {
            "deterministic": bool(params.deterministic),
            "num_verify_passes": int(mt.get("num_verify_passes", 0)),
            "num_rollbacks": int(mt.get("num_rollbacks", 0)),
            "num_rolled_back_tokens": int(mt.get("num_rolled_back_tokens", 0)),
            "num_preemptions": int(mt.get("num_preemptions", 0)),
        }

    @staticmethod
    def _split_logprobs(d: dict[int, Any], k: int) -> tuple[int, float, list[tuple[int, float]]]:
        """(chosen token, its logprob, top-k [(token, logprob)] in rank order)."""
        items = list(d.items())
        tok, chosen = items[0]
        top = sorted(
            ((t, lp) for t, lp in items if lp.rank is not None and 1 <= lp.rank <= k),
            key=lambda x: x[1].rank,
        )
        return tok, chosen.logprob, [(t, lp.logprob) for t, lp in top]

    def _name(self, t: int, as_ids: bool) -> str:
        return f"token_id:{t}" if as_ids else self.decode_token(t)

    def _completion_logprobs(
        self, lps: list[dict[int, Any]], k: int, offset: int, as_ids: bool
    ) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for d in lps:
            tok, lp, top = self._split_logprobs(d, k)
            s = self._name(tok, as_ids)
            tokens.append(s)
            token_lps.append(_lp(lp))
            entry = {s: _lp(lp)}
            for t, tlp in top:
                entry.setdefault(self._name(t, as_ids), _lp(tlp))
            tops.append(entry)
            offsets.append(offset)
            offset += len(self.decode_token(tok))
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _chat_logprobs(self, lps: list[dict[int, Any]], k: int, as_ids: bool) -> dict[str, Any]:
        content = []
        for d in lps:
            tok, lp, top = self._split_logprobs(d, k)
            content.append(
                {
                    "token": self._name(tok, as_ids),
                    "logprob": _lp(lp),
                    "bytes": _token_bytes(self.decode_token(tok)),
                    "top_logprobs": [
                        {
                            "token": self._name(t, as_ids),
                            "logprob": _lp(tlp),
                            "bytes": _token_bytes(self.decode_token(t)),
                        }
                        for t, tlp in top
                    ],
                }
            )
        return {"content": content}

    def _text(self, c: Any, skip_special_tokens: bool) -> str:
        if skip_special_tokens or self.tokenizer is None:
            return c.text
        text = self.tokenizer.decode(c.token_ids, skip_special_tokens=False)
        if isinstance(c.stop_reason, str):
            cut = text.find(c.stop_reason)
            if cut >= 0:
                text = text[:cut]
        return text

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    # ---------------------------------------------------------------- completions

    async def completions(self, req: P.CompletionRequest, request: Request) -> Response:
        self.defaults.apply(req)
        check_max_tokens(req)
        if req.echo:
            return await echo_completions(self, req, request)
        model = self.check_model(req.model)
        self._common_checks(req)
        if req.suffix is not None:
            raise ApiError(400, "suffix is not supported", "suffix")
        prompts: list[str | list[int]]
        p = req.prompt
        if isinstance(p, str):
            prompts = [p]
        elif not p:
            raise ApiError(400, "prompt is an empty list", "prompt")
        elif isinstance(p[0], int):
            prompts = [list(p)]  # type: ignore[arg-type]
        else:
            prompts = list(p)  # type: ignore[arg-type]
        base = f"cmpl-{uuid.uuid4().hex}"
        jobs: list[_Job] = []
        for i, pr in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            ids = await self._encode(pr) if isinstance(pr, str) else list(pr)
            self._check_prompt_ids(ids, param)
            max_tokens = self._max_tokens(req.max_tokens, len(ids), "max_tokens")
            params = self._sampling_params(req, max_tokens, req.logprobs)
            jobs.append(_Job(i, f"{base}-{i}", ids, params))
        if req.prompt_logprobs is not None:
            for j in jobs:
                j.prompt_logprobs = await self._prompt_logprobs(j.prompt_ids, req.prompt_logprobs)
        return await self._respond(req, request, jobs, base, model, chat=False)

    # ---------------------------------------------------------------- chat

    async def chat(self, req: P.ChatCompletionRequest, request: Request) -> Response:
        self.defaults.apply(req)
        model = self.check_model(req.model)
        self._common_checks(req)
        if req.tools:
            raise ApiError(400, "tools are not supported by this server", "tools")
        if req.tool_choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice is not supported by this server", "tool_choice")
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        if req.max_completion_tokens is not None and req.max_tokens is not None:
            if req.max_completion_tokens != req.max_tokens:
                raise ApiError(
                    400,
                    "max_tokens and max_completion_tokens disagree; send one of them",
                    "max_completion_tokens",
                )
        ids = await self.render_chat(
            req.messages, req.add_generation_prompt, req.chat_template_kwargs
        )
        self._check_prompt_ids(ids, "messages")
        if req.max_completion_tokens is not None:
            max_tokens = self._max_tokens(
                req.max_completion_tokens, len(ids), "max_completion_tokens"
            )
        else:
            max_tokens = self._max_tokens(req.max_tokens, len(ids), "max_tokens")
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = self._sampling_params(req, max_tokens, k)
        base = f"chatcmpl-{uuid.uuid4().hex}"
        job = _Job(0, f"{base}-0", ids, params)
        if req.prompt_logprobs is not None:
            job.prompt_logprobs = await self._prompt_logprobs(ids, req.prompt_logprobs)
        return await self._respond(req, request, [job], base, model, chat=True)

    # ---------------------------------------------------------------- common response path

    async def _respond(
        self,
        req: P.CompletionRequest | P.ChatCompletionRequest,
        request: Request,
        jobs: list[_Job],
        rid: str,
        model: str,
        chat: bool,
    ) -> Response:
        agen = self._merged(jobs)
        try:
            if not req.stream:
                return await _until_disconnect(
                    request, self._collect(req, agen, jobs, rid, model, chat)
                )
            first = await _until_disconnect(request, self._first(agen))
        except _ClientGone:
            await agen.aclose()
            return Response(status_code=499)
        except InvalidRequestError as e:
            await agen.aclose()
            raise _invalid(e) from None
        except DetspecError as e:
            await agen.aclose()
            if server_stopped(e):
                raise ApiError(503, str(e), None, headers={"Retry-After": "1"}) from None
            raise
        except BaseException:
            await agen.aclose()
            raise
        return StreamingResponse(
            self._sse(req, agen, first, jobs, rid, model, chat),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _collect(
        self,
        req: P.CompletionRequest | P.ChatCompletionRequest,
        agen: AsyncIterator[tuple[_Job, RequestOutput]],
        jobs: list[_Job],
        rid: str,
        model: str,
        chat: bool,
    ) -> JSONResponse:
        last: dict[int, RequestOutput] = {}
        try:
            async for job, out in agen:
                last[job.index] = out
        finally:
            await agen.aclose()  # type: ignore[attr-defined]
        choices = []
        completion_tokens = 0
        for job in jobs:
            out = last[job.index]
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                index = job.index * job.params.n + c.index
                choice: dict[str, Any]
                if chat:
                    k = job.params.logprobs
                    choice = {
                        "index": index,
                        "message": {
                            "role": "assistant",
                            "content": self._text(c, req.skip_special_tokens),
                        },
                        "logprobs": (
                            self._chat_logprobs(c.logprobs or [], k, req.return_tokens_as_token_ids)
                            if k is not None
                            else None
                        ),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                else:
                    k = job.params.logprobs
                    choice = {
                        "index": index,
                        "text": self._text(c, req.skip_special_tokens),
                        "logprobs": (
                            self._completion_logprobs(
                                c.logprobs or [], k, 0, req.return_tokens_as_token_ids
                            )
                            if k is not None
                            else None
                        ),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                    if req.return_token_ids:
                        choice["prompt_token_ids"] = job.prompt_ids
                    if job.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = job.prompt_logprobs
                if req.return_token_ids:
                    choice["token_ids"] = list(c.token_ids)
                choice["dvr_metrics"] = self._dvr(out, job.params)
                choices.append(choice)
        body: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
            "usage": self._usage(sum(len(j.prompt_ids) for j in jobs), completion_tokens),
        }
        if chat:
            if req.return_token_ids:
                body["prompt_token_ids"] = jobs[0].prompt_ids
            if jobs[0].prompt_logprobs is not None:
                body["prompt_logprobs"] = jobs[0].prompt_logprobs
        return JSONResponse(body)

    async def _sse(
        self,
        req: P.CompletionRequest | P.ChatCompletionRequest,
        agen: AsyncIterator[tuple[_Job, RequestOutput]],
        first: tuple[_Job, RequestOutput] | None,
        jobs: list[_Job],
        rid: str,
        model: str,
        chat: bool,
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        states: dict[int, _ChoiceState] = {}
        prompt_tokens = sum(len(j.prompt_ids) for j in jobs)
        completion_tokens: dict[int, int] = {}
        first_extra: dict[str, Any] = {}
        if chat and req.return_token_ids:
            first_extra["prompt_token_ids"] = jobs[0].prompt_ids
        if chat and jobs[0].prompt_logprobs is not None:
            first_extra["prompt_logprobs"] = jobs[0].prompt_logprobs

        def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
            body: dict[str, Any] = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "system_fingerprint": self.fingerprint,
                "choices": choices,
            }
            if include_usage:
                body["usage"] = usage
            if first_extra:  # chat: the prompt fields ride on the first chunk
                body.update(first_extra)
                first_extra.clear()
            return b"data: " + json.dumps(body).encode() + b"\n\n"

        def events(job: _Job, out: RequestOutput) -> list[bytes]:
            res = []
            for c in out.outputs:
                index = job.index * job.params.n + c.index
                st = states.setdefault(index, _ChoiceState())
                if st.done:
                    continue
                text = self._text(c, req.skip_special_tokens)
                ntok = len(c.token_ids)
                finished = c.finish_reason is not None
                if ntok == st.ntok and not finished and st.started:
                    continue
                delta_text = text[st.text_len :]
                new_ids = list(c.token_ids[st.ntok :])
                new_lps = (c.logprobs or [])[st.ntok :]
                k = job.params.logprobs
                choice: dict[str, Any]
                if chat:
                    delta: dict[str, Any] = {}
                    if not st.started:
                        delta["role"] = "assistant"
                    delta["content"] = delta_text
                    choice = {
                        "index": index,
                        "delta": delta,
                        "logprobs": self._chat_logprobs(new_lps, k, req.return_tokens_as_token_ids)
                        if k is not None
                        else None,
                        "finish_reason": c.finish_reason,
                    }
                else:
                    choice = {
                        "index": index,
                        "text": delta_text,
                        "logprobs": (
                            self._completion_logprobs(
                                new_lps, k, st.text_len, req.return_tokens_as_token_ids
                            )
                            if k is not None
                            else None
                        ),
                        "finish_reason": c.finish_reason,
                    }
                    if not st.started:
                        if req.return_token_ids:
                            choice["prompt_token_ids"] = job.prompt_ids
                        if job.prompt_logprobs is not None:
                            choice["prompt_logprobs"] = job.prompt_logprobs
                if req.return_token_ids:
                    choice["token_ids"] = new_ids
                if finished:
                    choice["stop_reason"] = c.stop_reason
                    choice["dvr_metrics"] = self._dvr(out, job.params)
                    st.done = True
                st.started = True
                st.text_len = len(text)
                st.ntok = ntok
                completion_tokens[index] = ntok
                usage = (
                    self._usage(prompt_tokens, sum(completion_tokens.values()))
                    if continuous
                    else None
                )
                res.append(chunk([choice], usage))
            return res

        try:
            if first is not None:
                for ev in events(*first):
                    yield ev
            try:
                async for job, out in agen:
                    for ev in events(job, out):
                        yield ev
            except DetspecError as e:
                status = 400 if isinstance(e, InvalidRequestError) else 500
                msg = str(e)
                err = error_body(status, msg, _param_from_message(msg))
                yield b"data: " + json.dumps(err).encode() + b"\n\n"
            if include_usage:
                yield chunk([], self._usage(prompt_tokens, sum(completion_tokens.values())))
            yield b"data: [DONE]\n\n"
        finally:
            await agen.aclose()  # type: ignore[attr-defined]

    # ---------------------------------------------------------------- tokenizer routes

    async def tokenize(
        self, req: P.TokenizeCompletionRequest | P.TokenizeChatRequest
    ) -> dict[str, Any]:
        self.check_model(req.model)
        if isinstance(req, P.TokenizeChatRequest):
            ids = await self.render_chat(
                req.messages, req.add_generation_prompt, req.chat_template_kwargs
            )
        else:
            ids = await self._encode(req.prompt, req.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    async def detokenize(self, req: P.DetokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer", "tokens")
        bad = next((t for t in req.tokens if t >= self.vocab_size), None)
        if bad is not None:
            raise ApiError(
                400,
                f"tokens contains token id {bad}, outside the vocabulary (size {self.vocab_size})",
                "tokens",
            )
        try:
            text = await asyncio.to_thread(self.tokenizer.decode, req.tokens)
        except InvalidRequestError as e:
            raise _invalid(e, "tokens") from None
        return {"prompt": text}


# --------------------------------------------------------------------------- the app


_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": P.ErrorResponse},
    401: {"model": P.ErrorResponse},
    404: {"model": P.ErrorResponse},
    413: {"model": P.ErrorResponse},
    503: {"model": P.ErrorResponse},
}


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

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        server.metrics.error(exc.status)
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        e = errs[0] if errs else {"loc": ("body",), "msg": "invalid request", "type": ""}
        if e.get("type") == "json_invalid":
            err = ApiError(400, f"the request body is not valid JSON: {e.get('msg')}", "body")
        else:
            param = _loc_to_param(e.get("loc", ())) or "body"
            what = e.get("msg", "invalid value")
            if e.get("type") == "extra_forbidden":
                what = "unrecognized request argument (not supported by this server)"
            elif e.get("type") == "missing":
                what = "required"
            err = ApiError(400, f"invalid parameter `{param}`: {what}", param)
        server.metrics.error(400)
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        server.metrics.error(exc.status_code)
        msg = str(exc.detail)
        if exc.status_code == 404:
            msg = f"no route {request.url.path}"
        return JSONResponse(
            error_body(exc.status_code, msg), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        server.metrics.error(500)
        return JSONResponse(error_body(500, f"internal error: {exc}"), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        if server.draining:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/version", response_model=P.VersionResponse)
    async def version() -> dict[str, str]:
        return {"version": detspec.__version__, "fingerprint": server.fingerprint}

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await asyncio.to_thread(server.metrics.render)
        return Response(body, media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=P.ModelList, responses=_ERROR_RESPONSES)
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": server.created,
                    "owned_by": "detspec",
                    "root": engine.model,
                    "max_model_len": server.max_model_len,
                    "fingerprint": server.fingerprint,
                    "deterministic_by_default": server.defaults.deterministic_by_default,
                    "default_seed": (
                        server.defaults.default_seed
                        if server.defaults.deterministic_by_default
                        else None
                    ),
                    "weight_version": engine.weight_version,
                }
                for name in server.model_names
            ],
        }

    @app.post(
        "/v1/completions",
        response_model=P.CompletionResponse,
        responses=_ERROR_RESPONSES,
    )
    async def completions(req: P.CompletionRequest, request: Request) -> Response:
        return await server.completions(req, request)

    @app.post(
        "/v1/chat/completions",
        response_model=P.ChatCompletionResponse,
        responses=_ERROR_RESPONSES,
    )
    async def chat_completions(req: P.ChatCompletionRequest, request: Request) -> Response:
        return await server.chat(req, request)

    @app.post("/tokenize", response_model=P.TokenizeResponse, responses=_ERROR_RESPONSES)
    async def tokenize(
        req: P.TokenizeCompletionRequest | P.TokenizeChatRequest,
    ) -> dict[str, Any]:
        return await server.tokenize(req)

    @app.post("/detokenize", response_model=P.DetokenizeResponse, responses=_ERROR_RESPONSES)
    async def detokenize(req: P.DetokenizeRequest) -> dict[str, Any]:
        return await server.detokenize(req)

    app.include_router(build_scoring_router(server))
    app.include_router(build_rl_router(server))
    app.add_middleware(_GuardMiddleware, api_key=config.api_key, max_bytes=config.max_request_bytes)
    return app
