"""FP8 checkpoints: linear weights stored as E4M3 codes beside scales, in transformers' ``fp8``
format (DeepSeek-V3 / Qwen3-FP8: 128 × 128 blocks; Ministral 3: a scale per matrix) and
compressed-tensors' (``FP8_DYNAMIC``: a scale per output channel).

detspec widens them at load: a weight is its code's value times its block's scale, one f32
multiplication, as torch's ``codes.float() * scale``. So an FP8 checkpoint is the same model,
bit for bit and by fingerprint, as the checkpoint of its widened weights, which holds it to
transformers through the parity suite; here it is also compared with transformers directly.
The checkpoints are written here from the zoo's models, quantized as llm-compressor and
DeepSeek's scripts do (a block's scale is its largest magnitude over 448, E4M3's largest).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

# isort: split
from conftest import hf_logits
from test_determinism import fingerprint_bits, target_params

import detspec
from detspec import ModelLoadError

E4M3_MAX = 448.0
TARGET_PROMPT = [int(x) for x in np.random.default_rng(1).integers(3, 500, size=19)]

# Each format: its quantization_config, the scales' name after the weight's, the block
# ([rows, cols]; None: the whole dimension) and the dtype the scales are stored in.
FORMATS = {
    # Ragged on the zoo's 64-wide matrices: the last column block is cut short.
    "fp8_block": (
        {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [32, 48],
        },
        "_scale_inv",
        (32, 48),
        torch.float32,
    ),
    "fp8_tensor": (
        {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None},
        "_scale_inv",
        (None, None),
        torch.float32,
    ),
    "compressed_channel": (
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "channel",
                        "symmetric": True,
                        "dynamic": False,
                    },
                    "input_activations": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "token",
                        "dynamic": True,
                    },
                }
            },
            "ignore": ["lm_head"],
        },
        "_scale",
        (1, None),
        torch.bfloat16,
    ),
}


def quantized_names(state: dict[str, torch.Tensor]) -> list[str]:
    """The decoder layers' linear weights, as FP8 checkpoints quantize them (routers, norms,
    embeddings and the LM head stay as they are)."""
    return [
        n
        for n, t in state.items()
        if n.startswith("model.layers.")
        and n.endswith(".weight")
        and t.dim() == 2
        and not n.endswith("mlp.gate.weight")
    ]


def quantize(
    w: torch.Tensor, block, scale_dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """E4M3 codes and scales of ``w`` (``[rows, cols]``) in blocks of ``block``, and the widened
    weight they stand for (``codes.float() * scale``, each block's scale as stored)."""
    rows, cols = w.shape
    br, bc = block[0] or rows, block[1] or cols
    nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
    padded = torch.zeros(nr * br, nc * bc)
    padded[:rows, :cols] = w.float()
    amax = padded.abs().view(nr, br, nc, bc).amax(dim=(1, 3))
    scales = (amax / E4M3_MAX).clamp(min=1e-12).to(scale_dtype)
    spread = scales.float().repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]
    codes = (w.float() / spread).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scales, codes.float() * spread


def write_fp8(case, fmt: str, out: Path) -> Path:
    """``case``'s checkpoint quantized in ``fmt`` to ``out``; its widened twin (same config
    without the quantization, the widened weights in f32) beside it, returned."""
    quant, suffix, block, scale_dtype = FORMATS[fmt]
    state = load_file(case.path / "model.safetensors")
    widened = dict(state)
    for name in quantized_names(state):
        codes, scales, wide = quantize(state[name], block, scale_dtype)
        state[name] = codes
        if block == (None, None):
            scales = scales.reshape(())  # transformers' one scale per matrix: a scalar
        state[f"{name}{suffix}"] = scales
        widened[name] = wide
    config = json.loads((case.path / "config.json").read_text())
    twin = out.with_name(out.name + "-widened")
    for d, tensors, cfg in (
        (out, state, {**config, "quantization_config": quant}),
        (twin, widened, config),
    ):
        d.mkdir(parents=True)
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(case.path / f, d / f)
    return twin


def generated(llm: detspec.LLM):
    return fingerprint_bits(llm.generate([TARGET_PROMPT], target_params(0.8), use_tqdm=False)[0])


@pytest.mark.parametrize(
    "case_name, fmt",
    [
        ("llama", "fp8_block"),
        ("llama", "fp8_tensor"),
        ("llama", "compressed_channel"),
        ("qwen3_moe", "fp8_block"),  # every expert's matrices
        ("glm4_moe", "fp8_block"),  # GLM-4.5-FP8's form: experts in FP8, the f32 router not
        ("deepseek_v3", "fp8_block"),  # DeepSeek-V3's own release format, latent attention too
        ("minimax_m2", "fp8_block"),  # MiniMax-M2's release: Mixtral-named experts in FP8
        ("phi3", "compressed_channel"),  # q/k/v and gate/up stored fused
    ],
)
def test_fp8_checkpoint_is_its_widened_checkpoint(model_zoo, tmp_path: Path, case_name, fmt):
    case = model_zoo.get(case_name)
    fp8_dir = tmp_path / "fp8"
    twin = write_fp8(case, fmt, fp8_dir)
    fp8 = detspec.LLM(str(fp8_dir), num_kv_pages=256)
    plain = detspec.LLM(str(twin), num_kv_pages=256)
    # The same model: the fingerprint and every bit of a deterministic sampled request.
    assert fp8.fingerprint == plain.fingerprint
    assert generated(fp8) == generated(plain)
    # ... which is transformers' model of the widened weights.
    reference = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32)
    seqs = [TARGET_PROMPT, TARGET_PROMPT[:7]]
    for seq, got in zip(seqs, fp8.compute_logits(seqs), strict=True):
        ref = hf_logits(reference, seq)
        assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    # Negative control: the model before quantization is another model.
    original = detspec.LLM(str(case.path), num_kv_pages=256)
    assert original.fingerprint != fp8.fingerprint
    assert generated(original)[1] != generated(fp8)[1]


def test_fp8_in_bfloat16_is_its_widened_checkpoint_rounded(model_zoo, tmp_path: Path):
    """In bf16 (and the bf16-activation mode) the widened weights are rounded to bf16, as
    loading the f32 twin in bf16 rounds them."""
    twin = write_fp8(model_zoo.get("llama"), "fp8_block", tmp_path / "fp8")
    for kwargs in ({"dtype": "bfloat16"}, {"dtype": "bfloat16", "activation_dtype": "bfloat16"}):
        a, b = (detspec.LLM(str(d), num_kv_pages=256, **kwargs) for d in (tmp_path / "fp8", twin))
        assert a.fingerprint == b.fingerprint, kwargs
        assert generated(a) == generated(b), kwargs


def test_fp8_errors_name_the_tensor(model_zoo, tmp_path: Path):
    case = model_zoo.get("llama")
    src = tmp_path / "fp8"
    write_fp8(case, "fp8_block", src)
    name = "model.layers.1.mlp.down_proj.weight"

    def broken(label: str, edit) -> Path:
        d = tmp_path / label
        shutil.copytree(src, d)
        state = load_file(d / "model.safetensors")
        edit(state)
        save_file(state, d / "model.safetensors", metadata={"format": "pt"})
        return d

    def codes_with_nan(state):
        bits = state[name].view(torch.uint8).clone()
        bits[3, 5] = 0x7F  # E4M3's NaN
        state[name] = bits.view(torch.float8_e4m3fn)

    cases = [
        (lambda s: s.pop(f"{name}_scale_inv"), rf"{name}_scale_inv"),
        (
            lambda s: s.update({f"{name}_scale_inv": s[f"{name}_scale_inv"][:, :1].contiguous()}),
            r"scales of",
        ),
        (codes_with_nan, r"weight \[3, 5\] is not a number"),
    ]
    for i, (edit, message) in enumerate(cases):
        d = broken(f"broken{i}", edit)
        with pytest.raises(ModelLoadError, match=message) as info:
            detspec.LLM(str(d))
        assert "down_proj" in str(info.value)
    # FP8 tensors in a checkpoint whose config does not declare them: the tensor is named.
    d = tmp_path / "undeclared"
    shutil.copytree(src, d)
    config = json.loads((d / "config.json").read_text())
    del config["quantization_config"]
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"F8_E4M3"):
        detspec.LLM(str(d))


def test_updates_take_unquantized_weights_and_refuse_fp8_ones(model_zoo, tmp_path: Path):
    """A trainer's unquantized weights replace the kept FP8 matrices (here the widened values
    themselves: the fingerprint stays); an FP8 checkpoint as an update is refused, naming its
    tensor's dtype, and the engine keeps serving the weights it had."""
    twin = write_fp8(model_zoo.get("llama"), "fp8_block", tmp_path / "fp8")
    llm = detspec.LLM(str(tmp_path / "fp8"), num_kv_pages=256)
    before, out = llm.fingerprint, generated(llm)
    with pytest.raises(detspec.DetspecError, match="F8_E4M3"):
        llm.update_weights_from_disk(tmp_path / "fp8")
    assert llm.fingerprint == before and generated(llm) == out
    llm.update_weights_from_disk(twin)
    assert llm.fingerprint == before and generated(llm) == out
    # The negative control: other weights move the fingerprint.
    llm.update_weights_from_disk(model_zoo.get("llama").path)
    assert llm.fingerprint != before
