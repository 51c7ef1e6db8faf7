"""Tool-call parsers and the per-choice tool reader (pure Python, no server): the
formats, malformed calls returned as content, and streaming (any split of the text) adding up
to exactly the non-streamed answer."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detspec.server import protocol as P
from detspec.server.tool_parsers import (
    PARSERS,
    DeepSeekV3ToolParser,
    Glm45ToolParser,
    HermesToolParser,
    KimiK2ToolParser,
    Lfm2ToolParser,
    Llama3JsonToolParser,
    Llama4PythonicToolParser,
    MiniMaxM2ToolParser,
    MistralToolParser,
    NemotronJsonToolParser,
    Parsed,
    ParsedCall,
    PythonicToolParser,
    Qwen3CoderToolParser,
    ToolParser,
)
from detspec.server.tools import CallIds, ChoiceTools, ToolPlan, plan_tools, required_schema

WEATHER = ParsedCall("get_weather", '{"city": "Paris"}')
# DeepSeek's and Kimi K2's markers (special tokens of their tokenizers)
DS_CALLS, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
KIMI_CALLS, KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARGS, KIMI_CALL_END = (
    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
)  # fmt: skip
# Nemotron Nano 2's markers (special tokens of its tokenizer)
NEM, NEM_END = "<TOOLCALL>", "</TOOLCALL>"
# LFM2's markers (special tokens of its tokenizer)
LFM, LFM_END = "<|tool_call_start|>", "<|tool_call_end|>"
TIME = ParsedCall("get_time", "{}")
# Python literals of every kind a pythonic call's argument may be, and their JSON
LITERALS = (
    "n=-3, x=-2.5, e=1e3, l=[1, 'a'], d={'k': {'z': None}}, b=True, f=False, none=None, "
    "t=(1, 2), s='it\\'s \\\\d', j=[null, true, false]"
)
LITERALS_JSON = (
    '{"n": -3, "x": -2.5, "e": 1000.0, "l": [1, "a"], "d": {"k": {"z": null}}, "b": true, '
    '"f": false, "none": null, "t": [1, 2], "s": "it\'s \\\\d", "j": [null, true, false]}'
)


def chunked(parser: Callable[[], ToolParser], text: str, size: int) -> Parsed:
    p = parser()
    out = Parsed()
    for i in range(0, len(text), size):
        out.extend(p.feed(text[i : i + size]))
    out.extend(p.finish())
    return out


# (parser, output text, content, calls)
CASES = [
    (HermesToolParser, "Hello there", "Hello there", []),
    (
        HermesToolParser,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "",
        [WEATHER],
    ),
    (
        HermesToolParser,
        'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n',
        "Let me check.\n",
        [WEATHER, ParsedCall("get_time", "{}")],
    ),
    # an unclosed last call is read to the end (the model stopped on EOS)
    (
        HermesToolParser,
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}',
        "",
        [WEATHER],
    ),
    # arguments given as JSON text are kept
    (
        HermesToolParser,
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
        "",
        [ParsedCall("f", '{"a": 1}')],
    ),
    # malformed JSON inside a call: content, not a crash; the good call still counts
    (
        HermesToolParser,
        '<tool_call>{"name": "f", "arguments": {</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {</tool_call>',
        [WEATHER],
    ),
    (HermesToolParser, "<tool_call>not json", "<tool_call>not json", []),
    (HermesToolParser, '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}'
     "</tool_call>", []),  # fmt: skip
    (HermesToolParser, "a <tool_ca", "a <tool_ca", []),
    # text after a call keeps its trailing whitespace, however the stream is cut
    (HermesToolParser, '<tool_call>{"name": "get_time"}</tool_call>\nDone. ', "\nDone. ", [TIME]),
    # NaN is Python's, not JSON: a call holding it would give clients unparseable arguments
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', []),
    (Llama3JsonToolParser, "The weather is fine.", "The weather is fine.", []),
    (
        Llama3JsonToolParser,
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [WEATHER],
    ),
    (
        Llama3JsonToolParser,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "arguments": {}}',
        "",
        [WEATHER, ParsedCall("get_time", "{}")],
    ),
    (Llama3JsonToolParser, '  {"name": "get_weather", "parameters": {"city": "Par',
     '  {"name": "get_weather", "parameters": {"city": "Par', []),  # fmt: skip
    (Llama3JsonToolParser, '{"city": "Paris"}', '{"city": "Paris"}', []),
    (MistralToolParser, "No tools needed.", "No tools needed.", []),
    (
        MistralToolParser,
        'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}}]',
        "Sure. ",
        [WEATHER, ParsedCall("get_time", "{}")],
    ),
    (
        MistralToolParser,
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
        "",
        [WEATHER, ParsedCall("get_time", "{}")],
    ),
    (MistralToolParser, "[TOOL_CALLS] [{\"name\": ", "[TOOL_CALLS] [{\"name\": ", []),
    (Glm45ToolParser, "No tools needed.", "No tools needed.", []),
    (
        Glm45ToolParser,
        "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Paris</arg_value>\n</tool_call>",
        "Let me check.\n",
        [WEATHER],
    ),
    # GLM-4.7: no newline after the name; two calls; a call without arguments; without the
    # tools' schemas, values are JSON where they parse
    (
        Glm45ToolParser,
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>\"Paris\"</arg_value>"
        "</tool_call>\n<tool_call>get_time</tool_call>"
        "<tool_call>f<arg_key>n</arg_key><arg_value>3</arg_value><arg_key>x</arg_key>"
        "<arg_value>[1, {\"a\": null}]</arg_value><arg_key>s</arg_key><arg_value>hi there"
        "</arg_value></tool_call>",
        "",
        [WEATHER, ParsedCall("get_time", "{}"),
         ParsedCall("f", '{"n": 3, "x": [1, {"a": null}], "s": "hi there"}')],
    ),
    # an unclosed last call is read to the end
    (
        Glm45ToolParser,
        "<tool_call>get_weather\n<arg_key>city</arg_key><arg_value>Paris</arg_value>",
        "",
        [WEATHER],
    ),
    # not a call: no name, text between the pairs, an unclosed pair; content, not a crash
    (Glm45ToolParser, "<tool_call><arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
     "<tool_call><arg_key>a</arg_key><arg_value>1</arg_value></tool_call>", []),
    (Glm45ToolParser, "<tool_call>f\n<arg_key>a</arg_key>x<arg_value>1</arg_value></tool_call>",
     "<tool_call>f\n<arg_key>a</arg_key>x<arg_value>1</arg_value></tool_call>", []),
    (Glm45ToolParser, "<tool_call>f\n<arg_key>a</arg_key><arg_value>1", "<tool_call>f\n"
     "<arg_key>a</arg_key><arg_value>1", []),
    (Glm45ToolParser, "<tool_call>two words</tool_call>", "<tool_call>two words</tool_call>",
     []),
    # Qwen3-Coder: one newline off each side of a value; without schemas every value is text
    (
        Qwen3CoderToolParser,
        "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n</function>\n</tool_call>",
        "Checking.\n",
        [WEATHER],
    ),
    (
        Qwen3CoderToolParser,
        "<tool_call><function=f><parameter=n>3</parameter><parameter=code>\n\n  x = 1\n\n"
        "</parameter><parameter=none>null</parameter></function><function=get_time></function>"
        "</tool_call>",
        "",
        [ParsedCall("f", '{"n": "3", "code": "\\n  x = 1\\n", "none": null}'),
         ParsedCall("get_time", "{}")],
    ),
    (Qwen3CoderToolParser, "<tool_call>\n<function=f>\n<parameter=a>1</parameter>",
     "<tool_call>\n<function=f>\n<parameter=a>1</parameter>", []),  # unclosed function
    (Qwen3CoderToolParser, "<tool_call><function=f>text<parameter=a>1</parameter></function>"
     "</tool_call>", "<tool_call><function=f>text<parameter=a>1</parameter></function>"
     "</tool_call>", []),
    (Qwen3CoderToolParser, "<tool_call>{\"name\": \"f\"}</tool_call>",
     "<tool_call>{\"name\": \"f\"}</tool_call>", []),
    # DeepSeek-V3: the type, the name, fenced JSON; two calls; then V3.1's bare form
    (
        DeepSeekV3ToolParser,
        f"Let me check.{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n"
        f'{{"city": "Paris"}}\n```{DS_CALL_END}\n{DS_CALL}function{DS_SEP}get_time\n'
        f"```json\n{{}}\n```{DS_CALL_END}{DS_END}",
        "Let me check.",
        [WEATHER, ParsedCall("get_time", "{}")],
    ),
    (
        DeepSeekV3ToolParser,
        f'{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{"city": "Paris"}}{DS_CALL_END}{DS_END}',
        "",
        [WEATHER],
    ),
    # the model stopped before closing the section (or the call)
    (DeepSeekV3ToolParser, f'{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{"city": "Paris"}}', "",
     [WEATHER]),
    # not calls: text in the section, arguments not an object, no separator
    (DeepSeekV3ToolParser, f'{DS_CALLS}hm{DS_CALL}f{DS_SEP}{{}}{DS_CALL_END}{DS_END}',
     f'{DS_CALLS}hm{DS_CALL}f{DS_SEP}{{}}{DS_CALL_END}{DS_END}', []),
    (DeepSeekV3ToolParser, f"{DS_CALLS}{DS_CALL}f{DS_SEP}[1]{DS_CALL_END}{DS_END}",
     f"{DS_CALLS}{DS_CALL}f{DS_SEP}[1]{DS_CALL_END}{DS_END}", []),
    (DeepSeekV3ToolParser, f"{DS_CALLS}{DS_CALL}f {{}}{DS_CALL_END}{DS_END}",
     f"{DS_CALLS}{DS_CALL}f {{}}{DS_CALL_END}{DS_END}", []),
    # Kimi K2: the model's ids are kept
    (
        KimiK2ToolParser,
        f"Sure.{KIMI_CALLS}{KIMI_CALL}functions.get_weather:0{KIMI_ARGS}"
        f'{{"city": "Paris"}}{KIMI_CALL_END}{KIMI_CALL}functions.get_time:1{KIMI_ARGS}{{}}'
        f"{KIMI_CALL_END}{KIMI_END}",
        "Sure.",
        [ParsedCall("get_weather", '{"city": "Paris"}', id="functions.get_weather:0"),
         ParsedCall("get_time", "{}", id="functions.get_time:1")],
    ),
    (KimiK2ToolParser, f"{KIMI_CALLS}{KIMI_CALL}get_weather{KIMI_ARGS}{{}}{KIMI_CALL_END}"
     f"{KIMI_END}", f"{KIMI_CALLS}{KIMI_CALL}get_weather{KIMI_ARGS}{{}}{KIMI_CALL_END}"
     f"{KIMI_END}", []),  # no index in the id
    # MiniMax-M2: invokes in one block, names quoted or not, values stripped; without
    # schemas every value is text
    (
        MiniMaxM2ToolParser,
        'Checking.\n<minimax:tool_call>\n<invoke name="get_weather">\n'
        '<parameter name="city">\nParis\n</parameter>\n</invoke>\n<invoke name=get_time>'
        "</invoke>\n</minimax:tool_call>",
        "Checking.\n",
        [WEATHER, ParsedCall("get_time", "{}")],
    ),
    (MiniMaxM2ToolParser, '<minimax:tool_call><invoke name="f"><parameter name=\'n\'> 3 '
     "</parameter><parameter name=\"x\">nil</parameter></invoke>",
     "", [ParsedCall("f", '{"n": "3", "x": null}')]),  # unclosed block: read to the end
    # not calls: text between invokes, no invoke, an unclosed invoke, a name with a space
    (MiniMaxM2ToolParser, '<minimax:tool_call>hm<invoke name="f"></invoke></minimax:tool_call>',
     '<minimax:tool_call>hm<invoke name="f"></invoke></minimax:tool_call>', []),
    (MiniMaxM2ToolParser, "<minimax:tool_call>\n</minimax:tool_call>",
     "<minimax:tool_call>\n</minimax:tool_call>", []),
    (MiniMaxM2ToolParser, '<minimax:tool_call><invoke name="f"><parameter name="a">1',
     '<minimax:tool_call><invoke name="f"><parameter name="a">1', []),
    (MiniMaxM2ToolParser, '<minimax:tool_call><invoke name="a b"></invoke></minimax:tool_call>',
     '<minimax:tool_call><invoke name="a b"></invoke></minimax:tool_call>', []),
    # pythonic: the whole output is a list of calls, keyword arguments of literal values
    (PythonicToolParser, "Sunny in Paris.", "Sunny in Paris.", []),
    (PythonicToolParser, '[get_weather(city="Paris")]', "", [WEATHER]),
    (PythonicToolParser, '  [get_weather(city="Paris"), get_time()]\n', "", [WEATHER, TIME]),
    (PythonicToolParser, f"[f({LITERALS})]", "", [ParsedCall("f", LITERALS_JSON)]),
    # an invalid escape Python warns of is the backslash the model wrote
    (PythonicToolParser, '[f(path="C:\\docs")]', "", [ParsedCall("f", '{"path": "C:\\\\docs"}')]),
    # not calls: content, as it is -- unclosed, positional or ** arguments, a call or a name
    # as a value, a dotted name, text after the list, no call, not a call, a set, infinity,
    # text before the list
    *[(PythonicToolParser, t, t, []) for t in (
        '[get_weather(city="Paris")', '[get_weather("Paris")]', "[f(**kw)]", "[f(a=g())]",
        "[f(a=x)]", '[os.system(cmd="ls")]', "[get_time()] Done.", "[]", "[1, 2]",
        "[f(a={1, 2})]", "[f(a=1e999)]", "Calling: [get_time()]", "[get_time(), 'x']",
    )],
    # Llama 4's: the list between <|python_start|> and <|python_end|>, or bare
    (Llama4PythonicToolParser, '<|python_start|>[get_weather(city="Paris"), get_time()]'
     "<|python_end|>", "", [WEATHER, TIME]),
    (Llama4PythonicToolParser, "[get_time()]", "", [TIME]),
    (Llama4PythonicToolParser, '<|python_start|>print("x")<|python_end|>',
     '<|python_start|>print("x")<|python_end|>', []),
    (Llama4PythonicToolParser, "Hello", "Hello", []),
    # LFM2: pythonic lists between its markers, among the content (vLLM's example first)
    (Lfm2ToolParser, f'{LFM}[get_weather(city="Paris")]{LFM_END}The weather in Paris is sunny.',
     "The weather in Paris is sunny.", [WEATHER]),
    (Lfm2ToolParser, f'Let me check.\n{LFM}[get_weather(city="Paris"), get_time()]{LFM_END}\n'
     f"{LFM}[f({LITERALS})]{LFM_END}\nDone.", "Let me check.\n\nDone.",
     [WEATHER, TIME, ParsedCall("f", LITERALS_JSON)]),
    (Lfm2ToolParser, "No tools needed.", "No tools needed.", []),
    (Lfm2ToolParser, f'OK. {LFM}[get_weather(city="Paris")]', "OK. ", [WEATHER]),  # unclosed
    # LFM2's echo of its call after it, closed by a second end marker (or a lone end marker),
    # is dropped; a bracket not closed so is content
    (Lfm2ToolParser, f'{LFM}[get_weather(city="Paris")]{LFM_END} [get_weather(city="Paris")]'
     f"{LFM_END}Sunny.", "Sunny.", [WEATHER]),
    (Lfm2ToolParser, f"{LFM}[get_time()]{LFM_END}\n{LFM_END}", "", [TIME]),
    (Lfm2ToolParser, f"{LFM}[get_time()]{LFM_END}\n[1] A footnote.", "\n[1] A footnote.",
     [TIME]),
    (Lfm2ToolParser, f"{LFM}[get_time()]{LFM_END}[1]{LFM}[get_time()]{LFM_END}", "[1]",
     [TIME, TIME]),
    # not calls: content, markers and all; the good call still counts
    (Lfm2ToolParser, f'{LFM}get_weather(city="Paris"){LFM_END} then',
     f'{LFM}get_weather(city="Paris"){LFM_END} then', []),
    (Lfm2ToolParser, f'{LFM}[f("x")]{LFM_END}{LFM}[get_weather(city="Paris")]{LFM_END}',
     f'{LFM}[f("x")]{LFM_END}', [WEATHER]),
    (Lfm2ToolParser, f"{LFM}[f(a=open())]", f"{LFM}[f(a=open())]", []),
    (Lfm2ToolParser, "a <|tool_call", "a <|tool_call", []),
    # Nemotron Nano 2: a list of calls a block, any number of blocks
    (NemotronJsonToolParser,
     f'Let me check.{NEM}[{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}, '
     f'{{"name": "get_time", "arguments": {{}}}}]{NEM_END}', "Let me check.", [WEATHER, TIME]),
    (NemotronJsonToolParser,
     f'{NEM}{{"name": "get_time", "arguments": {{}}}}{NEM_END}\n'
     f'{NEM}[{{"name": "get_weather", "arguments": "{{\\"city\\": \\"Paris\\"}}"}}]{NEM_END}',
     "", [TIME, ParsedCall("get_weather", '{"city": "Paris"}')]),
    (NemotronJsonToolParser, "No tools needed.", "No tools needed.", []),
    (NemotronJsonToolParser, f'OK. {NEM}[{{"name": "get_time"}}]', "OK. ", [TIME]),  # unclosed
    # not calls: content, markers and all
    (NemotronJsonToolParser, f"{NEM}[]{NEM_END} then", f"{NEM}[]{NEM_END} then", []),
    (NemotronJsonToolParser, f'{NEM}[{{"name": "f", "arguments": [1]}}]{NEM_END}',
     f'{NEM}[{{"name": "f", "arguments": [1]}}]{NEM_END}', []),
    (NemotronJsonToolParser, "a <TOOL", "a <TOOL", []),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_parse(parser, text, content, calls) -> None:
    got = parser.parse(text)
    assert got.content == content
    assert got.calls == calls
    for size in (1, 2, 5, 13):  # any split of the stream adds up to the same answer
        assert chunked(parser, text, size) == got, size


def test_hermes_streams_content_before_the_call_is_complete() -> None:
    p = HermesToolParser()
    assert p.feed("Checking <tool").content == "Checking "
    assert p.feed('_call>{"name": "get_weather", ').content == ""
    out = p.feed('"arguments": {"city": "Paris"}}</tool_call>')
    assert out.calls == [WEATHER] and out.content == ""
    assert p.finish() == Parsed()


PYTHONIC_PIECES = [
    LFM, LFM_END, "<|python_start|>", "<|python_end|>", "<|tool", f"{LFM}[get_time()]{LFM_END}",
    '[get_weather(city="Paris")]', "[", "]", "get_weather(", 'city="Paris"', "n=-1", ")",
    ", ", "get_time()", " ", "\n", "Sunny.", "'", "null",
]  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(
    parser=st.sampled_from([PythonicToolParser, Llama4PythonicToolParser, Lfm2ToolParser]),
    pieces=st.lists(st.sampled_from(PYTHONIC_PIECES), max_size=14),
    cuts=st.lists(st.integers(0, 160), max_size=8),
)
def test_any_split_of_pythonic_output_adds_up_to_the_whole(parser, pieces, cuts) -> None:
    """The pythonic formats' streams (any split into deltas, markers cut anywhere) add up to
    exactly the non-streamed answer."""
    text = "".join(pieces)
    p, out = parser(), Parsed()
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    for a, b in zip(bounds, bounds[1:], strict=False):
        out.extend(p.feed(text[a:b]))
    out.extend(p.finish())
    assert out == parser.parse(text)


def test_lfm2_streams_content_and_each_call_as_it_closes() -> None:
    p = Lfm2ToolParser()
    assert p.feed("Checking <|tool_ca").content == "Checking "
    assert p.feed('ll_start|>[get_weather(city="Paris")').content == ""
    assert p.feed(f"]{LFM_END}") == Parsed("", [WEATHER])
    assert p.feed(" [get_weather(") == Parsed()  # perhaps its echo: held
    assert p.feed(f'city="Paris")]{LFM_END}Sunny') == Parsed("Sunny")
    assert p.finish() == Parsed()
    # the pythonic formats and LFM2 are vLLM's names; LFM2's markers are special tokens
    assert PARSERS["pythonic"] is PythonicToolParser and PARSERS["lfm2"] is Lfm2ToolParser
    assert PARSERS["llama4_pythonic"] is Llama4PythonicToolParser
    assert Lfm2ToolParser.needs_special_tokens and not PythonicToolParser.needs_special_tokens


def test_glm45_reads_values_by_the_tools_schemas() -> None:
    """A value is the argument's text where the tool's schema types it ``string`` (``007``,
    ``true``, ``{x}`` stay text), else JSON where it parses; vLLM's reading of GLM's calls."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "book",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "code": {"type": "string"},
                        "flag": {"type": "string"},
                        "note": {"type": "string"},
                        "seats": {"type": "integer"},
                        "vip": {"type": "boolean"},
                    },
                },
            },
        }
    ]
    text = (
        "<tool_call>book\n<arg_key>code</arg_key>\n<arg_value>007</arg_value>\n"
        "<arg_key>flag</arg_key>\n<arg_value>true</arg_value>\n<arg_key>note</arg_key>\n"
        "<arg_value>{x}</arg_value>\n<arg_key>seats</arg_key>\n<arg_value>2</arg_value>\n"
        "<arg_key>vip</arg_key>\n<arg_value>false</arg_value>\n</tool_call>"
    )
    want = ParsedCall(
        "book", '{"code": "007", "flag": "true", "note": "{x}", "seats": 2, "vip": false}'
    )
    assert Glm45ToolParser.parse(text, tools).calls == [want]
    for size in (1, 3, 7):
        p = Glm45ToolParser(tools)
        out = Parsed()
        for i in range(0, len(text), size):
            out.extend(p.feed(text[i : i + size]))
        out.extend(p.finish())
        assert out.calls == [want], size
    # Without the schemas the same text reads 007 as text (not JSON) and true as a boolean.
    assert Glm45ToolParser.parse(text).calls[0].arguments == (
        '{"code": "007", "flag": true, "note": "{x}", "seats": 2, "vip": false}'
    )
    # GLM-4.7's name for the same format, both keeping the special tokens they are made of.
    assert PARSERS["glm47"].parse(text, tools).calls == [want]
    assert PARSERS["glm45"].needs_special_tokens and PARSERS["glm47"].needs_special_tokens


def test_qwen3_coder_types_values_by_the_tools_schemas() -> None:
    """vLLM's reading of Qwen3-Coder's parameters: text for string types (``007``), integers
    and numbers where they parse (an integral number as an integer), a boolean by ``true``,
    JSON for objects and arrays, the text itself where a value does not parse (and never
    NaN, which is not JSON), null for ``null``."""
    props = {
        "code": {"type": "string"},
        "seats": {"type": "integer"},
        "price": {"type": "number"},
        "whole": {"type": "number"},
        "vip": {"type": "boolean"},
        "tags": {"type": "array"},
        "meta": {"type": ["object", "null"]},
        "bad": {"type": "integer"},
        "nan": {"type": "number"},
        "gone": {"type": "string"},
    }
    tools = [{"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": props}}}]  # fmt: skip
    values = {
        "code": "007", "seats": "2", "price": "9.5", "whole": "3.0", "vip": "True",
        "tags": '["a", 1]', "meta": '{"k": [1]}', "bad": "two", "nan": "NaN", "gone": "null",
    }  # fmt: skip
    text = (
        "<tool_call>\n<function=book>\n"
        + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
        + "</function>\n</tool_call>"
    )
    want = {
        "code": "007", "seats": 2, "price": 9.5, "whole": 3, "vip": True, "tags": ["a", 1],
        "meta": {"k": [1]}, "bad": "two", "nan": "NaN", "gone": None,
    }  # fmt: skip
    (call,) = Qwen3CoderToolParser.parse(text, tools).calls
    assert call.name == "book" and json.loads(call.arguments) == want
    assert PARSERS["qwen3_xml"].parse(text, tools).calls == [call]
    for size in (1, 4, 9):
        assert chunked(lambda: Qwen3CoderToolParser(tools), text, size).calls == [call]


def test_minimax_m2_types_values_by_the_tools_schemas() -> None:
    """vLLM's reading of MiniMax-M2's parameters: ``null``/``none``/``nil`` are null; else the
    first of integer, number, boolean (``yes``/``on``/``1`` too), object, array that the
    schema allows (its ``anyOf`` choices and ``enum`` values' types included) and the text
    parses as; text where it allows a string, or names no such parameter; else JSON where it
    parses (never NaN, which is not JSON), else the text."""
    props = {
        "code": {"type": "string"},
        "seats": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "price": {"type": "number"},
        "whole": {"type": "number"},
        "vip": {"type": "boolean"},
        "level": {"enum": [1, 2, 3]},
        "meta": {"type": ["object", "string"]},
        "note": {"type": ["object", "string"]},
        "bad": {"type": "integer"},
        "nan": {"type": "number"},
        "gone": {"type": "string"},
    }
    tools = [{"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": props}}}]  # fmt: skip
    values = {
        "code": "007", "seats": "2", "price": "9.5", "whole": "3.0", "vip": "yes", "level": "2",
        "meta": '{"k": [1]}', "note": "{x}", "bad": "two", "nan": "NaN", "gone": "None",
        "extra": "5",
    }  # fmt: skip
    text = (
        '<minimax:tool_call>\n<invoke name="book">\n'
        + "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in values.items())
        + "</invoke>\n</minimax:tool_call>"
    )
    want = {
        "code": "007", "seats": 2, "price": 9.5, "whole": 3, "vip": True, "level": 2,
        "meta": {"k": [1]}, "note": "{x}", "bad": "two", "nan": "NaN", "gone": None,
        "extra": "5",
    }  # fmt: skip
    (call,) = MiniMaxM2ToolParser.parse(text, tools).calls
    assert call.name == "book" and json.loads(call.arguments) == want
    for size in (1, 4, 9):
        assert chunked(lambda: MiniMaxM2ToolParser(tools), text, size).calls == [call]
    assert PARSERS["minimax_m2"].needs_special_tokens


def tool(name: str, params: dict | None = None) -> P.ChatTool:
    return P.ChatTool.model_validate(
        {"type": "function", "function": {"name": name, "parameters": params}}
    )


def reader(plan: ToolPlan, deterministic: bool = True) -> ChoiceTools:
    return ChoiceTools(plan, CallIds(deterministic, 7, [1, 2, 3]), 0)


def test_named_streams_arguments_and_finishes_stop() -> None:
    plan = ToolPlan("named", named="get_weather")
    t = reader(plan)
    content, deltas = t.feed('{"city": ')
    assert content == "" and deltas[0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": ',
    }
    assert deltas[0]["id"].startswith("call_") and deltas[0]["type"] == "function"
    _, deltas = t.feed('"Paris"}')
    assert deltas == [{"index": 0, "function": {"arguments": '"Paris"}'}}]
    assert t.finish("stop")[2] == "stop"  # as OpenAI and vLLM for a named function
    msg = t.message()
    assert msg["content"] is None
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'


def test_required_parses_the_array_and_finishes_tool_calls() -> None:
    t = reader(ToolPlan("required"))
    assert t.feed('[{"name": "get_weather", "parameters": {"city": "Paris"}}]') == ("", [])
    content, deltas, finish = t.finish("stop")
    assert finish == "tool_calls" and content == ""
    assert [d["function"] for d in deltas] == [
        {"name": "get_weather", "arguments": WEATHER.arguments}
    ]
    # cut short by max_tokens: the text stays content, the finish reason too
    t = reader(ToolPlan("required"))
    t.feed('[{"name": "get_wea')
    assert t.finish("length") == ('[{"name": "get_wea', [], "length")
    assert t.message() == {"role": "assistant", "content": '[{"name": "get_wea'}


def test_auto_ids_are_deterministic_and_parallel_false_keeps_one() -> None:
    text = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    plan = ToolPlan("auto", parser=HermesToolParser)
    a, b = reader(plan), reader(plan)
    for t in (a, b):
        t.feed(text)
        assert t.finish("stop")[2] == "tool_calls"
    assert a.message() == b.message() and len(a.calls) == 2
    ids = {c["id"] for c in a.calls}
    assert len(ids) == 2
    c = reader(plan, deterministic=False)
    c.feed(text)
    c.finish("stop")
    assert not ids & {x["id"] for x in c.calls}
    one = reader(ToolPlan("auto", parser=HermesToolParser, parallel=False))
    one.feed(text)
    one.finish("stop")
    assert [x["function"]["name"] for x in one.calls] == ["get_weather"]
    # no call: content, finish reason unchanged
    plain = reader(plan)
    plain.feed("just text")
    assert plain.finish("stop")[2] == "stop"
    assert plain.message() == {"role": "assistant", "content": "just text"}


def test_a_models_own_call_ids_are_kept() -> None:
    """Kimi K2's calls carry ids (``functions.NAME:INDEX``) its template writes back into the
    next prompt: the answer's ``tool_calls`` keep them, deterministic or not."""
    text = (
        f"{KIMI_CALLS}{KIMI_CALL}functions.get_weather:0{KIMI_ARGS}"
        f'{{"city": "Paris"}}{KIMI_CALL_END}{KIMI_END}'
    )
    for deterministic in (True, False):
        t = reader(ToolPlan("auto", parser=KimiK2ToolParser), deterministic)
        t.feed(text)
        assert t.finish("stop")[2] == "tool_calls"
        assert [c["id"] for c in t.calls] == ["functions.get_weather:0"]
    assert PARSERS["deepseek_v31"].needs_special_tokens and KimiK2ToolParser.needs_special_tokens


def test_mistral_ids_are_nine_alphanumerics() -> None:
    assert len(CallIds(True, None, [1], short=True).make(0, 0)) == 9
    assert CallIds(True, None, [1]).make(0, 0) != CallIds(True, None, [2]).make(0, 0)


def test_required_schema_is_vllms() -> None:
    defs = {"$defs": {"C": {"type": "string"}}, "type": "object",
            "properties": {"city": {"$ref": "#/$defs/C"}}}  # fmt: skip
    s = required_schema([tool("get_weather", defs), tool("get_time")], parallel=True)
    assert s["type"] == "array" and s["minItems"] == 1 and "maxItems" not in s
    assert s["$defs"] == {"C": {"type": "string"}}
    names = [v["properties"]["name"]["enum"] for v in s["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert s["items"]["anyOf"][1]["properties"]["parameters"] == {
        "type": "object",
        "properties": {},
    }
    assert required_schema([tool("f")], parallel=False)["maxItems"] == 1


def chat(**kw) -> P.ChatCompletionRequest:
    return P.ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **kw}
    )


def test_plan_tools_modes() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert plan_tools(chat(), None).mode == "none"
    assert plan_tools(chat(tools=tools, tool_choice="none"), None).tools == tools
    assert plan_tools(chat(tools=tools), "hermes").mode == "auto"
    assert plan_tools(chat(tools=[], tool_choice="required"), None).mode == "none"
    named = plan_tools(
        chat(tools=tools, tool_choice={"type": "function", "function": {"name": "f"}}), None
    )
    assert named.mode == "named" and named.constraint is not None
    assert named.constraint.fields == {"json": {"type": "object", "properties": {}}}
    assert named.constraint.http_param("structured_outputs.json") == "tools[0].function.parameters"
