"""MiniMax-M2's output format through the real ``openai`` client over loopback HTTP
(``--reasoning-parser minimax_m2 --tool-call-parser minimax_m2``, as vLLM serves MiniMax-M2),
on the scripted model (``scripted_model``: it says what its prompt scripts, token for token)
with MiniMax's tags as tokens of their own and a MiniMax-style chat template, whose generation
prompt opens the thinking block.

The properties: the output up to ``</think>`` is the reasoning, what follows it the content,
and ``<minimax:tool_call><invoke name="…"><parameter name="…">…</parameter></invoke>`` a
tool call typed by the request's schema, finish reason ``tool_calls``; streamed deltas add up
to the whole answer, logprob bits included; ``minimax_m2_append_think`` keeps the thinking in
the content after the ``<think>`` the template opened; a deterministic request's answer
repeats bit for bit. DeepSeek-V3's and Kimi K2's call sections (special tokens) are read by
their parsers on the same model, and Kimi K2 Thinking's reasoning ends at its call section.
Negative control: without the parsers the output is one flat content string.
"""

# ruff: noqa: F811  (pytest fixtures imported from server_fixtures)

from __future__ import annotations

import json
import struct

import pytest
from server_fixtures import SERVED_NAME
from test_server_glm import (
    chat,
    collect_stream,
    deterministic_call,
    openai_client,
    scripted,
    scripted_fixtures,
    scripted_server,
)

DS_CALLS, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
KIMI_CALLS, KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARGS, KIMI_CALL_END = (
    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
)  # fmt: skip
MARKERS = [
    "]~b]", "<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>",
    DS_CALLS, DS_END, DS_CALL, DS_SEP, DS_CALL_END,
    KIMI_CALLS, KIMI_END, KIMI_CALL, KIMI_ARGS, KIMI_CALL_END,
]  # fmt: skip
STOPS = ["[e~["]
# MiniMax-M2's template, reduced to what the tests read: each message after its role tag, the
# answer's thinking block opened by the generation prompt.
TEMPLATE = (
    "{% for m in messages %}]~b]{{ m['role'] }}\n{{ m['content'] }}[e~[\n{% endfor %}"
    "{% if add_generation_prompt %}]~b]ai\n<think>\n{% endif %}"
)
THINK = "A booking."
# (the scripted model says at most 128 tokens; the tests' tokenizer spells tags letter by letter)
CALL = (
    '<minimax:tool_call><invoke name="book"><parameter name="code">007</parameter>'
    '<parameter name="vip">yes</parameter></invoke></minimax:tool_call>'
)
SAYS = f"{THINK}</think>\nOK.\n{CALL}[e~["
ARGS = {"code": "007", "vip": True}
BOOK = {
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string"},
                "vip": {"type": "boolean"},
            },
        },
    },
}


model_dir, tok, server = scripted_fixtures(
    "minimax", MARKERS, STOPS, TEMPLATE,
    "--reasoning-parser", "minimax_m2",
    "--enable-auto-tool-choice", "--tool-call-parser", "minimax_m2",
)  # fmt: skip


def test_reasoning_content_and_a_typed_call(server, tok) -> None:
    client = openai_client(server)
    r = chat(client, server, tok, SAYS, tools=[BOOK], logprobs=True)
    ch = r.choices[0]
    assert ch.message.model_extra["reasoning"] == THINK
    assert ch.message.content == "\nOK.\n"
    (call,) = ch.message.tool_calls
    assert call.function.name == "book" and json.loads(call.function.arguments) == ARGS
    assert ch.finish_reason == "tool_calls"
    extra = {"chat_template_kwargs": {}, "return_token_ids": True}
    stream = client.chat.completions.create(
        model=SERVED_NAME,
        messages=scripted(server, tok, SAYS),
        temperature=0.0,
        max_tokens=120,
        tools=[BOOK],
        logprobs=True,
        stream=True,
        extra_body=extra,
    )
    reasoning, content, name, args, finish, lps = collect_stream(stream)
    assert (reasoning, content, name, finish) == (THINK, "\nOK.\n", "book", "tool_calls")
    assert json.loads(args) == ARGS
    assert lps == [struct.pack("<f", e.logprob) for e in ch.logprobs.content]


def test_a_deterministic_call_repeats_bit_for_bit(server, tok) -> None:
    client = openai_client(server)
    once = deterministic_call(client, server, tok, SAYS, [BOOK])
    assert once == deterministic_call(client, server, tok, SAYS, [BOOK])


def test_append_think_keeps_the_thinking_in_the_content(tmp_path_factory, model_dir, tok):
    s = scripted_server(
        tmp_path_factory, model_dir, "minimax-append",
        "--reasoning-parser", "minimax_m2_append_think",
        "--enable-auto-tool-choice", "--tool-call-parser", "minimax_m2",
    )  # fmt: skip
    try:
        ch = chat(openai_client(s), s, tok, SAYS, tools=[BOOK]).choices[0]
        assert ch.message.content == f"<think>{THINK}</think>\nOK.\n"
        assert not ch.message.model_extra.get("reasoning")
        (call,) = ch.message.tool_calls
        assert json.loads(call.function.arguments) == ARGS
    finally:
        assert s.stop() == 0, s.log()


@pytest.mark.parametrize(
    ("parser", "script", "call_id"),
    [
        (
            "deepseek_v3",
            f"Booking.{DS_CALLS}{DS_CALL}function{DS_SEP}book\n```json\n"
            f'{{"code": "007", "seats": 2}}\n```{DS_CALL_END}{DS_END}[e~[',
            None,
        ),
        (
            "kimi_k2",
            f"Booking.{KIMI_CALLS}{KIMI_CALL}functions.book:0{KIMI_ARGS}"
            f'{{"code": "007", "seats": 2}}{KIMI_CALL_END}{KIMI_END}[e~[',
            "functions.book:0",
        ),
    ],
)
def test_call_sections_of_special_tokens(tmp_path_factory, model_dir, tok, parser, script, call_id):
    """DeepSeek-V3's and Kimi K2's calls, whose markers are special tokens (decoded for the
    parser, never shown), read over HTTP; Kimi's own call id is the one returned."""
    s = scripted_server(
        tmp_path_factory, model_dir, parser, "--enable-auto-tool-choice",
        "--tool-call-parser", parser,
    )  # fmt: skip
    try:
        ch = chat(openai_client(s), s, tok, script, tools=[BOOK]).choices[0]
        assert ch.message.content == "Booking." and ch.finish_reason == "tool_calls"
        (call,) = ch.message.tool_calls
        assert call.function.name == "book"
        assert json.loads(call.function.arguments) == {"code": "007", "seats": 2}
        if call_id is not None:
            assert call.id == call_id
    finally:
        assert s.stop() == 0, s.log()


def test_kimi_k2_reasoning_ends_at_its_tool_call_section(tmp_path_factory, model_dir, tok):
    """Kimi K2 Thinking (``--reasoning-parser kimi_k2 --tool-call-parser kimi_k2``): with no
    ``</think>``, its tool-call section ends the reasoning and is read as the call."""
    s = scripted_server(
        tmp_path_factory, model_dir, "kimi-thinking", "--reasoning-parser", "kimi_k2",
        "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k2",
    )  # fmt: skip
    try:
        script = (
            f"{THINK}{KIMI_CALLS}{KIMI_CALL}functions.book:0{KIMI_ARGS}"
            f'{{"code": "007"}}{KIMI_CALL_END}{KIMI_END}[e~['
        )
        ch = chat(openai_client(s), s, tok, script, tools=[BOOK]).choices[0]
        assert ch.message.model_extra["reasoning"] == THINK
        assert not ch.message.content and ch.finish_reason == "tool_calls"
        (call,) = ch.message.tool_calls
        assert call.id == "functions.book:0"
        assert json.loads(call.function.arguments) == {"code": "007"}
    finally:
        assert s.stop() == 0, s.log()


def test_without_the_parsers_the_output_is_flat_content(tmp_path_factory, model_dir, tok):
    s = scripted_server(tmp_path_factory, model_dir, "minimax-flat")
    try:
        m = chat(openai_client(s), s, tok, SAYS, tools=None).choices[0].message
        assert not m.tool_calls and not m.model_extra.get("reasoning")
        assert THINK in m.content and "<invoke" in m.content
    finally:
        assert s.stop() == 0, s.log()
