//! The engine: a thread that owns the model, the KV pool and the scheduler and runs the step
//! loop; requests arrive on a channel from any thread and each request's outputs leave on the
//! stream its submitter chose.
//!
//! The thread blocks on its command channel whenever there is no work, so an idle engine uses
//! no CPU. Dropping the last [`Engine`] handle shuts it down: in-flight requests finish with
//! reason `abort` and the thread is joined.

mod core;
pub mod fingerprint;
pub mod fpenv;
mod lora;
mod stream;
mod text;
pub mod validate;

pub use self::core::{
    AuditInput, Classification, EmbedOptions, EngineCore, EngineStats, ForwardKind, ModelInfo,
    Pooling, Scopes, SeqScope, StepTimes,
};
pub use fingerprint::KERNEL_VERSION;
pub use stream::{OutputAccumulator, RequestStream, StreamEvent};
pub use validate::RequestRules;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;

use crossbeam::channel::{unbounded, Receiver, Sender};

use crate::config::EngineConfig;
use crate::error::{DetspecError, Result};
use crate::kv::KvStats;
use crate::model::LoraAdapter;
use crate::output::RequestOutput;
use crate::request::Request;
use crate::sampling::{Grammars, SamplingParams};
use crate::tokenizer::Tokenizer;

type Reply<T> = Sender<Result<T>>;

/// Named parameters for a weight update (Hugging Face names).
type Updates = Vec<(String, candle_core::Tensor)>;

/// Work run on the engine thread with the core, between steps (standalone forwards).
type CoreJob = Box<dyn FnOnce(&mut EngineCore) + Send>;

/// What to do with requests in flight when new weights arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InFlight {
    /// They finish on the old weights; requests submitted meanwhile wait for the new ones.
    #[default]
    Finish,
    /// They are aborted (finish reason `abort`) and the update applies at once.
    Abort,
}

/// What a pause does with the requests in flight (SGLang's `pause_generation` modes; vLLM's
/// `abort` / `wait` / `keep`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PauseMode {
    /// Abort them (finish reason `abort`); the pause applies at once.
    #[default]
    Abort,
    /// Let them finish; the pause returns once none is left. New requests wait.
    Wait,
    /// Freeze them where they are (no step runs); they go on after the resume.
    Keep,
}

enum Command {
    Add {
        /// Boxed: a request (prompt, sampling parameters, constraint) is the largest command.
        request: Box<Request>,
        events: Sender<StreamEvent>,
        arrival_time: f64,
        /// Aborted by its caller before it was sent: accepted and aborted in one command.
        aborted: bool,
    },
    Abort(String),
    WithCore(CoreJob),
    UpdateWeights {
        updates: Updates,
        in_flight: InFlight,
        reply: Reply<Arc<ModelInfo>>,
    },
    KvPages(Sender<(usize, usize)>),
    Stats(Sender<EngineStats>),
    KvStats(Sender<KvStats>),
    /// Work on the core that runs even while generation is paused (control operations).
    Control(CoreJob),
    Pause {
        mode: PauseMode,
        reply: Reply<()>,
    },
    Resume(Reply<()>),
    Shutdown,
}

struct Shared {
    commands: Sender<Command>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Shared {
    fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Handle to a running engine; cheap to clone and usable from any thread.
#[derive(Clone)]
pub struct Engine {
    shared: Arc<Shared>,
    /// Replaced by the engine thread when a weight update lands (fingerprint, version).
    info: Arc<RwLock<Arc<ModelInfo>>>,
    tokenizer: Option<Arc<Tokenizer>>,
    /// The core's grammar compiler, to check structured outputs before submitting.
    grammars: Arc<Grammars>,
    /// Generation is paused (set by the engine thread).
    paused: Arc<AtomicBool>,
    /// What a request is checked against (fixed for the engine's life).
    rules: RequestRules,
    /// Loaded LoRA adapters by name.
    loras: Arc<lora::LoraRegistry>,
}

impl Engine {
    /// Loads a Hugging Face model directory on `cfg.device` and starts the engine thread.
    pub fn from_model_dir(dir: impl AsRef<Path>, cfg: EngineConfig) -> Result<Self> {
        let device = cfg.device.open()?;
        let dir = dir.as_ref();
        // Loading computes too (rope tables, packing, hashes): in the engine's floating-point
        // environment, not the caller's.
        let core = std::thread::scope(|s| {
            s.spawn(|| {
                fpenv::enter();
                EngineCore::load(dir, cfg, &device)
            })
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })?;
        Self::start(core)
    }

    /// Starts the engine thread around a loaded core.
    pub fn start(core: EngineCore) -> Result<Self> {
        let (tx, rx) = unbounded();
        let info = Arc::new(RwLock::new(core.info().clone()));
        let thread_info = info.clone();
        let paused = Arc::new(AtomicBool::new(false));
        let thread_paused = paused.clone();
        let tokenizer = core.tokenizer().cloned();
        let grammars = core.grammars().clone();
        let rules = core.request_rules();
        let loras = Arc::new(lora::LoraRegistry::new(
            core.info().config.clone(),
            core.model().device().clone(),
            core.model().act_dtype(),
            core.lora_limits().0,
            core.lora_limits().1,
        ));
        // The loop itself runs on one of the pool's workers: between kernels its serial work
        // (scheduling, candle's glue ops, sampling bookkeeping) runs on a thread that then
        // takes its share of the next kernel at once, instead of an outside thread that hands
        // each kernel to the pool and sleeps until it is done (measured: ~10 % of a prefill's
        // wall time, mostly futex wake-ups).
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(core.num_threads().unwrap_or(0))
            .thread_name(|i| format!("detspec-worker-{i}"))
            // Workers inherit their creator's floating-point environment; set ours.
            .start_handler(|_| fpenv::enter())
            .build()
            .map_err(|e| DetspecError::param("num_threads", e.to_string()))?;
        let thread = std::thread::Builder::new()
            .name("detspec-engine".into())
            .spawn(move || {
                fpenv::enter();
                pool.install(|| engine_loop(core, rx, thread_info, thread_paused))
            })
            .map_err(|e| DetspecError::io("detspec-engine thread", e))?;
        Ok(Self {
            shared: Arc::new(Shared {
                commands: tx,
                thread: Mutex::new(Some(thread)),
            }),
            info,
            tokenizer,
            grammars,
            paused,
            rules,
            loras,
        })
    }

    /// The model's description; its fingerprint and weight version change with updates.
    pub fn info(&self) -> Arc<ModelInfo> {
        self.info.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The rules every request is checked against; the engine applies them at intake.
    pub fn request_rules(&self) -> RequestRules {
        self.rules
    }

    /// Checks sampling parameters as intake will: [`RequestRules::check_params`], and a
    /// structured output's schema, regex or grammar compiled against this model's vocabulary.
    pub fn check_params(&self, params: &SamplingParams) -> Result<()> {
        self.rules.check_params(params)?;
        if let Some(so) = &params.structured_outputs {
            self.grammars.compile(so)?;
        }
        Ok(())
    }

    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_deref()
    }

    pub fn fingerprint(&self) -> String {
        self.info().fingerprint.clone()
    }

    fn send(&self, cmd: Command) -> Result<()> {
        self.shared
            .commands
            .send(cmd)
            .map_err(|_| DetspecError::EngineStopped)
    }

    /// Submits a request whose events go to `events` (which may be shared by many requests).
    pub fn add_request_with_sender(
        &self,
        request: Request,
        events: Sender<StreamEvent>,
    ) -> Result<()> {
        self.submit(request, events, false)
    }

    /// [`Self::add_request_with_sender`] of a request its caller aborted before it could send
    /// it (an abort of an id the engine does not know yet is ignored): the engine accepts it
    /// (a bad one still gets its error) and aborts it in the same command, so it ends as a
    /// request aborted before its first step. An abort sent right after the submission could
    /// arrive steps late, after a short request had finished.
    pub fn add_aborted_request_with_sender(
        &self,
        request: Request,
        events: Sender<StreamEvent>,
    ) -> Result<()> {
        self.submit(request, events, true)
    }

    fn submit(&self, request: Request, events: Sender<StreamEvent>, aborted: bool) -> Result<()> {
        self.send(Command::Add {
            request: Box::new(request),
            events,
            arrival_time: stream::now(),
            aborted,
        })
    }

    /// Submits a request and returns its output stream.
    pub fn add_request(&self, request: Request) -> Result<RequestStream> {
        let (tx, rx) = unbounded();
        let id = request.request_id.clone();
        self.add_request_with_sender(request, tx)?;
        Ok(RequestStream::new(&id, rx))
    }

    /// Loads the PEFT LoRA adapter in `dir` (`adapter_config.json`,
    /// `adapter_model.safetensors`) as `name`, for requests to name
    /// ([`Request::with_lora`] with [`Self::lora`]). A loaded name is refused unless
    /// `replace`: then requests submitted after get the new adapter, those in flight keep
    /// theirs.
    pub fn load_lora(&self, name: &str, dir: &Path, replace: bool) -> Result<Arc<LoraAdapter>> {
        self.loras.load(name, dir, replace)
    }

    /// [`Self::load_lora`] of an adapter sent as bytes: its `adapter_config.json` text and
    /// its `adapter_model.safetensors` file's bytes (an RL trainer's new adapter each step,
    /// without a file between them).
    pub fn load_lora_bytes(
        &self,
        name: &str,
        config_json: &str,
        safetensors: &[u8],
        replace: bool,
    ) -> Result<Arc<LoraAdapter>> {
        self.loras
            .load_bytes(name, config_json, safetensors, replace)
    }

    /// Unloads adapter `name` (requests running with it finish with it).
    pub fn unload_lora(&self, name: &str) -> Result<()> {
        self.loras.unload(name)
    }

    /// The adapter loaded as `name`, or an error naming `lora_name`.
    pub fn lora(&self, name: &str) -> Result<Arc<LoraAdapter>> {
        self.loras.get(name)
    }

    /// Every loaded adapter, by name.
    pub fn loras(&self) -> Vec<(String, Arc<LoraAdapter>)> {
        self.loras.list()
    }

    /// Aborts a request; its stream ends with finish reason `abort`. Unknown ids are ignored.
    pub fn abort(&self, request_id: &str) -> Result<()> {
        self.send(Command::Abort(request_id.to_string()))
    }

    /// Runs every request to completion and returns the final outputs in request order.
    /// Fails (aborting the others) if any request fails.
    pub fn generate(&self, requests: Vec<Request>) -> Result<Vec<RequestOutput>> {
        let ids: Vec<String> = requests.iter().map(|r| r.request_id.clone()).collect();
        let mut streams = Vec::with_capacity(requests.len());
        for r in requests {
            streams.push(self.add_request(r)?);
        }
        let mut outs = Vec::with_capacity(streams.len());
        for s in streams {
            match s.wait() {
                Ok(o) => outs.push(o),
                Err(e) => {
                    for id in &ids {
                        let _ = self.abort(id);
                    }
                    return Err(e);
                }
            }
        }
        Ok(outs)
    }

    /// Runs `f` on the engine thread with the core, between steps, and returns its result.
    pub fn with_core<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut EngineCore) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let (tx, rx) = unbounded();
        self.send(Command::WithCore(Box::new(move |core| {
            let _ = tx.send(f(core));
        })))?;
        rx.recv().map_err(|_| DetspecError::EngineStopped)?
    }

    /// Per-position logits of each prompt, flattened `[len_i × vocab]`, on the verify-path
    /// kernels.
    pub fn prompt_logits(&self, prompts: Vec<Vec<u32>>) -> Result<Vec<Vec<f32>>> {
        self.with_core(move |c| c.prompt_logits(&prompts))
    }

    /// Replaces the named parameters (Hugging Face names) and returns the new model info.
    /// Every name, shape and dtype is checked before anything changes. Requests in flight
    /// finish on the old weights (`InFlight::Finish`: the update waits for them, and requests
    /// submitted meanwhile wait for the update) or are aborted (`InFlight::Abort`).
    /// A sparse model's experts may come fused, as a transformers `state_dict()` holds them
    /// ([`crate::model::unfuse_experts`]); a multimodal model's language model under its own
    /// prefix, Nemotron-H's under its own names ([`crate::model::engine_name`]).
    pub fn update_weights(&self, updates: Updates, in_flight: InFlight) -> Result<Arc<ModelInfo>> {
        let info = self.info();
        let updates = updates
            .into_iter()
            .map(|(n, t)| (crate::model::engine_name(&info.config, n), t))
            .collect();
        let updates = crate::model::unfuse_experts(&info.config, updates)?;
        let shapes: Vec<_> = updates
            .iter()
            .map(|(n, t)| (n.clone(), t.dims().to_vec(), t.dtype()))
            .collect();
        crate::model::check_update(&info.config, &shapes)?;
        let (tx, rx) = unbounded();
        self.send(Command::UpdateWeights {
            updates,
            in_flight,
            reply: tx,
        })?;
        rx.recv().map_err(|_| DetspecError::EngineStopped)?
    }

    /// Applies every parameter of this model that the safetensors checkpoint in `dir` holds
    /// (`model.safetensors` or a sharded index) as one update; see [`Engine::update_weights`].
    pub fn update_weights_from_disk(
        &self,
        dir: &Path,
        in_flight: InFlight,
    ) -> Result<Arc<ModelInfo>> {
        let info = self.info();
        let ck = crate::model::Checkpoint::open_for(dir, &info.config)?;
        let device = candle_core::Device::Cpu;
        let mut updates = Vec::new();
        // Each parameter, or the stacked experts a checkpoint holds in their place.
        let stacked = crate::model::fused_expert_shapes(&info.config);
        for (name, shape) in crate::model::param_shapes(&info.config)
            .into_iter()
            .chain(stacked)
        {
            if ck.contains(&name) {
                let t = ck.load(&name, &shape, candle_core::DType::F32, &device)?;
                updates.push((name, t));
            }
        }
        if updates.is_empty() {
            return Err(DetspecError::file(
                dir,
                "holds none of this model's parameters",
            ));
        }
        self.update_weights(updates, in_flight)
    }

    /// Applies every parameter of this model that the safetensors checkpoint in `dir` holds;
    /// with `complete`, the checkpoint must hold all of them (a tied model's `lm_head.weight`
    /// excepted), else the error names the first missing one and nothing changes.
    pub fn update_weights_from_checkpoint(
        &self,
        dir: &Path,
        in_flight: InFlight,
        complete: bool,
    ) -> Result<Arc<ModelInfo>> {
        if complete {
            let info = self.info();
            let cfg = &info.config;
            let ck = crate::model::Checkpoint::open_for(dir, cfg)?;
            let has = |name: &str| ck.contains(name);
            for name in crate::model::param_shapes(cfg).keys() {
                let optional = (name == "lm_head.weight" && cfg.tie_word_embeddings)
                    || crate::model::held_stacked(cfg, &has, name);
                if !optional && !ck.contains(name) {
                    return Err(DetspecError::MissingTensor {
                        name: name.clone(),
                        path: dir.to_path_buf(),
                    });
                }
            }
        }
        self.update_weights_from_disk(dir, in_flight)
    }

    /// Applies the tensors of a serialized safetensors buffer (the file format, in memory) as
    /// one update: every name, shape and dtype is checked before anything changes.
    pub fn update_weights_from_safetensors(
        &self,
        bytes: &[u8],
        in_flight: InFlight,
    ) -> Result<Arc<ModelInfo>> {
        let tensors = candle_core::safetensors::load_buffer(bytes, &candle_core::Device::Cpu)
            .map_err(|e| {
                DetspecError::param("body", format!("not a valid safetensors buffer: {e}"))
            })?;
        if tensors.is_empty() {
            return Err(DetspecError::param(
                "body",
                "the safetensors buffer holds no tensor",
            ));
        }
        let mut updates: Updates = tensors.into_iter().collect();
        updates.sort_by(|a, b| a.0.cmp(&b.0));
        self.update_weights(updates, in_flight)
    }

    /// Pauses generation: no new request (or standalone forward) starts until
    /// [`Engine::resume`]; `mode` says what happens to the requests in flight. Returns once
    /// the pause is in force (with [`PauseMode::Wait`], once the requests in flight are done).
    pub fn pause(&self, mode: PauseMode) -> Result<()> {
        let (tx, rx) = unbounded();
        self.send(Command::Pause { mode, reply: tx })?;
        rx.recv().map_err(|_| DetspecError::EngineStopped)?
    }

    /// Resumes generation after [`Engine::pause`]; held requests start. Fails while the KV
    /// memory is released.
    pub fn resume(&self) -> Result<()> {
        let (tx, rx) = unbounded();
        self.send(Command::Resume(tx))?;
        rx.recv().map_err(|_| DetspecError::EngineStopped)?
    }

    /// Whether generation is paused.
    pub fn is_paused(&self) -> bool {
        self.paused.load(Ordering::SeqCst)
    }

    /// Runs `f` on the engine thread between steps, even while generation is paused.
    fn control<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut EngineCore) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let (tx, rx) = unbounded();
        self.send(Command::Control(Box::new(move |core| {
            let _ = tx.send(f(core));
        })))?;
        rx.recv().map_err(|_| DetspecError::EngineStopped)?
    }

    /// Drops the prefix cache; returns how many cached pages it let go.
    pub fn reset_prefix_cache(&self) -> Result<usize> {
        self.control(|c| Ok(c.reset_prefix_cache()))
    }

    /// Frees the KV pool's memory. Generation must be paused with no request in flight;
    /// [`Engine::resume_kv_memory`] allocates it again (before [`Engine::resume`]).
    pub fn release_kv_memory(&self) -> Result<()> {
        let paused = self.paused.clone();
        self.control(move |c| {
            if !paused.load(Ordering::SeqCst) {
                return Err(DetspecError::param(
                    "tags",
                    "pause generation before releasing the KV cache",
                ));
            }
            c.release_kv_memory()
        })
    }

    /// Allocates the KV pool again after [`Engine::release_kv_memory`].
    pub fn resume_kv_memory(&self) -> Result<()> {
        self.control(|c| c.resume_kv_memory())
    }

    /// `(bytes the KV pool holds, whether it is released)`.
    pub fn kv_memory(&self) -> Result<(usize, bool)> {
        self.control(|c| Ok((c.kv_memory_bytes(), c.kv_memory_released())))
    }

    /// Stops the engine thread: in-flight requests end with reason `abort`; later calls fail
    /// with [`DetspecError::EngineStopped`]. Also done when the last handle is dropped.
    pub fn shutdown(&self) {
        self.shared.shutdown();
    }

    /// Engine-wide decode–verify–rollback and preemption counters.
    pub fn stats(&self) -> Result<EngineStats> {
        let (tx, rx) = unbounded();
        self.send(Command::Stats(tx))?;
        rx.recv().map_err(|_| DetspecError::EngineStopped)
    }

    /// KV page pool and prefix-cache statistics.
    pub fn kv_stats(&self) -> Result<KvStats> {
        let (tx, rx) = unbounded();
        self.send(Command::KvStats(tx))?;
        rx.recv().map_err(|_| DetspecError::EngineStopped)
    }

    /// `(free, total)` KV pages.
    pub fn kv_pages(&self) -> Result<(usize, usize)> {
        let (tx, rx) = unbounded();
        self.send(Command::KvPages(tx))?;
        rx.recv().map_err(|_| DetspecError::EngineStopped)
    }
}

/// The engine thread: drain commands (blocking when idle), step, route events.
///
/// A weight update waits until no request is in flight; while it waits, commands that would
/// compute with the weights (new requests, standalone forwards, other updates) are held back
/// and run after it, on the new weights.
fn engine_loop(
    mut core: EngineCore,
    commands: Receiver<Command>,
    shared_info: Arc<RwLock<Arc<ModelInfo>>>,
    shared_paused: Arc<AtomicBool>,
) {
    let mut routes = Routes::default();
    // The weights of an update waiting for the requests in flight, and its caller's reply.
    let mut pending: Option<(Updates, Reply<Arc<ModelInfo>>)> = None;
    let mut held: std::collections::VecDeque<Command> = Default::default();
    // Paused: new requests and standalone forwards are held. Frozen (PauseMode::Keep): no
    // step runs either. Pause callers waiting for the requests in flight to finish.
    let mut paused = false;
    let mut frozen = false;
    let mut pause_waiters: Vec<Reply<()>> = Vec::new();
    loop {
        if !core.has_work() {
            for w in pause_waiters.drain(..) {
                let _ = w.send(Ok(()));
            }
        }
        if !core.has_work() {
            if let Some((updates, reply)) = pending.take() {
                let r = core.update_weights(updates);
                if let Ok(info) = &r {
                    *shared_info.write().unwrap_or_else(|e| e.into_inner()) = info.clone();
                }
                let _ = reply.send(r);
            }
        }
        let replay_held = if pending.is_none() && !paused {
            std::mem::take(&mut held)
        } else {
            Default::default()
        };
        // Block for a command when idle; otherwise take whatever has arrived and step.
        let first = if (core.has_work() && !frozen) || !replay_held.is_empty() {
            commands.try_recv().ok()
        } else {
            match commands.recv() {
                Ok(c) => Some(c),
                Err(_) => break,
            }
        };
        let mut shutdown = false;
        for cmd in replay_held
            .into_iter()
            .chain(first)
            .chain(std::iter::from_fn(|| commands.try_recv().ok()))
        {
            let computes = matches!(
                cmd,
                Command::Add { .. } | Command::WithCore(_) | Command::UpdateWeights { .. }
            );
            let starts = matches!(cmd, Command::Add { .. } | Command::WithCore(_));
            if (pending.is_some() && computes) || (paused && starts) {
                held.push_back(cmd);
                continue;
            }
            match cmd {
                Command::Add {
                    request,
                    events,
                    arrival_time,
                    aborted,
                } => {
                    let id = request.request_id.clone();
                    // Only one it accepted: a refused duplicate id names another request.
                    let accepted = accept(&mut core, &mut routes, *request, events, arrival_time);
                    if aborted && accepted {
                        for ev in core.abort(&id) {
                            route(&mut routes, ev);
                        }
                    }
                }
                Command::Abort(id) => {
                    // A request held back (a pending weight update, a paused engine) never
                    // started: it is accepted now and aborted with the others, so it ends as
                    // any request aborted before its first step does (finish reason `abort`,
                    // no tokens), and a bad one still gets its error.
                    let (ours, others) = std::mem::take(&mut held).into_iter().partition(
                        |c| matches!(c, Command::Add { request, .. } if request.request_id == id),
                    );
                    held = others;
                    for cmd in ours {
                        accept_held(&mut core, &mut routes, cmd);
                    }
                    for ev in core.abort(&id) {
                        route(&mut routes, ev);
                    }
                }
                Command::WithCore(job) => job(&mut core),
                Command::UpdateWeights {
                    updates,
                    in_flight,
                    reply,
                } => {
                    if in_flight == InFlight::Abort {
                        for ev in core.abort_all() {
                            route(&mut routes, ev);
                        }
                    } else if frozen && core.has_work() {
                        let _ = reply.send(Err(DetspecError::param(
                            "in_flight",
                            "generation is paused with requests in flight (mode \"keep\"): \
                             they could not finish on the old weights; continue generation \
                             first or update with in_flight=\"abort\"",
                        )));
                        continue;
                    }
                    pending = Some((updates, reply));
                }
                Command::KvPages(reply) => {
                    let _ = reply.send(core.kv_pages());
                }
                Command::Stats(reply) => {
                    let mut stats = core.stats();
                    stats.weight_update_pending = pending.is_some();
                    let _ = reply.send(stats);
                }
                Command::KvStats(reply) => {
                    let _ = reply.send(core.kv_stats());
                }
                Command::Control(job) => job(&mut core),
                Command::Pause { mode, reply } => {
                    paused = true;
                    frozen = mode == PauseMode::Keep;
                    shared_paused.store(true, Ordering::SeqCst);
                    match mode {
                        PauseMode::Abort => {
                            for ev in core.abort_all() {
                                route(&mut routes, ev);
                            }
                            let _ = reply.send(Ok(()));
                        }
                        PauseMode::Wait if core.has_work() => pause_waiters.push(reply),
                        PauseMode::Wait | PauseMode::Keep => {
                            let _ = reply.send(Ok(()));
                        }
                    }
                }
                Command::Resume(reply) => {
                    if core.kv_memory_released() {
                        let _ = reply.send(Err(DetspecError::param(
                            "tags",
                            "the KV cache is released: resume its memory before continuing \
                             generation",
                        )));
                        continue;
                    }
                    paused = false;
                    frozen = false;
                    shared_paused.store(false, Ordering::SeqCst);
                    for w in pause_waiters.drain(..) {
                        let _ = w.send(Ok(()));
                    }
                    let _ = reply.send(Ok(()));
                }
                Command::Shutdown => shutdown = true,
            }
        }
        if shutdown {
            break;
        }
        if core.has_work() && !frozen {
            for ev in core.step() {
                route(&mut routes, ev);
            }
        }
    }
    // Requests held back (a paused engine, a pending weight update) were submitted before the
    // shutdown: accepted now, they end with the others, finish reason `abort` and no tokens.
    // Dropping `pending` and the other held commands drops their reply channels (callers see
    // `EngineStopped`).
    for cmd in held {
        accept_held(&mut core, &mut routes, cmd);
    }
    for ev in core.abort_all() {
        route(&mut routes, ev);
    }
    tracing::debug!("engine thread stopped");
}

/// Hands `request` to the core: its stream gets the core's `Accepted` (and a route for what
/// follows) or the error it was refused with. Whether it was accepted.
fn accept(
    core: &mut EngineCore,
    routes: &mut Routes,
    request: Request,
    events: Sender<StreamEvent>,
    arrival_time: f64,
) -> bool {
    let id = request.request_id.clone();
    match core.add_request(request, arrival_time) {
        Ok(ev) => {
            let n = match &ev {
                StreamEvent::Accepted { n, .. } => *n,
                _ => 1,
            };
            let _ = events.send(ev);
            routes.insert(id, (events, n));
            true
        }
        Err(error) => {
            tracing::debug!(request_id = %id, "rejected: {error}");
            let _ = events.send(StreamEvent::Failed {
                request_id: id,
                error,
            });
            false
        }
    }
}

/// [`accept`] of a held-back command that is a request (about to be aborted: at an abort of
/// its id, at shutdown); other commands are dropped (their reply channels with them).
fn accept_held(core: &mut EngineCore, routes: &mut Routes, cmd: Command) {
    if let Command::Add {
        request,
        events,
        arrival_time,
        ..
    } = cmd
    {
        accept(core, routes, *request, events, arrival_time);
    }
}

/// Where each live request's events go, and how many of its completions are unfinished.
type Routes = std::collections::HashMap<String, (Sender<StreamEvent>, usize)>;

/// Sends an event to its request's stream; forgets the route once the request is over.
fn route(routes: &mut Routes, ev: StreamEvent) {
    let id = ev.request_id().to_string();
    let ends_one = match &ev {
        StreamEvent::Failed { .. } => usize::MAX,
        StreamEvent::Tokens { finish_reason, .. } => usize::from(finish_reason.is_some()),
        StreamEvent::Accepted { .. } => 0,
    };
    let Some((tx, remaining)) = routes.get_mut(&id) else {
        return;
    };
    let _ = tx.send(ev);
    *remaining = remaining.saturating_sub(ends_one);
    if *remaining == 0 {
        routes.remove(&id);
    }
}
