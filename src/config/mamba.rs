//! The Mamba2 part of a Granite 4.0-H or Bamba `config.json` (`GraniteMoeHybridConfig`'s and
//! `BambaConfig`'s `mamba_*` fields): which layers are Mamba2 mixers rather than attention,
//! and their widths.

use std::path::Path;

use serde::Deserialize;

use super::json::ConfigFields;
use crate::error::Result;

/// The widths of a Mamba2 mixer (transformers' `GraniteMoeHybridMambaLayer`): `in_proj` makes
/// per token a gate `z` (`inner` wide), the convolution's input `xBC` (`inner` values `x`,
/// then `groups` × `state` for `B` and as many for `C`) and one time step per head; a causal
/// depthwise convolution of `kernel` taps (then SiLU) mixes `xBC` with the tokens before; each
/// head keeps a `state × head_dim` matrix that decays by `e^{Δ·A}` and takes in `Δ · B xᵀ`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MambaDims {
    /// The convolution's taps per channel (`mamba_d_conv`).
    pub kernel: usize,
    /// `mamba_n_heads`.
    pub heads: usize,
    /// `mamba_d_head`; `heads · head_dim` is `mamba_expand · hidden_size`.
    pub head_dim: usize,
    /// `mamba_n_groups`: heads share `B` and `C` within a group.
    pub groups: usize,
    /// `mamba_d_state`.
    pub state: usize,
}

impl MambaDims {
    /// The mixer's inner width: `x`, `z` and the output are this wide.
    pub fn inner(&self) -> usize {
        self.heads * self.head_dim
    }

    /// The convolution's channels: `x`, `B`, `C`.
    pub fn conv_dim(&self) -> usize {
        self.inner() + 2 * self.groups * self.state
    }

    /// `in_proj`'s output: `z`, `xBC`, a time step per head.
    pub fn in_proj_dim(&self) -> usize {
        self.inner() + self.conv_dim() + self.heads
    }

    /// The convolution's part of the state: its last `kernel - 1` inputs.
    pub fn conv_state(&self) -> usize {
        (self.kernel - 1) * self.conv_dim()
    }

    /// The values a sequence's state takes in one layer: the convolution's part, then each
    /// head's `state × head_dim` matrix.
    pub fn state_values(&self) -> usize {
        self.conv_state() + self.heads * self.head_dim * self.state
    }
}

/// Granite 4.0-H's Mamba2 layers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MambaConfig {
    pub dims: MambaDims,
    /// Per layer: Mamba2 (`true`) or attention.
    pub layers: Vec<bool>,
    /// The convolution has a bias (`mamba_conv_bias`).
    pub conv_bias: bool,
    /// `in_proj` and `out_proj` have biases (`mamba_proj_bias`).
    pub proj_bias: bool,
}

impl MambaConfig {
    /// Whether layer `i` is a Mamba2 mixer.
    pub fn is_mamba(&self, i: usize) -> bool {
        self.layers.get(i).copied().unwrap_or(false)
    }
}

/// `config.json`'s Mamba fields as written.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct RawMamba {
    layer_types: Option<Vec<String>>,
    /// Bamba's: the attention layers (every other one Mamba2).
    attn_layer_indices: Option<Vec<usize>>,
    mamba_n_heads: Option<usize>,
    mamba_n_groups: Option<usize>,
    mamba_d_state: Option<usize>,
    /// A number, or `"auto"` (the inner width over the heads; the default).
    mamba_d_head: Option<serde_json::Value>,
    mamba_d_conv: Option<usize>,
    mamba_expand: Option<usize>,
    mamba_conv_bias: Option<bool>,
    mamba_proj_bias: Option<bool>,
    /// `[low, high]` ([`time_step_unclamped`]).
    time_step_limit: Option<Vec<serde_json::Value>>,
}

impl RawMamba {
    /// The checked fields, with `GraniteMoeHybridConfig`'s defaults, for a model of
    /// `num_layers` layers of `hidden_size`. Layer kinds: Bamba's `attn_layer_indices`, or
    /// Granite's `layer_types`, `"mamba"` (transformers 5: `"linear_attention"`) or
    /// `"attention"` (`"full_attention"`); every layer Mamba2 where neither says.
    pub(super) fn check(
        &self,
        path: &Path,
        num_layers: usize,
        hidden_size: usize,
    ) -> Result<MambaConfig> {
        let fields = ConfigFields { path };
        let heads = fields.positive("mamba_n_heads", self.mamba_n_heads, 128)?;
        let groups = fields.positive("mamba_n_groups", self.mamba_n_groups, 1)?;
        let state = fields.positive("mamba_d_state", self.mamba_d_state, 256)?;
        let kernel = fields.positive("mamba_d_conv", self.mamba_d_conv, 4)?;
        let inner = fields.positive("mamba_expand", self.mamba_expand, 2)? * hidden_size;
        let head_dim = match &self.mamba_d_head {
            None => inner / heads,
            Some(serde_json::Value::String(s)) if s == "auto" => inner / heads,
            Some(v) => match v.as_u64() {
                Some(n) if n > 0 => n as usize,
                _ => return Err(fields.err("mamba_d_head", format!("{v}: a width or \"auto\""))),
            },
        };
        if heads * head_dim != inner {
            return Err(fields.err(
                "mamba_d_head",
                format!(
                    "{heads} heads of {head_dim} must make mamba_expand × hidden_size = {inner}"
                ),
            ));
        }
        if heads % groups != 0 {
            return Err(fields.err(
                "mamba_n_groups",
                format!("{groups} does not divide mamba_n_heads={heads}"),
            ));
        }
        time_step_unclamped(fields, "time_step_limit", self.time_step_limit.as_ref())?;
        if let Some(bad) = self
            .attn_layer_indices
            .iter()
            .flatten()
            .find(|&&l| l >= num_layers)
        {
            return Err(fields.err(
                "attn_layer_indices",
                format!("layer {bad}, but the model has {num_layers} layers"),
            ));
        }
        let layers = match (&self.layer_types, &self.attn_layer_indices) {
            (_, Some(attends)) => (0..num_layers).map(|l| !attends.contains(&l)).collect(),
            (None, None) => vec![true; num_layers],
            (Some(types), None) if types.len() != num_layers => {
                return Err(fields.err(
                    "layer_types",
                    format!("{} entries for {num_layers} layers", types.len()),
                ))
            }
            (Some(types), None) => types
                .iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    "mamba" | "linear_attention" => Ok(true),
                    "attention" | "full_attention" => Ok(false),
                    other => Err(fields.err(
                        "layer_types",
                        format!("layer {i} is {other:?} (expected \"mamba\" or \"attention\")"),
                    )),
                })
                .collect::<Result<_>>()?,
        };
        Ok(MambaConfig {
            dims: MambaDims {
                kernel,
                heads,
                head_dim,
                groups,
                state,
            },
            layers,
            conv_bias: self.mamba_conv_bias.unwrap_or(true),
            proj_bias: self.mamba_proj_bias.unwrap_or(false),
        })
    }
}

/// Checks that a Mamba2 mixer's time step is unclamped (`limit` `[0, ∞]`, transformers'
/// default, where a config names one as `field`): a clamp would apply in transformers' whole-sequence
/// form only, not in the recurrent one it decodes with.
pub(super) fn time_step_unclamped(
    fields: ConfigFields<'_>,
    field: &str,
    limit: Option<&Vec<serde_json::Value>>,
) -> Result<()> {
    let Some(limit) = limit else {
        return Ok(());
    };
    // transformers 5 writes infinity as `{"__float__": "Infinity"}`.
    let value = |v: &serde_json::Value| match v {
        serde_json::Value::Object(o) => o
            .get("__float__")
            .and_then(|s| s.as_str())
            .and_then(|s| s.parse::<f64>().ok()),
        v => v.as_f64(),
    };
    match limit.as_slice() {
        [low, high] if value(low) == Some(0.0) && value(high) == Some(f64::INFINITY) => Ok(()),
        _ => Err(fields.err(
            field,
            format!("{limit:?}: only the unclamped [0, inf] is supported"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(json: &str, layers: usize) -> Result<MambaConfig> {
        serde_json::from_str::<RawMamba>(json)
            .unwrap()
            .check(Path::new("config.json"), layers, 64)
    }

    #[test]
    fn granite_4_h_fields_and_layer_kinds() {
        // transformers 5's spelling of the kinds and of infinity.
        let c = check(
            r#"{"layer_types": ["linear_attention", "full_attention", "mamba", "attention"],
            "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_n_groups": 2,
            "time_step_limit": [0.0, {"__float__": "Infinity"}]}"#,
            4,
        )
        .unwrap();
        assert_eq!(c.layers, [true, false, true, false]);
        let d = c.dims;
        assert_eq!((d.inner(), d.conv_dim(), d.in_proj_dim()), (128, 192, 324));
        assert_eq!(d.state_values(), 3 * 192 + 4 * 32 * 16);
        assert!(c.conv_bias && !c.proj_bias);
        let bamba = check(r#"{"mamba_n_heads": 4, "attn_layer_indices": [0, 2]}"#, 3).unwrap();
        assert_eq!(bamba.layers, [false, true, false]);
        let auto = check(r#"{"mamba_n_heads": 8, "mamba_d_head": "auto"}"#, 2).unwrap();
        assert_eq!((auto.dims.head_dim, auto.layers), (16, vec![true, true]));
    }

    #[test]
    fn bad_fields_are_named() {
        for (json, field) in [
            (r#"{"mamba_n_heads": 3}"#, "mamba_d_head"),
            (
                r#"{"mamba_n_heads": 2, "mamba_d_head": 32}"#,
                "mamba_d_head",
            ),
            (
                r#"{"mamba_n_heads": 2, "mamba_d_head": 64, "mamba_n_groups": 3}"#,
                "mamba_n_groups",
            ),
            (
                r#"{"mamba_n_heads": 2, "mamba_d_head": 64, "mamba_d_conv": 0}"#,
                "mamba_d_conv",
            ),
            (
                r#"{"mamba_n_heads": 2, "mamba_d_head": 64, "layer_types": ["mamba"]}"#,
                "layer_types",
            ),
            (
                r#"{"mamba_n_heads": 2, "mamba_d_head": 64, "layer_types": ["conv", "mamba"]}"#,
                "layer_types",
            ),
            (
                r#"{"mamba_n_heads": 2, "mamba_d_head": 64, "time_step_limit": [0.001, 0.1]}"#,
                "time_step_limit",
            ),
            (
                r#"{"mamba_n_heads": 2, "attn_layer_indices": [2]}"#,
                "attn_layer_indices",
            ),
        ] {
            let e = check(json, 2).unwrap_err().to_string();
            assert!(e.contains(field), "{json}: {e}");
        }
    }
}
