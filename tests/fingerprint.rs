//! The fingerprint names what changes a deterministic output's bits (config values the forward
//! reads, tokenizer files, kernel profile), and engine threads compute in their own
//! floating-point environment, whatever the caller's.

mod common;

use std::path::{Path, PathBuf};

use detspec::config::KernelProfile;
use detspec::engine::fpenv;
use detspec::{Engine, EngineConfig, Request, SamplingParams};

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

fn engine(dir: &Path, cfg: EngineConfig) -> Engine {
    Engine::from_model_dir(
        dir,
        EngineConfig {
            num_kv_pages: Some(64),
            ..cfg
        },
    )
    .unwrap()
}

fn fingerprint(dir: &Path) -> String {
    engine(dir, EngineConfig::default()).fingerprint()
}

/// `dir` copied to a sibling with `edit` applied to one file's text.
fn edited(dir: &Path, tag: &str, file: &str, edit: impl Fn(String) -> String) -> PathBuf {
    let to = dir.with_file_name(format!(
        "{}-{tag}",
        dir.file_name().unwrap().to_string_lossy()
    ));
    copy_dir(dir, &to);
    let text = std::fs::read_to_string(to.join(file)).unwrap();
    let new = edit(text.clone());
    assert_ne!(new, text, "{tag}: the edit changed nothing");
    std::fs::write(to.join(file), new).unwrap();
    to
}

#[test]
fn a_config_or_tokenizer_change_moves_the_fingerprint_and_a_copy_does_not() {
    let dir = common::write_test_model("fingerprint", 3, 0.1, 256);
    let base = fingerprint(&dir);
    assert_eq!(base, fingerprint(&dir), "same directory, same fingerprint");
    let copy = edited(&dir, "copy", "config.json", |t| format!("{t}\n"));
    assert_eq!(fingerprint(&copy), base, "whitespace is not a config value");

    let eps = edited(&dir, "eps", "config.json", |t| {
        let mut v: serde_json::Value = serde_json::from_str(&t).unwrap();
        v["rms_norm_eps"] = serde_json::json!(1.5e-3);
        v.to_string()
    });
    let theta = edited(&dir, "theta", "config.json", |t| {
        let mut v: serde_json::Value = serde_json::from_str(&t).unwrap();
        v["rope_theta"] = serde_json::json!(1234.5);
        v.to_string()
    });
    let tok = edited(&dir, "tok", "tokenizer.json", |t| t + " ");
    for (what, d) in [
        ("rms_norm_eps", &eps),
        ("rope_theta", &theta),
        ("tokenizer", &tok),
    ] {
        let fp = fingerprint(d);
        assert_ne!(fp, base, "{what} changed but the fingerprint did not");
        // The weights did not change: only the model part of the fingerprint moves.
        assert_eq!(fp[..25], base[..25], "{what}: weights hash moved");
    }

    let shaped = engine(
        &dir,
        EngineConfig {
            kernel_profile: KernelProfile::ShapeDependent,
            ..Default::default()
        },
    )
    .fingerprint();
    assert!(shaped.contains("-shapedep-") && shaped != base, "{shaped}");
    for d in [copy, eps, theta, tok] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

fn sampled_run(engine: &Engine) -> Vec<(u32, u32)> {
    let params = SamplingParams {
        temperature: 0.8,
        seed: Some(11),
        max_tokens: 24,
        ignore_eos: true,
        deterministic: true,
        ..Default::default()
    };
    let outs = engine
        .generate(vec![Request::new(
            "r",
            (1..40).collect::<Vec<u32>>(),
            params,
        )])
        .unwrap();
    let c = &outs[0].outputs[0];
    c.token_ids
        .iter()
        .zip(&c.logprobs)
        .map(|(&t, lp)| (t, lp.logprob.to_bits()))
        .collect()
}

#[cfg(target_arch = "x86_64")]
#[test]
fn engine_threads_ignore_the_callers_flush_to_zero_mode() {
    let dir = common::write_test_model("fpenv", 4, 0.1, 256);
    let reference = sampled_run(&engine(&dir, EngineConfig::default()));
    let from_ftz = std::thread::spawn(move || {
        // The caller runs with flush-to-zero and denormals-are-zero, as some libraries set.
        unsafe { fpenv::set_control_word(fpenv::IEEE_DEFAULT_MXCSR | 0x8040) };
        let e = engine(&dir, EngineConfig::default());
        let words = e
            .with_core(|_| Ok(rayon::broadcast(|_| fpenv::control_word())))
            .unwrap();
        (sampled_run(&e), words, fpenv::control_word())
    })
    .join()
    .unwrap();
    let (bits, words, caller) = from_ftz;
    assert_eq!(
        caller,
        Some(fpenv::IEEE_DEFAULT_MXCSR | 0x8040),
        "the caller's mode is its own"
    );
    assert!(!words.is_empty());
    for w in words {
        assert_eq!(
            w,
            Some(fpenv::IEEE_DEFAULT_MXCSR),
            "an engine worker inherited the caller's mode"
        );
    }
    assert_eq!(bits, reference);
}
