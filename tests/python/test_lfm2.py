"""LFM2's short convolutions keep their state, each token's `B ⊙ x`, in the paged cache beside
the attention layers' keys and values. So every way a sequence's cache gets built must give
what one whole-prompt prefill gives, bit for bit for a deterministic request: prefill in small
chunks (a token's convolution reads rows of the chunk before), a prefix read from the cache
(rows another request computed), preemption (rows recomputed), rollbacks (rows the verifier
overwrote). The whole-prompt run is checked against transformers first."""

from __future__ import annotations

import numpy as np
import pytest
from whole_prompt import bits, params, run, whole_prompt_bits

import detspec

PROMPT = [int(x) for x in np.random.default_rng(5).integers(3, 500, size=61)]


@pytest.fixture(scope="module")
def lfm2(model_zoo):
    return model_zoo.get("lfm2")


@pytest.fixture(scope="module")
def whole(lfm2):
    return whole_prompt_bits(lfm2, PROMPT)


def test_chunked_prefill_reads_the_rows_of_earlier_chunks(lfm2, whole):
    # 7-token chunks: every chunk's first tokens convolve rows the chunk before wrote.
    outs, _ = run(
        lfm2, [PROMPT] * 2, [params(), params(7)], max_prefill_chunk=7, max_num_batched_tokens=16
    )
    assert [bits(o) for o in outs] == list(whole)


def test_a_cached_prefix_gives_the_rows_it_was_computed_with(lfm2, whole):
    other = PROMPT[:48] + [7, 8, 9]
    llm = detspec.LLM(str(lfm2.path), num_kv_pages=256)
    llm.generate([other], params(3), use_tqdm=False)
    hits = llm.kv_stats()["prefix_hits"]
    outs = llm.generate([PROMPT] * 2, [params(), params(7)], use_tqdm=False)
    assert llm.kv_stats()["prefix_hits"] > hits, "the prefix was not read from the cache"
    assert [bits(o) for o in outs] == list(whole)
    llm.shutdown()


def test_preempted_sequences_recompute_their_rows(lfm2, whole):
    rng = np.random.default_rng(9)
    crowd = [[int(x) for x in rng.integers(3, 500, size=50)] for _ in range(6)]
    sps = [params(), params(7)] + [params(20 + i) for i in range(len(crowd))]
    # 14 pages of 16 slots for ~600 tokens of work: someone is preempted.
    outs, stats = run(lfm2, [PROMPT, PROMPT, *crowd], sps, num_kv_pages=14, page_size=16)
    assert max(o.metrics["num_preemptions"] for o in outs) > 0, "the pool never ran dry"
    assert [bits(o) for o in outs[:2]] == list(whole)


def test_rollbacks_rewrite_the_rows(lfm2, whole):
    # Forced mismatches roll sequences back: the rows past the rollback point are written
    # again by the next pass, and the committed tokens are the whole-prompt run's.
    outs, stats = run(
        lfm2,
        [PROMPT] * 2,
        [params(), params(7)],
        verify_strategy="replay",
        verify_window=4,
        fault_injection=0.4,
    )
    assert stats["num_rollbacks"] > 0, stats
    assert [bits(o) for o in outs] == list(whole)
