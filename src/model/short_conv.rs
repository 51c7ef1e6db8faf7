//! LFM2's gated short-convolution layer (transformers' `Lfm2ShortConv`), in place of attention
//! in most of its layers: `out_proj(C ⊙ conv(B ⊙ x))` with B, C, x the three thirds of
//! `in_proj` of the normed input.
//!
//! Its state is the last `kernel - 1` tokens' `B ⊙ x`. Rather than a per-sequence state that
//! rollback would have to rewind, each token's `B ⊙ x` is written to the paged cache at its
//! slot, as attention writes its keys and values, and the convolution reads the rows it needs
//! from there (`ops::short_conv`). DVR's rollback, prefix sharing, preemption and the verifier's
//! overwrite of a window then hold for these layers with no code of their own, at the cost of
//! one `hidden`-wide row per token and layer (LFM2-1.2B: 2048 values, where an attention
//! layer's key and value take 1024; docs/models.md weighs it against per-sequence states).

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_core::Tensor;

use crate::config::{ModelConfig, ShortConvConfig};
use crate::error::Result;
use crate::ops::{self, AttentionMetadata, ConvTaps};

use super::linear::{GemmOptions, Linear};
use super::loader::{host_vector, WeightLoader};

/// One layer's convolution.
#[derive(Debug)]
pub(super) struct ShortConv {
    /// `[3 · hidden, hidden]`: B, C, x.
    pub(super) in_proj: Linear,
    /// The convolution's taps and bias on the host, rounded to the weights' dtype.
    pub(super) taps: ConvTaps,
    pub(super) out_proj: Linear,
}

/// A layer's convolution parameters under `conv.` by name (`in_proj.weight`, `conv.weight`, ...)
/// with their shapes.
pub(super) fn conv_params(
    cfg: &ModelConfig,
    conv: &ShortConvConfig,
) -> BTreeMap<String, Vec<usize>> {
    let hs = cfg.hidden_size;
    let mut m = BTreeMap::new();
    m.insert("in_proj.weight".into(), vec![3 * hs, hs]);
    m.insert("out_proj.weight".into(), vec![hs, hs]);
    m.insert("conv.weight".into(), vec![hs, 1, conv.kernel]);
    if conv.bias {
        m.insert("in_proj.bias".into(), vec![3 * hs]);
        m.insert("out_proj.bias".into(), vec![hs]);
        m.insert("conv.bias".into(), vec![hs]);
    }
    m
}

impl ShortConv {
    /// Layer `prefix`'s (`model.layers.{i}`) convolution.
    pub(super) fn load(
        ld: &WeightLoader<'_>,
        cfg: &ModelConfig,
        conv: &ShortConvConfig,
        prefix: &str,
    ) -> Result<Self> {
        let hs = cfg.hidden_size;
        let name = |n: &str| format!("{prefix}.conv.{n}");
        let taps = ConvTaps {
            weight: host_vector(&ld.load(&name("conv.weight"), &[hs, 1, conv.kernel])?)?,
            bias: conv
                .bias
                .then(|| host_vector(&ld.load(&name("conv.bias"), &[hs])?))
                .transpose()?,
            kernel: conv.kernel,
        };
        Ok(Self {
            in_proj: ld.linear(&name("in_proj"), hs, 3 * hs, conv.bias)?,
            taps,
            out_proj: ld.linear(&name("out_proj"), hs, hs, conv.bias)?,
        })
    }

    /// The layer's output for the normed input `x` (`[rows, hidden]`): each row's `B ⊙ x` is
    /// written to `rows` (the layer's cache) at its slot first, then read back with the rows
    /// before it.
    pub(super) fn forward(
        &self,
        x: &Tensor,
        rows: &Tensor,
        slots: Arc<Vec<u32>>,
        meta: &AttentionMetadata,
        inv: GemmOptions,
    ) -> Result<Tensor> {
        let hs = x.dim(1)?;
        let bcx = self.in_proj.apply(x, inv)?;
        let (b, c, xs) = (
            bcx.narrow(1, 0, hs)?,
            bcx.narrow(1, hs, hs)?,
            bcx.narrow(1, 2 * hs, hs)?,
        );
        ops::write_kv(rows, &b.mul(&xs)?, slots)?;
        let conv = ops::short_conv(rows, &self.taps, meta)?;
        let y = c.mul(&conv.to_dtype(c.dtype())?)?;
        Ok(self.out_proj.apply(&y, inv)?)
    }
}
