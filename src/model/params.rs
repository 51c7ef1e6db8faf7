//! A decoder's parameters by their Hugging Face names, known from its config alone: the names
//! and shapes a checkpoint holds, and the check of a weight update against them.

use std::collections::BTreeMap;

use candle_core::DType;

use crate::config::{ModelConfig, UngatedMlp};
use crate::error::{DetspecError, Result};

use super::gated_delta_net::delta_net_params;
use super::mamba2::mamba_params;
use super::mla::latent_params;
use super::moe_names::sparse_params;
use super::short_conv::conv_params;
use super::xielu::XieluParams;

/// Every parameter name a checkpoint of `cfg` holds, with its shape, in name order.
/// `lm_head.weight` is listed for tied models too (torch's `state_dict()` yields it); it then
/// names the embedding matrix. A classifier has `score.weight` in its place.
pub fn param_shapes(cfg: &ModelConfig) -> BTreeMap<String, Vec<usize>> {
    let (h, kvh, d) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let (hs, is, vocab) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let mut m = BTreeMap::new();
    m.insert("model.embed_tokens.weight".into(), vec![vocab, hs]);
    m.insert(cfg.architecture.final_norm().into(), vec![hs]);
    m.insert(
        cfg.head.weight_name().into(),
        vec![cfg.head.rows(vocab), hs],
    );
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let mut linear = |name: String, i: usize, o: usize, bias: bool| {
            if bias {
                m.insert(format!("{name}.bias"), vec![o]);
            }
            m.insert(format!("{name}.weight"), vec![o, i]);
        };
        let fused = cfg.architecture.fused();
        let conv = cfg.short_conv.as_ref().filter(|c| c.is_conv(i));
        let delta_net = cfg.linear_attention.as_ref().filter(|la| la.is_linear(i));
        let mamba = cfg.mamba.as_ref().filter(|m| m.is_mamba(i));
        let (has_mixer, has_mlp) = (cfg.has_mixer(i), cfg.has_mlp(i));
        let attends = has_mixer && conv.is_none() && delta_net.is_none() && mamba.is_none();
        // (Latent attention's projections are listed with the norms below.)
        let [q_width, ..] = cfg.qkv_widths();
        match (&cfg.mla, fused.qkv) {
            _ if !attends => {}
            (Some(_), _) => {}
            (None, true) => linear(
                format!("{p}.self_attn.qkv_proj"),
                hs,
                (h + 2 * kvh) * d,
                false,
            ),
            (None, false) => {
                linear(format!("{p}.self_attn.q_proj"), hs, q_width, cfg.qkv_bias);
                linear(format!("{p}.self_attn.k_proj"), hs, kvh * d, cfg.qkv_bias);
                linear(format!("{p}.self_attn.v_proj"), hs, kvh * d, cfg.qkv_bias);
            }
        }
        let o_in = cfg.mla.as_ref().map_or(h * d, |m| h * m.v_head_dim);
        if attends {
            let o = cfg.architecture.o_proj_module();
            linear(format!("{p}.{o}"), o_in, hs, cfg.o_bias);
        }
        match &cfg.moe {
            _ if !has_mlp => {}
            Some(moe) if moe.is_sparse(i) => {
                m.extend(sparse_params(cfg, moe, i));
            }
            _ if cfg.architecture.ungated_mlp().is_some() => {
                linear(format!("{p}.mlp.up_proj"), hs, is, cfg.mlp_bias);
                linear(format!("{p}.mlp.down_proj"), is, hs, cfg.mlp_bias);
                if cfg.architecture.ungated_mlp() == Some(UngatedMlp::Xielu) {
                    for (name, shape) in XieluParams::NAMES {
                        m.insert(format!("{p}.mlp.act_fn.{name}"), shape.to_vec());
                    }
                }
            }
            _ if fused.gate_up => {
                linear(format!("{p}.{}", fused.gate_up_module()), hs, 2 * is, false);
                linear(format!("{p}.{}", fused.down_module()), is, hs, false);
            }
            _ => {
                let [gate, up] = fused.gate_and_up_modules();
                linear(format!("{p}.{gate}"), hs, is, cfg.mlp_bias);
                linear(format!("{p}.{up}"), hs, is, cfg.mlp_bias);
                linear(format!("{p}.{}", fused.down_module()), is, hs, cfg.mlp_bias);
            }
        }
        for norm in cfg.layer_norms(i).into_iter().flatten() {
            m.insert(format!("{p}.{norm}.weight"), vec![hs]);
        }
        if !has_mixer {
            continue;
        }
        if let Some(conv) = conv {
            for (name, shape) in conv_params(cfg, conv) {
                m.insert(format!("{p}.conv.{name}"), shape);
            }
            continue;
        }
        if let Some(la) = delta_net {
            for (name, shape) in delta_net_params(cfg, la) {
                m.insert(format!("{p}.linear_attn.{name}"), shape);
            }
            continue;
        }
        if let Some(mamba) = mamba {
            for (name, shape) in mamba_params(cfg, mamba) {
                m.insert(format!("{p}.mamba.{name}"), shape);
            }
            continue;
        }
        if let Some(mla) = &cfg.mla {
            for (name, shape) in latent_params(cfg, mla) {
                m.insert(format!("{p}.self_attn.{name}"), shape);
            }
        }
        if cfg.architecture.has_attention_sinks() {
            m.insert(format!("{p}.self_attn.sinks"), vec![h]);
        }
        if cfg.qk_norm {
            let (q, k) = if cfg.architecture.norms_whole_qk() {
                (h * d, kvh * d)
            } else {
                (d, d)
            };
            let (q_name, k_name, _) = cfg.architecture.qk_norms();
            m.insert(format!("{p}.self_attn.{q_name}.weight"), vec![q]);
            m.insert(format!("{p}.self_attn.{k_name}.weight"), vec![k]);
        }
    }
    m
}

/// The error for a name that is no parameter of the model.
pub(super) fn unknown(name: &str) -> DetspecError {
    let hint = if super::weights::is_vision_name(name) {
        " (detspec serves a multimodal checkpoint's language model only: send the parameters \
         under `model.language_model.` and `lm_head.`)"
    } else {
        ""
    };
    DetspecError::param(
        "named_tensors",
        format!("`{name}` is not a parameter of this model{hint}"),
    )
}

/// Checks that every `(name, shape, dtype)` names a parameter of a `cfg` model with its shape
/// and a float dtype; the error names the first bad tensor. Needs only the config, so a caller
/// can check before handing the update to the engine thread.
pub fn check_update(cfg: &ModelConfig, updates: &[(String, Vec<usize>, DType)]) -> Result<()> {
    let shapes = param_shapes(cfg);
    let mut seen = std::collections::HashSet::new();
    for (name, shape, dtype) in updates {
        let want = shapes.get(name).ok_or_else(|| unknown(name))?;
        if shape != want {
            return Err(DetspecError::param(
                "named_tensors",
                format!("`{name}` has shape {shape:?}; the model's is {want:?}"),
            ));
        }
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(DetspecError::param(
                "named_tensors",
                format!(
                    "`{name}` has dtype {dtype:?}; weights must be float32, bfloat16 or float16"
                ),
            ));
        }
        if !seen.insert(name.as_str()) {
            return Err(DetspecError::param(
                "named_tensors",
                format!("`{name}` is given twice"),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    #[test]
    fn a_sparse_model_lists_every_expert() {
        let cfg = ModelConfig::from_json_str(
            r#"{"architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 16,
            "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 2,
            "vocab_size": 50, "num_experts": 3, "num_experts_per_tok": 2,
            "moe_intermediate_size": 8, "shared_expert_intermediate_size": 12,
            "mlp_only_layers": [1]}"#,
            Path::new("/m/config.json"),
        )
        .unwrap();
        let shapes = param_shapes(&cfg);
        let l0 = "model.layers.0.mlp";
        assert_eq!(shapes[&format!("{l0}.gate.weight")], vec![3, 16]);
        assert_eq!(
            shapes[&format!("{l0}.experts.2.down_proj.weight")],
            vec![16, 8]
        );
        assert_eq!(
            shapes[&format!("{l0}.shared_expert.up_proj.weight")],
            vec![12, 16]
        );
        assert_eq!(
            shapes[&format!("{l0}.shared_expert_gate.weight")],
            vec![1, 16]
        );
        assert!(!shapes.contains_key(&format!("{l0}.gate_proj.weight")));
        assert_eq!(shapes["model.layers.1.mlp.gate_proj.weight"], vec![40, 16]);
        // Layer 0's MLP: router, 3 experts × 3, shared expert × 3 and its gate.
        let mlp0 = shapes.keys().filter(|k| k.starts_with(l0)).count();
        assert_eq!(mlp0, 1 + 9 + 3 + 1);
    }

    #[test]
    fn a_deepseek_routed_model_lists_its_router_bias_and_ungated_shared_experts() {
        let cfg = ModelConfig::from_json_str(
            r#"{"architectures": ["Glm4MoeForCausalLM"], "hidden_size": 16,
            "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 2,
            "vocab_size": 50, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 8, "n_shared_experts": 2}"#,
            Path::new("/m/config.json"),
        )
        .unwrap();
        let shapes = param_shapes(&cfg);
        let l1 = "model.layers.1.mlp";
        assert_eq!(shapes[&format!("{l1}.gate.weight")], vec![4, 16]);
        assert_eq!(
            shapes[&format!("{l1}.gate.e_score_correction_bias")],
            vec![4]
        );
        assert_eq!(
            shapes[&format!("{l1}.shared_experts.down_proj.weight")],
            vec![16, 16]
        );
        // Layer 1's MLP: router and its bias, 4 experts × 3, the shared experts × 3, no gate.
        let mlp1 = shapes.keys().filter(|k| k.starts_with(l1)).count();
        assert_eq!(mlp1, 2 + 12 + 3);
        // Layer 0 is dense (`first_k_dense_replace` defaults to 1).
        assert_eq!(shapes["model.layers.0.mlp.gate_proj.weight"], vec![40, 16]);
    }

    #[test]
    fn a_latent_attention_model_lists_its_projections_and_norms() {
        let cfg = ModelConfig::from_json_str(
            r#"{"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 16,
            "intermediate_size": 40, "num_hidden_layers": 1, "num_attention_heads": 2,
            "vocab_size": 50, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 8, "q_lora_rank": 12, "kv_lora_rank": 6,
            "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 10}"#,
            Path::new("/m/config.json"),
        )
        .unwrap();
        let shapes = param_shapes(&cfg);
        let a = "model.layers.0.self_attn";
        for (name, shape) in [
            ("q_a_proj.weight", vec![12, 16]),
            ("q_a_layernorm.weight", vec![12]),
            ("q_b_proj.weight", vec![24, 12]),
            ("kv_a_proj_with_mqa.weight", vec![10, 16]),
            ("kv_a_layernorm.weight", vec![6]),
            ("kv_b_proj.weight", vec![36, 6]),
            ("o_proj.weight", vec![16, 20]),
        ] {
            assert_eq!(shapes[&format!("{a}.{name}")], shape, "{name}");
        }
        assert_eq!(shapes.keys().filter(|k| k.starts_with(a)).count(), 7);
    }
}
