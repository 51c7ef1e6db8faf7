//! Property test: the prefix cache's page classes against a reference model.
//!
//! Random sequences arrive as deterministic (`Invariant`) or plain (`Fast`) requests with
//! prompts that share prefixes. Each looks up what it may read, computes the rest on fresh
//! pages and registers its full pages; sequences finish and pages are evicted at random. The
//! model records, for every page, the tokens its KV was computed for and whether every page of
//! its path ran on invariant kernels, and keeps its own registry of cached pages (unique ids,
//! parents by id, no hashing). After every operation:
//!
//! * a lookup hands out pages whose KV is that of the query's own prefix;
//! * a deterministic lookup hands out only pages whose whole path ran on invariant kernels;
//! * a lookup is as long as the model's longest readable path (`Invariant` pages only, or for
//!   a plain request `Invariant` pages continued by `Fast` ones);
//! * a sequence's full pages are all readable after it registered them, whatever class the
//!   pages it read were (the case a plain request after a deterministic prefix used to lose);
//! * the cache holds exactly the model's pages.

#![cfg(not(loom))]

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use detspec::kv::{AtomicAllocator, PageAllocator, PageClass, PageId, PrefixCache};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

const NUM_PAGES: usize = 32;
const PS: usize = 4;
const MAX_LIVE: usize = 3;

/// How often a plain request read invariant pages and went on past them (to show the test
/// reaches the case it is about).
static FAST_AFTER_INVARIANT: AtomicUsize = AtomicUsize::new(0);

/// Prompts that share a 8-token prefix (two of three) and diverge after it.
fn base(i: u8) -> Vec<u32> {
    let common = (0..8).map(|t| 100 + t);
    match i % 3 {
        0 => common.chain((0..16).map(|t| 200 + t)).collect(),
        1 => common.chain((0..16).map(|t| 300 + t)).collect(),
        _ => (0..24).map(|t| 400 + t).collect(),
    }
}

#[derive(Debug, Clone)]
enum Op {
    Request {
        deterministic: bool,
        base: u8,
        len: usize,
    },
    Finish(usize),
    Evict(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (any::<bool>(), 0u8..3, 1usize..=24)
            .prop_map(|(deterministic, base, len)| Op::Request { deterministic, base, len }),
        2 => (0usize..MAX_LIVE).prop_map(Op::Finish),
        1 => (1usize..8).prop_map(Op::Evict),
    ]
}

/// What a page's KV holds: the tokens through it, and whether its whole path ran on invariant
/// kernels.
#[derive(Debug, Clone)]
struct Computed {
    prefix: Vec<u32>,
    pure: bool,
}

/// A cached page in the model: unique id, the id of the page it continues (0: the first page).
#[derive(Debug, Clone)]
struct Registered {
    id: u64,
    parent: u64,
    prefix: Vec<u32>,
    class: PageClass,
}

#[derive(Default)]
struct Model {
    computed: HashMap<PageId, Computed>,
    registered: HashMap<PageId, Registered>,
    next_id: u64,
}

impl Model {
    /// The longest path of registered pages along `tokens` a request of `class` may read.
    fn longest(&self, tokens: &[u32], class: PageClass) -> usize {
        self.deepest(tokens, class, 0, PageClass::Invariant, 0)
    }

    fn deepest(
        &self,
        tokens: &[u32],
        class: PageClass,
        parent: u64,
        pc: PageClass,
        d: usize,
    ) -> usize {
        let Some(want) = tokens.get(..(d + 1) * PS) else {
            return d;
        };
        self.registered
            .values()
            .filter(|r| r.parent == parent && r.prefix == want)
            .filter(|r| match (class, r.class) {
                (PageClass::Invariant, c) => c == PageClass::Invariant,
                // Invariant pages only before any fast one.
                (PageClass::Fast, PageClass::Invariant) => pc == PageClass::Invariant,
                (PageClass::Fast, PageClass::Fast) => true,
            })
            .map(|r| self.deepest(tokens, class, r.id, r.class, d + 1))
            .max()
            .unwrap_or(d)
    }

    /// Drops the pages the cache no longer holds.
    fn reconcile(&mut self, cache: &PrefixCache) {
        let held = cache.cached_pages();
        self.registered.retain(|p, _| held.contains(p));
    }
}

/// One request: look up, check what came back, compute the rest, register, check it stuck.
fn request(
    cache: &mut PrefixCache,
    alloc: &AtomicAllocator,
    model: &mut Model,
    tokens: &[u32],
    class: PageClass,
) -> Option<Vec<PageId>> {
    let hit = cache.lookup_class(tokens, PS, class, 0, alloc);
    for (i, p) in hit.iter().enumerate() {
        let c = &model.computed[p];
        assert_eq!(
            c.prefix,
            tokens[..(i + 1) * PS],
            "page {p} holds another prefix"
        );
        if class == PageClass::Invariant {
            assert!(
                c.pure,
                "a deterministic lookup read page {p}, computed on the fast path"
            );
        }
    }
    assert_eq!(
        hit.len(),
        model.longest(tokens, class),
        "lookup length of {tokens:?}"
    );
    let read_invariant = hit
        .iter()
        .any(|p| model.registered[p].class == PageClass::Invariant);
    let mut pages = hit.clone();
    for i in hit.len()..tokens.len().div_ceil(PS) {
        let page = match alloc.allocate() {
            Some(p) => p,
            None => {
                cache.evict(NUM_PAGES, alloc);
                model.reconcile(cache);
                let Some(p) = alloc.allocate() else {
                    release(cache, alloc, &pages);
                    model.reconcile(cache);
                    return None;
                };
                p
            }
        };
        let end = ((i + 1) * PS).min(tokens.len());
        let pure = class == PageClass::Invariant;
        model.computed.insert(
            page,
            Computed {
                prefix: tokens[..end].to_vec(),
                pure,
            },
        );
        pages.push(page);
    }
    let full = tokens.len() / PS;
    if class == PageClass::Fast && read_invariant && full > hit.len() {
        FAST_AFTER_INVARIANT.fetch_add(1, Ordering::Relaxed);
    }
    let before: Vec<PageId> = cache.cached_pages();
    cache.insert_class(tokens, &pages, PS, class, 0, alloc);
    let mut parent = 0;
    for (i, &p) in pages.iter().take(full).enumerate() {
        if !before.contains(&p) {
            assert!(
                cache.is_cached(p),
                "full page {i} of {tokens:?} was not registered"
            );
            model.next_id += 1;
            let prefix = tokens[..(i + 1) * PS].to_vec();
            let id = model.next_id;
            model.registered.insert(
                p,
                Registered {
                    id,
                    parent,
                    prefix,
                    class,
                },
            );
        }
        parent = model.registered[&p].id;
    }
    let again = cache.lookup_class(tokens, PS, class, 0, alloc);
    assert_eq!(
        again,
        pages[..full],
        "{tokens:?} does not read back its own pages"
    );
    release(cache, alloc, &again);
    Some(pages)
}

fn release(cache: &mut PrefixCache, alloc: &AtomicAllocator, pages: &[PageId]) {
    for &p in pages {
        alloc.release(p);
        cache.on_sole_holder(p, alloc);
    }
}

fn run(ops: &[Op]) {
    let alloc = AtomicAllocator::new(NUM_PAGES);
    let mut cache = PrefixCache::new(NUM_PAGES);
    let mut model = Model::default();
    let mut live: Vec<Vec<PageId>> = Vec::new();
    for op in ops {
        match *op {
            Op::Request {
                deterministic,
                base: b,
                len,
            } => {
                if live.len() == MAX_LIVE {
                    release(&mut cache, &alloc, &live.remove(0));
                }
                let class = if deterministic {
                    PageClass::Invariant
                } else {
                    PageClass::Fast
                };
                if let Some(pages) = request(&mut cache, &alloc, &mut model, &base(b)[..len], class)
                {
                    live.push(pages);
                }
            }
            Op::Finish(i) if i < live.len() => release(&mut cache, &alloc, &live.remove(i)),
            Op::Finish(_) => {}
            Op::Evict(n) => {
                cache.evict(n, &alloc);
                model.reconcile(&cache);
            }
        }
        let mut held: Vec<PageId> = model.registered.keys().copied().collect();
        held.sort_unstable();
        assert_eq!(cache.cached_pages(), held, "cached pages after {op:?}");
    }
}

#[test]
fn page_classes_match_the_model() {
    let mut runner = TestRunner::new(Config {
        cases: 256,
        ..Config::default()
    });
    runner
        .run(&proptest::collection::vec(op(), 1..40), |ops| {
            run(&ops);
            Ok(())
        })
        .unwrap();
    let n = FAST_AFTER_INVARIANT.load(Ordering::Relaxed);
    assert!(
        n > 50,
        "plain requests went past invariant pages only {n} times"
    );
}

/// The case the classes' chaining is for, spelled out: a deterministic prompt, then a plain
/// conversation that starts with it and goes on.
#[test]
fn plain_turns_after_a_deterministic_prefix_are_cached() {
    let alloc = AtomicAllocator::new(NUM_PAGES);
    let mut cache = PrefixCache::new(NUM_PAGES);
    let system: Vec<u32> = (0..8).collect();
    let turn1: Vec<u32> = system.iter().copied().chain(10..18).collect();
    let turn2: Vec<u32> = turn1.iter().copied().chain(20..28).collect();
    let det: Vec<PageId> = (0..2).map(|_| alloc.allocate().unwrap()).collect();
    assert_eq!(
        cache.insert_class(&system, &det, PS, PageClass::Invariant, 0, &alloc),
        2
    );
    // Turn 1, plain: reads the system prompt's invariant pages, computes two of its own.
    let mut t1 = cache.lookup_class(&turn1, PS, PageClass::Fast, 0, &alloc);
    assert_eq!(t1, det);
    t1.extend((0..2).map(|_| alloc.allocate().unwrap()));
    assert_eq!(
        cache.insert_class(&turn1, &t1, PS, PageClass::Fast, 0, &alloc),
        2
    );
    // Turn 2 reads all four pages of turn 1.
    assert_eq!(
        cache.lookup_class(&turn2, PS, PageClass::Fast, 0, &alloc),
        t1
    );
    // A deterministic request with turn 2's tokens reads only the invariant system prompt.
    assert_eq!(
        cache.lookup_class(&turn2, PS, PageClass::Invariant, 0, &alloc),
        det
    );
    // Its own continuation of the system prompt does not take the plain pages' keys.
    let mut d1 = det.clone();
    d1.extend((0..2).map(|_| alloc.allocate().unwrap()));
    assert_eq!(
        cache.insert_class(&turn1, &d1, PS, PageClass::Invariant, 0, &alloc),
        2
    );
    assert_eq!(
        cache.lookup_class(&turn1, PS, PageClass::Invariant, 0, &alloc),
        d1
    );
    assert_eq!(
        cache
            .lookup_class(&turn2, PS, PageClass::Fast, 0, &alloc)
            .len(),
        4
    );
}
