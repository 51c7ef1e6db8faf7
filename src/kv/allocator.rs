//! Page allocation with reference counts.
//!
//! [`PageAllocator`] is the interface the rest of the engine uses. Two implementations:
//!
//! * [`AtomicAllocator`]: the production allocator. Lock-free: an atomic bitmap of used pages plus
//!   one atomic reference count per page. `allocate`, `share` and `release` may be called from any
//!   thread and never block each other.
//! * [`SimpleAllocator`]: a `Mutex`-protected reference implementation with the same observable
//!   behaviour in single-threaded use. Tests compare against it and benchmarks use it as the
//!   baseline.
//!
//! Both always hand out the **lowest free id**, so page ids are reproducible for the same sequence
//! of calls (a prompt lands in the same pages on every run, which keeps traces and KV dumps
//! comparable across runs).
//!
//! Misuse (sharing or releasing a page that is not allocated, an id outside the pool) never
//! corrupts the allocator: the `try_*` methods report it as a [`PageError`], and the infallible
//! `share`/`release` wrappers ignore it after a `debug_assert!` so that the bug is loud in debug
//! builds and harmless in release builds.

use std::collections::BTreeSet;
use std::sync::Mutex;

use self::sync::{fence, AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// Physical page index into the KV pool.
pub type PageId = u32;

/// Why a `share` or `release` was refused. Always a caller bug, never a resource condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PageError {
    /// The page id is not inside the pool.
    #[error("page {page} out of range (pool of {total} pages)")]
    OutOfRange { page: PageId, total: usize },
    /// The page is free: it has no reference to share or drop.
    #[error("page {page} is not allocated")]
    NotAllocated { page: PageId },
    /// Sharing would overflow the 32-bit reference count.
    #[error("page {page}: reference count overflow")]
    RefOverflow { page: PageId },
}

/// Reference-counted page allocation, callable from any thread.
pub trait PageAllocator: Send + Sync {
    /// Takes a free page (ref count 1), or `None` when the pool is exhausted.
    fn allocate(&self) -> Option<PageId>;

    /// Adds a reference to an allocated page.
    fn try_share(&self, page: PageId) -> Result<(), PageError>;

    /// Drops a reference. `Ok(true)` when this dropped the last one and freed the page.
    fn try_release(&self, page: PageId) -> Result<bool, PageError>;

    /// Current reference count (0 for a free page or an id outside the pool). Only a snapshot
    /// when other threads hold the page too.
    fn ref_count(&self, page: PageId) -> u32;

    /// Pages that `allocate` can hand out right now.
    fn num_free(&self) -> usize;

    /// Pages in the pool.
    fn num_total(&self) -> usize;

    /// Adds a reference to an allocated page. Misuse is a bug: it asserts in debug builds and is
    /// ignored (state untouched) in release builds; use [`PageAllocator::try_share`] to observe it.
    fn share(&self, page: PageId) {
        let r = self.try_share(page);
        debug_assert!(r.is_ok(), "share: {r:?}");
    }

    /// Drops a reference; returns `true` when this freed the page. Misuse asserts in debug builds
    /// and returns `false` (state untouched) in release builds.
    fn release(&self, page: PageId) -> bool {
        let r = self.try_release(page);
        debug_assert!(r.is_ok(), "release: {r:?}");
        r.unwrap_or(false)
    }
}

/// Atomics used by [`AtomicAllocator`]: `std`'s normally, `loom`'s when the crate is built with
/// `--cfg loom` so that `tests/kv_loom.rs` can explore every interleaving of the core.
mod sync {
    #[cfg(loom)]
    pub use loom::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicUsize, Ordering};
    #[cfg(not(loom))]
    pub use std::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicUsize, Ordering};
}

/// Lock-free allocator: atomic bitmap + atomic reference counts.
///
/// # Structure
///
/// * `used`: one bit per page, **1 = allocated**. Bits past `total` in the last word are set at
///   construction so they are never handed out.
/// * `refs`: one `AtomicU32` per page; 0 exactly when the page is free (or in the middle of being
///   allocated / freed, see below).
///
/// * `hint`: index of the first bitmap word that may have a clear bit. Every word below it is
///   full whenever no operation is in flight (see "Hint" below), so a claim starts there instead
///   of at word 0: with most of a large pool in use, `allocate` is O(1) instead of O(pages / 64).
///
/// An `allocate` + `release` pair costs three atomic read-modify-writes (claim bit, decrement,
/// clear bit) and no shared counter: an atomic free-page counter (reserve a unit, then claim a
/// bit) measured slower single-threaded and worse under contention, because every operation on
/// any page hits its one global cache line. Without it,
/// [`PageAllocator::num_free`] counts zero bits (O(pages / 64) relaxed loads), which is fine for
/// its callers (admission decisions, stats). The hint is written only when a word fills up or a
/// full word gets a free bit, so it is a read-mostly line.
///
/// # Lowest free id
///
/// The claim scans words from the hint and takes the lowest zero bit with `fetch_or`. In
/// single-threaded use this is exactly "lowest free id", the same policy as
/// [`SimpleAllocator`], so the same call sequence yields the same page ids. Under concurrency
/// each call still gets *a* free page, and ids depend on the interleaving (nothing can do
/// better). A call may return `None` while a release is completing concurrently; that is
/// indistinguishable from the release landing just after the call.
///
/// # Hint
///
/// Invariant at quiescence: every word below `hint` is full. A claim that skipped or filled words
/// advances it with a CAS from the value it started at; a release into a word below it lowers it
/// with `fetch_min`. The race to close is "a release frees a bit in word `w` and reads the old
/// hint (so does not lower it) while a claim advances the hint past `w`". Both sides use `SeqCst`
/// for exactly these accesses (the release's bit clear and hint load; the claim's hint CAS and a
/// re-check of the words it skipped), so in the single total order either the claim's re-check
/// sees the freed bit (and lowers the hint itself) or the release's hint load sees the advanced
/// hint (and lowers it). On x86 these `SeqCst` accesses compile to the same instructions as
/// their `Acquire`/`Release` versions. Should the hint ever be stale anyway, a claim that finds
/// nothing above it scans the words below it and repairs it, so pages are never lost; only the
/// lowest-id order could differ, and only after concurrent use.
///
/// # Memory orderings
///
/// Pages guard KV memory that is written outside the allocator (tensor writes), so a page's reuse
/// must happen-after everything its previous holders did with it, exactly like `Arc` drop:
///
/// * `try_release` decrements with `Release`; the thread that takes the count 1 -> 0 then issues
///   an `Acquire` fence, so every holder's accesses happen-before the freeing thread's next step
///   (the same reasoning as `Arc::drop`). It then clears the bit with `SeqCst` (which includes
///   `Release`; `SeqCst` only for the hint protocol above).
/// * `allocate` claims the bit with `Acquire`, pairing with that `Release` clear (RMWs on one word
///   form a release sequence, so this holds even when other claims or clears touched the word in
///   between). Hence all previous holders' KV accesses happen-before the new owner's.
///   `tests/kv_loom.rs` checks exactly this with loom `UnsafeCell`s standing in for KV memory,
///   and fails if the decrement is weakened to `Relaxed`.
/// * The new owner stores ref count 1 with `Relaxed`: nobody else can legitimately touch a page
///   before the owner publishes its id, and that publication (a channel, a lock, a join) carries
///   the happens-before edge.
/// * `try_share` increments with `Relaxed`, like `Arc::clone`: the caller already holds a
///   reference, so the page cannot be freed concurrently and no data is published by sharing.
///   It is a CAS loop instead of `fetch_add` only so that sharing a free page (count 0) is
///   refused instead of resurrecting it; `try_release` is a CAS loop for the same reason (a
///   double release must not wrap the count).
/// * Plain loads (`ref_count`, `num_free`, the scan's pre-check of a word) are `Relaxed`: they are
///   snapshots or hints, and every decision is confirmed by an RMW with the orderings above.
#[derive(Debug)]
pub struct AtomicAllocator {
    used: Box<[AtomicU64]>,
    refs: Box<[AtomicU32]>,
    hint: AtomicUsize,
    total: usize,
}

impl AtomicAllocator {
    /// A pool of `num_pages` free pages. Ids are `0..num_pages`; at most `u32::MAX` pages.
    pub fn new(num_pages: usize) -> Self {
        let num_pages = num_pages.min(PageId::MAX as usize);
        let words = num_pages.div_ceil(64);
        let used = (0..words)
            .map(|w| {
                // Bits past the end of the pool are permanently "used".
                let valid = (num_pages - w * 64).min(64);
                let mask = if valid == 64 { 0 } else { !0u64 << valid };
                AtomicU64::new(mask)
            })
            .collect();
        let refs = (0..num_pages).map(|_| AtomicU32::new(0)).collect();
        Self {
            used,
            refs,
            hint: AtomicUsize::new(0),
            total: num_pages,
        }
    }

    /// Claims the lowest clear bit at or above the hint, or below it if the hint was stale.
    #[inline]
    fn claim_lowest(&self) -> Option<PageId> {
        let words = self.used.len();
        let h = self.hint.load(Ordering::SeqCst).min(words);
        if let Some((w, bit, full)) = self.claim_in(h, words) {
            let next = if full { w + 1 } else { w };
            if next > h {
                self.advance_hint(h, next);
            }
            return Some((w * 64) as PageId + bit);
        }
        // Nothing at or above the hint: the pool is full, or the hint is stale (possible only
        // after concurrent use). Look below it, and repair the hint if that finds a page.
        let (w, bit, _) = self.claim_in(0, h)?;
        self.hint.fetch_min(w, Ordering::SeqCst);
        Some((w * 64) as PageId + bit)
    }

    /// Claims the lowest clear bit in words `from..to`: `(word, bit, word is now full)`.
    #[inline]
    fn claim_in(&self, from: usize, to: usize) -> Option<(usize, u32, bool)> {
        for w in from..to {
            let word = &self.used[w];
            let mut cur = word.load(Ordering::Relaxed);
            while cur != u64::MAX {
                let bit = (!cur).trailing_zeros();
                let mask = 1u64 << bit;
                let prev = word.fetch_or(mask, Ordering::Acquire);
                if prev & mask == 0 {
                    return Some((w, bit, prev | mask == u64::MAX));
                }
                // Someone else took that bit; look again at this word's current value.
                cur = prev | mask;
            }
        }
        None
    }

    /// Moves the hint from `from` to `to` (words `from..to` were seen full), then re-checks those
    /// words: a release into one of them may have read the old hint (see the type docs).
    #[cold]
    fn advance_hint(&self, from: usize, to: usize) {
        if self
            .hint
            .compare_exchange(from, to, Ordering::SeqCst, Ordering::Relaxed)
            .is_err()
        {
            return; // Someone else moved it; their value is at least as good.
        }
        if let Some(w) = (from..to).find(|&w| self.used[w].load(Ordering::SeqCst) != u64::MAX) {
            self.hint.fetch_min(w, Ordering::SeqCst);
        }
    }

    /// `try_release`, returning the count left after the decrement (0 = freed).
    #[inline]
    pub fn release_count(&self, page: PageId) -> Result<u32, PageError> {
        let r = self.slot(page)?;
        let prev = r
            .fetch_update(Ordering::Release, Ordering::Relaxed, |c| c.checked_sub(1))
            .map_err(|_| PageError::NotAllocated { page })?;
        if prev == 1 {
            // Synchronise with every other holder's `Release` decrement before the page becomes
            // reusable (see the type docs).
            fence(Ordering::Acquire);
            let (w, mask) = word_bit(page);
            let before = self.used[w].fetch_and(!mask, Ordering::SeqCst);
            debug_assert!(before & mask != 0, "page {page} had refs but a clear bit");
            if w < self.hint.load(Ordering::SeqCst) {
                self.hint.fetch_min(w, Ordering::SeqCst);
            }
        }
        Ok(prev - 1)
    }

    fn slot(&self, page: PageId) -> Result<&AtomicU32, PageError> {
        self.refs.get(page as usize).ok_or(PageError::OutOfRange {
            page,
            total: self.total,
        })
    }
}

/// Word index and bit mask of a page in the bitmap.
#[inline]
fn word_bit(page: PageId) -> (usize, u64) {
    ((page / 64) as usize, 1u64 << (page % 64))
}

impl PageAllocator for AtomicAllocator {
    #[inline]
    fn allocate(&self) -> Option<PageId> {
        let page = self.claim_lowest()?;
        // Publication of the id by the caller orders this store for other threads.
        self.refs[page as usize].store(1, Ordering::Relaxed);
        Some(page)
    }

    fn try_share(&self, page: PageId) -> Result<(), PageError> {
        let r = self.slot(page)?;
        r.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| match c {
            0 | u32::MAX => None,
            c => Some(c + 1),
        })
        .map(|_| ())
        .map_err(|c| {
            if c == 0 {
                PageError::NotAllocated { page }
            } else {
                PageError::RefOverflow { page }
            }
        })
    }

    #[inline]
    fn try_release(&self, page: PageId) -> Result<bool, PageError> {
        self.release_count(page).map(|left| left == 0)
    }

    fn ref_count(&self, page: PageId) -> u32 {
        self.slot(page).map_or(0, |r| r.load(Ordering::Relaxed))
    }

    /// Zero bits in the bitmap: exact when no other thread is allocating or releasing.
    fn num_free(&self) -> usize {
        self.used
            .iter()
            .map(|w| w.load(Ordering::Relaxed).count_zeros() as usize)
            .sum()
    }

    fn num_total(&self) -> usize {
        self.total
    }
}

#[derive(Debug)]
struct SimpleState {
    free: BTreeSet<PageId>,
    refs: Vec<u32>,
}

/// Mutex-based allocator: lowest free id first. The reference implementation and benchmark
/// baseline for [`AtomicAllocator`].
#[derive(Debug)]
pub struct SimpleAllocator {
    state: Mutex<SimpleState>,
    total: usize,
}

impl SimpleAllocator {
    pub fn new(num_pages: usize) -> Self {
        let num_pages = num_pages.min(PageId::MAX as usize);
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
        // checked before any field is written), so a poisoned lock is safe to reuse.
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

    fn try_share(&self, page: PageId) -> Result<(), PageError> {
        let total = self.total;
        let mut s = self.lock();
        let r = s
            .refs
            .get_mut(page as usize)
            .ok_or(PageError::OutOfRange { page, total })?;
        match *r {
            0 => Err(PageError::NotAllocated { page }),
            u32::MAX => Err(PageError::RefOverflow { page }),
            _ => {
                *r += 1;
                Ok(())
            }
        }
    }

    fn try_release(&self, page: PageId) -> Result<bool, PageError> {
        let total = self.total;
        let mut s = self.lock();
        let r = s
            .refs
            .get_mut(page as usize)
            .ok_or(PageError::OutOfRange { page, total })?;
        if *r == 0 {
            return Err(PageError::NotAllocated { page });
        }
        *r -= 1;
        if *r == 0 {
            s.free.insert(page);
            Ok(true)
        } else {
            Ok(false)
        }
    }

    fn ref_count(&self, page: PageId) -> u32 {
        self.lock().refs.get(page as usize).copied().unwrap_or(0)
    }

    fn num_free(&self) -> usize {
        self.lock().free.len()
    }

    fn num_total(&self) -> usize {
        self.total
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn lowest_id_first_and_refcounts(a: &dyn PageAllocator) {
        assert_eq!(a.allocate(), Some(0));
        assert_eq!(a.allocate(), Some(1));
        a.share(0);
        assert_eq!(a.ref_count(0), 2);
        assert!(!a.release(0));
        assert!(a.release(0));
        assert_eq!(a.ref_count(0), 0);
        assert_eq!(a.allocate(), Some(0));
        assert_eq!(a.allocate(), Some(2));
        assert_eq!(a.allocate(), Some(3));
        assert_eq!(a.allocate(), None);
        assert_eq!(a.num_free(), 0);
    }

    #[test]
    fn simple_lowest_id_first() {
        lowest_id_first_and_refcounts(&SimpleAllocator::new(4));
    }

    #[test]
    fn atomic_lowest_id_first() {
        lowest_id_first_and_refcounts(&AtomicAllocator::new(4));
    }

    fn misuse_is_refused(a: &dyn PageAllocator) {
        let n = a.num_total() as PageId;
        assert_eq!(a.try_share(0), Err(PageError::NotAllocated { page: 0 }));
        assert_eq!(a.try_release(0), Err(PageError::NotAllocated { page: 0 }));
        assert!(matches!(
            a.try_release(n),
            Err(PageError::OutOfRange { .. })
        ));
        assert!(matches!(
            a.try_share(n + 5),
            Err(PageError::OutOfRange { .. })
        ));
        assert_eq!(a.ref_count(n), 0);
        // Nothing was corrupted.
        assert_eq!(a.num_free(), n as usize);
        let p = a.allocate().unwrap();
        assert_eq!(a.try_release(p), Ok(true));
        assert_eq!(a.try_release(p), Err(PageError::NotAllocated { page: p }));
        assert_eq!(a.num_free(), n as usize);
    }

    #[test]
    fn misuse_atomic() {
        misuse_is_refused(&AtomicAllocator::new(5));
    }

    #[test]
    fn misuse_simple() {
        misuse_is_refused(&SimpleAllocator::new(5));
    }

    /// The infallible wrappers must not panic on misuse in release builds.
    #[cfg(not(debug_assertions))]
    #[test]
    fn misuse_wrappers_are_harmless_in_release() {
        let a = AtomicAllocator::new(3);
        a.share(1);
        assert!(!a.release(1));
        assert!(!a.release(99));
        assert_eq!(a.num_free(), 3);
        assert_eq!(a.allocate(), Some(0));
    }

    #[test]
    fn pool_not_multiple_of_64() {
        for n in [1usize, 63, 64, 65, 130] {
            let a = AtomicAllocator::new(n);
            let got: Vec<PageId> = std::iter::from_fn(|| a.allocate()).collect();
            assert_eq!(got, (0..n as PageId).collect::<Vec<_>>(), "n={n}");
            assert_eq!(a.num_free(), 0);
            for p in got.iter().rev() {
                assert!(a.release(*p));
            }
            assert_eq!(a.num_free(), n);
        }
        let empty = AtomicAllocator::new(0);
        assert_eq!(empty.allocate(), None);
    }

    #[test]
    fn same_calls_same_ids_as_simple() {
        let a = AtomicAllocator::new(300);
        let s = SimpleAllocator::new(300);
        let mut held: Vec<PageId> = Vec::new();
        // A fixed pseudo-random walk of allocate / release.
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for i in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Phases that fill the pool and phases that drain it, so the hint moves both ways.
            let fill = (i / 2000) % 2 == 0;
            if (fill && !x.is_multiple_of(4)) || (!fill && x.is_multiple_of(4)) || held.is_empty() {
                let (pa, ps) = (a.allocate(), s.allocate());
                assert_eq!(pa, ps);
                held.extend(pa);
            } else {
                let p = held.swap_remove((x >> 8) as usize % held.len());
                assert_eq!(a.release(p), s.release(p));
            }
            assert_eq!(a.num_free(), s.num_free());
        }
    }
}
