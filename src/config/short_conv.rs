//! The LFM2-specific part of a `config.json` (Liquid AI's LFM2: 350M, 700M, 1.2B, 2.6B): which
//! layers are gated short convolutions rather than attention, the convolution's taps, and the
//! fields LFM2 names its own way (its MLP width with the adjustment transformers applies to
//! it, `norm_eps`, `tie_embedding`).

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use super::json::{layer_kinds, ConfigFields};
use crate::error::{DetspecError, Result};

/// LFM2's gated short convolution (transformers' `Lfm2ShortConv`): `in_proj` makes three
/// `hidden`-wide vectors B, C, x of each token; the layer's output is
/// `out_proj(C ⊙ conv(B ⊙ x))`, where `conv` is a causal depthwise convolution over each
/// channel's last `kernel` tokens (the token's own `B ⊙ x` and the `kernel - 1` before it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShortConvConfig {
    /// Taps per channel (`conv_L_cache`).
    pub kernel: usize,
    /// Biases on `in_proj`, the convolution and `out_proj` (`conv_bias`).
    pub bias: bool,
    /// Per layer: a convolution (`true`) or attention.
    pub layers: Vec<bool>,
}

impl ShortConvConfig {
    /// Whether layer `i` is a convolution.
    pub fn is_conv(&self, i: usize) -> bool {
        self.layers.get(i).copied().unwrap_or(false)
    }
}

/// What LFM2's config says that the common reader does not read.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Lfm2Shape {
    pub(super) conv: ShortConvConfig,
    /// The MLP's width after transformers' adjustment (`Lfm2MLP`).
    pub(super) intermediate_size: usize,
    pub(super) norm_eps: Option<f64>,
    /// `tie_embedding` wins over `tie_word_embeddings`; LFM2's default is tied.
    pub(super) tie_word_embeddings: bool,
}

/// `config.json`'s LFM2 fields as written.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct RawLfm2 {
    #[serde(rename = "conv_L_cache")]
    conv_l_cache: Option<usize>,
    conv_bias: Option<bool>,
    layer_types: Option<Vec<String>>,
    full_attn_idxs: Option<Vec<usize>>,
    /// The hub's name for `intermediate_size` (it wins, as in `Lfm2Config`).
    block_ff_dim: Option<usize>,
    intermediate_size: Option<usize>,
    block_auto_adjust_ff_dim: Option<bool>,
    /// Absent: 1.0; `null`: no multiplier (and then no rounding to `block_multiple_of`).
    #[serde(deserialize_with = "present")]
    block_ffn_dim_multiplier: Option<Value>,
    block_multiple_of: Option<usize>,
    norm_eps: Option<f64>,
    tie_embedding: Option<bool>,
    tie_word_embeddings: Option<bool>,
}

/// A field's value as written, `null` included (serde reads a `null` `Option` as absent).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

impl RawLfm2 {
    /// The checked fields; `adjusts_width`: the MLP width is adjusted as `Lfm2MLP` adjusts it
    /// (LFM2's; LFM2-MoE's dense MLPs take `intermediate_size` as written).
    pub(super) fn check(
        &self,
        path: &Path,
        num_layers: usize,
        adjusts_width: bool,
    ) -> Result<Lfm2Shape> {
        let fields = ConfigFields { path };
        let err = |field: &str, message: String| fields.err(field, message);
        let kernel = fields.positive("conv_L_cache", self.conv_l_cache, 3)?;
        let layers = match (&self.layer_types, &self.full_attn_idxs) {
            (Some(types), _) => layer_kinds(types, num_layers, ["conv", "full_attention"])
                .map_err(|m| err("layer_types", m))?,
            (None, Some(idxs)) => {
                if let Some(&bad) = idxs.iter().find(|&&i| i >= num_layers) {
                    return Err(err(
                        "full_attn_idxs",
                        format!("layer {bad} does not exist ({num_layers} layers)"),
                    ));
                }
                (0..num_layers).map(|i| !idxs.contains(&i)).collect()
            }
            // transformers' default: every layer attends.
            (None, None) => vec![false; num_layers],
        };
        let width = self
            .block_ff_dim
            .or(self.intermediate_size)
            .ok_or_else(|| err("intermediate_size", "missing".into()))?;
        let intermediate_size = match adjusts_width {
            true => self.adjusted_width(width, &err)?,
            false => width,
        };
        if intermediate_size == 0 {
            return Err(err(
                "intermediate_size",
                format!("{width} adjusts to an MLP of width 0"),
            ));
        }
        Ok(Lfm2Shape {
            conv: ShortConvConfig {
                kernel,
                bias: self.conv_bias.unwrap_or(false),
                layers,
            },
            intermediate_size,
            norm_eps: self.norm_eps,
            tie_word_embeddings: self
                .tie_embedding
                .or(self.tie_word_embeddings)
                .unwrap_or(true),
        })
    }

    /// The MLP's width as `Lfm2MLP` computes it: with `block_auto_adjust_ff_dim` (on by
    /// default), two thirds of it, times the multiplier and rounded up to a multiple of
    /// `block_multiple_of` where there is a multiplier.
    fn adjusted_width(
        &self,
        width: usize,
        err: &impl Fn(&str, String) -> DetspecError,
    ) -> Result<usize> {
        if !self.block_auto_adjust_ff_dim.unwrap_or(true) {
            return Ok(width);
        }
        // Python's `int(2 * width / 3)`: a float division, truncated.
        let two_thirds = (2.0 * width as f64 / 3.0) as usize;
        let multiplier = match &self.block_ffn_dim_multiplier {
            None => Some(1.0),
            Some(Value::Null) => None,
            Some(v) => match v.as_f64() {
                Some(m) if m.is_finite() && m > 0.0 => Some(m),
                _ => {
                    return Err(err(
                        "block_ffn_dim_multiplier",
                        format!("{v}: must be a number > 0 or null"),
                    ))
                }
            },
        };
        let Some(multiplier) = multiplier else {
            return Ok(two_thirds);
        };
        let of = match self.block_multiple_of.unwrap_or(256) {
            0 => return Err(err("block_multiple_of", "must be > 0".into())),
            m => m,
        };
        let scaled = (multiplier * two_thirds as f64) as usize;
        Ok(scaled.div_ceil(of) * of)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(json: &str, layers: usize) -> Result<Lfm2Shape> {
        let raw: RawLfm2 = serde_json::from_str(json).map_err(|e| DetspecError::InvalidConfig {
            path: "config.json".into(),
            field: String::new(),
            message: e.to_string(),
        })?;
        raw.check(Path::new("config.json"), layers, true)
    }

    #[test]
    fn lfm2_1_2b_as_the_hub_writes_it() {
        let s = shape(
            r#"{"block_ff_dim": 12288, "block_auto_adjust_ff_dim": true,
                "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256, "conv_L_cache": 3,
                "conv_bias": false, "full_attn_idxs": [2, 5, 8, 10, 12, 14], "norm_eps": 1e-05}"#,
            16,
        )
        .unwrap();
        assert_eq!(s.intermediate_size, 8192);
        assert_eq!(s.conv.kernel, 3);
        assert!(!s.conv.bias);
        let attention: Vec<usize> = (0..16).filter(|&i| !s.conv.is_conv(i)).collect();
        assert_eq!(attention, [2, 5, 8, 10, 12, 14]);
        assert!(s.tie_word_embeddings);
        assert_eq!(s.norm_eps, Some(1e-5));
    }

    /// The hub's LFM2-1.2B config, read whole: names, the defaults LFM2 differs in (tied,
    /// theta 1e6), its eps field, per-head q/k norms.
    #[test]
    fn the_model_config_reads_lfm2() {
        use crate::config::{Architecture, ModelConfig};
        let text = r#"{"architectures": ["Lfm2ForCausalLM"], "block_auto_adjust_ff_dim": true,
            "block_ff_dim": 12288, "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256,
            "conv_L_cache": 3, "conv_bias": false, "full_attn_idxs": [2, 5, 8, 10, 12, 14],
            "hidden_size": 2048, "max_position_embeddings": 128000, "model_type": "lfm2",
            "norm_eps": 1e-05, "num_attention_heads": 32, "num_hidden_layers": 16,
            "num_key_value_heads": 8, "torch_dtype": "bfloat16", "vocab_size": 65536}"#;
        let c = ModelConfig::from_json_str(text, Path::new("config.json")).unwrap();
        assert_eq!(c.architecture, Architecture::Lfm2);
        assert_eq!((c.intermediate_size, c.head_dim), (8192, 64));
        assert_eq!(c.rms_norm_eps, 1e-5);
        assert!(c.tie_word_embeddings && c.qk_norm);
        assert_eq!(c.rope.theta, 1e6);
        let conv = c.short_conv.as_ref().unwrap();
        assert_eq!(conv.layers.iter().filter(|&&l| l).count(), 10);
        assert_eq!(c.architecture.o_proj_module(), "self_attn.out_proj");
        assert_eq!(c.architecture.final_norm(), "model.embedding_norm.weight");
        let e = ModelConfig::from_json_str(
            &text.replace("\"norm_eps\": 1e-05", "\"norm_eps\": 0"),
            Path::new("config.json"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("norm_eps"), "{e}");
    }

    /// LFM2-8B-A1B's config: LFM2's layers, the MLP width as written, experts after the
    /// dense first layers, routed with the experts' bias.
    #[test]
    fn the_model_config_reads_lfm2_moe() {
        use crate::config::{Architecture, ExpertNaming, ModelConfig, Scoring};
        let kinds = ["conv", "conv", "full_attention", "conv"];
        let text = format!(
            r#"{{"architectures": ["Lfm2MoeForCausalLM"], "hidden_size": 2048,
            "intermediate_size": 7168, "moe_intermediate_size": 1792, "num_experts": 32,
            "num_experts_per_tok": 4, "num_dense_layers": 2, "norm_topk_prob": true,
            "use_expert_bias": true, "routed_scaling_factor": 1.0, "num_hidden_layers": 4,
            "layer_types": {kinds:?}, "num_attention_heads": 32, "num_key_value_heads": 8,
            "norm_eps": 1e-05, "vocab_size": 65536}}"#
        );
        let c = ModelConfig::from_json_str(&text, Path::new("config.json")).unwrap();
        assert_eq!(c.architecture, Architecture::Lfm2Moe);
        assert!(c.architecture.is_lfm2() && c.tie_word_embeddings);
        assert_eq!(c.intermediate_size, 7168);
        assert_eq!(
            c.short_conv.as_ref().unwrap().layers,
            [true, true, false, true]
        );
        let moe = c.moe.as_ref().unwrap();
        assert_eq!(moe.naming, ExpertNaming::Lfm2);
        assert_eq!(moe.sparse_layers, [false, false, true, true]);
        assert_eq!(
            (moe.num_experts, moe.top_k, moe.expert_intermediate_size),
            (32, 4, 1792)
        );
        assert!(moe.norm_topk_prob && moe.shared_expert_intermediate_size.is_none());
        let routing = moe.deepseek_routing.unwrap();
        assert_eq!(routing.scoring, Scoring::Sigmoid);
        assert_eq!((routing.n_group, routing.routed_scaling_factor), (1, 1.0));
        let refused = |from: &str, to: &str| {
            ModelConfig::from_json_str(&text.replace(from, to), Path::new("config.json"))
                .unwrap_err()
                .to_string()
        };
        let e = refused("\"use_expert_bias\": true", "\"use_expert_bias\": false");
        assert!(e.contains("use_expert_bias"), "{e}");
        let e = refused(
            "\"routed_scaling_factor\": 1.0",
            "\"routed_scaling_factor\": 0",
        );
        assert!(e.contains("routed_scaling_factor"), "{e}");
    }

    #[test]
    fn widths_follow_lfm2_mlp() {
        // 2·128/3 = 85, ×1.0, up to a multiple of 16: 96.
        let w = |extra: &str| {
            shape(&format!(r#"{{"intermediate_size": 128{extra}}}"#), 1)
                .map(|s| s.intermediate_size)
        };
        assert_eq!(w(r#", "block_multiple_of": 16"#).unwrap(), 96);
        assert_eq!(w(r#", "block_ffn_dim_multiplier": null"#).unwrap(), 85);
        assert_eq!(w(r#", "block_auto_adjust_ff_dim": false"#).unwrap(), 128);
        assert_eq!(
            w(r#", "block_ffn_dim_multiplier": 1.5, "block_multiple_of": 16"#).unwrap(),
            128
        );
        assert!(w(r#", "block_ffn_dim_multiplier": -1"#).is_err());
        assert!(w(r#", "block_multiple_of": 0"#).is_err());
    }

    #[test]
    fn layer_kinds_are_read_and_checked() {
        let s = shape(
            r#"{"intermediate_size": 64, "layer_types": ["conv", "full_attention", "conv"]}"#,
            3,
        )
        .unwrap();
        assert_eq!(s.conv.layers, [true, false, true]);
        let e = shape(
            r#"{"intermediate_size": 64, "layer_types": ["conv", "mamba"]}"#,
            2,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("layer_types") && e.contains("mamba"), "{e}");
        let e = shape(r#"{"intermediate_size": 64, "layer_types": ["conv"]}"#, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("1 entries for 2 layers"), "{e}");
        let e = shape(r#"{"intermediate_size": 64, "full_attn_idxs": [4]}"#, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("full_attn_idxs") && e.contains("layer 4"), "{e}");
        let e = shape(r#"{"intermediate_size": 64, "conv_L_cache": 0}"#, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("conv_L_cache"), "{e}");
        // `tie_embedding` wins.
        let s = shape(
            r#"{"intermediate_size": 64, "tie_embedding": false, "tie_word_embeddings": true}"#,
            1,
        )
        .unwrap();
        assert!(!s.tie_word_embeddings);
    }
}
