//! Continuous-batching scheduler: which tokens of which sequences run in the next forward pass.
//!
//! vLLM-v1-like: each step has a token budget (`max_num_batched_tokens`) and a sequence cap
//! (`max_num_seqs`). Running sequences go first (decodes, or the next chunk of a chunked
//! prefill), then waiting prompts are admitted in arrival order. When the KV pool runs dry the
//! newest running sequence is preempted: its pages are freed and it is requeued at the front of
//! the waiting queue, to be recomputed (prompt + tokens so far) when it is admitted again.
//!
//! The scheduler owns sequence state and KV reservations but never touches tensors.

mod sequence;
mod sharing;

pub use sequence::{DvrState, Sequence, SequenceId};

use std::collections::VecDeque;

use crate::error::DetspecError;
use crate::kv::{BlockTable, PageAllocator, PageId, StateSeed};

use sharing::SharedPrefills;

/// One sequence's share of a step: rows `start..start + len` of its tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanEntry {
    pub seq: SequenceId,
    /// First token index (absolute position) computed in this step.
    pub start: usize,
    /// Number of rows.
    pub len: usize,
    /// Whether the last row's logits are sampled (the chunk reaches the end of the sequence).
    pub sample: bool,
}

/// What a waiting sequence may start from instead of its first token: the cached pages of its
/// prefix's longest run it may read (a reference taken on each), and, where the model keeps
/// recurrent states, the state after them.
#[derive(Debug, Default)]
pub struct CachedPrefix {
    pub pages: Vec<PageId>,
    pub state: Option<StateSeed>,
    /// Tokens of the prefix held in the cache, read or not (a recurrent model reads only as
    /// far as a state was kept).
    pub cached_tokens: usize,
}

/// The work of one engine step.
#[derive(Debug, Default)]
pub struct StepPlan {
    pub entries: Vec<PlanEntry>,
    /// Deterministic requests' prompts, unchunked, prefilled apart from the shared batch in
    /// passes whose shapes do not depend on what else runs, so their KV and first tokens
    /// depend on nothing but the prompts (the replay strategy). Several per step, within a
    /// budget of `max_num_batched_tokens` rows of their own (one prompt at least).
    pub isolated: Vec<PlanEntry>,
    /// Sequences preempted while planning (already requeued).
    pub preempted: Vec<SequenceId>,
    /// Sequences that can never run (they do not fit in the whole pool), removed.
    pub failed: Vec<(Sequence, DetspecError)>,
}

impl StepPlan {
    /// Tokens in the shared (fast-path) batch.
    pub fn num_tokens(&self) -> usize {
        self.entries.iter().map(|e| e.len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty() && self.isolated.is_empty()
    }
}

/// Limits a plan must respect.
#[derive(Debug, Clone, Copy)]
pub struct SchedulerLimits {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub page_size: usize,
    /// Largest prefill chunk of one sequence in one step.
    pub max_prefill_chunk: usize,
    /// Prefill deterministic requests alone (DVR mode).
    pub isolate_deterministic_prefill: bool,
    /// Hold back a waiting prompt while a prefill still running computes pages covering at
    /// least half of it (the `n` samples of a request, a GRPO group), so that it reads them
    /// from the prefix cache instead of computing them beside it. For engines with a prefix
    /// cache.
    pub defer_shared_prefills: bool,
}

/// The continuous-batching scheduler.
#[derive(Debug)]
pub struct Scheduler {
    limits: SchedulerLimits,
    /// Sequences holding pages, in admission order (newest last).
    running: Vec<Sequence>,
    /// Sequences waiting for admission, in arrival order (preempted ones at the front).
    waiting: VecDeque<Sequence>,
}

impl Scheduler {
    pub fn new(limits: SchedulerLimits) -> Self {
        Self {
            limits,
            running: Vec::new(),
            waiting: VecDeque::new(),
        }
    }

    pub fn add(&mut self, seq: Sequence) {
        self.waiting.push_back(seq);
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn get(&self, id: SequenceId) -> Option<&Sequence> {
        self.running.iter().find(|s| s.id == id)
    }

    pub fn get_mut(&mut self, id: SequenceId) -> Option<&mut Sequence> {
        self.running.iter_mut().find(|s| s.id == id)
    }

    /// A sequence, running or waiting.
    pub fn find_mut(&mut self, id: SequenceId) -> Option<&mut Sequence> {
        self.running
            .iter_mut()
            .chain(self.waiting.iter_mut())
            .find(|s| s.id == id)
    }

    /// Iterates over every sequence, running and waiting.
    pub fn iter(&self) -> impl Iterator<Item = &Sequence> {
        self.running.iter().chain(self.waiting.iter())
    }

    /// Frees `seq`'s pages and requeues it for recomputation.
    fn preempt(&mut self, idx: usize, alloc: &dyn PageAllocator, plan: &mut StepPlan) {
        let mut seq = self.running.remove(idx);
        seq.restart(alloc);
        seq.num_preemptions += 1;
        tracing::debug!(request_id = %seq.request_id, "preempted (KV pool exhausted)");
        plan.preempted.push(seq.id);
        self.waiting.push_front(seq);
    }

    /// Builds the next step. `lookup_prefix(seq, tokens)` returns what `seq` may start from of
    /// `tokens`' longest cached prefix.
    /// Sequences it preempts are listed in the plan; what they keep of their output is the
    /// determinism policy's call.
    pub fn plan(
        &mut self,
        alloc: &dyn PageAllocator,
        lookup_prefix: &dyn Fn(&Sequence, &[u32]) -> CachedPrefix,
    ) -> StepPlan {
        let l = self.limits;
        let mut plan = StepPlan::default();
        let mut budget = l.max_num_batched_tokens;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let seq = &self.running[i];
            if seq.finish.is_some() {
                // A deterministic sequence that finished on the fast path and waits for its
                // verify pass: nothing to compute.
                i += 1;
                continue;
            }
            let remaining = seq.len() - seq.num_computed;
            let len = remaining.min(budget).min(l.max_prefill_chunk);
            let target = seq.num_computed + len;
            let mut scheduled = false;
            loop {
                if self.running[i]
                    .block_table
                    .reserve(target, l.page_size, alloc)
                    .is_ok()
                {
                    scheduled = true;
                    break;
                }
                let newest = self.running.len() - 1;
                if newest == i {
                    if i == 0 {
                        // Alone and still does not fit: it never will.
                        let seq = self.running.remove(0);
                        fail_out_of_pages(&mut plan, seq, target, l.page_size, alloc);
                    } else {
                        self.preempt(i, alloc, &mut plan);
                    }
                    break;
                }
                self.preempt(newest, alloc, &mut plan);
            }
            if !scheduled {
                continue; // `running[i]` was removed; the next sequence now sits at `i`.
            }
            let seq = &self.running[i];
            plan.entries.push(PlanEntry {
                seq: seq.id,
                start: seq.num_computed,
                len,
                sample: len == remaining,
            });
            budget -= len;
            i += 1;
        }
        // Admit waiting sequences, unless this step already had to preempt; skip those that
        // wait for a prefill of the same prompt start.
        let mut isolated_budget = l.max_num_batched_tokens;
        let mut prefilling = SharedPrefills::new(&self.running, &l);
        let mut w = 0;
        while budget > 0 && plan.preempted.is_empty() && self.running.len() < l.max_num_seqs {
            let Some(seq) = self.waiting.get_mut(w) else {
                break;
            };
            if prefilling.holds_back(seq) {
                w += 1;
                continue;
            }
            if l.isolate_deterministic_prefill && seq.deterministic && seq.num_computed == 0 {
                let prompt_len = seq.prompt.len();
                if seq.block_table.pages().is_empty() {
                    // The prompt only: the isolated prefill computes no output token.
                    let prompt = seq.prompt.clone();
                    adopt_cached_prefix(seq, &prompt, lookup_prefix, l.page_size);
                }
                let start = seq.num_computed;
                // Past the isolated budget (the first prompt of a step always fits it): next
                // step's, keeping arrival order.
                let over_budget = !plan.isolated.is_empty() && prompt_len - start > isolated_budget;
                if over_budget
                    || seq
                        .block_table
                        .reserve(prompt_len, l.page_size, alloc)
                        .is_err()
                {
                    seq.restart(alloc);
                    if !over_budget && self.running.is_empty() {
                        if let Some(seq) = self.waiting.remove(w) {
                            fail_out_of_pages(&mut plan, seq, prompt_len, l.page_size, alloc);
                        }
                        continue;
                    }
                    break;
                }
                if !seq.acquire_states() {
                    seq.restart(alloc);
                    break;
                }
                let Some(seq) = self.waiting.remove(w) else {
                    break;
                };
                plan.isolated.push(PlanEntry {
                    seq: seq.id,
                    start,
                    len: prompt_len - start,
                    sample: prompt_len == seq.len(),
                });
                isolated_budget = isolated_budget.saturating_sub(prompt_len - start);
                prefilling.admitted(&seq);
                self.running.push(seq);
                continue;
            }
            if seq.num_computed == 0 && seq.block_table.pages().is_empty() {
                let all: Vec<u32> = seq.prompt.iter().chain(&seq.output).copied().collect();
                adopt_cached_prefix(seq, &all, lookup_prefix, l.page_size);
            }
            let remaining = seq.len() - seq.num_computed;
            let len = remaining.min(budget).min(l.max_prefill_chunk);
            if seq
                .block_table
                .reserve(seq.num_computed + len, l.page_size, alloc)
                .is_err()
            {
                // Not admitted after all: give back any cached pages it was handed.
                seq.restart(alloc);
                if self.running.is_empty() {
                    if let Some(seq) = self.waiting.remove(w) {
                        fail_out_of_pages(&mut plan, seq, len, l.page_size, alloc);
                    }
                    continue;
                }
                break;
            }
            if !seq.acquire_states() {
                seq.restart(alloc);
                break;
            }
            let Some(seq) = self.waiting.remove(w) else {
                break;
            };
            plan.entries.push(PlanEntry {
                seq: seq.id,
                start: seq.num_computed,
                len,
                sample: len == remaining,
            });
            budget -= len;
            prefilling.admitted(&seq);
            self.running.push(seq);
        }
        // Prefills that prompts wait on keep their state where those share their runs.
        let asked = prefilling.snapshots(self.waiting.iter().take(l.max_num_seqs));
        for (id, &at) in asked {
            if let Some(leader) = self.running.iter_mut().find(|s| s.id == *id) {
                leader.shared_prefix = leader.shared_prefix.max(at);
            }
        }
        plan
    }

    /// Marks the planned rows computed (their KV is now in the cache).
    pub fn mark_computed(&mut self, plan: &StepPlan) {
        for e in plan.entries.iter().chain(&plan.isolated) {
            if let Some(seq) = self.get_mut(e.seq) {
                seq.num_computed = e.start + e.len;
            }
        }
    }

    /// The running sequences, in admission order.
    pub fn running(&self) -> &[Sequence] {
        &self.running
    }

    /// The running sequences, mutably (their DVR state; never their pages).
    pub fn running_mut(&mut self) -> &mut [Sequence] {
        &mut self.running
    }

    /// Removes finished sequences (all of whose tokens are committed), releasing their pages.
    pub fn take_finished(&mut self, alloc: &dyn PageAllocator) -> Vec<Sequence> {
        let (done, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(Sequence::is_done);
        self.running = keep;
        done.into_iter()
            .map(|mut s| {
                s.block_table.free(alloc);
                s
            })
            .collect()
    }

    /// Removes the sequences `pred` selects (running or waiting), releasing their pages.
    pub fn remove_where(
        &mut self,
        alloc: &dyn PageAllocator,
        mut pred: impl FnMut(&Sequence) -> bool,
    ) -> Vec<Sequence> {
        let mut out = Vec::new();
        let mut keep = Vec::with_capacity(self.running.len());
        for s in std::mem::take(&mut self.running) {
            if pred(&s) {
                out.push(s);
            } else {
                keep.push(s);
            }
        }
        self.running = keep;
        let mut keep = VecDeque::with_capacity(self.waiting.len());
        for s in std::mem::take(&mut self.waiting) {
            if pred(&s) {
                out.push(s);
            } else {
                keep.push_back(s);
            }
        }
        self.waiting = keep;
        for s in &mut out {
            s.block_table.free(alloc);
        }
        out
    }
}

/// Starts `seq` (holding no pages) from the cached pages of `tokens`' longest cached prefix
/// that it may read, keeping at least the last token to compute so its row yields logits, and
/// from the state after them where it keeps recurrent states.
fn adopt_cached_prefix(
    seq: &mut Sequence,
    tokens: &[u32],
    lookup_prefix: &dyn Fn(&Sequence, &[u32]) -> CachedPrefix,
    page_size: usize,
) {
    let CachedPrefix {
        pages,
        state,
        cached_tokens,
    } = lookup_prefix(seq, &tokens[..tokens.len().saturating_sub(1)]);
    seq.shared_prefix = cached_tokens.max(pages.len() * page_size);
    if seq.num_preemptions == 0 {
        seq.num_cached_tokens = pages.len() * page_size;
    }
    if !pages.is_empty() {
        seq.num_computed = pages.len() * page_size;
        seq.block_table = BlockTable::from_shared_pages(pages, page_size);
        if let (Some(states), Some(seed)) = (&mut seq.states, state) {
            states.seed(seed);
        }
    }
}

/// Fails `seq`, which cannot get pages for `tokens` tokens even with nothing else running.
fn fail_out_of_pages(
    plan: &mut StepPlan,
    mut seq: Sequence,
    tokens: usize,
    page_size: usize,
    alloc: &dyn PageAllocator,
) {
    seq.restart(alloc);
    let err = DetspecError::OutOfPages {
        needed: seq.block_table.pages_needed(tokens, page_size),
        free: alloc.num_free(),
        total: alloc.num_total(),
    };
    plan.failed.push((seq, err));
}
