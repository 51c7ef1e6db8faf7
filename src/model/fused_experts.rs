//! gpt-oss's experts as its checkpoints store them: one tensor per part holding every expert
//! of a layer, with biases, and the per-expert `[out, in]` matrices the engine runs (each
//! expert a `Linear` like any other, so the GEMMs and their invariance are the dense layers').
//!
//! The layout (transformers' `GptOssExperts`): `gate_up_proj` `[experts, hidden, 2 × width]`
//! multiplies from the right, its columns alternating gate and up; `down_proj`
//! `[experts, width, hidden]` likewise. (MXFP4 checkpoints hold the transposes as 4-bit
//! blocks, `super::mxfp4`; the loader widens them into this layout.)

use candle_core::Tensor;

use crate::config::{ModelConfig, MoeConfig};
use crate::error::Result;

/// One of a layer's stacked expert tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FusedPart {
    GateUp,
    GateUpBias,
    Down,
    DownBias,
}

impl FusedPart {
    pub(super) const ALL: [FusedPart; 4] = [
        FusedPart::GateUp,
        FusedPart::GateUpBias,
        FusedPart::Down,
        FusedPart::DownBias,
    ];

    /// Its name under `mlp.experts.`.
    pub(super) fn name(self) -> &'static str {
        match self {
            FusedPart::GateUp => "gate_up_proj",
            FusedPart::GateUpBias => "gate_up_proj_bias",
            FusedPart::Down => "down_proj",
            FusedPart::DownBias => "down_proj_bias",
        }
    }

    /// The part named `name` (under `mlp.experts.`), if any.
    pub(super) fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }

    /// Its full name in decoder layer `layer`.
    pub(super) fn path(self, layer: usize) -> String {
        format!("model.layers.{layer}.mlp.experts.{}", self.name())
    }

    /// Whether it is a matrix (held in the weights' dtype) rather than biases.
    pub(super) fn is_matrix(self) -> bool {
        matches!(self, FusedPart::GateUp | FusedPart::Down)
    }

    /// Its shape in a checkpoint (and in transformers' `state_dict()`).
    pub(super) fn shape(self, cfg: &ModelConfig, moe: &MoeConfig) -> Vec<usize> {
        let (e, w, h) = (
            moe.num_experts,
            moe.expert_intermediate_size,
            cfg.hidden_size,
        );
        match self {
            FusedPart::GateUp => vec![e, h, 2 * w],
            FusedPart::GateUpBias => vec![e, 2 * w],
            FusedPart::Down => vec![e, w, h],
            FusedPart::DownBias => vec![e, h],
        }
    }

    /// Per expert, the pieces of `t` (this part, shaped as [`Self::shape`]): for `GateUp` the
    /// gate's and up's `[width, hidden]` weights, for `GateUpBias` their biases, for `Down`
    /// its `[hidden, width]` weight, for `DownBias` its bias.
    pub(super) fn split(self, t: &Tensor) -> Result<Vec<Vec<Tensor>>> {
        let per_expert = |t: &Tensor| -> candle_core::Result<Vec<Tensor>> {
            Ok(match self {
                FusedPart::GateUp | FusedPart::GateUpBias => {
                    // Gate and up alternate along the output dimension.
                    let out = t.dim(0)?;
                    let pairs = t.reshape((out / 2, 2, ()))?;
                    let half = |i| pairs.narrow(1, i, 1)?.squeeze(1)?.contiguous();
                    let (gate, up) = (half(0)?, half(1)?);
                    match self {
                        FusedPart::GateUpBias => vec![gate.flatten_all()?, up.flatten_all()?],
                        _ => vec![gate, up],
                    }
                }
                FusedPart::Down | FusedPart::DownBias => vec![t.contiguous()?],
            })
        };
        // `[experts, out, in]` for the matrices, `[experts, out]` for the biases.
        let t = if self.is_matrix() {
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
