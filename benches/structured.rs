//! Per-token cost of structured outputs: the allowed-token mask (llguidance) and its
//! application to a row of logits, on a synthetic byte-level vocabulary of Llama 3's size.
//!
//! ```sh
//! cargo bench --bench structured -- --warm-up-time 1 --measurement-time 5
//! ```
//!
//! * `mask/<constraint>`: one output token of a constrained request — the parser consumes the
//!   previous token and computes the mask of the next — averaged over a 64-token walk
//!   (`Throughput::Elements` = tokens, so criterion reports tokens/s).
//! * `apply/<vocab>`: masking one row of logits and sampling from it (`sample_next`), against
//!   the same row unmasked.
//!
//! The vocabulary is 128 256 pieces of pseudo-English, digits, punctuation and JSON fragments
//! (byte-level, like GPT-2/Llama 3); a real tokenizer's trie differs, so treat the figures as
//! the order of magnitude, not a property of any model.

use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use detspec::sampling::{sample_next, Grammars, SamplingParams, StructuredOutputs};
use detspec::tokenizer::Tokenizer;

const VOCAB: usize = 128_256;

/// GPT-2's byte → printable-char map (bytes that print as themselves keep their char).
fn byte_char(b: u8) -> char {
    let printable = |c: u32| {
        (0x21..=0x7e).contains(&c) || (0xa1..=0xac).contains(&c) || (0xae..=0xff).contains(&c)
    };
    if printable(b as u32) {
        return b as char;
    }
    let shift = (0..b as u32).filter(|&c| !printable(c)).count() as u32;
    char::from_u32(256 + shift).unwrap_or('?')
}

fn synthetic_tokenizer() -> PathBuf {
    let mut vocab = serde_json::Map::new();
    let add = |s: String, vocab: &mut serde_json::Map<String, serde_json::Value>| {
        if !vocab.contains_key(&s) {
            let id = vocab.len();
            vocab.insert(s, id.into());
        }
    };
    for b in 0..=255u8 {
        add(byte_char(b).to_string(), &mut vocab);
    }
    let frags = [
        "\":", "\",", "{\"", "\"}", "\":\"", "\",\"", "[", "]", "},", "null", "true", "false",
        "\":[", "\"]", "\\n", ".", ",", "!", "?", "'s",
    ];
    for f in frags {
        add(f.chars().map(|c| byte_char(c as u8)).collect(), &mut vocab);
    }
    let (cons, vow) = ("bcdfghjklmnprstvwz", "aeiouy");
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = |n: usize| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % n as u64) as usize
    };
    while vocab.len() < VOCAB - 1 {
        let mut s = String::new();
        match next(10) {
            0 => {
                for _ in 0..1 + next(4) {
                    s.push((b'0' + next(10) as u8) as char);
                }
            }
            k => {
                if k < 6 {
                    s.push(byte_char(b' '));
                }
                for _ in 0..1 + next(4) {
                    s.push(cons.as_bytes()[next(cons.len())] as char);
                    s.push(vow.as_bytes()[next(vow.len())] as char);
                }
                if next(3) == 0 {
                    s.push(cons.as_bytes()[next(cons.len())] as char);
                }
            }
        }
        add(s, &mut vocab);
    }
    let eos = vocab.len();
    let json = serde_json::json!({
        "version": "1.0",
        "added_tokens": [{"id": eos, "content": "<|eot|>", "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
            "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
            "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": []},
    });
    let dir = std::env::temp_dir().join(format!("detspec-structured-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, json.to_string()).unwrap();
    path
}

fn constraints() -> Vec<(&'static str, StructuredOutputs)> {
    let schema = r#"{"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"street": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["street", "zip"]}},
        "required": ["name", "age", "email", "tags", "address"]}"#;
    vec![
        (
            "json_schema",
            StructuredOutputs {
                json: Some(schema.into()),
                ..Default::default()
            },
        ),
        (
            "json_object",
            StructuredOutputs {
                json_object: true,
                ..Default::default()
            },
        ),
        (
            "regex",
            StructuredOutputs {
                regex: Some(r"([a-z]+ ){3,40}[0-9]{1,4}\.".into()),
                ..Default::default()
            },
        ),
    ]
}

fn bench(c: &mut Criterion) {
    let path = synthetic_tokenizer();
    let tok = Arc::new(Tokenizer::from_file(&path).unwrap());
    let eos = (VOCAB - 1) as u32;
    let grammars = Grammars::new(Some(tok), VOCAB, vec![eos]);
    let mut g = c.benchmark_group("mask");
    g.sample_size(10);
    for (name, so) in constraints() {
        // A 64-token walk: at each step the allowed non-EOS token with the lowest id.
        let mut walker = grammars.compile(&so).unwrap();
        let mut path: Vec<u32> = Vec::new();
        while path.len() < 64 {
            let mask = walker.mask_after(&path).unwrap().expect("ungated");
            let next =
                (0..VOCAB as u32).find(|&t| t != eos && mask[t as usize / 32] >> (t % 32) & 1 == 1);
            match next {
                Some(t) => path.push(t),
                None => break,
            }
        }
        g.throughput(Throughput::Elements(path.len() as u64));
        g.bench_with_input(BenchmarkId::from_parameter(name), &path, |b, path| {
            b.iter_batched(
                || grammars.compile(&so).unwrap(),
                |mut c| {
                    for i in 0..path.len() {
                        black_box(c.mask_after(&path[..i]).unwrap());
                    }
                },
                criterion::BatchSize::LargeInput,
            )
        });
    }
    g.finish();

    let mut g = c.benchmark_group("apply");
    let row: Vec<f32> = (0..VOCAB)
        .map(|i| ((i * 7919) % 1000) as f32 / 100.0)
        .collect();
    let mut c0 = grammars.compile(&constraints()[0].1).unwrap();
    let mask = c0.mask_after(&[]).unwrap().expect("ungated");
    let params = SamplingParams {
        temperature: 0.8,
        seed: Some(1),
        ..Default::default()
    };
    for (label, m) in [("unmasked", None), ("masked", Some(&mask[..]))] {
        g.bench_function(BenchmarkId::new(label, VOCAB), |b| {
            b.iter(|| black_box(sample_next(&params, 1, &[1, 2], &[], &row, &[eos], m).unwrap()))
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
