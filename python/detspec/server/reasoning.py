"""Reasoning outputs (vLLM's and SGLang's ``--reasoning-parser``): a thinking model's output
split into its reasoning, the ``<think> ... </think>`` block, and its answer, the content.

Two formats, by vLLM's names, use ``<think>`` and ``</think>``, which must be single tokens
of the tokenizer (checked when the server starts):

* ``deepseek_r1`` -- DeepSeek-R1 and its distills, QwQ: the output begins inside the block
  (the template may have opened it, or the model opens it itself);
* ``qwen3`` -- the same, except that ``chat_template_kwargs: {"enable_thinking": false}``
  means no thinking when the template does not say otherwise; ``glm45`` (GLM-4.5/4.6/4.7,
  whose templates take the same switch) reads the same way;
* ``deepseek_v3`` -- DeepSeek-V3.1's hybrid: no thinking unless
  ``chat_template_kwargs: {"thinking": true}`` (or the template opened the block), as vLLM's
  parser of that name reads it; DeepSeek-V3 itself never thinks;
* ``kimi_k2`` -- Kimi K2 Thinking: thinking unless ``chat_template_kwargs:
  {"thinking": false}``; a tool-call section (``<|tool_calls_section_begin|>``, where the
  tokenizer has it as one token) also ends the reasoning, and stays in the content for the
  ``kimi_k2`` tool parser, as vLLM's parser of that name reads it;
* ``minimax_m2`` -- MiniMax-M2 (its template opens the block): read as ``deepseek_r1``;
  ``minimax_m2_append_think`` splits nothing off: the thinking stays in the content, the
  ``<think>`` the template opened written before it, as vLLM's parser of that name returns it
  (MiniMax asks clients to send the thinking back in the history).

Whether the output begins inside the block is read off the generation prompt (what the chat
template appended after the last message): its last tag decides (``<think>``: inside;
``</think>``, as Qwen3's template writes an empty block when thinking is off: outside);
without one, the format's default above. Earlier turns' tags do not count.

The split is on tokens: reasoning ends at the ``</think>`` token, not at text that ordinary
tokens happen to spell (the piece of output that holds the token splits at the tag's text), and
the same token opens a request's output constraint (``response_format``,
``structured_outputs``, a required or named tool): the engine applies it after that token
only (``StructuredOutputsParams.starts_after``), so a model thinks freely and then answers in
the schema. A reasoning request is as reproducible as any other: the split and the gate are
functions of the output tokens.

The third, ``openai_gptoss``, is gpt-oss's Harmony format (``harmony``): its reasoning is a
message on the ``analysis`` channel, its answer one on ``final``, and its tool calls
messages to ``functions.*``; it is the default for a gpt-oss checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from detspec.server.harmony import NAME as HARMONY
from detspec.server.harmony import HarmonyFormat, HarmonyReader, harmony_format, single_token_ids

if TYPE_CHECKING:
    from detspec.llm import Tokenizer

START, END = "<think>", "</think>"
APPEND_THINK = "minimax_m2_append_think"
# Kimi K2's tool-call section, which ends its reasoning where the model writes no </think>
KIMI_SECTION = "<|tool_calls_section_begin|>"

# name -> (the chat_template_kwargs switch that turns thinking on or off (None: none), whether
# the output thinks when neither the switch nor the generation prompt says)
PARSERS: dict[str, tuple[str | None, bool]] = {
    "deepseek_r1": (None, True),
    "qwen3": ("enable_thinking", True),
    "glm45": ("enable_thinking", True),
    "deepseek_v3": ("thinking", False),
    "kimi_k2": ("thinking", True),
    "minimax_m2": (None, True),
    APPEND_THINK: (None, True),
    HARMONY: (None, True),
}


@dataclass(frozen=True)
class ReasoningParser:
    """A reasoning format on one tokenizer."""

    name: str
    start_id: int
    end_id: int
    # The tags are special tokens, which a decode with skip_special_tokens drops.
    special: bool
    # A token that ends the reasoning too, kept in the content (Kimi K2's tool-call section).
    section_id: int | None = None

    def thinks(self, generation_prompt: Sequence[int], template_kwargs: dict[str, Any]) -> bool:
        """Whether the output begins inside the thinking block."""
        for t in reversed(generation_prompt):
            if t == self.end_id:
                return False
            if t == self.start_id:
                return True
        switch, default = PARSERS[self.name]
        said = template_kwargs.get(switch) if switch is not None else None
        return default if said is None else bool(said)


def reasoning_parser(name: str, tokenizer: Tokenizer | None) -> ReasoningParser | HarmonyFormat:
    """The parser ``name`` on ``tokenizer``; ``ValueError`` when unknown or when its tags
    are not single tokens."""
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r} (known: {', '.join(PARSERS)})")
    if name == HARMONY:
        return harmony_format(tokenizer)
    start_id, end_id = single_token_ids(name, tokenizer, (START, END))
    assert tokenizer is not None  # (single_token_ids refuses none)
    special = tokenizer.decode([end_id], True) != END
    section_id = None
    if name == "kimi_k2":
        found = tokenizer.encode(KIMI_SECTION, False)
        section_id = found[0] if len(found) == 1 else None
    return ReasoningParser(name, start_id, end_id, special, section_id)


@dataclass(frozen=True)
class ReasoningPlan:
    """What one chat request's output does with reasoning."""

    parser: ReasoningParser | HarmonyFormat
    thinking: bool  # the output begins inside the block (Harmony: before the answer)
    include: bool  # the reasoning is returned (vLLM's ``include_reasoning``)
    # Harmony: the generation prompt (text, tokens), which may have begun the first message
    primer: tuple[str, tuple[int, ...]] = ("", ())

    def split(self, calls: bool) -> ReasoningSplit | HarmonyReader:
        """A split of one choice's output; ``calls``: tool calls are read (Harmony's)."""
        if isinstance(self.parser, HarmonyFormat):
            return self.parser.reader(calls, self.primer)
        return ReasoningSplit(self.parser, self.thinking)

    @property
    def gate(self) -> tuple[int, ...]:
        """The tokens after which the answer's output constraint starts."""
        if isinstance(self.parser, HarmonyFormat):
            return self.parser.final_header
        return (self.parser.end_id,)


def generation_prompt(with_prompt: Sequence[int], without: Sequence[int]) -> Sequence[int]:
    """What the chat template appended for the answer: ``with_prompt`` past its common
    prefix with the rendering without the generation prompt."""
    n = 0
    for a, b in zip(with_prompt, without, strict=False):
        if a != b:
            break
        n += 1
    return with_prompt[n:]


class ReasoningSplit:
    """One choice's output, fed as it comes (all at once when not streamed), split into
    reasoning and content. A ``<think>`` opening the reasoning (after whitespace) is
    dropped; text is held back while it may still be that tag. ``minimax_m2_append_think``
    splits nothing: the output is content, after the ``<think>`` its prompt opened."""

    def __init__(self, parser: ReasoningParser, thinking: bool) -> None:
        self.parser = parser
        self.thinking = thinking  # inside the block now
        self.began_thinking = thinking
        self.reasoning = ""  # all reasoning so far
        self.num_tokens = 0  # reasoning tokens (the tags not counted)
        self._append = parser.name == APPEND_THINK
        # held back; None: settled
        self._head: str | None = "" if thinking and not self._append else None
        self._opening = START if thinking and self._append else ""  # not yet written

    def feed(self, text: str, token_ids: Sequence[int]) -> tuple[str, str]:
        """(reasoning, content) of the next piece of output."""
        if not self.thinking:
            return "", text
        ids = list(token_ids)
        p = self.parser
        ends = (p.end_id, p.section_id)
        k = next((i for i, t in enumerate(ids) if t in ends), len(ids))
        self.num_tokens += sum(t != p.start_id for t in ids[:k])
        self.thinking = k == len(ids)
        if self._append:
            opening, self._opening = self._opening, ""
            return "", opening + text
        if self.thinking:
            return self._reasoning(text, final=False), ""
        # </think> is dropped; a tool-call section starts the content
        tag, kept = (END, False) if ids[k] == p.end_id else (KIMI_SECTION, True)
        at = text.find(tag)
        if at < 0:  # the tag's text was not decoded: all of this piece is reasoning
            return self._reasoning(text, final=True), ""
        return self._reasoning(text[:at], final=True), text[at if kept else at + len(tag) :]

    def finish(self) -> str:
        """Reasoning still held back when the output ends."""
        return self._reasoning("", final=True) if self._head is not None else ""

    def _reasoning(self, text: str, final: bool) -> str:
        if self._head is not None:
            self._head += text
            head = self._head.lstrip()
            if not final and START.startswith(head):
                return ""
            text = head[len(START) :] if head.startswith(START) else self._head
            self._head = None
        self.reasoning += text
        return text
