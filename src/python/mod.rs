//! PyO3 bindings (feature `python`): a thin layer that converts types and errors.
//!
//! No engine logic lives here. Every entry point releases the GIL while Rust works and catches
//! panics, so a bug surfaces as a `detspec.DetspecError` rather than a `PanicException`.

mod convert;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::Mutex;

use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::config::EngineConfig;
use crate::engine::Engine;
use crate::error::DetspecError;
use crate::request::Request;

use convert::{output_to_py, params_from_dict, prompt_from_py, to_pyerr};

/// Runs `f` without the GIL, turning errors and panics into Python exceptions.
fn run_detached<T: Send>(py: Python<'_>, f: impl FnOnce() -> Result<T, DetspecError> + Send) -> PyResult<T> {
    let r = py.detach(|| catch_unwind(AssertUnwindSafe(f)));
    match r {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(to_pyerr(py, e)),
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(convert::internal_error(py, &msg))
        }
    }
}

/// The Rust engine behind `detspec.LLM`.
#[pyclass(name = "Engine", module = "detspec._core")]
struct PyEngine {
    inner: Mutex<Engine>,
}

impl PyEngine {
    fn with<T: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut Engine) -> Result<T, DetspecError> + Send) -> PyResult<T> {
        run_detached(py, || {
            let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            f(&mut g)
        })
    }
}

#[pymethods]
impl PyEngine {
    #[new]
    #[pyo3(signature = (model_dir, *, page_size=16, num_kv_pages=None, kv_cache_bytes=None, max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model_dir: PathBuf,
        page_size: usize,
        num_kv_pages: Option<usize>,
        kv_cache_bytes: Option<usize>,
        max_num_seqs: usize,
        max_num_batched_tokens: usize,
        max_model_len: Option<usize>,
    ) -> PyResult<Self> {
        let mut cfg = EngineConfig {
            page_size,
            num_kv_pages,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            ..Default::default()
        };
        if let Some(b) = kv_cache_bytes {
            cfg.kv_cache_bytes = b;
        }
        let engine = run_detached(py, move || Engine::from_model_dir(&model_dir, cfg))?;
        Ok(Self {
            inner: Mutex::new(engine),
        })
    }

    /// Generates `requests`, a list of `(request_id, prompt, params_dict)`; returns output dicts.
    fn generate<'py>(&self, py: Python<'py>, requests: &Bound<'py, PyList>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let mut reqs = Vec::with_capacity(requests.len());
        for item in requests.iter() {
            let (rid, prompt, params): (String, Bound<'py, PyAny>, Bound<'py, PyDict>) = item.extract()?;
            reqs.push(Request {
                request_id: rid,
                prompt: prompt_from_py(py, &prompt)?,
                params: params_from_dict(py, &params)?,
            });
        }
        let outs = self.with(py, move |e| e.generate(reqs))?;
        outs.iter().map(|o| output_to_py(py, o)).collect()
    }

    /// Per-position logits of each prompt, all prompts in one flat forward.
    fn prompt_logits<'py>(&self, py: Python<'py>, prompts: Vec<Vec<u32>>) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let vocab = self.with(py, |e| Ok(e.model_config().vocab_size))?;
        let logits = self.with(py, move |e| e.prompt_logits(&prompts))?;
        logits
            .into_iter()
            .map(|rows| {
                let n = rows.len();
                let flat: Vec<f32> = rows.into_iter().flatten().collect();
                Ok(PyArray1::from_vec(py, flat).reshape([n, vocab])?.into_any())
            })
            .collect()
    }

    fn encode(&self, py: Python<'_>, text: String, add_special_tokens: bool) -> PyResult<Vec<u32>> {
        self.with(py, move |e| tokenizer_of(e)?.encode(&text, add_special_tokens))
    }

    fn decode(&self, py: Python<'_>, ids: Vec<u32>, skip_special_tokens: bool) -> PyResult<String> {
        self.with(py, move |e| tokenizer_of(e)?.decode(&ids, skip_special_tokens))
    }

    fn has_tokenizer(&self, py: Python<'_>) -> PyResult<bool> {
        self.with(py, |e| Ok(e.tokenizer().is_some()))
    }

    fn vocab_size(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |e| Ok(e.model_config().vocab_size))
    }

    fn max_model_len(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |e| Ok(e.max_model_len()))
    }

    fn eos_token_ids(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        self.with(py, |e| Ok(e.eos_token_ids().to_vec()))
    }

    fn fingerprint(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, |e| Ok(e.fingerprint().to_string()))
    }

    /// `(free, total)` KV pages.
    fn kv_pages(&self, py: Python<'_>) -> PyResult<(usize, usize)> {
        self.with(py, |e| Ok(e.kv_pages()))
    }
}

fn tokenizer_of(e: &Engine) -> Result<&crate::tokenizer::Tokenizer, DetspecError> {
    e.tokenizer()
        .ok_or_else(|| DetspecError::Tokenizer("the model directory has no tokenizer.json".into()))
}

/// Validates a SamplingParams dict, raising `InvalidRequestError` naming the parameter.
#[pyfunction]
fn validate_sampling_params(py: Python<'_>, params: &Bound<'_, PyDict>) -> PyResult<()> {
    let p = params_from_dict(py, params)?;
    p.validate().map_err(|e| to_pyerr(py, e))
}

/// Writes a random-weight demo model (`kind`: "tiny" or "bench") into `dir`.
#[pyfunction]
#[pyo3(signature = (dir, kind="tiny", seed=0))]
fn write_demo_model(py: Python<'_>, dir: PathBuf, kind: &str, seed: u64) -> PyResult<()> {
    let mut spec = match kind {
        "tiny" => crate::demo::DemoModelSpec::tiny(),
        "bench" => crate::demo::DemoModelSpec::bench(),
        other => {
            return Err(to_pyerr(
                py,
                DetspecError::param("kind", format!("unknown demo model `{other}` (tiny, bench)")),
            ))
        }
    };
    spec.seed = seed;
    run_detached(py, move || crate::demo::write_demo_model(&dir, &spec))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEngine>()?;
    m.add_function(wrap_pyfunction!(validate_sampling_params, m)?)?;
    m.add_function(wrap_pyfunction!(write_demo_model, m)?)?;
    m.add("KERNEL_VERSION", crate::engine::KERNEL_VERSION)?;
    Ok(())
}
