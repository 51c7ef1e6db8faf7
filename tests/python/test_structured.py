"""Structured outputs and logit_bias through the Python API: outputs satisfy their constraint,
a constrained deterministic request is bitwise identical alone and in a batch (with a negative
control), and bad constraints and biases raise ``InvalidRequestError`` naming the field."""

from __future__ import annotations

import json
import re

import pytest

# isort: split
from detspec import SamplingParams, StructuredOutputsParams
from detspec.errors import InvalidRequestError

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "rain": {"type": "boolean"},
    },
    "required": ["city", "days", "rain"],
    "additionalProperties": False,
}

PROMPTS = [[5, 17, 33, 2], [40, 41, 42, 43, 44, 45, 46], [9]]


@pytest.fixture(scope="module")
def llm(llm_factory):
    return llm_factory("llama")


def constrained(structured: StructuredOutputsParams, seed: int = 3, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0.8)
    kw.setdefault("max_tokens", 80)
    return SamplingParams(seed=seed, structured_outputs=structured, **kw)


def finished(out) -> bool:
    return out.outputs[0].finish_reason == "stop"


def test_json_schema_outputs_parse_and_follow_the_schema(llm):
    params = [constrained(StructuredOutputsParams(json=SCHEMA), seed=s) for s in range(6)]
    outs = llm.generate([PROMPTS[s % 3] for s in range(6)], params)
    done = [o for o in outs if finished(o)]
    assert len(done) >= 3, [o.outputs[0].text for o in outs]
    for o in done:
        v = json.loads(o.outputs[0].text)
        assert set(v) == {"city", "days", "rain"}
        assert isinstance(v["city"], str) and len(v["city"]) <= 10
        assert isinstance(v["days"], int) and 1 <= v["days"] <= 14
        assert isinstance(v["rain"], bool)


@pytest.mark.parametrize(
    ("structured", "check"),
    [
        (StructuredOutputsParams(regex=r"[A-Z][a-z]{2,6} [0-9]{2}"), None),
        (StructuredOutputsParams(choice=["sunny", "rain (heavy)", "snow?"]), None),
        (StructuredOutputsParams(grammar='start: "x=" NUM ";"\nNUM: /[0-9]{1,4}/\n'), None),
        (StructuredOutputsParams(json_object=True), None),
    ],
    ids=["regex", "choice", "grammar", "json_object"],
)
def test_regex_choice_grammar_and_json_object(llm, structured, check):
    outs = llm.generate(
        [PROMPTS[s % 3] for s in range(4)],
        [constrained(structured, seed=s) for s in range(4)],
    )
    done = [o.outputs[0].text for o in outs if finished(o)]
    assert done, [o.outputs[0].text for o in outs]
    for text in done:
        if structured.regex:
            assert re.fullmatch(structured.regex, text), text
        elif structured.choice:
            assert text in structured.choice, text
        elif structured.grammar:
            assert re.fullmatch(r"x=[0-9]{1,4};", text), text
        else:
            assert isinstance(json.loads(text), dict), text


def test_constrained_logprobs_are_those_of_the_masked_distribution(llm):
    p = constrained(StructuredOutputsParams(choice=["yes", "no"]), logprobs=5)
    out = llm.generate([PROMPTS[0]], p)[0].outputs[0]
    first = out.logprobs[0]
    # Only grammar-allowed tokens have a finite logprob, so the alternatives are few.
    assert all(lp.logprob > float("-inf") for lp in first.values())
    assert len(first) <= 1 + 5


def test_logit_bias_forces_and_bans_tokens(llm):
    greedy = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
    forced = llm.generate([PROMPTS[1]], SamplingParams(logit_bias={77: 100.0}, **greedy))
    assert forced[0].outputs[0].token_ids == [77] * 6
    plain = llm.generate([PROMPTS[1]], SamplingParams(**greedy))[0].outputs[0].token_ids
    banned = (
        llm.generate(
            [PROMPTS[1]], SamplingParams(logit_bias={t: -100.0 for t in set(plain)}, **greedy)
        )[0]
        .outputs[0]
        .token_ids
    )
    assert not set(banned) & set(plain)


def test_constrained_deterministic_request_is_bitwise_identical_in_a_batch(llm_factory):
    llm = llm_factory("llama", fault_injection=0.3)
    target = constrained(
        StructuredOutputsParams(json=SCHEMA),
        seed=21,
        deterministic=True,
        logit_bias={10: 3.0},
        logprobs=2,
    )
    alone = llm.generate([PROMPTS[1]], target)[0].outputs[0]
    for k in range(3):
        others = [
            SamplingParams(temperature=1.0, seed=100 + i, max_tokens=5 + 9 * i, ignore_eos=True)
            if i % 2
            else constrained(StructuredOutputsParams(json_object=True), seed=200 + i)
            for i in range(3 + 4 * k)
        ]
        mid = len(others) // 2
        prompts = [PROMPTS[i % 3] + [i] * (i * 3) for i in range(len(others))]
        outs = llm.generate(
            prompts[:mid] + [PROMPTS[1]] + prompts[mid:], others[:mid] + [target] + others[mid:]
        )
        got = outs[mid].outputs[0]
        assert got.token_ids == alone.token_ids
        assert got.text == alone.text
        assert [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids, strict=True)] == [
            lp[t].logprob for lp, t in zip(alone.logprobs, alone.token_ids, strict=True)
        ]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"structured_outputs": StructuredOutputsParams(json="{not json")}, "json"),
        ({"structured_outputs": StructuredOutputsParams(json={"type": "nope"})}, "json"),
        ({"structured_outputs": StructuredOutputsParams(regex="a(b")}, "regex"),
        ({"structured_outputs": StructuredOutputsParams(grammar="start: x\nx: y\n")}, "grammar"),
        ({"structured_outputs": StructuredOutputsParams(choice=[])}, "choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, None),
        ({"structured_outputs": {"jsonn": "{}"}}, "jsonn"),
        ({"logit_bias": {3: 150.0}}, None),
        ({"logit_bias": {10**6: 1.0}}, None),
        ({"logit_bias": {"x": 1.0}}, None),
    ],
)
def test_bad_constraints_and_biases_name_the_field(llm, kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, **kwargs))
    want = next(iter(kwargs))
    if param is not None:
        want = f"{want}.{param}"
    assert e.value.param == want, str(e.value)
    # The engine keeps serving.
    assert llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
