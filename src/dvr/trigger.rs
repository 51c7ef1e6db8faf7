//! When to verify ("Trigger" and "Grouped, fixed-shape verification" in docs/architecture.md).
//!
//! A deterministic sequence is *ready* when its speculative tokens fill a window (with the last
//! committed token, exactly W input rows), or when it finished on the fast path and its pass is
//! due under the finish-wait policy. Ready sequences are packed into groups of B, each topped up
//! with not-yet-ready deterministic sequences (verified early, for free).

use crate::sched::{Scheduler, Sequence, SequenceId};

use super::VerifyShape;

/// A deterministic sequence with speculative tokens whose committed prefix has KV.
pub fn is_verifiable(seq: &Sequence) -> bool {
    seq.deterministic
        && seq.num_speculative() > 0
        && seq.num_computed + 1 >= seq.prompt.len() + seq.verified
}

/// Whether sequences that finished on the fast path get their verify pass now: when they may
/// not wait, one has waited `finish_wait` steps, they fill a group, or no running
/// deterministic sequence is still decoding (nobody else could join). Records, per sequence,
/// the step it began waiting (`DvrState::wait_since`).
pub fn finished_verification_due(sched: &mut Scheduler, step: u64, shape: &VerifyShape) -> bool {
    let mut finished = 0;
    let mut decoding = 0;
    let mut oldest = step;
    for seq in sched.running_mut() {
        if !seq.deterministic {
            continue;
        }
        if seq.finish.is_some() && is_verifiable(seq) {
            finished += 1;
            oldest = oldest.min(*seq.dvr.wait_since.get_or_insert(step));
        } else {
            seq.dvr.wait_since = None;
            decoding += usize::from(seq.finish.is_none());
        }
    }
    finished > 0
        && (step - oldest >= shape.finish_wait as u64 || finished >= shape.group || decoding == 0)
}

/// The sequences to verify now, in admission order: full windows; and, if any full window is
/// ready or finished sequences are due, the finished ones (they cannot progress otherwise).
pub fn ready_sequences(running: &[Sequence], window: usize, finish_due: bool) -> Vec<SequenceId> {
    let verifiable = || running.iter().filter(|s| is_verifiable(s));
    let mut ready: Vec<SequenceId> = verifiable()
        .filter(|s| s.num_speculative() + 1 >= window)
        .map(|s| s.id)
        .collect();
    if ready.is_empty() && !finish_due {
        return ready;
    }
    ready.extend(
        verifiable()
            .filter(|s| s.finish.is_some() && s.num_speculative() + 1 < window)
            .map(|s| s.id),
    );
    ready
}

/// `group` (a chunk of `ready`) topped up to `size` with verifiable sequences that are not
/// ready: they fill rows that would otherwise be padding.
pub fn top_up_group(
    running: &[Sequence],
    group: &[SequenceId],
    ready: &[SequenceId],
    size: usize,
) -> Vec<SequenceId> {
    let mut members = group.to_vec();
    for s in running {
        if members.len() >= size {
            break;
        }
        if is_verifiable(s) && !members.contains(&s.id) && !ready.contains(&s.id) {
            members.push(s.id);
        }
    }
    members
}
