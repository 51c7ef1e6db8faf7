//! bfloat16 on the CPU: bf16 weights read by the packed GEMM, a bf16 KV cache, and the engine
//! end to end in bf16.
//!
//! The kernels widen bf16 to f32 exactly and then run the f32 kernels' arithmetic, so the
//! strongest check is equality: the bf16 GEMM gives the f32 GEMM's bits on the widened weights,
//! and attention over a bf16 cache gives f32 attention's bits over the widened cache, on every
//! instruction set and thread count. The f32 kernels' invariances (`tests/gemm.rs`,
//! `tests/ops.rs`) carry over; the bf16 kernels' own batch/position invariance is asserted here
//! too, and the engine's deterministic requests are checked alone and in batches.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use candle_core::{DType, Device, Tensor};
use detspec::config::{ActivationDtype, DTypeSpec, DeterminismMode, KernelProfile};
use detspec::ops::{
    bf16_bits, bf16_to_f32, packed_matmul_bf16, packed_matmul_bf16_with, packed_matmul_with,
    paged_attention, paged_attention_with_isa, write_k, write_kv, AttentionSchedule, CpuIsa,
    PackedWeight, PackedWeightBf16,
};
use detspec::{Engine, EngineConfig, Request, RequestOutput, SamplingParams};
use proptest::prelude::*;

#[path = "common/kernels.rs"]
mod kernels;
use kernels::{bits, in_pool, meta, MODEL_GEMM_SHAPES};

/// Random f32 values in [-0.5, 0.5), a few of them denormal or signed zero.
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            match i % 97 {
                13 => f32::from_bits(((s >> 45) as u32) | ((s as u32) & 0x8000_0000)), // denormal
                41 => -0.0,
                _ => ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5,
            }
        })
        .collect()
}

/// bf16 bits of random values (every bit pattern a checkpoint may hold, NaN and inf aside).
fn bf16_values(seed: u64, n: usize) -> Vec<u16> {
    values(seed, n).into_iter().map(bf16_bits).collect()
}

fn to_bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The bf16 GEMM of `a` against bf16 `w` `[k, n]` equals the f32 GEMM against the widened
/// weights, bit for bit, on every instruction set and at 1 and 2 threads.
fn check_equals_f32(m: usize, k: usize, n: usize, seed: u64) {
    let a = values(seed, m * k);
    let w = bf16_values(seed + 1, k * n);
    let wide: Vec<f32> = w.iter().map(|&b| bf16_to_f32(b)).collect();
    let p16 = PackedWeightBf16::from_row_major_bits(&w, k, n).expect("pack bf16");
    let p32 = PackedWeight::from_row_major(&wide, k, n).expect("pack f32");
    let want = to_bits(&packed_matmul_with(&a, m, &p32, CpuIsa::Portable).expect("gemm"));
    for isa in CpuIsa::available() {
        for threads in [1, 2] {
            let got = in_pool(threads, || packed_matmul_bf16_with(&a, m, &p16, isa)).expect("gemm");
            assert!(
                to_bits(&got) == want,
                "m={m} k={k} n={n} isa {isa:?} threads {threads}: bf16 GEMM differs from f32"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn bf16_gemm_is_the_f32_gemm_on_widened_weights(
        m in 1usize..70, k in 1usize..300, n in 1usize..100, seed in any::<u64>()
    ) {
        check_equals_f32(m, k, n, seed);
    }
}

#[test]
fn bf16_gemm_elements_are_the_sequential_fma_chain() {
    let (m, k, n) = (5, 77, 45);
    let a = values(1, m * k);
    let w = bf16_values(2, k * n);
    let p = PackedWeightBf16::from_row_major_bits(&w, k, n).expect("pack");
    let c = packed_matmul_bf16(&a, m, &p).expect("gemm");
    for i in 0..m {
        for j in 0..n {
            let want = (0..k).fold(0f32, |acc, kk| {
                a[i * k + kk].mul_add(bf16_to_f32(w[kk * n + j]), acc)
            });
            assert_eq!(c[i * n + j].to_bits(), want.to_bits(), "row {i} col {j}");
        }
    }
}

#[test]
fn bf16_gemm_model_shapes_at_engine_batch_sizes() {
    // (K, N): bench model, the Rust and Python test models, the built-in default model
    // (hidden 192, 4 × 48 heads, 2 KV heads, intermediate 512, vocab 2048).
    let shapes = MODEL_GEMM_SHAPES.into_iter().chain([
        (192, 192),
        (192, 96),
        (192, 512),
        (512, 192),
        (192, 2048),
    ]);
    for (k, n) in shapes {
        for m in [1, 2, 7, 8, 9, 16, 64, 65] {
            check_equals_f32(m, k, n, (k * 131 + n * 7 + m) as u64);
        }
    }
    // The 8B shape's layers (hidden 4096, 32 × 128 heads, 8 KV heads, intermediate 14336), at
    // decode and small prefill sizes; its LM head (4096 × 128256) is the same kernel over more
    // panels and is left out for the test's memory.
    for (k, n) in [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)] {
        for m in [1, 9] {
            check_equals_f32(m, k, n, (k + n + m) as u64);
        }
    }
}

#[test]
fn bf16_gemm_row_bits_do_not_depend_on_m_position_or_neighbours() {
    let (k, n) = (512, 1408);
    let row = values(5, k);
    let w = bf16_values(6, k * n);
    let packed = PackedWeightBf16::from_row_major_bits(&w, k, n).expect("pack");
    let alone = to_bits(&packed_matmul_bf16(&row, 1, &packed).expect("gemm"));
    for (m, at, threads) in [
        (2, 1, 1),
        (8, 3, 2),
        (9, 8, 1),
        (17, 0, 2),
        (64, 40, 2),
        (300, 299, 1),
    ] {
        let mut a = values(m as u64 + 100, m * k);
        a[at * k..(at + 1) * k].copy_from_slice(&row);
        let c = in_pool(threads, || packed_matmul_bf16(&a, m, &packed)).expect("gemm");
        assert_eq!(to_bits(&c[at * n..(at + 1) * n]), alone, "row {at} of {m}");
    }
}

#[test]
fn transposed_bf16_packing_equals_row_major_packing() {
    let (k, n) = (70, 45);
    let w = bf16_values(9, k * n);
    let mut wt = vec![0u16; k * n];
    for kk in 0..k {
        for j in 0..n {
            wt[j * k + kk] = w[kk * n + j];
        }
    }
    let a = values(10, 3 * k);
    let p1 = PackedWeightBf16::from_row_major_bits(&w, k, n).expect("pack");
    let p2 = PackedWeightBf16::from_transposed_bits(&wt, n, k).expect("pack");
    assert_eq!(
        to_bits(&packed_matmul_bf16(&a, 3, &p1).expect("gemm")),
        to_bits(&packed_matmul_bf16(&a, 3, &p2).expect("gemm"))
    );
    assert!(PackedWeightBf16::from_row_major_bits(&[0; 5], 2, 3).is_err());
    assert!(packed_matmul_bf16(&[1.0; 5], 2, &p1).is_err());
}

#[test]
fn bf16_rounding_is_half_s_round_to_nearest_even() {
    let mut xs = values(3, 100_000);
    xs.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001), // signalling NaN
        f32::MAX,
        f32::MIN_POSITIVE,
        f32::from_bits(1),
        f32::from_bits(0x3f80_8000), // tie, even below
        f32::from_bits(0x3f81_8000), // tie, odd below
        f32::from_bits(0x7f7f_ffff), // rounds to inf
    ]);
    for x in xs {
        assert_eq!(
            bf16_bits(x),
            half::bf16::from_f32(x).to_bits(),
            "{x:e} ({:#x})",
            x.to_bits()
        );
    }
}

// ---------------------------------------------------------------- attention and cache writes

const PAGE: usize = 4;
const KVH: usize = 2;
const H: usize = 4;
const D: usize = 32;

/// A bf16 cache of random values and the same values widened to f32.
fn caches(pages: usize) -> ((Tensor, Tensor), (Tensor, Tensor)) {
    let dev = Device::Cpu;
    let n = pages * PAGE * KVH * D;
    let k = Tensor::from_vec(values(1, n), (pages, KVH, D, PAGE), &dev).expect("k");
    let v = Tensor::from_vec(values(2, n), (pages, PAGE, KVH, D), &dev).expect("v");
    let k16 = k.to_dtype(DType::BF16).expect("k bf16");
    let v16 = v.to_dtype(DType::BF16).expect("v bf16");
    let wide = (
        k16.to_dtype(DType::F32).expect("k f32"),
        v16.to_dtype(DType::F32).expect("v f32"),
    );
    ((k16, v16), wide)
}

#[test]
fn attention_over_a_bf16_cache_is_f32_attention_over_its_values() {
    let ((k16, v16), (k32, v32)) = caches(16);
    let tables = vec![
        (0..8).collect::<Vec<u32>>(),
        (8..16).rev().collect::<Vec<u32>>(),
    ];
    // Decode rows, a prefill run (tiled) and rows whose blocks straddle pages.
    let rows = [
        (0, 29),
        (1, 30),
        (0, 3),
        (1, 31),
        (1, 5),
        (1, 6),
        (1, 7),
        (1, 8),
    ];
    let q = Tensor::from_vec(
        values(23, rows.len() * H * D),
        (rows.len(), H, D),
        &Device::Cpu,
    )
    .expect("q");
    for schedule in [
        AttentionSchedule::Fixed,
        AttentionSchedule::SplitKv { splits: 3 },
    ] {
        for fixed_seqs in [vec![], vec![false, true]] {
            let mut m = meta(&rows, tables.clone(), schedule);
            m.fixed_seqs = fixed_seqs.clone();
            let m = Arc::new(m);
            let want = bits(
                &paged_attention_with_isa(&q, &k32, &v32, m.clone(), 0.3, CpuIsa::Portable)
                    .expect("f32 attention"),
            );
            for isa in CpuIsa::available() {
                for threads in [1, 2] {
                    let got = in_pool(threads, || {
                        paged_attention_with_isa(&q, &k16, &v16, m.clone(), 0.3, isa)
                    })
                    .expect("bf16 attention");
                    assert!(
                        bits(&got) == want,
                        "{schedule:?} fixed {fixed_seqs:?} {isa:?} {threads} threads"
                    );
                }
            }
        }
    }
}

#[test]
fn bf16_cache_attention_row_is_invariant_to_batch_position_and_neighbours() {
    let ((k, v), _) = caches(8);
    let tables = vec![vec![5, 0, 7], vec![2, 6], vec![1, 3, 4]];
    let target_q = values(10, H * D);
    let fixed = AttentionSchedule::Fixed;
    let solo = {
        let q = Tensor::from_vec(target_q.clone(), (1, H, D), &Device::Cpu).expect("q");
        let m = Arc::new(meta(&[(0, 9)], vec![tables[0].clone()], fixed));
        bits(&paged_attention(&q, &k, &v, m, 0.3).expect("attention"))
    };
    for (threads, before, seed) in [(1, 0, 11), (2, 3, 12), (2, 5, 13), (1, 2, 14)] {
        let mut rows = Vec::new();
        let mut qdata = Vec::new();
        let neighbours = values(seed, (before + 2) * H * D);
        for i in 0..before {
            rows.push((1 + (i % 2) as u32, (i % 7) as u32));
            qdata.extend_from_slice(&neighbours[i * H * D..(i + 1) * H * D]);
        }
        rows.push((0, 9));
        qdata.extend_from_slice(&target_q);
        for i in before..before + 2 {
            rows.push((2, 11));
            qdata.extend_from_slice(&neighbours[i * H * D..(i + 1) * H * D]);
        }
        let q = Tensor::from_vec(qdata, (rows.len(), H, D), &Device::Cpu).expect("q");
        let m = Arc::new(meta(&rows, tables.clone(), fixed));
        let out = in_pool(threads, || paged_attention(&q, &k, &v, m, 0.3)).expect("attention");
        let row = out.narrow(0, before, 1).expect("row");
        assert_eq!(bits(&row), solo, "threads={threads} before={before}");
    }
}

#[test]
fn cache_writes_round_to_bf16_at_their_slots() {
    let dev = Device::Cpu;
    let pages = 3;
    let k = Tensor::zeros((pages, KVH, D, PAGE), DType::BF16, &dev).expect("k");
    let v = Tensor::zeros((pages, PAGE, KVH, D), DType::BF16, &dev).expect("v");
    let slots = vec![5u32, 0, 11];
    let src = values(7, slots.len() * KVH * D);
    let rows = Tensor::from_vec(src.clone(), (slots.len(), KVH, D), &dev).expect("rows");
    write_k(&k, &rows, Arc::new(slots.clone())).expect("write k");
    write_kv(&v, &rows, Arc::new(slots.clone())).expect("write v");
    let kb: Vec<u16> = k
        .flatten_all()
        .and_then(|t| t.to_vec1::<half::bf16>())
        .expect("k values")
        .into_iter()
        .map(half::bf16::to_bits)
        .collect();
    let vb: Vec<u16> = v
        .flatten_all()
        .and_then(|t| t.to_vec1::<half::bf16>())
        .expect("v values")
        .into_iter()
        .map(half::bf16::to_bits)
        .collect();
    for (i, &slot) in slots.iter().enumerate() {
        let (page, t) = (slot as usize / PAGE, slot as usize % PAGE);
        for hd in 0..KVH * D {
            let want = bf16_bits(src[i * KVH * D + hd]);
            assert_eq!(
                vb[slot as usize * KVH * D + hd],
                want,
                "v slot {slot} elem {hd}"
            );
            assert_eq!(
                kb[(page * KVH * D + hd) * PAGE + t],
                want,
                "k slot {slot} elem {hd}"
            );
        }
    }
}

// ---------------------------------------------------------------- the engine in bf16

/// The test model (f32 checkpoint), and the same weights rounded to bf16 stored as bf16
/// (`torch_dtype` "bfloat16") and as f32 (values exactly representable in bf16).
struct Models {
    f32_dir: PathBuf,
    bf16_dir: PathBuf,
    rounded_f32_dir: PathBuf,
}

fn models() -> &'static Models {
    static M: OnceLock<Models> = OnceLock::new();
    M.get_or_init(|| {
        let f32_dir = common::write_test_model("bf16", 3, 0.02, 512);
        let tensors =
            candle_core::safetensors::load(f32_dir.join("model.safetensors"), &Device::Cpu)
                .expect("read the test model");
        let write = |name: &str, dtype: DType, as_dtype: DType| -> PathBuf {
            let dir = f32_dir.with_file_name(format!(
                "{}-{name}",
                f32_dir.file_name().and_then(|n| n.to_str()).unwrap_or("m")
            ));
            std::fs::create_dir_all(&dir).expect("dir");
            for entry in std::fs::read_dir(&f32_dir).expect("list") {
                let p = entry.expect("entry").path();
                if p.file_name().is_some_and(|n| n != "model.safetensors") {
                    std::fs::copy(&p, dir.join(p.file_name().unwrap_or_default())).expect("copy");
                }
            }
            let converted: HashMap<String, Tensor> = tensors
                .iter()
                .map(|(n, t)| {
                    let t = t.to_dtype(DType::BF16).and_then(|t| t.to_dtype(as_dtype));
                    (n.clone(), t.expect("convert"))
                })
                .collect();
            candle_core::safetensors::save(&converted, dir.join("model.safetensors"))
                .expect("write");
            let cfg_path = dir.join("config.json");
            let text = std::fs::read_to_string(&cfg_path).expect("config");
            let mut cfg: serde_json::Value = serde_json::from_str(&text).expect("json");
            cfg["torch_dtype"] = serde_json::Value::from(if dtype == DType::BF16 {
                "bfloat16"
            } else {
                "float32"
            });
            std::fs::write(&cfg_path, cfg.to_string()).expect("write config");
            dir
        };
        Models {
            bf16_dir: write("bf16", DType::BF16, DType::BF16),
            rounded_f32_dir: write("rounded", DType::F32, DType::F32),
            f32_dir,
        }
    })
}

fn cfg(dtype: DTypeSpec, kv: DTypeSpec, mode: DeterminismMode) -> EngineConfig {
    EngineConfig {
        dtype,
        kv_cache_dtype: kv,
        determinism: mode,
        num_kv_pages: Some(1024),
        num_threads: Some(2),
        max_num_batched_tokens: 256,
        ..Default::default()
    }
}

type Bits = (Vec<u32>, Vec<u32>);

fn out_bits(o: &RequestOutput) -> Bits {
    let c = &o.outputs[0];
    (
        c.token_ids.clone(),
        c.logprobs.iter().map(|l| l.logprob.to_bits()).collect(),
    )
}

fn prompt(seed: u64, len: usize) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 400) as u32
        })
        .collect()
}

fn target(deterministic: bool) -> Request {
    let params = SamplingParams {
        temperature: 0.8,
        seed: Some(42),
        max_tokens: 32,
        ignore_eos: true,
        deterministic,
        ..Default::default()
    };
    Request::new("target", prompt(7, 23), params)
}

/// The target alone, then inside batches of other requests (some deterministic) at several
/// positions; the target's bits in each.
fn solo_and_batched(e: &Engine, t: &Request, det_neighbours: bool) -> (Bits, Vec<Bits>) {
    let solo = out_bits(&e.generate(vec![t.clone()]).expect("solo")[0]);
    let mut batched = Vec::new();
    for (round, others) in [3usize, 9, 17].into_iter().enumerate() {
        let mut reqs: Vec<Request> = (0..others)
            .map(|i| {
                let params = SamplingParams {
                    temperature: if i % 2 == 0 { 0.0 } else { 1.0 },
                    seed: Some(i as u64 + 100 * round as u64),
                    max_tokens: 5 + (i * 7) % 40,
                    ignore_eos: true,
                    deterministic: det_neighbours && i % 3 == 0,
                    ..Default::default()
                };
                Request::new(
                    format!("o{round}-{i}"),
                    prompt(i as u64 + 31 * round as u64, 1 + (i * 13) % 100),
                    params,
                )
            })
            .collect();
        let at = (round * 5) % (others + 1);
        reqs.insert(at, t.clone());
        let outs = e.generate(reqs).expect("batch");
        batched.push(out_bits(&outs[at]));
    }
    (solo, batched)
}

#[test]
fn bf16_weights_give_the_f32_engine_s_bits_on_the_same_values() {
    // The bf16 GEMM is the f32 GEMM on widened weights and the embedding/norms widen exactly,
    // so with an f32 KV cache a bf16 checkpoint runs bit for bit like the f32 checkpoint of
    // the same (rounded) values, and its weights hash is the same.
    let m = models();
    let t = target(true);
    let f32_engine = Engine::from_model_dir(
        &m.rounded_f32_dir,
        cfg(DTypeSpec::Auto, DTypeSpec::Auto, DeterminismMode::Dvr),
    )
    .expect("f32 engine");
    let bf16_engine = Engine::from_model_dir(
        &m.bf16_dir,
        cfg(DTypeSpec::Auto, DTypeSpec::F32, DeterminismMode::Dvr),
    )
    .expect("bf16 engine");
    let a = f32_engine.generate(vec![t.clone()]).expect("f32")[0].clone();
    let b = bf16_engine.generate(vec![t.clone()]).expect("bf16")[0].clone();
    assert_eq!(out_bits(&a), out_bits(&b));
    assert!(a.fingerprint.contains("-f32-cpu-"), "{}", a.fingerprint);
    assert!(
        b.fingerprint.contains("-bf16-kvf32-cpu-"),
        "{}",
        b.fingerprint
    );
    let hash = |f: &str| f.split('-').nth(1).map(str::to_string);
    assert_eq!(hash(&a.fingerprint), hash(&b.fingerprint));
    // dtype="bfloat16" on the f32 checkpoint rounds the weights to the same values.
    let converted = Engine::from_model_dir(
        &m.f32_dir,
        cfg(DTypeSpec::Bf16, DTypeSpec::F32, DeterminismMode::Dvr),
    )
    .expect("converted engine");
    let c = converted.generate(vec![t]).expect("converted")[0].clone();
    assert_eq!(out_bits(&c), out_bits(&b));
    assert_eq!(c.fingerprint, b.fingerprint);
}

#[test]
fn bf16_engine_deterministic_requests_are_batch_invariant() {
    // `auto` on a bf16 checkpoint: bf16 weights and bf16 KV cache.
    let e = Engine::from_model_dir(
        &models().bf16_dir,
        cfg(DTypeSpec::Auto, DTypeSpec::Auto, DeterminismMode::Dvr),
    )
    .expect("engine");
    let t = target(true);
    let (solo, batched) = solo_and_batched(&e, &t, true);
    assert_eq!(solo.0.len(), 32);
    for (i, b) in batched.iter().enumerate() {
        assert_eq!(b, &solo, "batch {i}");
    }
    let fp = &e.generate(vec![t]).expect("gen")[0].fingerprint;
    assert!(
        fp.contains("-bf16-cpu-") && fp.ends_with("-dvr-inline"),
        "{fp}"
    );
    // The bf16 KV cache changes the numbers (it is a different configuration).
    let f32_kv = Engine::from_model_dir(
        &models().bf16_dir,
        cfg(DTypeSpec::Auto, DTypeSpec::F32, DeterminismMode::Dvr),
    )
    .expect("engine");
    let other = out_bits(&f32_kv.generate(vec![target(true)]).expect("gen")[0]);
    assert_ne!(
        other.1, solo.1,
        "a bf16 KV cache should round differently from f32"
    );
}

#[test]
fn bf16_negative_control_fast_path_alone_is_batch_variant() {
    let e = Engine::from_model_dir(
        &models().bf16_dir,
        cfg(DTypeSpec::Auto, DTypeSpec::Auto, DeterminismMode::Off),
    )
    .expect("engine");
    // A longer prompt than the needle's: split-KV attention has more keys to split.
    let mut t = target(false);
    t.prompt = prompt(7, 150).into();
    let (solo, batched) = solo_and_batched(&e, &t, false);
    assert!(
        batched.iter().any(|b| b != &solo),
        "the bf16 fast path looked batch-invariant: the bf16 needle test would be blind"
    );
}

fn load_err(dir: &Path, c: EngineConfig) -> String {
    match Engine::from_model_dir(dir, c) {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn cpu_dtype_choices_and_errors() {
    let m = models();
    let off = DeterminismMode::Dvr;
    let err = load_err(&m.f32_dir, cfg(DTypeSpec::F16, DTypeSpec::Auto, off));
    assert!(err.contains("dtype") && err.contains("bfloat16"), "{err}");
    let err = load_err(&m.f32_dir, cfg(DTypeSpec::Auto, DTypeSpec::F16, off));
    assert!(err.contains("kv_cache_dtype"), "{err}");
    // f32 weights with a bf16 KV cache: named in the fingerprint.
    let e = Engine::from_model_dir(&m.f32_dir, cfg(DTypeSpec::Auto, DTypeSpec::Bf16, off))
        .expect("engine");
    let fp = &e.generate(vec![target(true)]).expect("gen")[0].fingerprint;
    assert!(fp.contains("-f32-kvbf16-cpu-"), "{fp}");
}

#[test]
fn a_model_too_large_for_memory_fails_before_loading_and_says_how_much_it_needs() {
    // A config for ~17 T parameters and no weights at all: the check runs on the config alone,
    // before the checkpoint is opened or anything allocated.
    let scratch = tempfile::tempdir().expect("dir");
    let dir = scratch.path();
    let cfg_json = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 65536,
        "intermediate_size": 262144,
        "num_attention_heads": 512,
        "num_key_value_heads": 64,
        "num_hidden_layers": 320,
        "vocab_size": 128256,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16"
    });
    std::fs::write(dir.join("config.json"), cfg_json.to_string()).expect("config");
    let err = load_err(dir, EngineConfig::default());
    assert!(
        err.contains("GiB of memory") && err.contains("bf16"),
        "{err}"
    );
    assert!(err.contains("weights"), "{err}");
}

fn abf16_cfg(mode: DeterminismMode) -> EngineConfig {
    EngineConfig {
        activation_dtype: ActivationDtype::Bf16,
        ..cfg(DTypeSpec::Auto, DTypeSpec::Auto, mode)
    }
}

#[test]
fn abf16_engine_deterministic_requests_are_batch_invariant_and_fingerprinted() {
    // The bf16-activation mode (`ops::gemm_abf16` in every linear layer).
    let e = Engine::from_model_dir(&models().bf16_dir, abf16_cfg(DeterminismMode::Dvr))
        .expect("engine");
    let t = target(true);
    let (solo, batched) = solo_and_batched(&e, &t, true);
    assert_eq!(solo.0.len(), 32);
    for (i, b) in batched.iter().enumerate() {
        assert_eq!(b, &solo, "batch {i}");
    }
    let fp = e.generate(vec![t.clone()]).expect("gen")[0]
        .fingerprint
        .clone();
    assert!(
        fp.contains("-bf16-cpu-k") && fp.contains("-abf16-") && fp.ends_with("-dvr-inline"),
        "{fp}"
    );
    // Same weights (same hash), other numerics (other bits, other fingerprint).
    let f32_act = Engine::from_model_dir(
        &models().bf16_dir,
        cfg(DTypeSpec::Auto, DTypeSpec::Auto, DeterminismMode::Dvr),
    )
    .expect("engine");
    let o = f32_act.generate(vec![t.clone()]).expect("gen")[0].clone();
    assert_ne!(
        out_bits(&o).1,
        solo.1,
        "bf16 activations should round differently"
    );
    assert_ne!(o.fingerprint, fp);
    let hash = |f: &str| f.split('-').nth(1).map(str::to_string);
    assert_eq!(hash(&o.fingerprint), hash(&fp));
    // `dtype="bfloat16"` on the f32 checkpoint: the same weights, the same bits.
    let converted = Engine::from_model_dir(
        &models().f32_dir,
        EngineConfig {
            dtype: DTypeSpec::Bf16,
            ..abf16_cfg(DeterminismMode::Dvr)
        },
    )
    .expect("engine");
    let c = converted.generate(vec![t]).expect("gen")[0].clone();
    assert_eq!(out_bits(&c), solo);
    assert_eq!(c.fingerprint, fp);
}

#[test]
fn abf16_negative_control_fast_path_alone_is_batch_variant() {
    // Rounding every GEMM input to bf16 absorbs most of split-KV attention's last-bit
    // differences, so this mode's fast path is *nearly* batch-invariant on the tiny test
    // model: longer prompts (more keys to split) until one batch shows a difference.
    let e = Engine::from_model_dir(&models().bf16_dir, abf16_cfg(DeterminismMode::Off))
        .expect("engine");
    let variant = [150, 300, 450].into_iter().any(|len| {
        let mut t = target(false);
        t.prompt = prompt(len as u64, len).into();
        let (solo, batched) = solo_and_batched(&e, &t, false);
        batched.iter().any(|b| b != &solo)
    });
    assert!(
        variant,
        "the abf16 fast path looked batch-invariant: its needle test would be blind"
    );
}

#[test]
fn abf16_setting_errors() {
    let m = models();
    // f32 weights: refused, naming the setting.
    let err = load_err(&m.f32_dir, abf16_cfg(DeterminismMode::Dvr));
    assert!(
        err.contains("activation_dtype") && err.contains("bfloat16"),
        "{err}"
    );
    // The shape-dependent test profile has no bf16-activation kernel.
    let err = load_err(
        &m.bf16_dir,
        EngineConfig {
            kernel_profile: KernelProfile::ShapeDependent,
            ..abf16_cfg(DeterminismMode::Dvr)
        },
    );
    assert!(err.contains("activation_dtype"), "{err}");
    // `float32` is the CPU's default, named: the bf16 engine's bits and fingerprint.
    let t = target(true);
    let named = Engine::from_model_dir(
        &m.bf16_dir,
        EngineConfig {
            activation_dtype: ActivationDtype::F32,
            ..cfg(DTypeSpec::Auto, DTypeSpec::Auto, DeterminismMode::Dvr)
        },
    )
    .expect("engine");
    let auto = Engine::from_model_dir(
        &m.bf16_dir,
        cfg(DTypeSpec::Auto, DTypeSpec::Auto, DeterminismMode::Dvr),
    )
    .expect("engine");
    let a = named.generate(vec![t.clone()]).expect("gen")[0].clone();
    let b = auto.generate(vec![t]).expect("gen")[0].clone();
    assert_eq!(out_bits(&a), out_bits(&b));
    assert_eq!(a.fingerprint, b.fingerprint);
}

#[test]
fn abf16_amx_engine_is_batch_invariant_and_names_itself() {
    let c = EngineConfig {
        activation_dtype: ActivationDtype::Bf16Amx,
        ..cfg(DTypeSpec::Auto, DTypeSpec::Auto, DeterminismMode::Dvr)
    };
    if !detspec::ops::DotIsa::amx_available() {
        // Refused, naming the setting: no output may claim AMX bits without AMX.
        let err = load_err(&models().bf16_dir, c);
        assert!(
            err.contains("activation_dtype") && err.contains("AMX"),
            "{err}"
        );
        return;
    }
    let e = Engine::from_model_dir(&models().bf16_dir, c).expect("engine");
    let t = target(true);
    let (solo, batched) = solo_and_batched(&e, &t, true);
    for (i, b) in batched.iter().enumerate() {
        assert_eq!(b, &solo, "batch {i}");
    }
    let fp = e.generate(vec![t]).expect("gen")[0].fingerprint.clone();
    assert!(
        fp.contains("-abf16amx-") && fp.ends_with("-dvr-inline"),
        "{fp}"
    );
}

#[test]
fn abf16_weight_updates_repack_for_the_mode_and_restore_the_bits() {
    // A weight update in the bf16-activation mode packs the new matrix for its GEMM (and the
    // fingerprint keeps naming the mode); restoring the old weights restores the bits.
    let m = models();
    let e = Engine::from_model_dir(&m.bf16_dir, abf16_cfg(DeterminismMode::Dvr)).expect("engine");
    let t = target(true);
    let run = |e: &Engine| {
        let o = e.generate(vec![t.clone()]).expect("gen")[0].clone();
        (out_bits(&o), o.fingerprint)
    };
    let (before, fp0) = run(&e);
    let name = "model.layers.0.mlp.down_proj.weight";
    let tensors =
        candle_core::safetensors::load(m.bf16_dir.join("model.safetensors"), &Device::Cpu)
            .expect("read");
    let w = tensors[name].clone();
    let scaled = (w.to_dtype(DType::F32).expect("f32") * 1.5).expect("scale");
    e.update_weights(vec![(name.into(), scaled)], Default::default())
        .expect("update");
    let (after, fp1) = run(&e);
    assert_ne!(after, before);
    assert!(fp1.contains("-abf16-") && fp1 != fp0, "{fp1}");
    e.update_weights(vec![(name.into(), w)], Default::default())
        .expect("restore");
    assert_eq!(run(&e), (before, fp0));
}
