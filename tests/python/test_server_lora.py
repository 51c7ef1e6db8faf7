"""LoRA adapters over HTTP (``detspec serve --enable-lora --lora-modules``), with the real
``openai`` client: an adapter is a model (``/v1/models``, ``model``), a deterministic answer
of it is the same bits alone and amid concurrent requests of other adapters and of the base
model (and a plain one is not: the negative control), its prompt logprobs equal its
generation's, adapters load, replace and unload at run time under vLLM's and SGLang's routes,
and every refusal is a 4xx naming its field while the server goes on serving."""

# ruff: noqa: F811  (pytest fixtures imported from server_fixtures)

from __future__ import annotations

import asyncio
import json
import random
import struct
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from server_fixtures import (  # noqa: F401
    SERVED_NAME,
    ServerProcess,
    demo_model_dir,
    start_server,
    write_adapter,
)

PROMPT = [int(x) for x in np.random.default_rng(3).integers(3, 600, size=21)]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-adapters")
    return {
        "a": write_adapter(root, "a", 1),
        "b": write_adapter(root, "b", 2, ("self_attn.q_proj", "self_attn.v_proj")),
        "c": write_adapter(root, "c", 3),
    }


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, demo_model_dir, adapters) -> Iterator[ServerProcess]:
    s = start_server(
        tmp_path_factory,
        "lora",
        demo_model_dir,
        "--enable-lora",
        "--lora-modules",
        f"a={adapters['a']}",
        json.dumps({"name": "b", "path": adapters["b"]}),
        "--max-model-len",
        "256",
        "--verify-strategy",
        "replay",
        "--verify-window",
        "8",
        "--verify-group",
        "4",
        "--num-kv-pages",
        "1024",
    )
    yield s
    rc = s.stop()
    assert rc == 0, f"server exited with {rc}:\n{s.log()}"


def client(s: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0)


def target(model: str, deterministic: bool = True, prompt: list[int] = PROMPT) -> dict:
    return dict(
        model=model,
        prompt=prompt,
        max_tokens=24,
        temperature=0.8,
        seed=7,
        logprobs=1,
        extra_body={"deterministic": deterministic, "ignore_eos": True, "return_token_ids": True},
    )


def bits(resp) -> tuple:
    ch = resp.choices[0]
    return (
        tuple(ch.model_extra["token_ids"]),
        tuple(struct.pack("<f", x) for x in ch.logprobs.token_logprobs),
    )


async def amid_others(s: ServerProcess, kwargs: dict, seed: int) -> tuple:
    """The target sent while 16 other requests of the base model and both adapters run."""
    c = openai.AsyncOpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0)
    rng = random.Random(seed)

    async def other() -> None:
        await c.completions.create(
            model=rng.choice([SERVED_NAME, "a", "b"]),
            prompt=[rng.randrange(3, 600) for _ in range(rng.randint(1, 60))],
            max_tokens=rng.randint(4, 30),
            temperature=1.0,
            seed=rng.randrange(2**31),
            extra_body={"ignore_eos": True, "deterministic": rng.random() < 0.3},
        )

    others = [asyncio.create_task(other()) for _ in range(16)]
    await asyncio.sleep(0.05 * rng.random())
    resp = await c.completions.create(**kwargs)
    await asyncio.gather(*others)
    return bits(resp)


def test_an_adapter_is_a_model_with_its_own_fingerprint(lora_server, adapters):
    models = {m.id: m for m in client(lora_server).models.list().data}
    assert set(models) == {SERVED_NAME, "a", "b"}
    a = models["a"].model_extra
    assert a["parent"] == SERVED_NAME and models["a"].root == adapters["a"]
    base_fp = models[SERVED_NAME].model_extra["fingerprint"]
    assert a["fingerprint"].startswith("detspec-lora") and a["fingerprint"] != base_fp
    assert a["fingerprint"].endswith(base_fp.removeprefix("detspec-"))
    resp = client(lora_server).completions.create(**target("a"))
    assert resp.model == "a" and resp.system_fingerprint == a["fingerprint"]
    base = client(lora_server).completions.create(**target(SERVED_NAME))
    assert bits(base)[0] != bits(resp)[0], "the adapter changed nothing"


def test_a_deterministic_adapter_answer_is_the_same_bits_amid_other_models(lora_server):
    alone = bits(client(lora_server).completions.create(**target("a")))
    for seed in range(3):
        assert asyncio.run(amid_others(lora_server, target("a"), seed)) == alone, seed
    # Negative control: without the promise the answer follows its batch.
    plain = target("a", deterministic=False)
    plain_alone = bits(client(lora_server).completions.create(**plain))
    runs = [asyncio.run(amid_others(lora_server, plain, 10 + i)) for i in range(4)]
    assert any(r != plain_alone for r in runs), "batch variance never showed: the test is blind"


def test_prompt_logprobs_with_an_adapter_equal_its_generation(lora_server):
    c = client(lora_server)
    gen = c.completions.create(**target("a"))
    ids, lps = bits(gen)
    scored = c.completions.create(
        model="a",
        prompt=PROMPT + list(ids),
        max_tokens=0,
        echo=True,
        logprobs=0,
        extra_body={"deterministic": True},
    )
    echoed = scored.choices[0].logprobs.token_logprobs[len(PROMPT) :]
    assert tuple(struct.pack("<f", x) for x in echoed) == lps
    base = c.completions.create(
        model=SERVED_NAME,
        prompt=PROMPT + list(ids),
        max_tokens=0,
        echo=True,
        logprobs=0,
        extra_body={"deterministic": True},
    )
    assert base.choices[0].logprobs.token_logprobs[len(PROMPT) :] != echoed
    # Chat with the adapter, streamed and not, agree.
    msgs = [{"role": "user", "content": "hello there"}]
    kw = dict(model="b", messages=msgs, max_tokens=12, temperature=0, seed=1)
    whole = c.chat.completions.create(**kw).choices[0].message.content
    parts = [
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(**kw, stream=True)
        if ch.choices
    ]
    assert "".join(parts) == whole


def test_sglang_generate_names_the_adapter_in_lora_path(lora_server):
    want = bits(client(lora_server).completions.create(**target("a")))[0]
    body = {
        "input_ids": PROMPT,
        "lora_path": "a",
        "deterministic": True,
        "sampling_params": {
            "max_new_tokens": 24,
            "temperature": 0.8,
            "sampling_seed": 7,
            "ignore_eos": True,
        },
    }
    r = httpx.post(lora_server.base_url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert tuple(r.json()["output_ids"]) == want
    assert r.json()["meta_info"]["fingerprint"].startswith("detspec-lora")
    r = httpx.post(lora_server.base_url + "/generate", json={**body, "lora_path": "zz"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text


def test_adapters_load_replace_and_unload_at_run_time(lora_server, adapters, tmp_path):
    url = lora_server.base_url
    c = client(lora_server)
    load = {"lora_name": "n", "lora_path": adapters["a"]}
    r = httpx.post(url + "/v1/load_lora_adapter", json=load)
    assert r.status_code == 200 and r.json()["loaded_adapters"]["n"] == adapters["a"], r.text
    # The same weights under another name: the same answer and fingerprint.
    first = c.completions.create(**target("n"))
    assert bits(first) == bits(c.completions.create(**target("a")))
    r = httpx.post(url + "/v1/load_lora_adapter", json=load)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
    # load_inplace: new weights under the name (SGLang's route).
    r = httpx.post(
        url + "/load_lora_adapter", json={**load, "lora_path": adapters["c"], "load_inplace": True}
    )
    assert r.status_code == 200, r.text
    replaced = c.completions.create(**target("n"))
    assert bits(replaced) != bits(first)
    assert replaced.system_fingerprint != first.system_fingerprint
    # Refusals name their field; nothing changes.
    bad = tmp_path / "dora"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_dora": True})
    )
    for body, param, needle in [
        ({"lora_name": "x", "lora_path": str(tmp_path / "none")}, "lora_path", "adapter_config"),
        ({"lora_name": "x", "lora_path": str(bad)}, "lora_path", "use_dora"),
        ({"lora_name": SERVED_NAME, "lora_path": adapters["a"]}, "lora_name", "base model"),
    ]:
        r = httpx.post(url + "/v1/load_lora_adapter", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and needle in r.text, r.text
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "n"})
    assert r.status_code == 200 and "n" not in r.json()["loaded_adapters"], r.text
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(**target("n"))
    assert e.value.body["param"] == "model"
    r = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "n"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
    assert bits(c.completions.create(**target("a"))) == bits(first)


def test_without_enable_lora_adapters_are_refused(tmp_path_factory, demo_model_dir, adapters):
    import argparse

    from detspec.server.serve import SetupError, build_from_args
    from detspec.server.serve_flags import add_app_arguments

    p = argparse.ArgumentParser()
    add_app_arguments(p)
    args = p.parse_args([demo_model_dir, "--lora-modules", f"a={adapters['a']}"])
    with pytest.raises(SetupError, match="--enable-lora"):
        build_from_args(args)
    s = start_server(tmp_path_factory, "nolora", demo_model_dir, "--max-model-len", "128")
    try:
        r = httpx.post(
            s.base_url + "/v1/load_lora_adapter",
            json={"lora_name": "a", "lora_path": adapters["a"]},
        )
        assert r.status_code == 400 and "--enable-lora" in r.text, r.text
        with pytest.raises(openai.NotFoundError):
            client(s).completions.create(model="a", prompt=[1, 2], max_tokens=2)
    finally:
        assert s.stop() == 0


def test_embeddings_with_an_adapter(lora_server):
    c = client(lora_server)
    kw = dict(input=[PROMPT], encoding_format="float", extra_body={"deterministic": True})
    a = c.embeddings.create(model="a", **kw)
    base = c.embeddings.create(model=SERVED_NAME, **kw)
    assert a.data[0].embedding != base.data[0].embedding
    assert a.model_extra["fingerprint"].startswith("detspec-lora")
    assert c.embeddings.create(model="a", **kw).data[0].embedding == a.data[0].embedding
