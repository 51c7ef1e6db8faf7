//! Per-sequence mapping from logical page index to physical page.
//!
//! A table holds one reference on each of its pages. Pages may be shared with other tables
//! ([`BlockTable::fork`]) or with the prefix cache; a shared page is read-only, and
//! [`BlockTable::prepare_append`] / [`BlockTable::prepare_write`] swap in a private copy before
//! anything is written into it (copy-on-write). The copy of the KV data itself is the caller's
//! job ([`crate::ops::copy_pages`] / [`super::KvPool::copy_pages`]): this module knows nothing of
//! tensors.
//!
//! The table tracks `num_tokens`, the number of positions holding valid KV. It decides which
//! shared page needs its contents copied (the one holding position `num_tokens` when that
//! position is mid-page) and which can simply be replaced (pages wholly past `num_tokens`).
//! It is maintained by `prepare_append`/`prepare_write` (set to the new length), `truncate`
//! (lowered), `fork` (copied), [`BlockTable::from_shared_pages`] and
//! [`BlockTable::set_num_tokens`]. `reserve` only adds capacity and leaves it alone.

use crate::error::{DetspecError, Result};

use super::{PageAllocator, PageId};

/// The pages one sequence's KV lives in, in logical order.
///
/// `Clone` copies the ids without taking references; use [`BlockTable::fork`] to get a second
/// owner.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTable {
    pages: Vec<PageId>,
    num_tokens: usize,
}

impl BlockTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// A table over pages whose references the caller already holds for this table, e.g. the
    /// result of a prefix-cache lookup. They hold `pages.len() * page_size` valid tokens.
    pub fn from_shared_pages(pages: Vec<PageId>, page_size: usize) -> Self {
        let num_tokens = pages.len() * page_size;
        Self { pages, num_tokens }
    }

    /// Physical pages in logical order.
    pub fn pages(&self) -> &[PageId] {
        &self.pages
    }

    /// Positions holding valid KV (see the module docs for who maintains it).
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// Declares how many positions hold valid KV, for callers that write through
    /// [`BlockTable::reserve`] + [`BlockTable::slot`] instead of `prepare_*`. Clamped to the
    /// capacity.
    pub fn set_num_tokens(&mut self, num_tokens: usize, page_size: usize) {
        debug_assert!(num_tokens <= self.capacity(page_size));
        self.num_tokens = num_tokens.min(self.capacity(page_size));
    }

    /// Tokens the current pages can hold.
    pub fn capacity(&self, page_size: usize) -> usize {
        self.pages.len() * page_size
    }

    /// Pages needed beyond the current ones to hold `num_tokens` tokens.
    pub fn pages_needed(&self, num_tokens: usize, page_size: usize) -> usize {
        num_tokens
            .div_ceil(page_size.max(1))
            .saturating_sub(self.pages.len())
    }

    /// Grows the table so it can hold `num_tokens` tokens. All or nothing: on failure the pages
    /// taken by this call are returned and the table is unchanged.
    ///
    /// This only adds pages; it does not make shared pages private. Writers into pages that may
    /// be shared (after a fork or a prefix-cache hit) must use [`BlockTable::prepare_append`].
    pub fn reserve(
        &mut self,
        num_tokens: usize,
        page_size: usize,
        alloc: &dyn PageAllocator,
    ) -> Result<()> {
        let needed = self.pages_needed(num_tokens, page_size);
        let fresh = take_pages(needed, alloc)?;
        self.pages.extend(fresh);
        Ok(())
    }

    /// Flat cache slot of absolute position `pos`; `None` if no page holds it yet.
    pub fn slot(&self, pos: usize, page_size: usize) -> Option<u32> {
        let page = *self.pages.get(pos / page_size.max(1))?;
        let slot = page as usize * page_size + pos % page_size.max(1);
        u32::try_from(slot).ok()
    }

    /// Keeps only the pages needed for the first `num_tokens` tokens, releasing the rest. This is
    /// DVR's rollback. A page still holding kept tokens is kept even if the positions after the
    /// new length will be rewritten: when it is shared, the next `prepare_append` copies it.
    pub fn truncate(&mut self, num_tokens: usize, page_size: usize, alloc: &dyn PageAllocator) {
        let keep = num_tokens.div_ceil(page_size.max(1));
        for p in self.pages.drain(keep.min(self.pages.len())..) {
            alloc.release(p);
        }
        self.num_tokens = self.num_tokens.min(num_tokens);
    }

    /// Releases every page.
    pub fn free(&mut self, alloc: &dyn PageAllocator) {
        self.truncate(0, 1, alloc);
    }

    /// A second table over the same pages, each gained one reference. Both tables may read every
    /// page; the first to write into a shared page gets a private copy via `prepare_append`.
    pub fn fork(&self, alloc: &dyn PageAllocator) -> BlockTable {
        for &p in &self.pages {
            alloc.share(p);
        }
        self.clone()
    }

    /// Makes the table ready to write positions `num_tokens()..num_tokens_after`: grows it and
    /// replaces every shared page that the write touches by a private one. Returns the
    /// `(src, dst)` pair whose KV contents the caller must copy (all layers, K and V) before
    /// writing, when the first touched page is shared and already holds valid tokens. Afterwards
    /// `num_tokens() == num_tokens_after`.
    ///
    /// All or nothing: on `OutOfPages` the table is unchanged.
    ///
    /// The shared source page loses this table's reference immediately. Other holders keep it
    /// alive; in the rare case they all released it meanwhile, it is free but its contents stay
    /// intact until the next `allocate`, so copy before allocating again from another thread.
    pub fn prepare_append(
        &mut self,
        num_tokens_after: usize,
        page_size: usize,
        alloc: &dyn PageAllocator,
    ) -> Result<Option<(PageId, PageId)>> {
        self.prepare_write(self.num_tokens, num_tokens_after, page_size, alloc)
    }

    /// [`BlockTable::prepare_append`] with an explicit start: positions `start..end` will be
    /// written and positions `0..start` hold valid tokens (`start` may be below `num_tokens()`,
    /// e.g. to recompute the last token of a fully cached prompt). Afterwards
    /// `num_tokens() == end`.
    pub fn prepare_write(
        &mut self,
        start: usize,
        end: usize,
        page_size: usize,
        alloc: &dyn PageAllocator,
    ) -> Result<Option<(PageId, PageId)>> {
        let ps = page_size.max(1);
        if end <= start {
            self.num_tokens = self.num_tokens.min(end.max(start));
            return Ok(None);
        }
        let first = start / ps;
        let last = (end - 1) / ps;
        // Existing pages in the written range that someone else also holds.
        let shared: Vec<usize> = (first..=last.min(self.pages.len().saturating_sub(1)))
            .filter(|&i| i < self.pages.len() && alloc.ref_count(self.pages[i]) > 1)
            .collect();
        let grow = self.pages_needed(end, ps);
        let mut fresh = take_pages(shared.len() + grow, alloc)?.into_iter();
        let mut copy = None;
        for i in shared {
            let Some(private) = fresh.next() else { break };
            let old = std::mem::replace(&mut self.pages[i], private);
            // Only the page holding `start` mid-page has valid tokens to keep; pages wholly
            // at or past `start` are about to be overwritten (or lie past the new length).
            if i == first && !start.is_multiple_of(ps) {
                copy = Some((old, private));
            }
            alloc.release(old);
        }
        self.pages.extend(fresh);
        self.num_tokens = end;
        Ok(copy)
    }
}

/// Allocates `n` pages, all or nothing.
fn take_pages(n: usize, alloc: &dyn PageAllocator) -> Result<Vec<PageId>> {
    let mut got = Vec::with_capacity(n);
    for _ in 0..n {
        match alloc.allocate() {
            Some(p) => got.push(p),
            None => {
                for p in got {
                    alloc.release(p);
                }
                return Err(DetspecError::OutOfPages {
                    needed: n,
                    free: alloc.num_free(),
                    total: alloc.num_total(),
                });
            }
        }
    }
    Ok(got)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::kv::{AtomicAllocator, SimpleAllocator};

    #[test]
    fn reserve_slot_truncate_free() {
        let a = SimpleAllocator::new(3);
        let mut bt = BlockTable::new();
        bt.reserve(17, 16, &a).unwrap();
        assert_eq!(bt.pages(), &[0, 1]);
        assert_eq!(bt.slot(16, 16), Some(16));
        assert_eq!(bt.slot(32, 16), None);
        // Too much: all-or-nothing.
        let err = bt.reserve(64, 16, &a).unwrap_err();
        assert!(matches!(err, DetspecError::OutOfPages { .. }));
        assert_eq!(bt.pages().len(), 2);
        assert_eq!(a.num_free(), 1);
        bt.truncate(16, 16, &a);
        assert_eq!(bt.pages(), &[0]);
        bt.free(&a);
        assert_eq!(a.num_free(), 3);
    }

    #[test]
    fn fork_then_cow_of_partial_last_page() {
        let a = AtomicAllocator::new(8);
        let mut parent = BlockTable::new();
        parent.prepare_append(6, 4, &a).unwrap(); // pages 0,1; page 1 holds 2 of 4 tokens
        assert_eq!(parent.pages(), &[0, 1]);
        let mut child = parent.fork(&a);
        assert_eq!((a.ref_count(0), a.ref_count(1)), (2, 2));
        // Child appends one token at position 6: page 1 is shared and mid-page -> copy.
        let cow = child.prepare_append(7, 4, &a).unwrap();
        assert_eq!(cow, Some((1, 2)));
        assert_eq!(child.pages(), &[0, 2]);
        assert_eq!((a.ref_count(0), a.ref_count(1), a.ref_count(2)), (2, 1, 1));
        // Now private: no second copy.
        assert_eq!(child.prepare_append(8, 4, &a).unwrap(), None);
        // Parent's page 1 is private again too.
        assert_eq!(parent.prepare_append(7, 4, &a).unwrap(), None);
        assert_eq!(parent.pages(), &[0, 1]);
        parent.free(&a);
        child.free(&a);
        assert_eq!(a.num_free(), 8);
    }

    #[test]
    fn cow_at_page_boundary_needs_no_copy_and_replaces_lookahead() {
        let a = AtomicAllocator::new(8);
        let mut parent = BlockTable::new();
        parent.prepare_append(4, 4, &a).unwrap();
        parent.reserve(12, 4, &a).unwrap(); // lookahead pages 1, 2 (no valid tokens)
        let mut child = parent.fork(&a);
        // Writes start at a page boundary: page 0 is untouched, pages 1 and 2 are replaced
        // without a copy.
        assert_eq!(child.prepare_append(9, 4, &a).unwrap(), None);
        assert_eq!(child.pages()[0], 0);
        assert_eq!(child.pages()[1..], [3, 4]);
        assert_eq!(a.ref_count(0), 2);
        assert_eq!((a.ref_count(1), a.ref_count(2)), (1, 1));
        parent.free(&a);
        child.free(&a);
        assert_eq!(a.num_free(), 8);
    }

    #[test]
    fn prepare_append_is_all_or_nothing() {
        let a = AtomicAllocator::new(3);
        let mut parent = BlockTable::new();
        parent.prepare_append(6, 4, &a).unwrap();
        let mut child = parent.fork(&a);
        let before = child.clone();
        // Needs 1 copy page + 2 new pages; only 1 free.
        assert!(matches!(
            child.prepare_append(16, 4, &a),
            Err(DetspecError::OutOfPages { .. })
        ));
        assert_eq!(child, before);
        assert_eq!(a.num_free(), 1);
        assert_eq!(a.ref_count(1), 2);
        child.free(&a);
        parent.free(&a);
        assert_eq!(a.num_free(), 3);
    }

    #[test]
    fn truncate_lowers_num_tokens_and_regrow_copies_shared_page() {
        let a = AtomicAllocator::new(8);
        let mut t = BlockTable::new();
        t.prepare_append(8, 4, &a).unwrap();
        a.share(1); // e.g. the prefix cache holds the full page 1
        t.truncate(6, 4, &a);
        assert_eq!((t.num_tokens(), t.pages().len()), (6, 2));
        assert_eq!(t.prepare_append(7, 4, &a).unwrap(), Some((1, 2)));
        assert!(a.release(1));
        t.free(&a);
        assert_eq!(a.num_free(), 8);
    }
}
