"""Tool-call parsers: a model's free output (``tool_choice: "auto"``) as content and calls.

One per output format, chosen by ``detspec serve --tool-call-parser`` (vLLM's names):

* ``hermes`` -- ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of
  them (Qwen2, Qwen2.5, Qwen3, Hermes); an unclosed last call is read to the end;
* ``llama3_json`` -- the output *is* the calls: ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>``, several separated by ``;`` (Llama 3.1+);
* ``mistral`` -- content, then ``[TOOL_CALLS]`` and a JSON array of calls
  (``[{"name": ..., "arguments": {...}}]``), or the newer ``[TOOL_CALLS]name[ARGS]{...}``;
* ``nemotron_json`` -- Nemotron Nano 2's ``<TOOLCALL>[{"name": ..., "arguments": {...}},
  ...]</TOOLCALL>``, any number of blocks among the content (the name of NVIDIA's vLLM plugin);
* ``glm45`` (and ``glm47``) -- GLM-4.5/4.6/4.7's ``<tool_call>name`` then
  ``<arg_key>k</arg_key><arg_value>v</arg_value>`` pairs, ``</tool_call>``: a value is the
  argument's text where the tool's schema says ``string``, else JSON (text where it does not
  parse), as vLLM reads it;
* ``qwen3_coder`` (and ``qwen3_xml``) -- Qwen3-Coder's ``<tool_call><function=name>`` with
  ``<parameter=k>v</parameter>`` pairs: a value typed by the tool's schema (text for strings
  and for arguments the schema does not name; ``null`` is null), as vLLM reads it;
* ``deepseek_v3`` (and ``deepseek_v31``) -- DeepSeek-V3/R1's calls between
  ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``, each
  ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>name`` and its arguments in a ```` ```json ````
  fence (V3.1: ``name<｜tool▁sep｜>{...}``), ``<｜tool▁call▁end｜>``;
* ``kimi_k2`` -- Kimi K2's ``<|tool_calls_section_begin|>``, each
  ``<|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{...}<|tool_call_end|>``;
  the call's id is the model's (``functions.name:0``), which Kimi's template writes back;
* ``minimax_m2`` -- MiniMax-M2's ``<minimax:tool_call>`` with ``<invoke name="f">`` and
  ``<parameter name="k">v</parameter>`` pairs: a value typed by the tool's schema (its
  ``anyOf``/``enum`` types too; ``null`` is null), as vLLM reads it;
* ``pythonic`` -- the output *is* a Python list of calls with keyword arguments,
  ``[get_weather(city="Paris"), get_time()]`` (Llama 3.2, Llama 4, ToolACE); ``llama4_pythonic``
  also reads it between ``<|python_start|>`` and ``<|python_end|>``;
* ``lfm2`` -- LFM2's and LFM2.5's: such lists between ``<|tool_call_start|>`` and
  ``<|tool_call_end|>``, any number of them among the content;
* ``openai`` -- gpt-oss's Harmony messages to ``functions.*``: read with the rest of the
  format by its reasoning parser (``harmony``), so this parser only names it.

Parsers are incremental: ``feed(text)`` returns the content that can be shown now and the calls
completed so far, ``finish()`` the rest. A parser is made per output, with the request's tools
(``tools``: the request's ``tools`` as dicts, which GLM's format needs for its argument types).
A non-streamed response is ``feed(all) + finish()``, so a stream's pieces add up to exactly the
non-streamed answer. A call that does not parse (or lacks a name) is not a call: its text is
returned as content.
"""

from __future__ import annotations

import ast
import json
import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text
    # the id the model gave the call (Kimi K2's), kept as the call's id; else one is made
    id: str | None = None


@dataclass
class Parsed:
    """What a parser returns: content to show and calls completed."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)

    def extend(self, other: Parsed) -> None:
        self.content += other.content
        self.calls.extend(other.calls)


ARGUMENT_KEYS = ("arguments", "parameters")


def call_from_json(obj: Any) -> ParsedCall:
    """``{"name": str, "arguments": {...}}`` as a call; ``ValueError`` if it is not one.
    Arguments given as a JSON string are kept as they are."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError("not a call: no name")
    args: Any = {}
    for key in ARGUMENT_KEYS:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):
        strict_json(args)  # must be JSON text
        return ParsedCall(obj["name"], args)
    if not isinstance(args, dict):
        raise ValueError("arguments are not an object")
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict_json(text: str) -> Any:
    """``json.loads`` without Python's NaN and Infinity, which are not JSON: an argument read
    as one would make the call's ``arguments`` text no client can parse."""
    return json.loads(text, parse_constant=_refuse_constant)


def _runs(pattern: re.Pattern[str], text: str, start: int = 0) -> list[re.Match[str]]:
    """Matches of ``pattern`` one right after another from ``start`` to the end of ``text``;
    ``ValueError`` for any other text (whitespace around them is the pattern's to allow)."""
    out, i = [], start
    while text[i:].strip():
        m = pattern.match(text, i)
        if m is None:
            raise ValueError("not a call: text between its parts")
        out.append(m)
        i = m.end()
    return out


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that starts ``marker`` (it may be the
    beginning of a marker still arriving)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    """Base: ``feed`` text as it arrives, then ``finish`` once."""

    name: ClassVar[str]
    # vLLM's Mistral tool-call ids are 9 alphanumerics (its chat templates check that)
    short_ids: ClassVar[bool] = False
    # its marker is a special token: the output is decoded with special tokens kept
    needs_special_tokens: ClassVar[bool] = False
    # the calls are Harmony messages, read by the openai_gptoss reasoning parser
    harmony: ClassVar[bool] = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []

    def feed(self, text: str) -> Parsed:
        raise NotImplementedError

    def finish(self) -> Parsed:
        raise NotImplementedError

    @classmethod
    def parse(cls, text: str, tools: list[dict[str, Any]] | None = None) -> Parsed:
        """The whole output at once."""
        p = cls(tools)
        out = p.feed(text)
        out.extend(p.finish())
        return out


class _TaggedCallParser(ToolParser):
    """Formats whose calls are bodies between ``START`` and ``END``, any number of them among
    the content; an unclosed last call is read to the end. ``_calls`` reads a body."""

    START: ClassVar[str] = "<tool_call>"
    END: ClassVar[str] = "</tool_call>"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self.buf = ""
        self.in_call = False
        # a call ended and no text followed yet: whitespace here is layout, not content
        self.after_call = False

    def _calls(self, body: str) -> list[ParsedCall]:
        """The calls ``body`` holds; ``ValueError`` if it is not calls."""
        raise NotImplementedError

    def _schema(self, tool: str) -> dict[str, Any]:
        """The properties of ``tool``'s parameters in the request's tools (none if absent)."""
        for t in self.tools:
            f = t.get("function") or {}
            if f.get("name") == tool:
                return (f.get("parameters") or {}).get("properties") or {}
        return {}

    def _skipped(self) -> int | None:
        """How much of ``buf`` (outside a call) is neither content nor a call (LFM2's echo of
        a call); None while that is undecided."""
        return 0

    def _content(self, text: str) -> str:
        return "" if self.after_call and not text.strip() else text

    def _close(self, body: str, closed: bool) -> Parsed:
        try:
            calls = self._calls(body)
        except ValueError:
            return Parsed(self.START + body + (self.END if closed else ""))
        return Parsed("", calls)

    def feed(self, text: str) -> Parsed:
        self.buf += text
        out = Parsed()
        while True:
            if self.in_call:
                i = self.buf.find(self.END)
                if i < 0:
                    return out
                out.extend(self._close(self.buf[:i], closed=True))
                self.buf = self.buf[i + len(self.END) :]
                self.in_call = False
                continue
            skip = self._skipped()
            if skip is None:
                return out
            if skip:
                self.buf = self.buf[skip:]
                continue
            i = self.buf.find(self.START)
            if i < 0:
                keep = _held_prefix(self.buf, self.START)
                ready = self.buf[: len(self.buf) - keep]
                if ready.strip() or not self.after_call:
                    out.content += ready
                    self.buf = self.buf[len(ready) :]
                    # text followed the call: whitespace after it is text too, as read whole
                    self.after_call = False
                return out
            out.content += self._content(self.buf[:i])
            self.buf = self.buf[i + len(self.START) :]
            self.in_call = True
            self.after_call = True

    def finish(self) -> Parsed:
        buf, self.buf = self.buf, ""
        if self.in_call:
            self.in_call = False
            return self._close(buf, closed=False)
        return Parsed(self._content(buf))


class HermesToolParser(_TaggedCallParser):
    name = "hermes"

    def _calls(self, body: str) -> list[ParsedCall]:
        return [call_from_json(strict_json(body))]


class NemotronJsonToolParser(_TaggedCallParser):
    """Nemotron Nano 2's ``<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]
    </TOOLCALL>`` (special tokens of its tokenizer): a JSON list of calls in each block (one
    object alone is a list of one), any number of blocks among the content."""

    name = "nemotron_json"
    START = "<TOOLCALL>"
    END = "</TOOLCALL>"
    needs_special_tokens = True

    def _calls(self, body: str) -> list[ParsedCall]:
        obj = strict_json(body)
        calls = obj if isinstance(obj, list) else [obj]
        if not calls:
            raise ValueError("not a call: an empty list")
        return [call_from_json(c) for c in calls]


class Glm45ToolParser(_TaggedCallParser):
    """``<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n
    </tool_call>``: the name, then nothing but key/value pairs (GLM-4.7 writes no newline after
    the name). Its tags are special tokens."""

    name = "glm45"
    needs_special_tokens = True
    PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)

    def _calls(self, body: str) -> list[ParsedCall]:
        at = body.find("<arg_key>")
        name = (body if at < 0 else body[:at]).strip()
        if not name or any(c.isspace() or c == "<" for c in name):
            raise ValueError("not a call: no name")
        strings = {k for k, v in self._schema(name).items() if _schema_type(v) == "string"}
        args: dict[str, Any] = {}
        for m in _runs(self.PAIR, body, len(body) if at < 0 else at):
            key, value = m.group(1).strip(), m.group(2)
            if key in strings:
                args[key] = value
            else:
                try:
                    args[key] = strict_json(value)
                except ValueError:
                    args[key] = value
        return [ParsedCall(name, json.dumps(args, ensure_ascii=False))]


class Glm47ToolParser(Glm45ToolParser):
    """vLLM's name for GLM-4.7's format, which the same reader reads."""

    name = "glm47"


def _schema_type(prop: Any) -> str:
    """A JSON schema property's type, lower case (the first non-null one of a list; ``string``
    where it names none)."""
    t = prop.get("type", "string") if isinstance(prop, dict) else "string"
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), "string")
    return str(t).lower()


def _typed(value: str, prop: Any) -> Any:
    """Qwen3-Coder's parameter text as its schema types it (vLLM's reading): text for
    string-like types, an int or number where it parses as one, a boolean by ``true``, JSON for
    the rest; the text itself where it does not parse."""
    t = _schema_type(prop)
    if t in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    try:
        if t.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(value)
        if t.startswith(("num", "float")):
            f = strict_json(value.strip())
            if not isinstance(f, int | float) or isinstance(f, bool):
                return value
            return int(f) if float(f).is_integer() else f
        if t in ("boolean", "bool", "binary"):
            return value.strip().lower() == "true"
        return strict_json(value)
    except ValueError:
        return value


class Qwen3CoderToolParser(_TaggedCallParser):
    """``<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n
    </function>\n</tool_call>``: one or more functions, each nothing but parameters. A value
    loses one newline on each side; ``null`` is null; an argument the tool's schema names is
    typed by it (``_typed``), any other stays text."""

    name = "qwen3_coder"
    # Qwen's tokenizers make its tags ordinary tokens, others may not: kept either way.
    needs_special_tokens = True
    FUNCTION = re.compile(r"\s*<function=([^>\s]+)>(.*?)</function>\s*", re.DOTALL)
    PARAMETER = re.compile(r"\s*<parameter=([^>]+)>(.*?)</parameter>\s*", re.DOTALL)

    def _calls(self, body: str) -> list[ParsedCall]:
        calls = []
        for f in _runs(self.FUNCTION, body):
            name, schema = f.group(1), self._schema(f.group(1))
            args: dict[str, Any] = {}
            for p in _runs(self.PARAMETER, f.group(2)):
                key, value = p.group(1).strip(), p.group(2)
                value = value.removeprefix("\n").removesuffix("\n")
                if value.strip().lower() == "null":
                    args[key] = None
                else:
                    args[key] = _typed(value, schema[key]) if key in schema else value
            calls.append(ParsedCall(name, json.dumps(args, ensure_ascii=False)))
        if not calls:
            raise ValueError("not a call: no function")
        return calls


class Qwen3XmlToolParser(Qwen3CoderToolParser):
    """vLLM's other name for Qwen3-Coder's format."""

    name = "qwen3_xml"


def _schema_types(prop: Any) -> set[str]:
    """Every type a JSON schema property allows, lower case: its ``type`` (or list of them),
    its ``enum`` values' types, and those of its ``anyOf``/``oneOf``/``allOf`` choices;
    ``{"string"}`` where it names none."""
    if not isinstance(prop, dict):
        return {"string"}
    t = prop.get("type")
    types = {str(x).lower() for x in (t if isinstance(t, list) else [t]) if x is not None}
    for v in prop.get("enum") or []:
        types.add(_JSON_TYPES.get(type(v), "string"))
    for key in ("anyOf", "oneOf", "allOf"):
        for choice in prop.get(key) or []:
            types |= _schema_types(choice)
    return types or {"string"}


_JSON_TYPES: dict[type, str] = {
    type(None): "null", bool: "boolean", int: "integer", float: "number", list: "array",
    dict: "object", str: "string",
}  # fmt: skip


def _minimax_typed(value: str, types: set[str]) -> Any:
    """MiniMax-M2's parameter text as vLLM's parser types it: null for ``null``/``none``/
    ``nil``; else the first of integer, number (integral: an integer), boolean (``true``/
    ``1``/``yes``/``on`` and their opposites), object or array (JSON) that the schema allows and
    the text parses as; text where the schema allows a string; else JSON, or the text."""
    if value.lower() in ("null", "none", "nil"):
        return None
    for t in ("integer", "int", "number", "float", "boolean", "bool", "object", "array"):
        if t not in types:
            continue
        try:
            if t in ("integer", "int"):
                return int(value)
            if t in ("number", "float"):
                f = float(value)
                if not math.isfinite(f):
                    continue  # not JSON
                return int(f) if f.is_integer() else f
            if t in ("boolean", "bool"):
                word = value.strip().lower()
                if word in ("true", "1", "yes", "on", "false", "0", "no", "off"):
                    return word in ("true", "1", "yes", "on")
                continue
            return strict_json(value)
        except ValueError:
            continue
    if types & {"string", "str", "text"}:
        return value
    try:
        return strict_json(value)
    except ValueError:
        return value


class MiniMaxM2ToolParser(_TaggedCallParser):
    """``<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris
    </parameter>\n</invoke>\n</minimax:tool_call>``: one or more invokes, each nothing but
    parameters; names may be quoted; a value is its text stripped, typed by the tool's schema
    (``_minimax_typed``; a parameter the schema does not name is text)."""

    name = "minimax_m2"
    START = "<minimax:tool_call>"
    END = "</minimax:tool_call>"
    needs_special_tokens = True
    INVOKE = re.compile(r"\s*<invoke name=([^>]+)>(.*?)</invoke>\s*", re.DOTALL)
    PARAMETER = re.compile(r"\s*<parameter name=([^>]+)>(.*?)</parameter>\s*", re.DOTALL)

    @staticmethod
    def _unquoted(name: str) -> str:
        name = name.strip()
        if len(name) >= 2 and name[0] == name[-1] and name[0] in "\"'":
            return name[1:-1]
        return name

    def _calls(self, body: str) -> list[ParsedCall]:
        calls = []
        for f in _runs(self.INVOKE, body):
            name = self._unquoted(f.group(1))
            if not name or any(c.isspace() for c in name):
                raise ValueError("not a call: no name")
            schema = self._schema(name)
            args = {}
            for p in _runs(self.PARAMETER, f.group(2)):
                key = self._unquoted(p.group(1))
                types = _schema_types(schema[key]) if key in schema else {"string"}
                args[key] = _minimax_typed(p.group(2).strip(), types)
            calls.append(ParsedCall(name, json.dumps(args, ensure_ascii=False)))
        if not calls:
            raise ValueError("not a call: no invoke")
        return calls


def _json_args(text: str) -> str:
    """A call's arguments given as JSON text: an object, as compact JSON text (``ValueError``
    if it is not one)."""
    args = strict_json(text)
    if not isinstance(args, dict):
        raise ValueError("arguments are not an object")
    return json.dumps(args, ensure_ascii=False)


class _SectionParser(_TaggedCallParser):
    """Formats whose calls sit in one section (``START`` … ``END``), each between
    ``CALL_BEGIN`` and ``CALL_END``; nothing else may be in the section but whitespace.
    ``_call`` reads one call's text. Their markers are special tokens."""

    CALL_BEGIN: ClassVar[str]
    CALL_END: ClassVar[str]
    needs_special_tokens = True

    def _call(self, text: str) -> ParsedCall:
        raise NotImplementedError

    def _calls(self, body: str) -> list[ParsedCall]:
        calls, i = [], 0
        while body[i:].strip():
            start = body.find(self.CALL_BEGIN, i)
            if start < 0 or body[i:start].strip():
                raise ValueError("not a call: text in the calls section")
            start += len(self.CALL_BEGIN)
            end = body.find(self.CALL_END, start)
            if end < 0:
                end = len(body)  # the last call unclosed: read to the end
            calls.append(self._call(body[start:end]))
            i = end + len(self.CALL_END)
        if not calls:
            raise ValueError("not a call: an empty calls section")
        return calls


class DeepSeekV3ToolParser(_SectionParser):
    """``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n
    {"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>``, and V3.1's
    ``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>``."""

    name = "deepseek_v3"
    START = "<｜tool▁calls▁begin｜>"
    END = "<｜tool▁calls▁end｜>"
    CALL_BEGIN = "<｜tool▁call▁begin｜>"
    CALL_END = "<｜tool▁call▁end｜>"
    SEP = "<｜tool▁sep｜>"
    FENCED = re.compile(r"\s*([^\s`]+)\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)

    def _call(self, text: str) -> ParsedCall:
        head, sep, rest = text.partition(self.SEP)
        if not sep:
            raise ValueError("not a call: no tool separator")
        fenced = self.FENCED.fullmatch(rest) if head.strip() == "function" else None
        if fenced is not None:  # V3: the type, the name, the arguments fenced
            name, args = fenced.group(1), fenced.group(2)
        else:  # V3.1: the name, the arguments
            name, args = head.strip(), rest
        if not name or any(c.isspace() for c in name):
            raise ValueError("not a call: no name")
        return ParsedCall(name, _json_args(args))


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    """vLLM's name for DeepSeek-V3.1's form, which the same reader reads."""

    name = "deepseek_v31"


class KimiK2ToolParser(_SectionParser):
    """``<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>``:
    the name is what lies between the id's ``.`` and ``:``; the id is kept."""

    name = "kimi_k2"
    START = "<|tool_calls_section_begin|>"
    END = "<|tool_calls_section_end|>"
    CALL_BEGIN = "<|tool_call_begin|>"
    CALL_END = "<|tool_call_end|>"
    ARGS = "<|tool_call_argument_begin|>"
    CALL_ID = re.compile(r"(?:[^.\s:]+\.)?([^.\s:]+):\d+")

    def _call(self, text: str) -> ParsedCall:
        call_id, sep, args = text.partition(self.ARGS)
        call_id = call_id.strip()
        m = self.CALL_ID.fullmatch(call_id)
        if not sep or m is None:
            raise ValueError("not a call: no functions.NAME:INDEX id")
        return ParsedCall(m.group(1), _json_args(args), id=call_id)


class _TailParser(ToolParser):
    """Formats whose calls run from a marker to the end of the output: content before the
    marker streams; the calls are parsed once the output is complete (all or nothing: if
    they do not parse, the whole tail is content)."""

    MARKER: ClassVar[str]

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self.buf = ""
        self.in_calls = False

    def _start(self) -> int | None:
        """Where the calls start in ``buf``; None while undecided; -1 for never."""
        raise NotImplementedError

    def feed(self, text: str) -> Parsed:
        self.buf += text
        if self.in_calls:
            return Parsed()
        start = self._start()
        if start is None:
            return Parsed()
        if start < 0:
            keep = _held_prefix(self.buf, self.MARKER)
            ready, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
            return Parsed(ready)
        ready, self.buf = self.buf[:start], self.buf[start:]
        self.in_calls = True
        return Parsed(ready)

    def _calls(self, tail: str) -> list[ParsedCall]:
        raise NotImplementedError

    def finish(self) -> Parsed:
        buf, self.buf = self.buf, ""
        if not self.in_calls:
            return Parsed(buf)
        try:
            calls = self._calls(buf)
        except ValueError:
            return Parsed(buf)
        if not calls:
            return Parsed(buf)
        return Parsed("", calls)


def _json_values(text: str, sep: str) -> list[Any]:
    """JSON values one after another, separated by ``sep`` and/or whitespace."""
    dec = json.JSONDecoder(parse_constant=_refuse_constant)
    values = []
    i = 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == sep):
            i += 1
        if i >= len(text):
            return values
        value, i = dec.raw_decode(text, i)
        values.append(value)


class _WholeOutputParser(_TailParser):
    """Formats whose whole output is either calls or content, told by how it starts (after
    whitespace): calls start with one of ``OPENERS``. Content streams once that is decided."""

    OPENERS: ClassVar[tuple[str, ...]]

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self.content_only = False

    def feed(self, text: str) -> Parsed:
        if self.content_only:
            return Parsed(text)
        self.buf += text
        if self.in_calls:
            return Parsed()
        s = self.buf.lstrip()
        if s.startswith(self.OPENERS):
            self.in_calls = True
            return Parsed()
        if not s or any(o.startswith(s) for o in self.OPENERS):
            return Parsed()  # undecided
        self.content_only = True
        buf, self.buf = self.buf, ""
        return Parsed(buf)


class Llama3JsonToolParser(_WholeOutputParser):
    name = "llama3_json"
    MARKER = "<|python_tag|>"
    OPENERS = ("{", MARKER)

    def _calls(self, tail: str) -> list[ParsedCall]:
        s = tail.strip()
        if s.startswith(self.MARKER):
            s = s[len(self.MARKER) :]
        return [call_from_json(v) for v in _json_values(s, ";")]


class MistralToolParser(_TailParser):
    name = "mistral"
    short_ids = True
    needs_special_tokens = True
    MARKER = "[TOOL_CALLS]"
    ARGS = "[ARGS]"

    def _start(self) -> int | None:
        i = self.buf.find(self.MARKER)
        return i if i >= 0 else -1

    def _calls(self, tail: str) -> list[ParsedCall]:
        parts = [p.strip() for p in tail.split(self.MARKER)[1:]]
        if len(parts) == 1 and parts[0][:1] in ("[", "{"):
            values = _json_values(parts[0], ",")
            if len(values) == 1 and isinstance(values[0], list):
                values = values[0]
            return [call_from_json(v) for v in values]
        calls = []
        for p in parts:  # name[ARGS]{...}
            name, sep, args = p.partition(self.ARGS)
            if not sep:
                raise ValueError("no [ARGS]")
            obj = strict_json(args)
            calls.append(call_from_json({"name": name.strip(), "arguments": obj}))
        return calls


class _JsonNames(ast.NodeTransformer):
    """``null``, ``true`` and ``false`` as the constants they name: models trained on JSON
    write them in Python calls too, and vLLM reads them so."""

    NAMES: ClassVar[dict[str, Any]] = {"null": None, "true": True, "false": False}

    def visit_Name(self, node: ast.Name) -> ast.expr:
        return ast.Constant(self.NAMES[node.id]) if node.id in self.NAMES else node


def _pythonic_calls(text: str) -> list[ParsedCall]:
    """``[f(a=1, b="x"), g()]`` as calls (``ValueError`` if it is not such a list): only a
    list of calls of plain names with keyword arguments whose values are literals, read by
    ``ast`` (never run). An empty list is no calls."""
    try:
        with warnings.catch_warnings():  # "\d" in a string: Python warns, the model meant it
            warnings.simplefilter("ignore")
            tree = ast.parse(text.strip(), mode="eval").body
            if not isinstance(tree, ast.List):
                raise ValueError("not calls: not a list")
            calls = []
            for call in tree.elts:
                if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
                    raise ValueError("not a call: not NAME(...)")
                if call.args or any(k.arg is None for k in call.keywords):
                    raise ValueError("not a call: arguments without names")
                args = {k.arg: ast.literal_eval(_JsonNames().visit(k.value)) for k in call.keywords}
                # a value JSON cannot hold (a set, bytes, an infinity) raises: not a call
                arguments = json.dumps(args, ensure_ascii=False, allow_nan=False)
                calls.append(ParsedCall(call.func.id, arguments))
            return calls
    except (SyntaxError, TypeError, RecursionError, MemoryError) as e:
        raise ValueError(f"not calls: {e}") from e


class PythonicToolParser(_WholeOutputParser):
    """``[get_weather(city="Paris", days=3), get_time()]``: the whole output is the calls (an
    empty list, or a list that does not parse as ``_pythonic_calls``, is content)."""

    name = "pythonic"
    OPENERS = ("[",)

    def _calls(self, tail: str) -> list[ParsedCall]:
        return _pythonic_calls(tail)


class Llama4PythonicToolParser(PythonicToolParser):
    """Llama 4's: the list may be written between ``<|python_start|>`` and ``<|python_end|>``.
    They are special tokens of its tokenizer, which, as in vLLM, the decode drops: read here
    where a tokenizer makes them text."""

    name = "llama4_pythonic"
    START = "<|python_start|>"
    OPENERS = ("[", START)

    def _calls(self, tail: str) -> list[ParsedCall]:
        s = tail.strip()
        if s.startswith(self.START):
            s = s[len(self.START) :].replace("<|python_end|>", "")
        return _pythonic_calls(s)


class Lfm2ToolParser(_TaggedCallParser):
    """LFM2's ``<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>`` (special
    tokens of its tokenizer), any number among the content; the list is ``_pythonic_calls``.
    LFM2 often repeats a call's list after it, closed by a second ``<|tool_call_end|>``: as vLLM,
    that echo (after a call, text from ``[`` to an end marker no start marker opened, or that
    lone end marker) is dropped."""

    name = "lfm2"
    START = "<|tool_call_start|>"
    END = "<|tool_call_end|>"
    needs_special_tokens = True

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self.echo = False  # a call was just read: what follows may be its echo

    def _calls(self, body: str) -> list[ParsedCall]:
        return _pythonic_calls(body)

    def _close(self, body: str, closed: bool) -> Parsed:
        out = super()._close(body, closed)
        self.echo = bool(out.calls)
        return out

    def _skipped(self) -> int | None:
        s = self.buf.lstrip()
        if not self.echo or not s:
            return 0
        if len(s) < len(self.END) and self.END.startswith(s):
            return None  # perhaps a lone end marker
        start, end = self.buf.find(self.START), self.buf.find(self.END)
        if not s.startswith(("[", self.END)) or (0 <= start and (end < 0 or start < end)):
            self.echo = False  # text, or a new call first: content
            return 0
        return None if end < 0 else end + len(self.END)


class OpenAIToolParser(ToolParser):
    """gpt-oss's calls (``harmony.HarmonyReader`` reads them): the text it would be fed is
    already the answer's content."""

    name = "openai"
    harmony = True
    needs_special_tokens = True

    def feed(self, text: str) -> Parsed:
        return Parsed(text)

    def finish(self) -> Parsed:
        return Parsed()


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p
    for p in (
        HermesToolParser,
        NemotronJsonToolParser,
        Llama3JsonToolParser,
        MistralToolParser,
        PythonicToolParser,
        Llama4PythonicToolParser,
        Lfm2ToolParser,
        Glm45ToolParser,
        Glm47ToolParser,
        Qwen3CoderToolParser,
        Qwen3XmlToolParser,
        DeepSeekV3ToolParser,
        DeepSeekV31ToolParser,
        KimiK2ToolParser,
        MiniMaxM2ToolParser,
        OpenAIToolParser,
    )
}
