//! Mixture-of-experts models under decode–verify–rollback (a Mixtral-style demo model, 8
//! experts, 2 per token). Under the `shape_dependent` profile each expert's GEMM bits change
//! with how many rows the batch routes to it, as a GPU's do: a deterministic request must still
//! be bitwise identical alone and inside any batch (replay rolls back by itself, and the
//! verifier's passes run the experts on fixed row blocks), while the fast path alone is not.

mod common;
use common::{bits, in_haystack, Bits, Rng};

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use detspec::config::{DeterminismMode, KernelProfile, VerifyStrategy};
use detspec::demo::DemoMoe;
use detspec::{Engine, EngineConfig, Request, SamplingParams};

fn model_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let moe = DemoMoe {
        num_experts: 8,
        top_k: 2,
    };
    DIR.get_or_init(|| common::write_test_model_with("moe", 5, 0.02, 512, Some(moe)))
}

fn cfg(mode: DeterminismMode, strategy: VerifyStrategy, profile: KernelProfile) -> EngineConfig {
    EngineConfig {
        verify_strategy: strategy,
        kernel_profile: profile,
        num_kv_pages: Some(1024),
        determinism: mode,
        verify_window: 8,
        verify_group: 4,
        num_threads: Some(2),
        max_num_batched_tokens: 256,
        ..Default::default()
    }
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
    Request::new("target", Rng(9).prompt(23), params)
}

fn solo(c: &EngineConfig, t: &Request) -> Bits {
    let e = Engine::from_model_dir(model_dir(), c.clone()).unwrap();
    bits(&e.generate(vec![t.clone()]).unwrap()[0])
}

#[test]
fn moe_needle_in_haystack_is_bitwise_identical_on_both_profiles() {
    let t = target(true);
    for (strategy, profile) in [
        (VerifyStrategy::Replay, KernelProfile::ShapeDependent),
        (VerifyStrategy::Replay, KernelProfile::Invariant),
        (VerifyStrategy::Inline, KernelProfile::Invariant),
    ] {
        let c = cfg(DeterminismMode::Dvr, strategy, profile);
        let want = solo(&c, &t);
        let e = Engine::from_model_dir(model_dir(), c).unwrap();
        for seed in 0..8 {
            let got = in_haystack(&e, &t, seed, true);
            assert_eq!(
                got, want,
                "{strategy:?}/{profile:?}: haystack {seed} differs"
            );
        }
        if profile == KernelProfile::ShapeDependent {
            let stats = e.stats().unwrap();
            assert!(stats.rollbacks > 0, "no natural rollback: {stats:?}");
        }
    }
}

#[test]
fn moe_negative_control_fast_path_alone_is_batch_variant() {
    let t = target(false);
    let c = cfg(
        DeterminismMode::Off,
        VerifyStrategy::Auto,
        KernelProfile::ShapeDependent,
    );
    let want = solo(&c, &t);
    let e = Engine::from_model_dir(model_dir(), c).unwrap();
    let differing = (0..8)
        .filter(|&seed| in_haystack(&e, &t, seed, false) != want)
        .count();
    assert!(differing > 0, "the MoE fast path looked batch-invariant");
}
