//! The engine's forward passes on the bench model (`DemoModelSpec::bench`: hidden 512, 8 layers, 8
//! heads, 4 KV heads, intermediate 1408, vocab 32000, f32 on CPU): a decode step at batch 1 / 16 /
//! 64 (128 tokens of context each, fast path: split-KV attention, then greedy sampling of every
//! row, in parallel on the engine's kind of pool), a 512-token prefill (logits of the last row),
//! and one DVR verify pass of B × W = 8 × 64 rows (fixed attention schedule, logits and sampling of
//! every row).
//!
//! `cargo bench --bench engine`

use candle_core::{DType, Device};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use detspec::config::ModelConfig;
use detspec::demo::{write_demo_model, DemoModelSpec};
use detspec::kv::{KvPool, LayerCacheShape};
use detspec::model::{ForwardBatch, Model};
use detspec::ops::{with_f32_values, AttentionSchedule};
use detspec::sampling::{sample_next, SamplingParams};
use rayon::prelude::*;

const PAGE: usize = 16;
const CONTEXT: usize = 128;

struct Bench {
    model: Model,
    kv: KvPool,
    /// The engine's kernels run on its own pool, one thread per core.
    pool: rayon::ThreadPool,
    _dir: tempfile::TempDir,
}

fn setup() -> Bench {
    let dir = tempfile::tempdir().expect("tempdir");
    write_demo_model(dir.path(), &DemoModelSpec::bench()).expect("bench model");
    let cfg = ModelConfig::from_model_dir(dir.path()).expect("config");
    let model = Model::load(dir.path(), cfg.clone(), &Device::Cpu, DType::F32).expect("load");
    let kv = KvPool::new(
        LayerCacheShape::of_model(&cfg),
        1024,
        PAGE,
        DType::F32,
        &Device::Cpu,
    )
    .expect("kv pool");
    Bench {
        model,
        kv,
        pool: rayon::ThreadPoolBuilder::new()
            .build()
            .expect("thread pool"),
        _dir: dir,
    }
}

/// `seqs` sequences, each contributing the rows at positions `start..start + rows` (its pages
/// are its own), with logits for every row or only for each sequence's last.
fn batch(
    seqs: usize,
    start: usize,
    rows: usize,
    schedule: AttentionSchedule,
    all_logits: bool,
) -> ForwardBatch {
    let mut b = ForwardBatch::default();
    let pages_per_seq = (start + rows).div_ceil(PAGE);
    for s in 0..seqs {
        let table: Vec<u32> = (0..pages_per_seq)
            .map(|p| (s * pages_per_seq + p) as u32)
            .collect();
        for pos in start..start + rows {
            if all_logits || pos + 1 == start + rows {
                b.logit_rows.push(b.tokens.len() as u32);
            }
            b.tokens.push(((s * 7919 + pos * 31) % 30000) as u32 + 3);
            b.slots
                .push(table[pos / PAGE] * PAGE as u32 + (pos % PAGE) as u32);
            b.attention.positions.push(pos as u32);
            b.attention.row_seq.push(s as u32);
        }
        b.attention.block_tables.push(table);
    }
    b.attention.schedule = schedule;
    b
}

/// Forward, then a greedy token for every logit row, read in place and sampled in parallel
/// (what a step does besides bookkeeping). Runs on a worker of `bench.pool`, as the engine's
/// loop does.
fn step(bench: &Bench, b: &ForwardBatch) -> usize {
    bench.pool.install(|| {
        let logits = bench.model.forward(b, &bench.kv).expect("forward");
        let vocab = logits.dim(1).expect("vocab");
        let params = SamplingParams::default();
        with_f32_values(&logits, |values| {
            values
                .par_chunks(vocab)
                .map(|row| {
                    sample_next(&params, 0, &[1], &[], row, &[], None)
                        .expect("sample")
                        .token as usize
                })
                .sum()
        })
        .expect("logits")
    })
}

fn engine(c: &mut Criterion) {
    let bench = setup();
    let cfg = bench.model.config();
    let heads = (cfg.num_attention_heads, cfg.num_key_value_heads);
    let mut g = c.benchmark_group("decode_step");
    g.sample_size(10);
    for n in [1usize, 16, 64] {
        let b = batch(
            n,
            CONTEXT,
            1,
            AttentionSchedule::split_kv_for_batch(n, n, heads, &Device::Cpu),
            true,
        );
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::from_parameter(n), &b, |bch, b| {
            bch.iter(|| step(&bench, b))
        });
    }
    g.finish();

    let mut g = c.benchmark_group("prefill");
    g.sample_size(10);
    let b = batch(1, 0, 512, AttentionSchedule::Fixed, false);
    g.throughput(Throughput::Elements(512));
    g.bench_function("512_tokens", |bch| bch.iter(|| step(&bench, &b)));
    g.finish();

    let mut g = c.benchmark_group("verify_pass");
    g.sample_size(10);
    let b = batch(8, CONTEXT, 64, AttentionSchedule::Fixed, true);
    g.throughput(Throughput::Elements(8 * 64));
    g.bench_function("b8_w64", |bch| bch.iter(|| step(&bench, &b)));
    g.finish();
}

criterion_group!(benches, engine);
criterion_main!(benches);
