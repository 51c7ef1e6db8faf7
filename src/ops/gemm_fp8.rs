//! The CPU GEMM with FP8 weights: `x @ W` where `W` is held as an FP8 checkpoint stores it,
//! one E4M3 code a weight with an f32 scale per block of the matrix, packed once at load (a
//! byte a weight where bf16 takes two and f32 four).
//!
//! Same kernel as the f32 GEMM (`ops::gemm`: panels, register block, task split, driver); only
//! a panel's storage differs. A panel's k step holds its [`NR`] columns' codes in 32 bytes, and
//! each block of k steps the columns' scales. Runs of up to 32 steps are widened to f32, as
//! `E4M3[code] · scale` (one rounding), into a 4 KB buffer the f32 microkernel folds. So every
//! output element is the f32 GEMM's FMA chain over the widened weights: **the bits of the f32
//! GEMM on the weights widened at load** (`model::fp8`). Where the engine holds weights in
//! bf16 (`round_bf16`), each widened weight is rounded to bf16 (to nearest, ties to even, as
//! `to_dtype` rounds), giving the bf16 GEMM's bits on the rounded weights.
//!
//! The bf16-activation mode's GEMM (`ops::gemm_abf16`) reads the same packed weight as bf16
//! pair words, widened and rounded so a few blocks at a time as it multiplies ([`PairPanels`]):
//! the bits of that GEMM on the rounded weights stored in bf16.

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

/// Steps widened into the f32 buffer at a time.
const RUN: usize = 32;
/// Pair steps the bf16-activation GEMM widens at a time (`PairPanels::RUN_STEPS`: 128 k
/// steps, an 8 KB buffer, as MXFP4's).
const PAIR_RUN: usize = 64;

/// The value of every E4M3 code (OCP FP8's `E4M3FN`: bias 7, subnormals, no infinities; the
/// two NaN codes `S.1111.111` give NaN).
pub static E4M3: [f32; 256] = e4m3_table();

const fn e4m3_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut code = 0;
    while code < 256 {
        let m = code & 0x7f;
        let (e, mantissa) = ((m >> 3) as u32, (m & 7) as u32);
        let magnitude = if m == 0x7f {
            f32::NAN
        } else if e == 0 {
            mantissa as f32 / 512.0 // m / 8 · 2^-6
        } else {
            f32::from_bits(((e + 120) << 23) | (mantissa << 20))
        };
        t[code] = if code & 0x80 != 0 {
            -magnitude
        } else {
            magnitude
        };
        code += 1;
    }
    t
}

/// `w` rounded to bf16, to nearest with ties to even (as `half`'s `bf16::from_f32`, which
/// candle's `to_dtype` uses), held in f32. Finite `w` only (the packer refuses NaN codes).
#[inline(always)]
fn round_bf16(w: f32) -> f32 {
    let b = w.to_bits();
    f32::from_bits(b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000)
}

/// A `[K, N]` weight in FP8, packed into column panels for [`matmul_packed_fp8_profiled`]
/// (and, in the bf16-activation mode, `gemm_abf16`).
#[derive(Debug)]
pub struct PackedWeightFp8 {
    k: usize,
    n: usize,
    /// Per panel, K steps of the columns' codes.
    codes: Vec<[u8; NR]>,
    /// Per panel, a step block's columns' scales for each of the `k_blocks` blocks.
    scales: Vec<[f32; NR]>,
    /// Steps that share a scale.
    k_block: usize,
    k_blocks: usize,
    /// Whether each widened weight is rounded to bf16 (the engine holds its weights in bf16).
    round_bf16: bool,
    /// Per panel: it may widen to a denormal (`PairPanel::denormal`).
    denormal: Vec<bool>,
    /// Every scale times 2^120 is finite, so the AVX-512 widening may multiply by that.
    fast_scales: bool,
    /// This weight's number (`gemm::fold_widened_panel`).
    id: u64,
}

impl PackedWeightFp8 {
    /// Packs `W^T` from an FP8 checkpoint's `[rows, k]` matrix: `codes` (E4M3, row-major) and
    /// `scales` (`[⌈rows / block[0]⌉, ⌈k / block[1]⌉]`, row-major: one per block of
    /// `block[0]` rows × `block[1]` inputs). `Err` names what is wrong (NaN codes included).
    pub fn from_codes(
        codes: &[u8],
        scales: &[f32],
        rows: usize,
        k: usize,
        block: [usize; 2],
        round_bf16: bool,
    ) -> candle_core::Result<Self> {
        use rayon::prelude::*;
        let [block_rows, k_block] = block;
        if k == 0 || rows == 0 || block_rows == 0 || k_block == 0 {
            bail!("packed FP8 weight: [{k}, {rows}] in blocks of {block:?}");
        }
        let (row_blocks, k_blocks) = (rows.div_ceil(block_rows), k.div_ceil(k_block));
        if codes.len() != rows * k || scales.len() != row_blocks * k_blocks {
            bail!(
                "packed FP8 weight: {} codes and {} scales are not a [{rows}, {k}] matrix in \
                 blocks of {block:?}",
                codes.len(),
                scales.len()
            );
        }
        if let Some(i) = codes.iter().position(|&c| c & 0x7f == 0x7f) {
            bail!(
                "weight [{}, {}] is not a number (its code {:#04x})",
                i / k,
                i % k,
                codes[i]
            );
        }
        if let Some(s) = scales.iter().find(|s| !s.is_finite()) {
            bail!("a scale is {s}");
        }
        let panels = rows.div_ceil(NR);
        let mut packed = vec![[0u8; NR]; panels * k];
        let mut packed_scales = vec![[0f32; NR]; panels * k_blocks];
        packed
            .par_chunks_mut(k)
            .zip(packed_scales.par_chunks_mut(k_blocks))
            .enumerate()
            .for_each(|(p, (panel, panel_scales))| {
                for r in p * NR..((p + 1) * NR).min(rows) {
                    let c = r - p * NR;
                    for (step, &code) in panel.iter_mut().zip(&codes[r * k..(r + 1) * k]) {
                        step[c] = code;
                    }
                    let row_scales = &scales[(r / block_rows) * k_blocks..][..k_blocks];
                    for (b, &s) in panel_scales.iter_mut().zip(row_scales) {
                        b[c] = s;
                    }
                }
            });
        // The smallest non-zero code is 2^-9: a weight can be denormal (in f32 or bf16) only
        // with a scale below 2^-117.
        let denormal = packed_scales
            .chunks(k_blocks)
            .map(|b| b.iter().flatten().any(|s| s.abs() < 2f32.powi(-117)))
            .collect();
        Ok(Self {
            k,
            n: rows,
            codes: packed,
            scales: packed_scales,
            k_block,
            k_blocks,
            round_bf16,
            denormal,
            fast_scales: scales.iter().all(|s| s.abs() < 2f32.powi(7)),
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

    /// Bytes the packed weight holds (a byte a weight, the scales, the last panel's padding).
    pub fn bytes(&self) -> usize {
        std::mem::size_of_val(self.codes.as_slice()) + std::mem::size_of_val(self.scales.as_slice())
    }

    /// Steps `at..at + out.len()` of panel `p` widened into `out` (rounded to bf16 if `round`).
    fn widen_steps(&self, p: usize, at: usize, round: bool, out: &mut [[f32; NR]]) {
        let steps = Steps {
            codes: &self.codes[p * self.k + at..][..out.len()],
            scales: &self.scales[p * self.k_blocks..(p + 1) * self.k_blocks],
            k_block: self.k_block,
            at,
        };
        let isa = CpuIsa::detect();
        #[cfg(target_arch = "x86_64")]
        if isa == CpuIsa::Avx512 && self.fast_scales && !denormals_are_zero() {
            // SAFETY: the CPU has AVX-512 (`CpuIsa::detect`).
            unsafe { widen_avx512(steps, round, out) };
            return;
        }
        widen(isa, steps, round, out);
    }
}

/// A run of one panel's steps to widen: their codes, the panel's scales by block, and where
/// the run starts.
#[derive(Clone, Copy)]
struct Steps<'a> {
    codes: &'a [[u8; NR]],
    scales: &'a [[f32; NR]],
    k_block: usize,
    at: usize,
}

impl<'a> Steps<'a> {
    /// The run cut where the scales change: each piece's codes and their columns' scales.
    #[inline(always)]
    fn by_scale(self) -> impl Iterator<Item = (&'a [[u8; NR]], &'a [f32; NR])> {
        let first = self.at / self.k_block;
        let mut rest = self.codes;
        let mut end = (first + 1) * self.k_block - self.at;
        self.scales[first..].iter().map_while(move |scale| {
            if rest.is_empty() {
                return None;
            }
            let (piece, after) = rest.split_at(end.min(rest.len()));
            rest = after;
            end = self.k_block;
            Some((piece, scale))
        })
    }
}

isa_kernel! {
    /// The run's weights, `E4M3[code] · scale` (rounded to bf16 if `round`), into `out`, in a
    /// call of its own compiled for each instruction set.
    #[inline(never)]
    fn widen(isa: CpuIsa, steps: Steps<'_>, round: bool, out: &mut [[f32; NR]]) {
        let mut out = out.iter_mut();
        for (piece, scale) in steps.by_scale() {
            // The piece first: `zip` takes from its left side first, and `out` goes on.
            for (codes, o) in piece.iter().zip(out.by_ref()) {
                for ((w, &code), &s) in o.iter_mut().zip(codes).zip(scale) {
                    let v = E4M3[usize::from(code)] * s;
                    *w = if round { round_bf16(v) } else { v };
                }
            }
        }
    }
}

/// [`widen`] with AVX-512, 16 weights in four instructions: the code sign-extended to 32 bits
/// and shifted left by 20 puts its sign in f32's sign bit and its exponent and mantissa in the
/// low bits of f32's exponent field and the top of its mantissa; masked, that is the code's
/// value times 2^-120 (a denormal for E4M3's subnormals), and the scale times 2^120 (exact:
/// [`PackedWeightFp8::fast_scales`]) restores it in the one multiplication, whose exact product
/// is the same as `E4M3[code] · scale`'s, so is its rounding. A denormals-are-zero mode would
/// zero the subnormals: [`PackedWeightFp8::widen_steps`] does not come here under one.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn widen_avx512(steps: Steps<'_>, round: bool, out: &mut [[f32; NR]]) {
    use std::arch::x86_64::*;
    const HALF: usize = NR / 2;
    // SAFETY: every load and store is of 16 lanes inside the arrays named.
    unsafe {
        let fields = _mm512_set1_epi32(0x87f0_0000_u32 as i32);
        let rebias = _mm512_set1_ps(2f32.powi(120));
        let (tie, top) = (_mm512_set1_epi32(0x7fff), _mm512_set1_epi32(-0x1_0000));
        let one = _mm512_set1_epi32(1);
        let value = |codes: __m128i, scale: __m512| {
            let x = _mm512_slli_epi32::<20>(_mm512_cvtepi8_epi32(codes));
            let w = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(x, fields)), scale);
            if round {
                let b = _mm512_castps_si512(w);
                let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), one);
                let b = _mm512_add_epi32(b, _mm512_add_epi32(tie, lsb));
                _mm512_castsi512_ps(_mm512_and_si512(b, top))
            } else {
                w
            }
        };
        let mut out = out.iter_mut();
        for (piece, scale) in steps.by_scale() {
            let slo = _mm512_mul_ps(_mm512_loadu_ps(scale.as_ptr()), rebias);
            let shi = _mm512_mul_ps(_mm512_loadu_ps(scale.as_ptr().add(HALF)), rebias);
            for (codes, o) in piece.iter().zip(out.by_ref()) {
                let lo = value(_mm_loadu_si128(codes.as_ptr().cast()), slo);
                let hi = value(_mm_loadu_si128(codes.as_ptr().add(HALF).cast()), shi);
                _mm512_storeu_ps(o.as_mut_ptr(), lo);
                _mm512_storeu_ps(o.as_mut_ptr().add(HALF), hi);
            }
        }
    }
}

impl PackedWeightFp8 {
    /// Whether panel `p`'s pair words may come from [`widen_pairs_avx512bf16`]: on a CPU with
    /// AVX-512 BF16, with the AVX-512 widening's conditions, scale blocks of even length (a
    /// step pair shares its scale), and no weight of the panel denormal (the conversion
    /// instruction reads denormals as zero; the panel's weights are at least 2^-9 times its
    /// smallest scale).
    #[cfg(target_arch = "x86_64")]
    fn pairs_by_instruction(&self, p: usize) -> bool {
        super::gemm_abf16::DotIsa::detect() == super::gemm_abf16::DotIsa::Avx512Bf16
            && self.fast_scales
            && self.k_block.is_multiple_of(2)
            && !self.denormal[p]
            && !denormals_are_zero()
    }
}

/// Step pairs widened as [`widen_avx512`] widens them and rounded to bf16 by
/// `VCVTNE2PS2BF16` (to nearest even, as `round_bf16`, for the normal values it is given),
/// interleaved into pair words by one `VPERMW`: a third of the instructions of widening,
/// rounding and pairing apart.
///
/// # Safety
/// The CPU has AVX-512F, BW and BF16; the steps' scale blocks have even length and start at
/// an even step; `out` holds NR words per step pair.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn widen_pairs_avx512bf16(steps: Steps<'_>, out: &mut [u32]) {
    use std::arch::x86_64::*;
    const HALF: usize = NR / 2;
    // SAFETY: every load and store is of 16 lanes inside the arrays named.
    unsafe {
        let fields = _mm512_set1_epi32(0x87f0_0000_u32 as i32);
        let rebias = _mm512_set1_ps(2f32.powi(120));
        // 16-bit lanes: the even step's column c (lane c), then the odd step's (lane 16 + c).
        let interleave = _mm512_set_epi16(
            31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20,
            4, 19, 3, 18, 2, 17, 1, 16, 0,
        );
        let value = |codes: *const u8, scale: __m512| {
            let x = _mm512_slli_epi32::<20>(_mm512_cvtepi8_epi32(_mm_loadu_si128(codes.cast())));
            _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(x, fields)), scale)
        };
        let mut words = out.chunks_exact_mut(NR);
        for (piece, scale) in steps.by_scale() {
            let slo = _mm512_mul_ps(_mm512_loadu_ps(scale.as_ptr()), rebias);
            let shi = _mm512_mul_ps(_mm512_loadu_ps(scale.as_ptr().add(HALF)), rebias);
            for (pair, w) in piece.chunks_exact(2).zip(words.by_ref()) {
                for (h, s) in [(0, slo), (HALF, shi)] {
                    let even = value(pair[0].as_ptr().add(h), s);
                    let odd = value(pair[1].as_ptr().add(h), s);
                    let bf: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(odd, even));
                    let paired = _mm512_permutexvar_epi16(interleave, bf);
                    _mm512_storeu_si512(w.as_mut_ptr().add(h).cast(), paired);
                }
            }
        }
    }
}

/// Whether this thread's floating-point unit reads denormal inputs as zero (MXCSR's DAZ, which
/// some libraries set: torch's `set_flush_denormal`).
#[cfg(target_arch = "x86_64")]
fn denormals_are_zero() -> bool {
    let csr: u32;
    // SAFETY: `stmxcsr` stores the SSE control register (x86-64 always has SSE).
    unsafe {
        let mut v = 0u32;
        std::arch::asm!("stmxcsr [{}]", in(reg) &mut v, options(nostack, preserves_flags));
        csr = v;
    }
    csr & 0x40 != 0
}

/// One panel's steps from step `k0` on.
#[derive(Clone, Copy)]
pub(super) struct Fp8Panel<'a> {
    w: &'a PackedWeightFp8,
    p: usize,
    k0: usize,
    /// Widened whole, once per thread (`gemm::fold_widened_panel`): the GEMM's register
    /// blocks will read it more than once.
    whole: bool,
}

impl PanelSteps for Fp8Panel<'_> {
    #[inline(always)]
    fn skip_steps(self, k0: usize) -> Self {
        Self {
            k0: self.k0 + k0,
            ..self
        }
    }

    /// Runs of up to 32 steps, each widened into a buffer by one call, then folded as an f32
    /// panel (as MXFP4's panels are, for the same reasons: see `gemm_mxfp4`); or, where the
    /// GEMM's row blocks read the panel more than once, the panel widened whole once.
    #[inline(always)]
    unsafe fn fold<const R: usize, const C0: usize, const C: usize>(
        self,
        a: *const f32,
        lda: usize,
        k: usize,
        mut acc: [[f32; C]; R],
    ) -> [[f32; C]; R] {
        if self.whole {
            let w = self.w;
            let widen = |steps: &mut [[f32; NR]]| w.widen_steps(self.p, 0, w.round_bf16, steps);
            // SAFETY: the caller's contract.
            return unsafe {
                fold_widened_panel::<R, C0, C>(
                    (w.id, self.p),
                    w.k,
                    widen,
                    self.k0..self.k0 + k,
                    a,
                    lda,
                    acc,
                )
            };
        }
        let mut run = [[0f32; NR]; RUN];
        let mut kk = 0;
        while kk < k {
            let at = self.k0 + kk;
            let n = (RUN - at % RUN).min(k - kk);
            self.w
                .widen_steps(self.p, at, self.w.round_bf16, &mut run[..n]);
            // SAFETY: columns kk..kk + n of the caller's rows; `run` holds n steps.
            acc = unsafe { run[..n].fold::<R, C0, C>(a.add(kk), lda, n, acc) };
            kk += n;
        }
        acc
    }
}

impl Panels for PackedWeightFp8 {
    type Panel<'a> = Fp8Panel<'a>;
    const OP_NAME: &'static str = "detspec-packed-matmul-fp8";

    fn k(&self) -> usize {
        self.k
    }

    fn n(&self) -> usize {
        self.n
    }

    fn panel(&self, p: usize, rows: usize) -> Fp8Panel<'_> {
        Fp8Panel {
            w: self,
            p,
            k0: 0,
            whole: rows > WIDEN_WHOLE_PAST,
        }
    }
}

thread_local! {
    /// Steps widened to f32 on their way to pair words, and the panel being multiplied by as
    /// pair words (one each per worker thread).
    static WIDE: RefCell<Vec<[f32; NR]>> = const { RefCell::new(Vec::new()) };
    static PAIRS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

impl PairPanels for PackedWeightFp8 {
    const OP_NAME: &'static str = "detspec-packed-matmul-fp8-abf16";
    const RUN_STEPS: usize = PAIR_RUN;

    /// Even K only (the loader keeps odd-K matrices widened at load).
    fn k(&self) -> usize {
        self.k
    }

    fn n(&self) -> usize {
        self.n
    }

    /// The run's weights rounded to bf16, steps `2s` and `2s + 1` in one word per column (the
    /// even step's bits low), the layout of `gemm_abf16`'s panels.
    fn widen_run(&self, p: usize, run: usize, out: &mut [u32]) {
        let first = run * PAIR_RUN * 2;
        let steps = (PAIR_RUN * 2).min(self.k - first);
        #[cfg(target_arch = "x86_64")]
        if self.pairs_by_instruction(p) {
            let steps = Steps {
                codes: &self.codes[p * self.k + first..][..steps],
                scales: &self.scales[p * self.k_blocks..(p + 1) * self.k_blocks],
                k_block: self.k_block,
                at: first,
            };
            // SAFETY: the CPU has AVX-512 BF16 (`pairs_by_instruction`); `out` holds a word
            // per column of every step pair.
            unsafe { widen_pairs_avx512bf16(steps, out) };
            return;
        }
        WIDE.with_borrow_mut(|wide| {
            wide.resize(steps, [0f32; NR]);
            self.widen_steps(p, first, true, wide);
            let isa = CpuIsa::detect();
            #[cfg(target_arch = "x86_64")]
            if isa == CpuIsa::Avx512 {
                // SAFETY: the CPU has AVX-512 (`CpuIsa::detect`).
                unsafe { pair_words_avx512(wide, out) };
                return;
            }
            pair_words(isa, wide, out);
        });
    }

    /// Widened whole into this thread's buffer.
    fn with_panel<R>(&self, p: usize, f: impl FnOnce(PairPanel<'_>) -> R) -> R {
        PAIRS.with_borrow_mut(|words| {
            words.resize(self.k / 2 * NR, 0);
            for (run, out) in words.chunks_mut(PAIR_RUN * NR).enumerate() {
                self.widen_run(p, run, out);
            }
            f(PairPanel {
                words,
                denormal: self.denormal[p],
                kp: self.k / 2,
                n: self.n,
                p,
            })
        })
    }
}

isa_kernel! {
    /// Steps of bf16-rounded weights (`wide`) as pair words: steps `2s` and `2s + 1` in one
    /// word per column, the even step's bits low (the layout of `gemm_abf16`'s panels).
    fn pair_words(isa: CpuIsa, wide: &[[f32; NR]], out: &mut [u32]) {
        for (pair, words) in wide.chunks_exact(2).zip(out.chunks_exact_mut(NR)) {
            for ((o, e), d) in words.iter_mut().zip(&pair[0]).zip(&pair[1]) {
                *o = (e.to_bits() >> 16) | (d.to_bits() & 0xffff_0000);
            }
        }
    }
}

/// [`pair_words`] with AVX-512.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pair_words_avx512(wide: &[[f32; NR]], out: &mut [u32]) {
    use std::arch::x86_64::*;
    const HALF: usize = NR / 2;
    // SAFETY: every load and store is of 16 lanes inside the arrays named.
    unsafe {
        let top = _mm512_set1_epi32(-0x1_0000);
        for (pair, words) in wide.chunks_exact(2).zip(out.chunks_exact_mut(NR)) {
            for h in [0, HALF] {
                let even = _mm512_loadu_si512(pair[0].as_ptr().add(h).cast());
                let odd = _mm512_loadu_si512(pair[1].as_ptr().add(h).cast());
                let w = _mm512_or_si512(_mm512_srli_epi32::<16>(even), _mm512_and_si512(odd, top));
                _mm512_storeu_si512(words.as_mut_ptr().add(h).cast(), w);
            }
        }
    }
}

/// `a[m, k] @ w` into a new `[m, n]` buffer, with the given instruction set.
pub fn packed_matmul_fp8_with(
    a: &[f32],
    m: usize,
    w: &PackedWeightFp8,
    isa: CpuIsa,
) -> candle_core::Result<Vec<f32>> {
    matmul_panels(a, m, w, isa, Reduction::Sequential)
}

/// `x[m, k] @ w` as a candle op (CPU; `x` f32, output f32), with the reduction `profile`
/// picks for M rows (`invariant`: the batch-invariant mode's fixed-block GEMM).
pub fn matmul_packed_fp8_profiled(
    x: &Tensor,
    w: &Arc<PackedWeightFp8>,
    profile: KernelProfile,
    invariant: bool,
) -> candle_core::Result<Tensor> {
    apply_packed(x, w, profile, invariant)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_widening_gives_the_same_bits() {
        // Every code, scales of every kind (tiny ones make denormal weights), both roundings.
        let rows = NR;
        let k = 256;
        let codes: Vec<u8> = (0..rows * k)
            .map(|i| (i * 7 % 256) as u8)
            .map(|c| if c & 0x7f == 0x7f { 0 } else { c })
            .collect();
        let scales: Vec<f32> = [
            1.0,
            3.1e-3,
            -0.7,
            2f32.powi(-130),
            1.7e-38,
            127.9,
            0.1,
            1e-5,
        ]
        .into_iter()
        .cycle()
        .take(2 * 8)
        .collect();
        for round in [false, true] {
            let w = PackedWeightFp8::from_codes(&codes, &scales, rows, k, [16, 32], round).unwrap();
            let mut want = vec![[0f32; NR]; k];
            for (kk, step) in want.iter_mut().enumerate() {
                for (c, v) in step.iter_mut().enumerate() {
                    let s = scales[(c / 16) * 8 + kk / 32];
                    let x = E4M3[usize::from(codes[c * k + kk])] * s;
                    *v = if round {
                        half::bf16::from_f32(x).to_f32()
                    } else {
                        x
                    };
                }
            }
            let bits =
                |v: &[[f32; NR]]| v.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
            for isa in [CpuIsa::Portable, CpuIsa::Avx2Fma, CpuIsa::Avx512] {
                if !isa.supported() {
                    continue;
                }
                let steps = Steps {
                    codes: &w.codes[..k],
                    scales: &w.scales[..w.k_blocks],
                    k_block: w.k_block,
                    at: 0,
                };
                let mut got = vec![[0f32; NR]; k];
                widen(isa, steps, round, &mut got);
                assert_eq!(bits(&got), bits(&want), "{isa:?} round {round}");
                #[cfg(target_arch = "x86_64")]
                if isa == CpuIsa::Avx512 {
                    let mut got = vec![[0f32; NR]; k];
                    // SAFETY: the CPU has AVX-512 (checked above).
                    unsafe { widen_avx512(steps, round, &mut got) };
                    assert_eq!(bits(&got), bits(&want), "AVX-512 round {round}");
                }
            }
        }
    }

    /// `f` with MXCSR's denormals-are-zero bit set on this thread.
    #[cfg(target_arch = "x86_64")]
    fn with_daz<R>(f: impl FnOnce() -> R) -> R {
        let mut csr = 0u32;
        // SAFETY: reads and writes the SSE control register of this thread only, restored.
        unsafe { std::arch::asm!("stmxcsr [{}]", in(reg) &mut csr) };
        let daz = csr | 0x40;
        unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) &daz) };
        let out = f();
        unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) &csr) };
        out
    }

    #[test]
    fn large_scales_and_denormals_are_zero_take_the_table() {
        // A scale of 2^7 or more would overflow times 2^120; under DAZ the subnormal codes'
        // bits would read as zero: both widen by the table, same bits.
        let codes: Vec<u8> = (0..=255u8).filter(|c| c & 0x7f != 0x7f).collect();
        let k = codes.len();
        let want = |s: f32| {
            codes
                .iter()
                .map(|&c| (E4M3[usize::from(c)] * s).to_bits())
                .collect::<Vec<_>>()
        };
        for s in [300.0f32, 3.1e-3] {
            let w = PackedWeightFp8::from_codes(&codes, &[s], 1, k, [1, k], false).unwrap();
            assert_eq!(w.fast_scales, s < 128.0);
            let widened = || {
                let mut out = vec![[0f32; NR]; k];
                w.widen_steps(0, 0, false, &mut out);
                out.iter().map(|step| step[0].to_bits()).collect::<Vec<_>>()
            };
            assert_eq!(widened(), want(s), "scale {s}");
            #[cfg(target_arch = "x86_64")]
            assert_eq!(with_daz(widened), want(s), "scale {s} under DAZ");
        }
    }

    #[test]
    fn nan_codes_and_scales_are_refused() {
        let mut codes = vec![0x38u8; 64];
        assert!(PackedWeightFp8::from_codes(&codes, &[1.0], 2, 32, [2, 32], false).is_ok());
        assert!(PackedWeightFp8::from_codes(&codes, &[f32::NAN], 2, 32, [2, 32], false).is_err());
        codes[40] = 0xff;
        let e = PackedWeightFp8::from_codes(&codes, &[1.0], 2, 32, [2, 32], false).unwrap_err();
        assert!(
            e.to_string().contains("weight [1, 8] is not a number"),
            "{e}"
        );
    }
}
