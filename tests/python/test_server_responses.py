"""OpenAI's Responses API (``POST /v1/responses``) through the real ``openai`` client over
loopback HTTP: ``client.responses.create``, streamed and not.

The route runs the chat pipeline, so the properties are equalities with it: a response's text,
token logprob bits and usage equal the chat completion of the same conversation; streamed
deltas add up to the non-streamed response (text and logprob bits), with consecutive
sequence numbers from ``response.created`` to ``response.completed``; a deterministic
response is bitwise identical alone and amid concurrent traffic, and without ``deterministic``
it is not (the negative control). Tools: ``required`` and a named function give
``function_call`` items; a conversation that sends them back with ``function_call_output``
items renders as the chat messages with ``tool_calls`` and ``tool`` replies (same bits as chat).
``text.format`` constrains to a JSON schema. Bad input is a 400 naming this API's field, and
the server serves afterwards.
"""

# ruff: noqa: F811  (pytest fixtures imported from server_fixtures)

from __future__ import annotations

import json
import random
import struct
import threading
import time

import jsonschema
import openai
import pytest
from server_fixtures import (  # noqa: F401
    CITY_SCHEMA,
    SERVED_NAME,
    demo_model_dir,
    start_server,
    tool_model_dir,
    tool_server,
)

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": CITY_SCHEMA,
}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
DET = {"deterministic": True, "seed": 1234}
WORDS = ["city", "rain", "sun", "map", "river"]


@pytest.fixture(scope="module")
def client(tool_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_server.base_url + "/v1", api_key="unused", max_retries=0)


def f32(x: float) -> bytes:
    return struct.pack("<f", x)


def lp_bits(entries) -> tuple:
    """Token logprobs (chat's or Responses') as f32 bits, with their top alternatives."""
    return tuple(
        (f32(e.logprob), tuple((t.token, f32(t.logprob)) for t in e.top_logprobs)) for e in entries
    )


def text_part(resp):
    (msg,) = [o for o in resp.output if o.type == "message"]
    (part,) = msg.content
    return part


def ask(client: openai.OpenAI, **kw):
    return client.responses.create(model=SERVED_NAME, **kw)


def test_text_response_equals_the_chat_completion(client) -> None:
    """Instructions + input items are the chat's system + messages: same text, token
    logprob bits and usage, bit for bit (a deterministic sampled request)."""
    conv = [
        {"role": "user", "content": "Name a city."},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Paris."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Another one?"}]},
    ]
    r = ask(
        client,
        instructions="Answer briefly.",
        input=conv,
        max_output_tokens=24,
        temperature=0.8,
        top_logprobs=2,
        extra_body=DET,
    )
    c = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Name a city."},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "Another one?"},
        ],
        max_tokens=24,
        temperature=0.8,
        logprobs=True,
        top_logprobs=2,
        extra_body=DET,
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == c.choices[0].message.content
    assert lp_bits(text_part(r).logprobs) == lp_bits(c.choices[0].logprobs.content)
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens == 24
    assert r.usage.total_tokens == c.usage.total_tokens
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.model_extra["system_fingerprint"] == c.system_fingerprint
    assert r.model_extra["dvr_metrics"]["deterministic"] is True
    assert r.model_extra["dvr_metrics"]["num_verify_passes"] > 0


def collect(stream) -> tuple[list, object]:
    events = list(stream)
    return events, events[-1].response


def test_stream_adds_up_to_the_response(client) -> None:
    kw = dict(input="Tell me about Rome.", max_output_tokens=40, temperature=0.8, top_logprobs=1)
    whole = ask(client, extra_body=DET, **kw)
    events, final = collect(ask(client, stream=True, extra_body=DET, **kw))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    # How many pieces is timing: outputs committed while the server was busy are sent as one
    # delta (the engine's queue hands over what accumulated), and a fast CPU can commit all
    # 40 tokens before the first hand-over (seen in CI on a Zen 5 EPYC). Their sum is not.
    assert deltas, "no text delta"
    assert "".join(d.delta for d in deltas) == whole.output_text == final.output_text
    streamed = lp_bits([lp for d in deltas for lp in d.logprobs])
    assert streamed == lp_bits(text_part(whole).logprobs) == lp_bits(text_part(final).logprobs)
    assert final.usage.output_tokens == whole.usage.output_tokens == 40
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def bits(resp) -> tuple:
    return (
        resp.output_text,
        lp_bits(text_part(resp).logprobs),
        resp.model_extra["system_fingerprint"],
    )


def under_load(base_url: str, kw: dict, seed: int, repeats: int = 3) -> list[tuple]:
    """The target sent ``repeats`` times while 16 threads keep sending other responses
    (streamed and not, deterministic or not, of random lengths)."""
    stop = threading.Event()
    errors: list[BaseException] = []
    sent = [0]

    def load(i: int) -> None:
        c = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
        rng = random.Random(seed * 100 + i)
        try:
            while not stop.is_set():
                args = dict(
                    model=SERVED_NAME,
                    input=" ".join(rng.choices(WORDS, k=rng.randint(1, 30))),
                    max_output_tokens=rng.randint(4, 30),
                    temperature=rng.choice([0.0, 1.0]),
                    extra_body={"seed": rng.randrange(2**31), "deterministic": rng.random() < 0.3},
                )  # fmt: skip
                if rng.random() < 0.5:
                    for _ in c.responses.create(stream=True, **args):
                        sent[0] += 1
                else:
                    c.responses.create(**args)
                    sent[0] += 1
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 60
        while sent[0] < 32 and time.monotonic() < deadline and not errors:
            time.sleep(0.01)
        target = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
        results = []
        for _ in range(repeats):
            before = sent[0]
            results.append(bits(target.responses.create(**kw)))
            assert sent[0] > before, "the load was not running during the target request"
        return results
    finally:
        stop.set()
        for t in threads:
            t.join()
        assert not errors, errors[0]


def target(deterministic: bool) -> dict:
    return dict(
        model=SERVED_NAME,
        input="Where is the sun?",
        max_output_tokens=32,
        temperature=0.8,
        top_logprobs=2,
        extra_body={"deterministic": deterministic, "seed": 7},
    )


def test_deterministic_response_is_bitwise_identical_under_load(client, tool_server) -> None:
    kw = target(True)
    solo = bits(client.responses.create(**kw))
    for i, got in enumerate(under_load(tool_server.base_url, kw, seed=1)):
        assert got == solo, f"a deterministic response changed under load (repeat {i})"


def test_negative_control_plain_responses_differ_under_load(client, tool_server) -> None:
    kw = target(False)
    solo = bits(client.responses.create(**kw))
    for seed in range(4):
        if any(got[:2] != solo[:2] for got in under_load(tool_server.base_url, kw, seed)):
            return
    pytest.fail("plain responses under load were all bitwise identical to the solo one")


def calls_of(resp) -> list[tuple[str, str]]:
    return [(o.name, o.arguments) for o in resp.output if o.type == "function_call"]


def test_required_and_named_tools_give_function_calls(client) -> None:
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        r = ask(client, input="Weather?", tools=[TOOL], tool_choice=choice, extra_body=DET)
        calls = [o for o in r.output if o.type == "function_call"]
        assert len(calls) >= 1, r.output
        assert calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
        jsonschema.validate(json.loads(calls[0].arguments), CITY_SCHEMA)
        assert r.status == "completed"
        events, final = collect(
            ask(
                client,
                input="Weather?",
                tools=[TOOL],
                tool_choice=choice,
                stream=True,
                extra_body=DET,
            )  # fmt: skip
        )
        assert calls_of(final) == calls_of(r)
        done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
        assert done == [a for _, a in calls_of(r)]


def test_tool_loop_renders_as_chat_does(client) -> None:
    """The call and its output sent back as items: the same prompt as chat's assistant
    ``tool_calls`` and ``tool`` message (equal bits), and it reaches the template."""
    first = ask(client, input="Weather in Paris?", tools=[TOOL], tool_choice="required",
                extra_body=DET)  # fmt: skip
    (call,) = [o for o in first.output if o.type == "function_call"][:1]
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        *[o.model_dump(exclude_none=True) for o in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
    ]
    r = ask(client, input=items, tools=[TOOL], tool_choice="none", max_output_tokens=16,
            top_logprobs=0, extra_body=DET)  # fmt: skip
    calls = [
        {"id": o.call_id, "type": "function",
         "function": {"name": o.name, "arguments": o.arguments}}
        for o in first.output
        if o.type == "function_call"
    ]  # fmt: skip
    c = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
        ],
        tools=[CHAT_TOOL],
        tool_choice="none",
        max_tokens=16,
        logprobs=True,
        top_logprobs=0,
        extra_body=DET,
    )
    assert r.output_text == c.choices[0].message.content
    assert lp_bits(text_part(r).logprobs) == lp_bits(c.choices[0].logprobs.content)
    assert r.usage.input_tokens == c.usage.prompt_tokens


def test_previous_response_id_continues_the_stored_conversation(client) -> None:
    """A continuation renders as the whole conversation sent back in ``input`` (the same
    bits); stored responses are read and deleted by id; ``store=false`` keeps nothing."""
    first = ask(client, input="Weather in Paris?", tools=[TOOL], tool_choice="required",
                extra_body=DET)  # fmt: skip
    assert first.store is True
    call = next(o for o in first.output if o.type == "function_call")
    reply = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    common = {"tools": [TOOL], "tool_choice": "none", "max_output_tokens": 16,
              "top_logprobs": 0, "extra_body": DET}  # fmt: skip
    explicit = ask(
        client,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            *[o.model_dump(exclude_none=True) for o in first.output],
            reply,
        ],
        **common,
    )
    cont = ask(client, previous_response_id=first.id, input=[reply], **common)
    assert cont.previous_response_id == first.id
    assert cont.output_text == explicit.output_text
    assert lp_bits(text_part(cont).logprobs) == lp_bits(text_part(explicit).logprobs)
    assert cont.usage.input_tokens == explicit.usage.input_tokens
    # A chain of three: the second's conversation carries the first's.
    third = ask(client, previous_response_id=cont.id, input="And tomorrow?",
                **{**common, "max_output_tokens": 4})  # fmt: skip
    assert third.usage.input_tokens > cont.usage.input_tokens + cont.usage.output_tokens
    # Streamed answers are stored too.
    events = list(ask(client, input="Hello", max_output_tokens=4, stream=True, extra_body=DET))
    streamed = events[-1].response  # response.completed or .incomplete
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and [o.model_dump() for o in got.output] == [
        o.model_dump() for o in first.output
    ]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        ask(client, previous_response_id=first.id, input=[reply], **common)
    assert e.value.body["param"] == "previous_response_id"
    unstored = ask(client, input="Hi", store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_text_format_json_schema(client) -> None:
    fmt = {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA, "strict": True}
    r = ask(client, input="A city as JSON.", text={"format": fmt}, extra_body=DET)
    jsonschema.validate(json.loads(r.output_text), CITY_SCHEMA)
    assert r.text.format.type == "json_schema"
    r = ask(client, input="Any JSON.", text={"format": {"type": "json_object"}},
            max_output_tokens=64, extra_body=DET)  # fmt: skip
    assert r.status == "incomplete" or isinstance(json.loads(r.output_text), dict)


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"max_output_tokens": 5000}, "max_output_tokens"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": []}, "input"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0]"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0]",
        ),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
        ),
        ({"tools": [{**TOOL, "parameters": {"type": "string"}}]}, "tools[0].parameters"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"top_logprobs": 10_000}, "top_logprobs"),
        ({"include": ["file_search_call.results"]}, "include[0]"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"truncation": "auto"}, "truncation"),
        ({"temperature": 0.8, "extra_body": {"deterministic": True}}, "seed"),
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(client, kw, param) -> None:
    args = {"input": "x", **kw}
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, **args)
    assert e.value.body["param"] == param, e.value.body
    # still serving (sampled without a seed: it may also end by EOS within the two tokens)
    after = ask(client, input="still serving", max_output_tokens=2)
    assert after.status in {"incomplete", "completed"} and after.usage.output_tokens >= 1


def test_reasoning_effort_reaches_the_chat_template(tmp_path_factory, demo_model_dir) -> None:
    """Chat's ``reasoning_effort`` and the Responses API's ``reasoning.effort`` reach the
    template as ``reasoning_effort`` (as vLLM passes them), the same prompt as sending it in
    ``chat_template_kwargs``; an explicit template kwarg wins."""
    import shutil
    from pathlib import Path

    d = tmp_path_factory.mktemp("effort-model") / "m"
    shutil.copytree(demo_model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if reasoning_effort is defined %}effort {{ reasoning_effort }}\n{% endif %}"
        "assistant:"
    )
    (Path(d) / "tokenizer_config.json").write_text(json.dumps(cfg))
    s = start_server(tmp_path_factory, "effort", str(d), "--max-model-len", "256")
    try:
        c = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "hi"}]

        def prompt_ids(**kw) -> list[int]:
            extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
            r = c.chat.completions.create(
                model=SERVED_NAME, messages=msgs, max_tokens=1, extra_body=extra, **kw
            )
            return r.model_extra["prompt_token_ids"]

        plain = prompt_ids()
        high = prompt_ids(reasoning_effort="high")
        assert high != plain
        kwarg = prompt_ids(extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}})
        assert high == kwarg
        both = prompt_ids(
            reasoning_effort="high",
            extra_body={"chat_template_kwargs": {"reasoning_effort": "low"}},
        )
        assert both == prompt_ids(reasoning_effort="low")
        r = c.responses.create(
            model=SERVED_NAME, input="hi", max_output_tokens=1, reasoning={"effort": "high"}
        )
        assert r.usage.input_tokens == len(high)
    finally:
        assert s.stop() == 0
