//! The linear layers' GEMM: detspec's packed, fixed-order kernel (f32 weights, and bf16 weights
//! widened in registers; bf16 weights × bf16-rounded activations on `VDPBF16PS` or its
//! emulation, the `activation_dtype="bfloat16"` mode; MXFP4 and FP8 weights in both modes,
//! FP8 in the f32 mode as held in f32 and rounded to bf16) against
//! candle's CPU matmul, at the bench model's shapes
//! (`DemoModelSpec::bench`) and decode batch sizes 1 / 16 / 64.
//!
//! `cargo bench --bench gemm`

use std::sync::Arc;

use candle_core::{Device, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use detspec::config::KernelProfile;
use detspec::ops::{
    bf16_bits, matmul_packed, matmul_packed_abf16, matmul_packed_bf16, matmul_packed_fp8_profiled,
    matmul_packed_mxfp4_profiled, PackedWeight, PackedWeightAbf16, PackedWeightBf16,
    PackedWeightFp8, PackedWeightMxfp4,
};

/// (K, N) of the bench model's linear layers: q/o, k/v, gate/up, down, lm_head; a
/// gpt-oss-20b expert's gate/up; and a Llama-3.1-8B q/o projection.
const SHAPES: &[(usize, usize)] = &[
    (512, 512),
    (512, 256),
    (512, 1408),
    (1408, 512),
    (512, 32000),
    (2880, 2880),
    (4096, 4096),
];

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2654435761).wrapping_add(seed);
            (x >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        })
        .collect()
}

fn gemm(c: &mut Criterion) {
    let dev = Device::Cpu;
    for &(k, n) in SHAPES {
        let w = values(k * n, 7);
        let wt = Tensor::from_vec(w.clone(), (k, n), &dev).expect("weight");
        let packed = Arc::new(PackedWeight::from_row_major(&w, k, n).expect("pack"));
        let bits: Vec<u16> = w.iter().map(|&x| bf16_bits(x)).collect();
        let packed16 = Arc::new(PackedWeightBf16::from_row_major_bits(&bits, k, n).expect("pack"));
        let packed_a16 =
            Arc::new(PackedWeightAbf16::from_row_major_bits(&bits, k, n).expect("pack"));
        // MXFP4 (gpt-oss's experts): random codes, scales near 2^-6.
        let codes: Vec<u8> = (0..n * k / 2)
            .map(|i| ((i * 2654435761usize) >> 7) as u8)
            .collect();
        let scales: Vec<u8> = (0..n * k / 32).map(|i| 119 + (i % 4) as u8).collect();
        let rows: Vec<usize> = (0..n).collect();
        let packed4 =
            Arc::new(PackedWeightMxfp4::from_blocks(&codes, &scales, &rows, k).expect("pack"));
        // FP8 (an FP8 checkpoint's `[n, k]` matrix): every code but NaN, 128 × 128 blocks.
        let fp8_codes: Vec<u8> = (0..n * k)
            .map(|i| (((i * 2654435761usize) >> 9) as u8 & 0xfe) | 0x08)
            .collect();
        let fp8_scales: Vec<f32> = (0..n.div_ceil(128) * k.div_ceil(128))
            .map(|i| (1.0 + (i % 7) as f32 / 7.0) / 448.0)
            .collect();
        let fp8 = |round| {
            Arc::new(
                PackedWeightFp8::from_codes(&fp8_codes, &fp8_scales, n, k, [128, 128], round)
                    .expect("pack"),
            )
        };
        let (packed8, packed8_bf16) = (fp8(false), fp8(true));
        let mut g = c.benchmark_group(format!("gemm_k{k}_n{n}"));
        g.sample_size(20);
        for m in [1usize, 16, 64, 1024] {
            let x = Tensor::from_vec(values(m * k, 3), (m, k), &dev).expect("input");
            g.throughput(Throughput::Elements((2 * m * k * n) as u64));
            g.bench_with_input(BenchmarkId::new("packed", m), &m, |b, _| {
                b.iter(|| matmul_packed(&x, &packed).expect("packed"))
            });
            g.bench_with_input(BenchmarkId::new("packed_bf16", m), &m, |b, _| {
                b.iter(|| matmul_packed_bf16(&x, &packed16).expect("packed bf16"))
            });
            g.bench_with_input(BenchmarkId::new("packed_mxfp4", m), &m, |b, _| {
                b.iter(|| {
                    matmul_packed_mxfp4_profiled(&x, &packed4, KernelProfile::Invariant, false)
                        .expect("packed mxfp4")
                })
            });
            g.bench_with_input(BenchmarkId::new("packed_abf16", m), &m, |b, _| {
                b.iter(|| matmul_packed_abf16(&x, &packed_a16, false).expect("packed abf16"))
            });
            g.bench_with_input(BenchmarkId::new("packed_mxfp4_abf16", m), &m, |b, _| {
                b.iter(|| matmul_packed_abf16(&x, &packed4, false).expect("mxfp4 abf16"))
            });
            for (name, w) in [("packed_fp8", &packed8), ("packed_fp8_bf16", &packed8_bf16)] {
                g.bench_with_input(BenchmarkId::new(name, m), &m, |b, _| {
                    b.iter(|| {
                        matmul_packed_fp8_profiled(&x, w, KernelProfile::Invariant, false)
                            .expect("packed fp8")
                    })
                });
            }
            g.bench_with_input(BenchmarkId::new("packed_fp8_abf16", m), &m, |b, _| {
                b.iter(|| matmul_packed_abf16(&x, &packed8_bf16, false).expect("fp8 abf16"))
            });
            if detspec::ops::DotIsa::amx_available() {
                g.bench_with_input(BenchmarkId::new("packed_abf16_amx", m), &m, |b, _| {
                    b.iter(|| matmul_packed_abf16(&x, &packed_a16, true).expect("abf16 amx"))
                });
            }
            g.bench_with_input(BenchmarkId::new("candle", m), &m, |b, _| {
                b.iter(|| x.matmul(&wt).expect("candle"))
            });
        }
        g.finish();
    }
}

criterion_group!(benches, gemm);
criterion_main!(benches);
