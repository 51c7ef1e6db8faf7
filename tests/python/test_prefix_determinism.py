"""Deterministic requests read the prefix cache, but only pages computed on invariant kernels
(deterministic prefill: inline rows, or replay's isolated prefill in fixed-shape passes where
GEMMs depend on M). So a deterministic request after a shared prefix was prefilled by another
deterministic request, by a non-deterministic one, or as turn 1 of a conversation returns the
same bits as on a fresh engine, on both kernel profiles."""

from __future__ import annotations

import struct

import numpy as np
import pytest

import detspec
from detspec import SamplingParams

PROFILES = [
    pytest.param(("invariant", "inline"), id="invariant-inline"),
    pytest.param(("invariant", "replay"), id="invariant-replay"),
    pytest.param(("shape_dependent", "replay"), id="shape_dependent-replay"),
]

RNG = np.random.default_rng(42)
PREFIX = [int(x) for x in RNG.integers(3, 900, size=100)]
SUFFIX = [int(x) for x in RNG.integers(3, 900, size=9)]
OTHER = [int(x) for x in RNG.integers(3, 900, size=13)]


@pytest.fixture(scope="module")
def flat_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("prefix-model")
    detspec._core.write_demo_model(str(d), "tiny", 5)
    return str(d)


def params(deterministic: bool = True, seed: int = 3) -> SamplingParams:
    return SamplingParams(
        temperature=0.8,
        seed=seed,
        max_tokens=20,
        ignore_eos=True,
        logprobs=0,
        deterministic=deterministic,
    )


def bits(out: detspec.RequestOutput) -> tuple[list[int], list[str]]:
    return bits_of(out.outputs[0])


def engine(model: str, profile: tuple[str, str]) -> detspec.LLM:
    kernel_profile, strategy = profile
    return detspec.LLM(
        model,
        kernel_profile=kernel_profile,
        verify_strategy=strategy,
        verify_window=8,
        verify_group=4,
        num_kv_pages=512,
    )


def gen(llm: detspec.LLM, prompt: list[int], sp: SamplingParams) -> detspec.RequestOutput:
    return llm.generate([prompt], sp, use_tqdm=False)[0]


@pytest.mark.parametrize("profile", PROFILES)
def test_prefix_prefilled_by_anyone_gives_fresh_bits(flat_model: str, profile) -> None:
    fresh = bits(gen(engine(flat_model, profile), PREFIX + SUFFIX, params()))

    # (a) another deterministic request prefilled the prefix: its pages are read.
    llm = engine(flat_model, profile)
    gen(llm, PREFIX + OTHER, params(seed=9))
    hits = llm.kv_stats()["prefix_hits"]
    assert bits(gen(llm, PREFIX + SUFFIX, params())) == fresh
    assert llm.kv_stats()["prefix_hits"] > hits, "the deterministic prefix was not reused"

    # (b) a non-deterministic request prefilled it: its fast-path pages are never read.
    llm = engine(flat_model, profile)
    gen(llm, PREFIX + OTHER, params(deterministic=False, seed=9))
    assert bits(gen(llm, PREFIX + SUFFIX, params())) == fresh

    # (c) turn 2 of a conversation after turn 1 on the same engine.
    llm = engine(flat_model, profile)
    turn1 = gen(llm, PREFIX, params(seed=5))
    turn2_prompt = PREFIX + list(turn1.outputs[0].token_ids) + SUFFIX
    got = bits(gen(llm, turn2_prompt, params(seed=6)))
    assert got == bits(gen(engine(flat_model, profile), turn2_prompt, params(seed=6)))


@pytest.mark.parametrize("profile", PROFILES[1:])
def test_n_samples_of_one_prompt_prefill_it_once(flat_model: str, profile) -> None:
    """Under replay each sample's prompt is prefilled alone: the first computes it, the other
    seven read its pages. Every sample equals, bit for bit, the same sample on an engine
    without a prefix cache."""
    sp = params(seed=21)
    sp.n = 8
    llm = engine(flat_model, profile)
    out = llm.generate([PREFIX], sp, use_tqdm=False)[0]
    stats = llm.kv_stats()
    assert stats["prefix_hits"] >= 7, stats
    kernel_profile, strategy = profile
    uncached = detspec.LLM(
        flat_model,
        kernel_profile=kernel_profile,
        verify_strategy=strategy,
        verify_window=8,
        verify_group=4,
        num_kv_pages=512,
        enable_prefix_caching=False,
    )
    ref = uncached.generate([PREFIX], sp, use_tqdm=False)[0]
    assert uncached.kv_stats()["prefix_hits"] == 0
    for i in range(8):
        assert bits_of(out.outputs[i]) == bits_of(ref.outputs[i]), f"sample {i}"


def bits_of(c: detspec.CompletionOutput) -> tuple[list[int], list[str]]:
    return list(c.token_ids), [
        struct.pack("<f", lp[t].logprob).hex()
        for t, lp in zip(c.token_ids, c.logprobs, strict=True)
    ]
