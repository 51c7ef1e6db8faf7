//! The linear-attention part of a Qwen3-Next or Qwen3.5 `config.json`: which layers are gated
//! DeltaNets rather than attention, and their widths.

use std::path::Path;

use serde::Deserialize;

use super::json::{layer_kinds, ConfigFields};
use crate::error::Result;

/// The widths of Qwen3.5's gated DeltaNet (transformers' `Qwen3_5GatedDeltaNet`): per token,
/// `in_proj_qkv` makes queries and keys of `key_heads` heads and values of `value_heads`
/// heads, which a causal depthwise convolution of `kernel` taps (then SiLU) mixes with the
/// tokens before; each value head keeps a `key_dim × value_dim` state that decays and takes
/// in each token by the delta rule. The state is a function of the whole prefix (`kv::state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaNetDims {
    /// The convolution's taps per channel (`linear_conv_kernel_dim`).
    pub kernel: usize,
    pub key_heads: usize,
    pub value_heads: usize,
    /// A key (and query) head's width.
    pub key_dim: usize,
    /// A value head's width.
    pub value_dim: usize,
}

impl DeltaNetDims {
    /// Queries, keys and values of one token: the convolution's channels.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }

    /// The convolution's part of the state: its last `kernel - 1` inputs.
    pub fn conv_state(&self) -> usize {
        (self.kernel - 1) * self.conv_dim()
    }

    /// The values a sequence's state takes in one layer: the convolution's part, then each
    /// value head's `key_dim × value_dim` matrix.
    pub fn state_values(&self) -> usize {
        self.conv_state() + self.value_heads * self.key_dim * self.value_dim
    }
}

/// How a checkpoint stores a DeltaNet's input projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeltaNetProjections {
    /// Qwen3.5's: `in_proj_qkv` (every query head, then every key head, then every value
    /// head: the convolution's channels in order), `in_proj_z`, `in_proj_b`, `in_proj_a`.
    Split,
    /// Qwen3-Next's: `in_proj_qkvz` holds, per key head, its query, its key, then the values
    /// and gates of the value heads that share it; `in_proj_ba`, per key head, their `b`s
    /// then their `a`s. Read into the split form at load.
    GroupedByKeyHead,
}

/// Qwen3-Next's and Qwen3.5's linear-attention layers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinearAttentionConfig {
    pub dims: DeltaNetDims,
    /// Per layer: linear attention (`true`) or full attention.
    pub layers: Vec<bool>,
    pub projections: DeltaNetProjections,
}

impl LinearAttentionConfig {
    /// Whether layer `i` is linear attention.
    pub fn is_linear(&self, i: usize) -> bool {
        self.layers.get(i).copied().unwrap_or(false)
    }
}

/// `config.json`'s linear-attention fields as written.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct RawLinearAttention {
    linear_conv_kernel_dim: Option<usize>,
    linear_key_head_dim: Option<usize>,
    linear_value_head_dim: Option<usize>,
    linear_num_key_heads: Option<usize>,
    linear_num_value_heads: Option<usize>,
    layer_types: Option<Vec<String>>,
    full_attention_interval: Option<usize>,
}

impl RawLinearAttention {
    /// The checked fields, with transformers' defaults (`Qwen3NextConfig`'s).
    pub(super) fn check(
        &self,
        path: &Path,
        num_layers: usize,
        projections: DeltaNetProjections,
    ) -> Result<LinearAttentionConfig> {
        let fields = ConfigFields { path };
        let kernel = fields.positive("linear_conv_kernel_dim", self.linear_conv_kernel_dim, 4)?;
        let key_dim = fields.positive("linear_key_head_dim", self.linear_key_head_dim, 128)?;
        let value_dim =
            fields.positive("linear_value_head_dim", self.linear_value_head_dim, 128)?;
        let key_heads = fields.positive("linear_num_key_heads", self.linear_num_key_heads, 16)?;
        let value_heads =
            fields.positive("linear_num_value_heads", self.linear_num_value_heads, 32)?;
        if value_heads % key_heads != 0 {
            return Err(fields.err(
                "linear_num_value_heads",
                format!("{value_heads} is not a multiple of linear_num_key_heads={key_heads}"),
            ));
        }
        let layers = match &self.layer_types {
            Some(types) => layer_kinds(types, num_layers, ["linear_attention", "full_attention"])
                .map_err(|m| fields.err("layer_types", m))?,
            // transformers' default: every `full_attention_interval`-th layer attends.
            None => {
                let every =
                    fields.positive("full_attention_interval", self.full_attention_interval, 4)?;
                (0..num_layers).map(|i| (i + 1) % every != 0).collect()
            }
        };
        Ok(LinearAttentionConfig {
            dims: DeltaNetDims {
                kernel,
                key_heads,
                value_heads,
                key_dim,
                value_dim,
            },
            layers,
            projections,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(json: &str, layers: usize) -> Result<LinearAttentionConfig> {
        serde_json::from_str::<RawLinearAttention>(json)
            .unwrap()
            .check(Path::new("config.json"), layers, DeltaNetProjections::Split)
    }

    #[test]
    fn defaults_and_layer_kinds() {
        let c = check("{}", 8).unwrap();
        let d = c.dims;
        assert_eq!((d.kernel, d.key_heads, d.value_heads), (4, 16, 32));
        assert_eq!(c.layers, [true, true, true, false, true, true, true, false]);
        assert_eq!(d.conv_dim(), 2 * 16 * 128 + 32 * 128);
        assert_eq!(d.state_values(), 3 * d.conv_dim() + 32 * 128 * 128);
        let c = check(
            r#"{"layer_types": ["full_attention", "linear_attention"],
                "linear_num_key_heads": 2, "linear_num_value_heads": 4}"#,
            2,
        )
        .unwrap();
        assert_eq!(c.layers, [false, true]);
    }

    #[test]
    fn bad_fields_are_named() {
        for (json, field) in [
            (
                r#"{"linear_num_value_heads": 5, "linear_num_key_heads": 2}"#,
                "linear_num_value_heads",
            ),
            (r#"{"linear_conv_kernel_dim": 0}"#, "linear_conv_kernel_dim"),
            (r#"{"layer_types": ["full_attention"]}"#, "layer_types"),
            (
                r#"{"layer_types": ["mamba", "full_attention"]}"#,
                "layer_types",
            ),
        ] {
            let e = check(json, 2).unwrap_err().to_string();
            assert!(e.contains(field), "{json}: {e}");
        }
    }
}
