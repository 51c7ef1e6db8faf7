//! The CUDA half of the kernel table (docs/determinism.md), measured on a GPU: for every op a
//! forward runs, whether a row's bits depend on the batch around it (batch size, the row's
//! index, its neighbours' values, the paging of its keys) and, for attention, on the split of
//! the key range. Asserted where the determinism contract relies on the property; measured and
//! printed (`KERNEL-TABLE` lines) where it is the vendor library's behaviour, cuBLAS's choice of
//! kernel by M.
//!
//! Built with the `cuda` feature (CI compiles it; `scripts/gpu-session.sh` runs it on a GPU with
//! `--nocapture --test-threads=1`). Without a GPU every test returns at once, saying so.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use detspec::config::Activation;
use detspec::config::DeviceSpec;
use detspec::ops::{
    add, apply_rope, copy_pages, gated, invariant_matmul, paged_attention, rms_norm, swiglu,
    write_k, write_kv, AttentionMetadata, AttentionSchedule,
};

#[path = "common/kernels.rs"]
mod kernels;
use kernels::{assert_fused_ops_match_unfused, bits, meta, randn};

/// The GPU, or `None` (printed) where this machine has none.
fn gpu() -> Option<Device> {
    match DeviceSpec::Cuda(0).open() {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    }
}

fn tensor(seed: u64, shape: &[usize], dtype: DType, dev: &Device) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(randn(seed, n), shape, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .and_then(|t| t.to_device(dev))
        .expect("test tensor")
}

fn row(t: &Tensor, r: usize) -> Vec<u32> {
    bits(&t.narrow(0, r, 1).expect("row"))
}

/// `m` rows: `target` at row `at`, random rows (from `seed`) around it.
fn with_row_at(target: &Tensor, m: usize, at: usize, seed: u64) -> Tensor {
    let mut shape = target.dims().to_vec();
    shape[0] = m;
    let others = tensor(seed, &shape, target.dtype(), target.device());
    let mut parts = Vec::new();
    if at > 0 {
        parts.push(others.narrow(0, 0, at).expect("narrow"));
    }
    parts.push(target.clone());
    if at + 1 < m {
        parts.push(others.narrow(0, at + 1, m - at - 1).expect("narrow"));
    }
    Tensor::cat(&parts, 0).expect("cat")
}

fn table(op: &str, dtype: DType, property: &str, holds: bool, detail: &str) {
    println!(
        "KERNEL-TABLE | {op} | {} | {property} | {} | {detail}",
        dtype.as_str(),
        if holds { "yes" } else { "no" }
    );
}

const DTYPES: [DType; 2] = [DType::F32, DType::BF16];
/// Batch sizes the row-wise checks run at: 1, a few, the verify pass's B × W = 512, odd ones.
const ROWS: [usize; 6] = [1, 2, 7, 64, 257, 512];

#[test]
fn row_wise_kernels_are_batch_and_position_invariant() {
    let Some(dev) = gpu() else { return };
    // Llama-3.1-8B's widths: hidden 4096, 32 heads of 128, intermediate 14336.
    let (hs, h, d, inter) = (4096, 32, 128, 14336);
    for dtype in DTYPES {
        let x = tensor(1, &[1, hs], dtype, &dev);
        let w = tensor(2, &[hs], dtype, &dev);
        let q = tensor(3, &[1, h, d], dtype, &dev);
        let cos = tensor(4, &[1, d / 2], DType::F32, &dev);
        let sin = tensor(5, &[1, d / 2], DType::F32, &dev);
        let (g, u) = (
            tensor(6, &[1, inter], dtype, &dev),
            tensor(7, &[1, inter], dtype, &dev),
        );
        let solo_norm = row(&rms_norm(&x, &w, 1e-5).expect("rms_norm"), 0);
        let solo_rope = row(&apply_rope(&q, &cos, &sin).expect("rope"), 0);
        let solo_swiglu = row(&swiglu(&g, &u).expect("swiglu"), 0);
        let solo_geglu = row(&gated(&g, &u, Activation::GeluTanh).expect("geglu"), 0);
        let solo_add = row(&add(&x, &x).expect("add"), 0);
        let mut checked = 0;
        for (i, &m) in ROWS.iter().enumerate() {
            for at in [0, m / 2, m - 1] {
                let seed = 100 + 10 * i as u64 + at as u64;
                let xb = with_row_at(&x, m, at, seed);
                assert_eq!(
                    row(&rms_norm(&xb, &w, 1e-5).expect("rms_norm"), at),
                    solo_norm,
                    "rms_norm {dtype:?} M={m} row {at}"
                );
                let qb = with_row_at(&q, m, at, seed + 1);
                let (cb, sb) = (
                    with_row_at(&cos, m, at, seed + 2),
                    with_row_at(&sin, m, at, seed + 3),
                );
                assert_eq!(
                    row(&apply_rope(&qb, &cb, &sb).expect("rope"), at),
                    solo_rope,
                    "rope {dtype:?} M={m} row {at}"
                );
                let (gb, ub) = (
                    with_row_at(&g, m, at, seed + 4),
                    with_row_at(&u, m, at, seed + 5),
                );
                assert_eq!(
                    row(&swiglu(&gb, &ub).expect("swiglu"), at),
                    solo_swiglu,
                    "swiglu {dtype:?} M={m} row {at}"
                );
                assert_eq!(
                    row(&gated(&gb, &ub, Activation::GeluTanh).expect("geglu"), at),
                    solo_geglu,
                    "geglu {dtype:?} M={m} row {at}"
                );
                assert_eq!(
                    row(&add(&xb, &xb).expect("add"), at),
                    solo_add,
                    "add {dtype:?} M={m} row {at}"
                );
                checked += 1;
            }
        }
        let detail = format!("{checked} (M, row) placements, M in {ROWS:?}, 8B widths");
        for op in ["rms_norm", "rope", "swiglu", "geglu", "residual add"] {
            table(op, dtype, "batch- and position-invariant", true, &detail);
        }
    }
}

const PAGE: usize = 16;
const KVH: usize = 8;
const H: usize = 32;
const D: usize = 128;

/// A cache of `pages` pages; K transposed per page (`[pages, kv_heads, head_dim, page]`), V rows.
fn empty_cache(pages: usize, dtype: DType, dev: &Device) -> (Tensor, Tensor) {
    (
        Tensor::zeros((pages, KVH, D, PAGE), dtype, dev).expect("k cache"),
        Tensor::zeros((pages, PAGE, KVH, D), dtype, dev).expect("v cache"),
    )
}

/// Writes `len` positions of keys/values (from `seed`) into the pages of `table`.
fn fill(k: &Tensor, v: &Tensor, table: &[u32], len: usize, seed: u64) {
    let slots: Vec<u32> = (0..len)
        .map(|p| table[p / PAGE] * PAGE as u32 + (p % PAGE) as u32)
        .collect();
    let dev = k.device();
    let keys = tensor(seed, &[len, KVH, D], k.dtype(), dev);
    let values = tensor(seed + 1, &[len, KVH, D], v.dtype(), dev);
    let slots = Arc::new(slots);
    write_k(k, &keys, slots.clone()).expect("write_k");
    write_kv(v, &values, slots).expect("write_kv");
}

fn attend(q: &Tensor, k: &Tensor, v: &Tensor, m: AttentionMetadata) -> Tensor {
    paged_attention(q, k, v, Arc::new(m), 1.0 / (D as f32).sqrt()).expect("paged_attention")
}

fn max_abs_diff(a: &[u32], b: &[u32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (f32::from_bits(*x) - f32::from_bits(*y)).abs())
        .fold(0.0, f32::max)
}

#[test]
fn paged_attention_fixed_schedule_is_invariant_and_split_kv_is_not() {
    let Some(dev) = gpu() else { return };
    let len: usize = 700; // the target row attends to 700 keys (44 blocks of 16)
    let pages_per_seq = len.div_ceil(PAGE);
    for dtype in DTYPES {
        let p = pages_per_seq as u32;
        let (k, v) = empty_cache(3 * pages_per_seq, dtype, &dev);
        // The same keys and values under two pagings (in order; reversed in other pages), and
        // a neighbour sequence with other content.
        let table_a: Vec<u32> = (0..p).collect();
        let table_b: Vec<u32> = (p..2 * p).rev().collect();
        let table_n: Vec<u32> = (2 * p..3 * p).collect();
        fill(&k, &v, &table_a, len, 11);
        fill(&k, &v, &table_b, len, 11);
        let neighbour_len = len;
        fill(&k, &v, &table_n, neighbour_len, 21);
        let q = tensor(31, &[1, H, D], dtype, &dev);
        let pos = (len - 1) as u32;
        let solo = bits(&attend(
            &q,
            &k,
            &v,
            meta(&[(0, pos)], vec![table_a.clone()], AttentionSchedule::Fixed),
        ));
        // Fixed schedule: any batch, row index, neighbours and paging.
        let mut placements = 0;
        for (m, at, seed) in [
            (2, 1, 40),
            (9, 4, 41),
            (64, 0, 42),
            (64, 63, 43),
            (512, 300, 44),
        ] {
            let qb = with_row_at(&q, m, at, seed);
            let rows: Vec<(u32, u32)> = (0..m)
                .map(|r| {
                    if r == at {
                        (0, pos)
                    } else {
                        (1, (r * 37 % neighbour_len) as u32)
                    }
                })
                .collect();
            for table in [&table_a, &table_b] {
                let out = attend(
                    &qb,
                    &k,
                    &v,
                    meta(
                        &rows,
                        vec![table.clone(), table_n.clone()],
                        AttentionSchedule::Fixed,
                    ),
                );
                assert_eq!(row(&out, at), solo, "fixed {dtype:?} M={m} row {at}");
                // A fixed sequence inside a split-KV batch (the inline strategy's rows).
                let mut split = meta(
                    &rows,
                    vec![table.clone(), table_n.clone()],
                    AttentionSchedule::SplitKv { splits: 4 },
                );
                split.fixed_seqs = vec![true, false];
                assert_eq!(
                    row(&attend(&qb, &k, &v, split), at),
                    solo,
                    "fixed_seqs {dtype:?} M={m}"
                );
                placements += 1;
            }
        }
        table(
            "paged attention, fixed schedule",
            dtype,
            "batch-, position- and paging-invariant",
            true,
            &format!(
                "{placements} placements (M up to 512, two pagings, fixed rows in split batches)"
            ),
        );
        // Split-KV: close to the fixed schedule; whether its bits equal it, by split count.
        let mut differing = Vec::new();
        let mut worst = 0f32;
        for splits in [2, 3, 4, 8, 16] {
            let out = bits(&attend(
                &q,
                &k,
                &v,
                meta(
                    &[(0, pos)],
                    vec![table_a.clone()],
                    AttentionSchedule::SplitKv { splits },
                ),
            ));
            worst = worst.max(max_abs_diff(&out, &solo));
            if out != solo {
                differing.push(splits);
            }
            // The same split count gives the same bits under another paging and beside neighbours.
            let qb = with_row_at(&q, 5, 2, 50 + splits as u64);
            let rows: Vec<(u32, u32)> = (0..5)
                .map(|r| if r == 2 { (0, pos) } else { (1, 100) })
                .collect();
            let batched = attend(
                &qb,
                &k,
                &v,
                meta(
                    &rows,
                    vec![table_b.clone(), table_n.clone()],
                    AttentionSchedule::SplitKv { splits },
                ),
            );
            assert_eq!(
                row(&batched, 2),
                out,
                "split {splits} {dtype:?}: same split, other batch"
            );
        }
        let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
        assert!(
            worst < tol,
            "split-KV vs fixed {dtype:?}: max |diff| {worst}"
        );
        table(
            "paged attention, split-KV (fast path)",
            dtype,
            "same bits as the fixed schedule",
            differing.is_empty(),
            &format!(
                "splits differing from fixed: {differing:?} of [2, 3, 4, 8, 16]; max |diff| {worst:e}; \
                 at a given split count: batch-, position- and paging-invariant"
            ),
        );
        // In f32 the splits' other summation order must show in the last bits (the negative
        // control's premise); in bf16 the rounding of the output may absorb it (measured).
        assert!(
            dtype != DType::F32 || !differing.is_empty(),
            "split-KV rounded exactly like the fixed schedule in f32"
        );
    }
}

#[test]
fn fused_ops_give_their_unfused_pairs_bits() {
    let Some(dev) = gpu() else { return };
    for dtype in [DType::F32, DType::BF16] {
        assert_fused_ops_match_unfused(&dev, dtype);
        table(
            "add_rms_norm, rope_qkv, rope_qkv_into_cache, swiglu_halves, geglu_halves",
            dtype,
            "bits of the unfused ops",
            true,
            "",
        );
    }
}

#[test]
fn cache_write_and_page_copy_move_exact_bits() {
    let Some(dev) = gpu() else { return };
    for dtype in DTYPES {
        let (k, v) = empty_cache(8, dtype, &dev);
        let (kc, vc) = empty_cache(8, dtype, &Device::Cpu);
        let slots = Arc::new(vec![3u32, 17, 100, 127, 64, 5]);
        let keys = tensor(60, &[6, KVH, D], dtype, &dev);
        let values = tensor(61, &[6, KVH, D], dtype, &dev);
        write_k(&k, &keys, slots.clone()).expect("write_k");
        write_kv(&v, &values, slots.clone()).expect("write_kv");
        let cpu = |t: &Tensor| t.to_device(&Device::Cpu).expect("to cpu");
        // The CPU writes f32 activations into its cache (rounding to a bf16 cache exactly, as
        // these values are bf16 already).
        let f32_cpu = |t: &Tensor| cpu(t).to_dtype(DType::F32).expect("to f32");
        write_k(&kc, &f32_cpu(&keys), slots.clone()).expect("cpu write_k");
        write_kv(&vc, &f32_cpu(&values), slots).expect("cpu write_kv");
        assert_eq!(
            bits(&k),
            bits(&kc),
            "K cache {dtype:?}: GPU and CPU layouts differ"
        );
        assert_eq!(bits(&v), bits(&vc), "V cache {dtype:?}");
        let pairs = [(0u32, 7u32), (6, 2), (1, 4)];
        copy_pages(&k, &pairs).expect("copy_pages");
        copy_pages(&kc, &pairs).expect("cpu copy_pages");
        assert_eq!(bits(&k), bits(&kc), "page copy {dtype:?}");
        for op in ["KV cache write (K transposed, V rows)", "page copy"] {
            table(
                op,
                dtype,
                "exact copy, same bits as the CPU",
                true,
                "6 slots, 3 page pairs",
            );
        }
    }
}

/// (K, N) of Llama-3.1-8B's linear layers and LM head: q/o, k/v, gate/up, down, lm_head, and
/// the GPU's stacked q/k/v (4096 + 2 x 1024) and gate/up (2 x 14336).
const GEMM_SHAPES: [(usize, usize); 7] = [
    (4096, 4096),
    (4096, 1024),
    (4096, 14336),
    (14336, 4096),
    (4096, 128256),
    (4096, 6144),
    (4096, 28672),
];
const GEMM_MS: [usize; 13] = [1, 2, 3, 4, 8, 16, 24, 32, 64, 128, 256, 512, 1024];

#[test]
fn cublas_rows_change_bits_with_m_but_not_with_neighbours_at_fixed_m() {
    let Some(dev) = gpu() else { return };
    for dtype in DTYPES {
        for (k, n) in GEMM_SHAPES {
            let w = tensor(70 + k as u64 + n as u64, &[k, n], dtype, &dev);
            let x = tensor(71, &[1, k], dtype, &dev);
            let solo = row(&x.matmul(&w).expect("matmul"), 0);
            let mut changes = Vec::new();
            for (i, &m) in GEMM_MS.iter().enumerate() {
                let at = m / 2;
                let got = row(
                    &with_row_at(&x, m, at, 80 + i as u64)
                        .matmul(&w)
                        .expect("matmul"),
                    at,
                );
                if got != solo {
                    changes.push(m);
                }
                // At a fixed M the row's bits do not depend on its index or its neighbours: the
                // verify pass's B x W shape relies on this.
                if m > 1 {
                    let other = row(
                        &with_row_at(&x, m, 0, 90 + i as u64)
                            .matmul(&w)
                            .expect("matmul"),
                        0,
                    );
                    assert_eq!(
                        other, got,
                        "cuBLAS {dtype:?} {k}x{n} M={m}: row index/neighbours changed bits"
                    );
                }
            }
            table(
                &format!("cuBLAS GEMM {k}x{n}"),
                dtype,
                "batch-invariant (same bits at every M)",
                changes.is_empty(),
                &format!("M whose row differs from M=1: {changes:?}; position-invariant at every fixed M"),
            );
            // The batch_invariant mode's GEMM: 16-row blocks, same bits at every M.
            let inv = row(&invariant_matmul(&x, &w).expect("invariant_matmul"), 0);
            for m in [2, 17, 64, 300] {
                let got = row(
                    &invariant_matmul(&with_row_at(&x, m, m - 1, 95), &w).expect("inv"),
                    m - 1,
                );
                assert_eq!(got, inv, "invariant_matmul {dtype:?} {k}x{n} M={m}");
            }
            table(
                &format!("invariant_matmul {k}x{n}"),
                dtype,
                "batch- and position-invariant",
                true,
                "M in [1, 2, 17, 64, 300]",
            );
        }
    }
}
