//! Granite 4.0-H's Mamba2 mixer (transformers' `GraniteMoeHybridMambaLayer`), in place of
//! attention in most of its layers: `in_proj` of the normed input into a gate `z`, the
//! convolution's input `xBC` and a time step per head; the convolution and the selective scan
//! over the sequence's recurrent state (`ops::mamba2_scan`, state in `kv::state`); the output
//! gated by `silu(z)`, then RMS-normed per group (`norm`); `out_proj`.

use std::collections::BTreeMap;

use candle_core::Tensor;

use crate::config::{Activation, MambaConfig, ModelConfig};
use crate::error::Result;
use crate::kv::{StatePool, StateRef};
use crate::ops::{self, AttentionMetadata, Mamba2Params};

use super::linear::{GemmOptions, Linear};
use super::loader::{host_vector, WeightLoader};

/// One layer's Mamba2 mixer.
#[derive(Debug)]
pub(super) struct Mamba2Mixer {
    /// `[inner + conv_dim + heads, hidden]`: `z`, `xBC`, the time steps.
    in_proj: Linear,
    pub(super) params: Mamba2Params,
    /// The gated norm's weight `[inner]` (plain: it scales by `w`).
    pub(super) norm: Tensor,
    /// `[inner / groups]` ones: the per-group norm's own weight, the scaling left to `norm`.
    group_ones: Tensor,
    out_proj: Linear,
    eps: f64,
}

/// A layer's Mamba2 parameters under `mamba.`, by name, with their shapes.
pub(super) fn mamba_params(cfg: &ModelConfig, m: &MambaConfig) -> BTreeMap<String, Vec<usize>> {
    let hs = cfg.hidden_size;
    let d = &m.dims;
    let mut p = BTreeMap::new();
    p.insert("in_proj.weight".into(), vec![d.in_proj_dim(), hs]);
    p.insert("out_proj.weight".into(), vec![hs, d.inner()]);
    if m.proj_bias {
        p.insert("in_proj.bias".into(), vec![d.in_proj_dim()]);
        p.insert("out_proj.bias".into(), vec![hs]);
    }
    p.insert("conv1d.weight".into(), vec![d.conv_dim(), 1, d.kernel]);
    if m.conv_bias {
        p.insert("conv1d.bias".into(), vec![d.conv_dim()]);
    }
    for name in ["A_log", "D", "dt_bias"] {
        p.insert(name.into(), vec![d.heads]);
    }
    p.insert("norm.weight".into(), vec![d.inner()]);
    p
}

impl Mamba2Mixer {
    /// Layer `prefix`'s (`model.layers.{i}`) mixer.
    pub(super) fn load(
        ld: &WeightLoader<'_>,
        cfg: &ModelConfig,
        m: &MambaConfig,
        prefix: &str,
    ) -> Result<Self> {
        let hs = cfg.hidden_size;
        let d = m.dims;
        let name = |n: &str| format!("{prefix}.mamba.{n}");
        let vector = |n: &str, len: usize| host_vector(&ld.load(&name(n), &[len])?);
        let params = Mamba2Params {
            dims: d,
            conv: host_vector(&ld.load(&name("conv1d.weight"), &[d.conv_dim(), 1, d.kernel])?)?,
            conv_bias: m
                .conv_bias
                .then(|| vector("conv1d.bias", d.conv_dim()))
                .transpose()?,
            a_log: vector("A_log", d.heads)?,
            dt_bias: vector("dt_bias", d.heads)?,
            d: vector("D", d.heads)?,
        };
        let norm = ld.norm(&name("norm.weight"), &[d.inner()], 0.0)?;
        Ok(Self {
            in_proj: ld.linear(&name("in_proj"), hs, d.in_proj_dim(), m.proj_bias)?,
            params,
            group_ones: Tensor::ones(d.inner() / d.groups, norm.dtype(), norm.device())?,
            norm,
            out_proj: ld.linear(&name("out_proj"), d.inner(), hs, m.proj_bias)?,
            eps: cfg.rms_norm_eps,
        })
    }

    /// The linear layer named `module` under `mamba.` (for updates).
    pub(super) fn linear_mut(&mut self, module: &str) -> Option<&mut Linear> {
        match module {
            "in_proj" => Some(&mut self.in_proj),
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
        let d = self.params.dims;
        let (inner, groups) = (d.inner(), d.groups);
        let proj = self.in_proj.apply(x, inv)?;
        let z = proj.narrow(1, 0, inner)?;
        let xbc = proj.narrow(1, inner, d.conv_dim())?;
        let dt = proj.narrow(1, inner + d.conv_dim(), d.heads)?;
        let y = ops::mamba2_scan((&xbc, &dt), &self.params, meta, states, (pool, layer))?
            .to_dtype(x.dtype())?;
        // y · silu(z), normed over each group of `inner / groups`, then times the weight (as
        // transformers: normed, rounded to the activations' dtype, scaled).
        let gated = ops::gated(&z.contiguous()?, &y, Activation::Silu)?;
        let ones = self.group_ones.to_dtype(gated.dtype())?;
        let normed = ops::rms_norm(
            &gated.reshape((n * groups, inner / groups))?,
            &ones,
            self.eps,
        )?
        .reshape((n, inner))?;
        let scaled = normed.broadcast_mul(&self.norm.to_dtype(normed.dtype())?)?;
        Ok(self.out_proj.apply(&scaled, inv)?)
    }
}
