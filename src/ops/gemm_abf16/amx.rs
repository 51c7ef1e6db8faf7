//! The `bfloat16_amx` GEMM on AMX tiles (`TDPBF16PS`): its own bits, AMX-BF16 CPUs only.

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
