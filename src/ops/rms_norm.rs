//! RMSNorm over the last dimension.

use std::mem::MaybeUninit;

use candle_core::{bail, CpuStorage, CustomOp2, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::isa::isa_kernel;
use super::CpuIsa;
use super::{contiguous_f32, filled_f32};

/// Rows per task. Each row's sum of squares is one sequential chain (its order fixed by `dim`
/// alone), but the chains of a task's rows run interleaved: one chain alone waits out every
/// add's latency (a prefill spent ~2 % of its time there).
const ROWS_PER_TASK: usize = 8;

isa_kernel! {
    /// Normalises up to [`ROWS_PER_TASK`] rows of `x` (`w.len()` each) into `out`.
    fn norm_rows(isa: CpuIsa, out: &mut [MaybeUninit<f32>], x: &[f32], w: &[f32], eps: f32) {
        let dim = w.len();
        let mut sum_sq = [0f32; ROWS_PER_TASK];
        for i in 0..dim {
            for (s, row) in sum_sq.iter_mut().zip(x.chunks_exact(dim)) {
                *s += row[i] * row[i];
            }
        }
        for ((o, row), s) in out.chunks_exact_mut(dim).zip(x.chunks_exact(dim)).zip(sum_sq) {
            let inv = 1.0 / (s / dim as f32 + eps).sqrt();
            for ((o, &v), &g) in o.iter_mut().zip(row).zip(w) {
                o.write(g * (v * inv));
            }
        }
    }
}

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
        let eps = self.eps;
        // Every row of `out` is written: x's length is a multiple of `dim` (its last dim).
        let out = filled_f32(x.len(), |out| {
            out.par_chunks_mut(dim * ROWS_PER_TASK)
                .zip(x.par_chunks(dim * ROWS_PER_TASK))
                .for_each(|(o, rows)| norm_rows(CpuIsa::detect(), o, rows, w, eps))
        });
        Ok((CpuStorage::F32(out), xl.shape().clone()))
    }

    /// One block per row (`cuda/rms_norm.cu`): the same row-local reduction order at any batch.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda::{self, with_float_type};
        use candle_core::backend::BackendStorage;
        use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
        use candle_core::cuda::WrapErr;

        let dim = wl.shape().elem_count();
        if dim == 0 || xl.dims().last() != Some(&dim) {
            bail!(
                "rms_norm: weight of {dim} elements does not match input {:?}",
                xl.dims()
            );
        }
        if xs.dtype() != ws.dtype() {
            bail!(
                "rms_norm: input {:?} and weight {:?} dtypes differ",
                xs.dtype(),
                ws.dtype()
            );
        }
        let rows = xl.shape().elem_count() / dim;
        let dev = xs.device();
        let f = cuda::kernel(dev, &cuda::RMS_NORM, "rms_norm", xs.dtype())?;
        let dim_arg = cuda::arg_i32(dim, "rms_norm dim")?;
        let grid = u32::try_from(rows.max(1)).or_else(|_| bail!("rms_norm: {rows} rows"))?;
        with_float_type!(xs.dtype(), "rms_norm", |T| {
            let x = cuda::view::<T>(xs, xl, "rms_norm input")?;
            let w = cuda::view::<T>(ws, wl, "rms_norm weight")?;
            // SAFETY: every element is written by the kernel before anyone reads it.
            let mut out = unsafe { dev.alloc::<T>(rows * dim)? };
            if rows > 0 {
                let stream = dev.cuda_stream();
                let mut b = stream.launch_builder(&f);
                b.arg(&x).arg(&w).arg(&mut out).arg(&dim_arg).arg(&self.eps);
                let cfg = LaunchConfig {
                    grid_dim: (grid, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: argument types and order match `rms_norm_*` in cuda/rms_norm.cu.
                unsafe { b.launch(cfg) }.w()?;
            }
            Ok((
                candle_core::CudaStorage::wrap_cuda_slice(out, dev.clone()),
                xl.shape().clone(),
            ))
        })
    }
}

/// `x * rsqrt(mean(x^2) + eps) * weight` over the last dimension of `x`.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    x.contiguous()?
        .apply_op2_no_bwd(weight, &RmsNorm { eps: eps as f32 })
}
