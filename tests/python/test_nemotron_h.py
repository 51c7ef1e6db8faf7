"""Nemotron-H's two spellings: the hub's files (`backbone.` tensor names, each expert's
matrices apart; NVIDIA's configs) and transformers 5's in-memory form (`model.` names, each
layer's experts stacked; `layers_block_type`) are one model, bit for bit, for loading, updates
and the fingerprint; what it does not run is refused, naming the field.

Parity with transformers, the needle test, updates following transformers and the recurrent
state's tests run it as zoo models (`nemotron_h`, `nemotron_h_moe` in conftest's specs)."""

from __future__ import annotations

import copy
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


def other_spelling(case, out: Path) -> Path:
    """``case``'s checkpoint spelled the other way: transformers saves the hub's spelling
    (`backbone.` names, each expert's matrices apart); this writes its ``state_dict()``'s
    (`model.` names, each layer's experts stacked), with the hub config's
    `hybrid_override_pattern` and the Mamba2 fields' older names."""
    shutil.copytree(case.path, out)
    on_file = load_file(out / "model.safetensors")
    assert any(n.startswith("backbone.") for n in on_file)
    state = {k: v.contiguous() for k, v in case.model.state_dict().items()}
    assert not any(n.startswith("backbone.") for n in state)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["hybrid_override_pattern"] = "".join(PATTERN[k] for k in cfg.pop("layers_block_type"))
    cfg["num_hidden_layers"] = len(cfg["hybrid_override_pattern"])
    cfg["mamba_n_groups"] = cfg.pop("n_groups")
    cfg["mamba_d_conv"] = cfg.pop("conv_kernel")
    cfg["time_step_limit"] = [0.0, float("inf")]  # Python's `Infinity`, as hub configs have it
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module", params=["nemotron_h", "nemotron_h_moe"])
def spellings(request, model_zoo, tmp_path_factory):
    case = model_zoo.get(request.param)
    other = other_spelling(case, tmp_path_factory.mktemp(request.param) / "other")
    return case, other


def test_both_spellings_are_the_same_model_bit_for_bit(spellings):
    case, other = spellings
    ours = detspec.LLM(str(case.path), num_kv_pages=256)
    theirs = detspec.LLM(str(other), num_kv_pages=256)
    assert theirs.fingerprint == ours.fingerprint
    assert greedy_bits(theirs) == greedy_bits(ours)


def test_updates_by_either_spelling_are_one_update(spellings, tmp_path):
    case, other = spellings
    g = torch.Generator().manual_seed(7)
    new = {
        k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in case.model.state_dict().items()
    }
    by_module = detspec.LLM(str(case.path), num_kv_pages=256)
    by_file = detspec.LLM(str(other), num_kv_pages=256)
    fp0, before = by_module.fingerprint, greedy_bits(by_module)
    by_module.update_weights(new)
    # The hub's spelling of the same tensors, as transformers saves them.
    perturbed = copy.deepcopy(case.model)
    perturbed.load_state_dict(new)
    perturbed.save_pretrained(tmp_path / "saved")
    hub_names = load_file(tmp_path / "saved" / "model.safetensors")
    assert any(n.startswith("backbone.") for n in hub_names)
    by_file.update_weights(hub_names)
    assert by_module.fingerprint == by_file.fingerprint != fp0
    assert greedy_bits(by_module) == greedy_bits(by_file) != before
    # Either spelling's files as an update from disk restore the original weights (each
    # holds every parameter: the stacked experts stand for each expert's matrices).
    by_module.update_weights_from_disk(case.path, complete=True)
    by_file.update_weights_from_disk(other, complete=True)
    assert by_module.fingerprint == by_file.fingerprint == fp0
    assert greedy_bits(by_module) == greedy_bits(by_file) == before


@pytest.mark.parametrize(
    "change, field",
    [
        ({"moe_latent_size": 16}, "moe_latent_size"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"layers_block_type": ["linear_attention", "mamba2"]}, "layers_block_type"),
        ({"time_step_limit": [0.001, 0.1]}, "time_step_limit"),
        ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act"),
        ({"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
    ],
)
def test_what_it_does_not_run_is_refused_naming_the_field(model_zoo, tmp_path, change, field):
    case = model_zoo.get("nemotron_h_moe")
    bad = tmp_path / "bad"
    shutil.copytree(case.path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(change)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(detspec.DetspecError, match=field):
        detspec.LLM(str(bad), num_kv_pages=64)


@pytest.mark.parametrize("spelling", ["hub", "state_dict"])
def test_a_missing_tensor_is_named_as_its_checkpoint_spells_it(spellings, tmp_path, spelling):
    case, other = spellings
    source = case.path if spelling == "hub" else other
    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    tensors = load_file(broken / "model.safetensors")
    prefix = "backbone." if spelling == "hub" else "model."
    gone = f"{prefix}layers.0.mixer.in_proj.weight"
    del tensors[gone]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(detspec.DetspecError, match=f"missing tensor `{gone}`"):
        detspec.LLM(str(broken), num_kv_pages=64)
