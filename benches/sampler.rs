//! Host-side cost of turning one row of logits into a token: `sample_next`, the call the engine
//! makes for every sampled row (fast path and verifier alike), at the bench model's vocabulary
//! (32,000) and Llama 3's (128,256).
//!
//! ```sh
//! cargo bench --bench sampler -- --warm-up-time 1 --measurement-time 3
//! ```
//!
//! The row imitates a language model's logits rather than a flat random model's: a bulk of
//! N(0, 3²) values and a few tokens 10–18 above it, so the seeded cases see the spread a real
//! distribution has (it decides how many tokens the Gumbel-max draw may skip). Cases:
//! `greedy` (the default request), `greedy_logprobs5`, `t1` (temperature 1, RL rollouts),
//! `t0.6_p0.95` (temperature and nucleus, a common eval setting), `t1_k50`, `t1_minp0.05`;
//! and the seeded ones on a confident model's row (`peaked_*`: one token 20 above a narrow
//! bulk, as the GPU benchmarks' peaked model).
//! On a GPU the engine runs these on the host, in parallel over rows, after copying the logits.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use detspec::sampling::{sample_next, SamplingParams};

/// A language-model-like row: a N(0, 3²) bulk (sum of four uniforms, rescaled) and every
/// 997th token lifted by 10–18.
fn lm_row(vocab: usize) -> Vec<f32> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32
    };
    (0..vocab)
        .map(|i| {
            let bulk = (uniform() + uniform() + uniform() + uniform() - 2.0) * 3.0 * 1.732;
            if i % 997 == 3 {
                bulk + 10.0 + 8.0 * uniform()
            } else {
                bulk
            }
        })
        .collect()
}

fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..Default::default()
    }
}

fn cases() -> Vec<(&'static str, SamplingParams)> {
    let seeded = |temperature: f32| SamplingParams {
        temperature,
        seed: Some(7),
        ..Default::default()
    };
    vec![
        ("greedy", greedy()),
        (
            "greedy_logprobs5",
            SamplingParams {
                logprobs: Some(5),
                ..greedy()
            },
        ),
        ("t1", seeded(1.0)),
        (
            "t0.6_p0.95",
            SamplingParams {
                top_p: 0.95,
                ..seeded(0.6)
            },
        ),
        (
            "t1_k50",
            SamplingParams {
                top_k: 50,
                ..seeded(1.0)
            },
        ),
        (
            "t1_minp0.05",
            SamplingParams {
                min_p: 0.05,
                ..seeded(1.0)
            },
        ),
    ]
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("sample_next");
    g.throughput(Throughput::Elements(1));
    for vocab in [32_000usize, 128_256] {
        let row = lm_row(vocab);
        let prompt: Vec<u32> = (0..128).collect();
        let output: Vec<u32> = (1000..1032).collect();
        for (label, params) in cases() {
            g.bench_function(BenchmarkId::new(label, vocab), |b| {
                b.iter(|| {
                    black_box(sample_next(&params, 7, &prompt, &output, &row, &[2], None).unwrap())
                })
            });
        }
    }
    // A confident model's row (the GPU benchmarks' peaked model): one token 20 above a
    // narrow bulk, so at T = 0.6 every token is within the nucleus filter's reach.
    let mut peaked = lm_row(128_256);
    for l in peaked.iter_mut() {
        *l *= 0.1;
    }
    peaked[5] = 20.0;
    let prompt: Vec<u32> = (0..128).collect();
    let output: Vec<u32> = (1000..1032).collect();
    for (label, params) in cases().into_iter().filter(|(l, _)| l.starts_with('t')) {
        g.bench_function(BenchmarkId::new(format!("peaked_{label}"), 128_256), |b| {
            b.iter(|| {
                black_box(sample_next(&params, 7, &prompt, &output, &peaked, &[2], None).unwrap())
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
