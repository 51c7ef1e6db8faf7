"""A multimodal checkpoint serves its language model, text only: Gemma 3 4B/12B/27B
(``Gemma3ForConditionalGeneration``), Mistral Small 3.1/3.2 and Ministral 3
(``Mistral3ForConditionalGeneration``), Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4.1V,
GLM-4.5V/4.6V, LLaVA, InternVL 3.5 and LFM2-VL. Its config's language-model settings and its
weights under either spelling (the hub's, and transformers' module names) give the same model
as the text-only checkpoint of the same weights, bit for bit and under the same fingerprint,
and transformers' own text-only logits of the wrapper."""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import detspec
from detspec import LoRARequest, SamplingParams

# isort: split
from conftest import greedy_mismatch_message, hf_greedy

PROMPTS = [[5, 9, 13, 17, 21], list(range(3, 60, 2)), [200, 100, 50, 25, 12, 6, 3]]


def greedy_bits(llm: detspec.LLM) -> list[tuple[list[int], list[int]]]:
    """Token ids and logprob bits of deterministic greedy requests: the same whatever the
    engine ran before (the fast path's bits may move with its history)."""
    params = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0, deterministic=True
    )
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [
        (
            list(o.outputs[0].token_ids),
            np.asarray(o.outputs[0].token_logprobs, np.float32).view(np.uint32).tolist(),
        )
        for o in outs
    ]


TINY_VISION = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2}
# The Qwen VL vision towers' own spelling of it.
TINY_QWEN_VISION = {
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "out_hidden_size": 64,
}
# Gemma 3's and Mistral 3's saved spelling (the hub's) and transformers' module spelling,
# which checkpoints saved by transformers 4.52-4.57 use.
HUB_TO_MODULES = {
    "language_model.model.": "model.language_model.",
    "vision_tower.": "model.vision_tower.",
    "multi_modal_projector.": "model.multi_modal_projector.",
    "language_model.lm_head.": "lm_head.",
    "lm_head.": "lm_head.",
}

# zoo text model (or `TEXT_MODEL`'s key) -> (wrapper config class, wrapper class, its own
# settings, the rope settings its language model needs, the other spelling of each saved
# prefix): a tiny vision tower each. The wrappers with untied text models untie the LM head
# as their checkpoints do (the wrapper's own default would tie it).
WRAPPERS = {
    "gemma3": (
        "Gemma3Config",
        "Gemma3ForConditionalGeneration",
        {
            "vision_config": {
                **TINY_VISION,
                "num_hidden_layers": 1,
                "image_size": 28,
                "patch_size": 14,
            },
            "mm_tokens_per_image": 4,
        },
        {},
        HUB_TO_MODULES,
    ),
    # Mistral Small 3.1/3.2: Mistral's layers; Ministral 3: its own, with YaRN and queries
    # scaled past the original context.
    **{
        name: (
            "Mistral3Config",
            "Mistral3ForConditionalGeneration",
            {
                "vision_config": {
                    **TINY_VISION,
                    "num_hidden_layers": 1,
                    "head_dim": 8,
                    "image_size": 32,
                    "patch_size": 16,
                },
                "spatial_merge_size": 1,
                "tie_word_embeddings": False,
            },
            {},
            HUB_TO_MODULES,
        )
        for name in ("mistral", "ministral3")
    },
    # GLM-4.1V-Thinking (GLM-4-0414's layers) and GLM-4.5V / 4.6V (GLM-4.5's, without q/k
    # norms) under their multimodal rope (the plain one on text: GLM-4's neighbour pairs, and
    # GLM-4.5's halves, on half of each head); saved as transformers' modules spell them,
    # respelt as a text checkpoint's names beside a `visual.*` tower.
    **{
        name: (
            config_class,
            model_class,
            {
                "vision_config": {
                    "depth": 1,
                    "hidden_size": 16,
                    "intermediate_size": 32,
                    "num_heads": 2,
                    "out_hidden_size": 64,
                    "patch_size": 4,
                    "spatial_merge_size": 1,
                    "temporal_patch_size": 1,
                    "image_size": 16,
                },
                "tie_word_embeddings": False,
            },
            {"mrope_section": section},
            {"model.language_model.": "model.", "model.visual.": "visual.", "lm_head.": "lm_head."},
        )
        for name, config_class, model_class, section in [
            ("glm4", "Glm4vConfig", "Glm4vForConditionalGeneration", [2, 1, 1]),
            ("glm4_moe_plain", "Glm4vMoeConfig", "Glm4vMoeForConditionalGeneration", [2, 3, 3]),
        ]
    },
    # Qwen2-VL: Qwen2's layers under the multimodal rope, saved flat as the hub spells it.
    "qwen2_vl": (
        "Qwen2VLConfig",
        "Qwen2VLForConditionalGeneration",
        {
            "vision_config": {
                "depth": 1,
                "embed_dim": 16,
                "hidden_size": 64,
                "num_heads": 2,
                "mlp_ratio": 2,
                "patch_size": 4,
                "spatial_merge_size": 1,
                "temporal_patch_size": 1,
            },
            "tie_word_embeddings": False,
        },
        {"mrope_section": [2, 3, 3]},
        {"model.": "model.language_model.", "visual.": "model.visual.", "lm_head.": "lm_head."},
    ),
    # LLaVA (Llama's layers under a CLIP tower) and InternVL 3.5 (Qwen3's under its own):
    # saved as the hub spells them.
    "llava": (
        "LlavaConfig",
        "LlavaForConditionalGeneration",
        {
            "vision_config": {
                **TINY_VISION,
                "model_type": "clip_vision_model",
                "num_hidden_layers": 1,
                "image_size": 16,
                "patch_size": 4,
                "projection_dim": 16,
            },
            "tie_word_embeddings": False,
        },
        {},
        HUB_TO_MODULES,
    ),
    "internvl": (
        "InternVLConfig",
        "InternVLForConditionalGeneration",
        {
            "vision_config": {
                **TINY_VISION,
                "num_hidden_layers": 1,
                "image_size": [16, 16],
                "patch_size": [4, 4],
            },
            "tie_word_embeddings": False,
        },
        {},
        HUB_TO_MODULES,
    ),
    # LFM2-VL: LFM2's layers (short convolutions) beside a SigLIP2 tower; saved as
    # transformers' modules spell it, respelt as the hub's older wrappers spell theirs.
    "lfm2": (
        "Lfm2VlConfig",
        "Lfm2VlForConditionalGeneration",
        {
            "vision_config": {
                **TINY_VISION,
                "num_hidden_layers": 1,
                "num_patches": 16,
                "patch_size": 4,
            },
            "projector_hidden_size": 32,
        },
        {},
        {v: k for k, v in HUB_TO_MODULES.items() if k != "lm_head."},
    ),
    # Qwen2.5-VL: Qwen2's layers under the multimodal rope (the plain one on text); saved as
    # the hub spells it (`model.layers.*`, `visual.*`), respelt as transformers' modules.
    "qwen2": (
        "Qwen2_5_VLConfig",
        "Qwen2_5_VLForConditionalGeneration",
        {
            "vision_config": {**TINY_QWEN_VISION, "fullatt_block_indexes": [0]},
            "tie_word_embeddings": False,
        },
        {"mrope_section": [2, 3, 3]},
        {"model.": "model.language_model.", "visual.": "model.visual.", "lm_head.": "lm_head."},
    ),
    # Qwen3-VL: Qwen3's layers under the interleaved multimodal rope; saved as transformers'
    # modules spell it, respelt as a text checkpoint's names beside Qwen2.5-VL's `visual.*`.
    "qwen3": (
        "Qwen3VLConfig",
        "Qwen3VLForConditionalGeneration",
        {
            "vision_config": {
                **TINY_QWEN_VISION,
                "deepstack_visual_indexes": [0],
                "num_position_embeddings": 16,
            },
            "tie_word_embeddings": False,
        },
        {"mrope_section": [4, 6, 6], "mrope_interleaved": True},
        {"model.language_model.": "model.", "model.visual.": "visual.", "lm_head.": "lm_head."},
    ),
    # Qwen3.5: its DeltaNets and gated attention; a quarter of each 32-wide head rotates.
    "qwen3_5": (
        "Qwen3_5Config",
        "Qwen3_5ForConditionalGeneration",
        {
            "vision_config": {**TINY_QWEN_VISION, "num_position_embeddings": 16},
            "tie_word_embeddings": False,
        },
        {"mrope_section": [2, 1, 1], "mrope_interleaved": True},
        {"model.language_model.": "model.", "model.visual.": "visual.", "lm_head.": "lm_head."},
    ),
    # Qwen3.5-MoE: the same wrapper over Qwen3.5's layers with experts.
    "qwen3_5_moe": (
        "Qwen3_5MoeConfig",
        "Qwen3_5MoeForConditionalGeneration",
        {
            "vision_config": {**TINY_QWEN_VISION, "num_position_embeddings": 16},
            "tie_word_embeddings": False,
        },
        {"mrope_section": [2, 1, 1], "mrope_interleaved": True},
        {"model.language_model.": "model.", "model.visual.": "visual.", "lm_head.": "lm_head."},
    ),
}


# The zoo text model of the wrappers not named after theirs.
TEXT_MODEL = {"qwen2_vl": "qwen2", "llava": "llama", "internvl": "qwen3"}


@pytest.fixture(scope="module", params=list(WRAPPERS))
def wrapped(request, model_zoo, tmp_path_factory):
    """A zoo text model inside its multimodal wrapper with a tiny vision tower, saved in both
    spellings."""
    text = model_zoo.get(TEXT_MODEL.get(request.param, request.param))
    config_class, model_class, settings, rope, respell = WRAPPERS[request.param]
    text_config = text.model.config.to_dict()
    text_config["rope_parameters"] = {**text_config["rope_parameters"], **rope}
    config = getattr(transformers, config_class)(text_config=text_config, **settings)
    torch.manual_seed(0)
    vlm = getattr(transformers, model_class)(config).eval()
    vlm.model.language_model.load_state_dict(text.model.model.state_dict())
    if not text.model.config.tie_word_embeddings:
        vlm.lm_head.load_state_dict(text.model.lm_head.state_dict())
    root = tmp_path_factory.mktemp(f"{request.param}_vlm")
    new, old = root / "new", root / "old"
    vlm.save_pretrained(old)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(text.path / name, old / name)
    shutil.copytree(old, new)
    tensors = load_file(old / "model.safetensors")
    renamed = {}
    for name, t in tensors.items():
        prefix = next(p for p in respell if name.startswith(p))
        renamed[respell[prefix] + name[len(prefix) :]] = t
    assert set(renamed) != set(tensors), "the respelling changed no name"
    save_file(renamed, new / "model.safetensors", metadata={"format": "pt"})
    return text, vlm, new, old


def test_both_spellings_are_the_text_checkpoint_bit_for_bit(wrapped):
    text, vlm, new, old = wrapped
    cfg = json.loads((new / "config.json").read_text())
    assert cfg["architectures"] == [type(vlm).__name__] and "text_config" in cfg
    reference = detspec.LLM(str(text.path), num_kv_pages=256)
    want = greedy_bits(reference)
    for path in (new, old):
        llm = detspec.LLM(str(path), num_kv_pages=256)
        assert llm.fingerprint == reference.fingerprint, path.name
        assert greedy_bits(llm) == want, path.name


def test_the_wrapper_matches_transformers_text_only_logits(wrapped):
    _, vlm, new, _ = wrapped
    llm = detspec.LLM(str(new), num_kv_pages=256)
    for seq, got in zip(PROMPTS, llm.compute_logits(PROMPTS), strict=True):
        with torch.no_grad():
            ref = vlm(torch.tensor([seq])).logits[0].float().numpy()
        assert float(np.abs(got - ref).max()) <= 1e-4 * float(np.abs(ref).max())


def test_updates_take_the_wrappers_names_and_refuse_its_vision_tower(wrapped):
    text, vlm, new, _ = wrapped
    llm = detspec.LLM(str(new), num_kv_pages=256)
    fp0, before = llm.fingerprint, greedy_bits(llm)
    with pytest.raises(detspec.InvalidRequestError, match="language model only"):
        llm.update_weights(vlm.state_dict())
    assert llm.fingerprint == fp0 and greedy_bits(llm) == before
    # The language model's half of the wrapper's state_dict, perturbed: the same update as
    # the text model's names give the text-only checkpoint.
    g = torch.Generator().manual_seed(5)
    language = {
        k: v + 0.05 * torch.randn(v.shape, generator=g)
        for k, v in vlm.state_dict().items()
        if k.startswith("model.language_model.")
    }
    llm.update_weights(language)
    plain = detspec.LLM(str(text.path), num_kv_pages=256)
    plain.update_weights(
        {k.replace("model.language_model.", "model.", 1): v for k, v in language.items()}
    )
    assert llm.fingerprint == plain.fingerprint != fp0
    assert greedy_bits(llm) == greedy_bits(plain)


def test_a_peft_adapter_of_the_wrapper_adapts_its_language_model(wrapped, tmp_path):
    """PEFT names the wrapper's modules `model.language_model.layers.N…`, and the targets match
    the vision tower's attention too: those pairs never meet text, so they are left out."""
    peft = pytest.importorskip("peft")
    text, vlm, new, _ = wrapped
    # `qkv`: the Qwen VL vision towers' fused attention, which no language model has. On a
    # mixture of experts PEFT's `down_proj` would also reach the experts' fused tensor, whose
    # (and Qwen's shared expert's) adapters are refused (test_lora.py): there the adapter is of
    # the attention only.
    targets = ["q_proj", "v_proj", "down_proj", "qkv"]
    if any(text.model.config.to_dict().get(k) for k in ("n_routed_experts", "num_experts")):
        targets.remove("down_proj")
    torch.manual_seed(9)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    ref = peft.get_peft_model(copy.deepcopy(vlm), cfg).eval()
    ref.save_pretrained(tmp_path / "adapter")
    names = list(load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert any("language_model.layers.1.self_attn.v_proj.lora_B" in n for n in names)
    assert any("vision_tower" in n or "visual" in n for n in names)
    llm = detspec.LLM(str(new), num_kv_pages=256, enable_lora=True)
    adapter = LoRARequest("vlm", 1, str(tmp_path / "adapter"))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, deterministic=True)
    outs = llm.generate(PROMPTS, params, lora_request=adapter, use_tqdm=False)
    moved = 0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        want = hf_greedy(ref, prompt, 8)
        moved += want.tokens != hf_greedy(vlm, prompt, 8).tokens
        got = list(out.outputs[0].token_ids)
        msg = greedy_mismatch_message(prompt, got, want, f"[{type(vlm).__name__} + lora]")
        assert msg is None, msg
    assert moved > 0  # the adapter changes what the model says
