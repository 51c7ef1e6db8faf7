//! The engine: owns the model, the KV pool and the scheduler, and runs the step loop.
//!
//! One step: the scheduler plans → the model runs the flat batch → each sampled row goes
//! through the sampler → tokens are appended, finish conditions checked, finished requests
//! released. Text (detokenisation, stop strings) is handled per request by [`TextState`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device};
use rayon::prelude::*;

use crate::config::{EngineConfig, ModelConfig};
use crate::error::{DetspecError, Result};
use crate::kv::{BlockTable, KvPool, PageAllocator, SimpleAllocator};
use crate::model::{ForwardBatch, Model};
use crate::ops::AttentionMetadata;
use crate::output::{CompletionOutput, FinishReason, RequestOutput, StopReason, TokenLogprobs};
use crate::request::{Prompt, Request};
use crate::sampling::{self, SampleInput};
use crate::sched::{Scheduler, SchedulerLimits, Sequence, SequenceId, StepPlan};
use crate::tokenizer::{eos_token_ids, IncrementalDetokenizer, StopChecker, Tokenizer};

/// Bumped whenever a kernel's reduction order changes, so fingerprints tell old outputs apart.
pub const KERNEL_VERSION: u32 = 1;

/// Incremental text of one request: detokenizer, accumulated text, stop strings.
struct TextState {
    detok: IncrementalDetokenizer,
    text: String,
    stop: StopChecker,
}

/// A loaded model ready to generate.
pub struct Engine {
    model: Model,
    tokenizer: Option<Tokenizer>,
    kv: KvPool,
    alloc: Arc<dyn PageAllocator>,
    cfg: EngineConfig,
    max_model_len: usize,
    eos_token_ids: Vec<u32>,
    fingerprint: String,
    next_seq_id: SequenceId,
    model_dir: PathBuf,
}

impl Engine {
    /// Loads a Hugging Face model directory on the CPU.
    pub fn from_model_dir(dir: impl AsRef<Path>, cfg: EngineConfig) -> Result<Self> {
        Self::load(dir.as_ref(), cfg, &Device::Cpu)
    }

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
            Some(Tokenizer::from_model_dir(dir)?)
        } else {
            tracing::warn!("{} has no tokenizer.json: only token-id prompts will work", dir.display());
            None
        };
        let mut eos = eos_token_ids(dir, tokenizer.as_ref())?;
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
        let mc = model.config();
        let per_page = KvPool::bytes_per_page(mc.num_hidden_layers, cfg.page_size, mc.num_key_value_heads, mc.head_dim, DType::F32);
        let num_pages = cfg.num_kv_pages.unwrap_or((cfg.kv_cache_bytes / per_page).max(1));
        let kv = KvPool::new(mc.num_hidden_layers, num_pages, cfg.page_size, mc.num_key_value_heads, mc.head_dim, DType::F32, device)?;
        let fingerprint = format!(
            "detspec-{:016x}-{}-{}-k{}",
            model.weights_hash(),
            "f32",
            if device.is_cpu() { "cpu" } else { "cuda" },
            KERNEL_VERSION
        );
        Ok(Self {
            model,
            tokenizer,
            kv,
            alloc: Arc::new(SimpleAllocator::new(num_pages)),
            cfg,
            max_model_len,
            eos_token_ids: eos,
            fingerprint,
            next_seq_id: 0,
            model_dir: dir.to_path_buf(),
        })
    }

    pub fn model_config(&self) -> &ModelConfig {
        self.model.config()
    }

    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_ref()
    }

    pub fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// Free and total KV pages.
    pub fn kv_pages(&self) -> (usize, usize) {
        (self.alloc.num_free(), self.alloc.num_total())
    }

    fn tokenizer_or_err(&self, request_id: &str) -> Result<&Tokenizer> {
        self.tokenizer.as_ref().ok_or_else(|| DetspecError::InvalidRequest {
            request_id: Some(request_id.to_string()),
            message: format!(
                "text prompt given but the model has no tokenizer ({} is missing); pass token ids",
                self.model_dir.join("tokenizer.json").display()
            ),
        })
    }

    /// Checks a request and turns it into its `n` sequences (tokenizing a text prompt).
    fn make_sequences(&mut self, req: Request) -> Result<Vec<Sequence>> {
        let rid = req.request_id.clone();
        let invalid = |message: String| DetspecError::InvalidRequest {
            request_id: Some(rid.clone()),
            message,
        };
        req.params.validate()?;
        let (prompt_text, prompt) = match req.prompt {
            Prompt::Text(t) => {
                let ids = self.tokenizer_or_err(&rid)?.encode(&t, true)?;
                (Some(t), ids)
            }
            Prompt::Tokens(ids) => (None, ids),
        };
        if prompt.is_empty() {
            return Err(invalid("prompt is empty".into()));
        }
        let vocab = self.model.config().vocab_size;
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(invalid(format!("prompt contains token id {bad}, outside the vocabulary (size {vocab})")));
        }
        if prompt.len() >= self.max_model_len {
            return Err(invalid(format!(
                "prompt has {} tokens, which leaves no room to generate within max_model_len={}",
                prompt.len(),
                self.max_model_len
            )));
        }
        let max_len = (prompt.len() + req.params.max_tokens).min(self.max_model_len);
        let base_seed = req.params.seed.unwrap_or_else(sampling::request_seed_from_entropy);
        let mut seqs = Vec::with_capacity(req.params.n);
        for index in 0..req.params.n {
            let id = self.next_seq_id;
            self.next_seq_id += 1;
            seqs.push(Sequence {
                id,
                request_id: req.request_id.clone(),
                completion_index: index,
                prompt_text: prompt_text.clone(),
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
            });
        }
        Ok(seqs)
    }

    /// Generates every request together (a static batch) and returns the outputs in request order.
    /// Invalid requests are rejected before any work starts.
    pub fn generate(&mut self, requests: Vec<Request>) -> Result<Vec<RequestOutput>> {
        let mut sched = Scheduler::new(SchedulerLimits {
            max_num_seqs: self.cfg.max_num_seqs,
            max_num_batched_tokens: self.cfg.max_num_batched_tokens,
            page_size: self.cfg.page_size,
        });
        let mut texts: HashMap<SequenceId, TextState> = HashMap::new();
        let mut groups = Vec::with_capacity(requests.len());
        for req in requests {
            groups.push(self.make_sequences(req)?);
        }
        // Sequence ids of each request's completions, in request order.
        let order: Vec<Vec<SequenceId>> = groups.iter().map(|g| g.iter().map(|s| s.id).collect()).collect();
        for seq in groups.into_iter().flatten() {
            if self.tokenizer.is_some() {
                texts.insert(
                    seq.id,
                    TextState {
                        detok: IncrementalDetokenizer::new(&seq.prompt, true),
                        text: String::new(),
                        stop: StopChecker::new(seq.params.stop.clone()),
                    },
                );
            }
            sched.add(seq);
        }
        let mut done: HashMap<SequenceId, (Sequence, String)> = HashMap::new();
        let result = self.run_to_completion(&mut sched, &mut texts, &mut done);
        if let Err(e) = result {
            // Release everything this batch holds so the engine stays usable.
            for mut s in sched.take_all() {
                s.block_table.free(self.alloc.as_ref());
            }
            return Err(e);
        }
        Ok(order
            .into_iter()
            .map(|ids| {
                let seqs: Vec<_> = ids.iter().filter_map(|id| done.remove(id)).collect();
                self.final_output(seqs)
            })
            .collect())
    }

    fn run_to_completion(
        &mut self,
        sched: &mut Scheduler,
        texts: &mut HashMap<SequenceId, TextState>,
        done: &mut HashMap<SequenceId, (Sequence, String)>,
    ) -> Result<()> {
        while sched.has_work() {
            let plan = sched.plan(self.alloc.as_ref())?;
            if plan.is_empty() {
                return Err(DetspecError::OutOfPages {
                    needed: 1,
                    free: self.alloc.num_free(),
                    total: self.alloc.num_total(),
                });
            }
            self.step(sched, &plan, texts)?;
            for seq in sched.take_finished(self.alloc.as_ref()) {
                let text = texts.remove(&seq.id).map(|t| t.text).unwrap_or_default();
                done.insert(seq.id, (seq, text));
            }
        }
        Ok(())
    }

    /// Assembles one request's output from its finished completions.
    fn final_output(&self, seqs: Vec<(Sequence, String)>) -> RequestOutput {
        let mut out = RequestOutput {
            request_id: String::new(),
            prompt: None,
            prompt_token_ids: Vec::new(),
            outputs: Vec::with_capacity(seqs.len()),
            finished: true,
            fingerprint: self.fingerprint.clone(),
        };
        for (seq, text) in seqs {
            out.request_id = seq.request_id;
            out.prompt = seq.prompt_text;
            out.prompt_token_ids = seq.prompt;
            out.outputs.push(CompletionOutput {
                index: seq.completion_index,
                cumulative_logprob: seq.logprobs.iter().map(|l| l.logprob as f64).sum(),
                token_ids: seq.output,
                text,
                logprobs: seq.logprobs,
                finish_reason: seq.finish,
                stop_reason: seq.stop_reason,
            });
        }
        out
    }

    /// Builds the flat batch for a plan.
    fn build_batch(&self, sched: &Scheduler, plan: &StepPlan) -> Result<(ForwardBatch, Vec<SequenceId>)> {
        let ps = self.cfg.page_size;
        let mut batch = ForwardBatch {
            attention: AttentionMetadata {
                sliding_window: self.model.config().sliding_window,
                ..Default::default()
            },
            ..Default::default()
        };
        let mut sampled = Vec::new();
        for (si, e) in plan.entries.iter().enumerate() {
            let seq = sched.get(e.seq).ok_or_else(|| DetspecError::InvalidRequest {
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

    fn step(&mut self, sched: &mut Scheduler, plan: &StepPlan, texts: &mut HashMap<SequenceId, TextState>) -> Result<()> {
        let (batch, sampled_ids) = self.build_batch(sched, plan)?;
        let logits = self.model.forward(&batch, &self.kv)?;
        sched.mark_computed(plan);
        if sampled_ids.is_empty() {
            return Ok(());
        }
        let logits = logits.to_vec2::<f32>()?;
        // Sample every row in parallel: each row's result depends only on its own inputs.
        let eos = &self.eos_token_ids;
        let samples: Vec<Result<TokenLogprobs>> = sampled_ids
            .par_iter()
            .zip(logits.par_iter())
            .map(|(id, row)| {
                let seq = sched.get(*id).ok_or_else(|| DetspecError::InvalidRequest {
                    request_id: None,
                    message: format!("sampled sequence {id} is not running"),
                })?;
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
                let rank = 1 + row.iter().filter(|&&x| x > row[s.token as usize]).count() as u32;
                Ok(TokenLogprobs {
                    token: s.token,
                    logprob: s.logprob,
                    rank,
                    top: s.top_logprobs,
                })
            })
            .collect();
        for (id, lp) in sampled_ids.into_iter().zip(samples) {
            let lp = lp?;
            let tokenizer = self.tokenizer.as_ref();
            let Some(seq) = sched.get_mut(id) else { continue };
            let token = lp.token;
            seq.output.push(token);
            seq.logprobs.push(lp);
            let mut finish = None;
            if let (Some(tok), Some(ts)) = (tokenizer, texts.get_mut(&id)) {
                let delta = ts.detok.push(tok, token)?;
                ts.text.push_str(&delta);
                if let Some(m) = ts.stop.check(&ts.text, delta.len()) {
                    ts.text.truncate(m.truncate_at);
                    finish = Some((FinishReason::Stop, Some(StopReason::Text(m.stop))));
                }
            }
            if finish.is_none() {
                finish = check_token_finish(seq, token, &self.eos_token_ids);
            }
            if let Some((reason, stop)) = finish {
                if let (Some(tok), Some(ts)) = (tokenizer, texts.get_mut(&id)) {
                    if !matches!(stop, Some(StopReason::Text(_))) {
                        ts.text.push_str(&ts.detok.finish(tok)?);
                    }
                }
                seq.finish = Some(reason);
                seq.stop_reason = stop;
            }
        }
        Ok(())
    }

    /// Per-position logits of each prompt (`[len_i][vocab]`), all prompts in one flat forward.
    pub fn prompt_logits(&mut self, prompts: &[Vec<u32>]) -> Result<Vec<Vec<Vec<f32>>>> {
        let ps = self.cfg.page_size;
        let mut tables = Vec::with_capacity(prompts.len());
        let mut batch = ForwardBatch {
            attention: AttentionMetadata {
                sliding_window: self.model.config().sliding_window,
                ..Default::default()
            },
            ..Default::default()
        };
        let vocab = self.model.config().vocab_size;
        let result = (|| {
            for (si, p) in prompts.iter().enumerate() {
                if p.is_empty() || p.len() > self.max_model_len {
                    return Err(DetspecError::InvalidRequest {
                        request_id: None,
                        message: format!("prompt {si} has {} tokens (allowed 1..={})", p.len(), self.max_model_len),
                    });
                }
                if let Some(&bad) = p.iter().find(|&&t| t as usize >= vocab) {
                    return Err(DetspecError::InvalidRequest {
                        request_id: None,
                        message: format!("prompt {si} contains token id {bad}, outside the vocabulary (size {vocab})"),
                    });
                }
                let mut bt = BlockTable::new();
                bt.reserve(p.len(), ps, self.alloc.as_ref())?;
                for (pos, &t) in p.iter().enumerate() {
                    let slot = bt.slot(pos, ps).ok_or_else(|| DetspecError::param("page_size", "slot missing after reserve"))?;
                    batch.logit_rows.push(batch.tokens.len() as u32);
                    batch.tokens.push(t);
                    batch.slots.push(slot);
                    batch.attention.positions.push(pos as u32);
                    batch.attention.row_seq.push(si as u32);
                }
                batch.attention.block_tables.push(bt.pages().to_vec());
                tables.push(bt);
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
fn min_tokens_banned(p: &crate::sampling::SamplingParams, eos: &[u32]) -> Vec<u32> {
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
