//! Page allocation with reference counts.
//!
//! [`PageAllocator`] is the interface the rest of the engine uses; the lock-free implementation
//! of the KV-cache issue drops in behind it. [`SimpleAllocator`] is a mutex-protected reference
//! implementation that always hands out the lowest free id, so page ids are reproducible for the
//! same sequence of calls.

use std::collections::BTreeSet;
use std::sync::Mutex;

/// Physical page index into the KV pool.
pub type PageId = u32;

/// Reference-counted page allocation, callable from any thread.
pub trait PageAllocator: Send + Sync {
    /// Takes a free page (ref count 1), or `None` when the pool is exhausted.
    fn allocate(&self) -> Option<PageId>;
    /// Adds a reference to a page that is already allocated.
    fn share(&self, page: PageId);
    /// Drops a reference; returns `true` when this freed the page.
    fn release(&self, page: PageId) -> bool;
    /// Pages currently free.
    fn num_free(&self) -> usize;
    /// Pages in the pool.
    fn num_total(&self) -> usize;
}

#[derive(Debug)]
struct SimpleState {
    free: BTreeSet<PageId>,
    refs: Vec<u32>,
}

/// Mutex-based allocator: lowest free id first.
#[derive(Debug)]
pub struct SimpleAllocator {
    state: Mutex<SimpleState>,
    total: usize,
}

impl SimpleAllocator {
    pub fn new(num_pages: usize) -> Self {
        Self {
            state: Mutex::new(SimpleState {
                free: (0..num_pages as PageId).collect(),
                refs: vec![0; num_pages],
            }),
            total: num_pages,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SimpleState> {
        // A panic while holding this lock cannot leave the state half-updated (every update is
        // a single field write), so a poisoned lock is safe to reuse.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl PageAllocator for SimpleAllocator {
    fn allocate(&self) -> Option<PageId> {
        let mut s = self.lock();
        let page = s.free.pop_first()?;
        s.refs[page as usize] = 1;
        Some(page)
    }

    fn share(&self, page: PageId) {
        let mut s = self.lock();
        debug_assert!(s.refs[page as usize] > 0, "share of free page {page}");
        s.refs[page as usize] += 1;
    }

    fn release(&self, page: PageId) -> bool {
        let mut s = self.lock();
        let r = &mut s.refs[page as usize];
        debug_assert!(*r > 0, "release of free page {page}");
        *r = r.saturating_sub(1);
        if *r == 0 {
            s.free.insert(page);
            true
        } else {
            false
        }
    }

    fn num_free(&self) -> usize {
        self.lock().free.len()
    }

    fn num_total(&self) -> usize {
        self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lowest_id_first_and_refcounts() {
        let a = SimpleAllocator::new(4);
        assert_eq!(a.allocate(), Some(0));
        assert_eq!(a.allocate(), Some(1));
        a.share(0);
        assert!(!a.release(0));
        assert!(a.release(0));
        assert_eq!(a.allocate(), Some(0));
        assert_eq!(a.allocate(), Some(2));
        assert_eq!(a.allocate(), Some(3));
        assert_eq!(a.allocate(), None);
        assert_eq!(a.num_free(), 0);
    }
}
