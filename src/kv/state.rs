//! Per-sequence recurrent state: what a linear-attention layer (Qwen3.5's gated DeltaNet) keeps
//! in place of keys and values.
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
//! position is an error, never a silent mix of prefixes. Hence no prefix caching for such
//! models: a cached prefix would hand over KV without the state that goes with it.

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

/// The states of every running sequence, allocated as sequences take them and freed when they
/// drop them. Host memory: the layers that keep state run on the CPU.
#[derive(Debug)]
pub struct StatePool {
    /// Where each layer's state begins in a slot's values, and its length (0: none).
    layers: Vec<(usize, usize)>,
    len: usize,
    slots: Mutex<Vec<Option<Slot>>>,
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
}

impl StatePool {
    /// A pool for states of `per_layer[i]` values in layer `i`.
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
            slots: Mutex::new(Vec::new()),
        })
    }

    /// Whether any layer keeps a state.
    pub fn is_used(&self) -> bool {
        self.len > 0
    }

    /// Bytes one sequence's state takes.
    pub fn bytes_per_state(&self) -> usize {
        self.len * std::mem::size_of::<f32>()
    }

    /// `(start, len)` of layer `i`'s state in a slot's values.
    pub fn layer_range(&self, layer: usize) -> Option<(usize, usize)> {
        self.layers.get(layer).copied().filter(|&(_, n)| n > 0)
    }

    fn slots(&self) -> MutexGuard<'_, Vec<Option<Slot>>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new zeroed state, freed when the handle drops.
    pub fn take(self: &Arc<Self>) -> StateSlot {
        let data = Arc::new(Mutex::new(StateData {
            seen: vec![0; self.layers.len()],
            values: vec![0.0; self.len],
        }));
        let mut slots = self.slots();
        let id = match slots.iter().position(Option::is_none) {
            Some(i) => {
                slots[i] = Some(data);
                i
            }
            None => {
                slots.push(Some(data));
                slots.len() - 1
            }
        };
        StateSlot {
            pool: self.clone(),
            id: id as u32,
        }
    }

    /// The state in slot `id`.
    pub fn get(&self, id: u32) -> Result<Slot> {
        self.slots()
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

    /// Slots held now.
    pub fn num_held(&self) -> usize {
        self.slots().iter().flatten().count()
    }
}

/// A state held by a sequence; its slot is freed on drop.
#[derive(Debug)]
pub struct StateSlot {
    pool: Arc<StatePool>,
    id: u32,
}

impl StateSlot {
    pub fn id(&self) -> u32 {
        self.id
    }
}

impl Drop for StateSlot {
    fn drop(&mut self) {
        if let Some(slot) = self.pool.slots().get_mut(self.id as usize) {
            *slot = None;
        }
    }
}

/// A sequence's states: the live one, and the committed one where its tokens are speculative.
#[derive(Debug)]
pub struct SequenceStates {
    live: StateSlot,
    committed: Option<StateSlot>,
}

impl SequenceStates {
    /// `speculative`: the sequence's tokens wait for a verifier (replay), which needs the
    /// state at its last committed token.
    pub fn new(pool: &Arc<StatePool>, speculative: bool) -> Self {
        Self {
            live: pool.take(),
            committed: speculative.then(|| pool.take()),
        }
    }

    /// The fast path's (and a prefill's): the live state, advanced by every row.
    pub fn forward(&self) -> StateRef {
        StateRef {
            read: self.live.id,
            write: self.live.id,
            advance: u32::MAX,
        }
    }

    /// A verify pass's: from the committed state into the live one, advanced by `advance`
    /// rows.
    pub fn replay(&self, advance: usize) -> StateRef {
        StateRef {
            read: self.committed.as_ref().unwrap_or(&self.live).id,
            write: self.live.id,
            advance: u32::try_from(advance).unwrap_or(u32::MAX),
        }
    }

    /// The live state becomes the committed one (after a verify pass, and after the isolated
    /// prefill whose first token is committed at once).
    pub fn commit(&self) -> Result<()> {
        match &self.committed {
            Some(c) => self.live.pool.copy(self.live.id, c.id),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_freed_on_drop_and_reused() {
        let pool = StatePool::new(&[0, 3, 2]);
        assert_eq!(pool.layer_range(0), None);
        assert_eq!(pool.layer_range(1), Some((0, 3)));
        assert_eq!(pool.layer_range(2), Some((3, 2)));
        let a = SequenceStates::new(&pool, true);
        let b = SequenceStates::new(&pool, false);
        assert_eq!(pool.num_held(), 3);
        let first = a.forward().read;
        drop(a);
        assert_eq!(pool.num_held(), 1);
        assert!(pool.get(first).is_err());
        let c = SequenceStates::new(&pool, false);
        assert_eq!(c.forward().read, first);
        drop((b, c));
        assert_eq!(pool.num_held(), 0);
    }

    #[test]
    fn commit_copies_live_over_committed() {
        let pool = StatePool::new(&[2]);
        let s = SequenceStates::new(&pool, true);
        let live = pool.get(s.forward().write).unwrap();
        {
            let mut d = live.lock().unwrap();
            d.values.copy_from_slice(&[1.5, -2.0]);
            d.seen[0] = 7;
        }
        let replay = s.replay(3);
        assert_ne!(replay.read, replay.write);
        assert_eq!(replay.advance, 3);
        s.commit().unwrap();
        let committed = pool.get(replay.read).unwrap();
        let d = committed.lock().unwrap();
        assert_eq!((d.values.as_slice(), d.seen[0]), (&[1.5, -2.0][..], 7));
    }
}
