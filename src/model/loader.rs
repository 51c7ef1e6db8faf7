//! Loading a decoder's parameters from a checkpoint: each in the engine's dtype and, for a
//! linear layer, in the form the device's GEMM wants, with its content hash recorded on the way
//! (the fingerprint's weights hash).

use std::cell::RefCell;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::config::{ActivationDtype, Fp8Weights};
use crate::error::{DetspecError, Result};
use crate::ops::{PackedWeightAbf16, PackedWeightBf16, PackedWeightFp8, PackedWeightMxfp4};

use super::fp8;
use super::linear::{Linear, LinearWeight, Projection};
use super::mxfp4;
use super::param_hash::{bf16_hash, tensor_hash, ParamHashes};
use super::weights::{Checkpoint, StDtype};

/// Whether the engine keeps quantized weights (gpt-oss's MXFP4 experts, FP8 linear layers) as
/// stored on `device` with activations `act`: on the CPU, for its quantized GEMMs (f32
/// activations) or the bf16-activation GEMM's exact kernels, which widen a panel as they need
/// it. AMX tiles and other devices take them widened at load.
pub fn keeps_quantized(device: &Device, act: ActivationDtype) -> bool {
    device.is_cpu() && act != ActivationDtype::Bf16Amx
}

/// Loads parameters from a checkpoint in the engine's dtype, hashing each as it goes.
pub(super) struct WeightLoader<'a> {
    ck: &'a Checkpoint,
    device: &'a Device,
    /// Matrices (linear layers, embedding).
    dtype: DType,
    /// Vectors (norms, biases): the activations' dtype.
    vector_dtype: DType,
    /// The activations: linear layers are packed for the bf16-activation GEMM in its modes.
    act: ActivationDtype,
    /// How the checkpoint stores its FP8 matrices, if it has any.
    fp8: Option<Fp8Weights>,
    hashes: RefCell<ParamHashes>,
}

impl<'a> WeightLoader<'a> {
    pub(super) fn new(
        ck: &'a Checkpoint,
        device: &'a Device,
        dtype: DType,
        vector_dtype: DType,
        act: ActivationDtype,
        fp8: Option<Fp8Weights>,
    ) -> Self {
        Self {
            ck,
            device,
            dtype,
            vector_dtype,
            act,
            fp8,
            hashes: RefCell::default(),
        }
    }

    /// A vector (norm weight, bias), rounded to the weights' dtype and held in the
    /// activations' (so a float32 checkpoint run in bfloat16 is the bfloat16 checkpoint).
    pub(super) fn load(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.load_as(name, shape, self.vector_dtype)
    }

    /// An RMSNorm's weight, as [`Self::load`] gives it, plus `offset` ([`offset_norm`]).
    /// Hashed as the checkpoint holds it, so an update by the same values keeps the hash.
    pub(super) fn norm(&self, name: &str, shape: &[usize], offset: f64) -> Result<Tensor> {
        Ok(offset_norm(&self.load(name, shape)?, offset)?)
    }

    /// A parameter held in f32 whatever the engine's dtype (DeepSeek's router and its bias,
    /// which transformers keeps in f32): its stored values exactly.
    pub(super) fn load_f32(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.load_rounded(name, shape, DType::F32, DType::F32)
    }

    /// A matrix (linear weight, embedding), in the weights' dtype.
    pub(super) fn load_matrix(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.load_as(name, shape, self.dtype)
    }

    /// The linear layer `prefix`: its `[out, in]` weight prepared once in the form every
    /// forward's GEMM reads, and its bias if it has one.
    pub(super) fn linear(
        &self,
        prefix: &str,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
    ) -> Result<Linear> {
        let weight = self.load_linear(&format!("{prefix}.weight"), out_dim, in_dim)?;
        let bias = if bias {
            Some(self.load(&format!("{prefix}.bias"), &[out_dim])?)
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }

    /// The linear layers `prefixes` (name, output width), which all read an input of `in_dim`:
    /// apart, or `stacked` into one (see [`Projection`]). Each is hashed under its own name.
    pub(super) fn projection(
        &self,
        prefixes: &[(String, usize)],
        in_dim: usize,
        bias: bool,
        stacked: bool,
    ) -> Result<Projection> {
        if !stacked {
            return Ok(Projection::Apart(
                prefixes
                    .iter()
                    .map(|(p, out)| self.linear(p, in_dim, *out, bias))
                    .collect::<Result<_>>()?,
            ));
        }
        let weights = prefixes
            .iter()
            .map(|(p, out)| self.load_matrix(&format!("{p}.weight"), &[*out, in_dim]))
            .collect::<Result<Vec<_>>>()?;
        let weight = LinearWeight::new(&Tensor::cat(&weights, 0)?, self.bf16_act())?;
        let bias = if bias {
            let biases = prefixes
                .iter()
                .map(|(p, out)| self.load(&format!("{p}.bias"), &[*out]))
                .collect::<Result<Vec<_>>>()?;
            Some(Tensor::cat(&biases, 0)?)
        } else {
            None
        };
        Ok(Projection::Stacked {
            linear: Linear { weight, bias },
            widths: prefixes.iter().map(|(_, out)| *out).collect(),
        })
    }

    /// The linear layers of `widths` that a checkpoint stores as one matrix, `prefix` (Phi-3's
    /// `qkv_proj`, `gate_up_proj`: their rows in order, no bias): apart or `stacked`, as
    /// [`Self::projection`] gives them, and hashed as the one parameter it is.
    pub(super) fn fused_projection(
        &self,
        prefix: &str,
        widths: &[usize],
        in_dim: usize,
        stacked: bool,
    ) -> Result<Projection> {
        let out: usize = widths.iter().sum();
        let w = self.load_matrix(&format!("{prefix}.weight"), &[out, in_dim])?;
        Projection::from_fused(&w, widths, stacked, self.bf16_act())
    }

    /// A linear layer's `[out, in]` weight in the form the device's GEMM wants. A bf16 weight
    /// of a bf16 checkpoint on the CPU is packed straight from the mapped file (no copy of the
    /// matrix is made on the way).
    pub(super) fn load_linear(
        &self,
        name: &str,
        out_dim: usize,
        in_dim: usize,
    ) -> Result<LinearWeight> {
        let stored_fp8 = self.stores_fp8(name)?;
        // The bf16-activation GEMM reads k in pairs: an odd-K matrix is widened at load.
        let keeps_fp8 =
            keeps_quantized(self.device, self.act) && !(self.bf16_act() && in_dim % 2 == 1);
        if let Some(fp8) = self.fp8.filter(|_| stored_fp8 && keeps_fp8) {
            return self.packed_fp8(&fp8, name, out_dim, in_dim);
        }
        if self.device.is_cpu()
            && self.dtype == DType::BF16
            && cfg!(target_endian = "little")
            && !stored_fp8
        {
            let packed = self
                .ck
                .with_raw(name, &[out_dim, in_dim], |src, bytes, _| {
                    if src != DType::BF16 {
                        return Ok(None);
                    }
                    let owned: Vec<u16>;
                    let bits: &[u16] = match bytemuck::try_cast_slice(bytes) {
                        Ok(bits) => bits,
                        Err(_) => {
                            owned = bytes
                                .chunks_exact(2)
                                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                                .collect();
                            &owned
                        }
                    };
                    let packed = if self.bf16_act() {
                        LinearWeight::PackedAbf16(Arc::new(
                            PackedWeightAbf16::from_transposed_bits(bits, out_dim, in_dim)?,
                        ))
                    } else {
                        LinearWeight::PackedBf16(Arc::new(PackedWeightBf16::from_transposed_bits(
                            bits, out_dim, in_dim,
                        )?))
                    };
                    Ok::<_, DetspecError>(Some((packed, bf16_hash(bits))))
                })??;
            if let Some((packed, hash)) = packed {
                self.hashes.borrow_mut().insert(name.to_string(), hash);
                return Ok(packed);
            }
        }
        LinearWeight::new(
            &self.load_matrix(name, &[out_dim, in_dim])?,
            self.bf16_act(),
        )
    }

    /// FP8 matrix `name` kept as stored, packed for the CPU's FP8 GEMM (or, in the
    /// bf16-activation mode, that mode's GEMM). Hashed as its widened values in the engine's
    /// dtype, so the fingerprint is the widened checkpoint's.
    fn packed_fp8(
        &self,
        fp8: &Fp8Weights,
        name: &str,
        out_dim: usize,
        in_dim: usize,
    ) -> Result<LinearWeight> {
        let scales = self.fp8_scales(fp8, name, out_dim, in_dim)?;
        let block = fp8.block_dims(out_dim, in_dim);
        let round_bf16 = self.dtype == DType::BF16;
        let (packed, hash) =
            self.ck
                .with_bytes(name, &[out_dim, in_dim], StDtype::F8_E4M3, |codes, bad| {
                    let packed = PackedWeightFp8::from_codes(
                        codes, &scales, out_dim, in_dim, block, round_bf16,
                    )
                    .map_err(|e| bad(e.to_string()))?;
                    let hash = fp8::widened_hash(codes, &scales, out_dim, in_dim, fp8, round_bf16);
                    Ok::<_, DetspecError>((packed, hash))
                })??;
        self.hashes.borrow_mut().insert(name.to_string(), hash);
        let packed = Arc::new(packed);
        Ok(if self.bf16_act() {
            LinearWeight::PackedFp8Abf16(packed)
        } else {
            LinearWeight::PackedFp8(packed)
        })
    }

    /// Whether linear layers are packed for the bf16-activation GEMM.
    pub(super) fn bf16_act(&self) -> bool {
        self.act.is_bf16()
    }

    /// A stacked expert tensor `name` (`fused_experts`), shaped `shape` as a bf16/f32
    /// checkpoint stores it: a `matrix` in the weights' dtype, else biases in the
    /// activations'. gpt-oss's MXFP4 matrices (`…_blocks`, `…_scales`) are widened and hashed
    /// in that shape too, so they are the same parameters as the checkpoint of their widened
    /// values.
    pub(super) fn stacked_experts(
        &self,
        name: &str,
        shape: &[usize],
        matrix: bool,
    ) -> Result<Tensor> {
        if !matrix {
            return self.load(name, shape);
        }
        let widened = self.with_mxfp4(name, shape, |m| {
            let t = Tensor::from_vec(
                m.dequantize(),
                (m.experts, m.out_dim, m.in_dim),
                &Device::Cpu,
            )?;
            Ok(t.transpose(1, 2)?.to_dtype(self.dtype)?.contiguous()?)
        })?;
        let Some(t) = widened else {
            return self.load_matrix(name, shape);
        };
        self.hashes
            .borrow_mut()
            .insert(name.to_string(), tensor_hash(&t)?);
        Ok(t.to_device(self.device)?)
    }

    /// gpt-oss's MXFP4 stacked matrix `name` (`shape` `[experts, in, out]` as widened) kept
    /// as MXFP4 where the CPU's GEMMs read it ([`keeps_quantized`]): per
    /// expert, a weight for each of `outputs`, the checkpoint rows that are its columns
    /// (gpt-oss's gate and up alternate rows). Hashed as its widened values, so the
    /// fingerprint is the widened checkpoint's. `None`: the checkpoint holds it widened, or
    /// the engine widens it here (`stacked_experts`).
    pub(super) fn packed_mxfp4_experts(
        &self,
        name: &str,
        shape: &[usize],
        outputs: &[Vec<usize>],
    ) -> Result<Option<Vec<Vec<LinearWeight>>>> {
        if !keeps_quantized(self.device, self.act) {
            return Ok(None);
        }
        let bf16_act = self.bf16_act();
        // Packed straight from the mapped file (no copy of the 4-bit tensors is made).
        let packed = self.with_mxfp4(name, shape, |m| {
            let experts = (0..m.experts)
                .map(|e| {
                    let (blocks, scales) = m.expert(e);
                    outputs
                        .iter()
                        .map(|rows| {
                            let w = PackedWeightMxfp4::from_blocks(blocks, scales, rows, m.in_dim)?;
                            Ok(if bf16_act {
                                LinearWeight::PackedMxfp4Abf16(Arc::new(w))
                            } else {
                                LinearWeight::PackedMxfp4(Arc::new(w))
                            })
                        })
                        .collect::<Result<Vec<_>>>()
                })
                .collect::<Result<Vec<_>>>()?;
            Ok((experts, m.widened_hash()))
        })?;
        Ok(packed.map(|(experts, hash)| {
            self.hashes.borrow_mut().insert(name.to_string(), hash);
            experts
        }))
    }

    /// `f` of the MXFP4 blocks and scales of stacked matrix `name` (`shape` `[experts, in,
    /// out]` as widened), as they lie in the mapped file, if the checkpoint holds it so.
    fn with_mxfp4<R>(
        &self,
        name: &str,
        shape: &[usize],
        f: impl FnOnce(&mxfp4::Mxfp4Experts<'_>) -> Result<R>,
    ) -> Result<Option<R>> {
        let blocks_name = format!("{name}_blocks");
        if !self.ck.contains(&blocks_name) {
            return Ok(None);
        }
        // `[experts, in, out]` stored as `[experts, out, in / 32, 16]` codes and scales.
        let &[experts, in_dim, out_dim] = shape else {
            return Err(DetspecError::param("weights", format!("`{name}` is 3-D")));
        };
        if in_dim % 32 != 0 {
            return Err(DetspecError::BadTensor {
                name: blocks_name,
                path: self.ck.manifest().to_path_buf(),
                message: format!("MXFP4 blocks need an input width divisible by 32, got {in_dim}"),
            });
        }
        let groups = in_dim / 32;
        let blocks_shape = [experts, out_dim, groups, mxfp4::BLOCK_BYTES];
        let scales_name = format!("{name}_scales");
        let out =
            self.ck
                .with_bytes(&blocks_name, &blocks_shape, StDtype::U8, |blocks, _| {
                    self.ck.with_bytes(
                        &scales_name,
                        &[experts, out_dim, groups],
                        StDtype::U8,
                        |scales, _| {
                            f(&mxfp4::Mxfp4Experts {
                                blocks,
                                scales,
                                experts,
                                out_dim,
                                in_dim,
                            })
                        },
                    )?
                })??;
        Ok(Some(out))
    }

    /// Whether the checkpoint stores matrix `name` in FP8.
    fn stores_fp8(&self, name: &str) -> Result<bool> {
        Ok(self.fp8.is_some() && self.ck.stored_layout(name)?.0 == StDtype::F8_E4M3)
    }

    /// FP8 matrix `name` (`shape` `[rows, cols]`) widened by its scales (`fp8::widen`), in f32
    /// on the host.
    fn widen_fp8(&self, fp8: &Fp8Weights, name: &str, shape: &[usize]) -> Result<Tensor> {
        let &[rows, cols] = shape else {
            return Err(DetspecError::BadTensor {
                name: name.to_string(),
                path: self.ck.manifest().to_path_buf(),
                message: format!("FP8 weights are read as matrices, expected shape {shape:?}"),
            });
        };
        let scales = self.fp8_scales(fp8, name, rows, cols)?;
        let values = self
            .ck
            .with_bytes(name, shape, StDtype::F8_E4M3, |codes, bad| {
                fp8::widen(codes, &scales, rows, cols, fp8).map_err(|i| {
                    bad(format!(
                        "weight [{}, {}] is not a number (its code {:#04x}, or its scale)",
                        i / cols,
                        i % cols,
                        codes[i]
                    ))
                })
            })??;
        Ok(Tensor::from_vec(values, (rows, cols), &Device::Cpu)?)
    }

    /// The scales of FP8 matrix `name` (`[rows, cols]`), row-major, checked against the
    /// config's block layout.
    fn fp8_scales(
        &self,
        fp8: &Fp8Weights,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Vec<f32>> {
        let scale_name = format!("{name}{}", fp8.scale_suffix);
        let want = fp8.scale_shape(rows, cols);
        // Stored as `[r, c]`, or with its unit dimensions dropped (`[]` for one per matrix,
        // `[rows]` per channel).
        let (_, stored) = self.ck.stored_layout(&scale_name)?;
        let squeezed = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
        if squeezed(stored) != squeezed(&want) {
            return Err(DetspecError::BadTensor {
                name: scale_name,
                path: self.ck.manifest().to_path_buf(),
                message: format!(
                    "expected the scales of `{name}` {rows} x {cols} in blocks of {:?}: shape \
                     {want:?}, found {stored:?}",
                    fp8.block
                ),
            });
        }
        Ok(self
            .ck
            .load(&scale_name, stored, DType::F32, &Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    }

    /// Hashed on the host before the upload: hashing a GPU tensor would copy it back. An FP8
    /// matrix is widened first, so it is hashed as the checkpoint of its widened values.
    fn load_as(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor> {
        self.load_rounded(name, shape, self.dtype, dtype)
    }

    /// Parameter `name` (FP8 widened) rounded to `round` and held in `hold`, hashed as held.
    fn load_rounded(
        &self,
        name: &str,
        shape: &[usize],
        round: DType,
        hold: DType,
    ) -> Result<Tensor> {
        let stored = match self.fp8.as_ref() {
            Some(fp8) if self.stores_fp8(name)? => self.widen_fp8(fp8, name, shape)?,
            _ => self.ck.load(name, shape, round, &Device::Cpu)?,
        };
        let t = stored.to_dtype(round)?.to_dtype(hold)?;
        let h = tensor_hash(&t)?;
        self.hashes.borrow_mut().insert(name.to_string(), h);
        Ok(t.to_device(self.device)?)
    }

    /// Whether the checkpoint holds `name`.
    pub(super) fn has(&self, name: &str) -> bool {
        self.ck.contains(name)
    }

    /// Matrices a checkpoint stores stacked where the engine holds them apart (transformers 5's
    /// fused experts, `mlp.experts.gate_up_proj`): the stacked tensor `name`, cut by `cut` into
    /// named pieces, each in the weights' dtype and hashed under its own name (the one a
    /// checkpoint of the pieces uses), so that either spelling of a checkpoint or an update
    /// gives the same fingerprint.
    pub(super) fn unstacked(
        &self,
        name: &str,
        shape: &[usize],
        cut: impl Fn(&Tensor) -> Result<Vec<(String, Tensor)>>,
    ) -> Result<Vec<Tensor>> {
        let stored = self.ck.load(name, shape, self.dtype, &Device::Cpu)?;
        let mut pieces = Vec::new();
        for (piece, t) in cut(&stored.to_dtype(self.dtype)?)? {
            let t = t.contiguous()?;
            self.hashes.borrow_mut().insert(piece, tensor_hash(&t)?);
            pieces.push(t.to_device(self.device)?);
        }
        Ok(pieces)
    }

    pub(super) fn into_hashes(self) -> ParamHashes {
        self.hashes.into_inner()
    }
}

/// A norm weight `w` as the kernels multiply by it: `w + offset` (Gemma's norms scale by
/// `1 + w`), the sum taken in f32 as transformers takes it, then held in `w`'s dtype; `w` itself
/// where the offset is 0.
pub(super) fn offset_norm(w: &Tensor, offset: f64) -> candle_core::Result<Tensor> {
    if offset == 0.0 {
        return Ok(w.clone());
    }
    (w.to_dtype(DType::F32)? + offset)?.to_dtype(w.dtype())
}

/// A parameter (`[heads]` sink logits, a convolution's `[width, 1, kernel]` taps; any dtype
/// and device) in f32 on the host, flattened, where the CPU kernels read it.
pub(super) fn host_vector(t: &Tensor) -> Result<Arc<[f32]>> {
    Ok(t.to_dtype(DType::F32)?
        .to_device(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?
        .into())
}
