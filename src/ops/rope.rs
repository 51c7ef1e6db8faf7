//! Rotary position embedding (non-interleaved, "rotate half" as in transformers' Llama).

use std::mem::MaybeUninit;

use candle_core::{bail, CpuStorage, CustomOp3, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::isa::isa_kernel;
use super::CpuIsa;
use super::{contiguous_f32, filled_f32};

isa_kernel! {
    /// One token's heads (`x` and `out` are `heads × 2·half`), rotated by its angles.
    fn rotate_row(isa: CpuIsa, out: &mut [MaybeUninit<f32>], x: &[f32], cos: &[f32], sin: &[f32]) {
        let half = cos.len();
        for (oh, xh) in out.chunks_exact_mut(2 * half).zip(x.chunks_exact(2 * half)) {
            let (o1, o2) = oh.split_at_mut(half);
            let (x1, x2) = xh.split_at(half);
            for i in 0..half {
                o1[i].write(x1[i] * cos[i] - x2[i] * sin[i]);
                o2[i].write(x2[i] * cos[i] + x1[i] * sin[i]);
            }
        }
    }
}

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
        let (_, h, d) = rope_dims(xl, cl, sl)?;
        let half = d / 2;
        // Every element is written: rows of h heads of d = 2 · half values each.
        let out = filled_f32(x.len(), |out| {
            out.par_chunks_mut(h * d)
                .zip(x.par_chunks(h * d))
                .enumerate()
                .for_each(|(row, (o, xr))| {
                    let c = &cos[row * half..(row + 1) * half];
                    let s = &sin[row * half..(row + 1) * half];
                    rotate_row(CpuIsa::detect(), o, xr, c, s);
                })
        });
        Ok((CpuStorage::F32(out), xl.shape().clone()))
    }

    /// `x` in the model's dtype, `cos`/`sin` in f32 (`cuda/rope.cu`).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        cs: &candle_core::CudaStorage,
        cl: &Layout,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda::{self, with_float_type};
        use candle_core::backend::BackendStorage;
        use candle_core::cuda::cudarc::driver::PushKernelArg;
        use candle_core::cuda::WrapErr;

        let (t, h, d) = rope_dims(xl, cl, sl)?;
        let dev = xs.device();
        let f = cuda::kernel(dev, &cuda::ROPE, "rope", xs.dtype())?;
        let cos = cuda::view::<f32>(cs, cl, "rope cos")?;
        let sin = cuda::view::<f32>(ss, sl, "rope sin")?;
        let args = [
            cuda::arg_i32(t, "rope tokens")?,
            cuda::arg_i32(h, "rope heads")?,
            cuda::arg_i32(d, "rope head_dim")?,
        ];
        with_float_type!(xs.dtype(), "rope", |T| {
            let x = cuda::view::<T>(xs, xl, "rope input")?;
            // SAFETY: the kernel writes every element (both halves of every head).
            let mut out = unsafe { dev.alloc::<T>(t * h * d)? };
            if t * h * d > 0 {
                let stream = dev.cuda_stream();
                let mut b = stream.launch_builder(&f);
                b.arg(&x).arg(&cos).arg(&sin).arg(&mut out);
                b.arg(&args[0]).arg(&args[1]).arg(&args[2]);
                // SAFETY: argument types and order match `rope_*` in cuda/rope.cu.
                unsafe { b.launch(cuda::grid_1d(t * h * d / 2)) }.w()?;
            }
            Ok((
                candle_core::CudaStorage::wrap_cuda_slice(out, dev.clone()),
                xl.shape().clone(),
            ))
        })
    }
}

/// `(tokens, heads, head_dim)` of a rope call, after checking cos/sin against them.
fn rope_dims(xl: &Layout, cl: &Layout, sl: &Layout) -> candle_core::Result<(usize, usize, usize)> {
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
    Ok((t, h, d))
}

/// Rotates `x` `[tokens, heads, head_dim]` by per-token angles; `cos`/`sin` are `[tokens, head_dim/2]`
/// (already gathered at each token's absolute position).
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op3_no_bwd(cos, sin, &Rope)
}
