//! Request validation: the one place the rules a request must satisfy are written.
//!
//! The engine core applies them at intake ([`super::EngineCore::add_request`]); the Python
//! binding exposes them (`PyEngine.validate_request`) so the HTTP server refuses a bad
//! request with the same rule, message and parameter name before submitting anything.
//! Every error names its parameter ([`DetspecError::param_name`]).

use crate::config::DeterminismMode;
use crate::error::{DetspecError, Result};
use crate::sampling::SamplingParams;

/// What a request is checked against: the model's vocabulary and context, the KV pool, the
/// engine's determinism mode. Fixed for the life of an engine (a weight update keeps the
/// shapes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestRules {
    pub vocab_size: usize,
    pub max_model_len: usize,
    /// Pages one sequence may hold (the pool less the reserved pad page).
    pub max_pages: usize,
    pub page_size: usize,
    pub determinism: DeterminismMode,
    /// Most top logprobs a request may ask for (`EngineConfig::max_logprobs`, the vocabulary
    /// where that is unbounded).
    pub max_logprobs: usize,
}

impl RequestRules {
    /// Checks a tokenized prompt; `param` names it in the error (`prompt`, `prompt[2]`,
    /// `messages`).
    pub fn check_prompt(&self, prompt: &[u32], param: &str) -> Result<()> {
        if prompt.is_empty() {
            return Err(DetspecError::param(param, format!("{param} is empty")));
        }
        check_token_ids(prompt, self.vocab_size, param)?;
        let max_model_len = self.max_model_len;
        if prompt.len() >= max_model_len {
            return Err(DetspecError::param(
                param,
                format!(
                    "{param} has {} tokens, which leaves no room to generate within this \
                     model's maximum context length (max_model_len={max_model_len})",
                    prompt.len()
                ),
            ));
        }
        let pages_needed = (prompt.len() + 1).div_ceil(self.page_size.max(1));
        if pages_needed > self.max_pages {
            return Err(DetspecError::param(
                param,
                format!(
                    "{param} needs {pages_needed} KV pages but the pool has only {} \
                     (raise num_kv_pages)",
                    self.max_pages + 1
                ),
            ));
        }
        Ok(())
    }

    /// Checks a number of top logprobs asked for (`param`: the field that asked) against the
    /// engine's `max_logprobs`.
    pub fn check_top_logprobs(&self, n: usize, param: &str) -> Result<()> {
        if n > self.max_logprobs {
            return Err(DetspecError::param(
                param,
                format!(
                    "asks for {n} top logprobs, more than this engine's max_logprobs ({}); \
                     start it with a larger max_logprobs (-1: the vocabulary)",
                    self.max_logprobs
                ),
            ));
        }
        Ok(())
    }

    /// Checks sampling parameters: their ranges ([`SamplingParams::validate`]), then what
    /// depends on this engine (vocabulary, determinism mode) and the determinism contract.
    pub fn check_params(&self, params: &SamplingParams) -> Result<()> {
        params.validate()?;
        if let Some(n) = params.logprobs {
            self.check_top_logprobs(n, "logprobs")?;
        }
        check_token_ids(&params.stop_token_ids, self.vocab_size, "stop_token_ids")?;
        let biased: Vec<u32> = params.logit_bias.keys().copied().collect();
        check_token_ids(&biased, self.vocab_size, "logit_bias")?;
        if let Some(allowed) = &params.allowed_token_ids {
            check_token_ids(allowed, self.vocab_size, "allowed_token_ids")?;
        }
        if params.deterministic {
            if self.determinism == DeterminismMode::Off {
                return Err(DetspecError::param(
                    "deterministic",
                    "this engine runs with determinism=\"off\"; start it with \"dvr\" or \
                     \"batch_invariant\"",
                ));
            }
            // Without a seed a sampled output would draw its seed from entropy: it could not
            // be reproduced, which is what `deterministic` asks for.
            if !params.is_greedy() && params.seed.is_none() {
                return Err(DetspecError::param(
                    "seed",
                    "a deterministic request that samples (temperature > 0) needs a `seed`: \
                     without one its output cannot be reproduced",
                ));
            }
        }
        Ok(())
    }

    /// [`check_params`](Self::check_params), then [`check_prompt`](Self::check_prompt).
    pub fn check(&self, prompt: &[u32], params: &SamplingParams, param: &str) -> Result<()> {
        self.check_params(params)?;
        self.check_prompt(prompt, param)
    }
}

/// Every id is inside the vocabulary.
pub fn check_token_ids(ids: &[u32], vocab_size: usize, param: &str) -> Result<()> {
    match ids.iter().find(|&&t| t as usize >= vocab_size) {
        Some(&bad) => Err(DetspecError::param(
            param,
            format!("{param} contains token id {bad}, outside the vocabulary (size {vocab_size})"),
        )),
        None => Ok(()),
    }
}

/// The error for a request id that is already in flight (the engine's scheduler and the
/// Python output queues both refuse it).
pub fn cache_salt_hash(salt: Option<&str>) -> Result<u64> {
    match salt {
        None => Ok(0),
        Some("") => Err(DetspecError::param(
            "cache_salt",
            "must be a non-empty string (omit it for no salt)",
        )),
        Some(s) => Ok(crate::kv::salt_hash(s)),
    }
}

/// The error for a request id already in flight.
pub fn duplicate_request_id(request_id: &str) -> DetspecError {
    DetspecError::InvalidRequest {
        request_id: Some(request_id.to_string()),
        message: "a request with this id is already running".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> RequestRules {
        RequestRules {
            vocab_size: 100,
            max_model_len: 8,
            max_pages: 4,
            page_size: 16,
            determinism: DeterminismMode::Dvr,
            max_logprobs: 20,
        }
    }

    #[test]
    fn top_logprobs_are_bounded_by_the_engines_max_logprobs() {
        let r = rules();
        let asks = |n| SamplingParams {
            logprobs: Some(n),
            ..Default::default()
        };
        assert!(r.check_params(&asks(20)).is_ok());
        let e = r.check_params(&asks(21)).unwrap_err();
        assert_eq!(e.param_name(), Some("logprobs"));
        assert!(e.to_string().contains("max_logprobs (20)"), "{e}");
        let wide = RequestRules {
            max_logprobs: 100,
            ..r
        };
        assert!(wide.check_params(&asks(100)).is_ok());
        let e = wide.check_top_logprobs(101, "prompt_logprobs").unwrap_err();
        assert_eq!(e.param_name(), Some("prompt_logprobs"));
    }

    #[test]
    fn prompt_errors_name_their_parameter() {
        let r = rules();
        let e = r.check_prompt(&[], "prompt[1]").unwrap_err();
        assert_eq!(e.param_name(), Some("prompt[1]"));
        let e = r.check_prompt(&[1, 100], "messages").unwrap_err();
        assert_eq!(e.param_name(), Some("messages"));
        assert!(e.to_string().contains("100"));
        let e = r.check_prompt(&[1; 8], "prompt").unwrap_err();
        assert!(e.to_string().contains("max_model_len"));
        assert!(r.check_prompt(&[1; 7], "prompt").is_ok());
    }

    #[test]
    fn deterministic_sampling_needs_a_seed() {
        let r = rules();
        let p = SamplingParams {
            temperature: 0.7,
            deterministic: true,
            ..Default::default()
        };
        assert_eq!(r.check_params(&p).unwrap_err().param_name(), Some("seed"));
        assert!(r
            .check_params(&SamplingParams {
                seed: Some(1),
                ..p.clone()
            })
            .is_ok());
        assert!(r
            .check_params(&SamplingParams {
                temperature: 0.0,
                ..p.clone()
            })
            .is_ok());
        let off = RequestRules {
            determinism: DeterminismMode::Off,
            ..r
        };
        let e = off
            .check_params(&SamplingParams { seed: Some(1), ..p })
            .unwrap_err();
        assert_eq!(e.param_name(), Some("deterministic"));
    }
}
