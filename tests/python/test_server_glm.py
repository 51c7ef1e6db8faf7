"""GLM-4.5's output format through the real ``openai`` client over loopback HTTP
(``--reasoning-parser glm45 --tool-call-parser glm45``, as vLLM serves GLM-4.5/4.6/4.7), on
the scripted model (``scripted_model``: it says what its prompt scripts, token for token) with
GLM's tags as special tokens and a GLM-style chat template.

The properties: the ``<think>`` block is the reasoning, what follows it the content, and a
``<tool_call>name<arg_key>…</arg_key><arg_value>…</arg_value></tool_call>`` a tool call whose
arguments are typed by the request's tool schema (a ``string`` argument stays text, ``007``
included; an integer one is JSON), finish reason ``tool_calls``; streamed deltas add up to the
whole answer; with ``enable_thinking: false`` the template closes the block and the output is
all content; a deterministic request's answer repeats bit for bit. Negative control: without
the parsers the same output is one flat content string. Qwen3-Coder's XML calls
(``--tool-call-parser qwen3_coder``) are read the same way on the same model.
"""

# ruff: noqa: F811  (pytest fixtures imported from server_fixtures)

from __future__ import annotations

import json
import struct
from pathlib import Path

import openai
import pytest
from scripted_model import scripted_messages, write_scripted_model
from server_fixtures import SERVED_NAME, start_server
from tokenizers import Tokenizer

MARKERS = [
    "<|system|>", "<|user|>", "<|assistant|>", "<think>", "</think>", "<tool_call>",
    "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
]  # fmt: skip
STOPS = ["<|observation|>", "<|endoftext|>"]
# GLM-4.5's template, reduced to what the tests read: each message after its role tag, the
# thinking block closed at once when thinking is off.
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}\n<think></think>{% endif %}"
    "{% endif %}"
)
THINK = "The user wants a booking."
CALL = (
    "<tool_call>book\n<arg_key>code</arg_key>\n<arg_value>007</arg_value>\n"
    "<arg_key>seats</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
)
SAYS = f"<think>{THINK}</think>\nBooking it.{CALL}<|observation|>"
BOOK = {
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string"}, "seats": {"type": "integer"}},
            "required": ["code", "seats"],
        },
    },
}


def scripted_server(tmp_path_factory, model_dir, name: str, *parsers: str):
    return start_server(
        tmp_path_factory,
        name,
        str(model_dir),
        "--max-model-len", "512",
        "--verify-strategy", "replay",
        "--verify-window", "8",
        "--verify-group", "4",
        *parsers,
    )  # fmt: skip


def scripted_fixtures(name: str, markers, stops, template: str, *parsers: str):
    """A module's ``model_dir`` (the scripted model with ``markers`` as tokens of their own,
    ``stops`` and ``template``), ``tok`` (its tokenizer) and ``server`` (served with
    ``parsers``) fixtures, module-scoped: ``model_dir, tok, server = scripted_fixtures(...)``."""

    @pytest.fixture(scope="module")
    def model_dir(tmp_path_factory) -> Path:
        out = Path(tmp_path_factory.mktemp(f"scripted-{name}")) / "m"
        return write_scripted_model(out, markers, stops, template)

    @pytest.fixture(scope="module")
    def tok(model_dir) -> Tokenizer:
        return Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    @pytest.fixture(scope="module")
    def server(tmp_path_factory, model_dir):
        s = scripted_server(tmp_path_factory, model_dir, name, *parsers)
        yield s
        assert s.stop() == 0, s.log()

    return model_dir, tok, server


model_dir, tok, server = scripted_fixtures(
    "glm", MARKERS, STOPS, TEMPLATE,
    "--reasoning-parser", "glm45", "--enable-auto-tool-choice", "--tool-call-parser", "glm45",
)  # fmt: skip


def openai_client(server) -> openai.OpenAI:
    """The `openai` client of a test server, no retries."""
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server)


def scripted(server, tok, script: str, **template_kwargs) -> list[dict]:
    return scripted_messages(server.base_url, tok, script, chat_template_kwargs=template_kwargs)


def chat(client, server, tok, script: str, template_kwargs=None, **kw):
    template_kwargs = template_kwargs or {}
    extra = {
        "return_token_ids": True,
        "chat_template_kwargs": template_kwargs,
        **kw.pop("extra", {}),
    }
    messages = scripted(server, tok, script, **template_kwargs)
    args = dict(model=SERVED_NAME, messages=messages, temperature=0.0, max_tokens=120)
    return client.chat.completions.create(**{**args, **kw}, extra_body=extra)


def collect_stream(stream) -> tuple[str, str, str | None, str, str | None, list[bytes]]:
    """A streamed chat answer's (reasoning, content, call name, call arguments, finish reason,
    logprob bits), its deltas added up."""
    reasoning, content, args, name, finish, lps = "", "", "", None, None, []
    for chunk in stream:
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        reasoning += (c.delta.model_extra or {}).get("reasoning") or ""
        content += c.delta.content or ""
        for d in c.delta.tool_calls or []:
            name = name or d.function.name
            args += d.function.arguments or ""
        if c.logprobs and c.logprobs.content:
            lps += [struct.pack("<f", e.logprob) for e in c.logprobs.content]
        finish = c.finish_reason or finish
    return reasoning, content, name, args, finish, lps


def calls_streamed_or_not(server, tok, script: str, tools: list[dict]) -> list[tuple]:
    """A chat answer's (content, finish reason, calls as (name, arguments)), not streamed and
    streamed (its deltas added up, any number of calls)."""
    client = openai_client(server)
    ch = chat(client, server, tok, script, tools=tools).choices[0]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls]
    whole = (ch.message.content, ch.finish_reason, calls)
    stream = client.chat.completions.create(
        model=SERVED_NAME,
        messages=scripted(server, tok, script),
        temperature=0.0,
        max_tokens=120,
        tools=tools,
        stream=True,
        extra_body={"chat_template_kwargs": {}},
    )
    content, names, args, finish = "", {}, {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        content += c.delta.content or ""
        for d in c.delta.tool_calls or []:
            names[d.index] = names.get(d.index) or d.function.name
            args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
        finish = c.finish_reason or finish
    streamed = (content, finish, [(names[i], json.loads(args[i])) for i in sorted(names)])
    return [whole, streamed]


def deterministic_call(client, server, tok, script: str, tools: list[dict]) -> tuple:
    """One sampled deterministic chat answer's token ids, logprob bits and calls."""
    r = chat(
        client, server, tok, script, tools=tools, logprobs=True,
        temperature=0.7, seed=3, extra={"deterministic": True},
    )  # fmt: skip
    ch = r.choices[0]
    return (
        ch.model_extra["token_ids"],
        [struct.pack("<f", e.logprob) for e in ch.logprobs.content],
        [(c.id, c.function.name, c.function.arguments) for c in ch.message.tool_calls],
    )


def test_think_block_content_and_a_typed_call(client, server, tok) -> None:
    r = chat(client, server, tok, SAYS, tools=[BOOK], logprobs=True)
    ch = r.choices[0]
    assert ch.message.model_extra["reasoning"] == THINK
    assert ch.message.content == "\nBooking it."
    (call,) = ch.message.tool_calls
    assert call.function.name == "book"
    # the schema types `code` a string: 007 stays text; `seats` an integer: JSON
    assert json.loads(call.function.arguments) == {"code": "007", "seats": 2}
    assert ch.finish_reason == "tool_calls"
    # streamed: the deltas add up to the same answer, logprob bits included
    stream = client.chat.completions.create(
        model=SERVED_NAME,
        messages=scripted(server, tok, SAYS),
        temperature=0.0,
        max_tokens=120,
        tools=[BOOK],
        logprobs=True,
        stream=True,
    )
    reasoning, content, name, args, finish, lps = collect_stream(stream)
    assert (reasoning, content, name, finish) == (THINK, "\nBooking it.", "book", "tool_calls")
    assert json.loads(args) == {"code": "007", "seats": 2}
    assert lps == [struct.pack("<f", e.logprob) for e in ch.logprobs.content]


def test_thinking_off_is_all_content(client, server, tok) -> None:
    r = chat(client, server, tok, "It is booked.<|endoftext|>", {"enable_thinking": False})
    m = r.choices[0].message
    assert m.content == "It is booked." and not m.model_extra.get("reasoning")
    assert r.choices[0].finish_reason == "stop"


def test_a_deterministic_call_repeats_bit_for_bit(client, server, tok) -> None:
    once = deterministic_call(client, server, tok, SAYS, [BOOK])
    assert once == deterministic_call(client, server, tok, SAYS, [BOOK])


def test_without_the_parsers_the_output_is_flat_content(tmp_path_factory, model_dir, tok):
    s = scripted_server(tmp_path_factory, model_dir, "glm-flat")
    try:
        c = openai_client(s)
        r = chat(c, s, tok, SAYS)
        m = r.choices[0].message
        assert not m.tool_calls and not m.model_extra.get("reasoning")
        assert "arg_value" not in (m.content or "")  # special tokens are skipped when flat
        assert THINK in m.content and "Booking it." in m.content
    finally:
        assert s.stop() == 0, s.log()


def test_qwen3_coder_calls_are_read_by_their_parser(tmp_path_factory, model_dir, tok):
    """Qwen3-Coder's ``<function=…><parameter=…>`` calls (``--tool-call-parser qwen3_coder``,
    tags as ordinary text), typed by the same schema, on the same scripted model."""
    s = scripted_server(
        tmp_path_factory, model_dir, "qwen3-coder",
        "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder",
    )  # fmt: skip
    try:
        c = openai_client(s)
        script = (
            "Booking.\n<tool_call>\n<function=book>\n<parameter=code>\n007\n</parameter>\n"
            "<parameter=seats>\n2\n</parameter>\n</function>\n</tool_call><|endoftext|>"
        )
        ch = chat(c, s, tok, script, tools=[BOOK]).choices[0]
        assert ch.message.content == "Booking.\n" and ch.finish_reason == "tool_calls"
        (call,) = ch.message.tool_calls
        assert call.function.name == "book"
        assert json.loads(call.function.arguments) == {"code": "007", "seats": 2}
    finally:
        assert s.stop() == 0, s.log()
