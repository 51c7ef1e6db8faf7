//! The bf16-activation GEMM without AVX-512 BF16: the definition of `VDPBF16PS` (`super`'s
//! docs) run as plain FMAs where a check shows its flushing changed nothing, and lane by lane
//! where it might. Same bits as the definition and the instruction.

use super::{dot_bf16_pair_emulated, PairPanel, CANONICAL_NAN, NR, WORDS};

/// Pairs of k per chunk of [`microkernel_emulated`]'s fast path: what one fallback redoes.
const CHUNK: usize = 32;

/// Steps `s0..s1` of the R × C block (columns `C0..C0+C` of the panel) added to `acc` by the
/// definition, lane by lane (`wide`: the rows' widened pairs, stride `kp`).
#[inline(always)]
fn exact_steps<const R: usize, const C0: usize, const C: usize>(
    acc: &mut [[f32; C]; R],
    wide: &[[f32; 2]],
    kp: usize,
    panel: &[u32],
    steps: std::ops::Range<usize>,
) {
    for s in steps {
        let step = &panel[s * WORDS + C0..s * WORDS + C0 + C];
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let [odd, even] = wide[r * kp + s];
            // The paired word again: the widening is exact both ways.
            let ar = odd.to_bits() | even.to_bits() >> 16;
            for (acc, &wc) in acc_r.iter_mut().zip(step) {
                *acc = dot_bf16_pair_emulated(*acc, ar, wc);
            }
        }
    }
}

/// Whether `x` is nonzero and at most 2^-126 in magnitude, as `tiny_key(x) < TINY_KEY`: the
/// only results the definition's flushing can change (a zero is flushed to itself). Twice the
/// magnitude's bits (the sign shifted out) minus one, so that zero maps to the largest key.
#[inline(always)]
fn tiny_key(x: f32) -> u32 {
    (x.to_bits() << 1).wrapping_sub(1)
}

/// [`tiny_key`] of 2^-126, plus one.
const TINY_KEY: u32 = 0x0100_0000;

/// The R × C block (columns `C0..C0+C` of the panel) of rows `wide` (R rows of `kp` pairs by
/// [`widen_pairs`], stride `kp`) times `panel`, emulated.
///
/// The definition flushes denormal inputs and tiny results, which a vector loop cannot do
/// cheaply lane by lane. But where no input is denormal and no result is tiny, flushing changes
/// nothing and the definition is two plain FMAs per pair (odd element first). So the fast path
/// runs exactly that over chunks of [`CHUNK`] pairs, tracking the smallest magnitude of every
/// intermediate; a chunk that met a tiny one is redone from its starting accumulators by the
/// definition ([`exact_steps`]). Denormal inputs: activations never are ([`pair_rows`](super::pair_rows) rounds
/// them with [`round_activation_bf16`](super::round_activation_bf16), which maps f32 denormals to zero and cannot round a
/// normal value below 2^-126), and a panel holding a denormal weight (`denormal_weights`)
/// runs the definition throughout. Same bits as the definition either way.
#[inline(always)]
fn microkernel_emulated<const R: usize, const C0: usize, const C: usize>(
    wide: &[[f32; 2]],
    kp: usize,
    panel: &[u32],
    denormal_weights: bool,
) -> [[f32; C]; R] {
    let mut acc = [[0f32; C]; R];
    if denormal_weights {
        exact_steps::<R, C0, C>(&mut acc, wide, kp, panel, 0..kp);
        return acc;
    }
    let mut s0 = 0;
    while s0 < kp {
        let s1 = (s0 + CHUNK).min(kp);
        let start = acc;
        let mut smallest = [u32::MAX; C];
        let rows: [&[[f32; 2]]; R] = std::array::from_fn(|r| &wide[r * kp + s0..r * kp + s1]);
        let steps = panel[s0 * WORDS..s1 * WORDS].chunks_exact(WORDS);
        for (i, step) in steps.enumerate() {
            let step = &step[C0..C0 + C];
            let odd: [f32; C] = std::array::from_fn(|c| f32::from_bits(step[c] & 0xffff_0000));
            let even: [f32; C] = std::array::from_fn(|c| f32::from_bits(step[c] << 16));
            for (acc_r, row) in acc.iter_mut().zip(&rows) {
                let [a_odd, a_even] = row[i];
                for c in 0..C {
                    let t = a_odd.mul_add(odd[c], acc_r[c]);
                    let v = a_even.mul_add(even[c], t);
                    smallest[c] = smallest[c].min(tiny_key(t)).min(tiny_key(v));
                    acc_r[c] = v;
                }
            }
        }
        if smallest.iter().any(|&m| m < TINY_KEY) {
            acc = start;
            exact_steps::<R, C0, C>(&mut acc, wide, kp, panel, s0..s1);
        }
        s0 = s1;
    }
    acc
}

/// Writes `acc`'s first `cols` columns, NaN canonical, at `out` (row stride `n`).
///
/// # Safety
/// `out` addresses R rows of `cols` writable floats at stride `n`, this task's alone.
#[inline(always)]
unsafe fn store<const R: usize, const C: usize>(
    acc: &[[f32; C]; R],
    out: *mut f32,
    n: usize,
    cols: usize,
) {
    for (r, row) in acc.iter().enumerate() {
        for (c, &v) in row[..cols.min(C)].iter().enumerate() {
            let v = if v.is_nan() {
                f32::from_bits(CANONICAL_NAN)
            } else {
                v
            };
            // SAFETY: row r, column c < cols: inside the caller's block.
            unsafe { out.add(r * n + c).write(v) };
        }
    }
}

/// Rows `0..m` of `wide` (widened pairs, stride `kp`) times `panel` into `out` (row stride `n`),
/// emulated, in blocks of up to 3 rows × half a panel (6 accumulators, 4 widened weight
/// vectors, 2 of the smallest magnitudes and the activation pair: AVX2's 16 registers).
///
/// # Safety
/// `out` addresses `m` rows of the panel's columns, this task's alone.
#[inline(always)]
pub(super) unsafe fn panel_rows_emulated(
    wide: &[[f32; 2]],
    m: usize,
    panel: PairPanel<'_>,
    out: *mut f32,
) {
    const HALF: usize = NR / 2;
    let (kp, n, denormal) = (panel.kp, panel.n, panel.denormal);
    let c0 = panel.p * NR;
    let panel = panel.words;
    let width = NR.min(n - c0);
    let mut r0 = 0;
    while r0 < m {
        let rows = 3.min(m - r0);
        let rows_wide = &wide[r0 * kp..];
        macro_rules! block {
            ($r:literal) => {{
                let lo = microkernel_emulated::<$r, 0, HALF>(rows_wide, kp, panel, denormal);
                // SAFETY: rows r0..r0+$r of the caller's block, the panel's first columns.
                unsafe { store(&lo, out.add(r0 * n + c0), n, width) };
                if width > HALF {
                    let hi = microkernel_emulated::<$r, HALF, HALF>(rows_wide, kp, panel, denormal);
                    // SAFETY: as above, the columns past the first half.
                    unsafe { store(&hi, out.add(r0 * n + c0 + HALF), n, width - HALF) };
                }
            }};
        }
        match rows {
            3 => block!(3),
            2 => block!(2),
            _ => block!(1),
        }
        r0 += rows;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn panel_rows_emulated_fma(
    wide: &[[f32; 2]],
    m: usize,
    panel: PairPanel<'_>,
    out: *mut f32,
) {
    // SAFETY: forwarded from the caller.
    unsafe { panel_rows_emulated(wide, m, panel, out) }
}

/// Paired activations as the emulation's fast path reads them: each word's odd (high) and
/// even (low) bf16 widened to f32, in that order.
pub(super) fn widen_pairs(pairs: &[u32]) -> Vec<[f32; 2]> {
    pairs
        .iter()
        .map(|&w| [f32::from_bits(w & 0xffff_0000), f32::from_bits(w << 16)])
        .collect()
}
