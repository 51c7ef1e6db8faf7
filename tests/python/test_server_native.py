"""SGLang's native ``POST /generate`` against a real ``detspec serve`` over loopback HTTP,
driven as slime and other SGLang-based RL stacks drive it (httpx, JSON bodies):

* a deterministic request equals, bit for bit, the same request through ``/v1/completions``
  (token ids, the sampled tokens' logprobs, the prompt's logprobs), alone and among
  concurrent plain requests; a plain one's logprobs move with the batch (negative control);
* batches of prompts, ``n``, per-prompt ``sampling_params``, ``rid``, stop strings and
  lengths in SGLang's ``finish_reason``; streaming events add up to the non-streamed output;
* bad requests get a 400 naming this API's field, and the server keeps serving.
"""

# ruff: noqa: F811  (pytest fixtures imported from server_fixtures)

from __future__ import annotations

import asyncio
import struct
from typing import Any

import httpx
import numpy as np
import pytest
from server_fixtures import (  # noqa: F401
    API_KEY,
    ServerProcess,
    demo_model_dir,
    guarded_server,
    server,
    sse_events,
)

PROMPTS = [[int(x) for x in np.random.default_rng(s).integers(3, 900, size=n)]
           for s, n in ((11, 23), (12, 40), (13, 17))]  # fmt: skip


def f32(x: float | None) -> bytes | None:
    return None if x is None else struct.pack("<f", x)


def generate(srv: ServerProcess, body: dict[str, Any], status: int = 200) -> Any:
    r = httpx.post(srv.base_url + "/generate", json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def sampled(seed: int = 7, **kw: Any) -> dict[str, Any]:
    return {"temperature": 0.8, "sampling_seed": seed, "max_new_tokens": 24, "ignore_eos": True,
            **kw}  # fmt: skip


def completion(srv: ServerProcess, prompt: list[int], deterministic: bool) -> dict[str, Any]:
    r = httpx.post(
        srv.base_url + "/v1/completions",
        json={"prompt": prompt, "temperature": 0.8, "seed": 7, "max_tokens": 24,
              "ignore_eos": True, "logprobs": 0, "return_token_ids": True,
              "deterministic": deterministic},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_deterministic_generate_equals_completions_bit_for_bit(server) -> None:
    out = generate(
        server,
        {"input_ids": PROMPTS[0], "sampling_params": sampled(), "return_logprob": True,
         "top_logprobs_num": 2, "logprob_start_len": 0, "deterministic": True},
    )  # fmt: skip
    ref = completion(server, PROMPTS[0], True)
    assert out["output_ids"] == ref["token_ids"]
    assert out["text"] == ref["text"]
    meta = out["meta_info"]
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    assert [f32(lp) for lp, _, _ in lps] == [f32(x) for x in ref["logprobs"]["token_logprobs"]]
    assert all(len(top) == 2 and top[0][0] >= top[1][0] for top in meta["output_top_logprobs"])
    assert meta["finish_reason"] == {"type": "length", "length": 24}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(PROMPTS[0]), 24)
    assert meta["dvr_metrics"]["deterministic"] is True
    # Its prompt was scored first; the generation read the scored pages.
    assert meta["cached_tokens"] == (len(PROMPTS[0]) - 1) // 16 * 16 > 0
    models = httpx.get(server.base_url + "/v1/models", timeout=10).json()
    assert meta["fingerprint"] == models["data"][0]["fingerprint"]
    assert meta["weight_version"] == "0"
    # The prompt's logprobs: the first token has none; the rest equal echo's, bit for bit.
    inputs = meta["input_token_logprobs"]
    assert [t for _, t, _ in inputs] == PROMPTS[0] and inputs[0][0] is None
    echo = httpx.post(
        server.base_url + "/v1/completions",
        json={"prompt": PROMPTS[0], "max_tokens": 0, "echo": True, "logprobs": 0,
              "deterministic": True},
        timeout=60,
    ).json()["choices"][0]["logprobs"]["token_logprobs"]  # fmt: skip
    assert [f32(lp) for lp, _, _ in inputs] == [f32(x) for x in echo]
    assert meta["input_top_logprobs"][0] is None


async def _among_plain(srv: ServerProcess, deterministic: bool) -> list[bytes | None]:
    """The target's logprob bits while 6 plain requests of other lengths run beside it."""
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as client:

        async def one(body: dict[str, Any]) -> dict[str, Any]:
            r = await client.post("/generate", json=body)
            assert r.status_code == 200, r.text
            return r.json()

        others = [
            one({"input_ids": PROMPTS[i % 3][: 5 + 3 * i], "sampling_params": sampled(i)})
            for i in range(6)
        ]
        target = one({"input_ids": PROMPTS[1], "sampling_params": sampled(),
                      "return_logprob": True, "deterministic": deterministic})  # fmt: skip
        res = await asyncio.gather(target, *others)
    return [f32(lp) for lp, _, _ in res[0]["meta_info"]["output_token_logprobs"]]


@pytest.mark.parametrize("deterministic", [True, False])
def test_batched_generate_keeps_deterministic_bits_and_plain_ones_move(
    server, deterministic: bool
) -> None:
    body = {"input_ids": PROMPTS[1], "sampling_params": sampled(), "return_logprob": True,
            "deterministic": deterministic}  # fmt: skip
    solo = [f32(lp) for lp, _, _ in generate(server, body)["meta_info"]["output_token_logprobs"]]
    rounds = [asyncio.run(_among_plain(server, deterministic)) for _ in range(6)]
    if deterministic:
        assert all(r == solo for r in rounds), "a deterministic /generate moved in a batch"
    else:
        assert any(r != solo for r in rounds), (
            "plain /generate logprobs never moved with the batch: the test cannot see variance"
        )


def test_batch_n_per_prompt_params_rids_and_finish_reasons(server) -> None:
    out = generate(
        server,
        {"input_ids": PROMPTS[:2],
         "sampling_params": [sampled(1, n=2), {"temperature": 0.0, "max_new_tokens": 5}],
         "rid": ["a", "b"], "deterministic": True},
    )  # fmt: skip
    assert isinstance(out, list) and len(out) == 3  # n = 2, then n = 1
    assert [o["meta_info"]["id"] for o in out] == ["a-0", "a-1", "b"]
    assert out[0]["output_ids"] != out[1]["output_ids"]  # two samples
    assert [o["meta_info"]["completion_tokens"] for o in out] == [24, 24, 5]
    # A stop string: SGLang's finish reason names it; text ends before it.
    det = {"input_ids": PROMPTS[2], "deterministic": True}
    first = generate(server, {**det, "sampling_params": sampled()})
    stop = first["text"][5:9]
    assert len(stop) == 4, first["text"]
    shown = {"skip_special_tokens": False}  # as slime sends it
    got = generate(server, {**det, "sampling_params": sampled(stop=stop, **shown)})
    reason = got["meta_info"]["finish_reason"]
    assert reason == {"type": "stop", "matched": stop}, reason
    assert stop not in got["text"]
    # What slime sends: the stop string stays (SGLang's no_stop_trim), ids unchanged.
    kept = generate(
        server,
        {**det, "return_logprob": True,
         "sampling_params": sampled(stop=stop, no_stop_trim=True, **shown,
                                    spaces_between_special_tokens=False)},
    )  # fmt: skip
    assert kept["text"] == got["text"] + stop
    assert kept["output_ids"] == got["output_ids"]
    # A single prompt with n = 1 is an object, not a list.
    single = generate(server, {"input_ids": PROMPTS[2], "sampling_params": {"max_new_tokens": 3}})
    assert isinstance(single, dict) and len(single["output_ids"]) <= 3


def test_stream_events_add_up_to_the_output(server) -> None:
    body = {"input_ids": PROMPTS[0], "sampling_params": sampled(n=2), "return_logprob": True,
            "deterministic": True}  # fmt: skip
    whole = generate(server, body)
    with httpx.stream(
        "POST", server.base_url + "/generate", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    last: dict[int, dict[str, Any]] = {}
    for e in events[:-1]:
        assert isinstance(e, dict) and "index" in e
        seen = last.get(e["index"])
        if seen is not None:  # cumulative: each event extends the one before
            assert e["output_ids"][: len(seen["output_ids"])] == seen["output_ids"]
        last[e["index"]] = e
    assert sorted(last) == [0, 1]
    for i in (0, 1):
        assert last[i]["output_ids"] == whole[i]["output_ids"]
        assert last[i]["text"] == whole[i]["text"]
        assert (
            last[i]["meta_info"]["output_token_logprobs"]
            == whole[i]["meta_info"]["output_token_logprobs"]
        )
        assert last[i]["meta_info"]["finish_reason"] == {"type": "length", "length": 24}


def test_rescoring_a_rollout_as_a_prompt_gives_its_logprobs(server) -> None:
    """What slime does for old logprobs: the rollout sent back as a prompt with
    ``max_new_tokens: 0`` and ``logprob_start_len`` at the completion; on invariant kernels
    (this server's) the prompt logprobs are the sampled ones, bit for bit."""
    body = {"input_ids": PROMPTS[1], "sampling_params": sampled(), "return_logprob": True,
            "deterministic": True}  # fmt: skip
    out = generate(server, body)
    again = generate(
        server,
        {"input_ids": PROMPTS[1] + out["output_ids"], "return_logprob": True,
         "logprob_start_len": len(PROMPTS[1]), "deterministic": True,
         "sampling_params": {"max_new_tokens": 0}},
    )  # fmt: skip
    inputs = again["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in inputs] == out["output_ids"]
    sampled_lps = [f32(lp) for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert [f32(lp) for lp, _, _ in inputs] == sampled_lps


def test_prompt_logprobs_only_and_text_prompts(server) -> None:
    out = generate(
        server,
        {"text": ["hello there", "a second prompt"], "return_logprob": True,
         "logprob_start_len": 1, "return_text_in_logprobs": True,
         "sampling_params": {"max_new_tokens": 0}, "deterministic": True},
    )  # fmt: skip
    assert len(out) == 2
    for o in out:
        assert o["output_ids"] == [] and o["text"] == ""
        inputs = o["meta_info"]["input_token_logprobs"]
        assert len(inputs) == o["meta_info"]["prompt_tokens"] - 1
        assert all(lp is not None and isinstance(text, str) for lp, _, text in inputs)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input_ids": [1, 2], "text": "x"}, "input_ids"),
        ({}, "input_ids"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**6}},
         "sampling_params.max_new_tokens"),
        ({"input_ids": [1, 2], "deterministic": True, "sampling_params": {"temperature": 0.5}},
         "sampling_params.sampling_seed"),
        ({"input_ids": [1, 2], "sampling_params": {"regex": "("}}, "sampling_params.regex"),
        ({"input_ids": [1, 2], "sampling_params": {"typo": 1}}, "sampling_params.typo"),
        ({"input_ids": [1, 2], "return_routed_experts": True}, "return_routed_experts"),
        ({"input_ids": [[1, 2], [3]], "sampling_params": [{}]}, "sampling_params"),
        ({"input_ids": [1, 2], "return_hidden_states": True}, "return_hidden_states"),
        ({"input_ids": [1, 10**9]}, "input_ids"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_field_and_the_server_keeps_serving(server, body, param) -> None:
    err = generate(server, body, status=400)
    assert err["error"]["param"] == param, err
    ok = generate(server, {"input_ids": PROMPTS[2], "sampling_params": {"max_new_tokens": 2}})
    assert len(ok["output_ids"]) <= 2


def test_the_api_key_guards_generate(guarded_server) -> None:
    body = {"input_ids": PROMPTS[2], "sampling_params": {"max_new_tokens": 2}}
    r = httpx.post(guarded_server.base_url + "/generate", json=body, timeout=30)
    assert r.status_code == 401
    r = httpx.post(
        guarded_server.base_url + "/generate",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
