"""Decode–verify–rollback through the Python API: a deterministic request's token ids and
logprobs are bitwise identical alone and inside random batches with random arrivals; the same
workload with determinism="off" shows differences (negative control)."""

from __future__ import annotations

import asyncio
import struct

import numpy as np
import pytest

import detspec
from detspec import AsyncLLM, InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def flat_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny demo model: random weights, so next-token distributions are flat and the
    fast path's batch variance shows up in logprobs."""
    d = tmp_path_factory.mktemp("dvr-model")
    detspec._core.write_demo_model(str(d), "tiny", 5)
    return str(d)


def fingerprint_bits(out: detspec.RequestOutput) -> tuple[list[int], list[bytes]]:
    c = out.outputs[0]
    lps = [struct.pack("<f", lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs, strict=True)]
    return list(c.token_ids), lps


def target_params(temperature: float) -> SamplingParams:
    return SamplingParams(
        temperature=temperature,
        seed=1234,
        max_tokens=24,
        ignore_eos=True,
        logprobs=0,
        deterministic=True,
    )


TARGET_PROMPT = [int(x) for x in np.random.default_rng(0).integers(3, 900, size=17)]

# (kernel_profile, verify_strategy): every determinism test runs on both CPU profiles. Under
# "shape_dependent" each GEMM's bits change with its row count, as cuBLAS's do, so replay meets
# real mismatches and rolls back by itself; "inline" needs invariant GEMMs.
PROFILES = [
    pytest.param(("invariant", "replay"), id="invariant-replay"),
    pytest.param(("invariant", "inline"), id="invariant-inline"),
    pytest.param(("shape_dependent", "replay"), id="shape_dependent-replay"),
]


def haystack(rng: np.random.Generator, det_neighbours: bool, vocab: int = 900):
    # 1-16 neighbours, and one haystack in four of 64.
    n = 64 if rng.random() < 0.25 else int(rng.integers(1, 17))
    prompts, params = [], []
    for _ in range(n):
        prompts.append([int(x) for x in rng.integers(3, vocab, size=int(rng.integers(1, 90)))])
        params.append(
            SamplingParams(
                temperature=float(rng.choice([0.0, 1.0])),
                seed=int(rng.integers(0, 2**31)),
                max_tokens=int(rng.integers(1, 40)),
                ignore_eos=True,
                deterministic=det_neighbours and bool(rng.integers(0, 2)),
            )
        )
    pos = int(rng.integers(0, n + 1))
    return prompts, params, pos


def run_in_haystack(
    llm: detspec.LLM,
    target: SamplingParams,
    seed: int,
    det: bool,
    prompt: list[int] = TARGET_PROMPT,
    vocab: int = 900,
):
    prompts, params, pos = haystack(np.random.default_rng(seed), det, vocab)
    prompts.insert(pos, prompt)
    params.insert(pos, target)
    return fingerprint_bits(llm.generate(prompts, params, use_tqdm=False)[pos])


# bfloat16: weights held in bf16 (the f32 demo checkpoint rounded at load) and a bf16 KV
# cache, f32 activations; the same contract, its own fingerprint.
DTYPES = ["float32", "bfloat16"]
# The bf16-activation mode (activation_dtype="bfloat16": bf16 x bf16 linear layers, its own
# numerics and fingerprint, "-abf16"): on a couple of cheap cases below.
ABF16 = "bfloat16-abf16"


def numerics(dtype: str) -> dict[str, str]:
    """LLM keyword arguments of a DTYPES entry or ABF16."""
    if dtype == ABF16:
        return {"dtype": "bfloat16", "activation_dtype": "bfloat16"}
    return {"dtype": dtype}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_needle_in_haystack_bitwise(
    flat_model: str, temperature: float, profile: tuple[str, str], dtype: str
) -> None:
    needle_in_haystack(flat_model, temperature, profile, dtype)


@pytest.mark.parametrize("profile", PROFILES[:2])
def test_needle_in_haystack_bitwise_abf16(flat_model: str, profile: tuple[str, str]) -> None:
    needle_in_haystack(flat_model, 0.8, profile, ABF16)


def needle_in_haystack(
    flat_model: str, temperature: float, profile: tuple[str, str], dtype: str
) -> None:
    kernel_profile, strategy = profile
    target = target_params(temperature)
    llm = detspec.LLM(
        flat_model,
        **numerics(dtype),
        verify_window=8,
        verify_group=4,
        verify_strategy=strategy,
        kernel_profile=kernel_profile,
        num_kv_pages=2048,
    )
    assert ("-f32-cpu-" if dtype == "float32" else "-bf16-cpu-") in llm.fingerprint
    assert ("-abf16-" in llm.fingerprint) == (dtype == ABF16)
    solo = fingerprint_bits(llm.generate([TARGET_PROMPT], target, use_tqdm=False)[0])
    for seed in range(8):
        got = run_in_haystack(llm, target, seed, det=True)
        assert got[0] == solo[0], f"token ids differ in haystack {seed}"
        assert got[1] == solo[1], f"logprob bits differ in haystack {seed}"
    stats = llm.stats()
    # Replay verifies every window; inline commits each token as sampled.
    assert (
        stats["num_verify_passes"] > 0 if strategy == "replay" else stats["num_verify_passes"] == 0
    )
    if kernel_profile == "shape_dependent":
        # No fault injection: these rollbacks are real mismatches of the fast path.
        assert stats["num_rollbacks"] > 0, stats


# The decoder layouts beyond Llama's: fused q/k/v and gate/up (phi3), norms of sublayer outputs
# and whole q/k projections (olmo2), sliding and full layers with their own ropes (olmo3),
# multipliers (granite), YaRN's tables (qwen2_yarn), a layer without rope (smollm3), norms on
# both sides of each sublayer with GeGLU (gemma3), soft caps on scores and logits (gemma2),
# LongRoPE on three quarters of each head (phi4_mini), OLMo 2's q/k norms before a mixture of
# experts (olmoe), rope on half of each head pairing neighbours (glm4), the same pairing on
# whole heads with biases everywhere (ernie45), a sliding layer and a full one without rope
# (exaone4), queries scaled by position past the original context (ministral3), sink logits in
# every softmax before biased experts (gpt_oss), stacked experts beside a shared MLP under
# Granite's multipliers (granitemoeshared), q/k/v and o biases (seed_oss), DeepSeek's grouped
# sigmoid routing after a dense layer (glm4_moe), latent attention expanded into the paged
# cache (deepseek_v3; glm4_moe_lite with its layers' MLPs by name), short convolutions reading
# their inputs from the paged cache between attention layers (lfm2; with experts chosen by a
# per-expert bias, lfm2_moe). Their windows (8–24
# keys) are shorter than the haystacks' prompts.
@pytest.mark.parametrize(
    "name",
    [
        "phi3",
        "phi4_mini",
        "olmo2",
        "olmo3",
        "granite",
        "qwen2_yarn",
        "smollm3",
        "gemma2",
        "gemma3",
        "olmoe",
        "glm4",
        "ernie45",
        "exaone4",
        "ministral3",
        "gpt_oss",
        "granitemoeshared",
        "seed_oss",
        "glm4_moe",
        "deepseek_v3",
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
def test_needle_in_haystack_on_every_decoder_layout(model_zoo, name: str) -> None:
    llm = detspec.LLM(
        str(model_zoo.get(name).path),
        kernel_profile="shape_dependent",
        verify_window=8,
        verify_group=4,
        num_kv_pages=2048,
    )
    vocab = 500
    prompt = [int(x) for x in np.random.default_rng(1).integers(3, vocab, size=40)]
    target = target_params(0.8)
    solo = fingerprint_bits(llm.generate([prompt], target, use_tqdm=False)[0])
    for seed in range(4):
        got = run_in_haystack(llm, target, seed, det=True, prompt=prompt, vocab=vocab)
        assert got == solo, f"[{name}] bits differ in haystack {seed}"
    # Negative control: the same request on the fast path moves with its company.
    fast = target_params(0.8)
    fast.deterministic = False
    alone = fingerprint_bits(llm.generate([prompt], fast, use_tqdm=False)[0])
    moved = [
        run_in_haystack(llm, fast, seed, det=False, prompt=prompt, vocab=vocab) != alone
        for seed in range(4)
    ]
    assert any(moved), f"[{name}] the fast path never moved: this test would be blind"
    llm.shutdown()


@pytest.mark.parametrize("dtype", DTYPES)
def test_adaptive_windows_commit_the_same_bits(flat_model: str, dtype: str) -> None:
    """Where verify windows end never changes what they commit: every pass has the B x W
    shape, and a committed token is the verifier's, a function of the tokens before it. With
    `verify_window_adaptive` the windows after rollbacks (real ones here, and forced ones) are
    shorter; the target's bits are the fixed-window engine's, alone and in every haystack."""
    kw = dict(
        **numerics(dtype),
        kernel_profile="shape_dependent",
        verify_window=16,
        verify_group=4,
        num_kv_pages=2048,
        fault_injection=0.3,
    )
    fixed = detspec.LLM(flat_model, **kw, verify_window_adaptive=False)
    adaptive = detspec.LLM(flat_model, **kw)  # the default
    target = SamplingParams(
        temperature=0.8, seed=99, max_tokens=72, ignore_eos=True, logprobs=0, deterministic=True
    )
    want = fingerprint_bits(fixed.generate([TARGET_PROMPT], target, use_tqdm=False)[0])
    assert fingerprint_bits(adaptive.generate([TARGET_PROMPT], target, use_tqdm=False)[0]) == want
    for seed in range(4):
        assert run_in_haystack(fixed, target, seed, det=True) == want, f"fixed, haystack {seed}"
        assert run_in_haystack(adaptive, target, seed, det=True) == want, f"haystack {seed}"
    f, a = fixed.stats(), adaptive.stats()
    assert a["num_rollbacks"] > 0
    # The windows did shrink: the same tokens took other passes (else this test is blind).
    assert a["num_verify_passes"] != f["num_verify_passes"], (a, f)
    fixed.shutdown()
    adaptive.shutdown()


@pytest.mark.parametrize("dtype", [*DTYPES, ABF16])
def test_inline_and_replay_commit_the_same_bits(flat_model: str, dtype: str) -> None:
    target = target_params(0.8)
    outs = {}
    for strategy in ("inline", "replay"):
        llm = detspec.LLM(
            flat_model, **numerics(dtype), verify_strategy=strategy, num_kv_pages=1024
        )
        outs[strategy] = run_in_haystack(llm, target, 5, det=True)
        if strategy == "inline":
            assert llm.fingerprint.endswith("-dvr-inline")
        llm.shutdown()
    assert outs["inline"] == outs["replay"]
    with pytest.raises(InvalidRequestError, match="verify_strategy"):
        detspec.LLM(flat_model, verify_strategy="sometimes")


def test_shape_dependent_profile_refuses_inline_and_names_itself(flat_model: str) -> None:
    with pytest.raises(InvalidRequestError, match="verify_strategy"):
        detspec.LLM(flat_model, kernel_profile="shape_dependent", verify_strategy="inline")
    with pytest.raises(InvalidRequestError, match="kernel_profile"):
        detspec.LLM(flat_model, kernel_profile="cublas")
    auto = detspec.LLM(flat_model, kernel_profile="shape_dependent", num_kv_pages=64)
    default = detspec.LLM(flat_model, num_kv_pages=64)
    # auto means replay under it; outputs are not comparable across profiles.
    assert "-dvr-w64-b8" in auto.fingerprint and auto.fingerprint != default.fingerprint


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel_profile", ["invariant", "shape_dependent"])
def test_negative_control_off_mode_shows_batch_variance(
    flat_model: str, kernel_profile: str, dtype: str
) -> None:
    plain = target_params(0.8)
    plain.deterministic = False
    llm = detspec.LLM(
        flat_model,
        dtype=dtype,
        determinism="off",
        kernel_profile=kernel_profile,
        num_kv_pages=2048,
    )
    solo = fingerprint_bits(llm.generate([TARGET_PROMPT], plain, use_tqdm=False)[0])
    differing = sum(run_in_haystack(llm, plain, seed, det=False) != solo for seed in range(8))
    assert differing > 0, "the fast path looked batch-invariant: the needle test would be blind"
    with pytest.raises(InvalidRequestError, match="deterministic"):
        llm.generate([TARGET_PROMPT], target_params(0.0), use_tqdm=False)


def test_bfloat16_changes_the_numbers_and_the_fingerprint(flat_model: str) -> None:
    """The bf16 runs above are not the f32 runs under another name: same prompt, other bits,
    another fingerprint (same weights hash only if the weights were bf16 already); nor are the
    bf16-activation runs the bf16 ones (same weights hash, other bits and fingerprint)."""
    target = target_params(0.8)
    got = {}
    for dtype in [*DTYPES, ABF16]:
        llm = detspec.LLM(flat_model, **numerics(dtype), num_kv_pages=256)
        got[dtype] = (
            fingerprint_bits(llm.generate([TARGET_PROMPT], target, use_tqdm=False)[0]),
            llm.fingerprint,
        )
        llm.shutdown()
    assert got["float32"][0][1] != got["bfloat16"][0][1]
    assert got["float32"][1] != got["bfloat16"][1]
    assert got["bfloat16"][0][1] != got[ABF16][0][1]
    bf16_fp, abf16_fp = got["bfloat16"][1], got[ABF16][1]
    assert abf16_fp.split("-")[1] == bf16_fp.split("-")[1]  # the same weights
    assert abf16_fp.replace("-abf16", "") == bf16_fp
    with pytest.raises(InvalidRequestError, match="activation_dtype"):
        detspec.LLM(flat_model, dtype="float32", activation_dtype="bfloat16")


def test_forced_rollbacks_and_modes(flat_model: str) -> None:
    target = target_params(0.8)
    base = detspec.LLM(
        flat_model, verify_window=2, verify_group=2, verify_strategy="replay", num_kv_pages=512
    )
    want = fingerprint_bits(base.generate([TARGET_PROMPT], target, use_tqdm=False)[0])
    for share in (0.1, 0.5, 1.0):
        llm = detspec.LLM(
            flat_model,
            verify_window=2,
            verify_group=2,
            verify_strategy="replay",
            num_kv_pages=512,
            fault_injection=share,
        )
        out = llm.generate([TARGET_PROMPT], target, use_tqdm=False)[0]
        assert fingerprint_bits(out) == want, f"fault_injection={share}"
        assert out.metrics["num_rollbacks"] > 0
    assert "-dvr-w2-b2" in base.fingerprint
    inv = detspec.LLM(flat_model, determinism="batch_invariant", num_kv_pages=512)
    assert "batch_invariant" in inv.fingerprint
    a = fingerprint_bits(inv.generate([TARGET_PROMPT], target, use_tqdm=False)[0])
    b = run_in_haystack(inv, target, 3, det=True)
    assert a == b, "batch_invariant mode must be reproducible inside a batch"
    with pytest.raises(InvalidRequestError, match="determinism"):
        detspec.LLM(flat_model, determinism="sometimes")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("profile", PROFILES)
async def test_requests_joining_mid_decode(
    flat_model: str, profile: tuple[str, str], dtype: str
) -> None:
    kernel_profile, strategy = profile
    target = target_params(0.8)
    # Finished deterministic requests may wait up to 6 steps for fuller verify groups.
    engine = AsyncLLM(
        flat_model,
        dtype=dtype,
        verify_window=8,
        verify_group=4,
        verify_finish_wait=6,
        verify_strategy=strategy,
        kernel_profile=kernel_profile,
        num_kv_pages=1024,
    )
    try:

        async def run(prompt, params, rid):
            last = None
            async for out in engine.generate(prompt, params, request_id=rid):
                last = out
            return last

        solo = fingerprint_bits(await run(TARGET_PROMPT, target, "solo"))
        rng = np.random.default_rng(11)
        tasks = []
        for i in range(12):
            prompt = [int(x) for x in rng.integers(3, 900, size=int(rng.integers(1, 60)))]
            sp = SamplingParams(
                temperature=1.0, seed=i, max_tokens=30, ignore_eos=True, deterministic=i % 2 == 0
            )
            tasks.append(asyncio.create_task(run(prompt, sp, f"bg{i}")))
            if i == 6:
                tasks.append(asyncio.create_task(run(TARGET_PROMPT, target, "needle")))
            await asyncio.sleep(0.002)
        results = await asyncio.gather(*tasks)
        needle = next(r for r in results if r.request_id == "needle")
        assert fingerprint_bits(needle) == solo
    finally:
        engine.shutdown()


_LIBC_PROBE = """
import json, struct, sys
import detspec
llm = detspec.LLM(sys.argv[1], num_kv_pages=256, kernel_profile=sys.argv[2])
sp = detspec.SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True,
                            logprobs=0, deterministic=True)
c = llm.generate([list(range(3, 60))], sp, use_tqdm=False)[0].outputs[0]
print(json.dumps([c.token_ids, [struct.pack("<f", lp[t].logprob).hex()
                                for t, lp in zip(c.token_ids, c.logprobs)]]))
"""


@pytest.mark.parametrize("kernel_profile", ["invariant", "shape_dependent"])
def test_bits_do_not_depend_on_the_c_librarys_cpu_dispatch(
    flat_model: str, kernel_profile: str
) -> None:
    """glibc picks its math functions' variant (FMA, AVX2, ...) by CPU at run time; masking
    those features with GLIBC_TUNABLES plays a CPU without them. The forward takes nothing from
    the C library's math, so the bits stay."""
    import json
    import os
    import subprocess
    import sys

    def run(env: dict[str, str]) -> list:
        out = subprocess.run(
            [sys.executable, "-c", _LIBC_PROBE, flat_model, kernel_profile],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    masked = ",".join(
        f"-{f}{suffix}"
        for f in ("AVX512F", "AVX2", "FMA", "FMA4", "AVX")
        for suffix in ("", "_Usable")
    )
    assert run({}) == run({"GLIBC_TUNABLES": f"glibc.cpu.hwcaps={masked}"})
