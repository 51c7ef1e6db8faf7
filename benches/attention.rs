//! Paged attention at the bench model's shapes (8 query heads, 4 KV heads, head_dim 64, 16-slot
//! pages scattered over the pool): decode of 1 / 16 / 64 sequences at 160 keys, and a prefill of
//! 4 × 128 rows (the offline benchmark's chunked prefill); decode also with a bf16 KV cache
//! (`fixed_bf16`: half the bytes, widened as loaded), and at 64 over eight layers' caches in
//! turn (`fixed_bf16_8_layers`: the engine's working set, which no L3 holds).
//!
//! `cargo bench --bench attention`

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use detspec::ops::{paged_attention, AttentionMetadata, AttentionSchedule};

const HEADS: usize = 8;
const KV_HEADS: usize = 4;
const DIM: usize = 64;
const PAGE: usize = 16;

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2654435761).wrapping_add(seed);
            (x >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        })
        .collect()
}

struct Setup {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    meta: Arc<AttentionMetadata>,
}

/// `seqs` sequences of `ctx` keys on scattered pages; `rows_per_seq` query rows per sequence
/// at the last positions (1 for decode, `ctx` for a prefill).
fn setup(seqs: usize, ctx: usize, rows_per_seq: usize, schedule: AttentionSchedule) -> Setup {
    let dev = Device::Cpu;
    let pages_per_seq = ctx.div_ceil(PAGE);
    let pages = seqs * pages_per_seq;
    // Page p of sequence s sits at a pseudo-random physical page (a permutation of the pool).
    let perm: Vec<u32> = (0..pages as u64)
        .map(|i| ((i * 7919) % pages as u64) as u32)
        .collect();
    let block_tables: Vec<Vec<u32>> = (0..seqs)
        .map(|s| perm[s * pages_per_seq..(s + 1) * pages_per_seq].to_vec())
        .collect();
    let n = pages * PAGE * KV_HEADS * DIM;
    let k = Tensor::from_vec(values(n, 1), (pages, KV_HEADS, DIM, PAGE), &dev).expect("k");
    let v = Tensor::from_vec(values(n, 2), (pages, PAGE, KV_HEADS, DIM), &dev).expect("v");
    let mut positions = Vec::new();
    let mut row_seq = Vec::new();
    for s in 0..seqs {
        for p in ctx - rows_per_seq..ctx {
            positions.push(p as u32);
            row_seq.push(s as u32);
        }
    }
    let rows = positions.len();
    let q = Tensor::from_vec(values(rows * HEADS * DIM, 3), (rows, HEADS, DIM), &dev).expect("q");
    let meta = Arc::new(AttentionMetadata {
        positions,
        row_seq,
        block_tables,
        sliding_window: None,
        softcap: None,
        schedule,
        fixed_seqs: Vec::new(),
    });
    Setup { q, k, v, meta }
}

fn run(s: &Setup) -> Tensor {
    paged_attention(&s.q, &s.k, &s.v, s.meta.clone(), 0.125).expect("attention")
}

fn attention(c: &mut Criterion) {
    let ctx = 160;
    let mut g = c.benchmark_group("attention_decode");
    g.sample_size(30);
    for seqs in [1usize, 16, 64] {
        let schedule = AttentionSchedule::split_kv_for_batch(
            seqs,
            seqs,
            (HEADS, KV_HEADS),
            &candle_core::Device::Cpu,
        );
        let s = setup(seqs, ctx, 1, schedule);
        g.throughput(Throughput::Elements((seqs * ctx) as u64));
        g.bench_with_input(BenchmarkId::new("fast", seqs), &seqs, |b, _| {
            b.iter(|| run(&s))
        });
        let s = setup(seqs, ctx, 1, AttentionSchedule::Fixed);
        g.bench_with_input(BenchmarkId::new("fixed", seqs), &seqs, |b, _| {
            b.iter(|| run(&s))
        });
        let s = Setup {
            k: s.k.to_dtype(DType::BF16).expect("k bf16"),
            v: s.v.to_dtype(DType::BF16).expect("v bf16"),
            ..s
        };
        g.bench_with_input(BenchmarkId::new("fixed_bf16", seqs), &seqs, |b, _| {
            b.iter(|| run(&s))
        });
        if seqs == 64 {
            // The engine's working set: eight layers' caches read in turn (84 MB in bf16, past
            // this CPU's share of L3), where `fixed_bf16` rereads one layer's 10.5 MB.
            let layers: Vec<Setup> = (0..8)
                .map(|_| {
                    let s = setup(seqs, ctx, 1, AttentionSchedule::Fixed);
                    Setup {
                        k: s.k.to_dtype(DType::BF16).expect("k bf16"),
                        v: s.v.to_dtype(DType::BF16).expect("v bf16"),
                        ..s
                    }
                })
                .collect();
            let mut next = 0;
            g.bench_with_input(
                BenchmarkId::new("fixed_bf16_8_layers", seqs),
                &seqs,
                |b, _| {
                    b.iter(|| {
                        next = (next + 1) % layers.len();
                        run(&layers[next])
                    })
                },
            );
        }
    }
    g.finish();
    let mut g = c.benchmark_group("attention_prefill");
    g.sample_size(20);
    let s = setup(4, 128, 128, AttentionSchedule::Fixed);
    g.throughput(Throughput::Elements(4 * 128 * 129 / 2));
    g.bench_function("4x128", |b| b.iter(|| run(&s)));
    g.finish();
}

criterion_group!(benches, attention);
criterion_main!(benches);
