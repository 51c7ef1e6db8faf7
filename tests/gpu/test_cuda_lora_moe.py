"""LoRA adapters, mixtures of experts, embeddings and classifiers on a CUDA GPU: parity with
PEFT and transformers, and the determinism contract (needle in a haystack, its negative
control, score equal to the generation's logprobs). cuBLAS picks GEMM kernels by the row
count, so an expert's or an adapter's GEMM over a batch-dependent number of rows is where a
GPU's fast path varies: replay must catch it, and the fixed-shape passes must not carry it."""

from __future__ import annotations

import copy
import struct
from pathlib import Path

import numpy as np
import peft
import pytest
import torch
import transformers
from detspec_cpu_suite_fixtures import (
    build_classifier,
    greedy_mismatch_message,
    hf_greedy,
    top2_margin,
)
from test_cuda import NEW_TOKENS, TARGET_PROMPT, bits, greedy, in_haystack, target

import detspec
from detspec import LoRARequest, SamplingParams

ALL_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HAYSTACKS = 12
# A greedy flip against the CPU reference is allowed only where its top two logits nearly tie.
NEAR_TIE = 1e-4


def f32(xs) -> list[bytes]:
    return [struct.pack("<f", x) for x in xs]


# --------------------------------------------------------------------------- mixtures of experts


@pytest.mark.parametrize(
    "arch", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "granitemoe", "granitemoeshared"]
)
def test_moe_f32_greedy_matches_transformers(model_zoo, token_prompts, arch):
    case = model_zoo.get(arch)
    llm = detspec.LLM(str(case.path), device="cuda", dtype="float32")
    outs = llm.generate(token_prompts, greedy(), use_tqdm=False)
    # A router whose top two experts nearly tie sends a token elsewhere for a last-bit
    # difference (the GPU's reduction orders are not the CPU's), and the continuation parts
    # from there: most prompts, not all, must agree token for token.
    mismatches = [
        msg
        for i, (prompt, out) in enumerate(zip(token_prompts, outs, strict=True))
        if (
            msg := case.greedy_mismatch(
                prompt, list(out.outputs[0].token_ids), case.greedy(prompt), f"prompt {i}"
            )
        )
    ]
    print(f"\n[{arch} f32 on GPU] greedy agreement {len(outs) - len(mismatches)}/{len(outs)}")
    print("\n".join(mismatches))
    assert len(mismatches) <= len(outs) // 4, mismatches
    llm.shutdown()


@pytest.fixture(scope="module")
def flat_moe(tmp_path_factory) -> str:
    """The tiny demo MoE (Mixtral-style, random weights: flat distributions and routers that
    spread tokens over the experts, so each expert's row count follows the batch)."""
    d = tmp_path_factory.mktemp("gpu-moe-model")
    detspec._core.write_demo_model(str(d), "tiny-moe", 5)
    return str(d)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_moe_needle_in_haystack_bitwise_on_gpu(flat_moe, dtype, temperature):
    llm = detspec.LLM(flat_moe, device="cuda", dtype=dtype, num_kv_pages=4096)
    params = target(temperature, deterministic=True)
    solo = bits(llm.generate([TARGET_PROMPT], params, use_tqdm=False)[0])
    for seed in range(HAYSTACKS):
        assert in_haystack(llm, params, seed) == solo, f"haystack {seed}"
    (scored,) = llm.score([TARGET_PROMPT], [solo[0]], deterministic=True)
    assert f32(scored) == solo[1], "score != generation logprobs"
    stats = llm.stats()
    print(f"\n[moe {dtype}, T={temperature}] {stats}")
    assert stats["num_verify_passes"] > 0
    llm.shutdown()


def test_moe_negative_control_off_mode_differs_on_gpu(flat_moe):
    llm = detspec.LLM(
        flat_moe, device="cuda", dtype="float32", determinism="off", num_kv_pages=4096
    )
    params = target(0.8, deterministic=False)
    solo = bits(llm.generate([TARGET_PROMPT], params, use_tqdm=False)[0])
    differing = sum(in_haystack(llm, params, seed) != solo for seed in range(HAYSTACKS))
    print(f"\n[moe off] {differing}/{HAYSTACKS} haystacks differ")
    assert differing > 0, "the MoE fast path looked batch-invariant: the needle test is blind"
    llm.shutdown()


# --------------------------------------------------------------------------- LoRA adapters


# Phi-3 stores q/k/v and gate/up fused, and PEFT adapts the fused modules.
PHI3_PROJ = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def save_adapter(base: torch.nn.Module, out_dir: Path, seed: int, **kw) -> torch.nn.Module:
    """A random PEFT LoRA adapter (lora_B non-zero) of `base`, saved; returns the PEFT model."""
    fused = base.config.model_type == "phi3"
    kw = {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": list(PHI3_PROJ if fused else ALL_PROJ),
        "init_lora_weights": False,
    }
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**kw)).eval()
    model.save_pretrained(out_dir)
    return model


@pytest.mark.parametrize("name", ["llama", "qwen2", "phi3"])
def test_lora_greedy_matches_peft_on_gpu(model_zoo, token_prompts, tmp_path, name):
    case = model_zoo.get(name)
    ref = save_adapter(case.model, tmp_path / "adapter", seed=3)
    llm = detspec.LLM(str(case.path), device="cuda", dtype="float32", enable_lora=True)
    adapter = LoRARequest("a", 1, tmp_path / "adapter")
    n = len(token_prompts)
    fast = greedy()
    det = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, deterministic=True
    )
    outs = llm.generate(
        token_prompts * 3,
        [fast] * n + [det] * n + [fast] * n,
        use_tqdm=False,
        lora_request=[adapter] * (2 * n) + [None] * n,
    )
    agree, changed = 0, 0
    for i, prompt in enumerate(token_prompts):
        want = hf_greedy(ref, prompt, NEW_TOKENS)
        case.assert_greedy_matches(prompt, list(outs[2 * n + i].outputs[0].token_ids))
        changed += list(outs[i].outputs[0].token_ids) != list(outs[2 * n + i].outputs[0].token_ids)
        for out in (outs[i], outs[n + i]):
            got = list(out.outputs[0].token_ids)
            m = next(
                (j for j, (a, b) in enumerate(zip(got, want.tokens, strict=True)) if a != b), None
            )
            if m is None:
                agree += 1
            else:
                msg = greedy_mismatch_message(prompt, got, want, f"[{name}+lora] prompt {i}")
                assert top2_margin(want.step_logits[m]) < NEAR_TIE, msg
    print(f"\n[{name}+lora on GPU] greedy agreement with PEFT {agree}/{2 * n}")
    assert agree >= 2 * n - 1
    assert changed >= 1, "the adapter changed no greedy continuation"
    llm.shutdown()


@pytest.fixture(scope="module")
def flat_model_adapters(tmp_path_factory) -> tuple[str, dict[str, Path]]:
    """The tiny demo model (random weights) and two adapters of it: A on all seven projections,
    B (rank 16, rslora) on q/v/o."""
    d = tmp_path_factory.mktemp("gpu-lora-model")
    detspec._core.write_demo_model(str(d), "tiny", 5)
    base = transformers.LlamaForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    root = tmp_path_factory.mktemp("gpu-lora-adapters")
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
    return str(d), {"A": root / "A", "B": root / "B"}


def lora_llm(flat_model_adapters, dtype: str, **kw) -> detspec.LLM:
    model, adapters = flat_model_adapters
    llm = detspec.LLM(model, device="cuda", dtype=dtype, enable_lora=True, num_kv_pages=4096, **kw)
    for name, path in adapters.items():
        llm.load_lora(name, path)
    return llm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_needle_in_haystack_bitwise_on_gpu(flat_model_adapters, dtype):
    llm = lora_llm(flat_model_adapters, dtype)
    params = target(0.8, deterministic=True)
    solo = {
        lora: bits(llm.generate([TARGET_PROMPT], params, use_tqdm=False, lora_request=lora)[0])
        for lora in ("A", "B", None)
    }
    assert solo["A"] != solo["B"] and solo["A"] != solo[None], "the adapters change nothing"
    for seed in range(HAYSTACKS):
        assert in_haystack(llm, params, seed, "A", (None, "A", "B")) == solo["A"], (
            f"haystack {seed}"
        )
    (scored,) = llm.score([TARGET_PROMPT], [solo["A"][0]], deterministic=True, lora_request="A")
    assert f32(scored) == solo["A"][1], "score != generation logprobs"
    print(f"\n[lora {dtype}] {llm.stats()}")
    llm.shutdown()


def test_lora_negative_control_off_mode_differs_on_gpu(flat_model_adapters):
    llm = lora_llm(flat_model_adapters, "float32", determinism="off")
    params = target(0.8, deterministic=False)
    solo = bits(llm.generate([TARGET_PROMPT], params, use_tqdm=False, lora_request="A")[0])
    differing = sum(
        in_haystack(llm, params, seed, "A", (None, "A", "B")) != solo for seed in range(HAYSTACKS)
    )
    print(f"\n[lora off] {differing}/{HAYSTACKS} haystacks differ")
    assert differing > 0, "the adapter fast path looked batch-invariant: the needle is blind"
    llm.shutdown()


# --------------------------------------------------------------------------- embeddings


def test_embeddings_match_transformers_and_keep_their_bits_on_gpu(model_zoo, token_prompts):
    case = model_zoo.get("llama")
    llm = detspec.LLM(str(case.path), device="cuda", dtype="float32", num_kv_pages=4096)
    prompts = [p for p in token_prompts if len(p) > 1]
    alone = [llm.embed([p])[0].outputs.embedding for p in prompts]
    together = [o.outputs.embedding for o in llm.embed(prompts)]
    assert [f32(a) for a in alone] == [f32(t) for t in together], "deterministic embeddings moved"
    worst = 0.0
    for p, e in zip(prompts, alone, strict=True):
        with torch.no_grad():
            h = case.model.model(torch.tensor([p])).last_hidden_state[0, -1].float().numpy()
        worst = max(worst, float(np.abs(np.array(e) - h / np.linalg.norm(h)).max()))
    print(f"\n[embeddings on GPU] max |diff| against transformers {worst:.2e}")
    assert worst < 1e-4, worst
    llm.shutdown()


# --------------------------------------------------------------------------- classifiers


@pytest.mark.parametrize("name", ["llama3", "qwen2_reward"])
def test_classifiers_match_transformers_and_keep_their_bits_on_gpu(
    name, tokenizer_dir, token_prompts, tmp_path
):
    model = build_classifier(name, tmp_path / name, tokenizer_dir)
    llm = detspec.LLM(str(tmp_path / name), device="cuda", dtype="float32", num_kv_pages=4096)
    prompts = [p for p in token_prompts if len(p) > 1]
    alone = [llm.classify([p])[0].outputs for p in prompts]
    together = [o.outputs for o in llm.classify(prompts)]
    for a, t in zip(alone, together, strict=True):
        assert f32(a.logits) == f32(t.logits) and f32(a.probs) == f32(t.probs), "moved"
    worst = 0.0
    for p, a in zip(prompts, alone, strict=True):
        with torch.no_grad():
            want = model(torch.tensor([p])).logits[0].float().numpy()
        worst = max(worst, float(np.abs(np.array(a.logits) - want).max()))
    print(f"\n[{name} classifier on GPU] max |diff| against transformers {worst:.2e}")
    assert worst < 1e-4, worst
    llm.shutdown()
