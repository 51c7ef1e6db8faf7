"""gpt-oss beyond the parity zoo (where ``gpt_oss`` matches transformers and passes the needle
test): its checkpoints' MXFP4 experts, and weight updates by its stacked expert names.

gpt-oss ships its experts in MXFP4 (4-bit codes in blocks of 32 with a power-of-two scale per
block). On the CPU detspec keeps them so: with f32 activations its MXFP4 GEMM multiplies by
them, in the bf16-activation mode that mode's GEMM widens each panel to bf16 as it needs it
(on AMX tiles, and on other devices, they are widened at load). Their values are exact in bf16
and f32, so either way an MXFP4 checkpoint is the same model, bit for bit and by fingerprint,
as the checkpoint of its widened weights. The reference widening is
transformers' own (``convert_moe_packed_tensors``).
"""

from __future__ import annotations

import copy
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

# isort: split
from conftest import MODEL_SPECS, build_hf_model, hf_logits, save_model_dir
from test_determinism import fingerprint_bits, target_params

import detspec
from detspec import InvalidRequestError, ModelLoadError

PARTS = ("gate_up_proj", "down_proj")
# The zoo's models have 512 ids.
TARGET_PROMPT = [int(x) for x in np.random.default_rng(0).integers(3, 500, size=17)]


def bits(values) -> list[bytes]:
    return [struct.pack("<f", v) for v in values]


def quantize_experts(case, out: Path, seed: int = 5) -> torch.nn.Module:
    """``case``'s checkpoint with every expert matrix replaced by random MXFP4 blocks and
    scales, written to ``out``; returns the transformers model holding their widened values."""
    model = copy.deepcopy(case.model)
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    state = load_file(case.path / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        for part in PARTS:
            param = getattr(experts, part)  # [experts, in, out]
            e, in_dim, out_dim = param.shape
            blocks = torch.randint(0, 256, (e, out_dim, in_dim // 32, 16), generator=gen)
            # Scales 2^-6 .. 2^-4: weights up to 6/16, like the random model's.
            scales = torch.randint(127 - 6, 127 - 3, (e, out_dim, in_dim // 32), generator=gen)
            blocks, scales = blocks.to(torch.uint8), scales.to(torch.uint8)
            widened = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            assert widened.shape == param.shape
            with torch.no_grad():
                param.copy_(widened)
            name = f"model.layers.{i}.mlp.experts.{part}"
            del state[name]
            state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
    out.mkdir(parents=True)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((case.path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer(case.path, out)
    return model


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)


def test_mxfp4_experts_widen_to_the_same_model(model_zoo, tmp_path: Path) -> None:
    case = model_zoo.get("gpt_oss")
    model = quantize_experts(case, tmp_path / "mxfp4")
    widened = tmp_path / "widened"
    model.save_pretrained(widened)
    copy_tokenizer(case.path, widened)
    packed = detspec.LLM(str(tmp_path / "mxfp4"), num_kv_pages=256)
    seqs = [TARGET_PROMPT, TARGET_PROMPT[:9]]
    for seq, got in zip(seqs, packed.compute_logits(seqs), strict=True):
        ref = hf_logits(model, seq)
        assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    # The widened checkpoint is the same model: the fingerprint and every bit.
    plain = detspec.LLM(str(widened), num_kv_pages=256)
    assert packed.fingerprint == plain.fingerprint
    target = target_params(0.8)
    a = fingerprint_bits(packed.generate([TARGET_PROMPT], target, use_tqdm=False)[0])
    b = fingerprint_bits(plain.generate([TARGET_PROMPT], target, use_tqdm=False)[0])
    assert a == b
    # Negative control: the model before quantization is another model.
    assert detspec.LLM(str(case.path)).fingerprint != packed.fingerprint
    # In bf16 too, and in the bf16-activation mode, whose GEMM widens the kept experts' panels
    # to bf16 as it multiplies (bf16 by bf16).
    for kwargs in ({"dtype": "bfloat16"}, {"dtype": "bfloat16", "activation_dtype": "bfloat16"}):
        a, b = (
            detspec.LLM(str(d), num_kv_pages=256, **kwargs) for d in (tmp_path / "mxfp4", widened)
        )
        assert a.fingerprint == b.fingerprint, kwargs
        out = [
            fingerprint_bits(x.generate([TARGET_PROMPT], target, use_tqdm=False)[0]) for x in (a, b)
        ]
        assert out[0] == out[1], kwargs


def test_mxfp4_errors_name_the_tensor_or_field(model_zoo, tmp_path: Path) -> None:
    case = model_zoo.get("gpt_oss")
    quantize_experts(case, tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    state = load_file(path)
    name = "model.layers.1.mlp.experts.down_proj_scales"
    state[name] = state[name][:, :-1].contiguous()
    save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")):
        detspec.LLM(str(tmp_path / "m"))
    # Another quantization method is refused at the config, naming it.
    config = json.loads((case.path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    other = tmp_path / "awq"
    shutil.copytree(case.path, other)
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="quant_method"):
        detspec.LLM(str(other))


def test_update_by_stacked_expert_names_follows_transformers(model_zoo, tmp_path: Path) -> None:
    """A trainer's ``state_dict()`` of gpt-oss names its experts as its checkpoints do
    (``mlp.experts.gate_up_proj`` ``[experts, hidden, 2 × width]``, gate and up columns
    alternating; biases; sinks): it turns model a into model b, fingerprint and bits, and back."""
    case = model_zoo.get("gpt_oss")
    spec = {**MODEL_SPECS["gpt_oss"], "seed": 113}
    model_b = save_model_dir(build_hf_model(spec), spec, tmp_path / "b", case.path)
    ref = detspec.LLM(str(tmp_path / "b"), num_kv_pages=256)
    llm = detspec.LLM(str(case.path), num_kv_pages=256)
    fp_a, target = llm.fingerprint, target_params(0.8)
    want_a = fingerprint_bits(llm.generate([TARGET_PROMPT], target, use_tqdm=False)[0])
    want_b = fingerprint_bits(ref.generate([TARGET_PROMPT], target, use_tqdm=False)[0])
    state = model_b.state_dict()
    assert tuple(state["model.layers.0.mlp.experts.gate_up_proj"].shape) == (8, 64, 256)
    assert "model.layers.0.self_attn.sinks" in state
    llm.update_weights(state.items())
    assert llm.fingerprint == ref.fingerprint != fp_a
    assert fingerprint_bits(llm.generate([TARGET_PROMPT], target, use_tqdm=False)[0]) == want_b
    llm.update_weights(case.model.state_dict().items())
    assert llm.fingerprint == fp_a
    assert fingerprint_bits(llm.generate([TARGET_PROMPT], target, use_tqdm=False)[0]) == want_a
    # The sinks alone move the output; a stacked tensor of the wrong shape is refused by name.
    sinks = "model.layers.1.self_attn.sinks"
    llm.update_weights([(sinks, state[sinks] + 3.0)])
    assert llm.fingerprint != fp_a
    bad = "model.layers.0.mlp.experts.down_proj"
    with pytest.raises(InvalidRequestError, match=bad.replace(".", r"\.")):
        llm.update_weights([(bad, torch.zeros(8, 64, 128))])
