//! Counter-based random numbers for sampling.
//!
//! # Why counter-based
//!
//! A stateful RNG stream (one generator advanced once per draw) makes a token's noise depend on
//! how many draws happened before it: on batch composition, on whether the token was produced by
//! the fast path or by the verifier replay, on rollbacks and on preemption/recompute. Here the
//! noise is a *pure function* of `(seed, absolute position, vocab index)`, so the fast path and
//! the verifier (docs/architecture.md, "Replay") draw exactly the same noise for the same
//! token, and a rolled-back position re-draws the same values when it is decoded again.
//!
//! # Construction
//!
//! The three input words are absorbed one after another into a 64-bit state, each word first
//! passed through the SplitMix64 finaliser (`mix64`, a bijection on `u64` with full avalanche) and
//! XORed into the state, which is then mixed again. Because every step is a bijection in the
//! absorbed word, two different vocab indices at the same `(seed, position)` can never produce
//! the same 64-bit output. The quality is ample for sampling (SplitMix64 passes BigCrush); it is
//! not a cryptographic generator.
//!
//! Results are bitwise reproducible for a given build and platform: integer mixing is exact and
//! `f64::ln` is deterministic for a given libm.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// Domain-separation constants (odd, from the golden ratio and SplitMix64), one per input word so
/// that swapping `position` and `index` gives unrelated values.
const K_SEED: u64 = 0x9E37_79B9_7F4A_7C15;
const K_POSITION: u64 = 0xD1B5_4A32_D192_ED03;
const K_INDEX: u64 = 0x8CB9_2BA7_2F3D_8DD7;

/// 2^-52, the spacing of the grid that [`uniform`] returns values on.
const TWO_POW_M52: f64 = 1.0 / (1u64 << 52) as f64;

/// SplitMix64's increment (the golden ratio in 64 bits): steps its state, spreads counters.
pub const SPLITMIX_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// Seed of completion `index` of a request: the request's seed for the first, distinct
/// well-mixed seeds for the others, so `n > 1` samples differ but stay reproducible.
pub fn completion_seed(seed: u64, index: usize) -> u64 {
    if index == 0 {
        return seed;
    }
    mix64(seed ^ (index as u64).wrapping_mul(SPLITMIX_GAMMA))
}

/// SplitMix64's output finaliser (Stafford's "Mix13"): a bijection on `u64` with strong avalanche.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Hashes the three counter words into 64 well-mixed bits.
#[inline]
fn hash3(seed: u64, position: u64, index: u64) -> u64 {
    index_hash(row_hash(seed, position), index)
}

/// The part of [`hash3`] that depends on the row only.
#[inline]
fn row_hash(seed: u64, position: u64) -> u64 {
    let h = mix64(seed.wrapping_add(K_SEED));
    mix64(h ^ mix64(position.wrapping_add(K_POSITION)))
}

/// [`hash3`] from its row part.
#[inline]
fn index_hash(row: u64, index: u64) -> u64 {
    mix64(row ^ mix64(index.wrapping_add(K_INDEX)))
}

/// A uniform random number in the open interval (0, 1), a pure function of its inputs.
///
/// The value is `(k + 0.5) / 2^52` for a 52-bit `k` taken from the hash, so it is exact in `f64`,
/// never 0 and never 1 (both would make [`gumbel`] infinite), and symmetric about 1/2.
#[inline]
pub fn uniform(seed: u64, position: u64, index: u64) -> f64 {
    uniform_of_grid(hash3(seed, position, index) >> 12)
}

/// The uniform value of grid point `k < 2^52` (see [`uniform`]).
#[inline]
fn uniform_of_grid(k: u64) -> f64 {
    (k as f64 + 0.5) * TWO_POW_M52
}

/// A standard Gumbel(0, 1) sample, `-ln(-ln(u))` with `u = uniform(seed, position, index)`.
///
/// Adding independent Gumbel noise to log-probabilities and taking the argmax samples exactly from
/// the softmax (the Gumbel-max trick). That lets every vocab entry get its own noise keyed by its
/// index, with no cumulative sum whose order would matter.
#[inline]
pub fn gumbel(seed: u64, position: u64, index: u64) -> f64 {
    gumbel_of_grid(hash3(seed, position, index) >> 12)
}

#[inline]
fn gumbel_of_grid(k: u64) -> f64 {
    -(-uniform_of_grid(k).ln()).ln()
}

/// The noise of one row, `(seed, position)`: the same values as [`gumbel`], with the part of
/// the hash that does not depend on the vocab index computed once, and cheap bounds that let the
/// sampler rule out most tokens without the two logarithms.
#[derive(Debug, Clone, Copy)]
pub struct RowNoise {
    row: u64,
    bounds: &'static [(f64, f64); 1 << BUCKET_BITS],
}

/// The bounds table has one entry per `2^BUCKET_BITS`-th of the unit interval.
const BUCKET_BITS: u32 = 10;

/// Added to (subtracted from) each bucket's edge values: far above the error of `ln` (about
/// 1e-14 on values below 40), so the bounds hold for the computed noise, not only the exact one.
const BOUND_MARGIN: f64 = 1e-9;

/// `[lower, upper]` bounds on [`gumbel_of_grid`] over each bucket of grid points.
fn gumbel_bounds() -> &'static [(f64, f64); 1 << BUCKET_BITS] {
    static BOUNDS: OnceLock<[(f64, f64); 1 << BUCKET_BITS]> = OnceLock::new();
    BOUNDS.get_or_init(|| {
        let shift = 52 - BUCKET_BITS;
        std::array::from_fn(|j| {
            let first = (j as u64) << shift;
            let last = first + (1u64 << shift) - 1;
            // The noise increases with the grid point: the bucket's first and last points bound
            // every point in between.
            (
                gumbel_of_grid(first) - BOUND_MARGIN,
                gumbel_of_grid(last) + BOUND_MARGIN,
            )
        })
    })
}

impl RowNoise {
    /// The noise of the token at `position` of a request seeded with `seed`.
    pub fn new(seed: u64, position: u64) -> Self {
        Self {
            row: row_hash(seed, position),
            bounds: gumbel_bounds(),
        }
    }

    #[inline]
    fn grid(&self, index: u64) -> u64 {
        index_hash(self.row, index) >> 12
    }

    /// `gumbel(seed, position, index)`, bit for bit.
    #[inline]
    pub fn gumbel(&self, index: u64) -> f64 {
        gumbel_of_grid(self.grid(index))
    }

    /// Which of the bounds table's buckets `index`'s noise falls in (see [`Self::bounds`]).
    #[inline]
    pub fn bucket(&self, index: u64) -> u32 {
        (self.grid(index) >> (52 - BUCKET_BITS)) as u32
    }

    /// `(lower, upper)` with `lower <= self.gumbel(index) <= upper` for every `index` whose
    /// [`Self::bucket`] is `bucket`; the two are within a few thousandths of each other for all
    /// but the extreme buckets.
    #[inline]
    pub fn bounds(&self, bucket: u32) -> (f64, f64) {
        self.bounds[bucket as usize & ((1 << BUCKET_BITS) - 1)]
    }
}

/// A strict upper bound on any value [`gumbel`] can return.
///
/// The largest `u` is `1 - 2^-53`, whose Gumbel value is about 36.74; 37 leaves margin for libm
/// rounding. The sampler uses it to skip drawing noise for tokens that cannot win.
pub const GUMBEL_MAX: f64 = 37.0;

/// A fresh seed for a request that did not specify one.
///
/// Uses std's randomly keyed `RandomState` (a new key per call), mixed with the wall clock and a
/// process-wide counter, so no extra crate is needed and concurrent calls never collide in
/// practice. The engine records the chosen seed so the request can be replayed.
pub fn request_seed_from_entropy() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = RandomState::new().build_hasher();
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    hasher.write_u128(nanos);
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    mix64(hasher.finish())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn uniform_is_pure_and_in_open_interval() {
        for pos in 0..1000u64 {
            for idx in 0..10u64 {
                let u = uniform(42, pos, idx);
                assert!(u > 0.0 && u < 1.0);
                assert_eq!(u.to_bits(), uniform(42, pos, idx).to_bits());
            }
        }
        // Extremes of the grid are still strictly inside (0, 1) and give a finite Gumbel.
        let lo = 0.5 * TWO_POW_M52;
        let hi = (((1u64 << 52) - 1) as f64 + 0.5) * TWO_POW_M52;
        assert!(lo > 0.0 && hi < 1.0);
        let g_hi = -(-hi.ln()).ln();
        let g_lo = -(-lo.ln()).ln();
        assert!(g_hi.is_finite() && g_hi < GUMBEL_MAX);
        assert!(g_lo.is_finite());
    }

    #[test]
    fn uniform_moments_look_uniform() {
        let n = 200_000u64;
        let (mut sum, mut sum2) = (0.0f64, 0.0f64);
        for i in 0..n {
            let u = uniform(7, i / 100, i % 100);
            sum += u;
            sum2 += u * u;
        }
        let mean = sum / n as f64;
        let var = sum2 / n as f64 - mean * mean;
        // Standard error of the mean is ~0.00065; of the variance ~0.00019.
        assert!((mean - 0.5).abs() < 0.004, "mean {mean}");
        assert!((var - 1.0 / 12.0).abs() < 0.0015, "var {var}");
    }

    #[test]
    fn inputs_are_not_interchangeable_and_indices_do_not_collide() {
        assert_ne!(uniform(1, 2, 3), uniform(1, 3, 2));
        assert_ne!(uniform(1, 2, 3), uniform(2, 1, 3));
        assert_ne!(uniform(0, 0, 0), uniform(0, 0, 1));
        let bits: HashSet<u64> = (0..100_000u64).map(|i| hash3(9, 17, i)).collect();
        assert_eq!(bits.len(), 100_000);
    }

    #[test]
    fn gumbel_mean_is_euler_gamma() {
        let n = 200_000u64;
        let mean = (0..n).map(|i| gumbel(3, i, 5)).sum::<f64>() / n as f64;
        // Gumbel(0,1) mean = 0.5772, sd = 1.2825, so the standard error is ~0.0029.
        assert!((mean - 0.577_215_66).abs() < 0.015, "mean {mean}");
    }

    #[test]
    fn row_noise_is_gumbel_and_within_its_bounds() {
        for (seed, pos) in [(0u64, 0u64), (7, 130), (u64::MAX, 1 << 40)] {
            let noise = RowNoise::new(seed, pos);
            for i in 0..50_000u64 {
                let g = noise.gumbel(i);
                assert_eq!(g.to_bits(), gumbel(seed, pos, i).to_bits());
                let (lo, hi) = noise.bounds(noise.bucket(i));
                assert!(lo <= g && g <= hi, "{lo} <= {g} <= {hi}");
            }
        }
        // Every bucket's edges, and the grid's extremes, as the sampler's proof needs them.
        let shift = 52 - BUCKET_BITS;
        for (j, &(lo, hi)) in gumbel_bounds().iter().enumerate() {
            let first = (j as u64) << shift;
            let last = first + (1 << shift) - 1;
            for k in [first, first + 1, last - 1, last] {
                let g = gumbel_of_grid(k);
                assert!(lo <= g && g <= hi, "bucket {j}: {lo} <= {g} <= {hi}");
            }
            assert!(hi < GUMBEL_MAX && hi - lo > 0.0);
        }
    }

    #[test]
    fn entropy_seeds_differ() {
        let seeds: HashSet<u64> = (0..1000).map(|_| request_seed_from_entropy()).collect();
        assert_eq!(seeds.len(), 1000);
    }
}
