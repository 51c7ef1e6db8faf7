//! Qwen3.5's gated DeltaNet layer (transformers' `Qwen3_5GatedDeltaNet`), in place of
//! attention in three of every four layers: projections of the normed input, the convolution
//! and delta rule over the sequence's recurrent state (`ops::gated_delta_rule`, state in
//! `kv::state`), a per-head RMSNorm gated by `silu(z)`, and `out_proj`.

use std::collections::BTreeMap;

use candle_core::Tensor;

use crate::config::{Activation, DeltaNetDims, ModelConfig};
use crate::error::Result;
use crate::kv::{StatePool, StateRef};
use crate::ops::{self, AttentionMetadata, DeltaNetParams};

use super::linear::{GemmOptions, Linear};
use super::loader::{host_vector, WeightLoader};

/// One layer's DeltaNet.
#[derive(Debug)]
pub(super) struct GatedDeltaNet {
    /// Queries, keys and values before the convolution: `[conv_dim, hidden]`.
    in_qkv: Linear,
    /// The output gate's input, `[value_heads · value_dim, hidden]`.
    in_z: Linear,
    /// β's and the decay's inputs, `[value_heads, hidden]` each.
    in_b: Linear,
    in_a: Linear,
    pub(super) params: DeltaNetParams,
    /// The gated norm's weight `[value_dim]` (plain: it scales by `w`, not `1 + w`).
    pub(super) norm: Tensor,
    out_proj: Linear,
    eps: f64,
}

/// A layer's DeltaNet parameters under `linear_attn.`, by name, with their shapes.
pub(super) fn delta_net_params(
    cfg: &ModelConfig,
    d: &DeltaNetDims,
) -> BTreeMap<String, Vec<usize>> {
    let hs = cfg.hidden_size;
    let (hv, dv) = (d.value_heads, d.value_dim);
    let mut m = BTreeMap::new();
    m.insert("in_proj_qkv.weight".into(), vec![d.conv_dim(), hs]);
    m.insert("in_proj_z.weight".into(), vec![hv * dv, hs]);
    m.insert("in_proj_b.weight".into(), vec![hv, hs]);
    m.insert("in_proj_a.weight".into(), vec![hv, hs]);
    m.insert("conv1d.weight".into(), vec![d.conv_dim(), 1, d.kernel]);
    m.insert("A_log".into(), vec![hv]);
    m.insert("dt_bias".into(), vec![hv]);
    m.insert("norm.weight".into(), vec![dv]);
    m.insert("out_proj.weight".into(), vec![hs, hv * dv]);
    m
}

impl GatedDeltaNet {
    /// Layer `prefix`'s (`model.layers.{i}`) DeltaNet.
    pub(super) fn load(
        ld: &WeightLoader<'_>,
        cfg: &ModelConfig,
        d: &DeltaNetDims,
        prefix: &str,
    ) -> Result<Self> {
        let hs = cfg.hidden_size;
        let (hv, dv) = (d.value_heads, d.value_dim);
        let name = |n: &str| format!("{prefix}.linear_attn.{n}");
        let params = DeltaNetParams {
            dims: *d,
            conv: host_vector(&ld.load(&name("conv1d.weight"), &[d.conv_dim(), 1, d.kernel])?)?,
            a_log: host_vector(&ld.load(&name("A_log"), &[hv])?)?,
            dt_bias: host_vector(&ld.load(&name("dt_bias"), &[hv])?)?,
        };
        Ok(Self {
            in_qkv: ld.linear(&name("in_proj_qkv"), hs, d.conv_dim(), false)?,
            in_z: ld.linear(&name("in_proj_z"), hs, hv * dv, false)?,
            in_b: ld.linear(&name("in_proj_b"), hs, hv, false)?,
            in_a: ld.linear(&name("in_proj_a"), hs, hv, false)?,
            params,
            norm: ld.norm(&name("norm.weight"), &[dv], 0.0)?,
            out_proj: ld.linear(&name("out_proj"), hv * dv, hs, false)?,
            eps: cfg.rms_norm_eps,
        })
    }

    /// The linear layer named `module` under `linear_attn.` (for updates).
    pub(super) fn linear_mut(&mut self, module: &str) -> Option<&mut Linear> {
        match module {
            "in_proj_qkv" => Some(&mut self.in_qkv),
            "in_proj_z" => Some(&mut self.in_z),
            "in_proj_b" => Some(&mut self.in_b),
            "in_proj_a" => Some(&mut self.in_a),
            "out_proj" => Some(&mut self.out_proj),
            _ => None,
        }
    }

    /// The layer's output for the normed input `x` (`[rows, hidden]`); each sequence's rows
    /// continue its state `states[seq]` in layer `layer` of `pool`.
    pub(super) fn forward(
        &self,
        x: &Tensor,
        meta: &AttentionMetadata,
        states: &[Option<StateRef>],
        (pool, layer): (&StatePool, usize),
        inv: GemmOptions,
    ) -> Result<Tensor> {
        let n = x.dim(0)?;
        let (hv, dv) = (self.params.dims.value_heads, self.params.dims.value_dim);
        let qkv = self.in_qkv.apply(x, inv)?;
        let z = self.in_z.apply(x, inv)?;
        let b = self.in_b.apply(x, inv)?;
        let a = self.in_a.apply(x, inv)?;
        let core =
            ops::gated_delta_rule((&qkv, &a, &b), &self.params, meta, states, (pool, layer))?
                .to_dtype(x.dtype())?
                .reshape((n * hv, dv))?;
        let normed = ops::rms_norm(&core, &self.norm, self.eps)?;
        let gated = ops::gated(&z.reshape((n * hv, dv))?, &normed, Activation::Silu)?;
        Ok(self.out_proj.apply(&gated.reshape((n, hv * dv))?, inv)?)
    }
}
