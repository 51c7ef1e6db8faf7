//! The multi-head latent attention part of a DeepSeek-V3 `config.json` (DeepSeek-V3/R1/V3.1,
//! Kimi K2, Moonlight): the latent ranks, each head's query/key and value widths, how rope
//! pairs the rotated dimensions, and the softmax scale YaRN sets.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::error::{DetspecError, Result};

/// DeepSeek's attention (transformers' `DeepseekV3Attention`): queries from the hidden state
/// (through a rank-`q_lora_rank` bottleneck with its norm, or one matrix), keys and values
/// from one shared latent of rank `kv_lora_rank` (normed, then expanded per head) plus a
/// rotated key part every head shares. A head's query and key are `qk_nope_head_dim` plain
/// dimensions and `qk_rope_head_dim` rotated ones; its value is `v_head_dim` wide.
#[derive(Debug, Clone, PartialEq)]
pub struct MlaConfig {
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// Rope pairs neighbouring dimensions (`rope_interleave`, on by default) rather than halves.
    pub rope_interleave: bool,
    /// The softmax scale: `qk_head_dim^-½`, times YaRN's `mscale(factor, mscale_all_dim)²`
    /// where the rope sets one (transformers' `yarn_apply_mscale`).
    pub softmax_scale: f64,
}

impl MlaConfig {
    /// A head's query and key width.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
}

/// `config.json`'s latent-attention fields as written.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct RawMla {
    q_lora_rank: Option<usize>,
    kv_lora_rank: Option<usize>,
    qk_nope_head_dim: Option<usize>,
    qk_rope_head_dim: Option<usize>,
    v_head_dim: Option<usize>,
    rope_interleave: Option<bool>,
    attention_bias: Option<bool>,
    rope_parameters: Option<Value>,
    rope_scaling: Option<Value>,
}

impl RawMla {
    /// The checked settings. The engine's KV cache holds each head's key and value at the
    /// query/key width (`qk_head_dim`), so a value wider than that is refused.
    pub(super) fn check(&self, path: &Path) -> Result<MlaConfig> {
        let err = |field: &str, message: String| DetspecError::InvalidConfig {
            path: path.to_path_buf(),
            field: field.to_string(),
            message,
        };
        let positive = |field: &str, v: Option<usize>| match v {
            None => Err(err(field, "missing".into())),
            Some(0) => Err(err(field, "must be > 0".into())),
            Some(v) => Ok(v),
        };
        let kv_lora_rank = positive("kv_lora_rank", self.kv_lora_rank)?;
        let qk_nope_head_dim = positive("qk_nope_head_dim", self.qk_nope_head_dim)?;
        let qk_rope_head_dim = positive("qk_rope_head_dim", self.qk_rope_head_dim)?;
        let v_head_dim = positive("v_head_dim", self.v_head_dim)?;
        if self.q_lora_rank == Some(0) {
            return Err(err("q_lora_rank", "must be > 0 (or null)".into()));
        }
        if !qk_rope_head_dim.is_multiple_of(2) {
            return Err(err(
                "qk_rope_head_dim",
                format!("{qk_rope_head_dim}: rotary pairs need an even number"),
            ));
        }
        let qk_head_dim = qk_nope_head_dim + qk_rope_head_dim;
        if v_head_dim > qk_head_dim {
            return Err(err(
                "v_head_dim",
                format!(
                    "{v_head_dim} is wider than a query/key head ({qk_head_dim}); the KV cache \
                     holds values at that width"
                ),
            ));
        }
        if self.attention_bias == Some(true) {
            return Err(err(
                "attention_bias",
                "biases on the latent attention's projections are not supported".into(),
            ));
        }
        let rope = self.rope_parameters.as_ref().or(self.rope_scaling.as_ref());
        Ok(MlaConfig {
            q_lora_rank: self.q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
            rope_interleave: self.rope_interleave.unwrap_or(true),
            softmax_scale: (qk_head_dim as f64).powf(-0.5) * yarn_mscale_squared(rope),
        })
    }
}

/// `mscale(factor, mscale_all_dim)²` of a YaRN-type rope that names `mscale_all_dim`
/// (`0.1 · m · ln(factor) + 1`, 1 for a factor ≤ 1), else 1.
fn yarn_mscale_squared(rope: Option<&Value>) -> f64 {
    let Some(r) = rope else { return 1.0 };
    let kind = r
        .get("rope_type")
        .or_else(|| r.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let all_dim = r
        .get("mscale_all_dim")
        .and_then(Value::as_f64)
        .unwrap_or(0.0);
    let factor = r.get("factor").and_then(Value::as_f64).unwrap_or(1.0);
    if kind == "default" || all_dim == 0.0 || factor <= 1.0 {
        return 1.0;
    }
    let m = 0.1 * all_dim * factor.ln() + 1.0;
    m * m
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<MlaConfig> {
        serde_json::from_str::<RawMla>(json)
            .unwrap()
            .check(Path::new("/m/config.json"))
    }

    #[test]
    fn deepseek_v3s_settings_and_its_yarn_softmax_scale() {
        let c = parse(
            r#"{"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_scaling": {"type": "yarn",
            "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32}}"#,
        )
        .unwrap();
        assert_eq!(c.qk_head_dim(), 192);
        assert!(c.rope_interleave && c.q_lora_rank == Some(1536));
        let m = 0.1 * 40f64.ln() + 1.0;
        assert!((c.softmax_scale - m * m / 192f64.sqrt()).abs() < 1e-12);
        // Without a YaRN mscale_all_dim (or with the default rope), the plain scale.
        let plain = parse(
            r#"{"q_lora_rank": null, "kv_lora_rank": 32, "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16, "v_head_dim": 32, "rope_interleave": false,
            "rope_parameters": {"rope_type": "default", "mscale_all_dim": 1.0, "factor": 4}}"#,
        )
        .unwrap();
        assert_eq!(plain.softmax_scale, 48f64.powf(-0.5));
        assert!(!plain.rope_interleave && plain.q_lora_rank.is_none());
    }

    #[test]
    fn errors_name_the_field() {
        let base = r#""kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16"#;
        for (json, field) in [
            (format!("{{{base}}}"), "v_head_dim"),
            (format!("{{{base}, \"v_head_dim\": 64}}"), "v_head_dim"),
            (
                format!("{{{base}, \"v_head_dim\": 8, \"q_lora_rank\": 0}}"),
                "q_lora_rank",
            ),
            (
                r#"{"kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 15,
                "v_head_dim": 8}"#
                    .to_string(),
                "qk_rope_head_dim",
            ),
            (
                format!("{{{base}, \"v_head_dim\": 8, \"attention_bias\": true}}"),
                "attention_bias",
            ),
        ] {
            let e = parse(&json).unwrap_err();
            assert!(e.to_string().contains(field), "{field}: {e}");
        }
    }
}
