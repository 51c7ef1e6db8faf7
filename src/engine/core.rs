//! The synchronous engine core: model, KV pool, scheduler and the step function.
//!
//! One step: the scheduler plans → the model runs the flat batch → each sampled row goes
//! through the sampler → tokens are appended, finish conditions checked, finished sequences
//! released → one [`StreamEvent`] per sequence that produced tokens. The engine thread
//! ([`super::Engine`]) drives this; nothing here blocks or spawns.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device};
use rayon::prelude::*;

use crate::config::{
    device_label, device_memory, DeviceSpec, EngineConfig, KernelProfile, ModelConfig,
    DEFAULT_KV_CACHE_BYTES,
};
use crate::dvr::DeterminismPolicy;
use crate::error::{DetspecError, Result};
use crate::kv::{
    BlockTable, KvManager, KvPool, KvStats, LayerCacheShape, PageAllocator, SequenceStates,
    StatePool,
};
use crate::model::{ForwardBatch, Model};
use crate::ops;
use crate::ops::{AttentionMetadata, AttentionSchedule};
use crate::output::{FinishReason, RequestMetrics, StopReason, TokenLogprobs};
use crate::request::{Prompt, Request};
use crate::sampling::{self, Grammars, SamplingParams};
use crate::sched::{PlanEntry, Scheduler, SchedulerLimits, Sequence, SequenceId, StepPlan};
use crate::tokenizer::{eos_token_ids, Tokenizer};

use super::fingerprint::{self, fingerprint_of};
use super::stream::{now, StreamEvent};
use super::text::TextState;

mod caching;
mod control;
mod masks;
mod standalone;

pub use standalone::{
    AuditInput, Classification, EmbedOptions, ForwardKind, Pooling, Scopes, SeqScope,
};

/// What the engine knows about a model once loaded; shared read-only with API handles.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub config: ModelConfig,
    pub max_model_len: usize,
    pub eos_token_ids: Vec<u32>,
    pub fingerprint: String,
    pub model_dir: PathBuf,
    /// How many weight updates the engine has applied since it loaded `model_dir`.
    pub weight_version: u64,
    /// The weights' and the KV cache's dtypes as resolved at load (`auto` included).
    pub dtype: DType,
    pub kv_dtype: DType,
}

/// Per-sequence state that is not the scheduler's business.
struct SeqExtra {
    text: Option<TextState>,
    first_scheduled_time: Option<f64>,
    first_token_time: Option<f64>,
}

/// Engine-wide decode–verify–rollback counters.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    pub verify_passes: usize,
    pub rollbacks: usize,
    pub rolled_back_tokens: usize,
    /// Verify-pass rows that carried no real token (window and group padding).
    pub padded_rows: usize,
    pub preemptions: usize,
    /// A weight update is waiting for the requests in flight to finish.
    pub weight_update_pending: bool,
    /// Steps that ran a forward (the engine's step clock).
    pub steps: u64,
    /// Where those steps spent their time.
    pub times: StepTimes,
}

/// Wall time of the engine's steps by phase, summed. On a GPU the forward's kernels run
/// asynchronously: `forward` is the time to issue them (the host's share), and the wait for
/// them lands in `sample`, which starts with copying the logits to the host.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimes {
    /// Building the batch and issuing the forward(s), seconds.
    pub forward_s: f64,
    /// Waiting for the logits, copying them to the host and sampling every row, seconds.
    pub sample_s: f64,
    /// Verify passes with their accept and rollback, seconds.
    pub verify_s: f64,
}

/// Model + KV + scheduler; runs one step at a time.
pub struct EngineCore {
    model: Model,
    tokenizer: Option<Arc<Tokenizer>>,
    /// Compiles structured-output constraints over the tokenizer's vocabulary.
    grammars: Arc<Grammars>,
    kv: KvPool,
    alloc: Arc<KvManager>,
    cfg: EngineConfig,
    info: Arc<ModelInfo>,
    sched: Scheduler,
    extra: HashMap<SequenceId, SeqExtra>,
    next_seq_id: SequenceId,
    /// What deterministic requests get: every determinism decision of a step is one of its
    /// hooks.
    policy: DeterminismPolicy,
    preemptions: usize,
    times: StepTimes,
    /// Steps run so far (the clock of `verify_finish_wait`).
    steps: u64,
    /// The fingerprint after the weights hash: dtype, device, kernels, determinism.
    fingerprint_tail: String,
}

/// The config field and why, where a model needs what the CUDA kernels lack: the rope
/// kernels rotate whole heads in halves (GLM's and ERNIE's pair neighbours, Phi-4-mini's and
/// GLM's rotate part of each head); the attention kernel has no sinks and the elementwise
/// ones no clamped SwiGLU (gpt-oss); there is no short-convolution kernel (LFM2).
fn cuda_lacks(cfg: &ModelConfig) -> Option<(&'static str, String)> {
    if cfg.architecture.ungated_mlp() == Some(crate::config::UngatedMlp::Xielu) {
        return Some((
            "hidden_act",
            format!("{:?}'s xielu has no CUDA kernel", cfg.architecture),
        ));
    }
    if cfg.short_conv.is_some() {
        return Some((
            "layer_types",
            "LFM2's short convolutions have no CUDA kernel".into(),
        ));
    }
    if cfg.linear_attention.is_some() {
        return Some((
            "layer_types",
            "the linear attention of Qwen3-Next and Qwen3.5 (gated DeltaNet) has no CUDA kernel"
                .into(),
        ));
    }
    if cfg.mamba.is_some() {
        return Some((
            "layer_types",
            "Granite 4.0-H's Mamba2 layers have no CUDA kernel".into(),
        ));
    }
    if cfg.mla.is_some() {
        return Some((
            "architectures",
            format!(
                "{:?}'s latent attention runs on the CPU only (never run on a GPU)",
                cfg.architecture
            ),
        ));
    }
    if cfg.architecture.has_attention_sinks() {
        return Some((
            "architectures",
            format!(
                "{:?}'s attention sinks and clamped SwiGLU experts have no CUDA kernels",
                cfg.architecture
            ),
        ));
    }
    if cfg.architecture.rope_interleaved() {
        return Some((
            "architectures",
            format!(
                "{:?} pairs neighbouring dimensions in its rope: the CUDA rope kernels pair halves",
                cfg.architecture
            ),
        ));
    }
    (cfg.rotary_dim != cfg.head_dim).then(|| {
        (
            "partial_rotary_factor",
            format!(
                "rotates {} of each head's {} dimensions: the CUDA rope kernels rotate whole heads",
                cfg.rotary_dim, cfg.head_dim
            ),
        )
    })
}

impl EngineCore {
    /// Loads a Hugging Face model directory on `device`.
    pub fn load(dir: &Path, cfg: EngineConfig, device: &Device) -> Result<Self> {
        cfg.validate()?;
        if !dir.is_dir() {
            return Err(DetspecError::io(
                dir,
                std::io::Error::new(std::io::ErrorKind::NotFound, "model directory not found"),
            ));
        }
        let mut model_cfg = ModelConfig::from_model_dir(dir)?;
        let tokenizer = if dir.join("tokenizer.json").exists() {
            Some(Arc::new(Tokenizer::from_model_dir(dir)?))
        } else {
            tracing::warn!(
                "{} has no tokenizer.json: only token-id prompts will work",
                dir.display()
            );
            None
        };
        let mut eos = eos_token_ids(dir, tokenizer.as_deref())?;
        for id in &model_cfg.eos_token_ids {
            if !eos.contains(id) {
                eos.push(*id);
            }
        }
        let max_model_len = match cfg.max_model_len {
            Some(n) if n > model_cfg.max_context() => {
                return Err(DetspecError::param(
                    "max_model_len",
                    format!(
                        "{n} exceeds the model's context ({}: max_position_embeddings, \
                         times the factor under YaRN rope scaling)",
                        model_cfg.max_context()
                    ),
                ))
            }
            Some(n) => n,
            None => model_cfg.max_context(),
        };
        model_cfg.serve_up_to(max_model_len);
        let model_digest = fingerprint::model_digest(&model_cfg, dir, &eos)?;
        let device_spec = if device.is_cpu() {
            DeviceSpec::Cpu
        } else {
            cfg.device
        };
        if let Some((field, message)) = (!device.is_cpu()).then(|| cuda_lacks(&model_cfg)).flatten()
        {
            return Err(DetspecError::InvalidConfig {
                path: model_cfg.path.clone(),
                field: field.into(),
                message: format!("{message} (this model runs on the CPU)"),
            });
        }
        let dtype = cfg
            .dtype
            .resolve(device_spec, model_cfg.torch_dtype.as_deref())?;
        if !device.is_cpu() && cfg.kernel_profile != KernelProfile::Invariant {
            return Err(DetspecError::param(
                "kernel_profile",
                "selects the CPU GEMMs' profile; on a GPU the vendor library picks kernels by shape",
            ));
        }
        let kv_dtype = cfg.kv_cache_dtype.resolve_kv(device_spec, dtype)?;
        // Recurrent states come out of the KV budget (at most half of it), pages get the rest.
        let budget = cfg.kv_cache_bytes.unwrap_or(DEFAULT_KV_CACHE_BYTES);
        let cache_shapes = LayerCacheShape::of_model(&model_cfg);
        let per_page = KvPool::bytes_per_page(&cache_shapes, cfg.page_size, kv_dtype);
        let state_bytes = LayerCacheShape::state_bytes(&cache_shapes);
        let state_slots = StatePool::capacity_within(state_bytes, budget, cfg.max_num_seqs)?;
        let states_total = state_slots * state_bytes;
        let kv_bytes = cfg.num_kv_pages.map_or(budget, |n| {
            n.saturating_mul(per_page).saturating_add(states_total)
        });
        let act = cfg
            .activation_dtype
            .resolve(device_spec, dtype, cfg.kernel_profile)?;
        let keeps_quantized = crate::model::keeps_quantized(device, act);
        crate::model::check_fits(
            dir,
            &model_cfg,
            dtype,
            keeps_quantized,
            kv_bytes as u64,
            device,
        )?;
        let model = Model::load_with(dir, model_cfg, device, dtype, act)?
            .with_kernel_profile(cfg.kernel_profile);
        let mc = model.config().clone();
        let num_pages = match cfg.num_kv_pages {
            Some(n) => n,
            None => {
                let bytes = kv_budget(&cfg, &mc, dtype, device)?.saturating_sub(states_total);
                (bytes / per_page).max(1)
            }
        };
        let kv = KvPool::new(cache_shapes, num_pages, cfg.page_size, kv_dtype, device)?;
        if state_slots > 0 {
            kv.states().set_capacity(state_slots);
            tracing::info!(
                "recurrent states: {state_slots} of {} each ({} of the KV budget); \
                 a sequence holds one, two under replay",
                crate::error::gib(state_bytes as u64),
                crate::error::gib(states_total as u64)
            );
        }
        let alloc = Arc::new(KvManager::new(
            num_pages,
            cfg.page_size,
            cfg.enable_prefix_caching,
        )?);
        let pad_page = alloc
            .reserve_pinned(1)
            .ok()
            .and_then(|p| p.first().copied())
            .ok_or_else(|| {
                DetspecError::param("num_kv_pages", "the pool needs at least 2 pages")
            })?;
        // The CPU's packed GEMM is proven batch- and position-invariant (tests/gemm.rs), unless
        // the shape-dependent test profile stands in for a GPU's.
        let invariant_gemms = device.is_cpu() && cfg.kernel_profile == KernelProfile::Invariant;
        let policy = DeterminismPolicy::new(&cfg, invariant_gemms, mc.sliding_window, pad_page)?;
        // The KV cache's dtype is named only where it differs from the weights'.
        let dtypes = if kv_dtype == dtype {
            dtype.as_str().to_string()
        } else {
            format!("{}-kv{}", dtype.as_str(), kv_dtype.as_str())
        };
        let fingerprint_tail = fingerprint::tail(
            model_digest,
            &dtypes,
            &device_label(device),
            cfg.kernel_profile,
            act,
            policy.label(),
        );
        let fingerprint = fingerprint_of(model.weights_hash(), &fingerprint_tail);
        let sched = Scheduler::new(SchedulerLimits {
            max_num_seqs: cfg.max_num_seqs,
            max_num_batched_tokens: cfg.max_num_batched_tokens,
            page_size: cfg.page_size,
            max_prefill_chunk: cfg.max_prefill_chunk.unwrap_or(cfg.max_num_batched_tokens),
            isolate_deterministic_prefill: policy.isolates_deterministic_prefill(),
            defer_shared_prefills: cfg.enable_prefix_caching,
        });
        tracing::info!(model = %dir.display(), num_pages, page_size = cfg.page_size, "engine loaded");
        let grammars = Arc::new(Grammars::new(tokenizer.clone(), mc.vocab_size, eos.clone()));
        Ok(Self {
            info: Arc::new(ModelInfo {
                config: mc,
                max_model_len,
                eos_token_ids: eos,
                fingerprint,
                model_dir: dir.to_path_buf(),
                weight_version: 0,
                dtype,
                kv_dtype,
            }),
            fingerprint_tail,
            model,
            tokenizer,
            grammars,
            kv,
            alloc,
            cfg,
            sched,
            extra: HashMap::new(),
            next_seq_id: 0,
            policy,
            preemptions: 0,
            times: StepTimes::default(),
            steps: 0,
        })
    }

    pub fn info(&self) -> &Arc<ModelInfo> {
        &self.info
    }

    pub fn tokenizer(&self) -> Option<&Arc<Tokenizer>> {
        self.tokenizer.as_ref()
    }

    /// `(max_loras, max_lora_rank)` of its config.
    pub fn lora_limits(&self) -> (usize, usize) {
        (self.cfg.max_loras, self.cfg.max_lora_rank)
    }

    /// The loaded model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn grammars(&self) -> &Arc<Grammars> {
        &self.grammars
    }

    /// Free and total KV pages (the reserved verify page counts as free: it is always there).
    pub fn kv_pages(&self) -> (usize, usize) {
        (self.alloc.num_free() + 1, self.alloc.num_total())
    }

    pub fn stats(&self) -> EngineStats {
        let v = self.policy.verify_stats();
        EngineStats {
            verify_passes: v.verify_passes,
            rollbacks: v.rollbacks,
            rolled_back_tokens: v.rolled_back_tokens,
            padded_rows: v.padded_rows,
            preemptions: self.preemptions,
            weight_update_pending: false,
            steps: self.steps,
            times: self.times,
        }
    }

    /// Page pool and prefix-cache statistics.
    pub fn kv_stats(&self) -> KvStats {
        let states = self.kv.states();
        KvStats {
            state_slots: if states.is_used() {
                states.capacity()
            } else {
                0
            },
            states_held: states.num_held(),
            state_snapshots: states.num_snapshots(),
            ..self.alloc.stats()
        }
    }

    /// Replaces the named parameters (HF names; values in any float dtype) between steps.
    /// Checks every name, shape and dtype before changing anything. The prefix cache is
    /// dropped (its KV was computed with the old weights), the weight version bumped, and the
    /// fingerprint moved to the new weights' content hash, so restoring old weights restores
    /// the old fingerprint. Call it with no request in flight: running sequences' KV would mix
    /// both weights.
    pub fn update_weights(
        &mut self,
        updates: Vec<(String, candle_core::Tensor)>,
    ) -> Result<Arc<ModelInfo>> {
        if self.has_work() {
            return Err(DetspecError::param(
                "named_tensors",
                "weights can only change with no request in flight",
            ));
        }
        let hash = self.model.set_params(updates)?;
        self.clear_cached_prefixes();
        let mut info = (*self.info).clone();
        info.fingerprint = fingerprint_of(hash, &self.fingerprint_tail);
        info.weight_version += 1;
        self.info = Arc::new(info);
        Ok(self.info.clone())
    }

    pub fn num_threads(&self) -> Option<usize> {
        self.cfg.num_threads
    }

    pub fn has_work(&self) -> bool {
        self.sched.has_work()
    }

    pub fn num_running(&self) -> usize {
        self.sched.num_running()
    }

    /// What a request is checked against (see [`super::validate`]).
    pub fn request_rules(&self) -> super::validate::RequestRules {
        super::validate::RequestRules {
            vocab_size: self.info.config.vocab_size,
            max_model_len: self.info.max_model_len,
            max_pages: self.alloc.num_total().saturating_sub(1),
            page_size: self.cfg.page_size,
            determinism: self.cfg.determinism,
            max_logprobs: self.cfg.max_logprobs.unwrap_or(self.info.config.vocab_size),
        }
    }

    /// `params.bad_words` as the sampler bans them ([`sampling::bad_words::tokenize`]).
    pub(super) fn bad_words_token_ids(&self, params: &SamplingParams) -> Result<Vec<Vec<u32>>> {
        if params.bad_words.is_empty() {
            return Ok(Vec::new());
        }
        let tokenizer = self.tokenizer.as_ref().ok_or_else(|| {
            DetspecError::param(
                "bad_words",
                "needs a tokenizer, and this model has none (tokenizer.json)",
            )
        })?;
        let ids = sampling::bad_words::tokenize(&params.bad_words, tokenizer)?;
        super::validate::check_token_ids(&ids.concat(), self.info.config.vocab_size, "bad_words")?;
        Ok(ids)
    }

    /// Validates and tokenizes a request, queues its `n` sequences, and returns the
    /// `Accepted` event for its stream.
    pub fn add_request(&mut self, req: Request, arrival_time: f64) -> Result<StreamEvent> {
        let rid = req.request_id.clone();
        let invalid = |message: String| DetspecError::InvalidRequest {
            request_id: Some(rid.clone()),
            message,
        };
        if self.sched.iter().any(|s| s.request_id == rid) {
            return Err(super::validate::duplicate_request_id(&rid));
        }
        self.require_language_model("generation")?;
        let rules = self.request_rules();
        rules.check_params(&req.params)?;
        let mut req = req;
        req.params.bad_words_token_ids = self.bad_words_token_ids(&req.params)?;
        let cache_salt = super::validate::cache_salt_hash(req.cache_salt.as_deref())?;
        let deterministic = self.policy.admit(&req.params)?;
        let constraint = req
            .params
            .structured_outputs
            .as_ref()
            .map(|so| self.grammars.compile(so))
            .transpose()?;
        let (prompt_text, prompt) = match req.prompt {
            Prompt::Text(t) => {
                let tok = self.tokenizer.as_ref().ok_or_else(|| {
                    invalid(format!(
                        "text prompt given but the model has no tokenizer ({} is missing); pass token ids",
                        self.info.model_dir.join("tokenizer.json").display()
                    ))
                })?;
                let ids = tok.encode(&t, true)?;
                (Some(t), ids)
            }
            Prompt::Tokens(ids) => (None, ids),
        };
        rules.check_prompt(&prompt, "prompt")?;
        let max_model_len = self.info.max_model_len;
        let max_len = (prompt.len() + req.params.max_tokens).min(max_model_len);
        let base_seed = req
            .params
            .seed
            .unwrap_or_else(sampling::request_seed_from_entropy);
        for index in 0..req.params.n {
            let id = self.next_seq_id;
            self.next_seq_id += 1;
            self.extra.insert(
                id,
                SeqExtra {
                    text: self
                        .tokenizer
                        .as_ref()
                        .map(|_| TextState::new(&prompt, &req.params)),
                    first_scheduled_time: None,
                    first_token_time: None,
                },
            );
            self.sched.add(Sequence {
                id,
                request_id: rid.clone(),
                completion_index: index,
                prompt: prompt.clone(),
                output: Vec::new(),
                logprobs: Vec::new(),
                params: req.params.clone(),
                seed: sampling::completion_seed(base_seed, index),
                num_computed: 0,
                block_table: BlockTable::new(),
                finish: None,
                stop_reason: None,
                max_len,
                num_preemptions: 0,
                num_cached_tokens: 0,
                deterministic,
                verified: 0,
                emitted: 0,
                dvr: Default::default(),
                constraint: constraint.clone(),
                lora: req.lora.clone(),
                cache_salt,
                states: self.kv.states().is_used().then(|| {
                    SequenceStates::new(self.kv.states(), self.policy.speculates(deterministic))
                }),
                shared_prefix: 0,
            });
        }
        Ok(StreamEvent::Accepted {
            request_id: rid,
            prompt: prompt_text,
            prompt_token_ids: prompt,
            n: req.params.n,
            fingerprint: match &req.lora {
                Some(a) => fingerprint::with_adapter(&self.info.fingerprint, a.content_hash()),
                None => self.info.fingerprint.clone(),
            },
            arrival_time,
        })
    }

    /// Aborts every sequence of `request_id`; returns the final events (reason `abort`).
    pub fn abort(&mut self, request_id: &str) -> Vec<StreamEvent> {
        let removed = self
            .sched
            .remove_where(self.alloc.as_ref(), |s| s.request_id == request_id);
        removed
            .into_iter()
            .map(|mut s| {
                s.finish = Some(FinishReason::Abort);
                let extra = self.extra.remove(&s.id);
                // Events carry deltas: the abort adds nothing to what was streamed.
                Self::event(&s, s.emitted, String::new(), extra.as_ref())
            })
            .collect()
    }

    /// Aborts everything (engine shutdown).
    pub fn abort_all(&mut self) -> Vec<StreamEvent> {
        let ids: Vec<String> = self.sched.iter().map(|s| s.request_id.clone()).collect();
        let mut events = Vec::new();
        for id in ids {
            events.extend(self.abort(&id));
        }
        events
    }

    /// A `Tokens` event with `seq`'s tokens from output index `from`.
    fn event(
        seq: &Sequence,
        from: usize,
        text_delta: String,
        extra: Option<&SeqExtra>,
    ) -> StreamEvent {
        StreamEvent::Tokens {
            request_id: seq.request_id.clone(),
            index: seq.completion_index,
            token_ids: seq
                .output
                .get(from..seq.emitted)
                .unwrap_or_default()
                .to_vec(),
            logprobs: seq
                .logprobs
                .get(from..seq.emitted)
                .unwrap_or_default()
                .to_vec(),
            text_delta,
            finish_reason: seq.finish,
            stop_reason: seq.stop_reason.clone(),
            metrics: RequestMetrics {
                first_scheduled_time: extra.and_then(|e| e.first_scheduled_time),
                first_token_time: extra.and_then(|e| e.first_token_time),
                finished_time: seq.finish.map(|_| now()),
                num_preemptions: seq.num_preemptions,
                num_cached_tokens: seq.num_cached_tokens,
                num_verify_passes: seq.dvr.verify_passes,
                num_rollbacks: seq.dvr.rollbacks,
                num_rolled_back_tokens: seq.dvr.rolled_back_tokens,
                num_padded_rows: seq.dvr.padded_rows,
                ..Default::default()
            },
        }
    }

    /// Runs one step and returns the events it produced.
    pub fn step(&mut self) -> Vec<StreamEvent> {
        let (kv, states) = (self.alloc.clone(), self.kv.states().clone());
        let policy = &self.policy;
        let mut plan = self.sched.plan(self.alloc.as_ref(), &|seq, tokens| {
            let scope = (policy.page_class(seq), seq.cache_namespace());
            caching::cached_prefix(&kv, &states, scope, tokens)
        });
        for &id in &plan.preempted {
            if let Some(seq) = self.sched.find_mut(id) {
                self.policy.on_preempt(seq);
            }
        }
        let mut events = Vec::new();
        for (seq, err) in plan.failed.drain(..) {
            self.extra.remove(&seq.id);
            events.push(StreamEvent::Failed {
                request_id: seq.request_id,
                error: err,
            });
        }
        self.preemptions += plan.preempted.len();
        if plan.is_empty() {
            // Only sequences waiting for their final verify pass (or nothing) are left.
            match self.verify_and_emit(Vec::new()) {
                Ok(mut evs) => events.append(&mut evs),
                Err(err) => events.extend(self.fail_step(Vec::new(), &err)),
            }
            return events;
        }
        self.steps += 1;
        let t = now();
        for e in plan.entries.iter().chain(&plan.isolated) {
            if let Some(x) = self.extra.get_mut(&e.seq) {
                x.first_scheduled_time.get_or_insert(t);
            }
        }
        match self.run_plan(&plan) {
            Ok(mut evs) => events.append(&mut evs),
            Err(err) => {
                let ids = plan.entries.iter().chain(&plan.isolated).map(|e| e.seq);
                events.extend(self.fail_step(ids.collect(), &err));
            }
        }
        events
    }

    /// A failed forward concerns exactly the sequences in the step: `ids` and those waiting
    /// for a verify pass (which may have been part of it). They fail; the rest keep going.
    fn fail_step(&mut self, mut ids: Vec<SequenceId>, err: &DetspecError) -> Vec<StreamEvent> {
        tracing::error!("step failed: {err}");
        ids.extend(
            self.sched
                .running()
                .iter()
                .filter(|s| s.finish.is_some())
                .map(|s| s.id),
        );
        ids.sort_unstable();
        ids.dedup();
        let message = format!("step failed: {err}");
        let failed = ids
            .into_iter()
            .map(|id| {
                let error = DetspecError::InvalidRequest {
                    request_id: None,
                    message: message.clone(),
                };
                (id, error)
            })
            .collect();
        self.fail_sequences(failed)
    }

    fn run_plan(&mut self, plan: &StepPlan) -> Result<Vec<StreamEvent>> {
        let started = Instant::now();
        let snapshots = self.plan_snapshots(plan);
        let shared = if plan.entries.is_empty() {
            None
        } else {
            let (mut batch, ids) = self.build_batch(&plan.entries, &snapshots)?;
            let deterministic = plan
                .entries
                .iter()
                .map(|e| self.sched.get(e.seq).is_some_and(|s| s.deterministic));
            self.policy.prepare_shared_batch(&mut batch, deterministic);
            Some((batch, ids))
        };
        let isolated = (!plan.isolated.is_empty())
            .then(|| self.build_batch(&plan.isolated, &snapshots))
            .transpose()?;
        let sampling_ids: Vec<SequenceId> = shared
            .iter()
            .chain(&isolated)
            .flat_map(|(_, ids)| ids.iter().copied())
            .collect();
        let (forwards, masks) =
            self.forward_with_masks(&sampling_ids, |core| core.run_forwards(shared, isolated));
        let forwards = forwards?;
        self.times.forward_s += started.elapsed().as_secs_f64();
        let sampling_started = Instant::now();
        self.sched.mark_computed(plan);
        self.keep_snapshots(snapshots);
        self.cache_prompt_pages(plan);
        let eos = self.info.eos_token_ids.clone();
        let sched = &self.sched;
        // Each row's sample depends only on its own logits, mask and (seed, position); rows
        // are read in place from the logits tensor.
        let mut sampled: Vec<SequenceId> = Vec::new();
        let mut samples: Vec<Result<TokenLogprobs>> = Vec::new();
        for (ids, logits) in &forwards {
            if ids.is_empty() {
                continue;
            }
            let vocab = logits.dim(1)?;
            let rows = ops::with_f32_values(logits, |values| {
                values
                    .par_chunks(vocab)
                    .zip(ids.par_iter())
                    .filter(|(_, id)| !masks.failed(**id))
                    .map(|(row, id)| {
                        let seq = sched.get(*id).ok_or_else(|| DetspecError::InvalidRequest {
                            request_id: None,
                            message: format!("sampled sequence {id} is not running"),
                        })?;
                        sampling::sample_next(
                            &seq.params,
                            seq.seed,
                            &seq.prompt,
                            &seq.output,
                            row,
                            &eos,
                            masks.get(*id),
                        )
                    })
                    .collect::<Vec<_>>()
            })?;
            sampled.extend(ids.iter().filter(|id| !masks.failed(**id)));
            samples.extend(rows);
        }
        self.times.sample_s += sampling_started.elapsed().as_secs_f64();
        let mut events = self.fail_sequences(masks.into_failures());
        let t = now();
        let mut touched: Vec<SequenceId> = Vec::with_capacity(sampled.len());
        for (id, lp) in sampled.iter().zip(samples) {
            let lp = lp?;
            let Some(seq) = self.sched.get_mut(*id) else {
                continue;
            };
            seq.output.push(lp.token);
            seq.logprobs.push(lp);
            self.policy.after_sample(seq);
            if seq.finish.is_none() {
                if let Some((reason, stop)) = seq.finish_at(seq.output.len() - 1, &eos) {
                    seq.finish = Some(reason);
                    seq.stop_reason = stop;
                }
            }
            if let Some(x) = self.extra.get_mut(id) {
                x.first_token_time.get_or_insert(t);
            }
            touched.push(*id);
        }
        for e in plan.entries.iter().chain(&plan.isolated) {
            if let Some(seq) = self.sched.get(e.seq) {
                self.policy.commit_state(seq)?;
            }
        }
        events.extend(self.verify_and_emit(touched)?);
        Ok(events)
    }

    /// The forwards of a step: the shared batch, then the isolated deterministic prefills.
    /// Returns (sequences that sample, their logits `[sequences, vocab]`) of each.
    fn run_forwards(
        &self,
        shared: Option<(ForwardBatch, Vec<SequenceId>)>,
        isolated: Option<(ForwardBatch, Vec<SequenceId>)>,
    ) -> Result<Vec<(Vec<SequenceId>, candle_core::Tensor)>> {
        let mut forwards = Vec::with_capacity(2);
        if let Some((batch, ids)) = shared {
            forwards.push((ids, self.model.forward(&batch, &self.kv)?));
        }
        if let Some((batch, ids)) = isolated {
            // Apart from the shared batch, on invariant kernels: each row a pure function of
            // its own prompt.
            let mut sampled = Vec::with_capacity(ids.len());
            for (pass, rows) in self.policy.isolated_prefill_passes(batch) {
                let logits = self.model.forward(&pass, &self.kv)?;
                for row in rows {
                    sampled.push(logits.narrow(0, row, 1)?);
                }
            }
            if !sampled.is_empty() {
                forwards.push((ids, candle_core::Tensor::cat(&sampled, 0)?));
            }
        }
        Ok(forwards)
    }

    /// Fails single sequences (a request whose own input broke, e.g. its grammar); the rest
    /// of the step goes on.
    fn fail_sequences(&mut self, failed: Vec<(SequenceId, DetspecError)>) -> Vec<StreamEvent> {
        let mut events = Vec::new();
        for (id, error) in failed {
            tracing::warn!("sequence {id} failed: {error}");
            let removed = self.sched.remove_where(self.alloc.as_ref(), |s| s.id == id);
            if let Some(s) = removed.into_iter().next() {
                self.extra.remove(&s.id);
                events.push(StreamEvent::Failed {
                    request_id: s.request_id,
                    error,
                });
            }
        }
        events
    }

    /// Runs due verify passes, emits the committed tokens of `touched` and of every verified
    /// sequence, and releases finished sequences.
    fn verify_and_emit(&mut self, mut touched: Vec<SequenceId>) -> Result<Vec<StreamEvent>> {
        let eos = self.info.eos_token_ids.clone();
        let (model, kv) = (&self.model, &self.kv);
        let mut forward = |batch: &ForwardBatch, rows: &[u32]| -> Result<Vec<f32>> {
            let logits = model.forward(batch, kv)?;
            if rows.is_empty() {
                return Ok(Vec::new());
            }
            // Every row, in order (the real rows are all the logit rows unless the pass
            // projects its padding): no selection to make.
            let all = rows.len() == logits.dim(0)?
                && rows.iter().enumerate().all(|(i, &r)| i == r as usize);
            if all {
                return Ok(ops::to_f32_vec(&logits)?);
            }
            // Selecting rows copies them: their bits are those the pass computed.
            let ids = candle_core::Tensor::from_slice(rows, rows.len(), logits.device())?;
            Ok(ops::to_f32_vec(&logits.index_select(&ids, 0)?)?)
        };
        let started = Instant::now();
        touched.extend(self.policy.after_step(
            &mut self.sched,
            self.alloc.as_ref(),
            self.steps,
            &eos,
            &mut forward,
        )?);
        self.times.verify_s += started.elapsed().as_secs_f64();
        touched.sort_unstable();
        touched.dedup();
        let mut events = Vec::with_capacity(touched.len());
        for id in touched {
            if let Some(ev) = self.emit(id, &eos)? {
                events.push(ev);
            }
        }
        self.cache_output_pages();
        for s in self.sched.take_finished(self.alloc.as_ref()) {
            self.extra.remove(&s.id);
        }
        Ok(events)
    }

    /// Emits a sequence's newly committed tokens: text, stop strings and finish checks run on
    /// committed tokens only, in order.
    fn emit(&mut self, id: SequenceId, eos: &[u32]) -> Result<Option<StreamEvent>> {
        let Some(seq) = self.sched.get_mut(id) else {
            return Ok(None);
        };
        let from = seq.emitted;
        let tok = self.tokenizer.as_deref();
        let mut extra = self.extra.get_mut(&id);
        let mut delta = String::new();
        let mut finish: Option<(FinishReason, Option<StopReason>)> = None;
        let mut idx = from;
        while idx < seq.verified {
            let token = seq.output[idx];
            if let (Some(tok), Some(ts)) = (tok, extra.as_mut().and_then(|x| x.text.as_mut())) {
                let up = ts.push(tok, token, idx + 1 >= seq.params.min_tokens)?;
                delta.push_str(&up.delta);
                if let Some(stop) = up.stop {
                    finish = Some((FinishReason::Stop, Some(StopReason::Text(stop))));
                }
            }
            if finish.is_none() {
                finish = seq.finish_at(idx, eos);
            }
            idx += 1;
            if finish.is_some() {
                break;
            }
        }
        if let Some((_, stop)) = &finish {
            if !matches!(stop, Some(StopReason::Text(_))) {
                if let (Some(tok), Some(ts)) = (tok, extra.as_mut().and_then(|x| x.text.as_mut())) {
                    delta.push_str(&ts.finish(tok)?);
                }
            }
        }
        self.policy
            .settle_finish(seq, finish.map(|(reason, stop)| (idx, reason, stop)));
        seq.emitted = idx.max(seq.emitted);
        let finished = seq.finish.is_some() && seq.verified == seq.output.len();
        if idx == from && !finished {
            return Ok(None);
        }
        let seq: &Sequence = seq;
        Ok(Some(Self::event(seq, from, delta, self.extra.get(&id))))
    }

    /// Builds the flat batch for a plan; returns it with the ids of the sampled sequences.
    fn build_batch(
        &self,
        entries: &[PlanEntry],
        snapshots: &[caching::PendingSnapshot],
    ) -> Result<(ForwardBatch, Vec<SequenceId>)> {
        let ps = self.cfg.page_size;
        let mut batch = ForwardBatch {
            attention: AttentionMetadata {
                sliding_window: self.info.config.sliding_window,
                schedule: AttentionSchedule::split_kv_for_batch(
                    entries.len(),
                    entries.iter().map(|e| e.len).sum(),
                    (
                        self.info.config.num_attention_heads,
                        self.info.config.num_key_value_heads,
                    ),
                    self.model.device(),
                ),
                ..Default::default()
            },
            ..Default::default()
        };
        let mut sampled = Vec::new();
        for (si, e) in entries.iter().enumerate() {
            let seq = self
                .sched
                .get(e.seq)
                .ok_or_else(|| DetspecError::InvalidRequest {
                    request_id: None,
                    message: format!("planned sequence {} is not running", e.seq),
                })?;
            for pos in e.start..e.start + e.len {
                let (Some(tok), Some(slot)) = (seq.token(pos), seq.block_table.slot(pos, ps))
                else {
                    return Err(DetspecError::InvalidRequest {
                        request_id: Some(seq.request_id.clone()),
                        message: format!("position {pos} has no token or no KV slot"),
                    });
                };
                batch.tokens.push(tok);
                batch.slots.push(slot);
                batch.attention.positions.push(pos as u32);
                batch.attention.row_seq.push(si as u32);
            }
            batch
                .attention
                .block_tables
                .push(seq.block_table.pages().to_vec());
            batch.adapters.push(seq.lora.clone());
            batch.states.push(
                seq.states
                    .as_ref()
                    .map(SequenceStates::forward)
                    .transpose()?
                    .map(|refs| caching::with_snapshots(refs, e.seq, snapshots)),
            );
            if e.sample {
                batch.logit_rows.push((batch.tokens.len() - 1) as u32);
                sampled.push(e.seq);
            }
        }
        Ok((batch, sampled))
    }
}

/// The KV pool's bytes where `num_kv_pages` does not fix them: `kv_cache_bytes`, else on a GPU
/// with `gpu_memory_utilization` what that share of its memory leaves once the weights are
/// loaded (less a forward's headroom at the step's largest row count), else the default.
fn kv_budget(cfg: &EngineConfig, mc: &ModelConfig, dtype: DType, device: &Device) -> Result<usize> {
    if let Some(bytes) = cfg.kv_cache_bytes {
        return Ok(bytes);
    }
    let (Some(utilization), Some(memory)) = (cfg.gpu_memory_utilization, device_memory(device))
    else {
        return Ok(DEFAULT_KV_CACHE_BYTES);
    };
    let rows = cfg
        .max_num_batched_tokens
        .max(cfg.verify_group * cfg.verify_window);
    let headroom = crate::model::forward_headroom(mc, rows, dtype);
    let bytes = crate::model::kv_bytes_for_utilization(utilization, memory, headroom)?;
    tracing::info!(
        "KV cache: {} of gpu_memory_utilization {utilization} ({} free of {} after loading, \
         {} kept for a forward)",
        crate::error::gib(bytes as u64),
        crate::error::gib(memory.0),
        crate::error::gib(memory.1),
        crate::error::gib(headroom)
    );
    Ok(bytes)
}
