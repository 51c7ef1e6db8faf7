//! The CPU GEMM of the opt-in bf16-activation mode (`activation_dtype="bfloat16"`): `x @ W`
//! with `W` in bf16 and the activations `x` rounded to bf16 once, per element, on the way in;
//! products of two bf16 values accumulated in f32 with **`VDPBF16PS` semantics**, which this
//! module defines once and runs either on the instruction (AVX-512 BF16) or in a portable
//! emulation that gives the same bits (`tests/gemm_abf16.rs` checks the two against each other
//! bit for bit, instruction by instruction and GEMM by GEMM, over random inputs with denormals,
//! infinities and values near the overflow threshold).
//!
//! The arithmetic, per output element `c[i][j]`, with `a = x[i]` rounded by
//! [`round_activation_bf16`] and K padded with a zero to even length:
//!
//! ```text
//! acc = +0.0
//! for p in 0..K/2:                      // k pairs in increasing order
//!     acc = ftz(fma(a[2p], w[2p][j], ftz(fma(a[2p+1], w[2p+1][j], acc))))
//! c[i][j] = acc, a NaN written as the canonical quiet NaN 0x7fc00000
//! ```
//!
//! where the bf16 inputs are widened exactly (bits << 16) with denormals read as signed zero
//! (DAZ), each `fma` rounds to nearest even once, and `ftz` replaces a tiny result (one whose
//! magnitude, rounded to 24 bits with an unbounded exponent, is below 2^-126: x86's
//! after-rounding tininess) by a zero of its sign. Odd element of the pair first: the SDM's
//! pseudocode for `VDPBF16PS`, checked on this machine by the conformance test.
//!
//! Every element is that one chain over its own row and column, whatever M, the row's index,
//! its neighbours, the thread count or whether the instruction or the emulation ran: the GEMM
//! is batch-, position- and thread-invariant and gives the same bits on every CPU. It is a
//! different function from the f32-activation GEMMs (`ops::gemm`, `ops::gemm_bf16`), so the
//! engine's fingerprint names the mode (`-abf16`).
//!
//! [`DotIsa::Amx`] (`activation_dtype="bfloat16_amx"`) runs the same rounded inputs on AMX
//! tiles instead: faster from M = 16 on, but `TDPBF16PS` does not accumulate in this order
//! (measured), so its bits are its own, reproducible on AMX-BF16 CPUs only, and the fingerprint
//! says `-abf16amx`. It is still batch-, position- and thread-invariant.
//!
//! Layout: panel `p` holds columns `p*NR .. p*NR+NR` of `W` as K/2 steps of NR words, word
//! `c` of step `s` = bf16 bits of `w[2s][c]` in the low half and of `w[2s+1][c]` in the high
//! half (zero past K and N): one 64-byte load is the second operand of one `VDPBF16PS` for 16
//! columns. A row of `a` becomes K/2 such words, each broadcast to all 16 lanes.

use std::mem::MaybeUninit;
use std::sync::{Arc, OnceLock};

use candle_core::{bail, CpuStorage, CustomOp1, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::gemm::{for_each_block, NR};
use super::{contiguous_f32, zeroed};

/// Rows per microkernel call (2 × MR accumulators, 2 weight vectors, 1 broadcast: 27 of 32
/// AVX-512 registers).
const MR: usize = 12;
/// Rows of A kept hot while all panels pass.
const ROW_BLOCK: usize = 96;
/// Pairs per AMX tile row (64 bytes), and rows per AMX tile.
const AMX_PAIRS: usize = 16;
const AMX_ROWS: usize = 16;
/// Words per panel step (one per column).
const WORDS: usize = NR;
/// The NaN every NaN output is written as.
pub const CANONICAL_NAN: u32 = 0x7fc0_0000;

/// How the bf16 dot products run. Both give the same bits; only speed differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DotIsa {
    /// `VDPBF16PS` (AVX-512 BF16).
    Avx512Bf16,
    /// The portable emulation: plain FMAs over chunks where a check shows flushing changed
    /// nothing, the definition lane by lane over the others (`microkernel_emulated`).
    Emulated,
    /// AMX tiles (`TDPBF16PS`, 16 pairs of k per instruction). **Other bits**: the tile
    /// instruction does not accumulate in `VDPBF16PS`'s order (measured: about half of all
    /// elements differ in the last bits), so results are reproducible only on CPUs with
    /// AMX-BF16, and the engine's fingerprint names it (`-abf16amx`). Still batch-, position-
    /// and thread-invariant: every output row is its own tile row, K walked in fixed tiles.
    Amx,
}

impl DotIsa {
    /// The fastest one this CPU runs.
    pub fn detect() -> Self {
        static ISA: OnceLock<DotIsa> = OnceLock::new();
        *ISA.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bf16")
                {
                    return DotIsa::Avx512Bf16;
                }
            }
            DotIsa::Emulated
        })
    }

    /// Whether this CPU runs AMX-BF16 tiles and the kernel lets this process use them
    /// (asked once, `arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)`).
    pub fn amx_available() -> bool {
        static AMX: OnceLock<bool> = OnceLock::new();
        *AMX.get_or_init(|| {
            #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
            {
                amx::request()
            }
            #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
            {
                false
            }
        })
    }

    /// Every one this CPU runs that gives the definition's bits (tests compare them bitwise;
    /// not [`DotIsa::Amx`]).
    pub fn available() -> Vec<Self> {
        let mut all = vec![DotIsa::Emulated];
        if Self::detect() == DotIsa::Avx512Bf16 {
            all.push(DotIsa::Avx512Bf16);
        }
        all
    }
}

/// An activation rounded to bf16 bits: `VCVTNEPS2BF16`'s definition, in integer arithmetic (the
/// same on every CPU): nearest, ties to even; zero and f32 denormals → zero of their sign;
/// infinities kept; NaN → its top 16 bits with the quiet bit set.
#[inline(always)]
pub fn round_activation_bf16(x: f32) -> u16 {
    // Selects, not branches, so that a row of them vectorises.
    let b = x.to_bits();
    let exp = b & 0x7f80_0000;
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let top = b >> 16;
    let special = if b & 0x007f_ffff != 0 {
        top | 0x0040
    } else {
        top
    };
    let r = if exp == 0x7f80_0000 { special } else { rounded };
    (if exp == 0 { top & 0x8000 } else { r }) as u16
}

/// A bf16 input as the instruction reads it: widened exactly, a denormal as a zero of its sign.
#[inline(always)]
fn widen_daz(h: u32) -> f32 {
    let b = h << 16;
    if b & 0x7f80_0000 == 0 {
        f32::from_bits(b & 0x8000_0000)
    } else {
        f32::from_bits(b)
    }
}

/// `fma(a, b, c)` rounded to nearest even, a tiny result flushed to a zero of its sign.
#[inline(always)]
fn fma_ftz(a: f32, b: f32, c: f32) -> f32 {
    let r = a.mul_add(b, c);
    let m = r.abs();
    if m < f32::MIN_POSITIVE || (m == f32::MIN_POSITIVE && tiny_before_denormal_rounding(a, b, c)) {
        f32::from_bits(r.to_bits() & 0x8000_0000)
    } else {
        r
    }
}

/// Whether `a·b + c`, which rounded to ±2^-126 at the denormal precision, is tiny after
/// rounding to 24 bits with an unbounded exponent (|exact| < 2^-126 − 2^-151). `a·b` of two
/// bf16 values is exact in f64 and `fma` rounds the sum once; at this magnitude the sum is
/// exact or far from the threshold (see the module's tests).
#[cold]
fn tiny_before_denormal_rounding(a: f32, b: f32, c: f32) -> bool {
    let v = f64::from(a).mul_add(f64::from(b), f64::from(c));
    // 2^-126 − 2^-151 = (2 − 2^-24)·2^-127: the midpoint between 2^-126 and the largest
    // 24-bit value below it.
    let threshold = f64::from_bits(0x380f_ffff_f000_0000);
    v.abs() < threshold
}

/// One `VDPBF16PS` lane in the portable emulation: `acc` plus the products of the bf16 pairs
/// `a` and `b` (each a word: even element in the low half, odd in the high half), odd first.
#[inline(always)]
pub fn dot_bf16_pair_emulated(acc: f32, a: u32, b: u32) -> f32 {
    let acc = if acc.to_bits() & 0x7f80_0000 == 0 {
        f32::from_bits(acc.to_bits() & 0x8000_0000)
    } else {
        acc
    };
    let t = fma_ftz(widen_daz(a >> 16), widen_daz(b >> 16), acc);
    fma_ftz(widen_daz(a & 0xffff), widen_daz(b & 0xffff), t)
}

/// 16 lanes of `VDPBF16PS` on the instruction; `None` where the CPU lacks AVX-512 BF16. For
/// the conformance test.
pub fn dot_bf16_pairs_hw(acc: &[f32; 16], a: &[u32; 16], b: &[u32; 16]) -> Option<[f32; 16]> {
    if DotIsa::detect() != DotIsa::Avx512Bf16 {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: the CPU has AVX-512F and AVX-512 BF16 (checked above).
        Some(unsafe { x86::dot16(acc, a, b) })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (acc, a, b);
        None
    }
}

/// 16 activations rounded by `VCVTNEPS2BF16`; `None` where the CPU lacks AVX-512 BF16. For
/// the conformance test of [`round_activation_bf16`].
pub fn round_activations_hw(x: &[f32; 16]) -> Option<[u16; 16]> {
    if DotIsa::detect() != DotIsa::Avx512Bf16 {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: the CPU has AVX-512F and AVX-512 BF16 (checked above).
        Some(unsafe { x86::cvt16(x) })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = x;
        None
    }
}

/// A `[K, N]` bf16 weight packed in k pairs for [`packed_matmul_abf16`].
#[derive(Debug)]
pub struct PackedWeightAbf16 {
    k: usize,
    n: usize,
    /// K/2 rounded up: the steps the exact kernels walk.
    kp: usize,
    /// Steps stored per panel: `kp` rounded up to a multiple of 16 with zero steps (whole AMX
    /// tiles of 16 pairs).
    kps: usize,
    data: Vec<u32>,
    /// Per panel: whether it holds a denormal weight (the emulation's fast path assumes none).
    denormal_panels: Vec<bool>,
}

impl PackedWeightAbf16 {
    /// Packs `W^T` given as the bf16 bits of the row-major `[n, k]` matrix `wt` (a checkpoint's
    /// `[out, in]`).
    pub fn from_transposed_bits(wt: &[u16], n: usize, k: usize) -> candle_core::Result<Self> {
        Self::pack(wt.len(), k, n, |kk, j| wt[j * k + kk])
    }

    /// Packs the bf16 bits of a row-major `[k, n]` matrix (`w[kk * n + j]`).
    pub fn from_row_major_bits(w: &[u16], k: usize, n: usize) -> candle_core::Result<Self> {
        Self::pack(w.len(), k, n, |kk, j| w[kk * n + j])
    }

    fn pack(
        len: usize,
        k: usize,
        n: usize,
        w: impl Fn(usize, usize) -> u16 + Sync,
    ) -> candle_core::Result<Self> {
        if len != k * n || k == 0 || n == 0 {
            bail!("packed bf16-activation weight: {len} values for a [{k}, {n}] matrix");
        }
        let kp = k.div_ceil(2);
        let kps = kp.next_multiple_of(AMX_PAIRS);
        let mut data = vec![0u32; n.div_ceil(NR) * kps * WORDS];
        data.par_chunks_mut(kps * WORDS)
            .enumerate()
            .for_each(|(p, panel)| {
                let c0 = p * NR;
                let bits = |kk: usize, c: usize| {
                    if kk < k && c0 + c < n {
                        u32::from(w(kk, c0 + c))
                    } else {
                        0
                    }
                };
                for (s, step) in panel.chunks_exact_mut(WORDS).enumerate() {
                    for (c, word) in step.iter_mut().enumerate() {
                        *word = bits(2 * s, c) | bits(2 * s + 1, c) << 16;
                    }
                }
            });
        let denormal = |h: u32| h & 0x7f80 == 0 && h & 0x007f != 0;
        let denormal_panels = data
            .par_chunks(kps * WORDS)
            .map(|panel| {
                panel
                    .iter()
                    .any(|&word| denormal(word & 0xffff) || denormal(word >> 16))
            })
            .collect();
        Ok(Self {
            k,
            n,
            kp,
            kps,
            data,
            denormal_panels,
        })
    }

    /// Inner dimension K.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Output columns N.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Bytes the packed weight holds.
    pub fn bytes(&self) -> usize {
        std::mem::size_of_val(self.data.as_slice())
    }

    /// Panel `p`'s `kp` steps (what the exact kernels walk).
    fn panel(&self, p: usize) -> &[u32] {
        let start = p * self.kps * WORDS;
        &self.data[start..start + self.kp * WORDS]
    }

    /// Panel `p`'s `kps` steps, zero steps included (AMX's whole tiles).
    #[cfg(target_arch = "x86_64")]
    fn panel_padded(&self, p: usize) -> &[u32] {
        &self.data[p * self.kps * WORDS..(p + 1) * self.kps * WORDS]
    }
}

/// The rows of `a` (`m × k` f32) rounded to bf16 and paired: `rows × kp` words (`rows ≥ m`;
/// rows past `m` and words past K/2 are zero).
fn pair_rows(a: &[f32], m: usize, k: usize, kp: usize, rows: usize) -> Vec<u32> {
    let mut out: Vec<u32> = Vec::with_capacity(rows * kp);
    #[cfg(target_arch = "x86_64")]
    let avx512 = std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw");
    // Each task writes its own row: the K/2 rounded up pairs of a real row, zeros in the
    // padding words past them and in the padding rows past `m`.
    let convert = |(row, dst): (usize, &mut [MaybeUninit<u32>])| {
        if row >= m {
            zeroed(dst);
            return;
        }
        let (pairs, padding) = dst.split_at_mut(k.div_ceil(2));
        zeroed(padding);
        let src = &a[row * k..(row + 1) * k];
        #[cfg(target_arch = "x86_64")]
        if avx512 {
            // SAFETY: the CPU has AVX-512F and AVX-512BW (checked above).
            unsafe { pair_row_avx512(src, pairs) };
            return;
        }
        pair_row(src, pairs);
    };
    let spare = &mut out.spare_capacity_mut()[..rows * kp];
    if m * k >= 1 << 16 {
        spare.par_chunks_mut(kp).enumerate().for_each(convert);
    } else {
        spare.chunks_mut(kp).enumerate().for_each(convert);
    }
    // SAFETY: `convert` wrote every element of every row chunk of the `rows * kp`.
    unsafe { out.set_len(rows * kp) };
    out
}

/// One row rounded and paired into `dst` (K/2 rounded up words; integer code, the same bits
/// on every instruction set).
#[inline(always)]
fn pair_row(src: &[f32], dst: &mut [MaybeUninit<u32>]) {
    let (pairs, rest) = src.as_chunks::<2>();
    for (d, pair) in dst.iter_mut().zip(pairs) {
        d.write(
            u32::from(round_activation_bf16(pair[0]))
                | u32::from(round_activation_bf16(pair[1])) << 16,
        );
    }
    if let [last] = rest {
        dst[src.len() / 2].write(u32::from(round_activation_bf16(*last)));
    }
}

/// [`pair_row`] compiled for AVX-512 (vectorised).
///
/// # Safety
/// The CPU has AVX-512F and AVX-512BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
unsafe fn pair_row_avx512(src: &[f32], dst: &mut [MaybeUninit<u32>]) {
    pair_row(src, dst)
}

/// Pairs of k per chunk of [`microkernel_emulated`]'s fast path: what one fallback redoes.
const CHUNK: usize = 32;

/// Steps `s0..s1` of the R × C block (columns `C0..C0+C` of the panel) added to `acc` by the
/// definition, lane by lane.
#[inline(always)]
fn exact_steps<const R: usize, const C0: usize, const C: usize>(
    acc: &mut [[f32; C]; R],
    a: &[u32],
    kp: usize,
    panel: &[u32],
    steps: std::ops::Range<usize>,
) {
    for s in steps {
        let step = &panel[s * WORDS + C0..s * WORDS + C0 + C];
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let ar = a[r * kp + s];
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

/// The R × C block (columns `C0..C0+C` of the panel) of rows `a` (R rows of `kp` words,
/// stride `kp`; `wide`: the same rows by [`widen_pairs`]) times `panel`, emulated.
///
/// The definition flushes denormal inputs and tiny results, which a vector loop cannot do
/// cheaply lane by lane. But where no input is denormal and no result is tiny, flushing changes
/// nothing and the definition is two plain FMAs per pair (odd element first). So the fast path
/// runs exactly that over chunks of [`CHUNK`] pairs, tracking the smallest magnitude of every
/// intermediate; a chunk that met a tiny one is redone from its starting accumulators by the
/// definition ([`exact_steps`]). Denormal inputs: activations never are ([`pair_rows`] rounds
/// them with [`round_activation_bf16`], which maps f32 denormals to zero and cannot round a
/// normal value below 2^-126), and a panel holding a denormal weight (`denormal_weights`)
/// runs the definition throughout. Same bits as the definition either way.
#[inline(always)]
fn microkernel_emulated<const R: usize, const C0: usize, const C: usize>(
    a: &[u32],
    wide: &[[f32; 2]],
    kp: usize,
    panel: &[u32],
    denormal_weights: bool,
) -> [[f32; C]; R] {
    let mut acc = [[0f32; C]; R];
    if denormal_weights {
        exact_steps::<R, C0, C>(&mut acc, a, kp, panel, 0..kp);
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
            exact_steps::<R, C0, C>(&mut acc, a, kp, panel, s0..s1);
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

/// Rows `0..m` of `a` (paired, stride `kp`) times panel `p` into `out` (row stride `n`),
/// emulated, in blocks of up to 3 rows × half a panel (6 accumulators, 4 widened weight
/// vectors, 2 of the smallest magnitudes and the activation pair: AVX2's 16 registers).
///
/// # Safety
/// `out` addresses `m` rows of the panel's columns, this task's alone.
#[inline(always)]
unsafe fn panel_rows_emulated(
    a: &[u32],
    wide: &[[f32; 2]],
    m: usize,
    w: &PackedWeightAbf16,
    p: usize,
    out: *mut f32,
) {
    const HALF: usize = NR / 2;
    let (kp, n) = (w.kp, w.n);
    let panel = w.panel(p);
    let denormal = w.denormal_panels[p];
    let c0 = p * NR;
    let width = NR.min(n - c0);
    let mut r0 = 0;
    while r0 < m {
        let rows = 3.min(m - r0);
        let (a_rows, wide_rows) = (&a[r0 * kp..], &wide[r0 * kp..]);
        macro_rules! block {
            ($r:literal) => {{
                let lo =
                    microkernel_emulated::<$r, 0, HALF>(a_rows, wide_rows, kp, panel, denormal);
                // SAFETY: rows r0..r0+$r of the caller's block, the panel's first columns.
                unsafe { store(&lo, out.add(r0 * n + c0), n, width) };
                if width > HALF {
                    let hi = microkernel_emulated::<$r, HALF, HALF>(
                        a_rows, wide_rows, kp, panel, denormal,
                    );
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
unsafe fn panel_rows_emulated_fma(
    a: &[u32],
    wide: &[[f32; 2]],
    m: usize,
    w: &PackedWeightAbf16,
    p: usize,
    out: *mut f32,
) {
    // SAFETY: forwarded from the caller.
    unsafe { panel_rows_emulated(a, wide, m, w, p, out) }
}

/// Paired activations as the emulation's fast path reads them: each word's odd (high) and
/// even (low) bf16 widened to f32, in that order.
fn widen_pairs(pairs: &[u32]) -> Vec<[f32; 2]> {
    pairs
        .iter()
        .map(|&w| [f32::from_bits(w & 0xffff_0000), f32::from_bits(w << 16)])
        .collect()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{PackedWeightAbf16, CANONICAL_NAN, MR, NR, WORDS};

    /// 16 lanes of `VDPBF16PS`.
    ///
    /// # Safety
    /// The CPU has AVX-512F and AVX-512 BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn dot16(acc: &[f32; 16], a: &[u32; 16], b: &[u32; 16]) -> [f32; 16] {
        let mut out = [0f32; 16];
        // SAFETY: 16-element arrays are 64 readable/writable bytes; unaligned loads/stores.
        unsafe {
            let c = _mm512_loadu_ps(acc.as_ptr());
            let a: __m512bh = std::mem::transmute(_mm512_loadu_si512(a.as_ptr().cast()));
            let b: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.as_ptr().cast()));
            _mm512_storeu_ps(out.as_mut_ptr(), _mm512_dpbf16_ps(c, a, b));
        }
        out
    }

    /// 16 values through `VCVTNEPS2BF16`.
    ///
    /// # Safety
    /// The CPU has AVX-512F and AVX-512 BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn cvt16(x: &[f32; 16]) -> [u16; 16] {
        let mut out = [0u16; 16];
        // SAFETY: 64 readable bytes in, 32 writable bytes out; unaligned load/store.
        unsafe {
            let v = _mm512_cvtneps_pbh(_mm512_loadu_ps(x.as_ptr()));
            _mm256_storeu_si256(
                out.as_mut_ptr().cast(),
                std::mem::transmute::<__m256bh, __m256i>(v),
            );
        }
        out
    }

    /// The R × NR block: rows `a` (stride `kp` words) times `panel`, NaN canonical, first
    /// `width` columns written at `out` (row stride `n`).
    ///
    /// # Safety
    /// AVX-512F and AVX-512 BF16; `a` holds R rows of `kp` words; `panel` holds `kp` steps;
    /// `out` addresses R rows of `width` writable floats at stride `n`, this task's alone.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn block<const R: usize>(
        a: *const u32,
        kp: usize,
        panel: *const u32,
        out: *mut f32,
        n: usize,
        width: usize,
    ) {
        // SAFETY: as the function's contract says; every load is unaligned-safe.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); 2]; R];
            for s in 0..kp {
                let w = panel.add(s * WORDS);
                let w0: __m512bh = std::mem::transmute(_mm512_loadu_si512(w.cast()));
                let w1: __m512bh = std::mem::transmute(_mm512_loadu_si512(w.add(16).cast()));
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let ar: __m512bh =
                        std::mem::transmute(_mm512_set1_epi32(*a.add(r * kp + s) as i32));
                    acc_r[0] = _mm512_dpbf16_ps(acc_r[0], ar, w0);
                    acc_r[1] = _mm512_dpbf16_ps(acc_r[1], ar, w1);
                }
            }
            let nan = _mm512_castsi512_ps(_mm512_set1_epi32(CANONICAL_NAN as i32));
            for (r, acc_r) in acc.iter().enumerate() {
                let row = out.add(r * n);
                for (h, &v) in acc_r.iter().enumerate() {
                    let v = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v), nan);
                    let lo = h * 16;
                    if width >= lo + 16 {
                        _mm512_storeu_ps(row.add(lo), v);
                    } else if width > lo {
                        let mask: __mmask16 = (1u32 << (width - lo)) as u16 - 1;
                        _mm512_mask_storeu_ps(row.add(lo), mask, v);
                    }
                }
            }
        }
    }

    /// Rows `0..m` of `a` (paired, stride `kp`) times panel `p` into `out` (row stride `n`).
    ///
    /// # Safety
    /// AVX-512F and AVX-512 BF16; `a` holds `m × kp` words; `out` addresses `m` rows of the
    /// panel's columns, this task's alone.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn panel_rows(
        a: &[u32],
        m: usize,
        w: &PackedWeightAbf16,
        p: usize,
        out: *mut f32,
    ) {
        let (kp, n) = (w.kp, w.n);
        let panel = w.panel(p).as_ptr();
        let c0 = p * NR;
        let width = NR.min(n - c0);
        let mut r0 = 0;
        while r0 < m {
            let rows = MR.min(m - r0);
            // SAFETY: rows r0..r0+rows of `a` and of the caller's block (contract above).
            unsafe {
                let a = a.as_ptr().add(r0 * kp);
                let dst = out.add(r0 * n + c0);
                match rows {
                    12 => block::<12>(a, kp, panel, dst, n, width),
                    11 => block::<11>(a, kp, panel, dst, n, width),
                    10 => block::<10>(a, kp, panel, dst, n, width),
                    9 => block::<9>(a, kp, panel, dst, n, width),
                    8 => block::<8>(a, kp, panel, dst, n, width),
                    7 => block::<7>(a, kp, panel, dst, n, width),
                    6 => block::<6>(a, kp, panel, dst, n, width),
                    5 => block::<5>(a, kp, panel, dst, n, width),
                    4 => block::<4>(a, kp, panel, dst, n, width),
                    3 => block::<3>(a, kp, panel, dst, n, width),
                    2 => block::<2>(a, kp, panel, dst, n, width),
                    _ => block::<1>(a, kp, panel, dst, n, width),
                }
            }
            r0 += rows;
        }
    }
}

/// `a[m, k] @ w` into a new `[m, n]` buffer, with the given way of running the dot products
/// (an instruction set this CPU lacks falls back to the emulation: same bits).
pub fn packed_matmul_abf16_with(
    a: &[f32],
    m: usize,
    w: &PackedWeightAbf16,
    isa: DotIsa,
) -> candle_core::Result<Vec<f32>> {
    let (k, n, kp) = (w.k, w.n, w.kp);
    if a.len() != m * k {
        bail!(
            "packed bf16-activation matmul: input has {} values, expected [{m}, {k}]",
            a.len()
        );
    }
    let isa = if isa == DotIsa::Avx512Bf16 && DotIsa::detect() != DotIsa::Avx512Bf16 {
        DotIsa::Emulated
    } else {
        isa
    };
    if isa == DotIsa::Amx {
        return amx_matmul(a, m, w);
    }
    #[cfg(target_arch = "x86_64")]
    let fma =
        std::arch::is_x86_feature_detected!("fma") && std::arch::is_x86_feature_detected!("avx2");
    let pairs = pair_rows(a, m, k, kp, m);
    let wide = if isa == DotIsa::Emulated {
        widen_pairs(&pairs)
    } else {
        Vec::new()
    };
    Ok(for_each_block(m, n, k, ROW_BLOCK, |r0, rows, p, out| {
        let a_block = &pairs[r0 * kp..(r0 + rows) * kp];
        let wide_block = wide.get(r0 * kp..(r0 + rows) * kp).unwrap_or_default();
        // SAFETY: `out` is row r0 of the m × n buffer and rows r0..r0+rows of panel p are
        // this task's alone; AVX-512 BF16 (resp. AVX2+FMA) is used only where detected.
        unsafe {
            match isa {
                #[cfg(target_arch = "x86_64")]
                DotIsa::Avx512Bf16 => x86::panel_rows(a_block, rows, w, p, out),
                #[cfg(target_arch = "x86_64")]
                DotIsa::Emulated if fma => {
                    panel_rows_emulated_fma(a_block, wide_block, rows, w, p, out)
                }
                _ => panel_rows_emulated(a_block, wide_block, rows, w, p, out),
            }
        }
    }))
}

/// `a[m, k] @ w` on AMX tiles ([`DotIsa::Amx`]); an error where the CPU or the kernel does
/// not allow them.
fn amx_matmul(a: &[f32], m: usize, w: &PackedWeightAbf16) -> candle_core::Result<Vec<f32>> {
    if !DotIsa::amx_available() {
        bail!("the AMX bf16 GEMM needs a CPU with AMX-BF16 (and a kernel that grants it)");
    }
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        let (k, n, kps) = (w.k, w.n, w.kps);
        let rows16 = m.next_multiple_of(AMX_ROWS);
        let pairs = pair_rows(a, m, k, kps, rows16);
        // 64-row blocks: the tile kernel walks them 32 rows at a time.
        Ok(for_each_block(m, n, k, 64, |r0, rows, p, out| {
            // SAFETY: AMX is available (checked above); `pairs` holds whole 16-row tiles of
            // `kps` words from row r0 on; rows r0..r0+rows of panel p's columns are this
            // task's alone and inside the m × n buffer.
            unsafe {
                amx::panel_rows(
                    &pairs[r0 * kps..],
                    rows,
                    kps,
                    w.panel_padded(p),
                    out.add(p * NR),
                    n,
                    NR.min(n - p * NR),
                )
            };
        }))
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    {
        let _ = (a, m, w);
        bail!("the AMX bf16 GEMM runs on x86-64 Linux only")
    }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod amx {
    use std::arch::asm;

    use super::{AMX_PAIRS, AMX_ROWS, CANONICAL_NAN, NR, WORDS};

    /// Whether the CPU has AMX-BF16 and AMX-TILE (CPUID.(7,0):EDX bits 22 and 24) and the
    /// kernel grants this process the tile data state.
    pub(super) fn request() -> bool {
        // CPUID leaf 7 exists on every x86-64 CPU that has AVX-512 (checked first).
        let has = std::arch::is_x86_feature_detected!("avx512f") && {
            let r = std::arch::x86_64::__cpuid_count(7, 0);
            r.edx & (1 << 22) != 0 && r.edx & (1 << 24) != 0
        };
        if !has {
            return false;
        }
        const SYS_ARCH_PRCTL: usize = 158;
        const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
        const XFEATURE_XTILEDATA: usize = 18;
        let ret: isize;
        // SAFETY: the arch_prctl system call with two integer arguments; it touches no memory
        // of ours. The syscall instruction clobbers rcx and r11.
        unsafe {
            asm!(
                "syscall",
                inlateout("rax") SYS_ARCH_PRCTL as isize => ret,
                in("rdi") ARCH_REQ_XCOMP_PERM,
                in("rsi") XFEATURE_XTILEDATA,
                lateout("rcx") _,
                lateout("r11") _,
                options(nostack),
            );
        }
        ret == 0
    }

    /// Tile configuration (palette 1), every tile 16 rows × 64 bytes: tmm0–tmm3 the C block
    /// (rows 0..16 / 16..32 × columns 0..16 / 16..32, f32), tmm4/tmm5 the A tiles (16 rows ×
    /// 16 pairs each), tmm6/tmm7 the B halves (16 pairs × 16 columns each).
    fn config() -> [u8; 64] {
        let mut cfg = [0u8; 64];
        cfg[0] = 1;
        for t in 0..8 {
            cfg[16 + 2 * t] = 64;
            cfg[48 + t] = AMX_ROWS as u8;
        }
        cfg
    }

    /// Copies `rows` rows of a stored C block (`NR` floats per row) to `out`, NaN canonical.
    /// AVX-512 (every AMX CPU has it): at K = 512 a scalar copy cost a third of the tile work.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `out` addresses `rows` rows of `width` writable floats at stride
    /// `n`.
    #[target_feature(enable = "avx512f")]
    unsafe fn copy_out(tile: &[[f32; NR]], rows: usize, out: *mut f32, n: usize, width: usize) {
        use std::arch::x86_64::*;
        let nan = _mm512_set1_ps(f32::from_bits(CANONICAL_NAN));
        // Column masks of the two 16-float halves of a row.
        let mask = |from: usize| -> __mmask16 {
            let cols = width.saturating_sub(from).min(16);
            ((1u32 << cols) - 1) as __mmask16
        };
        let (m0, m1) = (mask(0), mask(16));
        for (r, row) in tile.iter().enumerate().take(rows) {
            for (half, m) in [(0, m0), (16, m1)] {
                if m == 0 {
                    continue;
                }
                // SAFETY: `row[half..half + 16]` is inside the row; the masked store writes
                // columns below `width` of row r < rows (the caller's contract).
                unsafe {
                    let v = _mm512_loadu_ps(row.as_ptr().add(half));
                    let v = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v), nan);
                    _mm512_mask_storeu_ps(out.add(r * n + half), m, v);
                }
            }
        }
    }

    /// Rows `0..m` of `a` (paired, stride `kps`, whole 16-row tiles readable) times a panel
    /// (`kps` steps of NR words) into `out` (row stride `n`, `width` columns). 32 rows at a
    /// time (four C tiles; each A and B tile loaded once per 16 pairs of k), then 16.
    ///
    /// # Safety
    /// AMX-BF16 is usable by this process; `a` holds `m` rounded up to 16 rows of `kps`
    /// words; `kps` is a multiple of 16; `out` addresses `m` rows of `width` writable floats
    /// at stride `n`, this task's alone.
    pub(super) unsafe fn panel_rows(
        a: &[u32],
        m: usize,
        kps: usize,
        panel: &[u32],
        out: *mut f32,
        n: usize,
        width: usize,
    ) {
        let cfg = config();
        let mut tile = [[0f32; NR]; 2 * AMX_ROWS];
        let a_stride = kps * 4;
        let b_stride = WORDS * 4;
        let c_stride = NR * 4;
        let chunks = kps / AMX_PAIRS;
        // SAFETY: the caller vouches for AMX and the buffers; every tile load reads 16 rows of
        // 64 bytes inside `a` (whole 16-row tiles, rows r0..r0+32 exist when more than 16
        // rows remain) or `panel` (kps steps); the stores write `tile` (32 rows × NR floats).
        unsafe {
            asm!("ldtilecfg [{0}]", in(reg) cfg.as_ptr(), options(nostack, readonly));
            let tp = tile.as_mut_ptr() as *mut f32;
            let mut r0 = 0;
            while r0 < m {
                let a_rows = a.as_ptr().add(r0 * kps);
                let rows = m - r0;
                if rows > AMX_ROWS {
                    asm!(
                        "tilezero tmm0",
                        "tilezero tmm1",
                        "tilezero tmm2",
                        "tilezero tmm3",
                        options(nostack, nomem)
                    );
                    for kc in 0..chunks {
                        let at = a_rows.add(kc * AMX_PAIRS);
                        let bt = panel.as_ptr().add(kc * AMX_PAIRS * WORDS);
                        asm!(
                            "tileloadd tmm6, [{b} + {sb}*1]",
                            "tileloadd tmm4, [{a} + {sa}*1]",
                            "tdpbf16ps tmm0, tmm4, tmm6",
                            "tileloadd tmm7, [{b1} + {sb}*1]",
                            "tdpbf16ps tmm1, tmm4, tmm7",
                            "tileloadd tmm5, [{a1} + {sa}*1]",
                            "tdpbf16ps tmm2, tmm5, tmm6",
                            "tdpbf16ps tmm3, tmm5, tmm7",
                            a = in(reg) at,
                            a1 = in(reg) at.add(AMX_ROWS * kps),
                            sa = in(reg) a_stride,
                            b = in(reg) bt,
                            b1 = in(reg) bt.add(16),
                            sb = in(reg) b_stride,
                            options(nostack, readonly),
                        );
                    }
                    asm!(
                        "tilestored [{c} + {s}*1], tmm0",
                        "tilestored [{c1} + {s}*1], tmm1",
                        "tilestored [{c2} + {s}*1], tmm2",
                        "tilestored [{c3} + {s}*1], tmm3",
                        c = in(reg) tp,
                        c1 = in(reg) tp.add(16),
                        c2 = in(reg) tp.add(AMX_ROWS * NR),
                        c3 = in(reg) tp.add(AMX_ROWS * NR + 16),
                        s = in(reg) c_stride,
                        options(nostack),
                    );
                    copy_out(&tile, rows.min(2 * AMX_ROWS), out.add(r0 * n), n, width);
                    r0 += 2 * AMX_ROWS;
                } else {
                    asm!("tilezero tmm0", "tilezero tmm1", options(nostack, nomem));
                    for kc in 0..chunks {
                        let at = a_rows.add(kc * AMX_PAIRS);
                        let bt = panel.as_ptr().add(kc * AMX_PAIRS * WORDS);
                        asm!(
                            "tileloadd tmm4, [{a} + {sa}*1]",
                            "tileloadd tmm6, [{b} + {sb}*1]",
                            "tileloadd tmm7, [{b1} + {sb}*1]",
                            "tdpbf16ps tmm0, tmm4, tmm6",
                            "tdpbf16ps tmm1, tmm4, tmm7",
                            a = in(reg) at,
                            sa = in(reg) a_stride,
                            b = in(reg) bt,
                            b1 = in(reg) bt.add(16),
                            sb = in(reg) b_stride,
                            options(nostack, readonly),
                        );
                    }
                    asm!(
                        "tilestored [{c} + {s}*1], tmm0",
                        "tilestored [{c1} + {s}*1], tmm1",
                        c = in(reg) tp,
                        c1 = in(reg) tp.add(16),
                        s = in(reg) c_stride,
                        options(nostack),
                    );
                    copy_out(&tile, rows, out.add(r0 * n), n, width);
                    r0 += AMX_ROWS;
                }
            }
            asm!("tilerelease", options(nostack, nomem));
        }
    }
}

/// `a[m, k] @ w` with the fastest way this CPU has.
pub fn packed_matmul_abf16(
    a: &[f32],
    m: usize,
    w: &PackedWeightAbf16,
) -> candle_core::Result<Vec<f32>> {
    packed_matmul_abf16_with(a, m, w, DotIsa::detect())
}

struct PackedMatmulAbf16 {
    w: Arc<PackedWeightAbf16>,
    amx: bool,
}

impl CustomOp1 for PackedMatmulAbf16 {
    fn name(&self) -> &'static str {
        "detspec-packed-matmul-abf16"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(s, l, "matmul input")?;
        let (wk, wn) = (self.w.k, self.w.n);
        let (m, k) = match l.dims() {
            [m, k] => (*m, *k),
            dims => bail!("matmul: input must be [rows, {wk}], got {dims:?}"),
        };
        if k != wk {
            bail!("matmul: input has {k} columns, weight has {wk} rows");
        }
        let isa = if self.amx {
            DotIsa::Amx
        } else {
            DotIsa::detect()
        };
        let out = packed_matmul_abf16_with(x, m, &self.w, isa)?;
        Ok((CpuStorage::F32(out), Shape::from((m, wn))))
    }
}

/// `x[m, k] @ w` as a candle op (CPU; `x` f32, rounded to bf16 inside; output f32); `amx`: on
/// AMX tiles ([`DotIsa::Amx`], its own bits), else the exact kernels.
pub fn matmul_packed_abf16(
    x: &Tensor,
    w: &Arc<PackedWeightAbf16>,
    amx: bool,
) -> candle_core::Result<Tensor> {
    x.contiguous()?
        .apply_op1_no_bwd(&PackedMatmulAbf16 { w: w.clone(), amx })
}
