//! Kernels as candle ops. Each has a CPU implementation in Rust; the CUDA issue adds
//! `cuda_fwd` bodies that launch kernels from `cuda/`, so the model code never forks by device.
//!
//! Every CPU kernel here reduces in a fixed sequential order per output row, so a row's result
//! depends only on that row's inputs: not on its index in the batch, its neighbours, or the
//! number of threads (rayon only splits *independent* rows).

mod attention_plan;
mod cache_write;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
mod cuda_attention;
mod elementwise;
mod gated_delta;
mod gemm;
mod gemm_abf16;
mod gemm_bf16;
mod gemm_fp8;
mod gemm_mxfp4;
mod isa;
mod mamba2;
mod math;
mod matmul;
mod page_copy;
mod paged_attention;
mod recurrent;
mod rms_norm;
mod rope;
mod rope_cache;
mod short_conv;

pub use attention_plan::{AttentionMetadata, AttentionSchedule};
pub use cache_write::{write_k, write_kv};
#[cfg(feature = "cuda")]
pub use cuda::multiprocessors as cuda_multiprocessors;
pub use elementwise::{
    add, clamped_swiglu, gated, gated_halves, softcap, swiglu, swiglu_halves, xielu, Xielu,
};
pub use gated_delta::{gated_delta_rule, sigmoid_gate, DeltaNetParams};
pub use gemm::{
    matmul_packed, matmul_packed_profiled, packed_matmul, packed_matmul_reduced,
    packed_matmul_with, split_k_parts, PackedWeight, Reduction,
};
pub use gemm_abf16::{
    dot_bf16_pair_emulated, dot_bf16_pairs_hw, matmul_packed_abf16, packed_matmul_abf16,
    packed_matmul_abf16_with, round_activation_bf16, round_activations_hw, DotIsa,
    PackedWeightAbf16, PairPanels, CANONICAL_NAN,
};
pub use gemm_bf16::{
    matmul_packed_bf16, matmul_packed_bf16_profiled, packed_matmul_bf16, packed_matmul_bf16_with,
    PackedWeightBf16,
};
pub use gemm_fp8::{matmul_packed_fp8_profiled, packed_matmul_fp8_with, PackedWeightFp8, E4M3};
pub use gemm_mxfp4::{
    matmul_packed_mxfp4_profiled, packed_matmul_mxfp4, packed_matmul_mxfp4_with, PackedWeightMxfp4,
    E2M1, E8M0, MXFP4_BLOCK,
};
pub(crate) use isa::isa_kernel;
pub use isa::CpuIsa;
pub use mamba2::{mamba2_scan, Mamba2Params};
pub use math::{bf16_bits, bf16_to_f32, exp_nonpositive, gelu_tanh, sigmoid, silu, tanh};
pub use matmul::{invariant_matmul, INVARIANT_GEMM_ROWS};
pub use page_copy::copy_pages;
pub use paged_attention::{paged_attention, paged_attention_with_isa, paged_attention_with_sinks};
pub use rms_norm::{add_rms_norm, rms_norm};
pub use rope::{apply_rope, apply_rope_interleaved, rope_qkv};
pub use rope_cache::rope_qkv_into_cache;
pub use short_conv::{short_conv, ConvTaps};

use std::mem::MaybeUninit;

use candle_core::{bail, CpuStorage, Layout};

/// Runs `f` on a tensor's values as f32 in row-major order: in place for a contiguous f32 CPU
/// tensor, on a copy ([`to_f32_vec`]) otherwise.
pub fn with_f32_values<R>(
    t: &candle_core::Tensor,
    f: impl FnOnce(&[f32]) -> R,
) -> candle_core::Result<R> {
    if t.dtype() == candle_core::DType::F32 {
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(cpu), Some((a, b))) =
            (&*storage, layout.contiguous_offsets())
        {
            return Ok(f(&cpu.as_slice::<f32>()?[a..b]));
        }
    }
    Ok(f(&to_f32_vec(t)?))
}

/// A tensor's values as f32 in row-major order, copied: from a GPU through a pinned buffer,
/// half-precision values copied as they are and widened on the host (exact).
pub fn to_f32_vec(t: &candle_core::Tensor) -> candle_core::Result<Vec<f32>> {
    #[cfg(feature = "cuda")]
    if let Some(values) = cuda::to_host_f32(t)? {
        return Ok(values);
    }
    t.flatten_all()?
        .to_dtype(candle_core::DType::F32)?
        .to_vec1::<f32>()
}

/// Runs `f` on a bf16 tensor's values in row-major order, as bits: in place for a contiguous
/// CPU tensor, on a copy otherwise; `None` if the tensor is not bf16.
pub fn with_bf16_bits<R>(
    t: &candle_core::Tensor,
    f: impl FnOnce(&[u16]) -> R,
) -> candle_core::Result<Option<R>> {
    if t.dtype() != candle_core::DType::BF16 {
        return Ok(None);
    }
    {
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(cpu), Some((a, b))) =
            (&*storage, layout.contiguous_offsets())
        {
            let values = &cpu.as_slice::<half::bf16>()?[a..b];
            return Ok(Some(f(bytemuck::cast_slice(values))));
        }
    }
    let values = t
        .flatten_all()?
        .to_device(&candle_core::Device::Cpu)?
        .to_vec1::<half::bf16>()?;
    Ok(Some(f(bytemuck::cast_slice(&values))))
}

/// A new vector of `len` floats that `fill` writes, each element exactly once, without
/// zeroing it first: the elementwise ops' outputs are megabytes at prefill, and zeroing them ran
/// on the calling thread alone, the other core idle (with [`zeroed`]: bench model, batch 64,
/// bf16 AMX mode, prefill 0.76 → 0.54 s and decode 19.3 → 15.3 ms per step).
///
/// `fill` must write every element of the slice it is given (the kernels below are per-element
/// maps over the whole output, so they do by construction).
fn filled_f32(len: usize, fill: impl FnOnce(&mut [MaybeUninit<f32>])) -> Vec<f32> {
    let mut out: Vec<f32> = Vec::with_capacity(len);
    fill(&mut out.spare_capacity_mut()[..len]);
    // SAFETY: `fill` initialised all `len` elements (its contract above).
    unsafe { out.set_len(len) };
    out
}

/// `dst` zeroed, as an initialised slice: for outputs that are zeroed piece by piece inside
/// parallel tasks rather than all at once by the thread that allocates them.
fn zeroed<T: bytemuck::Zeroable>(dst: &mut [MaybeUninit<T>]) -> &mut [T] {
    for x in dst.iter_mut() {
        x.write(T::zeroed());
    }
    // SAFETY: every element was just written; `MaybeUninit<T>` has `T`'s layout.
    unsafe { &mut *(dst as *mut [MaybeUninit<T>] as *mut [T]) }
}

/// The contiguous f32 data a layout addresses, or an error naming the operand.
fn contiguous_f32<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> candle_core::Result<&'a [f32]> {
    let data = s.as_slice::<f32>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => bail!("{what}: expected a contiguous f32 tensor"),
    }
}

/// An f32 tensor's values as bits, for the tests' bitwise comparisons.
#[cfg(test)]
pub(crate) fn tensor_bits(t: &candle_core::Tensor) -> Vec<u32> {
    t.flatten_all()
        .and_then(|f| f.to_vec1::<f32>())
        .map(|v| v.iter().map(|x| x.to_bits()).collect())
        .unwrap_or_default()
}
