//! Loading a HuggingFace tokenizer (`tokenizer.json`) together with the bits of
//! `tokenizer_config.json` / `chat_template.jinja` / `generation_config.json` / `config.json` that
//! the engine needs: special tokens, the chat template and the set of EOS token ids.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::config::json::{parse_json, TokenIds};
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
        if let Some(text) = read_text_optional(&config_path)? {
            let cfg: TokenizerConfigFile = parse_json(&text, &config_path)?;
            tok.bos_token = cfg.bos_token.map(SpecialToken::into_content);
            tok.eos_token = cfg.eos_token.map(SpecialToken::into_content);
            tok.add_bos_token = cfg.add_bos_token;
            if let Some(t) = cfg.chat_template.and_then(ChatTemplateField::into_template) {
                tok.chat_template = Some(t);
                tok.chat_template_origin = Some(config_path.clone());
            }
        }

        let json_path = dir.join(CHAT_TEMPLATE_JSON_FILE);
        if let Some(text) = read_text_optional(&json_path)? {
            let cfg: ChatTemplateFile = parse_json(&text, &json_path)?;
            if let Some(t) = cfg.chat_template.and_then(ChatTemplateField::into_template) {
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

    /// `first` and `second` as one sequence pair, joined by the tokenizer's pair template (its
    /// post-processor's, e.g. `[CLS] a [SEP] b [SEP]`; without one, the two concatenated), as
    /// transformers' `tokenizer(text, text_pair)` encodes a cross-encoder's input.
    pub fn encode_pair(
        &self,
        first: &str,
        second: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode((first, second), add_special_tokens)
            .map_err(|e| {
                DetspecError::Tokenizer(format!(
                    "encoding a pair failed ({}): {e}",
                    self.origin.display()
                ))
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
        let Some(text) = read_text_optional(&path)? else {
            continue;
        };
        let cfg: EosConfig = parse_json(&text, &path)?;
        let mut field = cfg.eos_token_id;
        if field.is_none() && name == MODEL_CONFIG_FILE {
            field = cfg.text_config.and_then(|t| t.eos_token_id);
        }
        for id in field.map(TokenIds::into_vec).unwrap_or_default() {
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

/// The fields of `tokenizer_config.json` the engine reads.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct TokenizerConfigFile {
    bos_token: Option<SpecialToken>,
    eos_token: Option<SpecialToken>,
    add_bos_token: Option<bool>,
    chat_template: Option<ChatTemplateField>,
}

/// `chat_template.json` (older processors): `{"chat_template": ...}`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ChatTemplateFile {
    chat_template: Option<ChatTemplateField>,
}

/// `bos_token` / `eos_token`: a string or an `{"content": ...}` object (AddedToken).
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "a string or a token object with a string `content`"
)]
enum SpecialToken {
    Text(String),
    Added { content: String },
}

impl SpecialToken {
    fn into_content(self) -> String {
        match self {
            Self::Text(s) | Self::Added { content: s } => s,
        }
    }
}

/// `chat_template`: a string, or a list of `{"name", "template"}` (take `default`, else the
/// first).
#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string or a list of {name, template}")]
enum ChatTemplateField {
    One(String),
    Named(Vec<NamedTemplate>),
}

#[derive(Debug, Deserialize)]
struct NamedTemplate {
    #[serde(default)]
    name: Option<String>,
    template: String,
}

impl ChatTemplateField {
    fn into_template(self) -> Option<String> {
        match self {
            Self::One(t) => Some(t),
            Self::Named(mut named) => {
                let i = named
                    .iter()
                    .position(|n| n.name.as_deref() == Some("default"))
                    .unwrap_or(0);
                (i < named.len()).then(|| named.swap_remove(i).template)
            }
        }
    }
}

/// `eos_token_id` of `generation_config.json` / `config.json` (there, falling back to
/// `text_config.eos_token_id`).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct EosConfig {
    eos_token_id: Option<TokenIds>,
    text_config: Option<TextConfig>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct TextConfig {
    eos_token_id: Option<TokenIds>,
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
