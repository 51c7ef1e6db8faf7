"""Helpers of the tests that check every way a sequence gets computed (chunked prefill,
preemption, rollbacks, a cached prefix) against one whole-prompt run, bit for bit: LFM2's
convolution rows in the pages, Qwen3.5's recurrent state beside them."""

from __future__ import annotations

import numpy as np
from conftest import log_softmax

import detspec
from detspec import SamplingParams

NEW = 12


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


def whole_prompt_bits(case, prompt: list[int]):
    """The whole-prompt run's bits (greedy, seeded), its greedy run checked against
    transformers: every token its argmax, every logprob within 1e-4."""
    llm = detspec.LLM(str(case.path), num_kv_pages=256)
    greedy, seeded = (bits(o) for o in llm.generate([prompt] * 2, [params(), params(7)]))
    llm.shutdown()
    tokens, lp_bits = greedy
    rows = log_softmax(case.logits(prompt + tokens[:-1])[len(prompt) - 1 :])
    assert [int(t) for t in rows.argmax(axis=-1)] == tokens
    got = np.array(lp_bits, dtype=np.uint32).view(np.float32)
    assert np.abs(got - rows[np.arange(NEW), tokens]).max() < 1e-4
    return greedy, seeded


def run(case, prompts, sps, **kw) -> tuple[list[detspec.RequestOutput], dict]:
    """A fresh engine's outputs of `prompts`, with its stats and KV stats."""
    llm = detspec.LLM(str(case.path), **{"num_kv_pages": 256, **kw})
    outs = llm.generate(prompts, sps, use_tqdm=False)
    stats = {**llm.stats(), **llm.kv_stats()}
    llm.shutdown()
    return outs, stats
