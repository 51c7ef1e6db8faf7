"""Chat rendering: OpenAI messages to the conversation the model's chat template reads
(minijinja, in the Rust core), then to token ids."""

from __future__ import annotations

import asyncio
from typing import Any

from detspec.errors import InvalidRequestError
from detspec.llm import Tokenizer
from detspec.server import protocol as P
from detspec.server.errors import ApiError, invalid

# Chat-template variables that are arguments of apply_chat_template itself.
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "add_generation_prompt", "tokenize"})


def conversation(messages: list[P.ChatMessage]) -> list[dict[str, Any]]:
    """Messages as template input: content parts joined into one string."""
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
    return conv


async def render_chat(
    tokenizer: Tokenizer | None,
    messages: list[P.ChatMessage],
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None,
) -> list[int]:
    """The token ids of a conversation rendered with the model's chat template."""
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: chat is unavailable", "messages")
    kwargs = dict(template_kwargs or {})
    clash = RESERVED_TEMPLATE_KWARGS & kwargs.keys()
    if clash:
        raise ApiError(
            400, f"chat_template_kwargs may not set {sorted(clash)}", "chat_template_kwargs"
        )
    try:
        ids = await asyncio.to_thread(
            tokenizer.apply_chat_template,
            conversation(messages),
            add_generation_prompt,
            True,
            **kwargs,
        )
    except InvalidRequestError as e:
        raise invalid(e, "messages") from None
    return list(ids)  # type: ignore[arg-type]
