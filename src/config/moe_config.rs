//! The mixture-of-experts part of a Hugging Face `config.json` (Qwen2-MoE, Qwen3-MoE, Mixtral,
//! OLMoE, gpt-oss, Granite MoE, GLM-4.5, DeepSeek, GLM-4.7-Flash): how many experts, how many each token is routed to and
//! how, which layers are sparse, and how the checkpoint names the experts' tensors.

use std::path::Path;

use serde::Deserialize;

use crate::error::{DetspecError, Result};

/// How a checkpoint names a sparse layer's router and experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExpertNaming {
    /// `mlp.gate`, `mlp.experts.{e}.{gate,up,down}_proj` (Qwen2-MoE, Qwen3-MoE, OLMoE).
    Qwen,
    /// `block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.{w1,w3,w2}` (Mixtral).
    Mixtral,
    /// gpt-oss: `mlp.router` (with a bias), and every expert's matrices in one tensor per
    /// part with their biases: `mlp.experts.gate_up_proj` `[experts, hidden, 2 × width]`
    /// (gate and up columns alternating), `mlp.experts.down_proj` `[experts, width, hidden]`,
    /// and `…_bias`; or MXFP4's `…_blocks` and `…_scales` in place of the matrices.
    GptOss,
    /// Granite MoE: `block_sparse_moe.router.layer`, every expert's gate and up in
    /// `block_sparse_moe.input_linear.weight` `[experts, 2 × width, hidden]` (gate rows first),
    /// their down projections in `output_linear.weight`; Granite MoE Shared's ungated
    /// `shared_mlp.{input,output}_linear`.
    Granite,
    /// DeepSeek-V3's (GLM-4.5's): Qwen's expert names, an f32 router `mlp.gate` with
    /// `mlp.gate.e_score_correction_bias`, routed by [`DeepSeekRouting`], and ungated shared
    /// experts `mlp.shared_experts.{gate,up,down}_proj`.
    DeepSeek,
    /// ERNIE 4.5's: DeepSeek's names, but the correction bias in
    /// `mlp.moe_statics.e_score_correction_bias` (`[1, experts]`), chosen with softmax scores.
    Ernie,
    /// LFM2-MoE's: `feed_forward.gate`, `feed_forward.experts.{e}.{w1,w3,w2}`, and the
    /// per-expert bias `feed_forward.expert_bias` its sigmoid scores are chosen with.
    Lfm2,
    /// Hunyuan-A13B's: Qwen's expert names, an f32 router `mlp.gate.wg`, and an ungated shared
    /// MLP `mlp.shared_mlp.{gate,up,down}_proj`, every MLP `intermediate_size` wide.
    Hunyuan,
}

impl ExpertNaming {
    /// Whether the router and the experts have biases (gpt-oss's).
    pub fn has_biases(self) -> bool {
        self == ExpertNaming::GptOss
    }

    /// Whether the routing weights are a softmax over the top k logits (gpt-oss's, Granite's),
    /// rather than the top k of a softmax over all of them. The same numbers when
    /// renormalised, but not the same roundings.
    pub fn softmax_over_top_k(self) -> bool {
        self.stacked()
    }

    /// Whether the router's weight is held and applied in f32 whatever the model's dtype
    /// (transformers keeps DeepSeek-V3's `gate.weight` and its bias in f32).
    pub fn router_f32(self) -> bool {
        matches!(
            self,
            ExpertNaming::DeepSeek | ExpertNaming::Ernie | ExpertNaming::Hunyuan
        )
    }

    /// Whether checkpoints hold each part of every expert in one tensor
    /// (`model::fused_experts`), rather than a matrix per expert.
    pub fn stacked(self) -> bool {
        matches!(self, ExpertNaming::GptOss | ExpertNaming::Granite)
    }
}

/// DeepSeek's routing, in groups of experts, scaled by `routed_scaling_factor`:
/// - V3's (transformers' `DeepseekV3TopkRouter`, GLM-4.5's; [`Scoring::Sigmoid`]): each
///   expert's score is the sigmoid of its logit; experts are chosen by score plus a per-expert
///   correction bias, within the `topk_group` of `n_group` groups whose two best biased scores
///   sum highest; a chosen expert's weight is its unbiased score, renormalised over the chosen
///   ones where `norm_topk_prob`;
/// - V2's (`DeepseekV2TopkRouter`, [`Scoring::Softmax`]): scores are a softmax of the logits;
///   the top k of them, within the `topk_group` groups whose best score is highest (V2's
///   `group_limited_greedy`; one group is its `greedy`), weigh as they are.
///
/// MiniMax-M2 routes as V3 in one group, unscaled; ERNIE 4.5 as V3 in one group with softmax
/// scores (its experts are chosen by softmax score plus the correction bias).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeepSeekRouting {
    pub scoring: Scoring,
    pub n_group: usize,
    pub topk_group: usize,
    pub routed_scaling_factor: f32,
}

/// How DeepSeek's router scores experts ([`DeepSeekRouting`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scoring {
    Sigmoid,
    Softmax,
}

/// A sparse decoder's mixture-of-experts settings, checked. Its `Debug` text is part of the
/// fingerprint's model hash (`engine::fingerprint`).
#[derive(Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    /// Experts each token runs (`num_experts_per_tok`).
    pub top_k: usize,
    /// Each expert's MLP width (`moe_intermediate_size`; Mixtral's and OLMoE's
    /// `intermediate_size`).
    pub expert_intermediate_size: usize,
    /// The top-k routing weights renormalised to sum to one (Mixtral and gpt-oss always;
    /// Qwen's `norm_topk_prob`).
    pub norm_topk_prob: bool,
    /// Qwen2-MoE's shared expert (every token runs it, scaled by a sigmoid gate), or Granite
    /// MoE Shared's and DeepSeek's (ungated; DeepSeek's `n_shared_experts` side by side, one
    /// MLP as wide as all of them): its width.
    pub shared_expert_intermediate_size: Option<usize>,
    /// DeepSeek's routing ([`ExpertNaming::DeepSeek`]).
    pub deepseek_routing: Option<DeepSeekRouting>,
    /// Per decoder layer: whether its MLP is the sparse block (else a dense MLP of
    /// `intermediate_size`; Qwen's `mlp_only_layers` and `decoder_sparse_step`).
    pub sparse_layers: Vec<bool>,
    pub naming: ExpertNaming,
    /// DeepSeek's correction bias stored beside the router (`mlp.e_score_correction_bias`,
    /// K-EXAONE's checkpoints) rather than under it.
    pub bias_beside_router: bool,
    /// V3's choosing (groups by their two best scores, weights renormalised) over softmax
    /// scores with no correction bias, rather than V2's; the router held in the model's dtype,
    /// as transformers holds Mistral 4's.
    pub unbiased_choice: bool,
    /// The experts and the shared expert are ungated, `down(relu(up(x))²)` (Nemotron-H's),
    /// rather than SwiGLU MLPs.
    pub ungated: bool,
}

/// The derived form, with DeepSeek's routing written only where a model has it, so the
/// other sparse models' fingerprints are what they were before it existed.
impl std::fmt::Debug for MoeConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut s = f.debug_struct("MoeConfig");
        s.field("num_experts", &self.num_experts)
            .field("top_k", &self.top_k)
            .field("expert_intermediate_size", &self.expert_intermediate_size)
            .field("norm_topk_prob", &self.norm_topk_prob)
            .field(
                "shared_expert_intermediate_size",
                &self.shared_expert_intermediate_size,
            )
            .field("sparse_layers", &self.sparse_layers)
            .field("naming", &self.naming);
        if let Some(r) = &self.deepseek_routing {
            s.field("deepseek_routing", r);
        }
        if self.bias_beside_router {
            s.field("bias_beside_router", &true);
        }
        if self.unbiased_choice {
            s.field("unbiased_choice", &true);
        }
        if self.ungated {
            s.field("ungated", &true);
        }
        s.finish()
    }
}

impl MoeConfig {
    /// MiniMax-M2's routing: DeepSeek-V3's sigmoid scores and correction bias in one group,
    /// renormalised and unscaled.
    pub(super) fn with_biased_sigmoid_routing(self) -> Self {
        Self {
            deepseek_routing: Some(DeepSeekRouting {
                scoring: Scoring::Sigmoid,
                n_group: 1,
                topk_group: 1,
                routed_scaling_factor: 1.0,
            }),
            norm_topk_prob: true,
            ..self
        }
    }

    /// Qwen3.5-MoE's (`Qwen3_5MoeSparseMoeBlock`): every layer sparse and the top k always
    /// renormalised (its class reads neither `decoder_sparse_step`, `mlp_only_layers` nor
    /// `norm_topk_prob`).
    pub(super) fn with_every_layer_sparse_renormalised(self) -> Self {
        Self {
            sparse_layers: vec![true; self.sparse_layers.len()],
            norm_topk_prob: true,
            ..self
        }
    }

    /// DeepSeek-V2's routing in place of V3's: softmax scores, groups by their best, and the
    /// top k's weights never renormalised (its router reads no `norm_topk_prob`).
    pub(super) fn with_softmax_scoring(mut self) -> Self {
        if let Some(r) = &mut self.deepseek_routing {
            r.scoring = Scoring::Softmax;
            self.norm_topk_prob = false;
        }
        self
    }

    /// Mistral 4's routing (`Mistral4TopkRouter`): V3's with softmax scores and no correction
    /// bias.
    pub(super) fn with_unbiased_softmax_choice(mut self) -> Self {
        if let Some(r) = &mut self.deepseek_routing {
            r.scoring = Scoring::Softmax;
        }
        Self {
            unbiased_choice: true,
            ..self
        }
    }

    /// Nemotron-H's (`NemotronHMoE`): DeepSeek-V3's routing over ungated squared-ReLU
    /// experts, in the layers `sparse` names, beside one shared expert `shared_width` wide.
    pub(super) fn with_nemotron_h(self, sparse: &[bool], shared_width: usize) -> Self {
        Self {
            sparse_layers: sparse.to_vec(),
            shared_expert_intermediate_size: Some(shared_width),
            ungated: true,
            ..self
        }
    }

    /// K-EXAONE's: the correction bias beside the router on file.
    pub(super) fn with_bias_beside_router(self) -> Self {
        Self {
            bias_beside_router: true,
            ..self
        }
    }

    /// Whether the router's weight is held and applied in f32 whatever the model's dtype
    /// ([`ExpertNaming::router_f32`], but for Mistral 4's router).
    pub fn router_f32(&self) -> bool {
        self.naming.router_f32() && !self.unbiased_choice
    }

    /// Whether decoder layer `layer`'s MLP is the sparse block.
    pub fn is_sparse(&self, layer: usize) -> bool {
        self.sparse_layers.get(layer).copied().unwrap_or(false)
    }
}

/// `config.json`'s mixture-of-experts fields as written.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct RawMoe {
    num_experts: Option<usize>,
    num_local_experts: Option<usize>,
    /// DeepSeek's names: its expert count, shared experts, routing, and dense first layers.
    n_routed_experts: Option<usize>,
    n_shared_experts: Option<usize>,
    n_group: Option<usize>,
    topk_group: Option<usize>,
    routed_scaling_factor: Option<f64>,
    first_k_dense_replace: Option<usize>,
    /// K-EXAONE's name for DeepSeek's `n_shared_experts`.
    num_shared_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    /// Hunyuan's configs write it per layer (its class reads `intermediate_size` instead).
    moe_intermediate_size: Option<PerLayer>,
    norm_topk_prob: Option<bool>,
    shared_expert_intermediate_size: Option<usize>,
    /// Granite MoE Shared's name for it.
    shared_intermediate_size: Option<usize>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    /// GLM-4.7-Flash's `"dense"`/`"sparse"` per layer.
    mlp_layer_types: Option<Vec<String>>,
    /// ERNIE 4.5's names: its expert count, top k, shared experts, and the sparse layers
    /// (from the start index to the end one, -1 the last, every interval-th).
    moe_num_experts: Option<usize>,
    moe_k: Option<usize>,
    moe_num_shared_experts: Option<usize>,
    moe_layer_start_index: Option<usize>,
    moe_layer_end_index: Option<i64>,
    moe_layer_interval: Option<usize>,
    moe_norm_min: Option<f64>,
    /// LFM2-MoE's dense first layers and its switch for the experts' bias.
    num_dense_layers: Option<usize>,
    use_expert_bias: Option<bool>,
    /// Hunyuan's top k and shared MLPs, per layer or one for all; its cross-layer attention.
    moe_topk: Option<PerLayer>,
    num_shared_expert: Option<PerLayer>,
    use_cla: Option<bool>,
}

/// A count a config gives once or once per layer (Hunyuan's `moe_topk`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "a count or a list of counts, one per layer")]
pub(super) enum PerLayer {
    One(usize),
    Each(Vec<usize>),
}

impl PerLayer {
    /// The one value every layer has; the layers' values where they differ.
    fn uniform(&self) -> std::result::Result<usize, Vec<usize>> {
        match self {
            PerLayer::One(v) => Ok(*v),
            PerLayer::Each(v) => match v.split_first() {
                Some((&first, rest)) if rest.iter().all(|&x| x == first) => Ok(first),
                _ => Err(v.clone()),
            },
        }
    }
}

/// What a sparse architecture's class reads from its config beyond the common fields.
#[derive(Debug, Clone, Copy)]
pub(super) struct SparseShape {
    pub naming: ExpertNaming,
    /// A shared expert beside the routed ones (Qwen2-MoE's gated one, Granite MoE Shared's,
    /// DeepSeek's).
    pub shared_expert: bool,
    /// Experts are `moe_intermediate_size` wide (Qwen's, DeepSeek's), not `intermediate_size`
    /// (Mixtral's, OLMoE's).
    pub own_width: bool,
    /// Each layer's MLP is named in `mlp_layer_types` (GLM-4.7-Flash's class), in place of
    /// DeepSeek's `first_k_dense_replace`.
    pub layer_types: bool,
    /// What a Qwen-named config without `norm_topk_prob` means by it.
    pub norm_topk_default: bool,
    /// What a DeepSeek-named config means by the fields it leaves out.
    pub deepseek_defaults: DeepSeekDefaults,
}

/// transformers' defaults for DeepSeek's fields, which its classes set differently.
#[derive(Debug, Clone, Copy)]
pub(super) struct DeepSeekDefaults {
    pub first_dense: FirstDense,
    pub norm_topk_prob: bool,
    /// `None`: the field is required (its class has no usable default).
    pub n_shared_experts: Option<usize>,
}

/// How many first layers are dense where `mlp_layer_types` does not say.
#[derive(Debug, Clone, Copy)]
pub(super) enum FirstDense {
    /// `first_k_dense_replace`, this many where it is absent.
    Read(usize),
    /// This many, whatever the config says (the class reads no `first_k_dense_replace`).
    Fixed(usize),
}

impl DeepSeekDefaults {
    /// DeepSeek-V2/V3's, GLM-4.5's.
    pub const DEEPSEEK: Self = Self {
        first_dense: FirstDense::Read(1),
        norm_topk_prob: true,
        n_shared_experts: Some(1),
    };
    /// GLM-4.7-Flash's (`Glm4MoeLiteConfig`): `mlp_layer_types`, by default the first layer
    /// dense.
    pub const GLM4_MOE_LITE: Self = Self {
        first_dense: FirstDense::Fixed(1),
        ..Self::DEEPSEEK
    };
    /// Mistral 4's (`Mistral4Config`): no dense first layer unless `first_k_dense_replace`
    /// says, one shared expert, weights renormalised.
    pub const MISTRAL4: Self = Self {
        first_dense: FirstDense::Read(0),
        ..Self::DEEPSEEK
    };
    /// K-EXAONE's (`ExaoneMoeConfig`): `mlp_layer_types`, by default the first
    /// `first_k_dense_replace` (1) dense.
    pub const EXAONE_MOE: Self = Self::DEEPSEEK;
    /// Solar Open's (`SolarOpenConfig`): every layer sparse (its class reads no
    /// `first_k_dense_replace`), one shared expert, weights renormalised.
    pub const SOLAR_OPEN: Self = Self {
        first_dense: FirstDense::Fixed(0),
        ..Self::DEEPSEEK
    };
    /// dots.llm1's (`Dots1Config`): no dense first layer, weights not renormalised, and
    /// `n_shared_experts` must be given.
    pub const DOTS1: Self = Self {
        first_dense: FirstDense::Read(0),
        norm_topk_prob: false,
        n_shared_experts: None,
    };
}

impl RawMoe {
    /// The checked settings of a sparse architecture of `shape` with `num_layers` decoder
    /// layers whose dense MLP width is `intermediate_size`.
    pub(super) fn check(
        &self,
        path: &Path,
        shape: SparseShape,
        num_layers: usize,
        intermediate_size: usize,
    ) -> Result<MoeConfig> {
        let SparseShape {
            naming,
            shared_expert,
            own_width,
            layer_types,
            norm_topk_default,
            deepseek_defaults: defaults,
        } = shape;
        let err = |field: &str, message: String| DetspecError::InvalidConfig {
            path: path.to_path_buf(),
            field: field.to_string(),
            message,
        };
        let (field, num_experts) = match (
            self.num_experts,
            self.num_local_experts,
            self.n_routed_experts,
            self.moe_num_experts,
        ) {
            (Some(n), ..) => ("num_experts", n),
            (None, Some(n), ..) => ("num_local_experts", n),
            (None, None, Some(n), _) => ("n_routed_experts", n),
            (None, None, None, Some(n)) => ("moe_num_experts", n),
            (None, None, None, None) => return Err(err("num_experts", "missing".into())),
        };
        if num_experts == 0 {
            return Err(err(field, "must be > 0".into()));
        }
        let uniform = |field: &str, v: &PerLayer| {
            v.uniform().map_err(|each| {
                err(
                    field,
                    format!("{each:?}: layers with different values are not supported"),
                )
            })
        };
        let (top_k_field, top_k) = match (self.num_experts_per_tok, self.moe_k, &self.moe_topk) {
            (Some(k), ..) => ("num_experts_per_tok", k),
            (None, Some(k), _) => ("moe_k", k),
            (None, None, Some(k)) => ("moe_topk", uniform("moe_topk", k)?),
            (None, None, None) => return Err(err("num_experts_per_tok", "missing".into())),
        };
        if naming == ExpertNaming::Hunyuan {
            self.check_hunyuan(&err)?;
        }
        if top_k == 0 || top_k > num_experts {
            return Err(err(
                top_k_field,
                format!("{top_k} must be in 1..={num_experts} ({field})"),
            ));
        }
        let own = self
            .moe_intermediate_size
            .as_ref()
            .map(|w| uniform("moe_intermediate_size", w))
            .transpose()?;
        let expert_intermediate_size = match (own_width, own) {
            (false, _) => intermediate_size,
            (true, Some(0)) => return Err(err("moe_intermediate_size", "must be > 0".into())),
            (true, Some(n)) => n,
            (true, None) => return Err(err("moe_intermediate_size", "missing".into())),
        };
        let (shared_field, shared_width) = match naming {
            ExpertNaming::Granite => ("shared_intermediate_size", self.shared_intermediate_size),
            // transformers' default is one shared expert.
            // (K-EXAONE's name for it: `num_shared_experts`)
            ExpertNaming::DeepSeek => (
                "n_shared_experts",
                self.n_shared_experts
                    .or(self.num_shared_experts)
                    .or(defaults.n_shared_experts)
                    .map(|n| expert_intermediate_size * n),
            ),
            // transformers' default is two.
            ExpertNaming::Ernie => (
                "moe_num_shared_experts",
                Some(expert_intermediate_size * self.moe_num_shared_experts.unwrap_or(2)),
            ),
            // One shared MLP as wide as the experts (`check_hunyuan`).
            ExpertNaming::Hunyuan => ("num_shared_expert", Some(intermediate_size)),
            _ => (
                "shared_expert_intermediate_size",
                self.shared_expert_intermediate_size,
            ),
        };
        let shared_expert_intermediate_size = match (shared_expert, shared_width) {
            (false, _) | (true, Some(0)) => None,
            (true, Some(n)) => Some(n),
            (true, None) => return Err(err(shared_field, "missing".into())),
        };
        let (step_field, step) = match naming {
            ExpertNaming::Ernie => ("moe_layer_interval", self.moe_layer_interval.unwrap_or(1)),
            _ => ("decoder_sparse_step", self.decoder_sparse_step.unwrap_or(1)),
        };
        if step == 0 {
            return Err(err(step_field, "must be > 0".into()));
        }
        let dense_only = self.mlp_only_layers.clone().unwrap_or_default();
        if let Some(bad) = dense_only.iter().find(|&&l| l >= num_layers) {
            return Err(err(
                "mlp_only_layers",
                format!("layer {bad}, but the model has {num_layers} layers"),
            ));
        }
        // DeepSeek's first layers are dense (transformers' default: one), as ERNIE's are
        // before its start index (default one) and after its end index (-1: the last layer).
        let first_sparse = match naming {
            ExpertNaming::DeepSeek => match defaults.first_dense {
                FirstDense::Read(d) => self.first_k_dense_replace.unwrap_or(d),
                FirstDense::Fixed(d) => d,
            },
            ExpertNaming::Ernie => self.moe_layer_start_index.unwrap_or(1),
            // transformers' default: two.
            ExpertNaming::Lfm2 => self.num_dense_layers.unwrap_or(2),
            _ => 0,
        };
        let last_sparse = match (naming, self.moe_layer_end_index) {
            (ExpertNaming::Ernie, Some(end)) if end < -1 => {
                return Err(err(
                    "moe_layer_end_index",
                    format!("{end}: must be a layer index or -1 (the last)"),
                ))
            }
            (ExpertNaming::Ernie, Some(end)) if end >= 0 => end as usize,
            _ => num_layers.saturating_sub(1),
        };
        // The k best of a softmax over E experts sum to at least k / E: a smaller floor never
        // binds, and the division is the plain renormalisation.
        if let Some(floor) = self.moe_norm_min.filter(|_| naming == ExpertNaming::Ernie) {
            if !(floor >= 0.0 && floor <= top_k as f64 / num_experts as f64) {
                return Err(err(
                    "moe_norm_min",
                    format!(
                        "{floor}: a floor above {top_k}/{num_experts} (the least sum of the top \
                         k weights) is not supported"
                    ),
                ));
            }
        }
        let sparse_layers = match (layer_types, &self.mlp_layer_types) {
            (true, Some(types)) => super::json::layer_kinds(types, num_layers, ["sparse", "dense"])
                .map_err(|m| err("mlp_layer_types", m))?,
            // transformers' default: the first layers dense, the rest sparse.
            (true, None) => (0..num_layers).map(|l| l >= first_sparse).collect(),
            (false, _) => (0..num_layers)
                .map(|l| {
                    (first_sparse..=last_sparse).contains(&l)
                        && !dense_only.contains(&l)
                        && (l + 1) % step == 0
                })
                .collect(),
        };
        let deepseek_routing = match naming {
            ExpertNaming::DeepSeek => Some(self.deepseek_routing(num_experts, top_k, &err)?),
            ExpertNaming::Ernie => Some(DeepSeekRouting {
                scoring: Scoring::Softmax,
                n_group: 1,
                topk_group: 1,
                routed_scaling_factor: 1.0,
            }),
            ExpertNaming::Lfm2 => Some(self.lfm2_routing(&err)?),
            _ => None,
        };
        Ok(MoeConfig {
            num_experts,
            top_k,
            expert_intermediate_size,
            norm_topk_prob: match naming {
                ExpertNaming::Mixtral | ExpertNaming::GptOss | ExpertNaming::Granite => true,
                ExpertNaming::Qwen => self.norm_topk_prob.unwrap_or(norm_topk_default),
                ExpertNaming::DeepSeek => self.norm_topk_prob.unwrap_or(defaults.norm_topk_prob),
                // Its router divides by the chosen scores' sum (at least `moe_norm_min`).
                ExpertNaming::Ernie => true,
                ExpertNaming::Lfm2 => self.norm_topk_prob.unwrap_or(true),
                // Its gate divides the top k by their sum.
                ExpertNaming::Hunyuan => true,
            },
            shared_expert_intermediate_size,
            deepseek_routing,
            sparse_layers,
            naming,
            bias_beside_router: false,
            unbiased_choice: false,
            ungated: false,
        })
    }

    /// What transformers' Hunyuan MoE class reads the way detspec does: one shared MLP
    /// (`num_shared_expert` 1 in every layer), no cross-layer attention (`use_cla`).
    fn check_hunyuan(&self, err: &dyn Fn(&str, String) -> DetspecError) -> Result<()> {
        if self.use_cla == Some(true) {
            return Err(err(
                "use_cla",
                "true: cross-layer attention (layers sharing keys and values) is not supported"
                    .into(),
            ));
        }
        match self.num_shared_expert.as_ref().map(PerLayer::uniform) {
            None | Some(Ok(1)) => Ok(()),
            Some(Ok(n)) => Err(err(
                "num_shared_expert",
                format!("{n}: one shared MLP per layer is supported"),
            )),
            Some(Err(each)) => Err(err(
                "num_shared_expert",
                format!("{each:?}: one shared MLP per layer is supported"),
            )),
        }
    }

    /// LFM2-MoE's routing (`Lfm2MoeTopKRouter`): sigmoid scores chosen with the experts'
    /// bias in one group, scaled by `routed_scaling_factor` (default 1). Its class can route
    /// without the bias (`use_expert_bias: false`); no released checkpoint does, and that
    /// reading is refused, naming the field.
    fn lfm2_routing(&self, err: &dyn Fn(&str, String) -> DetspecError) -> Result<DeepSeekRouting> {
        if self.use_expert_bias == Some(false) {
            return Err(err(
                "use_expert_bias",
                "false: LFM2-MoE's routing without the experts' bias is not supported".into(),
            ));
        }
        let scale = self.routed_scaling_factor.unwrap_or(1.0);
        if !(scale.is_finite() && scale > 0.0) {
            return Err(err(
                "routed_scaling_factor",
                format!("{scale}: must be > 0"),
            ));
        }
        Ok(DeepSeekRouting {
            scoring: Scoring::Sigmoid,
            n_group: 1,
            topk_group: 1,
            routed_scaling_factor: scale as f32,
        })
    }

    /// DeepSeek's routing settings, checked as its router needs them: groups that split the
    /// experts evenly, each with the two experts its group score sums (where there is more
    /// than one group), and enough experts in the kept groups for the top k.
    fn deepseek_routing(
        &self,
        num_experts: usize,
        top_k: usize,
        err: &dyn Fn(&str, String) -> DetspecError,
    ) -> Result<DeepSeekRouting> {
        let n_group = self.n_group.unwrap_or(1);
        let topk_group = self.topk_group.unwrap_or(1);
        if n_group == 0 || !num_experts.is_multiple_of(n_group) {
            return Err(err(
                "n_group",
                format!("{n_group} groups must split the {num_experts} experts evenly"),
            ));
        }
        let per_group = num_experts / n_group;
        if n_group > 1 && per_group < 2 {
            return Err(err(
                "n_group",
                format!(
                    "{n_group} groups of {per_group} expert; a group's score sums its best two"
                ),
            ));
        }
        if topk_group == 0 || topk_group > n_group || topk_group * per_group < top_k {
            return Err(err(
                "topk_group",
                format!(
                    "{topk_group} must be in 1..={n_group} (n_group) and keep at least \
                     num_experts_per_tok = {top_k} experts ({per_group} a group)"
                ),
            ));
        }
        let scale = self.routed_scaling_factor.unwrap_or(1.0);
        if !(scale.is_finite() && scale > 0.0) {
            return Err(err("routed_scaling_factor", format!("{scale} must be > 0")));
        }
        Ok(DeepSeekRouting {
            scoring: Scoring::Sigmoid,
            n_group,
            topk_group,
            routed_scaling_factor: scale as f32,
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::config::ModelConfig;
    use crate::error::Result;
    use std::path::Path;

    use super::*;

    fn parse(arch: &str, extra: &str) -> Result<ModelConfig> {
        let json = format!(
            r#"{{"architectures": ["{arch}"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 100{extra}}}"#
        );
        ModelConfig::from_json_str(&json, Path::new("/m/config.json"))
    }

    /// Mistral 4: V3's choosing over softmax scores, no correction bias, its router in the
    /// model's dtype, no dense first layer by default; Ministral 3's query scaling.
    #[test]
    fn mistral4_routes_by_softmax_without_a_bias() {
        let c = parse(
            "Mistral4ForCausalLM",
            r#", "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
            "n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.5, "kv_lora_rank": 32,
            "q_lora_rank": 48, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 24,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 64}"#,
        )
        .unwrap();
        let m = c.moe.as_ref().unwrap();
        let r = m.deepseek_routing.unwrap();
        assert_eq!(
            (r.scoring, r.n_group, r.topk_group),
            (Scoring::Softmax, 4, 2)
        );
        assert!(m.unbiased_choice && !m.router_f32() && m.norm_topk_prob);
        assert_eq!(m.sparse_layers, [true; 4]);
        assert!(c.mla.is_some());
        assert_eq!(c.query_scale_beta, Some((0.1, 64.0)));
        let names = crate::model::param_shapes(&c);
        assert!(!names.keys().any(|n| n.contains("e_score_correction_bias")));
    }

    /// K-EXAONE: `mlp_layer_types`, by default its `first_k_dense_replace` (read, unlike
    /// GLM-4.7-Flash's class); shared experts by its own field name; the correction bias
    /// beside the router on file.
    #[test]
    fn k_exaone_reads_its_layer_kinds_and_names() {
        let base = r#", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
            "num_shared_experts": 2"#;
        let cfg = |extra: &str| parse("ExaoneMoeForCausalLM", &format!("{base}{extra}")).unwrap();
        let moe = |extra: &str| cfg(extra).moe.unwrap();
        let m = moe("");
        assert_eq!(m.sparse_layers, [false, true, true, true]);
        assert_eq!(m.shared_expert_intermediate_size, Some(32));
        let names = crate::model::param_shapes(&cfg(""));
        assert!(names.contains_key("model.layers.1.mlp.e_score_correction_bias"));
        assert!(!names.contains_key("model.layers.1.mlp.gate.e_score_correction_bias"));
        assert_eq!(
            moe(r#", "first_k_dense_replace": 2"#).sparse_layers,
            [false, false, true, true]
        );
        let listed = r#", "first_k_dense_replace": 2,
            "mlp_layer_types": ["sparse", "dense", "sparse", "dense"]"#;
        assert_eq!(moe(listed).sparse_layers, [true, false, true, false]);
    }

    #[test]
    fn sparse_layers_follow_step_and_dense_only_layers() {
        let c = parse(
            "Qwen2MoeForCausalLM",
            r#", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48, "decoder_sparse_step": 2, "mlp_only_layers": [3]"#,
        )
        .unwrap();
        let moe = c.moe.unwrap();
        assert_eq!(moe.sparse_layers, vec![false, true, false, false]);
        assert_eq!(moe.shared_expert_intermediate_size, Some(48));
        assert!(!moe.norm_topk_prob && c.qkv_bias);
        // transformers 5 writes Qwen3-MoE's expert count as num_local_experts.
        let c = parse(
            "Qwen3MoeForCausalLM",
            r#", "num_local_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 32,
            "norm_topk_prob": true"#,
        )
        .unwrap();
        let moe = c.moe.unwrap();
        assert_eq!(
            (moe.num_experts, moe.top_k, moe.naming),
            (4, 1, ExpertNaming::Qwen)
        );
        assert!(moe.norm_topk_prob && c.qk_norm && moe.shared_expert_intermediate_size.is_none());
        // Mixtral: experts as wide as intermediate_size, weights always renormalised.
        let c = parse(
            "MixtralForCausalLM",
            r#", "num_local_experts": 8, "num_experts_per_tok": 2"#,
        )
        .unwrap();
        let moe = c.moe.unwrap();
        assert_eq!(moe.expert_intermediate_size, 128);
        assert!(moe.norm_topk_prob && moe.sparse_layers.iter().all(|&s| s));
        assert!(parse("LlamaForCausalLM", "").unwrap().moe.is_none());
        // OLMoE: Qwen's names and routing, experts as wide as intermediate_size (a
        // moe_intermediate_size is not its), OLMo 2's q/k norms; OLMo 1's clamp refused.
        let c = parse(
            "OlmoeForCausalLM",
            r#", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "clip_qkv": null"#,
        )
        .unwrap();
        let moe = c.moe.unwrap();
        assert_eq!(
            (moe.expert_intermediate_size, moe.naming),
            (128, ExpertNaming::Qwen)
        );
        assert!(!moe.norm_topk_prob && c.qk_norm && c.architecture.norms_whole_qk());
        let e = parse(
            "OlmoeForCausalLM",
            r#", "num_experts": 8, "num_experts_per_tok": 2, "clip_qkv": 8.0"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("clip_qkv"), "{e}");
    }

    #[test]
    fn glm4_moe_routes_as_deepseek_with_dense_first_layers_and_shared_experts() {
        let glm = r#", "n_routed_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 16, "n_shared_experts": 2, "first_k_dense_replace": 2,
            "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "use_qk_norm": true,
            "attention_bias": true, "rope_parameters": {"rope_type": "default",
            "rope_theta": 10000.0, "partial_rotary_factor": 0.5}"#;
        let c = parse("Glm4MoeForCausalLM", glm).unwrap();
        let moe = c.moe.clone().unwrap();
        assert_eq!(
            (moe.num_experts, moe.top_k, moe.naming),
            (8, 2, ExpertNaming::DeepSeek)
        );
        assert_eq!(moe.sparse_layers, vec![false, false, true, true]);
        assert_eq!(moe.shared_expert_intermediate_size, Some(32));
        assert_eq!(
            moe.deepseek_routing,
            Some(DeepSeekRouting {
                scoring: Scoring::Sigmoid,
                n_group: 4,
                topk_group: 2,
                routed_scaling_factor: 2.5
            })
        );
        assert!(moe.norm_topk_prob && c.qk_norm && c.qkv_bias && !c.o_bias);
        // Half of each head rotates, pairing halves (Phi-3's layout), by default too.
        assert_eq!((c.head_dim, c.rotary_dim), (16, 8));
        assert!(!c.architecture.rope_interleaved());
        let plain = parse(
            "Glm4MoeForCausalLM",
            r#", "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8"#,
        )
        .unwrap();
        let moe = plain.moe.unwrap();
        assert_eq!(moe.sparse_layers, vec![false, true, true, true]);
        assert_eq!(plain.rotary_dim, 8);
        assert!(!plain.qk_norm && !plain.qkv_bias && moe.norm_topk_prob);
        assert_eq!(moe.shared_expert_intermediate_size, Some(8));
        for (extra, field) in [
            (r#", "n_group": 3"#, "n_group"),
            (r#", "n_group": 8"#, "n_group"),
            (r#", "n_group": 2, "topk_group": 3"#, "topk_group"),
            (r#", "n_group": 4, "topk_group": 0"#, "topk_group"),
            (r#", "routed_scaling_factor": 0.0"#, "routed_scaling_factor"),
        ] {
            let json = format!(
                r#", "n_routed_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 8{extra}"#
            );
            let e = parse("Glm4MoeForCausalLM", &json).unwrap_err();
            assert!(e.to_string().contains(field), "{field}: {e}");
        }
        // topk_group 1 of 4 groups keeps 2 experts, fewer than the top 3.
        let e = parse(
            "Glm4MoeForCausalLM",
            r#", "n_routed_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 8,
            "n_group": 4, "topk_group": 1"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("topk_group"), "{e}");
    }

    #[test]
    fn glm4_moe_lite_names_each_layers_mlp_in_mlp_layer_types() {
        let mla = r#", "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
            "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 8"#;
        let sparse = |extra: &str| {
            parse("Glm4MoeLiteForCausalLM", &format!("{mla}{extra}"))
                .map(|c| c.moe.map(|m| m.sparse_layers))
        };
        // transformers' class reads the list, never first_k_dense_replace.
        assert_eq!(
            sparse(
                r#", "first_k_dense_replace": 3,
                "mlp_layer_types": ["sparse", "dense", "sparse", "dense"]"#
            )
            .unwrap(),
            Some(vec![true, false, true, false])
        );
        // Its default: the first layer dense.
        assert_eq!(sparse("").unwrap(), Some(vec![false, true, true, true]));
        for bad in [
            r#", "mlp_layer_types": ["dense", "sparse"]"#,
            r#", "mlp_layer_types": ["dense", "sparse", "moe", "sparse"]"#,
        ] {
            let e = sparse(bad).unwrap_err();
            assert!(e.to_string().contains("mlp_layer_types"), "{e}");
        }
        let c = parse("Glm4MoeLiteForCausalLM", mla).unwrap();
        assert!(c.mla.is_some() && c.moe.unwrap().naming == ExpertNaming::DeepSeek);
    }

    #[test]
    fn minimax_m2_routes_mixtrals_experts_by_biased_sigmoid_in_one_group() {
        // Its hub config names the rotated width only (`rotary_dim`), as here.
        let c = parse(
            "MiniMaxM2ForCausalLM",
            r#", "head_dim": 32, "rotary_dim": 16, "num_local_experts": 8,
            "num_experts_per_tok": 2, "use_qk_norm": true, "qk_norm_type": "per_layer",
            "scoring_func": "sigmoid", "use_routing_bias": true"#,
        )
        .unwrap();
        let moe = c.moe.unwrap();
        assert_eq!(
            (moe.naming, moe.expert_intermediate_size, moe.norm_topk_prob),
            (ExpertNaming::Mixtral, 128, true)
        );
        assert_eq!(
            moe.deepseek_routing,
            Some(DeepSeekRouting {
                scoring: Scoring::Sigmoid,
                n_group: 1,
                topk_group: 1,
                routed_scaling_factor: 1.0
            })
        );
        assert!(moe.shared_expert_intermediate_size.is_none());
        assert!(c.qk_norm && c.architecture.norms_whole_qk());
        assert_eq!((c.head_dim, c.rotary_dim), (32, 16));
        // transformers' factor, where the config writes one, wins over the width.
        let c = parse(
            "MiniMaxM2ForCausalLM",
            r#", "head_dim": 32, "rotary_dim": 16, "num_local_experts": 8,
            "num_experts_per_tok": 2, "partial_rotary_factor": 0.25"#,
        )
        .unwrap();
        assert_eq!(c.rotary_dim, 8);
        let e = parse(
            "MiniMaxM2ForCausalLM",
            r#", "head_dim": 32, "rotary_dim": 15, "num_local_experts": 8,
            "num_experts_per_tok": 2"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("rotary_dim"), "{e}");
    }

    #[test]
    fn ernie45_moe_reads_its_own_names_and_sparse_layer_range() {
        let ernie = |extra: &str| {
            parse(
                "Ernie4_5_MoeForCausalLM",
                &format!(
                    r#", "moe_num_experts": 8, "moe_k": 2, "moe_intermediate_size": 16{extra}"#
                ),
            )
        };
        // transformers' defaults: layers 1 to the last sparse, two shared experts.
        let moe = ernie("").unwrap().moe.unwrap();
        assert_eq!(
            (moe.num_experts, moe.top_k, moe.naming),
            (8, 2, ExpertNaming::Ernie)
        );
        assert_eq!(moe.sparse_layers, vec![false, true, true, true]);
        assert_eq!(moe.shared_expert_intermediate_size, Some(32));
        assert_eq!(
            moe.deepseek_routing,
            Some(DeepSeekRouting {
                scoring: Scoring::Softmax,
                n_group: 1,
                topk_group: 1,
                routed_scaling_factor: 1.0
            })
        );
        assert!(moe.norm_topk_prob && moe.naming.router_f32());
        let c = ernie(
            r#", "moe_layer_start_index": 0, "moe_layer_end_index": 2,
            "moe_layer_interval": 2, "moe_num_shared_experts": 0"#,
        )
        .unwrap();
        let moe = c.moe.unwrap();
        assert_eq!(moe.sparse_layers, vec![false, true, false, false]);
        assert!(moe.shared_expert_intermediate_size.is_none());
        assert!(c.architecture.rope_interleaved());
        for (extra, field) in [
            (r#", "moe_layer_end_index": -2"#, "moe_layer_end_index"),
            (r#", "moe_layer_interval": 0"#, "moe_layer_interval"),
            (r#", "moe_norm_min": 0.5"#, "moe_norm_min"),
            (r#", "moe_k": 9"#, "moe_k"),
            (r#", "use_bias": true"#, "use_bias"),
        ] {
            let e = ernie(extra).unwrap_err();
            assert!(e.to_string().contains(field), "{field}: {e}");
        }
        assert!(ernie(r#", "moe_norm_min": 1e-12"#).is_ok());
    }

    #[test]
    fn dots1_routes_as_deepseek_with_its_own_defaults_and_qwen3s_layers() {
        let dots = |extra: &str| {
            parse(
                "Dots1ForCausalLM",
                &format!(
                    r#", "n_routed_experts": 8, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 16{extra}"#
                ),
            )
        };
        // Dots1Config's defaults: every layer sparse, weights not renormalised; no window
        // where max_window_layers (62) is past the last layer.
        let c = dots(r#", "n_shared_experts": 2, "sliding_window": 4096"#).unwrap();
        let moe = c.moe.unwrap();
        assert_eq!(moe.sparse_layers, vec![true; 4]);
        assert!(!moe.norm_topk_prob && moe.naming == ExpertNaming::DeepSeek);
        assert_eq!(moe.shared_expert_intermediate_size, Some(32));
        assert!(c.qk_norm && !c.architecture.norms_whole_qk());
        assert!(c.sliding_window.is_none() && c.sliding_layers.is_none());
        // Its layer kinds, and transformers' default from max_window_layers.
        let c = dots(
            r#", "n_shared_experts": 1, "sliding_window": 8,
            "layer_types": ["full_attention", "sliding_attention", "full_attention",
            "full_attention"]"#,
        )
        .unwrap();
        assert_eq!(c.sliding_window, Some(8));
        assert_eq!(c.sliding_layers, Some(vec![false, true, false, false]));
        let c = dots(r#", "n_shared_experts": 1, "sliding_window": 8, "max_window_layers": 2"#)
            .unwrap();
        assert_eq!(c.sliding_layers, Some(vec![false, false, true, true]));
        // Its class has no shared-expert count to fall back on.
        let e = dots("").unwrap_err();
        assert!(e.to_string().contains("n_shared_experts"), "{e}");
    }

    #[test]
    fn other_sparse_models_describe_themselves_as_before_deepseeks_routing() {
        // The fingerprint hashes this text: it must not change for models without the routing.
        let c = parse(
            "Qwen3MoeForCausalLM",
            r#", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8"#,
        )
        .unwrap();
        assert_eq!(
            format!("{:?}", c.moe.unwrap()),
            "MoeConfig { num_experts: 4, top_k: 2, expert_intermediate_size: 8, \
             norm_topk_prob: false, shared_expert_intermediate_size: None, \
             sparse_layers: [true, true, true, true], naming: Qwen }"
        );
    }

    #[test]
    fn errors_name_the_field() {
        for (extra, field) in [
            (
                r#", "num_experts_per_tok": 2, "moe_intermediate_size": 8"#,
                "num_experts",
            ),
            (
                r#", "num_experts": 4, "moe_intermediate_size": 8"#,
                "num_experts_per_tok",
            ),
            (
                r#", "num_experts": 4, "num_experts_per_tok": 5, "moe_intermediate_size": 8"#,
                "num_experts_per_tok",
            ),
            (
                r#", "num_experts": 4, "num_experts_per_tok": 2"#,
                "moe_intermediate_size",
            ),
            (
                r#", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                "mlp_only_layers": [4]"#,
                "mlp_only_layers",
            ),
            (
                r#", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                "decoder_sparse_step": 0"#,
                "decoder_sparse_step",
            ),
            (
                r#", "num_experts": "four", "num_experts_per_tok": 2, "moe_intermediate_size": 8"#,
                "num_experts",
            ),
        ] {
            let e = parse("Qwen3MoeForCausalLM", extra).unwrap_err();
            assert!(e.to_string().contains(field), "{field}: {e}");
        }
    }
}
