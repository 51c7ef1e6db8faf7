"""Qwen3.5's gated DeltaNets keep a recurrent state per sequence, outside the pages: a live
state every forward advances and, for a request whose tokens a verifier commits, the state at
its last committed token. So every way a sequence gets computed must give what one
whole-prompt prefill gives, bit for bit: prefill in small chunks (the state carried between
them), preemption (the state rebuilt from position 0), rollbacks (the verify pass run again
with the accepted rows only, then the committed state copied over the live one), scoring (a
state of its own). A cached prefix would come without its state, so prefix caching is off.
The whole-prompt run is checked against transformers first."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import log_softmax

import detspec
from detspec import SamplingParams

RNG = np.random.default_rng(11)
PROMPT = [int(x) for x in RNG.integers(3, 500, size=61)]
NEW = 12


def params(seed: int = 0) -> SamplingParams:
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


@pytest.fixture(scope="module")
def qwen(model_zoo):
    return model_zoo.get("qwen3_5")


@pytest.fixture(scope="module")
def whole(qwen):
    """The whole-prompt run's bits (greedy, seeded), its greedy run checked against
    transformers: every token its argmax, every logprob within 1e-4."""
    llm = detspec.LLM(str(qwen.path), num_kv_pages=256)
    greedy, seeded = (bits(o) for o in llm.generate([PROMPT] * 2, [params(), params(7)]))
    llm.shutdown()
    tokens, lp_bits = greedy
    rows = log_softmax(qwen.logits(PROMPT + tokens[:-1])[len(PROMPT) - 1 :])
    assert [int(t) for t in rows.argmax(axis=-1)] == tokens
    got = np.array(lp_bits, dtype=np.uint32).view(np.float32)
    assert np.abs(got - rows[np.arange(NEW), tokens]).max() < 1e-4
    return greedy, seeded


def run(qwen, prompts, sps, **kw) -> tuple[list[detspec.RequestOutput], dict]:
    llm = detspec.LLM(str(qwen.path), **{"num_kv_pages": 256, **kw})
    outs = llm.generate(prompts, sps, use_tqdm=False)
    stats = {**llm.stats(), **llm.kv_stats()}
    llm.shutdown()
    return outs, stats


def test_chunked_prefill_carries_the_state(qwen, whole):
    # 7-token chunks (inline rows: deterministic prompts are chunked as any other).
    outs, _ = run(
        qwen, [PROMPT] * 2, [params(), params(7)], max_prefill_chunk=7, max_num_batched_tokens=16
    )
    assert [bits(o) for o in outs] == list(whole)


def test_prefix_caching_is_off(qwen, whole):
    llm = detspec.LLM(str(qwen.path), num_kv_pages=256)
    llm.generate([PROMPT[:48] + [7, 8, 9]], params(3), use_tqdm=False)
    outs = llm.generate([PROMPT] * 2, [params(), params(7)], use_tqdm=False)
    assert llm.kv_stats()["prefix_hits"] == 0
    assert [bits(o) for o in outs] == list(whole)
    llm.shutdown()


@pytest.mark.parametrize("strategy", ["inline", "replay"])
def test_preempted_sequences_rebuild_their_state(qwen, whole, strategy):
    rng = np.random.default_rng(9)
    crowd = [[int(x) for x in rng.integers(3, 500, size=50)] for _ in range(6)]
    sps = [params(), params(7)] + [params(20 + i) for i in range(len(crowd))]
    # 14 pages of 16 slots for ~600 tokens of work: someone is preempted.
    outs, _ = run(
        qwen,
        [PROMPT, PROMPT, *crowd],
        sps,
        num_kv_pages=14,
        page_size=16,
        verify_strategy=strategy,
        verify_window=4,
    )
    assert max(o.metrics["num_preemptions"] for o in outs) > 0, "the pool never ran dry"
    assert [bits(o) for o in outs[:2]] == list(whole)


def test_rollbacks_leave_the_committed_state(qwen, whole):
    # Forced mismatches roll sequences back: the pass runs again taking in the accepted rows
    # only, and the next window replays from there.
    outs, stats = run(
        qwen,
        [PROMPT] * 2,
        [params(), params(7)],
        verify_strategy="replay",
        verify_window=4,
        fault_injection=0.4,
    )
    assert stats["num_rollbacks"] > 0, stats
    assert [bits(o) for o in outs] == list(whole)


def test_a_state_left_wrong_by_rollback_would_show(qwen, whole):
    """Negative control for the test above: without forced faults nothing rolls back, and with
    them the bits hold only because the state is rewound; so the same run on the
    shape-dependent profile (real mismatches) still gives one answer alone and crowded."""
    kw = dict(kernel_profile="shape_dependent", verify_window=4, verify_group=2)
    alone, _ = run(qwen, [PROMPT], [params(7)], **kw)
    rng = np.random.default_rng(4)
    crowd = [[int(x) for x in rng.integers(3, 500, size=n)] for n in (5, 30, 44)]
    sps = [params(7)] + [params(40 + i) for i in range(3)]
    crowded, stats = run(qwen, [PROMPT, *crowd], sps, **kw)
    assert bits(crowded[0]) == bits(alone[0])


def test_score_equals_the_generation(qwen, whole):
    llm = detspec.LLM(str(qwen.path), num_kv_pages=256)
    tokens, lp_bits = whole[0]
    (scored,) = llm.score([PROMPT], [tokens])
    assert [np.float32(x).view(np.uint32).item() for x in scored] == lp_bits
    llm.shutdown()
