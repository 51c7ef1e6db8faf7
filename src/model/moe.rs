//! The sparse mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, Granite MoE,
//! gpt-oss): a router picks each token's top-k experts, each expert runs over the rows routed
//! to it, and a row's output is its experts' outputs scaled by their routing weights and
//! summed.
//!
//! Why it keeps the determinism contract: everything a row's output depends on is a function
//! of that row alone, computed in a fixed order. The router is a linear layer like any other;
//! softmax, top-k and renormalisation run on the host in f32 in index order (ties go to the
//! lower expert); a row's contributions are summed in expert-id order (as transformers'
//! `index_add_` loop does). The one thing the batch decides is how many rows each expert's
//! GEMMs see. Where a GEMM's bits depend on its row count (a GPU's, or the CPU's
//! `shape_dependent` profile) that makes the fast path batch-variant, as a dense layer is,
//! and replay catches it; but it would also let the *other* rows of a fixed-shape verify or
//! prefill pass change a row's bits, so those passes run the experts on fixed row blocks
//! (`fixed_blocks`), which no routing can change.

use std::sync::Arc;

use candle_core::{DType, Tensor};
use rayon::prelude::*;

use crate::config::{DeepSeekRouting, ExpertNaming, ModelConfig, MoeConfig, Scoring};
use crate::error::{DetspecError, Result};
use crate::ops;

use super::fused_experts::FusedPart;
use super::linear::{GemmOptions, Linear, LinearWeight};
use super::loader::WeightLoader;
use super::moe_names::{
    has_shared_gate, router_bias_name, router_bias_shape, ExpertPart, FusedExperts, SparseLinear,
};

/// One expert: a SwiGLU MLP (gpt-oss's: with biases, gated by the clamped SwiGLU), or an
/// ungated squared-ReLU one without `gate` (Nemotron-H's).
#[derive(Debug)]
pub(super) struct Expert {
    pub(super) gate: Option<Linear>,
    pub(super) up: Linear,
    pub(super) down: Linear,
}

impl Expert {
    /// An expert whose parts are the linear layers `which(part)`.
    fn load(
        ld: &WeightLoader<'_>,
        cfg: &ModelConfig,
        moe: &MoeConfig,
        layer: usize,
        which: impl Fn(ExpertPart) -> SparseLinear,
    ) -> Result<Self> {
        let linear = |part| load_linear(ld, cfg, moe, layer, which(part));
        Ok(Self {
            gate: (!moe.ungated)
                .then(|| linear(ExpertPart::Gate))
                .transpose()?,
            up: linear(ExpertPart::Up)?,
            down: linear(ExpertPart::Down)?,
        })
    }

    /// `clamped`: gpt-oss's `(alpha, limit)` ([`ops::clamped_swiglu`]), else SwiGLU; an
    /// ungated expert's `relu(up(x))²` (per element: the same bits in any batch).
    fn forward(
        &self,
        x: &Tensor,
        gemm: GemmOptions,
        clamped: Option<(f32, f32)>,
    ) -> candle_core::Result<Tensor> {
        let up = self.up.apply(x, gemm)?;
        let act = match (&self.gate, clamped) {
            (None, _) => up.relu()?.sqr()?,
            (Some(gate), Some((alpha, limit))) => {
                ops::clamped_swiglu(&gate.apply(x, gemm)?, &up, alpha, limit)?
            }
            (Some(gate), None) => ops::swiglu(&gate.apply(x, gemm)?, &up)?,
        };
        self.down.apply(&act, gemm)
    }

    pub(super) fn part_mut(&mut self, part: ExpertPart) -> Option<&mut Linear> {
        match part {
            ExpertPart::Gate => self.gate.as_mut(),
            ExpertPart::Up => Some(&mut self.up),
            ExpertPart::Down => Some(&mut self.down),
        }
    }
}

/// An expert every row runs, added to the routed experts' sum.
#[derive(Debug)]
pub(super) struct SharedExpert {
    pub(super) expert: Expert,
    /// Qwen2-MoE's `[1, hidden]` sigmoid gate scaling it per row (Granite's is ungated).
    pub(super) gate: Option<Linear>,
}

/// How a router's logits become each row's experts and weights.
#[derive(Debug)]
pub(super) enum RoutingRule {
    /// The top k of a softmax over all logits, renormalised where `norm` (Qwen's, Mixtral's).
    TopKOfSoftmax { norm: bool },
    /// A softmax over the top k logits (gpt-oss's, Granite's).
    SoftmaxOverTopK,
    /// Scores (DeepSeek-V3's sigmoid, ERNIE's softmax) chosen by group with a correction bias
    /// (GLM-4.5's, MiniMax-M2's); its router runs in f32 (MiniMax-M2's on its weight's
    /// values, which transformers holds in the model's dtype).
    Biased {
        rule: DeepSeekRouting,
        /// Where the chosen weights are renormalised, what their sum is padded by
        /// ([`renorm_epsilon`]).
        norm: Option<f32>,
        /// `e_score_correction_bias`, one per expert.
        bias: Arc<[f32]>,
    },
    /// DeepSeek-V2's softmax scores chosen by group; its router runs in f32.
    GroupedSoftmax(DeepSeekRouting),
}

/// What the chosen weights' sum is padded by before they are divided by it: transformers'
/// DeepSeek-V3 router adds 1e-20 (nothing, in f32, to a sum of sigmoids), LFM2-MoE's 1e-6.
fn renorm_epsilon(naming: ExpertNaming) -> f32 {
    match naming {
        ExpertNaming::Lfm2 => 1e-6,
        _ => 1e-20,
    }
}

/// A decoder layer's sparse MLP.
#[derive(Debug)]
pub(super) struct SparseMlp {
    /// `[num_experts, hidden]`: the router's logits.
    pub(super) router: Linear,
    /// The router reads the hidden state in f32 (its weight is held in f32, or its routing
    /// runs in f32: [`RoutingRule::Biased`], [`RoutingRule::GroupedSoftmax`]).
    router_reads_f32: bool,
    pub(super) experts: Vec<Expert>,
    /// The shared expert every row runs (Qwen2-MoE's, Granite MoE Shared's, DeepSeek's).
    pub(super) shared: Option<SharedExpert>,
    top_k: usize,
    pub(super) routing: RoutingRule,
    /// gpt-oss's expert activation, `(alpha, limit)`.
    clamped: Option<(f32, f32)>,
}

impl SparseMlp {
    /// Layer `layer`'s sparse MLP, from the checkpoint's names for it.
    pub(super) fn load(
        ld: &WeightLoader<'_>,
        cfg: &ModelConfig,
        moe: &MoeConfig,
        layer: usize,
    ) -> Result<Self> {
        let (experts, shared) = if moe.naming.stacked() {
            load_stacked(ld, cfg, moe, layer)?
        } else {
            let experts = match load_fused_experts(ld, cfg, moe, layer)? {
                Some(experts) => experts,
                None => (0..moe.num_experts)
                    .map(|e| Expert::load(ld, cfg, moe, layer, |p| SparseLinear::Expert(e, p)))
                    .collect::<Result<_>>()?,
            };
            let shared = match moe.shared_expert_intermediate_size {
                Some(_) => Some(SharedExpert {
                    expert: Expert::load(ld, cfg, moe, layer, SparseLinear::Shared)?,
                    gate: has_shared_gate(moe)
                        .then(|| load_linear(ld, cfg, moe, layer, SparseLinear::SharedGate))
                        .transpose()?,
                }),
                None => None,
            };
            (experts, shared)
        };
        let router = if moe.router_f32() {
            let [out_dim, in_dim] = SparseLinear::Router.shape(cfg, moe);
            let path = SparseLinear::Router.path(moe.naming, layer);
            let w = ld.load_f32(&format!("{path}.weight"), &[out_dim, in_dim])?;
            Linear {
                weight: LinearWeight::new(&w, false)?,
                bias: None,
            }
        } else {
            load_linear(ld, cfg, moe, layer, SparseLinear::Router)?
        };
        let routing = match (moe.deepseek_routing, router_bias_name(moe, layer)) {
            // Routing with a correction bias (`router_bias_name`).
            (Some(rule), Some(bias)) => RoutingRule::Biased {
                rule,
                norm: moe.norm_topk_prob.then(|| renorm_epsilon(moe.naming)),
                bias: ld
                    .load_f32(&bias, &router_bias_shape(moe))?
                    .flatten_all()?
                    .to_vec1::<f32>()?
                    .into(),
            },
            // Mistral 4's: V3's choosing with nothing added to the scores.
            (Some(rule), None) if moe.unbiased_choice => RoutingRule::Biased {
                rule,
                norm: moe.norm_topk_prob.then(|| renorm_epsilon(moe.naming)),
                bias: vec![0.0; moe.num_experts].into(),
            },
            (Some(rule), None) => RoutingRule::GroupedSoftmax(rule),
            _ if moe.naming.softmax_over_top_k() => RoutingRule::SoftmaxOverTopK,
            _ => RoutingRule::TopKOfSoftmax {
                norm: moe.norm_topk_prob,
            },
        };
        Ok(Self {
            router,
            router_reads_f32: moe.router_f32()
                || matches!(
                    routing,
                    RoutingRule::Biased { .. } | RoutingRule::GroupedSoftmax(_)
                ),
            experts,
            shared,
            top_k: moe.top_k,
            routing,
            clamped: cfg.clamped_swiglu.map(|c| (c.alpha as f32, c.limit as f32)),
        })
    }

    /// Replaces every expert's part of the stacked tensor `part` (a weight update of
    /// gpt-oss or Granite MoE; shaped as a checkpoint of `naming` stores it, in the engine's
    /// dtypes).
    pub(super) fn set_stacked(
        &mut self,
        naming: ExpertNaming,
        part: FusedPart,
        t: &Tensor,
        bf16_act: bool,
    ) -> Result<()> {
        let shared = self.shared.as_mut().map(|s| &mut s.expert);
        put(
            &mut self.experts,
            shared,
            part,
            part.split(naming, t)?,
            bf16_act,
        )
    }

    /// The MLP's output for `x` (`[n, hidden]`). `fixed_blocks`: run the experts' GEMMs on
    /// fixed row blocks, so a row's bits never depend on how the other rows were routed.
    pub(super) fn forward(
        &self,
        x: &Tensor,
        gemm: GemmOptions,
        fixed_blocks: bool,
    ) -> Result<Tensor> {
        let (n, _) = x.dims2()?;
        let dev = x.device();
        let logits = match self.router_reads_f32 {
            true => self.router.apply(&x.to_dtype(DType::F32)?, gemm)?,
            false => self.router.apply(x, gemm)?,
        };
        let num_experts = self.experts.len();
        let routing = ops::with_f32_values(&logits, |logits| match &self.routing {
            RoutingRule::TopKOfSoftmax { norm } => {
                Routing::new(logits, num_experts, self.top_k, *norm)
            }
            RoutingRule::SoftmaxOverTopK => {
                Routing::softmax_over_top_k(logits, num_experts, self.top_k)
            }
            RoutingRule::Biased { rule, norm, bias } => {
                Routing::biased(logits, num_experts, self.top_k, bias, rule, *norm)
            }
            RoutingRule::GroupedSoftmax(rule) => {
                Routing::grouped_softmax(logits, num_experts, self.top_k, rule)
            }
        })??;
        let expert_gemm = GemmOptions {
            invariant: gemm.invariant || fixed_blocks,
            ..gemm
        };
        // Each expert over its rows, stacked in expert order: `routed[offset[e] + i]` is
        // expert e's output for its i-th row. On the CPU the experts run in parallel, each
        // one's small GEMMs on one thread: a parallel region per GEMM of a few rows costs
        // more in wake-ups than it saves. A row's bits are the same either way.
        let active: Vec<(&Expert, &Vec<u32>)> = self
            .experts
            .iter()
            .zip(&routing.rows)
            .filter(|(_, rows)| !rows.is_empty())
            .collect();
        let run = |&(expert, rows): &(&Expert, &Vec<u32>)| {
            let idx = Tensor::from_slice(rows, rows.len(), dev)?;
            expert.forward(&x.index_select(&idx, 0)?, expert_gemm, self.clamped)
        };
        let outputs = if dev.is_cpu() {
            active
                .par_iter()
                .map(run)
                .collect::<candle_core::Result<Vec<_>>>()?
        } else {
            active
                .iter()
                .map(run)
                .collect::<candle_core::Result<Vec<_>>>()?
        };
        let routed = Tensor::cat(&outputs, 0)?;
        let mut out: Option<Tensor> = None;
        for (positions, weights) in routing.slots(n) {
            let idx = Tensor::from_vec(positions, n, dev)?;
            let w = Tensor::from_vec(weights, (n, 1), dev)?.to_dtype(x.dtype())?;
            let term = routed.index_select(&idx, 0)?.broadcast_mul(&w)?;
            out = Some(match out {
                Some(acc) => (acc + term)?,
                None => term,
            });
        }
        let mut out =
            out.ok_or_else(|| DetspecError::param("num_experts_per_tok", "must be > 0"))?;
        if let Some(shared) = &self.shared {
            let y = shared.expert.forward(x, gemm, None)?;
            let y = match &shared.gate {
                Some(gate) => {
                    let scale = ops::with_f32_values(&gate.apply(x, gemm)?, |g| {
                        g.iter().map(|&v| ops::sigmoid(v)).collect::<Vec<f32>>()
                    })?;
                    y.broadcast_mul(&Tensor::from_vec(scale, (n, 1), dev)?.to_dtype(x.dtype())?)?
                }
                None => y,
            };
            out = (out + y)?;
        }
        Ok(out)
    }
}

/// The linear layer `which` of layer `layer`'s sparse MLP (with a bias in gpt-oss only).
fn load_linear(
    ld: &WeightLoader<'_>,
    cfg: &ModelConfig,
    moe: &MoeConfig,
    layer: usize,
    which: SparseLinear,
) -> Result<Linear> {
    let [out_dim, in_dim] = which.shape(cfg, moe);
    let bias = moe.naming.has_biases();
    ld.linear(&which.path(moe.naming, layer), in_dim, out_dim, bias)
}

/// The experts (and shared expert) of layer `layer` of a checkpoint that stacks them (gpt-oss,
/// Granite MoE: `fused_experts`), cut from its tensors.
/// Layer `layer`'s experts where the checkpoint holds them as transformers 5 does
/// ([`FusedExperts`]), each cut into the matrices the engine holds (hashed under their
/// per-expert names); `None` where it holds each expert's matrices.
fn load_fused_experts(
    ld: &WeightLoader<'_>,
    cfg: &ModelConfig,
    moe: &MoeConfig,
    layer: usize,
) -> Result<Option<Vec<Expert>>> {
    // Ungated experts stack their up projections alone.
    let [first, down] = FusedExperts::of(moe);
    if !ld.has(&first.name(moe.naming, layer)) {
        return Ok(None);
    }
    let pieces = |fused: FusedExperts| {
        ld.unstacked(
            &fused.name(moe.naming, layer),
            &fused.shape(cfg, moe),
            |t| Ok(fused.cut(moe, layer, t)?),
        )
    };
    let (gate_ups, downs) = (pieces(first)?, pieces(down)?);
    let linear = |t: &Tensor| -> Result<Linear> {
        Ok(Linear {
            weight: LinearWeight::new(t, ld.bf16_act())?,
            bias: None,
        })
    };
    gate_ups
        .chunks(if moe.ungated { 1 } else { 2 })
        .zip(&downs)
        .map(|(gu, d)| match gu {
            [g, u] => Ok(Expert {
                gate: Some(linear(g)?),
                up: linear(u)?,
                down: linear(d)?,
            }),
            [u] => Ok(Expert {
                gate: None,
                up: linear(u)?,
                down: linear(d)?,
            }),
            _ => Err(DetspecError::param("weights", "gate/up are two halves")),
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

fn load_stacked(
    ld: &WeightLoader<'_>,
    cfg: &ModelConfig,
    moe: &MoeConfig,
    layer: usize,
) -> Result<(Vec<Expert>, Option<SharedExpert>)> {
    let naming = moe.naming;
    let split = |p: FusedPart| -> Result<Vec<Vec<Tensor>>> {
        let t = ld.stacked_experts(
            &p.path(naming, layer),
            &p.shape(naming, cfg, moe),
            p.is_matrix(),
        )?;
        p.split(naming, &t)
    };
    // Per expert, the weights of a matrix part's outputs (gate and up, or down): kept in
    // MXFP4 where the checkpoint has it so and the CPU's MXFP4 GEMM runs, else cut from the
    // widened tensor.
    let weights = |p: FusedPart| -> Result<Vec<Vec<LinearWeight>>> {
        let (path, shape) = (p.path(naming, layer), p.shape(naming, cfg, moe));
        if let Some(w) = ld.packed_mxfp4_experts(&path, &shape, &p.output_rows(naming, cfg, moe))? {
            return Ok(w);
        }
        split(p)?
            .iter()
            .map(|pieces| {
                pieces
                    .iter()
                    .map(|t| LinearWeight::new(t, ld.bf16_act()))
                    .collect()
            })
            .collect()
    };
    // Experts of the matrices `gate_up` and `down`; their biases come after.
    let build = |gate_up: FusedPart, down: FusedPart| -> Result<Vec<Expert>> {
        let mut experts = Vec::new();
        for (gu, d) in weights(gate_up)?.into_iter().zip(weights(down)?) {
            let [gate, up] = <[LinearWeight; 2]>::try_from(gu)
                .map_err(|_| DetspecError::param("weights", "gate/up are two halves"))?;
            let [down] = <[LinearWeight; 1]>::try_from(d)
                .map_err(|_| DetspecError::param("weights", "down is one matrix"))?;
            let linear = |weight| Linear { weight, bias: None };
            experts.push(Expert {
                gate: Some(linear(gate)),
                up: linear(up),
                down: linear(down),
            });
        }
        Ok(experts)
    };
    let mut experts = build(FusedPart::GateUp, FusedPart::Down)?;
    let mut shared = match moe.shared_expert_intermediate_size {
        Some(_) => build(FusedPart::SharedGateUp, FusedPart::SharedDown)?
            .pop()
            .map(|expert| SharedExpert { expert, gate: None }),
        None => None,
    };
    let parts = FusedPart::all(naming, shared.is_some());
    for &p in parts.iter().filter(|p| !p.is_matrix()) {
        let target = shared.as_mut().map(|s| &mut s.expert);
        put(&mut experts, target, p, split(p)?, ld.bf16_act())?;
    }
    Ok((experts, shared))
}

/// Puts `pieces` (stacked part `part` cut per expert, `FusedPart::split`) into the experts, or
/// the shared expert for a shared part: a matrix as a weight, packed for the GEMM
/// (`bf16_act`: for the bf16-activation mode's), or a bias.
fn put(
    experts: &mut [Expert],
    shared: Option<&mut Expert>,
    part: FusedPart,
    pieces: Vec<Vec<Tensor>>,
    bf16_act: bool,
) -> Result<()> {
    let targets: Vec<&mut Expert> = match part.is_shared() {
        true => shared.into_iter().collect(),
        false => experts.iter_mut().collect(),
    };
    let halves: &[ExpertPart] = match part {
        FusedPart::Down | FusedPart::DownBias | FusedPart::SharedDown => &[ExpertPart::Down],
        _ => &[ExpertPart::Gate, ExpertPart::Up],
    };
    for (expert, pieces) in targets.into_iter().zip(pieces) {
        for (&p, piece) in halves.iter().zip(pieces) {
            let Some(linear) = expert.part_mut(p) else {
                return Err(DetspecError::param(
                    "weights",
                    "an ungated expert has no gate",
                ));
            };
            if part.is_matrix() {
                linear.weight = LinearWeight::new(&piece, bf16_act)?;
            } else {
                linear.bias = Some(piece);
            }
        }
    }
    Ok(())
}

/// Where each row goes: per expert the rows routed to it, in row order; per row its experts
/// and weights, in expert-id order.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Routing {
    pub(super) rows: Vec<Vec<u32>>,
    pub(super) picks: Vec<Vec<(usize, f32)>>,
}

impl Routing {
    /// The routing of rows whose router logits are `logits` (`[n, num_experts]`, row-major):
    /// softmax in f32 (max-subtracted, `ops::exp_nonpositive`, summed in index order), the
    /// `top_k` largest (ties to
    /// the lower index), renormalised to sum to one when `norm`.
    pub(super) fn new(
        logits: &[f32],
        num_experts: usize,
        top_k: usize,
        norm: bool,
    ) -> Result<Self> {
        let mut exps: Vec<f32> = Vec::with_capacity(num_experts);
        Self::by_row(logits, num_experts, |row, order| {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            exps.clear();
            exps.extend(row.iter().map(|&v| ops::exp_nonpositive(v - max)));
            let sum: f32 = exps.iter().sum();
            // Largest first; equal probabilities keep index order (a stable sort).
            order.sort_by(|&a, &b| exps[b].total_cmp(&exps[a]));
            let mut top: Vec<(usize, f32)> = order
                .iter()
                .take(top_k)
                .map(|&e| (e, exps[e] / sum))
                .collect();
            if norm {
                let total: f32 = top.iter().map(|&(_, p)| p).sum();
                for (_, p) in &mut top {
                    *p /= total;
                }
            }
            top
        })
    }

    /// The routing of rows whose router logits are `logits` (gpt-oss's, Granite's): the
    /// `top_k` largest logits (ties to the lower index), and their softmax in f32
    /// (max-subtracted, `ops::exp_nonpositive`, summed largest first as transformers' `topk`
    /// orders them).
    pub(super) fn softmax_over_top_k(
        logits: &[f32],
        num_experts: usize,
        top_k: usize,
    ) -> Result<Self> {
        Self::by_row(logits, num_experts, |row, order| {
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            order.truncate(top_k);
            let max = order.first().map_or(0.0, |&e| row[e]);
            let exps: Vec<f32> = order
                .iter()
                .map(|&e| ops::exp_nonpositive(row[e] - max))
                .collect();
            let sum: f32 = exps.iter().sum();
            order
                .iter()
                .zip(&exps)
                .map(|(&e, &x)| (e, x / sum))
                .collect()
        })
    }

    /// DeepSeek's routing of rows whose router logits are `logits` ([`DeepSeekRouting`]): each
    /// expert's score its logit's sigmoid (ERNIE's: the logits' softmax, as
    /// [`Self::grouped_softmax`] takes it); where there are groups, the `topk_group` groups
    /// whose two best biased scores sum highest (ties to the lower group); in them, the
    /// `top_k` best biased scores (ties to the lower expert), weighted by their unbiased
    /// scores, over the scores' sum (largest first) plus `norm`'s epsilon where there is one
    /// (ERNIE's floor of `moe_norm_min` never binds: the config check), times the scaling
    /// factor.
    pub(super) fn biased(
        logits: &[f32],
        num_experts: usize,
        top_k: usize,
        bias: &[f32],
        rule: &DeepSeekRouting,
        norm: Option<f32>,
    ) -> Result<Self> {
        if bias.len() != num_experts || rule.n_group == 0 {
            return Err(DetspecError::param(
                "e_score_correction_bias",
                format!("{} values for {num_experts} experts", bias.len()),
            ));
        }
        let mut scores: Vec<f32> = Vec::with_capacity(num_experts);
        let mut choice: Vec<f32> = Vec::with_capacity(num_experts);
        Self::by_row(logits, num_experts, |row, order| {
            match rule.scoring {
                Scoring::Sigmoid => {
                    scores.clear();
                    scores.extend(row.iter().map(|&v| ops::sigmoid(v)));
                }
                Scoring::Softmax => softmax_into(row, &mut scores),
            }
            choice.clear();
            choice.extend(scores.iter().zip(bias).map(|(&s, &b)| s + b));
            // A group's score: its two best biased scores, summed.
            grouped_top_k(&choice, order, rule, top_k, |g| {
                let (mut best, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                for &v in g {
                    if v > best {
                        (best, second) = (v, best);
                    } else if v > second {
                        second = v;
                    }
                }
                best + second
            });
            let mut top: Vec<(usize, f32)> = order.iter().map(|&e| (e, scores[e])).collect();
            if let Some(eps) = norm {
                let total = top.iter().map(|&(_, w)| w).sum::<f32>() + eps;
                for (_, w) in &mut top {
                    *w /= total;
                }
            }
            for (_, w) in &mut top {
                *w *= rule.routed_scaling_factor;
            }
            top
        })
    }

    /// DeepSeek-V2's routing of rows whose router logits are `logits`: a softmax in f32 (as
    /// [`Self::new`] takes it); where there are groups, the `topk_group` groups whose best
    /// score is highest (ties to the lower group); in them, the `top_k` best scores (ties to
    /// the lower expert), each weighing its score times the scaling factor.
    pub(super) fn grouped_softmax(
        logits: &[f32],
        num_experts: usize,
        top_k: usize,
        rule: &DeepSeekRouting,
    ) -> Result<Self> {
        if rule.n_group == 0 || !num_experts.is_multiple_of(rule.n_group) {
            return Err(DetspecError::param(
                "n_group",
                format!("{} groups for {num_experts} experts", rule.n_group),
            ));
        }
        let mut scores: Vec<f32> = Vec::with_capacity(num_experts);
        Self::by_row(logits, num_experts, |row, order| {
            softmax_into(row, &mut scores);
            // A group's score: its best.
            grouped_top_k(&scores, order, rule, top_k, |g| {
                g.iter().copied().fold(f32::NEG_INFINITY, f32::max)
            });
            order
                .iter()
                .map(|&e| (e, scores[e] * rule.routed_scaling_factor))
                .collect()
        })
    }

    /// The routing whose per-row picks `pick(row's logits, 0..num_experts)` gives (experts and
    /// weights, any order; `order` is scratch for it), put in expert-id order.
    fn by_row(
        logits: &[f32],
        num_experts: usize,
        mut pick: impl FnMut(&[f32], &mut Vec<usize>) -> Vec<(usize, f32)>,
    ) -> Result<Self> {
        Self::check(logits, num_experts)?;
        let mut rows = vec![Vec::new(); num_experts];
        let mut picks = Vec::with_capacity(logits.len() / num_experts);
        let mut order: Vec<usize> = Vec::with_capacity(num_experts);
        for (r, row) in logits.chunks(num_experts).enumerate() {
            order.clear();
            order.extend(0..num_experts);
            let mut top = pick(row, &mut order);
            top.sort_by_key(|&(e, _)| e);
            for &(e, _) in &top {
                rows[e].push(r as u32);
            }
            picks.push(top);
        }
        Ok(Self { rows, picks })
    }

    fn check(logits: &[f32], num_experts: usize) -> Result<()> {
        if num_experts == 0 || !logits.len().is_multiple_of(num_experts) {
            return Err(DetspecError::param(
                "num_experts",
                format!(
                    "{} router logits are not rows of {num_experts}",
                    logits.len()
                ),
            ));
        }
        Ok(())
    }

    /// For each of a row's k contributions, in expert-id order: every row's index into the
    /// experts' stacked outputs and its weight.
    fn slots(&self, n: usize) -> Vec<(Vec<u32>, Vec<f32>)> {
        let mut offset = Vec::with_capacity(self.rows.len());
        let mut total = 0u32;
        for rows in &self.rows {
            offset.push(total);
            total += rows.len() as u32;
        }
        let k = self.picks.first().map_or(0, Vec::len);
        let mut slots = vec![(Vec::with_capacity(n), Vec::with_capacity(n)); k];
        for top in &self.picks {
            for (slot, &(e, w)) in slots.iter_mut().zip(top) {
                slot.0.push(offset[e]);
                slot.1.push(w);
                offset[e] += 1;
            }
        }
        slots
    }
}

/// `row`'s softmax in f32 into `out` (max-subtracted, `ops::exp_nonpositive`, summed in
/// order).
fn softmax_into(row: &[f32], out: &mut Vec<f32>) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    out.clear();
    out.extend(row.iter().map(|&v| ops::exp_nonpositive(v - max)));
    let sum: f32 = out.iter().sum();
    for s in out.iter_mut() {
        *s /= sum;
    }
}

/// DeepSeek's choice: `order` (every expert) narrowed to the `topk_group` groups (of
/// `n_group` equal runs of `values`) whose `group_score` is highest (ties to the lower group),
/// then to the `top_k` highest `values`, best first (ties to the lower expert).
fn grouped_top_k(
    values: &[f32],
    order: &mut Vec<usize>,
    rule: &DeepSeekRouting,
    top_k: usize,
    group_score: impl Fn(&[f32]) -> f32,
) {
    if rule.n_group > 1 {
        let per_group = values.len() / rule.n_group;
        let scores: Vec<f32> = values.chunks(per_group).map(group_score).collect();
        let mut groups: Vec<usize> = (0..rule.n_group).collect();
        groups.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
        groups.truncate(rule.topk_group);
        order.retain(|&e| groups.contains(&(e / per_group)));
    }
    // A stable sort: equal values keep index order.
    order.sort_by(|&a, &b| values[b].total_cmp(&values[a]));
    order.truncate(top_k);
}

impl SparseMlp {
    /// The linear layer `which`, if this MLP has it.
    pub(super) fn linear_mut(&mut self, which: SparseLinear) -> Option<&mut Linear> {
        match which {
            SparseLinear::Router => Some(&mut self.router),
            SparseLinear::Expert(e, part) => self.experts.get_mut(e)?.part_mut(part),
            SparseLinear::Shared(part) => self.shared.as_mut()?.expert.part_mut(part),
            SparseLinear::SharedGate => self.shared.as_mut()?.gate.as_mut(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DeepSeek's renormalisation ([`renorm_epsilon`]).
    const DEEPSEEK_EPS: Option<f32> = Some(1e-20);

    #[test]
    fn routing_picks_top_k_in_expert_order_and_renormalises() {
        // Row 0 prefers experts 2 then 0; row 1 has a tie between 1 and 3 (the lower wins).
        let logits = [1.0, 0.0, 3.0, -1.0, 0.0, 2.0, 0.0, 2.0];
        let r = Routing::new(&logits, 4, 2, true).unwrap();
        assert_eq!(r.rows, vec![vec![0], vec![1], vec![0], vec![1]]);
        let experts: Vec<Vec<usize>> = r
            .picks
            .iter()
            .map(|p| p.iter().map(|&(e, _)| e).collect())
            .collect();
        assert_eq!(experts, vec![vec![0, 2], vec![1, 3]]);
        for top in &r.picks {
            let sum: f32 = top.iter().map(|&(_, w)| w).sum();
            assert!((sum - 1.0).abs() < 1e-6);
        }
        let e = [1.0f32, 0.0, 3.0, -1.0].map(|v| (v - 3.0f32).exp());
        assert!((r.picks[0][0].1 - e[0] / (e[0] + e[2])).abs() < 1e-6);
        let plain = Routing::new(&logits, 4, 2, false).unwrap();
        let total: f32 = e.iter().sum();
        assert!((plain.picks[0][1].1 - e[2] / total).abs() < 1e-6);
    }

    #[test]
    fn softmax_over_top_k_equals_renormalised_top_k_up_to_rounding() {
        let logits: Vec<f32> = (0..48)
            .map(|i| ((i * 29 % 13) as f32 - 6.0) * 0.37)
            .collect();
        let a = Routing::softmax_over_top_k(&logits, 8, 3).unwrap();
        let b = Routing::new(&logits, 8, 3, true).unwrap();
        assert_eq!(a.rows, b.rows);
        for (x, y) in a.picks.iter().zip(&b.picks) {
            for (&(e, w), &(f, v)) in x.iter().zip(y) {
                assert_eq!(e, f);
                assert!((w - v).abs() < 1e-6, "{w} vs {v}");
            }
        }
        // Ties go to the lower expert.
        let tie = Routing::softmax_over_top_k(&[1.0, 2.0, 2.0, 0.0], 4, 1).unwrap();
        assert_eq!(tie.picks[0], vec![(1, 1.0)]);
    }

    #[test]
    fn slots_index_the_stacked_expert_outputs() {
        let logits = [5.0, 4.0, 0.0, 0.0, 4.0, 5.0, 5.0, 0.0, 4.0];
        let r = Routing::new(&logits, 3, 2, false).unwrap();
        // Experts' rows [0, 2] | [0, 1] | [1, 2], stacked at 0..2 | 2..4 | 4..6.
        assert_eq!(r.rows, vec![vec![0, 2], vec![0, 1], vec![1, 2]]);
        let slots = r.slots(3);
        assert_eq!(slots[0].0, vec![0, 3, 1]);
        assert_eq!(slots[1].0, vec![2, 4, 5]);
    }

    #[test]
    fn a_rows_routing_is_its_own() {
        // Routing row by row equals routing the batch: nothing crosses rows.
        let logits: Vec<f32> = (0..40)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3)
            .collect();
        let batch = Routing::new(&logits, 8, 3, true).unwrap();
        for (r, row) in logits.chunks(8).enumerate() {
            let alone = Routing::new(row, 8, 3, true).unwrap();
            let a: Vec<(usize, u32)> = alone.picks[0]
                .iter()
                .map(|&(e, w)| (e, w.to_bits()))
                .collect();
            let b: Vec<(usize, u32)> = batch.picks[r]
                .iter()
                .map(|&(e, w)| (e, w.to_bits()))
                .collect();
            assert_eq!(a, b);
        }
    }

    #[test]
    fn deepseek_routing_chooses_by_group_and_bias_and_weighs_by_score() {
        // Four groups of two; the best two groups' experts compete for the top 2.
        let logits = [3.0, -3.0, 1.0, 1.0, 2.0, 0.0, 2.5, -5.0];
        let rule = DeepSeekRouting {
            scoring: Scoring::Sigmoid,
            n_group: 4,
            topk_group: 2,
            routed_scaling_factor: 2.0,
        };
        let s: Vec<f32> = logits.iter().map(|&v| ops::sigmoid(v)).collect();
        let weights = |a: usize, b: usize| {
            let total = s[a] + s[b] + 1e-20;
            vec![(a, s[a] / total * 2.0), (b, s[b] / total * 2.0)]
        };
        // No bias: group 0 sums 0.95 + 0.05, so groups 1 and 2 win; experts 4 and 2 (not 6,
        // the second best overall, whose group lost).
        let zero = [0.0; 8];
        let r = Routing::biased(&logits, 8, 2, &zero, &rule, DEEPSEEK_EPS).unwrap();
        assert_eq!(r.picks[0], weights(2, 4));
        // Expert 1's bias lifts group 0 over group 2; its own biased score (0.55) still loses
        // to expert 2's and 3's (0.73, tied: the lower wins). Weights are the unbiased scores.
        let mut bias = zero;
        bias[1] = 0.5;
        let r = Routing::biased(&logits, 8, 2, &bias, &rule, DEEPSEEK_EPS).unwrap();
        assert_eq!(r.picks[0], weights(0, 2));
        // One group: the plain top 2 by biased score, unnormalised, scaled.
        let one = DeepSeekRouting {
            n_group: 1,
            topk_group: 1,
            ..rule
        };
        let r = Routing::biased(&logits, 8, 2, &zero, &one, None).unwrap();
        assert_eq!(r.picks[0], vec![(0, s[0] * 2.0), (6, s[6] * 2.0)]);
        assert!(Routing::biased(&logits, 8, 2, &[0.0; 7], &rule, DEEPSEEK_EPS).is_err());
    }

    #[test]
    fn deepseek_routing_equals_masked_repeated_argmax() {
        // transformers' reading: mask the losing groups' experts to -inf, then take the top k;
        // here by repeated argmax (first maximum wins), against the engine's sorts.
        let (experts, top_k) = (12, 3);
        let rule = DeepSeekRouting {
            scoring: Scoring::Sigmoid,
            n_group: 4,
            topk_group: 2,
            routed_scaling_factor: 1.5,
        };
        let logits: Vec<f32> = (0..experts * 40)
            .map(|i| (((i * 7919) % 23) as f32 - 11.0) * 0.25)
            .collect();
        let bias: Vec<f32> = (0..experts).map(|e| (e % 5) as f32 * 0.05).collect();
        let r = Routing::biased(&logits, experts, top_k, &bias, &rule, DEEPSEEK_EPS).unwrap();
        let argmax =
            |v: &[f32]| (0..v.len()).fold(0, |best, i| if v[i] > v[best] { i } else { best });
        for (row, got) in logits.chunks(experts).zip(&r.picks) {
            let s: Vec<f32> = row.iter().map(|&v| ops::sigmoid(v)).collect();
            let mut choice: Vec<f32> = s.iter().zip(&bias).map(|(a, b)| a + b).collect();
            let mut group: Vec<f32> = choice
                .chunks(3)
                .map(|g| {
                    let mut g = g.to_vec();
                    g.sort_by(|a, b| b.total_cmp(a));
                    g[0] + g[1]
                })
                .collect();
            let mut kept = [false; 4];
            for _ in 0..rule.topk_group {
                let g = argmax(&group);
                kept[g] = true;
                group[g] = f32::NEG_INFINITY;
            }
            for (e, c) in choice.iter_mut().enumerate() {
                if !kept[e / 3] {
                    *c = f32::NEG_INFINITY;
                }
            }
            let mut picked = Vec::new();
            for _ in 0..top_k {
                let e = argmax(&choice);
                picked.push(e);
                choice[e] = f32::NEG_INFINITY;
            }
            let total = picked.iter().map(|&e| s[e]).sum::<f32>() + 1e-20;
            let mut want: Vec<(usize, u32)> = picked
                .iter()
                .map(|&e| (e, (s[e] / total * 1.5).to_bits()))
                .collect();
            want.sort();
            let got: Vec<(usize, u32)> = got.iter().map(|&(e, w)| (e, w.to_bits())).collect();
            assert_eq!(got, want, "row {row:?}");
        }
    }

    #[test]
    fn ernie_routing_chooses_by_biased_softmax_and_weighs_by_softmax() {
        // ERNIE 4.5's: softmax scores; the bias only chooses (it lifts expert 3 over 1 here);
        // the chosen scores renormalised, unscaled.
        let logits = [2.0f32, 1.0, -1.0, 0.5];
        let bias = [0.0, 0.0, 0.0, 0.5];
        let rule = DeepSeekRouting {
            scoring: Scoring::Softmax,
            n_group: 1,
            topk_group: 1,
            routed_scaling_factor: 1.0,
        };
        let r = Routing::biased(&logits, 4, 2, &bias, &rule, DEEPSEEK_EPS).unwrap();
        let mut p = Vec::new();
        softmax_into(&logits, &mut p);
        assert!(p[1] > p[3] && p[3] + bias[3] > p[1] + bias[1]);
        let total = p[0] + p[3] + 1e-20;
        let want = vec![(0, p[0] / total), (3, p[3] / total)];
        let bits =
            |v: &[(usize, f32)]| v.iter().map(|&(e, w)| (e, w.to_bits())).collect::<Vec<_>>();
        assert_eq!(bits(&r.picks[0]), bits(&want));
        // Without the bias, expert 1 is chosen.
        let r = Routing::biased(&logits, 4, 2, &[0.0; 4], &rule, DEEPSEEK_EPS).unwrap();
        assert_eq!(
            r.picks[0].iter().map(|&(e, _)| e).collect::<Vec<_>>(),
            [0, 1]
        );
    }

    #[test]
    fn grouped_softmax_routing_keeps_the_best_groups_and_weighs_by_score() {
        // DeepSeek-V2's: softmax, groups scored by their best, the top k of the kept groups,
        // weights the scores times the scale (never renormalised).
        let logits = [2.0, 1.9, 0.0, 1.8, 1.0, 0.5, -1.0, 0.9];
        let rule = DeepSeekRouting {
            scoring: Scoring::Softmax,
            n_group: 4,
            topk_group: 2,
            routed_scaling_factor: 1.5,
        };
        let max = 2.0f32;
        let e: Vec<f32> = logits
            .iter()
            .map(|&v| ops::exp_nonpositive(v - max))
            .collect();
        let sum: f32 = e.iter().sum();
        let p: Vec<f32> = e.iter().map(|&x| x / sum).collect();
        // Groups {0,1} (best 2.0) and {2,3} (best 1.8) win over {4,5} (1.0) and {6,7} (0.9):
        // the top 2 are experts 0 and 1.
        let r = Routing::grouped_softmax(&logits, 8, 2, &rule).unwrap();
        assert_eq!(r.picks[0], vec![(0, p[0] * 1.5), (1, p[1] * 1.5)]);
        // Top 3: expert 3 (group 1) comes before 4 (1.0, its group lost).
        let r = Routing::grouped_softmax(&logits, 8, 3, &rule).unwrap();
        let got: Vec<usize> = r.picks[0].iter().map(|&(e, _)| e).collect();
        assert_eq!(got, vec![0, 1, 3]);
        // One group: the plain top k of the softmax.
        let one = DeepSeekRouting {
            n_group: 1,
            topk_group: 1,
            ..rule
        };
        let r = Routing::grouped_softmax(&logits, 8, 4, &one).unwrap();
        let got: Vec<usize> = r.picks[0].iter().map(|&(e, _)| e).collect();
        assert_eq!(got, vec![0, 1, 3, 4]);
        assert!(
            Routing::grouped_softmax(&logits, 8, 2, &DeepSeekRouting { n_group: 3, ..rule })
                .is_err()
        );
    }
}
