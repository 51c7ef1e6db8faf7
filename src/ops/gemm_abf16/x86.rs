//! The bf16-activation GEMM on `VDPBF16PS` (AVX-512 BF16), and the instruction-level entry
//! points the conformance tests compare the emulation with.

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
