//! FP8 linear weights (`config::Fp8Weights`), widened at load: each E4M3 code's value times
//! its block's scale, one f32 multiplication, as `weight.to(float32) * scale` computes it in
//! torch. So an FP8 checkpoint loads as the checkpoint of its widened weights (in float32, or
//! rounded from those to the engine's dtype), bit for bit, on every device.

use xxhash_rust::xxh3::Xxh3;

use crate::config::Fp8Weights;
use crate::ops::E4M3;

/// Each row of the `[rows, cols]` matrix of E4M3 `codes` (row-major) widened by `scales`
/// (row-major, `fp8.scale_shape(rows, cols)`), in order, into a row buffer `f` reads (and may
/// change).
fn for_each_row(
    codes: &[u8],
    scales: &[f32],
    rows: usize,
    cols: usize,
    fp8: &Fp8Weights,
    mut f: impl FnMut(&mut [f32]),
) {
    let [_, scale_cols] = fp8.scale_shape(rows, cols);
    let [block_rows, block_cols] = fp8.block_dims(rows, cols);
    let mut row = vec![0f32; cols];
    for (r, codes) in codes.chunks_exact(cols).enumerate().take(rows) {
        let row_scales = &scales[(r / block_rows) * scale_cols..][..scale_cols];
        for (c, (w, &code)) in row.iter_mut().zip(codes).enumerate() {
            *w = E4M3[usize::from(code)] * row_scales[c / block_cols];
        }
        f(&mut row);
    }
}

/// The widened matrix, f32 values row-major. `Err(i)`: weight `i` is not a number (a NaN code
/// or scale).
pub fn widen(
    codes: &[u8],
    scales: &[f32],
    rows: usize,
    cols: usize,
    fp8: &Fp8Weights,
) -> Result<Vec<f32>, usize> {
    let mut out = Vec::with_capacity(rows * cols);
    for_each_row(codes, scales, rows, cols, fp8, |row| {
        out.extend_from_slice(row)
    });
    match out.iter().position(|v| v.is_nan()) {
        Some(i) => Err(i),
        None => Ok(out),
    }
}

/// The parameter hash (`param_hash::tensor_hash`) of the widened matrix held in f32, or rounded to
/// bf16 (`round_bf16`), without holding it: xxh3 over its values as f32, row by row.
pub fn widened_hash(
    codes: &[u8],
    scales: &[f32],
    rows: usize,
    cols: usize,
    fp8: &Fp8Weights,
    round_bf16: bool,
) -> u64 {
    let mut h = Xxh3::new();
    for_each_row(codes, scales, rows, cols, fp8, |row| {
        if round_bf16 {
            for w in row.iter_mut() {
                *w = half::bf16::from_f32(*w).to_f32();
            }
        }
        h.update(bytemuck::cast_slice(row));
    });
    h.digest()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_values_follow_the_format() {
        // Each code against its bits read as an f32 with E4M3's fields moved into place: the
        // exponent rebiased (normal codes) or the subnormal scaled.
        for code in 0..=255u8 {
            let m = code & 0x7f;
            let want = if m == 0x7f {
                None
            } else {
                let bits = u32::from(m) << 20; // exponent and mantissa in f32's fields
                let v = f32::from_bits(bits) * 2f32.powi(120); // rebias 127 → 7; exact
                Some(if code & 0x80 != 0 { -v } else { v })
            };
            let got = E4M3[usize::from(code)];
            assert_eq!(
                (!got.is_nan()).then_some(got.to_bits()),
                want.map(f32::to_bits),
                "{code:#04x}"
            );
        }
        assert_eq!(E4M3[0x7e], 448.0); // the largest
        assert_eq!(E4M3[0x01], 2f32.powi(-9)); // the smallest
        assert_eq!(E4M3[0x38], 1.0);
    }

    #[test]
    fn blocks_cut_short_at_the_edges_take_their_own_scale() {
        // 3 × 5 in blocks of 2 × 2: scales [2, 3], the last row and column blocks short.
        let fp8 = Fp8Weights {
            block: [Some(2), Some(2)],
            scale_suffix: "_scale_inv",
        };
        let one = 0x38; // 1.0
        let codes = vec![one; 15];
        let scales: Vec<f32> = (1..=6).map(|s| s as f32).collect();
        let w = widen(&codes, &scales, 3, 5, &fp8).unwrap();
        assert_eq!(
            w,
            [1., 1., 2., 2., 3., 1., 1., 2., 2., 3., 4., 4., 5., 5., 6.]
        );
        // per channel and per matrix
        let per_row = Fp8Weights {
            block: [Some(1), None],
            ..fp8
        };
        let w = widen(&codes, &[1., 2., 3.], 3, 5, &per_row).unwrap();
        assert_eq!(w[..6], [1., 1., 1., 1., 1., 2.]);
        let whole = Fp8Weights {
            block: [None, None],
            ..fp8
        };
        assert!(widen(&codes, &[0.5], 3, 5, &whole)
            .unwrap()
            .iter()
            .all(|&v| v == 0.5));
        let mut nan = codes;
        nan[7] = 0x7f;
        assert_eq!(widen(&nan, &scales, 3, 5, &fp8), Err(7));
    }
}
