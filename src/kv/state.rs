//! Per-sequence recurrent state: what a recurrent layer (Qwen3-Next's and Qwen3.5's gated
//! DeltaNet, Granite 4.0-H's Mamba2) keeps in place of keys and values.
//!
//! Such a state is a function of the whole prefix, so it cannot live in pages the way keys,
//! values and LFM2's convolution rows do (a snapshot per page would cost far more than the
//! attention KV it sits beside). A sequence holds one *live* state, which every forward of its
//! rows advances, and, when its tokens are speculative (replay), a *committed* one: the state
//! after exactly the tokens whose KV the verifier wrote. A verify pass replays its window from
//! the committed state into the live one; [`SequenceStates::commit`] then copies live over
//! committed, so the next window starts where the accepted tokens end. Rollback needs nothing
//! more: after a pass the live state is the committed one.
//!
//! A sequence's first row at position 0 starts from zeros (a fresh prefill, or the recompute of
//! a preempted sequence), and every other first row must continue the state exactly where it
//! stands: each layer's state records how many tokens it has seen, and a row at any other
//! position is an error, never a silent mix of prefixes.
//!
//! # Snapshots for the prefix cache
//!
//! Cached KV pages are of no use to such a model without the state after them, so a prompt's
//! prefill also leaves a *snapshot*: a copy of its state after the prompt's last full page
//! (where a lookup of the same prompt lands), taken by the op mid-forward
//! ([`StateRef::snapshots`]) and kept under the id of the prefix-cache entry holding that
//! page; a prompt that shares more cached pages with earlier ones than it can read leaves one
//! where the shared run ends (a system prompt, an eval's few-shot examples: the prompts after
//! it read that far); an answer whose tokens are final as decoded leaves one after each page
//! it completes (where a conversation's next turn starts reading).
//! A later sequence reads cached pages only up to the deepest page with a snapshot, and starts
//! from a copy of it ([`SequenceStates::seed`]). Prefill and decode give the same bits however
//! a sequence's rows are split, so the seeded state is the one a fresh prefill would reach.
//! Snapshots use the capacity the running sequences leave free and are evicted, least
//! recently used first, when a sequence needs the room: like cached pages, they are what the
//! pool holds while nothing else wants it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{DetspecError, Result};

/// One sequence's state in every layer: per layer `seen` tokens and `values`.
#[derive(Debug)]
pub struct StateData {
    /// Tokens each layer's state has taken in.
    pub seen: Vec<usize>,
    /// Every layer's state, one after another ([`StatePool::layer_range`]).
    pub values: Vec<f32>,
}

type Slot = Arc<Mutex<StateData>>;

/// A kept state a sequence starts from instead of zeros (a prefix-cache hit): a copy is taken
/// when the sequence takes its states.
#[derive(Debug, Clone)]
pub struct StateSeed(Slot);

/// Snapshots kept under the prefix-cache entry after whose page they were taken.
#[derive(Debug, Default)]
struct Snapshots {
    by_entry: HashMap<u64, (StateSlot, u64)>,
    tick: u64,
}

/// The pool's slots, and how many of them running sequences hold (bounded by the capacity).
#[derive(Debug, Default)]
struct Slots {
    entries: Vec<Option<Slot>>,
    bounded: usize,
}

/// The states of every running sequence, allocated as sequences are admitted and freed when
/// they are preempted or end. Host memory: the layers that keep state run on the CPU.
///
/// A running sequence's states come out of a capacity (a share of the KV budget, set by the
/// engine) so admission, not the allocator, is what runs out: a sequence that finds no room
/// waits as one that finds no KV pages does. A standalone forward's states (scoring, audits)
/// live for that call only and are not counted.
#[derive(Debug)]
pub struct StatePool {
    /// Where each layer's state begins in a slot's values, and its length (0: none).
    layers: Vec<(usize, usize)>,
    len: usize,
    capacity: AtomicUsize,
    slots: Mutex<Slots>,
    /// Never locked while `slots` is (a slot's drop locks `slots`).
    snapshots: Mutex<Snapshots>,
}

/// Which states a forward's rows of one sequence read and write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateRef {
    /// The state its first row continues (unless that row is at position 0).
    pub read: u32,
    /// Where the state is left.
    pub write: u32,
    /// How many of its rows the state left in `write` takes in (all of them: `u32::MAX`);
    /// later rows still compute their outputs. A verify pass that rolled back runs again with
    /// the accepted rows only here.
    pub advance: u32,
    /// Where copies of the state are also left, and after how many tokens: the prefix cache
    /// keeps the state after a prompt's last full page, where its shared run ends, and after
    /// an answer's pages.
    pub snapshots: [Option<SnapshotAt>; 2],
}

/// A copy of the state after the tokens before `position`, left in slot `slot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotAt {
    pub position: u32,
    pub slot: u32,
}

impl SnapshotAt {
    /// The state after `position` tokens, into `slot`.
    pub fn of(position: usize, slot: &StateSlot) -> Self {
        Self {
            position: u32::try_from(position).unwrap_or(u32::MAX),
            slot: slot.id,
        }
    }
}

impl StateRef {
    /// These rows also leave a copy of the state after each `(position, slot)` (the first two).
    pub fn leaving<'a>(self, snapshots: impl IntoIterator<Item = (usize, &'a StateSlot)>) -> Self {
        let mut at = [None; 2];
        for (at, (position, slot)) in at.iter_mut().zip(snapshots) {
            *at = Some(SnapshotAt::of(position, slot));
        }
        Self {
            snapshots: at,
            ..self
        }
    }
}

impl StatePool {
    /// A pool for states of `per_layer[i]` values in layer `i`, without a capacity.
    pub fn new(per_layer: &[usize]) -> Arc<Self> {
        let mut at = 0;
        let layers = per_layer
            .iter()
            .map(|&n| {
                let range = (at, n);
                at += n;
                range
            })
            .collect();
        Arc::new(Self {
            layers,
            len: at,
            capacity: AtomicUsize::new(usize::MAX),
            slots: Mutex::new(Slots::default()),
            snapshots: Mutex::new(Snapshots::default()),
        })
    }

    /// How many states running sequences may hold within a KV budget of `budget` bytes, for
    /// states of `bytes_per_state`: two per sequence of `max_num_seqs` (a replayed sequence
    /// holds two), within half the budget (the pages get the rest), and at least two (one
    /// replayed sequence), else an error naming `kv_cache_bytes`. 0 where no layer keeps one.
    pub fn capacity_within(
        bytes_per_state: usize,
        budget: usize,
        max_num_seqs: usize,
    ) -> Result<usize> {
        if bytes_per_state == 0 {
            return Ok(0);
        }
        let slots = (budget / 2 / bytes_per_state).min(max_num_seqs.saturating_mul(2));
        if slots < 2 {
            return Err(DetspecError::param(
                "kv_cache_bytes",
                format!(
                    "{budget} bytes: the model's recurrent layers keep {bytes_per_state} \
                     bytes of state per sequence, and a running sequence may need two, within \
                     half the KV budget: it needs at least {}",
                    4 * bytes_per_state
                ),
            ));
        }
        Ok(slots)
    }

    /// Whether any layer keeps a state.
    pub fn is_used(&self) -> bool {
        self.len > 0
    }

    /// Bytes one sequence's state takes.
    pub fn bytes_per_state(&self) -> usize {
        self.len * std::mem::size_of::<f32>()
    }

    /// At most `slots` states held by running sequences at once.
    pub fn set_capacity(&self, slots: usize) {
        self.capacity.store(slots, Ordering::Relaxed);
    }

    /// States running sequences may hold at once.
    pub fn capacity(&self) -> usize {
        self.capacity.load(Ordering::Relaxed)
    }

    /// `(start, len)` of layer `i`'s state in a slot's values.
    pub fn layer_range(&self, layer: usize) -> Option<(usize, usize)> {
        self.layers.get(layer).copied().filter(|&(_, n)| n > 0)
    }

    fn slots(&self) -> MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn snapshots(&self) -> MutexGuard<'_, Snapshots> {
        self.snapshots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Evicts snapshots, least recently used first, until `n` more bounded slots fit the
    /// capacity or none is left.
    fn make_room(&self, n: usize) {
        while self.slots().bounded + n > self.capacity() {
            let victim = {
                let mut snaps = self.snapshots();
                let oldest = snaps
                    .by_entry
                    .iter()
                    .min_by_key(|(_, (_, used))| *used)
                    .map(|(&entry, _)| entry);
                oldest.and_then(|entry| snaps.by_entry.remove(&entry))
            };
            // Dropped here, with neither lock held: a slot's drop takes `slots`.
            if victim.is_none() {
                return;
            }
        }
    }

    /// `n` new zeroed states, counted against the capacity where `bounded` (evicting
    /// snapshots for them), or `None` where that leaves no room for them. Each is freed when
    /// its handle drops.
    fn take(self: &Arc<Self>, n: usize, bounded: bool) -> Option<Vec<StateSlot>> {
        if bounded {
            self.make_room(n);
        }
        let mut slots = self.slots();
        if bounded {
            if slots.bounded + n > self.capacity() {
                return None;
            }
            slots.bounded += n;
        }
        let taken = (0..n)
            .map(|_| {
                let data = Arc::new(Mutex::new(StateData {
                    seen: vec![0; self.layers.len()],
                    values: vec![0.0; self.len],
                }));
                let id = match slots.entries.iter().position(Option::is_none) {
                    Some(i) => {
                        slots.entries[i] = Some(data);
                        i
                    }
                    None => {
                        slots.entries.push(Some(data));
                        slots.entries.len() - 1
                    }
                };
                StateSlot {
                    pool: self.clone(),
                    id: id as u32,
                    bounded,
                }
            })
            .collect();
        Some(taken)
    }

    /// The state in slot `id`.
    pub fn get(&self, id: u32) -> Result<Slot> {
        self.slots()
            .entries
            .get(id as usize)
            .cloned()
            .flatten()
            .ok_or_else(|| DetspecError::InvalidRequest {
                request_id: None,
                message: format!("recurrent state {id} is not held by any sequence"),
            })
    }

    /// Copies state `src` over `dst`.
    fn copy(&self, src: u32, dst: u32) -> Result<()> {
        if src == dst {
            return Ok(());
        }
        let (src, dst) = (self.get(src)?, self.get(dst)?);
        let src = src.lock().unwrap_or_else(|e| e.into_inner());
        let mut dst = dst.lock().unwrap_or_else(|e| e.into_inner());
        dst.seen.clone_from(&src.seen);
        dst.values.copy_from_slice(&src.values);
        Ok(())
    }

    /// Slots held now (running sequences', standalone forwards' and snapshots).
    pub fn num_held(&self) -> usize {
        self.slots().entries.iter().flatten().count()
    }

    /// A slot for a snapshot a forward is about to take (counted against the capacity,
    /// evicting older snapshots), or `None` where running sequences hold it all.
    pub fn snapshot_slot(self: &Arc<Self>) -> Option<StateSlot> {
        self.take(1, true)?.pop()
    }

    /// Keeps the snapshot in `slot` under prefix-cache entry `entry`.
    pub fn keep_snapshot(&self, entry: u64, slot: StateSlot) {
        let replaced = {
            let mut snaps = self.snapshots();
            snaps.tick += 1;
            let tick = snaps.tick;
            snaps.by_entry.insert(entry, (slot, tick))
        };
        drop(replaced);
    }

    /// Whether a snapshot is kept under `entry`.
    pub fn has_snapshot(&self, entry: u64) -> bool {
        self.snapshots().by_entry.contains_key(&entry)
    }

    /// The snapshot kept under `entry`, marked used.
    pub fn snapshot(&self, entry: u64) -> Option<StateSeed> {
        let id = {
            let mut snaps = self.snapshots();
            snaps.tick += 1;
            let tick = snaps.tick;
            let (slot, used) = snaps.by_entry.get_mut(&entry)?;
            *used = tick;
            slot.id
        };
        self.get(id).ok().map(StateSeed)
    }

    /// Snapshots kept now.
    pub fn num_snapshots(&self) -> usize {
        self.snapshots().by_entry.len()
    }

    /// Drops every snapshot (the prefix cache was cleared: new weights).
    pub fn clear_snapshots(&self) {
        let all = std::mem::take(&mut self.snapshots().by_entry);
        drop(all);
    }
}

/// A state held by a sequence; its slot is freed on drop.
#[derive(Debug)]
pub struct StateSlot {
    pool: Arc<StatePool>,
    id: u32,
    /// Counted against the pool's capacity.
    bounded: bool,
}

impl StateSlot {
    /// The slot's id ([`StateRef`]).
    pub fn id(&self) -> u32 {
        self.id
    }
}

impl Drop for StateSlot {
    fn drop(&mut self) {
        let mut slots = self.pool.slots();
        if let Some(slot) = slots.entries.get_mut(self.id as usize) {
            *slot = None;
        }
        if self.bounded {
            slots.bounded -= 1;
        }
    }
}

/// A sequence's states: the live one, and the committed one where its tokens are speculative.
/// A waiting sequence holds none; it takes them when admitted and gives them back when
/// preempted (its recompute starts from position 0, from zeros).
#[derive(Debug)]
pub struct SequenceStates {
    pool: Arc<StatePool>,
    speculative: bool,
    /// `[live]`, or `[live, committed]` where speculative; empty while not held.
    held: Vec<StateSlot>,
    /// What its states start from when taken, instead of zeros (a prefix-cache hit).
    seed: Option<StateSeed>,
}

impl SequenceStates {
    /// `speculative`: the sequence's tokens wait for a verifier (replay), which needs the
    /// state at its last committed token. Holds nothing until [`SequenceStates::acquire`].
    pub fn new(pool: &Arc<StatePool>, speculative: bool) -> Self {
        Self {
            pool: pool.clone(),
            speculative,
            held: Vec::new(),
            seed: None,
        }
    }

    /// A standalone forward's state, held at once and not counted against the capacity,
    /// starting from `seed` where it reads a cached prefix.
    pub fn transient(pool: &Arc<StatePool>, seed: Option<StateSeed>) -> Self {
        let held = pool.take(1, false).unwrap_or_default();
        let states = Self {
            pool: pool.clone(),
            speculative: false,
            held,
            seed: None,
        };
        if let Some(seed) = seed {
            states.start_from(&seed);
        }
        states
    }

    /// Copies `seed` into every state it holds.
    fn start_from(&self, StateSeed(seed): &StateSeed) {
        let seed = seed.lock().unwrap_or_else(|e| e.into_inner());
        for slot in &self.held {
            if let Ok(dst) = self.pool.get(slot.id) {
                let mut dst = dst.lock().unwrap_or_else(|e| e.into_inner());
                dst.seen.clone_from(&seed.seen);
                dst.values.copy_from_slice(&seed.values);
            }
        }
    }

    /// Its states, when taken, start from `seed` (the state after the cached prefix it
    /// starts from) instead of zeros.
    pub fn seed(&mut self, seed: StateSeed) {
        self.seed = Some(seed);
    }

    /// Takes its states if it does not hold them, starting from its seed where it has one;
    /// false where the pool has no room for them now (the sequence waits).
    pub fn acquire(&mut self) -> bool {
        if !self.held.is_empty() {
            return true;
        }
        let Some(slots) = self.pool.take(1 + usize::from(self.speculative), true) else {
            return false;
        };
        self.held = slots;
        if let Some(seed) = self.seed.take() {
            self.start_from(&seed);
        }
        true
    }

    /// Gives its states back (preemption), and any seed: its recompute starts where its
    /// next admission's cache lookup says.
    pub fn release(&mut self) {
        self.held.clear();
        self.seed = None;
    }

    fn live(&self) -> Result<&StateSlot> {
        self.held
            .first()
            .ok_or_else(|| DetspecError::InvalidRequest {
                request_id: None,
                message: "a sequence runs without its recurrent state (never admitted)".into(),
            })
    }

    /// The fast path's (and a prefill's): the live state, advanced by every row.
    pub fn forward(&self) -> Result<StateRef> {
        let live = self.live()?.id;
        Ok(StateRef {
            read: live,
            write: live,
            advance: u32::MAX,
            snapshots: [None; 2],
        })
    }

    /// A verify pass's: from the committed state into the live one, advanced by `advance`
    /// rows.
    pub fn replay(&self, advance: usize) -> Result<StateRef> {
        let live = self.live()?.id;
        Ok(StateRef {
            read: self.held.get(1).map_or(live, |c| c.id),
            write: live,
            advance: u32::try_from(advance).unwrap_or(u32::MAX),
            snapshots: [None; 2],
        })
    }

    /// The live state becomes the committed one (after a verify pass, and after the isolated
    /// prefill whose first token is committed at once).
    pub fn commit(&self) -> Result<()> {
        match self.held.get(1) {
            Some(c) => self.pool.copy(self.live()?.id, c.id),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admitted(pool: &Arc<StatePool>, speculative: bool) -> SequenceStates {
        let mut s = SequenceStates::new(pool, speculative);
        assert!(s.acquire());
        s
    }

    #[test]
    fn slots_are_taken_on_admission_freed_on_drop_and_reused() {
        let pool = StatePool::new(&[0, 3, 2]);
        assert_eq!(pool.layer_range(0), None);
        assert_eq!(pool.layer_range(1), Some((0, 3)));
        assert_eq!(pool.layer_range(2), Some((3, 2)));
        let waiting = SequenceStates::new(&pool, true);
        assert_eq!(pool.num_held(), 0);
        assert!(
            waiting.forward().is_err(),
            "a waiting sequence holds no state"
        );
        let a = admitted(&pool, true);
        let b = admitted(&pool, false);
        assert_eq!(pool.num_held(), 3);
        let first = a.forward().unwrap().read;
        drop(a);
        assert_eq!(pool.num_held(), 1);
        assert!(pool.get(first).is_err());
        let c = admitted(&pool, false);
        assert_eq!(c.forward().unwrap().read, first);
        drop((b, c));
        assert_eq!(pool.num_held(), 0);
    }

    #[test]
    fn the_capacity_bounds_running_sequences_not_standalone_forwards() {
        let pool = StatePool::new(&[4]);
        pool.set_capacity(3);
        let mut replayed = admitted(&pool, true);
        let mut plain = admitted(&pool, false);
        let mut next = SequenceStates::new(&pool, false);
        assert!(!next.acquire(), "three of three slots are held");
        let scored = SequenceStates::transient(&pool, None);
        assert!(
            scored.forward().is_ok(),
            "a standalone forward is not counted"
        );
        assert_eq!(pool.num_held(), 4);
        // Preemption gives the slots back; a second acquire holds what it holds.
        plain.release();
        assert!(next.acquire() && next.acquire());
        assert!(!plain.acquire());
        replayed.release();
        assert!(plain.acquire());
        assert_eq!(pool.num_held(), 3);
    }

    /// Snapshots fill the room running sequences leave and give it up, oldest use first,
    /// when a sequence is admitted; a new snapshot never takes a running sequence's room.
    #[test]
    fn snapshots_use_free_room_and_are_evicted_for_sequences() {
        let pool = StatePool::new(&[2]);
        pool.set_capacity(3);
        for entry in [10, 11, 12] {
            let slot = pool.snapshot_slot().unwrap();
            pool.keep_snapshot(entry, slot);
        }
        assert_eq!(pool.num_snapshots(), 3);
        assert!(pool.snapshot(10).is_some(), "10 is now the latest used");
        let _plain = admitted(&pool, false);
        assert!(!pool.has_snapshot(11), "the least recently used goes first");
        assert!(pool.has_snapshot(10) && pool.has_snapshot(12));
        let _replayed = admitted(&pool, true);
        assert_eq!((pool.num_snapshots(), pool.num_held()), (0, 3));
        assert!(
            pool.snapshot_slot().is_none(),
            "running sequences hold it all"
        );
        let mut waiting = SequenceStates::new(&pool, false);
        assert!(!waiting.acquire());
        drop(_plain);
        let slot = pool.snapshot_slot().unwrap();
        pool.keep_snapshot(13, slot);
        pool.clear_snapshots();
        assert_eq!((pool.num_snapshots(), pool.num_held()), (0, 2));
    }

    #[test]
    fn the_capacity_is_half_the_budget_two_per_sequence_at_most() {
        assert_eq!(StatePool::capacity_within(0, 0, 8).unwrap(), 0);
        assert_eq!(StatePool::capacity_within(100, 10_000, 256).unwrap(), 50);
        assert_eq!(StatePool::capacity_within(100, 10_000, 4).unwrap(), 8);
        let e = StatePool::capacity_within(100, 399, 8).unwrap_err();
        assert_eq!(e.param_name(), Some("kv_cache_bytes"));
        assert!(e.to_string().contains("at least 400"), "{e}");
    }

    #[test]
    fn commit_copies_live_over_committed() {
        let pool = StatePool::new(&[2]);
        let s = admitted(&pool, true);
        let live = pool.get(s.forward().unwrap().write).unwrap();
        {
            let mut d = live.lock().unwrap();
            d.values.copy_from_slice(&[1.5, -2.0]);
            d.seen[0] = 7;
        }
        let replay = s.replay(3).unwrap();
        assert_ne!(replay.read, replay.write);
        assert_eq!(replay.advance, 3);
        s.commit().unwrap();
        let committed = pool.get(replay.read).unwrap();
        let d = committed.lock().unwrap();
        assert_eq!((d.values.as_slice(), d.seen[0]), (&[1.5, -2.0][..], 7));
    }
}
