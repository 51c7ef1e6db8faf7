//! Which waiting prompts wait for a prefill still running, so that they read its pages from
//! the prefix cache instead of computing them beside it
//! ([`super::SchedulerLimits::defer_shared_prefills`]): the `n` samples of a request, a GRPO
//! group. SGLang's scheduler deprioritises in-batch shared prefixes the same way.

use std::collections::HashMap;

use super::{SchedulerLimits, Sequence, SequenceId};

/// The prefills of one step's planning that waiting prompts may wait for: the running ones
/// still prefilling, then each one admitted. Empty (holding nobody back) when deferral is off.
pub(super) struct SharedPrefills {
    leaders: Option<HashMap<PrefillKey, Leader>>,
    page_size: usize,
    /// On a recurrent model: where a leader's prefill is to keep its state for the prompts
    /// waiting on it that share less than its whole prompt (`Sequence::shared_prefix`).
    snapshots: HashMap<SequenceId, usize>,
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
        Self {
            leaders,
            page_size,
            snapshots: HashMap::new(),
        }
    }

    /// Whether the waiting `seq`, holding no pages yet, waits for a running prefill that
    /// computes full pages covering at least half of its prompt (on a recurrent model, asking
    /// it to keep its state where their shared run ends, unless it already keeps one
    /// elsewhere for another).
    pub(super) fn holds_back(&mut self, seq: &Sequence) -> bool {
        let Some(leaders) = &self.leaders else {
            return false;
        };
        let fresh = seq.num_computed == 0 && seq.block_table.pages().is_empty();
        let Some(leader) = prefill_key(seq, self.page_size).and_then(|k| leaders.get(&k)) else {
            return false;
        };
        let Some(read) = fresh
            .then(|| readable_after(&seq.prompt, leader, self.page_size))
            .flatten()
        else {
            return false;
        };
        if read.saturating_sub(leader.cached) * 2 < seq.prompt.len() {
            return false;
        }
        if !leader.recurrent || read == leader.kept(self.page_size) {
            return true;
        }
        *self.snapshots.entry(leader.id).or_insert(read) == read
    }

    /// Where each leader is to keep its state ([`Self::holds_back`]) for the prompts that
    /// wait on it, `waiting` included (those the step had no room to look at, which can then
    /// read it next step). Only prefills on recurrent models are asked.
    pub(super) fn snapshots<'a>(
        &mut self,
        waiting: impl Iterator<Item = &'a Sequence>,
    ) -> &HashMap<SequenceId, usize> {
        let recurrent = self
            .leaders
            .as_ref()
            .is_some_and(|l| l.values().any(|l| l.recurrent));
        if recurrent {
            for seq in waiting {
                self.holds_back(seq);
            }
        }
        &self.snapshots
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
    id: SequenceId,
    prompt: Vec<u32>,
    cached: usize,
    /// Prompt tokens computed when planning began: a state is kept only past them.
    computed: usize,
    /// The model keeps recurrent states: the prefill leaves a state after its prompt's last
    /// full page (`kv::state`), and after a shorter run only where asked to.
    recurrent: bool,
}

impl Leader {
    /// Where its prefill keeps its state unasked: after its prompt's last full page.
    fn kept(&self, page_size: usize) -> usize {
        self.prompt.len().saturating_sub(1) / page_size * page_size
    }
}

/// [`prefill_key`] and [`Leader`] of a sequence whose prefill computes prompt pages others
/// could read: more full pages than it read from the cache.
fn leader_entry(seq: &Sequence, page_size: usize) -> Option<(PrefillKey, Leader)> {
    let readable = seq.prompt.len().saturating_sub(1) / page_size * page_size;
    if readable < seq.num_cached_tokens + page_size {
        return None;
    }
    let leader = Leader {
        id: seq.id,
        prompt: seq.prompt.clone(),
        cached: seq.num_cached_tokens,
        computed: seq.num_computed,
        recurrent: seq.states.is_some(),
    };
    prefill_key(seq, page_size).map(|k| (k, leader))
}

/// The prompt tokens `prompt` could read once `leader`'s prefill ran: the full pages they
/// share (on a recurrent model at most the leader's kept run, and a shorter one only where the
/// leader's prefill has yet to pass it). The caller weighs them: waiting pays where those the
/// leader computes (not those it read from the cache) cover at least half of the prompt (a
/// long prefill sharing only a short system prompt is not worth the wait; nor is one whose
/// shared part was cached already, as the system prompt of a chat's later requests).
fn readable_after(prompt: &[u32], leader: &Leader, page_size: usize) -> Option<usize> {
    let common = prompt
        .iter()
        .zip(&leader.prompt)
        .take_while(|(a, b)| a == b)
        .count();
    let pages = common.min(prompt.len().saturating_sub(1)) / page_size * page_size;
    if !leader.recurrent {
        return Some(pages);
    }
    let kept = leader.kept(page_size);
    match pages >= kept {
        true => Some(kept),
        false => (pages > leader.computed).then_some(pages),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a prompt could read after a prefill: the pages they share; on a recurrent model
    /// the leader's whole kept run, or a shorter shared run only where the leader's prefill
    /// has yet to pass it (it is then asked to keep its state there).
    #[test]
    fn a_recurrent_models_prompt_reads_only_where_the_leader_keeps_a_state() {
        let leader = |recurrent, computed| Leader {
            id: 1,
            prompt: (0..100).collect(),
            cached: 0,
            computed,
            recurrent,
        };
        let same: Vec<u32> = (0..100).collect();
        let first_70: Vec<u32> = (0..70).chain(500..530).collect();
        for recurrent in [false, true] {
            assert_eq!(readable_after(&same, &leader(recurrent, 0), 16), Some(96));
        }
        assert_eq!(readable_after(&first_70, &leader(false, 0), 16), Some(64));
        assert_eq!(readable_after(&first_70, &leader(true, 0), 16), Some(64));
        assert_eq!(
            readable_after(&first_70, &leader(true, 64), 16),
            None,
            "the leader's prefill passed 64 tokens already"
        );
    }
}
