//! Token ranking: "more likely first" as a total order (larger logit first, equal logits by
//! lower id), so every filter and top-n list keeps a unique set whatever the sort's stability;
//! and the top rank's logit, the row's maximum, which the sampler and the filters start from.

use std::cmp::Ordering;

use crate::ops::isa_kernel;

/// Total order "more likely first": larger logit first, equal logits by lower token id.
#[inline]
pub(crate) fn rank_desc(logits: &[f32], a: u32, b: u32) -> Ordering {
    logits[b as usize]
        .total_cmp(&logits[a as usize])
        .then(a.cmp(&b))
}

/// Token `t` with logit `l` as one integer whose ascending order is [`rank_desc`]'s: the
/// descending `total_cmp` key of the logit above the id.
#[inline]
pub(super) fn rank_key(t: usize, l: f32) -> u64 {
    let bits = l.to_bits();
    let ascending = if bits >> 31 == 1 {
        !bits
    } else {
        bits | 1 << 31
    };
    (u64::from(!ascending) << 32) | t as u64
}

/// The ids of the tokens still alive (logit above `-inf`, so not NaN) for which `keep` holds,
/// in [`rank_desc`] order. Each id is packed with its rank key into one `u64` ([`rank_key`]), so
/// the sort compares plain integers instead of loading two logits per comparison; the keys are
/// distinct, so the order is the one `rank_desc` defines, bit for bit.
pub(super) fn alive_ids_by_rank(logits: &[f32], keep: impl Fn(f32) -> bool) -> Vec<u32> {
    // Written without a branch per token (every key is stored, the length advances only for
    // the kept ones): which tokens are kept is data, and a mispredicted branch per token cost
    // more than the rest of the packing.
    let mut packed = vec![0u64; logits.len()];
    let mut len = 0;
    for (t, &l) in logits.iter().enumerate() {
        packed[len] = rank_key(t, l);
        len += usize::from(l > f32::NEG_INFINITY && keep(l));
    }
    packed.truncate(len);
    packed.sort_unstable();
    packed.into_iter().map(|k| k as u32).collect()
}

/// Lanes of the row kernels here and in the sampler (16 f32: one AVX-512 register).
pub(super) const LANES: usize = 16;

isa_kernel! {
    /// The largest logit of a row, the top rank's (`-inf` for an empty or all-`-inf` row;
    /// NaN is never larger, so it is passed over).
    pub(super) fn row_max(isa: CpuIsa, logits: &[f32]) -> f32 {
        max_in_lanes(logits)
    }
}

/// Maximum in [`LANES`] lanes, then across them (max is exact: any order gives the same value).
#[inline(always)]
pub(super) fn max_in_lanes(logits: &[f32]) -> f32 {
    // `>` rather than `f32::max`: one vector max instruction per lane (`f32::max`'s NaN rule
    // costs a compare and a blend more), the same value on a row without NaN (the sign of a
    // zero maximum aside, which no caller can tell apart).
    let mut maxes = [f32::NEG_INFINITY; LANES];
    let (chunks, rest) = logits.as_chunks::<LANES>();
    for c in chunks {
        for l in 0..LANES {
            maxes[l] = if c[l] > maxes[l] { c[l] } else { maxes[l] };
        }
    }
    for (l, &x) in rest.iter().enumerate() {
        maxes[l] = if x > maxes[l] { x } else { maxes[l] };
    }
    maxes.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alive_ids_by_rank_is_the_rank_desc_sort() {
        let specials = [
            0.0,
            -0.0,
            1.5,
            -1.5,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
        ];
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for n in [0usize, 1, 2, 7, 100, 2000] {
            let logits: Vec<f32> = (0..n)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
                    let r = (state >> 33) as u32;
                    match r % 10 {
                        0 => specials[(r / 10) as usize % specials.len()],
                        1 => 0.25, // ties
                        _ => (r % 2000) as f32 / 100.0 - 10.0,
                    }
                })
                .collect();
            let mut want: Vec<u32> = (0..n as u32).collect();
            want.sort_unstable_by(|&a, &b| rank_desc(&logits, a, b));
            want.retain(|&t| logits[t as usize] > f32::NEG_INFINITY);
            assert_eq!(alive_ids_by_rank(&logits, |_| true), want, "n={n}");
        }
    }
}
