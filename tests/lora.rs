//! LoRA adapters: a request with an adapter keeps the determinism contract amid requests of
//! other adapters and of none (needles under replay, forced rollbacks), its KV never mixes with
//! the base model's in the prefix cache, its fingerprint names the adapter, and a bad adapter
//! is a clear error. (Parity with PEFT on transformers: `tests/python/test_lora.py`.)

mod common;
use common::{bits, Bits, Rng};
#[path = "common/kernels.rs"]
mod kernels;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use candle_core::{Device, Tensor};
use detspec::config::{DeterminismMode, KernelProfile, VerifyStrategy};
use detspec::{Engine, EngineConfig, Request, SamplingParams};

const TARGETS: [(&str, usize, usize); 7] = [
    ("self_attn.q_proj", 64, 64),
    ("self_attn.k_proj", 64, 32),
    ("self_attn.v_proj", 64, 32),
    ("self_attn.o_proj", 64, 64),
    ("mlp.gate_proj", 64, 128),
    ("mlp.up_proj", 64, 128),
    ("mlp.down_proj", 128, 64),
];

fn model_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| common::write_test_model("lora", 5, 0.02, 512))
}

/// Writes a PEFT adapter of rank `r` on `modules` (every layer) under `name`; `b_scale` 0
/// makes every `B` zero (the adapter then changes nothing). Extra config JSON fields and extra
/// tensors can be added to make it invalid.
fn write_adapter(
    name: &str,
    r: usize,
    modules: &[&str],
    seed: u64,
    b_scale: f32,
    extra_config: &str,
    extra_tensors: &[(&str, Vec<usize>)],
) -> PathBuf {
    let dir = model_dir().with_file_name(format!(
        "{}-lora-{name}",
        model_dir().file_name().unwrap().to_string_lossy()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let mut tensors = HashMap::new();
    let mut s = seed;
    for layer in 0..2 {
        for &(module, din, dout) in TARGETS.iter().filter(|t| modules.contains(&t.0)) {
            let p = format!("base_model.model.model.layers.{layer}.{module}");
            s += 1;
            let a = kernels::randn(s, r * din);
            s += 1;
            let b: Vec<f32> = kernels::randn(s, dout * r)
                .into_iter()
                .map(|v| v * b_scale)
                .collect();
            let a = Tensor::from_vec(a, (r, din), &Device::Cpu).unwrap();
            let b = Tensor::from_vec(b, (dout, r), &Device::Cpu).unwrap();
            tensors.insert(format!("{p}.lora_A.weight"), (a * 0.1).unwrap());
            tensors.insert(format!("{p}.lora_B.weight"), b);
        }
    }
    for (n, shape) in extra_tensors {
        tensors.insert(
            n.to_string(),
            Tensor::zeros(shape.as_slice(), candle_core::DType::F32, &Device::Cpu).unwrap(),
        );
    }
    candle_core::safetensors::save(&tensors, dir.join("adapter_model.safetensors")).unwrap();
    let targets: Vec<String> = modules
        .iter()
        .map(|m| format!("\"{}\"", m.rsplit('.').next().unwrap()))
        .collect();
    std::fs::write(
        dir.join("adapter_config.json"),
        format!(
            "{{\"peft_type\": \"LORA\", \"r\": {r}, \"lora_alpha\": {}, \"target_modules\": [{}], \
             \"bias\": \"none\"{extra_config}}}",
            2 * r,
            targets.join(", ")
        ),
    )
    .unwrap();
    dir
}

const ALL: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

fn cfg() -> EngineConfig {
    EngineConfig {
        verify_strategy: VerifyStrategy::Replay,
        num_kv_pages: Some(1024),
        determinism: DeterminismMode::Dvr,
        verify_window: 8,
        verify_group: 4,
        num_threads: Some(2),
        max_num_batched_tokens: 256,
        max_loras: 4,
        ..Default::default()
    }
}

fn params(deterministic: bool) -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        seed: Some(42),
        max_tokens: 32,
        ignore_eos: true,
        deterministic,
        ..Default::default()
    }
}

/// Runs `target` amid a random batch whose requests use adapter `a`, adapter `b` or none.
fn in_haystack(
    e: &Engine,
    target: &Request,
    seed: u64,
    adapters: &[Arc<detspec::model::LoraAdapter>],
) -> Bits {
    let mut rng = Rng(seed.wrapping_mul(0x9e3779b97f4a7c15) | 1);
    let others = 1 + rng.below(16) as usize;
    let position = rng.below(others as u64 + 1) as usize;
    let mut streams = Vec::new();
    let mut target_stream = None;
    for i in 0..=others {
        if i == position {
            target_stream = Some(e.add_request(target.clone()).unwrap());
            continue;
        }
        let p = SamplingParams {
            temperature: 1.0,
            seed: Some(rng.next()),
            max_tokens: 1 + rng.below(40) as usize,
            ignore_eos: true,
            deterministic: rng.below(3) == 0,
            ..Default::default()
        };
        let len = 1 + rng.below(80) as usize;
        let mut r = Request::new(format!("o{seed}-{i}"), rng.prompt(len), p);
        let pick = rng.below(adapters.len() as u64 + 1) as usize;
        if let Some(a) = adapters.get(pick) {
            r = r.with_lora(a.clone());
        }
        streams.push(e.add_request(r).unwrap());
    }
    let out = target_stream.unwrap().wait().unwrap();
    for s in streams {
        s.wait().unwrap();
    }
    bits(&out)
}

#[test]
fn an_adapter_with_zero_b_gives_the_base_models_bits_and_a_real_one_does_not() {
    let e = Engine::from_model_dir(model_dir(), cfg()).unwrap();
    let zero = e
        .load_lora(
            "zero",
            &write_adapter("zero", 4, &ALL, 1, 0.0, "", &[]),
            false,
        )
        .unwrap();
    let real = e
        .load_lora(
            "real",
            &write_adapter("real", 4, &ALL, 1, 1.0, "", &[]),
            false,
        )
        .unwrap();
    let prompt = Rng(3).prompt(20);
    let run = |a: Option<&Arc<detspec::model::LoraAdapter>>| {
        let mut r = Request::new("r", prompt.clone(), params(true));
        if let Some(a) = a {
            r = r.with_lora(a.clone());
        }
        bits(&e.generate(vec![r]).unwrap()[0])
    };
    let base = run(None);
    assert_eq!(run(Some(&zero)), base);
    assert_ne!(run(Some(&real)), base);
}

#[test]
fn a_deterministic_adapter_request_is_the_same_bits_in_any_batch_of_other_adapters() {
    // The shape-dependent profile makes the fast path's GEMM bits depend on the row count, so
    // the verifier meets real mismatches; forced rollbacks on top.
    let config = EngineConfig {
        kernel_profile: KernelProfile::ShapeDependent,
        fault_injection: 0.2,
        ..cfg()
    };
    let e = Engine::from_model_dir(model_dir(), config.clone()).unwrap();
    let a = e
        .load_lora("a", &write_adapter("a", 8, &ALL, 11, 1.0, "", &[]), false)
        .unwrap();
    let b = e
        .load_lora(
            "b",
            &write_adapter(
                "b",
                4,
                &["self_attn.q_proj", "self_attn.v_proj"],
                21,
                1.0,
                "",
                &[],
            ),
            false,
        )
        .unwrap();
    let target = Request::new("target", Rng(7).prompt(23), params(true)).with_lora(a.clone());
    let alone = bits(&e.generate(vec![target.clone()]).unwrap()[0]);
    for seed in 0..6 {
        assert_eq!(
            in_haystack(&e, &target, seed, &[a.clone(), b.clone()]),
            alone,
            "haystack {seed}"
        );
    }
    assert!(e.stats().unwrap().rollbacks > 0, "no rollback happened");
    // Negative control: the same request without the promise changes with its batch.
    let plain = Request::new("target", Rng(7).prompt(23), params(false)).with_lora(a.clone());
    let plain_alone = bits(&e.generate(vec![plain.clone()]).unwrap()[0]);
    let differing = (0..6)
        .filter(|&seed| in_haystack(&e, &plain, seed, &[a.clone(), b.clone()]) != plain_alone)
        .count();
    assert!(
        differing > 0,
        "the fast path looked batch-invariant: the test would be blind"
    );
}

#[test]
fn the_replay_verifier_commits_what_the_inline_strategy_computes_with_the_adapter() {
    // Inline runs the adapter on invariant kernels inside the fast batch and commits what it
    // sampled; replay commits what its verifier computes. Equal bits mean the verifier (and the
    // isolated prefill) ran the adapter too.
    let dir = write_adapter("inline", 8, &ALL, 61, 1.0, "", &[]);
    let run = |strategy: VerifyStrategy| {
        let e = Engine::from_model_dir(
            model_dir(),
            EngineConfig {
                verify_strategy: strategy,
                fault_injection: if strategy == VerifyStrategy::Replay {
                    0.3
                } else {
                    0.0
                },
                ..cfg()
            },
        )
        .unwrap();
        let a = e.load_lora("a", &dir, false).unwrap();
        let target = Request::new("t", Rng(9).prompt(30), params(true)).with_lora(a.clone());
        let out = e.generate(vec![target.clone()]).unwrap();
        let busy = in_haystack(&e, &target, 3, &[a]);
        assert_eq!(busy, bits(&out[0]), "{strategy:?}: batch changed the bits");
        (bits(&out[0]), out[0].metrics.num_rollbacks)
    };
    let (inline, _) = run(VerifyStrategy::Inline);
    let (replayed, rollbacks) = run(VerifyStrategy::Replay);
    assert!(rollbacks > 0);
    assert_eq!(replayed, inline);
}

#[test]
fn adapter_kv_never_mixes_with_the_base_models_in_the_prefix_cache() {
    let prompt = Rng(5).prompt(70);
    let adapter = write_adapter("cache", 4, &ALL, 31, 1.0, "", &[]);
    let fresh = {
        let e = Engine::from_model_dir(model_dir(), cfg()).unwrap();
        let a = e.load_lora("x", &adapter, false).unwrap();
        let r = Request::new("r", prompt.clone(), params(true)).with_lora(a);
        bits(&e.generate(vec![r]).unwrap()[0])
    };
    let e = Engine::from_model_dir(model_dir(), cfg()).unwrap();
    let a = e.load_lora("x", &adapter, false).unwrap();
    let base = e
        .generate(vec![Request::new("base", prompt.clone(), params(true))])
        .unwrap();
    assert_ne!(bits(&base[0]), fresh);
    let run = |id: &str| {
        let r = Request::new(id, prompt.clone(), params(true)).with_lora(a.clone());
        e.generate(vec![r]).unwrap().remove(0)
    };
    let first = run("first");
    assert_eq!(
        first.metrics.num_cached_tokens, 0,
        "read the base model's pages"
    );
    assert_eq!(bits(&first), fresh);
    let second = run("second");
    assert!(
        second.metrics.num_cached_tokens > 0,
        "did not read its own pages"
    );
    assert_eq!(bits(&second), fresh);
}

#[test]
fn the_fingerprint_names_the_adapter_and_unloading_spares_running_requests() {
    let e = Engine::from_model_dir(model_dir(), cfg()).unwrap();
    let dir = write_adapter("fp", 4, &ALL, 41, 1.0, "", &[]);
    let a = e.load_lora("one", &dir, false).unwrap();
    let same = e.load_lora("two", &dir, false).unwrap();
    let fp = |r: Request| e.generate(vec![r]).unwrap()[0].fingerprint.clone();
    let base = fp(Request::new("b", vec![1, 2, 3], params(true)));
    let with_a = fp(Request::new("a", vec![1, 2, 3], params(true)).with_lora(a.clone()));
    assert_ne!(with_a, base);
    assert!(
        with_a.contains(&format!("lora{:016x}", a.content_hash())),
        "{with_a}"
    );
    assert_eq!(
        fp(Request::new("s", vec![1, 2, 3], params(true)).with_lora(same)),
        with_a
    );
    // Unloaded while running: the request finishes with its adapter; the name is gone.
    let long = SamplingParams {
        max_tokens: 200,
        ..params(true)
    };
    let stream = e
        .add_request(
            Request::new("long", vec![4, 5, 6], long.clone()).with_lora(e.lora("one").unwrap()),
        )
        .unwrap();
    e.unload_lora("one").unwrap();
    let out = stream.wait().unwrap();
    assert_eq!(out.outputs[0].token_ids.len(), 200);
    let again = e
        .generate(vec![Request::new("again", vec![4, 5, 6], long).with_lora(a)])
        .unwrap();
    assert_eq!(bits(&again[0]), bits(&out));
    let err = e.lora("one").unwrap_err().to_string();
    assert!(err.contains("lora_name") && err.contains("one"), "{err}");
    assert!(e.unload_lora("one").is_err());
}

#[test]
fn bad_adapters_are_clear_errors() {
    let off = Engine::from_model_dir(
        model_dir(),
        EngineConfig {
            max_loras: 0,
            ..cfg()
        },
    )
    .unwrap();
    let good = write_adapter("good", 4, &ALL, 51, 1.0, "", &[]);
    let err = off.load_lora("x", &good, false).unwrap_err().to_string();
    assert!(err.contains("enable_lora"), "{err}");

    let e = Engine::from_model_dir(
        model_dir(),
        EngineConfig {
            max_loras: 2,
            max_lora_rank: 8,
            ..cfg()
        },
    )
    .unwrap();
    let mut cases: Vec<(PathBuf, &str)> = vec![
        (model_dir().join("nowhere"), "adapter_config.json"),
        (
            write_adapter("rank", 16, &ALL, 1, 1.0, "", &[]),
            "max_lora_rank",
        ),
        (
            write_adapter("dora", 4, &ALL, 1, 1.0, ", \"use_dora\": true", &[]),
            "use_dora",
        ),
        (
            write_adapter("bias", 4, &ALL, 1, 1.0, ", \"bias\": \"all\"", &[]),
            "bias",
        ),
        (
            write_adapter(
                "embed",
                4,
                &ALL,
                1,
                1.0,
                "",
                &[(
                    "base_model.model.model.embed_tokens.lora_embedding_A",
                    vec![4, 512],
                )],
            ),
            "embed_tokens",
        ),
        (
            write_adapter(
                "shape",
                4,
                &ALL,
                1,
                1.0,
                "",
                &[(
                    "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight",
                    vec![4, 64],
                )],
            ),
            "layers.1.mlp.down_proj.lora_A",
        ),
        (
            write_adapter(
                "layer",
                4,
                &ALL,
                1,
                1.0,
                "",
                &[(
                    "base_model.model.model.layers.7.mlp.up_proj.lora_A.weight",
                    vec![4, 64],
                )],
            ),
            "layer 7",
        ),
    ];
    // A config refused for what it asks is refused before the weights are read.
    let dora_only = write_adapter("dora-only", 4, &ALL, 1, 1.0, ", \"use_dora\": true", &[]);
    std::fs::remove_file(dora_only.join("adapter_model.safetensors")).unwrap();
    cases.push((dora_only, "use_dora"));
    for (dir, needle) in cases {
        let err = e.load_lora("x", &dir, false).unwrap_err().to_string();
        assert!(err.contains(needle), "{}: {err}", dir.display());
    }
    e.load_lora("x", &good, false).unwrap();
    let err = e.load_lora("x", &good, false).unwrap_err().to_string();
    assert!(err.contains("already loaded"), "{err}");
    e.load_lora("x", &good, true).unwrap();
    e.load_lora("y", &good, false).unwrap();
    let err = e.load_lora("z", &good, false).unwrap_err().to_string();
    assert!(err.contains("max_loras"), "{err}");
    // The engine still serves.
    let out = e
        .generate(vec![
            Request::new("ok", vec![1, 2], params(false)).with_lora(e.lora("x").unwrap())
        ])
        .unwrap();
    assert_eq!(out[0].outputs[0].token_ids.len(), 32);
}

#[test]
fn a_prompt_of_another_adapter_does_not_wait_for_a_prefill_it_cannot_read() {
    // With the prefix cache on, a waiting prompt that shares most of a running prefill waits
    // for it, to read its pages. Under another adapter those pages are not its own: it must
    // start at once, beside the prefill.
    let config = detspec::ModelConfig::from_model_dir(model_dir()).unwrap();
    let dir = write_adapter("defer", 4, &ALL, 71, 1.0, "", &[]);
    let adapter = Arc::new(
        detspec::model::LoraAdapter::load(
            &dir,
            &detspec::model::LoraBase {
                config: &config,
                device: &Device::Cpu,
                dtype: candle_core::DType::F32,
                max_rank: 64,
            },
        )
        .unwrap(),
    );
    let prompt = Rng(11).prompt(60);
    let first_step = |with_lora: bool| {
        let mut core = detspec::engine::EngineCore::load(model_dir(), cfg(), &Device::Cpu).unwrap();
        core.add_request(Request::new("base", prompt.clone(), params(false)), 0.0)
            .unwrap();
        let mut other = Request::new("other", prompt.clone(), params(false));
        if with_lora {
            other = other.with_lora(adapter.clone());
        }
        core.add_request(other, 0.0).unwrap();
        core.step()
            .into_iter()
            .filter_map(|ev| match ev {
                detspec::engine::StreamEvent::Tokens { request_id, .. } => Some(request_id),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    // The same prompt on the base model waits (the control: deferral is on here) ...
    assert_eq!(first_step(false), vec!["base".to_string()]);
    // ... and under an adapter it does not.
    let mut both = first_step(true);
    both.sort();
    assert_eq!(both, vec!["base".to_string(), "other".to_string()]);
}

#[test]
fn an_adapter_sent_as_bytes_is_the_adapter_of_its_files() {
    let e = Engine::from_model_dir(model_dir(), cfg()).unwrap();
    let dir = write_adapter("bytes", 4, &ALL, 81, 1.0, "", &[]);
    let from_disk = e.load_lora("disk", &dir, false).unwrap();
    let config = std::fs::read_to_string(dir.join("adapter_config.json")).unwrap();
    let weights = std::fs::read(dir.join("adapter_model.safetensors")).unwrap();
    let sent = e.load_lora_bytes("sent", &config, &weights, false).unwrap();
    assert_eq!(sent.content_hash(), from_disk.content_hash());
    let run = |a| {
        let r = Request::new("r", Rng(4).prompt(20), params(true)).with_lora(a);
        bits(&e.generate(vec![r]).unwrap()[0])
    };
    assert_eq!(run(sent), run(from_disk));
    // Bad bytes are an error naming the adapter; nothing is registered.
    let err = e
        .load_lora_bytes("bad", &config, &weights[..100], false)
        .unwrap_err()
        .to_string();
    assert!(err.contains("bad") && err.contains("safetensors"), "{err}");
    assert!(e.lora("bad").is_err());
}
