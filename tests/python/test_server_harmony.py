"""gpt-oss's Harmony format through the real ``openai`` client over loopback HTTP
(``--reasoning-parser openai_gptoss --tool-call-parser openai``), on the scripted model
(``scripted_model``: it says what its prompt scripts, token for token), with a Harmony-style
chat template.

The properties: the analysis message is the reasoning and the final message the content
(the unsplit output is the flattened transcript: the negative control); a message to
``functions.*`` is a tool call with finish reason ``tool_calls`` (and reasoning when the
request reads no calls); streamed deltas add up to the whole answer, logprob bits included;
the Responses API returns a reasoning item and a function call; an output constraint starts
after the final message's header (the scripted analysis is said freely, the answer is JSON
of the schema); ``tool_choice`` required turns a scripted answer into a call and a named
function turns a scripted call into that function's; a deterministic request's call ids
repeat; the reasoning sent back reaches the template as ``thinking``; a tool-call parser without
the format's reasoning parser is refused at start-up, and a gpt-oss checkpoint gets the
format's reasoning parser by default.
"""

# ruff: noqa: F811  (pytest fixtures imported from server_fixtures)

from __future__ import annotations

import json
import struct
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from scripted_model import scripted_messages, write_scripted_model
from server_fixtures import SERVED_NAME, start_server
from tokenizers import Tokenizer

from detspec.server.serve import default_reasoning_parser

THINK = "The user wants the weather."
ANSWER = "It is warm in Paris."
SAYS = (
    f"<|channel|>analysis<|message|>{THINK}<|end|>"
    f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"
)
CALLS = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)
# Closed schemas: the scripted model, constrained off its script, must reach the end.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {"topic": {"type": "string", "enum": ["news", "sport"]}},
            "required": ["topic"],
            "additionalProperties": False,
        },
    },
}
WARM = {
    "type": "object",
    "properties": {"warm": {"type": "boolean"}},
    "required": ["warm"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_scripted_model(Path(tmp_path_factory.mktemp("scripted")) / "m")


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    s = start_server(
        tmp_path_factory,
        "harmony",
        str(model_dir),
        "--max-model-len", "512",
        "--verify-strategy", "replay",
        "--verify-window", "8",
        "--verify-group", "4",
        "--reasoning-parser", "openai_gptoss",
        "--enable-auto-tool-choice", "--tool-call-parser", "openai",
    )  # fmt: skip
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def scripted(server, tok, script: str, before: tuple = (), tools=None) -> list[dict]:
    return scripted_messages(server.base_url, tok, script, before, tools=tools)


def chat(client, server, tok, script: str, before: tuple = (), **kw):
    extra = {"return_token_ids": True, **kw.pop("extra", {})}
    messages = scripted(server, tok, script, before, kw.get("tools"))
    args = dict(model=SERVED_NAME, messages=messages, temperature=0.0, max_tokens=120)
    return client.chat.completions.create(**{**args, **kw}, extra_body=extra)


def f32(x: float) -> bytes:
    return struct.pack("<f", x)


def test_the_analysis_is_the_reasoning_and_the_final_message_the_content(client, server, tok):
    ch = chat(client, server, tok, SAYS, logprobs=True).choices[0]
    ids = tok.encode(SAYS, add_special_tokens=False).ids
    assert ch.model_extra["token_ids"] == ids, "the scripted model did not say its script"
    m = ch.message
    assert m.model_extra["reasoning"] == m.model_extra["reasoning_content"] == THINK
    assert m.content == ANSWER and ch.finish_reason == "stop" and not m.tool_calls
    assert len(ch.logprobs.content) == len(ids)
    # the negative control: unsplit, the answer is the transcript with its markers dropped
    flat = chat(client, server, tok, SAYS, extra={"separate_reasoning": False}).choices[0]
    assert flat.model_extra["token_ids"] == ids
    assert flat.message.content == f"analysis{THINK}assistantfinal{ANSWER}"


def test_reasoning_tokens_count_the_analysis_body(client, server, tok):
    r = chat(client, server, tok, SAYS)
    n = len(tok.encode(THINK, add_special_tokens=False).ids)
    assert r.usage.completion_tokens_details.reasoning_tokens == n


def collect(stream) -> dict:
    got = {"reasoning": "", "content": "", "calls": {}, "lps": [], "finish": None}
    for chunk in stream:
        for ch in chunk.choices:
            got["reasoning"] += ch.delta.model_extra.get("reasoning") or ""
            got["content"] += ch.delta.content or ""
            for c in ch.delta.tool_calls or []:
                call = got["calls"].setdefault(c.index, {"id": c.id, "name": "", "args": ""})
                call["name"] += (c.function.name or "") if c.function else ""
                call["args"] += (c.function.arguments or "") if c.function else ""
            got["lps"] += ch.logprobs.content if ch.logprobs else []
            got["finish"] = ch.finish_reason or got["finish"]
    return got


def test_stream_adds_up_to_the_answer(client, server, tok):
    ch = chat(client, server, tok, SAYS, logprobs=True).choices[0]
    s = collect(chat(client, server, tok, SAYS, logprobs=True, stream=True))
    assert (s["reasoning"], s["content"], s["finish"]) == (THINK, ANSWER, "stop")
    assert [f32(e.logprob) for e in s["lps"]] == [f32(e.logprob) for e in ch.logprobs.content]


def test_a_message_to_a_function_is_a_tool_call(client, server, tok):
    kw = {"tools": [WEATHER], "extra": {"deterministic": True}, "seed": 7}
    ch = chat(client, server, tok, CALLS, **kw).choices[0]
    assert ch.model_extra["token_ids"] == tok.encode(CALLS, add_special_tokens=False).ids
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    assert ch.message.model_extra["reasoning"] == "Need the weather."
    # streamed: the same call, and a deterministic request's call id repeats
    s = collect(chat(client, server, tok, CALLS, stream=True, **kw))
    assert s["finish"] == "tool_calls" and s["content"] == ""
    streamed = {"id": call.id, "name": "get_weather", "args": call.function.arguments}
    assert s["calls"] == {0: streamed}
    # a request that reads no calls: the call is the model's own action, reasoning
    none = chat(client, server, tok, CALLS, tools=[WEATHER], tool_choice="none").choices[0]
    assert not none.message.tool_calls and none.finish_reason == "stop"
    assert '{"city": "Paris"}' in none.message.model_extra["reasoning"]


def test_required_makes_an_answer_a_call(client, server, tok):
    """The script answers; ``required`` lets its analysis through and turns what follows
    into a call of one of the tools, with arguments of its schema."""
    ch = chat(client, server, tok, SAYS, tools=[WEATHER, LOOKUP], tool_choice="required")
    ch = ch.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert ch.message.model_extra["reasoning"] == THINK
    (call,) = ch.message.tool_calls
    tool = {"get_weather": WEATHER, "lookup": LOOKUP}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_a_named_function_is_the_one_called(client, server, tok):
    """The script calls get_weather; naming lookup makes the call lookup's."""
    named = {"type": "function", "function": {"name": "lookup"}}
    ch = chat(client, server, tok, CALLS, tools=[WEATHER, LOOKUP], tool_choice=named)
    ch = ch.choices[0]
    assert ch.finish_reason == "stop"  # as OpenAI's for a named function
    (call,) = ch.message.tool_calls
    assert call.function.name == "lookup"
    jsonschema.validate(json.loads(call.function.arguments), LOOKUP["function"]["parameters"])
    assert ch.message.model_extra["reasoning"] == "Need the weather."
    # the same request streamed: the same call
    s = collect(chat(client, server, tok, CALLS, tools=[WEATHER, LOOKUP], tool_choice=named,
                     stream=True))  # fmt: skip
    assert [(c["name"], c["args"]) for c in s["calls"].values()] == [
        ("lookup", call.function.arguments)
    ]


def test_a_tool_choice_and_a_response_format_are_one_constraint_too_many(client, server, tok):
    fmt = {"type": "json_schema", "json_schema": {"name": "warm", "schema": WARM}}
    with pytest.raises(openai.BadRequestError, match="one output constraint"):
        chat(client, server, tok, SAYS, tools=[WEATHER], tool_choice="required",
             response_format=fmt)  # fmt: skip


def test_the_responses_api_returns_the_reasoning_and_the_call(client, server, tok):
    messages = scripted(server, tok, CALLS, tools=[WEATHER])
    r = client.responses.create(
        model=SERVED_NAME,
        input=messages[-1]["content"],
        tools=[{"type": "function", **WEATHER["function"]}],
        temperature=0.0,
    )
    kinds = [o.type for o in r.output]
    assert kinds == ["reasoning", "function_call"], kinds
    assert r.output[0].content[0].text == "Need the weather."
    called = (r.output[1].name, json.loads(r.output[1].arguments))
    assert called == ("get_weather", {"city": "Paris"})


def test_an_output_constraint_starts_after_the_final_header(client, server, tok):
    fmt = {"type": "json_schema", "json_schema": {"name": "warm", "schema": WARM}}
    ch = chat(client, server, tok, SAYS, response_format=fmt).choices[0]
    # the analysis was said as scripted (not JSON), the answer is the schema's
    assert ch.message.model_extra["reasoning"] == THINK
    jsonschema.validate(json.loads(ch.message.content), WARM)
    header = tok.encode("<|channel|>final<|message|>", add_special_tokens=False).ids
    ids = ch.model_extra["token_ids"]
    script = tok.encode(SAYS, add_special_tokens=False).ids
    k = next(i for i in range(len(ids)) if ids[i : i + len(header)] == header) + len(header)
    assert ids[:k] == script[:k] and ids[k:] != script[k:]


def test_reasoning_sent_back_reaches_the_template_as_thinking(server, tok):
    before = (
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": ANSWER, "reasoning_content": THINK},
    )
    body = {"messages": [*before, {"role": "user", "content": "And tomorrow?"}]}
    ids = httpx.post(server.base_url + "/tokenize", json=body).json()["tokens"]
    text = tok.decode(ids, skip_special_tokens=False)
    assert f"<|channel|>analysis<|message|>{THINK}<|end|>" in text


def test_the_openai_tool_parser_needs_the_harmony_reasoning_parser(tmp_path_factory, model_dir):
    with pytest.raises(RuntimeError, match="--tool-call-parser openai goes with"):
        start_server(
            tmp_path_factory,
            "openai-alone",
            str(model_dir),
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "openai",
        )


def test_a_gpt_oss_checkpoint_reads_harmony_by_default(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    assert default_reasoning_parser(str(tmp_path)) == "openai_gptoss"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert default_reasoning_parser(str(tmp_path)) is None
    assert default_reasoning_parser(str(tmp_path / "absent")) is None
