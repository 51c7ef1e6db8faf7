"""``detspec serve`` through the real ``openai`` client (sync, async, streaming): every request
field reaches the engine (checked against the same request run in-process), response shapes,
``n > 1``, ``stop``, logprobs, usage, ``system_fingerprint``, the extension fields and the
non-``/v1`` routes."""

# ruff: noqa: F811  (pytest fixtures imported from server_fixtures)

from __future__ import annotations

import asyncio
import struct

import httpx
import numpy as np
import openai
import pytest
from server_fixtures import SERVED_NAME, demo_model_dir, server, sse_events  # noqa: F401

import detspec
from detspec import SamplingParams


def f32(x: float) -> bytes:
    return struct.pack("<f", x)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llm(demo_model_dir) -> detspec.LLM:
    """The server's engine configuration, in-process: deterministic requests must match it
    bit for bit."""
    return detspec.LLM(
        demo_model_dir,
        max_model_len=256,
        verify_strategy="replay",
        verify_window=8,
        verify_group=4,
        num_kv_pages=1024,
    )


def test_models_health_version(server, client, llm) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [SERVED_NAME]
    assert models.data[0].model_extra["max_model_len"] == 256
    assert httpx.get(server.base_url + "/health").status_code == 200
    v = httpx.get(server.base_url + "/version").json()
    assert v["version"] == detspec.__version__
    assert v["fingerprint"] == llm.fingerprint


# Every sampling field, each set away from its default; deterministic so that the in-process
# run is a valid reference whatever else the server runs.
FIELD_CASES = [
    dict(temperature=0.0, max_tokens=12),
    dict(temperature=0.8, seed=7, top_p=0.9, max_tokens=12),
    dict(temperature=1.0, seed=3, top_k=5, min_p=0.05, max_tokens=12),
    dict(temperature=0.0, presence_penalty=1.5, frequency_penalty=-0.5, max_tokens=12),
    dict(temperature=0.0, repetition_penalty=1.3, min_tokens=10, max_tokens=12, ignore_eos=True),
    dict(temperature=0.7, seed=11, n=3, max_tokens=10),
    dict(temperature=0.0, max_tokens=16, stop_token_ids=[5, 6, 7, 8, 9, 10]),
]
EXTRA_FIELDS = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
)


@pytest.mark.parametrize("case", FIELD_CASES, ids=lambda c: ",".join(c))
def test_completion_fields_reach_the_engine(client, llm, case) -> None:
    prompt = "The old lighthouse stood at the end"
    kw = {k: v for k, v in case.items() if k not in EXTRA_FIELDS}
    extra = {k: v for k, v in case.items() if k in EXTRA_FIELDS}
    r = client.completions.create(
        model=SERVED_NAME,
        prompt=prompt,
        logprobs=2,
        user="tester",
        extra_body={
            **extra,
            "deterministic": True,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        },
        **kw,
    )
    want = llm.generate(
        [prompt], SamplingParams(**case, logprobs=2, deterministic=True), use_tqdm=False
    )[0]
    assert r.object == "text_completion" and r.model == SERVED_NAME
    assert r.system_fingerprint == want.fingerprint
    assert len(r.choices) == len(want.outputs) == case.get("n", 1)
    for ch, w in zip(r.choices, want.outputs, strict=True):
        assert ch.index == w.index
        extra_fields = ch.model_extra
        assert extra_fields["token_ids"] == w.token_ids
        assert extra_fields["prompt_token_ids"] == want.prompt_token_ids
        assert ch.text == w.text
        assert ch.finish_reason == w.finish_reason
        assert extra_fields["stop_reason"] == w.stop_reason
        lp = ch.logprobs
        assert len(lp.tokens) == len(w.token_ids) == len(lp.token_logprobs)
        got_bits = [f32(x) for x in lp.token_logprobs]
        want_bits = [f32(d[t].logprob) for t, d in zip(w.token_ids, w.logprobs, strict=True)]
        assert got_bits == want_bits
        assert lp.tokens == [f"token_id:{t}" for t in w.token_ids]
        for top, d in zip(lp.top_logprobs, w.logprobs, strict=True):
            # the chosen token plus the top 2 (the chosen one may be among them)
            want_top = {f"token_id:{t}": f32(x.logprob) for t, x in d.items()}
            assert {k: f32(v) for k, v in top.items()} == want_top
        dvr = extra_fields["dvr_metrics"]
        assert dvr["deterministic"] is True
        assert dvr["num_verify_passes"] == want.metrics["num_verify_passes"] > 0
        assert dvr["num_rollbacks"] >= 0
        assert dvr["num_padded_rows"] == want.metrics["num_padded_rows"]
    total = sum(len(w.token_ids) for w in want.outputs)
    assert r.usage.completion_tokens == total
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.total_tokens == total + len(want.prompt_token_ids)
    if "stop_token_ids" in case and len(want.outputs[0].token_ids) < 16:
        assert r.choices[0].finish_reason == "stop"
        assert r.choices[0].model_extra["stop_reason"] in case["stop_token_ids"]


def test_stop_strings(client, llm) -> None:
    prompt = "Once upon a time"
    base = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(base.text) > 6, base.text
    stop = base.text[3:6]
    r = client.completions.create(
        model=SERVED_NAME,
        prompt=prompt,
        max_tokens=24,
        temperature=0.0,
        stop=[stop, "never-appears"],
        extra_body={"ignore_eos": True},
    )
    ch = r.choices[0]
    assert ch.finish_reason == "stop"
    assert ch.model_extra["stop_reason"] == stop
    assert ch.text == base.text[: base.text.index(stop)]
    # vLLM's include_stop_str_in_output: the text keeps the stop string, streamed or not
    kw = dict(model=SERVED_NAME, prompt=prompt, max_tokens=24, temperature=0.0, stop=[stop])
    extra = {"ignore_eos": True, "include_stop_str_in_output": True}
    kept = client.completions.create(**kw, extra_body=extra).choices[0]
    assert kept.text == ch.text + stop and kept.finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(**kw, extra_body=extra, stream=True)
    )
    assert streamed == kept.text


def test_batch_prompts_and_n(client, llm) -> None:
    prompts = [[5, 6, 7, 8], [100, 200, 300]]
    r = client.completions.create(
        model=SERVED_NAME,
        prompt=prompts,
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=5,
        extra_body={"deterministic": True, "return_token_ids": True, "ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    want = llm.generate(
        prompts,
        SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=5, deterministic=True,
                       ignore_eos=True),
        use_tqdm=False,
    )  # fmt: skip
    for i, ch in enumerate(r.choices):
        w = want[i // 2]
        assert ch.model_extra["prompt_token_ids"] == prompts[i // 2]
        assert ch.model_extra["token_ids"] == w.outputs[i % 2].token_ids
    assert r.choices[0].model_extra["token_ids"] != r.choices[1].model_extra["token_ids"]
    assert r.usage.prompt_tokens == 7 and r.usage.completion_tokens == 24
    # a single token-id prompt
    r1 = client.completions.create(model=SERVED_NAME, prompt=[5, 6, 7, 8], max_tokens=3)
    assert r1.usage.prompt_tokens == 4 and len(r1.choices) == 1


def test_completion_stream_matches_non_stream(client) -> None:
    kw = dict(
        model=SERVED_NAME,
        prompt="In the village below",
        max_tokens=20,
        temperature=0.8,
        seed=9,
        logprobs=1,
    )
    body = {"deterministic": True, "return_token_ids": True, "ignore_eos": True}
    full = client.completions.create(**kw, extra_body=body)
    chunks = list(
        client.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}, extra_body=body
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])
    body_chunks = chunks[:-1]
    assert "".join(c.choices[0].text for c in body_chunks) == full.choices[0].text
    ids = [t for c in body_chunks for t in c.choices[0].model_extra["token_ids"]]
    assert ids == full.choices[0].model_extra["token_ids"]
    lps = [x for c in body_chunks for x in c.choices[0].logprobs.token_logprobs]
    assert [f32(x) for x in lps] == [f32(x) for x in full.choices[0].logprobs.token_logprobs]
    assert body_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in body_chunks[:-1])
    assert body_chunks[-1].choices[0].model_extra["dvr_metrics"]["deterministic"] is True
    assert {c.system_fingerprint for c in chunks} == {full.system_fingerprint}


def test_chat_sync_and_stream(client, llm) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello, world! How are you today?"},
    ]
    r = client.chat.completions.create(
        model=SERVED_NAME,
        messages=messages,
        max_completion_tokens=12,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"deterministic": True, "return_token_ids": True, "ignore_eos": True},
    )
    want = llm.chat(
        messages,
        SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, deterministic=True,
                       ignore_eos=True),
        use_tqdm=False,
    )[0]  # fmt: skip
    ch = r.choices[0]
    assert r.object == "chat.completion"
    assert ch.message.role == "assistant" and ch.message.content == want.outputs[0].text
    assert r.model_extra["prompt_token_ids"] == want.prompt_token_ids
    assert ch.model_extra["token_ids"] == want.outputs[0].token_ids
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == 12
    content = ch.logprobs.content
    assert len(content) == 12
    for item, t, d in zip(content, want.outputs[0].token_ids, want.outputs[0].logprobs,
                          strict=True):  # fmt: skip
        assert f32(item.logprob) == f32(d[t].logprob)
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert bytes(item.bytes) == item.token.encode()
    assert r.system_fingerprint == want.fingerprint
    # streaming: role first, content deltas, usage last
    stream = client.chat.completions.create(
        model=SERVED_NAME,
        messages=messages,
        max_tokens=12,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"deterministic": True, "ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.outputs[0].text
    assert chunks[-1].usage.total_tokens == len(want.prompt_token_ids) + 12
    assert chunks[-2].choices[0].finish_reason == "length"


def test_chat_n_and_content_parts(client) -> None:
    r = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        n=3,
        max_tokens=5,
        temperature=1.0,
        seed=1,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 15
    assert len({tuple(c.model_extra["token_ids"]) for c in r.choices}) > 1
    assert all(c.model_extra["dvr_metrics"]["deterministic"] is False for c in r.choices)


async def test_async_client_concurrent_and_streaming(server, llm) -> None:
    aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    prompts = [f"The river wound {i}" for i in range(6)]
    rs = await asyncio.gather(
        *[
            aclient.completions.create(
                model=SERVED_NAME,
                prompt=p,
                max_tokens=8,
                temperature=0.0,
                extra_body={"deterministic": True, "ignore_eos": True},
            )
            for p in prompts
        ]
    )
    want = llm.generate(
        prompts,
        SamplingParams(max_tokens=8, temperature=0.0, deterministic=True, ignore_eos=True),
        use_tqdm=False,
    )
    assert [r.choices[0].text for r in rs] == [w.outputs[0].text for w in want]
    stream = await aclient.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=6,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    chunks = [chunk async for chunk in stream]
    # the engine may hand several tokens over in one output, so count tokens, not chunks
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].model_extra["prompt_token_ids"], "prompt ids ride on the first chunk"
    assert all("prompt_token_ids" not in c.model_extra for c in chunks[1:])
    assert sum(len(c.choices[0].model_extra["token_ids"]) for c in chunks) == 6
    assert chunks[-1].choices[0].finish_reason == "length"
    await aclient.close()


def test_prompt_logprobs(client, llm) -> None:
    ids = [11, 42, 77, 300, 5, 9]
    r = client.completions.create(
        model=SERVED_NAME, prompt=ids, max_tokens=2, extra_body={"prompt_logprobs": 3}
    )
    pl = r.choices[0].model_extra["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    logits = llm.compute_logits([ids])[0].astype(np.float64)
    ref = logits - logits.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    for pos in range(1, len(ids)):
        entry = pl[pos]
        tok = ids[pos]
        assert str(tok) in entry and 3 <= len(entry) <= 4
        assert entry[str(tok)]["logprob"] == pytest.approx(ref[pos - 1, tok], abs=1e-4)
        assert entry[str(tok)]["rank"] == int((ref[pos - 1] > ref[pos - 1, tok]).sum()) + 1
        ranks = sorted(v["rank"] for k, v in entry.items() if k != str(tok) or v["rank"] <= 3)
        assert ranks[:3] == [1, 2, 3]
    # The same numbers as the offline API, exactly (one engine function computes both).
    (offline,) = llm.generate(
        [ids], SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False
    )
    for pos in range(1, len(ids)):
        got = {int(t): v["logprob"] for t, v in pl[pos].items()}
        assert got == {t: lp.logprob for t, lp in offline.prompt_logprobs[pos].items()}
    chat = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 0, "return_token_ids": True},
    )
    assert len(chat.model_extra["prompt_logprobs"]) == len(chat.model_extra["prompt_token_ids"])


def test_usage_counts_prompt_tokens_read_from_the_prefix_cache(client) -> None:
    """OpenAI's ``usage.prompt_tokens_details.cached_tokens``: 0 the first time a prompt runs,
    every full page but the last token's after (JSON and the stream's last chunk)."""
    prompt = [int(x) for x in np.random.default_rng(99).integers(3, 900, size=50)]
    first = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=2)
    full_pages = (len(prompt) - 1) // 16 * 16
    assert again.usage.prompt_tokens_details.cached_tokens == full_pages
    chunks = list(
        client.completions.create(
            model=SERVED_NAME,
            prompt=[prompt, prompt],
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 2 * full_pages

    # A conversation's next turn, sent as ids (prompt + answer + more), reads the answer's
    # pages too: every full page before the answer's last token.
    turn1 = client.completions.create(
        model=SERVED_NAME,
        prompt=prompt,
        max_tokens=30,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    answer = turn1.choices[0].model_extra["token_ids"]
    assert len(answer) == 30
    turn2 = client.completions.create(
        model=SERVED_NAME, prompt=prompt + answer + [5, 6, 7], max_tokens=2
    )
    read = (len(prompt) + len(answer) - 1) // 16 * 16
    assert turn2.usage.prompt_tokens_details.cached_tokens == read


def test_skip_special_tokens_false(client, llm) -> None:
    r = client.completions.create(
        model=SERVED_NAME,
        prompt="Hello",
        max_tokens=10,
        temperature=0.0,
        extra_body={"skip_special_tokens": False, "return_token_ids": True, "ignore_eos": True},
    )
    ids = r.choices[0].model_extra["token_ids"]
    assert r.choices[0].text == llm.get_tokenizer().decode(ids, skip_special_tokens=False)


def test_tokenize_detokenize(server, client, llm) -> None:
    t = httpx.post(server.base_url + "/tokenize", json={"prompt": "Hello, world!"}).json()
    assert t["tokens"] == llm.get_tokenizer().encode("Hello, world!")
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 256
    d = httpx.post(server.base_url + "/detokenize", json={"tokens": t["tokens"]}).json()
    assert d["prompt"] == llm.get_tokenizer().decode(t["tokens"])
    messages = [{"role": "user", "content": "Hi there"}]
    tc = httpx.post(server.base_url + "/tokenize", json={"messages": messages}).json()
    r = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=1)
    assert tc["count"] == r.usage.prompt_tokens


@pytest.mark.parametrize("final", ["The answer is", "  Paris, then  ", "say:\n", "x y"])
def test_continue_final_message(server, client, demo_model_dir, final) -> None:
    """vLLM's ``continue_final_message``: the prompt ends with the last message's content,
    as transformers renders it, and the answer continues it (the same bits as a completion
    of those tokens)."""
    from transformers import AutoTokenizer

    conv = [{"role": "user", "content": "Where is it?"}, {"role": "assistant", "content": final}]
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    text = tok.apply_chat_template(
        conv, continue_final_message=True, add_generation_prompt=False, tokenize=False
    )
    assert not text.endswith("</s>\n") and final.strip() in text
    want = tok.encode(text, add_special_tokens=False)
    body = {"messages": conv, "add_generation_prompt": False, "continue_final_message": True}
    got = httpx.post(server.base_url + "/tokenize", json=body).json()["tokens"]
    assert got == list(want)
    kw = dict(model=SERVED_NAME, max_tokens=6, temperature=0.7, seed=9)
    extra = {"deterministic": True, "ignore_eos": True, "return_token_ids": True}
    chat = client.chat.completions.create(
        messages=conv,
        logprobs=True,
        extra_body={**extra, "add_generation_prompt": False, "continue_final_message": True},
        **kw,
    ).choices[0]
    cmpl = client.completions.create(prompt=got, logprobs=0, extra_body=extra, **kw).choices[0]
    assert chat.model_extra["token_ids"] == cmpl.model_extra["token_ids"]
    assert [e.logprob for e in chat.logprobs.content] == cmpl.logprobs.token_logprobs


def test_continue_final_message_errors(server) -> None:
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well"}]
    url = server.base_url + "/v1/chat/completions"
    r = httpx.post(url, json={"messages": conv, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    body = {"messages": conv, "chat_template_kwargs": {"continue_final_message": True}}
    r = httpx.post(url, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_metrics_names(server, client) -> None:
    client.completions.create(
        model=SERVED_NAME,
        prompt="Hello",
        max_tokens=4,
        temperature=0.0,
        extra_body={"deterministic": True},
    )
    m = server.metrics()
    names = {k.split("{")[0] for k in m}
    for want in (
        "detspec:num_requests_running",
        "detspec:num_requests_waiting",
        "detspec:kv_cache_usage_perc",
        "detspec:prompt_tokens_total",
        "detspec:generation_tokens_total",
        "detspec:time_to_first_token_seconds_bucket",
        "detspec:inter_token_latency_seconds_bucket",
        "detspec:e2e_request_latency_seconds_count",
        "detspec:num_preemptions_total",
        "detspec:deterministic_requests_total",
        "detspec:verify_passes_total",
        "detspec:rollbacks_total",
        "detspec:rolled_back_tokens_total",
        "detspec:padded_verify_rows_total",
        "detspec:request_success_total",
    ):
        assert want in names, want
    assert server.metric("detspec:deterministic_requests_total") >= 1
    assert server.metric("detspec:verify_passes_total") >= 1
    assert server.metric("detspec:generation_tokens_total") >= 4
    assert all(k.startswith("detspec:") for k in m), "every series carries the prefix"


def test_metrics_count_exactly(server, client) -> None:
    def snap() -> dict[str, float]:
        m = server.metrics()
        return {
            "prompt": server.metric("detspec:prompt_tokens_total"),
            "gen": server.metric("detspec:generation_tokens_total"),
            "e2e": server.metric("detspec:e2e_request_latency_seconds_count"),
            "ttft": server.metric("detspec:time_to_first_token_seconds_count"),
            "length": m.get(
                f'detspec:request_success_total{{finished_reason="length",'
                f'model_name="{SERVED_NAME}"}}',
                0.0,
            ),
            "det": server.metric("detspec:deterministic_requests_total"),
        }

    before = snap()
    client.completions.create(
        model=SERVED_NAME,
        prompt=[[7, 8, 9, 10, 11], [12, 13]],
        n=2,
        max_tokens=4,
        temperature=0.0,
        extra_body={"ignore_eos": True, "deterministic": True},
    )
    after = snap()
    delta = {k: after[k] - before[k] for k in before}
    assert delta == {"prompt": 7, "gen": 16, "e2e": 2, "ttft": 2, "length": 4, "det": 2}, delta


def test_cache_salt_confines_prefix_cache_hits(server, client) -> None:
    """vLLM's ``cache_salt``: a prompt's cached pages are found only by requests with the same
    salt (multi-tenant isolation); the outputs do not change. Also through ``prompt_logprobs``
    (scored first, its pages cached under the salt) and chat; an empty salt is refused."""
    prompt = [int(x) for x in np.random.default_rng(4242).integers(5, 900, size=80)]

    def complete(salt: str | None, **extra):
        body = {"deterministic": True, **extra}
        if salt is not None:
            body["cache_salt"] = salt
        r = client.completions.create(
            model=SERVED_NAME,
            prompt=prompt,
            max_tokens=4,
            temperature=0.0,
            logprobs=1,
            extra_body=body,
        )
        lps = [f32(x) for x in r.choices[0].logprobs.token_logprobs]
        return r.usage.prompt_tokens_details.cached_tokens, (r.choices[0].text, lps)

    cached_a, out = complete("tenant-a")
    assert cached_a == 0
    for salt in ("tenant-b", None):
        cached, got = complete(salt)
        assert cached == 0, f"{salt!r} read tenant-a's pages"
        assert got == out
    cached, got = complete("tenant-a")
    assert cached > 0 and got == out
    # prompt_logprobs leave the prompt's pages under the request's salt, for it alone.
    cached, got = complete("tenant-c", prompt_logprobs=1)
    assert got == out
    assert complete("tenant-c")[0] > 0
    assert complete("tenant-d")[0] == 0
    chat = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=2,
        extra_body={"cache_salt": "tenant-a"},
    )
    assert chat.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError) as e:
        complete("")
    assert "cache_salt" in str(e.value)
