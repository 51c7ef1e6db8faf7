//! Which waiting prompts wait for a prefill still running, so that they read its pages from
//! the prefix cache instead of computing them beside it
//! ([`super::SchedulerLimits::defer_shared_prefills`]): the `n` samples of a request, a GRPO
//! group. SGLang's scheduler deprioritises in-batch shared prefixes the same way.

use std::collections::HashMap;

use super::{SchedulerLimits, Sequence};

/// The prefills of one step's planning that waiting prompts may wait for: the running ones
/// still prefilling, then each one admitted. Empty (holding nobody back) when deferral is off.
pub(super) struct SharedPrefills {
    leaders: Option<HashMap<PrefillKey, Leader>>,
    page_size: usize,
}

impl SharedPrefills {
    pub(super) fn new(running: &[Sequence], limits: &SchedulerLimits) -> Self {
        let page_size = limits.page_size.max(1);
        let leaders = limits.defer_shared_prefills.then(|| {
            running
                .iter()
                .filter(|s| s.num_computed < s.prompt.len())
                .filter_map(|s| leader_entry(s, page_size))
                .collect()
        });
        Self { leaders, page_size }
    }

    /// Whether the waiting `seq`, holding no pages yet, waits for a running prefill that
    /// computes full pages covering at least half of its prompt.
    pub(super) fn holds_back(&self, seq: &Sequence) -> bool {
        let Some(leaders) = &self.leaders else {
            return false;
        };
        let fresh = seq.num_computed == 0 && seq.block_table.pages().is_empty();
        fresh
            && prefill_key(seq, self.page_size)
                .and_then(|k| leaders.get(&k))
                .is_some_and(|l| worth_waiting_for(&seq.prompt, l, self.page_size))
    }

    /// `seq` was admitted: the prompts behind it may wait for its prefill.
    pub(super) fn admitted(&mut self, seq: &Sequence) {
        if let Some(leaders) = &mut self.leaders {
            leaders.extend(leader_entry(seq, self.page_size));
        }
    }
}

/// What makes two prompts candidates to share a prefill: the same first full page, both
/// deterministic or both not (the two read different page classes), and the same cache
/// namespace (a LoRA adapter's pages are its own).
type PrefillKey = (bool, u64, Vec<u32>);

/// `None`: a prompt of a page or less, which reads nothing from the cache.
fn prefill_key(seq: &Sequence, page_size: usize) -> Option<PrefillKey> {
    (seq.prompt.len() > page_size).then(|| {
        (
            seq.deterministic,
            seq.cache_namespace(),
            seq.prompt[..page_size].to_vec(),
        )
    })
}

/// A prefill others may wait for: its prompt, and the prompt tokens it read from the cache
/// (which it does not compute, so waiting for it gains nothing there).
struct Leader {
    prompt: Vec<u32>,
    cached: usize,
    /// The model keeps recurrent states: the prefill leaves a state only after its prompt's
    /// last full page (`kv::state`), so a prompt gains from waiting only if it shares that
    /// whole run.
    recurrent: bool,
}

/// [`prefill_key`] and [`Leader`] of a sequence whose prefill computes prompt pages others
/// could read: more full pages than it read from the cache.
fn leader_entry(seq: &Sequence, page_size: usize) -> Option<(PrefillKey, Leader)> {
    let readable = seq.prompt.len().saturating_sub(1) / page_size * page_size;
    if readable < seq.num_cached_tokens + page_size {
        return None;
    }
    let leader = Leader {
        prompt: seq.prompt.clone(),
        cached: seq.num_cached_tokens,
        recurrent: seq.states.is_some(),
    };
    prefill_key(seq, page_size).map(|k| (k, leader))
}

/// Whether `prompt` gains enough by waiting for `leader`'s prefill: the full pages they share
/// that the leader computes (not those it read from the cache) cover at least half of it. (A
/// long prefill sharing only a short system prompt is not worth the wait; nor is one whose
/// shared part was cached already, as the system prompt of a chat's later requests.)
fn worth_waiting_for(prompt: &[u32], leader: &Leader, page_size: usize) -> bool {
    let common = prompt
        .iter()
        .zip(&leader.prompt)
        .take_while(|(a, b)| a == b)
        .count();
    let mut pages = common.min(prompt.len().saturating_sub(1)) / page_size * page_size;
    if leader.recurrent {
        let kept = leader.prompt.len().saturating_sub(1) / page_size * page_size;
        pages = if pages >= kept { kept } else { 0 };
    }
    2 * pages.saturating_sub(leader.cached) >= prompt.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prompt waits for a prefill sharing at least half of it; on a recurrent model only
    /// where it shares the leader's whole run up to its state snapshot.
    #[test]
    fn a_recurrent_models_prompt_waits_only_for_the_whole_snapshotted_run() {
        let leader = |recurrent| Leader {
            prompt: (0..100).collect(),
            cached: 0,
            recurrent,
        };
        let same: Vec<u32> = (0..100).collect();
        let first_70: Vec<u32> = (0..70).chain(500..530).collect();
        for recurrent in [false, true] {
            assert!(worth_waiting_for(&same, &leader(recurrent), 16));
        }
        assert!(worth_waiting_for(&first_70, &leader(false), 16));
        assert!(
            !worth_waiting_for(&first_70, &leader(true), 16),
            "the leader's state is kept after 96 tokens, past the 70 they share"
        );
    }
}
