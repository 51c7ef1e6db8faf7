"""Streaming: fan-in of a request's engine streams, client-disconnect watching, and the SSE
body (``data: {chunk}`` events ending in ``data: [DONE]``).

The engine streams deltas (``AsyncLLM.generate(..., delta=True)``): each chunk carries what
the engine committed since the last one, so nothing here re-derives them from snapshots.

The chunks' choices are shaped by ``shaping``, as the JSON bodies' are; ``sse_body`` is given
the two things of the server it reads (the fingerprint, the ``LogprobShaper``), not the
server, so that ``serving`` depends on this module and not the other way round.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request

from detspec.errors import DetspecError
from detspec.outputs import RequestOutput
from detspec.server import protocol as P
from detspec.server.errors import stream_error_body
from detspec.server.jobs import Job
from detspec.server.logprobs import LogprobShaper
from detspec.server.shaping import choice_fields, dvr_metrics, usage


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


async def until_disconnect(request: Request, aw: Awaitable[Any]) -> Any:
    """Awaits ``aw`` unless the client disconnects first; then cancels it (which aborts the
    engine requests it runs) and raises ``ClientGone``."""
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
    raise ClientGone()


async def merge(
    streams: list[tuple[Job, AsyncIterator[RequestOutput]]],
) -> AsyncIterator[tuple[Job, RequestOutput]]:
    """Outputs of several engine streams as they come. Closing it (or cancelling its
    consumer) closes every stream, which aborts the unfinished engine requests."""
    if len(streams) == 1:
        job, stream = streams[0]
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            async for out in stream:
                yield job, out
        return
    q: asyncio.Queue[tuple[Job, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(job: Job, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for out in stream:
                    await q.put((job, out))
            await q.put((job, None))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            await q.put((job, e))

    tasks = [asyncio.ensure_future(pump(j, s)) for j, s in streams]
    try:
        left = len(streams)
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


async def first_output(
    agen: AsyncIterator[tuple[Job, RequestOutput]],
) -> tuple[Job, RequestOutput] | None:
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        return None


class _ChoiceState:
    """What has been sent of one choice."""

    __slots__ = ("text_len", "ntok", "started", "done")

    def __init__(self) -> None:
        self.text_len = 0
        self.ntok = 0
        self.started = False
        self.done = False


async def sse_body(
    fingerprint: Callable[[], str],
    logprobs: LogprobShaper,
    req: P.CompletionRequest | P.ChatCompletionRequest,
    agen: AsyncIterator[tuple[Job, RequestOutput]],
    first: tuple[Job, RequestOutput] | None,
    jobs: list[Job],
    rid: str,
    model: str,
    chat: bool,
) -> AsyncIterator[bytes]:
    """The SSE events of a streamed completion or chat completion, from delta outputs.
    ``fingerprint`` is read at every chunk: the weights may be updated while it streams."""
    created = int(time.time())
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    states: dict[int, _ChoiceState] = {}
    prompt_tokens = sum(len(j.prompt_ids) for j in jobs)
    completion_tokens: dict[int, int] = {}
    cached: dict[int, int] = {}  # per job: prompt tokens read from the prefix cache
    first_extra: dict[str, Any] = {}
    if chat and req.return_token_ids:
        first_extra["prompt_token_ids"] = jobs[0].prompt_ids
    if chat and jobs[0].prompt_logprobs is not None:
        first_extra["prompt_logprobs"] = jobs[0].prompt_logprobs

    def chunk(choices: list[dict[str, Any]], counts: P.UsageInfo | None = None) -> bytes:
        fields: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": fingerprint(),
            "choices": choices,
        }
        if include_usage:
            fields["usage"] = counts
        if first_extra:  # chat: the prompt fields ride on the first chunk
            fields.update(first_extra)
            first_extra.clear()
        cls = P.ChatCompletionChunk if chat else P.CompletionChunk
        body = cls(**fields).model_dump(exclude_unset=True)
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    def counts() -> P.UsageInfo:
        reasoning = jobs[0].reasoning_tokens() if chat else None
        return usage(
            prompt_tokens, sum(completion_tokens.values()), sum(cached.values()), reasoning
        )

    def events(job: Job, out: RequestOutput) -> list[bytes]:
        res = []
        for c in out.outputs:
            index = job.index * job.params.n + c.index
            st = states.setdefault(index, _ChoiceState())
            if st.done:
                continue
            finished = c.finish_reason is not None
            if not c.token_ids and not c.text and not finished and st.started:
                continue
            choice = choice_fields(
                logprobs,
                req,
                job,
                c,
                chat=chat,
                first=not st.started,
                text_offset=st.text_len,
                stream=True,
            )
            if finished:
                choice["stop_reason"] = c.stop_reason
                choice["dvr_metrics"] = dvr_metrics(out, job.params)
                st.done = True
            st.started = True
            st.text_len += len(c.text if chat else choice["text"])  # an echo's prompt too
            st.ntok += len(c.token_ids)
            completion_tokens[index] = st.ntok
            cached[job.index] = out.num_cached_tokens
            so_far = counts() if continuous else None
            res.append(chunk([choice], so_far))
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
            yield b"data: " + json.dumps(stream_error_body(e)).encode() + b"\n\n"
        if include_usage:
            yield chunk([], counts())
        yield b"data: [DONE]\n\n"
    finally:
        await agen.aclose()  # type: ignore[attr-defined]
