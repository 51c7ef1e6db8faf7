//! The bf16-activation GEMM (`ops::gemm_abf16`, `activation_dtype="bfloat16"`).
//!
//! Conformance: the portable emulation of `VDPBF16PS` and of `VCVTNEPS2BF16` gives the
//! instruction's bits, lane by lane, over random inputs that include denormals, signed zeros,
//! infinities, products that overflow and sums that land on the flush-to-zero threshold (where
//! the CPU lacks AVX-512 BF16 these checks have nothing to compare and pass vacuously; the GEMM
//! checks below still pin the emulation to its written definition).
//!
//! Invariance: every element of the GEMM, on the instruction and on the emulation, with 1 and
//! 2 threads, equals one scalar chain over its own row and column (the module's definition),
//! so a row's bits depend neither on M, nor on its index or neighbours, nor on the thread
//! count or the instruction set.

use detspec::ops::{
    dot_bf16_pair_emulated, dot_bf16_pairs_hw, packed_matmul_abf16, packed_matmul_abf16_with,
    round_activation_bf16, round_activations_hw, DotIsa, PackedWeightAbf16, CANONICAL_NAN,
};
use proptest::prelude::*;

#[path = "common/kernels.rs"]
mod kernels;
use kernels::{in_pool, sampled_columns, MODEL_GEMM_SHAPES};

struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9e3779b97f4a7c15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        (self.next() >> 11) % n
    }
    /// Uniform in [-0.5, 0.5).
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }
}

/// bf16 bits from a mix of classes: mostly ordinary values of a few binades, then denormals,
/// zeros, infinities, the largest finite values and very small normals.
fn bf16_sample(r: &mut Rng, nan: bool) -> u16 {
    let sign = ((r.next() & 1) as u16) << 15;
    let man = (r.next() & 0x7f) as u16;
    let exp: u16 = match r.below(16) {
        0 => 0,                        // zero / denormal
        1 => 0xff,                     // inf (or NaN below)
        2 => 0xfe - r.below(4) as u16, // near the top: products overflow
        3 => 1 + r.below(4) as u16,    // smallest normals: products underflow
        4 => 60 + r.below(8) as u16,   // products near 2^-126
        _ => 120 + r.below(14) as u16, // ordinary magnitudes
    };
    let man = if exp == 0xff && !nan { 0 } else { man };
    sign | exp << 7 | man
}

fn f32_sample(r: &mut Rng) -> f32 {
    let bits = r.next() as u32;
    let v = match r.below(8) {
        0 => bits & 0x807f_ffff,                                 // denormal / zero
        1 => (bits & 0x8000_0000) | 0x7f80_0000,                 // inf
        2 => (bits & 0x8000_0000) | 0x0080_0000 | (bits & 0x7f), // just above 2^-126
        3 => bits & 0x807f_ffff | 0x7f00_0000,                   // huge
        _ => (bits & 0x807f_ffff) | ((100 + (bits >> 24) % 50) << 23), // ordinary
    };
    f32::from_bits(v)
}

/// Bits, with every NaN as the canonical one (NaN payloads are not part of the contract).
fn canon(x: f32) -> u32 {
    if x.is_nan() {
        CANONICAL_NAN
    } else {
        x.to_bits()
    }
}

#[test]
fn activation_rounding_is_vcvtneps2bf16() {
    let mut r = Rng::new(1);
    let specials = [
        0.0f32,
        -0.0,
        f32::MIN_POSITIVE,
        -f32::MIN_POSITIVE,
        f32::from_bits(1),
        f32::from_bits(0x807f_ffff),
        f32::MAX,
        f32::MIN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::from_bits(0x7f80_0001),
        f32::from_bits(0xff81_2345),
        f32::from_bits(0x3f80_8000), // tie, even below
        f32::from_bits(0x3f81_8000), // tie, odd below
        f32::from_bits(0x7f7f_8000), // rounds to inf
    ];
    let mut checked = 0;
    for round in 0..40_000 {
        let x: [f32; 16] = std::array::from_fn(|i| {
            if round == 0 {
                specials[i]
            } else if round % 2 == 0 {
                f32::from_bits(r.next() as u32)
            } else {
                f32_sample(&mut r)
            }
        });
        let Some(hw) = round_activations_hw(&x) else {
            return;
        };
        for i in 0..16 {
            assert_eq!(
                round_activation_bf16(x[i]),
                hw[i],
                "x = {:#010x}",
                x[i].to_bits()
            );
        }
        checked += 16;
    }
    assert_eq!(checked, 40_000 * 16);
}

/// Compares the emulation with `VDPBF16PS` on 16 lanes.
fn compare_lanes(acc: &[f32; 16], a: &[u32; 16], b: &[u32; 16]) -> bool {
    let Some(hw) = dot_bf16_pairs_hw(acc, a, b) else {
        return false;
    };
    for i in 0..16 {
        let emu = dot_bf16_pair_emulated(acc[i], a[i], b[i]);
        assert_eq!(
            canon(emu),
            canon(hw[i]),
            "acc {:#010x} a {:#010x} b {:#010x}: emulation {emu:e}, instruction {:e}",
            acc[i].to_bits(),
            a[i],
            b[i],
            hw[i]
        );
    }
    true
}

#[test]
fn dot_emulation_is_vdpbf16ps_bit_for_bit() {
    let mut r = Rng::new(2);
    let pair = |r: &mut Rng, nan: bool| {
        u32::from(bf16_sample(r, nan)) | u32::from(bf16_sample(r, nan)) << 16
    };
    let mut compared = 0u64;
    for round in 0..200_000u32 {
        let nan = round % 16 == 0;
        let acc: [f32; 16] = std::array::from_fn(|_| match r.below(4) {
            0 => 0.0,
            1 => f32::from_bits(widen(bf16_sample(&mut r, false))),
            _ => f32_sample(&mut r),
        });
        let a: [u32; 16] = std::array::from_fn(|_| pair(&mut r, nan));
        let b: [u32; 16] = std::array::from_fn(|_| pair(&mut r, nan));
        if !compare_lanes(&acc, &a, &b) {
            return;
        }
        compared += 16;
    }
    assert_eq!(compared, 200_000 * 16);
}

fn widen(h: u16) -> u32 {
    u32::from(h) << 16
}

fn bf16_of(x: f32) -> u32 {
    x.to_bits() >> 16
}

/// Hand-made lanes: the order of the two products, flushing of denormal inputs and outputs,
/// and the flush-to-zero threshold (tininess after rounding).
#[test]
fn dot_emulation_edge_cases_are_the_instruction_s() {
    let two = |lo: f32, hi: f32| bf16_of(lo) | bf16_of(hi) << 16;
    let p2 = |e: i32| 2f32.powi(e);
    let cases: Vec<(f32, u32, u32)> = vec![
        // Odd product first: (1 + 2^-24 is lost) vs kept in the other order.
        (1.0, two(p2(-24), p2(-24)), two(1.0, 1.0)),
        (p2(30), two(-p2(30), 1.0), two(1.0, 1.0)),
        (p2(30), two(1.0, -p2(30)), two(1.0, 1.0)),
        // Denormal inputs read as zero.
        (1.0, 0x0001_0001, two(1.0, 1.0)),
        (0.0, 0x0040_0040, 0x3f80_3f80),
        // Denormal accumulator.
        (f32::from_bits(0x0040_0000), two(0.0, 0.0), two(0.0, 0.0)),
        (
            f32::from_bits(0x8040_0000),
            two(p2(-126), 0.0),
            two(1.0, 0.0),
        ),
        // Tiny results flushed to a zero of their sign.
        (0.0, two(p2(-100), 0.0), two(p2(-30), 0.0)),
        (0.0, two(-p2(-100), 0.0), two(p2(-30), 0.0)),
        // Exact 2^-126 − 1.5·2^-151: rounds to 2^-126 at denormal precision, but is tiny after
        // rounding to 24 bits → flushed on x86 (tininess after rounding, unbounded exponent).
        (p2(-126), two(0.0, -3.0 * p2(-76)), two(0.0, p2(-76))),
        // Exact 2^-126 − 2^-151 (a tie that rounds to 2^-126 either way).
        (p2(-126), two(0.0, -p2(-75)), two(0.0, p2(-76))),
        // Overflow, inf − inf.
        (f32::MAX, two(f32::MAX, f32::MAX), two(2.0, 2.0)),
        (f32::INFINITY, two(0.0, f32::NEG_INFINITY), two(0.0, 1.0)),
        (-0.0, two(-0.0, 0.0), two(1.0, 1.0)),
        (-0.0, two(-0.0, -0.0), two(1.0, 1.0)),
    ];
    for chunk in cases.chunks(16) {
        let mut acc = [0f32; 16];
        let mut a = [0u32; 16];
        let mut b = [0u32; 16];
        for (i, &(c, x, y)) in chunk.iter().enumerate() {
            acc[i] = c;
            a[i] = x;
            b[i] = y;
        }
        compare_lanes(&acc, &a, &b);
    }
    // The emulation's own definition, whatever the CPU.
    assert_eq!(
        dot_bf16_pair_emulated(1.0, two(p2(-24), p2(-24)), two(1.0, 1.0)),
        1.0
    );
    assert_eq!(
        dot_bf16_pair_emulated(p2(30), two(1.0, -p2(30)), two(1.0, 1.0)),
        1.0
    );
    assert_eq!(
        dot_bf16_pair_emulated(p2(-126), two(0.0, -3.0 * p2(-76)), two(0.0, p2(-76))).to_bits(),
        0
    );
}

/// c[i][j] by the definition: the pairs of row i and column j, odd element first, in order.
fn reference(a: &[f32], w: &[u16], k: usize, n: usize, i: usize, j: usize) -> u32 {
    let act = |kk: usize| {
        if kk < k {
            u32::from(round_activation_bf16(a[i * k + kk]))
        } else {
            0
        }
    };
    let wt = |kk: usize| if kk < k { u32::from(w[kk * n + j]) } else { 0 };
    let acc = (0..k.div_ceil(2)).fold(0f32, |acc, p| {
        dot_bf16_pair_emulated(
            acc,
            act(2 * p) | act(2 * p + 1) << 16,
            wt(2 * p) | wt(2 * p + 1) << 16,
        )
    });
    canon(acc)
}

fn activations(r: &mut Rng, len: usize, specials: bool) -> Vec<f32> {
    (0..len)
        .map(|_| {
            if specials && r.below(50) == 0 {
                f32_sample(r)
            } else {
                r.unit() * 4.0
            }
        })
        .collect()
}

fn weights(r: &mut Rng, len: usize, specials: bool) -> Vec<u16> {
    (0..len)
        .map(|_| {
            if specials && r.below(50) == 0 {
                bf16_sample(r, false)
            } else {
                (bf16_of(r.unit() * 0.2)) as u16
            }
        })
        .collect()
}

/// Checks columns `cols` of every row against [`reference`], for `isas` and 1 and 2 threads.
fn check(m: usize, k: usize, n: usize, seed: u64, cols: &[usize], isas: &[DotIsa], specials: bool) {
    let mut r = Rng::new(seed);
    let a = activations(&mut r, m * k, specials);
    let w = weights(&mut r, k * n, specials);
    let packed = PackedWeightAbf16::from_row_major_bits(&w, k, n).expect("pack");
    let want: Vec<Vec<u32>> = (0..m)
        .map(|i| {
            cols.iter()
                .map(|&j| reference(&a, &w, k, n, i, j))
                .collect()
        })
        .collect();
    for &isa in isas {
        for threads in [1, 2] {
            let c =
                in_pool(threads, || packed_matmul_abf16_with(&a, m, &packed, isa)).expect("gemm");
            for i in 0..m {
                for (&j, &want) in cols.iter().zip(&want[i]) {
                    assert_eq!(
                        canon(c[i * n + j]),
                        want,
                        "m={m} k={k} n={n} row {i} col {j} isa {isa:?} threads {threads}"
                    );
                    // NaNs are written canonical by the kernel itself.
                    assert_eq!(c[i * n + j].to_bits(), want);
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn every_element_is_the_pairwise_chain_on_every_isa(
        m in 1usize..40, k in 1usize..200, n in 1usize..80, seed in any::<u64>(),
        specials in any::<bool>()
    ) {
        let cols: Vec<usize> = (0..n).collect();
        check(m, k, n, seed, &cols, &DotIsa::available(), specials);
    }
}

#[test]
fn model_shapes_at_engine_batch_sizes() {
    for (k, n) in MODEL_GEMM_SHAPES {
        let cols = sampled_columns(n);
        for m in [1, 2, 11, 12, 13, 16, 64, 97] {
            // The emulation over the whole width is slow in a debug build: the instruction
            // here, the emulation on the small shapes (and everywhere in the proptest).
            let isas = if k * n <= 64 * 512 {
                DotIsa::available()
            } else {
                vec![DotIsa::detect()]
            };
            check(m, k, n, (k * 131 + n * 7 + m) as u64, &cols, &isas, m == 13);
        }
    }
}

/// Products near 2^-126 with normal weights: the emulation's fast path (plain FMAs) meets tiny
/// intermediates and must hand those chunks to the definition; zero weights and activations
/// (zero intermediates, which need no flushing) mixed in. Every element against the definition
/// on every instruction set.
#[test]
fn tiny_intermediates_without_denormal_inputs_are_the_definition_s() {
    let mut r = Rng::new(17);
    for (m, k, n) in [(7, 200, 70), (13, 64, 33), (3, 1408, 40)] {
        let a: Vec<f32> = (0..m * k)
            .map(|i| {
                if i % 29 == 0 {
                    0.0
                } else {
                    (r.unit() - 0.5) * f32::powi(2.0, -62)
                }
            })
            .collect();
        let w: Vec<u16> = (0..k * n)
            .map(|i| {
                if i % 31 == 0 {
                    0
                } else {
                    bf16_of((r.unit() - 0.5) * f32::powi(2.0, -62)) as u16
                }
            })
            .collect();
        assert!(
            w.iter().all(|&h| h & 0x7f80 != 0 || h & 0x7f == 0),
            "no denormal weight"
        );
        let packed = PackedWeightAbf16::from_row_major_bits(&w, k, n).expect("pack");
        // Plain FMAs without flushing part from the definition here (else this test could
        // not tell a fast path that skipped the fallback).
        let unflushed = |i: usize, j: usize| {
            let act = |kk: usize| {
                let h = if kk < k {
                    round_activation_bf16(a[i * k + kk])
                } else {
                    0
                };
                f32::from_bits(u32::from(h) << 16)
            };
            let wt = |kk: usize| {
                let h = if kk < k { w[kk * n + j] } else { 0 };
                f32::from_bits(u32::from(h) << 16)
            };
            canon((0..k.div_ceil(2)).fold(0f32, |acc, p| {
                let t = act(2 * p + 1).mul_add(wt(2 * p + 1), acc);
                act(2 * p).mul_add(wt(2 * p), t)
            }))
        };
        let mut parted = 0;
        for isa in DotIsa::available() {
            let c = packed_matmul_abf16_with(&a, m, &packed, isa).expect("gemm");
            for i in 0..m {
                for j in 0..n {
                    let want = reference(&a, &w, k, n, i, j);
                    parted += usize::from(unflushed(i, j) != want);
                    assert_eq!(
                        c[i * n + j].to_bits(),
                        want,
                        "m={m} k={k} n={n} ({i}, {j}) {isa:?}"
                    );
                }
            }
        }
        assert!(parted > 0, "flushing changes some sums");
    }
}

#[test]
fn row_bits_do_not_depend_on_m_position_or_neighbours() {
    let (k, n) = (512, 1408);
    let mut r = Rng::new(5);
    let row = activations(&mut r, k, false);
    let w = weights(&mut r, k * n, false);
    let packed = PackedWeightAbf16::from_row_major_bits(&w, k, n).expect("pack");
    let alone = packed_matmul_abf16(&row, 1, &packed).expect("gemm");
    let want: Vec<u32> = alone.iter().map(|x| x.to_bits()).collect();
    for (m, at) in [
        (2, 1),
        (8, 3),
        (13, 12),
        (17, 0),
        (64, 40),
        (97, 96),
        (300, 299),
    ] {
        let mut a = activations(&mut Rng::new(m as u64 + 100), m * k, false);
        a[at * k..(at + 1) * k].copy_from_slice(&row);
        for threads in [1, 2] {
            let c = in_pool(threads, || packed_matmul_abf16(&a, m, &packed)).expect("gemm");
            let got: Vec<u32> = c[at * n..(at + 1) * n]
                .iter()
                .map(|x| x.to_bits())
                .collect();
            assert_eq!(got, want, "row at {at} of {m}, {threads} threads");
        }
    }
}

#[test]
fn transposed_packing_equals_row_major_packing_and_bad_shapes_are_errors() {
    let (k, n) = (71, 45);
    let mut r = Rng::new(9);
    let w = weights(&mut r, k * n, false);
    let mut wt = vec![0u16; k * n];
    for kk in 0..k {
        for j in 0..n {
            wt[j * k + kk] = w[kk * n + j];
        }
    }
    let a = activations(&mut r, 3 * k, false);
    let p1 = PackedWeightAbf16::from_row_major_bits(&w, k, n).expect("pack");
    let p2 = PackedWeightAbf16::from_transposed_bits(&wt, n, k).expect("pack");
    let c1: Vec<u32> = packed_matmul_abf16(&a, 3, &p1)
        .expect("gemm")
        .iter()
        .map(|x| x.to_bits())
        .collect();
    let c2: Vec<u32> = packed_matmul_abf16(&a, 3, &p2)
        .expect("gemm")
        .iter()
        .map(|x| x.to_bits())
        .collect();
    assert_eq!(c1, c2);
    assert!(PackedWeightAbf16::from_row_major_bits(&[0; 5], 2, 3).is_err());
    let p = PackedWeightAbf16::from_row_major_bits(&[0; 6], 2, 3).expect("pack");
    assert!(packed_matmul_abf16(&[1.0; 5], 2, &p).is_err());
}

/// AMX (`DotIsa::Amx`, `activation_dtype="bfloat16_amx"`): not the definition's bits, but a
/// row's bits still depend neither on M, nor on its index or neighbours, nor on the thread
/// count; and the values are the definition's up to accumulation-order rounding. Skipped where
/// the CPU has no AMX-BF16.
#[test]
fn amx_rows_are_batch_position_and_thread_invariant_and_close_to_the_definition() {
    if !DotIsa::amx_available() {
        return;
    }
    let mut differing = 0usize;
    let mut total = 0usize;
    for (k, n) in [(512, 1408), (1408, 512), (64, 96), (70, 33), (512, 32000)] {
        let mut r = Rng::new((k * 7 + n) as u64);
        let w = weights(&mut r, k * n, false);
        let packed = PackedWeightAbf16::from_row_major_bits(&w, k, n).expect("pack");
        let row = activations(&mut r, k, false);
        let alone = packed_matmul_abf16_with(&row, 1, &packed, DotIsa::Amx).expect("amx");
        let exact = packed_matmul_abf16_with(&row, 1, &packed, DotIsa::detect()).expect("exact");
        for (j, (&x, &y)) in alone.iter().zip(&exact).enumerate() {
            total += 1;
            differing += usize::from(x.to_bits() != y.to_bits());
            // Sums of |a·w| bound the rounding differences of two orders.
            let scale: f32 = (0..k)
                .map(|kk| {
                    let a = f32::from_bits(u32::from(round_activation_bf16(row[kk])) << 16);
                    let b = f32::from_bits(u32::from(w[kk * n + j]) << 16);
                    (a * b).abs()
                })
                .sum();
            assert!(
                (x - y).abs() <= scale * 1e-5 + 1e-30,
                "k={k} n={n} col {j}: amx {x:e} vs exact {y:e}"
            );
        }
        let want: Vec<u32> = alone.iter().map(|x| x.to_bits()).collect();
        for (m, at) in [(2, 1), (13, 12), (16, 0), (17, 16), (64, 40), (97, 50)] {
            let mut a = activations(&mut Rng::new(m as u64 + 7), m * k, true);
            a[at * k..(at + 1) * k].copy_from_slice(&row);
            for threads in [1, 2] {
                let c = in_pool(threads, || {
                    packed_matmul_abf16_with(&a, m, &packed, DotIsa::Amx)
                })
                .expect("amx");
                let got: Vec<u32> = c[at * n..(at + 1) * n]
                    .iter()
                    .map(|x| x.to_bits())
                    .collect();
                assert_eq!(
                    got, want,
                    "k={k} n={n}: row at {at} of {m}, {threads} threads"
                );
            }
        }
    }
    eprintln!("AMX vs the VDPBF16PS definition: {differing} of {total} elements differ in bits");
}

/// AMX writes every NaN output as the canonical NaN, in ragged panels too (the vectorised
/// copy out of the tiles masks the columns past N).
#[test]
fn amx_writes_canonical_nans_and_only_its_columns() {
    if !DotIsa::amx_available() {
        return;
    }
    for (k, n) in [(64, 33), (70, 96), (512, 1408)] {
        let mut r = Rng::new((k + n) as u64);
        let w = weights(&mut r, k * n, false);
        let packed = PackedWeightAbf16::from_row_major_bits(&w, k, n).expect("pack");
        let m = 19;
        let mut a = activations(&mut r, m * k, false);
        a[5 * k + 3] = f32::NAN;
        let c = packed_matmul_abf16_with(&a, m, &packed, DotIsa::Amx).expect("amx");
        assert_eq!(c.len(), m * n);
        for (j, x) in c[5 * n..6 * n].iter().enumerate() {
            assert_eq!(x.to_bits(), CANONICAL_NAN, "k={k} n={n} col {j}");
        }
        let nans = c.iter().filter(|x| x.is_nan()).count();
        assert_eq!(nans, n, "k={k} n={n}: only row 5 is NaN");
    }
}
