"""OpenAI's Responses API, ``POST /v1/responses`` (what ``client.responses.create`` sends, and
the schema agent and RL-environment frameworks speak), on the chat pipeline: the request
becomes the chat completion it means (``input`` and ``instructions`` the messages, flat
``tools`` nested ones, ``text.format`` a ``response_format``), which is checked, rendered
and run as ``/v1/chat/completions`` runs it; the output becomes Responses output items (a
``message`` with one ``output_text`` part, then a ``function_call`` per tool call). Streamed,
the events are Responses' (``response.created`` ... ``response.output_text.delta`` ...
``response.completed``), each with its ``sequence_number``.

Stateless: nothing is stored (``store`` is accepted and answered ``false``), so
``previous_response_id`` is refused; a conversation goes back in ``input``, earlier output
items included, as with chat. ``deterministic``, ``seed`` and vLLM's sampling extras are
accepted as on chat, and the response carries ``system_fingerprint`` and ``dvr_metrics``.
Errors name this API's fields (``input``, ``max_output_tokens``, ``tools[0].parameters``).
Built on ``serving`` (like ``native_routes``), never the other way round.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ConfigDict, Discriminator, Field, Tag

from detspec.errors import DetspecError
from detspec.outputs import RequestOutput
from detspec.server import protocol as P
from detspec.server.errors import ERROR_RESPONSES, ApiError, stream_error_body
from detspec.server.jobs import Job
from detspec.server.serving import OpenAIServer, failed
from detspec.server.shaping import choice_fields, dvr_metrics
from detspec.server.streaming import first_output, until_disconnect

LOGPROBS_INCLUDE = "message.output_text.logprobs"

# --------------------------------------------------------------------------- request


class InputText(P.OpenAIBaseModel):
    type: Literal["input_text"]
    text: str


class OutputText(P.OpenAIBaseModel):
    """An earlier answer's text, sent back as it came (its annotations and logprobs are not
    read)."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class _Item(P.OpenAIBaseModel):
    """What an output item sent back as input carries beside its content (not read)."""

    id: str | None = None
    status: str | None = None


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[Annotated[InputText | OutputText, Field(discriminator="type")]] | str


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningText(P.OpenAIBaseModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Item):
    """An earlier answer's reasoning, sent back: it goes to the chat template with the
    assistant message after it (as ``reasoning_content``); a summary is read if there is
    no content."""

    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or self.summary)


def _item_kind(v: Any) -> str | None:
    """An input item's tag (a message may leave out its ``type``); capitalised, so that an
    error's path skips it (``input[1].call_id``)."""
    t = v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", None)
    return {
        "message": "Message",
        "function_call": "FunctionCall",
        "function_call_output": "FunctionCallOutput",
        "reasoning": "Reasoning",
    }.get(t)


InputItem = Annotated[
    Annotated[MessageItem, Tag("Message")]
    | Annotated[FunctionCallItem, Tag("FunctionCall")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")]
    | Annotated[ReasoningItem, Tag("Reasoning")],
    Discriminator(
        _item_kind,
        custom_error_type="invalid_item",
        custom_error_message="an input item is a message, a function_call, a "
        "function_call_output or a reasoning item (other item types are not supported)",
    ),
]


class FunctionTool(P.OpenAIBaseModel):
    type: Literal["function"]
    name: str = Field(pattern=P.NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(P.OpenAIBaseModel):
    type: Literal["function"]
    name: str


class TextFormat(P.OpenAIBaseModel):
    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=P.NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(P.OpenAIBaseModel):
    format: TextFormat | None = None
    # Accepted at its neutral value only: nothing here can honour another.
    verbosity: Literal["medium"] | None = None


class ResponsesRequest(P.OpenAIBaseModel):
    model: str | None = None
    # The list first: a bad item's error (the first one reported) names the item.
    input: list[InputItem] | str = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=2**31 - 1)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=P.MAX_LOGPROBS)
    include: list[Literal["message.output_text.logprobs"]] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    previous_response_id: str | None = None
    # Accepted at their neutral values only.
    truncation: Literal["disabled"] | None = None
    background: Literal[False] | None = None
    reasoning: None = None
    # vLLM's and detspec's extras, as on chat
    seed: P.Int64 | None = None
    deterministic: bool | None = None
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or [])


def _messages(req: ResponsesRequest) -> list[P.ChatMessage]:
    """``instructions`` and ``input`` as chat messages: a function call joins the assistant
    message before it (or makes one), its output is a ``tool`` message; a reasoning item is
    the ``reasoning`` of the assistant message it precedes."""
    messages: list[P.ChatMessage] = []
    if req.instructions is not None:
        messages.append(P.ChatMessage(role="system", content=req.instructions))
    items = req.input
    if isinstance(items, str):
        items = [MessageItem(role="user", content=items)]
    reasoning: str | None = None  # of the next assistant message
    for it in items:
        if isinstance(it, ReasoningItem):
            reasoning = (reasoning or "") + it.text
            continue
        if isinstance(it, MessageItem):
            content = it.content
            if not isinstance(content, str):
                content = "".join(part.text for part in content)
            messages.append(P.ChatMessage(role=it.role, content=content))
        elif isinstance(it, FunctionCallItem):
            call = P.ToolCall(
                id=it.call_id, function=P.FunctionCall(name=it.name, arguments=it.arguments)
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and reasoning is None:
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(P.ChatMessage(role="assistant", tool_calls=[call]))
        else:
            messages.append(P.ChatMessage(role="tool", tool_call_id=it.call_id, content=it.output))
        if reasoning is not None and messages[-1].role == "assistant":
            messages[-1].reasoning = reasoning
            reasoning = None
    if not messages:
        raise ApiError(400, "input holds no message, only reasoning items", "input")
    return messages


def _response_format(text: TextConfig | None) -> P.ResponseFormat | None:
    f = text.format if text is not None else None
    if f is None or f.type == "text":
        return None
    if f.type == "json_object":
        return P.ResponseFormat(type="json_object")
    if f.name is None or f.schema_ is None:
        raise ApiError(
            400, "text.format of type json_schema needs `name` and `schema`", "text.format"
        )
    schema = P.JsonSchemaFormat(
        name=f.name, description=f.description, schema=f.schema_, strict=f.strict
    )
    return P.ResponseFormat(type="json_schema", json_schema=schema)


def chat_request(req: ResponsesRequest) -> P.ChatCompletionRequest:
    """The chat completion ``req`` means."""
    if req.previous_response_id is not None:
        raise ApiError(
            400,
            "previous_response_id is not supported: this server stores no responses; send "
            "the conversation in `input` (earlier output items included)",
            "previous_response_id",
        )
    tools = None
    if req.tools:
        tools = [
            P.ChatTool(
                type="function",
                function=P.FunctionDefinition(
                    name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
                ),
            )
            for t in req.tools
        ]
    choice: Any = req.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = P.NamedToolChoice(type="function", function=P.NamedFunction(name=choice.name))
    logprobs = req.wants_logprobs
    return P.ChatCompletionRequest(
        model=req.model,
        messages=_messages(req),
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        deterministic=req.deterministic,
        top_k=req.top_k,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=req.logit_bias,
        logprobs=logprobs,
        top_logprobs=(req.top_logprobs or 0) if logprobs else None,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=_response_format(req.text),
        chat_template_kwargs=req.chat_template_kwargs,
        stream=req.stream,
        user=req.user,
    )


# The chat field behind each of this API's (an error names the one the client sent).
_RENAMES = [
    (re.compile(r"^messages(\[\d+\])?(\..*)?$"), "input"),
    (re.compile(r"^max_tokens$"), "max_output_tokens"),
    (re.compile(r"^tools(\[\d+\])\.function\."), r"tools\1."),
    (re.compile(r"^tool_choice\.function\."), "tool_choice."),
    (re.compile(r"^response_format\.json_schema\."), "text.format."),
    (re.compile(r"^response_format(\..*)?$"), "text.format"),
    (re.compile(r"^logprobs$"), "include"),
]


def responses_param(param: str | None) -> str | None:
    """This API's field behind a chat field name."""
    if param is None:
        return None
    for pattern, repl in _RENAMES:
        if pattern.search(param):
            return pattern.sub(repl, param)
    return param


@contextmanager
def _renamed() -> Iterator[None]:
    """Re-raises an ``ApiError`` naming this API's field instead of the chat one."""
    try:
        yield
    except ApiError as e:
        name = responses_param(e.param)
        if name != e.param:
            e.message = f"{e.message} (field `{name}` here)"
            e.args = (e.message,)
            e.param = name
        raise


# --------------------------------------------------------------------------- response


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
    created: int = field(default_factory=lambda: int(time.time()))

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
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
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
            "system_fingerprint": self.server.fingerprint,
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
    server: OpenAIServer, req: ResponsesRequest, request: Request
) -> Response:
    chat = chat_request(req)
    with _renamed():
        job, rid, model = await server.chat_job(chat, "resp_")
    shaper = _Shaper(server, req, chat, job, rid, model)
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
        with _renamed():
            return failed(e, job)
    if req.stream:
        return StreamingResponse(
            _events(shaper, _chain(first, agen)),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return JSONResponse(shaper.response(answer, out))


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
        body = shaper.response(answer, out)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        yield event(kind, response=body)


def build_responses_router(server: OpenAIServer) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/responses", responses=ERROR_RESPONSES)
    async def responses(req: ResponsesRequest, request: Request) -> Response:
        return await create_response(server, req, request)

    return router
