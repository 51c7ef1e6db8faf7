//! Control operations an RL trainer drives between steps: dropping the prefix cache, and
//! releasing and re-allocating the KV pool's memory while generation is paused.

use crate::error::{DetspecError, Result};

use super::EngineCore;

impl EngineCore {
    /// Drops every prefix-cache entry (pages held by running sequences stay theirs); returns
    /// the number of cached pages it let go.
    pub fn reset_prefix_cache(&mut self) -> usize {
        self.clear_cached_prefixes()
    }

    /// Frees the KV pool's memory (the prefix cache goes with it). Only with no request in
    /// flight: the engine must not step until [`EngineCore::resume_kv_memory`].
    pub fn release_kv_memory(&mut self) -> Result<()> {
        if self.has_work() {
            return Err(DetspecError::param(
                "tags",
                "the KV cache cannot be released while requests are in flight (pause \
                 generation with mode \"abort\" or \"wait\" first)",
            ));
        }
        self.clear_cached_prefixes();
        self.kv.release();
        Ok(())
    }

    /// Re-allocates the KV pool released by [`EngineCore::release_kv_memory`] (zeroed, as at
    /// load). A no-op when it is allocated.
    pub fn resume_kv_memory(&mut self) -> Result<()> {
        self.kv.restore()
    }

    /// Whether the KV pool's memory is released.
    pub fn kv_memory_released(&self) -> bool {
        self.kv.is_released()
    }

    /// Bytes the KV pool's tensors hold now (0 while released).
    pub fn kv_memory_bytes(&self) -> usize {
        self.kv.allocated_bytes()
    }
}
