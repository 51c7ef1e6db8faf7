"""The request side of OpenAI's Responses API (``POST /v1/responses``, in
``responses_routes``): its request model (``input`` items, flat ``tools``, ``text.format``,
the extras chat takes) and the chat completion a request means (``chat_request``): the
``instructions`` and ``input`` as messages, a function call joined to the assistant message
before it, its output a ``tool`` message, a reasoning item the ``reasoning`` of the
assistant message after it, flat tools nested, ``text.format`` a ``response_format``.
Errors met on the chat side name this API's fields (``renamed_errors``: ``input``,
``max_output_tokens``, ``tools[0].parameters``, ``text.format``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, TypeAdapter

from detspec.server import protocol as P
from detspec.server.errors import ApiError

LOGPROBS_INCLUDE = "message.output_text.logprobs"


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


class ReasoningConfig(P.OpenAIBaseModel):
    """``reasoning``: ``effort`` reaches the chat template as ``reasoning_effort`` (as chat's
    field does); a ``summary`` of the reasoning is not produced (the reasoning item carries the
    reasoning itself)."""

    effort: P.ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(P.OpenAIBaseModel):
    model: str | None = None
    # The list first: a bad item's error (the first one reported) names the item.
    input: list[InputItem] | str = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=2**31 - 1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0)
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
    reasoning: ReasoningConfig | None = None
    # vLLM's and detspec's extras, as on chat
    seed: P.Int64 | None = None
    deterministic: bool | None = None
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = Field(default=None, min_length=1)

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or [])


def input_items(req: ResponsesRequest) -> list[InputItem]:
    """``input`` as items (a string is one user message)."""
    if isinstance(req.input, str):
        return [MessageItem(role="user", content=req.input)]
    return list(req.input)


INPUT_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])


def _messages(req: ResponsesRequest, history: list[InputItem]) -> list[P.ChatMessage]:
    """``instructions``, ``history`` (the stored conversation a continuation follows) and
    ``input`` as chat messages: a function call joins the assistant message before it (or
    makes one), its output is a ``tool`` message; a reasoning item is the ``reasoning`` of the
    assistant message it precedes."""
    messages: list[P.ChatMessage] = []
    if req.instructions is not None:
        messages.append(P.ChatMessage(role="system", content=req.instructions))
    items = [*history, *input_items(req)]
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


def chat_request(
    req: ResponsesRequest, history: list[InputItem] | None = None
) -> P.ChatCompletionRequest:
    """The chat completion ``req`` means, after the items of ``history`` (the conversation of
    the response it continues)."""
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
        messages=_messages(req, history or []),
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
        reasoning_effort=req.reasoning.effort if req.reasoning is not None else None,
        stream=req.stream,
        user=req.user,
        cache_salt=req.cache_salt,
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
def renamed_errors() -> Iterator[None]:
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
