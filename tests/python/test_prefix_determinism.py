"""Deterministic requests read the prefix cache, but only pages computed on invariant kernels
(deterministic prefill: inline rows, or replay's isolated prefill in fixed-shape passes where
GEMMs depend on M). So a deterministic request after a shared prefix was prefilled by another
deterministic request, by a non-deterministic one, or as turn 1 of a conversation returns the
same bits as on a fresh engine, on both kernel profiles."""

from __future__ import annotations

import struct
from collections.abc import Callable

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


def engine(model: str, profile: tuple[str, str], **kw) -> detspec.LLM:
    kernel_profile, strategy = profile
    return detspec.LLM(
        model,
        kernel_profile=kernel_profile,
        verify_strategy=strategy,
        verify_window=8,
        verify_group=4,
        num_kv_pages=512,
        **kw,
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

    # (c) turn 2 of a conversation after turn 1 on the same engine. Turn 2 reads turn 1's
    # answer too where its KV is what a prefill writes (every kernel shape-invariant); where
    # GEMMs depend on M the verifier wrote it, and turn 2 reads only the prompt's pages.
    llm = engine(flat_model, profile)
    turn1 = gen(llm, PREFIX, params(seed=5))
    answer = list(turn1.outputs[0].token_ids)
    turn2_prompt = PREFIX + answer + SUFFIX
    turn2 = gen(llm, turn2_prompt, params(seed=6))
    assert bits(turn2) == bits(gen(engine(flat_model, profile), turn2_prompt, params(seed=6)))
    if profile[0] == "invariant":
        assert turn2.num_cached_tokens == (len(PREFIX) + len(answer) - 1) // PAGE * PAGE
    else:
        assert turn2.num_cached_tokens == len(PREFIX) // PAGE * PAGE


@pytest.fixture(scope="module", params=["tiny", "qwen3_5"])
def any_model(request, flat_model: str, model_zoo) -> tuple[str, Callable[[list[int]], list[int]]]:
    """(a model, what makes the module's token lists its tokens): the tiny Llama, and
    Qwen3.5's zoo model, whose DeltaNet layers keep a state per sequence (a cached prefix is
    read from the state its prefill kept after its last full page; its vocabulary is 512)."""
    if request.param == "tiny":
        return flat_model, lambda tokens: tokens
    return str(model_zoo.get(request.param).path), lambda tokens: [t % 500 + 3 for t in tokens]


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("deterministic", [True, False])
def test_n_samples_of_one_prompt_prefill_it_once(any_model, profile, deterministic) -> None:
    """The first sample computes the prompt; the other seven wait for its prefill and read its
    pages (they would otherwise be admitted beside it and compute it too), and on Qwen3.5 the
    state its prefill kept after those pages. Every deterministic sample equals, bit for bit,
    the same sample on an engine without a prefix cache."""
    model, fit = any_model
    prompt = fit(PREFIX)
    sp = params(deterministic=deterministic, seed=21)
    sp.n = 8
    llm = engine(model, profile)
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    stats = llm.kv_stats()
    full = (len(prompt) - 1) // PAGE * PAGE
    assert stats["prefix_hits"] == 7 * full, stats
    assert out.num_cached_tokens == full
    if not deterministic:
        return  # a plain sample's bits depend on what it ran beside
    uncached = uncached_engine(model, profile)
    ref = uncached.generate([prompt], sp, use_tqdm=False)[0]
    assert uncached.kv_stats()["prefix_hits"] == 0
    for i in range(8):
        assert bits_of(out.outputs[i]) == bits_of(ref.outputs[i]), f"sample {i}"


PAGE = 16  # the default page size
PROMPT_PAGES = (len(PREFIX + SUFFIX) - 1) // PAGE  # the full pages a generation may read


def uncached_engine(model: str, profile: tuple[str, str]) -> detspec.LLM:
    return engine(model, profile, enable_prefix_caching=False)


def hits_of(llm: detspec.LLM, run) -> tuple[object, int]:
    """What `run()` returns and the prefix-cache tokens it read."""
    before = llm.kv_stats()["prefix_hits"]
    out = run()
    return out, int(llm.kv_stats()["prefix_hits"] - before)


def lp_bits(entries) -> list[tuple[int, str]]:
    return [
        (t, struct.pack("<f", lp.logprob).hex())
        for e in entries
        if e is not None
        for t, lp in sorted(e.items())
    ]


@pytest.mark.parametrize("profile", PROFILES)
def test_a_scored_prompt_is_not_computed_again_by_its_generation(any_model, profile) -> None:
    """Prompt logprobs (what eval harnesses ask with `max_tokens` 1) are computed as a
    deterministic prefill computes the prompt and leave its pages in the prefix cache (and on
    Qwen3.5 the state after them): the generation after them reads every full page of its
    prompt, and its tokens, logprobs and prompt logprobs equal an engine's without a prefix
    cache, bit for bit. A plain request reads those pages too."""
    flat_model, fit = any_model
    prompt = fit(PREFIX + SUFFIX)
    sp = params()
    sp.prompt_logprobs = 2
    sp.max_tokens = 1
    ref = uncached_engine(flat_model, profile).generate([prompt], sp, use_tqdm=False)[0]

    llm = engine(flat_model, profile)
    out, hits = hits_of(llm, lambda: gen(llm, prompt, sp))
    assert bits(out) == bits(ref)
    assert lp_bits(out.prompt_logprobs) == lp_bits(ref.prompt_logprobs)
    assert hits == PROMPT_PAGES * PAGE, "the generation computed its scored prompt again"
    assert out.num_cached_tokens == PROMPT_PAGES * PAGE and ref.num_cached_tokens == 0

    # Scored first, then generated by a deterministic and by a plain request.
    for deterministic in (True, False):
        llm = engine(flat_model, profile)
        llm.prompt_logprobs([prompt], 1)
        out, hits = hits_of(llm, lambda llm=llm, d=deterministic: gen(llm, prompt, params(d)))
        assert hits == PROMPT_PAGES * PAGE, f"deterministic={deterministic}: no page was read"
        if deterministic:
            fresh = uncached_engine(flat_model, profile)
            assert bits(out) == bits(gen(fresh, prompt, params()))


@pytest.mark.parametrize("profile", PROFILES)
def test_a_plain_conversation_on_a_deterministic_prefix_caches_its_own_turns(
    flat_model: str, profile
) -> None:
    """A plain request that read a deterministic request's pages registers the pages it
    computed after them, its answer's included, so the next turn of its conversation reads
    the whole of turn 1 (it used to stop at the deterministic prefix), while a deterministic
    request with the same tokens still reads only the invariant pages and keeps its
    fresh-engine bits."""
    llm = engine(flat_model, profile)
    gen(llm, PREFIX, params(seed=9))  # deterministic: the prefix's pages are invariant
    turn1_prompt = PREFIX + SUFFIX + OTHER
    turn1 = gen(llm, turn1_prompt, params(deterministic=False, seed=5))
    assert turn1.num_cached_tokens == len(PREFIX) // PAGE * PAGE
    turn2_prompt = turn1_prompt + list(turn1.outputs[0].token_ids) + SUFFIX
    turn2 = gen(llm, turn2_prompt, params(deterministic=False, seed=6))
    # every full page before turn 1's last token, whose KV turn 1 never computed
    read = (len(turn1_prompt) + len(turn1.outputs[0].token_ids) - 1) // PAGE * PAGE
    assert turn2.num_cached_tokens == read, "turn 2 did not read turn 1's own pages"

    det = gen(llm, turn2_prompt, params(seed=6))
    assert det.num_cached_tokens == len(PREFIX) // PAGE * PAGE
    assert bits(det) == bits(
        gen(uncached_engine(flat_model, profile), turn2_prompt, params(seed=6))
    )


@pytest.mark.parametrize("profile", PROFILES)
def test_logits_and_hidden_states_leave_only_pages_a_prefill_would_compute(
    flat_model: str, profile
) -> None:
    """`compute_logits` and `encode` run every row of their prompts; where GEMMs depend on M
    their rows ran at a shape no deterministic prefill runs at, so their pages must not be
    read by a deterministic request (it would see other bits than on a fresh engine)."""
    prompt = PREFIX + SUFFIX
    fresh = bits(gen(uncached_engine(flat_model, profile), prompt, params()))
    for forward in ("compute_logits", "encode"):
        llm = engine(flat_model, profile)
        getattr(llm, forward)([prompt])
        out, hits = hits_of(llm, lambda llm=llm: gen(llm, prompt, params()))
        assert bits(out) == fresh, forward
        assert hits == (PROMPT_PAGES * PAGE if profile[0] == "invariant" else 0), forward


@pytest.mark.parametrize("profile", PROFILES)
def test_score_reads_the_pages_of_the_prompt_it_generated_from(any_model, profile) -> None:
    """An RL step scores the completions it just sampled: `score` reads the prompt pages the
    deterministic generation left in the cache, and still equals the sampler's logprobs and an
    uncached engine's scores bit for bit. Pages of a plain generation are never read by it."""
    flat_model, fit = any_model
    prompt = fit(PREFIX + SUFFIX)
    llm = engine(flat_model, profile)
    out = gen(llm, prompt, params())
    completion = list(out.outputs[0].token_ids)
    scored, hits = hits_of(llm, lambda: llm.score([prompt], [completion], deterministic=True))
    assert hits == PROMPT_PAGES * PAGE, "score computed the cached prompt again"
    sampled = [c[t].logprob for t, c in zip(completion, out.outputs[0].logprobs, strict=True)]
    as_bits = lambda xs: [struct.pack("<f", x).hex() for x in xs]  # noqa: E731
    assert as_bits(scored[0]) == as_bits(sampled)
    fresh = uncached_engine(flat_model, profile).score([prompt], [completion], deterministic=True)
    assert as_bits(scored[0]) == as_bits(fresh[0])

    plain = engine(flat_model, profile)
    gen(plain, prompt, params(deterministic=False))
    _, hits = hits_of(plain, lambda: plain.score([prompt], [completion], deterministic=True))
    assert hits == 0, "deterministic scoring read pages of the fast path"


@pytest.mark.parametrize("profile", PROFILES)
def test_completions_of_one_prompt_scored_together_compute_it_once(any_model, profile):
    """GRPO's group of completions, DPO's chosen and rejected: pairs of one `score` call
    that share a prompt compute it once (the first pair of each prompt runs first, the
    others read its pages, and on Qwen3.5 the state it kept after them), interleaved or not,
    and every score equals an uncached engine's bit for bit."""
    flat_model, fit = any_model
    other = fit(OTHER * 4)
    prompts = [fit(PREFIX), other, fit(PREFIX), fit(PREFIX), other]
    completions = [[5 + i, 7, 9 + i] for i in range(len(prompts))]
    llm = engine(flat_model, profile)
    scored, hits = hits_of(llm, lambda: llm.score(prompts, completions, deterministic=True))
    pages = lambda p: (len(p) - 1) // PAGE * PAGE  # noqa: E731
    assert hits == 2 * pages(prompts[0]) + pages(other), "a shared prompt was computed again"
    ref = uncached_engine(flat_model, profile).score(prompts, completions, deterministic=True)
    as_bits = lambda xs: [struct.pack("<f", x).hex() for x in xs]  # noqa: E731
    assert [as_bits(x) for x in scored] == [as_bits(x) for x in ref]


def bits_of(c: detspec.CompletionOutput) -> tuple[list[int], list[str]]:
    return list(c.token_ids), [
        struct.pack("<f", lp[t].logprob).hex()
        for t, lp in zip(c.token_ids, c.logprobs, strict=True)
    ]


@pytest.mark.parametrize("profile", PROFILES)
def test_cache_salt_confines_hits_to_its_salt(flat_model: str, profile) -> None:
    """vLLM's ``cache_salt`` prompt key: a prompt's cached pages reach only requests with the
    same salt, through ``generate``, ``AsyncLLM`` and ``score``; outputs do not change."""
    llm = engine(flat_model, profile)
    prompt = PREFIX + SUFFIX

    def salted(salt: str | None) -> detspec.RequestOutput:
        p = (
            {"prompt_token_ids": prompt}
            if salt is None
            else {
                "prompt_token_ids": prompt,
                "cache_salt": salt,
            }
        )
        return llm.generate([p], params(), use_tqdm=False)[0]

    first = salted("a")
    assert first.num_cached_tokens == 0
    for salt in ("b", None):
        out = salted(salt)
        assert out.num_cached_tokens == 0, f"{salt!r} read salt a's pages"
        assert bits(out) == bits(first)
    again = salted("a")
    assert again.num_cached_tokens > 0 and bits(again) == bits(first)
    # score leaves the prompt's pages under its salt, and reads them under it alone
    c = list(first.outputs[0].token_ids)
    lps = first.outputs[0].token_logprobs
    assert llm.score([prompt], [c], cache_salt="c")[0] == list(lps)
    assert salted("c").num_cached_tokens > 0
    with pytest.raises(detspec.InvalidRequestError, match="cache_salt"):
        salted("")
    with pytest.raises(detspec.InvalidRequestError, match="cache_salt"):
        llm.score([prompt], [c], cache_salt="")
