"""Determinism over HTTP: a deterministic request (greedy, and seeded at temperature 0.8) sent
alone, then again while 32 concurrent clients stream other requests of random lengths, returns
identical token ids, identical logprob floats (compared as f32 bits after the JSON round
trip) and the same ``system_fingerprint``. The same comparison without ``deterministic``
must show a difference in at least one of several runs (the negative control: without it
this test could not see batch variance at all)."""

# ruff: noqa: F811  (pytest fixtures imported from server_fixtures)

from __future__ import annotations

import asyncio
import random
import struct

import numpy as np
import openai
import pytest
from server_fixtures import SERVED_NAME, demo_model_dir, inline_server, server  # noqa: F401

TARGET_PROMPT = [int(x) for x in np.random.default_rng(0).integers(3, 900, size=17)]
NUM_CLIENTS = 32


def target_kwargs(temperature: float, deterministic: bool) -> dict:
    return dict(
        model=SERVED_NAME,
        prompt=TARGET_PROMPT,
        max_tokens=32,
        temperature=temperature,
        seed=1234,
        logprobs=2,
        extra_body={
            "deterministic": deterministic,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )


def bits(resp) -> tuple:
    ch = resp.choices[0]
    lp = ch.logprobs
    return (
        tuple(ch.model_extra["token_ids"]),
        tuple(struct.pack("<f", x) for x in lp.token_logprobs),
        tuple(tuple(sorted((k, struct.pack("<f", v)) for k, v in d.items()))
              for d in lp.top_logprobs),
        resp.system_fingerprint,
    )  # fmt: skip


async def under_load(
    base_url: str,
    kwargs: dict,
    seed: int,
    repeats: int = 3,
    clients: int = NUM_CLIENTS,
    vocab: int = 900,
) -> list[tuple]:
    """Sends the target ``repeats`` times while ``clients`` clients keep streaming random
    requests (token ids below ``vocab``); returns the target's bits each time."""
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
    stop = asyncio.Event()
    started = asyncio.Semaphore(0)
    streamed = [0]

    async def load(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        first = True
        while not stop.is_set():
            stream = await client.completions.create(
                model=SERVED_NAME,
                prompt=[rng.randrange(3, vocab) for _ in range(rng.randint(1, 90))],
                max_tokens=rng.randint(4, 40),
                temperature=rng.choice([0.0, 1.0]),
                seed=rng.randrange(2**31),
                stream=True,
                extra_body={"ignore_eos": True, "deterministic": rng.random() < 0.3},
            )
            async for _ in stream:
                streamed[0] += 1
                if first:
                    started.release()
                    first = False

    tasks = [asyncio.create_task(load(i)) for i in range(clients)]
    try:
        for _ in range(clients // 2):  # at least half of the clients are streaming
            await asyncio.wait_for(started.acquire(), 60)
        results = []
        rng = random.Random(seed)
        for _ in range(repeats):
            await asyncio.sleep(rng.uniform(0.0, 0.3))
            before = streamed[0]
            results.append(bits(await client.completions.create(**kwargs)))
            assert streamed[0] > before, "the load was not running during the target request"
        return results
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()
        await client.close()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("strategy", ["replay", "inline"])
def test_deterministic_request_is_bitwise_identical_under_load(
    request, strategy, temperature
) -> None:
    server = request.getfixturevalue("server" if strategy == "replay" else "inline_server")
    sync = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    kwargs = target_kwargs(temperature, deterministic=True)
    solo = bits(sync.completions.create(**kwargs))
    assert len(solo[0]) == 32
    loaded = asyncio.run(under_load(server.base_url, kwargs, seed=int(temperature * 10)))
    for i, got in enumerate(loaded):
        assert got[0] == solo[0], f"token ids differ under load (repeat {i})"
        assert got[1] == solo[1], f"logprob bits differ under load (repeat {i})"
        assert got[2] == solo[2], f"top-logprob bits differ under load (repeat {i})"
        assert got[3] == solo[3], "system_fingerprint differs"


@pytest.mark.parametrize("strategy", ["replay", "inline"])
def test_negative_control_plain_requests_differ_under_load(request, strategy) -> None:
    """Without ``deterministic`` the fast path's batch variance shows in the logprob bits in
    at least one of several loaded runs."""
    server = request.getfixturevalue("server" if strategy == "replay" else "inline_server")
    sync = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    kwargs = target_kwargs(0.8, deterministic=False)
    solo = bits(sync.completions.create(**kwargs))
    runs = 0
    for seed in range(4):
        loaded = asyncio.run(under_load(server.base_url, kwargs, seed=100 + seed))
        runs += len(loaded)
        if any(got[:3] != solo[:3] for got in loaded):
            return
    pytest.fail(
        f"{runs} plain requests under load were all bitwise identical to the solo run: "
        "the determinism test above could not tell a broken DVR from a working one"
    )
