"""Shared fixtures for the detspec Python tests.

Everything is built offline, once per session, under ``tmp_path_factory``:

* a tiny byte-level BPE tokenizer trained with ``tokenizers`` on an embedded corpus
  (``tokenizer.json`` + ``tokenizer_config.json`` with bos/eos and a ChatML template);
* tiny random float32 models built with ``transformers`` (one per architecture and
  config variant, see ``MODEL_SPECS``), each saved with ``save_pretrained`` together
  with the tokenizer files;
* HF reference helpers (``hf_logits``, ``hf_greedy``) that run the in-memory HF model
  eagerly in float32 without any KV cache, so EOS never ends a reference early.

Test modules reach the models through fixtures (``model_zoo``, ``arch_case``,
``llm_factory``, ``copy_model_dir``); the helpers below are plain functions so a
throwaway script can import this file and exercise them without detspec built.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()
# The HF reference models are tiny: one thread is fastest and does not fight detspec's
# worker threads (several torch threads spin and crawl on a busy 2-core machine).
torch.set_num_threads(1)

# --------------------------------------------------------------------------- constants

VOCAB_SIZE = 512  # model vocab; the tokenizer has ~400 entries (padded like real models)
TOKENIZER_VOCAB = 400
MAX_POSITION_EMBEDDINGS = 256
BOS_ID = 0  # "<s>"  (special tokens are the first ids of the trained vocab)
EOS_ID = 1  # "</s>"
PROMPT_LENGTHS = (1, 7, 23, 61)
NEW_TOKENS = 32
PROMPT_SEED = 20240607

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = """\
The old lighthouse stood at the end of a narrow spit of rock, and every evening the \
keeper climbed the spiral stairs to light the lamp. Ships passing in the night would see \
the beam sweep across the water, and the sailors knew that they were close to home. The \
keeper kept a small notebook in which he wrote the weather, the number of ships, and the \
names of the birds that rested on the railing.

In the village below, the bakers started work long before sunrise. They mixed flour, \
water, salt and yeast in large wooden bowls, and the smell of fresh bread drifted down \
the streets. Children on their way to school would stop at the window and count the \
loaves cooling on the racks. On market days the square filled with stalls selling fish, \
cheese, apples, honey, wool and painted pottery.

A computer program is a list of instructions that a machine follows one step at a time. \
Programs read input, compute results and write output. A good program is easy to read, \
easy to test and easy to change. When a test fails, the programmer reads the message, \
finds the line at fault and fixes the bug. Small, fast tests that run every time the \
code changes are the best way to keep a large program correct.

The river wound through the valley between green hills and tall pine forests. In spring \
the water rose with melting snow, and in summer it slowed to a gentle stream where \
families came to swim and fish. Herons waited patiently in the shallows, and at dusk the \
frogs began their evening chorus. Travellers who followed the river path reached the sea \
after three days of walking.

Once upon a time, in a small village by the sea, there lived a girl who wanted to build \
a boat. She gathered wood from the beach, borrowed tools from her uncle and worked every \
afternoon after her lessons. The neighbours laughed at first, but when the boat was \
finished and floated on the morning tide, the whole village came down to the harbour to \
cheer. The quick brown fox jumps over the lazy dog. Hello, world! How are you today?
"""

TEXT_PROMPTS = (
    "Hello",
    "The quick brown fox",
    "Once upon a time, in a small village by the sea,",
)

# name -> how to build it. "reuse" shares the HF model (and reference) of another entry.
# YaRN as DeepSeek-V2-Lite sets it (its mscale also scales the softmax), at this zoo's size.
DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}

# Qwen3.5's zoo layers: three gated DeltaNets (2 key heads, 4 value heads of 16) and one
# attention layer.
_QWEN3_5_LAYERS = {
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}


# Nemotron-H's zoo models' Mamba2 mixers: 4 heads of 16 in 2 groups, a state of 16. Their time
# steps stay above `time_step_min` (transformers 5.24 clamps them there in its whole-sequence
# form only; the configs' `time_step_limit` is unclamped).
NEMOTRON_H_MAMBA = {
    "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    "ssm_state_size": 16,
    "n_groups": 2,
    "conv_kernel": 4,
    "time_step_min": 1e-6,
}

MODEL_SPECS: dict[str, dict] = {
    "llama": {
        "arch": "llama",
        "seed": 17,
        "rope": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "llama3_scaled": {
        "arch": "llama",
        "seed": 5,
        "rope": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "llama_tied": {
        "arch": "llama",
        "seed": 11,
        "tie": True,
        "rope": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "mistral": {
        "arch": "mistral",
        "seed": 7,
        "rope": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    # Ministral 3: Mistral's layers under YaRN, queries scaled by 1 + 0.1 ln(1 + floor(pos / 64))
    # past the original context of 64 (the longer sequences cross it).
    "ministral3": {
        "arch": "ministral3",
        "seed": 103,
        "head_dim": 16,
        "rope": {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
        "extra": {"pad_token_id": 0},
    },
    "qwen2": {
        "arch": "qwen2",
        "seed": 19,
        "rope": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "qwen2_sharded": {"reuse": "qwen2", "max_shard_size": "100KB"},
    # YaRN (Qwen2.5's and Qwen3's long-context setting): at head_dim 32 and an original
    # context of 4,096, frequencies 0-4 stay, 5-12 blend, 13-15 are interpolated, and cos/sin
    # carry the attention factor 0.1 ln 4 + 1.
    "qwen2_yarn": {
        "arch": "qwen2",
        "seed": 31,
        "head_dim": 32,
        "rope": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 4096,
        },
    },
    # Phi-3 / Phi-4: q/k/v and gate/up stored fused; a sliding window shorter than the
    # longer prompts (Phi-3-mini-4k's is 2,047).
    "phi3": {
        "arch": "phi3",
        "seed": 41,
        "rope": {"rope_type": "default", "rope_theta": 10000.0},
        "extra": {"sliding_window": 24, "pad_token_id": 0},
    },
    # Phi-3.5-mini / Phi-3-mini-128k: LongRoPE, an original context of 128 stretched to 256,
    # one rescale factor per rotating pair in each of a short and a long set, cos/sin times
    # sqrt(1 + ln 2 / ln 128). Served with max_model_len = the original context, the engine
    # uses the short set, which is transformers' for every sequence that short (the long set:
    # test_longrope_long_factors_beyond_the_original_context).
    "phi3_longrope": {
        "arch": "phi3",
        "seed": 71,
        "rope": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.4, 1.7, 2.0],
            "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
        },
        "extra": {"pad_token_id": 0, "original_max_position_embeddings": 128},
        "llm_kwargs": {"max_model_len": 128},
    },
    # Phi-4-mini: LongRoPE on the first three quarters of each head (12 of 16 dimensions, 6
    # pairs), the last quarter passed through, tied embeddings, and its sliding window longer
    # than any sequence (262,144), which the engine drops.
    "phi4_mini": {
        "arch": "phi3",
        "seed": 73,
        "tie": True,
        "rope": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.05, 1.1, 1.3, 1.6, 2.0],
            "long_factor": [1.0, 2.0, 3.0, 5.0, 8.0, 13.0],
        },
        "extra": {
            "pad_token_id": 0,
            "original_max_position_embeddings": 128,
            "sliding_window": 262144,
        },
        "llm_kwargs": {"max_model_len": 128},
    },
    # GLM (glm-4-9b-chat-hf): Llama's layers with gate/up fused, q/k/v biases, and rope on
    # half of each head (8 of 16 dimensions) pairing neighbours. GLM-4-0414: the same, each
    # sublayer normed before and after.
    **{
        arch: {
            "arch": arch,
            "seed": seed,
            "head_dim": 16,
            "rope": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            "extra": {"pad_token_id": 0},
        }
        for arch, seed in (("glm", 83), ("glm4", 89))
    },
    # ERNIE 4.5 (0.3B): Llama's layers with neighbour-pair rope on whole heads, biases on every
    # projection (use_bias), tied embeddings.
    "ernie45": {
        "arch": "ernie45",
        "seed": 97,
        "tie": True,
        "head_dim": 16,
        "rope": {"rope_type": "default", "rope_theta": 500000.0},
        "extra": {"pad_token_id": 0, "use_bias": True},
    },
    # Seed-OSS: Llama's layers with q/k/v biases (on by default) and an o_proj bias by its own
    # switch (attention_out_bias, on here to load it).
    "seed_oss": {
        "arch": "seed_oss",
        "seed": 137,
        "head_dim": 16,
        "rope": {"rope_type": "default", "rope_theta": 10000000.0},
        "extra": {"attention_out_bias": True},
    },
    # EXAONE 4.0: OLMo 2's norms of the sublayers' outputs, q/k normed per head, one layer
    # within a window shorter than the longer prompts and one attending to every key without
    # rope.
    "exaone4": {
        "arch": "exaone4",
        "seed": 101,
        "head_dim": 16,
        "rope": {"rope_type": "default", "rope_theta": 1000000.0},
        "extra": {
            "pad_token_id": 0,
            "sliding_window": 24,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    },
    # OLMo 2: sublayer outputs normed before the residual add, q/k normed over the whole
    # projection.
    "olmo2": {
        "arch": "olmo2",
        "seed": 43,
        "rope": {"rope_type": "default", "rope_theta": 500000.0},
        "extra": {"pad_token_id": 0},
    },
    # OLMo 3: OLMo 2's layers, one sliding (a window shorter than the longer prompts) and one
    # attending to everything, each kind with its own rope (YaRN on the full layer).
    "olmo3": {
        "arch": "olmo3",
        "seed": 47,
        "rope": {
            "full_attention": {
                "rope_type": "yarn",
                "rope_theta": 500000.0,
                "factor": 4.0,
                "original_max_position_embeddings": MAX_POSITION_EMBEDDINGS // 4,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
        },
        "extra": {
            "pad_token_id": 0,
            "sliding_window": 24,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    },
    # Granite 3: Llama's layers with multipliers on the embeddings, the sublayers' outputs and
    # the attention scores, and the logits divided.
    "granite": {
        "arch": "granite",
        "seed": 53,
        "rope": {"rope_type": "default", "rope_theta": 10000.0},
        "extra": {
            "embedding_multiplier": 4.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.2,
            "logits_scaling": 2.0,
        },
    },
    # SmolLM3: Llama's layers, the second without rope.
    "smollm3": {
        "arch": "smollm3",
        "seed": 59,
        "rope": {"rope_type": "default", "rope_theta": 10000.0},
        "extra": {"pad_token_id": 0, "no_rope_layers": [1, 0]},
    },
    # Gemma 3: both norms around each sublayer (scaling by 1 + w), GeGLU, embeddings times
    # sqrt(hidden), attention scaled by query_pre_attn_scalar^-1/2 (24, not head_dim), one
    # sliding layer with plain rope and one full layer with linear scaling, tied embeddings.
    "gemma3": {
        "arch": "gemma3",
        "seed": 61,
        "tie": True,
        "head_dim": 32,
        "rope": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "extra": {
            "pad_token_id": 0,
            "sliding_window": 24,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
        },
    },
    # Gemma 2: Gemma 3's layers without q/k norms, sliding and full layers alternating under
    # one rope, and soft caps small enough to bite on these scores and logits.
    "gemma2": {
        "arch": "gemma2",
        "seed": 67,
        "tie": True,
        "head_dim": 32,
        "rope": {"rope_type": "default", "rope_theta": 10000.0},
        "extra": {
            "pad_token_id": 0,
            "sliding_window": 24,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
        },
    },
    "qwen3": {
        "arch": "qwen3",
        "seed": 8,
        "head_dim": 32,
        "rope": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    # Llama-3 rope scaling written with the classic keys: top-level "rope_theta" and
    # "rope_scaling" (as in Meta's Llama-3.1 config.json); config.json is rewritten by
    # hand after saving because transformers 5 only writes "rope_parameters".
    "legacy_rope": {
        "arch": "llama",
        "seed": 11,
        "legacy_rope": True,
        "rope": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    # Weights stored as bf16: `auto` holds them in bf16 and the bf16 GEMM widens them
    # exactly, activations in f32; with an f32 KV cache that is the bf16-rounded model
    # evaluated in f32, which is the reference (the default bf16 KV cache rounds K and V,
    # a bf16-vs-bf16 comparison: test_bf16_parity_against_transformers_in_bf16).
    "llama_bf16": {
        "arch": "llama",
        "seed": 12,
        "store_dtype": "bfloat16",
        "llm_kwargs": {"kv_cache_dtype": "float32"},
        "rope": {"rope_type": "default", "rope_theta": 10000.0},
    },
    # Mixtures of experts: 8 experts, 2 per token, routers random so tokens spread over them.
    # Qwen3-MoE renormalises the top-2 weights; Qwen2-MoE does not, adds its gated shared
    # expert, and has a dense layer (mlp_only_layers); Mixtral names its experts w1/w2/w3.
    "qwen3_moe": {
        "arch": "qwen3_moe",
        "seed": 23,
        "head_dim": 32,
        "rope": {"rope_type": "default", "rope_theta": 1000000.0},
        "extra": {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "norm_topk_prob": True,
        },
    },
    "qwen2_moe": {
        "arch": "qwen2_moe",
        "seed": 29,
        "rope": {"rope_type": "default", "rope_theta": 1000000.0},
        "extra": {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 96,
            "mlp_only_layers": [1],
        },
    },
    # bf16 expert weights: the rounded model evaluated in f32 is the reference (as llama_bf16).
    "qwen3_moe_bf16": {
        "arch": "qwen3_moe",
        "seed": 37,
        "head_dim": 32,
        "store_dtype": "bfloat16",
        "llm_kwargs": {"kv_cache_dtype": "float32"},
        "rope": {"rope_type": "default", "rope_theta": 1000000.0},
        "extra": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48},
    },
    # OLMoE: Llama's layers with q/k normed over the whole projection (OLMo 2's), and experts
    # as wide as intermediate_size routed by softmax then top-2, not renormalised.
    "olmoe": {
        "arch": "olmoe",
        "seed": 79,
        "rope": {"rope_type": "default", "rope_theta": 10000.0},
        "extra": {"pad_token_id": 0, "num_experts": 8, "num_experts_per_tok": 2},
    },
    # gpt-oss: biases on q/k/v/o, a learned sink logit per head, a sliding layer (window 8, so
    # the longer prompts outgrow it) and a full one, YaRN without truncation, and 8 experts
    # with biases, stacked in one tensor per part, top-2 by a softmax over the two logits,
    # gated by SwiGLU clamped at 1.0 (low enough that the random model's gates reach it).
    "gpt_oss": {
        "arch": "gpt_oss",
        "seed": 109,
        "rope": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 64,
            "truncate": False,
        },
        "extra": {
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "swiglu_limit": 1.0,
        },
    },
    # Granite 3 MoE: Granite's four multipliers over experts stacked in one tensor per part
    # (`input_linear`: gate rows, then up), routed by a softmax over the top-2 logits; the
    # Shared variant adds an ungated shared MLP. (Seed 127's model had a prompt whose first two
    # tokens were 5 % of the logit range apart: bf16's routing flips reordered them, failing
    # the bf16 check's first-token agreement. 139's first tokens are further apart.)
    "granitemoe": {
        "arch": "granitemoe",
        "seed": 139,
        "rope": {"rope_type": "default", "rope_theta": 10000.0},
        "extra": {
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 48,
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.2,
            "logits_scaling": 2.0,
        },
    },
    "granitemoeshared": {
        "arch": "granitemoeshared",
        "seed": 131,
        "rope": {"rope_type": "default", "rope_theta": 10000.0},
        "extra": {
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 48,
            "shared_intermediate_size": 96,
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.2,
            "logits_scaling": 2.0,
        },
    },
    # Granite SWA (granite-swash): Granite's multipliers, a full layer then sliding ones
    # (transformers' default kinds), a sink logit per head (randomised below), and rope by
    # layer: none on the full layer, theta 10000 on the sliding ones.
    "granite_swa": {
        "arch": "granite_swa",
        "seed": 257,
        "rope": {"rope_type": "default", "rope_theta": 10000.0},
        "extra": {
            "num_hidden_layers": 4,
            "sliding_window": 8,
            "layer_rope_theta": [0, 10000.0, 10000.0, 10000.0],
            "embedding_multiplier": 4.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.2,
            "logits_scaling": 2.0,
        },
    },
    # Granite MoE SWA: Granite SWA's layers with Granite MoE Shared's MLPs, its experts saved
    # under transformers' module names (`experts.gate_up_proj`); its full layers rotate by
    # another theta than its sliding ones.
    "granitemoe_swa": {
        "arch": "granitemoe_swa",
        "seed": 263,
        "rope": {"rope_type": "default", "rope_theta": 10000.0},
        "extra": {
            "num_hidden_layers": 4,
            "sliding_window": 8,
            "layer_types": [
                "full_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ],
            "layer_rope_theta": [500000.0, 10000.0, 500000.0, 10000.0],
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 48,
            "shared_intermediate_size": 96,
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.2,
            "logits_scaling": 2.0,
        },
    },
    # Granite 4.0 Micro / 1B / 350M (GraniteMoeHybrid, attention layers only): no experts, so
    # each layer's MLP is its shared MLP (shared_mlp.input_linear, gate rows first); Granite's
    # multipliers. Its twin with experts beside the shared MLP and no rope anywhere
    # (position_embedding_type null, as the -H models set it).
    "granite4": {
        "arch": "granitemoehybrid",
        "seed": 191,
        "tie": True,
        "rope": {"rope_type": "default", "rope_theta": 10000.0},
        "extra": {
            "num_local_experts": 0,
            "shared_intermediate_size": 96,
            "layer_types": ["attention", "attention"],
            "position_embedding_type": "rope",
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.2,
            "logits_scaling": 2.0,
        },
    },
    "granite4_moe_nope": {
        "arch": "granitemoehybrid",
        "seed": 193,
        "rope": {"rope_type": "default", "rope_theta": 10000.0},
        "extra": {
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 48,
            "shared_intermediate_size": 64,
            "layer_types": ["attention", "attention"],
            "position_embedding_type": None,
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.7,
            "attention_multiplier": 0.25,
            "logits_scaling": 1.5,
        },
    },
    # Granite 4.0-H: Mamba2 mixers (4 heads of 32 in 2 groups sharing B and C, a state of 16)
    # in three of four layers, attention without rope in the other; experts beside the shared
    # MLP, as Granite-4.0-H-Tiny and -Small have them.
    "granite4_h": {
        "arch": "granitemoehybrid",
        "seed": 293,
        "rope": {"rope_type": "default", "rope_theta": 10000.0},
        "extra": {
            "num_hidden_layers": 4,
            "layer_types": ["mamba", "attention", "mamba", "mamba"],
            "mamba_n_heads": 4,
            "mamba_d_head": 32,
            "mamba_d_state": 16,
            "mamba_n_groups": 2,
            "mamba_d_conv": 4,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 48,
            "shared_intermediate_size": 64,
            "position_embedding_type": None,
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.7,
            "attention_multiplier": 0.25,
            "logits_scaling": 1.5,
        },
    },
    # Bamba: Granite 4.0-H's Mamba2 mixers but in the layer `attn_layer_indices` names, which
    # attends with half of each head rotating; Llama's MLP under `feed_forward`.
    "bamba": {
        "arch": "bamba",
        "seed": 307,
        "head_dim": 32,
        "rope": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "extra": {
            "num_hidden_layers": 3,
            "attn_layer_indices": [1],
            "mamba_n_heads": 4,
            "mamba_d_head": 32,
            "mamba_d_state": 16,
            "mamba_n_groups": 2,
            "mamba_d_conv": 4,
        },
    },
    # Nemotron-H: each layer one sublayer — Mamba2 mixers, attention without rope,
    # squared-ReLU MLPs — in the hub's pattern's order.
    "nemotron_h": {
        "arch": "nemotron_h",
        "seed": 311,
        "head_dim": 16,
        "rope": {"rope_type": "default", "rope_theta": 10000.0},
        "extra": {
            "layers_block_type": [
                "linear_attention",
                "mlp",
                "linear_attention",
                "full_attention",
                "mlp",
                "linear_attention",
                "mlp",
            ],
            **NEMOTRON_H_MAMBA,
            "layer_norm_epsilon": 1e-5,
        },
    },
    # Nemotron 3's layers: Nemotron-H's with mixtures of experts in place of its MLPs — 8
    # ungated squared-ReLU experts in 2 groups (1 kept), chosen by sigmoid score plus a
    # correction bias, renormalised and scaled, beside a shared expert of its own width.
    "nemotron_h_moe": {
        "arch": "nemotron_h",
        "seed": 313,
        "head_dim": 16,
        "rope": {"rope_type": "default", "rope_theta": 10000.0},
        "extra": {
            "layers_block_type": [
                "linear_attention",
                "moe",
                "full_attention",
                "moe",
                "linear_attention",
                "mlp",
            ],
            **NEMOTRON_H_MAMBA,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 48,
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
        },
    },
    "mixtral": {
        "arch": "mixtral",
        "seed": 31,
        "rope": {"rope_type": "default", "rope_theta": 1000000.0},
        "extra": {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None},
    },
    # GLM-4.5 (DeepSeek-V3's experts): a dense first layer, then 8 experts in 4 groups whose 2
    # best groups compete, chosen by sigmoid score plus a correction bias (randomised below),
    # weighed by score, renormalised and scaled by 2.5, beside an ungated shared expert; q/k/v
    # biases, per-head q/k norms, rope on the first half of each head pairing halves.
    "glm4_moe": {
        "arch": "glm4_moe",
        "seed": 151,
        "head_dim": 32,
        "rope": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "extra": {
            "num_hidden_layers": 3,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.5,
            "use_qk_norm": True,
            "attention_bias": True,
        },
    },
    # DeepSeek-V3: multi-head latent attention (queries through a rank-48 bottleneck, keys and
    # values from a rank-32 latent, 16 rotated dimensions per head paired as neighbours,
    # values 24 wide), YaRN with DeepSeek's mscale in the softmax scale, and GLM-4.5's experts
    # after a dense layer. The plain twin: queries from one matrix, rope pairing halves,
    # values as wide as keys, the default rope.
    "deepseek_v3": {
        "arch": "deepseek_v3",
        "seed": 157,
        "rope": DEEPSEEK_YARN,
        "extra": {
            "num_hidden_layers": 3,
            "num_key_value_heads": 4,
            "q_lora_rank": 48,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16,
            "v_head_dim": 24,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.5,
        },
    },
    "deepseek_v3_plain": {
        "arch": "deepseek_v3",
        "seed": 163,
        "rope": {"rope_type": "default", "rope_theta": 10000.0},
        "extra": {
            "num_key_value_heads": 4,
            "q_lora_rank": None,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16,
            "v_head_dim": 48,
            "rope_interleave": False,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        },
    },
    # GLM-4.7-Flash: DeepSeek-V3's layers (one group of experts, values as wide as keys, as
    # its release has them), each layer's MLP named by mlp_layer_types: a pattern no
    # first_k_dense_replace can write, so reading the wrong field shows.
    "glm4_moe_lite": {
        "arch": "glm4_moe_lite",
        "seed": 173,
        "rope": {"rope_type": "default", "rope_theta": 1000000.0},
        "extra": {
            "num_hidden_layers": 3,
            "num_key_value_heads": 4,
            "q_lora_rank": 48,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 24,
            "qk_rope_head_dim": 16,
            "v_head_dim": 40,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "n_shared_experts": 1,
            "mlp_layer_types": ["sparse", "dense", "sparse"],
            "routed_scaling_factor": 1.8,
        },
    },
    # MiniMax-M2: q/k norms over the whole projections, rope on the first 16 of each head's 32
    # dimensions pairing halves, and Mixtral-named experts routed by sigmoid score with a
    # correction bias (randomised below), renormalised.
    "minimax_m2": {
        "arch": "minimax_m2",
        "seed": 179,
        "head_dim": 32,
        "rope": {"rope_type": "default", "rope_theta": 5000000.0},
        "extra": {
            "rotary_dim": 16,
            "intermediate_size": 48,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
        },
    },
    # ERNIE 4.5 MoE (21B-A3B's layout): ERNIE's rope pairing neighbours on whole heads; the
    # layers from moe_layer_start_index to moe_layer_end_index sparse (the middle one here:
    # dense on both sides), an f32 router whose softmax plus a correction bias (randomised
    # below) chooses, weights renormalised, beside a shared expert.
    "ernie45_moe": {
        "arch": "ernie45_moe",
        "seed": 181,
        "tie": True,
        "head_dim": 16,
        "rope": {"rope_type": "default", "rope_theta": 500000.0},
        "extra": {
            "num_hidden_layers": 3,
            "pad_token_id": 0,
            "moe_num_experts": 8,
            "moe_k": 2,
            "moe_intermediate_size": 48,
            "moe_num_shared_experts": 1,
            "moe_layer_start_index": 1,
            "moe_layer_end_index": 1,
        },
    },
    # dots.llm1: Qwen3's attention (per-head q/k norms) with a sliding layer between full
    # ones (layer_types), DeepSeek-V3's router (sigmoid, a correction bias, randomised below)
    # with dots' defaults: weights not renormalised, no dense first layer unless asked (one
    # here), two shared experts. (Its seed is one where bf16 rounding flips no prompt's first
    # routing-sensitive token, which the bf16 parity check asks; 211 flips one. The engine's
    # bf16 is the rounded model with an f32 router within 2e-6 on every seed tried.)
    "dots1": {
        "arch": "dots1",
        "seed": 199,
        "head_dim": 16,
        "rope": {"rope_type": "default", "rope_theta": 10000.0},
        "extra": {
            "num_hidden_layers": 3,
            "layer_types": ["full_attention", "sliding_attention", "full_attention"],
            "sliding_window": 8,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "n_shared_experts": 2,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
        },
    },
    # Hunyuan dense (Hunyuan-0.5B/1.8B/4B/7B): per-head q/k norms on the rotated heads, and
    # "dynamic" rope with an alpha: a fixed NTK stretch of the base (transformers' ntk_alpha).
    "hunyuan_dense": {
        "arch": "hunyuan_v1_dense",
        "seed": 227,
        "head_dim": 16,
        "rope": {"rope_type": "dynamic", "alpha": 1000.0, "rope_theta": 10000.0, "factor": 1.0},
        "extra": {},
    },
    # Arcee AFM: Llama's layers with an ungated MLP, down(relu(up(x))²); YaRN as AFM ships.
    "arcee": {
        "arch": "arcee",
        "seed": 293,
        "rope": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "extra": {},
    },
    # Hunyuan-A13B: Hunyuan dense's attention (q/k norms after rope, NTK-alpha rope), and in
    # every layer experts `intermediate_size` wide chosen by an f32 router (`mlp.gate.wg`)
    # beside an ungated shared MLP.
    "hunyuan_moe": {
        "arch": "hunyuan_v1_moe",
        "seed": 251,
        "head_dim": 16,
        "rope": {"rope_type": "dynamic", "alpha": 1000.0, "rope_theta": 10000.0, "factor": 1.0},
        "extra": {"num_experts": 8, "moe_topk": 2, "intermediate_size": 64},
    },
    # Apertus: per-head q/k norms, its own norm names, and an ungated MLP through xIELU, whose
    # learned scalars are randomised below; Llama 3's rope as Apertus ships it.
    "apertus": {
        "arch": "apertus",
        "seed": 229,
        "head_dim": 16,
        "rope": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 12000000.0,
        },
        "extra": {},
    },
    # DeepSeek-V2 (V2-Lite's layout: queries from one matrix): V3's latent attention with rope
    # on complex pairs, YaRN as V2-Lite sets it; experts by softmax score, in 4 groups of 2
    # whose best 2 compete (group_limited_greedy), weights scaled and not renormalised.
    "deepseek_v2": {
        "arch": "deepseek_v2",
        "seed": 167,
        "rope": DEEPSEEK_YARN,
        "extra": {
            "num_hidden_layers": 3,
            "num_key_value_heads": 4,
            "q_lora_rank": None,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16,
            "v_head_dim": 32,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "n_shared_experts": 2,
            "first_k_dense_replace": 1,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 1.5,
        },
    },
    # LFM2: gated short convolutions in most layers (their `B ⊙ x` rows in the paged cache),
    # attention with per-head q/k norms in the others, its own module names, and an MLP width
    # adjusted as `Lfm2MLP` adjusts it (2·128/3 → 85, up to a multiple of 16: 96). Biases on
    # the convolutions (real checkpoints have none) so that loading them is checked too.
    "lfm2": {
        "arch": "lfm2",
        "seed": 233,
        "tie": True,
        "rope": {"rope_type": "default", "rope_theta": 1000000.0},
        "extra": {
            "num_hidden_layers": 4,
            "layer_types": ["conv", "full_attention", "conv", "conv"],
            "conv_L_cache": 3,
            "conv_bias": True,
            "block_multiple_of": 16,
            "norm_eps": 1e-5,
        },
    },
    # Qwen3.5: gated DeltaNets in three of four layers (their per-sequence recurrent state
    # outside the pages), gated attention with per-head q/k norms in the others, a quarter of
    # each head rotating, every norm but the DeltaNet's scaling by 1 + w. Seed 251: at 241
    # one prompt's first token flips between the engine's bf16 and transformers' (which runs
    # the delta rule's state and the convolution in bf16: 0.4-0.66 off the rounded model in
    # f32, where the engine's bf16 is within 1e-4 of it; the flipped prompt's margin was 0.03).
    "qwen3_5": {
        "arch": "qwen3_5",
        "seed": 251,
        "head_dim": 32,
        "rope": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "extra": _QWEN3_5_LAYERS,
    },
    # Qwen3.5 stored in bf16, run in bf16 with an f32 KV cache: the bf16 path checked exactly
    # against the rounded model computed in f32 (the recurrent state is f32 either way).
    "qwen3_5_bf16": {
        "arch": "qwen3_5",
        "seed": 257,
        "head_dim": 32,
        "store_dtype": "bfloat16",
        "llm_kwargs": {"kv_cache_dtype": "float32"},
        "rope": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "extra": _QWEN3_5_LAYERS,
    },
    # Qwen3-Next: Qwen3.5's layers (Qwen3.5 took them over) with the DeltaNets' projections
    # stored grouped by key head (`in_proj_qkvz`, `in_proj_ba`); Qwen2-MoE's MLPs, here sparse
    # but on layer 2 (`mlp_only_layers`: a dense MLP after a DeltaNet), renormalised by its
    # class's default (`norm_topk_prob` left out), with a gated shared expert.
    "qwen3_next": {
        "arch": "qwen3_next",
        "seed": 269,
        "head_dim": 32,
        "rope": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "extra": {
            **_QWEN3_5_LAYERS,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 96,
            "mlp_only_layers": [2],
        },
    },
    # Qwen3-Next stored in bf16, run in bf16 with an f32 KV cache: the grouped projections read
    # in bf16, checked exactly against the rounded model computed in f32.
    "qwen3_next_bf16": {
        "arch": "qwen3_next",
        "seed": 283,
        "head_dim": 32,
        "store_dtype": "bfloat16",
        "llm_kwargs": {"kv_cache_dtype": "float32"},
        "rope": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "extra": {
            **_QWEN3_5_LAYERS,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 96,
        },
    },
    # Qwen3.5-MoE: Qwen3.5's layers, every MLP sparse: 8 experts, 2 per token, always
    # renormalised, and a shared expert under its sigmoid gate (Qwen2-MoE's). Its config has
    # no dense width; `intermediate_size` (the zoo's default) is left in as transformers keeps
    # it, unread.
    "qwen3_5_moe": {
        "arch": "qwen3_5_moe",
        "seed": 263,
        "head_dim": 32,
        "rope": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "extra": {
            **_QWEN3_5_LAYERS,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 96,
        },
    },
    # LFM2-MoE: LFM2's layers, a dense first MLP (`intermediate_size` as written), then
    # experts under `feed_forward` chosen by sigmoid score plus a per-expert bias
    # (`feed_forward.expert_bias`, randomised), renormalised (sum + 1e-6), scaled by 1.5.
    "lfm2_moe": {
        "arch": "lfm2_moe",
        "seed": 239,
        "tie": True,
        "rope": {"rope_type": "default", "rope_theta": 1000000.0},
        "extra": {
            "num_hidden_layers": 4,
            "layer_types": ["conv", "full_attention", "conv", "full_attention"],
            "num_dense_layers": 1,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "routed_scaling_factor": 1.5,
            "norm_eps": 1e-5,
        },
    },
    # K-EXAONE: EXAONE 4's attention (per-head q/k norms, a sliding layer and full ones
    # without rope) under pre-norms, a dense first MLP (its default of `first_k_dense_replace`,
    # the list left out), then DeepSeek-V3's experts (in 2 groups, the correction bias
    # randomised below, one shared expert by its name `num_shared_experts`).
    "exaone_moe": {
        "arch": "exaone_moe",
        "seed": 271,
        "head_dim": 16,
        "rope": {"rope_type": "default", "rope_theta": 1000000.0},
        "extra": {
            "num_hidden_layers": 3,
            "pad_token_id": 0,
            "sliding_window": 24,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "num_shared_experts": 1,
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
        },
    },
    # Solar Open: Llama's attention with q/k/v biases, GLM-4.5's experts in every layer (one
    # group, its correction bias randomised below), theta 1e6. Its seed was chosen for the bf16
    # parity check, which asks that bf16 rounding flip no prompt's first token: with seeds 269
    # and 271 one flips, from the bf16 KV cache's rounding of the biased keys (the engine's
    # bf16 with a float32 cache equals the rounded model within 1.3e-6 relative: checked
    # directly).
    "solar_open": {
        "arch": "solar_open",
        "seed": 277,
        "head_dim": 16,
        "rope": {"rope_type": "default", "rope_theta": 1000000.0},
        "extra": {
            "num_hidden_layers": 3,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "n_shared_experts": 1,
            "routed_scaling_factor": 2.5,
            "attention_bias": True,
        },
    },
}
# Mistral 4: DeepSeek-V3's latent attention and experts (its spec's, with softmax scores and no
# correction bias, in 4 groups of which 2 compete; the router in the model's dtype), queries
# scaled past the original context; saved with its experts fused (transformers has no
# conversion for it). Its seed was chosen for the bf16 first-token check: with 281 and 307 one
# prompt flips against transformers' bf16, whose router scores in bf16; the engine's bf16 with
# a float32 cache equals the rounded model computed in f32 within 1.7e-6 (checked directly).
MODEL_SPECS["mistral4"] = {
    **MODEL_SPECS["deepseek_v3"],
    "arch": "mistral4",
    "seed": 283,
    "rope": {**DEEPSEEK_YARN, "llama_4_scaling_beta": 0.1},
    "extra": {**MODEL_SPECS["deepseek_v3"]["extra"], "routed_scaling_factor": 1.5},
}
# GLM-4.5's layers without q/k norms: the language model of GLM-4.5V and 4.6V, whose attention
# has none (test_multimodal_checkpoint.py).
MODEL_SPECS["glm4_moe_plain"] = {
    **MODEL_SPECS["glm4_moe"],
    "seed": 241,
    "extra": {**MODEL_SPECS["glm4_moe"]["extra"], "use_qk_norm": False},
}
ARCH_NAMES = tuple(MODEL_SPECS)

_CONFIG_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "ministral3": (transformers.Ministral3Config, transformers.Ministral3ForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
    "glm": (transformers.GlmConfig, transformers.GlmForCausalLM),
    "glm4": (transformers.Glm4Config, transformers.Glm4ForCausalLM),
    "ernie45": (transformers.Ernie4_5Config, transformers.Ernie4_5ForCausalLM),
    "exaone4": (transformers.Exaone4Config, transformers.Exaone4ForCausalLM),
    "exaone_moe": (transformers.ExaoneMoeConfig, transformers.ExaoneMoeForCausalLM),
    "olmo3": (transformers.Olmo3Config, transformers.Olmo3ForCausalLM),
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
    "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM),
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    "granitemoe": (transformers.GraniteMoeConfig, transformers.GraniteMoeForCausalLM),
    "granitemoeshared": (
        transformers.GraniteMoeSharedConfig,
        transformers.GraniteMoeSharedForCausalLM,
    ),
    "granite_swa": (transformers.GraniteSWAConfig, transformers.GraniteSWAForCausalLM),
    "granitemoe_swa": (transformers.GraniteMoeSWAConfig, transformers.GraniteMoeSWAForCausalLM),
    "seed_oss": (transformers.SeedOssConfig, transformers.SeedOssForCausalLM),
    "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM),
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
    "glm4_moe_lite": (transformers.Glm4MoeLiteConfig, transformers.Glm4MoeLiteForCausalLM),
    "minimax_m2": (transformers.MiniMaxM2Config, transformers.MiniMaxM2ForCausalLM),
    "ernie45_moe": (transformers.Ernie4_5_MoeConfig, transformers.Ernie4_5_MoeForCausalLM),
    "dots1": (transformers.Dots1Config, transformers.Dots1ForCausalLM),
    "apertus": (transformers.ApertusConfig, transformers.ApertusForCausalLM),
    "lfm2": (transformers.Lfm2Config, transformers.Lfm2ForCausalLM),
    "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
    "bamba": (transformers.BambaConfig, transformers.BambaForCausalLM),
    "nemotron_h": (transformers.NemotronHConfig, transformers.NemotronHForCausalLM),
    "hunyuan_v1_moe": (transformers.HunYuanMoEV1Config, transformers.HunYuanMoEV1ForCausalLM),
    "arcee": (transformers.ArceeConfig, transformers.ArceeForCausalLM),
    "solar_open": (transformers.SolarOpenConfig, transformers.SolarOpenForCausalLM),
    "mistral4": (transformers.Mistral4Config, transformers.Mistral4ForCausalLM),
    "lfm2_moe": (transformers.Lfm2MoeConfig, transformers.Lfm2MoeForCausalLM),
    "hunyuan_v1_dense": (
        transformers.HunYuanDenseV1Config,
        transformers.HunYuanDenseV1ForCausalLM,
    ),
    "granitemoehybrid": (
        transformers.GraniteMoeHybridConfig,
        transformers.GraniteMoeHybridForCausalLM,
    ),
}


# --------------------------------------------------------------------------- tokenizer


def build_tokenizer(out_dir: Path) -> Path:
    """Train the tiny byte-level BPE tokenizer and write tokenizer.json/_config.json."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    paragraphs = [p for p in CORPUS.split("\n\n") if p.strip()]
    tok.train_from_iterator(paragraphs, trainer=trainer)
    assert tok.token_to_id("<s>") == BOS_ID and tok.token_to_id("</s>") == EOS_ID
    assert tok.get_vocab_size() <= VOCAB_SIZE
    tok.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return out_dir


def add_tokens(tok_dir: Path, tokens: dict[int, str], special: bool, chat_template: str) -> None:
    """Adds ``tokens`` (id -> text) to the tokenizer in ``tok_dir`` as added tokens (special
    or not) and sets its chat template."""
    tok = json.loads((tok_dir / "tokenizer.json").read_text())
    for i, text in tokens.items():
        tok["added_tokens"].append(
            {"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": special}
        )  # fmt: skip
    (tok_dir / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = chat_template
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg))


# --------------------------------------------------------------------------- models


def _randomise_(model: torch.nn.Module, seed: int) -> None:
    """Make norm weights and biases non-trivial so that loading bugs show."""
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight")):  # every norm, q_norm, k_norm
                param.copy_(0.5 + torch.rand(param.shape, generator=gen))
            elif name.endswith((".bias", "_bias")):  # gpt-oss's experts': `gate_up_proj_bias`
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
            elif name.endswith(("act_fn.alpha_p", "act_fn.alpha_n")):  # Apertus's xIELU
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".sinks"):  # gpt-oss's per-head sink logits
                param.copy_(torch.randn(param.shape, generator=gen))
            # Mamba2's skip and decay rates (Nemotron-H's mixers are `mixer`)
            elif name.endswith((".mamba.D", ".mamba.A_log", ".mixer.D", ".mixer.A_log")):
                param.add_(0.5 * torch.randn(param.shape, generator=gen))
        for name, buf in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):  # routers' buffers
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))


def build_hf_model(spec: dict) -> torch.nn.Module:
    config_cls, model_cls = _CONFIG_CLASSES[spec["arch"]]
    kwargs = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "initializer_range": 0.15,
        "rms_norm_eps": 1e-5,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "tie_word_embeddings": spec.get("tie", False),
        "rope_parameters": dict(spec["rope"]),
    }
    if spec["arch"] == "mistral":
        kwargs["sliding_window"] = None
    if spec["arch"] in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        kwargs["use_sliding_window"] = False
        kwargs["rms_norm_eps"] = 1e-6
    if "head_dim" in spec:
        kwargs["head_dim"] = spec["head_dim"]
    kwargs.update(spec.get("extra", {}))
    config = config_cls(**kwargs)
    torch.manual_seed(spec["seed"])
    model = model_cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
    _randomise_(model, spec["seed"])
    model.eval()
    return model


def _rewrite_config_legacy_rope(model_dir: Path) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    path.write_text(json.dumps(config, indent=2))


def save_model_dir(model: torch.nn.Module, spec: dict, out_dir: Path, tokenizer_dir: Path):
    """Save `model` as an HF model dir; returns the float32 reference model."""
    out_dir = Path(out_dir)
    store_dtype = spec.get("store_dtype")
    if store_dtype is not None:
        dtype = getattr(torch, store_dtype)
        with torch.no_grad():  # the reference keeps the rounded weights, computed in f32
            for param in model.parameters():
                param.copy_(param.to(dtype).to(torch.float32))
        # convert a copy: .to() would also round buffers such as rope's inv_freq
        copy.deepcopy(model).to(dtype).save_pretrained(out_dir, safe_serialization=True)
    else:
        model.save_pretrained(
            out_dir,
            safe_serialization=True,
            max_shard_size=spec.get("max_shard_size", "50GB"),
        )
    if spec.get("legacy_rope"):
        _rewrite_config_legacy_rope(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_dir) / name, out_dir / name)
    return model


@dataclasses.dataclass
class GreedyRef:
    """HF greedy continuation and the logits it was chosen from."""

    tokens: list[int]
    step_logits: np.ndarray  # [n, vocab] float32: logits that produced tokens[i]

    @property
    def margins(self) -> np.ndarray:
        top2 = np.sort(self.step_logits, axis=-1)[:, -2:]
        return top2[:, 1] - top2[:, 0]

    @property
    def chosen_logprobs(self) -> np.ndarray:
        lp = log_softmax(self.step_logits)
        return lp[np.arange(len(self.tokens)), self.tokens]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def hf_logits(model: torch.nn.Module, ids) -> np.ndarray:
    """Per-position logits [len, vocab] (float32) of one sequence, no KV cache.

    A model with gated DeltaNets (Qwen3-Next, Qwen3.5) runs token by token through its cache
    instead: transformers' whole-sequence form of the delta rule reorders its sums into
    chunks (3e-4 apart from its own token-by-token form on the zoo model), and the
    token-by-token form is the one it decodes with, and the engine's. (Mamba2's chunked scan
    agrees with its recurrent form to 2e-6 on Granite 4.0-H's zoo model; Bamba's cached decode
    in transformers 5.24 is 0.09-0.7 away from its own whole-sequence logits, which the engine
    matches to 5e-6: the whole-sequence form is the reference there.)"""
    ids = torch.tensor([list(ids)], dtype=torch.long)
    with torch.inference_mode():
        if getattr(model.config, "linear_num_value_heads", None) is None:
            return model(ids, use_cache=False).logits[0].float().numpy()
        cache, rows = None, []
        for t in range(ids.shape[1]):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            rows.append(out.logits[0, -1].float())
        return torch.stack(rows).numpy()


def hf_greedy(model: torch.nn.Module, prompt_ids, n: int, process=None, stop_ids=()):
    """Greedy continuation by repeated full forwards + argmax (never stops on EOS).

    process: optional fn(prompt_ids, generated_ids, logits_row) -> processed row (float
    numpy), applied before the argmax (penalties, min_tokens masking); the recorded
    step_logits are the processed rows. stop_ids: stop after emitting one of these
    (the stop token is included in the result, as vLLM does).
    """
    prompt_ids = [int(t) for t in prompt_ids]
    tokens, rows = [], []
    for _ in range(n):
        row = hf_logits(model, prompt_ids + tokens)[-1]
        if process is not None:
            row = np.asarray(process(prompt_ids, list(tokens), row.copy()), dtype=np.float32)
        tok = int(np.argmax(row))
        tokens.append(tok)
        rows.append(row)
        if tok in stop_ids:
            break
    return GreedyRef(tokens=tokens, step_logits=np.stack(rows).astype(np.float32))


def top2_margin(row: np.ndarray) -> float:
    finite = np.sort(row[np.isfinite(row)])
    return float(finite[-1] - finite[-2])


def greedy_mismatch_message(prompt, got, ref: GreedyRef, label: str = "") -> str | None:
    """None if `got` equals the reference, else a message with position and HF margin."""
    got = [int(t) for t in got]
    if got == ref.tokens:
        return None
    pos = next(
        (i for i, (a, b) in enumerate(zip(got, ref.tokens, strict=False)) if a != b),
        min(len(got), len(ref.tokens)),
    )
    head = (
        f"{label}: greedy output differs from HF (prompt len {len(prompt)}, "
        f"detspec {len(got)} tokens, HF {len(ref.tokens)} tokens); "
    )
    if pos >= len(got) or pos >= len(ref.tokens):
        return head + f"length mismatch after {pos} equal tokens"
    row = ref.step_logits[pos]
    order = np.argsort(row)[::-1]
    got_tok = got[pos]
    if not 0 <= got_tok < row.size:
        about = "out of vocab"
    elif not np.isfinite(row[got_tok]):
        about = "a token the reference masks out (-inf after its logits processing)"
    else:
        rank = int(np.nonzero(order == got_tok)[0][0]) + 1
        about = f"HF rank {rank}, {float(row[order[0]] - row[got_tok]):.3g} below the top"
    return head + (
        f"first mismatch at generated index {pos} (absolute position {len(prompt) + pos}): "
        f"detspec={got_tok} ({about}), HF={ref.tokens[pos]}; "
        f"HF top-2 margin there = {top2_margin(row):.4g} "
        f"(max|logit| {float(np.abs(row[np.isfinite(row)]).max()):.4g}); "
        f"detspec {got[pos : pos + 8]} vs HF {ref.tokens[pos : pos + 8]}"
    )


def fixed_token_prompts(lengths=PROMPT_LENGTHS, seed=PROMPT_SEED) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # ids 2.. avoid the special tokens; ids >= tokenizer vocab are valid model ids too
    return [[int(t) for t in rng.integers(2, VOCAB_SIZE, size=n)] for n in lengths]


class ModelCase:
    """One saved model dir plus its in-memory HF reference model (with cached refs)."""

    def __init__(self, name: str, path: Path, model: torch.nn.Module, spec: dict):
        self.name = name
        self.path = Path(path)
        self.model = model
        self.spec = spec
        self._greedy: dict = {}

    def __repr__(self) -> str:
        return f"ModelCase({self.name!r}, {str(self.path)!r})"

    @property
    def config(self) -> dict:
        return json.loads((self.path / "config.json").read_text())

    def greedy(self, prompt_ids, n: int = NEW_TOKENS) -> GreedyRef:
        """HF greedy reference of n tokens (cached; shorter ones are prefixes)."""
        key = tuple(int(t) for t in prompt_ids)
        have = self._greedy.get(key)
        if have is None or len(have.tokens) < n:
            have = hf_greedy(self.model, key, max(n, NEW_TOKENS))
            self._greedy[key] = have
        return GreedyRef(tokens=have.tokens[:n], step_logits=have.step_logits[:n])

    def logits(self, ids) -> np.ndarray:
        """HF per-position logits [len, vocab] of one sequence."""
        return hf_logits(self.model, ids)

    def reference_greedy(self, prompt_ids, n: int, process=None, stop_ids=()) -> GreedyRef:
        """Uncached HF greedy with a logits processor and/or stop ids (see hf_greedy)."""
        return hf_greedy(self.model, prompt_ids, n, process=process, stop_ids=stop_ids)

    def greedy_mismatch(self, prompt_ids, got, ref: GreedyRef, label: str = "") -> str | None:
        return greedy_mismatch_message(prompt_ids, got, ref, f"[{self.name}] {label}")

    def assert_greedy_matches(self, prompt_ids, got, n: int = NEW_TOKENS, label: str = ""):
        """Assert detspec's greedy tokens `got` equal the n-token HF reference."""
        ref = self.greedy(prompt_ids, n)
        msg = greedy_mismatch_message(prompt_ids, got, ref, f"[{self.name}] {label}")
        if msg is not None:
            pytest.fail(msg)


class ModelZoo:
    """Builds model dirs lazily (once per session) under a tmp root."""

    def __init__(self, root: Path, tokenizer_dir: Path):
        self.root = Path(root)
        self.tokenizer_dir = Path(tokenizer_dir)
        self._cases: dict[str, ModelCase] = {}
        self._models: dict[str, torch.nn.Module] = {}

    def get(self, name: str) -> ModelCase:
        if name not in self._cases:
            spec = MODEL_SPECS[name]
            if "reuse" in spec:
                base = self.get(spec["reuse"])
                full_spec = {**base.spec, **spec}
                model = base.model
            else:
                full_spec = spec
                model = build_hf_model(spec)
            out_dir = self.root / name
            ref_model = save_model_dir(model, full_spec, out_dir, self.tokenizer_dir)
            self._cases[name] = ModelCase(name, out_dir, ref_model, full_spec)
        return self._cases[name]


# --------------------------------------------------------------------------- classifiers

# name -> (transformers classes, labels: id2label names, or None for transformers' default two)
CLASSIFIERS = {
    "llama3": (
        transformers.LlamaConfig,
        transformers.LlamaForSequenceClassification,
        ["negative", "neutral", "positive"],
    ),
    "qwen2_reward": (
        transformers.Qwen2Config,
        transformers.Qwen2ForSequenceClassification,
        ["LABEL_0"],
    ),
    "qwen3_default": (transformers.Qwen3Config, transformers.Qwen3ForSequenceClassification, None),
    "phi3_reward": (
        transformers.Phi3Config,
        transformers.Phi3ForSequenceClassification,
        ["LABEL_0"],
    ),
    # Gemma 2 reward models (Skywork-Reward-Gemma-2-27B): the attention's soft cap applies, the
    # logits' does not (transformers caps a causal LM's logits only; 3.0 would bite here).
    "gemma2_reward": (
        transformers.Gemma2Config,
        transformers.Gemma2ForSequenceClassification,
        ["LABEL_0"],
    ),
    # OLMo 2 reward models (Tülu 3's): norms of the sublayers' outputs and whole-projection
    # q/k norms under the score head. GLM-4's: neighbour-pair rope on half of each head.
    "olmo2_reward": (
        transformers.Olmo2Config,
        transformers.Olmo2ForSequenceClassification,
        ["LABEL_0"],
    ),
    "glm4_classifier": (
        transformers.Glm4Config,
        transformers.Glm4ForSequenceClassification,
        ["negative", "positive"],
    ),
    # Seed-OSS's: q/k/v biases under the score head.
    "seed_oss_reward": (
        transformers.SeedOssConfig,
        transformers.SeedOssForSequenceClassification,
        ["LABEL_0"],
    ),
}

# Settings a classifier's family needs beyond the shared ones.
_CLASSIFIER_EXTRA = {
    "glm4_classifier": {"head_dim": 16},
    "seed_oss_reward": {"head_dim": 16},
    "gemma2_reward": {
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 8,
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 3.0,
    },
}


def build_classifier(name: str, out: Path, tokenizer_dir: Path) -> torch.nn.Module:
    """A tiny random ``*ForSequenceClassification`` model (``CLASSIFIERS[name]``) saved with
    the tiny tokenizer at ``out``; returns the float32 reference."""
    config_cls, model_cls, labels = CLASSIFIERS[name]
    kw = {} if labels is None else {"id2label": dict(enumerate(labels))}
    config = config_cls(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        initializer_range=0.15,
        rms_norm_eps=1e-5,
        pad_token_id=0,
        tie_word_embeddings=name == "qwen2_reward",  # ignored by the classifier's `score`
        **kw,
        **_CLASSIFIER_EXTRA.get(name, {}),
    )
    torch.manual_seed(len(name))
    model = model_cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((tokenizer_dir / f).read_bytes())
    return model


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def hf_tokenizer(tokenizer_dir) -> Tokenizer:
    """The reference tokenizer (the `tokenizers` library on the same tokenizer.json)."""
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def model_zoo(tmp_path_factory, tokenizer_dir) -> ModelZoo:
    return ModelZoo(tmp_path_factory.mktemp("models"), tokenizer_dir)


@pytest.fixture(scope="session", params=ARCH_NAMES)
def arch_case(request, model_zoo) -> ModelCase:
    """Every architecture / config variant in turn."""
    return model_zoo.get(request.param)


@pytest.fixture(scope="session")
def llama_case(model_zoo) -> ModelCase:
    return model_zoo.get("llama")


@pytest.fixture(scope="session")
def token_prompts() -> list[list[int]]:
    """Token-id prompts of lengths 1, 7, 23, 61 (fixed numpy seed)."""
    return fixed_token_prompts()


@pytest.fixture(scope="session")
def llm_factory(model_zoo):
    """llm_factory(name, **llm_kwargs) -> detspec.LLM, cached per (name, kwargs)."""
    import detspec

    cache: dict = {}

    def get(name: str, **kwargs):
        key = (name, tuple(sorted(kwargs.items())))
        if key not in cache:
            case = model_zoo.get(name)
            kw = {**case.spec.get("llm_kwargs", {}), **kwargs}
            if "num_kv_pages" not in kw:
                # The engines live for the session: the default 1 GiB pool each (zeroed, so
                # resident) added up to ~19 GiB of a 24 GiB machine. 64 MiB holds 64k tokens
                # of these 2-layer models, far more than any test batch.
                kw.setdefault("kv_cache_bytes", 64 << 20)
            cache[key] = detspec.LLM(str(case.path), device="cpu", **kw)
        return cache[key]

    yield get
    cache.clear()
    gc.collect()


@pytest.fixture
def copy_model_dir(model_zoo, tmp_path):
    """copy_model_dir(name) -> a private copy of that model dir, safe to corrupt."""
    counter = iter(range(1000))

    def copy(name: str) -> Path:
        dst = tmp_path / f"{name}-copy{next(counter)}"
        shutil.copytree(model_zoo.get(name).path, dst)
        return dst

    return copy


def pytest_report_header(config):
    return (
        f"detspec tests: torch {torch.__version__}, transformers {transformers.__version__}, "
        f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}"
    )
