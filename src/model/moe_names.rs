//! The tensor names of a sparse MLP's parts, both ways: what a checkpoint of a mixture of
//! experts holds (Qwen's `mlp.experts.{e}.gate_proj`, Mixtral's `block_sparse_moe.experts.{e}.w1`),
//! which part a name addresses (weight updates), and transformers' fused in-memory form
//! turned into the checkpoint's. Needs only the config, so the parameter list
//! (`params.rs`) and the loader read it without the forward.

use candle_core::Tensor;

use crate::config::{ExpertNaming, ModelConfig, MoeConfig};
use crate::error::{DetspecError, Result};

/// A part of an expert's MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ExpertPart {
    Gate,
    Up,
    Down,
}

impl ExpertPart {
    pub(super) const ALL: [ExpertPart; 3] = [ExpertPart::Gate, ExpertPart::Up, ExpertPart::Down];

    pub(super) fn name(self, naming: ExpertNaming) -> &'static str {
        match (naming, self) {
            (ExpertNaming::Qwen, Self::Gate) => "gate_proj",
            (ExpertNaming::Qwen, Self::Up) => "up_proj",
            (ExpertNaming::Qwen, Self::Down) => "down_proj",
            (ExpertNaming::Mixtral, Self::Gate) => "w1",
            (ExpertNaming::Mixtral, Self::Up) => "w3",
            (ExpertNaming::Mixtral, Self::Down) => "w2",
        }
    }
}

/// A linear layer of a sparse MLP, by what it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SparseLinear {
    Router,
    Expert(usize, ExpertPart),
    Shared(ExpertPart),
    SharedGate,
}

/// The module path of layer `layer`'s sparse MLP (`model.layers.3.mlp`).
pub(super) fn sparse_root(naming: ExpertNaming, layer: usize) -> String {
    let block = match naming {
        ExpertNaming::Qwen => "mlp",
        ExpertNaming::Mixtral => "block_sparse_moe",
    };
    format!("model.layers.{layer}.{block}")
}

/// Every linear layer of layer `layer`'s sparse MLP: its module path and `[out, in]` shape.
pub(super) fn sparse_linears(
    cfg: &ModelConfig,
    moe: &MoeConfig,
    layer: usize,
) -> Vec<(String, [usize; 2])> {
    let (hidden, width) = (cfg.hidden_size, moe.expert_intermediate_size);
    let root = sparse_root(moe.naming, layer);
    let expert = |prefix: &str, width: usize| {
        ExpertPart::ALL.map(|part| {
            let shape = match part {
                ExpertPart::Down => [hidden, width],
                _ => [width, hidden],
            };
            (format!("{prefix}.{}", part.name(moe.naming)), shape)
        })
    };
    let mut out = vec![(format!("{root}.gate"), [moe.num_experts, hidden])];
    for e in 0..moe.num_experts {
        out.extend(expert(&format!("{root}.experts.{e}"), width));
    }
    if let Some(width) = moe.shared_expert_intermediate_size {
        out.extend(expert(&format!("{root}.shared_expert"), width));
        out.push((format!("{root}.shared_expert_gate"), [1, hidden]));
    }
    out
}

/// Which linear layer of a sparse MLP the module path `module` (relative to its decoder
/// layer: `mlp.experts.3.up_proj`) names, if any.
pub(super) fn parse_sparse_linear(moe: &MoeConfig, module: &str) -> Option<SparseLinear> {
    let block = match moe.naming {
        ExpertNaming::Qwen => "mlp.",
        ExpertNaming::Mixtral => "block_sparse_moe.",
    };
    let rest = module.strip_prefix(block)?;
    let part = |name: &str| {
        ExpertPart::ALL
            .into_iter()
            .find(|p| p.name(moe.naming) == name)
    };
    match rest {
        "gate" => return Some(SparseLinear::Router),
        "shared_expert_gate" if moe.shared_expert_intermediate_size.is_some() => {
            return Some(SparseLinear::SharedGate)
        }
        _ => {}
    }
    if let Some(name) = rest.strip_prefix("shared_expert.") {
        return moe
            .shared_expert_intermediate_size
            .and(part(name))
            .map(SparseLinear::Shared);
    }
    let (e, name) = rest.strip_prefix("experts.")?.split_once('.')?;
    let e: usize = e.parse().ok()?;
    (e < moe.num_experts).then_some(())?;
    Some(SparseLinear::Expert(e, part(name)?))
}

/// `updates` with transformers' in-memory names of a sparse model's experts turned into the
/// checkpoint's: since transformers 5 a model's `state_dict()` holds each layer's experts fused,
/// `mlp.experts.gate_up_proj` `[experts, 2 × width, hidden]` (gate rows first) and
/// `mlp.experts.down_proj` `[experts, hidden, width]`, and Mixtral's router as `mlp.gate`,
/// while checkpoints (and the engine) name each expert's matrices. Other names pass unchanged.
pub fn unfuse_experts(
    cfg: &ModelConfig,
    updates: Vec<(String, Tensor)>,
) -> Result<Vec<(String, Tensor)>> {
    let Some(moe) = &cfg.moe else {
        return Ok(updates);
    };
    let mut out = Vec::with_capacity(updates.len());
    for (name, t) in updates {
        let Some((layer, field)) = name
            .strip_prefix("model.layers.")
            .and_then(|r| r.split_once('.'))
            .and_then(|(l, f)| Some((l.parse::<usize>().ok()?, f)))
            .filter(|&(l, _)| moe.is_sparse(l))
        else {
            out.push((name, t));
            continue;
        };
        let root = sparse_root(moe.naming, layer);
        let (e, width, hidden) = (
            moe.num_experts,
            moe.expert_intermediate_size,
            cfg.hidden_size,
        );
        let fused = |want: [usize; 3]| -> Result<()> {
            if t.dims() != want {
                return Err(DetspecError::param(
                    "named_tensors",
                    format!("`{name}` has shape {:?}; the model's is {want:?}", t.dims()),
                ));
            }
            Ok(())
        };
        let expert = |i: usize, part: ExpertPart| {
            format!("{root}.experts.{i}.{}.weight", part.name(moe.naming))
        };
        match field {
            "mlp.gate.weight" => out.push((format!("{root}.gate.weight"), t)),
            "mlp.experts.gate_up_proj" => {
                fused([e, 2 * width, hidden])?;
                for i in 0..e {
                    let w = t.get(i)?;
                    out.push((
                        expert(i, ExpertPart::Gate),
                        w.narrow(0, 0, width)?.contiguous()?,
                    ));
                    out.push((
                        expert(i, ExpertPart::Up),
                        w.narrow(0, width, width)?.contiguous()?,
                    ));
                }
            }
            "mlp.experts.down_proj" => {
                fused([e, hidden, width])?;
                for i in 0..e {
                    out.push((expert(i, ExpertPart::Down), t.get(i)?.contiguous()?));
                }
            }
            _ => out.push((name, t)),
        }
    }
    Ok(out)
}
