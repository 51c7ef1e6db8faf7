"""LoRA adapters through the Python API (``LLM`` / ``AsyncLLM`` with ``enable_lora=True``).

* Parity: detspec with a PEFT adapter against ``peft.get_peft_model`` on the HF reference in
  float32 (greedy tokens, per-position logprobs), with base-model requests in the same batch
  still matching the base model; all seven projections, use_rslora on a subset of modules and
  layers, rank_pattern, on Llama and on Qwen2 (qkv bias).
* Determinism: a deterministic request with adapter A is bitwise the same alone and among
  requests of adapter B, of the base model and of A without determinism; the same request
  with ``deterministic=False`` varies (negative control).
* Scoring: ``score`` / ``prompt_logprobs`` / ``audit`` with the adapter reproduce the
  generation bit for bit; the base model's do not, and an audit without it is refused.
* Lifecycle: load on first use, ``list_loras``, ``replace``, ``unload_lora``, limits and the
  refused adapter formats (DoRA, biases, modules_to_save, embedding adapters).
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import peft
import pytest
import torch
import transformers
from conftest import greedy_mismatch_message, hf_greedy, hf_logits, log_softmax, top2_margin

import detspec
from detspec import AsyncLLM, DetspecError, InvalidRequestError, LoRARequest, SamplingParams

# transformers 5 warns about its own deprecated name when peft wraps a model; peft warns that
# it saves the embeddings of an embedding adapter (refused below).
pytestmark = [
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning"),
    pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers`:UserWarning"),
]

ALL_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NEW_TOKENS = 32
# Per-position |detspec - PEFT| logprob bound (float32). Measured over these cases with ten
# adapter seeds each: at most 1.9e-5 (llama-rslora-qv-layer1), else under 1e-5; the bound
# leaves 5x margin and is still ~10^4 below what the adapters move logprobs by (checked).
LOGPROB_ATOL = 1e-4
# A greedy mismatch is accepted only at a near-tie of the reference (float32 rounding can
# flip it); such a prompt is then compared up to the mismatch.
NEAR_TIE = 1e-4


def bits(xs) -> list[int]:
    return [struct.unpack("<I", struct.pack("<f", x))[0] for x in xs]


def out_bits(out: detspec.RequestOutput) -> tuple[list[int], list[int]]:
    """Token ids and the f32 bits of their logprobs (``logprobs=0`` entries and the
    ``token_logprobs`` that score/audit reproduce must agree)."""
    c = out.outputs[0]
    if c.logprobs is not None:
        assert [e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True)] == list(
            c.token_logprobs
        )
    return list(c.token_ids), bits(c.token_logprobs)


def save_adapter(base: torch.nn.Module, out_dir: Path, seed: int, gain: float = 1.0, **kw):
    """A random (non-zero B) PEFT LoRA adapter of `base`, saved to `out_dir`; returns the
    PEFT model (the reference). `gain` scales lora_B so a small adapter still shows."""
    kw = {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": list(ALL_PROJ),
        "init_lora_weights": False,
        **kw,
    }
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**kw))
    if gain != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(gain)
    model.eval()
    model.save_pretrained(out_dir)
    return model


# --------------------------------------------------------------------------- parity

PARITY_CASES = [
    pytest.param("llama", {}, id="llama-all7"),
    pytest.param("qwen2", {}, id="qwen2-all7-qkv_bias"),
    pytest.param(
        "llama",
        {
            "r": 4,
            "lora_alpha": 8,
            "use_rslora": True,
            "target_modules": ["q_proj", "v_proj"],
            "layers_to_transform": [1],
            "gain": 4.0,
        },
        id="llama-rslora-qv-layer1",
    ),
    pytest.param(
        "qwen2",
        {
            "target_modules": ["q_proj", "v_proj", "down_proj"],
            "rank_pattern": {"v_proj": 2, "down_proj": 16},
            "gain": 2.0,
        },
        id="qwen2-rank_pattern",
    ),
    # Phi-3 stores q/k/v and gate/up fused, and PEFT adapts the fused modules: one lora_A
    # shared by the layers a module holds, lora_B's rows split between them.
    pytest.param(
        "phi3",
        {"target_modules": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]},
        id="phi3-fused",
    ),
    # GLM-4 stores only gate/up fused: q/k/v adapted apart, gate/up as one module.
    pytest.param(
        "glm4",
        {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]},
        id="glm4-gate-up-fused",
    ),
    # Granite 4 (attention layers only): its MLP is its shared MLP, gate/up fused.
    pytest.param(
        "granite4",
        {"target_modules": ["q_proj", "o_proj", "input_linear", "output_linear"]},
        id="granite4-shared-mlp",
    ),
    # LFM2: attention on its attention layers, its MLP under its own names on every layer.
    pytest.param(
        "lfm2",
        {"target_modules": ["q_proj", "v_proj", "w1", "w3", "w2"]},
        id="lfm2-attention-mlp",
    ),
    # Qwen3.5's gated attention (q_proj's delta covers each head's gate too) and MLPs.
    pytest.param(
        "qwen3_5",
        {"target_modules": ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]},
        id="qwen3_5-attention-mlp",
    ),
    # Bamba: attention on its one attending layer, its MLP under `feed_forward` on every layer
    # (PEFT leaves the Mamba2 mixers' `in_proj` and `out_proj` alone when not named).
    pytest.param(
        "bamba",
        {"target_modules": ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
        id="bamba-attention-mlp",
    ),
    # Nemotron-H: its attending layer's attention and its MLP blocks' down projections
    # (every sublayer is `mixer` on file; the ungated MLP's up_proj adapters are refused).
    pytest.param(
        "nemotron_h",
        {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]},
        id="nemotron_h-attention-down",
    ),
    # Granite 4.0-H with experts: its one attending layer's attention (expert adapters are
    # refused, as on every mixture of experts).
    pytest.param(
        "granite4_h",
        {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        id="granite4_h-attention",
    ),
    # Apertus's ungated MLP: down only (up_proj adapters are refused: test below).
    pytest.param(
        "apertus",
        {"target_modules": ["q_proj", "v_proj", "down_proj"]},
        id="apertus-down",
    ),
]


@pytest.mark.parametrize("name, lora_kw", PARITY_CASES)
def test_parity_with_peft(name, lora_kw, request, model_zoo, llm_factory, token_prompts, tmp_path):
    case = model_zoo.get(name)
    lora_kw = dict(lora_kw)
    gain = lora_kw.pop("gain", 1.0)
    ref = save_adapter(case.model, tmp_path / "adapter", seed=3, gain=gain, **lora_kw)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == lora_kw.get("r", 8)
    if "rank_pattern" in lora_kw:
        assert config["rank_pattern"] == lora_kw["rank_pattern"]

    llm = llm_factory(name, enable_lora=True)
    adapter = LoRARequest(request.node.callspec.id, 1, tmp_path / "adapter")
    n = len(token_prompts)
    fast = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    det = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1, deterministic=True
    )
    # One batch: the adapter on the fast path and on the deterministic path, and the base model.
    outs = llm.generate(
        token_prompts * 3,
        [fast] * n + [det] * n + [fast] * n,
        use_tqdm=False,
        lora_request=[adapter] * (2 * n) + [None] * n,
    )
    with_lora, with_lora_det, base = outs[:n], outs[n : 2 * n], outs[2 * n :]

    agree, gen_diff, effect = 0, 0.0, 0.0
    for i, prompt in enumerate(token_prompts):
        want = hf_greedy(ref, prompt, NEW_TOKENS)
        want_base = case.greedy(prompt)
        # Base-model rows of the same batch are untouched by the adapter rows.
        case.assert_greedy_matches(prompt, base[i].outputs[0].token_ids, label="base row")
        assert base[i].fingerprint == llm.fingerprint
        # How far the adapter moves the model (on the base model's greedy path).
        moved = log_softmax(hf_logits(ref, prompt + want_base.tokens))[len(prompt) - 1 : -1]
        base_lp = want_base.chosen_logprobs
        effect = max(
            effect, float(np.abs(moved[np.arange(NEW_TOKENS), want_base.tokens] - base_lp).max())
        )
        for label, out in (("fast", with_lora[i]), ("deterministic", with_lora_det[i])):
            assert out.fingerprint == llm.lora_fingerprint(adapter.lora_name)
            got = list(out.outputs[0].token_ids)
            msg = greedy_mismatch_message(prompt, got, want, f"[{name}+lora {label}] prompt {i}")
            m = next(
                (j for j, (a, b) in enumerate(zip(got, want.tokens, strict=True)) if a != b),
                NEW_TOKENS,
            )
            if m == NEW_TOKENS:
                agree += 1
            else:
                assert top2_margin(want.step_logits[m]) < NEAR_TIE, msg
            lps = [e[t].logprob for t, e in zip(got[:m], out.outputs[0].logprobs, strict=False)]
            diff = float(np.abs(np.array(lps) - want.chosen_logprobs[:m]).max(initial=0.0))
            assert diff <= LOGPROB_ATOL, f"{label} prompt {i}: logprob diff {diff:.3g}"
            gen_diff = max(gen_diff, diff)

    # Every position of prompt + reference continuation, through prompt_logprobs.
    seqs = [p + hf_greedy(ref, p, 16).tokens for p in token_prompts]
    plp = llm.prompt_logprobs(seqs, 0, lora_request=adapter.lora_name)
    plp_diff = 0.0
    for i, (seq, entries) in enumerate(zip(seqs, plp, strict=True)):
        want = log_softmax(hf_logits(ref, seq))[np.arange(len(seq) - 1), seq[1:]]
        got = np.array([e[t].logprob for t, e in zip(seq[1:], entries[1:], strict=True)])
        diff = float(np.abs(got - want).max())
        assert diff <= LOGPROB_ATOL, f"prompt_logprobs of seq {i}: max diff {diff:.3g}"
        plp_diff = max(plp_diff, diff)

    print(
        f"\n[{request.node.callspec.id}] greedy agreement {agree}/{2 * n}, max |logprob diff| "
        f"generated {gen_diff:.2e}, all positions {plp_diff:.2e}; adapter effect {effect:.3g}"
    )
    assert agree >= 2 * n - 1, f"only {agree}/{2 * n} greedy continuations agree with PEFT"
    # Negative check: the adapter matters, far beyond the tolerance, and changes some outputs.
    assert effect > 100 * LOGPROB_ATOL, effect
    changed = sum(
        list(a.outputs[0].token_ids) != list(b.outputs[0].token_ids)
        for a, b in zip(with_lora, base, strict=True)
    )
    assert changed >= 1, "the adapter did not change any greedy continuation"


# --------------------------------------------------------------------------- determinism


@pytest.fixture(scope="module")
def flat_model(tmp_path_factory) -> str:
    """The tiny demo model (random weights, flat distributions: the fast path's batch
    variance shows in the logprobs)."""
    d = tmp_path_factory.mktemp("lora-flat-model")
    detspec._core.write_demo_model(str(d), "tiny", 5)
    return str(d)


@pytest.fixture(scope="module")
def flat_adapters(flat_model, tmp_path_factory) -> dict[str, Path]:
    """Adapters A and B of the demo model (all projections, and q/v/o with rslora)."""
    base = transformers.LlamaForCausalLM.from_pretrained(flat_model, dtype=torch.float32)
    root = tmp_path_factory.mktemp("lora-flat-adapters")
    save_adapter(base, root / "A", seed=1)
    save_adapter(
        base,
        root / "B",
        seed=2,
        r=16,
        lora_alpha=8,
        use_rslora=True,
        target_modules=["q_proj", "v_proj", "o_proj"],
    )
    return {"A": root / "A", "B": root / "B"}


TARGET_PROMPT = [int(x) for x in np.random.default_rng(0).integers(3, 900, size=17)]


def target_params(deterministic: bool = True, max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(
        temperature=0.8,
        seed=1234,
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=0,
        deterministic=deterministic,
    )


# (kernel_profile, verify_strategy), as in test_determinism.py: under "shape_dependent" the
# fast path's GEMM bits change with the row count, so replay meets real mismatches.
PROFILES = [
    pytest.param(("invariant", "inline"), id="invariant-inline"),
    pytest.param(("shape_dependent", "replay"), id="shape_dependent-replay"),
]


def lora_llm(flat_model: str, adapters: dict[str, Path], profile, **kw) -> detspec.LLM:
    kernel_profile, strategy = profile
    llm = detspec.LLM(
        flat_model,
        enable_lora=True,
        verify_window=8,
        verify_group=4,
        verify_strategy=strategy,
        kernel_profile=kernel_profile,
        num_kv_pages=2048,
        **kw,
    )
    for name, path in adapters.items():
        llm.load_lora(name, path)
    return llm


def lora_haystack(llm: detspec.LLM, target: SamplingParams, seed: int, det_neighbours=True):
    """The target request (TARGET_PROMPT with adapter A) among 4-24 random neighbours of
    adapter A, adapter B and the base model (deterministic or not where `det_neighbours`),
    plus two copies of the target prompt with A and deterministic=False. Returns (target
    output, the copies)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(4, 25))
    prompts, params, loras = [], [], []
    for _ in range(n):
        prompts.append([int(x) for x in rng.integers(3, 900, size=int(rng.integers(1, 90)))])
        params.append(
            SamplingParams(
                temperature=float(rng.choice([0.0, 1.0])),
                seed=int(rng.integers(0, 2**31)),
                max_tokens=int(rng.integers(1, 40)),
                ignore_eos=True,
                deterministic=det_neighbours and bool(rng.integers(0, 2)),
            )
        )
        loras.append([None, "A", "B"][int(rng.integers(0, 3))])
    for _ in range(2):
        at = int(rng.integers(0, len(prompts) + 1))
        prompts.insert(at, TARGET_PROMPT)
        params.insert(at, target_params(deterministic=False))
        loras.insert(at, "A")
    pos = int(rng.integers(0, len(prompts) + 1))
    prompts.insert(pos, TARGET_PROMPT)
    params.insert(pos, target)
    loras.insert(pos, "A")
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    copies = [
        o
        for i, o in enumerate(outs)
        if i != pos and loras[i] == "A" and o.prompt_token_ids == TARGET_PROMPT
    ]
    return outs[pos], copies


@pytest.mark.parametrize("profile", PROFILES)
def test_adapter_request_is_bitwise_reproducible_in_mixed_batches(
    flat_model, flat_adapters, profile
):
    llm = lora_llm(flat_model, flat_adapters, profile)
    target = target_params()
    solo = {
        lora: llm.generate([TARGET_PROMPT], target, use_tqdm=False, lora_request=lora)[0]
        for lora in ("A", "B", None)
    }
    want = out_bits(solo["A"])
    # Each adapter (and none) gives other bits: the needle below is not blind to the adapter.
    assert out_bits(solo["B"]) != want and out_bits(solo[None]) != want
    assert solo["A"].fingerprint == llm.lora_fingerprint("A") != llm.fingerprint
    assert solo[None].fingerprint == llm.fingerprint
    plain = target_params(deterministic=False)
    plain_solo = out_bits(llm.generate([TARGET_PROMPT], plain, use_tqdm=False, lora_request="A")[0])
    copies_differing = 0
    for seed in range(6):
        got, copies = lora_haystack(llm, target, seed)
        assert out_bits(got)[0] == want[0], f"token ids differ in haystack {seed}"
        assert out_bits(got)[1] == want[1], f"logprob bits differ in haystack {seed}"
        assert got.fingerprint == solo["A"].fingerprint
        copies_differing += sum(out_bits(c) != plain_solo for c in copies)
    print(
        f"\n[{profile}] rollbacks {llm.stats()['num_rollbacks']}, non-deterministic copies "
        f"differing from alone: {copies_differing}/12"
    )
    # Negative control: the non-deterministic copies of the same request (the fast path)
    # varied with the batch, so the needle's bits would show it if they did.
    assert copies_differing > 0, "deterministic=False looked batch-invariant: blind test"
    if profile[0] == "shape_dependent":
        # Replay met real mismatches of the fast path (with adapters in its rows), rolled back.
        assert llm.stats()["num_rollbacks"] > 0, llm.stats()
    llm.shutdown()


@pytest.mark.parametrize("kernel_profile", ["invariant", "shape_dependent"])
def test_negative_control_off_mode_adapter_request_shows_batch_variance(
    flat_model, flat_adapters, kernel_profile
):
    llm = detspec.LLM(
        flat_model,
        enable_lora=True,
        determinism="off",
        kernel_profile=kernel_profile,
        num_kv_pages=2048,
    )
    for name, path in flat_adapters.items():
        llm.load_lora(name, path)
    plain = target_params(deterministic=False)
    solo = out_bits(llm.generate([TARGET_PROMPT], plain, use_tqdm=False, lora_request="A")[0])
    differing = sum(
        out_bits(lora_haystack(llm, plain, seed, det_neighbours=False)[0]) != solo
        for seed in range(6)
    )
    print(f"\n[off, {kernel_profile}] haystacks differing from alone: {differing}/6")
    assert differing > 0, "the fast path with an adapter looked batch-invariant: blind test"
    with pytest.raises(InvalidRequestError, match="deterministic"):
        llm.generate([TARGET_PROMPT], target_params(), use_tqdm=False, lora_request="A")
    llm.shutdown()


# --------------------------------------------------------------------------- score / audit


@pytest.mark.parametrize("profile", PROFILES)
def test_score_prompt_logprobs_and_audit_reproduce_adapter_generation(
    flat_model, flat_adapters, profile
):
    llm = lora_llm(flat_model, flat_adapters, profile)
    out, _ = lora_haystack(llm, target_params(), seed=100)
    tokens, want = out_bits(out)

    (scored,) = llm.score([TARGET_PROMPT], [tokens], lora_request="A")
    assert bits(scored) == want
    (scored_req,) = llm.score(
        [TARGET_PROMPT], [tokens], lora_request=LoRARequest("A", 1, flat_adapters["A"])
    )
    assert bits(scored_req) == want
    # Negative: the base model and the other adapter score the same tokens differently.
    (scored_base,) = llm.score([TARGET_PROMPT], [tokens])
    (scored_b,) = llm.score([TARGET_PROMPT], [tokens], lora_request="B")
    assert bits(scored_base) != want and bits(scored_b) != want

    seq = TARGET_PROMPT + tokens
    (plp,) = llm.prompt_logprobs([seq], 1, lora_request="A")
    (plp_base,) = llm.prompt_logprobs([seq], 1)
    generated = [plp[len(TARGET_PROMPT) + i][t].logprob for i, t in enumerate(tokens)]
    if profile[0] == "invariant":
        # On invariant kernels a deterministic prefill computes what score computes.
        assert bits(generated) == want
    assert [e[t].logprob for t, e in zip(seq[1:], plp_base[1:], strict=True)] != [
        e[t].logprob for t, e in zip(seq[1:], plp[1:], strict=True)
    ]
    # generate's prompt_logprobs with the adapter are prompt_logprobs(lora_request=...)'s.
    with_plp = SamplingParams(temperature=0.0, max_tokens=1, deterministic=True, prompt_logprobs=1)
    (gen,) = llm.generate([seq], with_plp, use_tqdm=False, lora_request="A")
    assert [None if e is None else {t: lp.logprob for t, lp in e.items()} for e in plp] == [
        None if e is None else {t: lp.logprob for t, lp in e.items()} for e in gen.prompt_logprobs
    ]

    report = llm.audit(out, lora_request="A")
    assert report.ok and report.num_tokens == len(tokens) and report.first_mismatch is None
    assert report.fingerprint == out.fingerprint
    assert llm.audit(out, lora_request=LoRARequest("A", 1, flat_adapters["A"])).ok
    tampered = copy.deepcopy(out)
    tampered.outputs[0].token_logprobs[5] = struct.unpack("<f", struct.pack("<I", want[5] ^ 1))[0]
    bad = llm.audit(tampered, lora_request="A")
    assert not bad.ok and (bad.first_mismatch.position, bad.first_mismatch.field) == (
        5,
        "logprob",
    )
    # Without the adapter (or with another one) the fingerprint is not the output's.
    for wrong in (None, "B"):
        with pytest.raises(InvalidRequestError, match="fingerprint") as err:
            llm.audit(out, lora_request=wrong)
        assert err.value.param == "output"
    llm.shutdown()


# --------------------------------------------------------------------------- AsyncLLM


async def test_async_replace_mid_flight_keeps_the_running_requests_adapter(
    flat_model, flat_adapters
):
    """A request keeps the adapter it was submitted with when its name is replaced while it
    runs; requests submitted after get the new adapter. All among concurrent requests of other
    adapters and of the base model."""
    engine = AsyncLLM(
        flat_model, enable_lora=True, verify_window=8, verify_group=4, num_kv_pages=1024
    )
    try:

        async def run(prompt, params, lora, rid=None):
            last = None
            async for out in engine.generate(prompt, params, request_id=rid, lora_request=lora):
                last = out
            return last

        long = target_params(max_tokens=48)
        # LoRARequests load on first use, under their name.
        solo_a = await run(TARGET_PROMPT, long, LoRARequest("X", 1, flat_adapters["A"]))
        solo_b = await run(TARGET_PROMPT, long, LoRARequest("B", 2, flat_adapters["B"]))
        assert set(engine.list_loras()) == {"X", "B"}
        assert out_bits(solo_a) != out_bits(solo_b)

        rng = np.random.default_rng(3)
        noise = [
            asyncio.create_task(
                run(
                    [int(x) for x in rng.integers(3, 900, size=int(rng.integers(1, 60)))],
                    SamplingParams(
                        temperature=1.0,
                        seed=i,
                        max_tokens=30,
                        ignore_eos=True,
                        deterministic=i % 2 == 0,
                    ),
                    [None, "B", "X"][i % 3],
                )
            )
            for i in range(9)
        ]
        await asyncio.sleep(0.01)

        async def needle_replacing_x(rid: str) -> tuple[Any, int | None]:
            """Runs the needle on X and replaces X by B at its first unfinished output."""
            needle, replaced_at = None, None
            async for out in engine.generate(TARGET_PROMPT, long, rid, lora_request="X"):
                if replaced_at is None and not out.finished:
                    replaced_at = len(out.outputs[0].token_ids)
                    info = engine.load_lora("X", flat_adapters["B"], replace=True)
                    assert info["content_hash"] == engine.list_loras()["B"]["content_hash"]
                needle = out
            return needle, replaced_at

        # A consumer that lags gets a request's events merged into one output, so on a loaded
        # machine the needle's first output can already be its last; X is then still A, and
        # the needle runs again.
        for attempt in range(5):
            needle, replaced_at = await needle_replacing_x(f"needle-{attempt}")
            if replaced_at is not None:
                break
            assert out_bits(needle) == out_bits(solo_a)
        assert replaced_at is not None, "the needle finished before any output, five times"
        after = await run(TARGET_PROMPT, long, "X")
        await asyncio.gather(*noise)
        print(f"\nreplaced after {replaced_at} of 48 tokens")
        assert replaced_at < 48
        assert out_bits(needle) == out_bits(solo_a)
        assert needle.fingerprint == solo_a.fingerprint
        assert out_bits(after) == out_bits(solo_b)
        # The fingerprint names the adapter's content, not its name: A loaded again under
        # another name scores and audits the needle (awaitable score/audit, with its adapter).
        assert after.fingerprint == solo_b.fingerprint != solo_a.fingerprint
        again = LoRARequest("A2", 3, flat_adapters["A"])
        (scored,) = await engine.score(
            [TARGET_PROMPT], [needle.outputs[0].token_ids], lora_request=again
        )
        assert bits(scored) == out_bits(solo_a)[1]
        assert (await engine.audit(needle, lora_request="A2")).ok
        with pytest.raises(InvalidRequestError, match="fingerprint"):
            await engine.audit(needle, lora_request="X")
    finally:
        engine.shutdown()


# --------------------------------------------------------------------------- lifecycle


def test_lora_lifecycle(model_zoo, token_prompts, tmp_path):
    case = model_zoo.get("llama")
    save_adapter(case.model, tmp_path / "one", seed=5)
    save_adapter(case.model, tmp_path / "two", seed=6, r=4, target_modules=["gate_proj"])
    llm = detspec.LLM(str(case.path), enable_lora=True, max_loras=2, num_kv_pages=256)
    sp = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0, deterministic=True
    )
    prompt = token_prompts[2]

    def run(lora) -> tuple[tuple[list[int], list[int]], str]:
        (out,) = llm.generate([prompt], sp, use_tqdm=False, lora_request=lora)
        return out_bits(out), out.fingerprint

    base, base_fp = run(None)
    assert base_fp == llm.fingerprint == llm.lora_fingerprint()
    assert llm.list_loras() == {}

    # Loaded on first use; later requests may name it.
    one, one_fp = run(LoRARequest("ad", 7, tmp_path / "one"))
    loras = llm.list_loras()
    assert set(loras) == {"ad"}
    assert Path(loras["ad"]["path"]) == tmp_path / "one" and loras["ad"]["rank"] == 8
    h1 = loras["ad"]["content_hash"]
    assert re.fullmatch(r"[0-9a-f]{16}", h1), h1
    assert one_fp == f"detspec-lora{h1}-" + llm.fingerprint.removeprefix("detspec-")
    assert one_fp == llm.lora_fingerprint("ad") == llm.lora_fingerprint(LoRARequest("ad"))
    assert one != base
    assert run("ad") == (one, one_fp)
    assert run(LoRARequest("ad", 7, tmp_path / "one")) == (one, one_fp)

    # A loaded name is refused without replace, and nothing changes.
    with pytest.raises(InvalidRequestError, match="lora_name") as err:
        llm.load_lora("ad", tmp_path / "two")
    assert err.value.param == "lora_name"
    assert llm.list_loras()["ad"]["content_hash"] == h1

    # replace: later requests get the new adapter, under a new fingerprint.
    info = llm.load_lora("ad", tmp_path / "two", replace=True)
    assert Path(info["path"]) == tmp_path / "two" and info["rank"] == 4
    h2 = info["content_hash"]
    assert h2 != h1 and llm.list_loras()["ad"]["content_hash"] == h2
    two, two_fp = run("ad")
    assert two != one and two != base
    assert two_fp == llm.lora_fingerprint("ad") != one_fp and h2 in two_fp
    # A LoRARequest of a loaded name uses what is loaded (its path is read on first use only).
    assert run(LoRARequest("ad", 7, tmp_path / "one")) == (two, two_fp)
    # The same content under another name: same fingerprint, same bits.
    assert run(LoRARequest("ad2", 8, tmp_path / "two")) == (two, two_fp)

    # max_loras=2: a third one is refused.
    with pytest.raises(InvalidRequestError, match="max_loras"):
        llm.load_lora("ad3", tmp_path / "one")
    assert set(llm.list_loras()) == {"ad", "ad2"}

    # Per-prompt adapters and chat.
    outs = llm.generate(
        [prompt] * 3, sp, use_tqdm=False, lora_request=["ad", None, LoRARequest("ad2")]
    )
    assert [out_bits(o) for o in outs] == [two, base, two]
    with pytest.raises(InvalidRequestError, match="lora_request"):
        llm.generate([prompt] * 3, sp, use_tqdm=False, lora_request=["ad", None])
    for bad in ([3], 3):
        with pytest.raises(InvalidRequestError, match="lora_request"):
            llm.generate([prompt], sp, use_tqdm=False, lora_request=bad)  # type: ignore[arg-type]
    messages = [{"role": "user", "content": "Hello"}]
    (chat_lora,) = llm.chat(messages, sp, use_tqdm=False, lora_request="ad")
    (chat_base,) = llm.chat(messages, sp, use_tqdm=False)
    (again,) = llm.generate([chat_lora.prompt_token_ids], sp, use_tqdm=False, lora_request="ad")
    assert out_bits(chat_lora) == out_bits(again) != out_bits(chat_base)
    assert chat_lora.fingerprint == two_fp

    # unload: the name is gone for every entry point.
    llm.unload_lora("ad")
    assert set(llm.list_loras()) == {"ad2"}
    calls = [
        lambda: llm.generate([prompt], sp, use_tqdm=False, lora_request="ad"),
        lambda: llm.score([prompt], [[5, 6]], lora_request="ad"),
        lambda: llm.prompt_logprobs([prompt], 0, lora_request="ad"),
        lambda: llm.lora_fingerprint("ad"),
        lambda: llm.unload_lora("ad"),
    ]
    for call in calls:
        with pytest.raises(InvalidRequestError, match="lora_name") as err:
            call()
        assert err.value.param == "lora_name"
    # The engine still serves, as before.
    assert run(None) == (base, base_fp)
    assert run("ad2") == (two, two_fp)
    # A name freed by unload can be loaded again (also with another adapter).
    llm.load_lora("ad", tmp_path / "one")
    assert run("ad") == (one, one_fp)
    llm.shutdown()


def test_engine_without_enable_lora_refuses_adapters(llm_factory, model_zoo, tmp_path):
    case = model_zoo.get("llama")
    save_adapter(case.model, tmp_path / "one", seed=5)
    llm = llm_factory("llama")
    for call in (
        lambda: llm.load_lora("x", tmp_path / "one"),
        lambda: llm.generate(
            [[5, 6, 7]], use_tqdm=False, lora_request=LoRARequest("x", 1, tmp_path / "one")
        ),
    ):
        with pytest.raises(InvalidRequestError, match="enable_lora") as err:
            call()
        assert err.value.param == "enable_lora"
    assert llm.list_loras() == {}
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)[0].finished


def _peft_dir(base, tmp_path: Path, name: str, **kw) -> Path:
    save_adapter(base, tmp_path / name, seed=9, **kw)
    return tmp_path / name


def _edit_config(path: Path, **fields) -> Path:
    cfg_path = path / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(fields)
    cfg_path.write_text(json.dumps(cfg))
    return path


BAD_ADAPTERS = [
    pytest.param(
        lambda b, d: _peft_dir(b, d, "dora", use_dora=True), "field `use_dora`", id="dora"
    ),
    pytest.param(lambda b, d: _peft_dir(b, d, "bias", bias="all"), "field `bias`", id="bias-all"),
    pytest.param(
        lambda b, d: _peft_dir(b, d, "mts", modules_to_save=["lm_head"]),
        "field `modules_to_save`",
        id="modules_to_save",
    ),
    pytest.param(
        lambda b, d: _peft_dir(b, d, "embed", target_modules=["embed_tokens", "q_proj"]),
        r"tensor `[^`]*embed_tokens[^`]*`.*not a lora_A/lora_B weight",
        id="embedding-adapter",
    ),
    pytest.param(
        lambda b, d: _peft_dir(b, d, "lmhead", target_modules=["lm_head"]),
        r"tensor `[^`]*lm_head[^`]*`.*not a lora_A/lora_B weight",
        id="lm_head-adapter",
    ),
    pytest.param(
        lambda b, d: _peft_dir(b, d, "alpha", alpha_pattern={"q_proj": 4}),
        "field `alpha_pattern`",
        id="alpha_pattern",
    ),
    pytest.param(
        lambda b, d: _peft_dir(b, d, "big", r=128), r"field `r`.*max_lora_rank", id="rank-128"
    ),
    pytest.param(
        lambda b, d: _edit_config(_peft_dir(b, d, "ia3"), peft_type="IA3"),
        "field `peft_type`",
        id="not-lora",
    ),
    pytest.param(lambda b, d: d / "missing", "adapter_config.json", id="missing-dir"),
]


@pytest.mark.parametrize("make, match", BAD_ADAPTERS)
def test_unsupported_adapters_are_refused_and_the_engine_still_serves(
    make, match, model_zoo, tmp_path
):
    case = model_zoo.get("llama")
    path = make(case.model, tmp_path)
    llm = detspec.LLM(str(case.path), enable_lora=True, num_kv_pages=128)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, deterministic=True)
    (before,) = llm.generate([[5, 6, 7]], sp, use_tqdm=False)
    with pytest.raises(DetspecError, match=match):
        llm.load_lora("bad", path)
    # Through a LoRARequest the same refusal, and the name is not taken.
    with pytest.raises(DetspecError, match=match):
        llm.generate([[5, 6, 7]], sp, use_tqdm=False, lora_request=LoRARequest("bad", 1, path))
    assert llm.list_loras() == {}
    (after,) = llm.generate([[5, 6, 7]], sp, use_tqdm=False)
    assert out_bits(after) == out_bits(before)
    llm.shutdown()


def test_an_adapter_sent_from_memory_is_the_adapter_saved_to_disk(
    model_zoo, token_prompts, tmp_path
):
    """An RL trainer's adapter pushed without a file (``load_lora_from_tensors`` of
    ``get_peft_model_state_dict`` and the ``LoraConfig``) is the same adapter, bit for bit, as
    ``save_pretrained`` + ``load_lora``; a step's new weights replace it in place."""
    case = model_zoo.get("llama")
    peft_model = save_adapter(case.model, tmp_path / "disk", seed=9)
    llm = detspec.LLM(str(case.path), enable_lora=True, num_kv_pages=256)
    try:
        disk = llm.load_lora("disk", tmp_path / "disk")
        state = peft.get_peft_model_state_dict(peft_model)
        config = peft_model.peft_config["default"]
        sent = llm.load_lora_from_tensors("sent", state, config)
        assert sent["content_hash"] == disk["content_hash"]
        sp = SamplingParams(
            temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=0, deterministic=True
        )
        prompt = token_prompts[2]
        outs = llm.generate([prompt, prompt], sp, use_tqdm=False, lora_request=["disk", "sent"])
        assert out_bits(outs[0]) == out_bits(outs[1])
        assert outs[0].fingerprint == outs[1].fingerprint
        # The next step's weights (numpy this time) under the same name.
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.mul_(1.5)
        step = {k: v.numpy() for k, v in peft.get_peft_model_state_dict(peft_model).items()}
        replaced = llm.load_lora_from_tensors("sent", step, config.to_dict(), replace=True)
        assert replaced["content_hash"] != sent["content_hash"]
        (new,) = llm.generate([prompt], sp, use_tqdm=False, lora_request="sent")
        assert out_bits(new) != out_bits(outs[1])
        with pytest.raises(DetspecError, match="safetensors"):
            llm.load_lora_from_tensors("broken", b"not safetensors", config)
        assert "broken" not in llm.list_loras()
    finally:
        llm.shutdown()


def _refused_and_serving(case, adapter_dir, match: str) -> None:
    """Loading ``adapter_dir`` on ``case``'s model fails with ``match``, and the engine serves
    on unchanged: nothing loaded, the same bits as before."""
    llm = detspec.LLM(str(case.path), enable_lora=True, num_kv_pages=128)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, deterministic=True)
    (before,) = llm.generate([[5, 6, 7]], sp, use_tqdm=False)
    with pytest.raises(DetspecError, match=match):
        llm.load_lora("refused", adapter_dir)
    assert llm.list_loras() == {}
    (after,) = llm.generate([[5, 6, 7]], sp, use_tqdm=False)
    assert out_bits(after) == out_bits(before)
    llm.shutdown()


def test_latent_attention_models_refuse_adapters_and_keep_serving(model_zoo, tmp_path):
    """DeepSeek-V3's latent attention has no q/k/v projections for an adapter to change (the
    engine's adapters target q/k/v/o and the MLP): a PEFT adapter of its MLA projections is
    refused, naming the field, rather than loaded and silently not applied."""
    case = model_zoo.get("deepseek_v3")
    path = _peft_dir(case.model, tmp_path, "mla", target_modules=["q_b_proj", "kv_b_proj"])
    _refused_and_serving(case, path, "field `target_modules`.*latent-attention")


@pytest.mark.parametrize("name", ["apertus", "nemotron_h"])
def test_ungated_mlps_refuse_up_proj_adapters_and_keep_serving(model_zoo, tmp_path, name):
    """Apertus's and Nemotron-H's MLPs are ungated: an adapter of the up projection (which
    the engine's adapter groups pair with a gate) is refused, naming the module, not applied in
    part."""
    case = model_zoo.get(name)
    path = _peft_dir(case.model, tmp_path, "up", target_modules=["q_proj", "up_proj"])
    _refused_and_serving(case, path, "mlp.up_proj.*down_proj only")


def test_lfm2_refuses_convolution_adapters_and_keeps_serving(model_zoo, tmp_path):
    """PEFT's `out_proj` target matches LFM2's convolutions' output projections as well as
    its attention's: the engine adapts no convolution, so such an adapter is refused, naming
    the tensor, rather than loaded in part."""
    case = model_zoo.get("lfm2")
    path = _peft_dir(case.model, tmp_path, "lfm2", target_modules=["q_proj", "out_proj"])
    _refused_and_serving(case, path, "layers.0.conv.out_proj")


@pytest.mark.parametrize(
    "name, module, tensor",
    [
        ("qwen3_5", "in_proj_qkv", "layers.0.linear_attn.in_proj_qkv"),
        ("granite4_h", "in_proj", "layers.0.mamba.in_proj"),
        ("nemotron_h", "in_proj", "layers.0.mixer.in_proj"),
    ],
)
def test_recurrent_mixer_adapters_are_refused_and_the_engine_keeps_serving(
    model_zoo, tmp_path, name, module, tensor
):
    """An adapter of a DeltaNet's or a Mamba2 mixer's projections is refused, naming the
    tensor: the engine adapts attention and MLPs only."""
    case = model_zoo.get(name)
    path = _peft_dir(case.model, tmp_path, name, target_modules=["q_proj", module])
    _refused_and_serving(case, path, tensor)
