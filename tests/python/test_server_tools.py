"""Structured outputs and tool calling through the real ``openai`` client over loopback HTTP.

The tiny random model cannot choose to call a tool, so its output is *arranged*: a request
under ``tool_choice: "auto"`` carries a regex (``structured_outputs``) that spells a Hermes
``<tool_call>``, which the server's ``--tool-call-parser hermes`` reads back; ``required`` and a
named function constrain the output by themselves. The model's chat template (a Hermes-style
one written for the test) renders the tools, earlier calls and ``tool`` messages.

Covered: a multi-turn tool loop (streamed and not, the two equal), ``required`` / named /
``none``, ``response_format`` (``json_object``, ``json_schema``) and vLLM's extras on both
routes, ``logit_bias``, deterministic constrained requests under concurrent load equal bit for
bit (text, token ids, logprob bits, tool calls and their ids) to the same request alone, and
the bad-input battery (each a 400 naming its parameter; the server serves afterwards).
"""

# ruff: noqa: F811  (pytest fixtures imported from server_fixtures)

from __future__ import annotations

import asyncio
import json
import struct

import httpx
import jsonschema
import openai
import pytest
from server_fixtures import (  # noqa: F401
    CITY_SCHEMA,
    SERVED_NAME,
    demo_model_dir,
    server,
    tool_model_dir,
    tool_server,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": CITY_SCHEMA,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a city",
            "parameters": CITY_SCHEMA,
        },
    },
]
USER = {"role": "user", "content": "What is the weather in Paris?"}
# A Hermes call, as a regex (the parser reads it back as a call)
CALL_RE = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>'
# ... with a sampled part, for the determinism tests
SAMPLED_CALL_RE = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,7}"\}\}\n'
    r"</tool_call>"
)
ANSWER_RE = r"It is sunny in Paris\."
DET = {"deterministic": True, "return_token_ids": True}


def f32(x: float) -> bytes:
    return struct.pack("<f", x)


@pytest.fixture(scope="module")
def client(tool_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_server.base_url + "/v1", api_key="unused", max_retries=0)


def regex(r: str) -> dict:
    return {"structured_outputs": {"regex": r}}


def calls_of(message) -> list[tuple[str, str, str]]:
    return [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]


def collect_stream(stream) -> dict:
    """A streamed chat answer added up: content, calls (by index), finish reason, chunks."""
    content = ""
    calls: dict[int, dict] = {}
    finish = None
    token_ids: list[int] = []
    nchunks = 0
    for chunk in stream:
        nchunks += 1
        for ch in chunk.choices:
            d = ch.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    c["id"] = tc.id
                if tc.function and tc.function.name:
                    c["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    c["arguments"] += tc.function.arguments
            token_ids += (ch.model_extra or {}).get("token_ids") or []
            if ch.finish_reason:
                finish = ch.finish_reason
    return {
        "content": content,
        "calls": [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())],
        "finish": finish,
        "token_ids": token_ids,
        "chunks": nchunks,
    }


# --------------------------------------------------------------------------- template


def test_template_renders_tools_calls_and_tool_messages(tool_server) -> None:
    messages = [
        USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    base = tool_server.base_url
    r = httpx.post(base + "/tokenize", json={"messages": messages, "tools": TOOLS})
    assert r.status_code == 200, r.text
    text = httpx.post(base + "/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert "You may call these tools:" in text
    assert '"name": "get_weather"' in text and '"enum": ["Paris", "Rome", "Oslo"]' in text
    # the earlier call's arguments reach the template as a dict (rendered as JSON again)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert text.endswith("</tool_response>\n\nassistant\n")  # (<s> and </s> are skipped)


# --------------------------------------------------------------------------- tool loop


def test_tool_loop_auto_hermes(client) -> None:
    """Turn 1 calls get_weather (arranged by a regex), turn 2 answers from the tool result;
    streamed and non-streamed answers agree (deterministic requests: ids too)."""
    r = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[USER],
        tools=TOOLS,
        temperature=0,
        max_tokens=200,
        extra_body={**regex(CALL_RE), **DET},
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    assert ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    stream = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[USER],
        tools=TOOLS,
        temperature=0,
        max_tokens=200,
        stream=True,
        extra_body={**regex(CALL_RE), **DET},
    )
    got = collect_stream(stream)
    assert got["finish"] == "tool_calls"
    assert got["content"] == ""
    assert got["calls"] == calls_of(ch.message)
    assert got["token_ids"] == ch.model_extra["token_ids"]

    history = [
        USER,
        ch.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"weather": "sunny"}'},
    ]
    r2 = client.chat.completions.create(
        model=SERVED_NAME,
        messages=history,
        tools=TOOLS,
        temperature=0,
        max_tokens=100,
        extra_body={**regex(ANSWER_RE), **DET},
    )
    ch2 = r2.choices[0]
    assert ch2.finish_reason == "stop"
    assert ch2.message.content == "It is sunny in Paris."
    assert not ch2.message.tool_calls
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens  # the call and result are in it
    s2 = collect_stream(
        client.chat.completions.create(
            model=SERVED_NAME,
            messages=history,
            tools=TOOLS,
            temperature=0,
            max_tokens=100,
            stream=True,
            extra_body={**regex(ANSWER_RE), **DET},
        )
    )
    assert (s2["content"], s2["calls"], s2["finish"]) == ("It is sunny in Paris.", [], "stop")


@pytest.mark.parametrize(
    ("arranged", "content", "ncalls"),
    [
        (r"Let me check\.\n" + CALL_RE, "Let me check.\n", 1),
        # malformed JSON inside a call: returned as content, not an error
        (
            r'<tool_call>\n\{"name": oops\}\n</tool_call>',
            '<tool_call>\n{"name": oops}\n</tool_call>',
            0,
        ),
    ],
    ids=["content-then-call", "malformed-call"],
)
def test_auto_content_and_malformed_calls(client, arranged, content, ncalls) -> None:
    kw = dict(
        model=SERVED_NAME,
        messages=[USER],
        tools=TOOLS,
        temperature=0,
        max_tokens=200,
        extra_body={**regex(arranged), **DET},
    )
    ch = client.chat.completions.create(**kw).choices[0]
    assert ch.message.content == content
    assert len(ch.message.tool_calls or []) == ncalls
    assert ch.finish_reason == ("tool_calls" if ncalls else "stop")
    got = collect_stream(client.chat.completions.create(**kw, stream=True))
    assert (got["content"], got["calls"], got["finish"]) == (
        content,
        calls_of(ch.message),
        ch.finish_reason,
    )


def test_tool_choice_required(client) -> None:
    kw = dict(
        model=SERVED_NAME,
        messages=[USER],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,  # one call: the array closes after it
        temperature=0.8,
        seed=3,
        max_tokens=300,
        extra_body=DET,
    )
    r = client.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    (call,) = ch.message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    jsonschema.validate(json.loads(call.function.arguments), CITY_SCHEMA)
    got = collect_stream(client.chat.completions.create(**kw, stream=True))
    assert (got["calls"], got["finish"]) == (calls_of(ch.message), "tool_calls")


def test_tool_choice_required_parallel(client) -> None:
    """Several calls; a random model may also go on adding calls until max_tokens, which
    leaves the unfinished array as content with finish_reason length."""
    several = 0
    for seed in range(4):
        r = client.chat.completions.create(
            model=SERVED_NAME,
            messages=[USER],
            tools=TOOLS,
            tool_choice="required",
            temperature=0.8,
            seed=seed,
            max_tokens=300,
            extra_body=DET,
        )
        ch = r.choices[0]
        if ch.finish_reason == "length":
            assert ch.message.content.startswith('[{"name": "get_') and not ch.message.tool_calls
            continue
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        for c in ch.message.tool_calls:
            jsonschema.validate(json.loads(c.function.arguments), CITY_SCHEMA)
        assert len({c.id for c in ch.message.tool_calls}) == len(ch.message.tool_calls)
        several += len(ch.message.tool_calls) > 1
    assert several


def test_tool_choice_named(client) -> None:
    kw = dict(
        model=SERVED_NAME,
        messages=[USER],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0.8,
        seed=5,
        max_tokens=300,
        extra_body=DET,
    )
    r = client.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "stop", ch  # as OpenAI and vLLM for a named function
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), CITY_SCHEMA)
    got = collect_stream(client.chat.completions.create(**kw, stream=True))
    assert (got["calls"], got["finish"]) == (calls_of(ch.message), "stop")


def test_tool_choice_none_keeps_the_output_as_content(client) -> None:
    r = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[USER],
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=200,
        extra_body=regex(CALL_RE),
    )
    ch = r.choices[0]
    assert ch.finish_reason == "stop"
    assert not ch.message.tool_calls
    assert ch.message.content.startswith("<tool_call>")


# --------------------------------------------------------------------------- structured outputs

RESULT_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "sunny"],
    "additionalProperties": False,
}


def test_response_format_json_schema_chat_and_completions(client) -> None:
    rf = {
        "type": "json_schema",
        "json_schema": {"name": "r", "schema": RESULT_SCHEMA, "strict": True},
    }
    r = client.chat.completions.create(
        model=SERVED_NAME, messages=[USER], max_tokens=300, temperature=0, response_format=rf
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    jsonschema.validate(json.loads(r.choices[0].message.content), RESULT_SCHEMA)
    c = client.completions.create(
        model=SERVED_NAME,
        prompt="The weather:",
        max_tokens=300,
        temperature=0.9,
        seed=2,
        n=3,
        extra_body={"response_format": rf},
    )
    for ch in c.choices:
        assert ch.finish_reason == "stop", ch
        jsonschema.validate(json.loads(ch.text), RESULT_SCHEMA)


def test_response_format_json_object_with_logit_bias(client, tool_server) -> None:
    """json_object: any JSON object. A +100 bias on the token "}" closes it at once (the
    grammar allows "}" right after "{"), so the answer is {} -- the bias reaches the
    sampler."""
    tok = httpx.post(tool_server.base_url + "/tokenize", json={"prompt": "}"}).json()["tokens"]
    assert len(tok) == 1
    r = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[USER],
        max_tokens=100,
        temperature=0,
        response_format={"type": "json_object"},
        logit_bias={str(tok[0]): 100},
    )
    assert r.choices[0].finish_reason == "stop"
    assert json.loads(r.choices[0].message.content) == {}
    # and without the bias it is still an object
    r = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[USER],
        max_tokens=400,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # the random model may go on until max_tokens; then it is an object's start
        assert r.choices[0].message.content.lstrip().startswith("{")


def test_logit_bias_changes_greedy_output(client) -> None:
    kw = dict(model=SERVED_NAME, prompt="Hello", max_tokens=1, temperature=0)
    base = client.completions.create(**kw, extra_body={"return_token_ids": True})
    first = base.choices[0].model_extra["token_ids"][0]
    banned = client.completions.create(
        **kw, logit_bias={str(first): -100}, extra_body={"return_token_ids": True}
    )
    assert banned.choices[0].model_extra["token_ids"][0] != first
    forced = client.completions.create(
        **kw, logit_bias={"77": 100}, extra_body={"return_token_ids": True}
    )
    assert forced.choices[0].model_extra["token_ids"] == [77]


@pytest.mark.parametrize(
    "extra",
    [
        {"guided_choice": ["yes", "no", "maybe"]},
        {"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
        {"guided_regex": "(yes|no|maybe)"},
        {"structured_outputs": {"grammar": 'start: "yes" | "no" | "maybe"'}},
    ],
    ids=["guided_choice", "choice", "guided_regex", "grammar"],
)
def test_vllm_constraint_extras(client, extra) -> None:
    c = client.completions.create(
        model=SERVED_NAME,
        prompt="Is it sunny?",
        max_tokens=20,
        temperature=1.0,
        seed=4,
        n=4,
        extra_body=extra,
    )
    for ch in c.choices:
        assert ch.text in ("yes", "no", "maybe") and ch.finish_reason == "stop", ch


def test_guided_json_and_structured_outputs_json_on_chat(client) -> None:
    for extra in (
        {"guided_json": RESULT_SCHEMA},
        {"structured_outputs": {"json": json.dumps(RESULT_SCHEMA)}},
    ):
        r = client.chat.completions.create(
            model=SERVED_NAME, messages=[USER], max_tokens=300, temperature=0, extra_body=extra
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), RESULT_SCHEMA)


# --------------------------------------------------------------------------- determinism


def _fingerprint(r) -> dict:
    """Everything that must be bit-equal between two runs of a deterministic request."""
    out = []
    for ch in r.choices:
        lp = ch.logprobs.content if ch.logprobs else []
        out.append(
            {
                "content": ch.message.content,
                "calls": calls_of(ch.message),
                "finish": ch.finish_reason,
                "token_ids": ch.model_extra["token_ids"],
                "logprobs": [f32(x.logprob) for x in lp],
                "top": [[(t.token, f32(t.logprob)) for t in x.top_logprobs] for x in lp],
            }
        )
    return {"choices": out, "fingerprint": r.system_fingerprint}


DET_CASES = {
    "auto-regex": dict(tools=TOOLS, extra_body={**regex(SAMPLED_CALL_RE), **DET}),
    "required": dict(
        tools=TOOLS, tool_choice="required", parallel_tool_calls=False, extra_body=DET
    ),
    "named": dict(
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body=DET,
    ),
    "json_schema": dict(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "r", "schema": RESULT_SCHEMA},
        },
        extra_body=DET,
    ),
}


@pytest.mark.parametrize("case", list(DET_CASES))
async def test_deterministic_constrained_under_load_equals_alone(tool_server, case) -> None:
    aclient = openai.AsyncOpenAI(
        base_url=tool_server.base_url + "/v1", api_key="unused", max_retries=0
    )
    kw = dict(
        model=SERVED_NAME,
        messages=[USER],
        temperature=1.0,
        seed=11,
        n=2,
        max_tokens=200,
        logprobs=True,
        top_logprobs=3,
        **DET_CASES[case],
    )
    alone = _fingerprint(await aclient.chat.completions.create(**kw))

    async def noise(i: int) -> None:  # plain requests of other lengths and constraints
        await aclient.chat.completions.create(
            model=SERVED_NAME,
            messages=[{"role": "user", "content": "tell me a story " * (i + 1)}],
            max_tokens=20 + 13 * i,
            temperature=1.0,
            tools=TOOLS if i % 2 else None,
            tool_choice="required" if i % 2 else None,
        )

    results = await asyncio.gather(
        *[noise(i) for i in range(6)],
        aclient.chat.completions.create(**kw),
        aclient.chat.completions.create(**kw, stream=False),
    )
    for r in results[-2:]:
        assert _fingerprint(r) == alone
    assert alone["choices"][0]["calls"] or case == "json_schema"


# --------------------------------------------------------------------------- bad input

CHAT = {"model": SERVED_NAME, "messages": [USER], "max_tokens": 4}
CMPL = {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 4}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}


def tool_with(**function) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", **function}}]


# (id, base body, fields, param)
JSON_SCHEMA_RF = {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}
BAD_NAME_RF = {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}
NAMED_F = {"type": "function", "function": {"name": "f"}}
BAD_CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
RF = "response_format"
SO = "structured_outputs"
P0 = "tools[0].function"

BAD = [
    ("json-schema-invalid", CHAT, {RF: JSON_SCHEMA_RF}, f"{RF}.json_schema.schema"),
    ("json-schema-missing", CHAT, {RF: {"type": "json_schema"}}, f"{RF}.json_schema"),
    ("json-schema-bad-name", CHAT, {RF: BAD_NAME_RF}, f"{RF}.json_schema.name"),
    ("response-format-type", CMPL, {RF: {"type": "xml"}}, f"{RF}.type"),
    ("structured-json-invalid", CMPL, {SO: {"json": BAD_SCHEMA}}, f"{SO}.json"),
    ("structured-json-not-json", CMPL, {SO: {"json": "{not json"}}, f"{SO}.json"),
    ("guided-json-invalid", CHAT, {"guided_json": BAD_SCHEMA}, "guided_json"),
    ("structured-regex-invalid", CMPL, {SO: {"regex": "(ab"}}, f"{SO}.regex"),
    ("guided-regex-invalid", CMPL, {"guided_regex": "[a-"}, "guided_regex"),
    ("structured-grammar-invalid", CMPL, {SO: {"grammar": 'start: ( "a"'}}, f"{SO}.grammar"),
    ("guided-grammar-invalid", CHAT, {"guided_grammar": "start: undefined_rule"},
     "guided_grammar"),
    ("structured-empty", CMPL, {SO: {}}, SO),
    ("structured-unknown-field", CMPL, {SO: {"xml": "a"}}, f"{SO}.xml"),
    ("two-constraints", CHAT, {RF: {"type": "json_object"}, "guided_regex": "a+"},
     "guided_regex"),
    ("constraint-and-required", CHAT,
     {"tools": TOOLS, "tool_choice": "required", "guided_choice": ["a"]}, "guided_choice"),
    ("logit-bias-key", CMPL, {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("logit-bias-negative-key", CMPL, {"logit_bias": {"-1": 1}}, "logit_bias"),
    ("logit-bias-out-of-vocab", CMPL, {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("logit-bias-value", CHAT, {"logit_bias": {"5": -101}}, "logit_bias"),
    ("logit-bias-value-type", CHAT, {"logit_bias": {"5": "high"}}, "logit_bias"),
    ("tool-type", CHAT,
     {"tools": [{"type": "retrieval", "function": {"name": "f"}}], "tool_choice": "none"},
     "tools[0].type"),
    ("tool-name-missing", CHAT,
     {"tools": [{"type": "function", "function": {}}], "tool_choice": "none"}, f"{P0}.name"),
    ("tool-name-pattern", CHAT, {"tools": tool_with(name="get weather"), "tool_choice": "none"},
     f"{P0}.name"),
    ("tool-name-too-long", CHAT, {"tools": tool_with(name="f" * 65), "tool_choice": "none"},
     f"{P0}.name"),
    ("tool-parameters-not-object", CHAT,
     {"tools": tool_with(parameters=[1, 2]), "tool_choice": "none"}, f"{P0}.parameters"),
    ("tool-parameters-type", CHAT,
     {"tools": tool_with(parameters={"type": "string"}), "tool_choice": "none"},
     f"{P0}.parameters"),
    ("tool-parameters-invalid-schema", CHAT,
     {"tools": tool_with(parameters=BAD_SCHEMA), "tool_choice": NAMED_F}, f"{P0}.parameters"),
    ("tool-duplicate-name", CHAT, {"tools": TOOLS + TOOLS[:1], "tool_choice": "none"},
     "tools[2].function.name"),
    ("tool-choice-unknown-name", CHAT,
     {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("tool-choice-value", CHAT, {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ("tool-choice-without-tools", CHAT, {"tool_choice": NAMED}, "tool_choice"),
    ("history-arguments-not-json", CHAT,
     {"messages": [USER, {"role": "assistant", "tool_calls": [BAD_CALL]}]},
     "messages[1].tool_calls[0].function.arguments"),
]  # fmt: skip


def _post(url: str, base: dict, over: dict) -> httpx.Response:
    route = "/v1/chat/completions" if "messages" in base else "/v1/completions"
    return httpx.post(url + route, json={**base, **over}, timeout=60)


@pytest.mark.parametrize(("base", "over", "param"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input(tool_server, base, over, param) -> None:
    r = _post(tool_server.base_url, base, over)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"]


def test_bad_input_messages_say_where(tool_server) -> None:
    r = _post(tool_server.base_url, CMPL, {"structured_outputs": {"regex": "ab(c"}})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "ab(c\n" in msg and "^" in msg and "unclosed group" in msg, msg  # the position
    # the message names the field the client sent
    r = _post(tool_server.base_url, CHAT, {"guided_json": BAD_SCHEMA})
    assert "`guided_json`" in r.json()["error"]["message"], r.text
    r = _post(tool_server.base_url, CHAT, {"tools": tool_with(parameters=BAD_SCHEMA),
                                           "tool_choice": NAMED_F})  # fmt: skip
    assert "`tools[0].function.parameters`" in r.json()["error"]["message"], r.text


def test_auto_without_the_parser_flag_is_400(server) -> None:
    for choice in ("auto", None):
        body = {**CHAT, "tools": TOOLS} | ({"tool_choice": choice} if choice else {})
        r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "tool_choice" and "--enable-auto-tool-choice" in err["message"]
    # none, required and named work without it
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={**CHAT, "tools": TOOLS, "tool_choice": "none"},
        timeout=60,
    )
    assert r.status_code == 200, r.text


def test_serves_after_the_battery(tool_server, client) -> None:
    r = client.chat.completions.create(model=SERVED_NAME, messages=[USER], max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert tool_server.wait_kv_idle() == 0
    errors = {k: v for k, v in tool_server.metrics().items() if "request_errors_total" in k}
    assert not any('status="5' in k for k in errors), errors
