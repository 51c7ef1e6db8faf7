//! A decoder's parameters by their Hugging Face names: the names and shapes a checkpoint of a
//! given config holds, content hashes for the fingerprint, and replacing parameters in place
//! (weight updates from a trainer).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

use crate::config::ModelConfig;
use crate::error::{DetspecError, Result};
use crate::ops::{
    bf16_to_f32, with_bf16_bits, with_f32_values, PackedWeightAbf16, PackedWeightBf16,
};

use super::decoder::{LinearWeight, Model};
use super::Checkpoint;

/// Every parameter name a checkpoint of `cfg` holds, with its shape, in name order.
/// `lm_head.weight` is listed for tied models too (torch's `state_dict()` yields it); it then
/// names the embedding matrix.
pub fn param_shapes(cfg: &ModelConfig) -> BTreeMap<String, Vec<usize>> {
    let (h, kvh, d) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let (hs, is, vocab) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let mut m = BTreeMap::new();
    m.insert("model.embed_tokens.weight".into(), vec![vocab, hs]);
    m.insert("model.norm.weight".into(), vec![hs]);
    m.insert("lm_head.weight".into(), vec![vocab, hs]);
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let mut linear = |name: String, i: usize, o: usize, bias: bool| {
            if bias {
                m.insert(format!("{name}.bias"), vec![o]);
            }
            m.insert(format!("{name}.weight"), vec![o, i]);
        };
        linear(format!("{p}.self_attn.q_proj"), hs, h * d, cfg.qkv_bias);
        linear(format!("{p}.self_attn.k_proj"), hs, kvh * d, cfg.qkv_bias);
        linear(format!("{p}.self_attn.v_proj"), hs, kvh * d, cfg.qkv_bias);
        linear(format!("{p}.self_attn.o_proj"), h * d, hs, cfg.o_bias);
        linear(format!("{p}.mlp.gate_proj"), hs, is, cfg.mlp_bias);
        linear(format!("{p}.mlp.up_proj"), hs, is, cfg.mlp_bias);
        linear(format!("{p}.mlp.down_proj"), is, hs, cfg.mlp_bias);
        m.insert(format!("{p}.input_layernorm.weight"), vec![hs]);
        m.insert(format!("{p}.post_attention_layernorm.weight"), vec![hs]);
        if cfg.qk_norm {
            m.insert(format!("{p}.self_attn.q_norm.weight"), vec![d]);
            m.insert(format!("{p}.self_attn.k_norm.weight"), vec![d]);
        }
    }
    m
}

/// xxh3 of a tensor's values as f32 (exact for every engine dtype), as little-endian bytes.
/// bf16 values are widened a chunk at a time (the same digest as one call over all of them),
/// so hashing a large bf16 matrix allocates no f32 copy of it.
pub fn tensor_hash(t: &Tensor) -> Result<u64> {
    match with_bf16_bits(t, bf16_hash)? {
        Some(h) => Ok(h),
        None => Ok(with_f32_values(t, |v| xxh3_64(bytemuck::cast_slice(v)))?),
    }
}

/// [`tensor_hash`] of bf16 values given as bits.
fn bf16_hash(bits: &[u16]) -> u64 {
    let mut h = Xxh3::new();
    let mut buf = [0f32; 4096];
    for chunk in bits.chunks(buf.len()) {
        for (d, &b) in buf.iter_mut().zip(chunk) {
            *d = bf16_to_f32(b);
        }
        h.update(bytemuck::cast_slice(&buf[..chunk.len()]));
    }
    h.digest()
}

/// Content hash of each parameter, by HF name (the tied LM head is the embedding's entry).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParamHashes(BTreeMap<String, u64>);

impl ParamHashes {
    /// One hash of all parameters: names and hashes in name order.
    pub fn combined(&self) -> u64 {
        let mut h = Xxh3::new();
        for (name, v) in &self.0 {
            h.update(name.as_bytes());
            h.update(&[0]);
            h.update(&v.to_le_bytes());
        }
        h.digest()
    }
}

/// Loads parameters from a checkpoint in the engine's dtype, hashing each as it goes.
pub(super) struct WeightLoader<'a> {
    ck: &'a Checkpoint,
    device: &'a Device,
    /// Matrices (linear layers, embedding).
    dtype: DType,
    /// Vectors (norms, biases): the activations' dtype.
    vector_dtype: DType,
    /// Linear layers packed for the bf16-activation GEMM.
    bf16_act: bool,
    hashes: RefCell<ParamHashes>,
}

impl<'a> WeightLoader<'a> {
    pub(super) fn new(
        ck: &'a Checkpoint,
        device: &'a Device,
        dtype: DType,
        vector_dtype: DType,
        bf16_act: bool,
    ) -> Self {
        Self {
            ck,
            device,
            dtype,
            vector_dtype,
            bf16_act,
            hashes: RefCell::default(),
        }
    }

    /// A vector (norm weight, bias), rounded to the weights' dtype and held in the
    /// activations' (so a float32 checkpoint run in bfloat16 is the bfloat16 checkpoint).
    pub(super) fn load(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.load_as(name, shape, self.vector_dtype)
    }

    /// A matrix (linear weight, embedding), in the weights' dtype.
    pub(super) fn load_matrix(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.load_as(name, shape, self.dtype)
    }

    /// A linear layer's `[out, in]` weight in the form the device's GEMM wants. A bf16 weight
    /// of a bf16 checkpoint on the CPU is packed straight from the mapped file (no copy of the
    /// matrix is made on the way).
    pub(super) fn load_linear(
        &self,
        name: &str,
        out_dim: usize,
        in_dim: usize,
    ) -> Result<LinearWeight> {
        if self.device.is_cpu() && self.dtype == DType::BF16 && cfg!(target_endian = "little") {
            let packed = self
                .ck
                .with_raw(name, &[out_dim, in_dim], |src, bytes, _| {
                    if src != DType::BF16 {
                        return Ok(None);
                    }
                    let owned: Vec<u16>;
                    let bits: &[u16] = match bytemuck::try_cast_slice(bytes) {
                        Ok(bits) => bits,
                        Err(_) => {
                            owned = bytes
                                .chunks_exact(2)
                                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                                .collect();
                            &owned
                        }
                    };
                    let packed = if self.bf16_act {
                        LinearWeight::PackedAbf16(Arc::new(
                            PackedWeightAbf16::from_transposed_bits(bits, out_dim, in_dim)?,
                        ))
                    } else {
                        LinearWeight::PackedBf16(Arc::new(PackedWeightBf16::from_transposed_bits(
                            bits, out_dim, in_dim,
                        )?))
                    };
                    Ok::<_, DetspecError>(Some((packed, bf16_hash(bits))))
                })??;
            if let Some((packed, hash)) = packed {
                self.hashes.borrow_mut().0.insert(name.to_string(), hash);
                return Ok(packed);
            }
        }
        LinearWeight::new(&self.load_matrix(name, &[out_dim, in_dim])?, self.bf16_act)
    }

    fn load_as(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let t = self
            .ck
            .load(name, shape, self.dtype, self.device)?
            .to_dtype(dtype)?;
        let h = tensor_hash(&t)?;
        self.hashes.borrow_mut().0.insert(name.to_string(), h);
        Ok(t)
    }

    pub(super) fn into_hashes(self) -> ParamHashes {
        self.hashes.into_inner()
    }
}

/// Where a named parameter lives in the model.
enum Slot<'a> {
    Vector(&'a mut Tensor),
    Bias(&'a mut Option<Tensor>),
    Linear(&'a mut LinearWeight),
    Embedding,
}

impl Model {
    /// Replaces the named parameters, after checking all of them with [`check_update`] (so
    /// a bad one changes nothing); values are converted to the engine's dtype. Returns the new
    /// combined weights hash.
    pub fn set_params(&mut self, updates: Vec<(String, Tensor)>) -> Result<u64> {
        let shapes: Vec<(String, Vec<usize>, DType)> = updates
            .iter()
            .map(|(n, t)| (n.clone(), t.dims().to_vec(), t.dtype()))
            .collect();
        check_update(&self.cfg, &shapes)?;
        let tied = self.cfg.tie_word_embeddings;
        let bf16_act = self.bf16_activations();
        let device = self.device().clone();
        let sets_embedding = updates
            .iter()
            .any(|(n, _)| n == "model.embed_tokens.weight");
        for (name, t) in updates {
            // A tied model's `lm_head.weight` is the embedding: torch's state_dict yields both
            // names for one tensor, so when both come the embedding's entry is applied.
            if tied && name == "lm_head.weight" && sets_embedding {
                continue;
            }
            let t = t.to_device(&device)?;
            let hash_name = if tied && name == "lm_head.weight" {
                "model.embed_tokens.weight".to_string()
            } else {
                name.clone()
            };
            // Matrices in the weights' dtype, vectors rounded to it and held in the activations'
            // (they differ on the CPU with bf16 weights).
            let (matrix, vector) = (self.dtype(), self.act_dtype());
            let t = match self.slot(&hash_name).ok_or_else(|| unknown(&name))? {
                Slot::Vector(v) => {
                    *v = t.to_dtype(matrix)?.to_dtype(vector)?;
                    v.clone()
                }
                Slot::Bias(b) => {
                    let t = t.to_dtype(matrix)?.to_dtype(vector)?;
                    *b = Some(t.clone());
                    t
                }
                Slot::Linear(w) => {
                    let t = t.to_dtype(matrix)?;
                    *w = LinearWeight::new(&t, bf16_act)?;
                    t
                }
                Slot::Embedding => {
                    let t = t.to_dtype(matrix)?;
                    if tied {
                        self.lm_head = LinearWeight::new(&t, bf16_act)?;
                    }
                    self.embed = t.clone();
                    t
                }
            };
            self.param_hashes.0.insert(hash_name, tensor_hash(&t)?);
        }
        Ok(self.param_hashes.combined())
    }

    fn slot(&mut self, name: &str) -> Option<Slot<'_>> {
        match name {
            "model.embed_tokens.weight" => return Some(Slot::Embedding),
            "model.norm.weight" => return Some(Slot::Vector(&mut self.norm)),
            "lm_head.weight" => return Some(Slot::Linear(&mut self.lm_head)),
            _ => {}
        }
        let rest = name.strip_prefix("model.layers.")?;
        let (index, field) = rest.split_once('.')?;
        let layer = self.layers.get_mut(index.parse::<usize>().ok()?)?;
        let (module, kind) = field.rsplit_once('.')?;
        if module == "input_layernorm" && kind == "weight" {
            return Some(Slot::Vector(&mut layer.input_norm));
        }
        if module == "post_attention_layernorm" && kind == "weight" {
            return Some(Slot::Vector(&mut layer.post_norm));
        }
        let linear = match module {
            "self_attn.q_proj" => &mut layer.q,
            "self_attn.k_proj" => &mut layer.k,
            "self_attn.v_proj" => &mut layer.v,
            "self_attn.o_proj" => &mut layer.o,
            "mlp.gate_proj" => &mut layer.gate,
            "mlp.up_proj" => &mut layer.up,
            "mlp.down_proj" => &mut layer.down,
            "self_attn.q_norm" => return layer.q_norm.as_mut().map(Slot::Vector),
            "self_attn.k_norm" => return layer.k_norm.as_mut().map(Slot::Vector),
            _ => return None,
        };
        match kind {
            "weight" => Some(Slot::Linear(&mut linear.weight)),
            "bias" => Some(Slot::Bias(&mut linear.bias)),
            _ => None,
        }
    }
}

fn unknown(name: &str) -> DetspecError {
    DetspecError::param(
        "named_tensors",
        format!("`{name}` is not a parameter of this model"),
    )
}

/// Checks that every `(name, shape, dtype)` names a parameter of a `cfg` model with its shape
/// and a float dtype; the error names the first bad tensor. Needs only the config, so a caller
/// can check before handing the update to the engine thread.
pub fn check_update(cfg: &ModelConfig, updates: &[(String, Vec<usize>, DType)]) -> Result<()> {
    let shapes = param_shapes(cfg);
    let mut seen = std::collections::HashSet::new();
    for (name, shape, dtype) in updates {
        let want = shapes.get(name).ok_or_else(|| unknown(name))?;
        if shape != want {
            return Err(DetspecError::param(
                "named_tensors",
                format!("`{name}` has shape {shape:?}; the model's is {want:?}"),
            ));
        }
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(DetspecError::param(
                "named_tensors",
                format!(
                    "`{name}` has dtype {dtype:?}; weights must be float32, bfloat16 or float16"
                ),
            ));
        }
        if !seen.insert(name.as_str()) {
            return Err(DetspecError::param(
                "named_tensors",
                format!("`{name}` is given twice"),
            ));
        }
    }
    Ok(())
}
