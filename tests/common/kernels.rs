//! What the kernel tests share (`tests/gemm.rs`, `gemm_abf16.rs`, `bf16.rs`, `ops.rs`): a
//! rayon pool of a given size, the (K, N) shapes the engine's models run, and the columns a
//! shape's check samples. Included with `#[path]`, so not every binary uses every item.
#![allow(dead_code)]

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
