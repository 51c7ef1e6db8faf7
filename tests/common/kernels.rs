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
        softcap: None,
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

/// The fused decoder ops give their unfused pairs' bits on `dev` in `dtype` (the models'
/// shapes and odd ones): `add_rms_norm` = `add` then `rms_norm`; `rope_qkv` = the stacked
/// projection's q/k columns through `apply_rope` and its v columns as they are;
/// `rope_qkv_into_cache` = `rope_qkv` then `write_k`/`write_kv` (q and both caches, pages
/// around the written slots untouched); `gated_halves` = `gated` of the two halves (SwiGLU and
/// GeGLU).
pub fn assert_fused_ops_match_unfused(dev: &candle_core::Device, dtype: DType) {
    use detspec::config::Activation;
    use detspec::ops::{
        add, add_rms_norm, apply_rope, gated, gated_halves, rms_norm, rope_qkv,
        rope_qkv_into_cache, write_k, write_kv,
    };
    let tensor = |seed: u64, shape: &[usize], scale: f32, dtype: DType| {
        let n = shape.iter().product();
        let values = randn(seed, n).into_iter().map(|v| v * scale).collect();
        Tensor::from_vec(values, shape, &candle_core::Device::Cpu)
            .and_then(|t| t.to_dtype(dtype))
            .and_then(|t| t.to_device(dev))
            .expect("test tensor")
    };
    let part = |t: &Tensor, at: usize, width: usize, shape: (usize, usize, usize)| {
        t.narrow(1, at, width)
            .and_then(|p| p.contiguous())
            .and_then(|p| p.reshape(shape))
            .expect("part")
    };
    // (rows, q heads, kv heads, head_dim, intermediate)
    for (i, &(rows, h, kvh, d, is)) in
        [(1, 32, 8, 128, 14336), (7, 4, 2, 8, 24), (33, 6, 3, 64, 96)]
            .iter()
            .enumerate()
    {
        let seed = 100 * i as u64;
        let hs = h * d;
        let (x, delta) = (
            tensor(seed, &[rows, hs], 4.0, dtype),
            tensor(seed + 1, &[rows, hs], 1.0, dtype),
        );
        let w = tensor(seed + 2, &[hs], 1.0, dtype);
        let (sum, normed) = add_rms_norm(&x, &delta, &w, 1e-5).expect("add_rms_norm");
        let sum_ref = add(&x, &delta).expect("add");
        let normed_ref = rms_norm(&sum_ref, &w, 1e-5).expect("rms_norm");
        assert_eq!(
            bits(&sum),
            bits(&sum_ref),
            "add_rms_norm sum, case {i} {dtype:?}"
        );
        assert_eq!(
            bits(&normed),
            bits(&normed_ref),
            "add_rms_norm norm, case {i} {dtype:?}"
        );

        let qkv = tensor(seed + 3, &[rows, (h + 2 * kvh) * d], 2.0, dtype);
        let cos = tensor(seed + 4, &[rows, d / 2], 1.0, DType::F32);
        let sin = tensor(seed + 5, &[rows, d / 2], 1.0, DType::F32);
        let (q, k, v) = rope_qkv(&qkv, &cos, &sin, h, kvh).expect("rope_qkv");
        let q_ref = apply_rope(&part(&qkv, 0, h * d, (rows, h, d)), &cos, &sin).expect("rope q");
        let k_ref =
            apply_rope(&part(&qkv, h * d, kvh * d, (rows, kvh, d)), &cos, &sin).expect("rope k");
        let v_ref = part(&qkv, (h + kvh) * d, kvh * d, (rows, kvh, d));
        assert_eq!(
            (q.dims(), k.dims(), v.dims()),
            (q_ref.dims(), k_ref.dims(), v_ref.dims())
        );
        assert_eq!(bits(&q), bits(&q_ref), "rope_qkv q, case {i} {dtype:?}");
        assert_eq!(bits(&k), bits(&k_ref), "rope_qkv k, case {i} {dtype:?}");
        assert_eq!(bits(&v), bits(&v_ref), "rope_qkv v, case {i} {dtype:?}");

        // Pages of 16 slots, the rows' slots scattered over them (not in order, one page
        // partly filled), the caches starting from random values.
        let (page, pages) = (16, rows.div_ceil(3) + 2);
        let slots: std::sync::Arc<Vec<u32>> = std::sync::Arc::new(
            (0..rows)
                .map(|r| ((r * 37 + 5) % (pages * page)) as u32)
                .collect(),
        );
        let caches = || {
            (
                tensor(seed + 7, &[pages, kvh, d, page], 1.0, dtype),
                tensor(seed + 8, &[pages, page, kvh, d], 1.0, dtype),
            )
        };
        let (kc, vc) = caches();
        let q_fused = rope_qkv_into_cache(&qkv, &cos, &sin, h, kvh, &kc, &vc, slots.clone())
            .expect("rope_qkv_into_cache");
        let (kc_ref, vc_ref) = caches();
        write_k(&kc_ref, &k, slots.clone()).expect("write_k");
        write_kv(&vc_ref, &v, slots).expect("write_kv");
        assert_eq!(q_fused.dims(), q.dims());
        assert_eq!(
            bits(&q_fused),
            bits(&q),
            "rope_qkv_into_cache q, case {i} {dtype:?}"
        );
        assert_eq!(
            bits(&kc),
            bits(&kc_ref),
            "rope_qkv_into_cache K cache, case {i} {dtype:?}"
        );
        assert_eq!(
            bits(&vc),
            bits(&vc_ref),
            "rope_qkv_into_cache V cache, case {i} {dtype:?}"
        );

        let gu = tensor(seed + 6, &[rows, 2 * is], 6.0, dtype);
        for f in [Activation::Silu, Activation::GeluTanh] {
            let act = gated_halves(&gu, f).expect("gated_halves");
            let act_ref = gated(
                &gu.narrow(1, 0, is).expect("gate"),
                &gu.narrow(1, is, is).expect("up"),
                f,
            )
            .expect("gated");
            assert_eq!(
                bits(&act),
                bits(&act_ref),
                "gated_halves {f:?}, case {i} {dtype:?}"
            );
        }
    }
}
