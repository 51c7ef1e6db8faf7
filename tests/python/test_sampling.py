"""Sampling: seeded reproducibility, batch independence, distributions, logprobs,
stop conditions and penalties (vLLM semantics), on the tiny llama model."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

# isort: split
import detspec
from detspec import SamplingParams

SEED = 1234
LOGPROB_ATOL = 1e-4
VARIANTS = {
    "temp": {"temperature": 0.8},
    "top_k": {"temperature": 0.8, "top_k": 20},
    "top_p": {"temperature": 0.8, "top_p": 0.9},
    "min_p": {"temperature": 0.8, "min_p": 0.05},
    "top_k+top_p": {"temperature": 0.8, "top_k": 50, "top_p": 0.8},
}


def seeded(seed=SEED, max_tokens=24, **kwargs) -> SamplingParams:
    kwargs.setdefault("temperature", 0.8)
    return SamplingParams(seed=seed, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def log_softmax(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def lp_table(completion):
    """logprobs as comparable plain data: [{token: (logprob, rank)}]."""
    if completion.logprobs is None:
        return None
    return [
        {int(k): (float(v.logprob), int(v.rank)) for k, v in entry.items()}
        for entry in completion.logprobs
    ]


def assert_same_completion(a, b, exact: bool, where: str) -> None:
    assert list(a.token_ids) == list(b.token_ids), f"{where}: token ids differ"
    assert a.finish_reason == b.finish_reason, where
    ta, tb = lp_table(a), lp_table(b)
    if exact:
        assert ta == tb, f"{where}: logprobs differ bitwise"
        assert a.cumulative_logprob == b.cumulative_logprob, where
        return
    assert (ta is None) == (tb is None), where
    for t, (tok, ea, eb) in enumerate(zip(a.token_ids, ta or [], tb or [], strict=False)):
        assert ea[tok][0] == pytest.approx(eb[tok][0], abs=LOGPROB_ATOL), f"{where}, token {t}"
        assert ea[tok][1] == eb[tok][1], f"{where}, token {t}: rank"


def first_new_index(tokens, start: int) -> int:
    """First index >= start whose token does not occur earlier in `tokens`."""
    for i in range(start, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return i
    raise AssertionError(f"no fresh token after index {start} in {tokens}")


@pytest.fixture(scope="module")
def llm(llm_factory):
    return llm_factory("llama")


# --------------------------------------------------------------------------- SamplingParams


def test_sampling_params_defaults():
    sp = SamplingParams()
    assert sp.n == 1
    assert sp.temperature == 1.0
    assert sp.top_p == 1.0
    assert sp.top_k == 0
    assert sp.min_p == 0.0
    assert sp.seed is None
    assert sp.max_tokens == 16
    assert sp.min_tokens == 0
    assert not sp.stop
    assert not sp.stop_token_ids
    assert sp.ignore_eos is False
    assert sp.logprobs is None
    assert sp.presence_penalty == 0.0
    assert sp.frequency_penalty == 0.0
    assert sp.repetition_penalty == 1.0
    assert sp.deterministic is False


def test_sampling_params_keeps_values():
    sp = SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.1,
        seed=5,
        max_tokens=7,
        min_tokens=2,
        stop=["\n"],
        stop_token_ids=[3, 4],
        ignore_eos=True,
        logprobs=3,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        deterministic=True,
    )
    assert (sp.top_k, sp.seed, sp.max_tokens, sp.min_tokens, sp.logprobs) == (40, 5, 7, 2, 3)
    assert sp.temperature == pytest.approx(0.7) and sp.top_p == pytest.approx(0.9)
    assert sp.min_p == pytest.approx(0.1) and sp.repetition_penalty == pytest.approx(1.2)
    assert list(sp.stop) == ["\n"] and list(sp.stop_token_ids) == [3, 4]
    assert sp.ignore_eos is True and sp.deterministic is True


# --------------------------------------------------------------------------- reproducibility


def _variant_batch(token_prompts, seed=SEED, deterministic=False):
    prompts, params, labels = [], [], []
    for vname, variant in VARIANTS.items():
        for i, p in enumerate(token_prompts):
            prompts.append(p)
            params.append(seeded(seed, logprobs=2, deterministic=deterministic, **variant))
            labels.append(f"{vname}/prompt{i}")
    return prompts, params, labels


def test_seeded_sampling_reproducible_across_engines(model_zoo, token_prompts):
    """Two fresh engines, the same seeded batch: identical token ids and logprobs."""
    path = str(model_zoo.get("llama").path)
    prompts, params, labels = _variant_batch(token_prompts)
    runs = [detspec.LLM(path, device="cpu").generate(prompts, params) for _ in range(2)]
    for label, a, b in zip(labels, runs[0], runs[1], strict=True):
        assert_same_completion(a.outputs[0], b.outputs[0], exact=True, where=label)


@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
def test_seeded_sampling_reproducible_same_engine(llm, token_prompts, deterministic):
    """The same seeded batch twice on one engine (prefix cache may be warm the second
    time): same tokens; logprobs bitwise equal for deterministic requests."""
    prompts, params, labels = _variant_batch(token_prompts, deterministic=deterministic)
    first = llm.generate(prompts, params)
    second = llm.generate(prompts, params)
    for label, a, b in zip(labels, first, second, strict=True):
        c = a.outputs[0]
        assert len(c.token_ids) == 24 and c.finish_reason == "length", label
        assert all(0 <= t < 512 for t in c.token_ids), label
        assert_same_completion(c, b.outputs[0], exact=deterministic, where=label)


def test_different_seeds_give_different_outputs(llm, token_prompts):
    a = llm.generate(token_prompts, seeded(1234))
    b = llm.generate(token_prompts, seeded(4321))
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert list(x.outputs[0].token_ids) != list(y.outputs[0].token_ids), f"prompt {i}"


@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
def test_seeded_request_same_alone_and_in_batch(llm, token_prompts, deterministic):
    target_prompt = token_prompts[2]
    target = seeded(top_k=50, logprobs=2, deterministic=deterministic)
    alone = llm.generate([target_prompt], target)[0].outputs[0]

    batch_a = llm.generate(
        [token_prompts[3], target_prompt, token_prompts[0], token_prompts[1]],
        [
            SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
            target,
            seeded(99, temperature=1.0, max_tokens=5),
            seeded(5, top_p=0.9, max_tokens=40, deterministic=not deterministic),
        ],
    )[1].outputs[0]
    rng = np.random.default_rng(3)
    others = [[int(t) for t in rng.integers(2, 512, size=n)] for n in (90, 3, 33, 16, 64)]
    batch_b = llm.generate(
        others + [target_prompt],
        [seeded(s, temperature=1.0, max_tokens=8 + s) for s in range(len(others))] + [target],
    )[-1].outputs[0]

    assert_same_completion(alone, batch_a, exact=deterministic, where="alone vs batch A")
    assert_same_completion(alone, batch_b, exact=deterministic, where="alone vs batch B")


# --------------------------------------------------------------------------- distributions


def _expected_distribution(row, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """Token probabilities after temperature -> top-k -> top-p / min-p (vLLM order),
    plus a mask of tokens too close to a cut-off to tell kept from dropped."""
    z = np.asarray(row, dtype=np.float64) / temperature
    keep = np.ones(z.shape, dtype=bool)
    unsure = np.zeros(z.shape, dtype=bool)
    if top_k > 0:
        keep[:] = False
        keep[np.argsort(-z)[:top_k]] = True
    p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p)
        before = np.cumsum(p[order]) - p[order]
        keep[order[before >= top_p]] = False
        unsure[order[np.abs(before - top_p) < 1e-3]] = True
    if min_p > 0.0:
        threshold = min_p * p.max()
        keep &= p >= threshold
        unsure |= np.abs(p - threshold) < 1e-3 * p.max()
    q = np.where(keep, p, 0.0)
    return q / q.sum(), unsure


@pytest.mark.parametrize(
    "filters",
    [
        {"temperature": 0.8, "top_k": 5},
        {"temperature": 0.5, "top_p": 0.6},
        {"temperature": 0.7, "min_p": 0.2},
        {"temperature": 2.0, "top_k": 3},
    ],
    ids=["top_k", "top_p", "min_p", "hot_top_k"],
)
def test_sampling_distribution_matches_softmax(llm, llama_case, token_prompts, filters):
    """300 one-token samples with seeds 0..299 follow the filtered softmax."""
    prompt = token_prompts[1]
    probs, unsure = _expected_distribution(llama_case.logits(prompt)[-1], **filters)
    n = 300
    outs = llm.generate([prompt] * n, [seeded(s, max_tokens=1, **filters) for s in range(n)])
    samples = np.array([o.outputs[0].token_ids[0] for o in outs])
    counts = np.bincount(samples, minlength=probs.size)
    outside = sorted(set(np.nonzero((counts > 0) & (probs == 0) & ~unsure)[0].tolist()))
    assert not outside, f"sampled tokens the filter removes: {outside}"
    if unsure.any():
        return  # a token sits on a cut-off: only the support is checked
    support = np.nonzero(probs)[0]
    assert len(np.unique(samples)) > 1, "seeds 0..299 all gave the same token"
    for tok in support:
        expect, sd = n * probs[tok], np.sqrt(n * probs[tok] * (1 - probs[tok]))
        assert abs(counts[tok] - expect) <= 5 * sd + 2, (
            f"token {tok}: {counts[tok]} samples, expected {expect:.1f} +- {sd:.1f}; "
            f"counts {dict(zip(support.tolist(), counts[support].tolist(), strict=True))}, "
            f"probs {np.round(probs[support], 3).tolist()}"
        )


def test_logprobs_top_entries_and_ranks(llm, llama_case, token_prompts):
    """logprobs=3 at temperature 1 (processed == raw logprobs): chosen + top-3 entries,
    values equal HF's log_softmax, ranks are 1-based positions in the full vocab."""
    outs = llm.generate(token_prompts, seeded(7, temperature=1.0, max_tokens=16, logprobs=3))
    for i, (prompt, out) in enumerate(zip(token_prompts, outs, strict=True)):
        c = out.outputs[0]
        toks = list(c.token_ids)
        assert len(toks) == 16 and len(c.logprobs) == 16
        ref = log_softmax(llama_case.logits(prompt + toks[:-1])[len(prompt) - 1 :])
        for t, (tok, entry) in enumerate(zip(toks, c.logprobs, strict=True)):
            where = f"prompt {i}, token {t}"
            row = ref[t]
            assert tok in entry, f"{where}: chosen token missing"
            assert 3 <= len(entry) <= 4, f"{where}: {len(entry)} entries"
            for k, v in entry.items():
                assert abs(v.logprob - row[k]) <= LOGPROB_ATOL, f"{where}: token {k}"
                lo = 1 + int((row > row[k] + LOGPROB_ATOL).sum())
                hi = 1 + int((row > row[k] - LOGPROB_ATOL).sum())
                assert lo <= v.rank <= hi, f"{where}: token {k} rank {v.rank}, HF {lo}..{hi}"
                assert isinstance(v.decoded_token, str)
            ranks = sorted(v.rank for v in entry.values())
            assert ranks[:3] == [1, 2, 3], f"{where}: ranks {ranks}"
            chosen_rank = entry[tok].rank
            assert len(entry) == (3 if chosen_rank <= 3 else 4), f"{where}: {ranks}"
        chosen = [entry[tok].logprob for tok, entry in zip(toks, c.logprobs, strict=True)]
        assert c.cumulative_logprob == pytest.approx(sum(chosen), abs=1e-3)


def test_max_logprobs_bounds_top_logprobs(llm, llm_factory, llama_case, token_prompts):
    """The engine's ``max_logprobs`` (vLLM's, default 20) bounds ``logprobs`` and
    ``prompt_logprobs``, naming the field; -1 is the vocabulary. A wider engine returns that
    many entries, the narrow engine's bit for bit among them."""
    prompt = token_prompts[0]
    assert llm.max_logprobs == 20
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(detspec.InvalidRequestError) as e:
            llm.generate([prompt], seeded(max_tokens=2, **{field: 21}))
        assert e.value.param == field
    wide = llm_factory("llama", max_logprobs=-1)
    vocab = wide.max_logprobs
    assert vocab == json.loads((llama_case.path / "config.json").read_text())["vocab_size"]
    params = seeded(max_tokens=6, logprobs=vocab, prompt_logprobs=40)
    (out,) = wide.generate([prompt], params)
    entries = out.outputs[0].logprobs
    assert all(sorted(v.rank for v in e.values()) == list(range(1, vocab + 1)) for e in entries)
    assert out.prompt_logprobs[0] is None
    assert all(len(e) in (40, 41) for e in out.prompt_logprobs[1:])
    (narrow,) = llm.generate([prompt], seeded(max_tokens=6, logprobs=20, prompt_logprobs=20))
    assert list(narrow.outputs[0].token_ids) == list(out.outputs[0].token_ids)
    for a, b in zip(lp_table(narrow.outputs[0]), lp_table(out.outputs[0]), strict=True):
        assert all(b[k] == v for k, v in a.items())
    for a, b in zip(narrow.prompt_logprobs[1:], out.prompt_logprobs[1:], strict=True):
        assert all(b[k].logprob == v.logprob and b[k].rank == v.rank for k, v in a.items())
    with pytest.raises(detspec.InvalidRequestError) as e:
        llm_factory("llama", max_logprobs=-2)
    assert e.value.param == "max_logprobs"


# --------------------------------------------------------------------------- stopping


def test_stop_token_ids_and_max_tokens(llm, llama_case, token_prompts):
    refs = [llama_case.greedy(p).tokens for p in token_prompts]
    k0, k2 = first_new_index(refs[0], 3), first_new_index(refs[2], 10)
    never = next(t for t in range(2, 512) if t not in refs[3])
    params = [
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop_token_ids=[refs[0][k0]]),
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        SamplingParams(
            temperature=0,
            max_tokens=32,
            ignore_eos=True,
            stop_token_ids=[never, refs[2][k2]],
        ),
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop_token_ids=[never]),
    ]
    outs = llm.generate(token_prompts, params)
    expected = [
        (
            refs[0][: k0 + 1],
            "stop",
        ),  # the stop token itself is part of token_ids (vLLM)
        (refs[1][:5], "length"),
        (refs[2][: k2 + 1], "stop"),
        (refs[3], "length"),
    ]
    for i, (out, (tokens, reason)) in enumerate(zip(outs, expected, strict=True)):
        c = out.outputs[0]
        assert (list(c.token_ids), c.finish_reason) == (tokens, reason), f"prompt {i}"
        assert out.finished


def test_min_tokens_suppresses_stop_tokens(llm, llama_case, token_prompts):
    prompt = token_prompts[2]
    ref = llama_case.greedy(prompt).tokens
    k = first_new_index(ref, 2)
    stop, min_tokens = ref[k], k + 4

    def mask_stop(_prompt, generated, row):
        if len(generated) < min_tokens:
            row[stop] = -np.inf
        return row

    expected = llama_case.reference_greedy(prompt, 32, process=mask_stop, stop_ids={stop})
    sp = SamplingParams(
        temperature=0,
        max_tokens=32,
        min_tokens=min_tokens,
        stop_token_ids=[stop],
        ignore_eos=True,
    )
    c = llm.generate([prompt], sp)[0].outputs[0]
    msg = llama_case.greedy_mismatch(prompt, list(c.token_ids), expected, "min_tokens")
    if msg:
        pytest.fail(msg)
    stopped = expected.tokens[-1] == stop and len(expected.tokens) < 32
    assert c.finish_reason == ("stop" if stopped else "length")
    assert len(c.token_ids) >= min_tokens


def f32_bits(xs) -> list[bytes]:
    return [np.float32(x).tobytes() for x in xs]


def chosen_logprobs(c) -> list[float]:
    return [float(entry[t].logprob) for t, entry in zip(c.token_ids, c.logprobs, strict=True)]


def test_allowed_token_ids_restrict_the_choice_not_the_logprobs(llm, llama_case, token_prompts):
    """vLLM's ``allowed_token_ids``: the output is HF's greedy path over only those tokens;
    the logprobs stay the model's (the score of the same tokens, bit for bit)."""
    prompt = token_prompts[1]
    ref = llama_case.greedy(prompt).tokens
    allowed = sorted({t for t in ref[2:10] if t != ref[0]})

    def keep(_prompt, _generated, row):
        masked = np.full_like(row, -np.inf)
        masked[allowed] = row[allowed]
        return masked

    expected = llama_case.reference_greedy(prompt, 16, process=keep)
    sp = SamplingParams(
        temperature=0,
        max_tokens=16,
        ignore_eos=True,
        allowed_token_ids=allowed,
        logprobs=0,
        deterministic=True,
    )
    c = llm.generate([prompt], sp)[0].outputs[0]
    msg = llama_case.greedy_mismatch(prompt, list(c.token_ids), expected, "allowed_token_ids")
    if msg:
        pytest.fail(msg)
    assert c.token_ids[0] != ref[0]  # the restriction changed the choice
    scored = llm.score([prompt], [list(c.token_ids)])[0]
    assert f32_bits(chosen_logprobs(c)) == f32_bits(scored)
    # Sampled, every token is still one of them.
    sampled = llm.generate([prompt], seeded(allowed_token_ids=allowed))[0].outputs[0]
    assert set(sampled.token_ids) <= set(allowed)
    with pytest.raises(detspec.InvalidRequestError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(detspec.InvalidRequestError, match="allowed_token_ids"):
        llm.generate([prompt], SamplingParams(allowed_token_ids=[10**6]))


def contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_bad_words_never_appear(llm, token_prompts):
    """vLLM's ``bad_words``: a word of the unrestricted output (as written and with a leading
    space, as the tokenizer encodes each) never appears once banned; deterministic requests
    with bad words give the same bits alone and in a batch."""
    tok = llm.get_tokenizer()
    prompt = token_prompts[0]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    free = list(llm.generate([prompt], greedy)[0].outputs[0].token_ids)

    def word_forms(word: str) -> list[list[int]]:
        return [tok.encode(f, add_special_tokens=False) for f in (word, " " + word)]

    # A word of the free output, as one of its tokenizations.
    word = next(
        w
        for t in free
        if (w := tok.decode([t]).strip()) and any(contains(free, f) for f in word_forms(w))
    )
    forms = word_forms(word)
    banned = SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, logprobs=0, bad_words=[word]
    )
    c = llm.generate([prompt], banned)[0].outputs[0]
    assert not any(contains(list(c.token_ids), f) for f in forms), (word, forms, c.token_ids)
    det = SamplingParams(
        temperature=0.9, seed=3, max_tokens=24, ignore_eos=True, logprobs=0,
        bad_words=[word], deterministic=True,
    )  # fmt: skip
    alone = llm.generate([prompt], det)[0].outputs[0]
    batch = llm.generate([token_prompts[2], prompt, token_prompts[3]], [greedy, det, greedy])
    mixed = batch[1].outputs[0]
    assert list(alone.token_ids) == list(mixed.token_ids)
    assert f32_bits(chosen_logprobs(alone)) == f32_bits(chosen_logprobs(mixed))
    assert not any(contains(list(alone.token_ids), f) for f in forms)
    with pytest.raises(detspec.InvalidRequestError, match="bad_words"):
        SamplingParams(bad_words=["  "])


def test_eos_stops_unless_ignore_eos(llama_case, token_prompts, copy_model_dir):
    """Make a token the model will emit greedily the EOS (config.json,
    generation_config.json and tokenizer_config.json agree), then check stopping."""
    d = copy_model_dir("llama")
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    chosen = None
    for prompt in token_prompts[1:]:
        ref = llama_case.greedy(prompt).tokens
        for k in range(2, len(ref)):
            t = ref[k]
            if t not in ref[:k] and 2 <= t < tok.get_vocab_size() and 1 not in ref[: k + 1]:
                chosen = (prompt, ref, k)
                break
        if chosen:
            break
    assert chosen, "no suitable EOS candidate in the greedy references"
    prompt, ref, k = chosen
    eos = ref[k]
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((d / name).read_text()) if (d / name).exists() else {}
        cfg["eos_token_id"] = eos
        (d / name).write_text(json.dumps(cfg, indent=2))
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    tcfg["eos_token"] = tok.id_to_token(eos)
    (d / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))

    llm = detspec.LLM(str(d), device="cpu")
    stop = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32))[0].outputs[0]
    assert (list(stop.token_ids), stop.finish_reason) == (ref[: k + 1], "stop")
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[
        0
    ].outputs[0]
    assert (list(full.token_ids), full.finish_reason) == (ref, "length")


# --------------------------------------------------------------------------- penalties


def _penalised(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0):
    """vLLM semantics: repetition over prompt+output tokens (divide positive logits,
    multiply negative ones); presence/frequency over output tokens only."""

    def process(prompt, generated, row):
        row = row.astype(np.float64)
        if repetition_penalty != 1.0:
            seen = np.unique(np.array(prompt + generated, dtype=np.int64))
            vals = row[seen]
            row[seen] = np.where(vals > 0, vals / repetition_penalty, vals * repetition_penalty)
        if generated:
            counts = np.bincount(generated, minlength=row.size).astype(np.float64)
            row -= frequency_penalty * counts + presence_penalty * (counts > 0)
        return row

    return process


@pytest.mark.parametrize(
    "penalty",
    [
        {"repetition_penalty": 1.3},
        {"presence_penalty": 0.7},
        {"frequency_penalty": 0.5},
        {"repetition_penalty": 0.8, "frequency_penalty": -0.3},
    ],
    ids=["repetition", "presence", "frequency", "mixed"],
)
def test_greedy_with_penalties_matches_reference(llm, llama_case, token_prompts, penalty):
    prompts = token_prompts[1:3]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **penalty)
    outs = llm.generate(prompts, sp)
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        expected = llama_case.reference_greedy(prompt, 24, process=_penalised(**penalty))
        got = list(out.outputs[0].token_ids)
        msg = llama_case.greedy_mismatch(prompt, got, expected, f"{penalty} prompt {i}")
        if msg:
            pytest.fail(msg)
