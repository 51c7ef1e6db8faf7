//! Experts as gpt-oss's and Granite MoE's checkpoints store them, one tensor per part holding
//! every expert of a layer, and the per-expert `[out, in]` matrices the engine runs (each
//! expert a `Linear` like any other, so the GEMMs and their invariance are the dense layers').
//!
//! - gpt-oss (transformers' `GptOssExperts`): `mlp.experts.gate_up_proj` `[experts, hidden,
//!   2 × width]` multiplies from the right, its columns alternating gate and up; `down_proj`
//!   `[experts, width, hidden]` likewise; each with `…_bias`. (MXFP4 checkpoints hold the
//!   transposes as 4-bit blocks, `super::mxfp4`; the loader widens them into this layout.)
//! - Granite MoE: `block_sparse_moe.input_linear.weight` `[experts, 2 × width, hidden]`, gate
//!   rows then up rows; `output_linear.weight` `[experts, hidden, width]`; and Granite MoE
//!   Shared's ungated shared MLP, `shared_mlp.input_linear.weight` `[2 × width, hidden]` and
//!   `shared_mlp.output_linear.weight`, the same layout for one expert.

use candle_core::Tensor;

use crate::config::{ExpertNaming, ModelConfig, MoeConfig};
use crate::error::Result;

/// One of a layer's stacked expert tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FusedPart {
    GateUp,
    GateUpBias,
    Down,
    DownBias,
    /// Granite MoE Shared's shared MLP, gate and up.
    SharedGateUp,
    /// Its down projection.
    SharedDown,
}

impl FusedPart {
    /// The parts a checkpoint of `naming` (with a shared MLP or not) stacks.
    pub(super) fn all(naming: ExpertNaming, shared: bool) -> &'static [FusedPart] {
        use FusedPart::*;
        match (naming, shared) {
            (ExpertNaming::GptOss, _) => &[GateUp, GateUpBias, Down, DownBias],
            (ExpertNaming::Granite, false) => &[GateUp, Down],
            (ExpertNaming::Granite, true) => &[GateUp, Down, SharedGateUp, SharedDown],
            (
                ExpertNaming::Qwen
                | ExpertNaming::Mixtral
                | ExpertNaming::DeepSeek
                | ExpertNaming::Ernie
                | ExpertNaming::Lfm2
                | ExpertNaming::Hunyuan,
                _,
            ) => &[],
        }
    }

    /// Its name under decoder layer `layer` in a checkpoint of `naming`.
    pub(super) fn path(self, naming: ExpertNaming, layer: usize) -> String {
        let p = format!("model.layers.{layer}");
        match (naming, self) {
            (ExpertNaming::Granite, FusedPart::GateUp) => {
                format!("{p}.block_sparse_moe.input_linear.weight")
            }
            (ExpertNaming::Granite, FusedPart::Down) => {
                format!("{p}.block_sparse_moe.output_linear.weight")
            }
            (_, FusedPart::SharedGateUp) => format!("{p}.shared_mlp.input_linear.weight"),
            (_, FusedPart::SharedDown) => format!("{p}.shared_mlp.output_linear.weight"),
            (_, FusedPart::GateUp) => format!("{p}.mlp.experts.gate_up_proj"),
            (_, FusedPart::GateUpBias) => format!("{p}.mlp.experts.gate_up_proj_bias"),
            (_, FusedPart::Down) => format!("{p}.mlp.experts.down_proj"),
            (_, FusedPart::DownBias) => format!("{p}.mlp.experts.down_proj_bias"),
        }
    }

    /// The part of a checkpoint of `naming` (with a `shared` MLP or not) named `name` in decoder
    /// layer `layer`, if any.
    pub(super) fn parse(
        naming: ExpertNaming,
        shared: bool,
        layer: usize,
        name: &str,
    ) -> Option<Self> {
        Self::all(naming, shared)
            .iter()
            .copied()
            .find(|p| p.path(naming, layer) == name)
    }

    /// Whether it is a matrix (held in the weights' dtype) rather than biases.
    pub(super) fn is_matrix(self) -> bool {
        !matches!(self, FusedPart::GateUpBias | FusedPart::DownBias)
    }

    /// Whether it is of the shared MLP rather than the routed experts.
    pub(super) fn is_shared(self) -> bool {
        matches!(self, FusedPart::SharedGateUp | FusedPart::SharedDown)
    }

    /// Its shape in a checkpoint of `naming`.
    pub(super) fn shape(
        self,
        naming: ExpertNaming,
        cfg: &ModelConfig,
        moe: &MoeConfig,
    ) -> Vec<usize> {
        let (e, w, h) = (
            moe.num_experts,
            moe.expert_intermediate_size,
            cfg.hidden_size,
        );
        let s = moe.shared_expert_intermediate_size.unwrap_or(0);
        match (naming, self) {
            (_, FusedPart::SharedGateUp) => vec![2 * s, h],
            (_, FusedPart::SharedDown) => vec![h, s],
            (ExpertNaming::Granite, FusedPart::GateUp) => vec![e, 2 * w, h],
            (ExpertNaming::Granite, FusedPart::Down) => vec![e, h, w],
            (_, FusedPart::GateUp) => vec![e, h, 2 * w],
            (_, FusedPart::GateUpBias) => vec![e, 2 * w],
            (_, FusedPart::Down) => vec![e, w, h],
            (_, FusedPart::DownBias) => vec![e, h],
        }
    }

    /// A matrix part's outputs as rows of its `[out, in]` form (an MXFP4 checkpoint's rows):
    /// gate's and up's (alternating in gpt-oss, halves in Granite), or down's.
    pub(super) fn output_rows(
        self,
        naming: ExpertNaming,
        cfg: &ModelConfig,
        moe: &MoeConfig,
    ) -> Vec<Vec<usize>> {
        let width = match self {
            FusedPart::SharedGateUp => moe.shared_expert_intermediate_size.unwrap_or(0),
            FusedPart::GateUp => moe.expert_intermediate_size,
            _ => return vec![(0..cfg.hidden_size).collect()],
        };
        match naming {
            ExpertNaming::GptOss => vec![
                (0..width).map(|i| 2 * i).collect(),
                (0..width).map(|i| 2 * i + 1).collect(),
            ],
            _ => vec![(0..width).collect(), (width..2 * width).collect()],
        }
    }

    /// Per expert (one for a shared part), the pieces of `t` (this part of a checkpoint of
    /// `naming`, shaped as [`Self::shape`]): for a gate/up part the gate's and up's `[width,
    /// hidden]` weights, for `GateUpBias` their biases, for a down part its `[hidden, width]`
    /// weight, for `DownBias` its bias.
    pub(super) fn split(self, naming: ExpertNaming, t: &Tensor) -> Result<Vec<Vec<Tensor>>> {
        // gpt-oss's gate and up alternate along the output dimension; Granite's are halves.
        let interleaved = naming == ExpertNaming::GptOss;
        let per_expert = |t: &Tensor| -> candle_core::Result<Vec<Tensor>> {
            Ok(match self {
                FusedPart::GateUp | FusedPart::GateUpBias | FusedPart::SharedGateUp => {
                    let width = t.dim(0)? / 2;
                    let (gate, up) = if interleaved {
                        let pairs = t.reshape((width, 2, ()))?;
                        let half = |i| pairs.narrow(1, i, 1)?.squeeze(1)?.contiguous();
                        (half(0)?, half(1)?)
                    } else {
                        let half = |i| t.narrow(0, i * width, width)?.contiguous();
                        (half(0)?, half(1)?)
                    };
                    match self {
                        FusedPart::GateUpBias => vec![gate.flatten_all()?, up.flatten_all()?],
                        _ => vec![gate, up],
                    }
                }
                FusedPart::Down | FusedPart::DownBias | FusedPart::SharedDown => {
                    vec![t.contiguous()?]
                }
            })
        };
        if self.is_shared() {
            return Ok(vec![per_expert(t)?]);
        }
        // `[experts, out, in]` for the matrices, `[experts, out]` for the biases.
        let t = if interleaved && self.is_matrix() {
            t.transpose(1, 2)?
        } else {
            t.clone()
        };
        let experts = t.dim(0)?;
        let mut out = Vec::with_capacity(experts);
        for e in 0..experts {
            out.push(per_expert(&t.get(e)?)?);
        }
        Ok(out)
    }
}
