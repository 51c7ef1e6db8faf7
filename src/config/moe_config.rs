//! The mixture-of-experts part of a Hugging Face `config.json` (Qwen2-MoE, Qwen3-MoE, Mixtral,
//! OLMoE, gpt-oss): how many experts, how many each token is routed to, which layers are sparse, and
//! how the checkpoint names the experts' tensors.

use std::path::Path;

use serde::Deserialize;

use crate::error::{DetspecError, Result};

/// How a checkpoint names a sparse layer's router and experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExpertNaming {
    /// `mlp.gate`, `mlp.experts.{e}.{gate,up,down}_proj` (Qwen2-MoE, Qwen3-MoE, OLMoE).
    Qwen,
    /// `block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.{w1,w3,w2}` (Mixtral).
    Mixtral,
    /// gpt-oss: `mlp.router` (with a bias), and every expert's matrices in one tensor per
    /// part with their biases: `mlp.experts.gate_up_proj` `[experts, hidden, 2 × width]`
    /// (gate and up columns alternating), `mlp.experts.down_proj` `[experts, width, hidden]`,
    /// and `…_bias`; or MXFP4's `…_blocks` and `…_scales` in place of the matrices.
    GptOss,
    /// Granite MoE: `block_sparse_moe.router.layer`, every expert's gate and up in
    /// `block_sparse_moe.input_linear.weight` `[experts, 2 × width, hidden]` (gate rows first),
    /// their down projections in `output_linear.weight`; Granite MoE Shared's ungated
    /// `shared_mlp.{input,output}_linear`.
    Granite,
}

impl ExpertNaming {
    /// Whether the router and the experts have biases (gpt-oss's).
    pub fn has_biases(self) -> bool {
        self == ExpertNaming::GptOss
    }

    /// Whether the routing weights are a softmax over the top k logits (gpt-oss's, Granite's),
    /// rather than the top k of a softmax over all of them. The same numbers when
    /// renormalised, but not the same roundings.
    pub fn softmax_over_top_k(self) -> bool {
        self.stacked()
    }

    /// Whether checkpoints hold each part of every expert in one tensor
    /// (`model::fused_experts`), rather than a matrix per expert.
    pub fn stacked(self) -> bool {
        matches!(self, ExpertNaming::GptOss | ExpertNaming::Granite)
    }
}

/// A sparse decoder's mixture-of-experts settings, checked.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MoeConfig {
    pub num_experts: usize,
    /// Experts each token runs (`num_experts_per_tok`).
    pub top_k: usize,
    /// Each expert's MLP width (`moe_intermediate_size`; Mixtral's and OLMoE's
    /// `intermediate_size`).
    pub expert_intermediate_size: usize,
    /// The top-k routing weights renormalised to sum to one (Mixtral and gpt-oss always;
    /// Qwen's `norm_topk_prob`).
    pub norm_topk_prob: bool,
    /// Qwen2-MoE's shared expert (every token runs it, scaled by a sigmoid gate), or Granite
    /// MoE Shared's (ungated): its width.
    pub shared_expert_intermediate_size: Option<usize>,
    /// Per decoder layer: whether its MLP is the sparse block (else a dense MLP of
    /// `intermediate_size`; Qwen's `mlp_only_layers` and `decoder_sparse_step`).
    pub sparse_layers: Vec<bool>,
    pub naming: ExpertNaming,
}

impl MoeConfig {
    /// Whether decoder layer `layer`'s MLP is the sparse block.
    pub fn is_sparse(&self, layer: usize) -> bool {
        self.sparse_layers.get(layer).copied().unwrap_or(false)
    }
}

/// `config.json`'s mixture-of-experts fields as written.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct RawMoe {
    num_experts: Option<usize>,
    num_local_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    shared_expert_intermediate_size: Option<usize>,
    /// Granite MoE Shared's name for it.
    shared_intermediate_size: Option<usize>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
}

impl RawMoe {
    /// The checked settings of a sparse architecture with `num_layers` decoder layers whose
    /// dense MLP width is `intermediate_size`; `shared_expert`: the architecture has Qwen2-MoE's
    /// gated shared expert; `own_width`: its experts are `moe_intermediate_size` wide (Qwen's),
    /// not `intermediate_size` (Mixtral's, OLMoE's).
    pub(super) fn check(
        &self,
        path: &Path,
        naming: ExpertNaming,
        num_layers: usize,
        intermediate_size: usize,
        shared_expert: bool,
        own_width: bool,
    ) -> Result<MoeConfig> {
        let err = |field: &str, message: String| DetspecError::InvalidConfig {
            path: path.to_path_buf(),
            field: field.to_string(),
            message,
        };
        let (field, num_experts) = match (self.num_experts, self.num_local_experts) {
            (Some(n), _) => ("num_experts", n),
            (None, Some(n)) => ("num_local_experts", n),
            (None, None) => return Err(err("num_experts", "missing".into())),
        };
        if num_experts == 0 {
            return Err(err(field, "must be > 0".into()));
        }
        let top_k = self
            .num_experts_per_tok
            .ok_or_else(|| err("num_experts_per_tok", "missing".into()))?;
        if top_k == 0 || top_k > num_experts {
            return Err(err(
                "num_experts_per_tok",
                format!("{top_k} must be in 1..={num_experts} ({field})"),
            ));
        }
        let expert_intermediate_size = match (own_width, self.moe_intermediate_size) {
            (false, _) => intermediate_size,
            (true, Some(0)) => return Err(err("moe_intermediate_size", "must be > 0".into())),
            (true, Some(n)) => n,
            (true, None) => return Err(err("moe_intermediate_size", "missing".into())),
        };
        let (shared_field, shared_width) = match naming {
            ExpertNaming::Granite => ("shared_intermediate_size", self.shared_intermediate_size),
            _ => (
                "shared_expert_intermediate_size",
                self.shared_expert_intermediate_size,
            ),
        };
        let shared_expert_intermediate_size = match (shared_expert, shared_width) {
            (false, _) | (true, Some(0)) => None,
            (true, Some(n)) => Some(n),
            (true, None) => return Err(err(shared_field, "missing".into())),
        };
        let step = self.decoder_sparse_step.unwrap_or(1);
        if step == 0 {
            return Err(err("decoder_sparse_step", "must be > 0".into()));
        }
        let dense_only = self.mlp_only_layers.clone().unwrap_or_default();
        if let Some(bad) = dense_only.iter().find(|&&l| l >= num_layers) {
            return Err(err(
                "mlp_only_layers",
                format!("layer {bad}, but the model has {num_layers} layers"),
            ));
        }
        let sparse_layers = (0..num_layers)
            .map(|l| !dense_only.contains(&l) && (l + 1) % step == 0)
            .collect();
        Ok(MoeConfig {
            num_experts,
            top_k,
            expert_intermediate_size,
            norm_topk_prob: match naming {
                ExpertNaming::Mixtral | ExpertNaming::GptOss | ExpertNaming::Granite => true,
                ExpertNaming::Qwen => self.norm_topk_prob.unwrap_or(false),
            },
            shared_expert_intermediate_size,
            sparse_layers,
            naming,
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::config::ModelConfig;
    use crate::error::Result;
    use std::path::Path;

    use super::*;

    fn parse(arch: &str, extra: &str) -> Result<ModelConfig> {
        let json = format!(
            r#"{{"architectures": ["{arch}"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 100{extra}}}"#
        );
        ModelConfig::from_json_str(&json, Path::new("/m/config.json"))
    }

    #[test]
    fn sparse_layers_follow_step_and_dense_only_layers() {
        let c = parse(
            "Qwen2MoeForCausalLM",
            r#", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48, "decoder_sparse_step": 2, "mlp_only_layers": [3]"#,
        )
        .unwrap();
        let moe = c.moe.unwrap();
        assert_eq!(moe.sparse_layers, vec![false, true, false, false]);
        assert_eq!(moe.shared_expert_intermediate_size, Some(48));
        assert!(!moe.norm_topk_prob && c.qkv_bias);
        // transformers 5 writes Qwen3-MoE's expert count as num_local_experts.
        let c = parse(
            "Qwen3MoeForCausalLM",
            r#", "num_local_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 32,
            "norm_topk_prob": true"#,
        )
        .unwrap();
        let moe = c.moe.unwrap();
        assert_eq!(
            (moe.num_experts, moe.top_k, moe.naming),
            (4, 1, ExpertNaming::Qwen)
        );
        assert!(moe.norm_topk_prob && c.qk_norm && moe.shared_expert_intermediate_size.is_none());
        // Mixtral: experts as wide as intermediate_size, weights always renormalised.
        let c = parse(
            "MixtralForCausalLM",
            r#", "num_local_experts": 8, "num_experts_per_tok": 2"#,
        )
        .unwrap();
        let moe = c.moe.unwrap();
        assert_eq!(moe.expert_intermediate_size, 128);
        assert!(moe.norm_topk_prob && moe.sparse_layers.iter().all(|&s| s));
        assert!(parse("LlamaForCausalLM", "").unwrap().moe.is_none());
        // OLMoE: Qwen's names and routing, experts as wide as intermediate_size (a
        // moe_intermediate_size is not its), OLMo 2's q/k norms; OLMo 1's clamp refused.
        let c = parse(
            "OlmoeForCausalLM",
            r#", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "clip_qkv": null"#,
        )
        .unwrap();
        let moe = c.moe.unwrap();
        assert_eq!(
            (moe.expert_intermediate_size, moe.naming),
            (128, ExpertNaming::Qwen)
        );
        assert!(!moe.norm_topk_prob && c.qk_norm && c.architecture.norms_whole_qk());
        let e = parse(
            "OlmoeForCausalLM",
            r#", "num_experts": 8, "num_experts_per_tok": 2, "clip_qkv": 8.0"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("clip_qkv"), "{e}");
    }

    #[test]
    fn errors_name_the_field() {
        for (extra, field) in [
            (
                r#", "num_experts_per_tok": 2, "moe_intermediate_size": 8"#,
                "num_experts",
            ),
            (
                r#", "num_experts": 4, "moe_intermediate_size": 8"#,
                "num_experts_per_tok",
            ),
            (
                r#", "num_experts": 4, "num_experts_per_tok": 5, "moe_intermediate_size": 8"#,
                "num_experts_per_tok",
            ),
            (
                r#", "num_experts": 4, "num_experts_per_tok": 2"#,
                "moe_intermediate_size",
            ),
            (
                r#", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                "mlp_only_layers": [4]"#,
                "mlp_only_layers",
            ),
            (
                r#", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                "decoder_sparse_step": 0"#,
                "decoder_sparse_step",
            ),
            (
                r#", "num_experts": "four", "num_experts_per_tok": 2, "moe_intermediate_size": 8"#,
                "num_experts",
            ),
        ] {
            let e = parse("Qwen3MoeForCausalLM", extra).unwrap_err();
            assert!(e.to_string().contains(field), "{field}: {e}");
        }
    }
}
