//! Engine control between steps (what the server's RL routes drive): pause modes and resume,
//! KV memory release and re-allocation, prefix-cache reset, checkpoint completeness and
//! weight updates from a serialized safetensors buffer.

mod common;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crossbeam::channel::{unbounded, Receiver, TryRecvError};
use detspec::engine::{InFlight, PauseMode, StreamEvent};
use detspec::{DetspecError, Engine, EngineConfig, FinishReason, Request, SamplingParams};

fn model_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| common::write_test_model("control", 9, 0.1, 512))
}

fn engine() -> Engine {
    Engine::from_model_dir(
        model_dir(),
        EngineConfig {
            num_kv_pages: Some(128),
            ..Default::default()
        },
    )
    .unwrap()
}

fn det(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        seed: Some(5),
        deterministic: true,
        ignore_eos: true,
        max_tokens,
        ..Default::default()
    }
}

/// Long enough that a request is still running after its first tokens, when the keep-mode
/// test pauses it (a 24-token one could finish before the pause: that race failed it once).
const IN_FLIGHT_TOKENS: usize = 400;

fn bits(e: &Engine, id: &str, max_tokens: usize) -> (Vec<u32>, Vec<u32>) {
    let out = e
        .add_request(Request::new(
            id,
            (3..40).collect::<Vec<u32>>(),
            det(max_tokens),
        ))
        .unwrap()
        .wait()
        .unwrap();
    let c = &out.outputs[0];
    (
        c.token_ids.clone(),
        c.logprobs.iter().map(|l| l.logprob.to_bits()).collect(),
    )
}

#[test]
fn pause_holds_new_requests_and_abort_mode_aborts_in_flight() {
    let e = engine();
    let solo = bits(&e, "solo", 24);
    let running = e
        .add_request(Request::new("long", vec![5, 6, 7], det(500)))
        .unwrap();
    e.pause(PauseMode::Abort).unwrap();
    assert!(e.is_paused());
    let out = running.wait().unwrap();
    assert_eq!(out.outputs[0].finish_reason, Some(FinishReason::Abort));
    // A request submitted while paused is held: a control call behind it returns first and
    // the request has sent nothing (commands run in order on the engine thread).
    let (tx, rx) = unbounded();
    e.add_request_with_sender(
        Request::new("held", (3..40).collect::<Vec<u32>>(), det(24)),
        tx,
    )
    .unwrap();
    e.reset_prefix_cache().unwrap();
    assert!(matches!(rx.try_recv(), Err(TryRecvError::Empty)));
    e.resume().unwrap();
    assert!(!e.is_paused());
    assert_eq!(tokens_until(&rx, usize::MAX), solo);
}

/// Token ids and logprob bits from a request's events, until it finishes or at least `n`
/// tokens came.
fn tokens_until(rx: &Receiver<StreamEvent>, n: usize) -> (Vec<u32>, Vec<u32>) {
    let mut ids = Vec::new();
    let mut lps = Vec::new();
    while ids.len() < n {
        match rx.recv().unwrap() {
            StreamEvent::Tokens {
                token_ids,
                logprobs,
                finish_reason,
                ..
            } => {
                ids.extend(token_ids);
                lps.extend(logprobs.iter().map(|l| l.logprob.to_bits()));
                if finish_reason.is_some() {
                    break;
                }
            }
            StreamEvent::Accepted { .. } => {}
            StreamEvent::Failed { error, .. } => panic!("{error}"),
        }
    }
    (ids, lps)
}

#[test]
fn keep_mode_freezes_in_flight_requests_with_the_same_bits() {
    let e = engine();
    let solo = bits(&e, "solo", IN_FLIGHT_TOKENS);
    let (tx, rx) = unbounded();
    e.add_request_with_sender(
        Request::new("r", (3..40).collect::<Vec<u32>>(), det(IN_FLIGHT_TOKENS)),
        tx,
    )
    .unwrap();
    // Paused once it is running (its first tokens came) and before it can finish.
    let (mut ids, mut lps) = tokens_until(&rx, 1);
    assert!(ids.len() < IN_FLIGHT_TOKENS, "it finished before the pause");
    e.pause(PauseMode::Keep).unwrap();
    // It could not finish on the old weights while frozen: refused, nothing changes.
    let fp = e.fingerprint();
    let err = e
        .update_weights_from_disk(model_dir(), InFlight::Finish)
        .unwrap_err();
    assert!(err.to_string().contains("in_flight"), "{err}");
    assert_eq!(e.fingerprint(), fp);
    e.resume().unwrap();
    let (rest_ids, rest_lps) = tokens_until(&rx, usize::MAX);
    ids.extend(rest_ids);
    lps.extend(rest_lps);
    assert_eq!((ids, lps), solo);
    // Wait mode returns once the request in flight is done.
    let stream = e
        .add_request(Request::new("w", (3..40).collect::<Vec<u32>>(), det(24)))
        .unwrap();
    e.pause(PauseMode::Wait).unwrap();
    let out = stream.wait().unwrap();
    assert_eq!(out.outputs[0].finish_reason, Some(FinishReason::Length));
    e.resume().unwrap();
}

#[test]
fn kv_memory_is_released_and_restored() {
    let e = engine();
    let before = bits(&e, "a", 24);
    let (bytes, released) = e.kv_memory().unwrap();
    assert!(bytes > 0 && !released);
    let err = e.release_kv_memory().unwrap_err();
    assert!(
        matches!(err, DetspecError::InvalidParameter { .. }),
        "{err}"
    );
    e.pause(PauseMode::Abort).unwrap();
    e.release_kv_memory().unwrap();
    assert_eq!(e.kv_memory().unwrap(), (0, true));
    assert!(e.resume().unwrap_err().to_string().contains("released"));
    e.resume_kv_memory().unwrap();
    assert_eq!(e.kv_memory().unwrap(), (bytes, false));
    e.resume().unwrap();
    assert_eq!(bits(&e, "b", 24), before);
}

#[test]
fn complete_checkpoints_and_safetensors_buffers() {
    let e = engine();
    let fp = e.fingerprint();
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path();
    let t =
        candle_core::Tensor::ones(64, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    let path = dir.join("model.safetensors");
    candle_core::safetensors::save(
        &std::collections::HashMap::from([("model.norm.weight".to_string(), t)]),
        &path,
    )
    .unwrap();
    let err = e
        .update_weights_from_checkpoint(dir, InFlight::Finish, true)
        .unwrap_err();
    assert!(matches!(err, DetspecError::MissingTensor { .. }), "{err}");
    assert_eq!(e.fingerprint(), fp);
    let bytes = std::fs::read(&path).unwrap();
    let info = e
        .update_weights_from_safetensors(&bytes, InFlight::Finish)
        .unwrap();
    assert_ne!(info.fingerprint, fp);
    let err = e
        .update_weights_from_safetensors(b"nonsense", InFlight::Finish)
        .unwrap_err();
    assert!(err.to_string().contains("body"), "{err}");
    e.update_weights_from_checkpoint(model_dir(), InFlight::Finish, true)
        .unwrap();
    assert_eq!(e.fingerprint(), fp);
    let _ = std::fs::remove_dir_all(dir);
}

/// A request aborted while the engine holds it back (paused) ends as any request aborted
/// before its first step: finish reason `abort`, no tokens, not an error; the request held
/// beside it runs on at resume with its own bits.
#[test]
fn aborting_a_held_request_ends_it_with_abort_not_an_error() {
    let e = engine();
    let solo = bits(&e, "solo", 24);
    e.pause(PauseMode::Keep).unwrap();
    let doomed = e
        .add_request(Request::new("doomed", vec![5, 6, 7], det(24)))
        .unwrap();
    let (tx, rx) = unbounded();
    e.add_request_with_sender(
        Request::new("kept", (3..40).collect::<Vec<u32>>(), det(24)),
        tx,
    )
    .unwrap();
    e.abort("doomed").unwrap();
    let out = doomed.wait().unwrap();
    assert_eq!(out.outputs[0].finish_reason, Some(FinishReason::Abort));
    assert!(out.outputs[0].token_ids.is_empty());
    assert_eq!(out.prompt_token_ids, vec![5, 6, 7]);
    assert!(matches!(rx.try_recv(), Err(TryRecvError::Empty)));
    e.resume().unwrap();
    assert_eq!(tokens_until(&rx, usize::MAX), solo);
    // A request its caller aborted before submitting it: accepted and aborted in one command
    // (an abort sent after it could arrive after a short request had finished).
    let (tx, rx) = unbounded();
    e.add_aborted_request_with_sender(Request::new("late", vec![5, 6, 7], det(1)), tx)
        .unwrap();
    assert_eq!(tokens_until(&rx, usize::MAX), (vec![], vec![]));
}

/// At shutdown a request the paused engine held back ends as the running ones do: finish
/// reason `abort`, no tokens (not an error).
#[test]
fn shutdown_aborts_held_requests_like_running_ones() {
    let e = engine();
    let running = e
        .add_request(Request::new(
            "running",
            vec![5, 6, 7],
            det(IN_FLIGHT_TOKENS),
        ))
        .unwrap();
    e.pause(PauseMode::Keep).unwrap();
    let held = e
        .add_request(Request::new("held", vec![5, 6, 7], det(4)))
        .unwrap();
    e.shutdown();
    for (stream, tokens) in [(running, None), (held, Some(0))] {
        let out = stream.wait().unwrap();
        assert_eq!(out.outputs[0].finish_reason, Some(FinishReason::Abort));
        if let Some(n) = tokens {
            assert_eq!(out.outputs[0].token_ids.len(), n);
        }
    }
}

/// A request submitted as aborted under the id of a running one is refused as a duplicate
/// and aborts nothing: the running request finishes as it would have.
#[test]
fn an_aborted_submission_with_a_running_id_aborts_nothing() {
    let e = engine();
    let solo = bits(&e, "solo", IN_FLIGHT_TOKENS);
    let (tx, rx) = unbounded();
    e.add_request_with_sender(
        Request::new("dup", (3..40).collect::<Vec<u32>>(), det(IN_FLIGHT_TOKENS)),
        tx,
    )
    .unwrap();
    let (tx2, rx2) = unbounded();
    e.add_aborted_request_with_sender(Request::new("dup", vec![5, 6, 7], det(4)), tx2)
        .unwrap();
    let refused = rx2.recv().unwrap();
    assert!(matches!(refused, StreamEvent::Failed { .. }), "{refused:?}");
    assert_eq!(tokens_until(&rx, usize::MAX), solo);
}
