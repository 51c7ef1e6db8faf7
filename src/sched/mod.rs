//! Scheduling: which tokens of which sequences run in the next forward pass.
//!
//! The scheduler owns sequence state and KV reservations but never touches tensors: it hands
//! the engine a [`StepPlan`] and is told what was sampled.

mod sequence;

pub use sequence::{Sequence, SequenceId};

use crate::error::Result;
use crate::kv::PageAllocator;

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

/// The work of one engine step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub entries: Vec<PlanEntry>,
}

impl StepPlan {
    pub fn num_tokens(&self) -> usize {
        self.entries.iter().map(|e| e.len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Limits a plan must respect.
#[derive(Debug, Clone, Copy)]
pub struct SchedulerLimits {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub page_size: usize,
}

/// A first-come-first-served scheduler: running sequences decode first, then waiting prompts
/// are prefilled (in chunks) while the token budget and the KV pool allow.
#[derive(Debug)]
pub struct Scheduler {
    limits: SchedulerLimits,
    /// Sequences admitted (holding pages), in admission order.
    running: Vec<Sequence>,
    /// Sequences not yet admitted, in arrival order.
    waiting: std::collections::VecDeque<Sequence>,
}

impl Scheduler {
    pub fn new(limits: SchedulerLimits) -> Self {
        Self {
            limits,
            running: Vec::new(),
            waiting: Default::default(),
        }
    }

    pub fn add(&mut self, seq: Sequence) {
        self.waiting.push_back(seq);
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    pub fn get(&self, id: SequenceId) -> Option<&Sequence> {
        self.running.iter().find(|s| s.id == id)
    }

    pub fn get_mut(&mut self, id: SequenceId) -> Option<&mut Sequence> {
        self.running.iter_mut().find(|s| s.id == id)
    }

    /// Builds the next step. Admits waiting sequences only when their whole prompt plus one
    /// token fits in the pool, so the static batch never runs out of pages mid-way.
    pub fn plan(&mut self, alloc: &dyn PageAllocator) -> Result<StepPlan> {
        let l = self.limits;
        let mut plan = StepPlan::default();
        let mut budget = l.max_num_batched_tokens;
        for seq in self.running.iter_mut() {
            if budget == 0 {
                break;
            }
            let remaining = seq.len() - seq.num_computed;
            let len = remaining.min(budget);
            seq.block_table.reserve(seq.num_computed + len, l.page_size, alloc)?;
            plan.entries.push(PlanEntry {
                seq: seq.id,
                start: seq.num_computed,
                len,
                sample: len == remaining,
            });
            budget -= len;
        }
        // Pages the running sequences will still take as they grow to their longest.
        let mut promised: usize = self
            .running
            .iter()
            .map(|s| s.block_table.pages_needed(s.max_len_hint(), l.page_size))
            .sum();
        while budget > 0 && self.running.len() < l.max_num_seqs {
            let Some(seq) = self.waiting.front_mut() else { break };
            let needed = seq.block_table.pages_needed(seq.max_len_hint(), l.page_size);
            if needed + promised > alloc.num_free() && !self.running.is_empty() {
                break;
            }
            let len = seq.len().min(budget);
            seq.block_table.reserve(len, l.page_size, alloc)?;
            promised += seq.block_table.pages_needed(seq.max_len_hint(), l.page_size);
            let Some(seq) = self.waiting.pop_front() else { break };
            plan.entries.push(PlanEntry {
                seq: seq.id,
                start: 0,
                len,
                sample: len == seq.len(),
            });
            budget -= len;
            self.running.push(seq);
        }
        Ok(plan)
    }

    /// Marks the planned rows computed (their KV is now in the cache).
    pub fn mark_computed(&mut self, plan: &StepPlan) {
        for e in &plan.entries {
            if let Some(seq) = self.get_mut(e.seq) {
                seq.num_computed = e.start + e.len;
            }
        }
    }

    /// Removes finished sequences, releasing their pages.
    pub fn take_finished(&mut self, alloc: &dyn PageAllocator) -> Vec<Sequence> {
        let (done, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(|s| s.finish.is_some());
        self.running = keep;
        done.into_iter()
            .map(|mut s| {
                s.block_table.free(alloc);
                s
            })
            .collect()
    }
}

impl Scheduler {
    /// Removes every sequence (running and waiting), e.g. after a failed step.
    pub fn take_all(&mut self) -> Vec<Sequence> {
        let mut all = std::mem::take(&mut self.running);
        all.extend(self.waiting.drain(..));
        all
    }
}
