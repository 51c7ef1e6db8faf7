//! The synchronous engine core: model, KV pool, scheduler and the step function.
//!
//! One step: the scheduler plans → the model runs the flat batch → each sampled row goes
//! through the sampler → tokens are appended, finish conditions checked, finished sequences
//! released → one [`StreamEvent`] per sequence that produced tokens. The engine thread
//! ([`super::Engine`]) drives this; nothing here blocks or spawns.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device};
use rayon::prelude::*;

use crate::config::{EngineConfig, ModelConfig};
use crate::error::{DetspecError, Result};
use crate::kv::{BlockTable, KvPool, PageAllocator, SimpleAllocator};
use crate::model::{ForwardBatch, Model};
use crate::ops::{AttentionMetadata, AttentionSchedule};
use crate::output::{FinishReason, RequestMetrics, StopReason, TokenLogprobs};
use crate::request::{Prompt, Request};
use crate::sampling::{self, SampleInput, SamplingParams};
use crate::sched::{Scheduler, SchedulerLimits, Sequence, SequenceId, StepPlan};
use crate::tokenizer::{eos_token_ids, Tokenizer};

use super::stream::{now, StreamEvent};
use super::text::TextState;

/// Bumped whenever a kernel's reduction order changes, so fingerprints tell old outputs apart.
pub const KERNEL_VERSION: u32 = 1;

/// What the engine knows about a model once loaded; shared read-only with API handles.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub config: ModelConfig,
    pub max_model_len: usize,
    pub eos_token_ids: Vec<u32>,
    pub fingerprint: String,
    pub model_dir: PathBuf,
}

/// Per-sequence state that is not the scheduler's business.
struct SeqExtra {
    text: Option<TextState>,
    first_scheduled_time: Option<f64>,
    first_token_time: Option<f64>,
}

/// Model + KV + scheduler; runs one step at a time.
pub struct EngineCore {
    model: Model,
    tokenizer: Option<Arc<Tokenizer>>,
    kv: KvPool,
    alloc: Arc<dyn PageAllocator>,
    cfg: EngineConfig,
    info: Arc<ModelInfo>,
    sched: Scheduler,
    extra: HashMap<SequenceId, SeqExtra>,
    next_seq_id: SequenceId,
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
        let model_cfg = ModelConfig::from_model_dir(dir)?;
        let tokenizer = if dir.join("tokenizer.json").exists() {
            Some(Arc::new(Tokenizer::from_model_dir(dir)?))
        } else {
            tracing::warn!("{} has no tokenizer.json: only token-id prompts will work", dir.display());
            None
        };
        let mut eos = eos_token_ids(dir, tokenizer.as_deref())?;
        for id in &model_cfg.eos_token_ids {
            if !eos.contains(id) {
                eos.push(*id);
            }
        }
        let max_model_len = match cfg.max_model_len {
            Some(n) if n > model_cfg.max_position_embeddings => {
                return Err(DetspecError::param(
                    "max_model_len",
                    format!("{n} exceeds the model's max_position_embeddings ({})", model_cfg.max_position_embeddings),
                ))
            }
            Some(n) => n,
            None => model_cfg.max_position_embeddings,
        };
        let model = Model::load(dir, model_cfg, device)?;
        let mc = model.config().clone();
        let per_page = KvPool::bytes_per_page(mc.num_hidden_layers, cfg.page_size, mc.num_key_value_heads, mc.head_dim, DType::F32);
        let num_pages = cfg.num_kv_pages.unwrap_or((cfg.kv_cache_bytes / per_page).max(1));
        let kv = KvPool::new(mc.num_hidden_layers, num_pages, cfg.page_size, mc.num_key_value_heads, mc.head_dim, DType::F32, device)?;
        let fingerprint = format!(
            "detspec-{:016x}-f32-{}-k{}",
            model.weights_hash(),
            if device.is_cpu() { "cpu" } else { "cuda" },
            KERNEL_VERSION
        );
        let sched = Scheduler::new(SchedulerLimits {
            max_num_seqs: cfg.max_num_seqs,
            max_num_batched_tokens: cfg.max_num_batched_tokens,
            page_size: cfg.page_size,
            max_prefill_chunk: cfg.max_prefill_chunk.unwrap_or(cfg.max_num_batched_tokens),
        });
        tracing::info!(model = %dir.display(), num_pages, page_size = cfg.page_size, "engine loaded");
        Ok(Self {
            info: Arc::new(ModelInfo {
                config: mc,
                max_model_len,
                eos_token_ids: eos,
                fingerprint,
                model_dir: dir.to_path_buf(),
            }),
            model,
            tokenizer,
            kv,
            alloc: Arc::new(SimpleAllocator::new(num_pages)),
            cfg,
            sched,
            extra: HashMap::new(),
            next_seq_id: 0,
        })
    }

    pub fn info(&self) -> &Arc<ModelInfo> {
        &self.info
    }

    pub fn tokenizer(&self) -> Option<&Arc<Tokenizer>> {
        self.tokenizer.as_ref()
    }

    /// Free and total KV pages.
    pub fn kv_pages(&self) -> (usize, usize) {
        (self.alloc.num_free(), self.alloc.num_total())
    }

    pub fn has_work(&self) -> bool {
        self.sched.has_work()
    }

    pub fn num_running(&self) -> usize {
        self.sched.num_running()
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
            return Err(invalid("a request with this id is already running".into()));
        }
        req.params.validate()?;
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
        if prompt.is_empty() {
            return Err(invalid("prompt is empty".into()));
        }
        let vocab = self.info.config.vocab_size;
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(invalid(format!("prompt contains token id {bad}, outside the vocabulary (size {vocab})")));
        }
        let max_model_len = self.info.max_model_len;
        if prompt.len() >= max_model_len {
            return Err(invalid(format!(
                "prompt has {} tokens, which leaves no room to generate within max_model_len={max_model_len}",
                prompt.len()
            )));
        }
        let pages_needed = (prompt.len() + 1).div_ceil(self.cfg.page_size);
        if pages_needed > self.alloc.num_total() {
            return Err(invalid(format!(
                "prompt needs {pages_needed} KV pages but the pool has only {} (raise num_kv_pages)",
                self.alloc.num_total()
            )));
        }
        let max_len = (prompt.len() + req.params.max_tokens).min(max_model_len);
        let base_seed = req.params.seed.unwrap_or_else(sampling::request_seed_from_entropy);
        for index in 0..req.params.n {
            let id = self.next_seq_id;
            self.next_seq_id += 1;
            self.extra.insert(
                id,
                SeqExtra {
                    text: self.tokenizer.as_ref().map(|_| TextState::new(&prompt, &req.params.stop)),
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
                seed: completion_seed(base_seed, index),
                num_computed: 0,
                block_table: BlockTable::new(),
                finish: None,
                stop_reason: None,
                max_len,
                num_preemptions: 0,
            });
        }
        Ok(StreamEvent::Accepted {
            request_id: rid,
            prompt: prompt_text,
            prompt_token_ids: prompt,
            n: req.params.n,
            fingerprint: self.info.fingerprint.clone(),
            arrival_time,
        })
    }

    /// Aborts every sequence of `request_id`; returns the final events (reason `abort`).
    pub fn abort(&mut self, request_id: &str) -> Vec<StreamEvent> {
        let removed = self.sched.remove_where(self.alloc.as_ref(), |s| s.request_id == request_id);
        removed
            .into_iter()
            .map(|mut s| {
                s.finish = Some(FinishReason::Abort);
                let extra = self.extra.remove(&s.id);
                Self::event(&s, 0, String::new(), extra.as_ref())
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
    fn event(seq: &Sequence, from: usize, text_delta: String, extra: Option<&SeqExtra>) -> StreamEvent {
        StreamEvent::Tokens {
            request_id: seq.request_id.clone(),
            index: seq.completion_index,
            token_ids: seq.output.get(from..).unwrap_or_default().to_vec(),
            logprobs: seq.logprobs.get(from..).unwrap_or_default().to_vec(),
            text_delta,
            finish_reason: seq.finish,
            stop_reason: seq.stop_reason.clone(),
            metrics: RequestMetrics {
                first_scheduled_time: extra.and_then(|e| e.first_scheduled_time),
                first_token_time: extra.and_then(|e| e.first_token_time),
                finished_time: seq.finish.map(|_| now()),
                num_preemptions: seq.num_preemptions,
                ..Default::default()
            },
        }
    }

    /// Runs one step and returns the events it produced.
    pub fn step(&mut self) -> Vec<StreamEvent> {
        let mut plan = self.sched.plan(self.alloc.as_ref());
        let mut events = Vec::new();
        for (seq, err) in plan.failed.drain(..) {
            self.extra.remove(&seq.id);
            events.push(StreamEvent::Failed {
                request_id: seq.request_id,
                error: err,
            });
        }
        if plan.is_empty() {
            return events;
        }
        let t = now();
        for e in &plan.entries {
            if let Some(x) = self.extra.get_mut(&e.seq) {
                x.first_scheduled_time.get_or_insert(t);
            }
        }
        match self.run_plan(&plan) {
            Ok(mut evs) => events.append(&mut evs),
            Err(err) => {
                // A failed forward concerns exactly the sequences in this step.
                tracing::error!("step failed: {err}");
                let ids: Vec<SequenceId> = plan.entries.iter().map(|e| e.seq).collect();
                let msg = err.to_string();
                for s in self.sched.remove_where(self.alloc.as_ref(), |s| ids.contains(&s.id)) {
                    self.extra.remove(&s.id);
                    events.push(StreamEvent::Failed {
                        request_id: s.request_id,
                        error: DetspecError::InvalidRequest {
                            request_id: None,
                            message: format!("step failed: {msg}"),
                        },
                    });
                }
            }
        }
        events
    }

    fn run_plan(&mut self, plan: &StepPlan) -> Result<Vec<StreamEvent>> {
        let (batch, sampled) = self.build_batch(plan)?;
        let logits = self.model.forward(&batch, &self.kv)?;
        self.sched.mark_computed(plan);
        if sampled.is_empty() {
            return Ok(Vec::new());
        }
        let logits = logits.to_vec2::<f32>()?;
        let eos = &self.info.eos_token_ids;
        let sched = &self.sched;
        // Each row's sample depends only on its own logits and (seed, position).
        let samples: Vec<Result<TokenLogprobs>> = sampled
            .par_iter()
            .zip(logits.par_iter())
            .map(|(id, row)| {
                let seq = sched.get(*id).ok_or_else(|| DetspecError::InvalidRequest {
                    request_id: None,
                    message: format!("sampled sequence {id} is not running"),
                })?;
                sample_row(seq, row, eos)
            })
            .collect();
        let t = now();
        let mut events = Vec::new();
        for (id, lp) in sampled.into_iter().zip(samples) {
            let lp = lp?;
            let Some(seq) = self.sched.get_mut(id) else { continue };
            let from = seq.output.len();
            let token = lp.token;
            seq.output.push(token);
            seq.logprobs.push(lp);
            let extra = self.extra.get_mut(&id);
            let mut delta = String::new();
            let mut finish = None;
            if let Some(x) = extra {
                x.first_token_time.get_or_insert(t);
                if let (Some(tok), Some(ts)) = (self.tokenizer.as_deref(), x.text.as_mut()) {
                    let up = ts.push(tok, token)?;
                    delta = up.delta;
                    if let Some(stop) = up.stop {
                        finish = Some((FinishReason::Stop, Some(StopReason::Text(stop))));
                    }
                }
                if finish.is_none() {
                    finish = check_token_finish(seq, token, eos);
                    if finish.is_some() {
                        if let (Some(tok), Some(ts)) = (self.tokenizer.as_deref(), x.text.as_mut()) {
                            delta.push_str(&ts.finish(tok)?);
                        }
                    }
                }
            }
            if let Some((reason, stop)) = finish {
                seq.finish = Some(reason);
                seq.stop_reason = stop;
            }
            let seq: &Sequence = seq;
            events.push(Self::event(seq, from, delta, self.extra.get(&id)));
        }
        for s in self.sched.take_finished(self.alloc.as_ref()) {
            self.extra.remove(&s.id);
        }
        Ok(events)
    }

    /// Builds the flat batch for a plan; returns it with the ids of the sampled sequences.
    fn build_batch(&self, plan: &StepPlan) -> Result<(ForwardBatch, Vec<SequenceId>)> {
        let ps = self.cfg.page_size;
        let mut batch = ForwardBatch {
            attention: AttentionMetadata {
                sliding_window: self.info.config.sliding_window,
                schedule: AttentionSchedule::split_kv_for_batch(plan.entries.len(), self.info.config.num_attention_heads),
                ..Default::default()
            },
            ..Default::default()
        };
        let mut sampled = Vec::new();
        for (si, e) in plan.entries.iter().enumerate() {
            let seq = self.sched.get(e.seq).ok_or_else(|| DetspecError::InvalidRequest {
                request_id: None,
                message: format!("planned sequence {} is not running", e.seq),
            })?;
            for pos in e.start..e.start + e.len {
                let (Some(tok), Some(slot)) = (seq.token(pos), seq.block_table.slot(pos, ps)) else {
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
            batch.attention.block_tables.push(seq.block_table.pages().to_vec());
            if e.sample {
                batch.logit_rows.push((batch.tokens.len() - 1) as u32);
                sampled.push(e.seq);
            }
        }
        Ok((batch, sampled))
    }

    /// Per-position logits of each prompt (`[len_i][vocab]`), all prompts in one flat forward.
    /// Runs outside the scheduler, on pages it takes and returns itself.
    pub fn prompt_logits(&mut self, prompts: &[Vec<u32>]) -> Result<Vec<Vec<Vec<f32>>>> {
        let ps = self.cfg.page_size;
        let mut tables = Vec::with_capacity(prompts.len());
        let mut batch = ForwardBatch {
            attention: AttentionMetadata {
                sliding_window: self.info.config.sliding_window,
                ..Default::default()
            },
            ..Default::default()
        };
        let vocab = self.info.config.vocab_size;
        let max_len = self.info.max_model_len;
        let result = (|| {
            for (si, p) in prompts.iter().enumerate() {
                if p.is_empty() || p.len() > max_len {
                    return Err(DetspecError::InvalidRequest {
                        request_id: None,
                        message: format!("prompt {si} has {} tokens (allowed 1..={max_len})", p.len()),
                    });
                }
                if let Some(&bad) = p.iter().find(|&&t| t as usize >= vocab) {
                    return Err(DetspecError::InvalidRequest {
                        request_id: None,
                        message: format!("prompt {si} contains token id {bad}, outside the vocabulary (size {vocab})"),
                    });
                }
                let mut bt = BlockTable::new();
                let reserved = bt.reserve(p.len(), ps, self.alloc.as_ref());
                tables.push(bt);
                reserved?;
                let bt = &tables[si];
                for (pos, &t) in p.iter().enumerate() {
                    let slot = bt
                        .slot(pos, ps)
                        .ok_or_else(|| DetspecError::param("page_size", "slot missing after reserve"))?;
                    batch.logit_rows.push(batch.tokens.len() as u32);
                    batch.tokens.push(t);
                    batch.slots.push(slot);
                    batch.attention.positions.push(pos as u32);
                    batch.attention.row_seq.push(si as u32);
                }
                batch.attention.block_tables.push(bt.pages().to_vec());
            }
            let logits = self.model.forward(&batch, &self.kv)?.to_vec2::<f32>()?;
            let mut rows = logits.into_iter();
            Ok(prompts.iter().map(|p| rows.by_ref().take(p.len()).collect()).collect())
        })();
        for mut bt in tables {
            bt.free(self.alloc.as_ref());
        }
        result
    }
}

/// Samples one row for `seq` and ranks the chosen token.
fn sample_row(seq: &Sequence, row: &[f32], eos: &[u32]) -> Result<TokenLogprobs> {
    let banned = if seq.output.len() < seq.params.min_tokens {
        min_tokens_banned(&seq.params, eos)
    } else {
        Vec::new()
    };
    let s = sampling::sample(&SampleInput {
        logits: row,
        params: &seq.params,
        seed: seq.seed,
        position: seq.len() as u64,
        prompt_tokens: &seq.prompt,
        output_tokens: &seq.output,
        banned_tokens: &banned,
    })?;
    let chosen = row.get(s.token as usize).copied().unwrap_or(f32::NEG_INFINITY);
    let rank = 1 + row.iter().filter(|&&x| x > chosen).count() as u32;
    Ok(TokenLogprobs {
        token: s.token,
        logprob: s.logprob,
        rank,
        top: s.top_logprobs,
    })
}

/// Seed of completion `index` of a request: the request's seed for the first, distinct
/// well-mixed seeds for the others, so `n > 1` samples differ but stay reproducible.
fn completion_seed(seed: u64, index: usize) -> u64 {
    if index == 0 {
        return seed;
    }
    let mut z = seed ^ (index as u64).wrapping_mul(0x9e3779b97f4a7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
    z ^ (z >> 31)
}

/// Tokens that may not be sampled before `min_tokens`: EOS (unless ignored) and stop token ids,
/// as in vLLM.
fn min_tokens_banned(p: &SamplingParams, eos: &[u32]) -> Vec<u32> {
    let mut banned = p.stop_token_ids.clone();
    if !p.ignore_eos {
        banned.extend_from_slice(eos);
    }
    banned
}

/// EOS, stop token ids, max_tokens and context length, in vLLM's order of precedence.
fn check_token_finish(seq: &Sequence, token: u32, eos: &[u32]) -> Option<(FinishReason, Option<StopReason>)> {
    let p = &seq.params;
    let past_min = seq.output.len() >= p.min_tokens;
    if past_min && !p.ignore_eos && eos.contains(&token) {
        return Some((FinishReason::Stop, Some(StopReason::Token(token))));
    }
    if past_min && p.stop_token_ids.contains(&token) {
        return Some((FinishReason::Stop, Some(StopReason::Token(token))));
    }
    if seq.output.len() >= p.max_tokens || seq.len() >= seq.max_len {
        return Some((FinishReason::Length, None));
    }
    None
}
