//! Qwen3-Next's and Qwen3.5's gated DeltaNet layer (transformers' `Qwen3NextGatedDeltaNet`,
//! `Qwen3_5GatedDeltaNet`), in place of attention in three of every four layers: projections
//! of the normed input, the convolution and delta rule over the sequence's recurrent state
//! (`ops::gated_delta_rule`, state in `kv::state`), a per-head RMSNorm gated by `silu(z)`,
//! and `out_proj`. Qwen3-Next's checkpoints store the input projections grouped by key head
//! (`DeltaNetProjections::GroupedByKeyHead`); they are read into Qwen3.5's split form.

use std::collections::BTreeMap;

use candle_core::Tensor;

use crate::config::{
    Activation, DeltaNetDims, DeltaNetProjections, LinearAttentionConfig, ModelConfig,
};
use crate::error::Result;
use crate::kv::{StatePool, StateRef};
use crate::ops::{self, AttentionMetadata, DeltaNetParams};

use super::linear::{GemmOptions, Linear, LinearWeight};
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

/// A layer's DeltaNet parameters under `linear_attn.`, by name, with their shapes (as the
/// checkpoint stores them).
pub(super) fn delta_net_params(
    cfg: &ModelConfig,
    la: &LinearAttentionConfig,
) -> BTreeMap<String, Vec<usize>> {
    let hs = cfg.hidden_size;
    let d = &la.dims;
    let (hv, dv) = (d.value_heads, d.value_dim);
    let mut m = BTreeMap::new();
    match la.projections {
        DeltaNetProjections::Split => {
            m.insert("in_proj_qkv.weight".into(), vec![d.conv_dim(), hs]);
            m.insert("in_proj_z.weight".into(), vec![hv * dv, hs]);
            m.insert("in_proj_b.weight".into(), vec![hv, hs]);
            m.insert("in_proj_a.weight".into(), vec![hv, hs]);
        }
        DeltaNetProjections::GroupedByKeyHead => {
            m.insert(
                "in_proj_qkvz.weight".into(),
                vec![d.conv_dim() + hv * dv, hs],
            );
            m.insert("in_proj_ba.weight".into(), vec![2 * hv, hs]);
        }
    }
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
        la: &LinearAttentionConfig,
        prefix: &str,
    ) -> Result<Self> {
        let hs = cfg.hidden_size;
        let d = &la.dims;
        let (hv, dv) = (d.value_heads, d.value_dim);
        let name = |n: &str| format!("{prefix}.linear_attn.{n}");
        let linear = |w: &Tensor| -> Result<Linear> {
            Ok(Linear {
                weight: LinearWeight::new(w, ld.bf16_act())?,
                bias: None,
            })
        };
        let [in_qkv, in_z, in_b, in_a] = match la.projections {
            DeltaNetProjections::Split => [
                ld.linear(&name("in_proj_qkv"), hs, d.conv_dim(), false)?,
                ld.linear(&name("in_proj_z"), hs, hv * dv, false)?,
                ld.linear(&name("in_proj_b"), hs, hv, false)?,
                ld.linear(&name("in_proj_a"), hs, hv, false)?,
            ],
            DeltaNetProjections::GroupedByKeyHead => {
                let qkvz =
                    ld.load_matrix(&name("in_proj_qkvz.weight"), &[d.conv_dim() + hv * dv, hs])?;
                let ba = ld.load_matrix(&name("in_proj_ba.weight"), &[2 * hv, hs])?;
                let ([qkv, z], [b, a]) = (ungroup_qkvz(&qkvz, d)?, ungroup_ba(&ba, d)?);
                [linear(&qkv)?, linear(&z)?, linear(&b)?, linear(&a)?]
            }
        };
        let params = DeltaNetParams {
            dims: *d,
            conv: host_vector(&ld.load(&name("conv1d.weight"), &[d.conv_dim(), 1, d.kernel])?)?,
            a_log: host_vector(&ld.load(&name("A_log"), &[hv])?)?,
            dt_bias: host_vector(&ld.load(&name("dt_bias"), &[hv])?)?,
        };
        Ok(Self {
            in_qkv,
            in_z,
            in_b,
            in_a,
            params,
            norm: ld.norm(&name("norm.weight"), &[dv], 0.0)?,
            out_proj: ld.linear(&name("out_proj"), hv * dv, hs, false)?,
            eps: cfg.rms_norm_eps,
        })
    }

    /// Replaces the grouped projection `module` (`in_proj_qkvz`, `in_proj_ba`) of a
    /// Qwen3-Next checkpoint with `w` (checked by `params::check_update`): the linear layers
    /// it holds, read as at load.
    pub(super) fn set_grouped(&mut self, module: &str, w: &Tensor, bf16_act: bool) -> Result<()> {
        let d = self.params.dims;
        let (first, second, [x, y]) = match module {
            "in_proj_qkvz" => (&mut self.in_qkv, &mut self.in_z, ungroup_qkvz(w, &d)?),
            "in_proj_ba" => (&mut self.in_b, &mut self.in_a, ungroup_ba(w, &d)?),
            _ => return Err(super::params::unknown(module)),
        };
        first.weight = LinearWeight::new(&x, bf16_act)?;
        second.weight = LinearWeight::new(&y, bf16_act)?;
        Ok(())
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
/// Qwen3-Next's `in_proj_qkvz` (`[key_heads · (2 · key_dim + 2 · r · value_dim), hidden]`,
/// `r` value heads per key head: per key head its query, its key, its `r` values, their `r`
/// gates) as Qwen3.5's `in_proj_qkv` (every query, every key, every value) and `in_proj_z`.
fn ungroup_qkvz(w: &Tensor, d: &DeltaNetDims) -> candle_core::Result<[Tensor; 2]> {
    let (hk, dk) = (d.key_heads, d.key_dim);
    let rv = d.value_heads / hk * d.value_dim;
    let hidden = w.dim(1)?;
    let g = w.reshape((hk, 2 * dk + 2 * rv, hidden))?;
    let part = |at: usize, len: usize| g.narrow(1, at, len)?.reshape((hk * len, hidden));
    let qkv = Tensor::cat(&[part(0, dk)?, part(dk, dk)?, part(2 * dk, rv)?], 0)?;
    Ok([qkv.contiguous()?, part(2 * dk + rv, rv)?.contiguous()?])
}

/// Qwen3-Next's `in_proj_ba` (`[2 · value_heads, hidden]`: per key head the `b` rows of its
/// value heads, then their `a` rows) as `in_proj_b` and `in_proj_a`.
fn ungroup_ba(w: &Tensor, d: &DeltaNetDims) -> candle_core::Result<[Tensor; 2]> {
    let (hk, r) = (d.key_heads, d.value_heads / d.key_heads);
    let hidden = w.dim(1)?;
    let g = w.reshape((hk, 2 * r, hidden))?;
    let part = |at: usize| g.narrow(1, at, r)?.reshape((hk * r, hidden))?.contiguous();
    Ok([part(0)?, part(r)?])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each row of a grouped matrix holds its own index: the split form's rows say where they
    /// came from.
    fn rows_of(t: &Tensor) -> Vec<u32> {
        t.narrow(1, 0, 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .into_iter()
            .map(|x| x as u32)
            .collect()
    }

    #[test]
    fn grouped_projections_are_read_into_the_split_form() {
        // 2 key heads of 2, 4 value heads of 1 (two per key head): per key head q q k k v v z z.
        let d = DeltaNetDims {
            kernel: 4,
            key_heads: 2,
            value_heads: 4,
            key_dim: 2,
            value_dim: 1,
        };
        let grouped = |n: usize| {
            let v: Vec<f32> = (0..n).flat_map(|r| [r as f32; 3]).collect();
            Tensor::from_vec(v, (n, 3), &candle_core::Device::Cpu).unwrap()
        };
        let [qkv, z] = ungroup_qkvz(&grouped(16), &d).unwrap();
        // Queries of both key heads, their keys, then the values in value-head order.
        assert_eq!(rows_of(&qkv), [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13]);
        assert_eq!(rows_of(&z), [6, 7, 14, 15]);
        let [b, a] = ungroup_ba(&grouped(8), &d).unwrap();
        assert_eq!(
            (rows_of(&b), rows_of(&a)),
            (vec![0, 1, 4, 5], vec![2, 3, 6, 7])
        );
    }
}
