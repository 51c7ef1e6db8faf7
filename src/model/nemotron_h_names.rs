//! Nemotron-H's parameter names and the engine's. Its checkpoints name each layer's one
//! sublayer `mixer` and its norm `norm`, whatever the sublayer is (`model.layers.3.mixer.q_proj`,
//! `model.layers.4.mixer.in_proj`, `model.layers.5.mixer.up_proj`), the embeddings
//! `embeddings` and the final norm `norm_f`; the hub's files put all of it under `backbone.`
//! (transformers renames it `model.` at load). The engine holds them under the names of the
//! layers they are (`self_attn.q_proj`, `mamba.in_proj`, `mlp.up_proj`; the norm before a
//! mixer `input_layernorm`, before an MLP `post_attention_layernorm`), so loading, updates and
//! the fingerprint's hashes treat them as every other model's.

use crate::config::{Architecture, ModelConfig};

/// The engine's name for Nemotron-H's parameter `name` (`backbone.` or `model.` names);
/// `None` where it is not one of its layers' or where the engine's name is the same
/// (`lm_head.weight`).
pub fn engine_name(cfg: &ModelConfig, name: &str) -> Option<String> {
    if cfg.architecture != Architecture::NemotronH {
        return None;
    }
    let rest = name
        .strip_prefix("backbone.")
        .or_else(|| name.strip_prefix("model."))?;
    match rest {
        "embeddings.weight" => return Some("model.embed_tokens.weight".into()),
        "norm_f.weight" => return Some("model.norm.weight".into()),
        _ => {}
    }
    let (index, field) = rest.strip_prefix("layers.")?.split_once('.')?;
    let layer: usize = index.parse().ok()?;
    let own = field_in_layer(cfg, layer, field)?;
    Some(format!("model.layers.{layer}.{own}"))
}

/// The engine's name, under its decoder layer, of the field Nemotron-H's checkpoints call
/// `field` in layer `layer` (`mixer.q_proj.weight` → `self_attn.q_proj.weight`); `None` for
/// another model or a field it does not name so (`layer` past the last: none).
pub(super) fn field_in_layer(cfg: &ModelConfig, layer: usize, field: &str) -> Option<String> {
    if cfg.architecture != Architecture::NemotronH || layer >= cfg.num_hidden_layers {
        return None;
    }
    if field == "norm.weight" {
        return Some(match cfg.has_mixer(layer) {
            true => "input_layernorm.weight".to_string(),
            false => "post_attention_layernorm.weight".to_string(),
        });
    }
    let field = field.strip_prefix("mixer.")?;
    let module = match () {
        _ if !cfg.has_mixer(layer) => "mlp",
        _ if cfg.mamba.as_ref().is_some_and(|m| m.is_mamba(layer)) => "mamba",
        _ => "self_attn",
    };
    Some(format!("{module}.{field}"))
}

/// Nemotron-H's name, under `prefix` (`backbone.` or `model.`), for the engine's parameter
/// `name` ([`engine_name`] the other way; the layer kinds are in the engine's name); `None`
/// where the engine's name is the checkpoint's (`lm_head.weight`).
pub(super) fn file_name(prefix: &str, name: &str) -> Option<String> {
    let rest = name.strip_prefix("model.")?;
    match rest {
        "embed_tokens.weight" => return Some(format!("{prefix}embeddings.weight")),
        "norm.weight" => return Some(format!("{prefix}norm_f.weight")),
        _ => {}
    }
    let (index, field) = rest.strip_prefix("layers.")?.split_once('.')?;
    let theirs = match field {
        "input_layernorm.weight" | "post_attention_layernorm.weight" => "norm.weight".to_string(),
        _ => {
            let (_, inner) = field.split_once('.')?;
            format!("mixer.{inner}")
        }
    };
    Some(format!("{prefix}layers.{index}.{theirs}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_sublayer_is_named_as_what_it_is() {
        let json = r#"{"architectures": ["NemotronHForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "vocab_size": 100, "hybrid_override_pattern": "M-*",
            "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 8, "n_groups": 2}"#;
        let cfg = ModelConfig::from_json_str(json, std::path::Path::new("config.json")).unwrap();
        for (theirs, ours) in [
            ("backbone.embeddings.weight", "model.embed_tokens.weight"),
            ("model.norm_f.weight", "model.norm.weight"),
            (
                "backbone.layers.0.norm.weight",
                "model.layers.0.input_layernorm.weight",
            ),
            (
                "backbone.layers.0.mixer.A_log",
                "model.layers.0.mamba.A_log",
            ),
            (
                "model.layers.0.mixer.conv1d.bias",
                "model.layers.0.mamba.conv1d.bias",
            ),
            (
                "model.layers.1.norm.weight",
                "model.layers.1.post_attention_layernorm.weight",
            ),
            (
                "model.layers.1.mixer.up_proj.weight",
                "model.layers.1.mlp.up_proj.weight",
            ),
            (
                "model.layers.2.norm.weight",
                "model.layers.2.input_layernorm.weight",
            ),
            (
                "backbone.layers.2.mixer.o_proj.weight",
                "model.layers.2.self_attn.o_proj.weight",
            ),
        ] {
            assert_eq!(engine_name(&cfg, theirs).as_deref(), Some(ours), "{theirs}");
        }
        for same in [
            "lm_head.weight",
            "model.layers.3.norm.weight",
            "model.layers.0.mamba.D",
        ] {
            assert_eq!(engine_name(&cfg, same), None, "{same}");
        }
        // ... and back: each of the checkpoint's names is the file's name of its engine name.
        for (theirs, ours) in [
            ("backbone.embeddings.weight", "model.embed_tokens.weight"),
            (
                "backbone.layers.0.norm.weight",
                "model.layers.0.input_layernorm.weight",
            ),
            (
                "backbone.layers.0.mixer.A_log",
                "model.layers.0.mamba.A_log",
            ),
            (
                "backbone.layers.1.norm.weight",
                "model.layers.1.post_attention_layernorm.weight",
            ),
            (
                "backbone.layers.2.mixer.o_proj.weight",
                "model.layers.2.self_attn.o_proj.weight",
            ),
            ("backbone.norm_f.weight", "model.norm.weight"),
        ] {
            assert_eq!(
                file_name("backbone.", ours).as_deref(),
                Some(theirs),
                "{ours}"
            );
        }
        assert_eq!(file_name("backbone.", "lm_head.weight"), None);
    }
}
