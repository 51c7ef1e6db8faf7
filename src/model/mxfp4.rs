//! MXFP4 (OCP microscaling, 4-bit floats), as gpt-oss's checkpoints store their experts:
//! widened at load to the weights' dtype, so the engine runs them as any other weights.
//!
//! Each block of 32 values is 16 bytes of E2M1 codes (two per byte, the low nibble first)
//! and one E8M0 scale byte, the block's power of two biased by 127. A value is the code's
//! number times that power, which bf16 (and f32) hold exactly: widening loses nothing.

/// The E2M1 code points: sign bit, two exponent bits, one mantissa bit.
const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Bytes of codes per block (32 values).
pub(super) const BLOCK_BYTES: usize = 16;

/// The values of `blocks` (`[rows, groups, 16]` code bytes) scaled by `scales` (`[rows,
/// groups]` E8M0 bytes), row-major `[rows, groups × 32]`. A scale byte of 255 (E8M0's NaN)
/// gives `2^128`, infinite, as transformers' `ldexp` does.
pub(super) fn dequantize(blocks: &[u8], scales: &[u8]) -> Vec<f32> {
    let mut out = Vec::with_capacity(blocks.len() * 2);
    for (block, &scale) in blocks.chunks_exact(BLOCK_BYTES).zip(scales) {
        let power = 2f32.powi(i32::from(scale) - 127);
        for &byte in block {
            out.push(E2M1[usize::from(byte & 0x0f)] * power);
            out.push(E2M1[usize::from(byte >> 4)] * power);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_scale_by_powers_of_two_low_nibble_first() {
        // Codes 0x21: low nibble 1 (0.5), high 2 (1.0); 0xf8: -0.0, then -6.
        let mut block = [0u8; BLOCK_BYTES];
        block[0] = 0x21;
        block[1] = 0xf8;
        let v = dequantize(&block, &[127 + 3]);
        assert_eq!(v.len(), 32);
        assert_eq!(&v[..4], &[4.0, 8.0, -0.0, -48.0]);
        assert!(v[2].is_sign_negative());
        let tiny = dequantize(&block, &[0]);
        assert_eq!(tiny[0], 0.5 * 2f32.powi(-127));
        assert!(dequantize(&block, &[255])[1].is_infinite());
    }
}
