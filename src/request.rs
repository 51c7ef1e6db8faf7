//! What a client submits.

use std::sync::Arc;

use crate::model::LoraAdapter;
use crate::sampling::SamplingParams;

/// A prompt as text (tokenized by the model's tokenizer) or as token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

impl From<&str> for Prompt {
    fn from(s: &str) -> Self {
        Prompt::Text(s.to_string())
    }
}

impl From<String> for Prompt {
    fn from(s: String) -> Self {
        Prompt::Text(s)
    }
}

impl From<Vec<u32>> for Prompt {
    fn from(t: Vec<u32>) -> Self {
        Prompt::Tokens(t)
    }
}

/// One generation request.
#[derive(Debug, Clone)]
pub struct Request {
    /// Caller-chosen id, echoed in outputs and used to abort.
    pub request_id: String,
    pub prompt: Prompt,
    pub params: SamplingParams,
    /// The LoRA adapter to run on top of the base model (`None`: the base model).
    pub lora: Option<Arc<LoraAdapter>>,
    /// vLLM's `cache_salt`: the request's KV is cached, and prefix-cache hits are looked up,
    /// only among requests with the same salt (multi-tenant isolation; outputs unchanged).
    pub cache_salt: Option<String>,
}

impl Request {
    pub fn new(
        request_id: impl Into<String>,
        prompt: impl Into<Prompt>,
        params: SamplingParams,
    ) -> Self {
        Self {
            request_id: request_id.into(),
            prompt: prompt.into(),
            params,
            lora: None,
            cache_salt: None,
        }
    }

    /// The request with its prefix-cache hits and pages confined to `salt`'s namespace.
    pub fn with_cache_salt(mut self, salt: impl Into<String>) -> Self {
        self.cache_salt = Some(salt.into());
        self
    }

    /// The request run with `adapter` on top of the base model.
    pub fn with_lora(mut self, adapter: Arc<LoraAdapter>) -> Self {
        self.lora = Some(adapter);
        self
    }
}
