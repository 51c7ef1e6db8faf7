"""Nemotron-H's two spellings: the hub's files (NVIDIA's configs and `backbone.` tensor names)
and transformers 5's (`layers_block_type`, `model.` names) are one model, bit for bit, for
loading, updates and the fingerprint; what it does not run is refused, naming the field.

Parity with transformers, the needle test, updates following transformers and the recurrent
state's tests run it as a zoo model (`nemotron_h` in conftest's specs)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import detspec
from detspec import SamplingParams

PROMPTS = [[5, 9, 14, 3, 27, 8, 40, 11, 2 + i] for i in range(3)] + [list(range(3, 40))]
PATTERN = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}


def greedy_bits(llm: detspec.LLM) -> list[tuple[list[int], list[int]]]:
    """Token ids and logprob bits of deterministic greedy requests."""
    sp = SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0, deterministic=True
    )
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    return [
        (
            list(o.outputs[0].token_ids),
            np.asarray(o.outputs[0].token_logprobs, np.float32).view(np.uint32).tolist(),
        )
        for o in outs
    ]


def hub_spelling(model_dir: Path, out: Path) -> Path:
    """``model_dir``'s checkpoint as the hub's Nemotron-H files spell it: `backbone.` names,
    the layer kinds as `hybrid_override_pattern`, the Mamba2 fields' older names."""
    shutil.copytree(model_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["hybrid_override_pattern"] = "".join(PATTERN[k] for k in cfg.pop("layers_block_type"))
    cfg["num_hidden_layers"] = len(cfg["hybrid_override_pattern"])
    cfg["mamba_n_groups"] = cfg.pop("n_groups")
    cfg["mamba_d_conv"] = cfg.pop("conv_kernel")
    cfg["time_step_limit"] = [0.0, float("inf")]
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(out / "model.safetensors")
    renamed = {
        name.replace("model.", "backbone.", 1) if name.startswith("model.") else name: t
        for name, t in tensors.items()
    }
    assert any(n.startswith("backbone.") for n in renamed)
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def spellings(model_zoo, tmp_path_factory):
    case = model_zoo.get("nemotron_h")
    hub = hub_spelling(case.path, tmp_path_factory.mktemp("nemotron_h") / "hub")
    return case, hub


def test_the_hub_spelling_is_the_same_model_bit_for_bit(spellings):
    case, hub = spellings
    ours = detspec.LLM(str(case.path), num_kv_pages=256)
    theirs = detspec.LLM(str(hub), num_kv_pages=256)
    assert theirs.fingerprint == ours.fingerprint
    assert greedy_bits(theirs) == greedy_bits(ours)


def test_updates_by_either_spelling_are_one_update(spellings):
    case, hub = spellings
    g = torch.Generator().manual_seed(7)
    new = {
        k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in case.model.state_dict().items()
    }
    by_module = detspec.LLM(str(case.path), num_kv_pages=256)
    by_file = detspec.LLM(str(hub), num_kv_pages=256)
    fp0, before = by_module.fingerprint, greedy_bits(by_module)
    by_module.update_weights(new)
    by_file.update_weights({k.replace("model.", "backbone.", 1): v for k, v in new.items()})
    assert by_module.fingerprint == by_file.fingerprint != fp0
    assert greedy_bits(by_module) == greedy_bits(by_file) != before
    # The hub's files as an update from disk restore the original weights.
    by_module.update_weights_from_disk(hub)
    assert by_module.fingerprint == fp0 and greedy_bits(by_module) == before


@pytest.mark.parametrize(
    "change, field",
    [
        ({"layers_block_type": ["linear_attention", "moe"]}, "layers_block_type"),
        ({"layers_block_type": ["linear_attention", "mamba2"]}, "layers_block_type"),
        ({"time_step_limit": [0.001, 0.1]}, "time_step_limit"),
        ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act"),
        ({"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
    ],
)
def test_what_it_does_not_run_is_refused_naming_the_field(spellings, tmp_path, change, field):
    case, _ = spellings
    bad = tmp_path / "bad"
    shutil.copytree(case.path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(change)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(detspec.DetspecError, match=field):
        detspec.LLM(str(bad), num_kv_pages=64)
