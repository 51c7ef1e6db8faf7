//! DeepSeek's multi-head latent attention (MLA: DeepSeek-V3/R1, Kimi K2, Moonlight), run as
//! the plain multi-head attention it equals: each head's key and value are expanded from the
//! shared latent and written to the paged cache, so the attention kernels, the cache and the
//! determinism contract are the other decoders' own.
//!
//! Why it keeps the contract: every step is per row (three GEMMs, two RMSNorms, copies), so a
//! row's q, k and v are functions of that row alone, and the attention is the shared kernel.
//!
//! The layout: a head's query and key are held as `[rotated | plain]` (transformers holds
//! `[plain | rotated]`): both permuted alike, so every score is the same sum of the same
//! products (in another order), and the rope kernels rotate a head's leading dimensions, as
//! they do Phi-3's. Values are padded with zeros to the key width (the cache holds one width)
//! and cut back after the attention. What it costs: the cache holds `2 × heads × qk_head_dim`
//! values a token where MLA's own form holds `kv_lora_rank + qk_rope_head_dim`.

use std::sync::Arc;

use candle_core::Tensor;

use crate::config::{MlaConfig, ModelConfig};
use crate::error::Result;
use crate::ops;

use super::linear::{GemmOptions, Linear};
use super::loader::WeightLoader;

/// transformers' `DeepseekV3RMSNorm` default, which its latent norms keep whatever the
/// config's `rms_norm_eps`.
const LATENT_NORM_EPS: f64 = 1e-6;

/// How a layer makes its queries.
#[derive(Debug)]
pub(super) enum LatentQuery {
    /// `q_proj` (`q_lora_rank: null`).
    Direct(Linear),
    /// `q_b_proj(norm(q_a_proj(x)))`.
    Lora { a: Linear, norm: Tensor, b: Linear },
}

/// One layer's latent attention projections (`o_proj` is the layer's own).
#[derive(Debug)]
pub(super) struct LatentAttention {
    pub(super) query: LatentQuery,
    /// `kv_a_proj_with_mqa`: `[kv_lora_rank + qk_rope_head_dim, hidden]`, the latent and the
    /// key part every head shares.
    pub(super) kv_a: Linear,
    pub(super) kv_a_norm: Tensor,
    /// `kv_b_proj`: `[heads × (qk_nope_head_dim + v_head_dim), kv_lora_rank]`.
    pub(super) kv_b: Linear,
    mla: MlaConfig,
    heads: usize,
}

/// Every parameter of a latent attention layer under `self_attn` (`q_a_proj`, …) with its
/// shape, as a checkpoint names them.
pub(super) fn latent_params(cfg: &ModelConfig, mla: &MlaConfig) -> Vec<(&'static str, Vec<usize>)> {
    let (h, hs) = (cfg.num_attention_heads, cfg.hidden_size);
    let q_width = h * mla.qk_head_dim();
    let mut out = match mla.q_lora_rank {
        Some(r) => vec![
            ("q_a_proj.weight", vec![r, hs]),
            ("q_a_layernorm.weight", vec![r]),
            ("q_b_proj.weight", vec![q_width, r]),
        ],
        None => vec![("q_proj.weight", vec![q_width, hs])],
    };
    out.extend([
        (
            "kv_a_proj_with_mqa.weight",
            vec![mla.kv_lora_rank + mla.qk_rope_head_dim, hs],
        ),
        ("kv_a_layernorm.weight", vec![mla.kv_lora_rank]),
        (
            "kv_b_proj.weight",
            vec![
                h * (mla.qk_nope_head_dim + mla.v_head_dim),
                mla.kv_lora_rank,
            ],
        ),
    ]);
    out
}

impl LatentAttention {
    /// Layer `layer`'s projections.
    pub(super) fn load(
        ld: &WeightLoader<'_>,
        cfg: &ModelConfig,
        mla: &MlaConfig,
        layer: usize,
    ) -> Result<Self> {
        let p = |name: &str| format!("model.layers.{layer}.self_attn.{name}");
        let (h, hs) = (cfg.num_attention_heads, cfg.hidden_size);
        let q_width = h * mla.qk_head_dim();
        let query = match mla.q_lora_rank {
            Some(r) => LatentQuery::Lora {
                a: ld.linear(&p("q_a_proj"), hs, r, false)?,
                norm: ld.norm(&format!("{}.weight", p("q_a_layernorm")), &[r], 0.0)?,
                b: ld.linear(&p("q_b_proj"), r, q_width, false)?,
            },
            None => LatentQuery::Direct(ld.linear(&p("q_proj"), hs, q_width, false)?),
        };
        let (rank, rope) = (mla.kv_lora_rank, mla.qk_rope_head_dim);
        Ok(Self {
            query,
            kv_a: ld.linear(&p("kv_a_proj_with_mqa"), hs, rank + rope, false)?,
            kv_a_norm: ld.norm(&format!("{}.weight", p("kv_a_layernorm")), &[rank], 0.0)?,
            kv_b: ld.linear(
                &p("kv_b_proj"),
                rank,
                h * (mla.qk_nope_head_dim + mla.v_head_dim),
                false,
            )?,
            mla: mla.clone(),
            heads: h,
        })
    }

    /// The queries of `x` (`[n, hidden]`) as `[n, heads, qk_head_dim]` (rotated part first),
    /// with each head's key and value written into the layer's caches at `slots`. `cos`/`sin`
    /// are the rows' rope tables (`qk_rope_head_dim / 2` wide).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn q_into_cache(
        &self,
        x: &Tensor,
        gemm: GemmOptions,
        cos: &Tensor,
        sin: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        slots: Arc<Vec<u32>>,
    ) -> Result<Tensor> {
        let m = &self.mla;
        let (n, h) = (x.dim(0)?, self.heads);
        let (nope, rope, dv) = (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim);
        let q = match &self.query {
            LatentQuery::Direct(q) => q.apply(x, gemm)?,
            LatentQuery::Lora { a, norm, b } => {
                let latent = ops::rms_norm(&a.apply(x, gemm)?, norm, LATENT_NORM_EPS)?;
                b.apply(&latent, gemm)?
            }
        }
        .reshape((n, h, nope + rope))?;
        let q = Tensor::cat(&[q.narrow(2, nope, rope)?, q.narrow(2, 0, nope)?], 2)?;
        let kv = self.kv_a.apply(x, gemm)?;
        let latent = ops::rms_norm(
            &kv.narrow(1, 0, m.kv_lora_rank)?.contiguous()?,
            &self.kv_a_norm,
            LATENT_NORM_EPS,
        )?;
        let shared_rot = kv
            .narrow(1, m.kv_lora_rank, rope)?
            .reshape((n, 1, rope))?
            .broadcast_as((n, h, rope))?;
        let kv = self.kv_b.apply(&latent, gemm)?.reshape((n, h, nope + dv))?;
        let k = Tensor::cat(&[shared_rot.contiguous()?, kv.narrow(2, 0, nope)?], 2)?;
        let v = kv.narrow(2, nope, dv)?;
        let v = match nope + rope - dv {
            0 => v.contiguous()?,
            pad => {
                let zeros = Tensor::zeros((n, h, pad), v.dtype(), v.device())?;
                Tensor::cat(&[v, zeros], 2)?
            }
        };
        let rotate = |t: &Tensor| match m.rope_interleave {
            true => ops::apply_rope_interleaved(t, cos, sin),
            false => ops::apply_rope(t, cos, sin),
        };
        ops::write_k(k_cache, &rotate(&k)?, slots.clone())?;
        ops::write_kv(v_cache, &v, slots)?;
        Ok(rotate(&q)?)
    }

    /// The attention's output `[n, heads, qk_head_dim]` cut to each head's value,
    /// `[n, heads × v_head_dim]` (what `o_proj` reads).
    pub(super) fn values(&self, attn: &Tensor) -> Result<Tensor> {
        let n = attn.dim(0)?;
        let dv = self.mla.v_head_dim;
        Ok(attn
            .narrow(2, 0, dv)?
            .contiguous()?
            .reshape((n, self.heads * dv))?)
    }

    /// The parameter a checkpoint names `name` under `self_attn` (`kv_b_proj`,
    /// `kv_a_layernorm`), if this layer has it.
    pub(super) fn param_mut(&mut self, name: &str) -> Option<LatentParam<'_>> {
        use LatentParam::{Linear as L, Norm as N};
        match (name, &mut self.query) {
            ("q_proj", LatentQuery::Direct(q)) => Some(L(q)),
            ("q_a_proj", LatentQuery::Lora { a, .. }) => Some(L(a)),
            ("q_a_layernorm", LatentQuery::Lora { norm, .. }) => Some(N(norm)),
            ("q_b_proj", LatentQuery::Lora { b, .. }) => Some(L(b)),
            ("kv_a_proj_with_mqa", _) => Some(L(&mut self.kv_a)),
            ("kv_a_layernorm", _) => Some(N(&mut self.kv_a_norm)),
            ("kv_b_proj", _) => Some(L(&mut self.kv_b)),
            _ => None,
        }
    }
}

/// A latent attention parameter, for a weight update.
pub(super) enum LatentParam<'a> {
    Linear(&'a mut Linear),
    /// An RMSNorm's weight.
    Norm(&'a mut Tensor),
}
