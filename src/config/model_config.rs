//! Hugging Face `config.json` for the Llama family (Llama, Mistral, Qwen2, Qwen3, Phi-3,
//! OLMo 2 and 3, Granite, SmolLM3, Gemma 2 and 3) and its mixture-of-experts relatives (Qwen2-MoE,
//! Qwen3-MoE, Mixtral). The rotary settings are
//! read by [`super::rope`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use super::head::Head;
use super::json::{parse_json, TokenIds};
use super::linear_attention::{DeltaNetProjections, LinearAttentionConfig, RawLinearAttention};
use super::mamba::{MambaConfig, RawMamba};
use super::mla_config::{MlaConfig, RawMla};
use super::moe_config::{DeepSeekDefaults, ExpertNaming, MoeConfig, RawMoe, SparseShape};
use super::nemotron_h::{RawNemotronH, Sublayer};
use super::quant::{parse_quantization, Fp8Weights, Quantization};
use super::rope::{self, RawRope, RopeConfig, RopeDefaults, RopeScaling};
use super::short_conv::{Lfm2Shape, RawLfm2, ShortConvConfig};
use super::text_config::decoder_json;
use crate::error::{DetspecError, Result};

/// Architectures detspec implements; all share one decoder with small switches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    /// Phi-3 and Phi-4: Llama's decoder with q/k/v and gate/up each stored as one matrix.
    Phi3,
    /// OLMo 2: each sublayer's output normed before the residual add (its input is not), and
    /// q/k normed over the whole projection.
    Olmo2,
    /// OLMo 3: OLMo 2's layers, most of them attending within a sliding window (`layer_types`),
    /// each kind with its own rope.
    Olmo3,
    /// IBM Granite 3: Llama's layers with four scalar multipliers ([`GraniteScales`]).
    Granite,
    /// SmolLM3: Llama's layers, every fourth without rope (`no_rope_layers`).
    SmolLm3,
    /// Gemma 2: Gemma 3's layers without q/k norms, every other layer within a sliding window,
    /// and tanh soft caps on the attention scores and the logits.
    Gemma2,
    /// GLM (`glm-4-9b-chat-hf`): Llama's layers with gate/up stored as one matrix, biases on
    /// q/k/v, and rope on half of each head pairing neighbours (`2i`, `2i + 1`).
    Glm,
    /// GLM-4-0414 and GLM-Z1: GLM's layers with each sublayer normed before and after.
    Glm4,
    /// ERNIE 4.5 (dense): Llama's layers with GLM's neighbour-pair rope on whole heads, and
    /// biases on every projection or none (`use_bias`).
    Ernie45,
    /// Ministral 3: Mistral's layers with queries scaled up by position past the original
    /// context (`llama_4_scaling_beta`, [`ModelConfig::query_scale_beta`]).
    Ministral3,
    /// EXAONE 4.0: OLMo 2's norms of each sublayer's output, Qwen3's per-head q/k norms, and
    /// where it has a window, most layers within it and the others without rope
    /// (`layer_types`).
    Exaone4,
    /// K-EXAONE (236B-A23B; `ExaoneMoeForCausalLM`): EXAONE 4's attention (per-head q/k norms;
    /// where it has a window, most layers within it and the others without rope) under the
    /// Llama family's pre-norms (OLMoE's layer), and DeepSeek-V3's experts in the layers
    /// `mlp_layer_types` names sparse (by default after the first `first_k_dense_replace`).
    ExaoneMoe,
    /// Gemma 3 (text): each sublayer normed before and after, norms scaling by `1 + w`, GeGLU,
    /// embeddings scaled by √hidden, attention scaled by `query_pre_attn_scalar^-½`, and most
    /// layers within a sliding window with a rope of their own (`layer_types`).
    Gemma3,
    Mixtral,
    Qwen2Moe,
    Qwen3Moe,
    /// OLMoE: Llama's layers with OLMo 2's q/k norms over the whole projection, and a sparse
    /// MLP routed as Qwen's (softmax, then the top k), its experts `intermediate_size` wide.
    Olmoe,
    /// gpt-oss: biases on every attention projection, a learned sink logit per head in each
    /// softmax, sliding and full layers alternating (`layer_types`), and experts with biases,
    /// stored fused, gated by a clamped SwiGLU ([`ClampedSwiglu`]) and routed by a softmax over
    /// the top k logits.
    GptOss,
    /// Granite 3 MoE: Granite's multipliers over a sparse MLP whose experts checkpoints stack
    /// (`block_sparse_moe.input_linear`), routed by a softmax over the top k logits.
    GraniteMoe,
    /// Granite MoE Shared: Granite MoE with an ungated shared MLP beside the experts.
    GraniteMoeShared,
    /// Granite 4.0 (`GraniteMoeHybridForCausalLM`) with attention layers only (Micro, 1B,
    /// 350M; the -H models' Mamba layers are refused, naming `layer_types`): Granite's
    /// multipliers, rope or none by `position_embedding_type`; without experts
    /// (`num_local_experts: 0`) each layer's MLP is its shared MLP
    /// (`shared_mlp.input_linear`, `shared_mlp.output_linear`: [`DenseMlpNames::GraniteShared`]),
    /// with them Granite MoE Shared's layers.
    GraniteMoeHybrid,
    /// Granite SWA (`GraniteSWAForCausalLM`, granite-swash): Granite's multipliers, sliding
    /// and full layers (`layer_types`; by default every fourth from the first full), a learned
    /// sink logit per head in every softmax (gpt-oss's), and rope by layer
    /// (`layer_rope_theta`: 0 for none), one theta per layer kind. Its mixture of experts
    /// (`GraniteMoeSWAForCausalLM`) has Granite MoE Shared's MLPs, saved under transformers'
    /// module names (`experts.gate_up_proj`; `model::Checkpoint` reads them as Granite's).
    GraniteSwa,
    GraniteMoeSwa,
    /// Seed-OSS: Llama's layers with biases on q/k/v (`attention_bias`, on by default) and on
    /// o_proj only by `attention_out_bias`.
    SeedOss,
    /// GLM-4.5/4.6/4.7 (`Glm4MoeForCausalLM`): Llama's layers with q/k/v biases
    /// (`attention_bias`), per-head q/k norms by `use_qk_norm`, rope on the first half of each
    /// head pairing halves (Phi-3's layout), dense MLPs in the first `first_k_dense_replace`
    /// layers and DeepSeek-V3's experts after them ([`ExpertNaming::DeepSeek`]).
    Glm4Moe,
    /// Solar Open (`SolarOpenForCausalLM`, 100B): Llama's attention (q/k/v biases by
    /// `attention_bias`, none on o_proj; theta 1e6 by default), and in every layer GLM-4.5's
    /// experts ([`ExpertNaming::DeepSeek`]: the f32 router, sigmoid scores with a correction
    /// bias, shared experts).
    SolarOpen,
    /// DeepSeek-V3 (and R1, V3.1, Kimi K2, Moonlight): multi-head latent attention
    /// ([`MlaConfig`]), dense first layers, then its experts ([`ExpertNaming::DeepSeek`]).
    DeepseekV3,
    /// GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`): DeepSeek-V3's layers, each layer's MLP
    /// named in `mlp_layer_types` (by default the first dense, the rest sparse).
    Glm4MoeLite,
    /// ERNIE 4.5 MoE (21B-A3B, 300B-A47B; `Ernie4_5_MoeForCausalLM`): ERNIE 4.5's layers, the
    /// layers from `moe_layer_start_index` to `moe_layer_end_index` sparse
    /// ([`ExpertNaming::Ernie`]): an f32 router whose softmax scores plus a correction bias
    /// choose the experts, weighed by their scores renormalised, beside ungated shared experts.
    Ernie45Moe,
    /// dots.llm1 (`Dots1ForCausalLM`): Qwen3's attention (per-head q/k norms) and layer kinds
    /// (`layer_types`; transformers' default: the layers from `max_window_layers` on attend
    /// within the window), DeepSeek-V3's experts with dots' defaults (no dense first layer,
    /// weights not renormalised).
    Dots1,
    /// Hunyuan dense (0.5B, 1.8B, 4B, 7B; `HunYuanDenseV1ForCausalLM`): Llama's layers with
    /// per-head q/k norms applied after rope (`query_layernorm`, `key_layernorm`), and its
    /// `"dynamic"` rope with an `alpha` read as a fixed NTK stretch of the base.
    HunYuanDense,
    /// Hunyuan-A13B (`HunYuanMoEV1ForCausalLM`): Hunyuan dense's attention, and in every layer
    /// experts `intermediate_size` wide routed by an f32 router (`mlp.gate.wg`: the top k of a
    /// softmax, renormalised) beside an ungated shared MLP (`mlp.shared_mlp`).
    HunYuanMoe,
    /// Arcee AFM (4.5B; `ArceeForCausalLM`): Llama's layers with an ungated MLP,
    /// `down(relu(up(x))²)`.
    Arcee,
    /// Apertus (8B, 70B; `ApertusForCausalLM`): Llama's attention with per-head q/k norms,
    /// norms named `attention_layernorm` and `feedforward_layernorm`, and an ungated MLP,
    /// `down(xIELU(up(x)))`, whose activation has learned scalars per layer
    /// (`mlp.act_fn.{alpha_p, alpha_n, beta, eps}`).
    Apertus,
    /// MiniMax-M2 (M2, M2.1, M2.5; `MiniMaxM2ForCausalLM`): OLMo 2's q/k norms over the whole
    /// projections, rope on the first `rotary_dim` of each head pairing halves (Phi-3's
    /// layout), and Mixtral's experts routed as DeepSeek-V3 routes in one group: sigmoid
    /// scores, chosen with a correction bias (`block_sparse_moe.e_score_correction_bias`),
    /// renormalised, unscaled.
    MiniMaxM2,
    /// Mistral 4 (`Mistral4ForCausalLM`): DeepSeek-V3's latent attention with Ministral 3's
    /// queries scaled by position (`llama_4_scaling_beta`), dense first layers
    /// (`first_k_dense_replace`, default none), then V3's experts chosen by softmax score
    /// without a correction bias (its groups by their two best scores), renormalised,
    /// scaled.
    Mistral4,
    /// DeepSeek-V2 and V2.5 (V2-Lite): V3's latent attention with rope always pairing
    /// neighbours, and experts routed by softmax scores in groups (`Scoring::Softmax`).
    DeepseekV2,
    /// LFM2 (350M, 700M, 1.2B, 2.6B; `Lfm2ForCausalLM`): most layers are gated short
    /// convolutions ([`ShortConvConfig`]), the others attention with per-head q/k norms; its
    /// own names for the norms (`operator_norm`, `ffn_norm`, `q_layernorm`, `k_layernorm`,
    /// the final `embedding_norm`), the attention's output (`out_proj`) and the MLP
    /// (`feed_forward.w1`/`w3`/`w2`: [`DenseMlpNames::Lfm2`]).
    Lfm2,
    /// LFM2-MoE (8B-A1B; `Lfm2MoeForCausalLM`): LFM2's layers, the MLPs after the first
    /// `num_dense_layers` sparse ([`ExpertNaming::Lfm2`]): sigmoid scores chosen with a
    /// per-expert bias, renormalised, scaled.
    Lfm2Moe,
    /// Qwen3-Next (`Qwen3NextForCausalLM`, 80B-A3B): Qwen3.5's layers (below; Qwen3.5 took
    /// them over), its DeltaNets' input projections stored grouped by key head
    /// ([`DeltaNetProjections::GroupedByKeyHead`]); Qwen2-MoE's MLPs (sparse by
    /// `decoder_sparse_step` and `mlp_only_layers`, the top k renormalised unless
    /// `norm_topk_prob` is false, a shared expert under its sigmoid gate).
    Qwen3Next,
    /// Qwen3.5 (`Qwen3_5ForCausalLM`, the text model of its dense checkpoints): three of every
    /// four layers gated DeltaNets ([`LinearAttentionConfig`]), whose per-sequence state lives
    /// outside the pages (`kv::state`); the others attention with per-head q/k norms and an
    /// output gate (`q_proj` makes each head's query and gate), a quarter of each head
    /// rotating; every RMSNorm but the DeltaNet's scales by `1 + w`.
    Qwen3_5,
    /// Bamba (`BambaForCausalLM`, 9B): Granite 4.0-H's Mamba2 mixers in every layer but those
    /// `attn_layer_indices` names, which attend with half of each head rotating; Llama's MLP
    /// under `feed_forward`, norms `input_layernorm` and `pre_ff_layernorm`, the final one
    /// `final_layernorm`.
    Bamba,
    /// Qwen3.5's mixture of experts (`Qwen3_5MoeForCausalLM`, the text model of
    /// Qwen3.5-35B-A3B, 122B-A10B, 397B-A17B): Qwen3.5's layers, every MLP sparse (Qwen2-MoE's:
    /// a softmax router whose top k are always renormalised, experts `moe_intermediate_size`
    /// wide, a shared expert scaled by its sigmoid gate).
    Qwen3_5Moe,
    /// Nemotron-H (`NemotronHForCausalLM`: Nemotron-H 4B/8B/47B/56B, Nemotron Nano 2): each
    /// layer a norm and one sublayer — Granite 4.0-H's Mamba2 mixer, attention without rope,
    /// or an ungated squared-ReLU MLP (`config::nemotron_h`); its checkpoints name every
    /// sublayer `mixer` (`model::nemotron_h_names`).
    NemotronH,
}

impl Architecture {
    /// Each architecture's `*ForCausalLM` class (`architectures`) and its `model_type`, the
    /// fallback for a config without `architectures`.
    const CAUSAL_LM: [(&'static str, &'static str, Architecture); 48] = [
        ("LlamaForCausalLM", "llama", Architecture::Llama),
        ("MistralForCausalLM", "mistral", Architecture::Mistral),
        ("Qwen2ForCausalLM", "qwen2", Architecture::Qwen2),
        ("Qwen3ForCausalLM", "qwen3", Architecture::Qwen3),
        ("Phi3ForCausalLM", "phi3", Architecture::Phi3),
        ("Olmo2ForCausalLM", "olmo2", Architecture::Olmo2),
        ("Olmo3ForCausalLM", "olmo3", Architecture::Olmo3),
        ("GraniteForCausalLM", "granite", Architecture::Granite),
        ("SmolLM3ForCausalLM", "smollm3", Architecture::SmolLm3),
        ("Gemma2ForCausalLM", "gemma2", Architecture::Gemma2),
        ("Gemma3ForCausalLM", "gemma3_text", Architecture::Gemma3),
        ("MixtralForCausalLM", "mixtral", Architecture::Mixtral),
        ("Qwen2MoeForCausalLM", "qwen2_moe", Architecture::Qwen2Moe),
        ("Qwen3MoeForCausalLM", "qwen3_moe", Architecture::Qwen3Moe),
        ("OlmoeForCausalLM", "olmoe", Architecture::Olmoe),
        ("GlmForCausalLM", "glm", Architecture::Glm),
        ("Glm4ForCausalLM", "glm4", Architecture::Glm4),
        ("Ernie4_5ForCausalLM", "ernie4_5", Architecture::Ernie45),
        ("Exaone4ForCausalLM", "exaone4", Architecture::Exaone4),
        (
            "ExaoneMoeForCausalLM",
            "exaone_moe",
            Architecture::ExaoneMoe,
        ),
        (
            "Ministral3ForCausalLM",
            "ministral3",
            Architecture::Ministral3,
        ),
        ("GptOssForCausalLM", "gpt_oss", Architecture::GptOss),
        ("Mistral4ForCausalLM", "mistral4", Architecture::Mistral4),
        ("SeedOssForCausalLM", "seed_oss", Architecture::SeedOss),
        ("Glm4MoeForCausalLM", "glm4_moe", Architecture::Glm4Moe),
        (
            "SolarOpenForCausalLM",
            "solar_open",
            Architecture::SolarOpen,
        ),
        (
            "DeepseekV3ForCausalLM",
            "deepseek_v3",
            Architecture::DeepseekV3,
        ),
        (
            "DeepseekV2ForCausalLM",
            "deepseek_v2",
            Architecture::DeepseekV2,
        ),
        (
            "Glm4MoeLiteForCausalLM",
            "glm4_moe_lite",
            Architecture::Glm4MoeLite,
        ),
        (
            "MiniMaxM2ForCausalLM",
            "minimax_m2",
            Architecture::MiniMaxM2,
        ),
        ("Dots1ForCausalLM", "dots1", Architecture::Dots1),
        ("ApertusForCausalLM", "apertus", Architecture::Apertus),
        ("ArceeForCausalLM", "arcee", Architecture::Arcee),
        ("Lfm2ForCausalLM", "lfm2", Architecture::Lfm2),
        ("Lfm2MoeForCausalLM", "lfm2_moe", Architecture::Lfm2Moe),
        (
            "Qwen3NextForCausalLM",
            "qwen3_next",
            Architecture::Qwen3Next,
        ),
        ("BambaForCausalLM", "bamba", Architecture::Bamba),
        (
            "NemotronHForCausalLM",
            "nemotron_h",
            Architecture::NemotronH,
        ),
        ("Qwen3_5ForCausalLM", "qwen3_5_text", Architecture::Qwen3_5),
        (
            "Qwen3_5MoeForCausalLM",
            "qwen3_5_moe_text",
            Architecture::Qwen3_5Moe,
        ),
        (
            "HunYuanDenseV1ForCausalLM",
            "hunyuan_v1_dense",
            Architecture::HunYuanDense,
        ),
        (
            "HunYuanMoEV1ForCausalLM",
            "hunyuan_v1_moe",
            Architecture::HunYuanMoe,
        ),
        (
            "Ernie4_5_MoeForCausalLM",
            "ernie4_5_moe",
            Architecture::Ernie45Moe,
        ),
        (
            "GraniteMoeForCausalLM",
            "granitemoe",
            Architecture::GraniteMoe,
        ),
        (
            "GraniteMoeSharedForCausalLM",
            "granitemoeshared",
            Architecture::GraniteMoeShared,
        ),
        (
            "GraniteMoeHybridForCausalLM",
            "granitemoehybrid",
            Architecture::GraniteMoeHybrid,
        ),
        (
            "GraniteSWAForCausalLM",
            "granite_swa",
            Architecture::GraniteSwa,
        ),
        (
            "GraniteMoeSWAForCausalLM",
            "granitemoe_swa",
            Architecture::GraniteMoeSwa,
        ),
    ];

    /// Sequence classifiers (reward models, classifiers: `score` instead of `lm_head`) of the
    /// dense families; transformers has no MoE classifier heads.
    const CLASSIFIERS: [(&'static str, Architecture); 15] = [
        ("LlamaForSequenceClassification", Architecture::Llama),
        ("MistralForSequenceClassification", Architecture::Mistral),
        ("Qwen2ForSequenceClassification", Architecture::Qwen2),
        ("Qwen3ForSequenceClassification", Architecture::Qwen3),
        ("Phi3ForSequenceClassification", Architecture::Phi3),
        ("Gemma2ForSequenceClassification", Architecture::Gemma2),
        ("Gemma3TextForSequenceClassification", Architecture::Gemma3),
        // AI2's OLMo 2 reward models (Tülu 3's), and the newer families' heads.
        ("Olmo2ForSequenceClassification", Architecture::Olmo2),
        ("Olmo3ForSequenceClassification", Architecture::Olmo3),
        ("GlmForSequenceClassification", Architecture::Glm),
        ("Glm4ForSequenceClassification", Architecture::Glm4),
        ("Exaone4ForSequenceClassification", Architecture::Exaone4),
        (
            "Ministral3ForSequenceClassification",
            Architecture::Ministral3,
        ),
        ("SmolLM3ForSequenceClassification", Architecture::SmolLm3),
        ("SeedOssForSequenceClassification", Architecture::SeedOss),
    ];

    /// Which of each layer's projections checkpoints store as one matrix.
    pub fn fused(self) -> Fused {
        match self {
            Architecture::Phi3 => Fused {
                qkv: true,
                gate_up: true,
                ..Fused::default()
            },
            Architecture::Glm | Architecture::Glm4 => Fused {
                qkv: false,
                gate_up: true,
                ..Fused::default()
            },
            // Its dense MLP is Granite MoE Shared's shared MLP.
            Architecture::GraniteMoeHybrid => Fused {
                qkv: false,
                gate_up: true,
                mlp: DenseMlpNames::GraniteShared,
            },
            Architecture::Lfm2 | Architecture::Lfm2Moe => Fused {
                mlp: DenseMlpNames::Lfm2,
                ..Fused::default()
            },
            Architecture::Bamba => Fused {
                mlp: DenseMlpNames::FeedForward,
                ..Fused::default()
            },
            _ => Fused::default(),
        }
    }

    /// Whether rope pairs each head's neighbouring dimensions (`2i`, `2i + 1`: GLM's and
    /// ERNIE's) rather than its halves (`i`, `i + rotary_dim/2`: everyone else's).
    pub fn rope_interleaved(self) -> bool {
        matches!(
            self,
            Architecture::Glm
                | Architecture::Glm4
                | Architecture::Ernie45
                | Architecture::Ernie45Moe
        )
    }

    /// Each decoder layer's norms by their checkpoint names, in the order they apply: before
    /// the attention, on its output (before the residual add), before the MLP, on its output.
    /// The Llama family norms each sublayer's input; OLMo 2 and EXAONE 4 each sublayer's
    /// output (their `post_attention_layernorm` is on the attention's output, not the MLP's
    /// input); Gemma 2/3 and GLM-4 both.
    pub fn sublayer_norms(self) -> [Option<&'static str>; 4] {
        match self {
            Architecture::Olmo2 | Architecture::Olmo3 | Architecture::Exaone4 => [
                None,
                Some("post_attention_layernorm"),
                None,
                Some("post_feedforward_layernorm"),
            ],
            Architecture::Gemma2 | Architecture::Gemma3 => [
                Some("input_layernorm"),
                Some("post_attention_layernorm"),
                Some("pre_feedforward_layernorm"),
                Some("post_feedforward_layernorm"),
            ],
            Architecture::Glm4 => [
                Some("input_layernorm"),
                Some("post_self_attn_layernorm"),
                Some("post_attention_layernorm"),
                Some("post_mlp_layernorm"),
            ],
            Architecture::Apertus => [
                Some("attention_layernorm"),
                None,
                Some("feedforward_layernorm"),
                None,
            ],
            Architecture::Lfm2 | Architecture::Lfm2Moe => {
                [Some("operator_norm"), None, Some("ffn_norm"), None]
            }
            Architecture::Bamba => [
                Some("input_layernorm"),
                None,
                Some("pre_ff_layernorm"),
                None,
            ],
            _ => [
                Some("input_layernorm"),
                None,
                Some("post_attention_layernorm"),
                None,
            ],
        }
    }

    /// Whether each layer's MLP is ungated, `down(act(up(x)))`, and by which activation,
    /// rather than `down(act(gate(x)) · up(x))`.
    pub fn ungated_mlp(self) -> Option<UngatedMlp> {
        match self {
            Architecture::Apertus => Some(UngatedMlp::Xielu),
            Architecture::Arcee | Architecture::NemotronH => Some(UngatedMlp::Relu2),
            _ => None,
        }
    }

    /// Whether each attention head has a learned sink logit (`self_attn.sinks`) that joins its
    /// softmax without a value (gpt-oss).
    pub fn has_attention_sinks(self) -> bool {
        matches!(
            self,
            Architecture::GptOss | Architecture::GraniteSwa | Architecture::GraniteMoeSwa
        )
    }

    /// The q/k norms' module names, and whether they apply after rope (HunYuan's) rather
    /// than before it.
    pub fn qk_norms(self) -> (&'static str, &'static str, bool) {
        match self {
            Architecture::HunYuanDense | Architecture::HunYuanMoe => {
                ("query_layernorm", "key_layernorm", true)
            }
            Architecture::Lfm2 | Architecture::Lfm2Moe => ("q_layernorm", "k_layernorm", false),
            _ => ("q_norm", "k_norm", false),
        }
    }

    /// LFM2 and LFM2-MoE: short convolutions, and LFM2's names.
    pub fn is_lfm2(self) -> bool {
        matches!(self, Architecture::Lfm2 | Architecture::Lfm2Moe)
    }

    /// The attention's output projection inside a layer.
    pub fn o_proj_module(self) -> &'static str {
        match self {
            Architecture::Lfm2 | Architecture::Lfm2Moe => "self_attn.out_proj",
            _ => "self_attn.o_proj",
        }
    }

    /// The final norm's weight (before the LM head).
    pub fn final_norm(self) -> &'static str {
        match self {
            Architecture::Lfm2 | Architecture::Lfm2Moe => "model.embedding_norm.weight",
            Architecture::Bamba => "model.final_layernorm.weight",
            _ => "model.norm.weight",
        }
    }

    /// Whether `q_proj` makes each head's query and then its output gate (`2 · head_dim` per
    /// head), the attention's output multiplied by the gate's sigmoid (Qwen3.5).
    pub fn attention_output_gate(self) -> bool {
        self.has_qwen3_next_layers()
    }

    /// Qwen3-Next's layer design, which Qwen3.5 (dense or with experts) took over: gated
    /// DeltaNets beside gated attention, `1 + w` norms, a quarter of each head rotating.
    pub fn has_qwen3_next_layers(self) -> bool {
        matches!(
            self,
            Architecture::Qwen3Next | Architecture::Qwen3_5 | Architecture::Qwen3_5Moe
        )
    }

    /// Whether q/k are normed over the whole projection (OLMo 2: `q_norm` of
    /// `heads × head_dim`) rather than per head.
    pub fn norms_whole_qk(self) -> bool {
        matches!(
            self,
            Architecture::Olmo2
                | Architecture::Olmo3
                | Architecture::Olmoe
                | Architecture::MiniMaxM2
        )
    }

    /// Gemma 2 and 3: norms scaling by `1 + w`, GeGLU named by `hidden_activation`,
    /// embeddings times √hidden, attention scaled by `query_pre_attn_scalar^-½`, soft caps.
    pub fn is_gemma(self) -> bool {
        matches!(self, Architecture::Gemma2 | Architecture::Gemma3)
    }

    /// What every RMSNorm's weight is offset by: Gemma's norms scale by `1 + w` (its weights
    /// are stored as the difference from 1).
    pub fn norm_weight_offset(self) -> f64 {
        if self.is_gemma() || self.has_qwen3_next_layers() {
            1.0
        } else {
            0.0
        }
    }

    fn supported_list() -> String {
        let names: Vec<&str> = Self::CAUSAL_LM
            .iter()
            .map(|(n, _, _)| *n)
            .chain(Self::CLASSIFIERS.iter().map(|(n, _)| *n))
            .collect();
        names.join(", ")
    }
}

/// Which projections of a layer a checkpoint stores fused ([`Architecture::fused`]), and
/// under which names its dense MLP is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Fused {
    /// q/k/v as one `self_attn.qkv_proj` (rows q, then k, then v), without biases.
    pub qkv: bool,
    /// gate/up as one matrix (gate rows first), without biases: `mlp.gate_up_proj`.
    pub gate_up: bool,
    pub mlp: DenseMlpNames,
}

/// Where a layer's dense MLP is in checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DenseMlpNames {
    /// `mlp.gate_proj`, `mlp.up_proj` (fused: `mlp.gate_up_proj`), `mlp.down_proj`.
    #[default]
    Mlp,
    /// Granite 4's: gate and up fused in `shared_mlp.input_linear` (gate rows first), down
    /// in `shared_mlp.output_linear`.
    GraniteShared,
    /// LFM2's: `feed_forward.w1` (gate), `feed_forward.w3` (up), `feed_forward.w2` (down).
    Lfm2,
    /// Bamba's: Llama's names under `feed_forward`.
    FeedForward,
}

impl Fused {
    /// The module of the fused gate/up matrix (where [`Fused::gate_up`]).
    pub fn gate_up_module(self) -> &'static str {
        match self.mlp {
            DenseMlpNames::Mlp | DenseMlpNames::Lfm2 | DenseMlpNames::FeedForward => {
                "mlp.gate_up_proj"
            }
            DenseMlpNames::GraniteShared => "shared_mlp.input_linear",
        }
    }

    /// The modules of the gate and up projections stored apart.
    pub fn gate_and_up_modules(self) -> [&'static str; 2] {
        match self.mlp {
            DenseMlpNames::Lfm2 => ["feed_forward.w1", "feed_forward.w3"],
            DenseMlpNames::FeedForward => ["feed_forward.gate_proj", "feed_forward.up_proj"],
            DenseMlpNames::Mlp | DenseMlpNames::GraniteShared => ["mlp.gate_proj", "mlp.up_proj"],
        }
    }

    /// The module of the down projection.
    pub fn down_module(self) -> &'static str {
        match self.mlp {
            DenseMlpNames::Mlp => "mlp.down_proj",
            DenseMlpNames::GraniteShared => "shared_mlp.output_linear",
            DenseMlpNames::Lfm2 => "feed_forward.w2",
            DenseMlpNames::FeedForward => "feed_forward.down_proj",
        }
    }
}

/// The MLP's gate activation: `down(act(gate(x)) · up(x))`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Activation {
    /// SiLU (`silu`, `swish`): SwiGLU.
    #[default]
    Silu,
    /// GELU's tanh form (`gelu_pytorch_tanh`, `gelu_new`): GeGLU.
    GeluTanh,
}

impl Activation {
    /// transformers' `ACT2FN` name; `None` for one detspec does not implement (`gelu`, the
    /// erf form, among them).
    fn from_hf(name: &str) -> Option<Self> {
        match name {
            "silu" | "swish" => Some(Activation::Silu),
            "gelu_pytorch_tanh" | "gelu_new" => Some(Activation::GeluTanh),
            _ => None,
        }
    }
}

/// An ungated MLP's activation ([`Architecture::ungated_mlp`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UngatedMlp {
    /// Apertus's xIELU, its scalars each layer's parameters (`mlp.act_fn.*`).
    Xielu,
    /// Arcee's squared ReLU (`relu2`).
    Relu2,
}

impl UngatedMlp {
    /// Its `hidden_act` name.
    fn hf_name(self) -> &'static str {
        match self {
            UngatedMlp::Xielu => "xielu",
            UngatedMlp::Relu2 => "relu2",
        }
    }
}

/// gpt-oss's expert activation: with `g`, `u` the gate's and up's outputs, `g` clamped to at
/// most `limit` and `u` to `[-limit, limit]`, the expert's hidden state is
/// `(u + 1) · g · σ(alpha · g)` (transformers' `GptOssExperts._apply_gate`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClampedSwiglu {
    pub alpha: f64,
    pub limit: f64,
}

/// Granite's multipliers (transformers' `GraniteForCausalLM`): the embeddings are multiplied
/// by `embedding`, each sublayer's output by `residual` before the residual add, attention
/// scores by `attention` (in place of `1/√head_dim`), and the logits divided by `logits`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GraniteScales {
    pub embedding: f64,
    pub residual: f64,
    pub attention: f64,
    pub logits: f64,
}

/// The decoder's hyper-parameters, normalised across architectures.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    pub rope: RopeConfig,
    /// How many of each head's dimensions rotate: the first `rotary_dim`, the rest pass
    /// through. `head_dim` but for GLM's (half) and Phi-4-mini's and other Phi-3-layout
    /// models' with `partial_rotary_factor` below 1.
    pub rotary_dim: usize,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Bias on the q/k/v projections (always on for Qwen2; `attention_bias` elsewhere).
    pub qkv_bias: bool,
    /// Bias on the output projection (Llama's `attention_bias` covers o_proj too).
    pub o_bias: bool,
    /// Bias on the MLP projections (Llama's `mlp_bias`).
    pub mlp_bias: bool,
    /// RMSNorm on q and k before rope: per head (Qwen3, Gemma 3), or over the whole projection
    /// (OLMo 2, [`Architecture::norms_whole_qk`]).
    pub qk_norm: bool,
    /// The MLP's gate activation.
    pub hidden_act: Activation,
    /// Ministral 3's query scaling: after rope, each query is multiplied by
    /// `1 + β · ln(1 + ⌊position / original context⌋)` (transformers'
    /// `get_llama_4_attn_scale`), 1 within the original context. `(β, original context)`.
    pub query_scale_beta: Option<(f64, f64)>,
    /// Gemma's attention scale, `query_pre_attn_scalar^-½` in place of `head_dim^-½`.
    pub query_pre_attn_scalar: Option<f64>,
    /// gpt-oss's experts' activation (`None`: SwiGLU, or the dense MLP's `hidden_act`).
    pub clamped_swiglu: Option<ClampedSwiglu>,
    /// gpt-oss's experts stored in MXFP4 (`quantization_config.quant_method: mxfp4`).
    pub mxfp4_experts: bool,
    /// Linear weights stored in FP8, widened at load ([`Fp8Weights`]).
    pub fp8_weights: Option<Fp8Weights>,
    /// Gemma's tanh soft caps, `c · tanh(x / c)`: on the scaled attention scores (before the
    /// softmax) and on the logits.
    pub attn_logit_softcapping: Option<f64>,
    pub final_logit_softcapping: Option<f64>,
    /// The mixture-of-experts settings of a sparse architecture (`None`: every layer's MLP is
    /// dense).
    pub moe: Option<MoeConfig>,
    /// LFM2's short-convolution layers (`None`: every layer attends).
    pub short_conv: Option<ShortConvConfig>,
    /// Qwen3-Next's and Qwen3.5's linear-attention layers (`None`: every layer attends).
    pub linear_attention: Option<LinearAttentionConfig>,
    /// Granite 4.0-H's Mamba2 layers (`None`: every layer attends).
    pub mamba: Option<MambaConfig>,
    /// Nemotron-H's layers each hold one sublayer, a mixer (Mamba2 or attention) or an MLP
    /// (`None`: every layer holds both).
    pub sublayers: Option<Vec<Sublayer>>,
    /// DeepSeek's latent attention (`None`: q/k/v projections). With it, `head_dim` is a
    /// head's query/key width, `rotary_dim` its rotated part's, and every head has its own
    /// key and value (`num_key_value_heads` = `num_attention_heads`).
    pub mla: Option<MlaConfig>,
    /// Sliding-window attention span, when the checkpoint enables it.
    pub sliding_window: Option<usize>,
    /// Which layers attend within `sliding_window` (`layer_types`, OLMo 3); `None`: every
    /// layer does when there is a window.
    pub sliding_layers: Option<Vec<bool>>,
    /// The sliding-window layers' rope where it differs from the others' (OLMo 3: `rope` is
    /// then the full-attention layers').
    pub rope_sliding: Option<RopeConfig>,
    /// Granite's multipliers (`None` elsewhere).
    pub granite: Option<GraniteScales>,
    /// Which layers rotate q and k (SmolLM3's `no_rope_layers`: 0 marks a layer without;
    /// EXAONE 4's sliding layers only); `None`: every layer does.
    pub rope_layers: Option<Vec<bool>>,
    /// `eos_token_id` from config.json (generation_config.json is read by the tokenizer module).
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    /// The checkpoint's declared dtype (`torch_dtype`, or `dtype` in newer transformers), e.g.
    /// `bfloat16`: what a GPU engine runs in by default.
    pub torch_dtype: Option<String>,
    /// What the last hidden state feeds: next-token logits, or a sequence classifier's labels.
    pub head: Head,
    /// Where this config came from, for error messages.
    pub path: PathBuf,
}

/// Granite SWA's layer kinds and rope by layer ([`ModelConfig::granite_swa_layers`]).
struct GraniteSwaLayers {
    sliding: Vec<bool>,
    rope_full: RopeConfig,
    rope_sliding: Option<RopeConfig>,
    rope_layers: Option<Vec<bool>>,
}

/// `config.json` as written: every field the decoder reads, with serde's types (a wrong type
/// is an error naming the field, via [`super::json::parse_json`]); the ranges and the fields'
/// relations are checked in [`ModelConfig::from_json_str`].
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    /// A sequence classifier's label names by id (transformers writes it when it is not the
    /// default two labels).
    id2label: Option<BTreeMap<String, String>>,
    model_type: Option<String>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: Option<usize>,
    rms_norm_eps: Option<f64>,
    max_position_embeddings: Option<usize>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    /// Qwen2-MoE's bias switch for q/k/v.
    qkv_bias: Option<bool>,
    tie_word_embeddings: Option<bool>,
    use_sliding_window: Option<bool>,
    sliding_window: Option<usize>,
    eos_token_id: TokenIds,
    bos_token_id: TokenIds,
    torch_dtype: Option<Value>,
    dtype: Option<Value>,
    rope_theta: Option<f64>,
    /// Phi-3's and GPT-NeoX's: rotate only this share of each head (refused unless 1).
    partial_rotary_factor: Option<f64>,
    /// MiniMax-M2's rotated width per head.
    rotary_dim: Option<usize>,
    /// dots.llm1's first sliding layer where `layer_types` is absent.
    max_window_layers: Option<usize>,
    /// Granite 4's: its experts (0: none), its shared MLP's width (the dense MLP's without
    /// experts), each layer's kind, and whether attention rotates (`"rope"`).
    num_local_experts: Option<usize>,
    shared_intermediate_size: Option<usize>,
    position_embedding_type: Option<String>,
    /// Phi-3 keeps the pre-scaling context here, beside `rope_scaling`; it wins over the one
    /// inside (as transformers reads it).
    original_max_position_embeddings: Option<f64>,
    /// Granite's multipliers.
    embedding_multiplier: Option<f64>,
    residual_multiplier: Option<f64>,
    attention_multiplier: Option<f64>,
    logits_scaling: Option<f64>,
    /// SmolLM3's layers with rope (1) and without (0), or the interval of those without.
    no_rope_layers: Option<Vec<u8>>,
    no_rope_layer_interval: Option<usize>,
    /// Each layer's attention, `sliding_attention` or `full_attention` (OLMo 3, Gemma 3).
    layer_types: Option<Vec<String>>,
    /// Gemma 3 and EXAONE 4 without `layer_types`: every this-many-th layer attends to every
    /// key (a count, or EXAONE's spelling of it, `"LLLG"`).
    sliding_window_pattern: Option<Value>,
    /// Granite SWA's rope theta per layer (0: no rope).
    layer_rope_theta: Option<Vec<f64>>,
    /// Gemma 3's sliding layers' rope theta (classic keys; `rope_theta` is the full layers').
    rope_local_base_freq: Option<f64>,
    /// Gemma's attention scale (`query_pre_attn_scalar^-½`).
    query_pre_attn_scalar: Option<f64>,
    /// Gemma's tanh caps on the attention scores and the logits (read for Gemma only, as
    /// transformers reads them), and EmbeddingGemma's attention both ways (refused).
    attn_logit_softcapping: Option<f64>,
    final_logit_softcapping: Option<f64>,
    use_bidirectional_attention: Option<bool>,
    /// OLMo's clamp of q, k and v (refused).
    clip_qkv: Option<f64>,
    /// ERNIE 4.5's bias switch for every projection.
    use_bias: Option<bool>,
    /// Seed-OSS's bias switch for o_proj (`attention_bias` is q/k/v's).
    attention_out_bias: Option<bool>,
    /// GLM-4.5's switch for per-head q/k norms.
    use_qk_norm: Option<bool>,
    /// gpt-oss's experts' activation ([`ClampedSwiglu`]).
    swiglu_alpha: Option<f64>,
    swiglu_limit: Option<f64>,
    /// A quantized checkpoint's method and settings (`super::quant`).
    quantization_config: Option<Value>,
    /// Newer transformers: `rope_theta` and the scaling in one object.
    rope_parameters: Option<RawRope>,
    rope_scaling: Option<RawRope>,
    /// The MLP's activation (Gemma's key: `hidden_activation`); one detspec does not
    /// implement is refused rather than run as another.
    hidden_act: Option<String>,
    hidden_activation: Option<String>,
    /// Nemotron-H's names for `hidden_act` and `rms_norm_eps`.
    mlp_hidden_act: Option<String>,
    layer_norm_epsilon: Option<f64>,
}

impl ModelConfig {
    /// Reads `config.json` from a model directory.
    pub fn from_model_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| DetspecError::io(&path, e))?;
        Self::from_json_str(&text, &path)
    }

    /// Parses config JSON; `path` is only used in error messages. A multimodal checkpoint's
    /// language model is read from its `text_config` (errors name fields under it).
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        match decoder_json(text, path)? {
            None => Self::from_flat_json(text, path),
            Some((flat, None)) => Self::from_flat_json(&flat, path),
            Some((flat, Some(prefix))) => Self::from_flat_json(&flat, path).map_err(|e| match e {
                DetspecError::InvalidConfig {
                    path,
                    field,
                    message,
                } => DetspecError::InvalidConfig {
                    path,
                    field: format!("{prefix}.{field}"),
                    message,
                },
                e => e,
            }),
        }
    }

    /// [`Self::from_json_str`] of a decoder's own (flat) config.
    fn from_flat_json(text: &str, path: &Path) -> Result<Self> {
        let raw: RawConfig = parse_json(text, path)?;
        let err = |field: &str, message: String| DetspecError::InvalidConfig {
            path: path.to_path_buf(),
            field: field.to_string(),
            message,
        };
        let positive = |field: &str, v: Option<usize>| -> Result<usize> {
            match v {
                None => Err(err(field, "missing".into())),
                Some(0) => Err(err(field, "must be > 0".into())),
                Some(v) => Ok(v),
            }
        };

        let (architecture, head) = Self::parse_architecture(&raw, path)?;
        let nemotron_h = (architecture == Architecture::NemotronH)
            .then(|| parse_json::<RawNemotronH>(text, path)?.check(path))
            .transpose()?;
        // A quantized checkpoint is read in the formats `super::quant` names (FP8 weights,
        // gpt-oss's MXFP4 experts) and refused otherwise, naming the method, rather than
        // failing on the first tensor.
        let quantization = raw
            .quantization_config
            .as_ref()
            .map(parse_quantization)
            .transpose()
            .map_err(|(field, message)| err(&field, message))?;
        let mxfp4_experts = quantization == Some(Quantization::Mxfp4);
        if mxfp4_experts && architecture != Architecture::GptOss {
            return Err(err(
                "quantization_config.quant_method",
                "mxfp4: read for gpt-oss's experts only; load the unquantized checkpoint".into(),
            ));
        }
        let fp8_weights = match quantization {
            Some(Quantization::Fp8(w)) => Some(w),
            _ => None,
        };
        // Gemma's defaults are in the config by now (`super::text_config`).
        let gemma = architecture.is_gemma();
        let (act_field, act_name) = if gemma {
            let name = raw.hidden_activation.as_deref();
            (
                "hidden_activation",
                name.ok_or_else(|| err("hidden_activation", "missing".into()))?,
            )
        } else if nemotron_h.is_some() {
            (
                "mlp_hidden_act",
                raw.mlp_hidden_act.as_deref().unwrap_or("relu2"),
            )
        } else {
            ("hidden_act", raw.hidden_act.as_deref().unwrap_or("silu"))
        };
        // An ungated MLP (Apertus's xIELU, Arcee's squared ReLU) runs its own activation;
        // `hidden_act` (the gate's) is then unused.
        let act_name = match architecture.ungated_mlp() {
            Some(u) if act_name != u.hf_name() => {
                return Err(err(
                    act_field,
                    format!(
                        "`{act_name}`: {architecture:?}'s ungated MLP runs {} only",
                        u.hf_name()
                    ),
                ))
            }
            Some(_) => "silu",
            None => act_name,
        };
        let hidden_act = Activation::from_hf(act_name).ok_or_else(|| {
            err(
                act_field,
                format!(
                    "unsupported activation `{act_name}` (supported: silu, swish, \
                     gelu_pytorch_tanh, gelu_new)"
                ),
            )
        })?;
        let cap = |field: &str, value: Option<f64>| match value.filter(|_| gemma) {
            Some(c) if !(c.is_finite() && c > 0.0) => {
                Err(err(field, format!("{c}: a soft cap must be > 0")))
            }
            c => Ok(c),
        };
        let attn_logit_softcapping = cap("attn_logit_softcapping", raw.attn_logit_softcapping)?;
        // transformers caps a causal LM's logits, not a classifier's scores.
        let final_logit_softcapping = cap("final_logit_softcapping", raw.final_logit_softcapping)?
            .filter(|_| head == Head::LanguageModel);
        if raw.use_bidirectional_attention == Some(true) {
            return Err(err(
                "use_bidirectional_attention",
                "a decoder attends causally (bidirectional attention is an embedding model's)"
                    .into(),
            ));
        }
        let hidden_size = positive("hidden_size", raw.hidden_size)?;
        let num_attention_heads = positive("num_attention_heads", raw.num_attention_heads)?;
        // Latent attention expands its keys and values to every head. V2's rope always pairs
        // neighbours (it rotates complex numbers).
        let mla = matches!(
            architecture,
            Architecture::DeepseekV3
                | Architecture::DeepseekV2
                | Architecture::Glm4MoeLite
                | Architecture::Mistral4
        )
        .then(|| parse_json::<RawMla>(text, path)?.check(path))
        .transpose()?
        .map(|m| MlaConfig {
            rope_interleave: m.rope_interleave || architecture == Architecture::DeepseekV2,
            ..m
        });
        let num_key_value_heads = match &mla {
            Some(_) => num_attention_heads,
            None => raw.num_key_value_heads.unwrap_or(num_attention_heads),
        };
        if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
            return Err(err(
                "num_key_value_heads",
                format!("{num_key_value_heads} does not divide num_attention_heads={num_attention_heads}"),
            ));
        }
        // Seed-OSS's heads are 128 wide where its config does not say (transformers' default).
        let raw_head_dim = match architecture {
            Architecture::SeedOss => raw.head_dim.or(Some(128)),
            _ => raw.head_dim,
        };
        let head_dim = match raw_head_dim {
            // A latent-attention head's query/key width (its config's `head_dim` is the
            // rotated part's).
            _ if mla.is_some() => mla.as_ref().map_or(0, MlaConfig::qk_head_dim),
            Some(d) if d > 0 => d,
            Some(_) => return Err(err("head_dim", "must be > 0".into())),
            None => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(err(
                        "hidden_size",
                        "not divisible by num_attention_heads and no head_dim given".into(),
                    ));
                }
                hidden_size / num_attention_heads
            }
        };
        if head_dim % 2 != 0 {
            return Err(err(
                "head_dim",
                format!("rotary embeddings need an even head_dim, got {head_dim}"),
            ));
        }
        // Nemotron-H's layer count is its list of blocks' length (transformers ignores
        // `num_hidden_layers` beside it).
        let num_hidden_layers = match &nemotron_h {
            Some(n) => n.sublayers.len(),
            None => positive("num_hidden_layers", raw.num_hidden_layers)?,
        };
        // Granite 4.0-H's Mamba2 layers (its attention-only models have none).
        let mamba = match architecture {
            Architecture::GraniteMoeHybrid | Architecture::Bamba => Some(
                parse_json::<RawMamba>(text, path)?.check(path, num_hidden_layers, hidden_size)?,
            )
            .filter(|m| m.layers.iter().any(|&l| l)),
            Architecture::NemotronH => nemotron_h
                .as_ref()
                .map(|n| n.mamba.clone())
                .filter(|m| m.layers.iter().any(|&l| l)),
            _ => None,
        };
        let lfm2 = architecture
            .is_lfm2()
            .then(|| {
                // LFM2-MoE's dense MLPs are `intermediate_size` wide as written.
                let adjusts = architecture == Architecture::Lfm2;
                parse_json::<RawLfm2>(text, path)?.check(path, num_hidden_layers, adjusts)
            })
            .transpose()?;
        let (eps_field, eps) = match &lfm2 {
            Some(Lfm2Shape { norm_eps, .. }) => ("norm_eps", *norm_eps),
            None if nemotron_h.is_some() => {
                ("layer_norm_epsilon", raw.layer_norm_epsilon.or(Some(1e-5)))
            }
            None => ("rms_norm_eps", raw.rms_norm_eps),
        };
        let rms_norm_eps = eps.unwrap_or(1e-6);
        if rms_norm_eps.is_nan() || rms_norm_eps <= 0.0 {
            return Err(err(eps_field, "must be > 0".into()));
        }
        let max_position_embeddings = raw.max_position_embeddings.unwrap_or(4096);
        if max_position_embeddings == 0 {
            return Err(err("max_position_embeddings", "must be > 0".into()));
        }
        let attention_bias = raw.attention_bias.unwrap_or(false);
        // ERNIE's one switch for every projection's bias.
        let use_bias = raw.use_bias.unwrap_or(false);
        if use_bias && architecture == Architecture::Ernie45Moe {
            return Err(err(
                "use_bias",
                "true: biases on ERNIE 4.5 MoE's projections and shared experts are not supported"
                    .into(),
            ));
        }
        let (qkv_bias, o_bias) = match architecture {
            Architecture::Qwen2 => (true, false),
            Architecture::Qwen2Moe => (raw.qkv_bias.unwrap_or(true), false),
            // Its fused matrices have no biases (transformers' `Phi3Attention`, `Phi3MLP`);
            // Nemotron-H's attention (Jamba's) has none whatever `attention_bias` says.
            Architecture::Phi3 | Architecture::NemotronH => (false, false),
            // `attention_bias` (on by default) is q/k/v's; o_proj has none.
            Architecture::Glm | Architecture::Glm4 => (raw.attention_bias.unwrap_or(true), false),
            Architecture::Ernie45 => (use_bias, use_bias),
            Architecture::Glm4Moe | Architecture::SolarOpen => (attention_bias, false),
            Architecture::SeedOss => (
                raw.attention_bias.unwrap_or(true),
                raw.attention_out_bias.unwrap_or(false),
            ),
            // transformers' default is on; every gpt-oss checkpoint has them.
            Architecture::GptOss => {
                let on = raw.attention_bias.unwrap_or(true);
                (on, on)
            }
            _ => (attention_bias, attention_bias),
        };
        let sliding_window = match architecture {
            Architecture::Mistral
            | Architecture::Ministral3
            | Architecture::Mixtral
            | Architecture::Phi3
            | Architecture::Gemma2
            | Architecture::Gemma3
            | Architecture::Exaone4
            | Architecture::ExaoneMoe => raw.sliding_window,
            // transformers' default where the config has none.
            Architecture::GptOss | Architecture::GraniteSwa | Architecture::GraniteMoeSwa => {
                raw.sliding_window.or(Some(128))
            }
            // transformers' default where the config has none.
            Architecture::Olmo3 => raw.sliding_window.or(Some(4096)),
            Architecture::Qwen2
            | Architecture::Qwen3
            | Architecture::Qwen2Moe
            | Architecture::Qwen3Moe => {
                if raw.use_sliding_window.unwrap_or(false) {
                    raw.sliding_window
                } else {
                    None
                }
            }
            Architecture::Llama
            | Architecture::Olmo2
            | Architecture::Olmoe
            | Architecture::Granite
            | Architecture::GraniteMoe
            | Architecture::GraniteMoeShared
            | Architecture::Glm
            | Architecture::Glm4
            | Architecture::Ernie45
            | Architecture::SeedOss
            | Architecture::Glm4Moe
            | Architecture::SolarOpen
            | Architecture::Mistral4
            | Architecture::DeepseekV3
            | Architecture::DeepseekV2
            | Architecture::Glm4MoeLite
            | Architecture::MiniMaxM2
            | Architecture::Ernie45Moe
            | Architecture::GraniteMoeHybrid
            | Architecture::HunYuanDense
            | Architecture::HunYuanMoe
            | Architecture::Apertus
            | Architecture::Arcee
            | Architecture::Lfm2
            | Architecture::Lfm2Moe
            | Architecture::Qwen3Next
            | Architecture::Qwen3_5
            | Architecture::Qwen3_5Moe
            | Architecture::Bamba
            | Architecture::NemotronH => None,
            // Its window applies to its sliding layers only (below).
            Architecture::Dots1 => raw.sliding_window,
            // Its window applies to the layers without rope only (below).
            Architecture::SmolLm3 => raw
                .sliding_window
                .filter(|_| raw.use_sliding_window.unwrap_or(false)),
        };
        // Granite 4 without experts: its shared MLP is the dense one (transformers' default
        // width 1024).
        let intermediate_size = match architecture {
            Architecture::GraniteMoeHybrid if raw.num_local_experts == Some(0) => positive(
                "shared_intermediate_size",
                raw.shared_intermediate_size.or(Some(1024)),
            )?,
            // Every MLP sparse: no dense width to read (its class has none).
            Architecture::Qwen3_5Moe => raw.intermediate_size.unwrap_or(0),
            _ => match &lfm2 {
                Some(shape) => shape.intermediate_size,
                None => positive("intermediate_size", raw.intermediate_size)?,
            },
        };
        let sparse = |naming, shared_expert, own_width| SparseShape {
            naming,
            shared_expert,
            own_width,
            layer_types: matches!(
                architecture,
                Architecture::Glm4MoeLite | Architecture::ExaoneMoe
            ),
            // Qwen3-Next's config class renormalises by default, Qwen2/3-MoE's do not.
            norm_topk_default: architecture == Architecture::Qwen3Next,
            deepseek_defaults: match architecture {
                Architecture::Dots1 => DeepSeekDefaults::DOTS1,
                Architecture::Glm4MoeLite => DeepSeekDefaults::GLM4_MOE_LITE,
                Architecture::ExaoneMoe => DeepSeekDefaults::EXAONE_MOE,
                Architecture::Mistral4 => DeepSeekDefaults::MISTRAL4,
                Architecture::SolarOpen => DeepSeekDefaults::SOLAR_OPEN,
                _ => DeepSeekDefaults::DEEPSEEK,
            },
        };
        let moe = match architecture {
            Architecture::Mixtral => Some(sparse(ExpertNaming::Mixtral, false, false)),
            Architecture::Qwen2Moe | Architecture::Qwen3Next | Architecture::Qwen3_5Moe => {
                Some(sparse(ExpertNaming::Qwen, true, true))
            }
            Architecture::Qwen3Moe => Some(sparse(ExpertNaming::Qwen, false, true)),
            Architecture::Olmoe => Some(sparse(ExpertNaming::Qwen, false, false)),
            Architecture::GptOss => Some(sparse(ExpertNaming::GptOss, false, false)),
            Architecture::GraniteMoe => Some(sparse(ExpertNaming::Granite, false, false)),
            Architecture::GraniteMoeShared | Architecture::GraniteMoeSwa => {
                Some(sparse(ExpertNaming::Granite, true, false))
            }
            // (transformers' default is 8 experts: a config naming none is read as sparse)
            Architecture::GraniteMoeHybrid if raw.num_local_experts != Some(0) => {
                Some(sparse(ExpertNaming::Granite, true, false))
            }
            Architecture::MiniMaxM2 => Some(sparse(ExpertNaming::Mixtral, false, false)),
            Architecture::Ernie45Moe => Some(sparse(ExpertNaming::Ernie, true, true)),
            Architecture::Lfm2Moe => Some(sparse(ExpertNaming::Lfm2, false, true)),
            Architecture::HunYuanMoe => Some(sparse(ExpertNaming::Hunyuan, true, false)),
            Architecture::Glm4Moe
            | Architecture::DeepseekV3
            | Architecture::DeepseekV2
            | Architecture::Glm4MoeLite
            | Architecture::Dots1
            | Architecture::SolarOpen
            | Architecture::ExaoneMoe
            | Architecture::Mistral4 => Some(sparse(ExpertNaming::DeepSeek, true, true)),
            // Nemotron 3's `moe` layers.
            Architecture::NemotronH
                if nemotron_h
                    .as_ref()
                    .is_some_and(|n| n.sparse.contains(&true)) =>
            {
                Some(sparse(ExpertNaming::DeepSeek, true, true))
            }
            _ => None,
        }
        .map(|shape| {
            // A second pass over the text: a flattened field would lose its name in errors.
            parse_json::<RawMoe>(text, path)?.check(
                path,
                shape,
                num_hidden_layers,
                intermediate_size,
            )
        })
        .transpose()?
        .map(|m| match architecture {
            Architecture::DeepseekV2 => m.with_softmax_scoring(),
            Architecture::MiniMaxM2 => m.with_biased_sigmoid_routing(),
            Architecture::ExaoneMoe => m.with_bias_beside_router(),
            Architecture::Mistral4 => m.with_unbiased_softmax_choice(),
            Architecture::Qwen3_5Moe => m.with_every_layer_sparse_renormalised(),
            Architecture::NemotronH => match &nemotron_h {
                Some(n) => m.with_nemotron_h(&n.sparse, n.shared_width),
                None => m,
            },
            _ => m,
        });
        // Nemotron-H's shared experts would carry the MLPs' biases; no checkpoint has them.
        if architecture == Architecture::NemotronH && moe.is_some() && raw.mlp_bias == Some(true) {
            return Err(err(
                "mlp_bias",
                "true: biases on Nemotron-H's shared experts are not supported".into(),
            ));
        }
        // OLMo 1's clamp of q, k and v (OLMoE's configs have none).
        if let Some(clip) = raw.clip_qkv {
            return Err(err(
                "clip_qkv",
                format!("{clip}: clamping q, k and v is not supported (only null)"),
            ));
        }
        // gpt-oss's experts gate with their own activation, whatever `hidden_act` says.
        let clamped_swiglu = (architecture == Architecture::GptOss)
            .then(|| Self::parse_clamped_swiglu(&raw, path))
            .transpose()?;
        if moe.is_some() && clamped_swiglu.is_none() && hidden_act != Activation::Silu {
            return Err(err(
                "hidden_act",
                format!("{act_name}: the experts' kernels gate with SiLU only"),
            ));
        }
        let rotary_dim = match &mla {
            Some(m) => m.qk_rope_head_dim,
            None => Self::parse_rotary_dim(&raw, architecture, head_dim, path)?,
        };
        let defaults = RopeDefaults {
            // LFM2's and Solar Open's default theta (their configs' `default_theta`).
            rope_theta: raw.rope_theta.or((architecture.is_lfm2()
                || architecture == Architecture::SolarOpen)
                .then_some(1e6)),
            sliding_rope_theta: raw.rope_local_base_freq,
            original_max_position_embeddings: raw.original_max_position_embeddings,
            max_position_embeddings,
            rotary_dim,
            ntk_alpha: matches!(
                architecture,
                Architecture::HunYuanDense | Architecture::HunYuanMoe
            ),
        };
        let (mut rope, mut rope_sliding) = RopeConfig::parse_layers(
            raw.rope_parameters.as_ref(),
            raw.rope_scaling.as_ref(),
            &defaults,
            path,
        )?;
        // Granite SWA's layers without rope (`layer_rope_theta` 0), read with its layer kinds.
        let mut granite_swa_rope_layers = None;
        let smollm3_rope_layers = (architecture == Architecture::SmolLm3)
            .then(|| Self::parse_rope_layers(&raw, num_hidden_layers, path))
            .transpose()?;
        let sliding_layers = match architecture {
            Architecture::Olmo3 => {
                // A classic `rope_scaling` scales the full-attention layers only (transformers'
                // `Olmo3Config`); the sliding ones keep plain rope of the same theta.
                if rope_sliding.is_none() && rope.scaling != RopeScaling::None {
                    rope_sliding = Some(RopeConfig {
                        theta: rope.theta,
                        scaling: RopeScaling::None,
                    });
                }
                Some(Self::parse_layer_types(&raw, num_hidden_layers, 4, path)?)
            }
            Architecture::Gemma2 | Architecture::GptOss => {
                Some(Self::parse_layer_types(&raw, num_hidden_layers, 2, path)?)
            }
            Architecture::Dots1 => Self::dots1_sliding_layers(&raw, num_hidden_layers, path)?,
            Architecture::GraniteSwa | Architecture::GraniteMoeSwa => {
                let layers = Self::granite_swa_layers(&raw, num_hidden_layers, &rope, path)?;
                (rope, rope_sliding) = (layers.rope_full, layers.rope_sliding);
                granite_swa_rope_layers = layers.rope_layers;
                Some(layers.sliding)
            }
            Architecture::Gemma3 => {
                // The classic keys' `rope_scaling` is the full layers'; the sliding ones keep
                // plain rope of `rope_local_base_freq`.
                if rope_sliding.is_none() {
                    rope_sliding = Some(RopeConfig {
                        theta: defaults.sliding_rope_theta.unwrap_or(1e4),
                        scaling: RopeScaling::None,
                    });
                }
                let every = Self::window_every(&raw, 6, path)?;
                Some(Self::parse_layer_types(
                    &raw,
                    num_hidden_layers,
                    every,
                    path,
                )?)
            }
            // No window, no layer kinds: every layer attends to every key, with rope.
            Architecture::Exaone4 | Architecture::ExaoneMoe if raw.sliding_window.is_none() => None,
            Architecture::Exaone4 | Architecture::ExaoneMoe => {
                let every = Self::window_every(&raw, 4, path)?;
                Some(Self::parse_layer_types(
                    &raw,
                    num_hidden_layers,
                    every,
                    path,
                )?)
            }
            // transformers' `SmolLM3Config`: the window, when on, is the layers' without rope.
            Architecture::SmolLm3 => smollm3_rope_layers
                .as_ref()
                .map(|r| r.iter().map(|&rotates| !rotates).collect()),
            _ => {
                if rope_sliding.is_some() {
                    return Err(err(
                        "rope_parameters",
                        "settings by layer kind need an architecture with layer kinds (OLMo 3)"
                            .into(),
                    ));
                }
                None
            }
        };
        // EXAONE 4's full-attention layers have no rope (where it has a window at all);
        // Granite 4's layers rotate only where `position_embedding_type` says rope.
        let rope_layers = match architecture {
            Architecture::Exaone4 | Architecture::ExaoneMoe => sliding_layers.clone(),
            Architecture::GraniteMoeHybrid => (raw.position_embedding_type.as_deref()
                != Some("rope"))
            .then(|| vec![false; num_hidden_layers]),
            Architecture::GraniteSwa | Architecture::GraniteMoeSwa => granite_swa_rope_layers,
            // Its attention has no positions at all (Jamba's).
            Architecture::NemotronH => Some(vec![false; num_hidden_layers]),
            _ => smollm3_rope_layers,
        };
        let torch_dtype = [&raw.torch_dtype, &raw.dtype]
            .into_iter()
            .find_map(|v| v.as_ref().and_then(Value::as_str))
            .map(str::to_string);
        let query_scale_beta = match architecture {
            Architecture::Ministral3 | Architecture::Mistral4 => Self::parse_query_scale(
                &raw,
                rope.original_context()
                    .unwrap_or(max_position_embeddings as f64),
                path,
            )?,
            _ => None,
        };
        Ok(Self {
            architecture,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            vocab_size: positive("vocab_size", raw.vocab_size)?,
            rms_norm_eps,
            rope,
            rotary_dim,
            max_position_embeddings,
            // A classifier's `score` layer is its own matrix even where the config says tied.
            tie_word_embeddings: lfm2
                .as_ref()
                .map_or(raw.tie_word_embeddings.unwrap_or(false), |s| {
                    s.tie_word_embeddings
                })
                && head == Head::LanguageModel,
            qkv_bias,
            o_bias,
            mlp_bias: match architecture {
                Architecture::Ernie45 => use_bias,
                _ => raw.mlp_bias.unwrap_or(false) && !architecture.fused().gate_up,
            },
            qk_norm: match architecture {
                Architecture::Qwen3
                | Architecture::Qwen3Moe
                | Architecture::Olmo2
                | Architecture::Olmo3
                | Architecture::Olmoe
                | Architecture::Gemma3
                | Architecture::Exaone4
                | Architecture::ExaoneMoe
                | Architecture::MiniMaxM2
                | Architecture::Dots1
                | Architecture::HunYuanDense
                | Architecture::HunYuanMoe
                | Architecture::Apertus
                | Architecture::Lfm2
                | Architecture::Lfm2Moe
                | Architecture::Qwen3Next
                | Architecture::Qwen3_5
                | Architecture::Qwen3_5Moe => true,
                Architecture::Glm4Moe => raw.use_qk_norm.unwrap_or(false),
                _ => false,
            },
            hidden_act,
            attn_logit_softcapping,
            final_logit_softcapping,
            query_scale_beta,
            clamped_swiglu,
            mxfp4_experts,
            fp8_weights,
            query_pre_attn_scalar: raw
                .query_pre_attn_scalar
                .filter(|_| gemma)
                .map(|q| match q {
                    q if q.is_finite() && q > 0.0 => Ok(q),
                    q => Err(err("query_pre_attn_scalar", format!("{q} must be > 0"))),
                })
                .transpose()?,
            moe,
            short_conv: lfm2.map(|s| s.conv),
            linear_attention: architecture
                .has_qwen3_next_layers()
                .then(|| {
                    let projections = match architecture {
                        Architecture::Qwen3Next => DeltaNetProjections::GroupedByKeyHead,
                        _ => DeltaNetProjections::Split,
                    };
                    parse_json::<RawLinearAttention>(text, path)?.check(
                        path,
                        num_hidden_layers,
                        projections,
                    )
                })
                .transpose()?,
            mamba,
            sublayers: nemotron_h.map(|n| n.sublayers),
            mla,
            // dots.llm1's window only where a layer is sliding.
            sliding_window: sliding_window
                .filter(|_| architecture != Architecture::Dots1 || sliding_layers.is_some()),
            sliding_layers,
            rope_sliding,
            granite: matches!(
                architecture,
                Architecture::Granite
                    | Architecture::GraniteMoe
                    | Architecture::GraniteMoeShared
                    | Architecture::GraniteMoeHybrid
                    | Architecture::GraniteSwa
                    | Architecture::GraniteMoeSwa
            )
            .then(|| Self::parse_granite(&raw, path))
            .transpose()?,
            rope_layers,
            eos_token_ids: raw.eos_token_id.into_vec(),
            bos_token_id: raw.bos_token_id.into_vec().first().copied(),
            torch_dtype,
            head,
            path: path.to_path_buf(),
        })
    }

    /// The longest sequence (prompt + output) the model serves: `max_position_embeddings`, or
    /// YaRN's scaled context ([`RopeConfig::context`]).
    pub fn max_context(&self) -> usize {
        self.rope.context(self.max_position_embeddings)
    }

    /// Settles what depends on the longest sequence an engine serves, `max_model_len`:
    /// LongRoPE's factor set ([`RopeConfig::serve_up_to`]), and a sliding window no sequence
    /// can outgrow (Phi-3.5-mini's and Phi-4-mini's 262,144) dropped. A query attends to the
    /// same keys either way, so the bits are the same, but without a window the attention
    /// kernel shares a prefill tile's key loads across its rows.
    pub fn serve_up_to(&mut self, max_model_len: usize) {
        self.rope.serve_up_to(max_model_len);
        if let Some(rope) = &mut self.rope_sliding {
            rope.serve_up_to(max_model_len);
        }
        if self.sliding_window.is_some_and(|w| w >= max_model_len) {
            self.sliding_window = None;
        }
    }

    /// dots.llm1's layer kinds where any layer is sliding: `layer_types`, or transformers'
    /// default, the layers from `max_window_layers` (62) on where there is a window.
    fn dots1_sliding_layers(
        raw: &RawConfig,
        layers: usize,
        path: &Path,
    ) -> Result<Option<Vec<bool>>> {
        let sliding = match (&raw.layer_types, raw.sliding_window) {
            (Some(_), _) => Self::parse_layer_types(raw, layers, usize::MAX, path)?,
            (None, None) => vec![false; layers],
            (None, Some(_)) => {
                let from = raw.max_window_layers.unwrap_or(62);
                (0..layers).map(|l| l >= from).collect()
            }
        };
        Ok(sliding.iter().any(|&s| s).then_some(sliding))
    }

    /// How many of each head's `head_dim` dimensions rotate: `partial_rotary_factor` of them
    /// (rounded down, as transformers' `int(head_dim · factor)`; GLM's default 0.5), which
    /// only the Phi-3, GLM, MiniMax and Qwen3-Next layouts read (their attention rotates the first part and passes
    /// the rest through; Llama's and the others' rotate whole heads).
    fn parse_rotary_dim(
        raw: &RawConfig,
        architecture: Architecture,
        head_dim: usize,
        path: &Path,
    ) -> Result<usize> {
        // GLM's configs rotate half of each head unless they say otherwise.
        let glm_default = matches!(
            architecture,
            Architecture::Glm | Architecture::Glm4 | Architecture::Glm4Moe
        )
        .then(|| (0.5, "partial_rotary_factor (GLM's default)".to_string()));
        // MiniMax-M2's configs name the rotated width (transformers derives the factor).
        let minimax_default = (architecture == Architecture::MiniMaxM2)
            .then_some(raw.rotary_dim)
            .flatten()
            .map(|d| (d as f64 / head_dim as f64, "rotary_dim".to_string()));
        let Some((f, field)) = rope::rotary_fraction(
            raw.rope_parameters.as_ref(),
            raw.rope_scaling.as_ref(),
            raw.partial_rotary_factor,
        )
        .or(glm_default)
        .or(minimax_default) else {
            return Ok(head_dim);
        };
        let err = |message: String| DetspecError::InvalidConfig {
            path: path.to_path_buf(),
            field: field.clone(),
            message,
        };
        if f == 1.0 {
            return Ok(head_dim);
        }
        if !matches!(
            architecture,
            Architecture::Phi3
                | Architecture::Glm
                | Architecture::Glm4
                | Architecture::Glm4Moe
                | Architecture::SolarOpen
                | Architecture::MiniMaxM2
                | Architecture::Qwen3Next
                | Architecture::Qwen3_5
                | Architecture::Qwen3_5Moe
                | Architecture::Bamba
        ) {
            return Err(err(format!(
                "{f}: only the Phi-3, GLM and Qwen3.5 layouts rotate part of each head ({architecture:?} \
                 rotates all of it, as transformers does)"
            )));
        }
        if !(f > 0.0 && f < 1.0) {
            return Err(err(format!("{f}: must be in (0, 1]")));
        }
        let rotary_dim = (head_dim as f64 * f) as usize;
        if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) {
            return Err(err(format!(
                "{f} of head_dim {head_dim} rotates {rotary_dim} dimensions; rotary pairs need \
                 an even number, at least 2"
            )));
        }
        Ok(rotary_dim)
    }

    /// Ministral 3's `llama_4_scaling_beta` (in `rope_parameters`, or the classic
    /// `rope_scaling`) with the context past which it scales queries; `None` without one.
    fn parse_query_scale(
        raw: &RawConfig,
        original: f64,
        path: &Path,
    ) -> Result<Option<(f64, f64)>> {
        let (field, beta) = match (&raw.rope_parameters, &raw.rope_scaling) {
            (Some(p), _) => ("rope_parameters", p.llama_4_scaling_beta),
            (None, Some(s)) => ("rope_scaling", s.llama_4_scaling_beta),
            (None, None) => return Ok(None),
        };
        match beta {
            Some(b) if !b.is_finite() => Err(DetspecError::InvalidConfig {
                path: path.to_path_buf(),
                field: format!("{field}.llama_4_scaling_beta"),
                message: format!("{b} is not a number"),
            }),
            Some(b) => Ok(Some((b, original))),
            None => Ok(None),
        }
    }

    /// gpt-oss's `swiglu_alpha` and `swiglu_limit` (transformers' defaults 1.702 and 7.0).
    fn parse_clamped_swiglu(raw: &RawConfig, path: &Path) -> Result<ClampedSwiglu> {
        let read = |field: &str, v: Option<f64>, default: f64| match v.unwrap_or(default) {
            v if v.is_finite() && v > 0.0 => Ok(v),
            v => Err(DetspecError::InvalidConfig {
                path: path.to_path_buf(),
                field: field.into(),
                message: format!("{v} must be a number > 0"),
            }),
        };
        Ok(ClampedSwiglu {
            alpha: read("swiglu_alpha", raw.swiglu_alpha, 1.702)?,
            limit: read("swiglu_limit", raw.swiglu_limit, 7.0)?,
        })
    }

    /// `sliding_window_pattern` as a count of layers (every this-many-th one attends to
    /// every key), or `default` where absent: a number, or EXAONE 4's `"LLLG"` (that count
    /// written as sliding layers, `L`, then one full, `G`).
    fn window_every(raw: &RawConfig, default: usize, path: &Path) -> Result<usize> {
        let err = |message: String| DetspecError::InvalidConfig {
            path: path.to_path_buf(),
            field: "sliding_window_pattern".into(),
            message,
        };
        let every = match &raw.sliding_window_pattern {
            None | Some(Value::Null) => default,
            Some(Value::Number(n)) => n.as_u64().unwrap_or(0) as usize,
            Some(Value::String(p))
                if p.ends_with('G') && p[..p.len() - 1].chars().all(|c| c == 'L') =>
            {
                p.len()
            }
            Some(other) => {
                return Err(err(format!(
                    "{other}: a count of layers, or sliding layers then one full (\"LLLG\")"
                )))
            }
        };
        if every == 0 {
            return Err(err("must be > 0".into()));
        }
        Ok(every)
    }

    /// `layer_types` (each layer's attention: `sliding_attention` or `full_attention`), or
    /// transformers' default: every `every`-th layer full (OLMo 3: 4, Gemma 2: 2, Gemma 3: its
    /// `sliding_window_pattern`, 6; EXAONE 4: its `sliding_window_pattern`, 4).
    fn parse_layer_types(
        raw: &RawConfig,
        layers: usize,
        every: usize,
        path: &Path,
    ) -> Result<Vec<bool>> {
        let err = |message: String| DetspecError::InvalidConfig {
            path: path.to_path_buf(),
            field: "layer_types".into(),
            message,
        };
        let Some(types) = &raw.layer_types else {
            return Ok((0..layers).map(|i| (i + 1) % every != 0).collect());
        };
        if types.len() != layers {
            return Err(err(format!(
                "{} entries for num_hidden_layers={layers}",
                types.len()
            )));
        }
        types
            .iter()
            .map(|t| match t.as_str() {
                "sliding_attention" => Ok(true),
                "full_attention" => Ok(false),
                other => Err(err(format!(
                    "`{other}` (supported: sliding_attention, full_attention)"
                ))),
            })
            .collect()
    }

    /// Granite SWA's layers: their kinds (`layer_types`, by default full where `i % 4 == 0`),
    /// and their rope by `layer_rope_theta` (0: none; by default `rope`'s theta everywhere).
    /// Each kind rotates by one theta, the full layers' `rope` and the sliding layers'
    /// `rope_sliding` (with `rope`'s scaling, as transformers copies it), so a theta list that
    /// mixes thetas within a kind is refused, naming the field.
    fn granite_swa_layers(
        raw: &RawConfig,
        layers: usize,
        rope: &RopeConfig,
        path: &Path,
    ) -> Result<GraniteSwaLayers> {
        let sliding = match raw.layer_types {
            Some(_) => Self::parse_layer_types(raw, layers, usize::MAX, path)?,
            None => (0..layers).map(|i| i % 4 != 0).collect(),
        };
        let thetas = raw
            .layer_rope_theta
            .clone()
            .unwrap_or_else(|| vec![rope.theta; layers]);
        let err = |message: String| DetspecError::InvalidConfig {
            path: path.to_path_buf(),
            field: "layer_rope_theta".into(),
            message,
        };
        if thetas.len() != layers {
            return Err(err(format!("{} entries for {layers} layers", thetas.len())));
        }
        if let Some(bad) = thetas.iter().find(|t| !(t.is_finite() && **t >= 0.0)) {
            return Err(err(format!("{bad}: a theta is > 0, or 0 for no rope")));
        }
        // The one theta of the layers of a kind that rotate.
        let theta_of = |slides: bool| -> Result<Option<f64>> {
            let mut kind = thetas
                .iter()
                .zip(&sliding)
                .filter(|&(&t, &s)| s == slides && t != 0.0)
                .map(|(&t, _)| t);
            let first = kind.next();
            match kind.find(|&t| Some(t) != first) {
                Some(other) => Err(err(format!(
                    "the {} layers rotate by {} and {other}: one theta per layer kind is \
                     supported",
                    if slides { "sliding" } else { "full" },
                    first.unwrap_or_default(),
                ))),
                None => Ok(first),
            }
        };
        let with_theta = |theta: f64| RopeConfig {
            theta,
            scaling: rope.scaling.clone(),
        };
        let full = theta_of(false)?.map_or_else(|| rope.clone(), with_theta);
        let rope_sliding = theta_of(true)?.filter(|&t| t != full.theta).map(with_theta);
        Ok(GraniteSwaLayers {
            rope_layers: thetas
                .contains(&0.0)
                .then(|| thetas.iter().map(|&t| t != 0.0).collect()),
            sliding,
            rope_full: full,
            rope_sliding,
        })
    }

    /// Granite's multipliers, each 1 where absent (transformers' defaults); a multiplier that
    /// is not a finite number, or a zero `logits_scaling`, is refused naming it.
    fn parse_granite(raw: &RawConfig, path: &Path) -> Result<GraniteScales> {
        let read = |field: &str, v: Option<f64>| {
            let v = v.unwrap_or(1.0);
            if v.is_finite() && !(field == "logits_scaling" && v == 0.0) {
                Ok(v)
            } else {
                Err(DetspecError::InvalidConfig {
                    path: path.to_path_buf(),
                    field: field.into(),
                    message: format!("{v} is not a usable multiplier"),
                })
            }
        };
        Ok(GraniteScales {
            embedding: read("embedding_multiplier", raw.embedding_multiplier)?,
            residual: read("residual_multiplier", raw.residual_multiplier)?,
            attention: read("attention_multiplier", raw.attention_multiplier)?,
            logits: read("logits_scaling", raw.logits_scaling)?,
        })
    }

    /// SmolLM3's `no_rope_layers` (1: the layer rotates q/k, 0: it does not), or transformers'
    /// default: every `no_rope_layer_interval`-th layer (4) without.
    fn parse_rope_layers(raw: &RawConfig, layers: usize, path: &Path) -> Result<Vec<bool>> {
        let err = |field: &str, message: String| DetspecError::InvalidConfig {
            path: path.to_path_buf(),
            field: field.into(),
            message,
        };
        let Some(flags) = &raw.no_rope_layers else {
            let every = match raw.no_rope_layer_interval.unwrap_or(4) {
                0 => return Err(err("no_rope_layer_interval", "must be > 0".into())),
                n => n,
            };
            return Ok((0..layers).map(|i| (i + 1) % every != 0).collect());
        };
        if flags.len() != layers || flags.iter().any(|&f| f > 1) {
            return Err(err(
                "no_rope_layers",
                format!("needs {layers} entries, each 0 or 1, got {flags:?}"),
            ));
        }
        Ok(flags.iter().map(|&f| f == 1).collect())
    }

    /// The output widths of a layer's q, k and v projections.
    /// The q/k/v projections' output widths (q's with each head's output gate, where the
    /// architecture has one).
    pub fn qkv_widths(&self) -> [usize; 3] {
        let kv = self.num_key_value_heads * self.head_dim;
        let gates = if self.architecture.attention_output_gate() {
            2
        } else {
            1
        };
        [gates * self.num_attention_heads * self.head_dim, kv, kv]
    }

    /// What attention scores are scaled by: Granite's multiplier, Gemma's
    /// `query_pre_attn_scalar^-½`, or `head_dim^-½`.
    pub fn attention_scale(&self) -> f32 {
        if let Some(m) = &self.mla {
            return m.softmax_scale as f32;
        }
        match (self.granite, self.query_pre_attn_scalar) {
            (Some(g), _) => g.attention as f32,
            (None, Some(q)) => q.powf(-0.5) as f32,
            (None, None) => 1.0 / (self.head_dim as f32).sqrt(),
        }
    }

    /// What layer `layer` holds where it does not attend: LFM2's convolution, a gated
    /// DeltaNet, a Mamba2 mixer, or only an MLP (a Nemotron-H MLP block).
    pub fn non_attention_mixer(&self, layer: usize) -> Option<&'static str> {
        if self.short_conv.as_ref().is_some_and(|c| c.is_conv(layer)) {
            Some("a convolution")
        } else if self
            .linear_attention
            .as_ref()
            .is_some_and(|l| l.is_linear(layer))
        {
            Some("a gated DeltaNet")
        } else if self.mamba.as_ref().is_some_and(|m| m.is_mamba(layer)) {
            Some("a Mamba2 mixer")
        } else if !self.has_mixer(layer) {
            Some("an MLP block")
        } else {
            None
        }
    }

    /// Whether layer `layer` rotates q and k.
    pub fn layer_has_rope(&self, layer: usize) -> bool {
        self.rope_layers
            .as_ref()
            .is_none_or(|r| r.get(layer).copied().unwrap_or(true))
    }

    /// Whether layer `layer` mixes tokens (a Nemotron-H MLP block does not).
    pub fn has_mixer(&self, layer: usize) -> bool {
        self.sublayer(layer) != Some(Sublayer::Mlp)
    }

    /// Whether layer `layer` has an MLP (a Nemotron-H mixer block does not).
    pub fn has_mlp(&self, layer: usize) -> bool {
        self.sublayer(layer) != Some(Sublayer::Mixer)
    }

    /// Layer `layer`'s norms ([`Architecture::sublayer_norms`]), those of a sublayer it does
    /// not have left out.
    pub fn layer_norms(&self, layer: usize) -> [Option<&'static str>; 4] {
        let (mixer, mlp) = (self.has_mixer(layer), self.has_mlp(layer));
        let mut names = self.architecture.sublayer_norms();
        for (name, present) in names.iter_mut().zip([mixer, mixer, mlp, mlp]) {
            if !present {
                *name = None;
            }
        }
        names
    }

    fn sublayer(&self, layer: usize) -> Option<Sublayer> {
        self.sublayers.as_ref()?.get(layer).copied()
    }

    /// Whether layer `layer` attends within `sliding_window`.
    pub fn layer_slides(&self, layer: usize) -> bool {
        self.sliding_window.is_some()
            && self
                .sliding_layers
                .as_ref()
                .is_none_or(|s| s.get(layer).copied().unwrap_or(false))
    }

    /// The architecture and its output layer: `*ForCausalLM`, or `*ForSequenceClassification`
    /// of a dense family (a classifier's labels from `id2label`).
    fn parse_architecture(raw: &RawConfig, path: &Path) -> Result<(Architecture, Head)> {
        let name = match raw.architectures.as_deref() {
            Some([first, ..]) => first.clone(),
            _ => {
                // Fall back to model_type, which every HF config has.
                let model_type = raw.model_type.as_deref().unwrap_or("");
                Architecture::CAUSAL_LM
                    .iter()
                    .find(|(_, t, _)| *t == model_type)
                    .map(|(n, _, _)| n.to_string())
                    .ok_or_else(|| DetspecError::InvalidConfig {
                        path: path.to_path_buf(),
                        field: "architectures".into(),
                        message: "missing (and no known model_type)".into(),
                    })?
            }
        };
        if let Some((_, arch)) = Architecture::CLASSIFIERS.iter().find(|(n, _)| *n == name) {
            return Ok((*arch, Head::classifier(raw.id2label.as_ref(), path)?));
        }
        Architecture::CAUSAL_LM
            .iter()
            .find(|(n, _, _)| *n == name)
            .map(|(_, _, a)| (*a, Head::LanguageModel))
            .ok_or_else(|| DetspecError::UnsupportedArchitecture {
                path: path.to_path_buf(),
                architecture: name,
                supported: Architecture::supported_list(),
            })
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A config from JSON text, errors naming `/m/config.json` (also `rope.rs`'s tests').
    pub(in crate::config) fn parse(json: &str) -> Result<ModelConfig> {
        ModelConfig::from_json_str(json, Path::new("/m/config.json"))
    }

    /// Each `(extra fields, field)`: a config of `arch` with them is refused, naming `field`.
    pub(in crate::config) fn assert_refused(arch: &str, cases: &[(&str, &str)]) {
        for (extra, field) in cases {
            let e = parse(&format!(
                r#"{{"architectures": ["{arch}"], {BASE}, {extra}}}"#
            ))
            .unwrap_err();
            assert!(e.to_string().contains(field), "{field}: {e}");
        }
    }

    /// The fields every test config needs.
    pub(in crate::config) const BASE: &str = r#""hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 100"#;

    #[test]
    fn apertus_runs_xielu_only_with_its_own_norm_names() {
        let apertus = |act: &str| {
            parse(&format!(
                r#"{{"architectures": ["ApertusForCausalLM"], {BASE}, "hidden_act": "{act}"}}"#
            ))
        };
        let c = apertus("xielu").unwrap();
        assert!(c.architecture.ungated_mlp() == Some(UngatedMlp::Xielu) && c.qk_norm);
        assert_eq!(
            c.architecture.sublayer_norms(),
            [
                Some("attention_layernorm"),
                None,
                Some("feedforward_layernorm"),
                None
            ]
        );
        let e = apertus("silu").unwrap_err();
        assert!(e.to_string().contains("hidden_act"), "{e}");
    }

    #[test]
    fn hunyuan_dense_stretches_its_base_by_alpha_and_norms_after_rope() {
        let hunyuan = |rope: &str| {
            parse(&format!(
                r#"{{"architectures": ["HunYuanDenseV1ForCausalLM"], {BASE}, "head_dim": 16,
                "rope_parameters": {rope}}}"#
            ))
        };
        let c = hunyuan(
            r#"{"rope_type": "dynamic", "alpha": 1000.0, "rope_theta": 10000.0, "factor": 1.0}"#,
        )
        .unwrap();
        // transformers' ntk_alpha: theta · alpha^(d / (d − 2)), d the head width.
        let want = 10000.0 * 1000f64.powf(16.0 / 14.0);
        assert_eq!(c.rope.theta.to_bits(), want.to_bits());
        assert_eq!(c.rope.scaling, RopeScaling::None);
        assert!(c.qk_norm);
        assert_eq!(
            c.architecture.qk_norms(),
            ("query_layernorm", "key_layernorm", true)
        );
        let e = hunyuan(r#"{"rope_type": "dynamic", "alpha": -1.0, "rope_theta": 10000.0}"#)
            .unwrap_err();
        assert!(e.to_string().contains("rope_parameters.alpha"), "{e}");
        // Elsewhere "dynamic" is length-dependent NTK, which is not supported, alpha or not.
        let e = parse(&format!(
            r#"{{"architectures": ["LlamaForCausalLM"], {BASE},
            "rope_parameters": {{"rope_type": "dynamic", "alpha": 2.0, "factor": 2.0}}}}"#
        ))
        .unwrap_err();
        assert!(e.to_string().contains("rope_type"), "{e}");
        assert_eq!(Architecture::Qwen3.qk_norms(), ("q_norm", "k_norm", false));
    }

    #[test]
    fn granite_swa_reads_its_layer_kinds_sinks_and_rope_by_layer() {
        let swa = |extra: &str| {
            parse(&format!(
                r#"{{"architectures": ["GraniteSWAForCausalLM"], "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                "vocab_size": 100, "rope_theta": 10000.0{extra}}}"#
            ))
        };
        // transformers' defaults: full where i % 4 == 0, a 128-key window, one theta.
        let c = swa("").unwrap();
        assert!(c.architecture.has_attention_sinks() && c.granite.is_some());
        assert_eq!(c.sliding_window, Some(128));
        let slides: Vec<bool> = (0..4).map(|l| c.layer_slides(l)).collect();
        assert_eq!(slides, [false, true, true, true]);
        assert!(c.rope_layers.is_none() && c.rope_sliding.is_none());
        // Full layers without rope, sliding ones by their own theta.
        let c = swa(r#", "layer_rope_theta": [0, 5e5, 5e5, 5e5]"#).unwrap();
        assert_eq!(c.rope_layers, Some(vec![false, true, true, true]));
        assert_eq!(c.rope.theta, 10000.0);
        assert_eq!(c.rope_sliding.as_ref().map(|r| r.theta), Some(5e5));
        // Each kind its own theta.
        let c = swa(r#", "layer_rope_theta": [3e5, 5e5, 5e5, 5e5]"#).unwrap();
        assert_eq!((c.rope.theta, c.rope_layers), (3e5, None));
        assert_eq!(c.rope_sliding.as_ref().map(|r| r.theta), Some(5e5));
        for (extra, want) in [
            (
                r#", "layer_rope_theta": [0, 5e5, 6e5, 5e5]"#,
                "one theta per layer kind",
            ),
            (
                r#", "layer_rope_theta": [0, 5e5]"#,
                "2 entries for 4 layers",
            ),
            (r#", "layer_rope_theta": [0, -1, 5e5, 5e5]"#, "for no rope"),
        ] {
            let e = swa(extra).unwrap_err().to_string();
            assert!(e.contains("layer_rope_theta") && e.contains(want), "{e}");
        }
    }

    /// Hunyuan-A13B's hub config: per-layer lists of one value, its classic `rope_scaling`.
    #[test]
    fn hunyuan_a13b_reads_its_per_layer_lists() {
        let a13b = |topk: &str, shared: &str, cla: bool| {
            parse(&format!(
                r#"{{"architectures": ["HunYuanMoEV1ForCausalLM"], "hidden_size": 64,
                "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100, "num_experts": 8,
                "moe_topk": {topk}, "moe_intermediate_size": [48, 48, 48, 48],
                "num_shared_expert": {shared}, "use_cla": {cla}, "use_mixed_mlp_moe": true,
                "use_qk_norm": true, "rope_theta": 10000.0, "rope_scaling": {{"alpha": 1000.0,
                "factor": 1.0, "type": "dynamic"}}}}"#
            ))
        };
        let (two, one) = ("[2, 2, 2, 2]", "[1, 1, 1, 1]");
        let c = a13b(two, one, false).unwrap();
        assert_eq!(c.architecture, Architecture::HunYuanMoe);
        let moe = c.moe.as_ref().unwrap();
        assert_eq!(moe.naming, ExpertNaming::Hunyuan);
        assert_eq!(
            (moe.num_experts, moe.top_k, moe.expert_intermediate_size),
            (8, 2, 48)
        );
        assert_eq!(moe.shared_expert_intermediate_size, Some(48));
        assert!(moe.norm_topk_prob && moe.sparse_layers.iter().all(|&s| s));
        assert_eq!(
            c.rope.theta.to_bits(),
            (10000.0 * 1000f64.powf(16.0 / 14.0)).to_bits()
        );
        for (e, field) in [
            (a13b(two, one, true), "use_cla"),
            (a13b("[2, 2, 1, 2]", one, false), "moe_topk"),
            (a13b(two, "2", false), "num_shared_expert"),
        ] {
            let e = e.unwrap_err().to_string();
            assert!(e.contains(field) && !e.contains("duplicate"), "{e}");
        }
        // One count for every layer reads as the list does.
        assert_eq!(a13b("2", "1", false).unwrap().moe.unwrap().top_k, 2);
    }

    #[test]
    fn granite4_runs_attention_layers_with_its_shared_mlp_and_mamba_layers() {
        let granite = |extra: &str| {
            parse(&format!(
                r#"{{"architectures": ["GraniteMoeHybridForCausalLM"], {BASE},
                "shared_intermediate_size": 96{extra}}}"#
            ))
        };
        // Micro's form: no experts, the shared MLP is the dense one, rope by name.
        let c = granite(
            r#", "layer_types": ["attention", "full_attention"],
            "position_embedding_type": "rope", "num_local_experts": 0"#,
        )
        .unwrap();
        assert!(c.moe.is_none() && c.granite.is_some() && c.rope_layers.is_none());
        assert_eq!(c.intermediate_size, 96);
        let fused = c.architecture.fused();
        assert!(fused.gate_up && fused.mlp == DenseMlpNames::GraniteShared);
        assert_eq!(
            (fused.gate_up_module(), fused.down_module()),
            ("shared_mlp.input_linear", "shared_mlp.output_linear")
        );
        // No rope where the config names none (the -H models' NoPE); experts beside it.
        let c = granite(
            r#", "layer_types": ["attention", "attention"], "num_local_experts": 4,
            "num_experts_per_tok": 2"#,
        )
        .unwrap();
        assert_eq!(c.rope_layers, Some(vec![false, false]));
        assert_eq!(c.moe.unwrap().shared_expert_intermediate_size, Some(96));
        // transformers' default is 8 experts: a config naming none is not read as dense.
        let e = granite(r#", "layer_types": ["attention", "attention"]"#).unwrap_err();
        assert!(e.to_string().contains("num_experts"), "{e}");
        assert!(c.mamba.is_none(), "attention layers only: no Mamba config");
        // The -H models: Mamba2 layers by either spelling, every layer where none is named.
        let mamba = |extra: &str| {
            granite(&format!(
                r#", "num_local_experts": 0, "mamba_n_heads": 4, "mamba_d_head": 32{extra}"#
            ))
        };
        for (extra, layers) in [
            (
                r#", "layer_types": ["attention", "mamba"]"#,
                vec![false, true],
            ),
            (
                r#", "layer_types": ["linear_attention", "attention"]"#,
                vec![true, false],
            ),
            ("", vec![true, true]),
        ] {
            let c = mamba(extra).unwrap();
            assert_eq!(c.mamba.unwrap().layers, layers, "{extra}");
        }
        let e = mamba(r#", "layer_types": ["attention"]"#).unwrap_err();
        assert!(e.to_string().contains("layer_types"), "{e}");
    }

    #[test]
    fn errors_name_the_field() {
        let e = parse(r#"{"architectures": ["GPT2LMHeadModel"]}"#).unwrap_err();
        assert!(e.to_string().contains("GPT2LMHeadModel"), "{e}");
        let e = parse(r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}"#).unwrap_err();
        assert!(e.to_string().contains("num_attention_heads"), "{e}");
        let e = parse(&format!(
            r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "num_key_value_heads": 3}}"#
        ))
        .unwrap_err();
        assert!(e.to_string().contains("num_key_value_heads"), "{e}");
        let e = parse(&format!(
            r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "rope_scaling": {{"rope_type": "dynamic", "factor": 2.0}}}}"#
        ))
        .unwrap_err();
        assert!(e.to_string().contains("rope_scaling.rope_type"), "{e}");
        let e = parse(&format!(
            r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "hidden_act": "gelu"}}"#
        ))
        .unwrap_err();
        assert!(
            e.to_string().contains("hidden_act") && e.to_string().contains("gelu"),
            "{e}"
        );
        for act in ["silu", "swish"] {
            parse(&format!(
                r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "hidden_act": "{act}"}}"#
            ))
            .unwrap();
        }
        let e = parse("[1,2]").unwrap_err();
        assert!(e.to_string().contains("/m/config.json"), "{e}");
    }

    #[test]
    fn sequence_classifiers_have_a_score_head_with_their_labels() {
        let c = parse(&format!(
            r#"{{"architectures": ["Qwen2ForSequenceClassification"], {BASE},
                "id2label": {{"1": "good", "0": "bad", "2": "meh"}}, "tie_word_embeddings": true}}"#
        ))
        .unwrap();
        assert_eq!(c.architecture, Architecture::Qwen2);
        let labels: Vec<String> = ["bad", "good", "meh"].map(String::from).to_vec();
        assert_eq!(c.head.labels(), Some(&labels[..]));
        assert_eq!(
            (c.head.weight_name(), c.head.rows(100)),
            ("score.weight", 3)
        );
        assert!(
            !c.tie_word_embeddings,
            "a classifier's score layer is never the embedding"
        );
        // No id2label: transformers' two default labels.
        let d = parse(&format!(
            r#"{{"architectures": ["LlamaForSequenceClassification"], {BASE}}}"#
        ))
        .unwrap();
        assert_eq!(d.head.rows(100), 2);
        let lm = parse(&format!(
            r#"{{"architectures": ["LlamaForCausalLM"], {BASE}}}"#
        ))
        .unwrap();
        assert_eq!(
            (lm.head.weight_name(), lm.head.rows(100)),
            ("lm_head.weight", 100)
        );
        for (arch, extra, needle) in [
            (
                "LlamaForSequenceClassification",
                r#", "id2label": {"0": "a", "2": "c"}"#,
                "id2label",
            ),
            (
                "LlamaForSequenceClassification",
                r#", "id2label": {"x": "a"}"#,
                "id2label",
            ),
            (
                "LlamaForSequenceClassification",
                r#", "id2label": {}"#,
                "id2label",
            ),
            (
                "MixtralForSequenceClassification",
                "",
                "MixtralForSequenceClassification",
            ),
        ] {
            let e = parse(&format!(
                r#"{{"architectures": ["{arch}"], {BASE}{extra}}}"#
            ))
            .unwrap_err();
            assert!(e.to_string().contains(needle), "{e}");
        }
    }

    #[test]
    fn glm_fuses_gate_up_and_rotates_half_of_each_head_in_neighbour_pairs() {
        let c = parse(&format!(
            r#"{{"architectures": ["Glm4ForCausalLM"], {BASE}, "head_dim": 16,
            "rope_parameters": {{"rope_type": "default", "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5}}}}"#
        ))
        .unwrap();
        assert_eq!(
            c.architecture.fused(),
            Fused {
                qkv: false,
                gate_up: true,
                ..Fused::default()
            }
        );
        assert!(c.architecture.rope_interleaved() && !Architecture::Phi3.rope_interleaved());
        assert_eq!(
            (c.rotary_dim, c.qkv_bias, c.o_bias, c.mlp_bias),
            (8, true, false, false)
        );
        assert_eq!(
            c.architecture.sublayer_norms(),
            [
                Some("input_layernorm"),
                Some("post_self_attn_layernorm"),
                Some("post_attention_layernorm"),
                Some("post_mlp_layernorm")
            ]
        );
        // GLM: the Llama norms; half of each head rotates where the config says nothing, and
        // q/k/v biases follow `attention_bias`.
        let g = parse(&format!(
            r#"{{"architectures": ["GlmForCausalLM"], {BASE}, "attention_bias": false}}"#
        ))
        .unwrap();
        assert_eq!((g.rotary_dim, g.qkv_bias), (8, false));
        assert_eq!(
            g.architecture.sublayer_norms(),
            Architecture::Llama.sublayer_norms()
        );
    }

    #[test]
    fn ernie_pairs_neighbours_on_whole_heads_with_one_bias_switch() {
        let c = parse(&format!(
            r#"{{"architectures": ["Ernie4_5ForCausalLM"], {BASE}, "use_bias": true}}"#
        ))
        .unwrap();
        assert!(c.architecture.rope_interleaved());
        assert!(c.qkv_bias && c.o_bias && c.mlp_bias);
        // transformers' defaults where the config is silent: 128-wide heads (not 64 / 4),
        // tied embeddings, theta 500,000; whole heads rotate.
        assert_eq!((c.head_dim, c.rotary_dim), (128, 128));
        assert!(c.tie_word_embeddings);
        assert_eq!(c.rope.theta, 500_000.0);
        let plain = parse(&format!(
            r#"{{"architectures": ["Ernie4_5ForCausalLM"], {BASE}, "head_dim": 16}}"#
        ))
        .unwrap();
        assert!(!(plain.qkv_bias || plain.o_bias || plain.mlp_bias));
        assert_refused(
            "Ernie4_5ForCausalLM",
            &[(r#""partial_rotary_factor": 0.5"#, "partial_rotary_factor")],
        );
    }

    #[test]
    fn exaone4_slides_most_layers_and_leaves_rope_off_the_others() {
        let exaone = |extra: &str| {
            parse(&format!(
                r#"{{"architectures": ["Exaone4ForCausalLM"], "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
                "vocab_size": 100{extra}}}"#
            ))
        };
        // EXAONE-4.0-32B's spelling of the pattern, and a count: three sliding layers, then
        // one full one without rope.
        let want = vec![true, true, true, false, true, true, true, false];
        for pattern in [r#""LLLG""#, "4"] {
            let c = exaone(&format!(
                r#", "sliding_window": 4096, "sliding_window_pattern": {pattern}"#
            ))
            .unwrap();
            assert_eq!(c.sliding_layers.as_ref(), Some(&want), "{pattern}");
            assert_eq!(c.rope_layers.as_ref(), Some(&want), "{pattern}");
            assert!(c.layer_slides(0) && !c.layer_slides(3) && !c.layer_has_rope(3));
        }
        let c = exaone(r#", "sliding_window": 4096"#).unwrap();
        assert_eq!(c.sliding_layers, Some(want));
        assert!(c.qk_norm && !c.architecture.norms_whole_qk());
        assert_eq!(
            c.architecture.sublayer_norms(),
            Architecture::Olmo2.sublayer_norms()
        );
        // Without a window (EXAONE-4.0-1.2B) every layer attends to every key, with rope.
        let c = exaone(r#", "sliding_window": null, "sliding_window_pattern": "LLLG""#).unwrap();
        assert!(c.sliding_layers.is_none() && c.rope_layers.is_none());
        for bad in [r#""LGLG""#, "0", r#"[1]"#] {
            let e = exaone(&format!(
                r#", "sliding_window": 16, "sliding_window_pattern": {bad}"#
            ))
            .unwrap_err();
            assert!(
                e.to_string().contains("sliding_window_pattern"),
                "{bad}: {e}"
            );
        }
    }

    /// Configs of the shape the hub's checkpoints have (their keys and values, factor lists
    /// shortened to the right length): each loads with the geometry its model card gives.
    #[test]
    fn hub_shaped_configs_of_the_newer_families_load() {
        let factors = |n: usize| vec!["1.0"; n].join(", ");
        // Phi-4-mini-instruct: 128-wide heads, 96 dimensions rotating, 48 factors a set; its
        // window outlasts any sequence.
        let mut phi4 = parse(&format!(
            r#"{{"architectures": ["Phi3ForCausalLM"], "attention_bias": false,
            "bos_token_id": 199999, "eos_token_id": 199999, "full_attn_mod": 1,
            "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 8192,
            "interpolate_factor": 1, "lm_head_bias": false, "max_position_embeddings": 131072,
            "mlp_bias": false, "model_type": "phi3", "num_attention_heads": 24,
            "num_hidden_layers": 32, "num_key_value_heads": 8,
            "original_max_position_embeddings": 4096, "pad_token_id": 199999,
            "partial_rotary_factor": 0.75, "rms_norm_eps": 1e-05,
            "rope_scaling": {{"long_factor": [{f}], "short_factor": [{f}], "type": "longrope"}},
            "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": true,
            "torch_dtype": "bfloat16", "vocab_size": 200064}}"#,
            f = factors(48)
        ))
        .unwrap();
        assert_eq!((phi4.head_dim, phi4.rotary_dim), (128, 96));
        phi4.serve_up_to(phi4.max_context());
        assert_eq!((phi4.max_context(), phi4.sliding_window), (131_072, None));
        // GLM-4-9B-0414.
        let glm = parse(
            r#"{"architectures": ["Glm4ForCausalLM"], "attention_bias": true,
            "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
            "hidden_size": 4096, "intermediate_size": 13696, "max_position_embeddings": 32768,
            "model_type": "glm4", "num_attention_heads": 32, "num_hidden_layers": 40,
            "num_key_value_heads": 2, "pad_token_id": 151329, "partial_rotary_factor": 0.5,
            "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": false,
            "torch_dtype": "bfloat16", "vocab_size": 151552}"#,
        )
        .unwrap();
        assert_eq!((glm.rotary_dim, glm.eos_token_ids.len()), (64, 3));
        // OLMoE-1B-7B-0924: 64 experts of 1,024, 8 a token.
        let olmoe = parse(
            r#"{"architectures": ["OlmoeForCausalLM"], "attention_bias": false, "clip_qkv": null,
            "eos_token_id": 50279, "hidden_act": "silu", "hidden_size": 2048,
            "intermediate_size": 1024, "max_position_embeddings": 4096, "model_type": "olmoe",
            "norm_topk_prob": false, "num_attention_heads": 16, "num_experts": 64,
            "num_experts_per_tok": 8, "num_hidden_layers": 16, "num_key_value_heads": 16,
            "pad_token_id": 1, "rms_norm_eps": 1e-05, "rope_scaling": null,
            "rope_theta": 10000.0, "tie_word_embeddings": false, "vocab_size": 50304}"#,
        )
        .unwrap();
        let moe = olmoe.moe.unwrap();
        assert_eq!(
            (moe.num_experts, moe.top_k, moe.expert_intermediate_size),
            (64, 8, 1024)
        );
        // EXAONE-4.0-32B: 64 layers, every fourth full and without rope, llama3 scaling.
        let kinds: Vec<&str> = (0..64)
            .map(|i| match (i + 1) % 4 {
                0 => "\"full_attention\"",
                _ => "\"sliding_attention\"",
            })
            .collect();
        let exaone = parse(&format!(
            r#"{{"architectures": ["Exaone4ForCausalLM"], "head_dim": 128, "hidden_size": 5120,
            "intermediate_size": 27392, "layer_types": [{}], "max_position_embeddings": 131072,
            "num_attention_heads": 40, "num_hidden_layers": 64, "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05, "rope_scaling": {{"factor": 16.0, "high_freq_factor": 4.0,
            "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
            "rope_type": "llama3"}}, "rope_theta": 1000000, "sliding_window": 4096,
            "sliding_window_pattern": "LLLG", "tie_word_embeddings": false,
            "vocab_size": 102400}}"#,
            kinds.join(", ")
        ))
        .unwrap();
        assert!(exaone.layer_slides(62) && !exaone.layer_slides(63));
        assert!(exaone.layer_has_rope(62) && !exaone.layer_has_rope(63));
        // ERNIE-4.5-0.3B.
        let ernie = parse(
            r#"{"architectures": ["Ernie4_5ForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
            "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072,
            "max_position_embeddings": 131072, "model_type": "ernie4_5",
            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128,
            "num_hidden_layers": 18, "pad_token_id": 0, "rms_norm_eps": 1e-05,
            "rope_theta": 500000, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
            "use_bias": false, "vocab_size": 103424}"#,
        )
        .unwrap();
        assert_eq!((ernie.head_dim, ernie.rotary_dim), (128, 128));
        assert!(ernie.tie_word_embeddings && !ernie.qkv_bias);
        // Qwen2.5-VL-7B-Instruct's flat config: Qwen2's language model under plain rope.
        let vl = parse(
            r#"{"architectures": ["Qwen2_5_VLForConditionalGeneration"], "bos_token_id": 151643,
            "eos_token_id": 151645, "image_token_id": 151655, "hidden_act": "silu",
            "hidden_size": 3584, "intermediate_size": 18944, "max_position_embeddings": 128000,
            "max_window_layers": 28, "model_type": "qwen2_5_vl", "num_attention_heads": 28,
            "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": false,
            "torch_dtype": "bfloat16", "use_sliding_window": false,
            "vision_config": {"depth": 32, "hidden_size": 1280, "out_hidden_size": 3584},
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
            "vocab_size": 152064}"#,
        )
        .unwrap();
        assert_eq!(vl.architecture, Architecture::Qwen2);
        assert_eq!(
            (vl.head_dim, vl.rope.scaling.clone()),
            (128, RopeScaling::None)
        );
        assert!(vl.qkv_bias && vl.sliding_window.is_none() && !vl.tie_word_embeddings);
    }

    /// Granite 3.1's MoE (3B-A800M) and Seed-OSS-36B, shaped as the hub has them.
    #[test]
    fn deepseek_v3s_hub_config_loads_as_latent_attention() {
        // DeepSeek-V3's config.json (its classic rope keys; the MoE fields abridged).
        let c = ModelConfig::from_json_str(
            r#"{"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
            "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
            "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
            "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc",
            "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
            "norm_topk_prob": true, "scoring_func": "sigmoid", "hidden_act": "silu",
            "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
            "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
            "tie_word_embeddings": false, "vocab_size": 129280, "attention_bias": false,
            "bos_token_id": 0, "eos_token_id": 1, "num_nextn_predict_layers": 1}"#,
            Path::new("/m/config.json"),
        )
        .unwrap();
        let mla = c.mla.clone().unwrap();
        assert_eq!(
            (c.head_dim, c.rotary_dim, c.num_key_value_heads),
            (192, 64, 128)
        );
        assert_eq!((mla.kv_lora_rank, mla.q_lora_rank), (512, Some(1536)));
        let m = 0.1 * 40f64.ln() + 1.0;
        assert_eq!(c.attention_scale(), (m * m / 192f64.sqrt()) as f32);
        let moe = c.moe.unwrap();
        assert_eq!(moe.sparse_layers.iter().filter(|&&s| !s).count(), 3);
        assert_eq!(moe.naming, ExpertNaming::DeepSeek);
        assert!(matches!(c.rope.scaling, RopeScaling::Yarn { .. }));
        assert!(!c.qkv_bias && !c.o_bias && !c.qk_norm);
    }

    #[test]
    fn qwen3_next_reads_its_grouped_projections_and_qwen2_moe_fields() {
        // Qwen3-Next-80B-A3B's config, `norm_topk_prob` left out (its class's default: true).
        let next = |extra: &str| {
            parse(&format!(
                r#"{{"architectures": ["Qwen3NextForCausalLM"], "hidden_size": 2048,
                "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16,
                "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 151936,
                "full_attention_interval": 4, "linear_num_key_heads": 16,
                "linear_num_value_heads": 32, "num_experts": 512, "num_experts_per_tok": 10,
                "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                "decoder_sparse_step": 1, "partial_rotary_factor": 0.25{extra}}}"#
            ))
            .unwrap()
        };
        let c = next("");
        assert!(c.architecture.has_qwen3_next_layers());
        let la = c.linear_attention.clone().unwrap();
        assert_eq!(la.projections, DeltaNetProjections::GroupedByKeyHead);
        assert_eq!((la.dims.key_heads, la.dims.value_heads), (16, 32));
        let moe = c.moe.unwrap();
        assert!(moe.norm_topk_prob && moe.sparse_layers.iter().all(|&s| s));
        let c = next(r#", "norm_topk_prob": false, "mlp_only_layers": [3]"#);
        let moe = c.moe.unwrap();
        assert!(!moe.norm_topk_prob && !moe.sparse_layers[3] && moe.sparse_layers[2]);
    }

    #[test]
    fn qwen3_5_moe_has_every_mlp_sparse_and_renormalised_whatever_else_it_says() {
        // Qwen3.5-35B-A3B's text model: no dense width; the Qwen2-MoE fields its class does
        // not read are ignored.
        let c = parse(
            r#"{"architectures": ["Qwen3_5MoeForCausalLM"], "hidden_size": 2048,
            "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
            "head_dim": 256, "vocab_size": 248320, "full_attention_interval": 4,
            "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "norm_topk_prob": false,
            "decoder_sparse_step": 2, "mlp_only_layers": [0],
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                "partial_rotary_factor": 0.25}}"#,
        )
        .unwrap();
        assert!(c.architecture.has_qwen3_next_layers() && c.architecture.attention_output_gate());
        let moe = c.moe.clone().unwrap();
        assert_eq!(
            (moe.num_experts, moe.top_k, moe.expert_intermediate_size),
            (256, 8, 512)
        );
        assert_eq!(moe.shared_expert_intermediate_size, Some(512));
        assert!(moe.norm_topk_prob && moe.sparse_layers.iter().all(|&s| s));
        assert_eq!(moe.sparse_layers.len(), 40);
        let la = c.linear_attention.unwrap();
        assert_eq!((0..40).filter(|&l| la.is_linear(l)).count(), 30);
    }

    #[test]
    fn granite_moe_and_seed_oss_hub_configs_load() {
        let granite = |arch: &str, shared: &str| {
            parse(&format!(
                r#"{{"architectures": ["{arch}"], "attention_bias": false,
                "attention_multiplier": 0.015625, "bos_token_id": 0, "embedding_multiplier": 12.0,
                "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 1536,
                "intermediate_size": 512, "logits_scaling": 6.0, "max_position_embeddings": 131072,
                "num_attention_heads": 24, "num_experts_per_tok": 8, "num_hidden_layers": 32,
                "num_key_value_heads": 8, "num_local_experts": 40, "residual_multiplier": 0.22,
                "rms_norm_eps": 1e-06, "rope_theta": 10000000.0, "tie_word_embeddings": true,
                "vocab_size": 49155{shared}}}"#
            ))
        };
        let c = granite("GraniteMoeForCausalLM", "").unwrap();
        let moe = c.moe.clone().unwrap();
        assert_eq!(
            (moe.num_experts, moe.top_k, moe.expert_intermediate_size),
            (40, 8, 512)
        );
        assert_eq!(moe.naming, ExpertNaming::Granite);
        assert!(moe.naming.softmax_over_top_k() && moe.shared_expert_intermediate_size.is_none());
        assert_eq!(c.granite.map(|g| g.logits), Some(6.0));
        let c = granite(
            "GraniteMoeSharedForCausalLM",
            r#", "shared_intermediate_size": 1024"#,
        )
        .unwrap();
        assert_eq!(c.moe.unwrap().shared_expert_intermediate_size, Some(1024));
        // Shared with a width of 0 has none; without the field it names it.
        let c = granite(
            "GraniteMoeSharedForCausalLM",
            r#", "shared_intermediate_size": 0"#,
        )
        .unwrap();
        assert_eq!(c.moe.unwrap().shared_expert_intermediate_size, None);
        let e = granite("GraniteMoeSharedForCausalLM", "")
            .unwrap_err()
            .to_string();
        assert!(e.contains("shared_intermediate_size"), "{e}");
        let seed = parse(
            r#"{"architectures": ["SeedOssForCausalLM"], "attention_bias": true,
            "attention_dropout": 0.1, "attention_out_bias": false, "bos_token_id": 0,
            "eos_token_id": 2, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
            "intermediate_size": 27648, "max_position_embeddings": 524288, "mlp_bias": false,
            "model_type": "seed_oss", "num_attention_heads": 80, "num_hidden_layers": 64,
            "num_key_value_heads": 8, "residual_dropout": 0.1, "rms_norm_eps": 1e-06,
            "rope_scaling": {"rope_type": "default"}, "rope_theta": 10000000.0,
            "tie_word_embeddings": false, "torch_dtype": "bfloat16", "vocab_size": 155136}"#,
        )
        .unwrap();
        assert_eq!(seed.architecture, Architecture::SeedOss);
        assert!(seed.qkv_bias && !seed.o_bias && seed.sliding_window.is_none());
        assert_eq!(seed.head_dim, 128);
    }

    /// gpt-oss-20b's config as the hub has it: MXFP4 experts (accepted for gpt-oss alone),
    /// YaRN without truncation serving 131,072, sliding and full layers alternating.
    #[test]
    fn gpt_oss_20b_config_loads_with_its_mxfp4_experts() {
        let kinds: Vec<&str> = (0..24)
            .map(|i| match i % 2 {
                0 => "\"sliding_attention\"",
                _ => "\"full_attention\"",
            })
            .collect();
        let json = |quant: &str| {
            format!(
                r#"{{"architectures": ["GptOssForCausalLM"], "attention_bias": true,
                "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64,
                "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
                "intermediate_size": 2880, "layer_types": [{}],
                "max_position_embeddings": 131072, "model_type": "gpt_oss",
                "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
                "num_key_value_heads": 8, "num_local_experts": 32, "pad_token_id": 199999,
                "quantization_config": {{"modules_to_not_convert": ["model.layers.*.self_attn",
                "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
                "quant_method": "{quant}"}}, "rms_norm_eps": 1e-05,
                "rope_scaling": {{"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                "original_max_position_embeddings": 4096, "rope_type": "yarn",
                "truncate": false}}, "rope_theta": 150000, "router_aux_loss_coef": 0.9,
                "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": false,
                "vocab_size": 201088}}"#,
                kinds.join(", ")
            )
        };
        let c = parse(&json("mxfp4")).unwrap();
        assert_eq!(c.architecture, Architecture::GptOss);
        assert!(c.architecture.has_attention_sinks() && c.qkv_bias && c.o_bias);
        assert_eq!((c.max_context(), c.sliding_window), (131_072, Some(128)));
        assert!(c.layer_slides(0) && !c.layer_slides(1) && c.layer_slides(22));
        let moe = c.moe.clone().unwrap();
        assert_eq!(
            (moe.num_experts, moe.top_k, moe.expert_intermediate_size),
            (32, 4, 2880)
        );
        assert_eq!(moe.naming, ExpertNaming::GptOss);
        assert_eq!(
            c.clamped_swiglu,
            Some(ClampedSwiglu {
                alpha: 1.702,
                limit: 7.0
            })
        );
        // 21 B parameters: their bf16 bytes, the experts' stacked tensors counted as matrices.
        let (bytes, _) = crate::model::weight_bytes(
            &c,
            candle_core::DType::BF16,
            &candle_core::Device::Cpu,
            false,
        );
        assert!((40e9..44e9).contains(&(bytes as f64)), "{bytes}");
        // Another method is refused, naming it; so is a bad activation setting.
        let e = parse(&json("awq")).unwrap_err().to_string();
        assert!(
            e.contains("quantization_config.quant_method") && e.contains("awq"),
            "{e}"
        );
        let e = parse(&json("mxfp4").replace(r#""swiglu_limit": 7.0"#, r#""swiglu_limit": -1"#))
            .unwrap_err()
            .to_string();
        assert!(e.contains("swiglu_limit"), "{e}");
    }

    #[test]
    fn ministral3_scales_queries_past_yarns_original_context() {
        let rope = r#""rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0,
            "factor": 16.0, "original_max_position_embeddings": 16384, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0"#;
        let c = parse(&format!(
            r#"{{"architectures": ["Ministral3ForCausalLM"], {BASE}, {rope},
            "llama_4_scaling_beta": 0.1}}}}"#
        ))
        .unwrap();
        assert_eq!(c.query_scale_beta, Some((0.1, 16384.0)));
        assert_eq!((c.max_context(), c.rope.attention_factor()), (262_144, 1.0));
        // Without a beta nothing is scaled; Mistral's layers never are.
        let plain = parse(&format!(
            r#"{{"architectures": ["Ministral3ForCausalLM"], {BASE}, {rope}}}}}"#
        ))
        .unwrap();
        assert_eq!(plain.query_scale_beta, None);
        let mistral = parse(&format!(
            r#"{{"architectures": ["MistralForCausalLM"], {BASE}, {rope},
            "llama_4_scaling_beta": 0.1}}}}"#
        ))
        .unwrap();
        assert_eq!(mistral.query_scale_beta, None);
    }

    #[test]
    fn quantized_checkpoints_are_refused_naming_the_method() {
        for (config, want) in [
            (
                format!(
                    r#"{{"architectures": ["LlamaForCausalLM"], {BASE},
                    "quantization_config": {{"quant_method": "awq", "bits": 4}}}}"#
                ),
                "`quantization_config.quant_method`: awq",
            ),
            (
                format!(
                    r#"{{"architectures": ["LlamaForCausalLM"], {BASE},
                    "quantization_config": {{"bits": 4}}}}"#
                ),
                "quantization_config",
            ),
            // A wrapper's quantization is at its top level (Ministral 3's FP8 checkpoints).
            (
                format!(
                    r#"{{"architectures": ["Mistral3ForConditionalGeneration"],
                    "quantization_config": {{"quant_method": "gptq", "bits": 4}},
                    "text_config": {{{BASE}}}}}"#
                ),
                "`text_config.quantization_config.quant_method`: gptq",
            ),
        ] {
            let e = parse(&config).unwrap_err().to_string();
            assert!(e.contains(want), "{want}: {e}");
        }
    }

    #[test]
    fn fp8_checkpoints_load_with_their_scales_layout() {
        // A wrapper's quantization is at its top level (Ministral 3's FP8 checkpoints).
        let c = parse(&format!(
            r#"{{"architectures": ["Mistral3ForConditionalGeneration"],
            "quantization_config": {{"quant_method": "fp8", "activation_scheme": "static",
                "weight_block_size": null, "modules_to_not_convert": ["lm_head"]}},
            "text_config": {{{BASE}}}}}"#
        ))
        .unwrap();
        let w = c.fp8_weights.unwrap();
        assert_eq!((w.block, w.scale_suffix), ([None, None], "_scale_inv"));
        assert!(!c.mxfp4_experts);
        // MXFP4 outside gpt-oss is refused, naming the method.
        let e = parse(&format!(
            r#"{{"architectures": ["LlamaForCausalLM"], {BASE},
            "quantization_config": {{"quant_method": "mxfp4"}}}}"#
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("quantization_config.quant_method") && e.contains("gpt-oss"),
            "{e}"
        );
        // What the memory check counts for a Llama-3.1-8B-shaped FP8 checkpoint: its layer
        // matrices a byte a weight where the CPU keeps them (embedding and LM head in bf16),
        // else all of it in bf16.
        let c = parse(
            r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": false,
            "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}"#,
        )
        .unwrap();
        let bytes = |kept| {
            let cpu = candle_core::Device::Cpu;
            crate::model::weight_bytes(&c, candle_core::DType::BF16, &cpu, kept).0 as f64
        };
        assert!((9.0e9..9.2e9).contains(&bytes(true)), "{}", bytes(true));
        assert!((16.0e9..16.1e9).contains(&bytes(false)), "{}", bytes(false));
    }

    #[test]
    fn phi3_fuses_its_projections_and_keeps_its_window() {
        let c = parse(&format!(
            r#"{{"architectures": ["Phi3ForCausalLM"], {BASE}, "sliding_window": 2047,
            "original_max_position_embeddings": 4096, "rope_scaling": null,
            "rope_parameters": {{"rope_type": "default", "rope_theta": 10000.0,
            "partial_rotary_factor": 1.0}}, "attention_bias": true, "mlp_bias": true}}"#
        ))
        .unwrap();
        assert_eq!(c.architecture, Architecture::Phi3);
        assert!(
            c.architecture.fused()
                == Fused {
                    qkv: true,
                    gate_up: true,
                    ..Fused::default()
                }
        );
        assert!(Architecture::Llama.fused() == Fused::default());
        assert_eq!(c.sliding_window, Some(2047));
        assert!(
            !(c.qkv_bias || c.o_bias || c.mlp_bias),
            "Phi-3 has no biases"
        );
        // A window no served sequence can outgrow is no window.
        let mut served = c.clone();
        served.serve_up_to(2048);
        assert_eq!(served.sliding_window, Some(2047));
        served.serve_up_to(2047);
        assert_eq!(served.sliding_window, None);
        // Rotating part of each head (Phi-4-mini) is the Phi-3 layout's alone, and needs an
        // even number of rotating dimensions (head_dim is 16 here); refusals name the field.
        assert_refused(
            "LlamaForCausalLM",
            &[
                (
                    r#""rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}"#,
                    "rope_parameters.partial_rotary_factor",
                ),
                (r#""partial_rotary_factor": 0.5"#, "partial_rotary_factor"),
            ],
        );
        assert_refused(
            "Phi3ForCausalLM",
            &[
                (r#""partial_rotary_factor": 0.1"#, "partial_rotary_factor"),
                (r#""partial_rotary_factor": 1.5"#, "partial_rotary_factor"),
                (
                    r#""rope_scaling": {"type": "longrope", "short_factor": [1.0]}"#,
                    "rope_scaling.short_factor",
                ),
            ],
        );
        let partial = parse(&format!(
            r#"{{"architectures": ["Phi3ForCausalLM"], {BASE}, "partial_rotary_factor": 0.75}}"#
        ))
        .unwrap();
        assert_eq!((partial.head_dim, partial.rotary_dim), (16, 12));
        assert_eq!(partial.rope.inv_freq(partial.rotary_dim).len(), 6);
        assert_eq!(c.rotary_dim, c.head_dim);
        // The top-level original context wins over the scaling's own (transformers' rule).
        let y = parse(&format!(
            r#"{{"architectures": ["Phi3ForCausalLM"], {BASE}, "original_max_position_embeddings": 1000,
            "rope_scaling": {{"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096}}}}"#
        ))
        .unwrap();
        assert_eq!(y.max_context(), 2000);
        let m = parse(&format!(r#"{{"model_type": "phi3", {BASE}}}"#)).unwrap();
        assert_eq!(m.architecture, Architecture::Phi3);
    }

    #[test]
    fn olmo2_norms_its_sublayers_outputs_and_whole_qk() {
        let c = parse(&format!(
            r#"{{"architectures": ["Olmo2ForCausalLM"], {BASE}, "attention_bias": false}}"#
        ))
        .unwrap();
        assert!(c.architecture.norms_whole_qk() && c.qk_norm);
        assert_eq!(c.architecture.sublayer_norms()[0], None);
        assert!(!Architecture::Qwen3.norms_whole_qk());
        assert!(c.architecture.fused() == Fused::default());
        assert_eq!(c.sliding_window, None);
    }

    #[test]
    fn olmo3_reads_its_layer_kinds_and_their_ropes() {
        let c = parse(
            r#"{"architectures": ["Olmo3ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
            "vocab_size": 100, "sliding_window": 16, "rope_parameters": {
              "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
                                  "original_max_position_embeddings": 8192},
              "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}}}"#,
        )
        .unwrap();
        assert!(c.architecture.norms_whole_qk() && c.qk_norm);
        // transformers' default pattern: every fourth layer attends to everything.
        let slides: Vec<bool> = (0..4).map(|i| c.layer_slides(i)).collect();
        assert_eq!(slides, [true, true, true, false]);
        assert!(matches!(c.rope.scaling, RopeScaling::Yarn { .. }));
        assert_eq!(c.max_context(), 65_536);
        let sliding = c.rope_sliding.as_ref().unwrap();
        assert_eq!(
            (sliding.theta, &sliding.scaling),
            (500000.0, &RopeScaling::None)
        );

        // The classic keys: `rope_scaling` scales the full-attention layers only.
        let classic = parse(&format!(
            r#"{{"architectures": ["Olmo3ForCausalLM"], {BASE}, "rope_theta": 500000.0,
            "layer_types": ["full_attention", "sliding_attention"],
            "rope_scaling": {{"rope_type": "yarn", "factor": 8.0,
                              "original_max_position_embeddings": 8192}}}}"#
        ))
        .unwrap();
        assert_eq!(
            (classic.layer_slides(0), classic.layer_slides(1)),
            (false, true)
        );
        assert_eq!(
            classic.sliding_window,
            Some(4096),
            "transformers' default window"
        );
        assert_eq!(classic.rope, c.rope);
        assert_eq!(classic.rope_sliding, c.rope_sliding);
        // Other models slide on every layer or none.
        let m = parse(&format!(
            r#"{{"architectures": ["MistralForCausalLM"], {BASE}, "sliding_window": 8}}"#
        ))
        .unwrap();
        assert!(m.layer_slides(0) && m.layer_slides(1) && m.sliding_layers.is_none());

        assert_refused(
            "Olmo3ForCausalLM",
            &[
                (r#""layer_types": ["full_attention"]"#, "layer_types"),
                (
                    r#""layer_types": ["chunked", "full_attention"]"#,
                    "layer_types",
                ),
                (
                    r#""rope_parameters": {"full_attention": {"rope_type": "dynamic"}}"#,
                    "rope_parameters.full_attention.rope_type",
                ),
            ],
        );
        let e = parse(&format!(
            r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "rope_parameters":
            {{"sliding_attention": {{"rope_type": "default"}}}}}}"#
        ))
        .unwrap_err();
        assert!(e.to_string().contains("rope_parameters"), "{e}");
    }

    #[test]
    fn granite_reads_its_multipliers() {
        let c = parse(&format!(
            r#"{{"architectures": ["GraniteForCausalLM"], {BASE}, "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22, "attention_multiplier": 0.0078125,
            "logits_scaling": 8.0}}"#
        ))
        .unwrap();
        let want = GraniteScales {
            embedding: 12.0,
            residual: 0.22,
            attention: 0.0078125,
            logits: 8.0,
        };
        assert_eq!(c.granite, Some(want));
        let llama = parse(&format!(
            r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "logits_scaling": 8.0}}"#
        ))
        .unwrap();
        assert_eq!(llama.granite, None, "only Granite reads them");
        let e = parse(&format!(
            r#"{{"architectures": ["GraniteForCausalLM"], {BASE}, "logits_scaling": 0.0}}"#
        ))
        .unwrap_err();
        assert!(e.to_string().contains("logits_scaling"), "{e}");
    }

    #[test]
    fn smollm3_reads_its_layers_without_rope() {
        let c = parse(&format!(
            r#"{{"architectures": ["SmolLM3ForCausalLM"], {BASE}, "no_rope_layers": [1, 0],
            "use_sliding_window": false, "sliding_window": null}}"#
        ))
        .unwrap();
        assert_eq!((c.layer_has_rope(0), c.layer_has_rope(1)), (true, false));
        assert_eq!(c.sliding_window, None);
        // transformers' default: every fourth layer without; the window on those only.
        let d = parse(
            r#"{"architectures": ["SmolLM3ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
            "vocab_size": 100, "use_sliding_window": true, "sliding_window": 32}"#,
        )
        .unwrap();
        let rope: Vec<bool> = (0..8).map(|i| d.layer_has_rope(i)).collect();
        assert_eq!(rope, [true, true, true, false, true, true, true, false]);
        let slides: Vec<bool> = (0..8).map(|i| d.layer_slides(i)).collect();
        assert_eq!(slides, rope.iter().map(|r| !r).collect::<Vec<_>>());
        assert!(Architecture::Llama != d.architecture);
        assert_refused(
            "SmolLM3ForCausalLM",
            &[
                (r#""no_rope_layers": [1]"#, "no_rope_layers"),
                (r#""no_rope_layers": [1, 2]"#, "no_rope_layers"),
                (r#""no_rope_layer_interval": 0"#, "no_rope_layer_interval"),
            ],
        );
    }

    #[test]
    fn qwen2_always_has_qkv_bias() {
        let c = parse(&format!(
            r#"{{"architectures": ["Qwen2ForCausalLM"], {BASE}}}"#
        ))
        .unwrap();
        assert!(c.qkv_bias && !c.o_bias && !c.qk_norm);
        let c = parse(&format!(
            r#"{{"architectures": ["Qwen3ForCausalLM"], {BASE}, "head_dim": 32}}"#
        ))
        .unwrap();
        assert!(c.qk_norm && !c.qkv_bias);
        assert_eq!(c.head_dim, 32);
    }

    #[test]
    fn gemma3_reads_transformers_defaults_and_both_rope_spellings() {
        // google/gemma-3-1b-it's config.json (transformers 4.50), shrunk.
        let classic = parse(
            r#"{"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 7,
            "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 100,
            "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 16,
            "sliding_window_pattern": 6, "rope_theta": 1000000, "rope_local_base_freq": 10000,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "attn_logit_softcapping": null, "final_logit_softcapping": null,
            "hidden_activation": "gelu_pytorch_tanh"}"#,
        )
        .unwrap();
        assert_eq!(classic.architecture, Architecture::Gemma3);
        assert_eq!(classic.hidden_act, Activation::GeluTanh);
        assert!(classic.tie_word_embeddings && classic.qk_norm);
        assert!(!classic.architecture.norms_whole_qk());
        assert_eq!(classic.architecture.norm_weight_offset(), 1.0);
        assert!(classic
            .architecture
            .sublayer_norms()
            .iter()
            .all(Option::is_some));
        assert_eq!(classic.attention_scale(), 32f32.powf(-0.5));
        let slides: Vec<bool> = (0..7).map(|i| classic.layer_slides(i)).collect();
        assert_eq!(slides, [true, true, true, true, true, false, true]);
        assert_eq!(classic.rope.theta, 1e6);
        assert_eq!(classic.rope.scaling, RopeScaling::Linear { factor: 8.0 });
        let local = classic.rope_sliding.as_ref().unwrap();
        assert_eq!((local.theta, &local.scaling), (1e4, &RopeScaling::None));

        // transformers 5's spelling: rope by layer kind, and `layer_types`.
        let nested = parse(&format!(
            r#"{{"architectures": ["Gemma3ForCausalLM"], {BASE}, "sliding_window": 16,
            "layer_types": ["full_attention", "sliding_attention"], "rope_parameters": {{
              "full_attention": {{"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
              "sliding_attention": {{"rope_type": "default"}}}}}}"#
        ))
        .unwrap();
        assert!(!nested.layer_slides(0) && nested.layer_slides(1));
        assert_eq!(nested.rope.theta, 1e6);
        // A kind without a theta falls back on the kind's own default.
        assert_eq!(nested.rope_sliding.as_ref().unwrap().theta, 1e4);
        // Defaults: head_dim 256, query_pre_attn_scalar 256, GeGLU, window 4096.
        let bare = parse(&format!(r#"{{"model_type": "gemma3_text", {BASE}}}"#)).unwrap();
        assert_eq!((bare.head_dim, bare.sliding_window), (256, Some(4096)));
        assert_eq!(bare.attention_scale(), 1.0 / 16.0);
        assert_eq!(bare.hidden_act, Activation::GeluTanh);
    }

    #[test]
    fn gemma2_reads_its_soft_caps_and_alternating_windows() {
        // google/gemma-2-2b-it's config.json, shrunk; the caps are transformers' defaults too.
        let c = parse(&format!(
            r#"{{"architectures": ["Gemma2ForCausalLM"], {BASE}, "head_dim": 16,
            "query_pre_attn_scalar": 16, "sliding_window": 8, "rope_theta": 10000.0,
            "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": 50.0}}"#
        ))
        .unwrap();
        assert_eq!(c.architecture, Architecture::Gemma2);
        let caps = (c.attn_logit_softcapping, c.final_logit_softcapping);
        assert_eq!(caps, (Some(50.0), Some(30.0)));
        assert!(!c.qk_norm && c.tie_word_embeddings && c.rope_sliding.is_none());
        assert_eq!(c.architecture.norm_weight_offset(), 1.0);
        assert!(c.layer_slides(0) && !c.layer_slides(1));
        let none = parse(&format!(
            r#"{{"model_type": "gemma2", {BASE}, "final_logit_softcapping": null}}"#
        ))
        .unwrap();
        assert_eq!(none.final_logit_softcapping, None);
        assert_eq!((none.vocab_size, none.max_context()), (100, 8192));
        // A reward model's scores are not capped (transformers caps a causal LM's logits);
        // its attention is, and transformers' defaults apply to it too.
        let reward = parse(&format!(
            r#"{{"architectures": ["Gemma2ForSequenceClassification"], {BASE},
            "id2label": {{"0": "LABEL_0"}}}}"#
        ))
        .unwrap();
        let caps = (
            reward.attn_logit_softcapping,
            reward.final_logit_softcapping,
        );
        assert_eq!(caps, (Some(50.0), None));
        assert_eq!(reward.head_dim, 256);
        // Other families' configs do not read the caps (as transformers does not).
        let llama = parse(&format!(
            r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "final_logit_softcapping": 30.0}}"#
        ))
        .unwrap();
        assert_eq!(llama.final_logit_softcapping, None);
    }

    #[test]
    fn bad_gemma_settings_are_refused_by_name() {
        assert_refused(
            "Gemma3ForCausalLM",
            &[
                (
                    r#""attn_logit_softcapping": -1.0"#,
                    "attn_logit_softcapping",
                ),
                (
                    r#""final_logit_softcapping": 0.0"#,
                    "final_logit_softcapping",
                ),
                (
                    r#""use_bidirectional_attention": true"#,
                    "use_bidirectional_attention",
                ),
                (r#""hidden_activation": "gelu""#, "hidden_activation"),
                (r#""query_pre_attn_scalar": 0"#, "query_pre_attn_scalar"),
                (r#""sliding_window_pattern": 0"#, "sliding_window_pattern"),
            ],
        );
        // GeGLU on a Llama layout runs; on experts it is refused.
        let c = parse(&format!(
            r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "hidden_act": "gelu_new"}}"#
        ))
        .unwrap();
        assert_eq!(c.hidden_act, Activation::GeluTanh);
        assert_refused(
            "MixtralForCausalLM",
            &[(
                r#""num_local_experts": 4, "num_experts_per_tok": 2,
                "hidden_act": "gelu_pytorch_tanh""#,
                "hidden_act",
            )],
        );
    }

    #[test]
    fn gemma3s_multimodal_checkpoints_serve_their_language_model() {
        // google/gemma-3-4b-it's config.json: the text model's settings are mostly
        // transformers' defaults.
        let c = parse(
            r#"{"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
            "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
            "mm_tokens_per_image": 256, "model_type": "gemma3",
            "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
              "model_type": "gemma3_text", "num_hidden_layers": 34,
              "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
            "torch_dtype": "bfloat16", "vision_config": {"hidden_size": 1152,
              "image_size": 896, "model_type": "siglip_vision_model", "patch_size": 14}}"#,
        )
        .unwrap();
        assert_eq!(c.architecture, Architecture::Gemma3);
        let dims = (c.hidden_size, c.intermediate_size, c.num_hidden_layers);
        assert_eq!(dims, (2560, 10240, 34));
        let heads = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        assert_eq!(heads, (8, 4, 256));
        assert_eq!((c.vocab_size, c.max_context()), (262_208, 131_072));
        assert_eq!(c.eos_token_ids, [1, 106]);
        assert_eq!(c.torch_dtype.as_deref(), Some("bfloat16"));
        assert!(c.tie_word_embeddings);
        assert_eq!(c.sliding_window, Some(1024));
        assert_eq!(c.rope.scaling, RopeScaling::Linear { factor: 8.0 });
        assert_eq!(c.rope_sliding.as_ref().unwrap().theta, 1e4);
        let full: Vec<usize> = (0..34).filter(|&i| !c.layer_slides(i)).collect();
        assert_eq!(full, [5, 11, 17, 23, 29]);
        // Errors name the field under `text_config`.
        let e = parse(
            r#"{"architectures": ["Gemma3ForConditionalGeneration"],
            "text_config": {"num_attention_heads": 0}}"#,
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("text_config.num_attention_heads"),
            "{e}"
        );
    }
}
