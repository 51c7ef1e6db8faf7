//! Weight updates: replacing a loaded model's parameters in place, addressed by their Hugging
//! Face names (a trainer pushing new weights), with the weights hash kept up to date.

use candle_core::{DType, Tensor};

use crate::config::ExpertNaming;

use crate::error::Result;

use std::sync::Arc;

use super::decoder::{Attention, Mixer, Mlp, Model, QkvSource, UngatedAct};
use super::fused_experts::FusedPart;
use super::gated_delta_net::GatedDeltaNet;
use super::linear::{Linear, LinearWeight, Projection};
use super::loader::{host_vector, offset_norm};
use super::mla::LatentParam;
use super::moe::{RoutingRule, SparseMlp};
use super::moe_names::{parse_sparse_linear, router_bias_name, SparseLinear};
use super::param_hash::tensor_hash;
use super::params::{check_update, unknown};

/// Where a named parameter lives in the model.
enum Slot<'a> {
    /// An RMSNorm's weight (held offset, `loader::offset_norm`).
    Norm(&'a mut Tensor),
    /// An RMSNorm's weight held as written whatever the model's offset (the DeltaNet's gated
    /// norm).
    PlainNorm(&'a mut Tensor),
    Bias(&'a mut Option<Tensor>),
    Linear(&'a mut LinearWeight),
    /// A linear layer's weight held in f32 whatever the engine's dtype (DeepSeek's router).
    F32Linear(&'a mut LinearWeight),
    /// DeepSeek's router's correction bias, held in f32 on the host.
    RouterBias(&'a mut Arc<[f32]>),
    /// Weight of layer `.1` of a projection (apart or stacked).
    PartWeight(&'a mut Projection, usize),
    /// Bias of layer `.1` of a projection.
    PartBias(&'a mut Projection, usize),
    /// Every layer of a projection a checkpoint stores as one matrix, of these widths.
    FusedWeight(&'a mut Projection, Vec<usize>),
    /// A stacked tensor of every expert's part (gpt-oss's, Granite MoE's: `fused_experts`).
    Stacked(&'a mut SparseMlp, ExpertNaming, FusedPart),
    /// A vector held in f32 on the host, rounded to the weights' dtype: gpt-oss's per-head
    /// sink logits, a convolution's bias.
    HostVector(&'a mut Option<Arc<[f32]>>),
    /// The same, always present: a convolution's taps.
    HostValues(&'a mut Arc<[f32]>),
    /// A Qwen3-Next DeltaNet's projection stored grouped by key head (`in_proj_qkvz`,
    /// `in_proj_ba`), which the layer holds as two linear layers each.
    GroupedDeltaNet(&'a mut GatedDeltaNet, &'static str),
    /// One value (Apertus's xIELU parameters).
    Scalar(&'a mut f32),
    Embedding,
}

impl Model {
    /// Replaces the named parameters, after checking all of them with [`check_update`] (so
    /// a bad one changes nothing); values are converted to the engine's dtype. Returns the new
    /// combined weights hash.
    pub fn set_params(&mut self, updates: Vec<(String, Tensor)>) -> Result<u64> {
        let shapes: Vec<(String, Vec<usize>, DType)> = updates
            .iter()
            .map(|(n, t)| (n.clone(), t.dims().to_vec(), t.dtype()))
            .collect();
        check_update(&self.cfg, &shapes)?;
        let tied = self.cfg.tie_word_embeddings;
        let bf16_act = self.bf16_activations();
        let device = self.device().clone();
        let norm_offset = self.cfg.architecture.norm_weight_offset();
        let sets_embedding = updates
            .iter()
            .any(|(n, _)| n == "model.embed_tokens.weight");
        for (name, t) in updates {
            // A tied model's `lm_head.weight` is the embedding: torch's state_dict yields both
            // names for one tensor, so when both come the embedding's entry is applied.
            if tied && name == "lm_head.weight" && sets_embedding {
                continue;
            }
            let t = t.to_device(&device)?;
            let hash_name = if tied && name == "lm_head.weight" {
                "model.embed_tokens.weight".to_string()
            } else {
                name.clone()
            };
            // Matrices in the weights' dtype, vectors rounded to it and held in the activations'
            // (they differ on the CPU with bf16 weights).
            let (matrix, vector) = (self.dtype(), self.act_dtype());
            let t = match self.slot(&hash_name).ok_or_else(|| unknown(&name))? {
                Slot::Norm(v) => {
                    let t = t.to_dtype(matrix)?.to_dtype(vector)?;
                    *v = offset_norm(&t, norm_offset)?;
                    t
                }
                Slot::PlainNorm(v) => {
                    let t = t.to_dtype(matrix)?.to_dtype(vector)?;
                    *v = t.clone();
                    t
                }
                Slot::Bias(b) => {
                    let t = t.to_dtype(matrix)?.to_dtype(vector)?;
                    *b = Some(t.clone());
                    t
                }
                Slot::Linear(w) => {
                    let t = t.to_dtype(matrix)?;
                    *w = LinearWeight::new(&t, bf16_act)?;
                    t
                }
                Slot::F32Linear(w) => {
                    let t = t.to_dtype(DType::F32)?;
                    *w = LinearWeight::new(&t, false)?;
                    t
                }
                Slot::Scalar(v) => {
                    let t = t.to_dtype(DType::F32)?;
                    // (`check_update` has checked its one element)
                    if let Some(&x) = t.flatten_all()?.to_vec1::<f32>()?.first() {
                        *v = x;
                    }
                    t
                }
                Slot::RouterBias(b) => {
                    let t = t.to_dtype(DType::F32)?;
                    // ERNIE's is one row, `[1, experts]`.
                    *b = t.flatten_all()?.to_vec1::<f32>()?.into();
                    t
                }
                Slot::PartWeight(p, part) => {
                    let t = t.to_dtype(matrix)?;
                    p.set_weight(part, &t, bf16_act)?;
                    t
                }
                Slot::FusedWeight(p, widths) => {
                    let t = t.to_dtype(matrix)?;
                    p.set_fused_weight(&t, &widths, bf16_act)?;
                    t
                }
                Slot::GroupedDeltaNet(net, module) => {
                    let t = t.to_dtype(matrix)?;
                    net.set_grouped(module, &t, bf16_act)?;
                    t
                }
                Slot::Stacked(moe, naming, part) => {
                    let t = t.to_dtype(matrix)?;
                    let t = if part.is_matrix() {
                        t
                    } else {
                        t.to_dtype(vector)?
                    };
                    moe.set_stacked(naming, part, &t, bf16_act)?;
                    t
                }
                Slot::HostVector(s) => {
                    let t = t.to_dtype(matrix)?.to_dtype(vector)?;
                    *s = Some(host_vector(&t)?);
                    t
                }
                Slot::HostValues(s) => {
                    let t = t.to_dtype(matrix)?.to_dtype(vector)?;
                    *s = host_vector(&t)?;
                    t
                }
                Slot::PartBias(p, part) => {
                    let t = t.to_dtype(matrix)?.to_dtype(vector)?;
                    p.set_bias(part, t.clone())?;
                    t
                }
                Slot::Embedding => {
                    let t = t.to_dtype(matrix)?;
                    if tied {
                        self.lm_head = LinearWeight::new(&t, bf16_act)?;
                    }
                    self.embed = t.clone();
                    t
                }
            };
            self.param_hashes.insert(hash_name, tensor_hash(&t)?);
        }
        Ok(self.param_hashes.combined())
    }

    fn slot(&mut self, name: &str) -> Option<Slot<'_>> {
        match name {
            "model.embed_tokens.weight" => return Some(Slot::Embedding),
            n if n == self.cfg.architecture.final_norm() => {
                return Some(Slot::Norm(&mut self.norm))
            }
            n if n == self.cfg.head.weight_name() => return Some(Slot::Linear(&mut self.lm_head)),
            _ => {}
        }
        let rest = name.strip_prefix("model.layers.")?;
        let (index, field) = rest.split_once('.')?;
        let layer_index = index.parse::<usize>().ok()?;
        let layer = self.layers.get_mut(layer_index)?;
        let (module, kind) = field.rsplit_once('.')?;
        let (gate_up, down) = match &mut layer.mlp {
            None => (None, None),
            Some(Mlp::Dense { gate_up, down }) => (Some(gate_up), Some(down)),
            Some(Mlp::Ungated { up, down, act }) => match (module, kind, act) {
                ("mlp.up_proj", ..) => return linear_slot(up, kind),
                ("mlp.down_proj", ..) => return linear_slot(down, kind),
                ("mlp.act_fn", name, UngatedAct::Xielu(p)) => {
                    return p.param_mut(name).map(Slot::Scalar)
                }
                _ => (None, None),
            },
            Some(Mlp::Sparse(moe)) => {
                if let Some(m) = self.cfg.moe.as_ref() {
                    let shared = m.shared_expert_intermediate_size.is_some();
                    if let Some(part) = FusedPart::parse(m.naming, shared, layer_index, name) {
                        return Some(Slot::Stacked(moe, m.naming, part));
                    }
                }
                if let Some(m) = self.cfg.moe.as_ref() {
                    if router_bias_name(m, layer_index).as_deref() == Some(name) {
                        return match &mut moe.routing {
                            RoutingRule::Biased { bias, .. } => Some(Slot::RouterBias(bias)),
                            _ => None,
                        };
                    }
                    if let Some(which) = parse_sparse_linear(m, module) {
                        let linear = moe.linear_mut(which)?;
                        if which == SparseLinear::Router && m.router_f32() {
                            return (kind == "weight")
                                .then_some(Slot::F32Linear(&mut linear.weight));
                        }
                        return linear_slot(linear, kind);
                    }
                }
                (None, None)
            }
        };
        let attn: Option<&mut Attention> = match &mut layer.mixer {
            None => None,
            Some(Mixer::Attention(a)) => Some(a),
            Some(Mixer::ShortConv(conv)) => {
                // A convolution layer's own parameters.
                match (module, kind) {
                    ("conv.in_proj", _) => return linear_slot(&mut conv.in_proj, kind),
                    ("conv.out_proj", _) => return linear_slot(&mut conv.out_proj, kind),
                    ("conv.conv", "weight") => {
                        return Some(Slot::HostValues(&mut conv.taps.weight))
                    }
                    ("conv.conv", "bias") => return Some(Slot::HostVector(&mut conv.taps.bias)),
                    _ => None,
                }
            }
            Some(Mixer::GatedDeltaNet(net)) => {
                // Its own parameters; the layer's norms and MLP are found below.
                match (module, kind) {
                    ("linear_attn", "A_log") => {
                        return Some(Slot::HostValues(&mut net.params.a_log))
                    }
                    ("linear_attn", "dt_bias") => {
                        return Some(Slot::HostValues(&mut net.params.dt_bias))
                    }
                    ("linear_attn.conv1d", "weight") => {
                        return Some(Slot::HostValues(&mut net.params.conv))
                    }
                    ("linear_attn.norm", "weight") => return Some(Slot::PlainNorm(&mut net.norm)),
                    ("linear_attn.in_proj_qkvz", "weight") => {
                        return Some(Slot::GroupedDeltaNet(net, "in_proj_qkvz"))
                    }
                    ("linear_attn.in_proj_ba", "weight") => {
                        return Some(Slot::GroupedDeltaNet(net, "in_proj_ba"))
                    }
                    _ => {}
                }
                if let Some(linear) = module.strip_prefix("linear_attn.") {
                    return linear_slot(net.linear_mut(linear)?, kind);
                }
                None
            }
            Some(Mixer::Mamba2(mixer)) => {
                // Its own parameters; the layer's norms and MLP are found below.
                match (module, kind) {
                    ("mamba", "A_log") => return Some(Slot::HostValues(&mut mixer.params.a_log)),
                    ("mamba", "dt_bias") => {
                        return Some(Slot::HostValues(&mut mixer.params.dt_bias))
                    }
                    ("mamba", "D") => return Some(Slot::HostValues(&mut mixer.params.d)),
                    ("mamba.conv1d", "weight") => {
                        return Some(Slot::HostValues(&mut mixer.params.conv))
                    }
                    ("mamba.conv1d", "bias") => {
                        return Some(Slot::HostVector(&mut mixer.params.conv_bias))
                    }
                    ("mamba.norm", "weight") => return Some(Slot::PlainNorm(&mut mixer.norm)),
                    _ => {}
                }
                if let Some(linear) = module.strip_prefix("mamba.") {
                    return linear_slot(mixer.linear_mut(linear)?, kind);
                }
                None
            }
        };
        // Latent attention's own parameters (every `self_attn` one but o_proj).
        let latent = matches!(attn.as_deref(), Some(a) if matches!(a.qkv, QkvSource::Latent(_)));
        let latent_name = module.strip_prefix("self_attn.").filter(|n| *n != "o_proj");
        if let Some(name) = latent_name.filter(|_| latent) {
            let Some(Attention {
                qkv: QkvSource::Latent(latent),
                ..
            }) = attn
            else {
                return None;
            };
            return match latent.param_mut(name)? {
                LatentParam::Norm(norm) => (kind == "weight").then_some(Slot::Norm(norm)),
                LatentParam::Linear(linear) => linear_slot(linear, kind),
            };
        }
        // The same name is a different norm by layout (`post_attention_layernorm`: the MLP's
        // input in the Llama family, the attention's output in OLMo 2 and Gemma).
        let names = self.cfg.layer_norms(layer_index);
        if let Some(at) = names.iter().position(|n| *n == Some(module)) {
            let norms = [
                &mut layer.input_norm,
                &mut layer.attn_out_norm,
                &mut layer.mlp_norm,
                &mut layer.mlp_out_norm,
            ];
            return match kind {
                "weight" => norms.into_iter().nth(at)?.as_mut().map(Slot::Norm),
                _ => None,
            };
        }
        // A fused matrix replaces every layer it holds (`check_update` has refused the
        // separate names on such a model, and the fused ones elsewhere).
        let fused = self.cfg.architecture.fused();
        let (q_norm_name, k_norm_name, _) = self.cfg.architecture.qk_norms();
        if kind == "weight" {
            let is = self.cfg.intermediate_size;
            match module {
                "self_attn.qkv_proj" if fused.qkv => {
                    let widths = self.cfg.qkv_widths().to_vec();
                    return Some(Slot::FusedWeight(heads(attn?)?, widths));
                }
                m if fused.gate_up && m == fused.gate_up_module() => {
                    return Some(Slot::FusedWeight(gate_up?, vec![is, is]))
                }
                _ => {}
            }
        }
        let [gate_name, up_name] = fused.gate_and_up_modules();
        let (projection, part) = match module {
            "self_attn.q_proj" => (heads(attn?)?, 0),
            "self_attn.k_proj" => (heads(attn?)?, 1),
            "self_attn.v_proj" => (heads(attn?)?, 2),
            m if m == gate_name => (gate_up?, 0),
            m if m == up_name => (gate_up?, 1),
            m if m == self.cfg.architecture.o_proj_module() => {
                return linear_slot(&mut attn?.o, kind)
            }
            m if m == fused.down_module() => return linear_slot(down?, kind),
            m if m.strip_prefix("self_attn.") == Some(q_norm_name) => {
                return attn?.q_norm.as_mut().map(Slot::Norm)
            }
            m if m.strip_prefix("self_attn.") == Some(k_norm_name) => {
                return attn?.k_norm.as_mut().map(Slot::Norm)
            }
            "self_attn" if kind == "sinks" => return Some(Slot::HostVector(&mut attn?.sinks)),
            _ => return None,
        };
        match kind {
            "weight" => Some(Slot::PartWeight(projection, part)),
            "bias" => Some(Slot::PartBias(projection, part)),
            _ => None,
        }
    }
}

/// The weight or bias (`kind`) of a linear layer that stands alone.
/// A layer's q/k/v projections (none on a latent-attention layer).
fn heads(attn: &mut Attention) -> Option<&mut Projection> {
    match &mut attn.qkv {
        QkvSource::Heads(p) => Some(p),
        QkvSource::Latent(_) => None,
    }
}

fn linear_slot<'a>(linear: &'a mut Linear, kind: &str) -> Option<Slot<'a>> {
    match kind {
        "weight" => Some(Slot::Linear(&mut linear.weight)),
        "bias" => Some(Slot::Bias(&mut linear.bias)),
        _ => None,
    }
}
