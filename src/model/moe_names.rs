//! The tensor names of a sparse MLP's parts, both ways: what a checkpoint of a mixture of
//! experts holds (Qwen's `mlp.experts.{e}.gate_proj`, Mixtral's `block_sparse_moe.experts.{e}.w1`),
//! which part a name addresses (weight updates), and transformers' fused in-memory form
//! turned into the checkpoint's. Needs only the config, so the parameter list
//! (`params.rs`) and the loader read it without the forward.

use candle_core::Tensor;

use crate::config::{ExpertNaming, ModelConfig, MoeConfig, Scoring};
use crate::error::{DetspecError, Result};

use super::fused_experts::FusedPart;
use super::weights::granite_file_name;

/// A part of an expert's MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ExpertPart {
    Gate,
    Up,
    Down,
}

impl ExpertPart {
    /// The parts of `moe`'s experts: an ungated one's (Nemotron-H's) have no gate.
    fn all(moe: &MoeConfig) -> &'static [ExpertPart] {
        match moe.ungated {
            true => &[ExpertPart::Up, ExpertPart::Down],
            false => &[ExpertPart::Gate, ExpertPart::Up, ExpertPart::Down],
        }
    }

    fn name(self, naming: ExpertNaming) -> &'static str {
        match (naming, self) {
            (ExpertNaming::Mixtral | ExpertNaming::Lfm2, Self::Gate) => "w1",
            (ExpertNaming::Mixtral | ExpertNaming::Lfm2, Self::Up) => "w3",
            (ExpertNaming::Mixtral | ExpertNaming::Lfm2, Self::Down) => "w2",
            // Qwen's. gpt-oss's and Granite's checkpoints stack the experts
            // (`fused_experts`): for them these names are the engine's alone.
            (_, Self::Gate) => "gate_proj",
            (_, Self::Up) => "up_proj",
            (_, Self::Down) => "down_proj",
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

impl SparseLinear {
    /// Its module path in decoder layer `layer` (`model.layers.3.mlp.experts.5.up_proj`): the
    /// one place the checkpoint's names are written.
    pub(super) fn path(self, naming: ExpertNaming, layer: usize) -> String {
        let root = format!("model.layers.{layer}.{}", block(naming));
        match self {
            Self::Router => format!("{root}.{}", router(naming)),
            Self::Expert(e, part) => format!("{root}.experts.{e}.{}", part.name(naming)),
            Self::Shared(part) => format!("{root}.{}.{}", shared(naming), part.name(naming)),
            Self::SharedGate => format!("{root}.shared_expert_gate"),
        }
    }

    /// Its weight's `[out, in]` shape.
    pub(super) fn shape(self, cfg: &ModelConfig, moe: &MoeConfig) -> [usize; 2] {
        let hidden = cfg.hidden_size;
        let mlp = |part: ExpertPart, width: usize| match part {
            ExpertPart::Down => [hidden, width],
            _ => [width, hidden],
        };
        let shared = moe.shared_expert_intermediate_size.unwrap_or(0);
        match self {
            Self::Router => [moe.num_experts, hidden],
            Self::Expert(_, part) => mlp(part, moe.expert_intermediate_size),
            Self::Shared(part) => mlp(part, shared),
            Self::SharedGate => [1, hidden],
        }
    }
}

/// One of transformers 5's tensors of a layer's experts held stacked: its `state_dict()`'s,
/// and the files of models it saves without converting them (Mistral 4's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FusedExperts {
    /// `{block}.experts.gate_up_proj`, `[experts, 2 × width, hidden]`, gate rows first.
    GateUp,
    /// `{block}.experts.up_proj`, `[experts, width, hidden]`: ungated experts' (Nemotron-H's).
    Up,
    /// `{block}.experts.down_proj`, `[experts, hidden, width]`.
    Down,
}

impl FusedExperts {
    /// The stacked tensors of one layer of `moe`'s experts.
    pub(super) fn of(moe: &MoeConfig) -> [Self; 2] {
        match moe.ungated {
            true => [Self::Up, Self::Down],
            false => [Self::GateUp, Self::Down],
        }
    }

    /// Its name in layer `layer`.
    pub(super) fn name(self, naming: ExpertNaming, layer: usize) -> String {
        let leaf = match self {
            Self::GateUp => "gate_up_proj",
            Self::Up => "up_proj",
            Self::Down => "down_proj",
        };
        format!("model.layers.{layer}.{}.experts.{leaf}", block(naming))
    }

    pub(super) fn shape(self, cfg: &ModelConfig, moe: &MoeConfig) -> [usize; 3] {
        let (e, w, h) = (
            moe.num_experts,
            moe.expert_intermediate_size,
            cfg.hidden_size,
        );
        match self {
            Self::GateUp => [e, 2 * w, h],
            Self::Up => [e, w, h],
            Self::Down => [e, h, w],
        }
    }

    /// Each expert's matrices of `t` (of [`Self::shape`]) under their checkpoint names.
    pub(super) fn cut(
        self,
        moe: &MoeConfig,
        layer: usize,
        t: &Tensor,
    ) -> candle_core::Result<Vec<(String, Tensor)>> {
        let w = moe.expert_intermediate_size;
        let name = |i: usize, part| {
            format!(
                "{}.weight",
                SparseLinear::Expert(i, part).path(moe.naming, layer)
            )
        };
        let mut out = Vec::new();
        for i in 0..moe.num_experts {
            let x = t.get(i)?;
            match self {
                Self::GateUp => {
                    out.push((name(i, ExpertPart::Gate), x.narrow(0, 0, w)?.contiguous()?));
                    out.push((name(i, ExpertPart::Up), x.narrow(0, w, w)?.contiguous()?));
                }
                Self::Up => out.push((name(i, ExpertPart::Up), x.contiguous()?)),
                Self::Down => out.push((name(i, ExpertPart::Down), x.contiguous()?)),
            }
        }
        Ok(out)
    }
}

/// The module under a decoder layer that holds its sparse MLP.
fn block(naming: ExpertNaming) -> &'static str {
    match naming {
        ExpertNaming::Qwen
        | ExpertNaming::GptOss
        | ExpertNaming::DeepSeek
        | ExpertNaming::Ernie
        | ExpertNaming::Hunyuan => "mlp",
        ExpertNaming::Mixtral | ExpertNaming::Granite => "block_sparse_moe",
        ExpertNaming::Lfm2 => "feed_forward",
    }
}

/// [`block`] in transformers' in-memory names (`state_dict()`), where it differs: Mixtral's
/// `block_sparse_moe` is `mlp` there.
fn memory_block(naming: ExpertNaming) -> &'static str {
    match naming {
        ExpertNaming::Lfm2 => "feed_forward",
        _ => "mlp",
    }
}

/// The router's name under [`block`].
fn router(naming: ExpertNaming) -> &'static str {
    match naming {
        ExpertNaming::GptOss => "router",
        ExpertNaming::Granite => "router.layer",
        ExpertNaming::Hunyuan => "gate.wg",
        ExpertNaming::Qwen
        | ExpertNaming::Mixtral
        | ExpertNaming::DeepSeek
        | ExpertNaming::Ernie
        | ExpertNaming::Lfm2 => "gate",
    }
}

/// The shared expert's name under [`block`] (where its parts are named apart).
fn shared(naming: ExpertNaming) -> &'static str {
    match naming {
        ExpertNaming::DeepSeek | ExpertNaming::Ernie => "shared_experts",
        ExpertNaming::Hunyuan => "shared_mlp",
        _ => "shared_expert",
    }
}

/// Whether the shared expert is scaled by Qwen2-MoE's sigmoid gate (`shared_expert_gate`).
pub(super) fn has_shared_gate(moe: &MoeConfig) -> bool {
    moe.shared_expert_intermediate_size.is_some() && moe.naming == ExpertNaming::Qwen
}

/// The name of the router's per-expert correction bias, if it has one: DeepSeek's under its
/// router (`mlp.gate`), MiniMax-M2's beside it (`block_sparse_moe`), ERNIE's in
/// `mlp.moe_statics`, LFM2-MoE's beside its router as `expert_bias`. DeepSeek-V2's softmax
/// routing has none.
pub(super) fn router_bias_name(moe: &MoeConfig, layer: usize) -> Option<String> {
    let biased = match moe.naming {
        ExpertNaming::Ernie => true,
        _ if moe.unbiased_choice => false,
        _ => moe.deepseek_routing.map(|r| r.scoring) == Some(Scoring::Sigmoid),
    };
    let root = format!("model.layers.{layer}.{}", block(moe.naming));
    let owner = match moe.naming {
        ExpertNaming::DeepSeek if !moe.bias_beside_router => {
            SparseLinear::Router.path(moe.naming, layer)
        }
        ExpertNaming::Ernie => format!("{root}.moe_statics"),
        _ => root,
    };
    let leaf = match moe.naming {
        ExpertNaming::Lfm2 => "expert_bias",
        _ => "e_score_correction_bias",
    };
    biased.then(|| format!("{owner}.{leaf}"))
}

/// The correction bias's shape on file: ERNIE's one row (`[1, experts]`), else `[experts]`.
pub(super) fn router_bias_shape(moe: &MoeConfig) -> Vec<usize> {
    match moe.naming {
        ExpertNaming::Ernie => vec![1, moe.num_experts],
        _ => vec![moe.num_experts],
    }
}

/// Every linear layer of a sparse MLP, in checkpoint order.
fn sparse_parts(moe: &MoeConfig) -> Vec<SparseLinear> {
    let mut out = vec![SparseLinear::Router];
    let parts = ExpertPart::all(moe);
    for e in 0..moe.num_experts {
        out.extend(parts.iter().map(|&p| SparseLinear::Expert(e, p)));
    }
    if moe.shared_expert_intermediate_size.is_some() {
        out.extend(parts.iter().map(|&p| SparseLinear::Shared(p)));
    }
    if has_shared_gate(moe) {
        out.push(SparseLinear::SharedGate);
    }
    out
}

/// Every parameter of layer `layer`'s sparse MLP as a checkpoint names it, with its shape:
/// each linear layer's weight (and bias, gpt-oss's router); gpt-oss's and Granite's experts as
/// their stacked tensors (`fused_experts`).
pub(super) fn sparse_params(
    cfg: &ModelConfig,
    moe: &MoeConfig,
    layer: usize,
) -> Vec<(String, Vec<usize>)> {
    let naming = moe.naming;
    if naming.stacked() {
        let router = SparseLinear::Router.path(naming, layer);
        let mut out = vec![(
            format!("{router}.weight"),
            vec![moe.num_experts, cfg.hidden_size],
        )];
        if naming.has_biases() {
            out.push((format!("{router}.bias"), vec![moe.num_experts]));
        }
        let shared = moe.shared_expert_intermediate_size.is_some();
        out.extend(
            FusedPart::all(naming, shared)
                .iter()
                .map(|p| (p.path(naming, layer), p.shape(naming, cfg, moe))),
        );
        return out;
    }
    let mut out: Vec<_> = sparse_parts(moe)
        .into_iter()
        .map(|p| {
            let name = format!("{}.weight", p.path(moe.naming, layer));
            (name, p.shape(cfg, moe).to_vec())
        })
        .collect();
    out.extend(router_bias_name(moe, layer).map(|name| (name, router_bias_shape(moe))));
    out
}

/// The stacked expert tensors a checkpoint of `cfg` may hold in place of each expert's
/// matrices ([`FusedExperts`]: transformers 5 writes some models' so), with their shapes.
pub fn fused_expert_shapes(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let Some(moe) = cfg.moe.as_ref().filter(|m| !m.naming.stacked()) else {
        return Vec::new();
    };
    let parts = FusedExperts::of(moe);
    (0..cfg.num_hidden_layers)
        .filter(|&l| moe.is_sparse(l))
        .flat_map(|l| parts.map(|p| (p.name(moe.naming, l), p.shape(cfg, moe).to_vec())))
        .collect()
}

/// Whether `name`, an expert's matrix, is held in a checkpoint (whose tensors `has` tells)
/// by its layer's stacked tensors ([`fused_expert_shapes`]: all of that layer's there).
pub fn held_stacked(cfg: &ModelConfig, has: &dyn Fn(&str) -> bool, name: &str) -> bool {
    let Some(moe) = cfg.moe.as_ref().filter(|m| !m.naming.stacked()) else {
        return false;
    };
    let Some((layer, module)) = name
        .strip_prefix("model.layers.")
        .and_then(|r| r.strip_suffix(".weight"))
        .and_then(|r| r.split_once('.'))
        .and_then(|(l, m)| Some((l.parse::<usize>().ok()?, m)))
    else {
        return false;
    };
    let expert = matches!(
        parse_sparse_linear(moe, module),
        Some(SparseLinear::Expert(..))
    );
    let parts = FusedExperts::of(moe);
    expert && moe.is_sparse(layer) && parts.iter().all(|p| has(&p.name(moe.naming, layer)))
}

/// Which linear layer of a sparse MLP the module path `module` (relative to its decoder
/// layer: `mlp.experts.3.up_proj`) names, if any.
pub(super) fn parse_sparse_linear(moe: &MoeConfig, module: &str) -> Option<SparseLinear> {
    let rest = module.strip_prefix(block(moe.naming))?.strip_prefix('.')?;
    let part = |name: &str| {
        ExpertPart::all(moe)
            .iter()
            .copied()
            .find(|p| p.name(moe.naming) == name)
    };
    match rest {
        r if r == router(moe.naming) => return Some(SparseLinear::Router),
        "shared_expert_gate" if has_shared_gate(moe) => return Some(SparseLinear::SharedGate),
        _ => {}
    }
    if let Some(name) = rest
        .strip_prefix(shared(moe.naming))
        .and_then(|r| r.strip_prefix('.'))
    {
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

/// `updates` with transformers' in-memory names of Granite MoE's experts and router
/// (`block_sparse_moe.experts.gate_up_proj`, `.down_proj`, `.router.weight`) turned into its
/// checkpoints' (`block_sparse_moe.input_linear.weight`, `.output_linear.weight`,
/// `.router.layer.weight`): the same tensors under other names.
fn granite_names(updates: Vec<(String, Tensor)>) -> Vec<(String, Tensor)> {
    updates
        .into_iter()
        .map(|(name, t)| (granite_file_name(&name).unwrap_or(name), t))
        .collect()
}

/// `updates` with transformers' in-memory names of a sparse model's experts turned into the
/// checkpoint's: since transformers 5 a model's `state_dict()` holds each layer's experts fused,
/// `mlp.experts.gate_up_proj` `[experts, 2 × width, hidden]` (gate rows first) and
/// `mlp.experts.down_proj` `[experts, hidden, width]`, and Mixtral's router as `mlp.gate`
/// (MiniMax-M2's correction bias as `mlp.e_score_correction_bias`, ERNIE's under its router),
/// while checkpoints (and the engine) name each expert's matrices. Other names pass unchanged.
pub fn unfuse_experts(
    cfg: &ModelConfig,
    updates: Vec<(String, Tensor)>,
) -> Result<Vec<(String, Tensor)>> {
    // gpt-oss's in-memory names are its checkpoints'.
    let Some(moe) = cfg
        .moe
        .as_ref()
        .filter(|m| m.naming != ExpertNaming::GptOss)
    else {
        return Ok(updates);
    };
    if moe.naming == ExpertNaming::Granite {
        return Ok(granite_names(updates));
    }
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
        let weight = |which: SparseLinear| format!("{}.weight", which.path(moe.naming, layer));
        // (the file's block name too: a checkpoint that stacks them, read for an update)
        let Some(field) = [memory_block(moe.naming), block(moe.naming)]
            .iter()
            .find_map(|b| field.strip_prefix(b)?.strip_prefix('.'))
        else {
            out.push((name, t));
            continue;
        };
        let fused = match field {
            "experts.gate_up_proj" => Some(FusedExperts::GateUp),
            "experts.up_proj" if moe.ungated => Some(FusedExperts::Up),
            "experts.down_proj" => Some(FusedExperts::Down),
            _ => None,
        };
        if let Some(fused) = fused {
            let want = fused.shape(cfg, moe);
            if t.dims() != want {
                return Err(DetspecError::param(
                    "named_tensors",
                    format!("`{name}` has shape {:?}; the model's is {want:?}", t.dims()),
                ));
            }
            out.extend(fused.cut(moe, layer, &t)?);
            continue;
        }
        match field {
            "gate.weight" => out.push((weight(SparseLinear::Router), t)),
            // The correction bias where memory and file name it apart: MiniMax-M2's
            // (`block_sparse_moe.e_score_correction_bias` on file), ERNIE's
            // (`mlp.moe_statics.e_score_correction_bias`), K-EXAONE's
            // (`mlp.e_score_correction_bias` on file, under the router in memory).
            "e_score_correction_bias"
            | "gate.e_score_correction_bias"
            | "gate.moe_statics.e_score_correction_bias" => match router_bias_name(moe, layer) {
                Some(file) => out.push((file, t)),
                None => out.push((name, t)),
            },
            _ => out.push((name, t)),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Nemotron 3 layout: experts in layers 1 and 3, ungated.
    fn nemotron_moe() -> ModelConfig {
        let json = r#"{"architectures": ["NemotronHForCausalLM"], "hidden_size": 16,
            "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 8, "vocab_size": 50, "hybrid_override_pattern": "ME*E",
            "mamba_num_heads": 2, "mamba_head_dim": 8, "ssm_state_size": 4, "n_groups": 1,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
            "moe_shared_expert_intermediate_size": 12}"#;
        ModelConfig::from_json_str(json, std::path::Path::new("config.json")).unwrap()
    }

    #[test]
    fn ungated_experts_have_no_gate_and_stack_their_up_projections_alone() {
        let cfg = nemotron_moe();
        let shapes = crate::model::param_shapes(&cfg);
        let e = "model.layers.1.mlp.experts.2";
        assert_eq!(shapes[&format!("{e}.up_proj.weight")], vec![8, 16]);
        assert_eq!(shapes[&format!("{e}.down_proj.weight")], vec![16, 8]);
        assert!(!shapes.contains_key(&format!("{e}.gate_proj.weight")));
        let shared = "model.layers.3.mlp.shared_experts";
        assert_eq!(shapes[&format!("{shared}.up_proj.weight")], vec![12, 16]);
        assert!(shapes.contains_key("model.layers.3.mlp.gate.e_score_correction_bias"));
        let stacked = fused_expert_shapes(&cfg);
        assert_eq!(
            stacked,
            [1, 3]
                .into_iter()
                .flat_map(|l| [
                    (
                        format!("model.layers.{l}.mlp.experts.up_proj"),
                        vec![4, 8, 16]
                    ),
                    (
                        format!("model.layers.{l}.mlp.experts.down_proj"),
                        vec![4, 16, 8]
                    ),
                ])
                .collect::<Vec<_>>()
        );
    }

    /// An expert's matrix is held by its layer's stacked tensors only where all of them are
    /// there; the router, the shared expert and other layers' experts never are.
    #[test]
    fn stacked_tensors_hold_their_layers_experts_only() {
        let cfg = nemotron_moe();
        let up = "model.layers.1.mlp.experts.up_proj";
        let down = "model.layers.1.mlp.experts.down_proj";
        let both = |n: &str| n == up || n == down;
        let only_up = |n: &str| n == up;
        let expert = "model.layers.1.mlp.experts.3.down_proj.weight";
        assert!(held_stacked(&cfg, &both, expert));
        assert!(!held_stacked(&cfg, &only_up, expert));
        for other in [
            "model.layers.3.mlp.experts.3.down_proj.weight",
            "model.layers.1.mlp.shared_experts.up_proj.weight",
            "model.layers.1.mlp.gate.weight",
            "model.layers.1.mlp.experts.9.up_proj.weight",
        ] {
            assert!(!held_stacked(&cfg, &both, other), "{other}");
        }
    }
}
