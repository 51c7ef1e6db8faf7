//! Elementwise ops of the decoder (residual add, the MLP's gated activation: SwiGLU or GeGLU,
//! Gemma 2's soft cap on the logits): on the CPU on the engine's rayon
//! pool, on a GPU `cuda/elementwise.cu`.
//!
//! candle's own CPU elementwise kernels run on a separate thread pool whose threads spin on a
//! barrier while rayon's spin too: on a 2-core machine the two pools fought (12 % of a batch-64
//! decode step in `BarrierGuard::drop`, docs/performance.md). These are plain per-element maps,
//! so they are trivially batch-, position- and thread-invariant.

use std::mem::MaybeUninit;

use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::isa::isa_kernel;
use super::math::{gelu_tanh, sigmoid, silu, tanh};
use super::CpuIsa;
use super::{contiguous_f32, filled_f32};
use crate::config::Activation;

/// Elements per rayon task; smaller maps run on the calling thread.
const CHUNK: usize = 1 << 14;

isa_kernel! {
    pub(super) fn add_into(isa: CpuIsa, out: &mut [MaybeUninit<f32>], a: &[f32], b: &[f32]) {
        for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
            o.write(x + y);
        }
    }
}

isa_kernel! {
    /// silu(g) · u ([`silu`]: our exponential, not libm's, so it vectorises and its bits do
    /// not depend on the C library).
    fn swiglu_into(isa: CpuIsa, out: &mut [MaybeUninit<f32>], gate: &[f32], up: &[f32]) {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            o.write(silu(g) * u);
        }
    }
}

isa_kernel! {
    /// gelu_tanh(g) · u ([`gelu_tanh`], through the same exponential as [`silu`]).
    fn geglu_into(isa: CpuIsa, out: &mut [MaybeUninit<f32>], gate: &[f32], up: &[f32]) {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            o.write(gelu_tanh(g) * u);
        }
    }
}

isa_kernel! {
    /// `tanh(x / c) · c` ([`tanh`]), as transformers writes Gemma 2's soft cap.
    fn softcap_into(isa: CpuIsa, out: &mut [MaybeUninit<f32>], x: &[f32], cap: f32) {
        for (o, &v) in out.iter_mut().zip(x) {
            o.write(tanh(v / cap) * cap);
        }
    }
}

isa_kernel! {
    /// gpt-oss's expert gate, `(u + 1) · (g · σ(α g))` with `g` clamped to at most `limit` and
    /// `u` to `[-limit, limit]`, in transformers' order ([`sigmoid`]: our exponential).
    fn clamped_swiglu_into(
        isa: CpuIsa,
        out: &mut [MaybeUninit<f32>],
        gate: &[f32],
        up: &[f32],
        alpha: f32,
        limit: f32,
    ) {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            let g = g.min(limit);
            let u = u.clamp(-limit, limit);
            o.write((u + 1.0) * (g * sigmoid(g * alpha)));
        }
    }
}

/// The f32 data of a binary map's two operands of one shape (op `name`'s, for errors).
fn operands<'a>(
    name: &str,
    (s1, l1): (&'a CpuStorage, &Layout),
    (s2, l2): (&'a CpuStorage, &Layout),
) -> candle_core::Result<(&'a [f32], &'a [f32])> {
    if l1.dims() != l2.dims() {
        bail!("{name}: shapes {:?} and {:?} differ", l1.dims(), l2.dims());
    }
    Ok((contiguous_f32(s1, l1, name)?, contiguous_f32(s2, l2, name)?))
}

/// A binary map's CPU kernel: `out[i] = f(a[i], b[i])`.
type BinaryKernel = fn(CpuIsa, &mut [MaybeUninit<f32>], &[f32], &[f32]);

/// The CPU kernel of `act(gate) · up`.
fn gated_into(act: Activation) -> BinaryKernel {
    match act {
        Activation::Silu => swiglu_into,
        Activation::GeluTanh => geglu_into,
    }
}

/// The two maps, each a kernel compiled for this CPU's instruction set.
#[derive(Clone, Copy)]
enum Binary {
    Add,
    Gated(Activation),
}

impl Binary {
    fn apply(self, a: &[f32], b: &[f32]) -> Vec<f32> {
        let kernel = match self {
            Binary::Add => add_into,
            Binary::Gated(act) => gated_into(act),
        };
        let isa = CpuIsa::detect();
        // Every element is written: the chunks of `out` pair up with those of `a` and `b`,
        // which have its length (checked by the caller).
        filled_f32(a.len(), |out| {
            if a.len() <= CHUNK {
                kernel(isa, out, a, b);
            } else {
                out.par_chunks_mut(CHUNK)
                    .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
                    .for_each(|(o, (a, b))| kernel(isa, o, a, b));
            }
        })
    }
}

impl CustomOp2 for Binary {
    fn name(&self) -> &'static str {
        match self {
            Binary::Add => "detspec-add",
            Binary::Gated(Activation::Silu) => "detspec-swiglu",
            Binary::Gated(Activation::GeluTanh) => "detspec-geglu",
        }
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (a, b) = operands(self.name(), (s1, l1), (s2, l2))?;
        Ok((CpuStorage::F32(self.apply(a, b)), l1.shape().clone()))
    }

    /// `cuda/elementwise.cu`: the same map, f32 arithmetic, one rounding to the dtype.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda::{self, with_float_type};
        use candle_core::backend::BackendStorage;
        use candle_core::cuda::cudarc::driver::PushKernelArg;
        use candle_core::cuda::WrapErr;

        let name = self.name();
        if l1.dims() != l2.dims() || s1.dtype() != s2.dtype() {
            bail!(
                "{name}: operands {:?} {:?} and {:?} {:?} differ",
                l1.dims(),
                s1.dtype(),
                l2.dims(),
                s2.dtype()
            );
        }
        let n = l1.shape().elem_count();
        let dev = s1.device();
        let kernel = match self {
            Binary::Add => "add",
            Binary::Gated(Activation::Silu) => "swiglu",
            Binary::Gated(Activation::GeluTanh) => "geglu",
        };
        let f = cuda::kernel(dev, &cuda::ELEMENTWISE, kernel, s1.dtype())?;
        with_float_type!(s1.dtype(), name, |T| {
            let a = cuda::view::<T>(s1, l1, name)?;
            let b = cuda::view::<T>(s2, l2, name)?;
            // SAFETY: the kernel writes every element.
            let mut out = unsafe { dev.alloc::<T>(n.max(1))? };
            if n > 0 {
                let stream = dev.cuda_stream();
                let mut launch = stream.launch_builder(&f);
                launch.arg(&a).arg(&b).arg(&mut out).arg(&n);
                // SAFETY: argument types and order match `add_*` / `swiglu_*` / `geglu_*` in
                // cuda/elementwise.cu; every index is below `n`, the length of all three.
                unsafe { launch.launch(cuda::grid_1d(n)) }.w()?;
            }
            Ok((
                candle_core::CudaStorage::wrap_cuda_slice(out, dev.clone()),
                l1.shape().clone(),
            ))
        })
    }
}

/// The gated activation of the stacked gate/up projection's output `[rows, 2 · width]` (per
/// row the gate, then up): on a GPU one launch reading both halves where they lie, with
/// [`gated`]'s bits.
struct GatedHalves(Activation);

impl GatedHalves {
    /// `(rows, width)` of the input.
    fn dims(l: &Layout) -> candle_core::Result<(usize, usize)> {
        match l.dims() {
            [rows, w2] if w2 % 2 == 0 && *w2 > 0 => Ok((*rows, w2 / 2)),
            dims => bail!("gated_halves: expected [rows, 2 x width], got {dims:?}"),
        }
    }

    /// `cuda/elementwise.cu`'s kernel.
    #[cfg(feature = "cuda")]
    fn kernel(&self) -> &'static str {
        match self.0 {
            Activation::Silu => "swiglu_halves",
            Activation::GeluTanh => "geglu_halves",
        }
    }
}

impl CustomOp1 for GatedHalves {
    fn name(&self) -> &'static str {
        match self.0 {
            Activation::Silu => "detspec-swiglu-halves",
            Activation::GeluTanh => "detspec-geglu-halves",
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let gu = contiguous_f32(s, l, self.name())?;
        let (rows, width) = Self::dims(l)?;
        let kernel = gated_into(self.0);
        // Every element is written: row by row, from that row's two halves.
        let out = filled_f32(rows * width, |out| {
            out.par_chunks_mut(width)
                .zip(gu.par_chunks(2 * width))
                .for_each(|(o, row)| {
                    let (gate, up) = row.split_at(width);
                    kernel(CpuIsa::detect(), o, gate, up);
                })
        });
        Ok((CpuStorage::F32(out), Shape::from((rows, width))))
    }

    /// `cuda/elementwise.cu`'s `swiglu_halves` / `geglu_halves`.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda::{self, with_float_type};
        use candle_core::backend::BackendStorage;
        use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
        use candle_core::cuda::WrapErr;

        let (rows, width) = Self::dims(l)?;
        let n = rows * width;
        let dev = s.device();
        let f = cuda::kernel(dev, &cuda::ELEMENTWISE, self.kernel(), s.dtype())?;
        let args = [
            cuda::arg_i32(rows, "gated_halves rows")?,
            cuda::arg_i32(width, "gated_halves width")?,
        ];
        // Columns by 256-thread blocks, one grid row per row (both strided past 65,535).
        let cfg = LaunchConfig {
            grid_dim: (
                width.div_ceil(256).clamp(1, 65_535) as u32,
                rows.clamp(1, 65_535) as u32,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        with_float_type!(s.dtype(), self.name(), |T| {
            let gu = cuda::view::<T>(s, l, self.name())?;
            // SAFETY: the kernel writes every element.
            let mut out = unsafe { dev.alloc::<T>(n.max(1))? };
            if n > 0 {
                let stream = dev.cuda_stream();
                let mut launch = stream.launch_builder(&f);
                launch.arg(&gu).arg(&mut out).arg(&args[0]).arg(&args[1]);
                // SAFETY: argument types and order match `swiglu_halves_*` / `geglu_halves_*` in
                // cuda/elementwise.cu; `gu` holds rows x 2 width elements.
                unsafe { launch.launch(cfg) }.w()?;
            }
            Ok((
                candle_core::CudaStorage::wrap_cuda_slice(out, dev.clone()),
                Shape::from((rows, width)),
            ))
        })
    }
}

/// Gemma 2's soft cap on the logits, `tanh(x / cap) · cap` per element.
struct Softcap(f32);

/// xIELU's scalars as it applies them (Apertus's `XIELUActivation`): `alpha_p` and `alpha_n`
/// after their softplus (and `alpha_n`'s `+ beta`), `beta`, `eps`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Xielu {
    pub alpha_p: f32,
    pub alpha_n: f32,
    pub beta: f32,
    pub eps: f32,
}

impl Xielu {
    /// From the checkpoint's parameters (`alpha_p`, `alpha_n` before softplus), as
    /// transformers derives them: `softplus(alpha_p)`, `beta + softplus(alpha_n)`.
    pub fn from_params(alpha_p: f32, alpha_n: f32, beta: f32, eps: f32) -> Self {
        Self {
            alpha_p: softplus(alpha_p),
            alpha_n: beta + softplus(alpha_n),
            beta,
            eps,
        }
    }

    /// One value: `alpha_p·x² + beta·x` where `x > 0`, else
    /// `(expm1(min(x, eps)) − x)·alpha_n + beta·x`.
    fn apply(self, x: f32) -> f32 {
        if x > 0.0 {
            self.alpha_p * x * x + self.beta * x
        } else {
            (x.min(self.eps).exp_m1() - x) * self.alpha_n + self.beta * x
        }
    }
}

/// torch's softplus (`log1p(exp(x))`, `x` itself above 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

impl CustomOp1 for Xielu {
    fn name(&self) -> &'static str {
        "detspec-xielu"
    }

    /// Element by element, so a row's bits never depend on the batch; no GPU kernel (Apertus
    /// is refused on a GPU at load).
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(s, l, self.name())?;
        let act = *self;
        // Every element is written: the chunks of `out` pair up with those of `x`.
        let out = filled_f32(x.len(), |out| {
            out.par_chunks_mut(CHUNK)
                .zip(x.par_chunks(CHUNK))
                .for_each(|(o, x)| {
                    for (o, &v) in o.iter_mut().zip(x) {
                        o.write(act.apply(v));
                    }
                })
        });
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }
}

/// Apertus's xIELU of `x`, per element.
pub fn xielu(x: &Tensor, act: Xielu) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op1_no_bwd(&act)
}

impl CustomOp1 for Softcap {
    fn name(&self) -> &'static str {
        "detspec-softcap"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(s, l, self.name())?;
        let (isa, cap) = (CpuIsa::detect(), self.0);
        // Every element is written: the chunks of `out` pair up with those of `x`.
        let out = filled_f32(x.len(), |out| {
            out.par_chunks_mut(CHUNK)
                .zip(x.par_chunks(CHUNK))
                .for_each(|(o, x)| softcap_into(isa, o, x, cap))
        });
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    /// `cuda/elementwise.cu`'s `softcap`.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda::{self, with_float_type};
        use candle_core::backend::BackendStorage;
        use candle_core::cuda::cudarc::driver::PushKernelArg;
        use candle_core::cuda::WrapErr;

        let n = l.shape().elem_count();
        let dev = s.device();
        let f = cuda::kernel(dev, &cuda::ELEMENTWISE, "softcap", s.dtype())?;
        with_float_type!(s.dtype(), self.name(), |T| {
            let x = cuda::view::<T>(s, l, self.name())?;
            // SAFETY: the kernel writes every element.
            let mut out = unsafe { dev.alloc::<T>(n.max(1))? };
            if n > 0 {
                let stream = dev.cuda_stream();
                let mut launch = stream.launch_builder(&f);
                launch.arg(&x).arg(&mut out).arg(&n).arg(&self.0);
                // SAFETY: argument types and order match `softcap_*` in cuda/elementwise.cu;
                // every index is below `n`, the length of both.
                unsafe { launch.launch(cuda::grid_1d(n)) }.w()?;
            }
            Ok((
                candle_core::CudaStorage::wrap_cuda_slice(out, dev.clone()),
                l.shape().clone(),
            ))
        })
    }
}

/// gpt-oss's expert gate ([`clamped_swiglu`]); CPU only (gpt-oss is refused on a GPU).
struct ClampedSwiglu {
    alpha: f32,
    limit: f32,
}

impl CustomOp2 for ClampedSwiglu {
    fn name(&self) -> &'static str {
        "detspec-clamped-swiglu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (g, u) = operands(self.name(), (s1, l1), (s2, l2))?;
        let (isa, alpha, limit) = (CpuIsa::detect(), self.alpha, self.limit);
        // Every element is written: the chunks of `out` pair up with those of `g` and `u`.
        let out = filled_f32(g.len(), |out| {
            out.par_chunks_mut(CHUNK)
                .zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK)))
                .for_each(|(o, (g, u))| clamped_swiglu_into(isa, o, g, u, alpha, limit))
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// gpt-oss's expert gate of `gate` and `up` (same shape): `(u + 1) · g · σ(alpha · g)`, `g`
/// clamped to at most `limit`, `u` to `[-limit, limit]`.
pub fn clamped_swiglu(
    gate: &Tensor,
    up: &Tensor,
    alpha: f32,
    limit: f32,
) -> candle_core::Result<Tensor> {
    gate.contiguous()?
        .apply_op2_no_bwd(&up.contiguous()?, &ClampedSwiglu { alpha, limit })
}

/// `tanh(x / cap) · cap` per element (Gemma 2's final logits).
pub fn softcap(x: &Tensor, cap: f32) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op1_no_bwd(&Softcap(cap))
}

/// `act(gate) * up` of the stacked gate/up projection's output `[rows, 2 · width]`.
pub fn gated_halves(gate_up: &Tensor, act: Activation) -> candle_core::Result<Tensor> {
    gate_up.contiguous()?.apply_op1_no_bwd(&GatedHalves(act))
}

/// [`gated_halves`] with SiLU.
pub fn swiglu_halves(gate_up: &Tensor) -> candle_core::Result<Tensor> {
    gated_halves(gate_up, Activation::Silu)
}

/// `a + b` (same shape).
pub fn add(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    a.contiguous()?
        .apply_op2_no_bwd(&b.contiguous()?, &Binary::Add)
}

/// `act(gate) * up`: SwiGLU with silu(x) = x / (exp(-x) + 1) as candle-nn writes it ([`silu`]
/// on the CPU), or GeGLU with [`gelu_tanh`]; on a GPU in one pass with one rounding (not an
/// activation, then a multiply, each rounding to the dtype).
pub fn gated(gate: &Tensor, up: &Tensor, act: Activation) -> candle_core::Result<Tensor> {
    gate.contiguous()?
        .apply_op2_no_bwd(&up.contiguous()?, &Binary::Gated(act))
}

/// [`gated`] with SiLU: SwiGLU.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> candle_core::Result<Tensor> {
    gated(gate, up, Activation::Silu)
}

#[cfg(test)]
mod xielu_tests {
    use super::*;

    #[test]
    fn xielu_is_transformers_formula_on_both_sides_of_zero() {
        let act = Xielu::from_params(0.3, -0.2, 0.5, -1e-6);
        let sp = |v: f32| (1.0 + v.exp()).ln();
        assert!((act.alpha_p - sp(0.3)).abs() < 1e-6);
        assert!((act.alpha_n - (0.5 + sp(-0.2))).abs() < 1e-6);
        for x in [-30.0f32, -2.5, -1e-3, -1e-7, 0.0, 1e-3, 0.7, 12.0] {
            let want = if x > 0.0 {
                act.alpha_p * x * x + 0.5 * x
            } else {
                (x.min(-1e-6).exp_m1() - x) * act.alpha_n + 0.5 * x
            };
            assert_eq!(act.apply(x).to_bits(), want.to_bits(), "{x}");
        }
        // torch's softplus returns its input above 20.
        assert_eq!(Xielu::from_params(25.0, 0.0, 0.5, -1e-6).alpha_p, 25.0);
        let x = Tensor::new(&[-1.0f32, 2.0], &candle_core::Device::Cpu).unwrap();
        let y = xielu(&x, act).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(y, vec![act.apply(-1.0), act.apply(2.0)]);
    }
}
