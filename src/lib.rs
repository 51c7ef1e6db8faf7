//! detspec: an LLM inference engine with per-request bitwise-reproducible output under dynamic
//! batching. The architecture: `docs/architecture.md`; the determinism contract:
//! `docs/determinism.md`.
//!
//! ```no_run
//! use detspec::{Engine, EngineConfig, Request, SamplingParams};
//!
//! let engine = Engine::from_model_dir("path/to/hf-model", EngineConfig::default())?;
//! let params = SamplingParams { max_tokens: 32, temperature: 0.0, ..Default::default() };
//! // Blocking, all at once:
//! let outs = engine.generate(vec![Request::new("r1", "Hello", params.clone())])?;
//! println!("{}", outs[0].outputs[0].text);
//! // Streaming: cumulative snapshots as tokens are committed.
//! for snapshot in engine.add_request(Request::new("r2", "Hello", params))? {
//!     println!("{}", snapshot?.outputs[0].text);
//! }
//! # Ok::<(), detspec::DetspecError>(())
//! ```

pub mod config;
pub mod demo;
pub mod dvr;
pub mod engine;
pub mod error;
pub mod kv;
pub mod model;
pub mod ops;
pub mod output;
pub mod request;
pub mod sampling;
pub mod sched;
pub mod tokenizer;

#[cfg(feature = "python")]
mod python;

#[cfg(feature = "python")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Keeps the memory mimalloc frees for reuse instead of handing it back to the OS (mimalloc's
/// `purge_delay` = -1), unless `MIMALLOC_PURGE_DELAY` says otherwise. A step frees and
/// reallocates the same large buffers; once purged, every reuse page-faults and zeroes them
/// again on the engine's critical path (measured: ~5 % of a prefill's samples in
/// `clear_page`, where first-touching memory runs at ~0.4 GB/s on these VMs). The price is
/// that the process keeps its peak heap.
#[cfg(feature = "python")]
pub(crate) fn keep_freed_memory() {
    /// `mi_option_purge_delay` in mimalloc's `mi_option_e` (v2 and v3 alike).
    const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets a process-wide allocator option; mimalloc reads it on every purge.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    }
}

pub use config::{EngineConfig, ModelConfig};
pub use engine::{Engine, RequestStream};
pub use error::{DetspecError, Result};
pub use output::{
    CompletionOutput, FinishReason, RequestMetrics, RequestOutput, StopReason, TokenLogprobs,
};
pub use request::{Prompt, Request};
pub use sampling::SamplingParams;
