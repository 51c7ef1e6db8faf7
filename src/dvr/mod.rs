//! Decode–verify–rollback, laid out to be read side by side with docs/determinism.md and
//! docs/architecture.md ("Decode–verify–rollback").
//!
//! [`policy::DeterminismPolicy`] is the determinism policy as a whole: off, batch-invariant,
//! inline or replay, and the hooks the engine's step calls. The rest of this module is the
//! replay strategy:
//!
//! | protocol step           | here                                                         |
//! |-------------------------|--------------------------------------------------------------|
//! | Trigger                 | [`trigger::is_verifiable`], [`trigger::ready_sequences`], [`trigger::next_window`] |
//! | finish-wait policy      | [`trigger::finished_verification_due`]                       |
//! | Grouped, fixed shape    | [`trigger::top_up_group`], [`replay::build_replay_batch`]    |
//! | Replay                  | [`replay::build_replay_batch`] + the engine's `forward`; `predict` |
//! | Accept / roll back      | [`accept::first_mismatch`], [`accept::commit`]               |
//! | Stats                   | [`VerifyStats`] (engine-wide), `Sequence::dvr` (per request) |
//!
//! Prefill isolation is the scheduler's job (`SchedulerLimits::isolate_deterministic_prefill`,
//! set from [`DeterminismPolicy::isolates_deterministic_prefill`]); emitting committed tokens
//! is the engine's.
//! The verifier reaches the model only through the `forward` callback of
//! [`Verifier::run_due`]: it never owns tensors.

pub mod accept;
pub mod policy;
pub mod replay;
pub mod trigger;

pub use policy::{DeterminismPolicy, ScoringShape};

use crate::config::EngineConfig;
use crate::error::{DetspecError, Result};
use crate::kv::PageAllocator;
use crate::model::ForwardBatch;
use crate::sampling;
use crate::sched::{Scheduler, SequenceId};

use accept::FaultInjector;

/// Engine-wide verification counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VerifyStats {
    pub verify_passes: usize,
    pub rollbacks: usize,
    pub rolled_back_tokens: usize,
    /// Verify-pass rows that carried no real token (window and group padding).
    pub padded_rows: usize,
}

/// The fixed shape and policy of verify passes.
#[derive(Debug, Clone, Copy)]
pub struct VerifyShape {
    /// W: input rows per request (last committed token + up to W−1 speculative ones).
    pub window: usize,
    /// B: requests per pass.
    pub group: usize,
    /// Steps a sequence that finished on the fast path may wait for a fuller group.
    pub finish_wait: usize,
    pub page_size: usize,
    pub sliding_window: Option<usize>,
    /// Project every one of the B × W rows through the LM head, padding included, so that
    /// GEMM too runs at the pass's fixed shape (needed wherever a GEMM's bits depend on M;
    /// an invariant backend projects only the real rows).
    pub project_all_rows: bool,
    /// Shorter windows after rollbacks ([`trigger::next_window`]).
    pub adaptive: bool,
}

/// Runs verify passes for deterministic sequences and commits or rolls back their tokens.
#[derive(Debug)]
pub struct Verifier {
    shape: VerifyShape,
    /// The pad page: reserved, never freed; padding rows write to and read from it only.
    pad_page: u32,
    faults: FaultInjector,
    stats: VerifyStats,
}

/// Runs a batch and returns the logits of the asked logit rows (indices into the batch's
/// `logit_rows`), concatenated in the order asked: a verify pass projects all B × W rows for
/// the GEMM's fixed shape but reads only its real ones, and on a GPU copying the padding's
/// logits to the host cost more than the pass's GEMMs.
pub type ForwardFn<'a> = dyn FnMut(&ForwardBatch, &[u32]) -> Result<Vec<f32>> + 'a;

impl Verifier {
    pub fn new(
        cfg: &EngineConfig,
        sliding_window: Option<usize>,
        pad_page: u32,
        project_all_rows: bool,
    ) -> Self {
        Self {
            shape: VerifyShape {
                window: cfg.verify_window,
                group: cfg.verify_group,
                finish_wait: cfg.verify_finish_wait,
                page_size: cfg.page_size,
                sliding_window,
                project_all_rows,
                adaptive: cfg.verify_window_adaptive,
            },
            pad_page,
            faults: FaultInjector::new(cfg.fault_injection),
            stats: VerifyStats::default(),
        }
    }

    pub fn stats(&self) -> VerifyStats {
        self.stats
    }

    pub fn shape(&self) -> &VerifyShape {
        &self.shape
    }

    pub fn pad_page(&self) -> u32 {
        self.pad_page
    }

    /// Runs verify passes until no deterministic sequence is ready (`step` is the engine's step
    /// clock, for the finish-wait policy); returns the sequences whose committed state changed.
    pub fn run_due(
        &mut self,
        sched: &mut Scheduler,
        alloc: &dyn PageAllocator,
        step: u64,
        eos: &[u32],
        forward: &mut ForwardFn<'_>,
    ) -> Result<Vec<SequenceId>> {
        let mut touched = Vec::new();
        loop {
            let finish_due = trigger::finished_verification_due(sched, step, &self.shape);
            let ready = trigger::ready_sequences(sched.running(), self.shape.window, finish_due);
            if ready.is_empty() {
                return Ok(touched);
            }
            for group in ready.chunks(self.shape.group) {
                let members =
                    trigger::top_up_group(sched.running(), group, &ready, self.shape.group);
                self.verify_group(sched, alloc, &members, eos, forward)?;
                touched.extend(members);
            }
        }
    }

    /// One verify pass over up to B sequences (B × W rows, fixed attention schedule), then the
    /// accept step for each of them.
    fn verify_group(
        &mut self,
        sched: &mut Scheduler,
        alloc: &dyn PageAllocator,
        members: &[SequenceId],
        eos: &[u32],
        forward: &mut ForwardFn<'_>,
    ) -> Result<()> {
        let replay = replay::build_replay_batch(sched, alloc, members, &self.shape, self.pad_page)?;
        self.stats.verify_passes += 1;
        self.stats.padded_rows += replay.padded_rows;
        let wanted: Vec<u32> = replay
            .windows
            .iter()
            .flat_map(|w| (w.first_row..=w.first_row + w.n).map(|r| r as u32))
            .collect();
        let logits = forward(&replay.batch, &wanted)?;
        let vocab = logits.len().checked_div(wanted.len()).unwrap_or(0);
        if vocab * wanted.len() != logits.len() || (vocab == 0 && !wanted.is_empty()) {
            return Err(DetspecError::InvalidRequest {
                request_id: None,
                message: format!(
                    "verify pass returned {} logits for {} rows",
                    logits.len(),
                    wanted.len()
                ),
            });
        }
        let preds = predict(sched, &replay.windows, &logits, vocab, eos)?;
        let mut preds = preds.into_iter();
        // Each window's predictions and first mismatch (forced ones included).
        let mut verdicts = Vec::with_capacity(replay.windows.len());
        for window in &replay.windows {
            let window_preds: Vec<_> = preds.by_ref().take(window.n + 1).collect();
            let forced = self.faults.next_window();
            let Some(seq) = sched.get(window.seq) else {
                verdicts.push(None);
                continue;
            };
            let mut mismatch = accept::first_mismatch(&seq.output[seq.verified..], &window_preds);
            if let Some(fault) = forced {
                if mismatch.is_none() && window.n > 0 {
                    mismatch = Some(fault.index(window.seq, window.n));
                }
            }
            verdicts.push(Some((window_preds, mismatch)));
        }
        self.settle_states(sched, &replay, &verdicts, forward)?;
        for (window, verdict) in replay.windows.into_iter().zip(verdicts) {
            let (Some((window_preds, mismatch)), Some(seq)) = (verdict, sched.get_mut(window.seq))
            else {
                continue;
            };
            let rolled_back =
                accept::commit(seq, window_preds, mismatch, alloc, self.shape.page_size);
            seq.dvr.padded_rows += self.shape.window - (window.n + 1);
            if self.shape.adaptive {
                seq.dvr.window = trigger::next_window(seq.dvr.window, mismatch, self.shape.window);
            }
            if let Some(dropped) = rolled_back {
                self.stats.rollbacks += 1;
                self.stats.rolled_back_tokens += dropped;
            }
        }
        Ok(())
    }

    /// Leaves each window's recurrent state (models with linear attention) at its committed
    /// tokens: the pass advanced the live state by all its rows from the committed one; where
    /// a window rolled back, the same batch runs again (same shape, so the same bits), its
    /// state taking in only the accepted rows. Then live becomes committed.
    fn settle_states(
        &self,
        sched: &Scheduler,
        replay: &replay::ReplayBatch,
        verdicts: &[Option<(Vec<crate::output::TokenLogprobs>, Option<usize>)>],
        forward: &mut ForwardFn<'_>,
    ) -> Result<()> {
        let seqs: Vec<_> = replay.windows.iter().map(|w| sched.get(w.seq)).collect();
        if !seqs.iter().flatten().any(|s| s.states.is_some()) {
            return Ok(());
        }
        let rolled_back = verdicts.iter().flatten().any(|(_, m)| m.is_some());
        if rolled_back {
            let mut again = replay.batch.clone();
            again.logit_rows.clear();
            for (i, (window, verdict)) in replay.windows.iter().zip(verdicts).enumerate() {
                let accepted = match verdict {
                    Some((_, Some(m))) => m + 1,
                    _ => window.n + 1,
                };
                if let (Some(Some(s)), Some(slot)) = (seqs.get(i), again.states.get_mut(i)) {
                    *slot = s
                        .states
                        .as_ref()
                        .map(|st| st.replay(accepted))
                        .transpose()?;
                }
            }
            forward(&again, &[])?;
        }
        for seq in seqs.into_iter().flatten() {
            if let Some(states) = &seq.states {
                states.commit()?;
            }
        }
        Ok(())
    }
}

/// The verifier's prediction at every row of `windows` (`logits`: their rows, `vocab` wide, in
/// window order), sampled exactly as the fast path sampled: same seed, same absolute position,
/// same output context. Structured-output masks come first, one window after another (a
/// constraint's cache is mutable state); then the rows are sampled in parallel, each a pure
/// function of its logits, its sequence's parameters and the prefix before it. Every window's
/// sequence is running: the batch was built from running sequences and nothing ran since.
fn predict(
    sched: &mut Scheduler,
    windows: &[replay::ReplayWindow],
    logits: &[f32],
    vocab: usize,
    eos: &[u32],
) -> Result<Vec<crate::output::TokenLogprobs>> {
    use rayon::prelude::*;

    // (window, row within it, the mask of its position).
    let missing = |id: SequenceId| DetspecError::InvalidRequest {
        request_id: None,
        message: format!("verify: sequence {id} is not running"),
    };
    let mut rows = Vec::with_capacity(logits.len().checked_div(vocab).unwrap_or(0));
    for (wi, window) in windows.iter().enumerate() {
        let seq = sched
            .get_mut(window.seq)
            .ok_or_else(|| missing(window.seq))?;
        let v = seq.verified;
        for j in 0..=window.n {
            // The fast path's own mask, from the constraint's cache, as the prefix before this
            // position is the one it sampled after.
            let mask = match seq.constraint.as_mut() {
                Some(c) => c.mask_after(&seq.output[..v + j])?,
                None => None,
            };
            rows.push((wi, j, mask));
        }
    }
    let sched: &Scheduler = sched;
    rows.par_iter()
        .zip(logits.par_chunks(vocab.max(1)))
        .map(|((wi, j, mask), row)| {
            let id = windows[*wi].seq;
            let seq = sched.get(id).ok_or_else(|| missing(id))?;
            sampling::sample_next(
                &seq.params,
                seq.seed,
                &seq.prompt,
                &seq.output[..seq.verified + j],
                row,
                eos,
                mask.as_deref(),
            )
        })
        .collect()
}
