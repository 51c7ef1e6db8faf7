//! The continuous-batching engine: many concurrent requests, preemption under a small KV pool,
//! streaming, abort, and shutdown.

mod common;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use detspec::{Engine, EngineConfig, FinishReason, Request, RequestOutput, SamplingParams};

fn model_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| common::write_test_model("streaming", 11, 0.15, 512))
}

fn engine(cfg: EngineConfig) -> Engine {
    Engine::from_model_dir(model_dir(), cfg).unwrap()
}

/// Deterministic pseudo-random prompt of `len` tokens.
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

/// Compares a batched greedy output with the unbatched one. Tokens must agree until the first
/// position where the unbatched run's top-2 margin is a near-tie (which the fast path may
/// legitimately flip); such cases are reported, not hidden.
fn assert_greedy_agrees(batched: &RequestOutput, solo: &RequestOutput) {
    let (b, s) = (&batched.outputs[0], &solo.outputs[0]);
    for (i, (x, y)) in b.token_ids.iter().zip(&s.token_ids).enumerate() {
        if x != y {
            let lp = &s.logprobs[i];
            let margin = lp.top.first().map(|t| t.1).unwrap_or(0.0)
                - lp.top.get(1).map(|t| t.1).unwrap_or(f32::NEG_INFINITY);
            assert!(
                margin < 1e-3,
                "request {}: token {i} differs ({x} vs {y}) with a top-2 margin of {margin}",
                batched.request_id
            );
            eprintln!(
                "note: request {} flipped a near-tie at token {i} (margin {margin:e})",
                batched.request_id
            );
            return;
        }
    }
    assert_eq!(b.token_ids.len(), s.token_ids.len());
}

#[test]
fn sixty_four_concurrent_ragged_requests_complete() {
    let e = engine(EngineConfig {
        num_kv_pages: Some(2048),
        max_num_batched_tokens: 512,
        ..Default::default()
    });
    let solo_engine = engine(EngineConfig {
        num_kv_pages: Some(256),
        max_num_seqs: 1,
        ..Default::default()
    });
    let mut reqs = Vec::new();
    for i in 0..64u64 {
        let len = 1 + (i as usize * 37) % 300;
        let greedy = i % 2 == 0;
        let params = SamplingParams {
            temperature: if greedy { 0.0 } else { 0.9 },
            seed: Some(i),
            max_tokens: 4 + (i as usize * 7) % 24,
            ignore_eos: true,
            logprobs: Some(2),
            ..Default::default()
        };
        reqs.push(Request::new(format!("r{i}"), prompt(i, len), params));
    }
    // Submit from several threads at once.
    let streams: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = reqs
            .chunks(16)
            .map(|chunk| {
                let e = e.clone();
                let chunk = chunk.to_vec();
                s.spawn(move || {
                    chunk
                        .into_iter()
                        .map(|r| e.add_request(r).unwrap())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    let outs: Vec<RequestOutput> = streams.into_iter().map(|s| s.wait().unwrap()).collect();
    for (o, r) in outs.iter().zip(&reqs) {
        assert_eq!(o.outputs[0].token_ids.len(), r.params.max_tokens);
        assert_eq!(o.outputs[0].finish_reason, Some(FinishReason::Length));
        if r.params.temperature == 0.0 && o.request_id.ends_with('0') {
            let solo = solo_engine.generate(vec![r.clone()]).unwrap();
            assert_greedy_agrees(o, &solo[0]);
        }
    }
    let (free, total) = e.kv_pages().unwrap();
    assert_eq!(free, total);
}

#[test]
fn small_pool_preempts_and_recomputes_correctly() {
    let reqs: Vec<Request> = (0..8u64)
        .map(|i| {
            let params = SamplingParams {
                temperature: 0.0,
                max_tokens: 40,
                ignore_eos: true,
                logprobs: Some(2),
                ..Default::default()
            };
            Request::new(format!("p{i}"), prompt(100 + i, 40), params)
        })
        .collect();
    let big = engine(EngineConfig {
        num_kv_pages: Some(512),
        ..Default::default()
    });
    let small = engine(EngineConfig {
        num_kv_pages: Some(12),
        page_size: 16,
        ..Default::default()
    });
    let want = big.generate(reqs.clone()).unwrap();
    let got = small.generate(reqs).unwrap();
    let preemptions: usize = got.iter().map(|o| o.metrics.num_preemptions).sum();
    assert!(
        preemptions > 0,
        "a 12-page pool must preempt 8 × 80-token sequences"
    );
    for (g, w) in got.iter().zip(&want) {
        assert_greedy_agrees(g, w);
    }
    let (free, total) = small.kv_pages().unwrap();
    assert_eq!(free, total);
}

#[test]
fn streaming_delivers_each_token_once_in_order_and_abort_frees_pages() {
    let e = engine(EngineConfig {
        num_kv_pages: Some(256),
        ..Default::default()
    });
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: 30,
        ignore_eos: true,
        ..Default::default()
    };
    let full = e
        .generate(vec![Request::new("full", prompt(1, 10), params.clone())])
        .unwrap();
    let mut seen = Vec::new();
    let mut snapshots = 0;
    for snap in e
        .add_request(Request::new("s", prompt(1, 10), params.clone()))
        .unwrap()
    {
        let snap = snap.unwrap();
        let toks = &snap.outputs[0].token_ids;
        assert!(toks.starts_with(&seen), "snapshots are cumulative");
        assert!(toks.len() > seen.len(), "each snapshot adds tokens");
        seen = toks.clone();
        snapshots += 1;
    }
    assert_eq!(seen, full[0].outputs[0].token_ids);
    assert!(snapshots > 1);

    let long = SamplingParams {
        max_tokens: 400,
        ..params
    };
    let reference = e
        .generate(vec![Request::new("ref", prompt(2, 10), long.clone())])
        .unwrap();
    let mut stream = e
        .add_request(Request::new("a", prompt(2, 10), long))
        .unwrap();
    let first = stream.next().unwrap().unwrap();
    assert!(!first.finished);
    e.abort("a").unwrap();
    let last = stream.wait().unwrap();
    assert_eq!(last.outputs[0].finish_reason, Some(FinishReason::Abort));
    assert!(last.outputs[0].token_ids.len() < 400);
    // The abort adds no tokens: what the stream holds is a prefix of the full generation
    // (an abort that re-sent the tokens already streamed would repeat them).
    assert!(reference[0].outputs[0]
        .token_ids
        .starts_with(&last.outputs[0].token_ids));
    assert_eq!(
        last.outputs[0].logprobs.len(),
        last.outputs[0].token_ids.len()
    );
    let (free, total) = e.kv_pages().unwrap();
    assert_eq!(free, total);
}

#[test]
fn bad_request_fails_alone_and_shutdown_aborts_in_flight() {
    let e = engine(EngineConfig {
        num_kv_pages: Some(256),
        ..Default::default()
    });
    let ok = SamplingParams {
        temperature: 0.0,
        max_tokens: 1000,
        ignore_eos: true,
        ..Default::default()
    };
    let good = e
        .add_request(Request::new("good", prompt(3, 5), ok.clone()))
        .unwrap();
    let bad = e
        .add_request(Request::new("bad", vec![1, 99_999], ok.clone()))
        .unwrap();
    let err = bad.wait().unwrap_err().to_string();
    assert!(err.contains("99999"), "{err}");
    let dup = e
        .add_request(Request::new("good", prompt(3, 5), ok.clone()))
        .unwrap();
    assert!(dup
        .wait()
        .unwrap_err()
        .to_string()
        .contains("already running"));
    // A request in flight at shutdown (it has streamed, far from its end: the tiny model
    // decodes its whole context in tens of milliseconds, so no fixed sleep) ends "abort"; the
    // one that ran beside the bad request either did too or had finished normally.
    let mut late = e
        .add_request(Request::new("in-flight", prompt(4, 5), ok))
        .unwrap();
    assert!(!late.next().unwrap().unwrap().finished);
    e.shutdown();
    let last = late.wait().unwrap();
    assert_eq!(last.outputs[0].finish_reason, Some(FinishReason::Abort));
    let good = good.wait().unwrap();
    assert!(matches!(
        good.outputs[0].finish_reason,
        Some(FinishReason::Abort | FinishReason::Length)
    ));
    assert!(e
        .add_request(Request::new("late", vec![1], SamplingParams::default()))
        .is_err());
}

#[test]
fn prefix_cache_reuses_pages_and_keeps_outputs() {
    let shared = prompt(500, 96);
    let mut long = shared.clone();
    long.extend(prompt(501, 20));
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: 16,
        ignore_eos: true,
        logprobs: Some(2),
        ..Default::default()
    };
    let reqs = |tag: &str| {
        vec![Request::new(
            format!("{tag}-b"),
            long.clone(),
            params.clone(),
        )]
    };
    let cached = engine(EngineConfig {
        num_kv_pages: Some(256),
        ..Default::default()
    });
    let plain = engine(EngineConfig {
        num_kv_pages: Some(256),
        enable_prefix_caching: false,
        ..Default::default()
    });
    cached
        .generate(vec![Request::new("warm", shared.clone(), params.clone())])
        .unwrap();
    let before = cached.kv_stats().unwrap();
    let got = cached.generate(reqs("c")).unwrap();
    let after = cached.kv_stats().unwrap();
    assert!(
        after.prefix_hits > before.prefix_hits,
        "the shared 96-token prefix should hit: {after:?}"
    );
    assert!(after.cached_pages >= 96 / 16);
    let want = plain.generate(reqs("p")).unwrap();
    assert_greedy_agrees(&got[0], &want[0]);
    assert_eq!(plain.kv_stats().unwrap().prefix_hits, 0);
    // Everything not held by a request is free or evictable.
    let s = cached.kv_stats().unwrap();
    assert_eq!(
        s.free_pages + s.evictable_pages + s.pinned_pages,
        s.total_pages,
        "{s:?}"
    );
}
