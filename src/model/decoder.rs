//! The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flat varlen batch.
//!
//! One call runs any mix of prefill chunks and decode rows from many sequences: the batch is a
//! flat list of tokens with their absolute positions, and each token's K/V is written to the
//! paged cache at its slot before attention reads the cache.

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::config::ModelConfig;
use crate::error::{DetspecError, Result};
use crate::kv::KvPool;
use crate::ops::{self, invariant_matmul, matmul_packed, AttentionMetadata, PackedWeight};

use super::Checkpoint;

/// One forward pass's inputs: a flat batch of tokens from one or more sequences.
#[derive(Debug, Clone, Default)]
pub struct ForwardBatch {
    /// Token id of each row.
    pub tokens: Vec<u32>,
    /// Cache slot each row's K/V is written to.
    pub slots: Vec<u32>,
    /// Positions, sequence index and block tables for attention.
    pub attention: AttentionMetadata,
    /// Rows whose logits are wanted, in output order.
    pub logit_rows: Vec<u32>,
    /// Run every GEMM on fixed-size row blocks so a row's result never depends on how many
    /// rows the batch has (the `batch_invariant` mode).
    pub invariant_gemm: bool,
}

/// `x @ w^T (+ b)`.
#[derive(Debug, Clone)]
struct Linear {
    weight: LinearWeight,
    bias: Option<Tensor>,
}

/// A linear layer's weight in the form its device's GEMM wants.
#[derive(Debug, Clone)]
enum LinearWeight {
    /// CPU: packed once for the fixed-order GEMM (`ops::gemm`), invariant to the batch.
    Packed(Arc<PackedWeight>),
    /// Other devices: `[in, out]`, transposed and contiguous once at load.
    Dense(Tensor),
}

impl LinearWeight {
    /// From a checkpoint's `[out, in]` matrix.
    fn new(w: &Tensor) -> Result<Self> {
        if w.device().is_cpu() {
            let (out_dim, in_dim) = w.dims2()?;
            let data = w.flatten_all()?.to_vec1::<f32>()?;
            Ok(Self::Packed(Arc::new(PackedWeight::from_transposed(
                &data, out_dim, in_dim,
            )?)))
        } else {
            Ok(Self::Dense(w.t()?.contiguous()?))
        }
    }

    fn matmul(&self, x: &Tensor, invariant: bool) -> candle_core::Result<Tensor> {
        match self {
            Self::Packed(w) => matmul_packed(x, w),
            Self::Dense(w) if invariant => invariant_matmul(x, w),
            Self::Dense(w) => x.matmul(w),
        }
    }
}

impl Linear {
    /// Stores the weight transposed and contiguous once, so every forward's GEMM reads a
    /// row-major `[in, out]` right-hand side.
    fn load(
        ck: &Checkpoint,
        prefix: &str,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
        dev: &Device,
    ) -> Result<Self> {
        let w = ck.load(
            &format!("{prefix}.weight"),
            &[out_dim, in_dim],
            DType::F32,
            dev,
        )?;
        let bias = if bias {
            Some(ck.load(&format!("{prefix}.bias"), &[out_dim], DType::F32, dev)?)
        } else {
            None
        };
        Ok(Self {
            weight: LinearWeight::new(&w)?,
            bias,
        })
    }
}

impl Linear {
    fn apply(&self, x: &Tensor, invariant: bool) -> candle_core::Result<Tensor> {
        let y = self.weight.matmul(x, invariant)?;
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

#[derive(Debug)]
struct Layer {
    input_norm: Tensor,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    post_norm: Tensor,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// A loaded decoder.
#[derive(Debug)]
pub struct Model {
    cfg: ModelConfig,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: LinearWeight,
    /// `[max_positions, head_dim/2]` tables, indexed by absolute position.
    cos: Tensor,
    sin: Tensor,
    device: Device,
    weights_hash: u64,
}

impl Model {
    /// Loads the weights of a Hugging Face model directory whose config is `cfg`.
    pub fn load(dir: &Path, cfg: ModelConfig, device: &Device) -> Result<Self> {
        let ck = Checkpoint::open(dir)?;
        let (h, kvh, d) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let dev = device;
        let vec = |name: &str, n: usize| ck.load(name, &[n], DType::F32, dev);
        let embed = ck.load(
            "model.embed_tokens.weight",
            &[cfg.vocab_size, cfg.hidden_size],
            DType::F32,
            dev,
        )?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let hs = cfg.hidden_size;
            let is = cfg.intermediate_size;
            layers.push(Layer {
                input_norm: vec(&format!("{p}.input_layernorm.weight"), hs)?,
                q: Linear::load(
                    &ck,
                    &format!("{p}.self_attn.q_proj"),
                    hs,
                    h * d,
                    cfg.qkv_bias,
                    dev,
                )?,
                k: Linear::load(
                    &ck,
                    &format!("{p}.self_attn.k_proj"),
                    hs,
                    kvh * d,
                    cfg.qkv_bias,
                    dev,
                )?,
                v: Linear::load(
                    &ck,
                    &format!("{p}.self_attn.v_proj"),
                    hs,
                    kvh * d,
                    cfg.qkv_bias,
                    dev,
                )?,
                o: Linear::load(
                    &ck,
                    &format!("{p}.self_attn.o_proj"),
                    h * d,
                    hs,
                    cfg.o_bias,
                    dev,
                )?,
                q_norm: cfg
                    .qk_norm
                    .then(|| vec(&format!("{p}.self_attn.q_norm.weight"), d))
                    .transpose()?,
                k_norm: cfg
                    .qk_norm
                    .then(|| vec(&format!("{p}.self_attn.k_norm.weight"), d))
                    .transpose()?,
                post_norm: vec(&format!("{p}.post_attention_layernorm.weight"), hs)?,
                gate: Linear::load(
                    &ck,
                    &format!("{p}.mlp.gate_proj"),
                    hs,
                    is,
                    cfg.mlp_bias,
                    dev,
                )?,
                up: Linear::load(&ck, &format!("{p}.mlp.up_proj"), hs, is, cfg.mlp_bias, dev)?,
                down: Linear::load(
                    &ck,
                    &format!("{p}.mlp.down_proj"),
                    is,
                    hs,
                    cfg.mlp_bias,
                    dev,
                )?,
            });
        }
        let norm = vec("model.norm.weight", cfg.hidden_size)?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            ck.load(
                "lm_head.weight",
                &[cfg.vocab_size, cfg.hidden_size],
                DType::F32,
                dev,
            )?
        };
        let (cos, sin) = rope_tables(&cfg, dev)?;
        Ok(Self {
            weights_hash: ck.content_hash(),
            lm_head: LinearWeight::new(&lm_head)?,
            cfg,
            embed,
            layers,
            norm,
            cos,
            sin,
            device: device.clone(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Hash of the checkpoint's headers (names, shapes, dtypes, offsets) and sizes.
    pub fn weights_hash(&self) -> u64 {
        self.weights_hash
    }

    /// Runs the batch, writing its K/V into `kv`, and returns logits `[logit_rows, vocab]`.
    pub fn forward(&self, batch: &ForwardBatch, kv: &KvPool) -> Result<Tensor> {
        let n = batch.tokens.len();
        if n == 0 || batch.slots.len() != n || batch.attention.positions.len() != n {
            return Err(DetspecError::InvalidRequest {
                request_id: None,
                message: format!(
                    "malformed batch: {n} tokens, {} slots, {} positions",
                    batch.slots.len(),
                    batch.attention.positions.len()
                ),
            });
        }
        let cfg = &self.cfg;
        let vocab = cfg.vocab_size as u32;
        if let Some(&bad) = batch.tokens.iter().find(|&&t| t >= vocab) {
            return Err(DetspecError::InvalidRequest {
                request_id: None,
                message: format!("token id {bad} is outside the vocabulary (size {vocab})"),
            });
        }
        let max_pos = self.cos.dim(0)? as u32;
        if let Some(&bad) = batch.attention.positions.iter().find(|&&p| p >= max_pos) {
            return Err(DetspecError::InvalidRequest {
                request_id: None,
                message: format!("position {bad} is beyond the model's context ({max_pos})"),
            });
        }
        let dev = &self.device;
        let (h, kvh, d) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let ids = Tensor::from_slice(&batch.tokens, n, dev)?;
        let pos = Tensor::from_slice(&batch.attention.positions, n, dev)?;
        let cos = self.cos.index_select(&pos, 0)?;
        let sin = self.sin.index_select(&pos, 0)?;
        let slots = Arc::new(batch.slots.clone());
        let meta = Arc::new(batch.attention.clone());
        let scale = 1.0 / (d as f32).sqrt();
        let eps = cfg.rms_norm_eps;

        let inv = batch.invariant_gemm;
        let mut x = self.embed.index_select(&ids, 0)?;
        for (li, layer) in self.layers.iter().enumerate() {
            let (k_cache, v_cache) = kv.layer(li).ok_or_else(|| {
                DetspecError::param("num_layers", format!("KV pool has no layer {li}"))
            })?;
            let hn = ops::rms_norm(&x, &layer.input_norm, eps)?;
            let mut q = layer.q.apply(&hn, inv)?.reshape((n, h, d))?;
            let mut k = layer.k.apply(&hn, inv)?.reshape((n, kvh, d))?;
            let v = layer.v.apply(&hn, inv)?.reshape((n, kvh, d))?;
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                q = ops::rms_norm(&q, qn, eps)?;
                k = ops::rms_norm(&k, kn, eps)?;
            }
            let q = ops::apply_rope(&q, &cos, &sin)?;
            let k = ops::apply_rope(&k, &cos, &sin)?;
            ops::write_k(k_cache, &k, slots.clone())?;
            ops::write_kv(v_cache, &v, slots.clone())?;
            let attn = ops::paged_attention(&q, k_cache, v_cache, meta.clone(), scale)?;
            x = ops::add(&x, &layer.o.apply(&attn.reshape((n, h * d))?, inv)?)?;
            let hn = ops::rms_norm(&x, &layer.post_norm, eps)?;
            let act = ops::swiglu(&layer.gate.apply(&hn, inv)?, &layer.up.apply(&hn, inv)?)?;
            x = ops::add(&x, &layer.down.apply(&act, inv)?)?;
        }
        let rows = Tensor::from_slice(&batch.logit_rows, batch.logit_rows.len(), dev)?;
        let x = x.index_select(&rows, 0)?;
        let x = ops::rms_norm(&x, &self.norm, eps)?;
        Ok(self.lm_head.matmul(&x, inv)?)
    }
}

/// cos/sin of `position * inv_freq` for every position up to the model's context, in f32 as
/// transformers computes them.
fn rope_tables(cfg: &ModelConfig, dev: &Device) -> Result<(Tensor, Tensor)> {
    let inv = cfg.rope_inv_freq();
    let n = cfg.max_position_embeddings;
    let half = inv.len();
    let mut cos = Vec::with_capacity(n * half);
    let mut sin = Vec::with_capacity(n * half);
    for p in 0..n {
        for &f in &inv {
            let a = p as f32 * f;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    Ok((
        Tensor::from_vec(cos, (n, half), dev)?,
        Tensor::from_vec(sin, (n, half), dev)?,
    ))
}
