"""RL weight sync and flow control over HTTP (SGLang's endpoint names, vLLM's aliases), driven
with httpx and the openai client against a real ``detspec serve`` with an API key:

* weight updates from a checkpoint directory and from safetensors bytes: the fingerprint
  moves to the new weights' hash (and back when they are restored, with the old outputs bit
  for bit); in-flight requests finish on the old weights or are aborted, as asked;
* bad input (unknown tensor, wrong shape or dtype, missing directory, partial or corrupt
  checkpoint, wrong body) gets a 4xx naming it and changes nothing;
* pause (abort / wait / in place) and continue, prefix-cache flush, KV memory release and
  resume;
* a GRPO-shaped loop (n = 8 seeded deterministic samples per prompt; their "old" logprobs
  scored back over HTTP with ``echo`` equal the sampler's bit for bit; rewards, group
  advantages, a weight update per step, alternately by tensors and by checkpoint), then a
  replay of the whole run on a fresh server from the stored seeds and checkpoints: the same
  token ids, logprob bits and fingerprints.
"""

# ruff: noqa: F811  (pytest fixtures imported from server_fixtures)

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from safetensors.numpy import load_file, save, save_file
from server_fixtures import API_KEY, SERVED_NAME, ServerProcess, demo_model_dir, start_server  # noqa: F401

from detspec.server.rl_routes import RL_PATHS

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [int(x) for x in np.random.default_rng(3).integers(3, 900, size=21)]


# A request long enough to be in flight when a control call that follows its first chunk
# arrives: the tiny model decodes 200 tokens in ~6 ms on an idle 2-core machine.
LONG = 1900


def start_rl_server(tmp_path_factory, name: str, model_dir: str) -> ServerProcess:
    return start_server(
        tmp_path_factory,
        name,
        model_dir,
        "--api-key",
        API_KEY,
        "--max-model-len",
        "2048",
        "--num-kv-pages",
        "512",
        # far below one weight upload: the limit must not apply to /update_weights_from_tensor
        "--max-request-bytes",
        str(64 * 1024),
    )


@pytest.fixture(scope="module")
def rl_server(tmp_path_factory, demo_model_dir) -> Iterator[ServerProcess]:
    s = start_rl_server(tmp_path_factory, "rl", demo_model_dir)
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="module")
def weights(demo_model_dir) -> dict[str, np.ndarray]:
    path = Path(demo_model_dir) / "model.safetensors"
    return {k: v.astype(np.float32) for k, v in load_file(str(path)).items()}


def head_name(weights: dict[str, np.ndarray]) -> str:
    return "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"


def call(server: ServerProcess, method: str, path: str, **kw) -> httpx.Response:
    headers = {**AUTH, **kw.pop("headers", {})}
    return httpx.request(method, server.base_url + path, headers=headers, timeout=120, **kw)


def fingerprint(server: ServerProcess) -> str:
    return call(server, "GET", "/v1/models").json()["data"][0]["fingerprint"]


def generate(server: ServerProcess, **kw) -> tuple:
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 16, "temperature": 0.8,
            "seed": 11, "logprobs": 0, "deterministic": True, "ignore_eos": True,
            "return_token_ids": True, **kw}  # fmt: skip
    r = call(server, "POST", "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    return tuple(
        (
            tuple(c["token_ids"]),
            tuple(struct.pack("<f", x) for x in c["logprobs"]["token_logprobs"]),
        )
        for c in out["choices"]
    ), out["system_fingerprint"]


def write_checkpoint(d: Path, tensors: dict[str, np.ndarray]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / "model.safetensors"))
    return d


def restore(server: ServerProcess, model_dir: str) -> None:
    r = call(server, "POST", "/update_weights_from_disk", json={"model_path": model_dir})
    assert r.status_code == 200, r.text


def test_api_key_applies_to_every_rl_route(rl_server) -> None:
    for path in RL_PATHS:
        for method in ("GET", "POST"):
            r = httpx.request(method, rl_server.base_url + path, timeout=30)
            assert r.status_code == 401, (method, path, r.status_code)
    r = httpx.get(rl_server.base_url + "/tokenizer_info", timeout=30)
    assert r.status_code == 401


def test_update_from_disk_and_tensors_move_the_fingerprint(
    rl_server, weights, demo_model_dir, tmp_path
) -> None:
    fp0 = fingerprint(rl_server)
    out0, sfp0 = generate(rl_server)
    assert sfp0 == fp0
    name = head_name(weights)
    changed = {**weights, name: (weights[name] * np.float32(1.5)).astype(np.float32)}
    ck = write_checkpoint(tmp_path / "ck1", changed)
    r = call(rl_server, "POST", "/update_weights_from_disk", json={"model_path": str(ck)})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    fp1 = r.json()["fingerprint"]
    assert fp1 != fp0 and fingerprint(rl_server) == fp1
    out1, sfp1 = generate(rl_server)
    assert sfp1 == fp1 and out1 != out0
    # The same weights from tensors (only the changed one): the same fingerprint.
    restore(rl_server, demo_model_dir)
    assert fingerprint(rl_server) == fp0
    r = call(
        rl_server,
        "POST",
        "/update_weights_from_tensor?weight_version=v1",
        content=save({name: changed[name]}),
        headers={"Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["fingerprint"] == fp1 and generate(rl_server) == (out1, fp1)
    version = call(rl_server, "GET", "/get_weight_version").json()
    assert version["weight_version"] == "v1" and version["fingerprint"] == fp1
    restore(rl_server, demo_model_dir)
    assert generate(rl_server) == (out0, fp0), "restoring the weights restores the outputs"


def _check_refused(server, fp0, out0, r: httpx.Response, status: int, *needles: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["success"] is False
    text = body["message"] + " " + str(body["error"]["param"])
    for n in needles:
        assert n in text, (n, body)
    assert fingerprint(server) == fp0, "a refused update changed the weights"
    assert generate(server) == (out0, fp0)


def test_bad_updates_are_refused_and_change_nothing(
    rl_server, weights, demo_model_dir, tmp_path
) -> None:
    fp0 = fingerprint(rl_server)
    out0, _ = generate(rl_server)
    name = head_name(weights)
    octet = {"Content-Type": "application/octet-stream"}

    def tensor_update(tensors: dict[str, np.ndarray]) -> httpx.Response:
        return call(
            rl_server, "POST", "/update_weights_from_tensor", content=save(tensors), headers=octet
        )

    good = (weights[name] * np.float32(2)).astype(np.float32)
    r = tensor_update({name: good, "model.layers.99.mlp.up_proj.weight": good})
    _check_refused(rl_server, fp0, out0, r, 400, "model.layers.99.mlp.up_proj.weight")
    r = tensor_update({name: good[:, :-1].copy()})
    _check_refused(rl_server, fp0, out0, r, 400, name, "shape")
    r = tensor_update({name: good.astype(np.float64)})
    _check_refused(rl_server, fp0, out0, r, 400, name, "dtype")
    r = call(rl_server, "POST", "/update_weights_from_tensor", content=b"not safetensors",
             headers=octet)  # fmt: skip
    _check_refused(rl_server, fp0, out0, r, 400, "safetensors", "body")
    r = call(rl_server, "POST", "/update_weights_from_tensor", json={"tensors": []})
    _check_refused(rl_server, fp0, out0, r, 400, "Content-Type")
    r = call(rl_server, "POST", "/update_weights_from_tensor", content=b"", headers=octet)
    _check_refused(rl_server, fp0, out0, r, 400, "body")

    missing = str(tmp_path / "no-such-dir")
    r = call(rl_server, "POST", "/update_weights_from_disk", json={"model_path": missing})
    _check_refused(rl_server, fp0, out0, r, 400, "no-such-dir")
    partial = write_checkpoint(tmp_path / "partial", {name: good})
    r = call(rl_server, "POST", "/update_weights_from_disk", json={"model_path": str(partial)})
    _check_refused(rl_server, fp0, out0, r, 400, "missing tensor")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    data = (Path(demo_model_dir) / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])
    r = call(rl_server, "POST", "/update_weights_from_disk", json={"model_path": str(corrupt)})
    _check_refused(rl_server, fp0, out0, r, 400, "model.safetensors")
    wrong_shape = write_checkpoint(tmp_path / "wrong", {**weights, name: good[:-1].copy()})
    r = call(rl_server, "POST", "/update_weights_from_disk", json={"model_path": str(wrong_shape)})
    _check_refused(rl_server, fp0, out0, r, 400, name)
    r = call(rl_server, "POST", "/update_weights_from_disk",
             json={"model_path": demo_model_dir, "load_format": "gguf"})  # fmt: skip
    _check_refused(rl_server, fp0, out0, r, 400, "load_format")
    r = call(rl_server, "POST", "/update_weights_from_disk",
             json={"model_path": demo_model_dir, "in_flight": "finish",
                   "abort_all_requests": True})  # fmt: skip
    _check_refused(rl_server, fp0, out0, r, 400, "in_flight")
    r = call(rl_server, "POST", "/update_weights_from_disk", json={"path": demo_model_dir})
    assert r.status_code == 400 and r.json()["error"]["param"] in ("path", "model_path")
    # A partial checkpoint is applied when the caller says so.
    r = call(rl_server, "POST", "/update_weights_from_disk",
             json={"model_path": str(partial), "allow_partial": True})  # fmt: skip
    assert r.status_code == 200 and r.json()["fingerprint"] != fp0
    restore(rl_server, demo_model_dir)
    assert fingerprint(rl_server) == fp0


async def _stream_first_then(
    server: ServerProcess, action, max_tokens: int = 120
) -> tuple[str | None, list[int], object]:
    """Streams a deterministic request; after its first chunk runs ``action()`` (awaitable)
    concurrently; returns (finish_reason, token ids, action's result)."""
    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    stream = await client.completions.create(
        model=SERVED_NAME, prompt=PROMPT, max_tokens=max_tokens, temperature=0.8, seed=11,
        stream=True, extra_body={"deterministic": True, "ignore_eos": True,
                                 "return_token_ids": True},
    )  # fmt: skip
    ids: list[int] = []
    finish = None
    task = None
    async for chunk in stream:
        ch = chunk.choices[0]
        ids += ch.model_extra.get("token_ids") or []
        finish = ch.finish_reason or finish
        if task is None:
            task = asyncio.ensure_future(action())
    result = await task if task is not None else None
    await client.close()
    return finish, ids, result


async def _apost(server: ServerProcess, path: str, **kw) -> httpx.Response:
    async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=120) as c:
        return await c.post(path, **kw)


def test_update_in_flight_finish_or_abort(rl_server, weights, demo_model_dir, tmp_path) -> None:
    solo = generate(rl_server, max_tokens=120)[0][0]
    name = head_name(weights)
    ck = write_checkpoint(tmp_path / "ck", {**weights, name: weights[name] * np.float32(1.25)})
    body = {"model_path": str(ck)}

    async def update() -> httpx.Response:
        return await _apost(rl_server, "/update_weights_from_disk", json=body)

    try:
        finish, ids, r = asyncio.run(_stream_first_then(rl_server, update))
        assert r.status_code == 200, r.text
        # in_flight="finish" (default): the request ended on the old weights, all of it
        assert finish == "length" and tuple(ids) == solo[0]
    finally:
        restore(rl_server, demo_model_dir)

    async def update_abort() -> httpx.Response:
        return await _apost(
            rl_server, "/update_weights_from_disk", json={**body, "abort_all_requests": True}
        )

    # The tiny model can finish a short request before the update (which reads the
    # checkpoint first) reaches the engine: then there was nothing to abort; a long request
    # (tens of milliseconds), and a retry.
    outcomes = []
    for _ in range(4):
        try:
            finish, ids, r = asyncio.run(
                _stream_first_then(rl_server, update_abort, max_tokens=LONG)
            )
            assert r.status_code == 200, r.text
            outcomes.append((finish, len(ids)))
        finally:
            restore(rl_server, demo_model_dir)
        if finish == "abort":
            assert len(ids) < LONG
            break
    assert outcomes[-1][0] == "abort", outcomes


def test_pause_modes_and_continue(rl_server) -> None:
    solo = generate(rl_server, max_tokens=120)[0][0]

    async def pause_in_place_then_continue() -> bool:
        r = await _apost(rl_server, "/pause_generation", json={"mode": "in_place"})
        assert r.status_code == 200 and r.json()["is_paused"] is True, r.text
        async with httpx.AsyncClient(base_url=rl_server.base_url, headers=AUTH, timeout=120) as c:
            assert (await c.get("/is_paused")).json() == {"is_paused": True}
            late = asyncio.ensure_future(
                c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
            )
            await asyncio.sleep(0.5)
            held = not late.done()  # nothing can run while paused
            r = await c.post("/continue_generation", json={})
            assert r.status_code == 200 and r.json()["is_paused"] is False
            assert (await late).status_code == 200
        return held

    finish, ids, held = asyncio.run(_stream_first_then(rl_server, pause_in_place_then_continue))
    assert held, "a request ran while generation was paused"
    assert finish == "length" and tuple(ids) == solo[0], "paused in place, the bits moved"

    async def pause_abort() -> httpx.Response:
        return await _apost(rl_server, "/pause_generation", json={"mode": "abort"})

    finish, ids, r = asyncio.run(_stream_first_then(rl_server, pause_abort, max_tokens=LONG))
    assert r.status_code == 200 and finish == "abort" and len(ids) < LONG, (finish, len(ids))
    assert call(rl_server, "POST", "/continue_generation").status_code == 200

    async def pause_wait() -> httpx.Response:
        return await _apost(rl_server, "/pause?mode=wait")  # vLLM's name

    finish, ids, r = asyncio.run(_stream_first_then(rl_server, pause_wait))
    assert r.status_code == 200 and finish == "length" and tuple(ids) == solo[0]
    assert call(rl_server, "POST", "/resume").status_code == 200
    r = call(rl_server, "POST", "/pause_generation", json={"mode": "sideways"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
    assert generate(rl_server, max_tokens=120)[0][0] == solo


def test_flush_cache(rl_server) -> None:
    long_prompt = PROMPT * 4
    for _ in range(2):
        generate(rl_server, prompt=long_prompt, max_tokens=2)
    before = generate(rl_server, prompt=long_prompt)
    assert rl_server.metric("detspec:kv_cache_cached_pages") > 0
    r = call(rl_server, "POST", "/flush_cache")
    assert r.status_code == 200 and r.json()["num_cached_pages_freed"] > 0, r.text
    assert rl_server.metric("detspec:kv_cache_cached_pages") == 0
    assert call(rl_server, "POST", "/reset_prefix_cache").status_code == 200  # vLLM's name
    assert generate(rl_server, prompt=long_prompt) == before


def test_release_and_resume_kv_memory(rl_server) -> None:
    before = generate(rl_server)
    r = call(rl_server, "POST", "/release_memory_occupation", json={"tags": ["kv_cache"]})
    assert r.status_code == 409 and "pause" in r.json()["message"], r.text
    r = call(rl_server, "POST", "/release_memory_occupation", json={"tags": ["weights"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tags[0]"
    assert call(rl_server, "POST", "/pause_generation", json={"mode": "abort"}).status_code == 200
    r = call(rl_server, "POST", "/release_memory_occupation", json={})
    assert r.status_code == 200 and r.json()["kv_cache_bytes"] == 0, r.text
    assert call(rl_server, "GET", "/is_sleeping").json() == {"is_sleeping": True}
    r = call(rl_server, "POST", "/continue_generation")
    assert 400 <= r.status_code < 500 and "resume" in r.json()["message"]
    r = call(rl_server, "POST", "/resume_memory_occupation", json={"tags": ["kv_cache"]})
    assert r.status_code == 200 and r.json()["kv_cache_bytes"] > 0
    assert call(rl_server, "POST", "/continue_generation").status_code == 200
    assert generate(rl_server) == before
    # vLLM's sleep / wake_up
    r = call(rl_server, "POST", "/sleep?level=1")
    assert r.status_code == 200 and r.json()["kv_cache_bytes"] == 0, r.text
    assert call(rl_server, "POST", "/wake_up").status_code == 200
    assert call(rl_server, "GET", "/is_sleeping").json() == {"is_sleeping": False}
    assert generate(rl_server) == before


# ---------------------------------------------------------------- GRPO over HTTP

GRPO_PROMPTS = ["The quick brown fox", "Once upon a time there was", "What is the capital of"]
GROUP = 8
STEPS = 3


async def rollouts(server: ServerProcess, step: int) -> list[dict]:
    """n = GROUP seeded deterministic samples per prompt, all prompts at once."""
    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)

    async def one(i: int, prompt: str) -> dict:
        seed = 1000 * step + i
        r = await client.completions.create(
            model=SERVED_NAME, prompt=prompt, n=GROUP, max_tokens=12, temperature=1.0,
            seed=seed, logprobs=0,
            extra_body={"deterministic": True, "return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        return {
            "seed": seed,
            "fingerprint": r.system_fingerprint,
            "prompt_ids": r.choices[0].model_extra["prompt_token_ids"],
            "samples": [
                (tuple(c.model_extra["token_ids"]),
                 tuple(struct.pack("<f", x) for x in c.logprobs.token_logprobs))
                for c in sorted(r.choices, key=lambda c: c.index)
            ],
        }  # fmt: skip

    try:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(GRPO_PROMPTS))))
    finally:
        await client.close()


def old_logprobs(server: ServerProcess, group: dict) -> list[tuple[bytes, ...]]:
    """The trainer's "old" logprobs of each sample, scored over HTTP: ``echo`` of prompt +
    completion with ``max_tokens: 0``, the completion's part of ``token_logprobs``."""
    p = group["prompt_ids"]
    r = call(
        server,
        "POST",
        "/v1/completions",
        json={"prompt": [list(p) + list(ids) for ids, _ in group["samples"]], "max_tokens": 0,
              "echo": True, "logprobs": 0, "deterministic": True},
    )  # fmt: skip
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    return [
        tuple(struct.pack("<f", x) for x in c["logprobs"]["token_logprobs"][len(p) :])
        for c in choices
    ]


def reward(token_ids: tuple[int, ...]) -> float:
    return sum(t % 2 == 0 for t in token_ids) / max(1, len(token_ids))


def policy_step(w: np.ndarray, groups: list[dict], lr: float = 0.05) -> np.ndarray:
    """A toy policy-gradient step on the output embedding: each sampled token's row is scaled
    by its group-relative advantage (deterministic numpy, so a replay recomputes the bits)."""
    grad = np.zeros(w.shape[0], dtype=np.float64)
    for g in groups:
        r = np.array([reward(ids) for ids, _ in g["samples"]])
        adv = r - r.mean()
        for (ids, _), a in zip(g["samples"], adv, strict=True):
            for t in ids:
                grad[t] += a
    return (w * (1.0 + lr * np.tanh(grad))[:, None].astype(np.float32)).astype(np.float32)


def test_grpo_loop_over_http_and_replay(
    rl_server, weights, demo_model_dir, tmp_path, tmp_path_factory
) -> None:
    name = head_name(weights)
    w = weights
    log = []
    for step in range(STEPS):
        fp = fingerprint(rl_server)
        groups = asyncio.run(rollouts(rl_server, step))
        assert all(g["fingerprint"] == fp for g in groups)
        for g in groups:
            assert len(set(g["samples"])) > 1, "a group's samples are all the same"
            # on-policy: scoring the samples gives the sampler's logprobs, bit for bit
            assert old_logprobs(rl_server, g) == [lps for _, lps in g["samples"]]
        new_head = policy_step(w[name], groups)
        w = {**w, name: new_head}
        ck = write_checkpoint(tmp_path / f"step{step}", w)
        if step % 2 == 0:  # tensors over HTTP: only the changed parameter
            r = call(
                rl_server,
                "POST",
                "/update_weights_from_tensor",
                content=save({name: new_head}),
                headers={"Content-Type": "application/octet-stream"},
            )
        else:
            r = call(rl_server, "POST", "/update_weights_from_disk", json={"model_path": str(ck)})
        assert r.status_code == 200, r.text
        assert r.json()["fingerprint"] != fp
        log.append({"fingerprint": fp, "groups": groups, "checkpoint": ck,
                    "after": r.json()["fingerprint"]})  # fmt: skip
    restore(rl_server, demo_model_dir)

    # Replay on a fresh server from the stored seeds and checkpoints.
    fresh = start_rl_server(tmp_path_factory, "rl-replay", demo_model_dir)
    try:
        for step, entry in enumerate(log):
            assert fingerprint(fresh) == entry["fingerprint"]
            again = asyncio.run(rollouts(fresh, step))
            for g0, g1 in zip(entry["groups"], again, strict=True):
                assert g1["seed"] == g0["seed"]
                assert g1["samples"] == g0["samples"], f"step {step}: samples differ in replay"
            r = call(fresh, "POST", "/update_weights_from_disk",
                     json={"model_path": os.fspath(entry["checkpoint"])})  # fmt: skip
            assert r.status_code == 200 and r.json()["fingerprint"] == entry["after"], r.text
    finally:
        assert fresh.stop() == 0, fresh.log()
