"""Models whose layers keep state besides keys and values: LFM2's short convolutions (each
token's `B ⊙ x`, a row in the paged cache beside the keys and values), Qwen3.5's gated
DeltaNets and Granite 4.0-H's Mamba2 mixers (a recurrent state per sequence outside the
pages: a live one every forward advances, and for a request whose tokens a verifier commits,
the state at its last committed token). Every way a sequence gets computed must give what one
whole-prompt prefill gives, bit for bit for a deterministic request: prefill in small chunks
(the rows, or the state, carried between them), preemption (rebuilt from position 0),
rollbacks (LFM2: rows the next pass rewrites; the recurrent models: the verify pass run again
with the accepted rows only, then the committed state copied over the live one), real
mismatches among other requests, scoring, and a prefix read from the cache (LFM2's pages hold
its rows; the recurrent models start from the state an earlier prefill kept after its
prompt's last full page). The whole-prompt run is checked against transformers first."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import log_softmax

import detspec
from detspec import SamplingParams

NEW = 12
# model -> the seed of its prompt.
PROMPT_SEEDS = {"lfm2": 5, "qwen3_5": 11, "granite4_h": 13, "bamba": 17, "nemotron_h": 19}


def params(seed: int = 0) -> SamplingParams:
    """Deterministic: greedy (seed 0) or seeded at T = 0.8; NEW tokens with logprobs."""
    return SamplingParams(
        temperature=0.8 if seed else 0.0,
        seed=seed or None,
        max_tokens=NEW,
        ignore_eos=True,
        logprobs=0,
        deterministic=True,
    )


def bits(out: detspec.RequestOutput) -> tuple[list[int], list[int]]:
    c = out.outputs[0]
    return list(c.token_ids), [np.float32(x).view(np.uint32).item() for x in c.token_logprobs]


def run(case, prompts, sps, **kw) -> tuple[list[detspec.RequestOutput], dict]:
    """A fresh engine's outputs of `prompts`, with its stats and KV stats."""
    llm = detspec.LLM(str(case.path), **{"num_kv_pages": 256, **kw})
    outs = llm.generate(prompts, sps, use_tqdm=False)
    stats = {**llm.stats(), **llm.kv_stats()}
    llm.shutdown()
    return outs, stats


def prompt_of(name: str) -> list[int]:
    """Model `name`'s 61-token prompt."""
    rng = np.random.default_rng(PROMPT_SEEDS[name])
    return [int(x) for x in rng.integers(3, 500, size=61)]


@pytest.fixture(scope="module", params=list(PROMPT_SEEDS))
def model(request, model_zoo):
    """(the zoo model, its prompt)."""
    return model_zoo.get(request.param), prompt_of(request.param)


@pytest.fixture(scope="module")
def whole(model):
    """The whole-prompt run's bits (greedy, seeded), its greedy run checked against
    transformers: every token its argmax, every logprob within 1e-4."""
    case, prompt = model
    llm = detspec.LLM(str(case.path), num_kv_pages=256)
    greedy, seeded = (bits(o) for o in llm.generate([prompt] * 2, [params(), params(7)]))
    llm.shutdown()
    tokens, lp_bits = greedy
    rows = log_softmax(case.logits(prompt + tokens[:-1])[len(prompt) - 1 :])
    assert [int(t) for t in rows.argmax(axis=-1)] == tokens
    got = np.array(lp_bits, dtype=np.uint32).view(np.float32)
    assert np.abs(got - rows[np.arange(NEW), tokens]).max() < 1e-4
    return greedy, seeded


def test_chunked_prefill_carries_what_earlier_chunks_left(model, whole):
    # 7-token chunks (inline rows: deterministic prompts are chunked as any other): every
    # chunk's first tokens read the rows, or the state, the chunk before left.
    case, prompt = model
    outs, _ = run(
        case, [prompt] * 2, [params(), params(7)], max_prefill_chunk=7, max_num_batched_tokens=16
    )
    assert [bits(o) for o in outs] == list(whole)


@pytest.mark.parametrize("strategy", ["inline", "replay"])
def test_a_cached_prefix_gives_the_whole_prompt_runs_bits(model, whole, strategy):
    """A prompt whose first 48 tokens an earlier prompt of 51 had reads them from the cache
    (LFM2: its pages hold the convolution rows; the recurrent models: the earlier prefill
    kept its state after its last full page, 48 tokens), as do both samples of it, with the
    whole-prompt run's bits. After a longer prompt (its state kept after 64 tokens) the
    recurrent models read nothing: pages without the state after them are of no use."""
    case, prompt = model
    recurrent = case.name != "lfm2"
    kw = dict(verify_strategy=strategy, verify_window=4)
    llm = detspec.LLM(str(case.path), num_kv_pages=256, **kw)
    llm.generate([prompt[:48] + [7, 8, 9]], params(3), use_tqdm=False)
    outs = llm.generate([prompt] * 2, [params(), params(7)], use_tqdm=False)
    assert [o.metrics["num_cached_tokens"] for o in outs] == [48, 48]
    assert [bits(o) for o in outs] == list(whole)
    # The first prompt's, and under inline each sample's after its answer completed page 4.
    snapshots = 0 if not recurrent else 3 if strategy == "inline" else 1
    assert llm.kv_stats()["state_snapshots"] == snapshots
    llm.shutdown()
    llm = detspec.LLM(str(case.path), num_kv_pages=256, **kw)
    llm.generate([prompt + [7] * 20], params(3), use_tqdm=False)
    outs = llm.generate([prompt], [params()], use_tqdm=False)
    assert outs[0].metrics["num_cached_tokens"] == (0 if recurrent else 48)
    assert bits(outs[0]) == whole[0]
    llm.shutdown()


@pytest.mark.parametrize("strategy", ["inline", "replay"])
def test_a_conversations_next_turn_reads_the_answer_too(model, whole, strategy):
    """Turn 2 (turn 1's prompt and answer, then a new message) reads turn 1 up to the answer's
    last full page, 64 of its 73 tokens: LFM2 from the answer's pages, the recurrent models
    also from the state kept when the answer's decode completed that page. Under replay the
    recurrent models' answers are speculative when decoded, so turn 2 reads up to the
    prompt's snapshot (48). Either way its bits are a fresh engine's."""
    case, prompt = model
    kw = dict(verify_strategy=strategy, verify_window=4)
    turn2 = prompt + whole[1][0] + [7, 8, 9]
    (fresh,), _ = run(case, [turn2], [params(5)], **kw)
    llm = detspec.LLM(str(case.path), num_kv_pages=256, **kw)
    llm.generate([prompt], params(7), use_tqdm=False)
    (second,) = llm.generate([turn2], params(5), use_tqdm=False)
    llm.shutdown()
    reads_answer = strategy == "inline" or case.name == "lfm2"
    assert second.metrics["num_cached_tokens"] == (64 if reads_answer else 48)
    assert bits(second) == bits(fresh)


def system_prompted(prompt: list[int], lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    """Prompts sharing `prompt`'s first 48 tokens (a system prompt, an eval's few-shot
    examples), each going on with random tokens of its own."""
    rng = np.random.default_rng(seed)
    return [prompt[:48] + [int(x) for x in rng.integers(3, 500, size=n)] for n in lengths]


@pytest.mark.parametrize("strategy", ["inline", "replay"])
def test_prompts_sharing_a_system_prompt_read_it(model, strategy):
    """Sent one by one: the first prompt computes the shared 48 tokens; the second finds
    their pages cached but, on a recurrent model, no state after them (the first kept its own
    after 64), so it computes them too and keeps the state where the shared run ends; from the
    third on they are read. LFM2's pages alone serve from the second. Sent together: the
    others wait for the first. Every answer has a fresh engine's bits."""
    case, prompt = model
    kw = dict(verify_strategy=strategy, verify_window=4)
    prompts = system_prompted(prompt, (20, 25, 30, 22), seed=31)
    llm = detspec.LLM(str(case.path), num_kv_pages=256, **kw)
    outs = [llm.generate([p], params(7), use_tqdm=False)[0] for p in prompts]
    llm.shutdown()
    cached = [o.metrics["num_cached_tokens"] for o in outs]
    assert cached == ([0, 48, 48, 48] if case.name == "lfm2" else [0, 0, 48, 48])
    fresh = [run(case, [p], [params(7)], **kw)[0][0] for p in prompts]
    assert [bits(o) for o in outs] == [bits(f) for f in fresh]
    # Sent together, the others wait for the first one's prefill, which (on a recurrent
    # model, asked to) keeps its state where the shared run ends. `generate` submits its
    # prompts one by one to the engine's thread: one that arrives after the first's prefill
    # is done finds no state at 48 and computes the shared part as the second one-by-one
    # prompt does (the scheduler's rule itself: `sched::sharing`'s unit tests).
    together, _ = run(case, prompts, [params(7)] * len(prompts), **kw)
    cached = [o.metrics["num_cached_tokens"] for o in together]
    assert cached[0] == 0 and cached[1] in (0, 48) and cached[2:] == [48, 48], cached
    assert [bits(o) for o in together] == [bits(f) for f in fresh]


def test_scoring_calls_sharing_few_shot_examples_read_them(model):
    """lm-eval's loglikelihood requests share their few-shot examples: the first `score`
    call computes them (on a recurrent model its later pairs keep the state where the shared
    run ends), the next reads them; the scores equal an engine's without a prefix cache."""
    case, prompt = model
    first, second = (system_prompted(prompt, (20, 25, 30), seed=s) for s in (41, 43))
    completions = [[5, 7, 9], [11, 13], [17]]

    def scored(llm: detspec.LLM, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
        before = llm.kv_stats()["prefix_hits"]
        out = llm.score(prompts, completions, deterministic=True)
        as_bits = [[np.float32(x).view(np.uint32).item() for x in s] for s in out]
        return as_bits, llm.kv_stats()["prefix_hits"] - before

    llm = detspec.LLM(str(case.path), num_kv_pages=256)
    got = [scored(llm, first), scored(llm, second)]
    llm.shutdown()
    assert got[1][1] == 3 * 48, "the next call computed the shared examples again"
    uncached = detspec.LLM(str(case.path), num_kv_pages=256, enable_prefix_caching=False)
    assert [g[0] for g in got] == [scored(uncached, p)[0] for p in (first, second)]
    uncached.shutdown()


@pytest.mark.parametrize("strategy", ["inline", "replay"])
def test_preempted_sequences_rebuild_what_they_keep(model, whole, strategy):
    case, prompt = model
    rng = np.random.default_rng(9)
    crowd = [[int(x) for x in rng.integers(3, 500, size=50)] for _ in range(6)]
    sps = [params(), params(7)] + [params(20 + i) for i in range(len(crowd))]
    # 14 pages of 16 slots for ~600 tokens of work: someone is preempted.
    outs, _ = run(
        case,
        [prompt, prompt, *crowd],
        sps,
        num_kv_pages=14,
        page_size=16,
        verify_strategy=strategy,
        verify_window=4,
    )
    assert max(o.metrics["num_preemptions"] for o in outs) > 0, "the pool never ran dry"
    assert [bits(o) for o in outs[:2]] == list(whole)


def test_forced_rollbacks_commit_the_whole_prompt_runs_bits(model, whole):
    # Forced mismatches roll sequences back: the rows past the rollback point are written
    # again by the next pass (LFM2), the pass runs again taking in the accepted rows only and
    # the next window replays from there (Qwen3.5).
    case, prompt = model
    outs, stats = run(
        case,
        [prompt] * 2,
        [params(), params(7)],
        verify_strategy="replay",
        verify_window=4,
        fault_injection=0.4,
    )
    assert stats["num_rollbacks"] > 0, stats
    assert [bits(o) for o in outs] == list(whole)


@pytest.mark.parametrize("name", ["qwen3_5", "granite4_h"])
def test_real_mismatches_among_other_requests_keep_the_bits(model_zoo, name):
    """Under the shape-dependent profile the fast path's GEMMs change with the batch, so
    the recurrent models' windows roll back for real (LFM2's do not here; its needle test runs
    this profile); a replayed request gives one answer alone and crowded."""
    case, prompt = model_zoo.get(name), prompt_of(name)
    kw = dict(kernel_profile="shape_dependent", verify_window=4, verify_group=2)
    alone, _ = run(case, [prompt], [params(7)], **kw)
    rng = np.random.default_rng(4)
    crowd = [[int(x) for x in rng.integers(3, 500, size=n)] for n in (5, 30, 44)]
    sps = [params(7)] + [params(40 + i) for i in range(3)]
    crowded, stats = run(case, [prompt, *crowd], sps, **kw)
    assert stats["num_rollbacks"] > 0, "no window rolled back: this test would be blind"
    assert bits(crowded[0]) == bits(alone[0])
    # Behind a deterministic prompt sharing its first 48 tokens, it starts from the state
    # that prefill kept (computed on the invariant kernels) with the same bits; behind a
    # plain one it reads nothing (that state came from the fast path).
    for det, hit in [(True, 48), (False, 0)]:
        first = SamplingParams(max_tokens=2, seed=3, temperature=0.8, deterministic=det)
        llm = detspec.LLM(str(case.path), num_kv_pages=256, **kw)
        llm.generate([prompt[:48] + [7, 8, 9], *crowd], [first, *sps[1:]], use_tqdm=False)
        (behind,) = llm.generate([prompt], [params(7)], use_tqdm=False)
        assert llm.kv_stats()["state_snapshots"] > 0
        llm.shutdown()
        assert behind.metrics["num_cached_tokens"] == hit
        assert bits(behind) == bits(alone[0])


def test_score_equals_the_generation(model, whole):
    case, prompt = model
    llm = detspec.LLM(str(case.path), num_kv_pages=256)
    tokens, lp_bits = whole[0]
    (scored,) = llm.score([prompt], [tokens])
    assert [np.float32(x).view(np.uint32).item() for x in scored] == lp_bits
    llm.shutdown()


# Bytes of the zoo Qwen3.5's state per sequence: 3 DeltaNet layers, each 4 value heads of
# 16 × 16 plus 3 convolution taps of 2·2·16 + 4·16 channels, in f32.
QWEN3_5_STATE_BYTES = 3 * (4 * 16 * 16 + 3 * (2 * 2 * 16 + 4 * 16)) * 4


def test_running_sequences_share_a_bounded_pool_of_states(model_zoo):
    """The states come out of the KV budget (at most half of it): with room for three, four
    deterministic requests (two states each under replay) and four others run a few at a
    time, the deterministic ones with the bits a roomy engine gives them, and every state is
    given back."""
    case, prompt = model_zoo.get("qwen3_5"), prompt_of("qwen3_5")
    rng = np.random.default_rng(12)
    others = [[int(x) for x in rng.integers(3, 500, size=n)] for n in (9, 30, 17, 44)]
    prompts = [prompt, *others[:3], prompt, *others[1:]]
    sps = [params(7 * i) for i in range(4)] + [
        SamplingParams(temperature=0.8, seed=60 + i, max_tokens=NEW, ignore_eos=True, logprobs=0)
        for i in range(4)
    ]
    kw = dict(verify_strategy="replay", verify_window=4)
    roomy, _ = run(case, prompts, sps, **kw)
    llm = detspec.LLM(
        str(case.path), num_kv_pages=256, kv_cache_bytes=7 * QWEN3_5_STATE_BYTES, **kw
    )
    assert llm.kv_stats()["state_slots"] == 3
    bounded = llm.generate(prompts, sps, use_tqdm=False)
    kv = llm.kv_stats()
    assert kv["states_held"] == kv["state_snapshots"] <= 3, "a running sequence's state was kept"
    llm.shutdown()
    assert [bits(o) for o in bounded[:4]] == [bits(o) for o in roomy[:4]]
    assert all(len(o.outputs[0].token_ids) == NEW for o in bounded[4:])


def test_a_budget_without_room_for_the_states_is_refused(model_zoo):
    case = model_zoo.get("qwen3_5")
    with pytest.raises(ValueError, match=f"kv_cache_bytes.*at least {4 * QWEN3_5_STATE_BYTES}"):
        detspec.LLM(str(case.path), kv_cache_bytes=3 * QWEN3_5_STATE_BYTES)


def test_scoring_many_pairs_runs_them_a_few_states_at_a_time(model_zoo):
    """A standalone forward takes a fresh state per sequence; with room for three, twenty
    pairs run in groups of at most three, each with the logprobs a roomy engine gives it."""
    case = model_zoo.get("qwen3_5")
    rng = np.random.default_rng(21)
    prompts = [[int(x) for x in rng.integers(3, 500, size=n)] for n in rng.integers(2, 9, size=20)]
    completions = [[int(x) for x in rng.integers(3, 500, size=3)] for _ in prompts]

    def scored(**kw) -> list[list[int]]:
        llm = detspec.LLM(str(case.path), num_kv_pages=256, **kw)
        out = llm.score(prompts, completions)
        kv = llm.kv_stats()
        assert kv["states_held"] == kv["state_snapshots"]
        llm.shutdown()
        return [[np.float32(x).view(np.uint32).item() for x in s] for s in out]

    assert scored(kv_cache_bytes=7 * QWEN3_5_STATE_BYTES) == scored()
