"""gpt-oss's output format, Harmony (vLLM's ``--reasoning-parser openai_gptoss`` and
``--tool-call-parser openai``): the answer is a run of messages, each a header and a body,

    <|channel|>analysis<|message|>...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>...<|return|>

(the chat template's generation prompt wrote the first ``<|start|>assistant``). What each
message becomes, by its header:

* channel ``analysis`` -- reasoning (``reasoning`` / ``reasoning_content``);
* a recipient ``functions.NAME`` (``to=`` before or after the channel) -- a call of the
  client's tool NAME, its body the arguments, when the request reads calls (``tool_choice``
  ``auto`` with ``--tool-call-parser openai``); otherwise, and for any other recipient (the
  built-in ``browser`` and ``python`` tools), reasoning: the model's own actions;
* channel ``final``, and ``commentary`` without a recipient (a preamble to calls), or no
  channel -- content.

Successive reasoning messages, and successive content messages, are joined by a newline.

The markers are special tokens (checked at start-up: each must be one token): the reader
goes by the output's token ids, so text that ordinary tokens happen to spell is text, and
finds each marker's text in the output's text (decoded with special tokens kept). It is
fed as the output comes, so a stream's pieces add up to the whole answer. An answer's output
constraint (``response_format``) starts after ``<|channel|>final<|message|>``: the model
reasons freely, then answers in the schema. A call cut short (``max_tokens``) is a call if
its arguments parse as JSON; otherwise its text is content, as the other tool parsers do.

``tool_choice`` ``required`` or a named function constrain the whole output with a grammar
(``tool_grammar``): at most one analysis message, then a message to one of the functions
(the named one) whose body is JSON of its parameters schema, ended by ``<|call|>``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from detspec import _core
from detspec.server.tool_parsers import Parsed, ParsedCall

if TYPE_CHECKING:
    from detspec.llm import Tokenizer

NAME = "openai_gptoss"
START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
)
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
ENDS = (END, RETURN, CALL)
# The header of the answer: an output constraint starts after its tokens.
FINAL_HEADER = f"{CHANNEL}final{MESSAGE}"
FUNCTIONS = "functions."

# JSON as the json constraint writes it (compact; the engine's own layout): a model cannot
# pad it with whitespace forever.
_JSON_LAYOUT = json.loads(_core.JSON_OPTIONS)

_RECIPIENT = re.compile(r"\bto=([^\s<]+)")  # up to a space or a marker


@dataclass(frozen=True)
class HarmonyFormat:
    """Harmony on one tokenizer: each marker's token id."""

    markers: dict[int, str]  # token id -> the marker's text
    final_header: tuple[int, ...]  # FINAL_HEADER's tokens
    name: ClassVar[str] = NAME
    # The markers are special tokens: the output is decoded with special tokens kept.
    special: ClassVar[bool] = True

    def reader(self, calls: bool, primer: tuple[str, Sequence[int]] = ("", ())) -> HarmonyReader:
        """A reader of one choice's output; ``calls``: the request reads tool calls;
        ``primer``: the generation prompt (its text and tokens), which may have begun
        the first message."""
        r = HarmonyReader(self, calls)
        r.feed(*primer)
        r.reset_output()
        return r


def single_token_ids(parser: str, tokenizer: Tokenizer | None, tags: Sequence[str]) -> list[int]:
    """Each of ``tags``' one token id (the reasoning parsers' tags and markers);
    ``ValueError`` naming ``parser`` when there is no tokenizer or a tag is not one token."""
    if tokenizer is None:
        raise ValueError(f"the {parser} reasoning parser needs the model's tokenizer")
    ids = []
    for tag in tags:
        found = tokenizer.encode(tag, False)
        if len(found) != 1:
            raise ValueError(
                f"the {parser} reasoning parser needs {tag!r} as one token of the tokenizer; "
                f"it encodes to {len(found)} tokens {found}"
            )
        ids.append(found[0])
    return ids


def harmony_format(tokenizer: Tokenizer | None) -> HarmonyFormat:
    """Harmony on ``tokenizer``; ``ValueError`` when a marker is not one token."""
    ids = single_token_ids(f"{NAME} (gpt-oss's Harmony format)", tokenizer, MARKERS)
    assert tokenizer is not None  # (single_token_ids refuses none)
    return HarmonyFormat(
        dict(zip(ids, MARKERS, strict=True)), tuple(tokenizer.encode(FINAL_HEADER, False))
    )


def tool_grammar(tools: list[tuple[str, dict[str, Any]]]) -> str:
    """A Lark grammar (llguidance's dialect, where ``<|end|>`` is that special token) of an
    answer that calls one of ``tools`` (name, parameters schema): an optional analysis
    message, then ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>``,
    arguments of NAME's schema and ``<|call|>`` (the form OpenAI's Harmony guide shows the model
    writing; its chat template writes earlier calls with the recipient first, which the reader
    takes too)."""
    calls = []
    for i, (name, schema) in enumerate(tools):
        schema = {"x-guidance": _JSON_LAYOUT, **schema}
        calls.append(
            f'call_{i}: {json.dumps(name)} " " {CONSTRAIN} "json" {MESSAGE} '
            f"%json {json.dumps(schema)}"
        )
    names = " | ".join(f"call_{i}" for i in range(len(tools)))
    return "\n".join(
        [
            "start: analysis? call",
            f'analysis: {CHANNEL} "analysis" {MESSAGE} THOUGHT {END} {START} "assistant"',
            "THOUGHT: /(.|\\n)*/",
            f'call: {CHANNEL} "commentary to={FUNCTIONS}" ({names}) {CALL}',
            *calls,
        ]
    )


@dataclass(frozen=True)
class Header:
    """What a message's header says about its body."""

    channel: str | None
    recipient: str | None
    content_type: str | None

    @staticmethod
    def parse(text: str) -> Header:
        """``assistant to=functions.f<|channel|>commentary <|constrain|>json`` and the like
        (the role, when there, comes first)."""
        recipient = None
        found = _RECIPIENT.search(text)
        if found:
            recipient = found.group(1)
            text = text[: found.start()] + text[found.end() :]
        channel = None
        if CHANNEL in text:
            words = text.split(CHANNEL, 1)[1].replace(CONSTRAIN, " ").split()
            channel = words[0] if words else None
        content_type = None
        if CONSTRAIN in text:
            words = text.split(CONSTRAIN, 1)[1].split()
            content_type = words[0] if words else None
        return Header(channel, recipient, content_type)


class HarmonyReader:
    """One choice's output, fed as it comes, as reasoning, content and calls."""

    def __init__(self, fmt: HarmonyFormat, calls: bool) -> None:
        self.fmt = fmt
        self.calls = calls
        self.in_header = True  # the output begins in the header the prompt opened
        self.header = ""
        self.kind: str | None = None  # of the body being read: reasoning, content, call
        self.call_name = ""
        self.args = ""
        self.fresh = False  # no text of the body being read said yet
        self.loose, self.loose_said = "", False  # text outside any message
        self.reset_output()

    def reset_output(self) -> None:
        """Forget what was said (after priming with the generation prompt)."""
        self.reasoning = ""  # all reasoning so far
        self.num_tokens = 0  # reasoning tokens (markers and headers not counted)
        self.said: dict[str, bool] = {"reasoning": False, "content": False}

    @property
    def began_thinking(self) -> bool:
        """Whether there was reasoning (``ReasoningSplit``'s name, which shaping reads)."""
        return self.said["reasoning"]

    @property
    def answering(self) -> bool:
        """Inside a body that is content (an output constraint applies from here)."""
        return self.kind == "content" and not self.in_header

    def feed(self, text: str, token_ids: Sequence[int]) -> tuple[str, Parsed]:
        """The reasoning and the answer (content and completed calls) of the next piece of
        output: ``text``, the decoded ``token_ids``."""
        out = _Out()
        at = 0  # in text
        run = 0  # tokens since the last marker
        for t in token_ids:
            marker = self.fmt.markers.get(t)
            if marker is None:
                run += 1
                continue
            found = text.find(marker, at)
            # A marker whose text is not there (the stop token, taken off the answer):
            # the rest of the text comes before it.
            end = len(text) if found < 0 else found
            self._body(text[at:end], run, out)
            at = len(text) if found < 0 else found + len(marker)
            run = 0
            self._marker(marker, out)
        self._body(text[at:], run, out)
        return out.reasoning, out.answer

    def finish(self) -> tuple[str, Parsed]:
        """What the end of the output completes: a call cut short."""
        out = _Out()
        if self.kind == "call" and not self.in_header:
            self._end_call(out, closed=False)
        self.kind = None
        return out.reasoning, out.answer

    def _say(self, kind: str, text: str, out: _Out) -> None:
        if not text:
            return
        if self.fresh and self.said[kind]:
            text = "\n" + text  # a new message of a kind already said
        self.fresh = False
        self.said[kind] = True
        if kind == "reasoning":
            self.reasoning += text
            out.reasoning += text
        else:
            out.answer.content += text

    def _body(self, text: str, tokens: int, out: _Out) -> None:
        if self.in_header:
            self.header += text
        elif self.kind == "call":
            self.args += text
        elif self.kind == "reasoning":
            self.num_tokens += tokens
            self._say("reasoning", text, out)
        elif self.kind == "content":
            self._say("content", text, out)
        elif self.loose_said:  # between messages, outside any: shown, not lost
            self._say("content", text, out)
        else:  # (whitespace alone there is layout, held until text follows)
            self.loose += text
            if self.loose.strip():
                self.loose_said = True
                self._say("content", self.loose, out)

    def _marker(self, marker: str, out: _Out) -> None:
        if marker == START:
            self._end(out)
            self.in_header, self.header = True, ""
        elif marker == CHANNEL and not self.in_header:
            self._end(out)  # a new header without <|start|>
            self.in_header, self.header = True, marker
        elif marker in (CHANNEL, CONSTRAIN) and self.in_header:
            self.header += marker
        elif marker == MESSAGE and self.in_header:
            self._open(Header.parse(self.header))
        elif marker in ENDS:
            self._end(out)
        # otherwise (<|message|> or <|constrain|> in a body): dropped, as markers are

    def _open(self, h: Header) -> None:
        self.in_header, self.header, self.args, self.fresh = False, "", "", True
        if h.recipient is not None:
            if self.calls and h.recipient.startswith(FUNCTIONS):
                self.kind, self.call_name = "call", h.recipient[len(FUNCTIONS) :]
            else:
                self.kind = "reasoning"
        elif h.channel == "analysis":
            self.kind = "reasoning"
        else:
            self.kind = "content"

    def _end(self, out: _Out) -> None:
        if self.kind == "call" and not self.in_header:
            self._end_call(out, closed=True)
        self.kind = None
        self.in_header, self.header = False, ""
        self.loose, self.loose_said = "", False

    def _end_call(self, out: _Out, closed: bool) -> None:
        args, self.args = self.args.strip(), ""
        try:
            value = json.loads(args)
        except ValueError:
            if not closed:  # cut short and not JSON: not a call
                self._say("content", args, out)
                return
            value = None  # closed by <|call|>: a call, its arguments as written
        if isinstance(value, dict):
            args = json.dumps(value, ensure_ascii=False)
        out.answer.calls.append(ParsedCall(self.call_name, args))


@dataclass
class _Out:
    """What one ``feed`` returns."""

    reasoning: str = ""
    answer: Parsed = field(default_factory=Parsed)
