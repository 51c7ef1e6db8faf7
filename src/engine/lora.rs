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
use crate::model::{LoraAdapter, LoraBase};

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
        self.insert(name, replace, |base| LoraAdapter::load(dir, base))
    }

    /// [`Self::load`] of an adapter sent as its config's JSON and its safetensors bytes.
    pub(super) fn load_bytes(
        &self,
        name: &str,
        config_json: &str,
        safetensors: &[u8],
        replace: bool,
    ) -> Result<Arc<LoraAdapter>> {
        let label = Path::new("<memory>").join(name);
        self.insert(name, replace, |base| {
            LoraAdapter::from_bytes(&label, config_json, safetensors, base)
        })
    }

    /// Checks `name` can be (re)loaded, builds the adapter with `make` (outside the lock: a
    /// large adapter does not hold up submissions) and registers it.
    fn insert(
        &self,
        name: &str,
        replace: bool,
        make: impl FnOnce(&LoraBase<'_>) -> Result<LoraAdapter>,
    ) -> Result<Arc<LoraAdapter>> {
        if self.max_loras == 0 {
            return Err(DetspecError::param(
                "enable_lora",
                "LoRA adapters are off for this engine (enable_lora / --enable-lora)",
            ));
        }
        if name.is_empty() {
            return Err(DetspecError::param("lora_name", "must not be empty"));
        }
        Self::room_in(&self.map(), name, replace, self.max_loras)?;
        let adapter = Arc::new(make(&LoraBase {
            config: &self.config,
            device: &self.device,
            dtype: self.dtype,
            max_rank: self.max_rank,
        })?);
        let mut map = self.map();
        // Checked again: another load may have taken the room or the name meanwhile.
        Self::room_in(&map, name, replace, self.max_loras)?;
        map.insert(name.to_string(), adapter.clone());
        Ok(adapter)
    }

    /// Whether `map` may take `name`: new and under `max_loras`, or loaded and `replace`.
    fn room_in(
        map: &BTreeMap<String, Arc<LoraAdapter>>,
        name: &str,
        replace: bool,
        max_loras: usize,
    ) -> Result<()> {
        if map.contains_key(name) {
            return match replace {
                true => Ok(()),
                false => Err(DetspecError::param(
                    "lora_name",
                    format!("an adapter named `{name}` is already loaded"),
                )),
            };
        }
        if map.len() >= max_loras {
            return Err(DetspecError::param(
                "max_loras",
                format!(
                    "{} adapters are loaded, the most this engine holds; unload one first",
                    map.len()
                ),
            ));
        }
        Ok(())
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
