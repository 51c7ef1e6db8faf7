//! Nemotron-H's `config.json` (`NemotronHConfig`: Nemotron-H 4B/8B/47B/56B, Nemotron Nano 2
//! 9B/12B, Nemotron 3 Nano): each layer is one block, a norm and one sublayer added to the
//! residual stream — a Mamba2 mixer, attention, an MLP or (Nemotron 3) a mixture of experts —
//! named by `layers_block_type` (or the older `hybrid_override_pattern`, one letter a layer:
//! `M`, `*`, `-`, `E`). The Mamba2 mixers are Granite 4.0-H's ([`super::MambaConfig`]) under
//! Nemotron-H's own field names; the experts' fields are read with DeepSeek-V3's
//! (`super::moe_config`).

use std::path::Path;

use serde::Deserialize;

use super::json::ConfigFields;
use super::mamba::{time_step_unclamped, MambaConfig, MambaDims};
use crate::error::Result;

/// What one Nemotron-H layer holds besides its norm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sublayer {
    /// A token mixer: a Mamba2 mixer or attention (the layer's Mamba2 flag says which).
    Mixer,
    /// An MLP (`mlp`) or a mixture of experts (`moe`).
    Mlp,
}

/// The checked Nemotron-H fields.
#[derive(Debug, Clone)]
pub(super) struct NemotronHShape {
    /// Each layer's sublayer.
    pub sublayers: Vec<Sublayer>,
    /// Its Mamba2 mixers (`layers`: the `M` blocks).
    pub mamba: MambaConfig,
    /// Which layers' MLPs are mixtures of experts (the `E` blocks).
    pub sparse: Vec<bool>,
    /// Their shared expert's width (`moe_shared_expert_intermediate_size`).
    pub shared_width: usize,
}

/// `config.json`'s Nemotron-H fields as written (transformers' `NemotronHConfig` reads the
/// older `mamba_*` names too).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct RawNemotronH {
    layers_block_type: Option<Vec<String>>,
    hybrid_override_pattern: Option<String>,
    mamba_num_heads: Option<usize>,
    mamba_head_dim: Option<usize>,
    ssm_state_size: Option<usize>,
    n_groups: Option<usize>,
    mamba_n_groups: Option<usize>,
    conv_kernel: Option<usize>,
    mamba_d_conv: Option<usize>,
    use_conv_bias: Option<bool>,
    mamba_conv_bias: Option<bool>,
    /// `in_proj` and `out_proj` biases.
    use_bias: Option<bool>,
    mamba_hidden_act: Option<String>,
    time_step_limit: Option<Vec<serde_json::Value>>,
    mamba_dt_limit: Option<Vec<serde_json::Value>>,
    moe_shared_expert_intermediate_size: Option<usize>,
    /// Nemotron 3 Super's experts in a narrower latent space (`fc1_latent_proj`).
    moe_latent_size: Option<usize>,
}

impl RawNemotronH {
    /// The checked fields, with `NemotronHConfig`'s defaults.
    pub(super) fn check(&self, path: &Path) -> Result<NemotronHShape> {
        let fields = ConfigFields { path };
        let (field, kinds): (&str, Vec<String>) =
            match (&self.layers_block_type, &self.hybrid_override_pattern) {
                (Some(types), _) => ("layers_block_type", types.clone()),
                (None, Some(pattern)) => (
                    "hybrid_override_pattern",
                    pattern
                        .chars()
                        .map(|c| match c {
                            'M' => "linear_attention".to_string(),
                            '*' => "full_attention".to_string(),
                            '-' => "mlp".to_string(),
                            'E' => "moe".to_string(),
                            other => other.to_string(),
                        })
                        .collect(),
                ),
                (None, None) => return Err(fields.err("layers_block_type", "missing")),
            };
        if kinds.is_empty() {
            return Err(fields.err(field, "names no layer"));
        }
        let mut sublayers = Vec::with_capacity(kinds.len());
        let (mut mamba, mut sparse) = (Vec::new(), Vec::new());
        for (i, kind) in kinds.iter().enumerate() {
            let (sublayer, is_mamba, is_sparse) = match kind.as_str() {
                "linear_attention" | "mamba" => (Sublayer::Mixer, true, false),
                "full_attention" | "attention" => (Sublayer::Mixer, false, false),
                "mlp" => (Sublayer::Mlp, false, false),
                "moe" => (Sublayer::Mlp, false, true),
                other => {
                    return Err(fields.err(
                        field,
                        format!(
                            "layer {i} is {other:?} (expected \"linear_attention\", \
                             \"full_attention\", \"mlp\" or \"moe\"; M, *, - or E)"
                        ),
                    ))
                }
            };
            sublayers.push(sublayer);
            mamba.push(is_mamba);
            sparse.push(is_sparse);
        }
        if let Some(act) = self.mamba_hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(fields.err(
                "mamba_hidden_act",
                format!("{act:?}: the Mamba2 mixer's convolution runs silu only"),
            ));
        }
        let heads = fields.positive("mamba_num_heads", self.mamba_num_heads, 128)?;
        let groups = fields.positive("n_groups", self.n_groups.or(self.mamba_n_groups), 8)?;
        if heads % groups != 0 {
            return Err(fields.err(
                "n_groups",
                format!("{groups} does not divide mamba_num_heads={heads}"),
            ));
        }
        if let Some(latent) = self.moe_latent_size.filter(|_| sparse.contains(&true)) {
            return Err(fields.err(
                "moe_latent_size",
                format!("{latent}: experts in a latent space are not supported (only null)"),
            ));
        }
        let limit = self
            .time_step_limit
            .as_ref()
            .or(self.mamba_dt_limit.as_ref());
        time_step_unclamped(fields, "time_step_limit", limit)?;
        Ok(NemotronHShape {
            sublayers,
            mamba: MambaConfig {
                dims: MambaDims {
                    kernel: fields.positive(
                        "conv_kernel",
                        self.conv_kernel.or(self.mamba_d_conv),
                        4,
                    )?,
                    heads,
                    head_dim: fields.positive("mamba_head_dim", self.mamba_head_dim, 64)?,
                    groups,
                    state: fields.positive("ssm_state_size", self.ssm_state_size, 128)?,
                },
                layers: mamba,
                conv_bias: self.use_conv_bias.or(self.mamba_conv_bias).unwrap_or(true),
                proj_bias: self.use_bias.unwrap_or(false),
            },
            sparse,
            shared_width: fields.positive(
                "moe_shared_expert_intermediate_size",
                self.moe_shared_expert_intermediate_size,
                7688,
            )?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(json: &str) -> Result<NemotronHShape> {
        serde_json::from_str::<RawNemotronH>(json)
            .unwrap()
            .check(Path::new("config.json"))
    }

    #[test]
    fn block_kinds_by_list_and_by_pattern() {
        let by_list = check(
            r#"{"layers_block_type": ["linear_attention", "mlp", "full_attention", "moe"],
            "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 16, "n_groups": 2,
            "time_step_limit": [0.0, {"__float__": "Infinity"}]}"#,
        )
        .unwrap();
        let by_pattern = check(
            r#"{"hybrid_override_pattern": "M-*E", "mamba_num_heads": 4, "mamba_head_dim": 8,
            "ssm_state_size": 16, "mamba_n_groups": 2, "mamba_d_conv": 3}"#,
        )
        .unwrap();
        for shape in [&by_list, &by_pattern] {
            use Sublayer::*;
            assert_eq!(shape.sublayers, [Mixer, Mlp, Mixer, Mlp]);
            assert_eq!(shape.mamba.layers, [true, false, false, false]);
            assert_eq!(shape.sparse, [false, false, false, true]);
            assert_eq!(shape.mamba.dims.inner(), 32);
            assert_eq!(shape.mamba.dims.groups, 2);
        }
        assert_eq!(
            (by_list.mamba.dims.kernel, by_pattern.mamba.dims.kernel),
            (4, 3)
        );
    }

    /// Nemotron 3's: DeepSeek-V3's routing over ungated experts in the `E` layers, one shared
    /// expert as wide as `moe_shared_expert_intermediate_size` says.
    #[test]
    fn mixtures_of_experts_where_the_pattern_says() {
        let json = r#"{"architectures": ["NemotronHForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "vocab_size": 100, "hybrid_override_pattern": "ME*-E",
            "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 8, "n_groups": 2,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 48, "n_shared_experts": 1, "n_group": 2,
            "topk_group": 1, "routed_scaling_factor": 2.5, "time_step_limit": [0.0, Infinity]}"#;
        let cfg =
            crate::config::ModelConfig::from_json_str(json, Path::new("config.json")).unwrap();
        let moe = cfg.moe.as_ref().unwrap();
        assert_eq!(moe.sparse_layers, [false, true, false, false, true]);
        assert!(moe.ungated && moe.norm_topk_prob && moe.router_f32());
        assert_eq!(moe.shared_expert_intermediate_size, Some(48));
        assert_eq!(moe.expert_intermediate_size, 32);
        let r = moe.deepseek_routing.unwrap();
        assert_eq!(
            (r.n_group, r.topk_group, r.routed_scaling_factor),
            (2, 1, 2.5)
        );
        assert!(cfg.has_mlp(1) && !cfg.has_mixer(1) && cfg.has_mixer(2) && !cfg.has_mlp(2));
    }

    #[test]
    fn bad_fields_are_named() {
        for (json, field) in [
            (r#"{}"#, "layers_block_type"),
            (r#"{"layers_block_type": []}"#, "layers_block_type"),
            (r#"{"layers_block_type": ["mamba2"]}"#, "layers_block_type"),
            (
                r#"{"hybrid_override_pattern": "M-X"}"#,
                "hybrid_override_pattern",
            ),
            (
                r#"{"hybrid_override_pattern": "M", "mamba_num_heads": 6, "n_groups": 4}"#,
                "n_groups",
            ),
            (
                r#"{"hybrid_override_pattern": "M", "mamba_hidden_act": "gelu"}"#,
                "mamba_hidden_act",
            ),
            (
                r#"{"hybrid_override_pattern": "M", "time_step_limit": [0.001, 0.1]}"#,
                "time_step_limit",
            ),
            (
                r#"{"hybrid_override_pattern": "M", "ssm_state_size": 0}"#,
                "ssm_state_size",
            ),
            (
                r#"{"hybrid_override_pattern": "ME", "moe_latent_size": 32}"#,
                "moe_latent_size",
            ),
        ] {
            let e = check(json).unwrap_err().to_string();
            assert!(e.contains(field), "{json}: {e}");
        }
    }
}
