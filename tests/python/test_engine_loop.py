"""The continuous-batching engine loop seen from ``LLM.generate``: many ragged requests in
one call with chunked prefill, preemption under a KV pool that is too small, stop strings
(also across token boundaries) and the progress bar.

Greedy outputs are compared with the HF reference (``hf_greedy`` of conftest). The fast
path is batch-variant on purpose, so a greedy token may legitimately flip where the
reference's two best logits are (nearly) tied: such a flip is reported with
``warnings.warn`` (with the position and margin) instead of failing; any other difference
fails.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from conftest import (
    MODEL_SPECS,
    TEXT_PROMPTS,
    ModelCase,
    build_hf_model,
    save_model_dir,
    top2_margin,
)

# isort: split
import detspec
from detspec import SamplingParams

NEAR_TIE_RTOL = 1e-3  # a flip is a near-tie if HF's gap < NEAR_TIE_RTOL * max|logit|
LONG_CONTEXT = 512  # the long-prompt model: prompts of up to 300 tokens + outputs fit


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def check_greedy_vs_hf(case: ModelCase, prompt, got, label: str) -> str | None:
    """Fails unless `got` equals HF greedy for `prompt` up to a near-tie flip; returns a
    warning message for a near-tie flip (None when equal).

    Fast path: one HF forward over prompt + got; if every token is HF's argmax given the
    tokens before it, `got` is HF's greedy output. Otherwise the exact step-by-step HF
    greedy reference decides, and the first mismatch must be a near-tie.
    """
    got = [int(t) for t in got]
    rows = case.logits(list(prompt) + got[:-1])[len(prompt) - 1 :]
    if [int(t) for t in rows.argmax(axis=-1)] == got:
        return None
    ref = case.reference_greedy(prompt, len(got))
    msg = case.greedy_mismatch(prompt, got, ref, label)
    if msg is None:
        return None
    pos = next(i for i, (a, b) in enumerate(zip(got, ref.tokens, strict=False)) if a != b)
    row = ref.step_logits[pos]
    scale = float(np.abs(row).max())
    gap = float(row.max() - row[got[pos]])  # how far below HF's top detspec's token is
    if top2_margin(row) < NEAR_TIE_RTOL * scale and gap < NEAR_TIE_RTOL * scale:
        return f"near-tie flip (gap {gap:.3g} < {NEAR_TIE_RTOL} x {scale:.3g}): {msg}"
    pytest.fail(msg)


def report_near_ties(notes: list[str]) -> None:
    for note in notes:
        warnings.warn(note, stacklevel=2)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def long_case(tmp_path_factory, tokenizer_dir) -> ModelCase:
    """The tiny llama with max_position_embeddings 512 (default rope: the context length
    does not change the numbers), so prompts of up to 300 tokens fit."""
    spec = dict(MODEL_SPECS["llama"])
    model = build_hf_model(spec)
    model.config.max_position_embeddings = LONG_CONTEXT
    path = tmp_path_factory.mktemp("models") / "llama_ctx512"
    ref = save_model_dir(model, spec, path, tokenizer_dir)
    return ModelCase("llama_ctx512", path, ref, spec)


def ragged_workload(n: int = 64, seed: int = 4242):
    """n requests: prompt lengths 1..300 (both ends included), max_tokens 1..24, even
    indices greedy, odd ones seeded sampling with assorted filters."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 301, size=n)
    lengths[0], lengths[1], lengths[2] = 1, 300, 2
    prompts = [[int(t) for t in rng.integers(2, 512, size=int(k))] for k in lengths]
    filters = ({}, {"top_k": 20}, {"top_p": 0.9}, {"min_p": 0.05})
    params = []
    for i in range(n):
        max_tokens = int(rng.integers(1, 25))
        if i % 2 == 0:
            params.append(greedy(max_tokens))
        else:
            params.append(
                SamplingParams(
                    temperature=float(rng.choice([0.7, 1.0, 1.3])),
                    seed=1000 + i,
                    max_tokens=max_tokens,
                    ignore_eos=True,
                    **filters[(i // 2) % len(filters)],
                )
            )
    return prompts, params


# --------------------------------------------------------------------------- many requests


def test_64_ragged_requests_chunked_prefill(long_case):
    prompts, params = ragged_workload()
    assert max(map(len, prompts)) == 300 and min(map(len, prompts)) == 1
    # 64-token budget per step, 40-token prefill chunks: every prompt longer than 40 is
    # prefilled over several steps, next to other requests' decodes and chunks.
    llm = detspec.LLM(str(long_case.path), max_num_batched_tokens=64, max_prefill_chunk=40)
    outs = llm.generate(prompts, params, use_tqdm=False)

    assert len(outs) == len(prompts)
    notes = []
    for i, (prompt, sp, out) in enumerate(zip(prompts, params, outs, strict=True)):
        assert out.finished, f"request {i}"
        assert out.prompt_token_ids == prompt, f"output {i} is not prompt {i}"
        (c,) = out.outputs
        assert len(c.token_ids) == sp.max_tokens, f"request {i}"
        assert c.finish_reason == "length", f"request {i}"
        assert all(0 <= t < 512 for t in c.token_ids)
        m = out.metrics
        assert m["num_prompt_tokens"] == len(prompt) and m["num_output_tokens"] == sp.max_tokens
        assert m["arrival_time"] <= m["first_token_time"] <= m["finished_time"]
        if sp.temperature == 0.0:
            note = check_greedy_vs_hf(long_case, prompt, c.token_ids, f"request {i}")
            if note:
                notes.append(note)

    # Seeded samples depend only on the logits and (seed, position): the same requests in
    # a different batch (unchunked, without the greedy half) give the same tokens.
    seeded = [i for i, sp in enumerate(params) if sp.temperature > 0]
    again = detspec.LLM(str(long_case.path)).generate(
        [prompts[i] for i in seeded], [params[i] for i in seeded], use_tqdm=False
    )
    for i, out in zip(seeded, again, strict=True):
        a, b = outs[i].outputs[0].token_ids, out.outputs[0].token_ids
        if a != b:
            pos = next(k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
            row = long_case.logits(prompts[i] + a[:pos])[-1]
            gap = abs(float(row[a[pos]] - row[b[pos]]))
            scale = float(np.abs(row).max())
            where = f"seeded request {i} differs between batches at token {pos}"
            # Gumbel-max adds the same noise to both runs, so only (near-)equal logits flip
            assert gap < NEAR_TIE_RTOL * scale, f"{where}: HF logit gap {gap:.3g}"
            notes.append(f"near-tie flip: {where} (HF logit gap {gap:.3g}, scale {scale:.3g})")
    report_near_ties(notes)
    assert llm.kv_pages()[0] == llm.kv_pages()[1]


# --------------------------------------------------------------------------- preemption


def test_small_kv_pool_forces_preemption(llm_factory, llama_case):
    rng = np.random.default_rng(77)
    lengths = [90, 60, 100, 45, 80, 70, 33, 95, 55, 100, 20, 75]
    prompts = [[int(t) for t in rng.integers(2, 512, size=n)] for n in lengths]
    max_tokens = [32, 24, 32, 16, 32, 28, 32, 20, 32, 32, 8, 32]
    params = [greedy(n) for n in max_tokens]
    # 20 pages of 16 slots = 320 slots for ~1450 tokens of work; each request alone needs
    # at most ceil(132 / 16) = 9 pages, so it always fits once the others are preempted.
    llm = llm_factory("llama", num_kv_pages=20, page_size=16)
    assert llm.kv_pages() == (20, 20)
    outs = llm.generate(prompts, params, use_tqdm=False)

    notes = []
    for i, (prompt, n, out) in enumerate(zip(prompts, max_tokens, outs, strict=True)):
        assert out.finished and out.prompt_token_ids == prompt
        (c,) = out.outputs
        assert len(c.token_ids) == n and c.finish_reason == "length", f"request {i}"
        note = check_greedy_vs_hf(llama_case, prompt, c.token_ids, f"request {i}")
        if note:
            notes.append(note)
    preemptions = [out.metrics["num_preemptions"] for out in outs]
    assert max(preemptions) > 0, f"the pool never ran dry: preemptions {preemptions}"
    report_near_ties(notes)
    assert llm.kv_pages() == (20, 20)


# --------------------------------------------------------------------------- stop strings


def _plain(s: str) -> bool:
    return s.isascii() and s.isprintable()


@pytest.fixture(scope="module")
def reference_text(llm_factory, hf_tokenizer):
    """(prompt, greedy completion, text after each generated token, boundary stop string)
    for the first text prompt whose random-model continuation has a usable token boundary:
    a string made of the end of one token and the start of the next (>= 1 printable ASCII
    character from each, >= 3 in all) that first occurs exactly there, after >= 3
    characters of text."""
    llm = llm_factory("llama")
    tok = llm.get_tokenizer()
    for prompt in TEXT_PROMPTS:
        full = llm.generate(prompt, greedy(40), use_tqdm=False)[0].outputs[0]
        prompt_ids = tok.encode(prompt)
        base = hf_tokenizer.decode(prompt_ids, skip_special_tokens=True)
        prefixes = []  # text after k generated tokens, as one-shot decodes
        for k in range(len(full.token_ids) + 1):
            s = hf_tokenizer.decode(prompt_ids + full.token_ids[:k], skip_special_tokens=True)
            prefixes.append(s[len(base) :])
        if prefixes[-1] != full.text:  # invalid UTF-8 decodes differently one-shot
            continue
        text = full.text
        for k in range(1, len(prefixes) - 1):
            b = len(prefixes[k])  # boundary between generated tokens k-1 and k
            left = text[max(len(prefixes[k - 1]), b - 2) : b]
            right = text[b : min(len(prefixes[k + 1]), b + 2)]
            stop = left + right
            if left and right and len(stop) >= 3 and _plain(stop):
                if text.find(stop) == b - len(left) >= 3:  # with some text before it
                    return prompt, full, prefixes, stop
    pytest.fail("no text prompt gives a continuation with a usable token boundary")


def tokens_until(prefixes: list[str], stop: str) -> int:
    """How many generated tokens the engine needs before `stop` appears in the text."""
    return next(k for k, text in enumerate(prefixes) if stop in text)


def test_stop_string_spanning_token_boundary(llm_factory, reference_text):
    prompt, full, prefixes, stop = reference_text
    cut = full.text.find(stop)
    n = tokens_until(prefixes, stop)
    assert len(prefixes[n - 1]) < cut + len(stop) and len(prefixes[n - 1]) > cut  # spans

    llm = llm_factory("llama")
    (out,) = llm.generate(prompt, greedy(40, stop=[stop]), use_tqdm=False)
    c = out.outputs[0]
    assert c.text == full.text[:cut], (stop, c.text, full.text)
    assert c.finish_reason == "stop"
    assert c.stop_reason == stop
    # generation ends with the token that completes the stop string (vLLM keeps its id)
    assert c.token_ids == full.token_ids[:n]
    assert llm.kv_pages()[0] == llm.kv_pages()[1]


def test_stop_strings_earliest_wins_or_absent(llm_factory, reference_text):
    prompt, full, prefixes, _ = reference_text
    text = full.text
    firsts = [p for p in range(len(text) - 2) if _plain(text[p : p + 3])]
    firsts = [p for p in firsts if text.find(text[p : p + 3]) == p >= 1]
    early = text[firsts[0] : firsts[0] + 3]
    late = next(text[p : p + 3] for p in firsts if p >= firsts[0] + 3)
    llm = llm_factory("llama")
    outs = llm.generate(
        [prompt] * 3,
        [
            greedy(40, stop=[late, early]),  # listed late-first: the earliest match wins
            greedy(40, stop=[late]),
            greedy(40, stop="\x00never in the text"),
        ],
        use_tqdm=False,
    )
    a, b, c = (o.outputs[0] for o in outs)
    assert (a.text, a.finish_reason, a.stop_reason) == (text[: firsts[0]], "stop", early)
    assert a.token_ids == full.token_ids[: tokens_until(prefixes, early)]
    assert (b.text, b.finish_reason, b.stop_reason) == (text[: text.find(late)], "stop", late)
    assert b.token_ids == full.token_ids[: tokens_until(prefixes, late)]
    assert (c.text, c.finish_reason, c.stop_reason) == (text, "length", None)
    assert c.token_ids == full.token_ids


# --------------------------------------------------------------------------- progress bar


def test_use_tqdm_progress_to_stderr(llm_factory, token_prompts, capsys):
    llm = llm_factory("llama")
    capsys.readouterr()
    outs = llm.generate(token_prompts, greedy(4), use_tqdm=True)
    assert all(o.finished for o in outs)
    captured = capsys.readouterr()
    assert "Processed prompts" in captured.err
    assert f"{len(token_prompts)}/{len(token_prompts)}" in captured.err
    assert "toks/s" in captured.err
    assert "Processed prompts" not in captured.out

    llm.generate(token_prompts, greedy(4), use_tqdm=False)
    captured = capsys.readouterr()
    assert "Processed prompts" not in captured.err + captured.out
