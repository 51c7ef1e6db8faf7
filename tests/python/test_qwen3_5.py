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
from whole_prompt import bits, params, run, whole_prompt_bits

import detspec

PROMPT = [int(x) for x in np.random.default_rng(11).integers(3, 500, size=61)]


@pytest.fixture(scope="module")
def qwen(model_zoo):
    return model_zoo.get("qwen3_5")


@pytest.fixture(scope="module")
def whole(qwen):
    return whole_prompt_bits(qwen, PROMPT)


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


def test_real_mismatches_among_other_requests_keep_the_bits(qwen):
    """Under the shape-dependent profile the fast path's GEMMs change with the batch, so
    windows roll back for real; a replayed request gives one answer alone and crowded."""
    kw = dict(kernel_profile="shape_dependent", verify_window=4, verify_group=2)
    alone, _ = run(qwen, [PROMPT], [params(7)], **kw)
    rng = np.random.default_rng(4)
    crowd = [[int(x) for x in rng.integers(3, 500, size=n)] for n in (5, 30, 44)]
    sps = [params(7)] + [params(40 + i) for i in range(3)]
    crowded, stats = run(qwen, [PROMPT, *crowd], sps, **kw)
    assert stats["num_rollbacks"] > 0, "no window rolled back: this test would be blind"
    assert bits(crowded[0]) == bits(alone[0])


def test_score_equals_the_generation(qwen, whole):
    llm = detspec.LLM(str(qwen.path), num_kv_pages=256)
    tokens, lp_bits = whole[0]
    (scored,) = llm.score([PROMPT], [tokens])
    assert [np.float32(x).view(np.uint32).item() for x in scored] == lp_bits
    llm.shutdown()
