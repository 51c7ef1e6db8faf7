//! What a client receives; shaped like vLLM's `RequestOutput`/`CompletionOutput`.

use std::fmt;

use serde::ser::{Serialize, Serializer};

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// EOS, a stop token id or a stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
    /// Aborted by the client or by engine shutdown.
    Abort,
}

impl fmt::Display for FinishReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        })
    }
}

/// What caused a `Stop` finish, as vLLM's `stop_reason` (serialized as the token id or the
/// string).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(untagged)]
pub enum StopReason {
    /// EOS or a stop token id.
    Token(u32),
    /// A stop string (not included in the text).
    Text(String),
}

/// Log-probabilities at one generated position.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The chosen token and its log-probability under the model (raw logits).
    pub token: u32,
    pub logprob: f32,
    /// 1-based rank of the chosen token by log-probability.
    pub rank: u32,
    /// The `logprobs` most likely tokens, highest first.
    pub top: Vec<(u32, f32)>,
}

/// Serialized as the tuple `(token, logprob, rank, top)`, the form Python receives.
impl Serialize for TokenLogprobs {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        (self.token, self.logprob, self.rank, &self.top).serialize(s)
    }
}

/// One completion of a request.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CompletionOutput {
    pub index: usize,
    pub token_ids: Vec<u32>,
    pub text: String,
    /// Per generated token; always filled (cheap), exposed to Python only when asked for.
    pub logprobs: Vec<TokenLogprobs>,
    pub cumulative_logprob: f64,
    pub finish_reason: Option<FinishReason>,
    pub stop_reason: Option<StopReason>,
}

/// The state of one request: a snapshot while streaming, the final result once `finished`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RequestOutput {
    pub request_id: String,
    pub prompt: Option<String>,
    pub prompt_token_ids: Vec<u32>,
    pub outputs: Vec<CompletionOutput>,
    pub finished: bool,
    /// Identifies the model, numeric configuration and kernels that produced this output; two
    /// outputs are comparable bit for bit only when their fingerprints are equal.
    pub fingerprint: String,
    pub metrics: RequestMetrics,
}

/// Timing and counts of one request (times in seconds since the Unix epoch, as vLLM).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct RequestMetrics {
    pub arrival_time: f64,
    pub first_scheduled_time: Option<f64>,
    pub first_token_time: Option<f64>,
    pub finished_time: Option<f64>,
    pub num_prompt_tokens: usize,
    pub num_output_tokens: usize,
    /// Times the request was preempted (its KV freed and later recomputed).
    pub num_preemptions: usize,
    /// Prompt tokens read from the prefix cache instead of computed (at first admission; with
    /// `n` > 1, the most any one completion read).
    pub num_cached_tokens: usize,
    /// Decode–verify–rollback: verify passes, rollbacks and tokens discarded by rollbacks.
    pub num_verify_passes: usize,
    pub num_rollbacks: usize,
    pub num_rolled_back_tokens: usize,
    /// Rows of its verify windows that carried no token (W less the window's rows, each pass).
    pub num_padded_rows: usize,
}
