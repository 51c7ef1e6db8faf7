//! HuggingFace chat templates rendered with minijinja.
//!
//! HF renders templates with Jinja2 using `trim_blocks=True, lstrip_blocks=True`, a
//! `raise_exception(msg)` global, a `strftime_now(fmt)` global, a `tojson` filter that behaves
//! like Python's `json.dumps(..., ensure_ascii=False)`, and templates freely call Python methods
//! on strings and dicts (`.strip()`, `.startswith()`, `.items()`, ...). minijinja does not have
//! those methods without `minijinja-contrib`, so an unknown-method callback implements the common
//! ones here.
//!
//! Known gaps: `{% break %}` / `{% continue %}` need minijinja's `loop_controls` feature, which
//! this crate does not enable; templates using them fail to compile with a clear error. Map keys
//! are iterated in sorted order (minijinja without `preserve_order`), so `tojson` of a dict lists
//! keys sorted rather than in insertion order.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, Value, ValueKind};
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
        env.set_unknown_method_callback(pycompat_method);
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

/// `strftime_now(format)`: the current UTC time formatted with the common strftime codes
/// (`%Y %y %m %d %e %H %I %M %S %p %b %B %a %A %j %%`).
fn strftime_now(format: String) -> std::result::Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    strftime(&format, secs).map(Value::from)
}

fn strftime(format: &str, unix_secs: u64) -> std::result::Result<String, Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = (unix_secs / 86_400) as i64;
    let secs_of_day = unix_secs % 86_400;
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let day = doy_mar - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    const CUMULATIVE: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let month_idx = (month - 1) as usize;
    let yday = CUMULATIVE[month_idx] + day + i64::from(leap && month > 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('b') => out.push_str(&MONTHS[month_idx][..3]),
            Some('B') => out.push_str(MONTHS[month_idx]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported format code %{}",
                        other.map(String::from).unwrap_or_default()
                    ),
                ))
            }
        }
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

/// Python method emulation for values minijinja has no such method for.
fn pycompat_method(
    state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> std::result::Result<Value, Error> {
    match value.kind() {
        ValueKind::String => string_method(value.as_str().unwrap_or_default(), method, args),
        ValueKind::Map => map_method(state, value, method, args),
        _ => Err(Error::from(ErrorKind::UnknownMethod)),
    }
}

/// Binds `args` (positional, then keyword) to `names`; missing ones are `None`.
fn bind_args(
    method: &str,
    args: &[Value],
    names: &[&str],
) -> std::result::Result<Vec<Option<Value>>, Error> {
    let (positional, kwargs) = match args.split_last() {
        Some((last, rest)) if last.is_kwargs() => (rest, Some(Kwargs::try_from(last.clone())?)),
        _ => (args, None),
    };
    if positional.len() > names.len() {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            format!("{method}() takes at most {} arguments", names.len()),
        ));
    }
    let mut out: Vec<Option<Value>> = vec![None; names.len()];
    for (slot, v) in out.iter_mut().zip(positional) {
        *slot = Some(v.clone());
    }
    if let Some(kwargs) = kwargs {
        for (i, name) in names.iter().enumerate() {
            if let Some(v) = kwargs.get::<Option<Value>>(name)? {
                if out[i].is_some() {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        format!("{method}() got multiple values for argument {name}"),
                    ));
                }
                out[i] = Some(v);
            }
        }
        kwargs.assert_all_used()?;
    }
    // Python's None means "not given" for all the optional arguments emulated here.
    Ok(out
        .into_iter()
        .map(|v| v.filter(|v| !v.is_none() && !v.is_undefined()))
        .collect())
}

fn str_arg(method: &str, v: &Value) -> std::result::Result<String, Error> {
    v.as_str().map(str::to_string).ok_or_else(|| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("{method}() expects a string argument, got {}", v.kind()),
        )
    })
}

fn int_arg(method: &str, v: &Value) -> std::result::Result<i64, Error> {
    v.as_i64().ok_or_else(|| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("{method}() expects an integer argument, got {}", v.kind()),
        )
    })
}

fn required(method: &str, v: Option<Value>) -> std::result::Result<Value, Error> {
    v.ok_or_else(|| {
        Error::new(
            ErrorKind::MissingArgument,
            format!("{method}() is missing an argument"),
        )
    })
}

/// Prefixes for `startswith` / `endswith`: a string or a sequence of strings.
fn affixes(method: &str, v: &Value) -> std::result::Result<Vec<String>, Error> {
    if let Some(s) = v.as_str() {
        return Ok(vec![s.to_string()]);
    }
    if matches!(v.kind(), ValueKind::Seq) {
        return v.try_iter()?.map(|x| str_arg(method, &x)).collect();
    }
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("{method}() expects a string or a tuple of strings"),
    ))
}

fn strings(parts: impl IntoIterator<Item = impl Into<String>>) -> Value {
    Value::from(parts.into_iter().map(Into::into).collect::<Vec<String>>())
}

fn string_method(s: &str, method: &str, args: &[Value]) -> std::result::Result<Value, Error> {
    let m = method;
    match method {
        "strip" | "lstrip" | "rstrip" => {
            let chars = bind_args(m, args, &["chars"])?.into_iter().next().flatten();
            let chars = chars.map(|c| str_arg(m, &c)).transpose()?;
            let pred = |c: char| match &chars {
                Some(set) => set.contains(c),
                None => c.is_whitespace(),
            };
            Ok(Value::from(match method {
                "strip" => s.trim_matches(pred),
                "lstrip" => s.trim_start_matches(pred),
                _ => s.trim_end_matches(pred),
            }))
        }
        "startswith" | "endswith" => {
            let a = bind_args(m, args, &["prefix"])?;
            let list = affixes(m, &required(m, a.into_iter().next().flatten())?)?;
            let hit = list.iter().any(|p| {
                if method == "startswith" {
                    s.starts_with(p.as_str())
                } else {
                    s.ends_with(p.as_str())
                }
            });
            Ok(Value::from(hit))
        }
        "split" | "rsplit" => {
            let mut a = bind_args(m, args, &["sep", "maxsplit"])?.into_iter();
            let sep = a.next().flatten().map(|v| str_arg(m, &v)).transpose()?;
            let maxsplit = a.next().flatten().map(|v| int_arg(m, &v)).transpose()?;
            let limit = maxsplit.and_then(|n| usize::try_from(n).ok());
            let rev = method == "rsplit";
            match sep {
                Some(sep) if sep.is_empty() => Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("{m}(): empty separator"),
                )),
                Some(sep) => Ok(match (limit, rev) {
                    (None, _) => strings(s.split(sep.as_str())),
                    (Some(n), false) => strings(s.splitn(n + 1, sep.as_str())),
                    (Some(n), true) => {
                        let mut parts: Vec<&str> = s.rsplitn(n + 1, sep.as_str()).collect();
                        parts.reverse();
                        strings(parts)
                    }
                }),
                None => Ok(strings(split_whitespace(s, limit, rev))),
            }
        }
        "splitlines" => {
            let _ = bind_args(m, args, &["keepends"])?;
            Ok(strings(s.lines()))
        }
        "upper" | "lower" | "title" | "capitalize" | "swapcase" => {
            bind_args(m, args, &[])?;
            Ok(Value::from(match method {
                "upper" => s.to_uppercase(),
                "lower" => s.to_lowercase(),
                "title" => title_case(s),
                "capitalize" => {
                    let mut chars = s.chars();
                    match chars.next() {
                        Some(first) => first
                            .to_uppercase()
                            .chain(chars.flat_map(char::to_lowercase))
                            .collect(),
                        None => String::new(),
                    }
                }
                _ => s
                    .chars()
                    .flat_map(|c| -> Vec<char> {
                        if c.is_uppercase() {
                            c.to_lowercase().collect()
                        } else {
                            c.to_uppercase().collect()
                        }
                    })
                    .collect(),
            }))
        }
        "replace" => {
            let mut a = bind_args(m, args, &["old", "new", "count"])?.into_iter();
            let old = str_arg(m, &required(m, a.next().flatten())?)?;
            let new = str_arg(m, &required(m, a.next().flatten())?)?;
            let count = a.next().flatten().map(|v| int_arg(m, &v)).transpose()?;
            Ok(Value::from(
                match count.and_then(|n| usize::try_from(n).ok()) {
                    Some(n) => s.replacen(old.as_str(), &new, n),
                    None => s.replace(old.as_str(), &new),
                },
            ))
        }
        "removeprefix" | "removesuffix" => {
            let a = bind_args(m, args, &["affix"])?;
            let affix = str_arg(m, &required(m, a.into_iter().next().flatten())?)?;
            let out = if method == "removeprefix" {
                s.strip_prefix(affix.as_str())
            } else {
                s.strip_suffix(affix.as_str())
            };
            Ok(Value::from(out.unwrap_or(s)))
        }
        "find" | "rfind" | "index" | "rindex" | "count" => {
            let a = bind_args(m, args, &["sub"])?;
            let sub = str_arg(m, &required(m, a.into_iter().next().flatten())?)?;
            if method == "count" {
                return Ok(Value::from(s.matches(sub.as_str()).count()));
            }
            let found = if method.starts_with('r') {
                s.rfind(sub.as_str())
            } else {
                s.find(sub.as_str())
            };
            match found {
                // Python indexes by character, not byte.
                Some(byte) => Ok(Value::from(s[..byte].chars().count())),
                None if method.ends_with("find") => Ok(Value::from(-1)),
                None => Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("{m}(): substring not found"),
                )),
            }
        }
        "join" => {
            let a = bind_args(m, args, &["iterable"])?;
            let items = required(m, a.into_iter().next().flatten())?;
            let parts = items
                .try_iter()?
                .map(|v| str_arg(m, &v))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            Ok(Value::from(parts.join(s)))
        }
        "isdigit" | "isnumeric" | "isdecimal" | "isalpha" | "isalnum" | "isspace" | "isupper"
        | "islower" => {
            bind_args(m, args, &[])?;
            let non_empty = !s.is_empty();
            let all = |f: fn(char) -> bool| non_empty && s.chars().all(f);
            Ok(Value::from(match method {
                "isdigit" | "isnumeric" | "isdecimal" => all(|c| c.is_numeric()),
                "isalpha" => all(char::is_alphabetic),
                "isalnum" => all(char::is_alphanumeric),
                "isspace" => all(char::is_whitespace),
                "isupper" => {
                    s.chars().any(char::is_uppercase) && !s.chars().any(char::is_lowercase)
                }
                _ => s.chars().any(char::is_lowercase) && !s.chars().any(char::is_uppercase),
            }))
        }
        _ => Err(Error::from(ErrorKind::UnknownMethod)),
    }
}

/// Python's `str.split()` / `str.rsplit()` without a separator.
fn split_whitespace(s: &str, limit: Option<usize>, rev: bool) -> Vec<String> {
    let mut parts: Vec<String> = Vec::new();
    if rev {
        let mut rest = s.trim_end();
        loop {
            if rest.is_empty() {
                break;
            }
            if limit.is_some_and(|n| parts.len() == n) {
                parts.push(rest.trim_end().to_string());
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
    } else {
        let mut rest = s.trim_start();
        loop {
            if rest.is_empty() {
                break;
            }
            if limit.is_some_and(|n| parts.len() == n) {
                parts.push(rest.to_string());
                break;
            }
            match rest.find(char::is_whitespace) {
                Some(i) => {
                    parts.push(rest[..i].to_string());
                    rest = rest[i..].trim_start();
                }
                None => {
                    parts.push(rest.to_string());
                    break;
                }
            }
        }
    }
    parts
}

fn title_case(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut prev_cased = false;
    for c in s.chars() {
        if prev_cased {
            out.extend(c.to_lowercase());
        } else {
            out.extend(c.to_uppercase());
        }
        prev_cased = c.is_alphabetic();
    }
    out
}

fn map_method(
    state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> std::result::Result<Value, Error> {
    match method {
        "items" => {
            bind_args(method, args, &[])?;
            state.apply_filter("items", std::slice::from_ref(value))
        }
        "keys" => {
            bind_args(method, args, &[])?;
            Ok(Value::from(value.try_iter()?.collect::<Vec<Value>>()))
        }
        "values" => {
            bind_args(method, args, &[])?;
            let vals = value
                .try_iter()?
                .map(|k| value.get_item(&k))
                .collect::<std::result::Result<Vec<Value>, Error>>()?;
            Ok(Value::from(vals))
        }
        "get" => {
            let mut a = bind_args(method, args, &["key", "default"])?.into_iter();
            let key = required(method, a.next().flatten())?;
            let default = a.next().flatten().unwrap_or(Value::from(()));
            let v = value.get_item(&key)?;
            Ok(if v.is_undefined() { default } else { v })
        }
        _ => Err(Error::from(ErrorKind::UnknownMethod)),
    }
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
|{\"a\": 1, \"b\": \"é<x>\"}|[\n  {\n    \"args\": [],\n    \"name\": \"f\"\n  }\n]"
        );
    }

    #[test]
    fn unknown_method_is_an_error() {
        let t = ChatTemplate::new("{{ 'a'.frobnicate() }}", None, None).unwrap();
        let err = t.render(&[], false).unwrap_err();
        assert!(err.to_string().contains("frobnicate"), "{err}");
    }

    #[test]
    fn undefined_special_tokens_render_empty() {
        let t = ChatTemplate::new("[{{ bos_token }}]{{ messages | length }}", None, None).unwrap();
        assert_eq!(t.render(&msgs(&[("user", "x")]), false).unwrap(), "[]1");
    }

    #[test]
    fn strftime_formats() {
        // 2024-07-23 14:05:09 UTC, a Tuesday, day 205 of a leap year.
        let secs = 1_721_743_509;
        assert_eq!(strftime("%d %b %Y", secs).unwrap(), "23 Jul 2024");
        assert_eq!(
            strftime("%A %B %e %y %H:%M:%S %I%p %j %%", secs).unwrap(),
            "Tuesday July 23 24 14:05:09 02PM 205 %"
        );
        assert_eq!(strftime("%Y-%m-%d %a", 0).unwrap(), "1970-01-01 Thu");
        assert!(strftime("%Q", 0).is_err());
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
}
