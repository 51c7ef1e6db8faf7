"""Torch and RL surface: weight updates from a trainer, scoring, prompt logprobs, audits,
logits and hidden states as torch tensors.

The contract under test: for deterministic requests, ``score`` of a generated completion
returns the logprobs it was generated with, bit for bit, whatever ran beside it; ``audit``
re-runs stored outputs exactly; weight updates are atomic, move the fingerprint with the
weights and give it back when the old weights come back."""

from __future__ import annotations

import asyncio
import copy
import struct

import numpy as np
import pytest
import torch
from conftest import greedy_mismatch_message, hf_greedy, log_softmax

import detspec
from detspec import AsyncLLM, InvalidRequestError, SamplingParams

PROMPTS = [[5, 17, 99, 250, 3], [42] * 9, list(range(60, 91))]


def bits(xs) -> list[int]:
    return [struct.unpack("<I", struct.pack("<f", x))[0] for x in xs]


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return m


def token_ids(llm: detspec.LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]


def outputs_bits(llm: detspec.LLM) -> list[tuple[list[int], list[int]]]:
    """Deterministic requests: their bits do not depend on how the three were batched."""
    outs = llm.generate(PROMPTS, greedy(deterministic=True), use_tqdm=False)
    return [(o.outputs[0].token_ids, bits(o.outputs[0].token_logprobs)) for o in outs]


# ---------------------------------------------------------------- weight updates


@pytest.mark.parametrize(
    "name",
    [
        "llama",
        "llama_tied",
        "qwen3",
        "phi3",
        "phi4_mini",
        "glm4",
        "exaone4",
        "olmo2",
        "olmo3",
        "gemma2",
        "gemma3",
        "granitemoeshared",
        "glm4_moe",
        "deepseek_v3",
        "deepseek_v3_plain",
        "deepseek_v2",
        "glm4_moe_lite",
        "minimax_m2",
        "ernie45_moe",
        "granite4",
        "granite4_moe_nope",
        "dots1",
        "hunyuan_dense",
        "apertus",
        "arcee",
        "lfm2",
        "lfm2_moe",
        "hunyuan_moe",
        "granite_swa",
        "granitemoe_swa",
        "solar_open",
        "exaone_moe",
        "mistral4",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_next",
        "granite4_h",
        "bamba",
        "nemotron_h",
        "nemotron_h_moe",
    ],
)
def test_update_weights_follows_transformers_and_restores_bit_for_bit(model_zoo, name):
    case = model_zoo.get(name)
    llm = detspec.LLM(str(case.path), num_kv_pages=256, **case.spec.get("llm_kwargs", {}))
    before, fp0 = outputs_bits(llm), llm.fingerprint
    new = perturbed(case.model, seed=3)
    llm.update_weights(new.state_dict().items())
    assert llm.fingerprint != fp0 and llm.weight_version == 1
    for prompt, got in zip(PROMPTS, token_ids(llm), strict=True):
        ref = hf_greedy(new, prompt, len(got))
        msg = greedy_mismatch_message(prompt, got, ref, f"[{name} updated]")
        assert msg is None, msg
    llm.update_weights(dict(case.model.state_dict()))
    assert llm.fingerprint == fp0 and llm.weight_version == 2
    assert outputs_bits(llm) == before


def test_update_weights_from_disk_equals_in_memory_update(model_zoo, tmp_path):
    case = model_zoo.get("llama")
    new = perturbed(case.model, seed=4)
    new.save_pretrained(tmp_path)
    a = detspec.LLM(str(case.path), num_kv_pages=256)
    b = detspec.LLM(str(case.path), num_kv_pages=256)
    a.update_weights(new.state_dict().items())
    b.update_weights_from_disk(tmp_path)
    assert a.fingerprint == b.fingerprint != detspec.LLM(str(case.path)).fingerprint
    assert outputs_bits(a) == outputs_bits(b)


def test_update_of_a_subset_changes_only_those(model_zoo):
    case = model_zoo.get("llama")
    llm = detspec.LLM(str(case.path), num_kv_pages=256)
    fp0, before = llm.fingerprint, outputs_bits(llm)
    assert llm.kv_stats()["cached_pages"] > 0  # PROMPTS[2]'s first 16 tokens
    w = case.model.state_dict()["model.layers.0.mlp.down_proj.weight"]
    llm.update_weights([("model.layers.0.mlp.down_proj.weight", w * 1.5)])
    assert llm.kv_stats()["cached_pages"] == 0  # KV of the old weights is gone
    assert llm.fingerprint != fp0 and outputs_bits(llm) != before
    llm.update_weights([("model.layers.0.mlp.down_proj.weight", w)])
    assert llm.fingerprint == fp0 and outputs_bits(llm) == before


@pytest.mark.parametrize(
    "bad, match",
    [
        (("model.layers.0.mlp.up_proj.weightx", torch.zeros(3)), "up_proj.weightx"),
        (("model.layers.99.mlp.up_proj.weight", torch.zeros(3)), "layers.99"),
        (("model.norm.weight", torch.zeros(5)), "model.norm.weight.*shape"),
        (("model.norm.weight", None), "model.norm.weight"),
        (("lm_head.weight", "not a tensor"), "lm_head.weight"),
    ],
)
def test_bad_update_names_the_tensor_and_changes_nothing(model_zoo, bad, match):
    case = model_zoo.get("llama")
    llm = detspec.LLM(str(case.path), num_kv_pages=256)
    fp0, before = llm.fingerprint, outputs_bits(llm)
    name, value = bad
    if value is None:  # right shape, integer dtype
        value = torch.zeros(case.model.state_dict()[name].shape, dtype=torch.int64)
    good = [(n, t * 2) for n, t in case.model.state_dict().items()]
    with pytest.raises(InvalidRequestError, match=match):
        llm.update_weights([*good[:3], (name, value), *good[3:]])
    assert llm.fingerprint == fp0 and llm.weight_version == 0
    assert outputs_bits(llm) == before


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_repeated_full_updates_do_not_grow_memory(model_zoo):
    case = model_zoo.get("llama")
    llm = detspec.LLM(str(case.path), num_kv_pages=64)
    state = dict(case.model.state_dict())
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    for _ in range(10):
        llm.update_weights(state)
    start = _rss_bytes()
    for _ in range(100):
        llm.update_weights(state)
    grown = _rss_bytes() - start
    # A leaked copy per update would be 100 models; allow allocator noise of a few.
    assert grown < 4 * model_bytes, f"RSS grew {grown} bytes over 100 updates ({model_bytes=})"
    assert llm.weight_version == 110


async def test_in_flight_requests_finish_on_old_weights_and_later_ones_use_new(model_zoo):
    case = model_zoo.get("llama")
    new = dict(perturbed(case.model, seed=5).state_dict())
    ref_old = detspec.LLM(str(case.path), num_kv_pages=256)
    ref_new = detspec.LLM(str(case.path), num_kv_pages=256)
    ref_new.update_weights(new)
    # Deterministic, so its bits do not depend on the neighbours it runs with below.
    long_params = greedy(max_tokens=200, deterministic=True)
    want_old = ref_old.generate([PROMPTS[2]], long_params, use_tqdm=False)[0].outputs[0]
    want_new = ref_new.generate([PROMPTS[0]], greedy(), use_tqdm=False)[0].outputs[0]

    engine = AsyncLLM(str(case.path), num_kv_pages=256)
    started = asyncio.Event()

    async def run(prompt, params):
        last = None
        async for out in engine.generate(prompt, params):
            started.set()
            last = out
        return last

    old_weights = dict(case.model.state_dict())
    for _attempt in range(5):
        started.clear()
        in_flight = asyncio.create_task(run(PROMPTS[2], long_params))
        # Neighbours in flight too, so the steps are slow enough for the update to arrive while
        # the request runs (the tiny model decodes 200 tokens in tens of milliseconds).
        load = [asyncio.create_task(run(p, greedy(max_tokens=200))) for p in PROMPTS[:2] * 8]
        await started.wait()
        update = asyncio.create_task(engine.update_weights(new))
        while not engine.stats()["weight_update_pending"] and not in_flight.done():
            await asyncio.sleep(0.001)
        if not in_flight.done():
            break
        # The engine finished the request before the update reached it: undo and retry.
        await asyncio.gather(update, *load)
        await engine.update_weights(old_weights)
    else:
        pytest.fail("the request finished before the update arrived, 5 times")
    later = asyncio.create_task(run(PROMPTS[0], greedy()))
    old_out, _, new_out = await asyncio.gather(in_flight, update, later)
    await asyncio.gather(*load)
    assert old_out.outputs[0].token_ids == want_old.token_ids
    assert bits(old_out.outputs[0].token_logprobs) == bits(want_old.token_logprobs)
    assert new_out.outputs[0].token_ids == want_new.token_ids
    assert new_out.fingerprint == ref_new.fingerprint == engine.fingerprint
    assert not engine.stats()["weight_update_pending"]

    # "abort": requests in flight end at once with finish_reason "abort". The tiny model may
    # finish all of them before the update reaches the engine (a race the engine may win), so
    # a few attempts; one update that finds requests in flight is the property.
    for _attempt in range(5):
        started.clear()
        slow = [asyncio.create_task(run(p, greedy(max_tokens=220))) for p in PROMPTS[:2] * 8]
        await started.wait()
        await engine.update_weights(old_weights, in_flight="abort")
        reasons = [out.outputs[0].finish_reason for out in await asyncio.gather(*slow)]
        assert set(reasons) <= {"abort", "length"}, reasons
        if "abort" in reasons:
            break
    assert "abort" in reasons
    assert engine.fingerprint == ref_old.fingerprint
    with pytest.raises(InvalidRequestError, match="in_flight"):
        await engine.update_weights({}, in_flight="later")
    engine.shutdown()


# ---------------------------------------------------------------- scoring and audit


@pytest.fixture(scope="module")
def flat_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Random weights: flat next-token distributions, so batch variance shows in logprobs."""
    d = tmp_path_factory.mktemp("rl-flat-model")
    detspec._core.write_demo_model(str(d), "tiny", 5)
    return str(d)


TARGET = [int(x) for x in np.random.default_rng(1).integers(3, 900, size=70)]


def sampled(temperature: float, deterministic: bool = True) -> SamplingParams:
    return SamplingParams(
        temperature=temperature,
        seed=77,
        max_tokens=24,
        ignore_eos=True,
        deterministic=deterministic,
    )


def in_haystack(llm: detspec.LLM, target: SamplingParams, seed: int) -> detspec.RequestOutput:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(4, 17))
    lengths = rng.integers(1, 120, size=n)
    prompts = [[int(x) for x in rng.integers(3, 900, size=int(k))] for k in lengths]
    params = [
        SamplingParams(
            temperature=1.0, seed=i, max_tokens=int(rng.integers(1, 40)), ignore_eos=True
        )
        for i in range(n)
    ]
    pos = int(rng.integers(0, n + 1))
    prompts.insert(pos, TARGET)
    params.insert(pos, target)
    return llm.generate(prompts, params, use_tqdm=False)[pos]


PROFILES = [
    pytest.param(("invariant", "inline"), id="invariant-inline"),
    pytest.param(("invariant", "replay"), id="invariant-replay"),
    pytest.param(("shape_dependent", "replay"), id="shape_dependent-replay"),
]


def replay_llm(flat_model: str, profile: tuple[str, str], **kw) -> detspec.LLM:
    """An engine of `profile` (kernel profile, verify strategy) with short windows and groups,
    so a few dozen tokens span several verify passes; `kw` overrides engine settings."""
    kernel_profile, strategy = profile
    settings = {"verify_window": 8, "verify_group": 4, "num_kv_pages": 1024, **kw}
    return detspec.LLM(
        flat_model, verify_strategy=strategy, kernel_profile=kernel_profile, **settings
    )


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_score_of_a_deterministic_generation_equals_its_logprobs(flat_model, profile, temperature):
    llm = replay_llm(flat_model, profile)
    for seed in range(4):
        out = in_haystack(llm, sampled(temperature), seed)
        c = out.outputs[0]
        (scored,) = llm.score([TARGET], [c.token_ids], deterministic=True)
        assert bits(scored) == bits(c.token_logprobs), f"haystack {seed}"


def _prompt_logprob_bits(entries) -> list:
    return [
        None if e is None else sorted((t, bits([lp.logprob])[0], lp.rank) for t, lp in e.items())
        for e in entries
    ]


@pytest.mark.parametrize("profile", PROFILES)
def test_scoring_many_pairs_in_one_call_equals_each_generation(flat_model, profile):
    """One ``score`` call over many pairs shares forward passes between them (under replay on
    shape-dependent GEMMs: fixed-shape passes that several sequences fill, as the requests of a
    verify pass do, instead of one padded pass per sequence); every pair still scores to its
    own generation's logprobs bit for bit, audits clean, and prompt logprobs of many prompts
    equal each prompt's alone."""
    llm = replay_llm(flat_model, profile)
    rng = np.random.default_rng(5)
    prompts = [
        [int(x) for x in rng.integers(3, 900, size=int(k))] for k in rng.integers(1, 60, size=9)
    ]
    params = [
        SamplingParams(
            temperature=0.8,
            seed=i,
            max_tokens=int(rng.integers(1, 30)),
            ignore_eos=True,
            deterministic=True,
        )
        for i in range(len(prompts))
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    scored = llm.score(prompts, [o.outputs[0].token_ids for o in outs])
    for i, (o, s) in enumerate(zip(outs, scored, strict=True)):
        assert bits(s) == bits(o.outputs[0].token_logprobs), f"pair {i}"
    for o in outs:
        assert llm.audit(o).ok
    together = llm.prompt_logprobs(prompts, 2)
    for i, (p, t) in enumerate(zip(prompts, together, strict=True)):
        (alone,) = llm.prompt_logprobs([p], 2)
        assert _prompt_logprob_bits(t) == _prompt_logprob_bits(alone), f"prompt {i}"


async def test_async_score_under_concurrent_load_equals_generation(flat_model):
    engine = AsyncLLM(flat_model, num_kv_pages=1024)
    rng = np.random.default_rng(9)

    async def drain(prompt, params):
        last = None
        async for out in engine.generate(prompt, params):
            last = out
        return last

    target = asyncio.create_task(drain(TARGET, sampled(0.8)))
    noise = [
        asyncio.create_task(
            drain([int(x) for x in rng.integers(3, 900, size=50)], sampled(1.0, False))
        )
        for _ in range(8)
    ]
    out = await target
    # Scored while the noise is still decoding.
    (scored,) = await engine.score([TARGET], [out.outputs[0].token_ids])
    await asyncio.gather(*noise)
    assert bits(scored) == bits(out.outputs[0].token_logprobs)
    engine.shutdown()


def test_negative_control_fast_path_logprobs_differ_from_scores(flat_model):
    """Alone, the fast path splits attention over the KV (batch-variant on purpose); in a
    haystack it does not. Its logprobs must differ from the scorer's somewhere."""
    llm = detspec.LLM(flat_model, determinism="off", num_kv_pages=1024)
    plain = sampled(0.8, deterministic=False)
    runs = [llm.generate([TARGET], plain, use_tqdm=False)[0].outputs[0]]
    runs += [in_haystack(llm, plain, seed).outputs[0] for seed in range(3)]
    differing = 0
    for c in runs:
        (scored,) = llm.score([TARGET], [c.token_ids], deterministic=True)
        differing += bits(scored) != bits(c.token_logprobs)
    assert differing > 0, "fast-path logprobs looked batch-invariant: the scoring test is blind"


def test_score_matches_transformers_and_accepts_text(model_zoo):
    case = model_zoo.get("llama")
    llm = detspec.LLM(str(case.path), num_kv_pages=256)
    prompt, completion = PROMPTS[0], [7, 300, 12, 12, 401]
    (scored,) = llm.score([prompt], [completion])
    ref = log_softmax(case.logits(prompt + completion))
    want = [ref[len(prompt) - 1 + i, t] for i, t in enumerate(completion)]
    np.testing.assert_allclose(scored, want, rtol=0, atol=2e-4)
    (text_scored,) = llm.score(["Hello"], [" world"])
    assert len(text_scored) == len(llm.get_tokenizer().encode(" world", add_special_tokens=False))
    with pytest.raises(InvalidRequestError, match="completions"):
        llm.score([prompt], [completion, completion])
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        llm.score([prompt], [[10**6]])


def _tampered(out: detspec.RequestOutput, pos: int, *, token: bool) -> detspec.RequestOutput:
    t = copy.deepcopy(out)
    c = t.outputs[0]
    if token:
        c.token_ids[pos] = (c.token_ids[pos] + 1) % 512
    else:
        (b,) = bits([c.token_logprobs[pos]])
        c.token_logprobs[pos] = struct.unpack("<f", struct.pack("<I", b ^ 1))[0]
    return t


@pytest.mark.parametrize("kernel_profile", ["invariant", "shape_dependent"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_audit_passes_on_stored_outputs_and_pinpoints_tampering(
    flat_model, temperature, kernel_profile
):
    llm = detspec.LLM(
        flat_model,
        kernel_profile=kernel_profile,
        verify_window=8,
        verify_group=4,
        num_kv_pages=1024,
    )
    out = in_haystack(llm, sampled(temperature), seed=2)
    report = llm.audit(out)
    assert report.ok and report.num_tokens == 24 and report.first_mismatch is None
    for pos in (0, 9, 23):
        bad = llm.audit(_tampered(out, pos, token=True))
        assert not bad.ok
        assert (bad.first_mismatch.position, bad.first_mismatch.field) == (pos, "token_id")
        flipped = llm.audit(_tampered(out, pos, token=False))
        assert (flipped.first_mismatch.position, flipped.first_mismatch.field) == (pos, "logprob")
    other = detspec.LLM(flat_model, determinism="off", num_kv_pages=64)
    with pytest.raises(InvalidRequestError, match="fingerprint"):
        other.audit(out)
    plain = llm.generate([TARGET], sampled(0.8, deterministic=False), use_tqdm=False)[0]
    with pytest.raises(InvalidRequestError, match="deterministic"):
        llm.audit(plain)


# ---------------------------------------------------------------- tensors out


def test_prompt_logprobs_in_vllm_format(model_zoo):
    case = model_zoo.get("llama")
    llm = detspec.LLM(str(case.path), num_kv_pages=256)
    prompt = PROMPTS[2]
    out = llm.generate([prompt], greedy(max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    ref = log_softmax(case.logits(prompt))
    for i in range(1, len(prompt)):
        entry = plp[i]
        assert prompt[i] in entry and 3 <= len(entry) <= 4
        assert abs(entry[prompt[i]].logprob - ref[i - 1, prompt[i]]) < 2e-4
        top = sorted(entry.values(), key=lambda lp: lp.rank)
        assert top[0].rank == 1 and top[0].logprob >= entry[prompt[i]].logprob
    (scored,) = llm.score([prompt[:1]], [prompt[1:]])
    assert bits(scored) == bits([plp[i][prompt[i]].logprob for i in range(1, len(prompt))])
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(InvalidRequestError, match="max_logprobs"):  # over the engine's 20
        llm.generate([prompt], greedy(max_tokens=2, prompt_logprobs=99), use_tqdm=False)


def test_get_logits_and_hidden_states_are_torch_tensors_matching_transformers(model_zoo):
    case = model_zoo.get("llama")
    llm = detspec.LLM(str(case.path), num_kv_pages=256)
    logits = llm.get_logits(PROMPTS)
    for p, t in zip(PROMPTS, logits, strict=True):
        assert isinstance(t, torch.Tensor) and t.dtype == torch.float32
        assert tuple(t.shape) == (len(p), 512)
        np.testing.assert_allclose(t.numpy(), case.logits(p), rtol=0, atol=2e-4)
    hidden = llm.encode(PROMPTS, output="hidden_states")
    with torch.inference_mode():
        for p, h in zip(PROMPTS, hidden, strict=True):
            want = case.model.model(torch.tensor([p])).last_hidden_state[0]
            assert tuple(h.shape) == tuple(want.shape)
            torch.testing.assert_close(h, want, rtol=0, atol=2e-4)
    # The same bits as the scorer: logits come from the verify-path kernels.
    lp = torch.log_softmax(logits[0].double(), -1)
    (scored,) = llm.score([PROMPTS[0][:1]], [PROMPTS[0][1:]])
    want = [lp[i, PROMPTS[0][i + 1]].item() for i in range(4)]
    np.testing.assert_allclose(scored, want, atol=1e-6)
    with pytest.raises(InvalidRequestError, match="output"):
        llm.encode(PROMPTS, output="pooled")


def test_rl_example_runs_exactly_and_reproducibly(model_zoo):
    """examples/rl_loop.py: sampler == scorer at every step, and a rerun's digest is equal."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "rl_loop.py"
    model = str(model_zoo.get("llama").path)
    args = ["--model", model, "--steps", "2", "--group", "2", "--max-tokens", "8"]
    r = subprocess.run(
        [sys.executable, str(script), *args, "--check-rerun"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    steps = [line for line in r.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 4 and all("sampler == scorer: True" in s for s in steps)
    assert "identical" in r.stdout


@pytest.mark.parametrize("profile", PROFILES)
def test_scoring_more_than_the_free_pages_hold_runs_in_smaller_groups(flat_model, profile):
    """A scoring call whose sequences together need more KV pages than are free runs them in
    groups the pages hold (each sequence fitting alone), with the bits of each alone."""
    llm = replay_llm(flat_model, profile, num_kv_pages=24, max_num_batched_tokens=2048)
    rng = np.random.default_rng(11)
    prompts = [[int(x) for x in rng.integers(3, 900, size=150)] for _ in range(5)]
    together = llm.prompt_logprobs(prompts, 1)
    for i, p in enumerate(prompts):
        (alone,) = llm.prompt_logprobs([p], 1)
        assert _prompt_logprob_bits(together[i]) == _prompt_logprob_bits(alone), f"prompt {i}"
