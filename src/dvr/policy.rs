//! The determinism policy: what the engine does for `deterministic=True` requests, as one type
//! with the hooks a step needs.
//!
//! | strategy          | when                                              | deterministic rows                         | committed          |
//! |-------------------|---------------------------------------------------|--------------------------------------------|--------------------|
//! | `Off`             | `determinism="off"`                               | refused at admission                       | as sampled         |
//! | `BatchInvariant`  | `determinism="batch_invariant"`                   | every row of every batch on invariant kernels | as sampled      |
//! | `Inline`          | `dvr`, backend whose GEMMs are proven invariant   | inside the fast batch, invariant attention | as sampled         |
//! | `Replay`          | `dvr`, any backend (the GPU's strategy)           | fast path, then replayed in B × W passes    | when verified      |
//!
//! *Invariant kernels* are the ones whose result for a row depends on nothing but that row's
//! own sequence: the packed fixed-order GEMM (CPU) or GEMMs at one fixed shape, and attention
//! on [`AttentionSchedule::Fixed`] (one reduction order per row, never split by batch size).
//!
//! The engine's step calls the hooks in this order and holds no strategy branch of its own:
//!
//! 1. [`DeterminismPolicy::admit`] when a request arrives;
//! 2. [`DeterminismPolicy::page_class`] while the scheduler plans (which cached pages a
//!    sequence may read) and when prompt pages enter the prefix cache;
//! 3. [`DeterminismPolicy::on_preempt`] for each sequence the plan preempted;
//! 4. [`DeterminismPolicy::prepare_shared_batch`] / [`DeterminismPolicy::isolated_prefill_passes`]
//!    before the forward passes;
//! 5. [`DeterminismPolicy::after_sample`] for each sampled row, then
//!    [`DeterminismPolicy::commit_state`] for each planned sequence (recurrent layers' state);
//! 6. [`DeterminismPolicy::after_step`] (replay: the due verify passes, accept, roll back);
//! 7. [`DeterminismPolicy::settle_finish`] as committed tokens are emitted (finish-undo).
//!
//! Only this module (and the accept step it calls) writes a sequence's `verified` count.

use crate::config::{DeterminismMode, EngineConfig, VerifyStrategy};
use crate::error::{DetspecError, Result};
use crate::kv::{PageAllocator, PageClass};
use crate::model::ForwardBatch;
use crate::ops::AttentionSchedule;
use crate::output::{FinishReason, StopReason};
use crate::sampling::SamplingParams;
use crate::sched::{Scheduler, Sequence, SequenceId};

use super::{ForwardFn, Verifier, VerifyStats};

/// The shapes a standalone forward (score, audit) runs at so that its logits equal, bit for bit,
/// those of a deterministic generation of the same tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScoringShape {
    /// Every kernel on the invariant path is shape-invariant: any grouping gives the same bits.
    Any,
    /// Replay on GEMMs whose bits depend on M: the prompt in passes of exactly
    /// `prefill_rows` rows (as its isolated prefill ran), then the completion in passes of
    /// exactly `verify_rows` rows (as verify passes run), every row projected, padded with rows
    /// on the pad page.
    Generation {
        prefill_rows: usize,
        verify_rows: usize,
        pad_page: u32,
    },
}

/// How deterministic requests are made reproducible (see the module table).
#[derive(Debug)]
enum Strategy {
    Off,
    BatchInvariant,
    Inline,
    Replay(Verifier),
}

/// The engine's determinism policy, chosen once at load from the configuration and what the
/// backend's kernels prove.
#[derive(Debug)]
pub struct DeterminismPolicy {
    strategy: Strategy,
    /// `{mode}-w{W}-b{B}` or `dvr-inline`: the determinism part of the fingerprint.
    label: String,
}

impl DeterminismPolicy {
    /// `invariant_gemm_backend`: the backend's fast-path GEMM is batch- and position-invariant
    /// (asserted by tests for the CPU's packed GEMM), which is what the inline strategy needs.
    /// `pad_page` is the reserved KV page that replay's padding rows write to and read from.
    pub fn new(
        cfg: &EngineConfig,
        invariant_gemm_backend: bool,
        sliding_window: Option<usize>,
        pad_page: u32,
    ) -> Result<Self> {
        let strategy =
            match cfg.determinism {
                DeterminismMode::Off => Strategy::Off,
                DeterminismMode::BatchInvariant => Strategy::BatchInvariant,
                DeterminismMode::Dvr => {
                    match cfg.verify_strategy {
                        VerifyStrategy::Auto if invariant_gemm_backend => Strategy::Inline,
                        VerifyStrategy::Inline if invariant_gemm_backend => Strategy::Inline,
                        VerifyStrategy::Inline => return Err(DetspecError::param(
                            "verify_strategy",
                            "\"inline\" needs a backend whose GEMMs are batch-invariant (cpu with \
                         kernel_profile=\"invariant\"); use \"replay\"",
                        )),
                        VerifyStrategy::Auto | VerifyStrategy::Replay => Strategy::Replay(
                            Verifier::new(cfg, sliding_window, pad_page, !invariant_gemm_backend),
                        ),
                    }
                }
            };
        // Inline outputs do not depend on W and B; replayed ones are only promised per (W, B).
        let label = match strategy {
            Strategy::Inline => "dvr-inline".to_string(),
            _ => format!(
                "{}-w{}-b{}",
                cfg.determinism.as_str(),
                cfg.verify_window,
                cfg.verify_group
            ),
        };
        Ok(Self { strategy, label })
    }

    /// The determinism part of the fingerprint.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Whether deterministic prompts are prefilled alone and unchunked (replay: their KV and
    /// first token are then a pure function of the prompt; inline rows are invariant wherever
    /// they sit, so their prefill may be batched and chunked).
    pub fn isolates_deterministic_prefill(&self) -> bool {
        matches!(self.strategy, Strategy::Replay(_))
    }

    /// Admission: whether the request's sequences are deterministic, or why it is refused.
    pub fn admit(&self, params: &SamplingParams) -> Result<bool> {
        if params.deterministic && matches!(self.strategy, Strategy::Off) {
            return Err(DetspecError::param(
                "deterministic",
                "this engine runs with determinism=\"off\"; start it with \"dvr\" or \"batch_invariant\"",
            ));
        }
        Ok(params.deterministic)
    }

    /// The class of the prompt pages `seq` writes, and of the cached pages it may read: a
    /// deterministic request's prefill runs on invariant kernels (inline rows; replay's
    /// isolated prefill, in fixed-shape passes where GEMMs depend on M), so its pages are
    /// [`PageClass::Invariant`], the same bits whoever computed them, and it reads only those;
    /// fast-path pages are never read by a deterministic request. In `batch_invariant` mode
    /// every page is invariant.
    pub fn page_class(&self, seq: &Sequence) -> PageClass {
        match self.strategy {
            Strategy::Off => PageClass::Fast,
            Strategy::BatchInvariant => PageClass::Invariant,
            Strategy::Inline | Strategy::Replay(_) if seq.deterministic => PageClass::Invariant,
            Strategy::Inline | Strategy::Replay(_) => PageClass::Fast,
        }
    }

    /// The class of the pages holding a finished sequence's answer. A deterministic answer's
    /// KV was written by inline rows or by the verifier; where every kernel is
    /// shape-invariant that is what a prefill of the same tokens writes, so its pages are
    /// [`PageClass::Invariant`] and a deterministic next turn reads them. Where GEMMs depend on
    /// M the verifier's B × W passes differ from a prefill's W-row passes: they serve plain
    /// requests only ([`PageClass::Fast`], continuing the invariant prompt pages).
    pub fn output_page_class(&self, seq: &Sequence) -> PageClass {
        match (self.page_class(seq), self.scoring_shape()) {
            (PageClass::Invariant, ScoringShape::Any) => PageClass::Invariant,
            _ => PageClass::Fast,
        }
    }

    /// A sequence was preempted (its KV freed, requeued for recompute). Under replay its
    /// speculative tokens are dropped; committed ones stay (they were emitted) and are
    /// re-verified after the prompt's isolated re-prefill, which rebuilds the exact KV.
    pub fn on_preempt(&self, seq: &mut Sequence) {
        if !self.speculates(seq.deterministic) {
            return;
        }
        seq.output.truncate(seq.verified);
        seq.logprobs.truncate(seq.verified);
        seq.verified = seq.verified.min(1);
        seq.finish = None;
        seq.stop_reason = None;
        seq.dvr.wait_since = None;
    }

    /// Kernel options of the shared (fast-path) batch, whose sequences' deterministic flags
    /// are `deterministic`, in batch order.
    pub fn prepare_shared_batch(
        &self,
        batch: &mut ForwardBatch,
        deterministic: impl Iterator<Item = bool>,
    ) {
        // Every mode but batch_invariant runs the experts at their routed row counts: the
        // inline strategy's GEMMs are row-invariant at any count, and replay verifies.
        batch.fast_experts = !matches!(self.strategy, Strategy::BatchInvariant);
        match self.strategy {
            Strategy::BatchInvariant => {
                batch.attention.schedule = AttentionSchedule::Fixed;
                batch.invariant_gemm = true;
            }
            Strategy::Inline => batch.attention.fixed_seqs = deterministic.collect(),
            Strategy::Off | Strategy::Replay(_) => {}
        }
    }

    /// The forward passes of the isolated deterministic prefills (`batch`: the prompt rows of
    /// one or more sequences), each with the indices among its logits of the batch's logit
    /// rows it computes, in order. Invariant attention; on GEMMs whose bits depend on M,
    /// passes of exactly W rows ([`super::replay::fixed_shape_passes`]), so a prompt's KV is
    /// the same for every request that shares it, whatever shares its passes; otherwise one
    /// pass.
    pub fn isolated_prefill_passes(
        &self,
        mut batch: ForwardBatch,
    ) -> Vec<(ForwardBatch, Vec<usize>)> {
        batch.attention.schedule = AttentionSchedule::Fixed;
        batch.invariant_gemm = matches!(self.strategy, Strategy::BatchInvariant);
        match &self.strategy {
            Strategy::Replay(v) if v.shape().project_all_rows => super::replay::fixed_shape_passes(
                &batch,
                v.shape().window,
                v.pad_page(),
                v.shape().page_size,
            ),
            _ => {
                let sampled = (0..batch.logit_rows.len()).collect();
                vec![(batch, sampled)]
            }
        }
    }

    /// A token was sampled and appended to `seq`: commit it, unless it is speculative (replay,
    /// past the first token, which comes from the isolated prefill and is committed at once).
    pub fn after_sample(&self, seq: &mut Sequence) {
        if !self.speculates(seq.deterministic) || seq.output.len() == 1 {
            seq.verified = seq.output.len();
        }
    }

    /// After the step's forward passes: runs the verify passes that are due (replay) and
    /// returns the sequences whose committed state changed. `step` is the engine's step clock.
    pub fn after_step(
        &mut self,
        sched: &mut Scheduler,
        alloc: &dyn PageAllocator,
        step: u64,
        eos: &[u32],
        forward: &mut ForwardFn<'_>,
    ) -> Result<Vec<SequenceId>> {
        match &mut self.strategy {
            Strategy::Replay(verifier) => verifier.run_due(sched, alloc, step, eos, forward),
            _ => Ok(Vec::new()),
        }
    }

    /// Settles `seq`'s finish once its committed tokens before `emitted_to` have been emitted.
    /// `found`: the committed token index and reason where a finish was seen; anything after
    /// it (speculative) is discarded. With none found and every token committed, a finish
    /// seen on a discarded speculative path is undone.
    pub fn settle_finish(
        &self,
        seq: &mut Sequence,
        found: Option<(usize, FinishReason, Option<StopReason>)>,
    ) {
        if let Some((idx, reason, stop)) = found {
            seq.output.truncate(idx);
            seq.logprobs.truncate(idx);
            seq.verified = idx;
            seq.finish = Some(reason);
            seq.stop_reason = stop;
        } else if self.speculates(seq.deterministic) && seq.verified == seq.output.len() {
            seq.finish = None;
            seq.stop_reason = None;
        }
    }

    /// The shapes scoring must use to reproduce deterministic generations.
    pub fn scoring_shape(&self) -> ScoringShape {
        match &self.strategy {
            Strategy::Replay(v) if v.shape().project_all_rows => ScoringShape::Generation {
                prefill_rows: v.shape().window,
                verify_rows: v.shape().window * v.shape().group,
                pad_page: v.pad_page(),
            },
            _ => ScoringShape::Any,
        }
    }

    /// Engine-wide verification counters (zero unless replaying).
    pub fn verify_stats(&self) -> VerifyStats {
        match &self.strategy {
            Strategy::Replay(verifier) => verifier.stats(),
            _ => VerifyStats::default(),
        }
    }

    /// Whether a sequence of this `deterministic` flag decodes speculative tokens that a
    /// verify pass commits.
    pub fn speculates(&self, deterministic: bool) -> bool {
        deterministic && matches!(self.strategy, Strategy::Replay(_))
    }

    /// After a step's forwards and samples: where `seq`'s computed tokens end just before its
    /// last committed token (its isolated prefill, or the re-prefill after a preemption), its
    /// live recurrent state is the committed one, which the next verify window replays from.
    pub fn commit_state(&self, seq: &Sequence) -> Result<()> {
        match &seq.states {
            Some(states) if seq.num_computed + 1 == seq.prompt.len() + seq.verified => {
                states.commit()
            }
            _ => Ok(()),
        }
    }
}
