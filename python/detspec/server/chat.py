"""Chat rendering: OpenAI messages (and tools) to the conversation the model's chat template
reads (minijinja, in the Rust core), then to token ids. ``tools`` reach the template as the
``tools`` variable, as transformers' ``apply_chat_template(tools=...)`` passes them."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from detspec.errors import InvalidRequestError
from detspec.llm import Tokenizer
from detspec.server import protocol as P
from detspec.server.errors import ApiError, invalid

# Chat-template variables that are arguments of apply_chat_template itself.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "add_generation_prompt", "tokenize", "continue_final_message", "chat_template"}
)


def conversation(messages: list[P.ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template reads them: content parts joined into one string, a
    call's ``arguments`` parsed into a dict (as vLLM and transformers' templates expect), an
    answer's reasoning as ``reasoning_content`` (Qwen3's templates read it) and ``thinking``
    (gpt-oss's)."""
    conv = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            content = "".join(part.text for part in m.content)
        else:
            content = m.content or ""
        d: dict[str, Any] = {"role": m.role, "content": content}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [_template_call(i, j, c) for j, c in enumerate(m.tool_calls)]
        reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
        if reasoning is not None:
            d["reasoning_content"] = d["thinking"] = reasoning
        conv.append(d)
    return conv


def _template_call(i: int, j: int, c: P.ToolCall) -> dict[str, Any]:
    param = f"messages[{i}].tool_calls[{j}].function.arguments"
    try:
        args = json.loads(c.function.arguments)
    except ValueError as e:
        raise ApiError(400, f"{param} must be JSON text: {e}", param) from None
    return {
        "id": c.id,
        "type": "function",
        "function": {"name": c.function.name, "arguments": args},
    }


async def render_chat(
    tokenizer: Tokenizer | None,
    messages: list[P.ChatMessage],
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None,
    tools: list[dict[str, Any]] | None = None,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    add_special_tokens: bool = False,
) -> list[int]:
    """The token ids of a conversation rendered with the model's chat template;
    ``continue_final_message``: cut after the last message's content, so that the model
    goes on with it (vLLM's and transformers' option: what the template writes after the
    content, an end-of-turn token, is left out); ``add_special_tokens``: the rendered text
    encoded with the tokenizer's special tokens (vLLM's option; off, as transformers
    renders)."""
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: chat is unavailable", "messages")
    kwargs = dict(template_kwargs or {})
    clash = RESERVED_TEMPLATE_KWARGS & kwargs.keys()
    if clash:
        raise ApiError(
            400, f"chat_template_kwargs may not set {sorted(clash)}", "chat_template_kwargs"
        )
    if tools is not None:
        if "tools" in kwargs:
            raise ApiError(
                400,
                "send tools as `tools`, not also in chat_template_kwargs",
                "chat_template_kwargs",
            )
        kwargs["tools"] = tools
    conv = conversation(messages)
    try:
        rendered = await asyncio.to_thread(
            tokenizer.apply_chat_template,
            conv,
            add_generation_prompt,
            not add_special_tokens,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            **kwargs,
        )
        if add_special_tokens:
            rendered = await asyncio.to_thread(tokenizer.encode, rendered, True)
    except InvalidRequestError as e:
        raise invalid(e, "messages") from None
    return list(rendered)  # type: ignore[arg-type]
