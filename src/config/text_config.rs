//! The decoder's settings as `config.json` gives them: a multimodal checkpoint keeps its
//! language model's under `text_config` (detspec serves that model, text only), and real
//! Gemma configs lean on transformers' defaults (Gemma 3 4B's `text_config` names six fields),
//! as ERNIE 4.5's may (its default head is wider than `hidden_size / heads`).
//! Both are made into one flat config here, before [`super::ModelConfig`] reads it.

use std::path::Path;

use serde_json::{Map, Value};

use super::json::parse_json;
use crate::error::{DetspecError, Result};

/// A multimodal class whose language model detspec serves, text only.
struct Wrapper {
    class: &'static str,
    model_type: &'static str,
    /// The language model's `model_type` where `text_config` names none (Mistral 3's is
    /// `mistral` for Mistral Small 3.1/3.2, `ministral3` for Ministral 3).
    text_type: &'static str,
    /// `text_config` model types read as another's: the Qwen VL models' language halves
    /// are Qwen2's and Qwen3's layers, and their multimodal rope is the plain one on text
    /// (its three position streams are equal there).
    aliases: &'static [(&'static str, &'static str)],
    /// Whether configs may keep the language model's settings at the top level, with no
    /// `text_config` (Qwen2.5-VL's hub configs).
    flat_form: bool,
}

const WRAPPERS: [Wrapper; 12] = [
    Wrapper {
        class: "Gemma3ForConditionalGeneration",
        model_type: "gemma3",
        text_type: "gemma3_text",
        aliases: &[],
        flat_form: false,
    },
    Wrapper {
        class: "Mistral3ForConditionalGeneration",
        model_type: "mistral3",
        text_type: "mistral",
        aliases: &[],
        flat_form: false,
    },
    // Qwen2-VL: Qwen2.5-VL's predecessor, the same layers and configs.
    Wrapper {
        class: "Qwen2VLForConditionalGeneration",
        model_type: "qwen2_vl",
        text_type: "qwen2",
        aliases: &[("qwen2_vl_text", "qwen2")],
        flat_form: true,
    },
    // LLaVA (1.5, and the wrappers that reuse its class: Pixtral, and others) and InternVL 3 /
    // 3.5 (the `-hf` checkpoints): whichever language model `text_config` names.
    Wrapper {
        class: "LlavaForConditionalGeneration",
        model_type: "llava",
        text_type: "llama",
        aliases: &[],
        flat_form: false,
    },
    Wrapper {
        class: "InternVLForConditionalGeneration",
        model_type: "internvl",
        text_type: "qwen2",
        aliases: &[],
        flat_form: false,
    },
    Wrapper {
        class: "Qwen2_5_VLForConditionalGeneration",
        model_type: "qwen2_5_vl",
        text_type: "qwen2",
        aliases: &[("qwen2_5_vl_text", "qwen2")],
        flat_form: true,
    },
    // GLM-4.1V-Thinking: GLM-4-0414's layers. Its multimodal rope pairs neighbours on half of
    // each head as GLM-4's does, and is the plain one on text.
    Wrapper {
        class: "Glm4vForConditionalGeneration",
        model_type: "glm4v",
        text_type: "glm4",
        aliases: &[("glm4v_text", "glm4")],
        flat_form: false,
    },
    // GLM-4.5V and 4.6V: GLM-4.5's layers (without q/k norms), the same rope as GLM-4.5's on
    // text.
    Wrapper {
        class: "Glm4vMoeForConditionalGeneration",
        model_type: "glm4v_moe",
        text_type: "glm4_moe",
        aliases: &[("glm4v_moe_text", "glm4_moe")],
        flat_form: false,
    },
    Wrapper {
        class: "Lfm2VlForConditionalGeneration",
        model_type: "lfm2_vl",
        text_type: "lfm2",
        aliases: &[],
        flat_form: false,
    },
    // Qwen3.5: every checkpoint of it is this wrapper; its multimodal rope is the plain one
    // on text.
    Wrapper {
        class: "Qwen3_5ForConditionalGeneration",
        model_type: "qwen3_5",
        text_type: "qwen3_5_text",
        aliases: &[],
        flat_form: false,
    },
    Wrapper {
        class: "Qwen3_5MoeForConditionalGeneration",
        model_type: "qwen3_5_moe",
        text_type: "qwen3_5_moe_text",
        aliases: &[],
        flat_form: false,
    },
    Wrapper {
        class: "Qwen3VLForConditionalGeneration",
        model_type: "qwen3_vl",
        text_type: "qwen3",
        aliases: &[("qwen3_vl_text", "qwen3")],
        flat_form: false,
    },
];

/// Keys of the wrapper's own config that are the language model's too (transformers reads
/// the EOS ids, the dtype, whether the LM head is tied and how the checkpoint is quantized
/// from the top level).
const INHERITED: [&str; 7] = [
    "eos_token_id",
    "bos_token_id",
    "pad_token_id",
    "torch_dtype",
    "dtype",
    "tie_word_embeddings",
    "quantization_config",
];

/// Keys and transformers' values for them.
type Defaults = Vec<(&'static str, Value)>;

/// transformers' defaults for the keys a config of this decoder class (a causal LM or a
/// classifier; without `architectures`, this `model_type`) leaves out: Gemma's and ERNIE's configs lean on
/// them.
fn defaults_of(class: Option<&str>, model_type: Option<&str>) -> Defaults {
    let is = |prefix: &str, kind: &str| match class {
        Some(c) => c.starts_with(prefix),
        None => model_type == Some(kind),
    };
    if is("Gemma2For", "gemma2") {
        gemma2_defaults()
    } else if is("Gemma3ForCausalLM", "gemma3_text") || is("Gemma3TextFor", "gemma3_text") {
        gemma3_text_defaults()
    } else if is("Ernie4_5ForCausalLM", "ernie4_5") {
        ernie45_defaults()
    } else {
        Vec::new()
    }
}

/// transformers' `Gemma2Config` defaults.
fn gemma2_defaults() -> Defaults {
    let mut d = gemma_defaults();
    d.extend([
        ("vocab_size", 256_000.into()),
        ("max_position_embeddings", 8192.into()),
        ("rope_theta", 1e4.into()),
        ("attn_logit_softcapping", 50.0.into()),
        ("final_logit_softcapping", 30.0.into()),
    ]);
    d
}

/// transformers' `Gemma3TextConfig` defaults.
fn gemma3_text_defaults() -> Defaults {
    let mut d = gemma_defaults();
    d.extend([
        ("vocab_size", 262_208.into()),
        ("max_position_embeddings", 131_072.into()),
        ("rope_theta", 1e6.into()),
        ("rope_local_base_freq", 1e4.into()),
    ]);
    d
}

/// transformers' `Ernie4_5Config` defaults (ERNIE-4.5-0.3B's shape): its head is wider than
/// `hidden_size / heads`, and its embeddings are tied.
fn ernie45_defaults() -> Defaults {
    vec![
        ("vocab_size", 103_424.into()),
        ("hidden_size", 1024.into()),
        ("intermediate_size", 3072.into()),
        ("num_hidden_layers", 18.into()),
        ("num_attention_heads", 16.into()),
        ("num_key_value_heads", 2.into()),
        ("head_dim", 128.into()),
        ("max_position_embeddings", 131_072.into()),
        ("rms_norm_eps", 1e-5.into()),
        ("rope_theta", 500_000.0.into()),
        ("tie_word_embeddings", true.into()),
    ]
}

/// The defaults Gemma 2 and 3 share.
fn gemma_defaults() -> Defaults {
    vec![
        ("hidden_size", 2304.into()),
        ("intermediate_size", 9216.into()),
        ("num_hidden_layers", 26.into()),
        ("num_attention_heads", 8.into()),
        ("num_key_value_heads", 4.into()),
        ("head_dim", 256.into()),
        ("hidden_activation", "gelu_pytorch_tanh".into()),
        ("rms_norm_eps", 1e-6.into()),
        ("bos_token_id", 2.into()),
        ("eos_token_id", 1.into()),
        ("tie_word_embeddings", true.into()),
        ("query_pre_attn_scalar", 256.into()),
        ("sliding_window", 4096.into()),
    ]
}

/// The decoder's flat config JSON from `text` (the contents of `path`), and the field that
/// held it (`text_config` for a wrapper) for error messages; `None`: `text` as it is.
pub(super) fn decoder_json(
    text: &str,
    path: &Path,
) -> Result<Option<(String, Option<&'static str>)>> {
    let Value::Object(mut top) = parse_json::<Value>(text, path)? else {
        return Err(DetspecError::file(path, "config.json is not a JSON object"));
    };
    let class = |m: &Map<String, Value>| {
        m.get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    let model_type = |m: &Map<String, Value>| {
        m.get("model_type")
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    let top_class = class(&top);
    let wrapper = WRAPPERS.iter().find(|w| match &top_class {
        Some(name) => name == w.class,
        None => model_type(&top).as_deref() == Some(w.model_type),
    });
    let (mut cfg, field) = match wrapper {
        Some(w) => {
            let (mut inner, field) = match top.remove("text_config") {
                Some(Value::Object(inner)) => (inner, Some("text_config")),
                None if w.flat_form => {
                    let mut inner = std::mem::take(&mut top);
                    inner.remove("vision_config");
                    inner.insert("model_type".into(), Value::from(w.text_type));
                    (inner, None)
                }
                _ => {
                    return Err(DetspecError::InvalidConfig {
                        path: path.to_path_buf(),
                        field: "text_config".into(),
                        message: format!("{} needs its language model's settings here", w.class),
                    })
                }
            };
            for key in INHERITED {
                if let Some(v) = top.remove(key) {
                    inner.entry(key).or_insert(v);
                }
            }
            // The language model is its `model_type`'s causal LM, never the wrapper's class.
            inner.remove("architectures");
            let text_type = match model_type(&inner) {
                Some(t) => w
                    .aliases
                    .iter()
                    .find(|(theirs, _)| *theirs == t)
                    .map_or(t, |(_, ours)| ours.to_string()),
                None => w.text_type.to_string(),
            };
            inner.insert("model_type".into(), Value::from(text_type));
            (inner, field)
        }
        None => (top, None),
    };
    let mut changed = wrapper.is_some();
    for (key, value) in defaults_of(class(&cfg).as_deref(), model_type(&cfg).as_deref()) {
        if !cfg.contains_key(key) {
            cfg.insert(key.into(), value);
            changed = true;
        }
    }
    Ok(changed.then(|| (Value::Object(cfg).to_string(), field)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flat(text: &str) -> Option<(Value, Option<&'static str>)> {
        decoder_json(text, Path::new("/m/config.json"))
            .unwrap()
            .map(|(t, f)| (serde_json::from_str(&t).unwrap(), f))
    }

    #[test]
    fn a_wrapper_gives_its_language_model_with_the_top_levels_ids_and_dtype() {
        let (cfg, field) = flat(
            r#"{"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106],
            "torch_dtype": "bfloat16", "text_config": {"hidden_size": 2560,
            "num_hidden_layers": 34, "eos_token_id": 7}, "vision_config": {"hidden_size": 1152}}"#,
        )
        .unwrap();
        assert_eq!(field, Some("text_config"));
        assert!(cfg.get("architectures").is_none());
        assert_eq!(cfg["model_type"], "gemma3_text");
        assert_eq!(
            (&cfg["hidden_size"], &cfg["num_hidden_layers"]),
            (&2560.into(), &34.into())
        );
        // The language model's own value wins; what it lacks comes from the top level, the
        // rest from transformers' defaults.
        assert_eq!(
            (&cfg["eos_token_id"], &cfg["torch_dtype"]),
            (&7.into(), &"bfloat16".into())
        );
        assert_eq!(cfg["num_attention_heads"], 8);
        assert!(cfg.get("vision_config").is_none());
        // Mistral 3's language model is its text_config's model type: Mistral's (Mistral
        // Small 3.1/3.2) where it names none, or the one it names.
        for (text_type, want) in [
            ("", "mistral"),
            (r#""model_type": "ministral3","#, "ministral3"),
        ] {
            let (cfg, _) = flat(&format!(
                r#"{{"architectures": ["Mistral3ForConditionalGeneration"],
                "text_config": {{{text_type} "hidden_size": 5120}}}}"#
            ))
            .unwrap();
            assert_eq!(cfg["model_type"], want);
        }
    }

    #[test]
    fn qwen_vl_models_serve_their_qwen_language_model_from_either_config_form() {
        // transformers 5's form: `text_config` of model type qwen2_5_vl_text, the LM head's
        // tying at the top.
        let (cfg, field) = flat(
            r#"{"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
            "tie_word_embeddings": true, "vision_config": {"depth": 32},
            "text_config": {"model_type": "qwen2_5_vl_text", "hidden_size": 2048,
            "rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24]}}}"#,
        )
        .unwrap();
        assert_eq!(field, Some("text_config"));
        assert_eq!(
            (&cfg["model_type"], &cfg["tie_word_embeddings"]),
            (&"qwen2".into(), &true.into())
        );
        // The hub's Qwen2.5-VL configs: the language model's settings at the top.
        let (cfg, field) = flat(
            r#"{"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
            "hidden_size": 3584, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
            "vision_config": {"depth": 32}}"#,
        )
        .unwrap();
        assert_eq!(field, None);
        assert_eq!(
            (&cfg["model_type"], &cfg["hidden_size"]),
            (&"qwen2".into(), &3584.into())
        );
        assert!(cfg.get("vision_config").is_none() && cfg.get("architectures").is_none());
        let (cfg, _) = flat(
            r#"{"architectures": ["Qwen3VLForConditionalGeneration"],
            "text_config": {"model_type": "qwen3_vl_text", "head_dim": 128}}"#,
        )
        .unwrap();
        assert_eq!(cfg["model_type"], "qwen3");
    }

    #[test]
    fn other_configs_are_left_as_they_are() {
        assert!(flat(r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 8}"#).is_none());
        let e = decoder_json("[1]", Path::new("/m/config.json")).unwrap_err();
        assert!(e.to_string().contains("/m/config.json"), "{e}");
        let e = decoder_json(
            r#"{"architectures": ["Gemma3ForConditionalGeneration"]}"#,
            Path::new("/m/config.json"),
        )
        .unwrap_err();
        assert!(e.to_string().contains("text_config"), "{e}");
    }
}
