//! Accept or roll back ("Accept" in docs/architecture.md).
//!
//! The verifier's predictions v_0…v_n are compared with the speculative tokens u_0…u_{n−1}:
//! with no mismatch, u_0…u_{n−1} and the bonus token v_n are committed; with a first mismatch
//! at m, u_0…u_{m−1} and v_m are, the rest is discarded and the KV cache truncated to the
//! committed length. Committed tokens carry the verifier's logprobs.

use crate::kv::PageAllocator;
use crate::output::TokenLogprobs;
use crate::sampling;
use crate::sched::{Sequence, SequenceId};

/// Index of the first speculative token the verifier disagrees with.
pub fn first_mismatch(speculative: &[u32], preds: &[TokenLogprobs]) -> Option<usize> {
    (0..preds.len()).find(|&j| speculative.get(j).is_some_and(|&u| u != preds[j].token))
}

/// Commits the verifier's tokens of one window (`preds` = v_0…v_n) up to and including the
/// mismatch (or all of them), discards the rest and truncates the KV cache. Returns the number
/// of discarded speculative tokens when it rolled back.
pub fn commit(
    seq: &mut Sequence,
    preds: Vec<TokenLogprobs>,
    mismatch: Option<usize>,
    alloc: &dyn PageAllocator,
    page_size: usize,
) -> Option<usize> {
    let v = seq.verified;
    seq.dvr.verify_passes += 1;
    let (commit, rolled_back) = match mismatch {
        Some(m) => {
            let dropped = seq.output.len() - (v + m + 1);
            seq.dvr.rollbacks += 1;
            seq.dvr.rolled_back_tokens += dropped;
            (m + 1, Some(dropped))
        }
        None => (preds.len(), None),
    };
    seq.output.truncate(v);
    seq.logprobs.truncate(v);
    for p in preds.into_iter().take(commit) {
        seq.output.push(p.token);
        seq.logprobs.push(p);
    }
    seq.verified = seq.output.len();
    // A finish seen on the speculative path is re-checked on the committed tokens at emit.
    seq.finish = None;
    seq.stop_reason = None;
    // KV is valid up to the last committed token's predecessor; it is the next input.
    seq.num_computed = seq.prompt.len() + seq.verified - 1;
    seq.block_table.truncate(seq.num_computed, page_size, alloc);
    rolled_back
}

/// Forces a share of verify windows to mismatch, to exercise the rollback path in tests and
/// benchmarks: exactly `share` of all windows, spread evenly (window k is hit when
/// floor(k·share) steps up).
#[derive(Debug)]
pub struct FaultInjector {
    share: f64,
    windows: u64,
}

/// A window chosen to fail.
#[derive(Debug, Clone, Copy)]
pub struct ForcedFault {
    window: u64,
}

impl ForcedFault {
    /// The pseudo-random index in `0..n` where the window is made to diverge.
    pub fn index(&self, seq: SequenceId, n: usize) -> usize {
        (sampling::uniform(0xfa17, self.window, seq) * n as f64) as usize
    }
}

impl FaultInjector {
    pub fn new(share: f64) -> Self {
        Self { share, windows: 0 }
    }

    /// Counts one more window; `Some` when it is to be forced to mismatch.
    pub fn next_window(&mut self) -> Option<ForcedFault> {
        if self.share <= 0.0 {
            return None;
        }
        self.windows += 1;
        let k = self.windows as f64;
        ((k * self.share).floor() > ((k - 1.0) * self.share).floor()).then_some(ForcedFault {
            window: self.windows,
        })
    }
}
