//! Prefix cache: full KV pages keyed by the tokens they (and everything before them) hold, so a
//! new prompt that starts like an earlier one reuses its pages instead of recomputing them.
//!
//! # Keys
//!
//! Page `i` of a sequence is keyed by `chain_hash(key(i - 1), tokens of page i)`, the root being
//! a constant derived from the page size and the page's class ([`PageClass`]). Because the key
//! covers the whole prefix, equal keys mean equal KV (the model is deterministic on a given
//! path). A `Fast` page may follow `Invariant` ones (a plain request that read a deterministic
//! prefix and went on past it): its key starts from its parent's key marked as a change of
//! class, so it never takes the key an `Invariant` continuation would have.
//!
//! The hash is FNV-1a with its standard fixed offset basis and prime, followed by a fixed
//! 64-bit finaliser, so keys are the same in every process and on every run: a randomly seeded
//! hasher (`RandomState`) would make hits depend on the process, which breaks reproducibility
//! of page ids and of hit statistics.
//!
//! A hit is never trusted on the hash alone: each entry stores its page's tokens and the id of
//! the entry it was chained from, and lookups compare both. A 64-bit collision, or an orphan whose
//! parent was evicted and whose key was reused, is therefore a miss, never wrong KV.
//!
//! # Ownership
//!
//! The cache holds one reference on every cached page, so the page survives the sequence that
//! computed it. A cached page whose only holder is the cache (ref count 1) is *evictable* and sits
//! in an LRU ordered by last use, deepest page first on ties (a chain's tail goes before its
//! head, so no live entry is left without its parent). Eviction drops the cache's reference,
//! which frees the page.
//!
//! The cache learns that a page became evictable through [`PrefixCache::on_sole_holder`], which
//! [`super::KvManager`] calls from its `release`. The manager tells which pages are cached
//! without taking the cache's lock through the flags this cache keeps ([`PrefixCache::is_cached`]).
//!
//! This is the rare path (once per prompt and once per finished page), so it is a plain
//! single-threaded structure; the manager keeps it behind one `Mutex`.

use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::Arc;

use super::{PageAllocator, PageId};

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a, 64 bit, fixed parameters. Used for chain keys and for the entry map.
#[derive(Debug, Clone, Copy)]
pub struct FnvHasher(u64);

impl Default for FnvHasher {
    fn default() -> Self {
        Self(FNV_OFFSET)
    }
}

impl Hasher for FnvHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(FNV_PRIME);
        }
    }
}

/// Final avalanche (the `fmix64` step of MurmurHash3): FNV-1a alone mixes the last bytes of its
/// input weakly into the high bits, which the hash map uses.
fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^ (k >> 33)
}

/// How a cached page's KV was computed. Each class's chains start from their own root.
///
/// A deterministic request reads `Invariant` pages only. A request with no reproducibility
/// promise reads either, and `Fast` pages that continue `Invariant` ones: an invariant page
/// holds exact KV of its tokens too, so a prompt scored deterministically (prompt logprobs
/// before a generation, what eval harnesses send) is not computed twice, and a plain
/// conversation that began on a deterministic prefix caches its own turns after it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PageClass {
    /// By the batch-variant fast path: its bits depend on what else ran.
    #[default]
    Fast,
    /// On invariant kernels (deterministic prefill, verifier, inline rows): the bits are a pure
    /// function of the tokens, the same whoever computed them. Deterministic requests read only
    /// these.
    Invariant,
}

/// Key of the (empty) prefix before page 0. Includes the page size so that caches with different
/// page sizes can never agree on a key.
pub fn root_hash(page_size: usize) -> u64 {
    root_hash_of(page_size, PageClass::Fast, 0)
}

/// [`root_hash`] of one page class in one namespace: a sequence's KV is cached apart from the
/// base model's when it was computed otherwise for the same tokens (a LoRA adapter's content
/// hash; 0: the base model).
pub fn root_hash_of(page_size: usize, class: PageClass, namespace: u64) -> u64 {
    let mut h = FnvHasher::default();
    h.write(b"detspec-prefix-v1");
    h.write(&(page_size as u64).to_le_bytes());
    if class == PageClass::Invariant {
        h.write(b"invariant");
    }
    if namespace != 0 {
        h.write(b"namespace");
        h.write(&namespace.to_le_bytes());
    }
    fmix64(h.finish())
}

/// The namespace of KV computed with the adapter whose content hash is `adapter` (0: the base
/// model) for a request salted with `salt` ([`salt_hash`] of its `cache_salt`; 0: none).
/// Unsalted KV keeps the adapter's namespace; salted KV is in one no other salt reaches, so a
/// tenant cannot learn from a cache hit's timing what another tenant's prompts were.
pub fn namespace(adapter: u64, salt: u64) -> u64 {
    if salt == 0 {
        return adapter;
    }
    let mut h = FnvHasher::default();
    h.write(b"salt");
    h.write(&adapter.to_le_bytes());
    h.write(&salt.to_le_bytes());
    fmix64(h.finish()).max(1)
}

/// A request's `cache_salt` as the namespace component [`namespace`] takes (never 0).
pub fn salt_hash(salt: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(salt.as_bytes()).max(1)
}

/// Key of a page holding `tokens` that follows the prefix keyed `parent`.
pub fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = FnvHasher::default();
    h.write(&parent.to_le_bytes());
    for t in tokens {
        h.write(&t.to_le_bytes());
    }
    fmix64(h.finish())
}

/// The cached entry a page chains from.
#[derive(Debug, Clone, Copy)]
struct Link {
    key: u64,
    id: u64,
    class: PageClass,
}

/// What a page of `class` after `parent` (`None`: the first page) hashes its tokens onto: the
/// class's root, the parent's key within a class, and the parent's key marked where a `Fast`
/// page follows an `Invariant` one, so the two continuations of a page never share a key.
fn chain_base(page_size: usize, parent: Option<Link>, class: PageClass, namespace: u64) -> u64 {
    match parent {
        None => root_hash_of(page_size, class, namespace),
        Some(p) if p.class == class => p.key,
        Some(p) => {
            let mut h = FnvHasher::default();
            h.write(b"class-change");
            h.write(&p.key.to_le_bytes());
            fmix64(h.finish())
        }
    }
}

type FixedState = BuildHasherDefault<FnvHasher>;

/// LRU order: oldest `last_used` first, then deepest first, then page id (for uniqueness).
type LruKey = (u64, u32, PageId);

#[derive(Debug)]
struct Entry {
    /// Unique for the cache's lifetime; 0 is the root.
    id: u64,
    parent_id: u64,
    /// Key of the parent entry (meaningless for depth 0).
    parent_key: u64,
    page: PageId,
    class: PageClass,
    /// See [`root_hash_of`]; a chain's pages all have its root's.
    namespace: u64,
    tokens: Box<[u32]>,
    depth: u32,
    last_used: u64,
    in_lru: bool,
}

impl Entry {
    fn lru_key(&self) -> LruKey {
        (self.last_used, u32::MAX - self.depth, self.page)
    }

    fn link(&self, key: u64) -> Link {
        Link {
            key,
            id: self.id,
            class: self.class,
        }
    }
}

/// Counters of a [`PrefixCache`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Pages held by the cache (in use by sequences or not).
    pub cached_pages: usize,
    /// Cached pages only the cache holds: freed by eviction on demand.
    pub evictable_pages: usize,
    /// `lookup` calls while enabled.
    pub lookups: u64,
    /// Prompt tokens passed to `lookup` while enabled.
    pub query_tokens: u64,
    /// Of those, tokens found in the cache.
    pub hit_tokens: u64,
}

/// What [`PrefixCache::lookup_ending`] found.
#[derive(Debug, Default)]
pub struct EndingHit {
    /// The pages handed out (a reference taken on each), up to the cut.
    pub pages: Vec<PageId>,
    /// The entry id of the last of them.
    pub end: Option<u64>,
    /// Pages of the prefix cached for the request before the cut (at least `pages.len()`):
    /// where it shares more with earlier prompts than it can read.
    pub cached: usize,
}

/// Full KV pages keyed by chain hash, with an LRU of evictable ones. See the module docs.
#[derive(Debug)]
pub struct PrefixCache {
    enabled: bool,
    entries: HashMap<u64, Entry, FixedState>,
    /// Key of the entry caching each page.
    by_page: Vec<Option<u64>>,
    /// Same information as `by_page`, readable without `&self` access (see module docs).
    cached: Arc<[AtomicBool]>,
    lru: BTreeSet<LruKey>,
    tick: u64,
    next_id: u64,
    lookups: u64,
    query_tokens: u64,
    hit_tokens: u64,
}

impl PrefixCache {
    /// An empty, enabled cache for a pool of `num_pages` pages.
    pub fn new(num_pages: usize) -> Self {
        Self {
            enabled: true,
            entries: HashMap::default(),
            by_page: vec![None; num_pages],
            cached: (0..num_pages).map(|_| AtomicBool::new(false)).collect(),
            lru: BTreeSet::new(),
            tick: 0,
            next_id: 1,
            lookups: 0,
            query_tokens: 0,
            hit_tokens: 0,
        }
    }

    /// Turns lookups and inserts on or off. Turning it off keeps the cached pages (they are still
    /// evictable and will be reclaimed lazily); use [`PrefixCache::clear`] to drop them now.
    pub fn set_enabled(&mut self, enabled: bool) {
        self.enabled = enabled;
    }

    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// Whether `page` is cached. Lock-free view for [`super::KvManager`].
    pub fn is_cached(&self, page: PageId) -> bool {
        self.cached
            .get(page as usize)
            .is_some_and(|f| f.load(Ordering::Relaxed))
    }

    /// The flags behind [`PrefixCache::is_cached`], shared with the manager.
    pub(crate) fn cached_flags(&self) -> Arc<[AtomicBool]> {
        Arc::clone(&self.cached)
    }

    /// Cached pages, ascending.
    pub fn cached_pages(&self) -> Vec<PageId> {
        let mut v: Vec<PageId> = self.entries.values().map(|e| e.page).collect();
        v.sort_unstable();
        v
    }

    /// Evictable pages in eviction order (next victim first).
    pub fn evictable_pages(&self) -> Vec<PageId> {
        self.lru.iter().map(|k| k.2).collect()
    }

    pub fn stats(&self) -> PrefixStats {
        PrefixStats {
            cached_pages: self.entries.len(),
            evictable_pages: self.lru.len(),
            lookups: self.lookups,
            query_tokens: self.query_tokens,
            hit_tokens: self.hit_tokens,
        }
    }

    /// Longest run of cached full pages that `tokens` starts with. Takes one reference on each
    /// returned page for the caller (build the sequence's table with
    /// [`super::BlockTable::from_shared_pages`]). Empty when disabled.
    ///
    /// The caller usually passes the prompt minus its last token, so at least one token is left
    /// to compute (its logits are needed to sample).
    pub fn lookup(
        &mut self,
        tokens: &[u32],
        page_size: usize,
        alloc: &dyn PageAllocator,
    ) -> Vec<PageId> {
        self.lookup_class(tokens, page_size, PageClass::Fast, 0, alloc)
    }

    /// [`Self::lookup`] for a request of `class` in `namespace`: the longest run it may read
    /// (see [`PageClass`], [`root_hash_of`]).
    pub fn lookup_class(
        &mut self,
        tokens: &[u32],
        page_size: usize,
        class: PageClass,
        namespace: u64,
        alloc: &dyn PageAllocator,
    ) -> Vec<PageId> {
        let scope = (class, namespace);
        self.lookup_ending(tokens, page_size, scope, alloc, &|_| true)
            .pages
    }

    /// [`Self::lookup_class`] for a request of `class` in `namespace`, the run cut after its
    /// deepest page whose entry `ends` accepts (by entry id): a model with recurrent layers can
    /// start only where the state after the prefix was kept.
    pub fn lookup_ending(
        &mut self,
        tokens: &[u32],
        page_size: usize,
        (class, namespace): (PageClass, u64),
        alloc: &dyn PageAllocator,
        ends: &dyn Fn(u64) -> bool,
    ) -> EndingHit {
        if !self.enabled || page_size == 0 {
            return EndingHit::default();
        }
        self.tick += 1;
        self.lookups += 1;
        self.query_tokens += tokens.len() as u64;
        let (run, cached) = self.cached_run(tokens, page_size, class, namespace, ends);
        let mut pages = Vec::with_capacity(run.len());
        let mut last = None;
        for link in run {
            let Some(e) = self.entries.get_mut(&link.key) else {
                break;
            };
            if alloc.try_share(e.page).is_err() {
                // The cache's own reference is missing: some holder released one reference
                // too many. Treat as a miss rather than hand out a page that may be reused.
                debug_assert!(false, "cached page {} is not allocated", e.page);
                break;
            }
            if e.in_lru {
                self.lru.remove(&e.lru_key());
                e.in_lru = false;
            }
            e.last_used = self.tick;
            pages.push(e.page);
            last = Some(e.id);
        }
        self.hit_tokens += (pages.len() * page_size) as u64;
        EndingHit {
            pages,
            end: last,
            cached,
        }
    }

    /// The longest run of cached pages `tokens` starts with that a request of `class` may
    /// read, in order, cut after its deepest entry `ends` accepts: an `Invariant` chain, or for
    /// `Fast` requests the longest of `Invariant` pages followed by `Fast` ones (none of either
    /// included); and how many pages the longest run held before its cut.
    fn cached_run(
        &self,
        tokens: &[u32],
        page_size: usize,
        class: PageClass,
        namespace: u64,
        ends: &dyn Fn(u64) -> bool,
    ) -> (Vec<Link>, usize) {
        let cut = |mut run: Vec<Link>| {
            let usable = run.iter().rposition(|l| ends(l.id)).map_or(0, |i| i + 1);
            run.truncate(usable);
            run
        };
        let invariant = self.chain(tokens, page_size, None, PageClass::Invariant, namespace);
        let mut cached = invariant.len();
        if class == PageClass::Invariant {
            return (cut(invariant), cached);
        }
        // The longest of: the first `split` invariant pages, then fast ones.
        let mut best = cut(invariant.clone());
        for split in 0..=invariant.len() {
            let rest = &tokens[split * page_size..];
            let tail = self.chain(
                rest,
                page_size,
                split.checked_sub(1).map(|j| invariant[j]),
                PageClass::Fast,
                namespace,
            );
            cached = cached.max(split + tail.len());
            if split + tail.len() <= best.len() {
                continue;
            }
            let run = cut(invariant[..split].iter().copied().chain(tail).collect());
            if run.len() > best.len() {
                best = run;
            }
        }
        (best, cached)
    }

    /// The cached pages of `class` that continue `parent` with `tokens`' full pages, in order.
    fn chain(
        &self,
        tokens: &[u32],
        page_size: usize,
        mut parent: Option<Link>,
        class: PageClass,
        namespace: u64,
    ) -> Vec<Link> {
        let mut run = Vec::new();
        for chunk in tokens.chunks_exact(page_size) {
            match self.child(parent, chunk, page_size, class, namespace) {
                Some(link) => {
                    run.push(link);
                    parent = Some(link);
                }
                None => break,
            }
        }
        run
    }

    /// The cached page of `class` in `namespace` holding `chunk` after `parent`, if any: the
    /// hash is checked against the entry's parent, tokens, class and namespace, so a collision
    /// or an orphan is a miss.
    fn child(
        &self,
        parent: Option<Link>,
        chunk: &[u32],
        page_size: usize,
        class: PageClass,
        namespace: u64,
    ) -> Option<Link> {
        let key = chain_hash(chain_base(page_size, parent, class, namespace), chunk);
        let e = self.entries.get(&key)?;
        let parent_id = parent.map_or(0, |p| p.id);
        (e.parent_id == parent_id
            && e.class == class
            && e.namespace == namespace
            && *e.tokens == *chunk)
            .then(|| e.link(key))
    }

    /// Registers the full pages of a sequence whose KV for `tokens` lives in `pages` (its block
    /// table, in logical order; partial last page and pages past `tokens` are ignored). Pages
    /// whose prefix is already cached are skipped (the cached copy stays canonical); new ones gain
    /// a reference held by the cache. Returns how many pages were newly cached.
    ///
    /// Only pass tokens whose KV is final (after verification): a cached page is read-only, and
    /// the caller's next write into it must go through copy-on-write
    /// ([`super::BlockTable::prepare_append`]), which the cache's reference triggers.
    pub fn insert(
        &mut self,
        tokens: &[u32],
        pages: &[PageId],
        page_size: usize,
        alloc: &dyn PageAllocator,
    ) -> usize {
        self.insert_class(tokens, pages, page_size, PageClass::Fast, 0, alloc)
    }

    /// [`Self::insert`] as pages of `class`. A `Fast` sequence's pages continue the
    /// `Invariant` pages it read, so a plain conversation that began on a deterministic prefix
    /// caches its own turns after it. `namespace`: see [`root_hash_of`].
    pub fn insert_class(
        &mut self,
        tokens: &[u32],
        pages: &[PageId],
        page_size: usize,
        class: PageClass,
        namespace: u64,
        alloc: &dyn PageAllocator,
    ) -> usize {
        self.insert_chain(tokens, pages, page_size, (class, namespace), alloc)
            .0
    }

    /// [`Self::insert_class`], returning the id of the entry that holds `tokens`' last full
    /// page, where every full page is cached now and that entry is of `scope`'s class (a
    /// recurrent model's state after `tokens` is kept under it: a state computed on the fast
    /// path never under an `Invariant` page a `Fast` sequence passed through).
    pub fn insert_ending(
        &mut self,
        tokens: &[u32],
        pages: &[PageId],
        page_size: usize,
        scope: (PageClass, u64),
        alloc: &dyn PageAllocator,
    ) -> Option<u64> {
        let (_, end, depth) = self.insert_chain(tokens, pages, page_size, scope, alloc);
        let full = tokens.len() / page_size.max(1);
        end.filter(|l| full > 0 && depth == full && l.class == scope.0)
            .map(|l| l.id)
    }

    /// Inserts as [`Self::insert_class`] does; returns how many pages were newly cached, the
    /// last link of the chain it walked and how many pages deep it went.
    fn insert_chain(
        &mut self,
        tokens: &[u32],
        pages: &[PageId],
        page_size: usize,
        (class, namespace): (PageClass, u64),
        alloc: &dyn PageAllocator,
    ) -> (usize, Option<Link>, usize) {
        if !self.enabled || page_size == 0 {
            return (0, None, 0);
        }
        self.tick += 1;
        let tick = self.tick;
        let mut added = 0;
        let mut depth_reached = 0;
        let mut parent: Option<Link> = None;
        for (depth, (chunk, &page)) in tokens.chunks_exact(page_size).zip(pages).enumerate() {
            if let Some(link) = self.cached_child(parent, chunk, page, page_size, class, namespace)
            {
                // Already cached (this page or an identical one): refresh and go deeper.
                self.touch(link.key, tick);
                parent = Some(link);
                depth_reached = depth + 1;
                continue;
            }
            let key = chain_hash(chain_base(page_size, parent, class, namespace), chunk);
            if let Some(e) = self.entries.get(&key) {
                // The key is taken by another chain. An orphan (its parent was evicted) can never
                // be hit again: drop it and reuse the key. Otherwise it is a genuine 64-bit
                // collision: stop caching this sequence here.
                let orphan = e.depth > 0
                    && self.entries.get(&e.parent_key).map(|p| p.id) != Some(e.parent_id);
                if !orphan {
                    break;
                }
                self.remove_entry(key, alloc);
            }
            if self.by_page.get(page as usize) != Some(&None) {
                // Out of range, or this page is already cached under another key (its contents
                // changed under the cache, which copy-on-write should have prevented): skip.
                break;
            }
            if alloc.try_share(page).is_err() {
                break; // The caller does not hold this page.
            }
            let id = self.next_id;
            self.next_id += 1;
            self.entries.insert(
                key,
                Entry {
                    id,
                    parent_id: parent.map_or(0, |p| p.id),
                    parent_key: parent.map_or(0, |p| p.key),
                    page,
                    class,
                    namespace,
                    tokens: chunk.into(),
                    depth: depth as u32,
                    last_used: tick,
                    in_lru: false,
                },
            );
            self.by_page[page as usize] = Some(key);
            // Pairs with the fence in `KvManager::try_release`: either that release sees the flag
            // and reports the page, or we see its decrement here.
            self.cached[page as usize].store(true, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            self.on_sole_holder(page, alloc);
            added += 1;
            parent = Some(Link { key, id, class });
            depth_reached = depth + 1;
        }
        (added, parent, depth_reached)
    }

    /// The cached page that already holds `chunk` after `parent` for a sequence writing pages of
    /// `class`: `page` itself where it is cached there (the sequence read it from the cache),
    /// else an identical one, `Invariant` first (exact KV, readable by every request). A `Fast`
    /// sequence may pass through `Invariant` pages (those it read); an `Invariant` one only
    /// through its own class.
    fn cached_child(
        &self,
        parent: Option<Link>,
        chunk: &[u32],
        page: PageId,
        page_size: usize,
        class: PageClass,
        namespace: u64,
    ) -> Option<Link> {
        let after_invariant = parent.is_none_or(|p| p.class == PageClass::Invariant);
        let classes: &[PageClass] = match class {
            PageClass::Invariant => &[PageClass::Invariant],
            PageClass::Fast if after_invariant => &[PageClass::Invariant, PageClass::Fast],
            PageClass::Fast => &[PageClass::Fast],
        };
        let mut first = None;
        for link in classes
            .iter()
            .filter_map(|&c| self.child(parent, chunk, page_size, c, namespace))
        {
            if self.entries.get(&link.key).is_some_and(|e| e.page == page) {
                return Some(link);
            }
            first.get_or_insert(link);
        }
        first
    }

    /// Marks the entry at `key` used at `tick` (its place in the LRU moves with it).
    fn touch(&mut self, key: u64, tick: u64) {
        if let Some(e) = self.entries.get_mut(&key) {
            if e.in_lru {
                self.lru.remove(&e.lru_key());
                e.last_used = tick;
                self.lru.insert(e.lru_key());
            } else {
                e.last_used = tick;
            }
        }
    }

    /// Notification that `page`'s reference count may have dropped to 1; if it is cached and only
    /// the cache holds it, it becomes evictable. Idempotent, and harmless for uncached pages.
    pub fn on_sole_holder(&mut self, page: PageId, alloc: &dyn PageAllocator) {
        let Some(Some(key)) = self.by_page.get(page as usize) else {
            return;
        };
        let Some(e) = self.entries.get_mut(key) else {
            return;
        };
        if !e.in_lru && alloc.ref_count(page) == 1 {
            e.in_lru = true;
            self.lru.insert(e.lru_key());
        }
    }

    /// Frees up to `n` evictable pages, least recently used first. Returns how many were freed.
    pub fn evict(&mut self, n: usize, alloc: &dyn PageAllocator) -> usize {
        let mut freed = 0;
        while freed < n {
            let Some(lru_key) = self.lru.pop_first() else {
                break;
            };
            let page = lru_key.2;
            let Some(Some(key)) = self.by_page.get(page as usize).copied() else {
                continue;
            };
            if let Some(e) = self.entries.get_mut(&key) {
                e.in_lru = false;
            }
            // Only the cache can hand out new references to a page that only it holds, and we
            // hold `&mut self`, so this check cannot be invalidated before the release below.
            if alloc.ref_count(page) != 1 {
                continue;
            }
            if self.remove_entry(key, alloc) {
                freed += 1;
            }
        }
        freed
    }

    /// Drops every entry and the cache's references. Pages still used by sequences stay allocated
    /// (just no longer cached). Returns how many pages this freed.
    pub fn clear(&mut self, alloc: &dyn PageAllocator) -> usize {
        let keys: Vec<u64> = self.entries.keys().copied().collect();
        keys.into_iter()
            .filter(|&k| self.remove_entry(k, alloc))
            .count()
    }

    /// Removes an entry and drops the cache's reference; `true` when that freed the page.
    fn remove_entry(&mut self, key: u64, alloc: &dyn PageAllocator) -> bool {
        let Some(e) = self.entries.remove(&key) else {
            return false;
        };
        if e.in_lru {
            self.lru.remove(&e.lru_key());
        }
        let p = e.page as usize;
        if let Some(slot) = self.by_page.get_mut(p) {
            *slot = None;
        }
        if let Some(f) = self.cached.get(p) {
            f.store(false, Ordering::Relaxed);
        }
        alloc.release(e.page)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::kv::AtomicAllocator;

    #[test]
    fn hash_is_fixed() {
        // Golden values: these must never change between runs, processes or platforms.
        assert_eq!(root_hash(16), root_hash(16));
        assert_ne!(root_hash(16), root_hash(8));
        let a = chain_hash(root_hash(4), &[1, 2, 3, 4]);
        assert_eq!(a, chain_hash(root_hash(4), &[1, 2, 3, 4]));
        assert_ne!(a, chain_hash(root_hash(4), &[1, 2, 4, 3]));
        let mut h = FnvHasher::default();
        h.write(b"a");
        assert_eq!(h.finish(), 0xaf63_dc4c_8601_ec8c); // FNV-1a 64 test vector
    }

    #[test]
    fn insert_lookup_evict() {
        let a = AtomicAllocator::new(8);
        let mut c = PrefixCache::new(8);
        let toks: Vec<u32> = (0..10).collect();
        let pages: Vec<PageId> = (0..3).map(|_| a.allocate().unwrap()).collect();
        // 10 tokens, page size 4: two full pages.
        assert_eq!(c.insert(&toks, &pages, 4, &a), 2);
        assert_eq!((a.ref_count(0), a.ref_count(1), a.ref_count(2)), (2, 2, 1));
        assert_eq!(c.stats().evictable_pages, 0);
        // The sequence ends.
        for &p in &pages {
            a.release(p);
            c.on_sole_holder(p, &a);
        }
        assert_eq!(c.evictable_pages(), vec![1, 0]); // tail first
                                                     // A prompt sharing 6 tokens hits one page.
        let hit = c.lookup(&[0, 1, 2, 3, 4, 5, 9, 9], 4, &a);
        assert_eq!(hit, vec![0]);
        assert_eq!(a.ref_count(0), 2);
        assert_eq!(c.evictable_pages(), vec![1]);
        let s = c.stats();
        assert_eq!((s.query_tokens, s.hit_tokens, s.cached_pages), (8, 4, 2));
        assert_eq!(c.evict(5, &a), 1);
        assert_eq!(c.cached_pages(), vec![0]);
        a.release(0);
        c.on_sole_holder(0, &a);
        assert_eq!(c.evict(5, &a), 1);
        assert_eq!(a.num_free(), 8);
    }

    #[test]
    fn different_prefix_same_page_tokens_is_a_miss() {
        let a = AtomicAllocator::new(8);
        let mut c = PrefixCache::new(8);
        let p: Vec<PageId> = (0..2).map(|_| a.allocate().unwrap()).collect();
        c.insert(&[1, 1, 2, 2], &p, 2, &a);
        // Second page's tokens match but the first page's do not.
        assert!(c.lookup(&[9, 9, 2, 2], 2, &a).is_empty());
        assert_eq!(c.lookup(&[1, 1, 2, 2], 2, &a), p);
    }

    #[test]
    fn invariant_pages_serve_every_request_fast_pages_only_fast_ones() {
        let a = AtomicAllocator::new(8);
        let mut c = PrefixCache::new(8);
        let fast: Vec<PageId> = (0..2).map(|_| a.allocate().unwrap()).collect();
        let inv: Vec<PageId> = (0..3).map(|_| a.allocate().unwrap()).collect();
        c.insert_class(&[1, 1, 2, 2], &fast, 2, PageClass::Fast, 0, &a);
        c.insert_class(&[1, 1, 2, 2, 3, 3], &inv, 2, PageClass::Invariant, 0, &a);
        // A deterministic lookup reads the invariant chain.
        assert_eq!(
            c.lookup_class(&[1, 1, 2, 2, 3, 3], 2, PageClass::Invariant, 0, &a),
            inv
        );
        // A fast lookup takes the longer run: here the invariant one.
        assert_eq!(
            c.lookup_class(&[1, 1, 2, 2, 3, 3], 2, PageClass::Fast, 0, &a),
            inv
        );
        // Each lookup took a reference on the pages it handed out (two lookups); the fast
        // chain's pages have the allocation's and the cache's only.
        assert_eq!(a.ref_count(fast[0]), 2);
        assert_eq!(a.ref_count(inv[2]), 4);
        let inv_only: Vec<PageId> = (0..1).map(|_| a.allocate().unwrap()).collect();
        c.insert_class(&[7, 7], &inv_only, 2, PageClass::Invariant, 0, &a);
        assert_eq!(
            c.lookup_class(&[7, 7, 8], 2, PageClass::Fast, 0, &a),
            inv_only
        );
        let fast_only: Vec<PageId> = (0..1).map(|_| a.allocate().unwrap()).collect();
        c.insert_class(&[9, 9], &fast_only, 2, PageClass::Fast, 0, &a);
        assert!(c
            .lookup_class(&[9, 9, 8], 2, PageClass::Invariant, 0, &a)
            .is_empty());
        assert_eq!(
            c.lookup_class(&[9, 9, 8], 2, PageClass::Fast, 0, &a),
            fast_only
        );
        let s = c.stats();
        assert_eq!(s.hit_tokens, 6 + 6 + 2 + 2);
    }

    #[test]
    fn namespaces_never_share_pages() {
        let a = AtomicAllocator::new(8);
        let mut c = PrefixCache::new(8);
        let base: Vec<PageId> = (0..2).map(|_| a.allocate().unwrap()).collect();
        c.insert_class(&[1, 1, 2, 2], &base, 2, PageClass::Invariant, 0, &a);
        // An adapter's request finds nothing of the base model's, and the reverse.
        for class in [PageClass::Invariant, PageClass::Fast] {
            assert!(c.lookup_class(&[1, 1, 2, 2, 3], 2, class, 7, &a).is_empty());
        }
        let lora: Vec<PageId> = (0..2).map(|_| a.allocate().unwrap()).collect();
        assert_eq!(
            c.insert_class(&[1, 1, 2, 2], &lora, 2, PageClass::Fast, 7, &a),
            2
        );
        assert_eq!(
            c.lookup_class(&[1, 1, 2, 2, 3], 2, PageClass::Fast, 7, &a),
            lora
        );
        assert_eq!(
            c.lookup_class(&[1, 1, 2, 2, 3], 2, PageClass::Fast, 0, &a),
            base
        );
        assert!(c
            .lookup_class(&[1, 1, 2, 2, 3], 2, PageClass::Fast, 8, &a)
            .is_empty());
    }

    /// A lookup cut where `ends` allows: after the deepest page whose entry it accepts,
    /// whatever lies past it; `insert_ending` names the entry of a prefix's last full page.
    #[test]
    fn lookups_end_where_allowed_and_inserts_name_their_last_entry() {
        let a = AtomicAllocator::new(8);
        let mut c = PrefixCache::new(8);
        let toks: Vec<u32> = (0..8).collect();
        let pages: Vec<PageId> = (0..4).map(|_| a.allocate().unwrap()).collect();
        let scope = (PageClass::Fast, 0);
        let second = c.insert_ending(&toks[..4], &pages, 2, scope, &a).unwrap();
        let fourth = c.insert_ending(&toks, &pages, 2, scope, &a).unwrap();
        assert_ne!(second, fourth);
        assert_eq!(c.insert_ending(&toks[..1], &pages, 2, scope, &a), None);
        // A `Fast` sequence's state is never kept under an `Invariant` page it passed through.
        let inv: Vec<PageId> = (0..2).map(|_| a.allocate().unwrap()).collect();
        let (other, invariant) = ([9, 9, 8, 8], (PageClass::Invariant, 0));
        assert!(c.insert_ending(&other, &inv, 2, invariant, &a).is_some());
        assert_eq!(c.insert_ending(&other, &inv, 2, scope, &a), None);
        let hit = c.lookup_ending(&toks, 2, scope, &a, &|id| id == second);
        assert_eq!(
            (hit.pages.as_slice(), hit.end, hit.cached),
            (&pages[..2], Some(second), 4)
        );
        let hit = c.lookup_ending(&toks[..7], 2, scope, &a, &|_| false);
        assert_eq!((hit.pages, hit.end, hit.cached), (vec![], None, 3));
        let hit = c.lookup_ending(&toks, 2, scope, &a, &|_| true);
        assert_eq!((hit.pages, hit.end), (pages.clone(), Some(fourth)));
        assert_eq!(
            c.stats().hit_tokens,
            12,
            "hits count the pages handed out, after the cut"
        );
    }

    #[test]
    fn disabled_cache_does_nothing() {
        let a = AtomicAllocator::new(4);
        let mut c = PrefixCache::new(4);
        c.set_enabled(false);
        let p = a.allocate().unwrap();
        assert_eq!(c.insert(&[1, 2], &[p], 2, &a), 0);
        assert!(c.lookup(&[1, 2], 2, &a).is_empty());
        assert_eq!(c.stats(), PrefixStats::default());
    }
}
