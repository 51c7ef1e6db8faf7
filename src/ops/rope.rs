//! Rotary position embedding: of each head, the first `2 · half` dimensions rotate, where
//! `half` is the cos/sin tables' width, and the rest pass through (partial rotary,
//! Phi-4-mini's and GLM's). Pair `i` (angle `i`) is dimensions `i` and `i + half` ("rotate
//! half", transformers' Llama), or `2i` and `2i + 1` ([`apply_rope_interleaved`], GLM's).

use std::mem::MaybeUninit;

use candle_core::{bail, CpuStorage, CustomOp3, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::isa::isa_kernel;
use super::CpuIsa;
use super::{contiguous_f32, filled_f32};

isa_kernel! {
    /// One token's heads (`x` and `out` are `heads × dim`), rotated by its angles.
    fn rotate_row(
        isa: CpuIsa,
        out: &mut [MaybeUninit<f32>],
        x: &[f32],
        cos: &[f32],
        sin: &[f32],
        dim: usize,
        interleaved: bool,
    ) {
        let half = cos.len();
        for (oh, xh) in out.chunks_exact_mut(dim).zip(x.chunks_exact(dim)) {
            let (o_rot, o_pass) = oh.split_at_mut(2 * half);
            let (x_rot, x_pass) = xh.split_at(2 * half);
            if interleaved {
                for (i, (o, x)) in o_rot.chunks_exact_mut(2).zip(x_rot.chunks_exact(2)).enumerate() {
                    o[0].write(x[0] * cos[i] - x[1] * sin[i]);
                    o[1].write(x[1] * cos[i] + x[0] * sin[i]);
                }
            } else {
                let (o1, o2) = o_rot.split_at_mut(half);
                let (x1, x2) = x_rot.split_at(half);
                for i in 0..half {
                    o1[i].write(x1[i] * cos[i] - x2[i] * sin[i]);
                    o2[i].write(x2[i] * cos[i] + x1[i] * sin[i]);
                }
            }
            for (o, &v) in o_pass.iter_mut().zip(x_pass) {
                o.write(v);
            }
        }
    }
}

/// The rope op; `interleaved`: pairs of neighbours (GLM's) rather than of halves.
struct Rope {
    interleaved: bool,
}

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
        let (_, h, d, half) = rope_dims(xl, cl, sl)?;
        // Every element is written: rows of h heads of d values each.
        let out = filled_f32(x.len(), |out| {
            out.par_chunks_mut(h * d)
                .zip(x.par_chunks(h * d))
                .enumerate()
                .for_each(|(row, (o, xr))| {
                    let c = &cos[row * half..(row + 1) * half];
                    let s = &sin[row * half..(row + 1) * half];
                    rotate_row(CpuIsa::detect(), o, xr, c, s, d, self.interleaved);
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

        let (t, h, d, half) = rope_dims(xl, cl, sl)?;
        whole_heads(d, half)?;
        if self.interleaved {
            bail!("rope: the CUDA kernels pair halves, not neighbours (GLM's rope)");
        }
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

/// `(tokens, heads, head_dim, half)` of a rope call (`half`: the rotating pairs per head, the
/// tables' width), after checking cos/sin against them.
fn rope_dims(
    xl: &Layout,
    cl: &Layout,
    sl: &Layout,
) -> candle_core::Result<(usize, usize, usize, usize)> {
    let (t, h, d) = match xl.dims() {
        [t, h, d] => (*t, *h, *d),
        dims => bail!("rope: expected input [tokens, heads, head_dim], got {dims:?}"),
    };
    let half = match cl.dims() {
        [_, half] => *half,
        dims => bail!("rope: cos must be [tokens, rotary_dim/2], got {dims:?}"),
    };
    if half == 0 || 2 * half > d || cl.dims() != [t, half] || sl.dims() != [t, half] {
        bail!(
            "rope: cos/sin must be [{t}, n] with 0 < 2n <= head_dim {d}, got {:?} / {:?}",
            cl.dims(),
            sl.dims()
        );
    }
    Ok((t, h, d, half))
}

/// The CUDA kernels rotate whole heads: a partial rotation is refused there (the engine
/// refuses such a model on a GPU at load, naming `partial_rotary_factor`).
#[cfg(feature = "cuda")]
pub(super) fn whole_heads(head_dim: usize, half: usize) -> candle_core::Result<()> {
    if 2 * half != head_dim {
        bail!(
            "rope: the CUDA kernels rotate whole heads, not {} of {head_dim} dimensions",
            2 * half
        );
    }
    Ok(())
}

/// The stacked q/k/v projection's output `[tokens, (q_heads + 2 kv_heads) · head_dim]` (per
/// token its q heads, k heads, v heads) split into q and k rotated and v copied, as three
/// contiguous planes of one tensor: on a GPU one launch where the separate projections took a
/// rope each for q and k.
pub(super) struct RopeQkv {
    pub(super) q_heads: usize,
    pub(super) kv_heads: usize,
}

impl RopeQkv {
    /// `(tokens, head_dim, half)` (`half`: the rotating pairs per head, the tables' width),
    /// after checking `qkv` and cos/sin against them.
    pub(super) fn dims(
        &self,
        xl: &Layout,
        cl: &Layout,
        sl: &Layout,
    ) -> candle_core::Result<(usize, usize, usize)> {
        let (t, half) = match cl.dims() {
            [t, half] => (*t, *half),
            dims => bail!("rope_qkv: cos must be [tokens, rotary_dim/2], got {dims:?}"),
        };
        let heads = self.q_heads + 2 * self.kv_heads;
        let width = match xl.dims() {
            [rows, width] if *rows == t => *width,
            dims => bail!(
                "rope_qkv: qkv must be [{t}, (q_heads + 2 kv_heads) x head_dim], got {dims:?}"
            ),
        };
        let d = width / heads.max(1);
        if d * heads != width
            || sl.dims() != cl.dims()
            || half == 0
            || 2 * half > d
            || self.kv_heads == 0
        {
            bail!(
                "rope_qkv: qkv {:?} is not [{t}, ({} + 2 x {}) x head_dim] with head_dim >= \
                 2 x {half}, or sin {:?} is not cos's {:?}",
                xl.dims(),
                self.q_heads,
                self.kv_heads,
                sl.dims(),
                cl.dims()
            );
        }
        Ok((t, d, half))
    }
}

impl CustomOp3 for RopeQkv {
    fn name(&self) -> &'static str {
        "detspec-rope-qkv"
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
        let x = contiguous_f32(xs, xl, "rope_qkv input")?;
        let cos = contiguous_f32(cs, cl, "rope_qkv cos")?;
        let sin = contiguous_f32(ss, sl, "rope_qkv sin")?;
        let (t, d, half) = self.dims(xl, cl, sl)?;
        let (q, kv) = (self.q_heads * d, self.kv_heads * d);
        // Every element is written: per token, its q and k heads rotated into their planes
        // and its v heads copied into theirs.
        let out = filled_f32(x.len(), |out| {
            let (q_plane, rest) = out.split_at_mut(t * q);
            let (k_plane, v_plane) = rest.split_at_mut(t * kv);
            q_plane
                .par_chunks_mut(q)
                .zip(k_plane.par_chunks_mut(kv))
                .zip(v_plane.par_chunks_mut(kv))
                .zip(x.par_chunks(q + 2 * kv))
                .enumerate()
                .for_each(|(row, (((qo, ko), vo), xr))| {
                    let c = &cos[row * half..(row + 1) * half];
                    let s = &sin[row * half..(row + 1) * half];
                    let isa = CpuIsa::detect();
                    rotate_row(isa, qo, &xr[..q], c, s, d, false);
                    rotate_row(isa, ko, &xr[q..q + kv], c, s, d, false);
                    for (o, &v) in vo.iter_mut().zip(&xr[q + kv..]) {
                        o.write(v);
                    }
                })
        });
        Ok((CpuStorage::F32(out), Shape::from(x.len())))
    }

    /// `cuda/rope.cu`'s `rope_qkv`: each pair rotated by the function `rope` uses.
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

        let (t, d, half) = self.dims(xl, cl, sl)?;
        whole_heads(d, half)?;
        let n = xl.shape().elem_count();
        let dev = xs.device();
        let f = cuda::kernel(dev, &cuda::ROPE, "rope_qkv", xs.dtype())?;
        let cos = cuda::view::<f32>(cs, cl, "rope_qkv cos")?;
        let sin = cuda::view::<f32>(ss, sl, "rope_qkv sin")?;
        let args = [
            cuda::arg_i32(t, "rope_qkv tokens")?,
            cuda::arg_i32(self.q_heads, "rope_qkv q_heads")?,
            cuda::arg_i32(self.kv_heads, "rope_qkv kv_heads")?,
            cuda::arg_i32(d, "rope_qkv head_dim")?,
        ];
        with_float_type!(xs.dtype(), "rope_qkv", |T| {
            let x = cuda::view::<T>(xs, xl, "rope_qkv input")?;
            // SAFETY: the kernel writes every element (both halves of every head).
            let mut out = unsafe { dev.alloc::<T>(n.max(1))? };
            if n > 0 {
                let stream = dev.cuda_stream();
                let mut b = stream.launch_builder(&f);
                b.arg(&x).arg(&cos).arg(&sin).arg(&mut out);
                for a in &args {
                    b.arg(a);
                }
                // SAFETY: argument types and order match `rope_qkv_*` in cuda/rope.cu.
                unsafe { b.launch(cuda::grid_1d(n / 2)) }.w()?;
            }
            Ok((
                candle_core::CudaStorage::wrap_cuda_slice(out, dev.clone()),
                Shape::from(n),
            ))
        })
    }
}

/// The stacked q/k/v projection's output `qkv` `[tokens, (q_heads + 2 kv_heads) · head_dim]`
/// split into `(q, k, v)` (`[tokens, heads, head_dim]` each, contiguous), q and k rotated as
/// [`apply_rope`] rotates them (halves paired: no model with GLM's rope stacks its q/k/v).
pub fn rope_qkv(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    q_heads: usize,
    kv_heads: usize,
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let (t, d) = (qkv.dim(0)?, qkv.dim(1)? / (q_heads + 2 * kv_heads).max(1));
    let planes = qkv
        .contiguous()?
        .apply_op3_no_bwd(cos, sin, &RopeQkv { q_heads, kv_heads })?;
    let (q, kv) = (t * q_heads * d, t * kv_heads * d);
    Ok((
        planes.narrow(0, 0, q)?.reshape((t, q_heads, d))?,
        planes.narrow(0, q, kv)?.reshape((t, kv_heads, d))?,
        planes.narrow(0, q + kv, kv)?.reshape((t, kv_heads, d))?,
    ))
}

/// Rotates `x` `[tokens, heads, head_dim]` by per-token angles; `cos`/`sin` are `[tokens,
/// rotary_dim/2]` (already gathered at each token's absolute position): the first
/// `rotary_dim` dimensions of each head rotate, the rest pass through.
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    x.contiguous()?
        .apply_op3_no_bwd(cos, sin, &Rope { interleaved: false })
}

/// [`apply_rope`] with pair `i` made of dimensions `2i` and `2i + 1` (GLM's rope, GPT-J's
/// pairing), on the CPU.
pub fn apply_rope_interleaved(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
) -> candle_core::Result<Tensor> {
    x.contiguous()?
        .apply_op3_no_bwd(cos, sin, &Rope { interleaved: true })
}
