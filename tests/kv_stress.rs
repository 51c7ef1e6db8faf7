//! Multi-threaded stress test of the page allocators: several threads × many thousand
//! allocate / share / release operations, with pages handed between threads, checking that no
//! page is ever owned by two allocations at once and that nothing leaks.
//!
//! Ownership is tracked outside the allocator: `claimed[p]` is set by whoever receives `p` from
//! `allocate` (it must have been clear) and cleared by the holder that drops the *last* of the
//! test's own references, just before it calls `release`. The test's reference count
//! (`holders[p]`) is bumped before every `share` and dropped before every `release`, so the flag
//! is cleared strictly before the allocator can reuse the page: a double allocation always finds
//! the flag set.

#![cfg(not(loom))]

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Barrier;
use std::time::Instant;

use crossbeam::channel;
use detspec::kv::{AtomicAllocator, KvManager, PageAllocator, PageId, SimpleAllocator};

const THREADS: usize = 4;
const OPS_PER_THREAD: usize = 200_000;
const PAGES: usize = 96;

struct Tracker {
    claimed: Vec<AtomicBool>,
    holders: Vec<AtomicU32>,
    allocs: AtomicUsize,
    frees: AtomicUsize,
}

impl Tracker {
    fn new(n: usize) -> Self {
        Self {
            claimed: (0..n).map(|_| AtomicBool::new(false)).collect(),
            holders: (0..n).map(|_| AtomicU32::new(0)).collect(),
            allocs: AtomicUsize::new(0),
            frees: AtomicUsize::new(0),
        }
    }

    fn on_alloc(&self, p: PageId) {
        let was = self.claimed[p as usize].swap(true, Ordering::AcqRel);
        assert!(!was, "page {p} handed out while still owned");
        assert_eq!(self.holders[p as usize].swap(1, Ordering::AcqRel), 0);
        self.allocs.fetch_add(1, Ordering::Relaxed);
    }

    fn share(&self, a: &dyn PageAllocator, p: PageId) {
        self.holders[p as usize].fetch_add(1, Ordering::AcqRel);
        a.try_share(p).expect("share of a held page");
    }

    fn release(&self, a: &dyn PageAllocator, p: PageId) {
        if self.holders[p as usize].fetch_sub(1, Ordering::AcqRel) == 1 {
            assert!(self.claimed[p as usize].swap(false, Ordering::AcqRel));
        }
        if a.try_release(p).expect("release of a held page") {
            self.frees.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// xorshift64*: a per-thread deterministic op stream.
fn next(x: &mut u64) -> u64 {
    *x ^= *x >> 12;
    *x ^= *x << 25;
    *x ^= *x >> 27;
    x.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

fn stress(a: &dyn PageAllocator, min_allocs: usize) {
    let t = Tracker::new(a.num_total());
    let (tx, rx) = channel::bounded::<PageId>(64);
    let start = Barrier::new(THREADS);
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for id in 0..THREADS {
            let (t, tx, rx, start) = (&t, tx.clone(), rx.clone(), &start);
            s.spawn(move || {
                let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ (id as u64 + 1);
                let mut mine: Vec<PageId> = Vec::new();
                start.wait();
                for _ in 0..OPS_PER_THREAD {
                    // Keep each thread's holdings bounded so the pool keeps cycling.
                    let r = if mine.len() > 12 {
                        7
                    } else {
                        next(&mut rng) % 8
                    };
                    match r {
                        0..=2 => {
                            if let Some(p) = a.allocate() {
                                t.on_alloc(p);
                                mine.push(p);
                            }
                        }
                        3 if !mine.is_empty() => {
                            // Share with ourselves.
                            let p = mine[next(&mut rng) as usize % mine.len()];
                            t.share(a, p);
                            mine.push(p);
                        }
                        4 if !mine.is_empty() => {
                            // Share with another thread.
                            let p = mine[next(&mut rng) as usize % mine.len()];
                            t.share(a, p);
                            if let Err(e) = tx.try_send(p) {
                                t.release(a, e.into_inner());
                            }
                        }
                        5 => {
                            if let Ok(p) = rx.try_recv() {
                                mine.push(p);
                            }
                        }
                        _ if !mine.is_empty() => {
                            let p = mine.swap_remove(next(&mut rng) as usize % mine.len());
                            t.release(a, p);
                        }
                        _ => {}
                    }
                }
                for p in mine {
                    t.release(a, p);
                }
            });
        }
    });
    drop(tx);
    for p in rx.try_iter() {
        t.release(a, p);
    }
    let elapsed = t0.elapsed();
    assert_eq!(a.num_free(), a.num_total(), "pages leaked");
    for p in 0..a.num_total() as PageId {
        assert_eq!(a.ref_count(p), 0, "page {p} still referenced");
        assert!(!t.claimed[p as usize].load(Ordering::Relaxed));
    }
    let (allocs, frees) = (t.allocs.into_inner(), t.frees.into_inner());
    assert_eq!(allocs, frees);
    assert!(
        allocs >= min_allocs,
        "too few allocations ({allocs}) to mean anything"
    );
    eprintln!(
        "{THREADS} threads x {OPS_PER_THREAD} ops, {allocs} allocations: {:.1} ms",
        elapsed.as_secs_f64() * 1e3
    );
}

#[test]
fn stress_atomic_allocator() {
    stress(&AtomicAllocator::new(PAGES), OPS_PER_THREAD);
}

#[test]
fn stress_atomic_allocator_small_pool() {
    // Mostly exhausted: exercises the reservation / rescan paths.
    stress(&AtomicAllocator::new(5), 2_000);
}

#[test]
fn stress_atomic_allocator_multi_word() {
    stress(&AtomicAllocator::new(1000), OPS_PER_THREAD);
}

#[test]
fn stress_simple_allocator() {
    stress(&SimpleAllocator::new(PAGES), OPS_PER_THREAD);
}

#[test]
fn stress_kv_manager() {
    let m = KvManager::new(PAGES, 16, true).expect("manager");
    stress(&m, OPS_PER_THREAD);
    assert_eq!(m.stats().free_pages, PAGES);
}
