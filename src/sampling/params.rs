//! Per-request sampling parameters, named and defaulted like vLLM's `SamplingParams` so that
//! users (and the Python bindings) can carry their existing settings over unchanged.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::structured::StructuredOutputs;
use crate::{DetspecError, Result};

/// Temperatures below this are treated as greedy decoding (vLLM uses the same threshold), because
/// dividing logits by a near-zero temperature only overflows while selecting the same argmax.
pub const GREEDY_TEMPERATURE_EPS: f32 = 1e-5;

/// Largest magnitude of a `logit_bias` entry (OpenAI's range).
pub const MAX_LOGIT_BIAS: f32 = 100.0;

/// The default of [`crate::EngineConfig::max_logprobs`], the most top logprobs a request may
/// ask for (vLLM's default `max_logprobs`).
pub const DEFAULT_MAX_LOGPROBS: usize = 20;

/// How to turn one row of logits into a token, and when to stop.
///
/// Field names, meanings and defaults follow vLLM. `#[serde(default)]` lets JSON configs and
/// Python dicts name only the fields they change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Number of completions of the prompt (1..=256): each is its own sequence, sampled with
    /// its own seed ([`super::completion_seed`]), so the `n` differ and each is reproducible.
    pub n: usize,
    /// Softmax temperature; `< 1e-5` means greedy.
    pub temperature: f32,
    /// Nucleus sampling mass in (0, 1]; 1 disables it.
    pub top_p: f32,
    /// Keep only the k most likely tokens; 0 or -1 disables it.
    pub top_k: i32,
    /// Drop tokens whose probability is below `min_p * max_prob`; 0 disables it.
    pub min_p: f32,
    /// Seed of the counter-based RNG. `None` means the engine picks one from entropy.
    pub seed: Option<u64>,
    /// Maximum number of generated tokens.
    pub max_tokens: usize,
    /// EOS (and stop token ids) are banned until this many tokens have been generated.
    pub min_tokens: usize,
    /// Stop strings; generation ends when the detokenised output contains one.
    pub stop: Vec<String>,
    /// Keep the stop string that ended the output at the end of its text (vLLM's; the text
    /// only: the token ids are the same either way).
    pub include_stop_str_in_output: bool,
    /// Extra token ids that end generation.
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past EOS.
    pub ignore_eos: bool,
    /// Number of top logprobs to return besides the chosen token's; `None` returns none.
    pub logprobs: Option<usize>,
    /// OpenAI presence penalty in [-2, 2], over generated tokens.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty in [-2, 2], over generated tokens.
    pub frequency_penalty: f32,
    /// HF/CTRL repetition penalty (> 0; 1 disables it), over prompt and generated tokens.
    pub repetition_penalty: f32,
    /// Ask for bitwise-reproducible output (see docs/determinism.md).
    pub deterministic: bool,
    /// Leave special tokens (`</s>`, `<|im_end|>`...) out of the output text (vLLM's
    /// default); the token ids always have them. Stop strings match the text as written.
    pub skip_special_tokens: bool,
    /// Added to the logit of each listed token id before sampling (OpenAI's `logit_bias`,
    /// values in [-100, 100]); like the penalties it shapes the choice, not the reported
    /// logprobs.
    pub logit_bias: BTreeMap<u32, f32>,
    /// Constrain the output to a JSON schema, a regex, a choice or a grammar
    /// ([`super::structured`]).
    pub structured_outputs: Option<StructuredOutputs>,
    /// Only these token ids may be sampled (vLLM's); like the penalties it shapes the choice,
    /// not the reported logprobs.
    pub allowed_token_ids: Option<Vec<u32>>,
    /// Words the output never contains (vLLM's `bad_words`): tokenized at intake
    /// ([`Self::bad_words_token_ids`]), and the last token of one is banned wherever the output
    /// ends with the rest of it.
    pub bad_words: Vec<String>,
    /// `bad_words` as token ids, each word with and without a leading space, as vLLM
    /// tokenizes them; filled by the engine at intake ([`super::bad_words::tokenize`]).
    #[serde(skip)]
    pub bad_words_token_ids: Vec<Vec<u32>>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            n: 1,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            max_tokens: 16,
            min_tokens: 0,
            stop: Vec::new(),
            include_stop_str_in_output: false,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            deterministic: false,
            skip_special_tokens: true,
            logit_bias: BTreeMap::new(),
            structured_outputs: None,
            allowed_token_ids: None,
            bad_words: Vec::new(),
            bad_words_token_ids: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Checks every field's range, returning an error that names the first offending field.
    ///
    /// Called at request intake so that bad values fail loudly instead of producing NaN logits
    /// (or silently different semantics) deep inside an engine step.
    pub fn validate(&self) -> Result<()> {
        if self.n == 0 || self.n > 256 {
            return Err(DetspecError::param(
                "n",
                format!("must be in 1..=256, got {}", self.n),
            ));
        }
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(DetspecError::param(
                "temperature",
                format!("must be >= 0 and finite, got {}", self.temperature),
            ));
        }
        // Written as a negated range test so that NaN is rejected too.
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(DetspecError::param(
                "top_p",
                format!("must be in (0, 1], got {}", self.top_p),
            ));
        }
        if self.top_k < -1 {
            return Err(DetspecError::param(
                "top_k",
                format!(
                    "must be -1 or 0 (disabled) or a positive count, got {}",
                    self.top_k
                ),
            ));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return Err(DetspecError::param(
                "min_p",
                format!("must be in [0, 1], got {}", self.min_p),
            ));
        }
        if self.max_tokens < 1 {
            return Err(DetspecError::param(
                "max_tokens",
                format!("must be >= 1, got {}", self.max_tokens),
            ));
        }
        if self.min_tokens > self.max_tokens {
            return Err(DetspecError::param(
                "min_tokens",
                format!(
                    "must be <= max_tokens ({}), got {}",
                    self.max_tokens, self.min_tokens
                ),
            ));
        }
        if !(self.presence_penalty >= -2.0 && self.presence_penalty <= 2.0) {
            return Err(DetspecError::param(
                "presence_penalty",
                format!("must be in [-2, 2], got {}", self.presence_penalty),
            ));
        }
        if !(self.frequency_penalty >= -2.0 && self.frequency_penalty <= 2.0) {
            return Err(DetspecError::param(
                "frequency_penalty",
                format!("must be in [-2, 2], got {}", self.frequency_penalty),
            ));
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return Err(DetspecError::param(
                "repetition_penalty",
                format!("must be > 0 and finite, got {}", self.repetition_penalty),
            ));
        }
        if let Some(i) = self.stop.iter().position(String::is_empty) {
            return Err(DetspecError::param(
                "stop",
                format!("stop strings must be non-empty, entry {i} is empty"),
            ));
        }
        if let Some((id, bias)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| b.is_nan() || b.abs() > MAX_LOGIT_BIAS)
        {
            return Err(DetspecError::param(
                "logit_bias",
                format!("bias of token {id} must be in [-100, 100], got {bias}"),
            ));
        }
        if let Some(so) = &self.structured_outputs {
            so.validate()?;
        }
        if self.allowed_token_ids.as_ref().is_some_and(Vec::is_empty) {
            return Err(DetspecError::param(
                "allowed_token_ids",
                "is empty: nothing could be sampled (leave it unset to allow every token)",
            ));
        }
        if let Some(i) = self.bad_words.iter().position(|w| w.trim().is_empty()) {
            return Err(DetspecError::param(
                "bad_words",
                format!("bad words must hold a word, entry {i} is blank"),
            ));
        }
        Ok(())
    }

    /// Whether this request decodes greedily (argmax), as vLLM decides it.
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_TEMPERATURE_EPS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err_name(p: &SamplingParams) -> String {
        match p.validate() {
            Err(DetspecError::InvalidParameter { name, .. }) => name,
            other => panic!("expected InvalidParameter, got {other:?}"),
        }
    }

    #[test]
    fn defaults_match_vllm_and_validate() {
        let p = SamplingParams::default();
        assert_eq!(p.n, 1);
        assert_eq!(p.temperature, 1.0);
        assert_eq!(p.top_p, 1.0);
        assert_eq!(p.top_k, 0);
        assert_eq!(p.min_p, 0.0);
        assert_eq!(p.seed, None);
        assert_eq!(p.max_tokens, 16);
        assert_eq!(p.min_tokens, 0);
        assert!(p.stop.is_empty() && p.stop_token_ids.is_empty());
        assert!(!p.ignore_eos && !p.deterministic);
        assert_eq!(p.logprobs, None);
        assert_eq!(p.repetition_penalty, 1.0);
        p.validate().unwrap();
        assert!(!p.is_greedy());
    }

    #[test]
    fn validation_errors_name_the_parameter() {
        let base = SamplingParams::default();
        let cases: Vec<(SamplingParams, &str)> = vec![
            (
                SamplingParams {
                    n: 0,
                    ..base.clone()
                },
                "n",
            ),
            (
                SamplingParams {
                    temperature: -1.0,
                    ..base.clone()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..base.clone()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::INFINITY,
                    ..base.clone()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..base.clone()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_p: 1.5,
                    ..base.clone()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_p: f32::NAN,
                    ..base.clone()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_k: -2,
                    ..base.clone()
                },
                "top_k",
            ),
            (
                SamplingParams {
                    min_p: -0.1,
                    ..base.clone()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    min_p: 1.1,
                    ..base.clone()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    max_tokens: 0,
                    min_tokens: 0,
                    ..base.clone()
                },
                "max_tokens",
            ),
            (
                SamplingParams {
                    min_tokens: 17,
                    ..base.clone()
                },
                "min_tokens",
            ),
            (
                SamplingParams {
                    presence_penalty: 2.5,
                    ..base.clone()
                },
                "presence_penalty",
            ),
            (
                SamplingParams {
                    frequency_penalty: -2.5,
                    ..base.clone()
                },
                "frequency_penalty",
            ),
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..base.clone()
                },
                "repetition_penalty",
            ),
            (
                SamplingParams {
                    repetition_penalty: f32::NAN,
                    ..base.clone()
                },
                "repetition_penalty",
            ),
            (
                SamplingParams {
                    stop: vec!["a".into(), String::new()],
                    ..base.clone()
                },
                "stop",
            ),
        ];
        for (p, name) in cases {
            assert_eq!(err_name(&p), name, "{p:?}");
        }
    }

    #[test]
    fn error_message_shows_value() {
        let p = SamplingParams {
            temperature: -1.0,
            ..Default::default()
        };
        let msg = p.validate().unwrap_err().to_string();
        assert_eq!(
            msg,
            "invalid parameter `temperature`: must be >= 0 and finite, got -1"
        );
        let p = SamplingParams {
            n: 0,
            ..Default::default()
        };
        assert!(p.validate().unwrap_err().to_string().contains("1..=256"));
    }

    #[test]
    fn boundary_values_are_accepted() {
        let p = SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: -1,
            min_p: 1.0,
            max_tokens: 1,
            min_tokens: 1,
            presence_penalty: -2.0,
            frequency_penalty: 2.0,
            repetition_penalty: 1e-3,
            logprobs: Some(20),
            stop: vec!["\n".into()],
            ..Default::default()
        };
        p.validate().unwrap();
        assert!(p.is_greedy());
    }

    #[test]
    fn serde_round_trip_and_partial_json() {
        let p = SamplingParams {
            seed: Some(7),
            stop: vec!["x".into()],
            ..Default::default()
        };
        let s = serde_json::to_string(&p).unwrap();
        let q: SamplingParams = serde_json::from_str(&s).unwrap();
        assert_eq!(p, q);
        let r: SamplingParams = serde_json::from_str(r#"{"temperature": 0.5}"#).unwrap();
        assert_eq!(r.temperature, 0.5);
        assert_eq!(r.max_tokens, 16);
    }
}
