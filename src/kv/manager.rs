//! [`KvManager`]: the engine's single handle on KV pages. It owns the lock-free
//! [`AtomicAllocator`] and the [`PrefixCache`] (behind one `Mutex`, the rare path) and glues them:
//!
//! * it *is* a [`PageAllocator`], so block tables and the scheduler use it unchanged;
//! * `allocate` falls back to evicting the least recently used evictable cached page when the
//!   free bitmap is empty (lazy eviction: cached pages are kept until memory is actually needed);
//! * `release` tells the cache when a cached page's last sequence let go of it, so it becomes
//!   evictable. The common release (page not cached, or still shared) takes no lock.

use std::sync::atomic::{fence, AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::Serialize;

use crate::error::{DetspecError, Result};

use super::{AtomicAllocator, EndingHit, PageAllocator, PageClass, PageError, PageId, PrefixCache};

/// Snapshot of the KV pool, as reported by the engine's `kv_stats()`.
///
/// Every page is in exactly one of: free, evictable (cached, held only by the cache), used (held
/// by at least one sequence or pinned). `cached_pages` overlaps the last two.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct KvStats {
    pub total_pages: usize,
    /// In the free bitmap.
    pub free_pages: usize,
    /// Held by a sequence or pinned: `total - free - evictable`.
    pub used_pages: usize,
    /// Held by the prefix cache (used by sequences or not).
    pub cached_pages: usize,
    /// Cached and held by nothing else: reclaimed on demand by `allocate`.
    pub evictable_pages: usize,
    /// Reserved for the engine's lifetime ([`KvManager::reserve_pinned`]).
    pub pinned_pages: usize,
    pub page_size: usize,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_queries: u64,
    /// Of those, tokens found cached.
    pub prefix_hits: u64,
    /// `prefix_hits / prefix_queries` (0 when nothing was queried).
    pub hit_rate: f64,
    /// Recurrent states running sequences may hold at once (0: the model keeps none; filled
    /// in by the engine, which owns them).
    pub state_slots: usize,
    /// Recurrent states held now (running sequences', standalone forwards', snapshots).
    pub states_held: usize,
    /// Of those, snapshots kept for the prefix cache: the state after a cached prompt page.
    pub state_snapshots: usize,
}

/// Allocator + prefix cache. See the module docs.
#[derive(Debug)]
pub struct KvManager {
    alloc: AtomicAllocator,
    cache: Mutex<PrefixCache>,
    /// The cache's "is cached" flags, read without its lock on every release that leaves a
    /// page with one holder.
    cached: Arc<[AtomicBool]>,
    /// Mirror of the cache's evictable count, refreshed under its lock, so `num_free` (called by
    /// the scheduler for every admission decision) stays lock-free.
    evictable: AtomicUsize,
    pinned: AtomicUsize,
    page_size: usize,
}

impl KvManager {
    /// A pool of `num_pages` pages of `page_size` tokens, all free.
    pub fn new(num_pages: usize, page_size: usize, enable_prefix_caching: bool) -> Result<Self> {
        if num_pages == 0 || num_pages > PageId::MAX as usize {
            return Err(DetspecError::param(
                "num_kv_pages",
                format!("must be in 1..={}, got {num_pages}", PageId::MAX),
            ));
        }
        if page_size == 0 {
            return Err(DetspecError::param("page_size", "must be > 0"));
        }
        let mut cache = PrefixCache::new(num_pages);
        cache.set_enabled(enable_prefix_caching);
        Ok(Self {
            alloc: AtomicAllocator::new(num_pages),
            cached: cache.cached_flags(),
            cache: Mutex::new(cache),
            evictable: AtomicUsize::new(0),
            pinned: AtomicUsize::new(0),
            page_size,
        })
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Runs `f` on the cache under its lock, then refreshes the evictable mirror.
    fn with_cache<R>(&self, f: impl FnOnce(&mut PrefixCache, &AtomicAllocator) -> R) -> R {
        // Cache methods do not panic on any input, so a poisoned lock (a panic elsewhere while
        // holding it) still guards a consistent cache.
        let mut c: MutexGuard<'_, PrefixCache> =
            self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let r = f(&mut c, &self.alloc);
        self.evictable
            .store(c.stats().evictable_pages, Ordering::Relaxed);
        r
    }

    /// Longest cached run of full pages that `tokens` starts with; the caller receives one
    /// reference on each (wrap them with [`super::BlockTable::from_shared_pages`]). Pass the
    /// prompt without its last token so at least one token is computed.
    pub fn lookup_prefix(&self, tokens: &[u32]) -> Vec<PageId> {
        self.lookup_prefix_of(tokens, PageClass::Fast, 0)
    }

    /// [`Self::lookup_prefix`] among the cached pages of `class` in `namespace` (see
    /// [`super::prefix::root_hash_of`]).
    pub fn lookup_prefix_of(
        &self,
        tokens: &[u32],
        class: PageClass,
        namespace: u64,
    ) -> Vec<PageId> {
        let ps = self.page_size;
        self.with_cache(|c, a| c.lookup_class(tokens, ps, class, namespace, a))
    }

    /// [`Self::lookup_prefix_of`] cut after the deepest page whose cache entry `ends` accepts
    /// (see [`PrefixCache::lookup_ending`]).
    pub fn lookup_prefix_ending(
        &self,
        tokens: &[u32],
        scope: (PageClass, u64),
        ends: &dyn Fn(u64) -> bool,
    ) -> EndingHit {
        let ps = self.page_size;
        self.with_cache(|c, a| c.lookup_ending(tokens, ps, scope, a, ends))
    }

    /// Registers a sequence's full pages (its block table) for the final tokens `tokens`.
    /// Returns how many pages were newly cached. See [`PrefixCache::insert`].
    pub fn insert_prefix(&self, tokens: &[u32], pages: &[PageId]) -> usize {
        self.insert_prefix_of(tokens, pages, PageClass::Fast, 0)
    }

    /// [`Self::insert_prefix`] as pages of `class` in `namespace`.
    pub fn insert_prefix_of(
        &self,
        tokens: &[u32],
        pages: &[PageId],
        class: PageClass,
        namespace: u64,
    ) -> usize {
        let ps = self.page_size;
        self.with_cache(|c, a| c.insert_class(tokens, pages, ps, class, namespace, a))
    }

    /// [`Self::insert_prefix_of`], returning the id of the entry holding `tokens`' last full
    /// page where all of them are cached now (see [`PrefixCache::insert_ending`]).
    pub fn insert_prefix_ending(
        &self,
        tokens: &[u32],
        pages: &[PageId],
        scope: (PageClass, u64),
    ) -> Option<u64> {
        let ps = self.page_size;
        self.with_cache(|c, a| c.insert_ending(tokens, pages, ps, scope, a))
    }

    /// Frees up to `n` evictable cached pages now (normally unnecessary: `allocate` evicts
    /// lazily). Returns how many were freed.
    pub fn evict(&self, n: usize) -> usize {
        self.with_cache(|c, a| c.evict(n, a))
    }

    /// Turns the prefix cache on or off. Turning it off also drops every cached page (pages still
    /// used by sequences stay with them), so memory accounting matches a cache-less engine.
    pub fn set_prefix_caching(&self, enabled: bool) {
        self.with_cache(|c, a| {
            c.set_enabled(enabled);
            if !enabled {
                c.clear(a);
            }
        });
    }

    /// Drops every cached prefix (pages still used by sequences stay with them); returns how
    /// many pages were freed. Needed when the weights change: cached KV would be stale.
    pub fn clear_prefix_cache(&self) -> usize {
        self.with_cache(|c, a| c.clear(a))
    }

    pub fn prefix_caching_enabled(&self) -> bool {
        self.with_cache(|c, _| c.is_enabled())
    }

    /// Whether `page` is currently in the prefix cache.
    pub fn is_cached(&self, page: PageId) -> bool {
        self.cached
            .get(page as usize)
            .is_some_and(|f| f.load(Ordering::Relaxed))
    }

    /// Cached pages, ascending (for tests and debugging).
    pub fn cached_pages(&self) -> Vec<PageId> {
        self.with_cache(|c, _| c.cached_pages())
    }

    /// Allocates `n` pages for the engine's lifetime (e.g. DVR's dummy verification sequences):
    /// they are never released and count as used. All or nothing.
    pub fn reserve_pinned(&self, n: usize) -> Result<Vec<PageId>> {
        let mut got = Vec::with_capacity(n);
        for _ in 0..n {
            match self.allocate() {
                Some(p) => got.push(p),
                None => {
                    for p in got {
                        self.release(p);
                    }
                    return Err(DetspecError::OutOfPages {
                        needed: n,
                        free: self.num_free(),
                        total: self.num_total(),
                    });
                }
            }
        }
        self.pinned.fetch_add(n, Ordering::Relaxed);
        Ok(got)
    }

    /// A consistent snapshot when no other thread is allocating (the cache part is taken under
    /// its lock; the free count is a single load).
    pub fn stats(&self) -> KvStats {
        let s = self.with_cache(|c, _| c.stats());
        let total = self.alloc.num_total();
        let free = self.alloc.num_free();
        KvStats {
            total_pages: total,
            free_pages: free,
            used_pages: total.saturating_sub(free + s.evictable_pages),
            cached_pages: s.cached_pages,
            evictable_pages: s.evictable_pages,
            pinned_pages: self.pinned.load(Ordering::Relaxed),
            page_size: self.page_size,
            prefix_queries: s.query_tokens,
            prefix_hits: s.hit_tokens,
            hit_rate: if s.query_tokens == 0 {
                0.0
            } else {
                s.hit_tokens as f64 / s.query_tokens as f64
            },
            state_slots: 0,
            states_held: 0,
            state_snapshots: 0,
        }
    }

    /// Slow path of `allocate`: the bitmap is empty, so reclaim cached pages one at a time.
    #[cold]
    fn allocate_evicting(&self) -> Option<PageId> {
        loop {
            // Each round frees one page or gives up, so this ends after at most `cached` rounds
            // even if other threads keep taking the freed pages.
            let p = self.with_cache(|c, a| {
                if c.evict(1, a) == 0 {
                    Err(())
                } else {
                    Ok(a.allocate())
                }
            });
            match p {
                Err(()) => return self.alloc.allocate(),
                Ok(Some(p)) => return Some(p),
                Ok(None) => continue,
            }
        }
    }

    /// A release left `page` with one holder: if that holder is the prefix cache, the page is
    /// now evictable.
    #[cold]
    fn maybe_now_evictable(&self, page: PageId) {
        // Pairs with the fence in `PrefixCache::insert` (store-buffer pattern): either we see the
        // cached flag here, or the inserter sees our decrement and lists the page itself.
        fence(Ordering::SeqCst);
        if self.is_cached(page) {
            self.with_cache(|c, a| c.on_sole_holder(page, a));
        }
    }
}

impl PageAllocator for KvManager {
    /// Lowest free page; when none is free, evicts the LRU evictable cached page and retries.
    #[inline]
    fn allocate(&self) -> Option<PageId> {
        self.alloc.allocate().or_else(|| self.allocate_evicting())
    }

    fn try_share(&self, page: PageId) -> Result<(), PageError> {
        self.alloc.try_share(page)
    }

    #[inline]
    fn try_release(&self, page: PageId) -> Result<bool, PageError> {
        let left = self.alloc.release_count(page)?;
        if left == 1 {
            self.maybe_now_evictable(page);
        }
        Ok(left == 0)
    }

    fn ref_count(&self, page: PageId) -> u32 {
        self.alloc.ref_count(page)
    }

    /// Free pages plus evictable cached pages: what `allocate` can still hand out.
    fn num_free(&self) -> usize {
        self.alloc.num_free() + self.evictable.load(Ordering::Relaxed)
    }

    fn num_total(&self) -> usize {
        self.alloc.num_total()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::kv::BlockTable;

    #[test]
    fn prefix_reuse_and_lazy_eviction() {
        let m = KvManager::new(4, 2, true).unwrap();
        let prompt = [1, 2, 3, 4, 5];
        let mut a = BlockTable::new();
        a.prepare_append(prompt.len(), 2, &m).unwrap();
        assert_eq!(a.pages(), &[0, 1, 2]);
        assert_eq!(m.insert_prefix(&prompt, a.pages()), 2);
        a.free(&m);
        let s = m.stats();
        assert_eq!((s.free_pages, s.cached_pages, s.evictable_pages), (2, 2, 2));
        assert_eq!(m.num_free(), 4);
        // Same prefix: reuses pages 0 and 1.
        let hit = m.lookup_prefix(&prompt[..4]);
        assert_eq!(hit, vec![0, 1]);
        let mut b = BlockTable::from_shared_pages(hit, 2);
        assert_eq!(b.prepare_append(5, 2, &m).unwrap(), None);
        assert_eq!(m.stats().hit_rate, 1.0);
        // b holds 0, 1 (shared with the cache) and 2; only page 3 is free, nothing evictable.
        let mut c = BlockTable::new();
        c.reserve(2, 2, &m).unwrap();
        assert!(c.reserve(4, 2, &m).is_err());
        b.free(&m);
        // Now pages 0,1 are evictable; allocation evicts them lazily (tail first).
        c.reserve(8, 2, &m).unwrap();
        assert_eq!(m.stats().cached_pages, 0);
        c.free(&m);
        let s = m.stats();
        assert_eq!(s.free_pages + s.evictable_pages, s.total_pages);
    }

    #[test]
    fn disabling_drops_cached_pages() {
        let m = KvManager::new(4, 2, true).unwrap();
        let mut a = BlockTable::new();
        a.prepare_append(4, 2, &m).unwrap();
        m.insert_prefix(&[1, 2, 3, 4], a.pages());
        m.set_prefix_caching(false);
        assert!(!m.prefix_caching_enabled());
        assert_eq!(m.stats().cached_pages, 0);
        assert_eq!(m.ref_count(0), 1);
        a.free(&m);
        assert_eq!(m.stats().free_pages, 4);
    }

    #[test]
    fn pinned_pages_are_used() {
        let m = KvManager::new(4, 2, true).unwrap();
        assert_eq!(m.reserve_pinned(2).unwrap(), vec![0, 1]);
        assert!(m.reserve_pinned(3).is_err());
        let s = m.stats();
        assert_eq!((s.used_pages, s.pinned_pages, s.free_pages), (2, 2, 2));
    }

    #[test]
    fn stats_serialize() {
        let m = KvManager::new(4, 2, true).unwrap();
        let j = serde_json::to_string(&m.stats()).unwrap();
        assert!(j.contains("\"evictable_pages\":0"));
    }
}
