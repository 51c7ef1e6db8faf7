//! A linear layer, `x @ w^T (+ b)`, with its weight held in the form the device's GEMM wants and
//! the GEMM chosen per forward (kernel profile, batch-invariant row blocks).

use std::sync::Arc;

use candle_core::Tensor;

use crate::config::KernelProfile;
use crate::error::{DetspecError, Result};
use crate::ops::{
    self, invariant_matmul, matmul_packed_abf16, matmul_packed_bf16_profiled,
    matmul_packed_fp8_profiled, matmul_packed_mxfp4_profiled, matmul_packed_profiled, PackedWeight,
    PackedWeightAbf16, PackedWeightBf16, PackedWeightFp8, PackedWeightMxfp4,
};

/// `x @ w^T (+ b)`.
#[derive(Debug, Clone)]
pub(super) struct Linear {
    pub(super) weight: LinearWeight,
    pub(super) bias: Option<Tensor>,
}

/// A linear layer's weight in the form its device's GEMM wants.
#[derive(Debug, Clone)]
pub(super) enum LinearWeight {
    /// CPU: packed once for the fixed-order GEMM (`ops::gemm`), invariant to the batch.
    Packed(Arc<PackedWeight>),
    /// CPU, bf16 weights: packed in bf16 for the same GEMM (`ops::gemm_bf16`; f32 activations).
    PackedBf16(Arc<PackedWeightBf16>),
    /// CPU, bf16 weights in the bf16-activation mode: packed in k pairs for the bf16 × bf16
    /// GEMM (`ops::gemm_abf16`; inputs rounded to bf16 inside).
    PackedAbf16(Arc<PackedWeightAbf16>),
    /// CPU, gpt-oss's MXFP4 experts kept as the checkpoint stores them (`ops::gemm_mxfp4`:
    /// the bits of the widened weights' GEMM).
    PackedMxfp4(Arc<PackedWeightMxfp4>),
    /// The same in the bf16-activation mode, for its GEMM (`ops::gemm_abf16`, each panel
    /// widened to bf16 as it is needed: the bits of the widened bf16 weights).
    PackedMxfp4Abf16(Arc<PackedWeightMxfp4>),
    /// CPU, an FP8 checkpoint's weight kept as stored (`ops::gemm_fp8`: the bits of the
    /// widened weights' GEMM, in f32 or rounded to bf16 as the engine's dtype is).
    PackedFp8(Arc<PackedWeightFp8>),
    /// The same in the bf16-activation mode, for its GEMM (`ops::gemm_abf16`, a few blocks
    /// widened and rounded to bf16 at a time: the bits of the rounded weights).
    PackedFp8Abf16(Arc<PackedWeightFp8>),
    /// Other devices: `[in, out]`, transposed and contiguous once at load.
    Dense(Tensor),
}

impl LinearWeight {
    /// From a checkpoint's `[out, in]` matrix; `bf16_act`: for the bf16-activation mode (a
    /// bf16 matrix is packed for its GEMM).
    pub(super) fn new(w: &Tensor, bf16_act: bool) -> Result<Self> {
        if w.device().is_cpu() {
            let (out_dim, in_dim) = w.dims2()?;
            if bf16_act {
                let packed = ops::with_bf16_bits(w, |bits| {
                    PackedWeightAbf16::from_transposed_bits(bits, out_dim, in_dim)
                })?
                .ok_or_else(|| {
                    DetspecError::param(
                        "activation_dtype",
                        format!(
                            "\"bfloat16\" needs bf16 weights, got {}",
                            w.dtype().as_str()
                        ),
                    )
                })??;
                return Ok(Self::PackedAbf16(Arc::new(packed)));
            }
            if let Some(packed) = ops::with_bf16_bits(w, |bits| {
                PackedWeightBf16::from_transposed_bits(bits, out_dim, in_dim)
            })? {
                return Ok(Self::PackedBf16(Arc::new(packed?)));
            }
            let packed = ops::with_f32_values(w, |data| {
                PackedWeight::from_transposed(data, out_dim, in_dim)
            })??;
            Ok(Self::Packed(Arc::new(packed)))
        } else {
            Ok(Self::Dense(w.t()?.contiguous()?))
        }
    }

    /// The row blocks the invariant GEMM pads its input to, where it pads (dense weights:
    /// [`invariant_matmul`]); a caller chaining such GEMMs pads once and keeps the padding.
    pub(super) fn invariant_row_block(&self) -> Option<usize> {
        matches!(self, Self::Dense(_)).then_some(ops::INVARIANT_GEMM_ROWS)
    }

    pub(super) fn matmul(&self, x: &Tensor, gemm: GemmOptions) -> candle_core::Result<Tensor> {
        match self {
            Self::Packed(w) => matmul_packed_profiled(x, w, gemm.profile, gemm.invariant),
            Self::PackedBf16(w) => matmul_packed_bf16_profiled(x, w, gemm.profile, gemm.invariant),
            Self::PackedMxfp4(w) => {
                matmul_packed_mxfp4_profiled(x, w, gemm.profile, gemm.invariant)
            }
            // One kernel at every M (the mode runs the invariant profile only).
            Self::PackedAbf16(w) => matmul_packed_abf16(x, w, gemm.amx),
            Self::PackedMxfp4Abf16(w) => matmul_packed_abf16(x, w, false),
            Self::PackedFp8(w) => matmul_packed_fp8_profiled(x, w, gemm.profile, gemm.invariant),
            Self::PackedFp8Abf16(w) => matmul_packed_abf16(x, w, false),
            Self::Dense(w) if gemm.invariant => invariant_matmul(x, w),
            Self::Dense(w) => x.matmul(w),
        }
    }
}

/// What a forward's GEMMs promise: the backend's kernel profile, and whether this batch runs
/// them in the batch-invariant mode (fixed row blocks).
#[derive(Debug, Clone, Copy)]
pub(super) struct GemmOptions {
    pub(super) profile: KernelProfile,
    pub(super) invariant: bool,
    /// The bf16-activation GEMMs run on AMX tiles (`activation_dtype="bfloat16_amx"`).
    pub(super) amx: bool,
}

/// Linear layers that read the same input (q/k/v, gate/up): apart, or stacked into one GEMM
/// whose output holds theirs side by side, in their order, along its columns. Stacked on a GPU:
/// each GEMM there is a library call with its own host-side cost, which was most of a batch-1
/// decode step, so three calls a layer become one (and two become one). The CPU keeps them
/// apart: its packed weights are per layer, and its GEMM has no per-call library overhead.
#[derive(Debug, Clone)]
pub(super) enum Projection {
    Apart(Vec<Linear>),
    Stacked {
        linear: Linear,
        /// Output width of each stacked layer, in order.
        widths: Vec<usize>,
    },
}

impl Projection {
    /// The layers of `widths` from one `[Σ widths, in]` matrix holding their weights' rows in
    /// order (a checkpoint's fused `qkv_proj`), without biases: apart, or `stacked`.
    pub(super) fn from_fused(
        w: &Tensor,
        widths: &[usize],
        stacked: bool,
        bf16_act: bool,
    ) -> Result<Self> {
        if stacked {
            return Ok(Self::Stacked {
                linear: Linear {
                    weight: LinearWeight::new(w, bf16_act)?,
                    bias: None,
                },
                widths: widths.to_vec(),
            });
        }
        let mut at = 0;
        let mut layers = Vec::with_capacity(widths.len());
        for &width in widths {
            let part = w.narrow(0, at, width)?.contiguous()?;
            layers.push(Linear {
                weight: LinearWeight::new(&part, bf16_act)?,
                bias: None,
            });
            at += width;
        }
        Ok(Self::Apart(layers))
    }

    /// Replaces every layer's weight from one fused matrix (see [`Self::from_fused`]),
    /// keeping the projection apart or stacked as it is.
    pub(super) fn set_fused_weight(
        &mut self,
        w: &Tensor,
        widths: &[usize],
        bf16_act: bool,
    ) -> Result<()> {
        let stacked = matches!(self, Self::Stacked { .. });
        *self = Self::from_fused(w, widths, stacked, bf16_act)?;
        Ok(())
    }

    fn part(layers: &mut [Linear], part: usize) -> Result<&mut Linear> {
        let n = layers.len();
        layers
            .get_mut(part)
            .ok_or_else(|| DetspecError::param("weights", format!("projection part {part} of {n}")))
    }

    /// Replaces layer `part`'s `[out, in]` weight.
    pub(super) fn set_weight(&mut self, part: usize, w: &Tensor, bf16_act: bool) -> Result<()> {
        match self {
            Self::Apart(layers) => {
                Self::part(layers, part)?.weight = LinearWeight::new(w, bf16_act)?;
            }
            Self::Stacked { linear, widths } => {
                let LinearWeight::Dense(stacked) = &linear.weight else {
                    return Err(DetspecError::param(
                        "weights",
                        "a stacked projection holds a dense weight",
                    ));
                };
                // Dense is `[in, out]`: the part's columns.
                let new = replace_part(stacked, 1, widths, part, &w.t()?)?.contiguous()?;
                linear.weight = LinearWeight::Dense(new);
            }
        }
        Ok(())
    }

    /// Replaces layer `part`'s bias (the model has biases on these layers).
    pub(super) fn set_bias(&mut self, part: usize, b: Tensor) -> Result<()> {
        match self {
            Self::Apart(layers) => Self::part(layers, part)?.bias = Some(b),
            Self::Stacked { linear, widths } => {
                let Some(stacked) = &linear.bias else {
                    return Err(DetspecError::param(
                        "weights",
                        "this model's stacked projection has no bias to replace",
                    ));
                };
                linear.bias = Some(replace_part(stacked, 0, widths, part, &b)?);
            }
        }
        Ok(())
    }
}

/// `stacked` with part `part` (of `widths` along `dim`) replaced by `new`.
fn replace_part(
    stacked: &Tensor,
    dim: usize,
    widths: &[usize],
    part: usize,
    new: &Tensor,
) -> candle_core::Result<Tensor> {
    if part >= widths.len() {
        candle_core::bail!("projection part {part} of {}", widths.len());
    }
    let mut pieces = Vec::with_capacity(widths.len());
    let mut at = 0;
    for (i, &w) in widths.iter().enumerate() {
        pieces.push(if i == part {
            new.clone()
        } else {
            stacked.narrow(dim, at, w)?
        });
        at += w;
    }
    Tensor::cat(&pieces, dim)
}

impl Linear {
    pub(super) fn apply(&self, x: &Tensor, gemm: GemmOptions) -> candle_core::Result<Tensor> {
        let y = self.weight.matmul(x, gemm)?;
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}
