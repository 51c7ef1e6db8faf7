//! The nucleus (top-p) filter.
//!
//! Its definition sorts every token that could matter and sums their weights in rank order:
//! the total decides the threshold, the prefix sums decide where the nucleus ends. On a
//! 128,256-token row that sort and the `exp` per token cost ~1 ms, more than the rest of a
//! sampled row together, while a language model's nucleus is usually a handful of tokens.
//!
//! So [`apply_top_p`] first tries a bounded path that needs only the nucleus itself in rank
//! order: one vectorised pass over the row gives the total to within a proven relative error
//! (`TOTAL_SLACK`), hence an interval `[a, b]` around the threshold; the few tokens
//! near the top are sorted and their prefix sums computed exactly as the definition does. Where
//! the first prefix at or above `b` follows one below `a`, every total in the interval, the
//! exact one included, ends the nucleus there. Otherwise (a prefix falls inside the interval,
//! or the nucleus reaches far down the row) the definition runs as written. The kept set is the
//! definition's, bit for bit, either way; the lanes' sums only bound, they never decide.

use super::rank::{alive_ids_by_rank, rank_key, row_max, LANES};
use crate::ops::{exp_nonpositive, isa_kernel, CpuIsa};

/// How far below the maximum (in logits) a token's nucleus weight `exp(l - max)` is below
/// 2^-54: `exp(-38) < 3.2e-17 < 2^-54 = 5.6e-17`.
const TOP_P_NEGLIGIBLE: f64 = 38.0;

/// Relative bound on the lanes' total against the definition's. Each lane weight is the f32
/// `exp` (about 1 ulp) of `l - max` rounded to f32 (relative 2^-24 of at most 32 logits: a
/// factor within 1 ± 2e-6), summed in f64 (1e-10 over a million tokens); the definition's
/// weights are f64 `exp`s summed in rank order (1e-10 likewise). 1e-4 leaves a factor of 30.
const TOTAL_SLACK: f64 = 1e-4;

/// Nucleus filter: keeps the smallest prefix of tokens, most likely first (ties by lower id),
/// whose cumulative probability reaches `top_p`; always keeps at least one token. `top_p >= 1`
/// disables it.
///
/// Probabilities are computed in `f64` over the tokens still alive (so after top-k this is the
/// renormalised distribution, as in vLLM and HF). The total is the last prefix sum of the same
/// sequential loop, so the comparison `prefix >= top_p * total` is guaranteed to succeed by the
/// last token without a separate normalisation step.
///
/// Tokens more than `TOP_P_NEGLIGIBLE` (38) below the maximum are left out of the sort and the sum:
/// their weights are below 2^-54 and come after the maximum's weight of exactly 1, so adding
/// them cannot change a prefix sum (each is under half an ulp of anything >= 1), and the prefix
/// reaches `top_p * total` before them: they are always dropped. The result is the one over
/// every alive token, bit for bit, with less to sort.
pub fn apply_top_p(logits: &mut [f32], top_p: f32) {
    if top_p >= 1.0 {
        return;
    }
    let isa = CpuIsa::detect();
    let max = row_max(isa, logits);
    if max == f32::NEG_INFINITY {
        return;
    }
    let kept = bounded_nucleus(isa, logits, max, top_p)
        .unwrap_or_else(|| exact_nucleus(logits, max, top_p));
    // Every alive token out, then the nucleus back: two passes the compiler vectorises,
    // instead of a rank comparison per token.
    let values: Vec<f32> = kept.iter().map(|&t| logits[t as usize]).collect();
    for l in logits.iter_mut() {
        // NaN stays NaN, as the definition leaves it.
        *l = if *l > f32::NEG_INFINITY {
            f32::NEG_INFINITY
        } else {
            *l
        };
    }
    for (&t, v) in kept.iter().zip(values) {
        logits[t as usize] = v;
    }
}

/// The nucleus's ids in rank order, by the definition: every non-negligible alive token
/// sorted, weighed and summed.
fn exact_nucleus(logits: &[f32], max: f32, top_p: f32) -> Vec<u32> {
    let max = f64::from(max);
    let mut idx = alive_ids_by_rank(logits, |l| f64::from(l) - max >= -TOP_P_NEGLIGIBLE);
    let keep = nucleus_len(logits, &idx, max, top_p);
    idx.truncate(keep);
    idx
}

/// The nucleus's ids in rank order where the lanes' bounds on the total decide it (module
/// doc); `None` where they cannot, or the row's maximum is not finite.
fn bounded_nucleus(isa: CpuIsa, logits: &[f32], max: f32, top_p: f32) -> Option<Vec<u32>> {
    if !max.is_finite() {
        return None;
    }
    let total = lane_total(isa, logits, max);
    if !(total.is_finite() && total > 0.0) {
        return None;
    }
    let top_p = f64::from(top_p);
    let a = top_p * (total * (1.0 - TOTAL_SLACK));
    let b = top_p * (total * (1.0 + TOTAL_SLACK));
    // Tokens lighter than `floor` weigh less than the room between the total and the
    // threshold all together, so the heavier ones reach it: they are the candidates (with
    // room for the lanes' error; the exact prefix below decides).
    let floor = (total * (1.0 - TOTAL_SLACK) - b * 1.001) / logits.len() as f64;
    if floor <= 0.0 {
        return None;
    }
    let cut = floor.ln() as f32;
    // `l - max > cut` is monotone in `l`, so the candidates are a prefix of the rank order.
    let mut keys: Vec<u64> = Vec::new();
    const CHUNK: usize = 16;
    for (i, c) in logits.chunks(CHUNK).enumerate() {
        // Most chunks hold no candidate: one vectorised test each.
        if c.iter().fold(false, |any, &l| any | (l - max > cut)) {
            for (j, &l) in c.iter().enumerate() {
                if l - max > cut {
                    keys.push(rank_key(i * CHUNK + j, l));
                }
            }
        }
    }
    keys.sort_unstable();
    let max = f64::from(max);
    let (mut prefix, mut before) = (0.0f64, 0.0f64);
    for (i, &k) in keys.iter().enumerate() {
        // The definition's weights and sums, over the same first tokens in the same order.
        prefix += (f64::from(logits[k as u32 as usize]) - max).exp();
        if prefix >= b {
            return (before < a).then(|| keys[..=i].iter().map(|&k| k as u32).collect());
        }
        before = prefix;
    }
    None
}

isa_kernel! {
    /// The row's total weight `sum exp(l - max)`: f32 `exp` of each logit, summed in f64 lanes
    /// (lane `l` takes the indices ≡ l mod 16). NaN and `-inf` weigh nothing.
    fn lane_total(isa: CpuIsa, logits: &[f32], max: f32) -> f64 {
        let mut totals = [0f64; LANES];
        let (chunks, rest) = logits.as_chunks::<LANES>();
        let mut last = [f32::NEG_INFINITY; LANES];
        last[..rest.len()].copy_from_slice(rest);
        for c in chunks.iter().chain(std::iter::once(&last)) {
            let mut w = [0f32; LANES];
            for l in 0..LANES {
                // NaN and -inf fail the comparison; `exp_nonpositive` gives 0 below -87.
                let d = c[l] - max;
                w[l] = exp_nonpositive(if d >= -87.0 { d } else { -88.0 });
            }
            for l in 0..LANES {
                totals[l] += f64::from(w[l]);
            }
        }
        totals.iter().sum()
    }
}

/// How many of `idx` (alive ids in rank order, the largest logit `max` first) the nucleus
/// keeps: weights `exp(l - max)` in f64, summed in rank order.
pub(super) fn nucleus_len(logits: &[f32], idx: &[u32], max: f64, top_p: f32) -> usize {
    let weights: Vec<f64> = idx
        .iter()
        .map(|&t| (f64::from(logits[t as usize]) - max).exp())
        .collect();
    let total: f64 = weights.iter().fold(0.0, |acc, &w| acc + w);
    let threshold = f64::from(top_p) * total;
    let mut prefix = 0.0f64;
    for (i, &w) in weights.iter().enumerate() {
        prefix += w;
        if prefix >= threshold {
            return i + 1;
        }
    }
    idx.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A language-model-like row (as `benches/sampler.rs`): a N(0, 3²)-ish bulk and every
    /// 997th token 10–18 above it, divided by `temperature`.
    fn lm_row(vocab: usize, seed: u64, temperature: f32) -> Vec<f32> {
        let mut state = seed | 1;
        let mut uniform = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32
        };
        (0..vocab)
            .map(|i| {
                let bulk = (uniform() + uniform() + uniform() + uniform() - 2.0) * 5.2;
                let l = if i % 997 == 3 {
                    bulk + 10.0 + 8.0 * uniform()
                } else {
                    bulk
                };
                l / temperature
            })
            .collect()
    }

    /// On language-model-like rows of Llama 3's vocabulary the bounded path decides (it is
    /// not a path that always falls back) and its end is the definition's.
    #[test]
    fn the_bounded_path_decides_lm_rows_as_the_definition() {
        let mut decided = 0;
        let mut cases = 0;
        for seed in 1..=12u64 {
            for temperature in [0.6f32, 0.8, 1.0] {
                for top_p in [0.5f32, 0.9, 0.95] {
                    let row = lm_row(128_256, seed, temperature);
                    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let want = exact_nucleus(&row, max, top_p);
                    for isa in [CpuIsa::Portable, CpuIsa::detect()] {
                        cases += 1;
                        if let Some(got) = bounded_nucleus(isa, &row, max, top_p) {
                            assert_eq!(got, want, "seed {seed} T {temperature} p {top_p}");
                            decided += 1;
                        }
                    }
                }
            }
        }
        assert!(decided * 10 >= cases * 9, "decided {decided} of {cases}");
    }

    /// Where a prefix sum sits inside the interval the lanes leave, the bounded path gives
    /// way: equal weights whose threshold falls exactly on a prefix.
    #[test]
    fn a_threshold_on_a_prefix_falls_back_to_the_definition() {
        let mut row = vec![f32::NEG_INFINITY; 1000];
        row[..4].fill(2.0);
        let mut filtered = row.clone();
        apply_top_p(&mut filtered, 0.5);
        assert_eq!(bounded_nucleus(CpuIsa::detect(), &row, 2.0, 0.5), None);
        let kept: Vec<usize> = (0..row.len())
            .filter(|&t| filtered[t] > f32::NEG_INFINITY)
            .collect();
        assert_eq!(kept, vec![0, 1]);
    }
}
