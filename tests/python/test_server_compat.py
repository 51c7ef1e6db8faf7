"""What vLLM users' requests carry beyond the core fields, over real HTTP.

* The model's ``generation_config.json`` supplies the sampling fields a request leaves unset
  (``--generation-config auto``, vLLM's default): temperature, top-k, ..., and
  ``max_new_tokens`` as a cap on an absent ``max_tokens``; values equal to transformers'
  defaults are not defaults; ``vllm`` turns them off; other defaults than the model's own are
  named in the fingerprint.
* OpenAI fields that do not change the output (``metadata``, ``store``, ``service_tier``, ...)
  and the history fields the ``openai`` client sends back (``refusal``, ``annotations``, ...)
  are accepted; vLLM's ``request_id``, ``truncate_prompt_tokens`` and ``documents`` work;
  neutral-only fields (``priority``, ``use_beam_search``) refuse other values, naming them.
* ``--max-logprobs`` bounds every top-logprobs field (``test_server_errors``: the default 20).
"""

# ruff: noqa: F811  (pytest fixtures imported from server_fixtures)

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_fixtures import (  # noqa: F401
    SERVED_NAME,
    ServerProcess,
    demo_model_dir,
    start_server,
)

from detspec.server import generation_config as G
from detspec.server.serve import request_sampling_defaults
from detspec.server.serve_flags import add_app_arguments

# Greedy by default, at most 6 tokens; top_k 50 is transformers' default, so not a default.
GEN_CONFIG = {"temperature": 0.0, "top_k": 50, "max_new_tokens": 6, "do_sample": True}
# Renders retrieval documents before the conversation (transformers' `documents` variable).
DOCS_TEMPLATE = (
    "{% if documents %}{% for d in documents %}[doc] {{ d['text'] }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def compat_model_dir(demo_model_dir, tmp_path_factory) -> str:
    d = Path(tmp_path_factory.mktemp("compat-model")) / "m"
    shutil.copytree(demo_model_dir, d)
    gen_path = d / G.FILE_NAME
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen_path.write_text(json.dumps({**gen, **GEN_CONFIG}))
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = DOCS_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return str(d)


@pytest.fixture(scope="module")
def compat_server(tmp_path_factory, compat_model_dir) -> Iterator[ServerProcess]:
    s = start_server(
        tmp_path_factory,
        "compat",
        compat_model_dir,
        "--max-model-len",
        "256",
        "--num-kv-pages",
        "512",
        "--max-logprobs",
        "30",
    )
    yield s
    assert s.stop() == 0, s.log()


def client(s: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="none", max_retries=0)


def f32_bits(xs: list[float]) -> list[bytes]:
    return [struct.pack("<f", x) for x in xs]


MESSAGES = [{"role": "user", "content": "tell me about the sea"}]


# ------------------------------------------------------------------ generation config


def test_diff_semantics_override_and_vllm(tmp_path: Path) -> None:
    (tmp_path / G.FILE_NAME).write_text(
        json.dumps(
            {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "min_p": 0.05, "bos_token_id": 1}
        )
    )
    model = str(tmp_path)
    # 1.0 and 50 are transformers' defaults: not defaults; min_p and top_p are.
    assert G.sampling_defaults("auto", model) == {"top_p": 0.9, "min_p": 0.05}
    # An override is kept as given, even at transformers' default value.
    assert G.sampling_defaults("auto", model, {"temperature": 1.0, "max_new_tokens": 9}) == {
        "top_p": 0.9,
        "min_p": 0.05,
        "temperature": 1.0,
        "max_tokens": 9,
    }
    assert G.sampling_defaults("vllm", model) == {}
    other = tmp_path / "other"
    other.mkdir()
    (other / G.FILE_NAME).write_text(json.dumps({"temperature": 0.3}))
    assert G.sampling_defaults(str(other), model) == {"temperature": 0.3}
    with pytest.raises(G.GenerationConfigError, match="no generation_config.json"):
        G.sampling_defaults(str(tmp_path / "missing"), model)
    with pytest.raises(G.GenerationConfigError, match="top_k"):
        G.sampling_defaults("auto", model, {"top_k": "20"})
    G.check({"top_p": 0.9, "min_p": 0.05, "max_tokens": 9})
    # The engine's own rules refuse what it cannot sample with.
    with pytest.raises(G.GenerationConfigError, match="top_p"):
        G.check({"top_p": 0.0})
    with pytest.raises(G.GenerationConfigError, match="max_new_tokens"):
        G.check({"max_tokens": 0})


def test_fingerprint_names_defaults_other_than_the_models(compat_model_dir) -> None:
    p = argparse.ArgumentParser()
    add_app_arguments(p)
    own, suffix = request_sampling_defaults(p.parse_args([compat_model_dir]), compat_model_dir)
    assert own == {"temperature": 0.0, "max_tokens": 6} and suffix == ""
    none, suffix = request_sampling_defaults(
        p.parse_args([compat_model_dir, "--generation-config", "vllm"]), compat_model_dir
    )
    assert none == {} and suffix.startswith("+gen")
    over, suffix2 = request_sampling_defaults(
        p.parse_args([compat_model_dir, "--override-generation-config", '{"temperature": 0.7}']),
        compat_model_dir,
    )
    assert over["temperature"] == 0.7 and suffix2.startswith("+gen") and suffix2 != suffix


def test_unset_fields_take_the_generation_config(compat_server) -> None:
    c = client(compat_server)
    base = {"model": SERVED_NAME, "messages": MESSAGES, "extra_body": {"ignore_eos": True}}
    r = c.chat.completions.create(**base, logprobs=True)
    # max_new_tokens caps an absent max_tokens ...
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    assert "+gen" not in r.system_fingerprint
    # SGLang's clients read them as the server's preferred sampling parameters.
    info = httpx.get(f"{compat_server.base_url}/get_model_info", timeout=30).json()
    assert json.loads(info["preferred_sampling_params"]) == {
        "max_new_tokens": 6,
        "temperature": 0.0,
    }
    # ... but not a given one.
    r10 = c.chat.completions.create(**base, max_tokens=10)
    assert r10.usage.completion_tokens == 10
    # temperature 0 from the file: the same tokens and logprob bits as an explicit greedy request.
    greedy = c.chat.completions.create(**base, temperature=0.0, max_tokens=6, logprobs=True)

    def ids_and_bits(resp) -> tuple[list[str], list[bytes]]:
        content = resp.choices[0].logprobs.content
        return [t.token for t in content], f32_bits([t.logprob for t in content])

    assert ids_and_bits(r) == ids_and_bits(greedy)
    # Negative control: sampling at 1.0 leaves the greedy path for some seed.
    sampled = [
        ids_and_bits(
            c.chat.completions.create(**base, temperature=1.0, seed=s, max_tokens=6, logprobs=True)
        )[0]
        for s in range(4)
    ]
    assert any(t != ids_and_bits(greedy)[0] for t in sampled)


# ------------------------------------------------------------------ request fields


def test_openai_bookkeeping_fields_and_history_objects(compat_server) -> None:
    c = client(compat_server)
    first = c.chat.completions.create(
        model=SERVED_NAME,
        messages=MESSAGES,
        max_tokens=4,
        metadata={"run": "eval-7"},
        store=False,
        service_tier="auto",
        extra_body={
            "prompt_cache_key": "user-1",
            "safety_identifier": "h-123",
            "priority": 0,
            "use_beam_search": False,
        },
    )
    # The client's own message object sent back as history, with the fields it carries.
    answer = first.choices[0].message.model_dump()
    answer.update(refusal=None, annotations=[], audio=None, function_call=None)
    second = c.chat.completions.create(
        model=SERVED_NAME,
        messages=[*MESSAGES, answer, {"role": "user", "content": "more"}],
        max_tokens=4,
    )
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"priority": 1}, "priority"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"length_penalty": 0.5}, "length_penalty"),
        ({"service_tier": "fastest"}, "service_tier"),
        ({"verbosity": "low"}, "verbosity"),
    ],
)
def test_fields_that_would_change_the_output_are_refused(compat_server, extra, field) -> None:
    body = {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 2, **extra}
    r = httpx.post(f"{compat_server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert field in r.text


def test_history_fields_with_content_are_refused(compat_server) -> None:
    refusing = {"role": "assistant", "content": None, "refusal": "I cannot"}
    body = {"model": SERVED_NAME, "messages": [*MESSAGES, refusing], "max_tokens": 2}
    r = httpx.post(f"{compat_server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "refusal" in r.text, r.text


def test_request_id_names_the_response_and_may_repeat(compat_server) -> None:
    async def run() -> list[str]:
        c = openai.AsyncOpenAI(
            base_url=f"{compat_server.base_url}/v1", api_key="none", max_retries=0
        )
        rs = await asyncio.gather(
            *(
                c.chat.completions.create(
                    model=SERVED_NAME,
                    messages=MESSAGES,
                    max_tokens=8,
                    extra_body={"request_id": "job-42", "ignore_eos": True},
                )
                for _ in range(3)
            )
        )
        await c.close()
        return [r.id for r in rs]

    assert asyncio.run(run()) == ["chatcmpl-job-42"] * 3
    r = client(compat_server).completions.create(
        model=SERVED_NAME, prompt=[5, 6, 7], max_tokens=2, extra_body={"request_id": "c-1"}
    )
    assert r.id == "cmpl-c-1"


def test_truncate_prompt_tokens_keeps_the_last_tokens(compat_server) -> None:
    c = client(compat_server)
    prompt = [(7 * i) % 500 + 3 for i in range(40)]
    common = {"model": SERVED_NAME, "max_tokens": 5, "temperature": 0.0, "logprobs": 1}
    cut = c.completions.create(prompt=prompt, extra_body={"truncate_prompt_tokens": 12}, **common)
    tail = c.completions.create(prompt=prompt[-12:], **common)
    full = c.completions.create(prompt=prompt, **common)
    assert cut.usage.prompt_tokens == 12 and full.usage.prompt_tokens == 40
    assert cut.choices[0].logprobs.token_logprobs == tail.choices[0].logprobs.token_logprobs
    assert f32_bits(cut.choices[0].logprobs.token_logprobs) != f32_bits(
        full.choices[0].logprobs.token_logprobs
    )
    # -1: the model's context length, i.e. nothing cut from a prompt that fits.
    whole = c.completions.create(prompt=prompt, extra_body={"truncate_prompt_tokens": -1}, **common)
    assert whole.usage.prompt_tokens == 40


def test_documents_reach_the_chat_template(compat_server) -> None:
    c = client(compat_server)
    plain = c.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=1)
    docs = c.chat.completions.create(
        model=SERVED_NAME,
        messages=MESSAGES,
        max_tokens=1,
        extra_body={"documents": [{"title": "a", "text": "the sea is salty and deep"}]},
    )
    assert docs.usage.prompt_tokens > plain.usage.prompt_tokens


# ------------------------------------------------------------------ chat templates

# Renders only the contents, each behind a marker: recognisably not the model's template.
PLAIN_TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"


def tokenize_chat(s: ServerProcess, **extra) -> httpx.Response:
    body = {"model": SERVED_NAME, "messages": MESSAGES, **extra}
    return httpx.post(f"{s.base_url}/tokenize", json=body, timeout=30)


def test_request_chat_template_needs_trust(compat_server) -> None:
    r = tokenize_chat(compat_server, chat_template=PLAIN_TEMPLATE)
    assert r.status_code == 400 and "chat_template" in r.text, r.text
    body = {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 1}
    r = httpx.post(
        f"{compat_server.base_url}/v1/chat/completions",
        json={**body, "chat_template": PLAIN_TEMPLATE},
        timeout=30,
    )
    assert r.status_code == 400 and "trust-request-chat-template" in r.text, r.text


@pytest.fixture(scope="module")
def template_server(tmp_path_factory, compat_model_dir) -> Iterator[ServerProcess]:
    path = Path(tmp_path_factory.mktemp("template")) / "plain.jinja"
    path.write_text(PLAIN_TEMPLATE)
    s = start_server(
        tmp_path_factory,
        "template",
        compat_model_dir,
        "--max-model-len",
        "256",
        "--num-kv-pages",
        "256",
        "--chat-template",
        str(path),
        "--trust-request-chat-template",
    )
    yield s
    assert s.stop() == 0, s.log()


def test_server_and_request_chat_templates(compat_server, template_server) -> None:
    def encode(s: ServerProcess, text: str) -> list[int]:
        body = {"model": SERVED_NAME, "prompt": text, "add_special_tokens": False}
        return httpx.post(f"{s.base_url}/tokenize", json=body, timeout=30).json()["tokens"]

    content = MESSAGES[0]["content"]
    model_ids = tokenize_chat(compat_server).json()["tokens"]
    server_ids = tokenize_chat(template_server).json()["tokens"]
    assert server_ids == encode(template_server, f"<<{content}>>") != model_ids
    # A request's template wins over the server's.
    req_ids = tokenize_chat(template_server, chat_template="[{{ messages[0]['content'] }}]")
    assert req_ids.json()["tokens"] == encode(template_server, f"[{content}]")
    c = client(template_server)
    r = c.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=1)
    assert r.usage.prompt_tokens == len(server_ids)
    # The server's template changes what a body means: the fingerprint names it.
    plain = client(compat_server).chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, max_tokens=1
    )
    assert "+tmpl" in r.system_fingerprint and "+tmpl" not in plain.system_fingerprint
    # lm-eval reads the template the server renders with.
    info = httpx.get(f"{template_server.base_url}/tokenizer_info", timeout=30).json()
    assert info["chat_template"] == PLAIN_TEMPLATE
    # A template that does not compile, or runs away, is a 400 naming chat_template.
    bad = tokenize_chat(template_server, chat_template="{% for m in messages %}")
    assert bad.status_code == 400 and "chat_template" in bad.text, bad.text
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    r = httpx.post(
        f"{template_server.base_url}/v1/chat/completions",
        json={"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 1, "chat_template": loop},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    assert "fuel" in r.text
    after = c.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=1)
    assert after.usage.completion_tokens == 1


def test_allowed_token_ids_and_bad_words_over_http(compat_server) -> None:
    c = client(compat_server)
    common = {"model": SERVED_NAME, "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0.0}
    r = c.completions.create(
        **common, extra_body={"allowed_token_ids": [40, 41, 42], "return_token_ids": True}
    )
    assert set(r.choices[0].token_ids) <= {40, 41, 42}
    free = c.completions.create(**common, extra_body={"return_token_ids": True})
    free_ids = free.choices[0].token_ids

    def post(path: str, body: dict) -> dict:
        r = httpx.post(f"{compat_server.base_url}{path}", json=body, timeout=30)
        return r.json()

    def forms(word: str) -> list[list[int]]:
        body = {"model": SERVED_NAME, "add_special_tokens": False}
        return [post("/tokenize", {**body, "prompt": p})["tokens"] for p in (word, " " + word)]

    def contains(seq: list[int], sub: list[int]) -> bool:
        return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))

    words = [post("/detokenize", {"model": SERVED_NAME, "tokens": [t]})["prompt"] for t in free_ids]
    word = next(
        w for w in map(str.strip, words) if w and any(contains(free_ids, f) for f in forms(w))
    )
    banned = c.completions.create(
        **common, extra_body={"bad_words": [word], "return_token_ids": True}
    )
    assert not any(contains(banned.choices[0].token_ids, f) for f in forms(word))
    bad = httpx.post(
        f"{compat_server.base_url}/v1/completions",
        json={**common, "bad_words": ["  "]},
        timeout=30,
    )
    assert bad.status_code == 400 and "bad_words" in bad.text, bad.text


def test_ranges_are_the_engines(compat_server) -> None:
    """The server keeps no range of its own besides the engine's: a temperature or repetition
    penalty above 100 (which the engine samples with) is served, a negative one refused by the
    engine's rule, naming the field."""
    c = client(compat_server)
    common = {"model": SERVED_NAME, "prompt": [5, 6, 7], "max_tokens": 3, "seed": 1}
    r = c.completions.create(**common, temperature=250.0, extra_body={"repetition_penalty": 500.0})
    assert r.usage.completion_tokens == 3
    body = {**common, "temperature": -1.0}
    bad = httpx.post(f"{compat_server.base_url}/v1/completions", json=body, timeout=30)
    assert bad.status_code == 400 and "temperature" in bad.text, bad.text


def test_max_logprobs_is_the_servers_bound(compat_server) -> None:
    """``--max-logprobs 30``: 30 top logprobs are served on every route that asks for them,
    31 is a 400 naming the field the request used."""
    c = client(compat_server)
    chat = c.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, max_tokens=2, logprobs=True, top_logprobs=30
    )
    assert all(len(t.top_logprobs) == 30 for t in chat.choices[0].logprobs.content)
    comp = c.completions.create(
        model=SERVED_NAME,
        prompt=[5, 6, 7],
        max_tokens=2,
        logprobs=30,
        # token ids as keys: texts of different tokens may clash in the dict
        extra_body={"prompt_logprobs": 30, "return_tokens_as_token_ids": True},
    )
    assert all(len(t) >= 30 for t in comp.choices[0].logprobs.top_logprobs)
    assert all(len(t) >= 30 for t in comp.choices[0].model_extra["prompt_logprobs"][1:])
    base = f"{compat_server.base_url}"
    short = {"model": SERVED_NAME, "max_tokens": 2}
    over = [
        ("/v1/chat/completions", {**short, "messages": MESSAGES, "logprobs": True}, "top_logprobs"),
        ("/v1/completions", {**short, "prompt": [5, 6, 7]}, "logprobs"),
        ("/v1/completions", {**short, "prompt": [5, 6, 7]}, "prompt_logprobs"),
        ("/v1/completions", {**short, "prompt": [5, 6, 7], "echo": True}, "logprobs"),
        (
            "/v1/responses",
            {"model": SERVED_NAME, "input": "hi", "max_output_tokens": 2},
            "top_logprobs",
        ),
    ]
    for path, body, field in over:
        r = httpx.post(base + path, json={**body, field: 31}, timeout=30)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == field, (path, r.text)
        assert "max_logprobs (30)" in r.json()["error"]["message"]
    native = {"input_ids": [5, 6, 7], "return_logprob": True, "top_logprobs_num": 31}
    r = httpx.post(base + "/generate", json=native, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs_num", r.text


# ------------------------------------------------------------- special tokens at encoding


@pytest.fixture(scope="module")
def bos_server(tmp_path_factory, compat_model_dir) -> Iterator[ServerProcess]:
    """The compat model with a tokenizer that adds a BOS (``<s>``, id 0) to what it encodes,
    as Llama's does."""
    d = Path(tmp_path_factory.mktemp("bos-model")) / "m"
    shutil.copytree(compat_model_dir, d)
    tok = json.loads((d / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<s>", "type_id": 0}}
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            bos,
            {"Sequence": {"id": "A", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}},
    }
    (d / "tokenizer.json").write_text(json.dumps(tok))
    s = start_server(tmp_path_factory, "bos", str(d), "--max-model-len", "256")
    yield s
    assert s.stop() == 0, s.log()


def test_add_special_tokens_as_vllm(bos_server) -> None:
    """vLLM's ``add_special_tokens``: on by default for a completion's text prompt (off for
    text the client rendered with its own BOS), off by default for chat (the template writes
    its own; on adds the tokenizer's on top). ``spaces_between_special_tokens`` is accepted
    (the fast tokenizer puts no spaces there either way)."""
    base, c = bos_server.base_url, client(bos_server)

    def tokenize(body: dict) -> list[int]:
        r = httpx.post(f"{base}/tokenize", json={"model": SERVED_NAME, **body}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    text = "tell me about the sea"
    with_bos, plain = (
        tokenize({"prompt": text}),
        tokenize({"prompt": text, "add_special_tokens": False}),
    )
    assert with_bos == [0, *plain]
    for extra, ids in (({}, with_bos), ({"add_special_tokens": False}, plain)):
        r = c.completions.create(
            model=SERVED_NAME, prompt=text, max_tokens=1, echo=True, logprobs=0, extra_body=extra
        )
        assert r.usage.prompt_tokens == len(ids)
        r = c.completions.create(model=SERVED_NAME, prompt=text, max_tokens=1, extra_body=extra)
        assert r.usage.prompt_tokens == len(ids)
    chat = tokenize({"messages": MESSAGES})
    assert tokenize({"messages": MESSAGES, "add_special_tokens": True}) == [0, *chat]
    for extra, n in (({}, len(chat)), ({"add_special_tokens": True}, len(chat) + 1)):
        r = c.chat.completions.create(
            model=SERVED_NAME, messages=MESSAGES, max_tokens=1, extra_body=extra
        )
        assert r.usage.prompt_tokens == n
    for spaces in (True, False):
        r = c.completions.create(
            model=SERVED_NAME,
            prompt=text,
            max_tokens=2,
            extra_body={"spaces_between_special_tokens": spaces, "skip_special_tokens": False},
        )
        assert r.usage.completion_tokens == 2


def test_chat_echo_begins_with_the_assistant_message(compat_server) -> None:
    """vLLM's chat ``echo``: the answer to a conversation that ends with an assistant message
    begins with that message's content (streamed: in the first delta); after a user message
    it changes nothing."""
    c = client(compat_server)
    prefix = "The sea is"
    convo = [*MESSAGES, {"role": "assistant", "content": prefix}]
    go_on = {"add_generation_prompt": False, "continue_final_message": True}

    def answer(messages, stream: bool = False, **extra) -> str:
        kw = {"model": SERVED_NAME, "messages": messages, "max_tokens": 5, "extra_body": extra}
        if not stream:
            return c.chat.completions.create(**kw).choices[0].message.content
        chunks = c.chat.completions.create(**kw, stream=True)
        return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)

    plain = answer(convo, **go_on)
    assert answer(convo, echo=True, **go_on) == prefix + plain
    assert answer(convo, stream=True, echo=True, **go_on) == prefix + plain
    assert answer(MESSAGES, echo=True) == answer(MESSAGES)
