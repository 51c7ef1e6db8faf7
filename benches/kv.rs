//! KV page allocator and block-table benchmarks.
//!
//! ```sh
//! cargo bench --bench kv -- --warm-up-time 1 --measurement-time 3
//! ```
//!
//! * `alloc_release/1_thread/*`: one `allocate` + one `release`, pool of 4096 pages with 1024
//!   held (so the lowest free page is not in the first bitmap words).
//! * `alloc_release/2_threads/*`: two threads doing the same concurrently on a shared allocator;
//!   time per pair of operations *per thread* (wall time / iterations per thread).
//! * Baselines in the same run: [`SimpleAllocator`] (`Mutex<BTreeSet>` + ref counts, lowest id
//!   first) and a plain `Mutex<Vec<u32>>` free stack (no ref counts, LIFO ids).
//! * `block_table/*`: truncate and fork of a 256-page table.

use std::hint::black_box;
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use detspec::kv::{
    AtomicAllocator, BlockTable, KvManager, PageAllocator, PageError, PageId, SimpleAllocator,
};

const POOL: usize = 4096;
const HELD: usize = 1024;
const PS: usize = 16;

/// The simplest possible locked free list: what a lock-free allocator has to beat.
struct MutexVec {
    free: Mutex<Vec<u32>>,
    total: usize,
}

impl MutexVec {
    fn new(n: usize) -> Self {
        Self {
            free: Mutex::new((0..n as u32).rev().collect()),
            total: n,
        }
    }
}

impl PageAllocator for MutexVec {
    fn allocate(&self) -> Option<PageId> {
        self.free.lock().ok()?.pop()
    }
    fn try_share(&self, _: PageId) -> Result<(), PageError> {
        Ok(())
    }
    fn try_release(&self, page: PageId) -> Result<bool, PageError> {
        if let Ok(mut f) = self.free.lock() {
            f.push(page);
        }
        Ok(true)
    }
    fn ref_count(&self, _: PageId) -> u32 {
        0
    }
    fn num_free(&self) -> usize {
        self.free.lock().map(|f| f.len()).unwrap_or(0)
    }
    fn num_total(&self) -> usize {
        self.total
    }
}

fn allocators() -> Vec<(&'static str, Box<dyn PageAllocator>)> {
    let v: Vec<(&'static str, Box<dyn PageAllocator>)> = vec![
        ("AtomicAllocator", Box::new(AtomicAllocator::new(POOL))),
        (
            "KvManager",
            Box::new(KvManager::new(POOL, PS, true).expect("manager")),
        ),
        ("SimpleAllocator", Box::new(SimpleAllocator::new(POOL))),
        ("Mutex<Vec<u32>>", Box::new(MutexVec::new(POOL))),
    ];
    for (_, a) in &v {
        for _ in 0..HELD {
            a.allocate();
        }
    }
    v
}

fn alloc_release(c: &mut Criterion) {
    let mut g = c.benchmark_group("alloc_release");
    g.throughput(Throughput::Elements(1));
    for (name, a) in allocators() {
        let a = a.as_ref();
        g.bench_function(BenchmarkId::new("1_thread", name), |b| {
            b.iter(|| {
                let p = a.allocate().expect("page");
                a.release(black_box(p));
            })
        });
        g.bench_function(BenchmarkId::new("2_threads", name), |b| {
            b.iter_custom(|iters| {
                let start = Barrier::new(2);
                std::thread::scope(|s| {
                    let hs: Vec<_> = (0..2)
                        .map(|_| {
                            let start = &start;
                            s.spawn(move || {
                                start.wait();
                                let t = Instant::now();
                                for _ in 0..iters {
                                    let p = a.allocate().expect("page");
                                    a.release(black_box(p));
                                }
                                t.elapsed()
                            })
                        })
                        .collect();
                    hs.into_iter()
                        .map(|h| h.join().unwrap_or_default())
                        .max()
                        .unwrap_or_default()
                })
            })
        });
    }
    g.finish();
}

fn block_table(c: &mut Criterion) {
    const PAGES: usize = 256;
    let mut g = c.benchmark_group("block_table");
    let a = AtomicAllocator::new(POOL);
    let mut bt = BlockTable::new();
    bt.prepare_append(PAGES * PS, PS, &a).expect("reserve");

    // DVR rollback: drop the last few tokens (within the last page) and regrow: no page moves.
    g.bench_function("truncate_regrow_in_page_256", |b| {
        b.iter(|| {
            bt.truncate(PAGES * PS - 5, PS, &a);
            bt.prepare_append(PAGES * PS, PS, &a).expect("regrow");
        })
    });
    // Rollback across 4 pages: releases 4 pages and re-allocates them.
    g.bench_function("truncate_regrow_4_pages_256", |b| {
        b.iter(|| {
            bt.truncate(PAGES * PS - 4 * PS, PS, &a);
            bt.prepare_append(PAGES * PS, PS, &a).expect("regrow");
        })
    });
    // Full truncate (free) of 256 pages, timed alone; the table is rebuilt outside the timing.
    g.bench_function("truncate_all_256", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let mut t = BlockTable::new();
                t.prepare_append(PAGES * PS, PS, &a).expect("reserve");
                let s = Instant::now();
                t.truncate(0, PS, &a);
                total += s.elapsed();
            }
            total
        })
    });
    // Fork (share 256 pages), timed alone; the child is freed outside the timing.
    g.bench_function("fork_256", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut kids = Vec::with_capacity(64);
            let mut left = iters;
            while left > 0 {
                let n = left.min(64);
                let s = Instant::now();
                for _ in 0..n {
                    kids.push(black_box(bt.fork(&a)));
                }
                total += s.elapsed();
                for mut k in kids.drain(..) {
                    k.free(&a);
                }
                left -= n;
            }
            total
        })
    });
    // Fork, then copy-on-write of the shared partial last page on the first append.
    let mut partial = BlockTable::new();
    partial
        .prepare_append(PAGES * PS - 3, PS, &a)
        .expect("reserve");
    g.bench_function("fork_then_cow_append_256", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let s = Instant::now();
                let mut k = partial.fork(&a);
                let cow = k.prepare_append(PAGES * PS - 2, PS, &a).expect("cow");
                total += s.elapsed();
                black_box(cow);
                k.free(&a);
            }
            total
        })
    });
    g.finish();
    bt.free(&a);
    partial.free(&a);
}

criterion_group!(benches, alloc_release, block_table);
criterion_main!(benches);
