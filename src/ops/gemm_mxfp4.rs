//! The CPU GEMM with MXFP4 weights (gpt-oss's experts): `x @ W` where `x` is f32 and `W` is
//! held as its checkpoint stores it, 4-bit E2M1 codes with one power-of-two scale per 32
//! inputs, packed once at load. Activations, products and accumulation are f32.
//!
//! Same kernel as the f32 GEMM (`ops::gemm`: same panels, register block, task split and
//! driver); only a panel's storage differs. Each k step of a panel holds its [`NR`] = 32
//! codes in 16 bytes (byte `c`: column `c` in the low nibble, column `c + 16` in the high),
//! and each run of 32 k steps the 32 columns' scale exponents. A run widens to f32, as
//! `E2M1[code] · 2^(scale − 127)`, into a 4 KB buffer the f32 microkernel folds
//! (`PanelSteps::fold`). The widening is exact (an E2M1 value has at most two significant
//! bits), so every output element is the f32 GEMM's FMA chain over the widened weights. The
//! MXFP4 GEMM gives **the bits of the f32 and bf16 GEMMs on the widened weights**, and their
//! invariances (`tests/gemm_mxfp4.rs`), in 0.53 bytes a weight where bf16 takes 2.
//!
//! The bf16-activation mode's GEMM (`ops::gemm_abf16`) reads the same packed weight: each
//! panel is widened, as that GEMM is about to multiply by it, into the bf16 pair words its
//! stored weights hold ([`PairPanels`]). A widened value is exact in bf16 too (its f32 bits'
//! top half), so that GEMM gives the bits it gives on the widened weights stored in bf16.

use std::cell::RefCell;
use std::sync::Arc;

use candle_core::{bail, Tensor};

use super::gemm::{
    apply_packed, fold_widened_panel, matmul_panels, new_weight_number, PanelSteps, Panels,
    Reduction, NR, WIDEN_WHOLE_PAST,
};
use super::gemm_abf16::{PairPanel, PairPanels};
use super::isa::isa_kernel;
use super::CpuIsa;
use crate::config::KernelProfile;

/// Inputs sharing one scale.
pub const MXFP4_BLOCK: usize = 32;
/// Bytes of codes per panel step (two codes a byte).
const STEP_BYTES: usize = NR / 2;
/// MXFP4 blocks the bf16-activation GEMM widens at a time (`PairPanels::RUN_STEPS`).
const RUN_BLOCKS: usize = 4;

/// The E2M1 code points: sign bit, two exponent bits, one mantissa bit.
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// `2^(e − 127)` for every E8M0 scale byte `e` (255, E8M0's NaN, gives 2^128: infinite, as
/// transformers' `ldexp` does).
pub static E8M0: [f32; 256] = e8m0_table();

const fn e8m0_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut e = 1;
    while e < 255 {
        t[e] = f32::from_bits((e as u32) << 23);
        e += 1;
    }
    t[0] = f32::from_bits(1 << 22); // 2^-127, subnormal
    t[255] = f32::INFINITY;
    t
}

/// A `[K, N]` weight in MXFP4, packed into column panels for [`packed_matmul_mxfp4`].
#[derive(Debug)]
pub struct PackedWeightMxfp4 {
    k: usize,
    n: usize,
    /// Per panel, K steps of codes.
    codes: Vec<[u8; STEP_BYTES]>,
    /// Per panel, K / 32 runs of the columns' scale bytes.
    scales: Vec<[u8; NR]>,
    /// This weight's number (`gemm::fold_widened_panel`).
    id: u64,
}

impl PackedWeightMxfp4 {
    /// Packs `W^T` from a checkpoint's MXFP4 tensors of one `[rows, k]` matrix: `blocks`
    /// (`[rows, k / 32, 16]` code bytes, the low nibble the even input) and `scales`
    /// (`[rows, k / 32]`). Column `j` of `W` is checkpoint row `rows[j]` (gpt-oss's gate and
    /// up alternate rows).
    pub fn from_blocks(
        blocks: &[u8],
        scales: &[u8],
        rows: &[usize],
        k: usize,
    ) -> candle_core::Result<Self> {
        use rayon::prelude::*;
        let n = rows.len();
        if k == 0 || n == 0 || !k.is_multiple_of(MXFP4_BLOCK) {
            bail!("packed MXFP4 weight: [{k}, {n}] (k must be a multiple of {MXFP4_BLOCK})");
        }
        let groups = k / MXFP4_BLOCK;
        let row_bytes = groups * STEP_BYTES;
        let stored = blocks.len() / row_bytes.max(1);
        if !blocks.len().is_multiple_of(row_bytes) || scales.len() != stored * groups {
            bail!(
                "packed MXFP4 weight: {} code bytes and {} scales are not rows of {k} inputs",
                blocks.len(),
                scales.len()
            );
        }
        if let Some(bad) = rows.iter().find(|&&r| r >= stored) {
            bail!("packed MXFP4 weight: row {bad} of {stored}");
        }
        let panels = n.div_ceil(NR);
        let mut codes = vec![[0u8; STEP_BYTES]; panels * k];
        let mut packed_scales = vec![[0u8; NR]; panels * groups];
        codes
            .par_chunks_mut(k)
            .zip(packed_scales.par_chunks_mut(groups))
            .enumerate()
            .for_each(|(p, (panel, panel_scales))| {
                let cols = &rows[p * NR..((p + 1) * NR).min(n)];
                // A checkpoint row at a time, read in order (one byte: inputs 2j and 2j + 1);
                // the panel (k × 16 bytes) stays in cache while its 32 rows stream in.
                for (c, &r) in cols.iter().enumerate() {
                    let (byte, shift) = (c % STEP_BYTES, 4 * (c / STEP_BYTES));
                    let row = &blocks[r * row_bytes..(r + 1) * row_bytes];
                    for (pair, &b) in panel.chunks_exact_mut(2).zip(row) {
                        pair[0][byte] |= (b & 0x0f) << shift;
                        pair[1][byte] |= (b >> 4) << shift;
                    }
                }
                for (g, run) in panel_scales.iter_mut().enumerate() {
                    for (c, &r) in cols.iter().enumerate() {
                        run[c] = scales[r * groups + g];
                    }
                }
            });
        Ok(Self {
            k,
            n,
            codes,
            scales: packed_scales,
            id: new_weight_number(),
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

    /// Bytes the packed weight holds (17 per 32 elements, plus the last panel's padding).
    pub fn bytes(&self) -> usize {
        std::mem::size_of_val(self.codes.as_slice()) + std::mem::size_of_val(self.scales.as_slice())
    }
}

/// One panel's steps from step `k0` on.
#[derive(Clone, Copy)]
pub(super) struct Mxfp4Panel<'a> {
    codes: &'a [[u8; STEP_BYTES]],
    scales: &'a [[u8; NR]],
    k0: usize,
    /// The weight's number and the panel's index.
    key: (u64, usize),
    /// Widened whole, once per thread (`gemm::fold_widened_panel`): the GEMM's register
    /// blocks will read it more than once.
    whole: bool,
}

impl<'a> PanelSteps for Mxfp4Panel<'a> {
    #[inline(always)]
    fn skip_steps(self, k0: usize) -> Self {
        Self {
            k0: self.k0 + k0,
            ..self
        }
    }

    /// A run of up to 32 steps at a time: widened into a buffer by one call ([`widen_run`]),
    /// then folded as an f32 panel. Widened step by step inside the microkernel instead (as
    /// the bf16 panels are), the codes were not vectorised in decode's 1- to 3-row blocks (13×
    /// the bf16 GEMM's time at M = 1), and a call per step spilled the larger blocks'
    /// accumulators.
    #[inline(always)]
    unsafe fn fold<const R: usize, const C0: usize, const C: usize>(
        self,
        a: *const f32,
        lda: usize,
        k: usize,
        mut acc: [[f32; C]; R],
    ) -> [[f32; C]; R] {
        let isa = CpuIsa::detect();
        if self.whole {
            let widen = |steps: &mut [[f32; NR]]| {
                for (g, (run, codes)) in steps
                    .chunks_exact_mut(MXFP4_BLOCK)
                    .zip(self.codes.chunks_exact(MXFP4_BLOCK))
                    .enumerate()
                {
                    if let Ok(run) = <&mut [[f32; NR]; MXFP4_BLOCK]>::try_from(run) {
                        widen_any(isa, codes, &self.scales[g], run);
                    }
                }
            };
            let k_total = self.codes.len();
            // SAFETY: the caller's contract.
            return unsafe {
                fold_widened_panel::<R, C0, C>(
                    self.key,
                    k_total,
                    widen,
                    self.k0..self.k0 + k,
                    a,
                    lda,
                    acc,
                )
            };
        }
        let mut run = [[0f32; NR]; MXFP4_BLOCK];
        let mut kk = 0;
        while kk < k {
            let at = self.k0 + kk;
            let n = (MXFP4_BLOCK - at % MXFP4_BLOCK).min(k - kk);
            let scales = &self.scales[at / MXFP4_BLOCK];
            widen_any(isa, &self.codes[at..at + n], scales, &mut run);
            // SAFETY: columns kk..kk + n of the caller's rows; `run` holds n steps.
            acc = unsafe { run[..n].fold::<R, C0, C>(a.add(kk), lda, n, acc) };
            kk += n;
        }
        acc
    }
}

/// Up to a run's 32 steps widened into `out`, with the best kernel `isa` has.
#[inline(always)]
fn widen_any(
    isa: CpuIsa,
    steps: &[[u8; STEP_BYTES]],
    scales: &[u8; NR],
    out: &mut [[f32; NR]; MXFP4_BLOCK],
) {
    #[cfg(target_arch = "x86_64")]
    if isa == CpuIsa::Avx512 {
        // SAFETY: `isa` is this CPU's (`CpuIsa::detect`).
        unsafe { widen_run_avx512(steps, scales, out) };
        return;
    }
    widen_run(isa, steps, scales, out);
}

/// A run's columns' scales as f32 (`E8M0` of each scale byte).
#[inline(always)]
fn scale_values(scales: &[u8; NR]) -> [f32; NR] {
    std::array::from_fn(|c| E8M0[usize::from(scales[c])])
}

/// One step's 32 weights: codes times their columns' scales.
#[inline(always)]
fn widen(step: &[u8; STEP_BYTES], scale: &[f32; NR]) -> [f32; NR] {
    let mut out = [0f32; NR];
    let (lo, hi) = out.split_at_mut(STEP_BYTES);
    let (slo, shi) = scale.split_at(STEP_BYTES);
    for (i, &byte) in step.iter().enumerate() {
        lo[i] = e2m1(byte & 0x0f) * slo[i];
        hi[i] = e2m1(byte >> 4) * shi[i];
    }
    out
}

/// [`widen_run`] with AVX-512: the 16 code points are one register, and `vpermps` looks up 16
/// codes at once.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn widen_run_avx512(
    steps: &[[u8; STEP_BYTES]],
    scales: &[u8; NR],
    out: &mut [[f32; NR]; MXFP4_BLOCK],
) {
    use std::arch::x86_64::*;
    let scale = scale_values(scales);
    // SAFETY: every load and store is of 16 lanes inside the arrays named.
    unsafe {
        let table = _mm512_loadu_ps(E2M1.as_ptr());
        let (slo, shi) = (
            _mm512_loadu_ps(scale.as_ptr()),
            _mm512_loadu_ps(scale.as_ptr().add(STEP_BYTES)),
        );
        let nibble = _mm512_set1_epi32(0x0f);
        for (o, step) in out.iter_mut().zip(steps) {
            let codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(step.as_ptr().cast()));
            let lo = _mm512_permutexvar_ps(_mm512_and_si512(codes, nibble), table);
            let hi = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(codes), table);
            _mm512_storeu_ps(o.as_mut_ptr(), _mm512_mul_ps(lo, slo));
            _mm512_storeu_ps(o.as_mut_ptr().add(STEP_BYTES), _mm512_mul_ps(hi, shi));
        }
    }
}

isa_kernel! {
    /// Up to a run's 32 steps of codes, widened with the run's `scales` into `out`, in a call of
    /// its own compiled for each instruction set.
    #[inline(never)]
    fn widen_run(
        isa: CpuIsa,
        steps: &[[u8; STEP_BYTES]],
        scales: &[u8; NR],
        out: &mut [[f32; NR]; MXFP4_BLOCK],
    ) {
        let scale = scale_values(scales);
        for (o, step) in out.iter_mut().zip(steps) {
            *o = widen(step, &scale);
        }
    }
}

/// The bf16 pair words of a run's weights (step pairs `2s`, `2s + 1` in one word per column:
/// the even step's bf16 bits low, the odd step's high), the layout of `ops::gemm_abf16`'s
/// panels. A widened weight's bf16 bits are its f32 bits' top half (exact: see the module).
#[inline(always)]
fn pair_words(even: &[f32; NR], odd: &[f32; NR], out: &mut [u32]) {
    for ((o, e), d) in out.iter_mut().zip(even).zip(odd) {
        *o = (e.to_bits() >> 16) | (d.to_bits() & 0xffff_0000);
    }
}

isa_kernel! {
    /// A run's 32 steps of codes widened with the run's `scales` into its 16 steps of bf16
    /// pair words (`out`: 16 × NR words).
    #[inline(never)]
    fn widen_run_pairs(isa: CpuIsa, steps: &[[u8; STEP_BYTES]], scales: &[u8; NR], out: &mut [u32]) {
        let scale = scale_values(scales);
        for (pair, words) in steps.chunks_exact(2).zip(out.chunks_exact_mut(NR)) {
            pair_words(&widen(&pair[0], &scale), &widen(&pair[1], &scale), words);
        }
    }
}

/// [`widen_run_pairs`] with AVX-512 (`vpermps` lookups, as [`widen_run_avx512`]).
///
/// # Safety
/// The CPU has AVX-512F; `steps` holds 32 steps and `out` 16 × NR words.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn widen_run_pairs_avx512(steps: &[[u8; STEP_BYTES]], scales: &[u8; NR], out: &mut [u32]) {
    use std::arch::x86_64::*;
    let scale = scale_values(scales);
    // SAFETY: every load and store is of 16 lanes inside the arrays named (the contract's
    // sizes).
    unsafe {
        let table = _mm512_loadu_ps(E2M1.as_ptr());
        let (slo, shi) = (
            _mm512_loadu_ps(scale.as_ptr()),
            _mm512_loadu_ps(scale.as_ptr().add(STEP_BYTES)),
        );
        let nibble = _mm512_set1_epi32(0x0f);
        let top = _mm512_set1_epi32(0xffff_0000_u32 as i32);
        // The 32 columns of one step, as f32 bits: columns 0..16 and 16..32.
        let widened = |step: &[u8; STEP_BYTES]| {
            let codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(step.as_ptr().cast()));
            let lo = _mm512_permutexvar_ps(_mm512_and_si512(codes, nibble), table);
            let hi = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(codes), table);
            (
                _mm512_castps_si512(_mm512_mul_ps(lo, slo)),
                _mm512_castps_si512(_mm512_mul_ps(hi, shi)),
            )
        };
        for (s, words) in out.chunks_exact_mut(NR).enumerate().take(MXFP4_BLOCK / 2) {
            let (elo, ehi) = widened(&steps[2 * s]);
            let (olo, ohi) = widened(&steps[2 * s + 1]);
            let lo = _mm512_or_si512(_mm512_srli_epi32::<16>(elo), _mm512_and_si512(olo, top));
            let hi = _mm512_or_si512(_mm512_srli_epi32::<16>(ehi), _mm512_and_si512(ohi, top));
            _mm512_storeu_si512(words.as_mut_ptr().cast(), lo);
            _mm512_storeu_si512(words.as_mut_ptr().add(STEP_BYTES).cast(), hi);
        }
    }
}

thread_local! {
    /// The panel being multiplied by, widened to bf16 pair words (one per worker thread).
    static PAIRS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

impl PackedWeightMxfp4 {
    /// Panel `p` as `ops::gemm_abf16`'s K/2 steps of NR pair words, into `out`.
    fn widen_pairs(&self, p: usize, out: &mut Vec<u32>) {
        out.resize(self.k / 2 * NR, 0);
        for (run, words) in out.chunks_mut(Self::RUN_STEPS * NR).enumerate() {
            self.widen_run(p, run, words);
        }
    }
}

impl PairPanels for PackedWeightMxfp4 {
    const OP_NAME: &'static str = "detspec-packed-matmul-mxfp4-abf16";

    fn k(&self) -> usize {
        self.k
    }

    fn n(&self) -> usize {
        self.n
    }

    /// Four MXFP4 blocks (128 k steps, 8 KB of pair words: L1-resident). One block a run
    /// measured 36 % slower at M = 64 (the sums' loads and stores per run), four within 2 %
    /// of the whole panel there and faster at M = 1.
    const RUN_STEPS: usize = RUN_BLOCKS * MXFP4_BLOCK / 2;

    fn widen_run(&self, p: usize, run: usize, out: &mut [u32]) {
        let groups = self.k / MXFP4_BLOCK;
        let first = run * RUN_BLOCKS;
        let blocks = first..(first + RUN_BLOCKS).min(groups);
        let isa = CpuIsa::detect();
        for (g, words) in blocks.zip(out.chunks_exact_mut(MXFP4_BLOCK / 2 * NR)) {
            let at = p * self.k + g * MXFP4_BLOCK;
            let (steps, scales) = (
                &self.codes[at..at + MXFP4_BLOCK],
                &self.scales[p * groups + g],
            );
            #[cfg(target_arch = "x86_64")]
            if isa == CpuIsa::Avx512 {
                // SAFETY: the CPU has AVX-512 (`CpuIsa::detect`); 32 steps; `words` is 16 × NR.
                unsafe { widen_run_pairs_avx512(steps, scales, words) };
                continue;
            }
            widen_run_pairs(isa, steps, scales, words);
        }
    }

    /// Widened into this thread's buffer. It may hold a denormal only where a scale is 2^-126
    /// or less (the smallest non-zero code is 0.5).
    fn with_panel<R>(&self, p: usize, f: impl FnOnce(PairPanel<'_>) -> R) -> R {
        let groups = self.k / MXFP4_BLOCK;
        let denormal = self.scales[p * groups..(p + 1) * groups]
            .iter()
            .flatten()
            .any(|&e| e <= 1);
        PAIRS.with_borrow_mut(|words| {
            self.widen_pairs(p, words);
            f(PairPanel {
                words,
                denormal,
                kp: self.k / 2,
                n: self.n,
                p,
            })
        })
    }
}

/// The E2M1 value of `code`, from its bits rather than a table (a table lookup per weight
/// does not vectorise): sign, then for exponent bits `e` > 0 the f32 `1.m × 2^(e − 1)`, for
/// `e` = 0 the subnormal `m × 0.5`. Equal to [`E2M1`]`[code]` (tested).
#[inline(always)]
fn e2m1(code: u8) -> f32 {
    let c = u32::from(code);
    let (e, m) = ((c >> 1) & 3, c & 1);
    let magnitude = if e == 0 {
        m * (126 << 23)
    } else {
        ((126 + e) << 23) | (m << 22)
    };
    f32::from_bits(((c & 8) << 28) | magnitude)
}

impl Panels for PackedWeightMxfp4 {
    type Panel<'a> = Mxfp4Panel<'a>;
    const OP_NAME: &'static str = "detspec-packed-matmul-mxfp4";

    fn k(&self) -> usize {
        self.k
    }

    fn n(&self) -> usize {
        self.n
    }

    fn panel(&self, p: usize, rows: usize) -> Mxfp4Panel<'_> {
        let groups = self.k / MXFP4_BLOCK;
        Mxfp4Panel {
            codes: &self.codes[p * self.k..(p + 1) * self.k],
            scales: &self.scales[p * groups..(p + 1) * groups],
            k0: 0,
            key: (self.id, p),
            whole: rows > WIDEN_WHOLE_PAST,
        }
    }
}

/// `a[m, k] @ w` into a new `[m, n]` buffer, with the given instruction set.
pub fn packed_matmul_mxfp4_with(
    a: &[f32],
    m: usize,
    w: &PackedWeightMxfp4,
    isa: CpuIsa,
) -> candle_core::Result<Vec<f32>> {
    matmul_panels(a, m, w, isa, Reduction::Sequential)
}

/// `a[m, k] @ w` with the best instruction set of this CPU.
pub fn packed_matmul_mxfp4(
    a: &[f32],
    m: usize,
    w: &PackedWeightMxfp4,
) -> candle_core::Result<Vec<f32>> {
    packed_matmul_mxfp4_with(a, m, w, CpuIsa::detect())
}

/// `x[m, k] @ w` as a candle op (CPU; `x` f32, output f32), with the reduction `profile`
/// picks for M rows (`invariant`: the batch-invariant mode's fixed-block GEMM).
pub fn matmul_packed_mxfp4_profiled(
    x: &Tensor,
    w: &Arc<PackedWeightMxfp4>,
    profile: KernelProfile,
    invariant: bool,
) -> candle_core::Result<Tensor> {
    apply_packed(x, w, profile, invariant)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every widening (each instruction set's `widen_run`, AVX-512's own) gives the table's
    /// values times the scales, bit for bit: the GEMM's ISA test runs this CPU's widening
    /// only.
    #[test]
    fn every_widening_gives_the_same_bits() {
        let steps: Vec<[u8; STEP_BYTES]> = (0..MXFP4_BLOCK)
            .map(|i| std::array::from_fn(|b| (i * 37 + b * 11) as u8))
            .collect();
        let scales: [u8; NR] = std::array::from_fn(|c| [0, 1, 100, 127, 200, 254, 255][c % 7]);
        let mut want = [[0f32; NR]; MXFP4_BLOCK];
        for (w, step) in want.iter_mut().zip(&steps) {
            for (c, &byte) in step.iter().enumerate() {
                w[c] = E2M1[usize::from(byte & 15)] * E8M0[usize::from(scales[c])];
                w[c + STEP_BYTES] =
                    E2M1[usize::from(byte >> 4)] * E8M0[usize::from(scales[c + STEP_BYTES])];
            }
        }
        let bits = |o: &[[f32; NR]; MXFP4_BLOCK]| -> Vec<u32> {
            o.iter().flatten().map(|x| x.to_bits()).collect()
        };
        for isa in CpuIsa::available() {
            let mut out = [[0f32; NR]; MXFP4_BLOCK];
            widen_run(isa, &steps, &scales, &mut out);
            assert_eq!(bits(&out), bits(&want), "{isa:?}");
        }
        #[cfg(target_arch = "x86_64")]
        if CpuIsa::Avx512.supported() {
            let mut out = [[0f32; NR]; MXFP4_BLOCK];
            // SAFETY: checked just above.
            unsafe { widen_run_avx512(&steps, &scales, &mut out) };
            assert_eq!(bits(&out), bits(&want), "avx512 permute");
        }
    }

    /// Every widening to bf16 pair words gives the top halves of the table's f32 values: the
    /// even step's low, the odd step's high.
    #[test]
    fn every_pair_widening_gives_the_same_bits() {
        let steps: Vec<[u8; STEP_BYTES]> = (0..MXFP4_BLOCK)
            .map(|i| std::array::from_fn(|b| (i * 29 + b * 7) as u8))
            .collect();
        let scales: [u8; NR] = std::array::from_fn(|c| [0, 1, 2, 127, 200, 254, 255][c % 7]);
        let value = |s: usize, c: usize| {
            let byte = steps[s][c % STEP_BYTES];
            let code = if c < STEP_BYTES { byte & 15 } else { byte >> 4 };
            E2M1[usize::from(code)] * E8M0[usize::from(scales[c])]
        };
        let want: Vec<u32> = (0..MXFP4_BLOCK / 2)
            .flat_map(|s| (0..NR).map(move |c| (s, c)))
            .map(|(s, c)| {
                (value(2 * s, c).to_bits() >> 16) | (value(2 * s + 1, c).to_bits() & 0xffff_0000)
            })
            .collect();
        for isa in CpuIsa::available() {
            let mut out = vec![0u32; MXFP4_BLOCK / 2 * NR];
            widen_run_pairs(isa, &steps, &scales, &mut out);
            assert_eq!(out, want, "{isa:?}");
        }
        #[cfg(target_arch = "x86_64")]
        if CpuIsa::Avx512.supported() {
            let mut out = vec![0u32; MXFP4_BLOCK / 2 * NR];
            // SAFETY: checked just above; 32 steps, 16 × NR words.
            unsafe { widen_run_pairs_avx512(&steps, &scales, &mut out) };
            assert_eq!(out, want, "avx512 permute");
        }
    }

    #[test]
    fn e2m1_from_bits_is_the_table() {
        for code in 0..16u8 {
            assert_eq!(
                e2m1(code).to_bits(),
                E2M1[usize::from(code)].to_bits(),
                "{code}"
            );
        }
    }
}
