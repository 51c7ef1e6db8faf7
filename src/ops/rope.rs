//! Rotary position embedding (non-interleaved, "rotate half" as in transformers' Llama).

use candle_core::{bail, CpuStorage, CustomOp3, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::contiguous_f32;

struct Rope;

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        "detspec-rope"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        cs: &CpuStorage,
        cl: &Layout,
        ss: &CpuStorage,
        sl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(xs, xl, "rope input")?;
        let cos = contiguous_f32(cs, cl, "rope cos")?;
        let sin = contiguous_f32(ss, sl, "rope sin")?;
        let (t, h, d) = match xl.dims() {
            [t, h, d] => (*t, *h, *d),
            dims => bail!("rope: expected input [tokens, heads, head_dim], got {dims:?}"),
        };
        let half = d / 2;
        if d % 2 != 0 || cl.dims() != [t, half] || sl.dims() != [t, half] {
            bail!(
                "rope: cos/sin must be [{t}, {half}], got {:?} / {:?}",
                cl.dims(),
                sl.dims()
            );
        }
        let mut out = vec![0f32; x.len()];
        out.par_chunks_mut(h * d)
            .zip(x.par_chunks(h * d))
            .enumerate()
            .for_each(|(row, (o, xr))| {
                let c = &cos[row * half..(row + 1) * half];
                let s = &sin[row * half..(row + 1) * half];
                for (oh, xh) in o.chunks_mut(d).zip(xr.chunks(d)) {
                    for i in 0..half {
                        let (x1, x2) = (xh[i], xh[i + half]);
                        oh[i] = x1 * c[i] - x2 * s[i];
                        oh[i + half] = x2 * c[i] + x1 * s[i];
                    }
                }
            });
        Ok((CpuStorage::F32(out), xl.shape().clone()))
    }
}

/// Rotates `x` `[tokens, heads, head_dim]` by per-token angles; `cos`/`sin` are `[tokens, head_dim/2]`
/// (already gathered at each token's absolute position).
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op3_no_bwd(cos, sin, &Rope)
}
