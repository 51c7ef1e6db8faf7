//! RMSNorm over the last dimension.

use candle_core::{bail, CpuStorage, CustomOp2, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::contiguous_f32;

struct RmsNorm {
    eps: f32,
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "detspec-rms-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(xs, xl, "rms_norm input")?;
        let w = contiguous_f32(ws, wl, "rms_norm weight")?;
        let dim = w.len();
        if dim == 0 || xl.dims().last() != Some(&dim) {
            bail!(
                "rms_norm: weight of {dim} elements does not match input {:?}",
                xl.dims()
            );
        }
        let mut out = vec![0f32; x.len()];
        let eps = self.eps;
        out.par_chunks_mut(dim)
            .zip(x.par_chunks(dim))
            .for_each(|(o, row)| {
                // Sequential sum: the reduction order is fixed by `dim` alone.
                let mut sum_sq = 0f32;
                for &v in row {
                    sum_sq += v * v;
                }
                let inv = 1.0 / (sum_sq / dim as f32 + eps).sqrt();
                for ((o, &v), &g) in o.iter_mut().zip(row).zip(w) {
                    *o = g * (v * inv);
                }
            });
        Ok((CpuStorage::F32(out), xl.shape().clone()))
    }
}

/// `x * rsqrt(mean(x^2) + eps) * weight` over the last dimension of `x`.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    x.contiguous()?
        .apply_op2_no_bwd(weight, &RmsNorm { eps: eps as f32 })
}
