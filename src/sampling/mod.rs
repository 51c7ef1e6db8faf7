//! Sampling: per-request parameters, logits processors and a deterministic sampler.
//!
//! Everything here is a pure function of its inputs (logits, parameters, seed, absolute position,
//! token history) with sequential, fixed-order arithmetic, so the fast path and the DVR verifier
//! (docs/architecture.md, "Replay") pick the same token from the same logits regardless of
//! batching or thread count.

pub mod bad_words;
pub mod next_token;
mod nucleus;
pub mod params;
pub mod processors;
mod rank;
pub mod rng;
pub mod sampler;
pub mod structured;
#[cfg(test)]
mod test_rows;

pub use next_token::sample_next;
pub use params::{SamplingParams, DEFAULT_MAX_LOGPROBS, GREEDY_TEMPERATURE_EPS, MAX_LOGIT_BIAS};
pub use rng::{completion_seed, gumbel, request_seed_from_entropy, uniform, GUMBEL_MAX};
pub use sampler::{rank_of, sample, score_token, SampleInput, SampledToken};
pub use structured::{Grammars, StructuredOutputs, TokenConstraint, TokenMask, JSON_OPTIONS};
