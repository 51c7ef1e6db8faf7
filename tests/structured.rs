//! Structured outputs and logit bias: the allowed-token mask is a function of the output prefix
//! alone (whatever the constraint was asked before: the property a rollback relies on),
//! outputs sampled under it satisfy the constraint, a constrained deterministic request is
//! bitwise identical alone and in a busy batch under forced rollbacks (with a negative control
//! with determinism off), and bad schemas, regexes, grammars and biases are refused with the
//! field named.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use detspec::config::{DeterminismMode, VerifyStrategy};
use detspec::sampling::{Grammars, StructuredOutputs, TokenConstraint};
use detspec::tokenizer::{eos_token_ids, Tokenizer};
use detspec::{Engine, EngineConfig, Request, RequestOutput, SamplingParams};
use proptest::prelude::*;

const VOCAB: usize = 512;

fn model_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| common::write_test_model("structured", 5, 0.02, 512))
}

fn tokenizer() -> Arc<Tokenizer> {
    static TOK: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| Arc::new(Tokenizer::from_model_dir(model_dir()).unwrap()))
        .clone()
}

fn eos() -> Vec<u32> {
    eos_token_ids(model_dir(), Some(&tokenizer())).unwrap()
}

fn grammars() -> &'static Grammars {
    static G: OnceLock<Grammars> = OnceLock::new();
    G.get_or_init(|| Grammars::new(Some(tokenizer()), VOCAB, eos()))
}

const SCHEMA: &str = r#"{"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 200},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": false}"#;

fn json_schema() -> StructuredOutputs {
    StructuredOutputs {
        json: Some(SCHEMA.into()),
        ..Default::default()
    }
}

/// The mask of a constraint that has started.
fn mask(c: &mut TokenConstraint, prefix: &[u32]) -> detspec::sampling::TokenMask {
    c.mask_after(prefix)
        .unwrap()
        .expect("the constraint has started")
}

fn allowed(mask: &[u32]) -> Vec<u32> {
    (0..VOCAB as u32)
        .filter(|&t| mask[t as usize / 32] >> (t % 32) & 1 == 1)
        .collect()
}

/// A random walk under the mask: tokens drawn from the allowed set until only EOS is left
/// (or `max` tokens). Returns the tokens, EOS excluded.
fn walk(c: &mut TokenConstraint, seed: u64, max: usize) -> Vec<u32> {
    let eos = eos();
    let mut out = Vec::new();
    let mut x = seed | 1;
    while out.len() < max {
        let ok = allowed(&mask(c, &out));
        assert!(!ok.is_empty(), "the mask allows nothing after {out:?}");
        let non_eos: Vec<u32> = ok.iter().copied().filter(|t| !eos.contains(t)).collect();
        if non_eos.is_empty() {
            break;
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        // Prefer closing once the grammar allows EOS, so walks finish.
        if non_eos.len() < ok.len() && x.is_multiple_of(3) {
            break;
        }
        out.push(non_eos[(x % non_eos.len() as u64) as usize]);
    }
    out
}

#[test]
fn walks_under_a_json_schema_mask_are_valid_json_of_the_schema() {
    let tok = tokenizer();
    let mut finished = 0;
    for seed in 0..20u64 {
        let mut c = grammars().compile(&json_schema()).unwrap();
        let out = walk(&mut c, seed.wrapping_mul(0x9e37_79b9_7f4a_7c15), 400);
        if !allowed(&mask(&mut c, &out))
            .iter()
            .any(|t| eos().contains(t))
        {
            continue;
        }
        finished += 1;
        let text = tok.decode(&out, false).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
        let o = v.as_object().unwrap();
        assert_eq!(o.len(), 3, "{text}");
        assert!(o["name"].as_str().unwrap().chars().count() <= 8, "{text}");
        let age = o["age"].as_i64().unwrap();
        assert!((0..=200).contains(&age), "{text}");
        for t in o["tags"].as_array().unwrap() {
            assert!(["a", "b"].contains(&t.as_str().unwrap()), "{text}");
        }
    }
    assert!(finished >= 10, "only {finished} walks reached the end");
}

#[test]
fn regex_choice_and_grammar_constrain_the_text() {
    let tok = tokenizer();
    type Check = fn(&str) -> bool;
    let cases: Vec<(StructuredOutputs, Check)> = vec![
        (
            StructuredOutputs {
                regex: Some("[0-9]{3}-(yes|no)".into()),
                ..Default::default()
            },
            |s| {
                s.len() >= 6
                    && s[..3].chars().all(|c| c.is_ascii_digit())
                    && (&s[3..] == "-yes" || &s[3..] == "-no")
            },
        ),
        (
            StructuredOutputs {
                choice: Some(vec!["red".into(), "green (light)".into(), "a.b*".into()]),
                ..Default::default()
            },
            |s| ["red", "green (light)", "a.b*"].contains(&s),
        ),
        (
            StructuredOutputs {
                grammar: Some("start: \"say \" WORD \"!\"\nWORD: /[a-z]{1,5}/\n".into()),
                ..Default::default()
            },
            |s| {
                s.starts_with("say ")
                    && s.ends_with('!')
                    && s[4..s.len() - 1].chars().all(|c| c.is_ascii_lowercase())
            },
        ),
        (
            StructuredOutputs {
                json_object: true,
                ..Default::default()
            },
            // Valid JSON may hold a number past f64 (`9e021814`), which serde_json refuses.
            |s| match serde_json::from_str::<serde_json::Value>(s) {
                Ok(v) => v.is_object(),
                Err(e) => e.to_string().contains("number out of range") && s.starts_with('{'),
            },
        ),
    ];
    for (so, check) in cases {
        let mut done = 0;
        for seed in 1..17u64 {
            let mut c = grammars().compile(&so).unwrap();
            let out = walk(&mut c, seed * 7919, 400);
            let ends = allowed(&mask(&mut c, &out))
                .iter()
                .any(|t| eos().contains(t));
            if !ends {
                continue;
            }
            done += 1;
            let text = tok.decode(&out, false).unwrap();
            assert!(check(&text), "{so:?} produced {text:?}");
        }
        // Random walks through an open-ended grammar (json_object nests) end less often.
        assert!(done >= 2, "{so:?}: only {done} walks ended");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// The DVR property: after any history of questions (earlier positions, abandoned
    /// branches, a rolled-back tail), the mask after a prefix is the one a fresh parser gives.
    #[test]
    fn the_mask_after_a_prefix_does_not_depend_on_what_was_asked_before(
        seed in 1u64..u64::MAX,
        queries in proptest::collection::vec((0usize..1000, 0usize..1000), 1..24),
    ) {
        let mut c = grammars().compile(&json_schema()).unwrap();
        let path = walk(&mut c, seed, 60);
        // A second path that shares a random prefix with the first (a rollback's new branch).
        let mut branch_c = grammars().compile(&json_schema()).unwrap();
        let branch = walk(&mut branch_c, seed.rotate_left(17) | 1, 60);
        for (q, which) in queries {
            let p = if which % 2 == 0 { &path } else { &branch };
            let len = q % (p.len() + 1);
            let got = mask(&mut c, &p[..len]);
            let mut fresh = grammars().compile(&json_schema()).unwrap();
            let want = mask(&mut fresh, &p[..len]);
            prop_assert_eq!(&got[..], &want[..], "prefix of {} tokens", len);
        }
    }

    /// `starts_after`: no mask until the gate's run of tokens is in the prefix; after its
    /// first occurrence, the mask of the ungated constraint over what follows it, whatever
    /// was asked before (free tokens, which may hold the gate's first tokens without the
    /// rest; the gate rolled back and reached again elsewhere).
    #[test]
    fn a_gated_constraint_is_free_before_its_tokens_and_the_constraint_after_them(
        seed in 1u64..u64::MAX,
        gate_len in 1usize..4,
        free in proptest::collection::vec(0u32..VOCAB as u32, 0..12),
        queries in proptest::collection::vec((0usize..1000, 0usize..1000), 1..24),
    ) {
        let gate: Vec<u32> = (300..300 + gate_len as u32).collect();
        // The free part never holds the whole gate (it never holds the gate's last token), but
        // may hold its first token.
        let last = 300 + gate_len as u32 - 1;
        let stand_in = if gate_len > 1 { 300 } else { 299 };
        let free: Vec<u32> = free.into_iter().map(|t| if t == last { stand_in } else { t }).collect();
        let gated_so = StructuredOutputs { starts_after: Some(gate.clone()), ..json_schema() };
        let mut gated = grammars().compile(&gated_so).unwrap();
        let mut walker = grammars().compile(&json_schema()).unwrap();
        let answer = walk(&mut walker, seed, 40);
        // Two outputs: the gate after the free tokens, and after only part of them.
        let cut = free.len() / 2;
        let paths = [
            [&free[..], &gate[..], &answer[..]].concat(),
            [&free[..cut], &gate[..], &answer[..]].concat(),
        ];
        for (q, which) in queries {
            let p = &paths[which % 2];
            let len = q % (p.len() + 1);
            let got = gated.mask_after(&p[..len]).unwrap();
            match p[..len].windows(gate.len()).position(|w| w == &gate[..]) {
                None => prop_assert!(got.is_none(), "a mask before the gate ({} tokens)", len),
                Some(at) => {
                    let mut fresh = grammars().compile(&json_schema()).unwrap();
                    let want = mask(&mut fresh, &p[at + gate.len()..len]);
                    prop_assert_eq!(&got.unwrap()[..], &want[..], "prefix of {} tokens", len);
                }
            }
        }
    }
}

#[test]
fn bad_constraints_are_refused_with_the_field_named() {
    let compile = |so: StructuredOutputs| grammars().compile(&so).unwrap_err();
    let e = compile(StructuredOutputs {
        json: Some("{\"type\": \"object\",".into()),
        ..Default::default()
    });
    assert_eq!(e.param_name(), Some("structured_outputs.json"));
    assert!(e.to_string().contains("line 1"), "{e}");
    let e = compile(StructuredOutputs {
        json: Some(
            r#"{"type": "object", "properties": {"a": {"type": "string"},
                "b": {"type": "array", "items": {"type": "frobnicate"}}}}"#
                .into(),
        ),
        ..Default::default()
    });
    assert_eq!(e.param_name(), Some("structured_outputs.json"));
    assert!(
        e.to_string()
            .contains("frobnicate (at /properties/b/items/type)"),
        "{e}"
    );
    let e = compile(StructuredOutputs {
        json: Some(
            r#"{"type": "object", "properties": {"n": {"type": "integer", "minimum": "x"}}}"#
                .into(),
        ),
        ..Default::default()
    });
    assert!(e.to_string().contains("/properties/n/minimum"), "{e}");
    let e = compile(StructuredOutputs {
        regex: Some("ab(c".into()),
        ..Default::default()
    });
    assert_eq!(e.param_name(), Some("structured_outputs.regex"));
    assert!(e.to_string().contains("ab(c"), "{e}");
    let e = compile(StructuredOutputs {
        grammar: Some("start: foo\nfoo: \"x\" | \n bar\n".into()),
        ..Default::default()
    });
    assert_eq!(e.param_name(), Some("structured_outputs.grammar"));
    assert!(e.to_string().contains("bar"), "{e}");
    let e = compile(StructuredOutputs {
        regex: Some("a".into()),
        choice: Some(vec!["b".into()]),
        ..Default::default()
    });
    assert_eq!(e.param_name(), Some("structured_outputs"));
    let e = compile(StructuredOutputs {
        choice: Some(vec![]),
        ..Default::default()
    });
    assert_eq!(e.param_name(), Some("structured_outputs.choice"));
    let e = compile(StructuredOutputs::default());
    assert_eq!(e.param_name(), Some("structured_outputs"));
    let e = compile(StructuredOutputs {
        starts_after: Some(vec![VOCAB as u32]),
        ..json_schema()
    });
    assert_eq!(e.param_name(), Some("structured_outputs.starts_after"));
    assert!(e.to_string().contains("512"), "{e}");
    let e = compile(StructuredOutputs {
        starts_after: Some(vec![]),
        ..json_schema()
    });
    assert_eq!(e.param_name(), Some("structured_outputs.starts_after"));
    // A gate alone is no constraint.
    let e = compile(StructuredOutputs {
        starts_after: Some(vec![3]),
        ..Default::default()
    });
    assert_eq!(e.param_name(), Some("structured_outputs"));
}

fn cfg(mode: DeterminismMode) -> EngineConfig {
    EngineConfig {
        verify_strategy: VerifyStrategy::Replay,
        num_kv_pages: Some(1024),
        determinism: mode,
        verify_window: 8,
        verify_group: 4,
        num_threads: Some(2),
        max_num_batched_tokens: 256,
        fault_injection: if mode == DeterminismMode::Dvr {
            0.3
        } else {
            0.0
        },
        ..Default::default()
    }
}

#[test]
fn bad_biases_are_refused_and_the_engine_keeps_serving() {
    let e = Engine::from_model_dir(model_dir(), cfg(DeterminismMode::Dvr)).unwrap();
    let bias = |t: u32, b: f32| SamplingParams {
        logit_bias: BTreeMap::from([(t, b)]),
        ..Default::default()
    };
    let err = e.check_params(&bias(3, 101.0)).unwrap_err();
    assert_eq!(err.param_name(), Some("logit_bias"));
    let err = e.check_params(&bias(3, f32::NAN)).unwrap_err();
    assert_eq!(err.param_name(), Some("logit_bias"));
    let err = e.check_params(&bias(VOCAB as u32, 1.0)).unwrap_err();
    assert_eq!(err.param_name(), Some("logit_bias"));
    let bad_regex = SamplingParams {
        structured_outputs: Some(StructuredOutputs {
            regex: Some("(".into()),
            ..Default::default()
        }),
        ..Default::default()
    };
    assert_eq!(
        e.check_params(&bad_regex).unwrap_err().param_name(),
        Some("structured_outputs.regex")
    );
    // The same requests through intake fail alone; a good one after them is served.
    assert!(e
        .generate(vec![Request::new("bad", vec![1, 2, 3], bad_regex)])
        .is_err());
    let out = e
        .generate(vec![Request::new("ok", vec![1, 2, 3], bias(7, 100.0))])
        .unwrap();
    // A +100 bias makes token 7 the greedy choice at every step.
    let greedy = SamplingParams {
        temperature: 0.0,
        max_tokens: 5,
        ignore_eos: true,
        ..bias(7, 100.0)
    };
    let biased = e
        .generate(vec![Request::new("b", vec![1, 2, 3], greedy)])
        .unwrap();
    assert_eq!(biased[0].outputs[0].token_ids, vec![7; 5]);
    assert_eq!(out.len(), 1);
}

type Bits = (Vec<u32>, Vec<u32>);

fn bits(o: &RequestOutput) -> Bits {
    let c = &o.outputs[0];
    (
        c.token_ids.clone(),
        c.logprobs.iter().map(|l| l.logprob.to_bits()).collect(),
    )
}

fn constrained(deterministic: bool) -> Request {
    let params = SamplingParams {
        temperature: 0.9,
        seed: Some(11),
        max_tokens: 60,
        deterministic,
        structured_outputs: Some(json_schema()),
        logit_bias: BTreeMap::from([(5, 2.5), (9, -3.0)]),
        ..Default::default()
    };
    Request::new("target", vec![3, 1, 4, 1, 5, 9, 2, 6], params)
}

/// The end-of-thinking token of [`gated`] (a reasoning model's `</think>`).
const THINK_END: u32 = 300;

/// Free tokens until [`THINK_END`] (made likely by a bias), then the JSON schema.
fn gated(deterministic: bool) -> Request {
    let mut r = constrained(deterministic);
    r.params.max_tokens = 90;
    r.params.structured_outputs = Some(StructuredOutputs {
        starts_after: Some(vec![THINK_END]),
        ..json_schema()
    });
    r.params.logit_bias.insert(THINK_END, 3.0);
    r
}

/// `target` among `others` unconstrained and constrained neighbours; returns its bits.
fn in_batch(e: &Engine, target: &Request, others: usize, salt: u64) -> Bits {
    let mut streams = Vec::new();
    let mut target_stream = None;
    for i in 0..=others {
        if i == others / 2 {
            target_stream = Some(e.add_request(target.clone()).unwrap());
        }
        let mut params = SamplingParams {
            temperature: 1.0,
            seed: Some(salt * 100 + i as u64),
            max_tokens: 10 + (i * 7 + salt as usize) % 50,
            ignore_eos: true,
            ..Default::default()
        };
        if i % 3 == 0 {
            params.structured_outputs = Some(StructuredOutputs {
                json_object: true,
                ..Default::default()
            });
            params.ignore_eos = false;
        }
        let prompt: Vec<u32> = (0..1 + (i * 13 + salt as usize) % 90)
            .map(|k| ((k * 31 + i) % 400) as u32)
            .collect();
        streams.push(
            e.add_request(Request::new(format!("o{salt}-{i}"), prompt, params))
                .unwrap(),
        );
    }
    let out = target_stream.unwrap().wait().unwrap();
    for s in streams {
        s.wait().unwrap();
    }
    bits(&out)
}

#[test]
fn a_constrained_deterministic_request_is_bitwise_identical_alone_and_in_a_batch() {
    let t = constrained(true);
    let alone = Engine::from_model_dir(model_dir(), cfg(DeterminismMode::Dvr)).unwrap();
    let want = bits(&alone.generate(vec![t.clone()]).unwrap()[0]);
    // The output satisfies the schema when it ended by EOS.
    let text = tokenizer().decode(&want.0, true).unwrap();
    if want.0.len() < 60 {
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert!(v["tags"].is_array(), "{text}");
    }
    let e = Engine::from_model_dir(model_dir(), cfg(DeterminismMode::Dvr)).unwrap();
    for salt in 0..6 {
        let got = in_batch(&e, &t, 4 + salt as usize * 5, salt);
        assert_eq!(got, want, "salt {salt}");
    }
    let stats = e.stats().unwrap();
    assert!(stats.rollbacks > 0, "no rollback was exercised");
}

#[test]
fn a_gated_deterministic_request_thinks_freely_then_follows_the_schema_in_any_batch() {
    let t = gated(true);
    let alone = Engine::from_model_dir(model_dir(), cfg(DeterminismMode::Dvr)).unwrap();
    let want = bits(&alone.generate(vec![t.clone()]).unwrap()[0]);
    let at = want
        .0
        .iter()
        .position(|&x| x == THINK_END)
        .expect("the biased end-of-thinking token was sampled");
    assert!(at >= 2, "free tokens before the gate: {:?}", want.0);
    let answer = &want.0[at + 1..];
    if want.0.len() < 90 {
        let text = tokenizer().decode(answer, true).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert!(v["tags"].is_array(), "{text}");
    }
    // The free part is not JSON of the schema: no '{' opens it.
    let thinking = tokenizer().decode(&want.0[..at], true).unwrap();
    assert!(!thinking.starts_with('{'), "{thinking:?}");
    let e = Engine::from_model_dir(model_dir(), cfg(DeterminismMode::Dvr)).unwrap();
    for salt in 0..4 {
        let got = in_batch(&e, &t, 4 + salt as usize * 5, salt);
        assert_eq!(got, want, "salt {salt}");
    }
    assert!(
        e.stats().unwrap().rollbacks > 0,
        "no rollback was exercised"
    );
}

#[test]
fn negative_control_constrained_fast_path_alone_is_batch_variant() {
    let t = constrained(false);
    let alone = Engine::from_model_dir(model_dir(), cfg(DeterminismMode::Off)).unwrap();
    let want = bits(&alone.generate(vec![t.clone()]).unwrap()[0]);
    let e = Engine::from_model_dir(model_dir(), cfg(DeterminismMode::Off)).unwrap();
    let differing = (0..6)
        .filter(|&salt| in_batch(&e, &t, 4 + salt as usize * 5, salt) != want)
        .count();
    assert!(
        differing > 0,
        "the fast path looked batch-invariant: the test above would be blind"
    );
}
