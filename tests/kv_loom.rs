//! `loom` model test of the lock-free core of [`AtomicAllocator`] (bitmap + reservation counter +
//! ref counts): loom runs each scenario under every thread interleaving (bounded preemptions) and
//! every memory-ordering outcome the C11 model allows for the orderings we chose.
//!
//! Only built with `--cfg loom`, which swaps the allocator's atomics for loom's. Use a separate
//! target directory so the normal build cache is not invalidated by the changed RUSTFLAGS:
//!
//! ```sh
//! RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test --release --test kv_loom
//! ```

#![cfg(loom)]

use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;

use detspec::kv::{AtomicAllocator, PageAllocator, PageId};

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

/// Per-page "owned" flags maintained by the test (a page may never be handed to two owners).
struct Owners(Vec<AtomicBool>);

impl Owners {
    fn new(n: usize) -> Self {
        Self((0..n).map(|_| AtomicBool::new(false)).collect())
    }
    fn take(&self, p: PageId) {
        assert!(
            !self.0[p as usize].swap(true, Ordering::AcqRel),
            "page {p} allocated twice"
        );
    }
    fn give_back(&self, p: PageId) {
        assert!(self.0[p as usize].swap(false, Ordering::AcqRel));
    }
}

/// Two threads allocate and release concurrently on a 2-page pool; a third page request races
/// a release.
#[test]
fn alloc_release_two_threads() {
    model(|| {
        let a = Arc::new(AtomicAllocator::new(2));
        let own = Arc::new(Owners::new(2));
        let hs: Vec<_> = (0..2)
            .map(|_| {
                let (a, own) = (a.clone(), own.clone());
                thread::spawn(move || {
                    let p = a.allocate().expect("2 pages, 2 threads: must succeed");
                    own.take(p);
                    own.give_back(p);
                    assert!(a.release(p));
                    // Allocate again: there is always a page for us.
                    let q = a.allocate().expect("second round");
                    own.take(q);
                    own.give_back(q);
                    assert!(a.release(q));
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(a.num_free(), 2);
        assert_eq!((a.ref_count(0), a.ref_count(1)), (0, 0));
    });
}

/// Three threads on a 2-page pool: allocation may fail, but never double-allocates, and the
/// reservation counter stays exact.
#[test]
fn three_threads_contend_for_two_pages() {
    model(|| {
        let a = Arc::new(AtomicAllocator::new(2));
        let own = Arc::new(Owners::new(2));
        let hs: Vec<_> = (0..3)
            .map(|_| {
                let (a, own) = (a.clone(), own.clone());
                thread::spawn(move || {
                    if let Some(p) = a.allocate() {
                        own.take(p);
                        own.give_back(p);
                        assert!(a.release(p));
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(a.num_free(), 2);
    });
}

/// Share and release race on one page: exactly one release frees it, and a concurrent allocator
/// only gets it after that.
#[test]
fn share_release_race() {
    model(|| {
        let a = Arc::new(AtomicAllocator::new(2));
        let own = Arc::new(Owners::new(2));
        let p = a.allocate().unwrap();
        own.take(p);
        a.share(p); // second reference, handed to the other thread
        let freed = Arc::new(loom::sync::atomic::AtomicUsize::new(0));
        let holders = Arc::new(loom::sync::atomic::AtomicUsize::new(2));
        let t1 = {
            let (a, own, freed, holders) = (a.clone(), own.clone(), freed.clone(), holders.clone());
            thread::spawn(move || {
                a.share(p);
                holders.fetch_add(1, Ordering::AcqRel);
                for _ in 0..2 {
                    if holders.fetch_sub(1, Ordering::AcqRel) == 1 {
                        own.give_back(p);
                    }
                    if a.release(p) {
                        freed.fetch_add(1, Ordering::AcqRel);
                    }
                }
            })
        };
        let t2 = {
            let (a, own) = (a.clone(), own.clone());
            thread::spawn(move || {
                // Takes page 1 or, if the other page was freed already, page 0 -- never a page
                // that is still held.
                if let Some(q) = a.allocate() {
                    own.take(q);
                    own.give_back(q);
                    a.release(q);
                }
            })
        };
        if holders.fetch_sub(1, Ordering::AcqRel) == 1 {
            own.give_back(p);
        }
        if a.release(p) {
            freed.fetch_add(1, Ordering::AcqRel);
        }
        t1.join().unwrap();
        t2.join().unwrap();
        assert_eq!(freed.load(Ordering::Acquire), 1);
        assert_eq!(a.num_free(), 2);
        assert_eq!(a.ref_count(p), 0);
    });
}

/// Misuse under concurrency: a double release from two threads frees the page once and reports
/// the other as an error, without corrupting the counters.
#[test]
fn concurrent_double_release_is_refused() {
    model(|| {
        let a = Arc::new(AtomicAllocator::new(2));
        let p = a.allocate().unwrap();
        let t = {
            let a = a.clone();
            thread::spawn(move || a.try_release(p))
        };
        let mine = a.try_release(p);
        let theirs = t.join().unwrap();
        let oks = [mine, theirs].iter().filter(|r| r.is_ok()).count();
        assert_eq!(oks, 1);
        assert_eq!(a.num_free(), 2);
    });
}

/// The orderings themselves: page contents (modelled by loom `UnsafeCell`s, which loom checks for
/// unsynchronised access) written by one holder and read by a sharer must be safely reusable by
/// the next owner, with no synchronisation other than the allocator's own atomics. Weakening the
/// `Release` decrement, the `Acquire` fence or the `Acquire` claim makes loom report a race here.
#[test]
fn page_contents_are_handed_over_without_races() {
    use loom::cell::UnsafeCell;
    model(|| {
        let a = Arc::new(AtomicAllocator::new(1));
        let kv: Arc<Vec<UnsafeCell<u64>>> = Arc::new(vec![UnsafeCell::new(0)]);
        let p = a.allocate().unwrap();
        // SAFETY (of the test's own accesses): loom checks every access below for races.
        kv[p as usize].with_mut(|v| unsafe { *v = 1 });
        a.share(p);
        let reader = {
            let (a, kv) = (a.clone(), kv.clone());
            thread::spawn(move || {
                let seen = kv[p as usize].with(|v| unsafe { *v });
                assert_eq!(seen, 1);
                a.release(p);
            })
        };
        let next_owner = {
            let (a, kv) = (a.clone(), kv.clone());
            thread::spawn(move || {
                if let Some(q) = a.allocate() {
                    kv[q as usize].with_mut(|v| unsafe { *v = 2 });
                    a.release(q);
                }
            })
        };
        let seen = kv[p as usize].with(|v| unsafe { *v });
        assert!(seen == 1);
        a.release(p);
        reader.join().unwrap();
        next_owner.join().unwrap();
        assert_eq!(a.num_free(), 1);
    });
}

/// The search hint (first word that may have a free bit) raced by a claim that fills a word and a
/// release into that word. Safety only: no page is lost or handed out twice, whatever the hint
/// ends up as. (Its exactness relies on `SeqCst` accesses, which loom models as `AcqRel`, so loom
/// could only produce false alarms on it; a stale hint costs at most the lowest-id order, never a
/// page, because claims fall back to the words below the hint.)
#[test]
fn hint_race_loses_no_page() {
    model(|| {
        let a = Arc::new(AtomicAllocator::new(66)); // two bitmap words
        for _ in 0..64 {
            a.allocate().unwrap(); // word 0 full: the hint moves to word 1
        }
        assert!(a.release(5)); // back to word 0
        let filler = {
            let a = a.clone();
            thread::spawn(move || a.allocate()) // takes 5, fills word 0, advances the hint
        };
        let releaser = {
            let a = a.clone();
            thread::spawn(move || assert!(a.release(7)))
        };
        let got = filler.join().unwrap();
        releaser.join().unwrap();
        assert!(got == Some(5) || got == Some(7), "{got:?}");
        let mut rest: Vec<PageId> = std::iter::from_fn(|| a.allocate()).collect();
        rest.sort_unstable();
        let mut want = vec![64, 65, if got == Some(5) { 7 } else { 5 }];
        want.sort_unstable();
        assert_eq!(rest, want);
        assert_eq!(a.num_free(), 0);
    });
}
