"""Tool calling on ``/v1/chat/completions``: checking ``tools`` and ``tool_choice``, what the
chat template gets, the constraint that enforces ``required`` and a named function, and the
``tool_calls`` of each choice (streamed as deltas or all at once).

``tool_choice`` (vLLM's rules; absent means ``auto`` when there are tools, else ``none``):

* ``none`` -- the tools still reach the template; the output is content;
* ``auto`` -- the model's free output is read by the server's ``--tool-call-parser`` (needs
  ``--enable-auto-tool-choice``, else a 400); finish reason ``tool_calls`` when it called one;
* ``required`` -- constrained to a JSON array of ``{"name", "parameters"}`` over the tools
  (vLLM's schema); finish reason ``tool_calls``;
* ``{"type": "function", "function": {"name": N}}`` -- constrained to N's parameters schema;
  the output is the call's arguments; finish reason ``stop`` (as OpenAI and vLLM).

With gpt-oss's Harmony format (``--reasoning-parser openai_gptoss``) a call is a message the
model addresses to a function: ``required`` and a named function constrain the whole output
to one such message (``harmony_calls``), and the Harmony reader reads the calls of every mode.

Call ids are ``call_`` and 24 hex digits (9 alphanumerics with the Mistral parser, as its
templates want). A deterministic request's ids are a hash of its seed, prompt and the call's
position, so a replay returns the same ids; other requests get random ones.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from detspec.server import protocol as P
from detspec.server.errors import ApiError
from detspec.server.harmony import tool_grammar
from detspec.server.structured import Constraint
from detspec.server.tool_parsers import PARSERS, Parsed, ParsedCall, ToolParser

Mode = Literal["none", "auto", "named", "required"]
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass
class CallIds:
    """Tool-call ids of one request."""

    deterministic: bool
    seed: int | None
    prompt_ids: list[int]
    short: bool = False

    def make(self, choice: int, call: int) -> str:
        if self.deterministic:
            key = json.dumps([self.seed, self.prompt_ids, choice, call]).encode()
            digest = hashlib.sha256(key).hexdigest()
        else:
            digest = uuid.uuid4().hex
        if self.short:
            return digest[:9]
        return "call_" + digest[:24]


@dataclass
class ToolPlan:
    """What a chat request asked of its tools."""

    mode: Mode
    tools: list[dict[str, Any]] | None = None  # as the chat template gets them
    named: str | None = None
    parser: type[ToolParser] | None = None
    parallel: bool = True
    constraint: Constraint | None = None

    @property
    def keeps_special_tokens(self) -> bool:
        return self.mode == "auto" and self.parser is not None and self.parser.needs_special_tokens

    @property
    def reads_harmony(self) -> bool:
        """The calls are Harmony messages, which the reasoning parser's reader parses
        (``ChoiceTools.take``)."""
        return self.mode != "none" and self.parser is not None and self.parser.harmony

    @property
    def parses_output(self) -> bool:
        return self.mode != "none" and (self.mode != "auto" or self.parser is not None)


def check_tools(tools: list[P.ChatTool]) -> None:
    """What the models cannot say: a parameters schema must describe an object, names are
    unique."""
    seen: set[str] = set()
    for i, t in enumerate(tools):
        f = t.function
        if f.name in seen:
            param = f"tools[{i}].function.name"
            raise ApiError(400, f"{param}: tool name {f.name!r} is given twice", param)
        seen.add(f.name)
        params = f.parameters
        if params is not None and params.get("type", "object") != "object":
            raise ApiError(
                400,
                f"tools[{i}].function.parameters of tool {f.name!r} must be a JSON schema of "
                f"type 'object', got type {params.get('type')!r}",
                f"tools[{i}].function.parameters",
            )


def plan_tools(req: P.ChatCompletionRequest, parser: str | None) -> ToolPlan:
    """The request's tool mode; a 400 for a choice it cannot have."""
    tools = req.tools
    choice = req.tool_choice
    if tools is not None:
        check_tools(tools)
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and tools is None:
        raise ApiError(400, "tool_choice needs `tools`", "tool_choice")
    if choice == "required" and not tools:
        choice = "none"  # OpenAI: required over no tools is none
    template_tools = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    parallel = req.parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan("none", template_tools)
    assert tools is not None
    if choice == "auto":
        if parser is None:
            raise ApiError(
                400,
                'tool_choice "auto" (the default when tools are given) needs the server to run '
                "with --enable-auto-tool-choice and --tool-call-parser",
                "tool_choice",
            )
        return ToolPlan("auto", template_tools, parser=PARSERS[parser], parallel=parallel)
    if choice == "required":
        return ToolPlan(
            "required",
            template_tools,
            parallel=parallel,
            constraint=Constraint({"json": required_schema(tools, parallel)}, {}, "tools"),
        )
    assert isinstance(choice, P.NamedToolChoice)
    name = choice.function.name
    for i, t in enumerate(tools):
        if t.function.name == name:
            param = f"tools[{i}].function.parameters"
            schema = t.function.parameters or EMPTY_PARAMETERS
            return ToolPlan(
                "named",
                template_tools,
                named=name,
                constraint=Constraint({"json": schema}, {"json": param}, param),
            )
    raise ApiError(
        400,
        f"tool_choice names function {name!r}, which is not among `tools` "
        f"({', '.join(t.function.name for t in tools)})",
        "tool_choice",
    )


def harmony_calls(plan: ToolPlan, tools: list[P.ChatTool]) -> ToolPlan:
    """``required`` or a named function for gpt-oss's Harmony format: the whole output is
    constrained to an optional analysis message and a call of one of the tools (the named
    one), read as any Harmony call; the finish reasons stay ``required``'s and a named
    function's."""
    chosen = [(i, t) for i, t in enumerate(tools) if plan.named in (None, t.function.name)]
    grammar = tool_grammar(
        [(t.function.name, t.function.parameters or EMPTY_PARAMETERS) for _, t in chosen]
    )
    param = f"tools[{chosen[0][0]}].function.parameters" if plan.named else "tools"
    constraint = Constraint({"grammar": grammar}, {"grammar": param}, param, whole_output=True)
    return dataclasses.replace(plan, parser=PARSERS["openai"], constraint=constraint)


def required_schema(tools: list[P.ChatTool], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for ``tool_choice: required``: a non-empty array of calls, each one of
    the tools' ``{"name": const, "parameters": schema}`` (and nothing else: vLLM allows other
    keys, which a model then fills with text the call drops); the tools' ``$defs`` hoisted to
    the top (a name defined differently by two tools is a 400)."""
    defs: dict[str, Any] = {}
    variants = []
    for i, t in enumerate(tools):
        params = copy.deepcopy(t.function.parameters) or dict(EMPTY_PARAMETERS)
        for name, d in params.pop("$defs", {}).items():
            if name in defs and defs[name] != d:
                raise ApiError(
                    400,
                    f"tools[{i}].function.parameters defines $defs/{name} differently from an "
                    "earlier tool (tool_choice required merges them)",
                    f"tools[{i}].function.parameters",
                )
            defs[name] = d
        variants.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [t.function.name]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": variants},
    }
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


# --------------------------------------------------------------------------- output


@dataclass
class ChoiceTools:
    """One choice's text as content and tool calls. ``feed`` the text as it comes (all of it
    at once when not streaming), then ``finish``; each returns the content to send and the
    ``tool_calls`` deltas (OpenAI's streaming shape: ``index``, and ``id``, ``type``,
    ``function.name`` on a call's first delta). ``content`` and ``calls`` add them up."""

    plan: ToolPlan
    ids: CallIds
    choice: int
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    _text: str = ""
    _parser: ToolParser | None = None

    def __post_init__(self) -> None:
        if self.plan.mode == "auto" and self.plan.parser is not None:
            self._parser = self.plan.parser(self.plan.tools)

    def _call(self, name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
        call = {
            "index": len(self.calls),
            "id": call_id or self.ids.make(self.choice, len(self.calls)),
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        self.calls.append(copy.deepcopy(call))
        return call

    def take(self, p: Parsed) -> tuple[str, list[dict[str, Any]]]:
        """Content and calls another reader parsed: the content to send and the calls'
        deltas."""
        calls: list[ParsedCall] = p.calls
        if not self.plan.parallel:
            calls = calls[: max(0, 1 - len(self.calls))]
        deltas = [self._call(c.name, c.arguments, c.id) for c in calls]
        self.content += p.content
        return p.content, deltas

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        mode = self.plan.mode
        if self._parser is not None:
            return self.take(self._parser.feed(text))
        if mode == "named":
            if not self.calls:
                assert self.plan.named is not None
                return "", [self._call(self.plan.named, text)]
            self.calls[0]["function"]["arguments"] += text
            return "", ([{"index": 0, "function": {"arguments": text}}] if text else [])
        if mode == "required":
            self._text += text
            return "", []
        self.content += text
        return text, []

    def finish(self, finish_reason: str | None) -> tuple[str, list[dict[str, Any]], str | None]:
        """The rest, and the choice's finish reason: ``tool_calls`` when calls were made
        (``required``, ``auto``) and the output ended normally."""
        content, deltas = "", []
        if self._parser is not None:
            content, deltas = self.take(self._parser.finish())
        elif self.plan.reads_harmony:
            pass  # the Harmony reader handed over its calls
        elif self.plan.mode == "named" and not self.calls:
            assert self.plan.named is not None
            deltas = [self._call(self.plan.named, "")]
        elif self.plan.mode == "required":
            calls = _required_calls(self._text)
            if calls is None:  # cut short (max_tokens): what there is, as content
                content = self._text
                self.content += content
            else:
                content, deltas = self.take(Parsed("", calls))
        if self.calls and self.plan.mode != "named" and finish_reason == "stop":
            finish_reason = "tool_calls"
        return content, deltas, finish_reason

    def message(self) -> dict[str, Any]:
        """The non-streamed assistant message."""
        msg: dict[str, Any] = {"role": "assistant"}
        if self.calls:
            msg["content"] = self.content if self.content.strip() else None
            msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in self.calls]
        else:
            msg["content"] = self.content
        return msg


def _required_calls(text: str) -> list[ParsedCall] | None:
    try:
        items = json.loads(text)
        if not isinstance(items, list) or not items:
            return None
        return [
            ParsedCall(it["name"], json.dumps(it["parameters"], ensure_ascii=False)) for it in items
        ]
    except (ValueError, KeyError, TypeError):
        return None
