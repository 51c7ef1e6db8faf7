//! HuggingFace chat templates rendered with minijinja.
//!
//! HF renders templates with Jinja2 using `trim_blocks=True, lstrip_blocks=True`, a
//! `raise_exception(msg)` global, a `strftime_now(fmt)` global, a `tojson` filter that behaves
//! like Python's `json.dumps(..., ensure_ascii=False)`, and templates freely call Python methods
//! on strings and dicts (`.strip()`, `.startswith()`, `.items()`, ...). The Python methods come
//! from `minijinja-contrib`'s `pycompat` (with keyword arguments bound to positions and a few
//! string methods it lacks or answers differently from Python kept here, see `string_method`);
//! `strftime_now` formats through `minijinja-contrib`'s `datetimeformat`. The HF-specific
//! globals and `tojson` (minijinja's own is compact and HTML-escaping) are defined here.
//!
//! Known gap: maps reach the template through serde_json (without its `preserve_order`), so their
//! keys are sorted and `tojson` of a dict lists them sorted rather than in insertion order.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind, State};
use serde::{Deserialize, Serialize};

use super::Tokenizer;
use crate::error::{DetspecError, Result};

const TEMPLATE_NAME: &str = "chat_template";

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// Where the template came from, for error messages.
    origin: Option<PathBuf>,
}

impl ChatTemplate {
    /// Compiles `source`. `bos_token` / `eos_token` are exposed to the template under those
    /// names (undefined when `None`).
    pub fn new(source: &str, bos_token: Option<&str>, eos_token: Option<&str>) -> Result<Self> {
        Self::build(source, bos_token, eos_token, None)
    }

    /// Bounds each rendering to `fuel` template instructions (about one per expression and
    /// loop turn): a template from a request, or a server's flag, cannot loop for ever; past
    /// it, rendering fails with an error.
    pub fn with_fuel(mut self, fuel: u64) -> Self {
        self.env.set_fuel(Some(fuel));
        self
    }

    /// The chat template of `tokenizer` (from its model directory), with its special tokens;
    /// `Ok(None)` when it has no template. Compile errors name the template's file.
    pub fn from_tokenizer(tokenizer: &Tokenizer) -> Result<Option<Self>> {
        let Some(source) = tokenizer.chat_template() else {
            return Ok(None);
        };
        Self::build(
            source,
            tokenizer.bos_token(),
            tokenizer.eos_token(),
            tokenizer.chat_template_origin(),
        )
        .map(Some)
    }

    fn build(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
        origin: Option<&Path>,
    ) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.set_unknown_method_callback(py_method);
        // HF templates sometimes strip one leading/trailing newline of the file via `{%-`; the
        // source itself is taken verbatim.
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| {
                let msg = format!("invalid chat template: {}", describe(&e));
                match origin {
                    Some(p) => DetspecError::file(p, msg),
                    None => DetspecError::Tokenizer(msg),
                }
            })?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.map(str::to_string),
            eos_token: eos_token.map(str::to_string),
            origin: origin.map(Path::to_path_buf),
        })
    }

    /// Renders the conversation. With `add_generation_prompt` the template appends the header of
    /// an assistant turn. The result normally starts with the BOS token text when the template
    /// emits `{{ bos_token }}`, so encode it with `add_special_tokens = false`.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, &serde_json::Map::new())
    }

    /// Like [`render`](Self::render) for arbitrary JSON-like messages (content parts, tool
    /// calls, ...) and extra template variables (`tools`, `documents`, `enable_thinking`, ...).
    /// `messages`, `add_generation_prompt`, `bos_token` and `eos_token` cannot be overridden by
    /// `extra`.
    pub fn render_with<M: Serialize + ?Sized>(
        &self,
        messages: &M,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let mut ctx: BTreeMap<String, Value> = extra
            .iter()
            .map(|(k, v)| (k.clone(), Value::from_serialize(v)))
            .collect();
        ctx.insert("messages".into(), Value::from_serialize(messages));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        if let Some(t) = &self.bos_token {
            ctx.insert("bos_token".into(), Value::from(t.as_str()));
        }
        if let Some(t) = &self.eos_token {
            ctx.insert("eos_token".into(), Value::from(t.as_str()));
        }
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| self.error(&e))?;
        tmpl.render(ctx).map_err(|e| self.error(&e))
    }

    fn error(&self, e: &Error) -> DetspecError {
        let origin = self
            .origin
            .as_ref()
            .map(|p| format!(" ({})", p.display()))
            .unwrap_or_default();
        DetspecError::Tokenizer(format!("chat template{origin} failed: {}", describe(e)))
    }
}

/// An error with its detail, line and source chain.
fn describe(e: &Error) -> String {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        source = s.source();
    }
    msg
}

/// `raise_exception(message)`: aborts rendering with `message`.
fn raise_exception(message: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the current UTC time, formatted with Python's strftime codes.
fn strftime_now(state: &State, format: &str) -> std::result::Result<Value, Error> {
    strftime(state, minijinja_contrib::globals::now(), format)
}

/// Formats `time` (anything minijinja-contrib's `datetimeformat` takes: a unix timestamp, an
/// ISO 8601 string) with a Python strftime `format`, translated to a `time` format description.
fn strftime(state: &State, time: Value, format: &str) -> std::result::Result<Value, Error> {
    let kwargs = Kwargs::from_iter([("format", Value::from(time_format(format)?))]);
    minijinja_contrib::filters::datetimeformat(state, time, kwargs).map(Value::from)
}

/// Python strftime codes as a `time` format description (version 2): the common codes
/// `%Y %y %m %d %e %H %I %M %S %p %b %B %a %A %j %%`, other text verbatim.
fn time_format(strftime: &str) -> std::result::Result<String, Error> {
    let mut out = String::with_capacity(strftime.len() * 4);
    let mut chars = strftime.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            if matches!(c, '[' | ']' | '\\') {
                out.push('\\');
            }
            out.push(c);
            continue;
        }
        out.push_str(match chars.next() {
            Some('Y') => "[year]",
            Some('y') => "[year repr:last_two]",
            Some('m') => "[month]",
            Some('d') => "[day]",
            Some('e') => "[day padding:space]",
            Some('H') => "[hour]",
            Some('I') => "[hour repr:12]",
            Some('M') => "[minute]",
            Some('S') => "[second]",
            Some('p') => "[period]",
            Some('b') => "[month repr:short]",
            Some('B') => "[month repr:long]",
            Some('a') => "[weekday repr:short]",
            Some('A') => "[weekday repr:long]",
            Some('j') => "[ordinal]",
            Some('%') => "%",
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported format code %{}",
                        other.map(String::from).unwrap_or_default()
                    ),
                ))
            }
        });
    }
    Ok(out)
}

/// `tojson` as HF defines it: `json.dumps(value, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)` — Python's `", "` / `": "` separators, non-ASCII
/// kept, no HTML escaping.
fn tojson(
    value: &Value,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> std::result::Result<Value, Error> {
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => Some(" ".repeat(usize::try_from(v)?)),
        },
    };
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let _: Option<bool> = kwargs.get("sort_keys")?; // keys are always sorted here
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match separators.as_deref() {
        Some([a, b]) => (a.clone(), b.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            ))
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let mut out = Vec::new();
    let formatter = PyJsonFormatter {
        indent,
        item_sep,
        key_sep,
        level: 0,
        has_value: false,
    };
    let mut ser = serde_json::Serializer::with_formatter(&mut out, formatter);
    value.serialize(&mut ser).map_err(|e| {
        Error::new(ErrorKind::InvalidOperation, "cannot serialize to JSON").with_source(e)
    })?;
    let s = String::from_utf8(out)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, "JSON is not UTF-8").with_source(e))?;
    Ok(Value::from_safe_string(s))
}

/// A serde_json formatter producing Python `json.dumps` layout.
struct PyJsonFormatter {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    level: usize,
    has_value: bool,
}

impl PyJsonFormatter {
    fn newline<W: ?Sized + std::io::Write>(&self, w: &mut W) -> std::io::Result<()> {
        if let Some(ind) = &self.indent {
            w.write_all(b"\n")?;
            for _ in 0..self.level {
                w.write_all(ind.as_bytes())?;
            }
        }
        Ok(())
    }

    fn begin_item<W: ?Sized + std::io::Write>(
        &self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if !first {
            w.write_all(self.item_sep.as_bytes())?;
        }
        self.newline(w)
    }

    fn end_container<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        close: &[u8],
    ) -> std::io::Result<()> {
        self.level -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        self.has_value = true;
        w.write_all(close)
    }
}

impl serde_json::ser::Formatter for PyJsonFormatter {
    fn begin_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(b"[")
    }

    fn end_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.end_container(w, b"]")
    }

    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.begin_item(w, first)
    }

    fn end_array_value<W: ?Sized + std::io::Write>(&mut self, _w: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }

    fn begin_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(b"{")
    }

    fn end_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.end_container(w, b"}")
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.begin_item(w, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(self.key_sep.as_bytes())
    }

    fn end_object_value<W: ?Sized + std::io::Write>(&mut self, _w: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }
}

/// Python methods on template values: minijinja-contrib's `pycompat`, after keyword arguments
/// are bound to positions (pycompat takes positional ones only) and with the string methods it
/// lacks or answers differently from Python.
fn py_method(
    state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> std::result::Result<Value, Error> {
    let args = positional(method, args)?;
    if let Some(s) = value.as_str() {
        if let Some(v) = string_method(s, method, &args)? {
            return Ok(v);
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, &args)
}

/// Python's parameter names of the methods that take arguments.
fn parameter_names(method: &str) -> &'static [&'static str] {
    match method {
        "strip" | "lstrip" | "rstrip" => &["chars"],
        "split" | "rsplit" => &["sep", "maxsplit"],
        "splitlines" => &["keepends"],
        "replace" => &["old", "new", "count"],
        "startswith" => &["prefix"],
        "endswith" => &["suffix"],
        "get" => &["key", "default"],
        _ => &[],
    }
}

/// `args` with trailing keyword arguments moved to their positions (`none` fills a skipped one).
fn positional(method: &str, args: &[Value]) -> std::result::Result<Vec<Value>, Error> {
    let Some((last, rest)) = args.split_last().filter(|(last, _)| last.is_kwargs()) else {
        return Ok(args.to_vec());
    };
    let kwargs = Kwargs::try_from(last.clone())?;
    let mut out = rest.to_vec();
    for (i, name) in parameter_names(method).iter().enumerate() {
        let Some(v) = kwargs.get::<Option<Value>>(name)? else {
            continue;
        };
        if i < rest.len() {
            return Err(Error::new(
                ErrorKind::TooManyArguments,
                format!("{method}() got multiple values for argument '{name}'"),
            ));
        }
        out.resize(i, Value::from(()));
        out.push(v);
    }
    kwargs.assert_all_used()?;
    Ok(out)
}

fn str_arg<'a>(method: &str, v: Option<&'a Value>) -> std::result::Result<&'a str, Error> {
    v.and_then(Value::as_str).ok_or_else(|| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("{method}() expects a string argument"),
        )
    })
}

fn no_args(method: &str, args: &[Value]) -> std::result::Result<(), Error> {
    if args.is_empty() {
        Ok(())
    } else {
        Err(Error::new(
            ErrorKind::TooManyArguments,
            format!("{method}() takes no arguments"),
        ))
    }
}

/// The string methods pycompat does not have (`rsplit`, `removeprefix`, `removesuffix`, `index`,
/// `rindex`, `isdecimal`, `swapcase`), `count('')` (endless there), or answers differently from
/// Python: `find` / `rfind`
/// return byte offsets there (Python counts characters), and the `is*` predicates are true for
/// the empty string and `islower` / `isupper` false for `"a b"` (Python: false / true).
/// `Ok(None)` leaves the method to pycompat.
fn string_method(
    s: &str,
    method: &str,
    args: &[Value],
) -> std::result::Result<Option<Value>, Error> {
    let m = method;
    Ok(Some(match method {
        "rsplit" => {
            let sep = args.first().filter(|v| !v.is_none() && !v.is_undefined());
            let sep = sep.map(|v| str_arg(m, Some(v))).transpose()?;
            let limit = match args.get(1) {
                Some(v) if !v.is_none() && !v.is_undefined() => usize::try_from(v.clone()).ok(),
                _ => None,
            };
            if args.len() > 2 {
                return Err(Error::new(
                    ErrorKind::TooManyArguments,
                    "rsplit() takes at most 2 arguments",
                ));
            }
            let parts: Vec<String> = match (sep, limit) {
                (Some(""), _) => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "rsplit(): empty separator",
                    ))
                }
                (Some(sep), None) => s.split(sep).map(str::to_string).collect(),
                (Some(sep), Some(n)) => {
                    let mut parts: Vec<String> =
                        s.rsplitn(n + 1, sep).map(str::to_string).collect();
                    parts.reverse();
                    parts
                }
                (None, limit) => rsplit_whitespace(s, limit),
            };
            Value::from(parts)
        }
        "removeprefix" | "removesuffix" => {
            if args.len() != 1 {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("{m}() takes exactly one argument"),
                ));
            }
            let affix = str_arg(m, args.first())?;
            let out = if method == "removeprefix" {
                s.strip_prefix(affix)
            } else {
                s.strip_suffix(affix)
            };
            Value::from(out.unwrap_or(s))
        }
        // pycompat's `count('')` never returns (it searches for "" at the same place forever).
        "count" if args.len() == 1 && args[0].as_str() == Some("") => {
            Value::from(s.chars().count() + 1)
        }
        "find" | "rfind" | "index" | "rindex" => {
            if args.len() != 1 {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("{m}() takes exactly one argument"),
                ));
            }
            let sub = str_arg(m, args.first())?;
            let found = if method.starts_with('r') {
                s.rfind(sub)
            } else {
                s.find(sub)
            };
            match found {
                // Python indexes by character, not byte.
                Some(byte) => Value::from(s[..byte].chars().count()),
                None if method.ends_with("find") => Value::from(-1),
                None => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        format!("{m}(): substring not found"),
                    ))
                }
            }
        }
        "isdigit" | "isnumeric" | "isdecimal" | "isalpha" | "isalnum" | "isspace" | "isupper"
        | "islower" => {
            no_args(m, args)?;
            let non_empty = !s.is_empty();
            let all = |f: fn(char) -> bool| non_empty && s.chars().all(f);
            Value::from(match method {
                "isdigit" | "isnumeric" | "isdecimal" => all(char::is_numeric),
                "isalpha" => all(char::is_alphabetic),
                "isalnum" => all(char::is_alphanumeric),
                "isspace" => all(char::is_whitespace),
                "isupper" => {
                    s.chars().any(char::is_uppercase) && !s.chars().any(char::is_lowercase)
                }
                _ => s.chars().any(char::is_lowercase) && !s.chars().any(char::is_uppercase),
            })
        }
        "swapcase" => {
            no_args(m, args)?;
            let swapped: String = s
                .chars()
                .flat_map(|c| -> Vec<char> {
                    if c.is_uppercase() {
                        c.to_lowercase().collect()
                    } else {
                        c.to_uppercase().collect()
                    }
                })
                .collect();
            Value::from(swapped)
        }
        _ => return Ok(None),
    }))
}

/// Python's `str.rsplit()` without a separator: runs of whitespace separate, at most `limit`
/// splits from the right.
fn rsplit_whitespace(s: &str, limit: Option<usize>) -> Vec<String> {
    let mut parts: Vec<String> = Vec::new();
    let mut rest = s.trim_end();
    while !rest.is_empty() {
        if limit.is_some_and(|n| parts.len() == n) {
            parts.push(rest.to_string());
            break;
        }
        match rest.rfind(char::is_whitespace) {
            Some(i) => {
                let ws_len = rest[i..].chars().next().map_or(1, char::len_utf8);
                parts.push(rest[i + ws_len..].to_string());
                rest = rest[..i].trim_end();
            }
            None => {
                parts.push(rest.to_string());
                break;
            }
        }
    }
    parts.reverse();
    parts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::test_util::{model_dir, write};

    /// Llama-3-Instruct's template (abridged: no tools), with `.strip()` calls.
    const LLAMA3: &str = r#"{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- if system_message %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" + system_message + "<|eot_id|>" }}
{%- endif %}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'].strip() + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"#;

    /// Qwen-style ChatML, using Python string methods and no whitespace control on most tags
    /// (relies on trim_blocks / lstrip_blocks).
    const CHATML: &str = r#"{% for message in messages %}
    {% if loop.first and message.role != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
    {% endif %}
    {% set content = message.content %}
    {% if message.role == 'assistant' and '</think>' in content %}
        {% set content = content.split('</think>')[-1].lstrip('\n') %}
    {% endif %}
<|im_start|>{{ message.role }}
{{ content.strip() }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"#;

    fn msgs(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
        pairs
            .iter()
            .map(|(r, c)| ChatMessage::new(*r, *c))
            .collect()
    }

    #[test]
    fn llama3_template() {
        let t = ChatTemplate::new(LLAMA3, Some("<|begin_of_text|>"), Some("<|eot_id|>")).unwrap();
        let m = msgs(&[
            ("system", "  Be brief.  "),
            ("user", " Hi there!\n"),
            ("assistant", "Hello."),
            ("user", "What is 2+2?"),
        ]);
        let out = t.render(&m, true).unwrap();
        let expected =
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
<|start_header_id|>user<|end_header_id|>\n\nHi there!<|eot_id|>\
<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>\
<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>\
<|start_header_id|>assistant<|end_header_id|>\n\n";
        assert_eq!(out, expected);
        let no_gen = t.render(&m, false).unwrap();
        assert_eq!(
            no_gen,
            expected
                .strip_suffix("<|start_header_id|>assistant<|end_header_id|>\n\n")
                .unwrap()
        );

        // raise_exception surfaces the template's message.
        let bad = msgs(&[("user", "a"), ("user", "b")]);
        let err = t.render(&bad, true).unwrap_err();
        assert!(matches!(err, DetspecError::Tokenizer(_)));
        assert!(
            err.to_string()
                .contains("Conversation roles must alternate"),
            "{err}"
        );
    }

    #[test]
    fn chatml_template() {
        let t = ChatTemplate::new(CHATML, None, Some("<|im_end|>")).unwrap();
        let m = msgs(&[
            ("user", "  Hello?  "),
            ("assistant", "<think>hmm</think>\n\nHi! "),
            ("user", "Bye"),
        ]);
        let out = t.render(&m, true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
<|im_start|>user\nHello?<|im_end|>\n\
<|im_start|>assistant\nHi!<|im_end|>\n\
<|im_start|>user\nBye<|im_end|>\n\
<|im_start|>assistant\n"
        );
        let sys = msgs(&[("system", "S"), ("user", "U")]);
        assert_eq!(
            t.render(&sys, false).unwrap(),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
        );
    }

    #[test]
    fn trim_and_lstrip_blocks() {
        let t =
            ChatTemplate::new("A\n    {% if true %}\nB\n    {% endif %}\nC\n", None, None).unwrap();
        // lstrip_blocks removes the indentation before a tag, trim_blocks the newline after it;
        // the single trailing newline of the template is dropped as in Jinja2.
        assert_eq!(t.render(&[], false).unwrap(), "A\nB\nC");
    }

    #[test]
    fn python_string_methods() {
        let cases = [
            ("{{ '  a b  '.strip() }}", "a b"),
            (
                "{{ 'xxaxx'.strip('x') }}|{{ 'xxa'.lstrip('x') }}|{{ 'axx'.rstrip('x') }}",
                "a|a|a",
            ),
            ("{{ '\n\nhi'.lstrip('\n') }}", "hi"),
            (
                "{{ 'hello'.startswith('he') }} {{ 'hello'.endswith(('x', 'lo')) }}",
                "True True",
            ),
            ("{{ 'a,b,,c'.split(',') }}", r#"["a", "b", "", "c"]"#),
            ("{{ '  a  b c '.split() }}", r#"["a", "b", "c"]"#),
            ("{{ 'a b c'.split(maxsplit=1) }}", r#"["a", "b c"]"#),
            ("{{ 'a b c'.rsplit(' ', 1) }}", r#"["a b", "c"]"#),
            ("{{ ' a b c '.rsplit(None, 1) }}", r#"[" a b", "c"]"#),
            ("{{ 'x</think>y'.split('</think>')[-1] }}", "y"),
            ("{{ 'Ab'.upper() }}{{ 'Ab'.lower() }}", "ABab"),
            (
                "{{ 'hello world'.title() }} {{ 'hELLO'.capitalize() }}",
                "Hello World Hello",
            ),
            (
                "{{ 'aaa'.replace('a', 'b') }} {{ 'aaa'.replace('a', 'b', 2) }}",
                "bbb bba",
            ),
            (
                "{{ 'éab'.find('b') }} {{ 'ab'.find('z') }} {{ 'abab'.count('ab') }}",
                "2 -1 2",
            ),
            ("{{ ', '.join(['a', 'b']) }}", "a, b"),
            ("{{ '123'.isdigit() }} {{ ''.isdigit() }}", "True False"),
            ("{{ 'pre_x'.removeprefix('pre_') }}", "x"),
            ("{{ 'x_suf'.removesuffix('_suf') }}", "x"),
            ("{{ 'aXb'.swapcase() }}", "AxB"),
            // Keyword arguments, as Python allows them.
            ("{{ 'xax'.strip(chars='x') }}", "a"),
            ("{{ 'a-b-c'.rsplit(sep='-', maxsplit=1) }}", r#"["a-b", "c"]"#),
            ("{{ 'aaa'.replace('a', 'b', count=1) }}", "baa"),
            // Python's answers where pycompat's differ.
            ("{{ 'éab'.rfind('b') }} {{ 'éab'.index('a') }}", "2 1"),
            (
                "{{ 'a b'.islower() }} {{ 'A B'.isupper() }} {{ ''.isspace() }} {{ 'ab'.isupper() }}",
                "True True False False",
            ),
            // What only pycompat has.
            ("{{ '{} and {}'.format('x', 'y') }}", "x and y"),
            ("{{ 'ab'.isascii() }} {{ [1, 2, 1].count(1) }}", "True 2"),
            ("{{ 'abc'.count('') }} {{ 'é'.count('') }} {{ 'aaaa'.count('aa') }}", "4 2 2"),
            ("{{ 'a\\nb'.splitlines() }}", r#"["a", "b"]"#),
        ];
        for (src, expected) in cases {
            let t = ChatTemplate::new(src, None, None).unwrap();
            assert_eq!(t.render(&[], false).unwrap(), expected, "{src}");
        }
    }

    #[test]
    fn dict_methods_and_tojson() {
        let src = "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}\
|{{ d.keys() }}|{{ d.values() }}|{{ d.get('a') }}|{{ d.get('z', 'dflt') }}|{{ d.get('z') is none }}\
|{{ d | tojson }}|{{ tools | tojson(indent=2) }}";
        let t = ChatTemplate::new(src, None, None).unwrap();
        let extra = serde_json::json!({
            "d": {"a": 1, "b": "é<x>"},
            "tools": [{"name": "f", "args": []}],
        });
        let extra = extra.as_object().unwrap();
        let out = t.render_with(&[] as &[ChatMessage], false, extra).unwrap();
        assert_eq!(
            out,
            "a=1;b=é<x>;|[\"a\", \"b\"]|[1, \"é<x>\"]|1|dflt|True\
|{\"a\": 1, \"b\": \"é<x>\"}|[\n  {\n    \"name\": \"f\",\n    \"args\": []\n  }\n]"
        );
        // Keys keep the caller's order, as transformers' `tojson` (no `sort_keys`) writes them:
        // a tool's JSON in the prompt reads as the client sent it.
    }

    #[test]
    fn unknown_method_is_an_error() {
        let t = ChatTemplate::new("{{ 'a'.frobnicate() }}", None, None).unwrap();
        let err = t.render(&[], false).unwrap_err();
        assert!(err.to_string().contains("frobnicate"), "{err}");
    }

    #[test]
    fn bad_method_arguments_are_errors() {
        for src in [
            "{{ 'a'.strip(chars='x', width=2) }}",
            "{{ 'a'.strip('x', chars='y') }}",
            "{{ 'a'.find() }}",
            "{{ 'a'.index('z') }}",
            "{{ 'a'.rsplit('') }}",
            "{{ 'a'.isdigit(1) }}",
            "{{ 'a'.removeprefix(1) }}",
        ] {
            let t = ChatTemplate::new(src, None, None).unwrap();
            let err = t.render(&[], false).unwrap_err();
            assert!(matches!(err, DetspecError::Tokenizer(_)), "{src}: {err:?}");
        }
    }

    #[test]
    fn undefined_special_tokens_render_empty() {
        let t = ChatTemplate::new("[{{ bos_token }}]{{ messages | length }}", None, None).unwrap();
        assert_eq!(t.render(&msgs(&[("user", "x")]), false).unwrap(), "[]1");
    }

    #[test]
    fn strftime_formats() {
        let mut env = Environment::new();
        env.add_function("strftime_at", |state: &State, ts: i64, fmt: &str| {
            strftime(state, Value::from(ts), fmt)
        });
        let at = |ts: i64, fmt: &str| -> std::result::Result<String, Error> {
            let ctx = minijinja::context! { ts, fmt };
            env.render_str("{{ strftime_at(ts, fmt) }}", ctx)
        };
        // 2024-07-23 14:05:09 UTC, a Tuesday, day 205 of a leap year.
        let secs = 1_721_743_509;
        assert_eq!(at(secs, "%d %b %Y").unwrap(), "23 Jul 2024");
        assert_eq!(
            at(secs, "%A %B %e %y %H:%M:%S %I%p %j %%").unwrap(),
            "Tuesday July 23 24 14:05:09 02PM 205 %"
        );
        assert_eq!(at(0, "%Y-%m-%d %a").unwrap(), "1970-01-01 Thu");
        // Text that a `time` format description would read as syntax stays verbatim.
        assert_eq!(at(0, r"[%e] \ %I%p").unwrap(), r"[ 1] \ 12AM");
        let err = at(0, "%Q").unwrap_err();
        assert!(describe(&err).contains("%Q"), "{err}");
        let t = ChatTemplate::new("{{ strftime_now('%Y') | length }}", None, None).unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "4");
    }

    #[test]
    fn from_tokenizer_dir() {
        let dir = model_dir();
        let tok = Tokenizer::from_model_dir(dir.path()).unwrap();
        assert!(ChatTemplate::from_tokenizer(&tok).unwrap().is_none());

        write(dir.path(), "chat_template.jinja", CHATML);
        let tok = Tokenizer::from_model_dir(dir.path()).unwrap();
        let t = ChatTemplate::from_tokenizer(&tok).unwrap().unwrap();
        let prompt = t.render(&msgs(&[("user", "hi")]), true).unwrap();
        let ids = tok.encode(&prompt, false).unwrap();
        let im_start = tok.token_to_id("<|im_start|>").unwrap();
        assert_eq!(ids.iter().filter(|&&i| i == im_start).count(), 3);
        assert_eq!(tok.decode(&ids, false).unwrap(), prompt);

        // A compile error names the template file.
        write(dir.path(), "chat_template.jinja", "{% for m in messages %}");
        let tok = Tokenizer::from_model_dir(dir.path()).unwrap();
        let err = ChatTemplate::from_tokenizer(&tok).unwrap_err();
        assert!(matches!(err, DetspecError::InvalidFile { .. }), "{err:?}");
        assert!(err.to_string().contains("chat_template.jinja"), "{err}");
    }

    #[test]
    fn loop_controls_fail_cleanly_or_work() {
        // minijinja's `loop_controls` feature is not enabled in Cargo.toml: such templates must
        // fail with a tokenizer error rather than panic (and work once the feature is on).
        match ChatTemplate::new(
            "{% for x in [1,2] %}{{ x }}{% break %}{% endfor %}",
            None,
            None,
        ) {
            Ok(t) => assert_eq!(t.render(&[], false).unwrap(), "1"),
            Err(e) => {
                assert!(matches!(e, DetspecError::Tokenizer(_)), "{e:?}");
                assert!(e.to_string().contains("invalid chat template"), "{e}");
            }
        }
    }

    #[test]
    fn fuel_stops_a_runaway_template_and_not_a_real_one() {
        let runaway =
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}";
        let t = ChatTemplate::new(runaway, None, None)
            .unwrap()
            .with_fuel(1_000_000);
        let err = t.render(&[], false).unwrap_err().to_string();
        assert!(err.contains("fuel"), "{err}");
        let t = ChatTemplate::new(CHATML, None, Some("<|im_end|>"))
            .unwrap()
            .with_fuel(1_000_000);
        let long: Vec<ChatMessage> = (0..500)
            .map(|i| ChatMessage::new(if i % 2 == 0 { "user" } else { "assistant" }, "hello"))
            .collect();
        t.render(&long, true).unwrap();
    }
}
