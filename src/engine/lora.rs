//! The engine's LoRA adapters by name: loaded on the caller's thread (not the step loop's),
//! resolved by name when a request is submitted.
//!
//! The registry holds `Arc`s: a request keeps the adapter it was submitted with, so unloading a
//! name, or loading another adapter under it (an RL trainer's new weights each step), changes
//! requests submitted after, never one in flight.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device};

use crate::config::ModelConfig;
use crate::error::{DetspecError, Result};
use crate::model::LoraAdapter;

/// Loaded adapters and what a new one is checked against.
pub(super) struct LoraRegistry {
    config: ModelConfig,
    device: Device,
    dtype: DType,
    max_loras: usize,
    max_rank: usize,
    by_name: Mutex<BTreeMap<String, Arc<LoraAdapter>>>,
}

impl LoraRegistry {
    /// For a base model of `config` whose activations are `dtype` on `device`.
    pub(super) fn new(
        config: ModelConfig,
        device: Device,
        dtype: DType,
        max_loras: usize,
        max_rank: usize,
    ) -> Self {
        Self {
            config,
            device,
            dtype,
            max_loras,
            max_rank,
            by_name: Mutex::new(BTreeMap::new()),
        }
    }

    fn map(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Arc<LoraAdapter>>> {
        // Nothing panics while holding the lock; a poisoned map is still a consistent one.
        self.by_name.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Loads the PEFT adapter in `dir` as `name`. A name already loaded is refused unless
    /// `replace` (then later requests get the new adapter).
    pub(super) fn load(&self, name: &str, dir: &Path, replace: bool) -> Result<Arc<LoraAdapter>> {
        if self.max_loras == 0 {
            return Err(DetspecError::param(
                "enable_lora",
                "LoRA adapters are off for this engine (enable_lora / --enable-lora)",
            ));
        }
        if name.is_empty() {
            return Err(DetspecError::param("lora_name", "must not be empty"));
        }
        {
            let map = self.map();
            if map.contains_key(name) && !replace {
                return Err(DetspecError::param(
                    "lora_name",
                    format!("an adapter named `{name}` is already loaded"),
                ));
            }
            if !map.contains_key(name) && map.len() >= self.max_loras {
                return Err(DetspecError::param(
                    "max_loras",
                    format!(
                        "{} adapters are loaded, the most this engine holds; unload one first",
                        map.len()
                    ),
                ));
            }
        }
        // Outside the lock: reading a large adapter does not hold up submissions.
        let adapter = Arc::new(LoraAdapter::load(
            dir,
            &self.config,
            &self.device,
            self.dtype,
            self.max_rank,
        )?);
        let mut map = self.map();
        if !map.contains_key(name) && map.len() >= self.max_loras {
            return Err(DetspecError::param(
                "max_loras",
                format!(
                    "{} adapters are loaded, the most this engine holds",
                    map.len()
                ),
            ));
        }
        map.insert(name.to_string(), adapter.clone());
        Ok(adapter)
    }

    /// Drops `name`; requests running with it finish with it.
    pub(super) fn unload(&self, name: &str) -> Result<()> {
        self.map().remove(name).map(|_| ()).ok_or_else(|| {
            DetspecError::param("lora_name", format!("no adapter named `{name}` is loaded"))
        })
    }

    /// The adapter loaded as `name`.
    pub(super) fn get(&self, name: &str) -> Result<Arc<LoraAdapter>> {
        self.map().get(name).cloned().ok_or_else(|| {
            DetspecError::param("lora_name", format!("no adapter named `{name}` is loaded"))
        })
    }

    /// Every loaded adapter, by name.
    pub(super) fn list(&self) -> Vec<(String, Arc<LoraAdapter>)> {
        self.map()
            .iter()
            .map(|(n, a)| (n.clone(), a.clone()))
            .collect()
    }
}
