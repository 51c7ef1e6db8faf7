"""Nemotron Nano 2's tool calls through the real ``openai`` client over loopback HTTP
(``--enable-auto-tool-choice --tool-call-parser nemotron_json``, the name NVIDIA's vLLM plugin
registers), on the scripted model (``scripted_model``: it says what its prompt scripts, token
for token) with ``<TOOLCALL>`` and ``</TOOLCALL>`` as special tokens of its tokenizer, as they
are of Nemotron-H's.

The properties: ``<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>`` is read as the
calls, the text before it is the content, the finish reason is ``tool_calls``; a stream's
deltas add up to the same content and calls. Negative control: without the parser the output
is one flat content string, markers dropped.
"""

# ruff: noqa: F811  (pytest fixtures imported from server_fixtures)

from __future__ import annotations

import json

from test_server_glm import (
    calls_streamed_or_not,
    chat,
    openai_client,
    scripted_fixtures,
    scripted_server,
)
from test_server_lfm2_tools import STOPS, TEMPLATE  # the same ChatML-like template

START, END = "<TOOLCALL>", "</TOOLCALL>"
MARKERS = ["<|im_start|>", START, END]
CALLS = [("book", {"code": "007", "seats": -2, "note": None}), ("now", {})]
SAYS = f"On it.{START}{json.dumps([{'name': n, 'arguments': a} for n, a in CALLS])}{END}<|im_end|>"
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("book", "now")
]


model_dir, tok, server = scripted_fixtures(
    "nemotron",
    MARKERS,
    STOPS,
    TEMPLATE,
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "nemotron_json",
)


def test_calls_and_the_content_before_them_streamed_or_not(server, tok) -> None:
    want = ("On it.", "tool_calls", CALLS)
    assert calls_streamed_or_not(server, tok, SAYS, TOOLS) == [want, want]


def test_without_the_parser_the_output_is_flat_content(tmp_path_factory, model_dir, tok):
    s = scripted_server(tmp_path_factory, model_dir, "nemotron-flat")
    try:
        m = chat(openai_client(s), s, tok, SAYS, tools=None).choices[0].message
        assert not m.tool_calls
        assert m.content == "On it." + SAYS[len("On it.") + len(START) :].split(END)[0]
    finally:
        assert s.stop() == 0, s.log()
