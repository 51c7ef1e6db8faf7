//! The MXFP4 GEMM gives the f32 GEMM's bits on the widened weights: for every M, column
//! selection (gpt-oss's gate rows are every other row), instruction set and kernel profile;
//! so it inherits that GEMM's batch-, position- and thread-invariance. In the bf16-activation
//! mode, the same packed weight gives that mode's GEMM's bits on the widened weights stored in
//! bf16, on the instruction and in the emulation, denormal and infinite scales included.

use std::sync::Arc;

use candle_core::{Device, Tensor};
use detspec::config::KernelProfile;
use detspec::ops::{
    matmul_packed_mxfp4_profiled, matmul_packed_profiled, packed_matmul_abf16_with,
    packed_matmul_mxfp4_with, packed_matmul_with, CpuIsa, DotIsa, PackedWeight, PackedWeightAbf16,
    PackedWeightMxfp4, E2M1, E8M0, MXFP4_BLOCK,
};

/// A tiny deterministic generator (xorshift).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Random MXFP4 tensors of a `[rows, k]` matrix: code bytes and scales near 2^-4.
fn mxfp4(rows: usize, k: usize, seed: u64) -> (Vec<u8>, Vec<u8>) {
    let mut rng = Rng(seed);
    let blocks = (0..rows * k / 2).map(|_| rng.next() as u8).collect();
    let scales = (0..rows * k / MXFP4_BLOCK)
        .map(|_| 120 + (rng.next() % 6) as u8)
        .collect();
    (blocks, scales)
}

/// `W^T` widened, `[n, k]` row-major, for checkpoint rows `rows`.
fn widened(blocks: &[u8], scales: &[u8], rows: &[usize], k: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows.len() * k);
    for &r in rows {
        for kk in 0..k {
            let byte = blocks[r * k / 2 + kk / 2];
            let code = if kk % 2 == 0 { byte & 15 } else { byte >> 4 };
            let scale = scales[r * k / MXFP4_BLOCK + kk / MXFP4_BLOCK];
            out.push(E2M1[code as usize] * E8M0[scale as usize]);
        }
    }
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn activations(m: usize, k: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed);
    (0..m * k)
        .map(|_| (rng.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
        .collect()
}

#[test]
fn mxfp4_gemm_is_the_f32_gemm_on_the_widened_weights() {
    for (k, stored, seed) in [(64, 40, 1), (96, 70, 2), (320, 96, 3)] {
        let (blocks, scales) = mxfp4(stored, k, seed);
        // All rows in order, and every other row (gpt-oss's gate), a width not of 32.
        let all: Vec<usize> = (0..stored).collect();
        let even: Vec<usize> = (0..stored).step_by(2).collect();
        for rows in [all, even] {
            let n = rows.len();
            let packed =
                Arc::new(PackedWeightMxfp4::from_blocks(&blocks, &scales, &rows, k).unwrap());
            let dense = widened(&blocks, &scales, &rows, k);
            let reference = Arc::new(PackedWeight::from_transposed(&dense, n, k).unwrap());
            assert!(packed.bytes() < n.div_ceil(32) * 32 * k * 6 / 10);
            for m in [1, 3, 8, 17, 64] {
                let a = activations(m, k, seed + m as u64);
                let want = bits(&packed_matmul_with(&a, m, &reference, CpuIsa::Portable).unwrap());
                for isa in CpuIsa::available() {
                    let got = packed_matmul_mxfp4_with(&a, m, &packed, isa).unwrap();
                    assert_eq!(bits(&got), want, "k={k} n={n} m={m} {isa:?}");
                }
                // The shape-dependent profile's split-K sums too.
                let x = Tensor::from_vec(a, (m, k), &Device::Cpu).unwrap();
                let profile = KernelProfile::ShapeDependent;
                let got = matmul_packed_mxfp4_profiled(&x, &packed, profile, false).unwrap();
                let want = matmul_packed_profiled(&x, &reference, profile, false).unwrap();
                let flat = |t: Tensor| bits(&t.flatten_all().unwrap().to_vec1::<f32>().unwrap());
                assert_eq!(flat(got), flat(want), "split-K k={k} n={n} m={m}");
            }
        }
    }
}

#[test]
fn mxfp4_in_the_bf16_activation_gemm_is_that_gemm_on_the_widened_bf16_weights() {
    for (k, stored, seed) in [(64, 40, 11), (96, 70, 12), (320, 96, 13)] {
        let (blocks, mut scales) = mxfp4(stored, k, seed);
        // Scales whose values are denormal in bf16 (0 and 1), and 255 (infinite, as widened).
        if seed == 12 {
            for (i, s) in scales.iter_mut().enumerate() {
                *s = [0, 1, 2, 255, 121][i % 5];
            }
        }
        let all: Vec<usize> = (0..stored).collect();
        let odd: Vec<usize> = (1..stored).step_by(2).collect();
        for rows in [all, odd] {
            let n = rows.len();
            let packed = PackedWeightMxfp4::from_blocks(&blocks, &scales, &rows, k).unwrap();
            let dense: Vec<u16> = widened(&blocks, &scales, &rows, k)
                .iter()
                .map(|x| {
                    assert_eq!(x.to_bits() & 0xffff, 0, "not exact in bf16: {x}");
                    (x.to_bits() >> 16) as u16
                })
                .collect();
            let reference = PackedWeightAbf16::from_transposed_bits(&dense, n, k).unwrap();
            for m in [1, 3, 13, 64] {
                let a = activations(m, k, seed + m as u64);
                let want = packed_matmul_abf16_with(&a, m, &reference, DotIsa::Emulated).unwrap();
                for isa in DotIsa::available() {
                    let got = packed_matmul_abf16_with(&a, m, &packed, isa).unwrap();
                    assert_eq!(bits(&got), bits(&want), "k={k} n={n} m={m} {isa:?}");
                }
            }
        }
    }
}

#[test]
fn bad_mxfp4_shapes_are_errors() {
    let (blocks, scales) = mxfp4(4, 64, 9);
    // k not a multiple of 32; a row past the tensor; scales of another shape.
    assert!(PackedWeightMxfp4::from_blocks(&blocks, &scales, &[0, 1], 48).is_err());
    assert!(PackedWeightMxfp4::from_blocks(&blocks, &scales, &[0, 4], 64).is_err());
    assert!(PackedWeightMxfp4::from_blocks(&blocks, &scales[1..], &[0], 64).is_err());
}
