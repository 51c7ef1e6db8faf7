//! The packed GEMM's reduction order is fixed by construction: every output element equals the
//! sequential FMA chain over k of its row and column, whatever M, the row's index, its
//! neighbours, the thread count or the instruction set. Asserted bitwise against that chain
//! (so batch-, position- and thread-invariance follow), over random shapes and over every
//! (K, N) of the bench model and the test models at the M the engine runs.

use detspec::ops::{packed_matmul, packed_matmul_with, CpuIsa, PackedWeight};
use proptest::prelude::*;

#[path = "common/kernels.rs"]
mod kernels;
use kernels::{in_pool, sampled_columns, MODEL_GEMM_SHAPES};

fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

/// c[i][j] = fma(a[i][k-1], w[k-1][j], … fma(a[i][0], w[0][j], 0)).
fn reference(a: &[f32], w: &[f32], k: usize, n: usize, i: usize, j: usize) -> f32 {
    (0..k).fold(0f32, |acc, kk| a[i * k + kk].mul_add(w[kk * n + j], acc))
}

/// Checks columns `cols` of every row against the reference chain, for each instruction set
/// and 1 and 2 threads.
fn check(m: usize, k: usize, n: usize, seed: u64, cols: &[usize]) {
    let a = values(seed, m * k);
    let w = values(seed + 1, k * n);
    let packed = PackedWeight::from_row_major(&w, k, n).expect("pack");
    for isa in CpuIsa::available() {
        for threads in [1, 2] {
            let c = in_pool(threads, || packed_matmul_with(&a, m, &packed, isa)).expect("gemm");
            for i in 0..m {
                for &j in cols {
                    let want = reference(&a, &w, k, n, i, j);
                    assert_eq!(
                        c[i * n + j].to_bits(),
                        want.to_bits(),
                        "m={m} k={k} n={n} row {i} col {j} isa {isa:?} threads {threads}"
                    );
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn every_element_is_the_sequential_fma_chain(
        m in 1usize..70, k in 1usize..300, n in 1usize..100, seed in any::<u64>()
    ) {
        let cols: Vec<usize> = (0..n).collect();
        check(m, k, n, seed, &cols);
    }
}

#[test]
fn model_shapes_at_engine_batch_sizes() {
    for (k, n) in MODEL_GEMM_SHAPES {
        let cols = sampled_columns(n);
        for m in [1, 2, 7, 8, 9, 16, 31, 64, 65] {
            check(m, k, n, (k * 131 + n * 7 + m) as u64, &cols);
        }
    }
}

#[test]
fn row_bits_do_not_depend_on_m_position_or_neighbours() {
    let (k, n) = (512, 1408);
    let row = values(5, k);
    let w = values(6, k * n);
    let packed = PackedWeight::from_row_major(&w, k, n).expect("pack");
    let alone = packed_matmul(&row, 1, &packed).expect("gemm");
    for (m, at) in [(2, 1), (8, 3), (9, 8), (17, 0), (64, 40), (300, 299)] {
        let mut a = values(m as u64 + 100, m * k);
        a[at * k..(at + 1) * k].copy_from_slice(&row);
        let c = packed_matmul(&a, m, &packed).expect("gemm");
        let got: Vec<u32> = c[at * n..(at + 1) * n]
            .iter()
            .map(|x| x.to_bits())
            .collect();
        let want: Vec<u32> = alone.iter().map(|x| x.to_bits()).collect();
        assert_eq!(got, want, "row at {at} of {m}");
    }
}

#[test]
fn transposed_packing_equals_row_major_packing() {
    let (k, n) = (70, 45);
    let w = values(9, k * n);
    let mut wt = vec![0f32; k * n];
    for kk in 0..k {
        for j in 0..n {
            wt[j * k + kk] = w[kk * n + j];
        }
    }
    let a = values(10, 3 * k);
    let p1 = PackedWeight::from_row_major(&w, k, n).expect("pack");
    let p2 = PackedWeight::from_transposed(&wt, n, k).expect("pack");
    assert_eq!(
        packed_matmul(&a, 3, &p1).expect("gemm"),
        packed_matmul(&a, 3, &p2).expect("gemm")
    );
}

#[test]
fn bad_shapes_are_errors() {
    assert!(PackedWeight::from_row_major(&[1.0; 5], 2, 3).is_err());
    let p = PackedWeight::from_row_major(&[1.0; 6], 2, 3).expect("pack");
    assert!(packed_matmul(&[1.0; 5], 2, &p).is_err());
}

/// The `shape_dependent` test profile: at a fixed M a row's bits do not depend on its
/// neighbours, its index, the thread count or the instruction set (shape-consistent and
/// position-invariant, as the verify passes need), but across M they change, as cuBLAS's do:
/// otherwise the replay path would meet no real mismatch on CPU.
#[test]
fn split_k_rows_are_shape_consistent_but_change_with_m() {
    use detspec::config::KernelProfile;
    use detspec::ops::{packed_matmul_reduced, Reduction};
    let (k, n) = (512, 96);
    let w = values(7, k * n);
    let packed = PackedWeight::from_row_major(&w, k, n).expect("pack");
    let row = values(8, k);
    let row_bits_at = |m: usize, at: usize, seed: u64, isa: CpuIsa, threads: usize| {
        let mut a = values(seed, m * k);
        a[at * k..(at + 1) * k].copy_from_slice(&row);
        let reduction = Reduction::for_rows(KernelProfile::ShapeDependent, m, false);
        let c = in_pool(threads, || {
            packed_matmul_reduced(&a, m, &packed, isa, reduction)
        })
        .expect("gemm");
        c[at * n..(at + 1) * n]
            .iter()
            .map(|x| x.to_bits())
            .collect::<Vec<u32>>()
    };
    let mut per_m = Vec::new();
    for m in [1usize, 2, 4, 8, 16, 32, 64, 100, 512] {
        let first = row_bits_at(m, 0, 100, CpuIsa::detect(), 1);
        for isa in CpuIsa::available() {
            for (at, seed, threads) in [(m - 1, 200, 2), (m / 2, 300, 1)] {
                assert_eq!(
                    row_bits_at(m, at, seed, isa, threads),
                    first,
                    "M={m}: a row's bits moved with its index, neighbours, threads or ISA"
                );
            }
        }
        per_m.push((m, first));
    }
    // Adjacent power-of-two buckets pick another split: the row's bits change.
    for pair in per_m
        .windows(2)
        .filter(|p| p[0].0.ilog2() % 3 != p[1].0.ilog2() % 3)
    {
        let ((m0, a), (m1, b)) = (&pair[0], &pair[1]);
        let differing = a.iter().zip(b).filter(|(x, y)| x != y).count();
        assert!(
            differing > n / 4,
            "M={m0} vs M={m1}: only {differing} of {n} elements differ"
        );
    }
    // The invariant profile ignores M.
    assert_eq!(
        Reduction::for_rows(KernelProfile::Invariant, 7, false),
        Reduction::Sequential
    );
    // The batch-invariant mode uses one kernel (the one for 16 rows) at every M.
    assert_eq!(
        Reduction::for_rows(KernelProfile::ShapeDependent, 3, true),
        Reduction::for_rows(KernelProfile::ShapeDependent, 300, true)
    );
}
