//! JSON files of a model directory read into serde types, with errors that name the field.

use std::path::Path;

use serde::de::DeserializeOwned;
use serde::Deserialize;

use crate::error::{DetspecError, Result};

/// Parses `text` (the contents of `path`) as `T`. Malformed JSON is
/// [`DetspecError::InvalidFile`]; a value of the wrong type is [`DetspecError::InvalidConfig`]
/// naming the field by its path (`rope_scaling.factor`, `chat_template[1].template`).
/// Python's literals for non-finite floats are read ([`with_nonfinite_spelled`]).
pub fn parse_json<T: DeserializeOwned>(text: &str, path: &Path) -> Result<T> {
    let text = with_nonfinite_spelled(text);
    let de = &mut serde_json::Deserializer::from_str(&text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let field = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            DetspecError::file(path, format!("malformed JSON: {inner}"))
        } else {
            DetspecError::InvalidConfig {
                path: path.to_path_buf(),
                field,
                message: inner.to_string(),
            }
        }
    })
}

/// A list of one kind per layer (`layer_types`, `mlp_layer_types`) as flags: `true` where a
/// layer is `kinds[0]`, `false` where it is `kinds[1]`. Errs with the message for the field
/// (a wrong length, or a kind that is neither).
pub fn layer_kinds(
    types: &[String],
    num_layers: usize,
    kinds: [&str; 2],
) -> std::result::Result<Vec<bool>, String> {
    if types.len() != num_layers {
        return Err(format!("{} entries for {num_layers} layers", types.len()));
    }
    types
        .iter()
        .enumerate()
        .map(|(i, t)| match t.as_str() {
            t if t == kinds[0] => Ok(true),
            t if t == kinds[1] => Ok(false),
            other => Err(format!(
                "layer {i} is {other:?} (expected {:?} or {:?})",
                kinds[0], kinds[1]
            )),
        })
        .collect()
}

/// Errors naming a field of one `config.json`, and the positive-integer fields read with a
/// default (the section checks of `linear_attention.rs`, `mamba.rs`, `short_conv.rs`).
#[derive(Debug, Clone, Copy)]
pub(super) struct ConfigFields<'a> {
    pub path: &'a Path,
}

impl ConfigFields<'_> {
    /// [`DetspecError::InvalidConfig`] naming `field`.
    pub fn err(&self, field: &str, message: impl Into<String>) -> DetspecError {
        DetspecError::InvalidConfig {
            path: self.path.to_path_buf(),
            field: field.to_string(),
            message: message.into(),
        }
    }

    /// `v`, or `default` where the config leaves it out; 0 is an error naming `field`.
    pub fn positive(&self, field: &str, v: Option<usize>, default: usize) -> Result<usize> {
        match v.unwrap_or(default) {
            0 => Err(self.err(field, "must be > 0")),
            n => Ok(n),
        }
    }
}

/// `text` with the literals Python's `json` writes for non-finite floats (`NaN`, `Infinity`,
/// `-Infinity`: not JSON, but in many hub configs, e.g. Mamba2's `time_step_limit`) spelled as
/// transformers 5 spells them, `{"__float__": "Infinity"}`; the fields that take one read that
/// form, the others name themselves in a type error rather than failing the whole file.
fn with_nonfinite_spelled(text: &str) -> std::borrow::Cow<'_, str> {
    const LITERALS: [(&str, &str); 3] = [
        ("-Infinity", "-Infinity"),
        ("Infinity", "Infinity"),
        ("NaN", "NaN"),
    ];
    let bytes = text.as_bytes();
    let (mut out, mut copied) = (String::new(), 0);
    let (mut i, mut in_string) = (0, false);
    while i < bytes.len() {
        match bytes[i] {
            b'\\' if in_string => i += 1,
            b'"' => in_string = !in_string,
            b'-' | b'I' | b'N' if !in_string => {
                if let Some((lit, value)) = LITERALS.iter().find(|(l, _)| text[i..].starts_with(l))
                {
                    out.push_str(&text[copied..i]);
                    out.push_str(&format!("{{\"__float__\": \"{value}\"}}"));
                    i += lit.len();
                    copied = i;
                    continue;
                }
            }
            _ => {}
        }
        i += 1;
    }
    if copied == 0 {
        return std::borrow::Cow::Borrowed(text);
    }
    out.push_str(&text[copied..]);
    std::borrow::Cow::Owned(out)
}

/// A token id field (`eos_token_id`, `bos_token_id`): an integer, a list of them, or null.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(untagged, expecting = "a token id or a list of token ids")]
pub enum TokenIds {
    #[default]
    None,
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    pub fn into_vec(self) -> Vec<u32> {
        match self {
            Self::None => Vec::new(),
            Self::One(t) => vec![t],
            Self::Many(ts) => ts,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize)]
    struct Outer {
        #[serde(default)]
        ids: TokenIds,
        inner: Option<Inner>,
    }

    #[derive(Debug, Deserialize)]
    struct Inner {
        factor: f64,
    }

    #[test]
    fn python_nonfinite_literals_are_spelled_as_transformers_5_does() {
        let text = r#"{"a": [0.0, Infinity], "b": -Infinity, "c": NaN, "s": "NaN \" Infinity"}"#;
        let v: serde_json::Value = serde_json::from_str(&with_nonfinite_spelled(text)).unwrap();
        assert_eq!(v["a"][1]["__float__"], "Infinity");
        assert_eq!(v["b"]["__float__"], "-Infinity");
        assert_eq!(v["c"]["__float__"], "NaN");
        assert_eq!(v["s"], "NaN \" Infinity");
        let plain = r#"{"x": -1.5}"#;
        assert!(matches!(
            with_nonfinite_spelled(plain),
            std::borrow::Cow::Borrowed(_)
        ));
    }

    #[test]
    fn errors_name_the_field_path() {
        let p = Path::new("/m/x.json");
        let e = parse_json::<Outer>(r#"{"inner": {"factor": "big"}}"#, p).unwrap_err();
        assert!(
            matches!(&e, DetspecError::InvalidConfig { field, .. } if field == "inner.factor"),
            "{e:?}"
        );
        let e = parse_json::<Outer>(r#"{"inner": "#, p).unwrap_err();
        assert!(matches!(e, DetspecError::InvalidFile { .. }), "{e:?}");
        let o: Outer = parse_json(r#"{"ids": [1, 2]}"#, p).unwrap();
        assert_eq!(o.ids.into_vec(), vec![1, 2]);
        let o: Outer = parse_json(r#"{"ids": 7, "inner": {"factor": 2}}"#, p).unwrap();
        assert_eq!(o.inner.map(|i| i.factor), Some(2.0));
        assert_eq!(o.ids.into_vec(), vec![7]);
        let o: Outer = parse_json(r#"{"ids": null}"#, p).unwrap();
        assert!(o.ids.into_vec().is_empty());
    }
}
