//! When to verify ("Trigger" and "Grouped, fixed-shape verification" in docs/architecture.md).
//!
//! A deterministic sequence is *ready* when its speculative tokens fill a window (with the last
//! committed token, exactly W input rows; fewer after rollbacks with `verify_window_adaptive`,
//! [`next_window`]), or when it finished on the fast path and its pass is due under the
//! finish-wait policy. Ready sequences are packed into groups of B, each topped up
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
    let full = |s: &Sequence| s.num_speculative() + 1 >= window_of(s, window);
    let mut ready: Vec<SequenceId> = verifiable().filter(|s| full(s)).map(|s| s.id).collect();
    if ready.is_empty() && !finish_due {
        return ready;
    }
    ready.extend(
        verifiable()
            .filter(|s| s.finish.is_some() && !full(s))
            .map(|s| s.id),
    );
    ready
}

/// The input rows `seq`'s window waits for: its own (adaptive verifier), else W.
fn window_of(seq: &Sequence, window: usize) -> usize {
    match seq.dvr.window {
        0 => window,
        own => own.min(window),
    }
}

/// The next window of a sequence whose last window (`current` rows, 0: W) mismatched at
/// speculative token `mismatch` (or matched throughout): twice the m + 1 tokens the window
/// kept, at least W/8; after a window that matched throughout, twice the last, up to W.
pub fn next_window(current: usize, mismatch: Option<usize>, window: usize) -> usize {
    let floor = (window / 8).max(2);
    let current = if current == 0 { window } else { current };
    match mismatch {
        Some(m) => (2 * (m + 1)).clamp(floor, window),
        None => (2 * current).min(window),
    }
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

#[cfg(test)]
mod tests {
    use super::next_window;

    #[test]
    fn windows_shrink_after_rollbacks_and_grow_back() {
        // W = 64: a mismatch at token 5 kept 6 tokens -> 12 rows; at token 0 -> the floor, 8.
        assert_eq!(next_window(0, Some(5), 64), 12);
        assert_eq!(next_window(12, Some(0), 64), 8);
        // A late mismatch or clean windows go back up, never past W.
        assert_eq!(next_window(8, Some(40), 64), 64);
        assert_eq!(next_window(8, None, 64), 16);
        assert_eq!(next_window(48, None, 64), 64);
        assert_eq!(next_window(0, None, 64), 64);
        // Tiny W: the floor is 2 rows (one speculative token).
        assert_eq!(next_window(0, Some(0), 2), 2);
    }
}
