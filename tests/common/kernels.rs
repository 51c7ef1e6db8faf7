//! What the kernel tests share (`tests/gemm.rs`, `gemm_abf16.rs`, `bf16.rs`, `ops.rs`,
//! `cuda_ops.rs`): a rayon pool of a given size, the (K, N) shapes the engine's models run, the
//! columns a shape's check samples, fixed test data, bitwise views of tensors and attention
//! metadata. Included with `#[path]`, so not every binary uses every item.
#![allow(dead_code)]

use candle_core::{DType, Tensor};
use detspec::ops::{AttentionMetadata, AttentionSchedule};

/// Uniform values in [-1, 1) from a small LCG: the same test data on every machine.
pub fn randn(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// A tensor's values as f32 bits, row-major (bf16 widens exactly; any device).
pub fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .expect("f32 values")
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// Attention metadata of query rows given as (sequence, position), over `tables`.
pub fn meta(
    rows: &[(u32, u32)],
    tables: Vec<Vec<u32>>,
    schedule: AttentionSchedule,
) -> AttentionMetadata {
    AttentionMetadata {
        positions: rows.iter().map(|r| r.1).collect(),
        row_seq: rows.iter().map(|r| r.0).collect(),
        block_tables: tables,
        sliding_window: None,
        schedule,
        fixed_seqs: Vec::new(),
    }
}

/// `f` on a fresh rayon pool of `threads` threads.
pub fn in_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool")
        .install(f)
}

/// (K, N) of every linear layer of the bench model (hidden 512, 8 heads × 64, 4 KV heads,
/// intermediate 1408, vocab 32000) and of the test models (tests/common, tests/python/conftest.py).
pub const MODEL_GEMM_SHAPES: [(usize, usize); 10] = [
    (512, 512),
    (512, 256),
    (512, 1408),
    (1408, 512),
    (512, 32000),
    (64, 64),
    (64, 32),
    (64, 128),
    (128, 64),
    (64, 512),
];

/// Columns a check of an N-column product samples: a spread, and both sides of the first panel
/// edges and of the last column.
pub fn sampled_columns(n: usize) -> Vec<usize> {
    let mut cols: Vec<usize> = (0..n).step_by(37).collect();
    cols.extend([0, 31, 32, n - 1, n.saturating_sub(33)]);
    cols.retain(|&j| j < n);
    cols
}
