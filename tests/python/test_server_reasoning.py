"""Reasoning outputs (``--reasoning-parser qwen3``) through the real ``openai`` client over
loopback HTTP, on the tiny random model with ``<think>``/``</think>`` added to its tokenizer
and a Qwen3-style chat template (``enable_thinking: false`` writes an empty block).

The random model thinks until it samples ``</think>``, made likely by a ``logit_bias``. The
properties: the reasoning and the content are the output's text before and after that token
(equal to the unsplit answer around it), ``reasoning_tokens`` counts the tokens before it;
streamed deltas add up to the non-streamed answer, logprob bits included; an output
constraint applies after the thinking (the answer is JSON of the schema, the thinking free),
and from the first token when the prompt closed the block; a deterministic reasoning answer
is bitwise identical alone and amid concurrent traffic, and a plain one is not (the negative
control); the Responses API returns the same split as a reasoning item; an earlier answer's
reasoning sent back reaches the template; a model without the tags is refused at start-up.
"""

# ruff: noqa: F811  (pytest fixtures imported from server_fixtures)

from __future__ import annotations

import asyncio
import json
import shutil
import struct
from pathlib import Path

import jsonschema
import openai
import pytest
from conftest import add_tokens
from server_fixtures import (  # noqa: F401
    CITY_SCHEMA,
    SERVED_NAME,
    demo_model_dir,
    start_server,
)

START_ID, END_ID = 669, 670  # past the demo tokenizer's 669 tokens, inside the model's 1024
END = "</think>"
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n"
    "{% if m['reasoning_content'] %}<think>\n{{ m['reasoning_content'] }}\n</think>\n\n"
    "{% endif %}{{ m['content'] | trim }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
USER = {"role": "user", "content": "Where is it warm?"}
THINK = {"logit_bias": {str(END_ID): 4.5}}  # </think> after a few free tokens


@pytest.fixture(scope="module")
def reasoning_model_dir(demo_model_dir, tmp_path_factory) -> str:
    d = Path(tmp_path_factory.mktemp("reasoning-model")) / "m"
    shutil.copytree(demo_model_dir, d)
    add_tokens(d, {START_ID: "<think>", END_ID: END}, special=False, chat_template=TEMPLATE)
    return str(d)


@pytest.fixture(scope="module")
def reasoning_server(tmp_path_factory, reasoning_model_dir):
    s = start_server(
        tmp_path_factory,
        "reasoning",
        reasoning_model_dir,
        "--max-model-len", "1024",
        "--verify-strategy", "replay",
        "--verify-window", "8",
        "--verify-group", "4",
        "--num-kv-pages", "1024",
        "--reasoning-parser", "qwen3",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    )  # fmt: skip
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="module")
def client(reasoning_server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=reasoning_server.base_url + "/v1", api_key="unused", max_retries=0
    )


def chat(client: openai.OpenAI, seed: int, **kw):
    extra = {"return_token_ids": True, "deterministic": True, **THINK, **kw.pop("extra", {})}
    args = dict(model=SERVED_NAME, messages=[USER], temperature=1.0, seed=seed, max_tokens=64)
    return client.chat.completions.create(**{**args, **kw}, extra_body=extra)


@pytest.fixture(scope="module")
def seed(client) -> int:
    """A seed whose answer thinks for at least 3 tokens, then answers (found, not assumed:
    the model is random)."""
    for s in range(40):
        ids = chat(client, s).choices[0].model_extra["token_ids"]
        if END_ID in ids[3:60]:
            return s
    raise AssertionError("no seed in 40 thinks for 3-60 tokens")


def f32(x: float) -> bytes:
    return struct.pack("<f", x)


def lp_bits(entries) -> tuple:
    return tuple(f32(e.logprob) for e in entries)


def test_reasoning_and_content_are_the_text_around_the_end_token(client, seed) -> None:
    r = chat(client, seed, logprobs=True)
    ch = r.choices[0]
    m = ch.message
    ids = ch.model_extra["token_ids"]
    k = ids.index(END_ID)
    whole = chat(client, seed, extra={"separate_reasoning": False}).choices[0]
    assert whole.model_extra["token_ids"] == ids  # same request, same tokens
    assert m.model_extra["reasoning"] + END + (m.content or "") == whole.message.content
    assert m.model_extra["reasoning_content"] == m.model_extra["reasoning"]
    assert m.model_extra["reasoning"].strip() and END not in m.model_extra["reasoning"]
    assert r.usage.completion_tokens_details.reasoning_tokens == k
    assert len(ch.logprobs.content) == len(ids)  # logprobs cover every token
    # include_reasoning=false: the same answer without its reasoning
    hidden = chat(client, seed, extra={"include_reasoning": False}).choices[0].message
    assert hidden.model_extra["reasoning"] is None and hidden.content == m.content


def test_each_of_n_choices_splits_its_own_output(client, seed) -> None:
    r = chat(client, seed, n=3)
    assert len(r.choices) == 3
    total = 0
    for ch in r.choices:
        ids, m = ch.model_extra["token_ids"], ch.message
        whole = m.model_extra["reasoning"] or ""
        if END_ID in ids:  # (the content may hold more: the bias stays on)
            total += ids.index(END_ID)
        else:
            total += len(ids)
            assert m.content is None
        assert END not in whole
    assert r.usage.completion_tokens_details.reasoning_tokens == total
    assert len({ch.message.model_extra["reasoning"] for ch in r.choices}) > 1


def collect(stream) -> dict:
    got = {"reasoning": "", "reasoning_content": "", "content": "", "lps": [], "finish": None}
    for chunk in stream:
        for ch in chunk.choices:
            d = ch.delta.model_extra
            got["reasoning"] += d.get("reasoning") or ""
            got["reasoning_content"] += d.get("reasoning_content") or ""
            got["content"] += ch.delta.content or ""
            got["lps"] += ch.logprobs.content if ch.logprobs else []
            got["finish"] = ch.finish_reason or got["finish"]
        if chunk.usage is not None:
            got["usage"] = chunk.usage
    return got


def test_stream_adds_up_to_the_answer(client, seed) -> None:
    ch = chat(client, seed, logprobs=True).choices[0]
    s = collect(
        chat(client, seed, logprobs=True, stream=True, stream_options={"include_usage": True})
    )
    assert s["reasoning"] == s["reasoning_content"] == ch.message.model_extra["reasoning"]
    assert s["content"] == (ch.message.content or "")
    assert lp_bits(s["lps"]) == lp_bits(ch.logprobs.content)
    assert s["finish"] == ch.finish_reason
    k = ch.model_extra["token_ids"].index(END_ID)
    assert s["usage"].completion_tokens_details.reasoning_tokens == k


def test_cut_while_thinking_is_all_reasoning(client, seed) -> None:
    ch = chat(client, seed, max_tokens=2).choices[0]
    assert ch.finish_reason == "length" and ch.message.content is None
    assert ch.message.model_extra["reasoning"]


def test_a_schema_applies_after_the_thinking(client, seed) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}}
    ch = chat(client, seed, response_format=fmt, max_tokens=200).choices[0]
    ids = ch.model_extra["token_ids"]
    assert ids.index(END_ID) >= 3, "the thinking was constrained"
    jsonschema.validate(json.loads(ch.message.content), CITY_SCHEMA)
    assert not ch.message.model_extra["reasoning"].lstrip().startswith("{")
    # with thinking off the prompt closes the block: constrained from the first token
    off = chat(
        client,
        seed,
        response_format=fmt,
        max_tokens=200,
        extra={"chat_template_kwargs": {"enable_thinking": False}},
    ).choices[0]
    assert off.message.model_extra["reasoning"] is None
    assert END_ID not in off.model_extra["token_ids"]
    jsonschema.validate(json.loads(off.message.content), CITY_SCHEMA)


def test_a_required_tool_call_follows_the_thinking(client, seed) -> None:
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": CITY_SCHEMA},
    }
    ch = chat(client, seed, tools=[tool], tool_choice="required", max_tokens=200).choices[0]
    assert ch.finish_reason == "tool_calls"
    (call,) = ch.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), CITY_SCHEMA)
    assert ch.message.model_extra["reasoning"]
    s = collect(
        chat(client, seed, tools=[tool], tool_choice="required", max_tokens=200, stream=True)
    )
    assert s["reasoning"] == ch.message.model_extra["reasoning"]


def test_the_tool_parser_reads_the_answer_after_the_thinking(client, seed) -> None:
    """Qwen3's setup (hermes calls, thinking): a call written after ``</think>`` (arranged by
    a regex, which applies after the thinking) is a tool call; the thinking is reasoning."""
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Oslo"\}\}\n</tool_call>'
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": CITY_SCHEMA}}
    kw = dict(tools=[tool], max_tokens=200, extra={"structured_outputs": {"regex": call}})
    ch = chat(client, seed, **kw).choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (got,) = ch.message.tool_calls
    assert (got.function.name, json.loads(got.function.arguments)) == (
        "get_weather",
        {"city": "Oslo"},
    )
    assert ch.message.model_extra["reasoning"]
    s = collect(chat(client, seed, stream=True, **kw))
    assert s["reasoning"] == ch.message.model_extra["reasoning"] and s["content"] == ""


async def _round(base_url: str, seed: int, deterministic: bool, load: int) -> tuple:
    c = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)

    async def target() -> tuple:
        r = await c.chat.completions.create(
            model=SERVED_NAME,
            messages=[USER],
            temperature=1.0,
            seed=seed,
            max_tokens=64,
            logprobs=True,
            extra_body={**THINK, "deterministic": deterministic},
        )
        m = r.choices[0].message
        return m.model_extra["reasoning"], m.content, lp_bits(r.choices[0].logprobs.content)

    async def noise(i: int) -> None:
        await c.chat.completions.create(
            model=SERVED_NAME,
            messages=[{"role": "user", "content": "word " * (1 + i * 7 % 40)}],
            temperature=1.0,
            seed=i,
            max_tokens=8 + i * 5 % 40,
            extra_body=THINK,
        )

    got, *_ = await asyncio.gather(target(), *(noise(seed * 31 + i) for i in range(load)))
    await c.close()
    return got


@pytest.mark.parametrize("deterministic", [True, False], ids=["dvr", "negative-control"])
def test_deterministic_reasoning_is_identical_under_load(
    reasoning_server, seed, deterministic
) -> None:
    base = reasoning_server.base_url
    alone = asyncio.run(_round(base, seed, deterministic, 0))
    loaded = [asyncio.run(_round(base, seed, deterministic, 16)) for _ in range(3)]
    if deterministic:
        assert all(x == alone for x in loaded)
    else:  # the fast path's bits move with the batch
        assert any(x[2] != alone[2] for x in loaded)


def test_responses_api_returns_a_reasoning_item(client, seed) -> None:
    ch = chat(client, seed).choices[0]
    kw = dict(model=SERVED_NAME, input=[USER], temperature=1.0, max_output_tokens=64)
    extra = {"seed": seed, "deterministic": True, **THINK}
    r = client.responses.create(**kw, extra_body=extra)
    item = r.output[0]
    assert item.type == "reasoning" and item.content[0].text == ch.message.model_extra["reasoning"]
    assert r.output_text == (ch.message.content or "")
    assert r.usage.output_tokens_details.reasoning_tokens == (
        ch.model_extra["token_ids"].index(END_ID)
    )
    events = list(client.responses.create(**kw, extra_body=extra, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == item.content[0].text
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == item.content[0].text and done.output_index == 0
    final = events[-1].response
    assert [o.type for o in final.output] == [o.type for o in r.output]
    if r.output_text:
        texts = [e for e in events if e.type == "response.output_text.delta"]
        assert texts[0].output_index == 1
        assert "".join(e.delta for e in texts) == r.output_text


def test_earlier_reasoning_reaches_the_template(client, reasoning_server) -> None:
    """An answer's reasoning sent back (chat's ``reasoning`` or ``reasoning_content``, a
    Responses reasoning item) is rendered in its ``<think>`` block."""
    import httpx

    def count(messages) -> int:
        body = {"model": SERVED_NAME, "messages": messages}
        return httpx.post(reasoning_server.base_url + "/tokenize", json=body).json()["count"]

    plain = [USER, {"role": "assistant", "content": "Rome."}, USER]
    with_r = [USER, {"role": "assistant", "content": "Rome.", "reasoning": "warm south"}, USER]
    with_rc = [
        USER,
        {"role": "assistant", "content": "Rome.", "reasoning_content": "warm south"},
        USER,
    ]
    assert count(with_r) == count(with_rc) > count(plain)
    items = [
        USER,
        {"type": "reasoning", "summary": [],
         "content": [{"type": "reasoning_text", "text": "warm south"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Rome."}]},
        USER,
    ]  # fmt: skip
    r = client.responses.create(model=SERVED_NAME, input=items, max_output_tokens=1)
    c = client.chat.completions.create(model=SERVED_NAME, messages=with_r, max_tokens=1)
    assert r.usage.input_tokens == c.usage.prompt_tokens == count(with_r)


def test_a_model_without_the_tags_is_refused_at_start(tmp_path_factory, demo_model_dir) -> None:
    with pytest.raises(RuntimeError, match="needs '<think>' as one token"):
        start_server(
            tmp_path_factory, "no-tags", demo_model_dir, "--reasoning-parser", "deepseek_r1"
        )
