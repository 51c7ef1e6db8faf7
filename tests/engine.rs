//! End-to-end tests of the Rust API on a generated demo model.

mod common;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use detspec::{DetspecError, Engine, EngineConfig, FinishReason, Request, SamplingParams};

fn model_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| common::write_test_model("engine", 7, 0.1, 256))
}

fn engine() -> Engine {
    Engine::from_model_dir(
        model_dir(),
        EngineConfig {
            num_kv_pages: Some(256),
            ..Default::default()
        },
    )
    .unwrap()
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![5],
        (1..20).collect(),
        (30..77).collect(),
        vec![100, 3, 250, 7],
    ]
}

#[test]
fn greedy_batch_generates_and_frees_pages() {
    let e = engine();
    let reqs = prompts()
        .into_iter()
        .enumerate()
        .map(|(i, p)| Request::new(i.to_string(), p, greedy(20)))
        .collect();
    let outs = e.generate(reqs).unwrap();
    assert_eq!(outs.len(), 4);
    for (i, o) in outs.iter().enumerate() {
        assert_eq!(o.request_id, i.to_string());
        let c = &o.outputs[0];
        assert_eq!(c.token_ids.len(), 20);
        assert_eq!(c.logprobs.len(), 20);
        assert_eq!(c.finish_reason, Some(FinishReason::Length));
        assert!(
            c.logprobs.iter().all(|l| l.logprob <= 0.0 && l.rank == 1),
            "greedy picks rank 1"
        );
    }
    let (free, total) = e.kv_pages().unwrap();
    assert_eq!(free, total);
}

#[test]
fn same_inputs_same_bits_and_seeds_matter() {
    let run = |seed: u64| {
        let e = engine();
        let p = SamplingParams {
            temperature: 0.8,
            top_p: 0.95,
            seed: Some(seed),
            max_tokens: 24,
            ignore_eos: true,
            ..Default::default()
        };
        let reqs = prompts()
            .into_iter()
            .enumerate()
            .map(|(i, pr)| Request::new(i.to_string(), pr, p.clone()))
            .collect();
        e.generate(reqs)
            .unwrap()
            .into_iter()
            .map(|o| {
                let c = &o.outputs[0];
                (
                    c.token_ids.clone(),
                    c.logprobs
                        .iter()
                        .map(|l| l.logprob.to_bits())
                        .collect::<Vec<_>>(),
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(run(1), run(1));
    assert_ne!(run(1), run(2));
}

#[test]
fn n_completions_differ_under_sampling_and_agree_under_greedy() {
    let e = engine();
    let sampled = SamplingParams {
        n: 3,
        temperature: 1.0,
        seed: Some(9),
        max_tokens: 16,
        ignore_eos: true,
        ..Default::default()
    };
    let out = e
        .generate(vec![Request::new("a", vec![1, 2, 3], sampled)])
        .unwrap();
    let toks: Vec<_> = out[0].outputs.iter().map(|c| c.token_ids.clone()).collect();
    assert_eq!(toks.len(), 3);
    assert!(toks[0] != toks[1] || toks[1] != toks[2]);
    let out = e
        .generate(vec![Request::new(
            "b",
            vec![1, 2, 3],
            SamplingParams { n: 2, ..greedy(8) },
        )])
        .unwrap();
    assert_eq!(out[0].outputs[0].token_ids, out[0].outputs[1].token_ids);
}

#[test]
fn text_prompts_stop_strings_and_stop_tokens() {
    let e = engine();
    let out = e
        .generate(vec![Request::new("t", "Hello world", greedy(12))])
        .unwrap();
    let c = &out[0].outputs[0];
    assert_eq!(out[0].prompt.as_deref(), Some("Hello world"));
    let tok = e.tokenizer().unwrap();
    assert_eq!(c.text, tok.decode(&c.token_ids, true).unwrap());
    // Stop on the 4th greedy token's id.
    let stop_id = c.token_ids[3];
    let first = c.token_ids.iter().position(|&t| t == stop_id).unwrap();
    let p = SamplingParams {
        stop_token_ids: vec![stop_id],
        ..greedy(12)
    };
    let out = e
        .generate(vec![Request::new("s", "Hello world", p)])
        .unwrap();
    assert_eq!(out[0].outputs[0].token_ids, c.token_ids[..=first].to_vec());
    assert_eq!(out[0].outputs[0].finish_reason, Some(FinishReason::Stop));
    // A stop string taken from the middle of the text cuts the text before it.
    let text = &c.text;
    let chars: Vec<char> = text.chars().collect();
    if chars.len() > 6 {
        let stop: String = chars[3..6].iter().collect();
        let p = SamplingParams {
            stop: vec![stop.clone()],
            ..greedy(12)
        };
        let out = e
            .generate(vec![Request::new("ss", "Hello world", p)])
            .unwrap();
        let got = &out[0].outputs[0];
        assert_eq!(got.finish_reason, Some(FinishReason::Stop));
        assert!(!got.text.contains(&stop));
        assert!(text.starts_with(&got.text));
        // include_stop_str_in_output: the same tokens, the text up to and with the stop string.
        let p = SamplingParams {
            stop: vec![stop.clone()],
            include_stop_str_in_output: true,
            ..greedy(12)
        };
        let out = e
            .generate(vec![Request::new("si", "Hello world", p)])
            .unwrap();
        let kept = &out[0].outputs[0];
        assert_eq!(kept.token_ids, got.token_ids);
        assert_eq!(kept.text, format!("{}{stop}", got.text));
        // Before min_tokens a stop string does not stop generation (vLLM semantics).
        let p = SamplingParams {
            stop: vec![stop],
            min_tokens: 12,
            ..greedy(12)
        };
        let out = e
            .generate(vec![Request::new("sm", "Hello world", p)])
            .unwrap();
        assert_eq!(out[0].outputs[0].finish_reason, Some(FinishReason::Length));
        assert_eq!(out[0].outputs[0].token_ids, c.token_ids);
    }
}

#[test]
fn bad_requests_are_rejected_and_engine_keeps_serving() {
    let e = engine();
    let cases: Vec<(Request, &str)> = vec![
        (
            Request::new("a", Vec::<u32>::new(), greedy(4)),
            "prompt is empty",
        ),
        (Request::new("b", vec![1, 100_000], greedy(4)), "100000"),
        (Request::new("c", vec![1; 300], greedy(4)), "max_model_len"),
        (
            Request::new(
                "d",
                vec![1],
                SamplingParams {
                    temperature: -1.0,
                    ..greedy(4)
                },
            ),
            "temperature",
        ),
        (
            Request::new(
                "e",
                vec![1],
                SamplingParams {
                    top_p: 0.0,
                    ..greedy(4)
                },
            ),
            "top_p",
        ),
        (
            Request::new(
                "f",
                vec![1],
                SamplingParams {
                    max_tokens: 0,
                    ..greedy(4)
                },
            ),
            "max_tokens",
        ),
    ];
    for (req, needle) in cases {
        let err = e.generate(vec![req]).unwrap_err().to_string();
        assert!(err.contains(needle), "{err:?} should mention {needle:?}");
    }
    let out = e
        .generate(vec![Request::new("ok", vec![1, 2], greedy(4))])
        .unwrap();
    assert_eq!(out[0].outputs[0].token_ids.len(), 4);
    let (free, total) = e.kv_pages().unwrap();
    assert_eq!(free, total);
}

#[test]
fn prompt_logits_match_the_generation_path() {
    let e = engine();
    let p: Vec<u32> = (10..30).collect();
    let vocab = e.info().config.vocab_size;
    let logits = e.prompt_logits(vec![p.clone(), vec![4, 5]]).unwrap();
    assert_eq!(logits[0].len(), 20 * vocab);
    assert_eq!(logits[1].len(), 2 * vocab);
    let last = &logits[0][19 * vocab..];
    let argmax = (0..last.len())
        .max_by(|&a, &b| last[a].total_cmp(&last[b]).then(b.cmp(&a)))
        .unwrap();
    let out = e.generate(vec![Request::new("g", p, greedy(1))]).unwrap();
    assert_eq!(out[0].outputs[0].token_ids[0], argmax as u32);
}

/// A copy of `src` in a directory removed when the guard drops.
fn copy_dir(src: &Path) -> tempfile::TempDir {
    let dst = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(src).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), dst.path().join(f.file_name())).unwrap();
    }
    dst
}

fn load_err(dir: &Path) -> String {
    match Engine::from_model_dir(
        dir,
        EngineConfig {
            num_kv_pages: Some(8),
            ..Default::default()
        },
    ) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn load_errors_name_the_culprit() {
    let missing = std::env::temp_dir().join("detspec-no-such-model-dir");
    assert!(load_err(&missing).contains("detspec-no-such-model-dir"));

    let copy = copy_dir(model_dir());
    let dir = copy.path();
    let st = dir.join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_err(dir);
    assert!(err.contains("model.safetensors"), "{err}");

    let copy = copy_dir(model_dir());
    let dir = copy.path();
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        cfg.replace("LlamaForCausalLM", "GPT2LMHeadModel"),
    )
    .unwrap();
    let err = load_err(dir);
    assert!(
        err.contains("GPT2LMHeadModel") && err.contains("config.json"),
        "{err}"
    );

    let copy = copy_dir(model_dir());
    let dir = copy.path();
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        cfg.replace("\"intermediate_size\": 128", "\"intermediate_size\": 96"),
    )
    .unwrap();
    let err = load_err(dir);
    assert!(
        err.contains("mlp.gate_proj.weight") && err.contains("shape"),
        "{err}"
    );

    let copy = copy_dir(model_dir());
    let dir = copy.path();
    std::fs::remove_file(dir.join("config.json")).unwrap();
    assert!(load_err(dir).contains("config.json"));
    let _: Option<DetspecError> = None;
}

fn deterministic_bits(e: &Engine) -> Vec<(Vec<u32>, Vec<u32>)> {
    let params = SamplingParams {
        temperature: 0.8,
        seed: Some(3),
        deterministic: true,
        ..greedy(12)
    };
    let reqs = prompts()
        .into_iter()
        .enumerate()
        .map(|(i, p)| Request::new(i.to_string(), p, params.clone()))
        .collect();
    e.generate(reqs)
        .unwrap()
        .into_iter()
        .map(|o| {
            let c = &o.outputs[0];
            let bits = c.logprobs.iter().map(|l| l.logprob.to_bits()).collect();
            (c.token_ids.clone(), bits)
        })
        .collect()
}

#[test]
fn weight_updates_are_atomic_and_restoring_restores_fingerprint_and_bits() {
    let e = engine();
    let (fp0, before) = (e.fingerprint(), deterministic_bits(&e));
    let ck = detspec::model::Checkpoint::open(model_dir()).unwrap();
    let name = "model.layers.0.mlp.down_proj.weight";
    let shape = detspec::model::param_shapes(&e.info().config)[name].clone();
    let w = ck
        .load(
            name,
            &shape,
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
        )
        .unwrap();
    let scaled = (&w * 1.5).unwrap();
    // A bad entry after a good one: nothing changes, the error names the tensor.
    let bad =
        candle_core::Tensor::zeros(3, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    let err = e
        .update_weights(
            vec![
                (name.into(), scaled.clone()),
                ("model.norm.weight".into(), bad),
            ],
            detspec::engine::InFlight::Finish,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("model.norm.weight"), "{err}");
    assert_eq!((e.fingerprint(), e.info().weight_version), (fp0.clone(), 0));
    assert_eq!(deterministic_bits(&e), before);

    let info = e
        .update_weights(vec![(name.into(), scaled)], Default::default())
        .unwrap();
    assert_ne!(info.fingerprint, fp0);
    assert_eq!(info.weight_version, 1);
    assert_ne!(deterministic_bits(&e), before);
    e.update_weights(vec![(name.into(), w)], Default::default())
        .unwrap();
    assert_eq!(e.fingerprint(), fp0);
    assert_eq!(deterministic_bits(&e), before);
}

#[test]
fn scoring_a_deterministic_completion_returns_its_generation_logprobs() {
    let e = engine();
    let outs = deterministic_bits(&e);
    let pairs: Vec<(Vec<u32>, Vec<u32>)> = prompts()
        .into_iter()
        .zip(&outs)
        .map(|(p, (tokens, _))| (p, tokens.clone()))
        .collect();
    let scored = e.with_core(move |c| c.score(&pairs, 0, true, &[])).unwrap();
    for (s, (_, bits)) in scored.iter().zip(&outs) {
        let got: Vec<u32> = s.iter().map(|l| l.logprob.to_bits()).collect();
        assert_eq!(&got, bits);
    }
}

#[test]
fn cache_salt_confines_prefix_cache_hits_and_changes_no_bits() {
    let e = engine();
    let prompt: Vec<u32> = (0..70).map(|i| (i * 37 + 11) % 500).collect();
    let params = SamplingParams {
        deterministic: true,
        logprobs: Some(0),
        ..greedy(6)
    };
    let run = |id: &str, salt: Option<&str>| {
        let mut r = Request::new(id, prompt.clone(), params.clone());
        if let Some(s) = salt {
            r = r.with_cache_salt(s);
        }
        let out = e.generate(vec![r]).unwrap().remove(0);
        let c = &out.outputs[0];
        let lps: Vec<u32> = c.logprobs.iter().map(|l| l.logprob.to_bits()).collect();
        (out.metrics.num_cached_tokens, (c.token_ids.clone(), lps))
    };
    let (cached, want) = run("a1", Some("tenant-a"));
    assert_eq!(cached, 0);
    for (id, salt) in [("b1", Some("tenant-b")), ("plain", None)] {
        let (cached, got) = run(id, salt);
        assert_eq!(cached, 0, "{id} read tenant-a's pages");
        assert_eq!(got, want);
    }
    let (cached, got) = run("a2", Some("tenant-a"));
    assert!(cached > 0, "tenant-a did not read its own pages");
    assert_eq!(got, want);
    // Standalone passes (score) read and leave pages in the salt's namespace too.
    let salt_e = detspec::engine::SeqScope {
        lora: None,
        cache_salt: detspec::kv::salt_hash("tenant-e"),
    };
    let pairs = vec![(prompt.clone(), want.0.clone())];
    let scored = e
        .with_core(move |c| c.score(&pairs, 0, true, &[salt_e]))
        .unwrap();
    let got: Vec<u32> = scored[0].iter().map(|l| l.logprob.to_bits()).collect();
    assert_eq!(got, want.1);
    assert!(
        run("e1", Some("tenant-e")).0 > 0,
        "score left no pages for its salt"
    );
    let err = e
        .generate(vec![
            Request::new("empty", prompt.clone(), params.clone()).with_cache_salt("")
        ])
        .unwrap_err()
        .to_string();
    assert!(err.contains("cache_salt"), "{err}");
}
