"""LFM2's tool calls through the real ``openai`` client over loopback HTTP
(``--enable-auto-tool-choice --tool-call-parser lfm2``, as vLLM serves LFM2/LFM2.5), on the
scripted model (``scripted_model``: it says what its prompt scripts, token for token) with
LFM2's call markers as special tokens of its tokenizer and a ChatML template like LFM2's.

The properties: ``<|tool_call_start|>[f(k=v), g(...)]<|tool_call_end|>`` is read as the calls
(Python literals as JSON arguments), the text before and after it is the content, the finish
reason is ``tool_calls``; a stream's deltas add up to the same content and calls. Negative
control: without the parser the output is one flat content string, markers dropped.
"""

# ruff: noqa: F811  (pytest fixtures imported from server_fixtures)

from __future__ import annotations

from test_server_glm import (
    calls_streamed_or_not,
    chat,
    openai_client,
    scripted_fixtures,
    scripted_server,
)

START, END = "<|tool_call_start|>", "<|tool_call_end|>"
MARKERS = ["<|im_start|>", START, END]
STOPS = ["<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SAYS = (
    f'On it.{START}[book(code="007", seats=-2, tags=["a"], note=None), now()]{END}Done.<|im_end|>'
)
CALLS = [("book", {"code": "007", "seats": -2, "tags": ["a"], "note": None}), ("now", {})]
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("book", "now")
]


model_dir, tok, server = scripted_fixtures(
    "lfm2", MARKERS, STOPS, TEMPLATE, "--enable-auto-tool-choice", "--tool-call-parser", "lfm2"
)


def test_calls_and_the_content_around_them_streamed_or_not(server, tok) -> None:
    want = ("On it.Done.", "tool_calls", CALLS)
    assert calls_streamed_or_not(server, tok, SAYS, TOOLS) == [want, want]


def test_without_the_parser_the_output_is_flat_content(tmp_path_factory, model_dir, tok):
    s = scripted_server(tmp_path_factory, model_dir, "lfm2-flat")
    try:
        m = chat(openai_client(s), s, tok, SAYS, tools=None).choices[0].message
        assert not m.tool_calls
        assert m.content == 'On it.[book(code="007", seats=-2, tags=["a"], note=None), now()]Done.'
    finally:
        assert s.stop() == 0, s.log()
