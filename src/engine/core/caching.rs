//! What a step leaves in the prefix cache: the prompt pages of sequences whose prefill
//! completed, and the answer pages of sequences that finished, each as the class the
//! determinism policy gives them; for a model with recurrent layers, the state after a
//! prompt's last full page and after each page an answer completes (snapshots, `kv::state`),
//! and what a waiting sequence may start from: cached pages only as deep as a snapshot, and
//! the snapshot.

use crate::kv::{KvManager, PageAllocator, PageClass, PageId, StatePool, StateRef, StateSlot};
use crate::sched::{CachedPrefix, PlanEntry, Sequence, SequenceId, StepPlan};

use super::EngineCore;

/// What a sequence reading the cache as `scope` (page class, namespace) may start from of
/// `tokens`' longest cached prefix: where the model keeps recurrent states, the pages up to the
/// deepest one after which a snapshot was kept, and that snapshot.
pub(super) fn cached_prefix(
    kv: &KvManager,
    states: &StatePool,
    scope: (PageClass, u64),
    tokens: &[u32],
) -> CachedPrefix {
    if !states.is_used() {
        let pages = kv.lookup_prefix_of(tokens, scope.0, scope.1);
        let cached_tokens = pages.len() * kv.page_size();
        return CachedPrefix {
            pages,
            state: None,
            cached_tokens,
        };
    }
    let hit = kv.lookup_prefix_ending(tokens, scope, &|entry| states.has_snapshot(entry));
    let cached_tokens = hit.cached * kv.page_size();
    match hit.end.and_then(|entry| states.snapshot(entry)) {
        Some(state) => CachedPrefix {
            pages: hit.pages,
            state: Some(state),
            cached_tokens,
        },
        None => {
            for page in hit.pages {
                kv.release(page);
            }
            CachedPrefix {
                cached_tokens,
                ..Default::default()
            }
        }
    }
}

/// A snapshot a step's forward takes: of sequence `seq`'s state after its first `position`
/// tokens (a page boundary, [`EngineCore::snapshot_point`]), into `slot`.
pub(super) struct PendingSnapshot {
    seq: SequenceId,
    position: usize,
    slot: StateSlot,
}

/// Where `refs`, the state a forward's rows of sequence `seq` use, also leaves snapshots.
pub(super) fn with_snapshots(
    refs: StateRef,
    seq: SequenceId,
    pending: &[PendingSnapshot],
) -> StateRef {
    let mine = pending.iter().filter(|p| p.seq == seq);
    refs.leaving(mine.map(|p| (p.position, &p.slot)))
}

impl EngineCore {
    /// Drops every cached prefix and every kept state snapshot (new weights, or the cache
    /// reset); returns how many cached pages it let go.
    pub(super) fn clear_cached_prefixes(&self) -> usize {
        self.kv.states().clear_snapshots();
        self.alloc.clear_prefix_cache()
    }

    /// The snapshots the plan's forwards take ([`Self::snapshot_point`]), as far as the state
    /// pool has room for them.
    pub(super) fn plan_snapshots(&self, plan: &StepPlan) -> Vec<PendingSnapshot> {
        let states = self.kv.states();
        if !self.cfg.enable_prefix_caching || !states.is_used() {
            return Vec::new();
        }
        let mut pending = Vec::new();
        for e in plan.entries.iter().chain(&plan.isolated) {
            let Some(seq) = self.sched.get(e.seq) else {
                continue;
            };
            let ps = self.cfg.page_size;
            // Where the prefix it shares with earlier prompts ends, past what it could read.
            let shared = seq.shared_prefix;
            let branch =
                (shared >= ps && e.start < shared && shared <= e.start + e.len).then_some(shared);
            for end in [branch, self.snapshot_point(seq, e)] {
                let Some(end) = end.filter(|&end| pending_at(&pending, e.seq) != Some(end)) else {
                    continue;
                };
                let Some(slot) = states.snapshot_slot() else {
                    return pending;
                };
                pending.push(PendingSnapshot {
                    seq: e.seq,
                    position: end,
                    slot,
                });
            }
        }
        pending
    }

    /// Where chunk `e` of `seq` leaves a snapshot, if anywhere: after its prompt's last full
    /// page before the prompt's last token, where a lookup of the same prompt lands (`n`
    /// samples, the prompt sent again); else, for a sequence whose computed tokens are final
    /// (no verifier behind it), after the last page the chunk completes past there, where the
    /// next turn of a conversation (sent whole) can start. A speculative answer's state is
    /// not kept: its rows may yet roll back.
    fn snapshot_point(&self, seq: &Sequence, e: &PlanEntry) -> Option<usize> {
        let ps = self.cfg.page_size;
        let prompt_end = seq.prompt.len().saturating_sub(1) / ps * ps;
        let done = e.start + e.len;
        if prompt_end >= ps && e.start < prompt_end && prompt_end <= done {
            return Some(prompt_end);
        }
        let last = done / ps * ps;
        let final_rows = !self.policy.speculates(seq.deterministic);
        (final_rows && last > e.start && last > prompt_end).then_some(last)
    }

    /// Keeps each snapshot a step's forwards took under the prefix-cache entry of the page it
    /// follows, registering the pages up to there (of the class the policy gives the prompt's
    /// pages, or an answer's past the prompt).
    pub(super) fn keep_snapshots(&self, pending: Vec<PendingSnapshot>) {
        let ps = self.cfg.page_size;
        for p in pending {
            let Some(seq) = self.sched.get(p.seq) else {
                continue;
            };
            let tokens: Vec<u32> = seq
                .prompt
                .iter()
                .chain(&seq.output)
                .take(p.position)
                .copied()
                .collect();
            let Some(pages) = seq.block_table.pages().get(..p.position / ps) else {
                continue;
            };
            let class = match p.position <= seq.prompt.len() {
                true => self.policy.page_class(seq),
                false => self.policy.output_page_class(seq),
            };
            if tokens.len() == p.position {
                self.keep_snapshot(&tokens, pages, (class, seq.cache_namespace()), p.slot);
            }
        }
    }

    /// Keeps the snapshot in `slot`, the state after `tokens`, under the prefix-cache entry of
    /// their last page, registering their pages (`pages`, one per full page) as `scope`.
    pub(super) fn keep_snapshot(
        &self,
        tokens: &[u32],
        pages: &[PageId],
        scope: (PageClass, u64),
        slot: StateSlot,
    ) {
        if let Some(entry) = self.alloc.insert_prefix_ending(tokens, pages, scope) {
            self.kv.states().keep_snapshot(entry, slot);
        }
    }

    /// Registers the full prompt pages of sequences whose prefill completed this step in the
    /// prefix cache. Prompt KV is never rewritten (verification and rollback only touch
    /// positions past the prompt), so sharing it is safe.
    pub(super) fn cache_prompt_pages(&self, plan: &StepPlan) {
        if !self.cfg.enable_prefix_caching {
            return;
        }
        let ps = self.cfg.page_size;
        for e in plan.entries.iter().chain(&plan.isolated) {
            let Some(seq) = self.sched.get(e.seq) else {
                continue;
            };
            let l = seq.prompt.len();
            if e.start < l && e.start + e.len >= l {
                let full = l / ps;
                if let Some(pages) = seq.block_table.pages().get(..full) {
                    let class = self.policy.page_class(seq);
                    self.alloc.insert_prefix_of(
                        &seq.prompt[..full * ps],
                        pages,
                        class,
                        seq.cache_namespace(),
                    );
                }
            }
        }
    }

    /// Registers the full pages of finished sequences' committed output in the prefix cache,
    /// after their prompt pages, so the next turn of a conversation (prompt + answer + new
    /// message; an agent's rollout after a tool call) reads the answer instead of computing it
    /// again. Only positions whose KV is final count: those before the last committed token
    /// (its own KV may be missing, or a rejected guess's). The class is the policy's: where a
    /// deterministic answer's KV is what a prefill of the same tokens writes, `Invariant`.
    pub(super) fn cache_output_pages(&self) {
        if !self.cfg.enable_prefix_caching {
            return;
        }
        let ps = self.cfg.page_size;
        for seq in self.sched.running().iter().filter(|s| s.is_done()) {
            let final_kv = (seq.prompt.len() + seq.verified)
                .saturating_sub(1)
                .min(seq.num_computed);
            let full = final_kv / ps;
            if full <= seq.prompt.len() / ps {
                continue; // no page past the prompt's, which were registered after prefill
            }
            let Some(pages) = seq.block_table.pages().get(..full) else {
                continue;
            };
            let tokens: Vec<u32> = seq
                .prompt
                .iter()
                .chain(&seq.output)
                .take(full * ps)
                .copied()
                .collect();
            let class = self.policy.output_page_class(seq);
            self.alloc
                .insert_prefix_of(&tokens, pages, class, seq.cache_namespace());
        }
    }
}

/// The position of the snapshot already pending for `seq`, if any.
fn pending_at(pending: &[PendingSnapshot], seq: SequenceId) -> Option<usize> {
    pending.iter().find(|p| p.seq == seq).map(|p| p.position)
}
