//! MXFP4 (OCP microscaling, 4-bit floats), as gpt-oss's checkpoints store their experts:
//! widened at load to the weights' dtype, so the engine runs them as any other weights.
//!
//! Each block of 32 values is 16 bytes of E2M1 codes (two per byte, the low nibble first)
//! and one E8M0 scale byte, the block's power of two biased by 127. A value is the code's
//! number times that power, which bf16 (and f32) hold exactly: widening loses nothing.

use xxhash_rust::xxh3::Xxh3;

use crate::ops::{E2M1, E8M0};

/// Bytes of codes per block (32 values).
pub(super) const BLOCK_BYTES: usize = 16;

/// A stacked matrix's MXFP4 tensors: per expert, an `[out, in]` matrix as `blocks`
/// (`[out, in / 32, 16]`) and `scales` (`[out, in / 32]`).
pub(super) struct Mxfp4Experts<'a> {
    pub(super) blocks: &'a [u8],
    pub(super) scales: &'a [u8],
    pub(super) experts: usize,
    pub(super) out_dim: usize,
    pub(super) in_dim: usize,
}

impl Mxfp4Experts<'_> {
    /// Expert `e`'s blocks and scales.
    pub(super) fn expert(&self, e: usize) -> (&[u8], &[u8]) {
        let (codes, scales) = (
            self.out_dim * self.in_dim / 2,
            self.out_dim * self.in_dim / 32,
        );
        (
            &self.blocks[e * codes..(e + 1) * codes],
            &self.scales[e * scales..(e + 1) * scales],
        )
    }

    /// Every value, `[experts, out, in]`.
    pub(super) fn dequantize(&self) -> Vec<f32> {
        dequantize(self.blocks, self.scales)
    }

    /// `tensor_hash` of the widened tensor as a bf16/f32 checkpoint stores it, `[experts, in,
    /// out]` (xxh3 of its f32 values, streamed 32 inputs at a time: no widened copy). The
    /// bands of several 32-input groups are widened in parallel, then hashed in order: the
    /// same byte stream, so the same hash, on every thread count.
    pub(super) fn widened_hash(&self) -> u64 {
        use rayon::prelude::*;
        /// Groups widened at once (8 bands of gpt-oss-20b's gate/up: 5.9 MB).
        const BATCH: usize = 8;
        let (out_dim, groups) = (self.out_dim, self.in_dim / 32);
        let mut h = Xxh3::new();
        let mut bands = vec![vec![0f32; 32 * out_dim]; BATCH.min(groups)]; // [32 inputs][out]
        for e in 0..self.experts {
            let (blocks, scales) = self.expert(e);
            for g0 in (0..groups).step_by(BATCH) {
                let batch = &mut bands[..BATCH.min(groups - g0)];
                batch.par_iter_mut().enumerate().for_each(|(b, band)| {
                    let g = g0 + b;
                    for j in 0..out_dim {
                        let at = j * groups + g;
                        let block = &blocks[at * BLOCK_BYTES..(at + 1) * BLOCK_BYTES];
                        let power = E8M0[usize::from(scales[at])];
                        for (i, &byte) in block.iter().enumerate() {
                            band[2 * i * out_dim + j] = E2M1[usize::from(byte & 0x0f)] * power;
                            band[(2 * i + 1) * out_dim + j] = E2M1[usize::from(byte >> 4)] * power;
                        }
                    }
                });
                for band in batch.iter() {
                    h.update(bytemuck::cast_slice(band));
                }
            }
        }
        h.digest()
    }
}

/// The values of `blocks` (`[rows, groups, 16]` code bytes) scaled by `scales` (`[rows,
/// groups]` E8M0 bytes), row-major `[rows, groups × 32]`. A scale byte of 255 (E8M0's NaN)
/// gives `2^128`, infinite, as transformers' `ldexp` does.
pub(super) fn dequantize(blocks: &[u8], scales: &[u8]) -> Vec<f32> {
    let mut out = Vec::with_capacity(blocks.len() * 2);
    for (block, &scale) in blocks.chunks_exact(BLOCK_BYTES).zip(scales) {
        let power = E8M0[usize::from(scale)];
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

    /// The hash is xxh3 of the widened `[experts, in, out]` f32 values, whatever the batching
    /// of its groups (here 19 groups: two whole batches and a part).
    #[test]
    fn widened_hash_is_the_hash_of_the_widened_tensor() {
        let (experts, out_dim, in_dim) = (2, 5, 19 * 32);
        let blocks: Vec<u8> = (0..experts * out_dim * in_dim / 2)
            .map(|i| (i * 37 % 251) as u8)
            .collect();
        let scales: Vec<u8> = (0..experts * out_dim * in_dim / 32)
            .map(|i| 120 + (i % 7) as u8)
            .collect();
        let m = Mxfp4Experts {
            blocks: &blocks,
            scales: &scales,
            experts,
            out_dim,
            in_dim,
        };
        let mut widened = Vec::new(); // [experts, in, out]
        for e in 0..experts {
            let (b, s) = m.expert(e);
            let rows = dequantize(b, s); // [out, in]
            for i in 0..in_dim {
                widened.extend((0..out_dim).map(|j| rows[j * in_dim + i]));
            }
        }
        let want = xxhash_rust::xxh3::xxh3_64(bytemuck::cast_slice(&widened));
        assert_eq!(m.widened_hash(), want);
    }
}
