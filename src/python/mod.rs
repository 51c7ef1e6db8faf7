//! PyO3 bindings (feature `python`): a thin layer that converts types and errors.
//!
//! No engine logic lives here. Every entry point releases the GIL while Rust works and catches
//! panics, so a bug surfaces as a `detspec.DetspecError` rather than a `PanicException`.

mod convert;
mod dlpack;
mod logging;

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam::channel::{unbounded, Receiver, Sender};

use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::PyDict;

use crate::config::{
    ActivationDtype, DTypeSpec, DeterminismMode, DeviceSpec, EngineConfig, KernelProfile,
    VerifyStrategy,
};
use crate::engine::{
    AuditInput, EmbedOptions, Engine, InFlight, OutputAccumulator, PauseMode, Pooling, SeqScope,
    StreamEvent,
};
use crate::error::DetspecError;
use crate::model::LoraAdapter;
use crate::request::Request;
use crate::tokenizer::ChatTemplate;

use convert::{
    logprob_tuples, output_to_py, params_from_dict, prompt_from_py, to_pyerr, LogprobTuple,
};

/// Template instructions one rendering with a template given by the caller may run (see
/// `ChatTemplate::with_fuel`): a real template over a long conversation runs tens of
/// thousands, a runaway loop is stopped in well under a second.
const GIVEN_TEMPLATE_FUEL: u64 = 10_000_000;

/// `dtype` as torch (and the `dtype` setting) spell it.
fn torch_dtype_name(dtype: candle_core::DType) -> &'static str {
    match dtype {
        candle_core::DType::F32 => "float32",
        candle_core::DType::BF16 => "bfloat16",
        candle_core::DType::F16 => "float16",
        other => other.as_str(),
    }
}

/// Runs `f` without the GIL, turning errors and panics into Python exceptions.
fn run_detached<T: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> Result<T, DetspecError> + Send,
) -> PyResult<T> {
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

/// `(request_id, output dict, exception)` as returned by `OutputQueue.next_outputs`.
type QueueItem<'py> = (String, Option<Bound<'py, PyAny>>, Option<Py<PyAny>>);

/// A stream of outputs from any number of requests (one per `LLM.generate` call, one per
/// `AsyncLLM`). The engine thread pushes events; `next_outputs` blocks without the GIL.
#[pyclass(name = "OutputQueue", module = "detspec._core")]
struct PyOutputQueue {
    tx: Sender<StreamEvent>,
    rx: Receiver<StreamEvent>,
    /// Per request: its accumulated output, and whether it streams deltas.
    accs: Mutex<HashMap<String, (OutputAccumulator, bool)>>,
}

#[pymethods]
impl PyOutputQueue {
    #[new]
    fn new() -> Self {
        let (tx, rx) = unbounded();
        Self {
            tx,
            rx,
            accs: Mutex::new(HashMap::new()),
        }
    }

    /// Waits up to `timeout` seconds (forever if None) for events, then returns one
    /// `(request_id, output_dict | None, exception | None)` per request that changed.
    /// Finished and failed requests are forgotten after being returned.
    #[pyo3(signature = (timeout=None))]
    fn next_outputs<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
    ) -> PyResult<Vec<QueueItem<'py>>> {
        let rx = self.rx.clone();
        let events: Vec<StreamEvent> = py.detach(move || {
            let first = match timeout {
                Some(t) => rx.recv_timeout(Duration::from_secs_f64(t.max(0.0))).ok(),
                None => rx.recv().ok(),
            };
            first
                .into_iter()
                .chain(std::iter::from_fn(|| rx.try_recv().ok()))
                .collect()
        });
        let mut accs = self.accs.lock().unwrap_or_else(|e| e.into_inner());
        let mut changed: Vec<String> = Vec::new();
        let mut failed: HashMap<String, DetspecError> = HashMap::new();
        for ev in events {
            let id = ev.request_id().to_string();
            let accepted = matches!(ev, StreamEvent::Accepted { .. });
            let Some((acc, _)) = accs.get_mut(&id) else {
                continue;
            };
            if let Err(e) = acc.apply(ev) {
                failed.insert(id.clone(), e);
            } else if accepted {
                continue;
            }
            if !changed.contains(&id) {
                changed.push(id);
            }
        }
        let mut out = Vec::with_capacity(changed.len());
        for id in changed {
            if let Some(err) = failed.remove(&id) {
                accs.remove(&id);
                out.push((id, None, Some(to_pyerr(py, err).into_value(py).into_any())));
                continue;
            }
            let Some((acc, delta)) = accs.get_mut(&id) else {
                continue;
            };
            let d = if *delta {
                output_to_py(py, &acc.take_delta())?
            } else {
                output_to_py(py, acc.output())?
            };
            if acc.finished() {
                accs.remove(&id);
            }
            out.push((id, Some(d), None));
        }
        Ok(out)
    }

    /// Requests submitted through this queue that have not finished.
    fn num_unfinished(&self, py: Python<'_>) -> usize {
        // Without the GIL, for the reason given in `PyEngine::add_request`.
        py.detach(|| self.accs.lock().unwrap_or_else(|e| e.into_inner()).len())
    }
}

/// The Rust engine behind `detspec.LLM` and `detspec.AsyncLLM`.
#[pyclass(name = "Engine", module = "detspec._core")]
struct PyEngine {
    inner: Engine,
}

impl Drop for PyEngine {
    /// Joins the engine thread without the GIL: the thread may need it to log on its way out.
    fn drop(&mut self) {
        let inner = &self.inner;
        let _ = Python::try_attach(|py| py.detach(|| inner.shutdown()));
        inner.shutdown();
    }
}

impl PyEngine {
    fn call<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&Engine) -> Result<T, DetspecError> + Send,
    ) -> PyResult<T> {
        let e = &self.inner;
        run_detached(py, || f(e))
    }

    /// The loaded adapter `name` (`None`: the base model), or an error naming `lora_name`.
    fn lora(&self, py: Python<'_>, name: Option<&str>) -> PyResult<Option<Arc<LoraAdapter>>> {
        name.map(|n| self.inner.lora(n))
            .transpose()
            .map_err(|e| to_pyerr(py, e))
    }

    /// A prompt's top logprobs asked for (`top_n`, from `prompt_logprobs`) against the
    /// engine's `max_logprobs`.
    fn check_top_n(&self, py: Python<'_>, top_n: usize) -> PyResult<()> {
        self.inner
            .request_rules()
            .check_top_logprobs(top_n, "prompt_logprobs")
            .map_err(|e| to_pyerr(py, e))
    }

    /// `n` standalone sequences' scope: the adapter `lora_name`, the salt `cache_salt`.
    fn scopes(
        &self,
        py: Python<'_>,
        n: usize,
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> PyResult<Vec<SeqScope>> {
        let scope = SeqScope {
            lora: self.lora(py, lora_name)?,
            cache_salt: crate::engine::validate::cache_salt_hash(cache_salt)
                .map_err(|e| to_pyerr(py, e))?,
        };
        Ok(vec![scope; n])
    }
}

/// An adapter's description: `path`, `rank` and `content_hash` (16 hex digits, as in the
/// fingerprints of its requests).
fn lora_dict(py: Python<'_>, adapter: &LoraAdapter) -> PyResult<Py<PyDict>> {
    let d = PyDict::new(py);
    d.set_item("path", adapter.dir().to_string_lossy())?;
    d.set_item("rank", adapter.rank())?;
    d.set_item("content_hash", format!("{:016x}", adapter.content_hash()))?;
    Ok(d.unbind())
}

#[pymethods]
impl PyEngine {
    #[new]
    #[pyo3(signature = (model_dir, *, device="cpu", dtype="auto", kv_cache_dtype="auto", page_size=16, num_kv_pages=None, kv_cache_bytes=None, max_num_seqs=256, max_num_batched_tokens=512, max_model_len=None, max_prefill_chunk=None, determinism="dvr", verify_window=64, verify_group=8, verify_strategy="auto", kernel_profile="invariant", activation_dtype="auto", verify_finish_wait=0, verify_window_adaptive=true, fault_injection=0.0, enable_prefix_caching=true, num_threads=None, enable_lora=false, max_loras=8, max_lora_rank=64, max_logprobs=20, gpu_memory_utilization=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model_dir: PathBuf,
        device: &str,
        dtype: &str,
        kv_cache_dtype: &str,
        page_size: usize,
        num_kv_pages: Option<usize>,
        kv_cache_bytes: Option<usize>,
        max_num_seqs: usize,
        max_num_batched_tokens: usize,
        max_model_len: Option<usize>,
        max_prefill_chunk: Option<usize>,
        determinism: &str,
        verify_window: usize,
        verify_group: usize,
        verify_strategy: &str,
        kernel_profile: &str,
        activation_dtype: &str,
        verify_finish_wait: usize,
        verify_window_adaptive: bool,
        fault_injection: f64,
        enable_prefix_caching: bool,
        num_threads: Option<usize>,
        enable_lora: bool,
        max_loras: usize,
        max_lora_rank: usize,
        max_logprobs: i64,
        gpu_memory_utilization: Option<f64>,
    ) -> PyResult<Self> {
        // vLLM's convention: -1 is the vocabulary.
        let max_logprobs = match max_logprobs {
            -1 => None,
            n => Some(usize::try_from(n).map_err(|_| {
                to_pyerr(
                    py,
                    DetspecError::param(
                        "max_logprobs",
                        format!("must be >= 0, or -1 for the vocabulary, got {n}"),
                    ),
                )
            })?),
        };
        let determinism = DeterminismMode::parse(determinism).map_err(|e| to_pyerr(py, e))?;
        let verify_strategy =
            VerifyStrategy::parse(verify_strategy).map_err(|e| to_pyerr(py, e))?;
        let kernel_profile = KernelProfile::parse(kernel_profile).map_err(|e| to_pyerr(py, e))?;
        let activation_dtype =
            ActivationDtype::parse(activation_dtype).map_err(|e| to_pyerr(py, e))?;
        let device: DeviceSpec = device.parse().map_err(|e| to_pyerr(py, e))?;
        let dtype = DTypeSpec::parse(dtype).map_err(|e| to_pyerr(py, e))?;
        let kv_cache_dtype = DTypeSpec::parse(kv_cache_dtype)
            .map_err(|e| match e {
                DetspecError::InvalidParameter { message, .. } => {
                    DetspecError::param("kv_cache_dtype", message)
                }
                e => e,
            })
            .map_err(|e| to_pyerr(py, e))?;
        let mut cfg = EngineConfig {
            device,
            dtype,
            kv_cache_dtype,
            page_size,
            num_kv_pages,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            max_prefill_chunk,
            determinism,
            verify_window,
            verify_group,
            verify_strategy,
            kernel_profile,
            activation_dtype,
            verify_finish_wait,
            verify_window_adaptive,
            fault_injection,
            enable_prefix_caching,
            num_threads,
            // Off, the engine refuses adapters (0 may be loaded).
            max_loras: if enable_lora { max_loras } else { 0 },
            max_lora_rank,
            max_logprobs,
            gpu_memory_utilization,
            ..Default::default()
        };
        cfg.kv_cache_bytes = kv_cache_bytes;
        let inner = run_detached(py, move || Engine::from_model_dir(&model_dir, cfg))?;
        Ok(Self { inner })
    }

    /// Submits a request whose outputs arrive on `queue`: cumulative snapshots, or with
    /// `delta` what is new since the last output of this request. `aborted`: its caller
    /// aborted it before it could submit it; it ends at once with finish reason `abort`.
    #[pyo3(signature = (queue, request_id, prompt, params, delta=false, lora_name=None, cache_salt=None, aborted=false))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &self,
        py: Python<'_>,
        queue: &PyOutputQueue,
        request_id: String,
        prompt: &Bound<'_, PyAny>,
        params: &Bound<'_, PyDict>,
        delta: bool,
        lora_name: Option<&str>,
        cache_salt: Option<String>,
        aborted: bool,
    ) -> PyResult<()> {
        let request = Request {
            request_id: request_id.clone(),
            prompt: prompt_from_py(py, prompt)?,
            params: params_from_dict(py, params)?,
            lora: self.lora(py, lora_name)?,
            cache_salt,
        };
        // Take the accumulator lock without the GIL: `next_outputs` holds it while building
        // Python objects, where the GIL can pass to another thread (a GC callback runs
        // bytecode). Waiting for the lock with the GIL held would deadlock both threads.
        let inserted = py.detach(|| {
            let mut accs = queue.accs.lock().unwrap_or_else(|e| e.into_inner());
            if accs.contains_key(&request_id) {
                return false;
            }
            accs.insert(
                request_id.clone(),
                (OutputAccumulator::new(&request_id), delta),
            );
            true
        });
        if !inserted {
            return Err(to_pyerr(
                py,
                crate::engine::validate::duplicate_request_id(&request_id),
            ));
        }
        let tx = queue.tx.clone();
        self.call(py, move |e| {
            if aborted {
                e.add_aborted_request_with_sender(request, tx)
            } else {
                e.add_request_with_sender(request, tx)
            }
        })
    }

    /// Aborts a request (its output finishes with reason "abort"); unknown ids are ignored.
    fn abort(&self, py: Python<'_>, request_id: String) -> PyResult<()> {
        self.call(py, move |e| e.abort(&request_id))
    }

    /// Stops the engine thread; in-flight requests finish with reason "abort".
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        self.call(py, |e| {
            e.shutdown();
            Ok(())
        })
    }

    /// Per-position logits of each prompt as `[len, vocab]` arrays, on the verify-path
    /// kernels (the bits a deterministic request computes for the same tokens).
    fn prompt_logits(
        &self,
        py: Python<'_>,
        prompts: Vec<Vec<u32>>,
    ) -> PyResult<Vec<dlpack::PyTensor>> {
        let vocab = self.inner.info().config.vocab_size;
        let rows = self.call(py, move |e| e.prompt_logits(prompts))?;
        rows_to_tensors(py, rows, vocab)
    }

    /// Last-layer hidden states (after the final norm) of each prompt, `[len, hidden]`.
    fn hidden_states(
        &self,
        py: Python<'_>,
        prompts: Vec<Vec<u32>>,
    ) -> PyResult<Vec<dlpack::PyTensor>> {
        let hidden = self.inner.info().config.hidden_size;
        let rows = self.call(py, move |e| e.with_core(move |c| c.hidden_states(&prompts)))?;
        rows_to_tensors(py, rows, hidden)
    }

    /// One embedding per prompt, `[prompts, dimensions]`: the last-layer hidden states pooled
    /// (`"last"` or `"mean"`), cut to `dimensions`, L2-normalised (`normalize`), on the
    /// verify-path kernels where `deterministic`, with the loaded adapter `lora_name`.
    #[pyo3(signature = (prompts, pooling="last", dimensions=None, normalize=true, deterministic=true, lora_name=None))]
    #[allow(clippy::too_many_arguments)]
    fn embed(
        &self,
        py: Python<'_>,
        prompts: Vec<Vec<u32>>,
        pooling: &str,
        dimensions: Option<usize>,
        normalize: bool,
        deterministic: bool,
        lora_name: Option<&str>,
    ) -> PyResult<dlpack::PyTensor> {
        let opts = EmbedOptions {
            pooling: Pooling::parse(pooling).map_err(|e| to_pyerr(py, e))?,
            dimensions,
            normalize,
            deterministic,
        };
        let scopes = self.scopes(py, prompts.len(), lora_name, None)?;
        let n = prompts.len();
        let rows = self.call(py, move |e| {
            e.with_core(move |c| c.embed(&prompts, opts, &scopes))
        })?;
        let width = rows.first().map_or(0, Vec::len);
        dlpack::PyTensor::new(dlpack::Buffer::F32(rows.concat()), vec![n, width])
            .map_err(|e| to_pyerr(py, e))
    }

    /// Each prompt's classification as `(logits, probs)` (a `*ForSequenceClassification`
    /// model: its `score` layer at the last token, and softmax or the logistic function of
    /// it), on the verify-path kernels where `deterministic`, with the loaded adapter
    /// `lora_name`.
    #[pyo3(signature = (prompts, deterministic=true, lora_name=None))]
    fn classify(
        &self,
        py: Python<'_>,
        prompts: Vec<Vec<u32>>,
        deterministic: bool,
        lora_name: Option<&str>,
    ) -> PyResult<Vec<(Vec<f32>, Vec<f32>)>> {
        let scopes = self.scopes(py, prompts.len(), lora_name, None)?;
        let out = self.call(py, move |e| {
            e.with_core(move |c| c.classify(&prompts, deterministic, &scopes))
        })?;
        Ok(out.into_iter().map(|c| (c.logits, c.probs)).collect())
    }

    /// The labels of a classifier (`id2label`'s names in id order); `None` for a language model.
    fn labels(&self) -> Option<Vec<String>> {
        self.inner
            .info()
            .config
            .head
            .labels()
            .map(<[String]>::to_vec)
    }

    /// Per completion token `(token, logprob, rank, top)` given its prompt; `deterministic`
    /// runs the verify-path kernels; `lora_name`: a loaded adapter they all run with;
    /// `cache_salt`: the prefix-cache namespace their prompts' pages are read from and left in.
    #[pyo3(signature = (pairs, top_n, deterministic, lora_name=None, cache_salt=None))]
    fn score(
        &self,
        py: Python<'_>,
        pairs: Vec<(Vec<u32>, Vec<u32>)>,
        top_n: usize,
        deterministic: bool,
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> PyResult<Vec<Vec<LogprobTuple>>> {
        self.check_top_n(py, top_n)?;
        let scopes = self.scopes(py, pairs.len(), lora_name, cache_salt)?;
        let scored = self.call(py, move |e| {
            e.with_core(move |c| c.score(&pairs, top_n, deterministic, &scopes))
        })?;
        Ok(scored.iter().map(|s| logprob_tuples(s)).collect())
    }

    /// vLLM's prompt logprobs: `(token, logprob, rank, top)` for prompt positions 1...;
    /// `lora_name`: a loaded adapter they all run with; `cache_salt`: as `score`'s.
    #[pyo3(signature = (prompts, top_n, lora_name=None, cache_salt=None))]
    fn prompt_logprobs(
        &self,
        py: Python<'_>,
        prompts: Vec<Vec<u32>>,
        top_n: usize,
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> PyResult<Vec<Vec<LogprobTuple>>> {
        self.check_top_n(py, top_n)?;
        let scopes = self.scopes(py, prompts.len(), lora_name, cache_salt)?;
        let scored = self.call(py, move |e| {
            e.with_core(move |c| c.prompt_logprobs(&prompts, top_n, &scopes))
        })?;
        Ok(scored.iter().map(|s| logprob_tuples(s)).collect())
    }

    /// Re-runs stored outputs `(prompt, params dict, completion index, token ids)` with their
    /// tokens fed back (with the loaded adapter `lora_name`); returns what the sampler draws
    /// at each position.
    #[pyo3(signature = (items, lora_name=None))]
    fn audit(
        &self,
        py: Python<'_>,
        items: Vec<StoredOutput<'_>>,
        lora_name: Option<&str>,
    ) -> PyResult<Vec<Vec<LogprobTuple>>> {
        let lora = self.lora(py, lora_name)?;
        let inputs = items
            .into_iter()
            .map(|(prompt, params, completion_index, token_ids)| {
                Ok(AuditInput {
                    prompt,
                    params: params_from_dict(py, &params)?,
                    completion_index,
                    token_ids,
                    lora: lora.clone(),
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let redrawn = self.call(py, move |e| e.with_core(move |c| c.audit(&inputs)))?;
        Ok(redrawn.iter().map(|s| logprob_tuples(s)).collect())
    }

    /// Loads the PEFT LoRA adapter in `path` as `name` (`replace`: a loaded name gets the new
    /// adapter for requests submitted after); returns its description.
    #[pyo3(signature = (name, path, replace=false))]
    fn load_lora(
        &self,
        py: Python<'_>,
        name: String,
        path: PathBuf,
        replace: bool,
    ) -> PyResult<Py<PyDict>> {
        let adapter = self.call(py, move |e| e.load_lora(&name, &path, replace))?;
        lora_dict(py, &adapter)
    }

    /// `load_lora` of an adapter sent as its config's JSON text and the bytes of its
    /// safetensors file.
    #[pyo3(signature = (name, config_json, data, replace=false))]
    fn load_lora_from_bytes(
        &self,
        py: Python<'_>,
        name: String,
        config_json: String,
        data: PyBackedBytes,
        replace: bool,
    ) -> PyResult<Py<PyDict>> {
        let adapter = self.call(py, move |e| {
            e.load_lora_bytes(&name, &config_json, &data, replace)
        })?;
        lora_dict(py, &adapter)
    }

    /// Unloads adapter `name`; requests running with it finish with it.
    fn unload_lora(&self, py: Python<'_>, name: String) -> PyResult<()> {
        self.call(py, move |e| e.unload_lora(&name))
    }

    /// `{name: description}` of every loaded adapter.
    fn list_loras(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        let out = PyDict::new(py);
        for (name, adapter) in self.inner.loras() {
            out.set_item(name, lora_dict(py, &adapter)?)?;
        }
        Ok(out.unbind())
    }

    /// Replaces named parameters; returns `(fingerprint, weight_version)`.
    #[pyo3(signature = (named_tensors, in_flight="finish"))]
    fn update_weights(
        &self,
        py: Python<'_>,
        named_tensors: Vec<(String, Bound<'_, PyAny>)>,
        in_flight: &str,
    ) -> PyResult<(String, u64)> {
        let in_flight = parse_in_flight(py, in_flight)?;
        let mut updates = Vec::with_capacity(named_tensors.len());
        for (name, t) in named_tensors {
            let engine_tensor = dlpack::import(py, "named_tensors", &name, &t)?;
            let t = engine_tensor
                .into_candle(&name)
                .map_err(|e| to_pyerr(py, e))?;
            updates.push((name, t));
        }
        let info = self.call(py, move |e| e.update_weights(updates, in_flight))?;
        Ok((info.fingerprint.clone(), info.weight_version))
    }

    /// Loads every parameter a safetensors checkpoint directory holds and applies them as
    /// one update; returns `(fingerprint, weight_version)`.
    #[pyo3(signature = (path, in_flight="finish"))]
    fn update_weights_from_disk(
        &self,
        py: Python<'_>,
        path: PathBuf,
        in_flight: &str,
    ) -> PyResult<(String, u64)> {
        let in_flight = parse_in_flight(py, in_flight)?;
        let info = self.call(py, move |e| e.update_weights_from_disk(&path, in_flight))?;
        Ok((info.fingerprint.clone(), info.weight_version))
    }

    /// `update_weights_from_disk`; with `complete`, every parameter of the model must be in
    /// the checkpoint (the error names the first missing one). Returns `(fingerprint,
    /// weight_version)`.
    #[pyo3(signature = (path, in_flight="finish", complete=true))]
    fn update_weights_from_checkpoint(
        &self,
        py: Python<'_>,
        path: PathBuf,
        in_flight: &str,
        complete: bool,
    ) -> PyResult<(String, u64)> {
        let in_flight = parse_in_flight(py, in_flight)?;
        let info = self.call(py, move |e| {
            e.update_weights_from_checkpoint(&path, in_flight, complete)
        })?;
        Ok((info.fingerprint.clone(), info.weight_version))
    }

    /// Applies the tensors of a serialized safetensors buffer as one update; returns
    /// `(fingerprint, weight_version)`.
    #[pyo3(signature = (data, in_flight="finish"))]
    fn update_weights_from_safetensors(
        &self,
        py: Python<'_>,
        data: PyBackedBytes,
        in_flight: &str,
    ) -> PyResult<(String, u64)> {
        let in_flight = parse_in_flight(py, in_flight)?;
        let info = self.call(py, move |e| {
            e.update_weights_from_safetensors(&data, in_flight)
        })?;
        Ok((info.fingerprint.clone(), info.weight_version))
    }

    /// Pauses generation (`mode`: "abort", "wait" or "keep"); returns once it is in force.
    #[pyo3(signature = (mode="abort"))]
    fn pause(&self, py: Python<'_>, mode: &str) -> PyResult<()> {
        let mode = match mode {
            "abort" => PauseMode::Abort,
            "wait" => PauseMode::Wait,
            "keep" => PauseMode::Keep,
            other => {
                return Err(to_pyerr(
                    py,
                    DetspecError::param(
                        "mode",
                        format!("must be \"abort\", \"wait\" or \"keep\", got {other:?}"),
                    ),
                ))
            }
        };
        self.call(py, move |e| e.pause(mode))
    }

    fn resume(&self, py: Python<'_>) -> PyResult<()> {
        self.call(py, |e| e.resume())
    }

    fn is_paused(&self) -> bool {
        self.inner.is_paused()
    }

    fn reset_prefix_cache(&self, py: Python<'_>) -> PyResult<usize> {
        self.call(py, |e| e.reset_prefix_cache())
    }

    fn release_kv_memory(&self, py: Python<'_>) -> PyResult<()> {
        self.call(py, |e| e.release_kv_memory())
    }

    fn resume_kv_memory(&self, py: Python<'_>) -> PyResult<()> {
        self.call(py, |e| e.resume_kv_memory())
    }

    /// `(bytes the KV pool holds, whether it is released)`.
    fn kv_memory(&self, py: Python<'_>) -> PyResult<(usize, bool)> {
        self.call(py, |e| e.kv_memory())
    }

    fn weight_version(&self) -> u64 {
        self.inner.info().weight_version
    }

    fn encode(&self, py: Python<'_>, text: String, add_special_tokens: bool) -> PyResult<Vec<u32>> {
        self.call(py, move |e| {
            tokenizer_of(e)?.encode(&text, add_special_tokens)
        })
    }

    /// `first` and `second` encoded as a pair (the tokenizer's pair template).
    fn encode_pair(
        &self,
        py: Python<'_>,
        first: String,
        second: String,
        add_special_tokens: bool,
    ) -> PyResult<Vec<u32>> {
        self.call(py, move |e| {
            tokenizer_of(e)?.encode_pair(&first, &second, add_special_tokens)
        })
    }

    fn decode(&self, py: Python<'_>, ids: Vec<u32>, skip_special_tokens: bool) -> PyResult<String> {
        self.call(py, move |e| {
            tokenizer_of(e)?.decode(&ids, skip_special_tokens)
        })
    }

    /// Renders a conversation (JSON list of messages) with the model's chat template, or with
    /// `template` (its source) where given; `extra` (JSON object) adds template variables such
    /// as `tools` or `enable_thinking`.
    #[pyo3(signature = (messages_json, add_generation_prompt=true, extra_json=None, template=None))]
    fn apply_chat_template(
        &self,
        py: Python<'_>,
        messages_json: String,
        add_generation_prompt: bool,
        extra_json: Option<String>,
        template: Option<String>,
    ) -> PyResult<String> {
        self.call(py, move |e| {
            let tokenizer = tokenizer_of(e)?;
            let given = template
                .map(|source| {
                    ChatTemplate::new(&source, tokenizer.bos_token(), tokenizer.eos_token())
                        .map(|t| t.with_fuel(GIVEN_TEMPLATE_FUEL))
                        .map_err(|err| DetspecError::param("chat_template", err.to_string()))
                })
                .transpose()?;
            let given_template = given.is_some();
            let template = match given {
                Some(t) => Some(t),
                None => ChatTemplate::from_tokenizer(tokenizer)?,
            }
            .ok_or_else(|| DetspecError::InvalidRequest {
                request_id: None,
                message: format!(
                    "{} has no chat template (`chat_template` in tokenizer_config.json or \
                         chat_template.jinja): pass one as `chat_template`",
                    e.info().model_dir.display()
                ),
            })?;
            let messages: serde_json::Value = serde_json::from_str(&messages_json)
                .map_err(|err| DetspecError::param("messages", err.to_string()))?;
            let extra: serde_json::Map<String, serde_json::Value> = match extra_json {
                Some(s) => serde_json::from_str(&s)
                    .map_err(|err| DetspecError::param("chat_template_kwargs", err.to_string()))?,
                None => serde_json::Map::new(),
            };
            let rendered = template.render_with(&messages, add_generation_prompt, &extra);
            if given_template {
                // The caller's template failed (its own error, or out of fuel): name it.
                return rendered
                    .map_err(|err| DetspecError::param("chat_template", err.to_string()));
            }
            rendered
        })
    }

    fn has_tokenizer(&self) -> bool {
        self.inner.tokenizer().is_some()
    }

    fn vocab_size(&self) -> usize {
        self.inner.info().config.vocab_size
    }

    fn max_model_len(&self) -> usize {
        self.inner.info().max_model_len
    }

    /// The most top logprobs a request may ask for (`max_logprobs`; the vocabulary's size
    /// where it is -1).
    fn max_logprobs(&self) -> usize {
        self.inner.request_rules().max_logprobs
    }

    /// The weights' dtype as resolved at load, in torch's spelling (`float32`, `bfloat16`).
    fn dtype(&self) -> &'static str {
        torch_dtype_name(self.inner.info().dtype)
    }

    /// The KV cache's dtype as resolved at load, in torch's spelling.
    fn kv_cache_dtype(&self) -> &'static str {
        torch_dtype_name(self.inner.info().kv_dtype)
    }

    /// The engine's determinism mode: "dvr", "batch_invariant" or "off".
    fn determinism(&self) -> &'static str {
        self.inner.request_rules().determinism.as_str()
    }

    /// Checks a tokenized prompt and/or sampling parameters with the rules the engine
    /// applies at intake, raising `InvalidRequestError` whose `param` names the parameter
    /// (`prompt_param` for the prompt: "prompt", "prompt[1]", "messages").
    #[pyo3(signature = (prompt_token_ids=None, params=None, prompt_param="prompt"))]
    fn validate_request(
        &self,
        py: Python<'_>,
        prompt_token_ids: Option<Vec<u32>>,
        params: Option<&Bound<'_, PyDict>>,
        prompt_param: &str,
    ) -> PyResult<()> {
        let rules = self.inner.request_rules();
        if let Some(params) = params {
            let params = params_from_dict(py, params)?;
            // Compiling a grammar may take a while: without the GIL.
            py.detach(|| self.inner.check_params(&params))
                .map_err(|e| to_pyerr(py, e))?;
        }
        if let Some(ids) = prompt_token_ids {
            rules
                .check_prompt(&ids, prompt_param)
                .map_err(|e| to_pyerr(py, e))?;
        }
        Ok(())
    }

    fn eos_token_ids(&self) -> Vec<u32> {
        self.inner.info().eos_token_ids.clone()
    }

    /// The engine's fingerprint; with `lora_name`, that of its requests run with the adapter.
    #[pyo3(signature = (lora_name=None))]
    fn fingerprint(&self, py: Python<'_>, lora_name: Option<&str>) -> PyResult<String> {
        let fp = self.inner.fingerprint();
        Ok(match self.lora(py, lora_name)? {
            Some(a) => crate::engine::fingerprint::with_adapter(&fp, a.content_hash()),
            None => fp,
        })
    }

    /// `(free, total)` KV pages.
    fn kv_pages(&self, py: Python<'_>) -> PyResult<(usize, usize)> {
        self.call(py, |e| e.kv_pages())
    }

    /// KV page pool and prefix-cache statistics.
    fn kv_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.call(py, |e| e.kv_stats())?;
        let d = PyDict::new(py);
        d.set_item("total_pages", s.total_pages)?;
        d.set_item("free_pages", s.free_pages)?;
        d.set_item("used_pages", s.used_pages)?;
        d.set_item("cached_pages", s.cached_pages)?;
        d.set_item("evictable_pages", s.evictable_pages)?;
        d.set_item("pinned_pages", s.pinned_pages)?;
        d.set_item("page_size", s.page_size)?;
        d.set_item("prefix_queries", s.prefix_queries)?;
        d.set_item("prefix_hits", s.prefix_hits)?;
        d.set_item("hit_rate", s.hit_rate)?;
        d.set_item("state_slots", s.state_slots)?;
        d.set_item("states_held", s.states_held)?;
        d.set_item("state_snapshots", s.state_snapshots)?;
        Ok(d)
    }

    /// Engine-wide counters: verify passes, rollbacks, rolled-back tokens, padded rows,
    /// preemptions, and the steps' time by phase.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.call(py, |e| e.stats())?;
        let d = PyDict::new(py);
        d.set_item("num_verify_passes", s.verify_passes)?;
        d.set_item("num_rollbacks", s.rollbacks)?;
        d.set_item("num_rolled_back_tokens", s.rolled_back_tokens)?;
        d.set_item("num_padded_rows", s.padded_rows)?;
        d.set_item("num_preemptions", s.preemptions)?;
        d.set_item("weight_update_pending", s.weight_update_pending)?;
        d.set_item("num_steps", s.steps)?;
        d.set_item("time_forward_s", s.times.forward_s)?;
        d.set_item("time_sample_s", s.times.sample_s)?;
        d.set_item("time_verify_s", s.times.verify_s)?;
        Ok(d)
    }
}

/// A stored output to audit: `(prompt ids, params dict, completion index, token ids)`.
type StoredOutput<'py> = (Vec<u32>, Bound<'py, PyDict>, usize, Vec<u32>);

/// Flat rows `[n × width]` per sequence as `[n, width]` engine tensors (no copy).
fn rows_to_tensors(
    py: Python<'_>,
    rows: Vec<Vec<f32>>,
    width: usize,
) -> PyResult<Vec<dlpack::PyTensor>> {
    rows.into_iter()
        .map(|flat| {
            let n = flat.len() / width.max(1);
            dlpack::PyTensor::new(dlpack::Buffer::F32(flat), vec![n, width])
                .map_err(|e| to_pyerr(py, e))
        })
        .collect()
}

fn parse_in_flight(py: Python<'_>, s: &str) -> PyResult<InFlight> {
    match s {
        "finish" => Ok(InFlight::Finish),
        "abort" => Ok(InFlight::Abort),
        other => Err(to_pyerr(
            py,
            DetspecError::param(
                "in_flight",
                format!("must be \"finish\" or \"abort\", got {other:?}"),
            ),
        )),
    }
}

fn tokenizer_of(e: &Engine) -> Result<&crate::tokenizer::Tokenizer, DetspecError> {
    e.tokenizer()
        .ok_or_else(|| DetspecError::Tokenizer("the model directory has no tokenizer.json".into()))
}

/// CUDA GPUs this build can use (0 in a CPU build, or when no driver or GPU is present).
#[pyfunction]
fn cuda_device_count() -> usize {
    crate::config::cuda_device_count()
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
        "tiny-moe" => crate::demo::DemoModelSpec::tiny_moe(),
        "bench-moe" => crate::demo::DemoModelSpec::bench_moe(),
        other => {
            return Err(to_pyerr(
                py,
                DetspecError::param(
                    "kind",
                    format!("unknown demo model `{other}` (tiny, bench, tiny-moe, bench-moe)"),
                ),
            ))
        }
    };
    spec.seed = seed;
    run_detached(py, move || crate::demo::write_demo_model(&dir, &spec))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    logging::install();
    crate::keep_freed_memory();
    m.add_class::<PyEngine>()?;
    m.add_class::<PyOutputQueue>()?;
    m.add_class::<dlpack::PyTensor>()?;
    m.add_function(wrap_pyfunction!(validate_sampling_params, m)?)?;
    m.add_function(wrap_pyfunction!(write_demo_model, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_device_count, m)?)?;
    m.add("CUDA_BUILD", cfg!(feature = "cuda"))?;
    m.add("KERNEL_VERSION", crate::engine::KERNEL_VERSION)?;
    m.add("JSON_OPTIONS", crate::sampling::JSON_OPTIONS)?;
    m.add(
        "DEFAULT_MAX_LOGPROBS",
        crate::sampling::DEFAULT_MAX_LOGPROBS,
    )?;
    Ok(())
}
