//! The paged-attention kernel's arithmetic, written out as plain scalar code: the kernel must
//! give exactly these bits (for both schedules, every instruction set, every way it groups rows
//! and heads into tasks). Any restructuring of the kernel for speed is checked against this.
//!
//! Per query (row, head) over its keys `start..=pos`, in blocks of 16 aligned to absolute
//! positions: each score is `((0 + q0·k0) + q1·k1) + …` (products rounded, no FMA) times
//! `scale`, then where there is a soft cap `c`, `tanh(s / c) · c` (`ops::tanh`); the block maximum updates the running maximum, the old state is scaled by
//! `exp(old − new)`, the block's probabilities are added to the denominator key by key, then
//! `p · v` is added to the accumulator key by key; the result is scaled by `1 / denom`. The
//! split-KV schedule runs the same fold over page-aligned chunks and merges them in order.

use std::sync::Arc;

use candle_core::{Device, Tensor};
use detspec::ops::{
    exp_nonpositive, paged_attention_with_isa, tanh, AttentionMetadata, AttentionSchedule, CpuIsa,
};
use proptest::prelude::*;

const BLOCK: usize = 16;

struct Cache {
    k: Vec<f32>,
    v: Vec<f32>,
    page: usize,
    kv_heads: usize,
    dim: usize,
}

impl Cache {
    fn k(&self, bt: &[u32], kvh: usize, j: usize, d: usize) -> f32 {
        let page = bt[j / self.page] as usize;
        self.k[((page * self.kv_heads + kvh) * self.dim + d) * self.page + j % self.page]
    }
    fn v(&self, bt: &[u32], kvh: usize, j: usize, d: usize) -> f32 {
        let slot = bt[j / self.page] as usize * self.page + j % self.page;
        self.v[(slot * self.kv_heads + kvh) * self.dim + d]
    }
}

/// Unnormalised fold of keys `range` for one query: `(acc, max, denom)`.
fn fold(
    c: &Cache,
    bt: &[u32],
    kvh: usize,
    q: &[f32],
    range: std::ops::Range<usize>,
    (scale, softcap): (f32, Option<f32>),
) -> (Vec<f32>, f32, f32) {
    let mut acc = vec![0f32; c.dim];
    let (mut max, mut denom) = (f32::NEG_INFINITY, 0f32);
    let mut j = range.start;
    while j < range.end {
        let end = ((j / BLOCK + 1) * BLOCK).min(range.end);
        let scores: Vec<f32> = (j..end)
            .map(|key| {
                let mut s = 0f32;
                for (d, &qd) in q.iter().enumerate() {
                    s += qd * c.k(bt, kvh, key, d);
                }
                let s = s * scale;
                softcap.map_or(s, |c| tanh(s / c) * c)
            })
            .collect();
        let new_max = scores.iter().fold(max, |m, &s| m.max(s));
        let correction = exp_nonpositive(max - new_max);
        denom *= correction;
        acc.iter_mut().for_each(|a| *a *= correction);
        let probs: Vec<f32> = scores
            .iter()
            .map(|&s| exp_nonpositive(s - new_max))
            .collect();
        for &p in &probs {
            denom += p;
        }
        for (i, key) in (j..end).enumerate() {
            for (d, a) in acc.iter_mut().enumerate() {
                *a += probs[i] * c.v(bt, kvh, key, d);
            }
        }
        max = new_max;
        j = end;
    }
    (acc, max, denom)
}

fn normalise(acc: &mut [f32], denom: f32) {
    if denom > 0.0 {
        let inv = 1.0 / denom;
        acc.iter_mut().for_each(|a| *a *= inv);
    }
}

/// The whole call, per the spec above.
fn spec(c: &Cache, q: &[f32], heads: usize, meta: &AttentionMetadata, scale: f32) -> Vec<f32> {
    let dim = c.dim;
    let group = heads / c.kv_heads;
    let mut out = Vec::with_capacity(q.len());
    for (row, (&pos, &seq)) in meta.positions.iter().zip(&meta.row_seq).enumerate() {
        let bt = &meta.block_tables[seq as usize];
        let pos = pos as usize;
        let start = meta
            .sliding_window
            .map_or(0, |w| (pos + 1).saturating_sub(w));
        let fixed = meta.fixed_seqs.get(seq as usize).copied().unwrap_or(false);
        let scores = (scale, meta.softcap);
        for head in 0..heads {
            let qh = &q[(row * heads + head) * dim..(row * heads + head + 1) * dim];
            let kvh = head / group;
            match meta.schedule {
                AttentionSchedule::SplitKv { splits } if !fixed => {
                    let blocks = (pos + 1 - start).div_ceil(BLOCK);
                    let chunk = blocks.div_ceil(splits) * BLOCK;
                    let parts: Vec<_> = (0..splits)
                        .map(|s| {
                            let lo = (start + s * chunk).min(pos + 1);
                            let hi = (lo + chunk).min(pos + 1);
                            fold(c, bt, kvh, qh, lo..hi, scores)
                        })
                        .collect();
                    let m = parts.iter().fold(f32::NEG_INFINITY, |a, p| a.max(p.1));
                    let mut o = vec![0f32; dim];
                    let mut denom = 0f32;
                    for (acc, pm, pd) in &parts {
                        if *pd == 0.0 {
                            continue;
                        }
                        let w = exp_nonpositive(pm - m);
                        denom += pd * w;
                        for (o, &a) in o.iter_mut().zip(acc) {
                            *o += a * w;
                        }
                    }
                    normalise(&mut o, denom);
                    out.extend(o);
                }
                _ => {
                    let (mut acc, _, denom) = fold(c, bt, kvh, qh, start..pos + 1, scores);
                    normalise(&mut acc, denom);
                    out.extend(acc);
                }
            }
        }
    }
    out
}

fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005) ^ 0x9e37_79b9_7f4a_7c15;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

/// A batch shaped like the engine's: prefill chunks (runs of consecutive positions of one
/// sequence) and decode rows, over sequences on shuffled pages.
#[derive(Debug, Clone)]
struct Case {
    page: usize,
    dim: usize,
    kv_heads: usize,
    group: usize,
    /// Per sequence: (first query position, query rows).
    seqs: Vec<(usize, usize)>,
    window: Option<usize>,
    softcap: Option<f32>,
    schedule: AttentionSchedule,
    fixed: Vec<bool>,
    seed: u64,
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop_oneof![Just(4usize), Just(16), Just(32), Just(12)],
        prop_oneof![Just(8usize), Just(16), Just(64), Just(72)],
        1usize..=3,
        prop_oneof![Just(1usize), Just(2), Just(3), Just(4), Just(8), Just(10)],
        // Decode rows (one a sequence) half the time: the fixed schedule's row tasks.
        proptest::collection::vec((0usize..90, prop_oneof![Just(1usize), 1usize..40]), 1..5),
        prop_oneof![Just(None), (1usize..70).prop_map(Some)],
        // Scores here are a few units: caps from well below to above them.
        prop_oneof![Just(None), (0.05f32..4.0).prop_map(Some)],
        prop_oneof![
            Just(AttentionSchedule::Fixed),
            (2usize..6).prop_map(|splits| AttentionSchedule::SplitKv { splits })
        ],
        proptest::collection::vec(any::<bool>(), 5),
        any::<u64>(),
    )
        .prop_map(
            |(page, dim, kv_heads, group, seqs, window, softcap, schedule, fixed, seed)| Case {
                page,
                dim,
                kv_heads,
                group,
                seqs,
                window,
                softcap,
                schedule,
                fixed,
                seed,
            },
        )
}

fn run(case: &Case, isa: CpuIsa) -> (Vec<u32>, Vec<u32>) {
    let Case {
        page,
        dim,
        kv_heads,
        group,
        ..
    } = *case;
    let heads = kv_heads * group;
    let pages_of: Vec<usize> = case
        .seqs
        .iter()
        .map(|&(p0, n)| (p0 + n).div_ceil(page))
        .collect();
    let total: usize = pages_of.iter().sum();
    // Shuffle the pool's pages over the sequences.
    let mut ids: Vec<u32> = (0..total as u32).collect();
    let mut s = case.seed | 1;
    for i in (1..ids.len()).rev() {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
        ids.swap(i, (s >> 33) as usize % (i + 1));
    }
    let mut tables = Vec::new();
    let mut at = 0;
    for &n in &pages_of {
        tables.push(ids[at..at + n].to_vec());
        at += n;
    }
    let cache = Cache {
        k: values(case.seed ^ 1, total * page * kv_heads * dim),
        v: values(case.seed ^ 2, total * page * kv_heads * dim),
        page,
        kv_heads,
        dim,
    };
    let (mut positions, mut row_seq) = (Vec::new(), Vec::new());
    for (seq, &(p0, n)) in case.seqs.iter().enumerate() {
        for p in p0..p0 + n {
            positions.push(p as u32);
            row_seq.push(seq as u32);
        }
    }
    let rows = positions.len();
    let meta = AttentionMetadata {
        positions,
        row_seq,
        block_tables: tables,
        sliding_window: case.window,
        softcap: case.softcap,
        schedule: case.schedule,
        fixed_seqs: case.fixed[..case.seqs.len()].to_vec(),
    };
    let q = values(case.seed ^ 3, rows * heads * dim);
    let want = spec(&cache, &q, heads, &meta, 0.17);
    let dev = Device::Cpu;
    let qt = Tensor::from_vec(q, (rows, heads, dim), &dev).unwrap();
    let kt = Tensor::from_vec(cache.k.clone(), (total, kv_heads, dim, page), &dev).unwrap();
    let vt = Tensor::from_vec(cache.v.clone(), (total, page, kv_heads, dim), &dev).unwrap();
    let got = paged_attention_with_isa(&qt, &kt, &vt, Arc::new(meta), 0.17, isa)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    (bits(got), bits(want))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn kernel_computes_the_spec_bit_for_bit(case in case()) {
        for isa in CpuIsa::available() {
            let (got, want) = run(&case, isa);
            prop_assert_eq!(got, want, "{:?}", isa);
        }
    }
}
