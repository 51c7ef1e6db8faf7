//! Engine settings chosen by the user (not by the checkpoint).

use crate::error::{DetspecError, Result};

/// Settings for an [`crate::Engine`]. Defaults follow DESIGN.md.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Tokens per KV page.
    pub page_size: usize,
    /// Number of KV pages in the pool; `None` sizes the pool from `kv_cache_bytes`.
    pub num_kv_pages: Option<usize>,
    /// Memory budget for the KV pool when `num_kv_pages` is not given.
    pub kv_cache_bytes: usize,
    /// Most sequences decoded together in one step.
    pub max_num_seqs: usize,
    /// Most tokens (prefill + decode) in one forward pass.
    pub max_num_batched_tokens: usize,
    /// Longest prompt + output; `None` uses the model's `max_position_embeddings`.
    pub max_model_len: Option<usize>,
    /// Largest prefill chunk of one sequence per step; `None` = the whole token budget.
    pub max_prefill_chunk: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            page_size: 16,
            num_kv_pages: None,
            kv_cache_bytes: 1 << 30,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: None,
            max_prefill_chunk: None,
        }
    }
}

impl EngineConfig {
    /// Rejects settings the engine cannot run with, naming the parameter.
    pub fn validate(&self) -> Result<()> {
        if self.page_size == 0 || self.page_size > 1024 {
            return Err(DetspecError::param("page_size", format!("must be in 1..=1024, got {}", self.page_size)));
        }
        if self.num_kv_pages == Some(0) {
            return Err(DetspecError::param("num_kv_pages", "must be > 0"));
        }
        if self.num_kv_pages.is_none() && self.kv_cache_bytes == 0 {
            return Err(DetspecError::param("kv_cache_bytes", "must be > 0"));
        }
        if self.max_num_seqs == 0 {
            return Err(DetspecError::param("max_num_seqs", "must be > 0"));
        }
        if self.max_num_batched_tokens == 0 {
            return Err(DetspecError::param("max_num_batched_tokens", "must be > 0"));
        }
        if self.max_prefill_chunk == Some(0) {
            return Err(DetspecError::param("max_prefill_chunk", "must be > 0"));
        }
        if self.max_model_len == Some(0) {
            return Err(DetspecError::param("max_model_len", "must be > 0"));
        }
        Ok(())
    }
}
