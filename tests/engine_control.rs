//! Engine control between steps (what the server's RL routes drive): pause modes and resume,
//! KV memory release and re-allocation, prefix-cache reset, checkpoint completeness and
//! weight updates from a serialized safetensors buffer.

mod common;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crossbeam::channel::{unbounded, TryRecvError};
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

fn bits(e: &Engine, id: &str) -> (Vec<u32>, Vec<u32>) {
    let out = e
        .add_request(Request::new(id, (3..40).collect::<Vec<u32>>(), det(24)))
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
    let solo = bits(&e, "solo");
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
    let mut ids = Vec::new();
    let mut lps = Vec::new();
    loop {
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
    assert_eq!((ids, lps), solo);
}

#[test]
fn keep_mode_freezes_in_flight_requests_with_the_same_bits() {
    let e = engine();
    let solo = bits(&e, "solo");
    let stream = e
        .add_request(Request::new("r", (3..40).collect::<Vec<u32>>(), det(24)))
        .unwrap();
    e.pause(PauseMode::Keep).unwrap();
    // It could not finish on the old weights while frozen: refused, nothing changes.
    let fp = e.fingerprint();
    let err = e
        .update_weights_from_disk(model_dir(), InFlight::Finish)
        .unwrap_err();
    assert!(err.to_string().contains("in_flight"), "{err}");
    assert_eq!(e.fingerprint(), fp);
    e.resume().unwrap();
    let c = stream.wait().unwrap().outputs[0].clone();
    let got = (
        c.token_ids,
        c.logprobs.iter().map(|l| l.logprob.to_bits()).collect(),
    );
    assert_eq!(got, solo);
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
    let before = bits(&e, "a");
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
    assert_eq!(bits(&e, "b"), before);
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
