//! Memory-mapped safetensors checkpoints, single-file or sharded.
//!
//! Every failure names the file or the tensor, because a broken checkpoint is the most common
//! way a user meets detspec's errors.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use memmap2::Mmap;
pub use safetensors::Dtype as StDtype;
use safetensors::SafeTensors;

use crate::config::ModelConfig;
use crate::error::{DetspecError, Result};

use super::nemotron_h_names;

/// Where multimodal checkpoints keep their language model: each prefix its names carry, and
/// the decoder checkpoint's prefix in its place. transformers' modules name the decoder
/// `model.language_model.` (the LM head stays `lm_head.`); the hub's files,
/// `language_model.model.` and `language_model.lm_head.`.
const LANGUAGE_MODEL_PREFIXES: [(&str, &str); 3] = [
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
];

/// A multimodal checkpoint's name for its language model's parameter `name` as a decoder
/// checkpoint names it (`model.language_model.layers.0…` → `model.layers.0…`); `None` for a
/// name of no language model.
pub fn language_model_name(name: &str) -> Option<String> {
    LANGUAGE_MODEL_PREFIXES
        .iter()
        .find_map(|(stored, own)| name.strip_prefix(stored).map(|rest| format!("{own}{rest}")))
}

/// The engine's name for a parameter of a model of `cfg` that a trainer or a checkpoint calls
/// `name`: a multimodal checkpoint's language model's ([`language_model_name`]), Nemotron-H's
/// (`nemotron_h_names`), or `name` itself.
pub fn engine_name(cfg: &ModelConfig, name: String) -> String {
    language_model_name(&name)
        .or_else(|| nemotron_h_names::engine_name(cfg, &name))
        .unwrap_or(name)
}

/// Granite MoE's tensors as transformers 5 names its modules, and the name its checkpoints
/// (and the engine) use: a trainer's `state_dict()` carries the former, and Granite MoE SWA's
/// files too (transformers converts the others' names at load, not its).
const GRANITE_MODULE_NAMES: [(&str, &str); 3] = [
    (
        ".block_sparse_moe.experts.gate_up_proj",
        ".block_sparse_moe.input_linear.weight",
    ),
    (
        ".block_sparse_moe.experts.down_proj",
        ".block_sparse_moe.output_linear.weight",
    ),
    (
        ".block_sparse_moe.router.weight",
        ".block_sparse_moe.router.layer.weight",
    ),
];

/// Granite MoE's checkpoint name for the tensor transformers' modules call `name`
/// (`…block_sparse_moe.experts.gate_up_proj` → `…block_sparse_moe.input_linear.weight`);
/// `None` for any other name.
pub(super) fn granite_file_name(name: &str) -> Option<String> {
    GRANITE_MODULE_NAMES.iter().find_map(|(module, file)| {
        name.strip_suffix(module)
            .map(|layer| format!("{layer}{file}"))
    })
}

/// Whether `name` is of a multimodal checkpoint's vision side (its vision tower, or the
/// projector into the language model's embeddings; Qwen's `visual.`), which serving text
/// never reads.
pub fn is_vision_name(name: &str) -> bool {
    ["vision_tower.", "multi_modal_projector.", "visual."]
        .iter()
        .any(|p| name.contains(p))
}

/// An opened checkpoint: mmaps of each shard and an index of tensor name → shard and the name
/// the file stores it under. Names are a decoder checkpoint's (`model.layers.0…`); a
/// multimodal checkpoint's language model is found under its own prefix
/// ([`language_model_name`]), the rest of it (the vision tower) is not read.
pub struct Checkpoint {
    shards: Vec<(PathBuf, Mmap)>,
    index: HashMap<String, Stored>,
    /// The file users would look at to find a tensor (index json or the single file).
    manifest: PathBuf,
    /// Where the checkpoint spells its names otherwise (Nemotron-H's, under this prefix), a
    /// missing tensor is named as it would be spelled on file.
    nemotron_h_prefix: Option<&'static str>,
}

/// Where a tensor is, and its layout, as its shard's header says (read once, at open).
#[derive(Debug, Clone)]
struct Stored {
    shard: usize,
    /// The name the file stores it under.
    name: String,
    dtype: StDtype,
    shape: Vec<usize>,
}

impl Checkpoint {
    /// [`Self::open`] for a model of `cfg`: its tensors also found under the engine's names
    /// where its checkpoints name them otherwise (Nemotron-H's, [`engine_name`]).
    pub fn open_for(dir: &Path, cfg: &ModelConfig) -> Result<Self> {
        let mut ck = Self::open(dir)?;
        let renamed: Vec<(String, Stored)> = ck
            .index
            .iter()
            .filter_map(|(n, at)| nemotron_h_names::engine_name(cfg, n).map(|e| (e, at.clone())))
            .collect();
        if cfg.architecture == crate::config::Architecture::NemotronH {
            let hub = ck.index.keys().any(|n| n.starts_with("backbone."));
            ck.nemotron_h_prefix = Some(if hub { "backbone." } else { "model." });
        }
        for (name, at) in renamed {
            ck.index.entry(name).or_insert(at);
        }
        Ok(ck)
    }

    /// Opens `model.safetensors` or the shards listed in `model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let (files, manifest) = if index_path.exists() {
            (Self::shard_files(&index_path, dir)?, index_path)
        } else if single.exists() {
            (vec![single.clone()], single)
        } else {
            return Err(DetspecError::io(
                &single,
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "neither model.safetensors nor model.safetensors.index.json found",
                ),
            ));
        };
        let mut shards = Vec::with_capacity(files.len());
        let mut index = HashMap::new();
        for (i, path) in files.into_iter().enumerate() {
            let file = File::open(&path).map_err(|e| DetspecError::io(&path, e))?;
            // SAFETY: the mapping is read-only; a checkpoint modified while we load it is the
            // user's to avoid, as with every mmap-based loader.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| DetspecError::io(&path, e))?;
            let st = SafeTensors::deserialize(&mmap).map_err(|e| {
                DetspecError::file(&path, format!("not a valid safetensors file: {e}"))
            })?;
            for (name, view) in st.tensors() {
                let stored = Stored {
                    shard: i,
                    name: name.clone(),
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                };
                index.insert(name, stored);
            }
            drop(st);
            shards.push((path, mmap));
        }
        if !index.contains_key("model.embed_tokens.weight") {
            let wrapped: Vec<(String, Stored)> = index
                .iter()
                .filter_map(|(n, at)| language_model_name(n).map(|c| (c, at.clone())))
                .collect();
            index.extend(wrapped);
        }
        let granite: Vec<(String, Stored)> = index
            .iter()
            .filter_map(|(n, at)| granite_file_name(n).map(|file| (file, at.clone())))
            .collect();
        for (name, at) in granite {
            index.entry(name).or_insert(at);
        }
        Ok(Self {
            shards,
            index,
            manifest,
            nemotron_h_prefix: None,
        })
    }

    fn shard_files(index_path: &Path, dir: &Path) -> Result<Vec<PathBuf>> {
        let text =
            std::fs::read_to_string(index_path).map_err(|e| DetspecError::io(index_path, e))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| DetspecError::file(index_path, format!("not valid JSON: {e}")))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| DetspecError::file(index_path, "missing `weight_map` object"))?;
        let mut files: Vec<PathBuf> = Vec::new();
        for (name, f) in map {
            let f = f.as_str().ok_or_else(|| {
                DetspecError::file(
                    index_path,
                    format!("weight_map entry `{name}` is not a string"),
                )
            })?;
            if f.contains("..") || Path::new(f).is_absolute() {
                return Err(DetspecError::file(
                    index_path,
                    format!("shard path `{f}` leaves the model directory"),
                ));
            }
            let p = dir.join(f);
            if !files.contains(&p) {
                files.push(p);
            }
        }
        files.sort();
        Ok(files)
    }

    /// The file users would look at to find a tensor.
    pub fn manifest(&self) -> &Path {
        &self.manifest
    }

    /// Whether the checkpoint holds `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Loads `name` as `dtype` on `device`, checking its shape. f16/bf16/f32 are accepted.
    pub fn load(
        &self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let tensor = self.with_raw(name, shape, |src_dtype, data, bad| {
            Tensor::from_raw_buffer(data, src_dtype, shape, &Device::Cpu)
                .map_err(|e| bad(format!("cannot convert: {e}")))
        })??;
        Ok(tensor.to_dtype(dtype)?.to_device(device)?)
    }

    /// Runs `f` on `name`'s bytes as stored (little-endian, in the mapped file: no copy) and
    /// its dtype, after checking its shape; `f` also gets the constructor of an error naming
    /// the tensor. Afterwards the file's pages of the tensor are dropped from this process's
    /// mapping, so a checkpoint near the size of memory is not counted twice (what was made of
    /// it + the mapped file) while loading (advice only; a failure changes nothing).
    pub fn with_raw<R>(
        &self,
        name: &str,
        shape: &[usize],
        f: impl FnOnce(DType, &[u8], &dyn Fn(String) -> DetspecError) -> R,
    ) -> Result<R> {
        self.with_stored(name, shape, |stored, data, bad| {
            let src_dtype = match stored {
                StDtype::F32 => DType::F32,
                StDtype::F16 => DType::F16,
                StDtype::BF16 => DType::BF16,
                other => {
                    return Err(bad(format!(
                        "expected a float tensor (f32, f16, bf16), found {other:?}"
                    )))
                }
            };
            Ok(f(src_dtype, data, bad))
        })?
    }

    /// `f` of `name`'s bytes as stored, a tensor of `dtype` and `shape` (MXFP4's `u8` blocks
    /// and scales, FP8's `F8_E4M3` codes), in the mapped file: no copy. `f` also gets the
    /// constructor of an error naming the tensor.
    pub fn with_bytes<R>(
        &self,
        name: &str,
        shape: &[usize],
        dtype: StDtype,
        f: impl FnOnce(&[u8], &dyn Fn(String) -> DetspecError) -> R,
    ) -> Result<R> {
        self.with_stored(name, shape, |stored, data, bad| {
            if stored == dtype {
                Ok(f(data, bad))
            } else {
                Err(bad(format!(
                    "expected a {dtype:?} tensor, found {stored:?}"
                )))
            }
        })?
    }

    /// `name`'s dtype and shape as stored.
    pub fn stored_layout(&self, name: &str) -> Result<(StDtype, &[usize])> {
        let stored = self.locate(name)?;
        Ok((stored.dtype, &stored.shape))
    }

    fn locate(&self, name: &str) -> Result<&Stored> {
        self.index.get(name).ok_or_else(|| {
            let on_file = self
                .nemotron_h_prefix
                .and_then(|prefix| nemotron_h_names::file_name(prefix, name));
            DetspecError::MissingTensor {
                name: on_file.unwrap_or_else(|| name.to_string()),
                path: self.manifest.clone(),
            }
        })
    }

    /// [`Self::with_raw`] for a tensor of any stored dtype.
    fn with_stored<R>(
        &self,
        name: &str,
        shape: &[usize],
        f: impl FnOnce(StDtype, &[u8], &dyn Fn(String) -> DetspecError) -> R,
    ) -> Result<R> {
        let Stored {
            shard,
            name: stored,
            ..
        } = self.locate(name)?;
        let (path, mmap) = &self.shards[*shard];
        let bad = |message: String| DetspecError::BadTensor {
            name: stored.clone(),
            path: path.clone(),
            message,
        };
        let st = SafeTensors::deserialize(mmap)
            .map_err(|e| DetspecError::file(path, format!("not a valid safetensors file: {e}")))?;
        let view = st
            .tensor(stored)
            .map_err(|e| bad(format!("cannot read: {e}")))?;
        if view.shape() != shape {
            return Err(bad(format!(
                "expected shape {shape:?}, found {:?}",
                view.shape()
            )));
        }
        let out = f(view.dtype(), view.data(), &bad);
        #[cfg(unix)]
        {
            let offset = view.data().as_ptr() as usize - mmap.as_ptr() as usize;
            // SAFETY: the mapping is read-only and file-backed, so dropping its pages loses
            // nothing (a later read faults them in again from the file); `f` is done with them.
            let _ = unsafe {
                mmap.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    offset,
                    view.data().len(),
                )
            };
        }
        Ok(out)
    }
}
