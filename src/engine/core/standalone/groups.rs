//! Where a standalone forward's KV pages come from: its sequences run in groups that fit the
//! token budget and the free pages; each sequence reads the cached pages before its first
//! wanted row, and the pages a group computed are registered in the prefix cache before they
//! are given back ([`PrefixUse`] says which, and as which class). On a model with recurrent
//! layers each sequence has a state of its own for the call, starting from the snapshot after
//! the cached pages it reads, and leaves one where a later sequence like it would start.

use std::collections::HashSet;

use crate::error::Result;
use crate::kv::{BlockTable, PageClass, SequenceStates, StateRef, StateSlot};

use super::super::caching::cached_prefix;
use super::super::EngineCore;
use super::{namespace_of, Scopes};

/// One sequence of a group: its KV pages and, where the model keeps recurrent states, its
/// state for the call and the snapshots its forward leaves (after how many tokens, where).
pub(super) struct GroupSeq {
    pub table: BlockTable,
    states: Option<SequenceStates>,
    snapshots: Vec<(usize, StateSlot)>,
}

impl GroupSeq {
    /// The state its rows run on (none where the model keeps none).
    pub fn state_ref(&self) -> Result<Option<StateRef>> {
        let Some(states) = &self.states else {
            return Ok(None);
        };
        let snapshots = self.snapshots.iter().map(|(end, slot)| (*end, slot));
        Ok(Some(states.forward()?.leaving(snapshots)))
    }
}

impl EngineCore {
    /// Runs `run` on groups of `seqs` (their indices), each with KV pages reserved for its
    /// sequences ([`Self::reserve_group`], cached prefixes read as `prefix` allows) and given
    /// back after, the pages `prefix` names registered in the prefix cache first. Sequences
    /// that start like an earlier one run after all the others ([`Self::sharing_order`]), so
    /// they read its pages instead of computing them beside it. A sequence's pages are those
    /// of its scope in `scopes` (its adapter and salt: their own namespace in the cache).
    pub(super) fn in_groups(
        &self,
        seqs: &[&[u32]],
        prefix: &PrefixUse<'_>,
        scopes: Scopes<'_>,
        budget: usize,
        run: GroupRun<'_>,
    ) -> Result<()> {
        for order in self.sharing_order(seqs, prefix, scopes) {
            let mut start = 0;
            while start < order.len() {
                let mut kv = self.reserve_group(seqs, &order[start..], prefix, scopes, budget)?;
                let group = &order[start..start + kv.len()];
                let result = run(self, group, &kv);
                if result.is_ok() {
                    for (&i, g) in group.iter().zip(&kv) {
                        if let Some(&keep) = prefix.cacheable.get(i) {
                            let tokens = &seqs[i][..keep.min(seqs[i].len())];
                            let scope = (prefix.class, namespace_of(scopes, i));
                            self.alloc
                                .insert_prefix_of(tokens, g.table.pages(), scope.0, scope.1);
                        }
                    }
                    self.keep_group_snapshots(seqs, group, kv.as_mut_slice(), prefix, scopes);
                }
                self.free_group(kv);
                result?;
                start += group.len();
            }
        }
        Ok(())
    }

    /// `seqs` in two runs: the first sequence of each prompt (by its first page, where it may
    /// read cached pages), then the others, which read the first one's pages once it has
    /// run (a GRPO group's completions, DPO's chosen and rejected, `n` samples).
    fn sharing_order(
        &self,
        seqs: &[&[u32]],
        prefix: &PrefixUse<'_>,
        scopes: Scopes<'_>,
    ) -> [Vec<usize>; 2] {
        let ps = self.cfg.page_size;
        let reads = self.alloc.prefix_caching_enabled();
        let mut firsts = HashSet::new();
        let (mut leaders, mut followers) = (Vec::new(), Vec::new());
        for (i, seq) in seqs.iter().enumerate() {
            let page = (reads && prefix.readable(i).min(seq.len().saturating_sub(1)) >= ps)
                .then(|| (namespace_of(scopes, i), &seq[..ps]));
            match page {
                Some(page) if !firsts.insert(page) => followers.push(i),
                _ => leaders.push(i),
            }
        }
        [leaders, followers]
    }

    /// KV pages for the sequences `seqs[i]`, `i` in `order`, in order: as many as fit
    /// `budget` tokens to compute and the free pages (one at least, else the reason it cannot
    /// run), and, where the model keeps recurrent states, no more sequences than running ones
    /// may hold states (each takes a fresh one for the call: a long list of short pairs must
    /// not allocate a state for every pair at once). A table starts with the cached pages `prefix` lets its sequence read (its
    /// `num_tokens`: the positions not to compute). [`Self::free_group`] gives them back.
    fn reserve_group(
        &self,
        seqs: &[&[u32]],
        order: &[usize],
        prefix: &PrefixUse<'_>,
        scopes: Scopes<'_>,
        budget: usize,
    ) -> Result<Vec<GroupSeq>> {
        let alloc = self.alloc.as_ref();
        let ps = self.cfg.page_size;
        let mut group: Vec<GroupSeq> = Vec::new();
        let mut tokens = 0;
        let states = self.kv.states();
        let max_seqs = if states.is_used() {
            states.capacity().max(1)
        } else {
            usize::MAX
        };
        for &i in order {
            if group.len() >= max_seqs {
                break;
            }
            let seq = seqs[i];
            // At least the last row is computed, so a wanted row is never a cached one.
            let readable = prefix.readable(i).min(seq.len().saturating_sub(1));
            let cached = match readable >= ps {
                true => {
                    let scope = (prefix.class, namespace_of(scopes, i));
                    cached_prefix(&self.alloc, states, scope, &seq[..readable])
                }
                false => Default::default(),
            };
            let mut table = BlockTable::from_shared_pages(cached.pages, ps);
            let computed = seq.len() - table.num_tokens();
            if !group.is_empty() && tokens + computed > budget {
                table.free(alloc);
                break;
            }
            if let Err(e) = table.reserve(seq.len(), ps, alloc) {
                table.free(alloc);
                if group.is_empty() {
                    return Err(e);
                }
                break;
            }
            // Where a later sequence like this one would start: the last full page of the
            // tokens whose pages are registered, before the last of them (a generation of
            // them reads that far), and before its first wanted row where that is past a page
            // (another completion of its prompt reads that far).
            let registered = prefix.cacheable.get(i).map_or(0, |&c| c.min(seq.len()));
            let mut end = registered.saturating_sub(1);
            if readable >= ps {
                end = end.min(readable);
            }
            let end = end / ps * ps;
            // And where the prefix it shares with earlier sequences ends, past what it read.
            let shared = cached.cached_tokens;
            let mut snapshots = Vec::new();
            for at in [shared, end] {
                let new = at >= ps && at > table.num_tokens();
                if states.is_used() && new && snapshots.iter().all(|(e, _)| *e != at) {
                    snapshots.extend(states.snapshot_slot().map(|slot| (at, slot)));
                }
            }
            let states = states
                .is_used()
                .then(|| SequenceStates::transient(states, cached.state));
            group.push(GroupSeq {
                table,
                states,
                snapshots,
            });
            tokens += computed;
        }
        Ok(group)
    }

    /// Keeps the snapshots a group's forward left under the prefix-cache entries of the pages
    /// they follow (registering those pages).
    fn keep_group_snapshots(
        &self,
        seqs: &[&[u32]],
        order: &[usize],
        group: &mut [GroupSeq],
        prefix: &PrefixUse<'_>,
        scopes: Scopes<'_>,
    ) {
        for (&i, g) in order.iter().zip(group) {
            for (end, slot) in g.snapshots.drain(..) {
                let (Some(tokens), Some(pages)) = (
                    seqs[i].get(..end),
                    g.table.pages().get(..end / self.cfg.page_size),
                ) else {
                    continue;
                };
                let scope = (prefix.class, namespace_of(scopes, i));
                self.keep_snapshot(tokens, pages, scope, slot);
            }
        }
    }

    fn free_group(&self, group: Vec<GroupSeq>) {
        for mut g in group {
            g.table.free(self.alloc.as_ref());
        }
    }
}

/// How a standalone forward shares KV with the prefix cache: sequence `i` may read cached
/// pages a request of `class` may read (see [`PageClass`]) before its first wanted row
/// `first_wanted[i]`, and registers its pages of its first `cacheable[i]` tokens once computed.
/// A page is registered as `class` only where its rows ran as that class's prefills run them.
pub(super) struct PrefixUse<'a> {
    class: PageClass,
    first_wanted: &'a [usize],
    cacheable: &'a [usize],
}

impl<'a> PrefixUse<'a> {
    /// Neither read nor register.
    pub(super) const NONE: PrefixUse<'static> = PrefixUse {
        class: PageClass::Fast,
        first_wanted: &[],
        cacheable: &[],
    };

    pub(super) fn new(class: PageClass, first_wanted: &'a [usize], cacheable: &'a [usize]) -> Self {
        Self {
            class,
            first_wanted,
            cacheable,
        }
    }

    /// How many of sequence `i`'s first tokens may come from the cache.
    fn readable(&self, i: usize) -> usize {
        self.first_wanted.get(i).copied().unwrap_or(0)
    }
}

/// What runs one group of sequences: `(engine, the group's sequence indices, their pages and
/// states)`.
pub(super) type GroupRun<'a> = &'a mut dyn FnMut(&EngineCore, &[usize], &[GroupSeq]) -> Result<()>;
