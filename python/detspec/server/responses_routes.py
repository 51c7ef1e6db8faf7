"""OpenAI's Responses API, ``POST /v1/responses`` (what ``client.responses.create`` sends, and
the schema agent and RL-environment frameworks speak), on the chat pipeline: the request
becomes the chat completion it means (``input`` and ``instructions`` the messages, flat
``tools`` nested ones, ``text.format`` a ``response_format``), which is checked, rendered
and run as ``/v1/chat/completions`` runs it; the output becomes Responses output items (a
``message`` with one ``output_text`` part, then a ``function_call`` per tool call). Streamed,
the events are Responses' (``response.created`` ... ``response.output_text.delta`` ...
``response.completed``), each with its ``sequence_number``.

A response is stored (unless ``store`` is false; in memory, ``responses_store``): a request
with ``previous_response_id`` continues its conversation (its input and output items before
this request's ``input``), and ``GET`` / ``DELETE /v1/responses/{id}`` read and drop it. A
conversation can also go back whole in ``input``, earlier output items included, as with
chat. ``deterministic``, ``seed`` and vLLM's sampling extras are
accepted as on chat, and the response carries ``system_fingerprint`` and ``dvr_metrics``.
Errors name this API's fields (``input``, ``max_output_tokens``, ``tools[0].parameters``).
The request model and its translation are in ``responses_request``; this module shapes the
answer and its stream. Built on ``serving`` (like ``native_routes``), never the other way
round.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from detspec.errors import DetspecError
from detspec.outputs import RequestOutput
from detspec.server import protocol as P
from detspec.server.errors import ERROR_RESPONSES, ApiError, stream_error_body
from detspec.server.jobs import Job
from detspec.server.responses_request import (
    INPUT_ITEMS,
    FunctionChoice,
    ResponsesRequest,
    chat_request,
    input_items,
    renamed_errors,
)
from detspec.server.responses_store import ResponseStore, StoredResponse
from detspec.server.serving import OpenAIServer, failed
from detspec.server.shaping import choice_fields, dvr_metrics
from detspec.server.streaming import first_output, until_disconnect


@dataclass
class _Answer:
    """One response's output as it grows: the message's text and logprobs, the calls."""

    msg_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    rs_id: str = field(default_factory=lambda: f"rs_{uuid.uuid4().hex}")
    reasoning: str | None = None  # None: no reasoning item
    text: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)  # function_call items
    finish_reason: str | None = None
    num_tokens: int = 0

    def feed(self, fields: dict[str, Any]) -> None:
        """Adds a chunk's shaped choice (``choice_fields(..., stream=True)``)."""
        delta = fields["delta"]
        if delta.get("reasoning"):
            self.reasoning = (self.reasoning or "") + delta["reasoning"]
        self.text += delta.get("content") or ""
        if fields.get("logprobs"):
            self.logprobs += fields["logprobs"]["content"]
        for d in delta.get("tool_calls") or []:
            if "id" in d:
                self.calls.append(
                    {
                        "type": "function_call",
                        "id": f"fc_{uuid.uuid4().hex}",
                        "call_id": d["id"],
                        "name": d["function"]["name"],
                        "arguments": "",
                        "status": "completed",
                    }
                )
            self.calls[d["index"]]["arguments"] += d["function"].get("arguments") or ""
        if fields.get("finish_reason") is not None:
            self.finish_reason = fields["finish_reason"]

    @property
    def has_message(self) -> bool:
        """A message item, as chat's: unless there are calls or reasoning and only
        whitespace beside them."""
        return bool(self.text.strip()) or (not self.calls and self.reasoning is None)

    def part(self, with_logprobs: bool) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "output_text", "text": self.text, "annotations": []}
        if with_logprobs:
            part["logprobs"] = self.logprobs
        return part

    def message(self, status: str, with_logprobs: bool) -> dict[str, Any]:
        return {
            "type": "message",
            "id": self.msg_id,
            "status": status,
            "role": "assistant",
            "content": [self.part(with_logprobs)] if status != "in_progress" else [],
        }

    def reasoning_item(self, status: str) -> dict[str, Any]:
        text = self.reasoning if status != "in_progress" else ""
        return {
            "type": "reasoning",
            "id": self.rs_id,
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
            "status": status,
        }

    def items(self, with_logprobs: bool) -> list[dict[str, Any]]:
        status = "incomplete" if self.finish_reason == "length" else "completed"
        head = [self.reasoning_item(status)] if self.reasoning is not None else []
        if self.has_message:
            head.append(self.message(status, with_logprobs))
        return head + self.calls


@dataclass
class _Shaper:
    """The response object of one request."""

    server: OpenAIServer
    req: ResponsesRequest
    chat: P.ChatCompletionRequest  # what it became (``choice_fields`` reads it)
    job: Job
    rid: str
    model: str
    store: ResponseStore
    # The stored conversation this response continues (its input items come after it).
    history: list[dict[str, Any]] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def stored(self) -> bool:
        return self.req.store is not False and self.store.capacity > 0

    def done(self, body: dict[str, Any]) -> dict[str, Any]:
        """Stores the finished response ``body`` (where asked) with its conversation."""
        if self.stored:
            mine = [it.model_dump(exclude_none=True, by_alias=True) for it in input_items(self.req)]
            conversation = [*self.history, *mine, *body["output"]]
            self.store.put(self.rid, StoredResponse(body, conversation))
        return body

    def response(
        self, answer: _Answer | None, out: RequestOutput | None, status: str | None = None
    ) -> dict[str, Any]:
        """The response object; ``answer`` None: nothing yet (``in_progress``)."""
        req = self.req
        if status is None:
            status = "incomplete" if answer and answer.finish_reason == "length" else "completed"
        body: dict[str, Any] = {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": answer.items(req.wants_logprobs) if answer is not None else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": None,
            "store": self.stored,
            "temperature": req.temperature,
            "text": {"format": {"type": "text"}}
            if req.text is None or req.text.format is None
            else {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": (
                req.tool_choice.model_dump()
                if isinstance(req.tool_choice, FunctionChoice)
                else req.tool_choice or ("auto" if req.tools else "none")
            ),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_logprobs": req.top_logprobs,
            "top_p": req.top_p,
            "truncation": "disabled",
            "metadata": req.metadata or {},
            "user": req.user,
            "usage": None,
            "system_fingerprint": self.server.fingerprint_of(self.job),
        }
        if out is not None and answer is not None:
            output_tokens = answer.num_tokens
            prompt_tokens = len(self.job.prompt_ids)
            body["usage"] = {
                "input_tokens": prompt_tokens,
                "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": self.job.reasoning_tokens() or 0},
                "total_tokens": prompt_tokens + output_tokens,
            }
            body["dvr_metrics"] = dvr_metrics(out, self.job.params).model_dump()
        return body

    def feed(self, answer: _Answer, out: RequestOutput) -> None:
        """Adds a delta output to ``answer``, shaped as a streamed chat choice."""
        (c,) = out.outputs
        first = answer.num_tokens == 0
        answer.num_tokens += len(c.token_ids)
        fields = choice_fields(self.server.logprobs, self.chat, self.job, c, chat=True,
                               first=first, stream=True)  # fmt: skip
        answer.feed(fields)


async def create_response(
    server: OpenAIServer, req: ResponsesRequest, request: Request, store: ResponseStore
) -> Response:
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id)
        if prev is None:
            raise ApiError(
                404,
                f"no stored response {req.previous_response_id!r} (unknown, deleted, stored "
                "with store=false, or dropped: the server keeps the last "
                f"{store.capacity} in memory)",
                "previous_response_id",
            )
        history = prev.conversation
    chat = chat_request(req, INPUT_ITEMS.validate_python(history))
    with renamed_errors():
        job, rid, model = await server.chat_job(chat, "resp_")
    shaper = _Shaper(server, req, chat, job, rid, model, store, history)
    agen = server.run([job], delta=True)
    answer = _Answer()
    try:
        if req.stream:
            # The first output before the response starts, so that admission and engine
            # errors are HTTP errors rather than a broken stream.
            first = await until_disconnect(request, first_output(agen))
        else:
            out = await until_disconnect(request, _drain(shaper, answer, _chain(None, agen)))
    except BaseException as e:
        await agen.aclose()  # type: ignore[attr-defined]
        with renamed_errors():
            return failed(e, job)
    if req.stream:
        return StreamingResponse(
            _events(shaper, _chain(first, agen)),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return JSONResponse(shaper.done(shaper.response(answer, out)))


async def _chain(
    first: tuple[Job, RequestOutput] | None, agen: AsyncIterator[tuple[Job, RequestOutput]]
) -> AsyncIterator[RequestOutput]:
    """The outputs: ``first`` (already taken from ``agen``), then the rest of ``agen``,
    which is closed when this is."""
    try:
        if first is not None:
            yield first[1]
        async for _, out in agen:
            yield out
    finally:
        await agen.aclose()  # type: ignore[attr-defined]


async def _drain(
    shaper: _Shaper, answer: _Answer, outs: AsyncIterator[RequestOutput]
) -> RequestOutput | None:
    """Every output fed into ``answer``; the last one."""
    last = None
    async with contextlib.aclosing(outs):  # type: ignore[type-var]
        async for out in outs:
            shaper.feed(answer, out)
            last = out
    return last


async def _events(shaper: _Shaper, outs: AsyncIterator[RequestOutput]) -> AsyncIterator[bytes]:
    """The Responses stream: created, in_progress, the reasoning item and its text deltas
    (with a reasoning parser), the message item and its text deltas as they come (held back
    while only whitespace came, as it may turn out to sit beside tool calls), the function
    calls when they end, then completed (or incomplete)."""
    seq = 0
    answer = _Answer()
    with_lp = shaper.req.wants_logprobs

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        body = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n".encode()

    rs = {"item_id": answer.rs_id, "output_index": 0}
    msg = {"item_id": answer.msg_id, "output_index": 0}
    thinking = closed = opened = False
    sent_reasoning = 0  # of answer.reasoning
    sent_text = 0  # of answer.text
    sent_lp = 0  # of answer.logprobs

    def reasoning_events(final: bool) -> Iterator[bytes]:
        nonlocal thinking, closed, sent_reasoning
        text = answer.reasoning
        if text is None or closed:
            return
        if not thinking:
            thinking = True
            msg["output_index"] = 1
            item = answer.reasoning_item("in_progress")
            yield event("response.output_item.added", output_index=0, item=item)
        if len(text) > sent_reasoning:
            delta = text[sent_reasoning:]
            yield event("response.reasoning_text.delta", content_index=0, delta=delta, **rs)
            sent_reasoning = len(text)
        if final or answer.text or answer.calls:
            closed = True
            yield event("response.reasoning_text.done", content_index=0, text=text, **rs)
            status = "incomplete" if answer.finish_reason == "length" else "completed"
            item = answer.reasoning_item(status)
            yield event("response.output_item.done", output_index=0, item=item)

    def text_events(final: bool) -> Iterator[bytes]:
        nonlocal opened, sent_text, sent_lp
        yield from reasoning_events(final)
        if not opened and (answer.text.strip() or (final and answer.has_message)):
            opened = True
            item = answer.message("in_progress", with_lp)
            index = msg["output_index"]
            yield event("response.output_item.added", output_index=index, item=item)
            part = {"type": "output_text", "text": "", "annotations": []}
            yield event("response.content_part.added", content_index=0, part=part, **msg)
        if opened and (len(answer.text) > sent_text or len(answer.logprobs) > sent_lp):
            yield event(
                "response.output_text.delta",
                content_index=0,
                delta=answer.text[sent_text:],
                logprobs=answer.logprobs[sent_lp:] if with_lp else [],
                **msg,
            )
            sent_text, sent_lp = len(answer.text), len(answer.logprobs)

    async with contextlib.aclosing(outs):  # type: ignore[type-var]
        started = shaper.response(None, None, "in_progress")
        yield event("response.created", response=started)
        yield event("response.in_progress", response=started)
        out: RequestOutput | None = None
        try:
            async for out in outs:
                shaper.feed(answer, out)
                for ev in text_events(False):
                    yield ev
        except DetspecError as e:
            err = stream_error_body(e)["error"]
            yield event("error", code=err["type"], message=err["message"], param=err["param"])
            return
        for ev in text_events(True):
            yield ev
        items = answer.items(with_lp)
        index = msg["output_index"]
        if opened:
            yield event(
                "response.output_text.done",
                content_index=0,
                text=answer.text,
                logprobs=answer.logprobs if with_lp else [],
                **msg,
            )
            part = answer.part(with_lp)
            yield event("response.content_part.done", content_index=0, part=part, **msg)
            yield event("response.output_item.done", output_index=index, item=items[index])
            index += 1
        for call in answer.calls:
            item = {**call, "arguments": "", "status": "in_progress"}
            yield event("response.output_item.added", output_index=index, item=item)
            ids = {"item_id": call["id"], "output_index": index}
            args = call["arguments"]
            yield event("response.function_call_arguments.delta", delta=args, **ids)
            yield event("response.function_call_arguments.done", arguments=args, **ids)
            yield event("response.output_item.done", output_index=index, item=call)
            index += 1
        body = shaper.done(shaper.response(answer, out))
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        yield event(kind, response=body)


def build_responses_router(server: OpenAIServer) -> APIRouter:
    router = APIRouter()
    store = ResponseStore(server.config.max_stored_responses)

    @router.post("/v1/responses", responses=ERROR_RESPONSES)
    async def responses(req: ResponsesRequest, request: Request) -> Response:
        server.check_logprobs(top_logprobs=req.top_logprobs)
        return await create_response(server, req, request, store)

    def stored(rid: str) -> StoredResponse:
        found = store.get(rid)
        if found is None:
            raise ApiError(404, f"no stored response {rid!r}", "response_id")
        return found

    @router.get("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
    async def get_response(response_id: str) -> JSONResponse:
        return JSONResponse(stored(response_id).body)

    @router.delete("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
    async def delete_response(response_id: str) -> JSONResponse:
        stored(response_id)
        store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    return router
