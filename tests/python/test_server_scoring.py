"""Prompt scoring over HTTP and server-wide determinism.

* ``echo`` (+ ``logprobs``, ``max_tokens`` 0 or more) returns the prompt's tokens, offsets
  and logprobs in OpenAI's format; a deterministic request's equal ``LLM.score`` /
  ``LLM.prompt_logprobs`` bit for bit, alone or batched with concurrent scoring requests; a
  plain request's come from the fast path and move with the batch (negative control).
* ``/tokenizer_info`` is what lm-eval's remote-tokenizer detection accepts.
* ``--deterministic-by-default``: requests that do not say ``deterministic`` are, sampled
  ones without a seed get ``--default-seed``; reported in ``/v1/models`` and
  ``system_fingerprint``; ``"deterministic": false`` opts out.
"""

# ruff: noqa: F811  (pytest fixtures imported from server_fixtures)

from __future__ import annotations

import asyncio
import struct
import subprocess
import sys
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from server_fixtures import (  # noqa: F401
    SERVED_NAME,
    ServerProcess,
    demo_model_dir,
    inline_server,
    start_server,
)

import detspec

PROMPTS = [[int(x) for x in np.random.default_rng(s).integers(3, 900, size=n)]
           for s, n in ((1, 40), (2, 57), (3, 33), (4, 71), (5, 48), (6, 64))]  # fmt: skip


def f32(x: float) -> bytes:
    return struct.pack("<f", x)


def bits(xs) -> list[bytes | None]:
    return [None if x is None else f32(x) for x in xs]


@pytest.fixture(scope="module")
def llm(demo_model_dir) -> Iterator[detspec.LLM]:
    e = detspec.LLM(demo_model_dir, num_kv_pages=256)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def det_server(tmp_path_factory, demo_model_dir) -> Iterator[ServerProcess]:
    s = start_server(
        tmp_path_factory,
        "det-default",
        demo_model_dir,
        "--max-model-len",
        "256",
        "--num-kv-pages",
        "1024",
        "--deterministic-by-default",
        "--default-seed",
        "77",
    )
    yield s
    assert s.stop() == 0, s.log()


def post(server: ServerProcess, body: dict) -> dict:
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_max_tokens_zero_is_score_bitwise(inline_server, llm) -> None:
    ids = PROMPTS[0]
    body = post(
        inline_server,
        {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2, "deterministic": True,
         "return_tokens_as_token_ids": True},
    )  # fmt: skip
    (ch,) = body["choices"]
    lp = ch["logprobs"]
    assert len(lp["tokens"]) == len(ids) == len(lp["token_logprobs"]) == len(lp["text_offset"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert ch["text"] == llm.get_tokenizer().decode(ids, skip_special_tokens=False)
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]
    assert ch["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 0
    (scored,) = llm.score([ids[:1]], [ids[1:]])
    assert bits(lp["token_logprobs"][1:]) == bits(scored)
    (plp,) = llm.prompt_logprobs([ids], 2)
    for pos in range(1, len(ids)):
        top = lp["top_logprobs"][pos]
        assert 1 <= len(top) <= 3
        want = {f"token_id:{t}": v.logprob for t, v in plp[pos].items()}
        for name, v in top.items():
            assert f32(v) == f32(want[name]), (pos, name)
    offs = lp["text_offset"]
    assert offs[0] == 0 and all(b >= a for a, b in zip(offs, offs[1:], strict=False))


def test_echo_with_generation_text_prompt(inline_server, llm) -> None:
    """lm-eval's loglikelihood request: a text prompt, echo, logprobs=1, max_tokens=1."""
    prompt = "The quick brown fox jumps over the lazy dog. Hello world!"
    base = {"prompt": prompt, "temperature": 0, "logprobs": 1, "seed": 1234}
    body = post(inline_server, {**base, "echo": True, "max_tokens": 1, "deterministic": True})
    plain = post(inline_server, {**base, "max_tokens": 1, "deterministic": True})
    (ch,) = body["choices"]
    ids = llm.get_tokenizer().encode(prompt)
    lp = ch["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1
    assert ch["text"] == prompt + plain["choices"][0]["text"]
    assert lp["token_logprobs"][0] is None
    # the prompt part is the scorer's, the generated token the generator's
    (scored,) = llm.score([ids[:1]], [ids[1:]])
    assert bits(lp["token_logprobs"][1:-1]) == bits(scored)
    assert f32(lp["token_logprobs"][-1]) == f32(
        plain["choices"][0]["logprobs"]["token_logprobs"][0]
    )
    assert lp["text_offset"][-1] == len(prompt)
    # vLLM's prompt_logprobs field in the same response agrees
    both = post(
        inline_server,
        {**base, "echo": True, "max_tokens": 1, "deterministic": True, "prompt_logprobs": 0},
    )
    pl = both["choices"][0]["prompt_logprobs"]
    assert pl[0] is None
    assert bits([pl[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]) == bits(scored)


def test_echo_batch_of_prompts_and_n(inline_server) -> None:
    body = post(
        inline_server,
        {"prompt": PROMPTS[:3], "max_tokens": 0, "echo": True, "logprobs": 0, "n": 2,
         "deterministic": True},
    )  # fmt: skip
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for c in body["choices"]:
        assert len(c["logprobs"]["tokens"]) == len(PROMPTS[c["index"] // 2])
    no_lp = post(inline_server, {"prompt": "Hello", "max_tokens": 2, "echo": True})
    assert no_lp["choices"][0]["text"].startswith("Hello")
    assert no_lp["choices"][0]["logprobs"] is None


def _streamed_echo(server: ServerProcess, **kw) -> dict[int, dict]:
    """A streamed completion through the ``openai`` client, its chunks joined per choice:
    text, logprob lists, finish reason."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    joined: dict[int, dict] = {}
    for chunk in client.completions.create(model=SERVED_NAME, stream=True, echo=True, **kw):
        for c in chunk.choices:
            j = joined.setdefault(c.index, {"text": "", "logprobs": None, "chunks": 0})
            j["text"] += c.text
            j["chunks"] += 1
            if c.logprobs is not None:
                lp = j["logprobs"] = j["logprobs"] or {k: [] for k in LOGPROB_KEYS}
                for k in LOGPROB_KEYS:
                    lp[k] += getattr(c.logprobs, k)
            if c.finish_reason is not None:
                j["finish_reason"] = c.finish_reason
    return joined


LOGPROB_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def _same_logprobs(got: dict | None, want: dict | None, prompt_len: int) -> None:
    """Equal entries; the text offsets equal over the prompt and the first generated token.
    A later chunk's offsets start from the text streamed before it, which holds back a
    character still incomplete, where the whole answer adds each token's own text (vLLM's
    offsets do the same): they depend on where the chunks fell, which timing decides."""
    assert (got is None) == (want is None)
    if want is None:
        return
    assert got["tokens"] == want["tokens"]
    n = prompt_len + 1
    assert got["text_offset"][:n] == want["text_offset"][:n]
    assert bits(got["token_logprobs"]) == bits(want["token_logprobs"])
    for g, w in zip(got["top_logprobs"], want["top_logprobs"], strict=True):
        assert (g is None) == (w is None)
        if w is not None:
            assert {k: f32(v) for k, v in g.items()} == {k: f32(v) for k, v in w.items()}


@pytest.mark.parametrize("max_tokens", [0, 6])
@pytest.mark.parametrize("logprobs", [None, 2])
@pytest.mark.parametrize("ids", [False, True], ids=["text", "ids"])
def test_streamed_echo_is_the_unstreamed_one_in_pieces(inline_server, max_tokens, logprobs, ids):
    """vLLM streams ``echo``: a choice's first chunk begins with the prompt (and its tokens'
    logprobs), the completion follows; joined, the chunks are the unstreamed answer, bit for
    bit for a deterministic request (two prompts, ``n`` = 2)."""
    texts = ["The old lighthouse stood at the end", "A computer program is"]
    prompts = PROMPTS[2:4] if ids else texts
    kw = {"prompt": prompts, "max_tokens": max_tokens, "n": 2, "temperature": 0.8,
          "logprobs": logprobs}  # fmt: skip
    extra = {"deterministic": True, "seed": 5, "return_tokens_as_token_ids": True,
             "return_token_ids": True}  # fmt: skip
    want = post(inline_server, {**kw, **extra, "echo": True})
    got = _streamed_echo(inline_server, **kw, extra_body=extra)
    assert sorted(got) == [c["index"] for c in want["choices"]] == [0, 1, 2, 3]
    for w in want["choices"]:
        g = got[w["index"]]
        assert g["text"] == w["text"] and g["finish_reason"] == w["finish_reason"]
        _same_logprobs(g["logprobs"], w["logprobs"], len(w["prompt_token_ids"]))
        if max_tokens == 0:
            assert g["chunks"] == 1
    if not ids:
        assert all(got[i]["text"].startswith(texts[i // 2]) for i in got)


async def _concurrent_echo(base_url: str, deterministic: bool, rounds: int) -> list[list]:
    """Each round sends every prompt at once (and plain generation load beside them), so the
    server's score batcher coalesces them; returns the token_logprobs of each prompt per
    round."""
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:

        async def one(ids: list[int]) -> list:
            r = await client.post(
                "/v1/completions",
                json={"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0,
                      "deterministic": deterministic},
            )  # fmt: skip
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["logprobs"]["token_logprobs"]

        async def load(i: int) -> None:
            r = await client.post(
                "/v1/completions",
                json={"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 8, "ignore_eos": True},
            )
            assert r.status_code == 200, r.text

        out = []
        for _ in range(rounds):
            res = await asyncio.gather(*(one(p) for p in PROMPTS), *(load(i) for i in range(4)))
            out.append([bits(x) for x in res[: len(PROMPTS)]])
        return out


def test_deterministic_echo_is_batch_invariant_and_plain_is_not(inline_server, llm) -> None:
    solo_det = [bits(llm.score([p[:1]], [p[1:]])[0]) for p in PROMPTS]
    for rnd in asyncio.run(_concurrent_echo(inline_server.base_url, True, 3)):
        for i, got in enumerate(rnd):
            assert got[1:] == solo_det[i], f"deterministic echo of prompt {i} moved in a batch"
    # Negative control: plain echo requests run on the fast path; alone, its attention splits
    # the KV (batch-variant on purpose), batched with others it does not.
    solo_plain = []
    for p in PROMPTS:
        body = post(inline_server, {"prompt": p, "max_tokens": 0, "echo": True, "logprobs": 0})
        solo_plain.append(bits(body["choices"][0]["logprobs"]["token_logprobs"]))
    assert solo_plain != [[None, *s] for s in solo_det], "fast path equals the verify path"
    moved = False
    for _ in range(8):  # a round whose requests all ran alone shows nothing: try again
        (rnd,) = asyncio.run(_concurrent_echo(inline_server.base_url, False, 1))
        if rnd != solo_plain:
            moved = True
            break
    assert moved, (
        "plain echo logprobs never moved with the batch: the test above could not see "
        "batch variance"
    )


def test_tokenizer_info_and_lm_eval_detection(inline_server) -> None:
    info = httpx.get(inline_server.base_url + "/tokenizer_info").json()
    assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>"
    assert info["model_max_length"] == 256
    tok = httpx.post(
        inline_server.base_url + "/tokenize", json={"prompt": "</s>", "add_special_tokens": False}
    ).json()["tokens"]
    assert tok == info["eos_token_ids"][:1]
    lm_eval_utils = pytest.importorskip("lm_eval.utils")
    assert lm_eval_utils.check_remote_tokenizer_support(inline_server.base_url + "/v1/completions")


def test_deterministic_by_default(det_server, inline_server) -> None:
    models = httpx.get(det_server.base_url + "/v1/models").json()["data"][0]
    assert models["deterministic_by_default"] is True and models["default_seed"] == 77
    plain_models = httpx.get(inline_server.base_url + "/v1/models").json()["data"][0]
    assert plain_models["deterministic_by_default"] is False
    assert models["fingerprint"] == plain_models["fingerprint"] + "+det-default-seed77"
    # No `deterministic`, sampled, no seed: deterministic with seed 77 ...
    body = {"prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0.8, "logprobs": 0,
            "ignore_eos": True}  # fmt: skip
    got = post(det_server, body)
    assert got["system_fingerprint"] == models["fingerprint"]
    assert got["choices"][0]["dvr_metrics"]["deterministic"] is True
    # ... which is what an explicit request with that seed gets from a plain server.
    want = post(inline_server, {**body, "deterministic": True, "seed": 77})
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert bits(got["choices"][0]["logprobs"]["token_logprobs"]) == bits(
        want["choices"][0]["logprobs"]["token_logprobs"]
    )
    again = post(det_server, body)
    assert again["choices"][0]["logprobs"] == got["choices"][0]["logprobs"]
    # Opting out.
    out = post(det_server, {**body, "deterministic": False, "seed": 5})
    assert out["choices"][0]["dvr_metrics"]["deterministic"] is False
    # Chat too, and echo scoring is deterministic by default.
    client = openai.OpenAI(base_url=det_server.base_url + "/v1", api_key="x", max_retries=0)
    chat = client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert chat.choices[0].model_extra["dvr_metrics"]["deterministic"] is True
    assert chat.system_fingerprint == models["fingerprint"]
    echo = post(det_server, {"prompt": PROMPTS[0], "max_tokens": 0, "echo": True, "logprobs": 0})
    det_echo = post(
        inline_server,
        {"prompt": PROMPTS[0], "max_tokens": 0, "echo": True, "logprobs": 0, "deterministic": True},
    )
    assert echo["choices"][0]["logprobs"] == det_echo["choices"][0]["logprobs"]
    # SGLang's native /generate too: the same request, the same seed, the same bits.
    native = httpx.post(
        det_server.base_url + "/generate",
        json={"input_ids": PROMPTS[1], "return_logprob": True,
              "sampling_params": {"max_new_tokens": 16, "temperature": 0.8, "ignore_eos": True}},
        timeout=60,
    ).json()  # fmt: skip
    assert native["meta_info"]["dvr_metrics"]["deterministic"] is True
    assert native["text"] == got["choices"][0]["text"]
    assert bits([lp for lp, _, _ in native["meta_info"]["output_token_logprobs"]]) == bits(
        got["choices"][0]["logprobs"]["token_logprobs"]
    )


def test_deterministic_by_default_needs_a_deterministic_engine(demo_model_dir) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "detspec", "serve", demo_model_dir, "--determinism", "off",
         "--deterministic-by-default", "--port", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 1 and "--deterministic-by-default" in r.stderr


async def test_score_batcher_coalesces_and_isolates_a_refused_prompt() -> None:
    """Concurrent prompt-logprob calls share one engine call; if the engine refuses it, each
    prompt is retried alone, so only the one at fault gets the error and the others their
    results (one bad request never fails its neighbours)."""
    from detspec.server.score_batcher import ScoreBatcher

    calls: list[int] = []
    adapters: list[str | None] = []
    salts: list[str | None] = []

    class Engine:
        async def prompt_logprobs(
            self, prompts, k, deterministic, lora_request=None, cache_salt=None
        ):
            calls.append(len(prompts))
            adapters.append(lora_request)
            salts.append(cache_salt)
            await asyncio.sleep(0)
            if any(999 in p for p in prompts):
                raise ValueError("token 999 refused")
            return [[None, {p[1]: k}] for p in prompts]

    batcher = ScoreBatcher(Engine())  # type: ignore[arg-type]
    got = await asyncio.gather(
        batcher.prompt_logprobs([1, 2], 1, True),
        batcher.prompt_logprobs([3, 999], 1, True),
        batcher.prompt_logprobs([5, 6], 1, True),
        return_exceptions=True,
    )
    assert got[0] == [None, {2: 1}] and got[2] == [None, {6: 1}]
    assert isinstance(got[1], ValueError)
    assert calls == [3, 1, 1, 1], "one call for all three, then one per prompt"
    # Prompts of different LoRA adapters never share an engine call.
    calls.clear()
    adapters.clear()
    await asyncio.gather(
        batcher.prompt_logprobs([1, 2], 1, True, "a"),
        batcher.prompt_logprobs([3, 4], 1, True, None),
        batcher.prompt_logprobs([5, 6], 1, True, "a"),
    )
    assert sorted(zip(adapters, calls, strict=True), key=str) == [("a", 2), (None, 1)]
    # Nor prompts of different cache salts (each salt's pages are its own).
    calls.clear()
    salts.clear()
    await asyncio.gather(
        batcher.prompt_logprobs([1, 2], 1, True, None, "s"),
        batcher.prompt_logprobs([3, 4], 1, True, None, "t"),
        batcher.prompt_logprobs([5, 6], 1, True, None, "s"),
    )
    assert sorted(zip(salts, calls, strict=True), key=str) == [("s", 2), ("t", 1)]
