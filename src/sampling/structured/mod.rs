//! Structured outputs: a request's output constrained to a JSON schema, any JSON object, a
//! regular expression, a fixed list of choices or a Lark grammar.
//!
//! The constraint is compiled by `llguidance` into a parser over the tokenizer's vocabulary
//! ([`Grammars`]); each sequence carries its parser state ([`TokenConstraint`]), which yields
//! the set of tokens allowed after a given output prefix. The sampler masks every other token
//! to `-inf` before anything else ([`crate::sampling::sample_next`]), on the fast path, the
//! inline path and the replay verifier alike.
//!
//! Why this keeps the determinism contract: the mask is a function of the grammar and of the
//! output prefix only (the parser is deterministic and its work limits count steps, not time),
//! and the sampler is a pure function of the masked row. A rollback only shortens the prefix
//! the next mask is asked for; the parser state follows the prefix ([`TokenConstraint`] syncs
//! to it), so the grammar rewinds with the tokens.

mod state;
mod vocab;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde::{Deserialize, Serialize};

use crate::error::{DetspecError, Result};
use crate::tokenizer::Tokenizer;

pub use state::{TokenConstraint, TokenMask};

/// The constraint a request asks for: exactly one field is set (vLLM's
/// `StructuredOutputsParams`, whose field names these are).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StructuredOutputs {
    /// A JSON schema, as JSON text.
    pub json: Option<String>,
    /// A regular expression the whole output must match.
    pub regex: Option<String>,
    /// The output is exactly one of these strings.
    pub choice: Option<Vec<String>>,
    /// A Lark grammar (llguidance's dialect, which may embed JSON schemas with `%json{...}`).
    pub grammar: Option<String>,
    /// Any JSON object.
    pub json_object: bool,
    /// When set, the constraint applies to the output after the first occurrence of this
    /// run of tokens, which the model reaches freely (a reasoning model's end-of-thinking
    /// token; gpt-oss's `<|channel|>final<|message|>`, the header of its answer): the
    /// thinking is free, the answer is constrained. Not a constraint of its own.
    pub starts_after: Option<Vec<u32>>,
}

/// Separators and whitespace of generated JSON: compact, one space after `,` and `:` (what
/// OpenAI's models and `json.dumps` write). llguidance's default allows any whitespace between
/// tokens, where a model that likes newlines may never close the object. A schema's own
/// `x-guidance` object overrides these. (The server's Harmony tool grammar embeds schemas
/// with these too: exported to Python as `_core.JSON_OPTIONS`.)
pub const JSON_OPTIONS: &str = r#"{"item_separator": ", ", "key_separator": ": ",
    "whitespace_flexible": false, "coerce_one_of": true}"#;

impl StructuredOutputs {
    /// The parameter name of the one constraint set (`structured_outputs.json`, ...), for
    /// error messages.
    pub fn param_name(&self) -> &'static str {
        match self.kinds().first() {
            Some(kind) => kind,
            None => "structured_outputs",
        }
    }

    fn kinds(&self) -> Vec<&'static str> {
        let mut kinds = Vec::new();
        if self.json.is_some() {
            kinds.push("structured_outputs.json");
        }
        if self.regex.is_some() {
            kinds.push("structured_outputs.regex");
        }
        if self.choice.is_some() {
            kinds.push("structured_outputs.choice");
        }
        if self.grammar.is_some() {
            kinds.push("structured_outputs.grammar");
        }
        if self.json_object {
            kinds.push("structured_outputs.json_object");
        }
        kinds
    }

    /// Checks that exactly one constraint is set and that it is well-formed as far as can be
    /// told without a tokenizer (JSON text parses, choices are non-empty); the grammar itself
    /// is checked when it is compiled ([`Grammars::compile`]).
    pub fn validate(&self) -> Result<()> {
        let kinds = self.kinds();
        match kinds.len() {
            0 => {
                return Err(DetspecError::param(
                    "structured_outputs",
                    "set exactly one of json, regex, choice, grammar, json_object",
                ))
            }
            1 => {}
            _ => {
                return Err(DetspecError::param(
                    "structured_outputs",
                    format!("set exactly one constraint, got {}", kinds.join(", ")),
                ))
            }
        }
        if let Some(schema) = &self.json {
            schema_value(schema)?;
        }
        if let Some(choice) = &self.choice {
            if choice.is_empty() {
                return Err(DetspecError::param(
                    "structured_outputs.choice",
                    "must list at least one choice",
                ));
            }
            if let Some(i) = choice.iter().position(String::is_empty) {
                return Err(DetspecError::param(
                    "structured_outputs.choice",
                    format!("choice {i} is empty"),
                ));
            }
        }
        Ok(())
    }

    /// The llguidance grammar of this constraint.
    fn to_grammar(&self) -> Result<TopLevelGrammar> {
        self.validate()?;
        if let Some(schema) = &self.json {
            return Ok(TopLevelGrammar::from_json_schema(with_json_options(
                schema_value(schema)?,
            )));
        }
        if self.json_object {
            return Ok(TopLevelGrammar::from_json_schema(with_json_options(
                serde_json::json!({"type": "object"}),
            )));
        }
        if let Some(rx) = &self.regex {
            // Checked here so the error has the regex's own position; llguidance's message
            // for the same mistake does not.
            regex_syntax::Parser::new().parse(rx).map_err(|e| {
                DetspecError::param("structured_outputs.regex", format!("invalid regex: {e}"))
            })?;
            return Ok(TopLevelGrammar::from_regex(rx));
        }
        if let Some(choice) = &self.choice {
            let alternatives: Vec<String> =
                choice.iter().map(|c| regex_syntax::escape(c)).collect();
            return Ok(TopLevelGrammar::from_regex(&alternatives.join("|")));
        }
        match &self.grammar {
            Some(lark) => Ok(TopLevelGrammar::from_lark(lark.clone())),
            None => Err(DetspecError::param(
                "structured_outputs",
                "no constraint set",
            )),
        }
    }
}

fn schema_value(schema: &str) -> Result<serde_json::Value> {
    let value: serde_json::Value = serde_json::from_str(schema).map_err(|e| {
        DetspecError::param(
            "structured_outputs.json",
            format!("the schema is not valid JSON: {e}"),
        )
    })?;
    if !value.is_object() && !value.is_boolean() {
        return Err(DetspecError::param(
            "structured_outputs.json",
            "a JSON schema must be an object (or true/false)",
        ));
    }
    Ok(value)
}

/// Where in `schema` llguidance's `message` points: the JSON pointer of the keyword it names
/// (`'minimum'`, `Invalid type: strin`, `properties must be ...`), the occurrence whose value
/// the message quotes when there are several. llguidance's schema errors say what is wrong,
/// not where.
fn locate(schema: &str, message: &str) -> Option<String> {
    let keyword = if let Some(rest) = message.strip_prefix("Invalid type: ") {
        ("type", Some(rest.trim().to_string()))
    } else if let Some(start) = message.find(" for '") {
        let rest = &message[start + 6..];
        (rest.split('\'').next()?, None)
    } else {
        (message.split(' ').next()?, None)
    };
    let (key, value) = keyword;
    let schema: serde_json::Value = serde_json::from_str(schema).ok()?;
    let mut found = Vec::new();
    find_key(&schema, key, &mut String::new(), &mut found);
    let quoted = |v: &serde_json::Value| match (&value, v) {
        (Some(want), serde_json::Value::String(s)) => s == want,
        (Some(_), _) => false,
        (None, v) => message.contains(&v.to_string()),
    };
    found
        .iter()
        .find(|(_, v)| quoted(v))
        .or(if found.len() == 1 {
            found.first()
        } else {
            None
        })
        .map(|(at, _)| at.clone())
}

fn find_key(
    v: &serde_json::Value,
    key: &str,
    at: &mut String,
    found: &mut Vec<(String, serde_json::Value)>,
) {
    let len = at.len();
    match v {
        serde_json::Value::Object(o) => {
            for (k, child) in o {
                at.push('/');
                at.push_str(&k.replace('~', "~0").replace('/', "~1"));
                if k == key {
                    found.push((at.clone(), child.clone()));
                }
                find_key(child, key, at, found);
                at.truncate(len);
            }
        }
        serde_json::Value::Array(a) => {
            for (i, child) in a.iter().enumerate() {
                at.push_str(&format!("/{i}"));
                find_key(child, key, at, found);
                at.truncate(len);
            }
        }
        _ => {}
    }
}

/// The schema with [`JSON_OPTIONS`] as its `x-guidance` unless it sets its own.
fn with_json_options(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(obj) = schema.as_object_mut() {
        if !obj.contains_key("x-guidance") {
            let options: serde_json::Value =
                serde_json::from_str(JSON_OPTIONS).unwrap_or(serde_json::Value::Null);
            obj.insert("x-guidance".into(), options);
        }
    }
    schema
}

/// Compiles constraints for one model: the tokenizer's vocabulary as a token trie, built on
/// first use (a model that never sees a constrained request never pays for it) and shared by
/// every request.
pub struct Grammars {
    tokenizer: Option<Arc<Tokenizer>>,
    /// Length of a logits row (may exceed the tokenizer's vocabulary).
    vocab_size: usize,
    eos_token_ids: Vec<u32>,
    factory: OnceLock<std::result::Result<ParserFactory, String>>,
    /// Fresh parser states of recent constraints: the server checks a request's constraint
    /// before it submits it and intake compiles it again, and an eval or rollout sends the
    /// same schema many times; a copy of a fresh state is the compiled grammar for free.
    compiled: Mutex<HashMap<StructuredOutputs, TokenConstraint>>,
}

/// Most constraints [`Grammars`] keeps compiled (the map starts over when full).
const COMPILED_CACHE: usize = 64;

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("vocab_size", &self.vocab_size)
            .field("built", &self.factory.get().is_some())
            .finish()
    }
}

impl Grammars {
    pub fn new(
        tokenizer: Option<Arc<Tokenizer>>,
        vocab_size: usize,
        eos_token_ids: Vec<u32>,
    ) -> Self {
        Self {
            tokenizer,
            vocab_size,
            eos_token_ids,
            factory: OnceLock::new(),
            compiled: Mutex::default(),
        }
    }

    fn factory(&self) -> Result<&ParserFactory> {
        let built = self.factory.get_or_init(|| {
            let tokenizer = self.tokenizer.as_ref().ok_or_else(|| {
                "structured outputs need the model's tokenizer.json, which this model \
                 directory does not have"
                    .to_string()
            })?;
            let env = vocab::token_env(tokenizer, self.vocab_size, &self.eos_token_ids)
                .map_err(|e| e.to_string())?;
            let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
            factory.quiet();
            Ok(factory)
        });
        built
            .as_ref()
            .map_err(|message| DetspecError::param("structured_outputs", message.clone()))
    }

    /// Compiles `constraint` into a fresh parser state; a bad schema, regex or grammar is an
    /// error naming the field (`structured_outputs.json`, ...) with llguidance's message, which
    /// gives the position (line and column of a grammar, the schema path).
    pub fn compile(&self, constraint: &StructuredOutputs) -> Result<TokenConstraint> {
        let lock = || self.compiled.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = lock().get(constraint) {
            return Ok(c.clone());
        }
        let fresh = self.compile_uncached(constraint)?;
        let mut compiled = lock();
        if compiled.len() >= COMPILED_CACHE {
            compiled.clear();
        }
        compiled.insert(constraint.clone(), fresh.clone());
        Ok(fresh)
    }

    fn compile_uncached(&self, constraint: &StructuredOutputs) -> Result<TokenConstraint> {
        if let Some(gate) = &constraint.starts_after {
            let param = "structured_outputs.starts_after";
            if gate.is_empty() {
                return Err(DetspecError::param(
                    param,
                    "is empty (give one token id or more)",
                ));
            }
            if let Some(&t) = gate.iter().find(|&&t| t as usize >= self.vocab_size) {
                return Err(DetspecError::param(
                    param,
                    format!(
                        "token id {t} is outside the vocabulary (size {})",
                        self.vocab_size
                    ),
                ));
            }
        }
        let grammar = constraint.to_grammar()?;
        let factory = self.factory()?;
        let param = constraint.param_name();
        let parser = factory.create_parser(grammar).map_err(|e| {
            let mut message = e.to_string();
            if let Some(at) = constraint.json.as_deref().and_then(|s| locate(s, &message)) {
                message = format!("{message} (at {at})");
            }
            DetspecError::param(param, message)
        })?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(DetspecError::param(param, e));
        }
        Ok(TokenConstraint::new(
            matcher,
            self.vocab_size,
            constraint.starts_after.clone(),
        ))
    }
}
