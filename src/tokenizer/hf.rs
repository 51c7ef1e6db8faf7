//! Loading a HuggingFace tokenizer (`tokenizer.json`) together with the bits of
//! `tokenizer_config.json` / `chat_template.jinja` / `generation_config.json` / `config.json` that
//! the engine needs: special tokens, the chat template and the set of EOS token ids.

use std::path::{Path, PathBuf};

use serde_json::Value as Json;

use crate::error::{DetspecError, Result};

/// File names inside a HuggingFace model directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// See [`TOKENIZER_FILE`].
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
/// See [`TOKENIZER_FILE`].
pub const CHAT_TEMPLATE_JINJA_FILE: &str = "chat_template.jinja";
/// See [`TOKENIZER_FILE`]. Older processors store the template here as `{"chat_template": "..."}`.
pub const CHAT_TEMPLATE_JSON_FILE: &str = "chat_template.json";
/// See [`TOKENIZER_FILE`].
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";
/// See [`TOKENIZER_FILE`].
pub const MODEL_CONFIG_FILE: &str = "config.json";

/// A HuggingFace tokenizer plus the special-token and chat-template settings of its model
/// directory.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Where the tokenizer was loaded from (used in error messages).
    origin: PathBuf,
    bos_token: Option<String>,
    eos_token: Option<String>,
    add_bos_token: Option<bool>,
    chat_template: Option<String>,
    chat_template_origin: Option<PathBuf>,
}

/// Loads the tokenizer of the HuggingFace model directory `dir`. Same as
/// [`Tokenizer::from_model_dir`].
pub fn from_model_dir(dir: &Path) -> Result<Tokenizer> {
    Tokenizer::from_model_dir(dir)
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json` (required) and, when present, `dir/tokenizer_config.json`
    /// (`bos_token`, `eos_token`, `add_bos_token`, `chat_template`), `dir/chat_template.json`
    /// and `dir/chat_template.jinja`. The chat template is taken from the first of
    /// `chat_template.jinja`, `chat_template.json`, `tokenizer_config.json` that has one.
    pub fn from_model_dir(dir: &Path) -> Result<Tokenizer> {
        let mut tok = Tokenizer::from_file(&dir.join(TOKENIZER_FILE))?;

        let config_path = dir.join(TOKENIZER_CONFIG_FILE);
        if let Some(cfg) = read_json_optional(&config_path)? {
            let obj = cfg
                .as_object()
                .ok_or_else(|| DetspecError::file(&config_path, "expected a JSON object"))?;
            tok.bos_token = special_token_field(obj.get("bos_token"), &config_path, "bos_token")?;
            tok.eos_token = special_token_field(obj.get("eos_token"), &config_path, "eos_token")?;
            tok.add_bos_token = match obj.get("add_bos_token") {
                None | Some(Json::Null) => None,
                Some(Json::Bool(b)) => Some(*b),
                Some(other) => {
                    return Err(invalid_field(
                        &config_path,
                        "add_bos_token",
                        format!("expected a boolean, got {other}"),
                    ))
                }
            };
            if let Some(t) = chat_template_field(obj.get("chat_template"), &config_path)? {
                tok.chat_template = Some(t);
                tok.chat_template_origin = Some(config_path.clone());
            }
        }

        let json_path = dir.join(CHAT_TEMPLATE_JSON_FILE);
        if let Some(cfg) = read_json_optional(&json_path)? {
            let field = cfg.as_object().and_then(|o| o.get("chat_template"));
            if let Some(t) = chat_template_field(field, &json_path)? {
                tok.chat_template = Some(t);
                tok.chat_template_origin = Some(json_path);
            }
        }

        let jinja_path = dir.join(CHAT_TEMPLATE_JINJA_FILE);
        if let Some(t) = read_text_optional(&jinja_path)? {
            tok.chat_template = Some(t);
            tok.chat_template_origin = Some(jinja_path);
        }

        Ok(tok)
    }

    /// Loads a bare `tokenizer.json` file (no special-token or chat-template settings).
    pub fn from_file(path: &Path) -> Result<Tokenizer> {
        let bytes = std::fs::read(path).map_err(|e| DetspecError::io(path, e))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
            DetspecError::file(path, format!("not a valid HuggingFace tokenizer: {e}"))
        })?;
        Ok(Tokenizer::from_tokenizers(inner, path))
    }

    /// Wraps an already-built `tokenizers::Tokenizer`; `origin` is only used in error messages.
    pub fn from_tokenizers(inner: tokenizers::Tokenizer, origin: impl Into<PathBuf>) -> Tokenizer {
        Tokenizer {
            inner,
            origin: origin.into(),
            bos_token: None,
            eos_token: None,
            add_bos_token: None,
            chat_template: None,
            chat_template_origin: None,
        }
    }

    /// Encodes `text`. With `add_special_tokens` the tokenizer's post-processor runs (e.g. adds
    /// BOS for Llama). Chat-template output normally already contains BOS and should be encoded
    /// with `add_special_tokens = false`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, add_special_tokens).map_err(|e| {
            DetspecError::Tokenizer(format!("encoding failed ({}): {e}", self.origin.display()))
        })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes `ids` to text. Ids outside the vocabulary are ignored (as HuggingFace does).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(|e| {
            DetspecError::Tokenizer(format!("decoding failed ({}): {e}", self.origin.display()))
        })
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of `token` (a vocabulary or added token), if any.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of `id`, if any.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of the `eos_token` of `tokenizer_config.json` (empty when there is none or it is
    /// not in the vocabulary).
    pub fn eos_token_ids_from_tokenizer_config(&self) -> Vec<u32> {
        self.eos_token
            .as_deref()
            .and_then(|t| self.token_to_id(t))
            .into_iter()
            .collect()
    }

    /// `bos_token` of `tokenizer_config.json`.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// `eos_token` of `tokenizer_config.json`.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// `add_bos_token` of `tokenizer_config.json`, if set.
    pub fn add_bos_token(&self) -> Option<bool> {
        self.add_bos_token
    }

    /// The chat template source, if the model directory has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The file the chat template came from.
    pub fn chat_template_origin(&self) -> Option<&Path> {
        self.chat_template_origin.as_deref()
    }

    /// The file the tokenizer was loaded from.
    pub fn origin(&self) -> &Path {
        &self.origin
    }

    /// Overrides the special tokens (for tokenizers not loaded from a model directory).
    pub fn set_special_tokens(&mut self, bos_token: Option<String>, eos_token: Option<String>) {
        self.bos_token = bos_token;
        self.eos_token = eos_token;
    }

    /// Overrides the chat template.
    pub fn set_chat_template(&mut self, template: Option<String>) {
        self.chat_template = template;
        self.chat_template_origin = None;
    }

    /// The wrapped `tokenizers::Tokenizer`.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// The EOS token ids of the model directory `dir`: the union, deduplicated in first-seen order,
/// of `eos_token_id` in `generation_config.json`, then in `config.json` (falling back to
/// `text_config.eos_token_id` there), then the tokenizer's `eos_token` from
/// `tokenizer_config.json`. Each `eos_token_id` may be an integer, a list of integers, null or
/// absent; missing files are skipped, unreadable or malformed ones are errors naming the file.
pub fn eos_token_ids(dir: &Path, tokenizer: Option<&Tokenizer>) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    let mut push = |id: u32| {
        if !ids.contains(&id) {
            ids.push(id);
        }
    };
    for name in [GENERATION_CONFIG_FILE, MODEL_CONFIG_FILE] {
        let path = dir.join(name);
        let Some(cfg) = read_json_optional(&path)? else {
            continue;
        };
        let obj = cfg
            .as_object()
            .ok_or_else(|| DetspecError::file(&path, "expected a JSON object"))?;
        let mut field = obj.get("eos_token_id");
        let mut field_name = "eos_token_id";
        if field.is_none() && name == MODEL_CONFIG_FILE {
            if let Some(v) = obj.get("text_config").and_then(|t| t.get("eos_token_id")) {
                field = Some(v);
                field_name = "text_config.eos_token_id";
            }
        }
        for id in token_ids_field(field, &path, field_name)? {
            push(id);
        }
    }
    if let Some(tok) = tokenizer {
        for id in tok.eos_token_ids_from_tokenizer_config() {
            push(id);
        }
    }
    Ok(ids)
}

fn invalid_field(path: &Path, field: &str, message: impl Into<String>) -> DetspecError {
    DetspecError::InvalidConfig {
        path: path.to_path_buf(),
        field: field.to_string(),
        message: message.into(),
    }
}

/// Reads a UTF-8 text file; `Ok(None)` when it does not exist.
pub(crate) fn read_text_optional(path: &Path) -> Result<Option<String>> {
    match std::fs::read(path) {
        Ok(bytes) => String::from_utf8(bytes)
            .map(Some)
            .map_err(|e| DetspecError::file(path, format!("not valid UTF-8: {e}"))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(DetspecError::io(path, e)),
    }
}

/// Reads and parses a JSON file; `Ok(None)` when it does not exist.
pub(crate) fn read_json_optional(path: &Path) -> Result<Option<Json>> {
    let Some(text) = read_text_optional(path)? else {
        return Ok(None);
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| DetspecError::file(path, format!("malformed JSON: {e}")))
}

/// `bos_token` / `eos_token`: a string, an `{"content": ...}` object (AddedToken) or null.
fn special_token_field(value: Option<&Json>, path: &Path, field: &str) -> Result<Option<String>> {
    match value {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Object(o)) => match o.get("content") {
            Some(Json::String(s)) => Ok(Some(s.clone())),
            _ => Err(invalid_field(
                path,
                field,
                "token object has no string `content`",
            )),
        },
        Some(other) => Err(invalid_field(
            path,
            field,
            format!("expected a string or a token object, got {other}"),
        )),
    }
}

/// `chat_template`: a string, or a list of `{"name", "template"}` (take `default`, else the
/// first), or null.
fn chat_template_field(value: Option<&Json>, path: &Path) -> Result<Option<String>> {
    const FIELD: &str = "chat_template";
    match value {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Array(items)) => {
            let mut named = Vec::with_capacity(items.len());
            for item in items {
                let name = item.get("name").and_then(Json::as_str);
                let template = item.get("template").and_then(Json::as_str).ok_or_else(|| {
                    invalid_field(path, FIELD, "list entry without a string `template`")
                })?;
                named.push((name, template));
            }
            Ok(named
                .iter()
                .find(|(name, _)| *name == Some("default"))
                .or_else(|| named.first())
                .map(|(_, t)| t.to_string()))
        }
        Some(other) => Err(invalid_field(
            path,
            FIELD,
            format!(
                "expected a string or a list of {{name, template}}, got {}",
                json_kind(other)
            ),
        )),
    }
}

/// `eos_token_id`: an integer, a list of integers, or null/absent.
fn token_ids_field(value: Option<&Json>, path: &Path, field: &str) -> Result<Vec<u32>> {
    let one = |v: &Json| -> Result<u32> {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| invalid_field(path, field, format!("not a token id: {v}")))
    };
    match value {
        None | Some(Json::Null) => Ok(Vec::new()),
        Some(Json::Array(items)) => items.iter().map(one).collect(),
        Some(v) => Ok(vec![one(v)?]),
    }
}

fn json_kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "a list",
        Json::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::test_util::{model_dir, write};

    #[test]
    fn roundtrip_encode_decode() {
        let dir = model_dir();
        let tok = Tokenizer::from_model_dir(dir.path()).unwrap();
        assert!(tok.vocab_size() > 256);
        for text in [
            "hello world",
            "the quick brown fox jumps over the lazy dog",
            "café 😀 中文 mixed   spaces\nand newlines",
            "",
        ] {
            let ids = tok.encode(text, false).unwrap();
            assert_eq!(tok.decode(&ids, false).unwrap(), text);
        }
        // The post-processor adds BOS only with add_special_tokens.
        let bos = tok.token_to_id("<|bos|>").unwrap();
        let with = tok.encode("hello", true).unwrap();
        let without = tok.encode("hello", false).unwrap();
        assert_eq!(with[0], bos);
        assert_eq!(&with[1..], &without[..]);
        assert_eq!(tok.decode(&with, true).unwrap(), "hello");
        assert_eq!(tok.decode(&with, false).unwrap(), "<|bos|>hello");
        // Special tokens in text are recognised as single tokens.
        let eos = tok.token_to_id("<|eos|>").unwrap();
        assert_eq!(
            *tok.encode("hi<|eos|>", false).unwrap().last().unwrap(),
            eos
        );
        assert_eq!(tok.id_to_token(eos).as_deref(), Some("<|eos|>"));
    }

    #[test]
    fn tokenizer_config_fields() {
        let dir = model_dir();
        write(
            dir.path(),
            TOKENIZER_CONFIG_FILE,
            r#"{"bos_token": {"content": "<|bos|>", "lstrip": false}, "eos_token": "<|eos|>",
                "add_bos_token": true, "chat_template": [
                  {"name": "tool_use", "template": "TOOLS"},
                  {"name": "default", "template": "DEFAULT"}]}"#,
        );
        let tok = Tokenizer::from_model_dir(dir.path()).unwrap();
        assert_eq!(tok.bos_token(), Some("<|bos|>"));
        assert_eq!(tok.eos_token(), Some("<|eos|>"));
        assert_eq!(tok.add_bos_token(), Some(true));
        assert_eq!(tok.chat_template(), Some("DEFAULT"));
        assert_eq!(
            tok.eos_token_ids_from_tokenizer_config(),
            vec![tok.token_to_id("<|eos|>").unwrap()]
        );

        // List without "default": the first entry.
        write(
            dir.path(),
            TOKENIZER_CONFIG_FILE,
            r#"{"eos_token": null, "chat_template": [{"name": "a", "template": "A"},
                {"name": "b", "template": "B"}]}"#,
        );
        let tok = Tokenizer::from_model_dir(dir.path()).unwrap();
        assert_eq!(tok.chat_template(), Some("A"));
        assert_eq!(tok.eos_token(), None);
        assert!(tok.eos_token_ids_from_tokenizer_config().is_empty());

        // chat_template.jinja takes precedence.
        write(dir.path(), CHAT_TEMPLATE_JINJA_FILE, "JINJA {{ x }}");
        let tok = Tokenizer::from_model_dir(dir.path()).unwrap();
        assert_eq!(tok.chat_template(), Some("JINJA {{ x }}"));
        assert_eq!(
            tok.chat_template_origin(),
            Some(dir.path().join(CHAT_TEMPLATE_JINJA_FILE).as_path())
        );
    }

    #[test]
    fn no_tokenizer_config_is_fine() {
        let dir = model_dir();
        std::fs::remove_file(dir.path().join(TOKENIZER_CONFIG_FILE)).unwrap();
        let tok = Tokenizer::from_model_dir(dir.path()).unwrap();
        assert_eq!(tok.bos_token(), None);
        assert_eq!(tok.chat_template(), None);
    }

    #[test]
    fn missing_tokenizer_json_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let err = Tokenizer::from_model_dir(dir.path()).unwrap_err();
        assert!(matches!(err, DetspecError::Io { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains(TOKENIZER_FILE), "{msg}");
        assert!(msg.contains(&dir.path().display().to_string()), "{msg}");
    }

    #[test]
    fn invalid_tokenizer_json_names_the_path() {
        let dir = model_dir();
        write(dir.path(), TOKENIZER_FILE, "{\"model\": 3");
        let err = Tokenizer::from_model_dir(dir.path()).unwrap_err();
        assert!(matches!(err, DetspecError::InvalidFile { .. }), "{err:?}");
        assert!(err.to_string().contains(TOKENIZER_FILE), "{err}");
    }

    #[test]
    fn malformed_tokenizer_config_names_the_file() {
        let dir = model_dir();
        write(dir.path(), TOKENIZER_CONFIG_FILE, "{\"eos_token\": ");
        let err = Tokenizer::from_model_dir(dir.path()).unwrap_err();
        assert!(matches!(err, DetspecError::InvalidFile { .. }), "{err:?}");
        assert!(err.to_string().contains(TOKENIZER_CONFIG_FILE), "{err}");

        write(dir.path(), TOKENIZER_CONFIG_FILE, "{\"chat_template\": 5}");
        let err = Tokenizer::from_model_dir(dir.path()).unwrap_err();
        assert!(
            matches!(&err, DetspecError::InvalidConfig { field, .. } if field == "chat_template"),
            "{err:?}"
        );
        assert!(err.to_string().contains(TOKENIZER_CONFIG_FILE), "{err}");
    }

    #[test]
    fn eos_ids_union() {
        let dir = model_dir();
        let tok = Tokenizer::from_model_dir(dir.path()).unwrap();
        let eos = tok.token_to_id("<|eos|>").unwrap();

        // Nothing but tokenizer_config.
        assert_eq!(eos_token_ids(dir.path(), Some(&tok)).unwrap(), vec![eos]);
        assert!(eos_token_ids(dir.path(), None).unwrap().is_empty());

        // generation_config list, config int, tokenizer eos: union in order, deduplicated.
        write(
            dir.path(),
            GENERATION_CONFIG_FILE,
            r#"{"bos_token_id": 1, "eos_token_id": [7, 9, 7]}"#,
        );
        write(dir.path(), MODEL_CONFIG_FILE, r#"{"eos_token_id": 9}"#);
        assert_eq!(
            eos_token_ids(dir.path(), Some(&tok)).unwrap(),
            vec![7, 9, eos]
        );

        // generation_config int, config list, null and nested forms.
        write(dir.path(), GENERATION_CONFIG_FILE, r#"{"eos_token_id": 3}"#);
        write(
            dir.path(),
            MODEL_CONFIG_FILE,
            &format!(r#"{{"eos_token_id": [{eos}, 4]}}"#),
        );
        assert_eq!(
            eos_token_ids(dir.path(), Some(&tok)).unwrap(),
            vec![3, eos, 4]
        );
        write(
            dir.path(),
            GENERATION_CONFIG_FILE,
            r#"{"eos_token_id": null}"#,
        );
        write(
            dir.path(),
            MODEL_CONFIG_FILE,
            r#"{"text_config": {"eos_token_id": 11}}"#,
        );
        assert_eq!(eos_token_ids(dir.path(), None).unwrap(), vec![11]);
    }

    #[test]
    fn eos_ids_errors_name_the_file() {
        let dir = model_dir();
        write(dir.path(), GENERATION_CONFIG_FILE, "{not json");
        let err = eos_token_ids(dir.path(), None).unwrap_err();
        assert!(matches!(err, DetspecError::InvalidFile { .. }), "{err:?}");
        assert!(err.to_string().contains(GENERATION_CONFIG_FILE), "{err}");

        write(dir.path(), GENERATION_CONFIG_FILE, "{}");
        write(
            dir.path(),
            MODEL_CONFIG_FILE,
            r#"{"eos_token_id": [1, -2]}"#,
        );
        let err = eos_token_ids(dir.path(), None).unwrap_err();
        assert!(
            matches!(&err, DetspecError::InvalidConfig { field, .. } if field == "eos_token_id"),
            "{err:?}"
        );
        assert!(err.to_string().contains(MODEL_CONFIG_FILE), "{err}");

        write(dir.path(), MODEL_CONFIG_FILE, r#"{"eos_token_id": "2"}"#);
        assert!(eos_token_ids(dir.path(), None).is_err());
    }
}
