//! The structured-output masks of a step, computed on a second thread while the forward runs:
//! a mask depends on the tokens so far, not on the logits, so it need not wait for them.

use std::collections::HashMap;

use crate::error::{DetspecError, Result};
use crate::sampling::{TokenConstraint, TokenMask};
use crate::sched::SequenceId;

use super::EngineCore;

/// One constrained sequence's grammar state, out of the scheduler for the step.
struct MaskJob {
    seq: SequenceId,
    constraint: TokenConstraint,
    /// The output so far: the mask is of the token after it.
    prefix: Vec<u32>,
    /// `Ok(None)`: the constraint has not started (any token may come).
    mask: Option<Result<Option<TokenMask>>>,
}

/// The masks of one step by sequence, and the sequences whose mask could not be computed.
#[derive(Default)]
pub(super) struct StepMasks {
    by_seq: HashMap<SequenceId, TokenMask>,
    failed: Vec<(SequenceId, DetspecError)>,
}

impl StepMasks {
    pub fn get(&self, seq: SequenceId) -> Option<&[u32]> {
        self.by_seq.get(&seq).map(|m| &m[..])
    }

    pub fn failed(&self, seq: SequenceId) -> bool {
        self.failed.iter().any(|(s, _)| *s == seq)
    }

    pub fn into_failures(self) -> Vec<(SequenceId, DetspecError)> {
        self.failed
    }
}

impl EngineCore {
    /// Runs `forward` while the masks of the constrained sequences among `ids` are computed
    /// beside it; returns both.
    pub(super) fn forward_with_masks<T>(
        &mut self,
        ids: &[SequenceId],
        forward: impl FnOnce(&EngineCore) -> T,
    ) -> (T, StepMasks) {
        let jobs: Vec<MaskJob> = ids
            .iter()
            .filter_map(|&id| {
                let seq = self.sched.get_mut(id)?;
                let constraint = seq.constraint.take()?;
                Some(MaskJob {
                    seq: id,
                    constraint,
                    prefix: seq.output.clone(),
                    mask: None,
                })
            })
            .collect();
        if jobs.is_empty() {
            return (forward(self), StepMasks::default());
        }
        let job_ids: Vec<SequenceId> = jobs.iter().map(|j| j.seq).collect();
        let (out, jobs) = std::thread::scope(|s| {
            let masker = s.spawn(move || {
                let mut jobs = jobs;
                for job in jobs.iter_mut() {
                    job.mask = Some(job.constraint.mask_after(&job.prefix));
                }
                jobs
            });
            let out = forward(self);
            (out, masker.join())
        });
        let mut masks = StepMasks::default();
        let Ok(jobs) = jobs else {
            // The grammar states are lost with the thread: their sequences fail.
            for id in job_ids {
                let e = DetspecError::param(
                    "structured_outputs",
                    "the grammar engine panicked computing the allowed tokens",
                );
                masks.failed.push((id, e));
            }
            return (out, masks);
        };
        for job in jobs {
            if let Some(seq) = self.sched.get_mut(job.seq) {
                seq.constraint = Some(job.constraint);
            }
            match job.mask {
                Some(Ok(Some(mask))) => {
                    masks.by_seq.insert(job.seq, mask);
                }
                Some(Err(e)) => masks.failed.push((job.seq, e)),
                Some(Ok(None)) | None => {}
            }
        }
        (out, masks)
    }
}
