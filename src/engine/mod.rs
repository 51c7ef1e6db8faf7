//! The engine: a thread that owns the model, the KV pool and the scheduler and runs the step
//! loop; requests arrive on a channel from any thread and each request's outputs leave on the
//! stream its submitter chose.
//!
//! The thread blocks on its command channel whenever there is no work, so an idle engine uses
//! no CPU. Dropping the last [`Engine`] handle shuts it down: in-flight requests finish with
//! reason `abort` and the thread is joined.

mod core;
mod stream;
mod text;

pub use self::core::{EngineCore, EngineStats, ModelInfo, KERNEL_VERSION};
pub use stream::{OutputAccumulator, RequestStream, StreamEvent};

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use candle_core::Device;
use crossbeam::channel::{unbounded, Receiver, Sender};

use crate::config::EngineConfig;
use crate::error::{DetspecError, Result};
use crate::kv::KvStats;
use crate::output::RequestOutput;
use crate::request::Request;
use crate::tokenizer::Tokenizer;

type Reply<T> = Sender<Result<T>>;

enum Command {
    Add {
        request: Request,
        events: Sender<StreamEvent>,
        arrival_time: f64,
    },
    Abort(String),
    PromptLogits(Vec<Vec<u32>>, Reply<Vec<Vec<Vec<f32>>>>),
    KvPages(Sender<(usize, usize)>),
    Stats(Sender<EngineStats>),
    KvStats(Sender<KvStats>),
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
    info: Arc<ModelInfo>,
    tokenizer: Option<Arc<Tokenizer>>,
}

impl Engine {
    /// Loads a Hugging Face model directory on the CPU and starts the engine thread.
    pub fn from_model_dir(dir: impl AsRef<Path>, cfg: EngineConfig) -> Result<Self> {
        Self::start(EngineCore::load(dir.as_ref(), cfg, &Device::Cpu)?)
    }

    /// Starts the engine thread around a loaded core.
    pub fn start(core: EngineCore) -> Result<Self> {
        let (tx, rx) = unbounded();
        let info = core.info().clone();
        let tokenizer = core.tokenizer().cloned();
        let pool = match core.num_threads() {
            Some(n) => Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .thread_name(|i| format!("detspec-worker-{i}"))
                    .build()
                    .map_err(|e| DetspecError::param("num_threads", e.to_string()))?,
            ),
            None => None,
        };
        let thread = std::thread::Builder::new()
            .name("detspec-engine".into())
            .spawn(move || match pool {
                Some(pool) => pool.install(|| engine_loop(core, rx)),
                None => engine_loop(core, rx),
            })
            .map_err(|e| DetspecError::io("detspec-engine thread", e))?;
        Ok(Self {
            shared: Arc::new(Shared {
                commands: tx,
                thread: Mutex::new(Some(thread)),
            }),
            info,
            tokenizer,
        })
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_deref()
    }

    pub fn fingerprint(&self) -> &str {
        &self.info.fingerprint
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
        self.send(Command::Add {
            request,
            events,
            arrival_time: stream::now(),
        })
    }

    /// Submits a request and returns its output stream.
    pub fn add_request(&self, request: Request) -> Result<RequestStream> {
        let (tx, rx) = unbounded();
        let id = request.request_id.clone();
        self.add_request_with_sender(request, tx)?;
        Ok(RequestStream::new(&id, rx))
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

    /// Per-position logits of each prompt, computed together in one flat forward pass.
    pub fn prompt_logits(&self, prompts: Vec<Vec<u32>>) -> Result<Vec<Vec<Vec<f32>>>> {
        let (tx, rx) = unbounded();
        self.send(Command::PromptLogits(prompts, tx))?;
        rx.recv().map_err(|_| DetspecError::EngineStopped)?
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
fn engine_loop(mut core: EngineCore, commands: Receiver<Command>) {
    let mut routes = Routes::default();
    loop {
        // Block for a command when idle; otherwise take whatever has arrived and step.
        let first = if core.has_work() {
            commands.try_recv().ok()
        } else {
            match commands.recv() {
                Ok(c) => Some(c),
                Err(_) => break,
            }
        };
        let mut shutdown = false;
        for cmd in first
            .into_iter()
            .chain(std::iter::from_fn(|| commands.try_recv().ok()))
        {
            match cmd {
                Command::Add {
                    request,
                    events,
                    arrival_time,
                } => {
                    let id = request.request_id.clone();
                    match core.add_request(request, arrival_time) {
                        Ok(ev) => {
                            let n = match &ev {
                                StreamEvent::Accepted { n, .. } => *n,
                                _ => 1,
                            };
                            let _ = events.send(ev);
                            routes.insert(id, (events, n));
                        }
                        Err(error) => {
                            tracing::debug!(request_id = %id, "rejected: {error}");
                            let _ = events.send(StreamEvent::Failed {
                                request_id: id,
                                error,
                            });
                        }
                    }
                }
                Command::Abort(id) => {
                    for ev in core.abort(&id) {
                        route(&mut routes, ev);
                    }
                }
                Command::PromptLogits(prompts, reply) => {
                    let _ = reply.send(core.prompt_logits(&prompts));
                }
                Command::KvPages(reply) => {
                    let _ = reply.send(core.kv_pages());
                }
                Command::Stats(reply) => {
                    let _ = reply.send(core.stats());
                }
                Command::KvStats(reply) => {
                    let _ = reply.send(core.kv_stats());
                }
                Command::Shutdown => shutdown = true,
            }
        }
        if shutdown {
            break;
        }
        if core.has_work() {
            for ev in core.step() {
                route(&mut routes, ev);
            }
        }
    }
    for ev in core.abort_all() {
        route(&mut routes, ev);
    }
    tracing::debug!("engine thread stopped");
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
