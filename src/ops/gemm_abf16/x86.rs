//! The bf16-activation GEMM on `VDPBF16PS` (AVX-512 BF16), and the instruction-level entry
//! points the conformance tests compare the emulation with.

use std::arch::x86_64::*;

use super::{PairPanel, PairPanels, CANONICAL_NAN, MR, NR, WORDS};

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

/// R rows `a` (stride `kp` words) times `steps` steps of `panel`, added to the R × NR sums
/// at `acc`: the sums go on from where an earlier call left them, so a panel may come a run
/// of steps at a time (the chain, and so the bits, are those of one call over all of it).
///
/// # Safety
/// AVX-512F and AVX-512 BF16; `a` holds R rows of at least `steps` words at stride `kp`;
/// `panel` holds `steps` steps; `acc` addresses R × NR floats, this task's alone.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn block<const R: usize>(
    a: *const u32,
    kp: usize,
    panel: *const u32,
    steps: usize,
    acc: *mut f32,
) {
    // SAFETY: as the function's contract says; every load is unaligned-safe.
    unsafe {
        let mut sums = [[_mm512_setzero_ps(); 2]; R];
        for (r, sums_r) in sums.iter_mut().enumerate() {
            sums_r[0] = _mm512_loadu_ps(acc.add(r * NR));
            sums_r[1] = _mm512_loadu_ps(acc.add(r * NR + 16));
        }
        for s in 0..steps {
            let w = panel.add(s * WORDS);
            let w0: __m512bh = std::mem::transmute(_mm512_loadu_si512(w.cast()));
            let w1: __m512bh = std::mem::transmute(_mm512_loadu_si512(w.add(16).cast()));
            for (r, sums_r) in sums.iter_mut().enumerate() {
                let ar: __m512bh =
                    std::mem::transmute(_mm512_set1_epi32(*a.add(r * kp + s) as i32));
                sums_r[0] = _mm512_dpbf16_ps(sums_r[0], ar, w0);
                sums_r[1] = _mm512_dpbf16_ps(sums_r[1], ar, w1);
            }
        }
        for (r, sums_r) in sums.iter().enumerate() {
            _mm512_storeu_ps(acc.add(r * NR), sums_r[0]);
            _mm512_storeu_ps(acc.add(r * NR + 16), sums_r[1]);
        }
    }
}

/// [`block`] over rows `0..m` of `a`, MR at a time.
///
/// # Safety
/// As [`block`], for `m` rows of `a` and of `acc`.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn rows_block(
    a: *const u32,
    m: usize,
    kp: usize,
    panel: *const u32,
    steps: usize,
    acc: *mut f32,
) {
    let mut r0 = 0;
    while r0 < m {
        let rows = MR.min(m - r0);
        // SAFETY: rows r0..r0+rows of `a` and `acc` (contract above).
        unsafe {
            let (a, acc) = (a.add(r0 * kp), acc.add(r0 * NR));
            match rows {
                12 => block::<12>(a, kp, panel, steps, acc),
                11 => block::<11>(a, kp, panel, steps, acc),
                10 => block::<10>(a, kp, panel, steps, acc),
                9 => block::<9>(a, kp, panel, steps, acc),
                8 => block::<8>(a, kp, panel, steps, acc),
                7 => block::<7>(a, kp, panel, steps, acc),
                6 => block::<6>(a, kp, panel, steps, acc),
                5 => block::<5>(a, kp, panel, steps, acc),
                4 => block::<4>(a, kp, panel, steps, acc),
                3 => block::<3>(a, kp, panel, steps, acc),
                2 => block::<2>(a, kp, panel, steps, acc),
                _ => block::<1>(a, kp, panel, steps, acc),
            }
        }
        r0 += rows;
    }
}

/// The sums of `m` rows into `out` (row stride `n`, panel `p`'s first `width` columns), NaN
/// canonical.
///
/// # Safety
/// AVX-512F; `out` addresses `m` rows of the panel's columns, this task's alone.
#[target_feature(enable = "avx512f")]
unsafe fn store_rows(acc: &[f32], m: usize, out: *mut f32, n: usize, p: usize) {
    let c0 = p * NR;
    let width = NR.min(n - c0);
    // SAFETY: `acc` holds m × NR floats; `out` as the contract says.
    unsafe {
        let nan = _mm512_castsi512_ps(_mm512_set1_epi32(CANONICAL_NAN as i32));
        for r in 0..m {
            let row = out.add(r * n + c0);
            for h in 0..2 {
                let v = _mm512_loadu_ps(acc.as_ptr().add(r * NR + h * 16));
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

/// Rows `0..m` of `a` (paired, stride `kp`) times `panel` into `out` (row stride `n`).
///
/// # Safety
/// AVX-512F and AVX-512 BF16; `a` holds `m × kp` words; `out` addresses `m` rows of the
/// panel's columns, this task's alone.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn panel_rows(a: &[u32], m: usize, panel: PairPanel<'_>, out: *mut f32) {
    let mut acc = vec![0f32; m * NR];
    // SAFETY: as the contract says; `acc` holds m × NR floats.
    unsafe {
        rows_block(
            a.as_ptr(),
            m,
            panel.kp,
            panel.words.as_ptr(),
            panel.kp,
            acc.as_mut_ptr(),
        );
        store_rows(&acc, m, out, panel.n, panel.p);
    }
}

/// [`panel_rows`] for a weight widened a run at a time ([`PairPanels::widen_run`]): each run
/// into a buffer that stays in L1, the sums carried from run to run.
///
/// # Safety
/// As [`panel_rows`], for panel `p` of `w`.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn panel_rows_runs<W: PairPanels>(
    a: &[u32],
    m: usize,
    w: &W,
    p: usize,
    out: *mut f32,
) {
    let kp = w.k().div_ceil(2);
    let mut acc = vec![0f32; m * NR];
    let mut run = vec![0u32; W::RUN_STEPS * WORDS];
    for (i, s0) in (0..kp).step_by(W::RUN_STEPS).enumerate() {
        let steps = W::RUN_STEPS.min(kp - s0);
        w.widen_run(p, i, &mut run);
        // SAFETY: rows of `a` from step s0 on; `run` holds `steps` steps; `acc` m × NR.
        unsafe {
            rows_block(
                a.as_ptr().add(s0),
                m,
                kp,
                run.as_ptr(),
                steps,
                acc.as_mut_ptr(),
            )
        };
    }
    // SAFETY: as the contract says.
    unsafe { store_rows(&acc, m, out, w.n(), p) };
}
