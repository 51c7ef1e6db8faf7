//! detspec: an LLM inference engine with per-request bitwise-reproducible output under dynamic
//! batching. See `DESIGN.md` for the architecture and the determinism contract.
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

pub use config::{EngineConfig, ModelConfig};
pub use engine::{Engine, RequestStream};
pub use error::{DetspecError, Result};
pub use output::{
    CompletionOutput, FinishReason, RequestMetrics, RequestOutput, StopReason, TokenLogprobs,
};
pub use request::{Prompt, Request};
pub use sampling::SamplingParams;
