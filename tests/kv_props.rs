//! Property test: random sequences of page operations on a [`KvManager`] against a reference
//! model of ownership.
//!
//! The model knows, for every page, who holds it (sequences by id, the prefix cache) and what
//! tokens each slot holds, and keeps its own prefix cache keyed by the literal token prefix (no
//! hashing). After every operation we check:
//!
//! * ref counts are exact: `ref_count(p) == number of holders` for every page;
//! * ownership matches: the sequences whose block tables contain `p` are exactly the model's
//!   holders, so a page is in two sequences only through fork or a prefix-cache hit;
//! * every write lands in a page its sequence holds alone (copy-on-write happened), and every live
//!   sequence still reads back its own tokens from its pages;
//! * prefix lookups return exactly the model's longest cached prefix, with the right contents;
//! * stats agree with the model, and after freeing everything `free + evictable == total`;
//! * the same operations give the same page ids (run twice, traces equal).

#![cfg(not(loom))]

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use detspec::kv::{BlockTable, KvManager, PageAllocator, PageId};
use detspec::DetspecError;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// How often the interesting paths ran across all cases (to show the test is not vacuous).
static COW_COPIES: AtomicUsize = AtomicUsize::new(0);
static LAZY_EVICTIONS: AtomicUsize = AtomicUsize::new(0);
static PREFIX_HITS: AtomicUsize = AtomicUsize::new(0);
static OUT_OF_PAGES: AtomicUsize = AtomicUsize::new(0);
static FORKS: AtomicUsize = AtomicUsize::new(0);

const NUM_PAGES: usize = 24;
const PS: usize = 4;
const MAX_SEQS: usize = 6;

/// Prompts with shared prefixes, so lookups hit.
fn base(i: u8) -> Vec<u32> {
    let common: Vec<u32> = (0..8).map(|t| 100 + t).collect();
    match i % 3 {
        0 => common
            .iter()
            .copied()
            .chain((0..16).map(|t| 200 + t))
            .collect(),
        1 => common
            .iter()
            .copied()
            .chain((0..16).map(|t| 300 + t))
            .collect(),
        _ => (0..24).map(|t| 400 + t).collect(),
    }
}

#[derive(Debug, Clone)]
enum Op {
    New {
        base: u8,
        len: usize,
        use_prefix: bool,
    },
    Append {
        seq: usize,
        toks: Vec<u32>,
    },
    Reserve {
        seq: usize,
        extra: usize,
    },
    Truncate {
        seq: usize,
        keep_pct: usize,
    },
    Fork {
        seq: usize,
    },
    Free {
        seq: usize,
    },
    Insert {
        seq: usize,
    },
    Evict {
        n: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..3, 0usize..=24, any::<bool>())
            .prop_map(|(base, len, use_prefix)| Op::New { base, len, use_prefix }),
        4 => (0usize..MAX_SEQS, prop::collection::vec(0u32..3, 1..9))
            .prop_map(|(seq, toks)| Op::Append { seq, toks }),
        1 => (0usize..MAX_SEQS, 1usize..12).prop_map(|(seq, extra)| Op::Reserve { seq, extra }),
        2 => (0usize..MAX_SEQS, 0usize..=100)
            .prop_map(|(seq, keep_pct)| Op::Truncate { seq, keep_pct }),
        2 => (0usize..MAX_SEQS).prop_map(|seq| Op::Fork { seq }),
        2 => (0usize..MAX_SEQS).prop_map(|seq| Op::Free { seq }),
        2 => (0usize..MAX_SEQS).prop_map(|seq| Op::Insert { seq }),
        1 => (0usize..4).prop_map(|n| Op::Evict { n }),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Holder {
    Seq(u64),
    Cache,
}

#[derive(Debug, Clone)]
struct ModelEntry {
    page: PageId,
    id: u64,
    parent_id: u64,
}

struct Seq {
    id: u64,
    table: BlockTable,
    tokens: Vec<u32>,
}

/// The reference model.
struct Model {
    holders: Vec<Vec<Holder>>,
    content: Vec<Vec<Option<u32>>>,
    /// Full token prefix through a page -> entry.
    cache: HashMap<Vec<u32>, ModelEntry>,
    next_entry: u64,
}

impl Model {
    fn new() -> Self {
        Self {
            holders: vec![Vec::new(); NUM_PAGES],
            content: vec![vec![None; PS]; NUM_PAGES],
            cache: HashMap::new(),
            next_entry: 1,
        }
    }

    fn remove_holder(&mut self, p: PageId, h: Holder) {
        let v = &mut self.holders[p as usize];
        let i = v
            .iter()
            .position(|&x| x == h)
            .expect("model: holder not found");
        v.remove(i);
    }

    fn take_fresh(&mut self, p: PageId, h: Holder) {
        assert!(
            self.holders[p as usize].is_empty(),
            "page {p} handed out while held by {:?}",
            self.holders[p as usize]
        );
        self.holders[p as usize].push(h);
        self.content[p as usize] = vec![None; PS];
    }

    fn evictable(&self) -> Vec<PageId> {
        (0..NUM_PAGES as PageId)
            .filter(|&p| self.holders[p as usize] == [Holder::Cache])
            .collect()
    }

    fn num_free(&self) -> usize {
        self.holders.iter().filter(|h| h.is_empty()).count()
    }

    /// Pages the real cache dropped (lazy or explicit eviction) leave the model too; they must
    /// have been evictable. Returns how many.
    fn reconcile_evictions(&mut self, m: &KvManager) -> usize {
        let actual = m.cached_pages();
        let gone: Vec<(Vec<u32>, PageId)> = self
            .cache
            .iter()
            .filter(|(_, e)| !actual.contains(&e.page))
            .map(|(k, e)| (k.clone(), e.page))
            .collect();
        for (k, p) in &gone {
            assert_eq!(
                self.holders[*p as usize],
                [Holder::Cache],
                "evicted page {p} was still in use"
            );
            self.cache.remove(k);
            self.remove_holder(*p, Holder::Cache);
        }
        gone.len()
    }

    fn lookup(&self, tokens: &[u32]) -> Vec<PageId> {
        let mut out = Vec::new();
        let mut parent = 0;
        for i in 0..tokens.len() / PS {
            match self.cache.get(&tokens[..(i + 1) * PS]) {
                Some(e) if e.parent_id == parent => {
                    out.push(e.page);
                    parent = e.id;
                }
                _ => break,
            }
        }
        out
    }

    fn insert(&mut self, tokens: &[u32], pages: &[PageId]) {
        let mut parent = 0;
        for (i, &page) in pages.iter().enumerate().take(tokens.len() / PS) {
            let key = tokens[..(i + 1) * PS].to_vec();
            if let Some(e) = self.cache.get(&key) {
                if e.parent_id == parent {
                    parent = e.id;
                    continue;
                }
                // Orphan (its parent was evicted and re-cached): replaced.
                let old = e.page;
                self.cache.remove(&key);
                self.remove_holder(old, Holder::Cache);
            }
            if self.cache.values().any(|e| e.page == page) {
                break;
            }
            let id = self.next_entry;
            self.next_entry += 1;
            self.cache.insert(
                key,
                ModelEntry {
                    page,
                    id,
                    parent_id: parent,
                },
            );
            self.holders[page as usize].push(Holder::Cache);
            parent = id;
        }
    }
}

/// What one run produced, to compare two runs of the same ops.
type Trace = Vec<(Vec<Vec<PageId>>, usize, usize)>;

/// Grows `s` by `new` tokens through `prepare_append`, mirroring it in the model. `false` when the
/// pool was exhausted (the table must then be unchanged).
fn append(m: &KvManager, model: &mut Model, s: &mut Seq, new: &[u32]) -> bool {
    if new.is_empty() {
        return true;
    }
    let before = s.table.clone();
    let start = s.table.num_tokens();
    assert_eq!(start, s.tokens.len());
    let first = start / PS;
    let first_shared = !start.is_multiple_of(PS)
        && before
            .pages()
            .get(first)
            .is_some_and(|&p| model.holders[p as usize].len() > 1);
    let free_before = model.num_free();
    match s.table.prepare_append(start + new.len(), PS, m) {
        Err(DetspecError::OutOfPages { .. }) => {
            assert_eq!(s.table, before, "failed prepare_append changed the table");
            OUT_OF_PAGES.fetch_add(1, Ordering::Relaxed);
            model.reconcile_evictions(m);
            return false;
        }
        Err(e) => panic!("unexpected error {e}"),
        Ok(cow) => {
            let evicted = model.reconcile_evictions(m);
            LAZY_EVICTIONS.fetch_add(evicted, Ordering::Relaxed);
            let mut fresh = Vec::new();
            for (i, &p) in s.table.pages().iter().enumerate() {
                match before.pages().get(i) {
                    Some(&old) if old == p => {}
                    Some(&old) => {
                        model.remove_holder(old, Holder::Seq(s.id));
                        fresh.push(p);
                    }
                    None => fresh.push(p),
                }
            }
            assert!(
                evicted == 0 || free_before < fresh.len(),
                "evicted {evicted} cached pages with {free_before} free for {} new",
                fresh.len()
            );
            for &p in &fresh {
                model.take_fresh(p, Holder::Seq(s.id));
            }
            if first_shared {
                let (src, dst) = cow.expect("shared partial page written without a copy");
                assert_eq!((src, dst), (before.pages()[first], s.table.pages()[first]));
                model.content[dst as usize] = model.content[src as usize].clone();
                COW_COPIES.fetch_add(1, Ordering::Relaxed);
            } else {
                assert_eq!(cow, None);
            }
        }
    }
    for (k, &t) in new.iter().enumerate() {
        let pos = start + k;
        let p = s.table.pages()[pos / PS];
        assert_eq!(
            model.holders[p as usize],
            [Holder::Seq(s.id)],
            "write into page {p} that is not private"
        );
        model.content[p as usize][pos % PS] = Some(t);
    }
    s.tokens.extend_from_slice(new);
    true
}

fn check(m: &KvManager, model: &Model, seqs: &[Seq]) {
    let mut seq_holders: Vec<Vec<Holder>> = vec![Vec::new(); NUM_PAGES];
    for s in seqs {
        assert_eq!(s.table.num_tokens(), s.tokens.len());
        for &p in s.table.pages() {
            seq_holders[p as usize].push(Holder::Seq(s.id));
        }
        for (pos, &t) in s.tokens.iter().enumerate() {
            let p = s.table.pages()[pos / PS];
            assert_eq!(
                model.content[p as usize][pos % PS],
                Some(t),
                "seq {} lost its token at {pos} (page {p})",
                s.id
            );
        }
    }
    for (p, (held_by_seqs, holders)) in seq_holders.iter_mut().zip(&model.holders).enumerate() {
        let mut want: Vec<Holder> = holders.clone();
        assert_eq!(
            m.ref_count(p as PageId) as usize,
            want.len(),
            "ref count of page {p}, holders {want:?}"
        );
        want.retain(|&h| h != Holder::Cache);
        want.sort();
        held_by_seqs.sort();
        assert_eq!(*held_by_seqs, want, "owners of page {p}");
        assert_eq!(m.is_cached(p as PageId), holders.contains(&Holder::Cache));
    }
    let st = m.stats();
    let free = model.num_free();
    let evictable = model.evictable().len();
    assert_eq!(st.total_pages, NUM_PAGES);
    assert_eq!(st.free_pages, free);
    assert_eq!(st.cached_pages, model.cache.len());
    assert_eq!(st.evictable_pages, evictable);
    assert_eq!(st.used_pages, NUM_PAGES - free - evictable);
    assert_eq!(m.num_free(), free + evictable);
}

fn run(ops: &[Op]) -> Trace {
    let m = KvManager::new(NUM_PAGES, PS, true).expect("manager");
    let mut model = Model::new();
    let mut seqs: Vec<Seq> = Vec::new();
    let mut next_id = 0u64;
    let mut trace = Trace::new();
    for op in ops {
        let pick = |i: usize, n: usize| if n == 0 { None } else { Some(i % n) };
        match op.clone() {
            Op::New {
                base: b,
                len,
                use_prefix,
            } => {
                if seqs.len() >= MAX_SEQS {
                    continue;
                }
                let tokens = base(b)[..len].to_vec();
                let id = next_id;
                next_id += 1;
                let hit = if use_prefix {
                    let q = &tokens[..len.saturating_sub(1)];
                    let hit = m.lookup_prefix(q);
                    assert_eq!(hit, model.lookup(q), "prefix lookup");
                    PREFIX_HITS.fetch_add(usize::from(!hit.is_empty()), Ordering::Relaxed);
                    for (i, &p) in hit.iter().enumerate() {
                        let want: Vec<Option<u32>> = tokens[i * PS..(i + 1) * PS]
                            .iter()
                            .map(|&t| Some(t))
                            .collect();
                        assert_eq!(model.content[p as usize], want, "cached page {p} contents");
                        model.holders[p as usize].push(Holder::Seq(id));
                    }
                    hit
                } else {
                    Vec::new()
                };
                let n_hit = hit.len() * PS;
                let mut s = Seq {
                    id,
                    table: BlockTable::from_shared_pages(hit, PS),
                    tokens: tokens[..n_hit].to_vec(),
                };
                if append(&m, &mut model, &mut s, &tokens[n_hit..]) {
                    seqs.push(s);
                } else {
                    for &p in s.table.pages() {
                        model.remove_holder(p, Holder::Seq(id));
                    }
                    s.table.free(&m);
                }
            }
            Op::Append { seq, toks } => {
                let Some(i) = pick(seq, seqs.len()) else {
                    continue;
                };
                append(&m, &mut model, &mut seqs[i], &toks);
            }
            Op::Reserve { seq, extra } => {
                let Some(i) = pick(seq, seqs.len()) else {
                    continue;
                };
                let s = &mut seqs[i];
                let before = s.table.pages().len();
                if s.table.reserve(s.tokens.len() + extra, PS, &m).is_ok() {
                    model.reconcile_evictions(&m);
                    for &p in &s.table.pages()[before..] {
                        model.take_fresh(p, Holder::Seq(s.id));
                    }
                } else {
                    assert_eq!(s.table.pages().len(), before);
                    model.reconcile_evictions(&m);
                }
            }
            Op::Truncate { seq, keep_pct } => {
                let Some(i) = pick(seq, seqs.len()) else {
                    continue;
                };
                let s = &mut seqs[i];
                let len = s.tokens.len() * keep_pct / 100;
                let keep = len.div_ceil(PS);
                let had = s.table.pages().len();
                for &p in s.table.pages().iter().skip(keep) {
                    model.remove_holder(p, Holder::Seq(s.id));
                }
                s.table.truncate(len, PS, &m);
                s.tokens.truncate(len);
                assert_eq!(s.table.pages().len(), keep.min(had));
            }
            Op::Fork { seq } => {
                let Some(i) = pick(seq, seqs.len()) else {
                    continue;
                };
                if seqs.len() >= MAX_SEQS {
                    continue;
                }
                let id = next_id;
                next_id += 1;
                let table = seqs[i].table.fork(&m);
                FORKS.fetch_add(1, Ordering::Relaxed);
                for &p in table.pages() {
                    model.holders[p as usize].push(Holder::Seq(id));
                }
                let tokens = seqs[i].tokens.clone();
                seqs.push(Seq { id, table, tokens });
            }
            Op::Free { seq } => {
                let Some(i) = pick(seq, seqs.len()) else {
                    continue;
                };
                let mut s = seqs.remove(i);
                for &p in s.table.pages() {
                    model.remove_holder(p, Holder::Seq(s.id));
                }
                s.table.free(&m);
            }
            Op::Insert { seq } => {
                let Some(i) = pick(seq, seqs.len()) else {
                    continue;
                };
                let s = &seqs[i];
                m.insert_prefix(&s.tokens, s.table.pages());
                model.insert(&s.tokens, s.table.pages());
            }
            Op::Evict { n } => {
                let evictable = model.evictable().len();
                let freed = m.evict(n);
                assert_eq!(freed, n.min(evictable));
                assert_eq!(model.reconcile_evictions(&m), freed);
            }
        }
        check(&m, &model, &seqs);
        let st = m.stats();
        trace.push((
            seqs.iter().map(|s| s.table.pages().to_vec()).collect(),
            st.free_pages,
            st.cached_pages,
        ));
    }
    // Everything ends.
    for mut s in seqs.drain(..) {
        for &p in s.table.pages() {
            model.remove_holder(p, Holder::Seq(s.id));
        }
        s.table.free(&m);
    }
    check(&m, &model, &seqs);
    let st = m.stats();
    assert_eq!(st.free_pages + st.evictable_pages, st.total_pages);
    assert_eq!(st.used_pages, 0);
    assert_eq!(m.evict(usize::MAX), st.evictable_pages);
    assert_eq!(m.stats().free_pages, NUM_PAGES);
    trace
}

#[test]
fn kv_manager_matches_ownership_model() {
    let mut runner = TestRunner::new(Config {
        cases: 512,
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&prop::collection::vec(op(), 1..80), |ops| {
        let a = run(&ops);
        let b = run(&ops);
        prop_assert_eq!(a, b, "same operations, different page ids");
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let counts = [
        ("copy-on-write copies", COW_COPIES.load(Ordering::Relaxed)),
        ("lazy evictions", LAZY_EVICTIONS.load(Ordering::Relaxed)),
        ("prefix hits", PREFIX_HITS.load(Ordering::Relaxed)),
        ("out of pages", OUT_OF_PAGES.load(Ordering::Relaxed)),
        ("forks", FORKS.load(Ordering::Relaxed)),
    ];
    eprintln!("coverage over 512 cases x 2 runs: {counts:?}");
    for (what, n) in counts {
        assert!(n > 0, "no {what} happened: the test is not exercising it");
    }
}

/// A deterministic scenario that exercises lazy eviction and orphan replacement.
#[test]
fn scripted_scenario() {
    let ops = vec![
        Op::New {
            base: 0,
            len: 24,
            use_prefix: false,
        },
        Op::Insert { seq: 0 },
        Op::Free { seq: 0 },
        Op::New {
            base: 1,
            len: 24,
            use_prefix: true,
        },
        Op::Insert { seq: 0 },
        Op::New {
            base: 2,
            len: 24,
            use_prefix: true,
        },
        Op::Free { seq: 0 },
        Op::New {
            base: 0,
            len: 24,
            use_prefix: true,
        },
        Op::Fork { seq: 1 },
        Op::Append {
            seq: 2,
            toks: vec![1, 2, 3],
        },
        Op::Truncate {
            seq: 1,
            keep_pct: 50,
        },
        Op::Append {
            seq: 1,
            toks: vec![2, 2],
        },
        Op::Evict { n: 3 },
        Op::Insert { seq: 1 },
        Op::New {
            base: 0,
            len: 24,
            use_prefix: true,
        },
    ];
    assert_eq!(run(&ops), run(&ops));
}
