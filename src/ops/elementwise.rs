//! Elementwise ops of the decoder (residual add, SwiGLU), on the engine's rayon pool.
//!
//! candle's own CPU elementwise kernels run on a separate thread pool whose threads spin on a
//! barrier while rayon's spin too: on a 2-core machine the two pools fought (12 % of a batch-64
//! decode step in `BarrierGuard::drop`, docs/performance.md). These are plain per-element maps,
//! so they are trivially batch-, position- and thread-invariant.

use std::mem::MaybeUninit;

use candle_core::{bail, CpuStorage, CustomOp2, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::isa::isa_kernel;
use super::math::silu;
use super::CpuIsa;
use super::{contiguous_f32, filled_f32};

/// Elements per rayon task; smaller maps run on the calling thread.
const CHUNK: usize = 1 << 14;

isa_kernel! {
    fn add_into(isa: CpuIsa, out: &mut [MaybeUninit<f32>], a: &[f32], b: &[f32]) {
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

/// The two maps, each a kernel compiled for this CPU's instruction set.
#[derive(Clone, Copy)]
enum Binary {
    Add,
    Swiglu,
}

impl Binary {
    fn apply(self, a: &[f32], b: &[f32]) -> Vec<f32> {
        let kernel = match self {
            Binary::Add => add_into,
            Binary::Swiglu => swiglu_into,
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
            Binary::Swiglu => "detspec-swiglu",
        }
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let name = self.name();
        if l1.dims() != l2.dims() {
            bail!("{name}: shapes {:?} and {:?} differ", l1.dims(), l2.dims());
        }
        let a = contiguous_f32(s1, l1, name)?;
        let b = contiguous_f32(s2, l2, name)?;
        Ok((CpuStorage::F32(self.apply(a, b)), l1.shape().clone()))
    }
}

/// `a + b` (same shape).
pub fn add(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    if !a.device().is_cpu() {
        return a + b;
    }
    a.contiguous()?
        .apply_op2_no_bwd(&b.contiguous()?, &Binary::Add)
}

/// `silu(gate) * up`, with silu(x) = x / (exp(-x) + 1) as candle-nn writes it ([`silu`] on CPU).
pub fn swiglu(gate: &Tensor, up: &Tensor) -> candle_core::Result<Tensor> {
    if !gate.device().is_cpu() {
        return candle_nn::ops::silu(gate)? * up;
    }
    gate.contiguous()?
        .apply_op2_no_bwd(&up.contiguous()?, &Binary::Swiglu)
}
