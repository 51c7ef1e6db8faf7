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

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod amx;
mod emulated;
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(target_arch = "x86_64")]
use emulated::panel_rows_emulated_fma;
use emulated::{panel_rows_emulated, widen_pairs};

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

/// One panel as the exact kernels read it: `kp` steps of [`WORDS`] pair words.
#[derive(Clone, Copy)]
pub struct PairPanel<'a> {
    pub(crate) words: &'a [u32],
    /// It may hold a denormal weight (the emulation's fast path assumes none; a panel said to
    /// when it does not only runs the definition, same bits).
    pub(crate) denormal: bool,
    pub(crate) kp: usize,
    /// The weight's columns (the output's row stride).
    pub(crate) n: usize,
    /// Its index: it is the output's columns `p * NR ..`.
    pub(crate) p: usize,
}

/// A weight the bf16-activation GEMM multiplies by, as panels of pair words: stored so
/// ([`PackedWeightAbf16`]), or widened into them as they are needed (MXFP4's, whose values
/// are exact in bf16, so the bits are those of the stored widened weight).
pub trait PairPanels: Sync + Send + std::fmt::Debug + 'static {
    const OP_NAME: &'static str;

    fn k(&self) -> usize;

    fn n(&self) -> usize;

    /// `f` of panel `p`.
    fn with_panel<R>(&self, p: usize, f: impl FnOnce(PairPanel<'_>) -> R) -> R;

    /// Steps a panel is widened in at a time by [`Self::widen_run`] on `VDPBF16PS` (whose
    /// kernel carries its sums from run to run); 0: it is read whole ([`Self::with_panel`]).
    const RUN_STEPS: usize = 0;

    /// Run `run` (steps `run × RUN_STEPS ..`) of panel `p` into `out` (RUN_STEPS × NR words).
    fn widen_run(&self, p: usize, run: usize, out: &mut [u32]) {
        let _ = (p, run, out);
    }

    /// `a[m, k] @ self` on AMX tiles ([`DotIsa::Amx`]).
    fn amx_matmul(&self, a: &[f32], m: usize) -> candle_core::Result<Vec<f32>> {
        let _ = (a, m);
        bail!("{}: no AMX kernel for this weight", Self::OP_NAME)
    }
}

impl PairPanels for PackedWeightAbf16 {
    const OP_NAME: &'static str = "detspec-packed-matmul-abf16";

    fn k(&self) -> usize {
        self.k
    }

    fn n(&self) -> usize {
        self.n
    }

    fn with_panel<R>(&self, p: usize, f: impl FnOnce(PairPanel<'_>) -> R) -> R {
        let start = p * self.kps * WORDS;
        f(PairPanel {
            words: &self.data[start..start + self.kp * WORDS],
            denormal: self.denormal_panels[p],
            kp: self.kp,
            n: self.n,
            p,
        })
    }

    fn amx_matmul(&self, a: &[f32], m: usize) -> candle_core::Result<Vec<f32>> {
        amx_matmul(a, m, self)
    }
}

/// `a[m, k] @ w` into a new `[m, n]` buffer, with the given way of running the dot products
/// (an instruction set this CPU lacks falls back to the emulation: same bits).
pub fn packed_matmul_abf16_with<W: PairPanels>(
    a: &[f32],
    m: usize,
    w: &W,
    isa: DotIsa,
) -> candle_core::Result<Vec<f32>> {
    let (k, n) = (w.k(), w.n());
    let kp = k.div_ceil(2);
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
        return w.amx_matmul(a, m);
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
        #[cfg(target_arch = "x86_64")]
        if isa == DotIsa::Avx512Bf16 && W::RUN_STEPS > 0 {
            // SAFETY: as below.
            unsafe { x86::panel_rows_runs(a_block, rows, w, p, out) };
            return;
        }
        w.with_panel(p, |panel| {
            // SAFETY: `out` is row r0 of the m × n buffer and rows r0..r0+rows of panel p are
            // this task's alone; AVX-512 BF16 (resp. AVX2+FMA) is used only where detected.
            unsafe {
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    DotIsa::Avx512Bf16 => x86::panel_rows(a_block, rows, panel, out),
                    #[cfg(target_arch = "x86_64")]
                    DotIsa::Emulated if fma => {
                        panel_rows_emulated_fma(wide_block, rows, panel, out)
                    }
                    _ => panel_rows_emulated(wide_block, rows, panel, out),
                }
            }
        })
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

/// `a[m, k] @ w` with the fastest way this CPU has.
pub fn packed_matmul_abf16<W: PairPanels>(
    a: &[f32],
    m: usize,
    w: &W,
) -> candle_core::Result<Vec<f32>> {
    packed_matmul_abf16_with(a, m, w, DotIsa::detect())
}

struct PackedMatmulAbf16<W> {
    w: Arc<W>,
    amx: bool,
}

impl<W: PairPanels> CustomOp1 for PackedMatmulAbf16<W> {
    fn name(&self) -> &'static str {
        W::OP_NAME
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(s, l, "matmul input")?;
        let (wk, wn) = (self.w.k(), self.w.n());
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
        let out = packed_matmul_abf16_with(x, m, &*self.w, isa)?;
        Ok((CpuStorage::F32(out), Shape::from((m, wn))))
    }
}

/// `x[m, k] @ w` as a candle op (CPU; `x` f32, rounded to bf16 inside; output f32); `amx`: on
/// AMX tiles ([`DotIsa::Amx`], its own bits), else the exact kernels.
pub fn matmul_packed_abf16<W: PairPanels>(
    x: &Tensor,
    w: &Arc<W>,
    amx: bool,
) -> candle_core::Result<Tensor> {
    x.contiguous()?
        .apply_op1_no_bwd(&PackedMatmulAbf16 { w: w.clone(), amx })
}
