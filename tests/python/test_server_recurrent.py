"""Recurrent models served over loopback HTTP with the real ``openai`` client: Qwen3.5 (gated
DeltaNets) and Granite 4.0-H (Mamba2), each sequence holding its state outside the KV pages.

Under the shape-dependent kernel profile the fast path's bits change with the batch, so the
verifier rolls windows back for real (and the state with them). A deterministic request sent
alone, again (its prompt read from the prefix cache, its state from the snapshot kept after
the prompt's last full page), then while other clients stream, returns the same token ids
and logprob bits (a plain one's move: the negative control); `n`
samples and prompt logprobs (``echo`` with ``max_tokens: 0``, what lm-eval's loglikelihood
sends) are served beside them, and the server ends cleanly."""

from __future__ import annotations

import asyncio

import numpy as np
import openai
import pytest
from server_fixtures import SERVED_NAME, start_server
from test_server_determinism import bits, under_load

VOCAB = 500
PROMPT = [int(x) for x in np.random.default_rng(3).integers(3, VOCAB, size=21)]


@pytest.fixture(scope="module", params=["qwen3_5", "granite4_h"])
def served(request, model_zoo, tmp_path_factory):
    s = start_server(
        tmp_path_factory,
        request.param,
        str(model_zoo.get(request.param).path),
        "--max-model-len",
        "256",
        "--kernel-profile",
        "shape_dependent",
        "--verify-strategy",
        "replay",
        "--verify-window",
        "4",
        "--verify-group",
        "2",
        "--num-kv-pages",
        "512",
    )
    yield s
    rc = s.stop()
    assert rc == 0, f"server exited with {rc}:\n{s.log()}"


def target(temperature: float, deterministic: bool = True) -> dict:
    return dict(
        model=SERVED_NAME,
        prompt=PROMPT,
        max_tokens=24,
        temperature=temperature,
        seed=77,
        logprobs=1,
        extra_body={
            "deterministic": deterministic,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )


def loaded(base_url: str, kwargs: dict, seed: int) -> tuple:
    """The target's bits while six clients stream requests of random lengths."""
    return asyncio.run(under_load(base_url, kwargs, seed, repeats=1, clients=6, vocab=VOCAB))[0]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_deterministic_request_keeps_its_bits_under_load(served, temperature) -> None:
    sync = openai.OpenAI(base_url=served.base_url + "/v1", api_key="x", max_retries=0)
    solo = bits(sync.completions.create(**target(temperature)))
    assert len(solo[0]) == 24
    # Sent again, its prompt is read from the prefix cache up to its last full page (16 of
    # its 21 tokens), the state from the snapshot its first prefill kept there.
    again = sync.completions.create(**target(temperature))
    assert again.usage.prompt_tokens_details.cached_tokens == 16
    assert bits(again) == solo
    # Loaded runs until one rolled a window back (a greedy one may not, now and then).
    for seed in range(1, 4):
        assert loaded(served.base_url, target(temperature), seed=seed) == solo
        if served.metric("detspec:rollbacks_total") > 0:
            break
    assert served.metric("detspec:rollbacks_total") > 0, "no window rolled back: the test is blind"


def test_negative_control_a_plain_request_moves_under_load(served) -> None:
    """Without ``deterministic`` the shape-dependent fast path shows in the logprob bits in
    at least one of a few loaded runs (else the test above could not see variance)."""
    sync = openai.OpenAI(base_url=served.base_url + "/v1", api_key="x", max_retries=0)
    solo = bits(sync.completions.create(**target(0.8, deterministic=False)))
    runs = [loaded(served.base_url, target(0.8, False), seed=10 + i) for i in range(3)]
    assert any(r[:2] != solo[:2] for r in runs), "the load never moved a plain request"


def test_samples_and_prompt_logprobs_are_served(served) -> None:
    sync = openai.OpenAI(base_url=served.base_url + "/v1", api_key="x", max_retries=0)
    two = sync.completions.create(
        model=SERVED_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5, n=2
    )
    assert len(two.choices) == 2 and all(c.finish_reason == "length" for c in two.choices)
    echo = sync.completions.create(
        model=SERVED_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1
    )
    lps = echo.choices[0].logprobs.token_logprobs
    # The first token has no logprob; every other one is a real one.
    assert len(lps) == len(PROMPT) and lps[0] is None
    assert all(x is not None and x <= 0.0 for x in lps[1:])
    served.wait_kv_idle()
