"""Mixture-of-experts models under the determinism contract.

Parity with transformers for Qwen3-MoE, Qwen2-MoE and Mixtral is in test_model_parity.py (the
architecture zoo). Here, on a Qwen2-MoE model (8 experts, 2 per token, a gated shared expert, a
dense layer): a deterministic request is bitwise identical alone and in random batches on both
CPU profiles. Under ``shape_dependent`` each expert's GEMM bits change with how many rows the
batch routes to it, as a GPU's do, so replay rolls back by itself, and a verify pass's rows must
not change each other's bits through the routing (the experts run on fixed row blocks there).
The negative control shows the fast path varying; ``score`` reproduces a generation; weight
updates and LoRA adapters address the experts by their checkpoint names.
"""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

# isort: split
from conftest import hf_logits
from test_determinism import (
    PROFILES,
    TARGET_PROMPT,
    fingerprint_bits,
    run_in_haystack,
    target_params,
)

import detspec
from detspec import InvalidRequestError, LoRARequest, ModelLoadError, SamplingParams

VOCAB = 1024  # TARGET_PROMPT and the haystacks draw ids below 900


def build_moe(seed: int, **overrides) -> torch.nn.Module:
    config = transformers.Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[1],
        use_sliding_window=False,
        bos_token_id=1,
        eos_token_id=2,
        **overrides,
    )
    torch.manual_seed(seed)
    return transformers.Qwen2MoeForCausalLM._from_config(
        config, attn_implementation="eager", dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, torch.nn.Module]]:
    """Two Qwen2-MoE checkpoints of one config, different weights: name -> (dir, model)."""
    out = {}
    for name, seed in (("a", 3), ("b", 4)):
        model = build_moe(seed)
        d = tmp_path_factory.mktemp(f"moe-{name}")
        model.save_pretrained(d)
        out[name] = (str(d), model)
    return out


@pytest.fixture(scope="module")
def moe_model(moe_models) -> str:
    return moe_models["a"][0]


def bits(values) -> list[bytes]:
    return [struct.pack("<f", v) for v in values]


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_moe_needle_in_haystack_bitwise(
    moe_model: str, temperature: float, profile: tuple[str, str]
) -> None:
    kernel_profile, strategy = profile
    target = target_params(temperature)
    llm = detspec.LLM(
        moe_model,
        verify_window=8,
        verify_group=4,
        verify_strategy=strategy,
        kernel_profile=kernel_profile,
        num_kv_pages=2048,
    )
    solo = fingerprint_bits(llm.generate([TARGET_PROMPT], target, use_tqdm=False)[0])
    for seed in range(6):
        got = run_in_haystack(llm, target, seed, det=True)
        assert got[0] == solo[0], f"token ids differ in haystack {seed}"
        assert got[1] == solo[1], f"logprob bits differ in haystack {seed}"
    if kernel_profile == "shape_dependent":
        # Real mismatches of the fast path (expert GEMMs see the batch's routing), no injection.
        assert llm.stats()["num_rollbacks"] > 0, llm.stats()


@pytest.mark.parametrize("kernel_profile", ["invariant", "shape_dependent"])
def test_moe_negative_control_off_mode_varies(moe_model: str, kernel_profile: str) -> None:
    plain = target_params(0.8)
    plain.deterministic = False
    llm = detspec.LLM(
        moe_model, determinism="off", kernel_profile=kernel_profile, num_kv_pages=2048
    )
    solo = fingerprint_bits(llm.generate([TARGET_PROMPT], plain, use_tqdm=False)[0])
    differing = sum(run_in_haystack(llm, plain, seed, det=False) != solo for seed in range(6))
    assert differing > 0, "the MoE fast path looked batch-invariant: the needle test is blind"


@pytest.mark.parametrize("kernel_profile", ["invariant", "shape_dependent"])
def test_moe_batch_invariant_mode(moe_model: str, kernel_profile: str) -> None:
    """determinism="batch_invariant": every request reproducible, experts on fixed blocks."""
    llm = detspec.LLM(
        moe_model,
        determinism="batch_invariant",
        kernel_profile=kernel_profile,
        num_kv_pages=2048,
    )
    plain = target_params(0.8)
    plain.deterministic = False
    solo = fingerprint_bits(llm.generate([TARGET_PROMPT], plain, use_tqdm=False)[0])
    for seed in range(3):
        assert run_in_haystack(llm, plain, seed, det=False) == solo


@pytest.mark.parametrize("kernel_profile", ["invariant", "shape_dependent"])
def test_moe_score_reproduces_the_generation(moe_model: str, kernel_profile: str) -> None:
    llm = detspec.LLM(moe_model, kernel_profile=kernel_profile, num_kv_pages=2048)
    rng = np.random.default_rng(5)
    prompts = [[int(x) for x in rng.integers(3, 900, size=n)] for n in (5, 19, 40)]
    params = [
        SamplingParams(
            temperature=0.8, seed=i, max_tokens=20, ignore_eos=True, deterministic=True, logprobs=0
        )
        for i in range(len(prompts))
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    completions = [list(o.outputs[0].token_ids) for o in outs]
    scored = llm.score(prompts, completions)
    for out, got in zip(outs, scored, strict=True):
        c = out.outputs[0]
        want = [e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True)]
        assert bits(got) == bits(want)


def test_moe_matches_transformers_with_its_dense_layer_and_shared_expert(moe_models) -> None:
    path, model = moe_models["a"]
    llm = detspec.LLM(path)
    seqs = [TARGET_PROMPT, TARGET_PROMPT[:3] + [7, 8, 9, 10, 11, 12]]
    for seq, got in zip(seqs, llm.compute_logits(seqs), strict=True):
        ref = hf_logits(model, seq)
        assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


def test_moe_weight_update_by_expert_names(moe_models) -> None:
    """A trainer's ``state_dict()`` (transformers 5 holds each layer's experts fused:
    ``mlp.experts.gate_up_proj`` ``[8, 96, 64]``, ``mlp.experts.down_proj``) turns model a into
    model b: b's fingerprint and b's bits; so does b's checkpoint (per-expert names)."""
    (path_a, _), (path_b, model_b) = moe_models["a"], moe_models["b"]
    ref = detspec.LLM(path_b, num_kv_pages=512)
    target = target_params(0.8)
    want = fingerprint_bits(ref.generate([TARGET_PROMPT], target, use_tqdm=False)[0])
    state = model_b.state_dict()
    assert tuple(state["model.layers.0.mlp.experts.gate_up_proj"].shape) == (8, 96, 64)
    for how in ("state_dict", "disk"):
        llm = detspec.LLM(path_a, num_kv_pages=512)
        assert llm.fingerprint != ref.fingerprint
        if how == "state_dict":
            llm.update_weights(state.items())
        else:
            llm.update_weights_from_disk(path_b, complete=True)
        assert llm.fingerprint == ref.fingerprint, how
        got = fingerprint_bits(llm.generate([TARGET_PROMPT], target, use_tqdm=False)[0])
        assert got == want, how
    # One expert's weights by name: the fingerprint moves.
    name = "model.layers.0.mlp.experts.5.down_proj.weight"
    before = llm.fingerprint
    llm.update_weights([(name, torch.randn(64, 48) * 0.02)])
    assert llm.fingerprint != before
    # Errors name the tensor: an expert the model lacks, a wrong shape (per-expert and
    # fused), a dense layer's name on the sparse layer. Nothing changes.
    before = llm.fingerprint
    for bad, t in (
        ("model.layers.0.mlp.experts.8.up_proj.weight", torch.zeros(48, 64)),
        (name, torch.zeros(48, 64)),
        ("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(8, 48, 64)),
        ("model.layers.0.mlp.gate_proj.weight", torch.zeros(96, 64)),
    ):
        with pytest.raises(InvalidRequestError, match=bad.replace(".", r"\.")):
            llm.update_weights([(bad, t)])
    assert llm.fingerprint == before


def save_peft(base: torch.nn.Module, out_dir: Path, **kw) -> torch.nn.Module:
    import peft

    torch.manual_seed(11)
    model = peft.get_peft_model(
        copy.deepcopy(base),
        peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, **kw),
    ).eval()
    model.save_pretrained(out_dir)
    return model


def test_moe_lora_on_attention_and_dense_layers(moe_models, tmp_path: Path) -> None:
    """Adapters on what the MoE model has as plain linear layers (attention, the dense
    layer's MLP) match PEFT; adapters of the experts or the shared expert are refused,
    naming the tensor."""
    path, model = moe_models["a"]
    llm = detspec.LLM(path, enable_lora=True, num_kv_pages=512)
    cases = {
        "attn": {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "dense-mlp": {
            "target_modules": ["gate_proj", "up_proj", "down_proj"],
            "layers_to_transform": [1],
        },
    }
    for name, kw in cases.items():
        ref = save_peft(model, tmp_path / name, **kw)
        lora = LoRARequest(name, 1, str(tmp_path / name))
        [got] = llm.generate(
            [TARGET_PROMPT],
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0),
            lora_request=lora,
            use_tqdm=False,
        )
        c = got.outputs[0]
        seq = TARGET_PROMPT + list(c.token_ids)
        ref_logits = hf_logits(ref, seq)[len(TARGET_PROMPT) - 1 : -1]
        assert list(ref_logits.argmax(-1)) == list(c.token_ids), name
    # PEFT's gate/up/down on every layer reaches the sparse layer's shared expert.
    save_peft(model, tmp_path / "shared", target_modules=["gate_proj"])
    with pytest.raises(ModelLoadError, match="shared_expert.gate_proj"):
        llm.load_lora("shared", str(tmp_path / "shared"))
    # A hand-made adapter of the sparse layer's MLP by its dense name.
    d = tmp_path / "sparse-dense-name"
    d.mkdir()
    from safetensors.numpy import save_file

    p = "base_model.model.model.layers.0.mlp.up_proj"
    save_file(
        {
            f"{p}.lora_A.weight": np.zeros((4, 64), "f4"),
            f"{p}.lora_B.weight": np.zeros((96, 4), "f4"),
        },
        str(d / "adapter_model.safetensors"),
    )
    (d / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["up_proj"]})
    )
    with pytest.raises(ModelLoadError, match="mixture of experts"):
        llm.load_lora("x", str(d))


def test_moe_config_errors_name_the_field(moe_models, tmp_path: Path) -> None:
    path, _ = moe_models["a"]
    config = json.loads((Path(path) / "config.json").read_text())
    for field, value, match in (
        ("num_experts_per_tok", 9, "num_experts_per_tok"),
        ("mlp_only_layers", [5], "mlp_only_layers"),
        ("moe_intermediate_size", 0, "moe_intermediate_size"),
    ):
        d = tmp_path / field
        d.mkdir()
        for f in Path(path).iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        (d / "config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(ModelLoadError, match=match):
            detspec.LLM(str(d))


def test_mixtral_update_from_a_transformers_state_dict(tmp_path: Path) -> None:
    """Mixtral's in-memory names differ from its checkpoint's more than Qwen's do
    (``mlp.gate`` for ``block_sparse_moe.gate``, fused ``mlp.experts.*``): a trainer's
    ``state_dict()`` still turns model a into model b exactly."""
    models = []
    for seed in (5, 6):
        config = transformers.MixtralConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
            max_position_embeddings=512,
        )
        torch.manual_seed(seed)
        model = transformers.MixtralForCausalLM._from_config(
            config, attn_implementation="eager", dtype=torch.float32
        ).eval()
        model.save_pretrained(tmp_path / str(seed))
        models.append(model)
    state = models[1].state_dict()
    assert "model.layers.0.mlp.gate.weight" in state
    llm = detspec.LLM(str(tmp_path / "5"), num_kv_pages=256)
    ref = detspec.LLM(str(tmp_path / "6"), num_kv_pages=256)
    llm.update_weights(state.items())
    assert llm.fingerprint == ref.fingerprint
    target = target_params(0.8)
    assert fingerprint_bits(llm.generate([TARGET_PROMPT], target, use_tqdm=False)[0]) == (
        fingerprint_bits(ref.generate([TARGET_PROMPT], target, use_tqdm=False)[0])
    )


def _glm_reference(model: torch.nn.Module) -> torch.nn.Module:
    """GLM-4.5's model as a bf16 engine computes it: every weight rounded to bf16 but the
    router's (transformers keeps ``mlp.gate.weight`` and its correction bias in f32), evaluated
    in f32."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if not name.endswith("mlp.gate.weight"):
                p.copy_(p.to(torch.bfloat16).float())
    return ref


def test_glm4_moe_router_stays_f32_and_its_bias_is_a_parameter(model_zoo) -> None:
    """GLM-4.5 (DeepSeek-V3's routing) in bf16: the router's weight and correction bias are held
    and applied in f32, as transformers holds them, so the engine is the rounded model with an
    f32 router (within f32 rounding; a bf16 router moves every expert weight by ~1e-3). The
    correction bias only chooses experts; an update of it is followed (as transformers with the
    new buffer) and restoring it restores the bits."""
    case = model_zoo.get("glm4_moe")
    llm = detspec.LLM(str(case.path), dtype="bfloat16", kv_cache_dtype="float32")
    rng = np.random.default_rng(3)  # the zoo's vocabulary is 512
    seqs = [[int(t) for t in rng.integers(3, 500, size=n)] for n in (24, 9)]

    def worst(got_all, ref_model) -> float:
        return max(
            float(np.abs(got - (r := hf_logits(ref_model, s))).max() / np.abs(r).max())
            for s, got in zip(seqs, got_all, strict=True)
        )

    ref = _glm_reference(case.model)
    before = llm.compute_logits(seqs)
    assert worst(before, ref) <= 1e-4
    # Negative control: the reference with its router rounded too is not the engine.
    rounded_router = copy.deepcopy(ref)
    with torch.no_grad():
        for p in rounded_router.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    assert worst(before, rounded_router) > 1e-4

    name = "model.layers.2.mlp.gate.e_score_correction_bias"
    old = case.model.state_dict()[name].clone()
    fp0 = llm.fingerprint
    new = torch.randn(old.shape, generator=torch.Generator().manual_seed(9)) * 0.5
    llm.update_weights([(name, new)])
    assert llm.fingerprint != fp0
    with torch.no_grad():
        ref.get_buffer(name).copy_(new)
    after = llm.compute_logits(seqs)
    assert worst(after, ref) <= 1e-4
    assert any(not np.array_equal(a, b) for a, b in zip(after, before, strict=True))
    llm.update_weights([(name, old)])
    assert llm.fingerprint == fp0
    for a, b in zip(llm.compute_logits(seqs), before, strict=True):
        assert np.array_equal(a, b)
    # The router's weight is taken in f32 too.
    router = "model.layers.1.mlp.gate.weight"
    w = case.model.state_dict()[router] * 1.3 + 1e-3
    llm.update_weights([(router, w)])
    with torch.no_grad():
        ref.get_buffer(name).copy_(old)
        ref.get_parameter(router).copy_(w)
    assert worst(llm.compute_logits(seqs), ref) <= 1e-4


def _check_bias_updates(llm, ref, file_name: str, memory_name: str, scale: float) -> None:
    """``ref`` (transformers' model as the engine ``llm`` computes it) is ``llm``'s model; a
    new correction bias chooses other experts (the negative control), and an update of it
    under either name is followed as transformers follows it; restoring it restores the
    bits."""
    rng = np.random.default_rng(4)
    seqs = [[int(t) for t in rng.integers(3, 500, size=n)] for n in (24, 9)]
    held = dict(ref.named_parameters()) | dict(ref.named_buffers())

    def worst(got_all) -> float:
        return max(
            float(np.abs(got - (r := hf_logits(ref, s))).max() / np.abs(r).max())
            for s, got in zip(seqs, got_all, strict=True)
        )

    before = llm.compute_logits(seqs)
    assert worst(before) <= 1e-4
    old = held[memory_name].detach().clone()
    new = torch.randn(old.shape, generator=torch.Generator().manual_seed(9)) * scale
    with torch.no_grad():
        held[memory_name].copy_(new)
    assert worst(before) > 1e-4
    for name in (memory_name, file_name):
        llm.update_weights([(name, old)])
        llm.update_weights([(name, new)])
        assert worst(llm.compute_logits(seqs)) <= 1e-4, name
    llm.update_weights([(memory_name, old)])
    for a, b in zip(llm.compute_logits(seqs), before, strict=True):
        assert np.array_equal(a, b)


def test_minimax_m2_chooses_experts_by_its_correction_bias(model_zoo) -> None:
    """MiniMax-M2's correction bias sits beside its router (``block_sparse_moe`` on file,
    ``mlp.e_score_correction_bias`` in a trainer's ``state_dict()``) and only chooses experts:
    an update of it under either name is followed as transformers follows the new buffer, and
    restoring it restores the bits."""
    case = model_zoo.get("minimax_m2")
    llm = detspec.LLM(str(case.path), num_kv_pages=256)
    _check_bias_updates(
        llm,
        copy.deepcopy(case.model),
        "model.layers.1.block_sparse_moe.e_score_correction_bias",
        "model.layers.1.mlp.e_score_correction_bias",
        scale=1.0,
    )


def test_ernie45_moe_router_stays_f32_and_its_bias_updates_by_either_name(model_zoo) -> None:
    """ERNIE 4.5 MoE in bf16: transformers keeps its router and correction bias in f32 (as
    GLM-4.5's), so the engine is the rounded model with an f32 router. The bias (one row,
    ``mlp.moe_statics.e_score_correction_bias`` on file, under ``mlp.gate`` in a trainer's
    ``state_dict()``) only chooses experts: an update under either name is followed as
    transformers follows it, and restoring it restores the bits."""
    case = model_zoo.get("ernie45_moe")
    llm = detspec.LLM(str(case.path), dtype="bfloat16", kv_cache_dtype="float32")
    ref = copy.deepcopy(case.model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if not name.endswith(("mlp.gate.weight", "e_score_correction_bias")):
                p.copy_(p.to(torch.bfloat16).float())
    _check_bias_updates(
        llm,
        ref,
        "model.layers.1.mlp.moe_statics.e_score_correction_bias",
        "model.layers.1.mlp.gate.moe_statics.e_score_correction_bias",
        scale=0.5,
    )
