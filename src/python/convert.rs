//! Conversions between Python objects and detspec types, and errors to exceptions.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyType};

use crate::error::DetspecError;
use crate::output::{RequestOutput, TokenLogprobs};
use crate::request::Prompt;
use crate::sampling::{SamplingParams, StructuredOutputs};

/// The Python exception class for an error: load problems, bad requests, or engine failures.
fn class_name(e: &DetspecError) -> &'static str {
    use DetspecError::*;
    match e {
        Io { .. }
        | InvalidFile { .. }
        | InvalidConfig { .. }
        | UnsupportedArchitecture { .. }
        | MissingTensor { .. }
        | BadTensor { .. }
        | OutOfMemory { .. } => "ModelLoadError",
        InvalidParameter { .. } | InvalidRequest { .. } | Tokenizer(_) => "InvalidRequestError",
        EngineStopped => "EngineStoppedError",
        OutOfPages { .. } | Candle(_) => "DetspecError",
    }
}

fn raise(py: Python<'_>, class: &str, msg: String, param: Option<&str>) -> PyErr {
    // The classes live in Python (detspec/errors.py) so they can also subclass ValueError etc.
    let cls = py
        .import("detspec.errors")
        .and_then(|m| m.getattr(class))
        .and_then(|c| c.cast_into::<PyType>().map_err(PyErr::from));
    let Ok(cls) = cls else {
        return PyRuntimeError::new_err(msg);
    };
    // Built eagerly so `param` is a field of the exception, not text to parse back out.
    match cls.call1((msg.clone(), param)) {
        Ok(exc) => PyErr::from_value(exc),
        Err(_) => PyErr::from_type(cls, msg),
    }
}

/// The Python exception for `e`; `InvalidRequestError.param` names the parameter at fault.
pub fn to_pyerr(py: Python<'_>, e: DetspecError) -> PyErr {
    raise(py, class_name(&e), e.to_string(), e.param_name())
}

pub fn internal_error(py: Python<'_>, msg: &str) -> PyErr {
    raise(
        py,
        "DetspecError",
        format!("internal error (please report): {msg}"),
        None,
    )
}

pub fn prompt_from_py(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Prompt> {
    if let Ok(s) = obj.extract::<String>() {
        return Ok(Prompt::Text(s));
    }
    obj.extract::<Vec<i64>>()
        .ok()
        .and_then(|ids| {
            ids.into_iter()
                .map(|t| u32::try_from(t).ok())
                .collect::<Option<Vec<u32>>>()
        })
        .map(Prompt::Tokens)
        .ok_or_else(|| {
            to_pyerr(
                py,
                DetspecError::InvalidRequest {
                    request_id: None,
                    message: "prompt must be a string or a list of non-negative token ids".into(),
                },
            )
        })
}

fn get<'py, T: FromPyObjectOwned<'py>>(
    py: Python<'py>,
    d: &Bound<'py, PyDict>,
    key: &str,
) -> PyResult<Option<T>> {
    match d.get_item(key)? {
        None => Ok(None),
        Some(v) if v.is_none() => Ok(None),
        Some(v) => v.extract::<T>().map(Some).map_err(|_| {
            let ty = v
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default();
            to_pyerr(py, DetspecError::param(key, format!("wrong type `{ty}`")))
        }),
    }
}

/// Builds SamplingParams from a dict with vLLM's field names; unknown keys are an error.
pub fn params_from_dict(py: Python<'_>, d: &Bound<'_, PyDict>) -> PyResult<SamplingParams> {
    const KNOWN: &[&str] = &[
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "max_tokens",
        "min_tokens",
        "stop",
        "include_stop_str_in_output",
        "stop_token_ids",
        "ignore_eos",
        "logprobs",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "deterministic",
        "skip_special_tokens",
        "logit_bias",
        "structured_outputs",
        "allowed_token_ids",
        "bad_words",
    ];
    for k in d.keys() {
        let k: String = k.extract()?;
        if !KNOWN.contains(&k.as_str()) {
            return Err(to_pyerr(
                py,
                DetspecError::param(&k, "unknown sampling parameter"),
            ));
        }
    }
    let mut p = SamplingParams::default();
    macro_rules! field {
        ($name:ident) => {
            if let Some(v) = get(py, d, stringify!($name))? {
                p.$name = v;
            }
        };
    }
    field!(n);
    field!(temperature);
    field!(top_p);
    field!(top_k);
    field!(min_p);
    field!(min_tokens);
    field!(include_stop_str_in_output);
    field!(stop_token_ids);
    field!(ignore_eos);
    field!(presence_penalty);
    field!(frequency_penalty);
    field!(repetition_penalty);
    field!(deterministic);
    field!(skip_special_tokens);
    field!(bad_words);
    if let Some(v) = get::<Vec<u32>>(py, d, "allowed_token_ids")? {
        p.allowed_token_ids = Some(v);
    }
    if let Some(v) = get::<i64>(py, d, "max_tokens")? {
        p.max_tokens = usize::try_from(v).unwrap_or(0);
    }
    if let Some(v) = get::<i64>(py, d, "seed")? {
        // Negative seeds are fine in vLLM; reinterpret their bits.
        p.seed = Some(v as u64);
    }
    if let Some(v) = get::<i64>(py, d, "logprobs")? {
        p.logprobs = Some(usize::try_from(v).map_err(|_| {
            to_pyerr(
                py,
                DetspecError::param("logprobs", format!("must be >= 0, got {v}")),
            )
        })?);
    }
    if let Some(item) = d.get_item("logit_bias")? {
        if !item.is_none() {
            p.logit_bias = item.extract().map_err(|_| {
                to_pyerr(
                    py,
                    DetspecError::param(
                        "logit_bias",
                        "must map token ids (non-negative integers) to numbers",
                    ),
                )
            })?;
        }
    }
    if let Some(item) = d.get_item("structured_outputs")? {
        if !item.is_none() {
            let so = item.cast::<PyDict>().map_err(|_| {
                to_pyerr(
                    py,
                    DetspecError::param("structured_outputs", "must be a dict"),
                )
            })?;
            p.structured_outputs = Some(structured_from_dict(py, so)?);
        }
    }
    if let Some(item) = d.get_item("stop")? {
        if let Ok(s) = item.extract::<String>() {
            p.stop = vec![s];
        } else if !item.is_none() {
            p.stop = item.extract().map_err(|_| {
                to_pyerr(
                    py,
                    DetspecError::param("stop", "must be a string or a list of strings"),
                )
            })?;
        }
    }
    Ok(p)
}

/// A structured-output constraint from vLLM's `StructuredOutputsParams` fields (`json` as
/// JSON text: the Python side serialises a schema dict).
fn structured_from_dict(py: Python<'_>, d: &Bound<'_, PyDict>) -> PyResult<StructuredOutputs> {
    let mut so = StructuredOutputs::default();
    for (k, v) in d.iter() {
        let k: String = k.extract()?;
        if v.is_none() {
            continue;
        }
        let name = format!("structured_outputs.{k}");
        let wrong =
            |what: &str| to_pyerr(py, DetspecError::param(&name, format!("must be {what}")));
        match k.as_str() {
            "json" => so.json = Some(v.extract().map_err(|_| wrong("a JSON schema"))?),
            "regex" => so.regex = Some(v.extract().map_err(|_| wrong("a string"))?),
            "grammar" => so.grammar = Some(v.extract().map_err(|_| wrong("a string"))?),
            "choice" => so.choice = Some(v.extract().map_err(|_| wrong("a list of strings"))?),
            "json_object" => so.json_object = v.extract().map_err(|_| wrong("a bool"))?,
            "starts_after" => {
                let gate = match v.extract::<u32>() {
                    Ok(t) => vec![t],
                    Err(_) => v
                        .extract()
                        .map_err(|_| wrong("a token id or a list of token ids"))?,
                };
                so.starts_after = Some(gate);
            }
            _ => {
                return Err(to_pyerr(
                    py,
                    DetspecError::param(&name, "unknown structured-output field"),
                ))
            }
        }
    }
    Ok(so)
}

/// `(token, logprob, rank, top)` as Python receives it.
pub type LogprobTuple = (u32, f32, u32, Vec<(u32, f32)>);

pub fn logprob_tuples(lps: &[TokenLogprobs]) -> Vec<LogprobTuple> {
    lps.iter()
        .map(|l| (l.token, l.logprob, l.rank, l.top.clone()))
        .collect()
}

/// A request output as the dict Python's `request_output_from_dict` reads (the serde form of
/// [`RequestOutput`]: finish reasons as strings, logprobs as `(token, logprob, rank, top)`).
pub fn output_to_py<'py>(py: Python<'py>, o: &RequestOutput) -> PyResult<Bound<'py, PyAny>> {
    pythonize::pythonize(py, o).map_err(|e| internal_error(py, &e.to_string()))
}
