//! The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo 2 and 3, Granite,
//! SmolLM3, Gemma 2 and 3, and with sparse MLPs Mixtral, Qwen2-MoE, Qwen3-MoE) over a flat
//! varlen batch.
//!
//! One call runs any mix of prefill chunks and decode rows from many sequences: the batch is a
//! flat list of tokens with their absolute positions, and each token's K/V is written to the
//! paged cache at its slot before attention reads the cache.

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::config::{ActivationDtype, KernelProfile, ModelConfig, RopeConfig, UngatedMlp};
use crate::error::{DetspecError, Result};
use crate::kv::{KvPool, LayerCache, StateRef};
use crate::ops::{self, AttentionMetadata};

use super::gated_delta_net::GatedDeltaNet;
use super::linear::{GemmOptions, Linear, LinearWeight, Projection};
use super::loader::{host_vector, WeightLoader};
use super::lora::{LoraAdapter, LoraOutputs, LoraRows, LoraTarget};
use super::mamba2::Mamba2Mixer;
use super::mla::LatentAttention;
use super::moe::SparseMlp;
use super::param_hash::ParamHashes;
use super::short_conv::ShortConv;
use super::weights::Checkpoint;
use super::xielu::XieluParams;

/// One forward pass's inputs: a flat batch of tokens from one or more sequences.
#[derive(Debug, Clone, Default)]
pub struct ForwardBatch {
    /// Token id of each row.
    pub tokens: Vec<u32>,
    /// Cache slot each row's K/V is written to.
    pub slots: Vec<u32>,
    /// Positions, sequence index and block tables for attention.
    pub attention: AttentionMetadata,
    /// Rows whose logits are wanted, in output order.
    pub logit_rows: Vec<u32>,
    /// Run every GEMM on fixed-size row blocks so a row's result never depends on how many
    /// rows the batch has (the `batch_invariant` mode).
    pub invariant_gemm: bool,
    /// The LoRA adapter of each sequence, by sequence index (`attention.row_seq`); rows of a
    /// sequence past its end (padding) or with `None` run the base model alone.
    pub adapters: Vec<Option<Arc<LoraAdapter>>>,
    /// Mixture-of-experts layers run each expert's GEMMs over the rows routed to it as they
    /// come (the fast path). When false, on fixed row blocks: a fixed-shape pass (verify,
    /// isolated prefill, scoring) must not let how its other rows were routed change a
    /// row's bits where GEMM bits depend on the row count (`model::moe`).
    pub fast_experts: bool,
    /// The recurrent state each sequence's rows continue, by sequence index (models with
    /// linear-attention layers; `None`: padding).
    pub states: Vec<Option<StateRef>>,
}

/// One decoder layer's parameters. Its norms say where the residual stream is normed: the
/// Llama family norms each sublayer's input (`input_norm`, `mlp_norm`), OLMo 2 each
/// sublayer's output before it is added (`attn_out_norm`, `mlp_out_norm`), Gemma both
/// ([`crate::config::Architecture::sublayer_norms`]).
/// Every norm weight is held as the kernels multiply by it (Gemma's `1 + w`,
/// `loader::offset_norm`). A Nemotron-H layer holds one sublayer, a mixer or an MLP: the
/// other is `None`, with its norms.
#[derive(Debug)]
pub(super) struct Layer {
    pub(super) input_norm: Option<Tensor>,
    pub(super) mixer: Option<Mixer>,
    pub(super) attn_out_norm: Option<Tensor>,
    pub(super) mlp_norm: Option<Tensor>,
    pub(super) mlp_out_norm: Option<Tensor>,
    pub(super) mlp: Option<Mlp>,
}

/// What mixes a layer's tokens: attention, LFM2's short convolution, Qwen3-Next's gated
/// DeltaNet or Granite 4.0-H's Mamba2.
#[derive(Debug)]
pub(super) enum Mixer {
    Attention(Box<Attention>),
    ShortConv(Box<ShortConv>),
    GatedDeltaNet(Box<GatedDeltaNet>),
    Mamba2(Box<Mamba2Mixer>),
}

/// A layer's attention parameters.
#[derive(Debug)]
pub(super) struct Attention {
    pub(super) qkv: QkvSource,
    pub(super) o: Linear,
    /// Per head (`[head_dim]`), or over the whole projection (OLMo 2: `[heads × head_dim]`).
    pub(super) q_norm: Option<Tensor>,
    pub(super) k_norm: Option<Tensor>,
    /// gpt-oss's per-head sink logits, on the host (the CPU attention kernel reads them).
    pub(super) sinks: Option<Arc<[f32]>>,
    /// `q_proj` makes each head's query and then its output gate (Qwen3.5).
    pub(super) output_gate: bool,
}

/// Where a layer's queries, keys and values come from.
#[derive(Debug)]
pub(super) enum QkvSource {
    /// q, k, v projections (stacked on a GPU unless q/k are normed before rope).
    Heads(Projection),
    /// DeepSeek's latent attention, its keys and values expanded per head.
    Latent(Box<LatentAttention>),
}

/// A decoder layer's MLP.
#[derive(Debug)]
pub(super) enum Mlp {
    Dense {
        /// gate, up (stacked on a GPU).
        gate_up: Projection,
        down: Linear,
    },
    /// A mixture of experts (`model::moe`).
    Sparse(Box<SparseMlp>),
    /// An ungated MLP, `down(act(up(x)))`: Apertus's xIELU, Arcee's squared ReLU.
    Ungated {
        up: Linear,
        down: Linear,
        act: UngatedAct,
    },
}

/// An ungated MLP's activation, with its parameters.
#[derive(Debug)]
pub(super) enum UngatedAct {
    Xielu(XieluParams),
    Relu2,
}

/// A loaded decoder.
#[derive(Debug)]
pub struct Model {
    pub(super) cfg: ModelConfig,
    pub(super) embed: Tensor,
    pub(super) layers: Vec<Layer>,
    pub(super) norm: Tensor,
    pub(super) lm_head: LinearWeight,
    /// What the embeddings are multiplied by (Granite's multiplier, Gemma's √hidden), a scalar
    /// in the activations' dtype.
    embed_scale: Option<Tensor>,
    /// `[max_positions, head_dim/2]` tables, indexed by absolute position.
    cos: Tensor,
    sin: Tensor,
    /// The sliding-window layers' tables where their rope differs (OLMo 3).
    sliding_rope: Option<(Tensor, Tensor)>,
    device: Device,
    /// Weights (f32 or bf16 on the CPU; f32, bf16 or f16 on a GPU).
    dtype: DType,
    /// The CPU GEMMs' reduction-order promise.
    kernel_profile: KernelProfile,
    /// What the linear layers multiply by: `F32`, or a bf16-activation mode (`Bf16`,
    /// `Bf16Amx`: bf16 × bf16, `ops::gemm_abf16`).
    act: ActivationDtype,
    /// Activations, norm weights and biases: f32 on the CPU (its bf16 GEMM reads bf16 weights
    /// and accumulates in f32), `dtype` on a GPU.
    act_dtype: DType,
    /// Content hash of every parameter's engine-side (f32) values, by HF name: the
    /// fingerprint follows the weights through updates, and restoring old weights restores it.
    pub(super) param_hashes: ParamHashes,
}

impl Model {
    /// Loads the weights of a Hugging Face model directory whose config is `cfg`, in `dtype`.
    pub fn load(dir: &Path, cfg: ModelConfig, device: &Device, dtype: DType) -> Result<Self> {
        Self::load_with(dir, cfg, device, dtype, ActivationDtype::F32)
    }

    /// [`Self::load`]; `act`: what the linear layers multiply by (`Bf16`/`Bf16Amx`, CPU with
    /// bf16 weights: they round their inputs to bf16 and multiply bf16 by bf16,
    /// `ops::gemm_abf16`; `Auto` is `F32`).
    pub fn load_with(
        dir: &Path,
        cfg: ModelConfig,
        device: &Device,
        dtype: DType,
        act: ActivationDtype,
    ) -> Result<Self> {
        let bf16_act = act.is_bf16();
        if bf16_act && !(device.is_cpu() && dtype == DType::BF16) {
            return Err(DetspecError::param(
                "activation_dtype",
                "\"bfloat16\" runs on the CPU with bf16 weights",
            ));
        }
        let ck = Checkpoint::open_for(dir, &cfg)?;
        let act_dtype = if device.is_cpu() { DType::F32 } else { dtype };
        let ld = WeightLoader::new(&ck, device, dtype, act_dtype, act, cfg.fp8_weights);
        let (h, kvh, d) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let (hs, is) = (cfg.hidden_size, cfg.intermediate_size);
        let embed = ld.load_matrix("model.embed_tokens.weight", &[cfg.vocab_size, hs])?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        // A GPU stacks the projections that share an input (`Projection`); q and k stay apart
        // where they are normed before rope (Qwen3), or rotated in neighbour pairs (GLM:
        // `rope_qkv` pairs halves).
        let stack = !device.is_cpu();
        let stack_qkv = stack && !cfg.qk_norm && !cfg.architecture.rope_interleaved();
        let (q_norm_name, k_norm_name, _) = cfg.architecture.qk_norms();
        // Gemma's norms scale by `1 + w`.
        let norm_offset = cfg.architecture.norm_weight_offset();
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let attn = |name: &str| format!("{p}.self_attn.{name}");
            let mlp = |name: &str| format!("{p}.mlp.{name}");
            let qk_norm = |name: &str, heads: usize| {
                let width = if cfg.architecture.norms_whole_qk() {
                    heads * d
                } else {
                    d
                };
                let name = format!("{p}.self_attn.{name}.weight");
                cfg.qk_norm
                    .then(|| ld.norm(&name, &[width], norm_offset))
                    .transpose()
            };
            let (has_mixer, has_mlp) = (cfg.has_mixer(i), cfg.has_mlp(i));
            let [input_norm, attn_out_norm, mlp_norm, mlp_out_norm] =
                cfg.layer_norms(i).map(|name| {
                    name.map(|n| ld.norm(&format!("{p}.{n}.weight"), &[hs], norm_offset))
                        .transpose()
                });
            let widths = cfg.qkv_widths();
            let qkv = [
                (attn("q_proj"), widths[0]),
                (attn("k_proj"), widths[1]),
                (attn("v_proj"), widths[2]),
            ];
            let fused = cfg.architecture.fused();
            let mlp = match &cfg.moe {
                _ if !has_mlp => None,
                Some(moe) if moe.is_sparse(i) => {
                    Some(Mlp::Sparse(Box::new(SparseMlp::load(&ld, &cfg, moe, i)?)))
                }
                _ if let Some(kind) = cfg.architecture.ungated_mlp() => Some(Mlp::Ungated {
                    up: ld.linear(&mlp("up_proj"), hs, is, cfg.mlp_bias)?,
                    down: ld.linear(&mlp("down_proj"), is, hs, cfg.mlp_bias)?,
                    act: match kind {
                        UngatedMlp::Xielu => {
                            UngatedAct::Xielu(XieluParams::load(&ld, &mlp("act_fn"))?)
                        }
                        UngatedMlp::Relu2 => UngatedAct::Relu2,
                    },
                }),
                _ if fused.gate_up => Some(Mlp::Dense {
                    gate_up: ld.fused_projection(
                        &format!("{p}.{}", fused.gate_up_module()),
                        &[is, is],
                        hs,
                        stack,
                    )?,
                    down: ld.linear(&format!("{p}.{}", fused.down_module()), is, hs, false)?,
                }),
                _ => {
                    let module = |m: &str| format!("{p}.{m}");
                    let [gate, up] = fused.gate_and_up_modules().map(module);
                    Some(Mlp::Dense {
                        gate_up: ld.projection(&[(gate, is), (up, is)], hs, cfg.mlp_bias, stack)?,
                        down: ld.linear(&module(fused.down_module()), is, hs, cfg.mlp_bias)?,
                    })
                }
            };

            // o_proj reads every head's value.
            let o_in = cfg.mla.as_ref().map_or(h * d, |m| h * m.v_head_dim);
            let mixer = match (&cfg.short_conv, &cfg.linear_attention, &cfg.mamba) {
                _ if !has_mixer => None,
                (Some(conv), ..) if conv.is_conv(i) => Some(Mixer::ShortConv(Box::new(
                    ShortConv::load(&ld, &cfg, conv, &p)?,
                ))),
                (_, Some(la), _) if la.is_linear(i) => Some(Mixer::GatedDeltaNet(Box::new(
                    GatedDeltaNet::load(&ld, &cfg, la, &p)?,
                ))),
                (.., Some(m)) if m.is_mamba(i) => Some(Mixer::Mamba2(Box::new(Mamba2Mixer::load(
                    &ld, &cfg, m, &p,
                )?))),
                _ => Some(Mixer::Attention(Box::new(Attention {
                    qkv: match &cfg.mla {
                        Some(m) => {
                            QkvSource::Latent(Box::new(LatentAttention::load(&ld, &cfg, m, i)?))
                        }
                        None if fused.qkv => QkvSource::Heads(ld.fused_projection(
                            &attn("qkv_proj"),
                            &widths,
                            hs,
                            stack,
                        )?),
                        None => {
                            QkvSource::Heads(ld.projection(&qkv, hs, cfg.qkv_bias, stack_qkv)?)
                        }
                    },
                    o: ld.linear(
                        &format!("{p}.{}", cfg.architecture.o_proj_module()),
                        o_in,
                        hs,
                        cfg.o_bias,
                    )?,
                    q_norm: qk_norm(q_norm_name, h)?,
                    k_norm: qk_norm(k_norm_name, kvh)?,
                    sinks: cfg
                        .architecture
                        .has_attention_sinks()
                        .then(|| host_vector(&ld.load(&attn("sinks"), &[h])?))
                        .transpose()?,
                    output_gate: cfg.architecture.attention_output_gate(),
                }))),
            };
            layers.push(Layer {
                input_norm: input_norm?,
                mixer,
                attn_out_norm: attn_out_norm?,
                mlp_norm: mlp_norm?,
                mlp_out_norm: mlp_out_norm?,
                mlp,
            });
        }
        let norm = ld.norm(cfg.architecture.final_norm(), &[hs], norm_offset)?;
        let embed_scale = match cfg.granite {
            Some(g) => Some(Tensor::new(g.embedding as f32, device)?),
            // transformers rounds Gemma's √hidden to the weights' dtype first.
            None if cfg.architecture.is_gemma() => {
                let s = Tensor::new((hs as f32).sqrt(), device)?;
                Some(s.to_dtype(dtype)?)
            }
            None => None,
        }
        .map(|s| s.to_dtype(act_dtype))
        .transpose()?;
        let lm_head = if cfg.tie_word_embeddings {
            LinearWeight::new(&embed, bf16_act)?
        } else {
            let head = &cfg.head;
            ld.load_linear(head.weight_name(), head.rows(cfg.vocab_size), hs)?
        };
        let (cos, sin) = rope_tables(&cfg.rope, &cfg, device)?;
        let sliding_rope = match &cfg.rope_sliding {
            Some(rope) => Some(rope_tables(rope, &cfg, device)?),
            None => None,
        };
        Ok(Self {
            param_hashes: ld.into_hashes(),
            lm_head,
            cfg,
            embed,
            embed_scale,
            layers,
            norm,
            cos,
            sin,
            sliding_rope,
            device: device.clone(),
            dtype,
            kernel_profile: KernelProfile::Invariant,
            act: if bf16_act { act } else { ActivationDtype::F32 },
            act_dtype,
        })
    }

    /// The model with its CPU GEMMs run under `profile`.
    pub fn with_kernel_profile(mut self, profile: KernelProfile) -> Self {
        self.kernel_profile = profile;
        self
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The weights' dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The activations' dtype (f32 on the CPU whatever the weights').
    pub fn act_dtype(&self) -> DType {
        self.act_dtype
    }

    /// Whether the linear layers run in the bf16-activation mode.
    pub fn bf16_activations(&self) -> bool {
        self.act != ActivationDtype::F32
    }

    /// Hash of every parameter's values as the engine holds them (f32), by name.
    pub fn weights_hash(&self) -> u64 {
        self.param_hashes.combined()
    }

    fn gemm_options(&self, batch: &ForwardBatch) -> GemmOptions {
        GemmOptions {
            profile: self.kernel_profile,
            invariant: batch.invariant_gemm,
            amx: self.act == ActivationDtype::Bf16Amx,
        }
    }

    /// Runs the batch, writing its K/V into `kv`, and returns logits `[logit_rows, vocab]`.
    pub fn forward(&self, batch: &ForwardBatch, kv: &KvPool) -> Result<Tensor> {
        let x = self.final_hidden(batch, kv)?;
        if batch.logit_rows.is_empty() {
            return Ok(no_rows(self.cfg.vocab_size)?);
        }
        let logits = self.lm_head.matmul(&x, self.gemm_options(batch))?;
        let logits = match self.cfg.granite {
            // A division, as transformers does it (not a product with the reciprocal).
            Some(g) => logits.broadcast_div(&scalar(g.logits, &logits)?)?,
            None => logits,
        };
        Ok(match self.cfg.final_logit_softcapping {
            Some(cap) => ops::softcap(&logits, cap as f32)?,
            None => logits,
        })
    }

    /// Runs the batch, writing its K/V into `kv`, and returns the last layer's hidden states
    /// after the final norm (what the LM head reads; transformers' `last_hidden_state`),
    /// `[logit_rows, hidden]`.
    pub fn final_hidden(&self, batch: &ForwardBatch, kv: &KvPool) -> Result<Tensor> {
        let n = batch.tokens.len();
        if n == 0 || batch.slots.len() != n || batch.attention.positions.len() != n {
            return Err(DetspecError::InvalidRequest {
                request_id: None,
                message: format!(
                    "malformed batch: {n} tokens, {} slots, {} positions",
                    batch.slots.len(),
                    batch.attention.positions.len()
                ),
            });
        }
        let cfg = &self.cfg;
        let vocab = cfg.vocab_size as u32;
        if let Some(&bad) = batch.tokens.iter().find(|&&t| t >= vocab) {
            return Err(DetspecError::InvalidRequest {
                request_id: None,
                message: format!("token id {bad} is outside the vocabulary (size {vocab})"),
            });
        }
        let max_pos = self.cos.dim(0)? as u32;
        if let Some(&bad) = batch.attention.positions.iter().find(|&&p| p >= max_pos) {
            return Err(DetspecError::InvalidRequest {
                request_id: None,
                message: format!("position {bad} is beyond the model's context ({max_pos})"),
            });
        }
        let dev = &self.device;
        let (h, kvh, d) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let ids = Tensor::from_slice(&batch.tokens, n, dev)?;
        let pos = Tensor::from_slice(&batch.attention.positions, n, dev)?;
        let rope_rows = |(cos, sin): (&Tensor, &Tensor)| -> candle_core::Result<(Tensor, Tensor)> {
            Ok((cos.index_select(&pos, 0)?, sin.index_select(&pos, 0)?))
        };
        let full_rope = rope_rows((&self.cos, &self.sin))?;
        let sliding_rope = match &self.sliding_rope {
            Some((cos, sin)) => Some(rope_rows((cos, sin))?),
            None => None,
        };
        // A layer without rope (SmolLM3) rotates by nothing: cos 1, sin 0 leave q and k as
        // they are, and the rope ops (the stacked projection's fused one on a GPU) still run.
        let no_rope = match &cfg.rope_layers {
            Some(_) => {
                let (rows, dtype) = (full_rope.0.dims(), full_rope.0.dtype());
                Some((
                    Tensor::ones(rows, dtype, dev)?,
                    Tensor::zeros(rows, dtype, dev)?,
                ))
            }
            None => None,
        };
        let slots = Arc::new(batch.slots.clone());
        let mut attention = batch.attention.clone();
        attention.softcap = cfg.attn_logit_softcapping.map(|c| c as f32);
        // Where only some layers slide (OLMo 3, Gemma), the others attend to every key.
        let full_meta = if cfg.sliding_layers.is_some() && attention.sliding_window.is_some() {
            let mut m = attention.clone();
            m.sliding_window = None;
            Some(Arc::new(m))
        } else {
            None
        };
        let sliding_meta = Arc::new(attention);
        let full_meta = full_meta.unwrap_or_else(|| sliding_meta.clone());
        let scale = cfg.attention_scale();
        let residual_scale = |y: Tensor| match cfg.granite {
            Some(g) => y.broadcast_mul(&scalar(g.residual, &y)?),
            None => Ok(y),
        };
        let eps = cfg.rms_norm_eps;

        let inv = self.gemm_options(batch);
        let whole_qk_norm = cfg.architecture.norms_whole_qk();
        let (_, _, qk_norm_after_rope) = cfg.architecture.qk_norms();
        let interleaved = cfg.architecture.rope_interleaved();
        // Ministral 3's queries scaled by position, `[rows, 1, 1]`: in f32 as transformers
        // computes the scale, then in the activations' dtype.
        let query_scale = match cfg.query_scale_beta {
            Some((beta, original)) => {
                let s: Vec<f32> = batch
                    .attention
                    .positions
                    .iter()
                    .map(|&p| {
                        let k = (p as f32 / original as f32).floor();
                        1.0 + beta as f32 * libm::logf(1.0 + k)
                    })
                    .collect();
                // Within the original context every scale is 1: nothing to multiply.
                match s.iter().all(|&x| x == 1.0) {
                    true => None,
                    false => Some(Tensor::from_vec(s, (n, 1, 1), dev)?.to_dtype(self.act_dtype)?),
                }
            }
            None => None,
        };
        let lora = LoraRows::of(&batch.attention.row_seq, &batch.adapters, dev)?;
        // Each linear layer's LoRA target.
        let [t_q, t_k, t_v, t_o, t_gate, t_up, t_down] = [
            LoraTarget::Q,
            LoraTarget::K,
            LoraTarget::V,
            LoraTarget::O,
            LoraTarget::Gate,
            LoraTarget::Up,
            LoraTarget::Down,
        ]
        .map(|t| [t]);
        // The residual stream `x` and `hn`, what the next sublayer reads (its norm of `x`, or
        // `x` where the layout norms sublayer outputs instead): each residual add runs fused
        // with the norm after it (the next layer's input norm, the final norm after the last).
        let mut x = self.embed.index_select(&ids, 0)?.to_dtype(self.act_dtype)?;
        if let Some(s) = &self.embed_scale {
            x = x.broadcast_mul(s)?;
        }
        // The norm of layer `li`'s first sublayer's input (the final norm after the last).
        let input_norm = |li: usize| match self.layers.get(li) {
            None => Some(&self.norm),
            Some(l) if l.mixer.is_some() => l.input_norm.as_ref(),
            Some(l) => l.mlp_norm.as_ref(),
        };
        let mut hn = match input_norm(0) {
            Some(w) => ops::rms_norm(&x, w, eps)?,
            None => x.clone(),
        };
        // `x + y`, and what the next sublayer reads of it.
        let add_then_norm = |x: &Tensor, y: &Tensor, norm: Option<&Tensor>| match norm {
            Some(w) => ops::add_rms_norm(x, y, w, eps),
            None => ops::add(x, y).map(|s| (s.clone(), s)),
        };
        let out_norm = |y: Tensor, norm: &Option<Tensor>| match norm {
            Some(w) => ops::rms_norm(&y, w, eps),
            None => Ok(y),
        };
        for (li, layer) in self.layers.iter().enumerate() {
            let cache = kv.layer(li).ok_or_else(|| {
                DetspecError::param("num_layers", format!("KV pool has no layer {li}"))
            })?;
            let slides = cfg.layer_slides(li);
            let (cos, sin) = match (&no_rope, &sliding_rope) {
                (Some(identity), _) if !cfg.layer_has_rope(li) => identity,
                (_, Some(rope)) if slides => rope,
                _ => &full_rope,
            };
            let meta = if slides { &sliding_meta } else { &full_meta };
            // Linear layers' outputs of one input with the rows' adapters' deltas added.
            let with_lora = |x: &Tensor, outs: LoraOutputs<'_>| match &lora {
                Some(l) => l.add(x, li, outs),
                None => Ok(outs.into_iter().map(|(y, _)| y).collect()),
            };
            // One linear layer's output with the rows' adapters' deltas added.
            let one = |x: &Tensor, y: Tensor, t: &[LoraTarget]| {
                with_lora(x, vec![(y, t)])?
                    .pop()
                    .ok_or_else(|| candle_core::Error::Msg("LoRA returned no output".into()))
            };
            let o = match (&layer.mixer, cache) {
                (None, LayerCache::Stateless) => None,
                (Some(Mixer::ShortConv(conv)), LayerCache::Rows(rows)) => {
                    Some(conv.forward(&hn, rows, slots.clone(), &full_meta, inv)?)
                }
                (Some(Mixer::GatedDeltaNet(net)), LayerCache::Recurrent) => {
                    Some(net.forward(&hn, &full_meta, &batch.states, (kv.states(), li), inv)?)
                }
                (Some(Mixer::Mamba2(mixer)), LayerCache::Recurrent) => {
                    Some(mixer.forward(&hn, &full_meta, &batch.states, (kv.states(), li), inv)?)
                }
                (
                    Some(Mixer::Attention(attn)),
                    LayerCache::Attention {
                        k: k_cache,
                        v: v_cache,
                    },
                ) => {
                    // q, with k and v written into the layer's cache at the rows' slots, and
                    // the output gate where `q_proj` makes one.
                    let (q, gate) = match &attn.qkv {
                        QkvSource::Latent(latent) => (
                            latent.q_into_cache(
                                &hn,
                                inv,
                                cos,
                                sin,
                                k_cache,
                                v_cache,
                                slots.clone(),
                            )?,
                            None,
                        ),
                        QkvSource::Heads(Projection::Stacked { linear, .. }) => {
                            let targets = [t_q[0], t_k[0], t_v[0]];
                            let y = one(&hn, linear.apply(&hn, inv)?, &targets)?;
                            let q = ops::rope_qkv_into_cache(
                                &y,
                                cos,
                                sin,
                                h,
                                kvh,
                                k_cache,
                                v_cache,
                                slots.clone(),
                            )?;
                            (q, None)
                        }
                        QkvSource::Heads(Projection::Apart(qkv)) => {
                            let [q, k, v] = qkv.as_slice() else {
                                return Err(DetspecError::param(
                                    "weights",
                                    "q/k/v are three layers",
                                ));
                            };
                            let outs = vec![
                                (q.apply(&hn, inv)?, &t_q[..]),
                                (k.apply(&hn, inv)?, &t_k[..]),
                                (v.apply(&hn, inv)?, &t_v[..]),
                            ];
                            let [q, k, v]: [Tensor; 3] =
                                with_lora(&hn, outs)?.try_into().map_err(|_| {
                                    DetspecError::param("weights", "q/k/v are three layers")
                                })?;
                            // Each head's query, then its gate.
                            let (q, gate) = match attn.output_gate {
                                true => {
                                    let qg = q.reshape((n, h, 2 * d))?;
                                    let gate = qg.narrow(2, d, d)?.contiguous()?;
                                    (
                                        qg.narrow(2, 0, d)?.contiguous()?.reshape((n, h * d))?,
                                        Some(gate.reshape((n, h * d))?),
                                    )
                                }
                                false => (q, None),
                            };
                            // q/k norms apply over the whole projection (OLMo 2) before the split into
                            // heads, or to each head after it (Qwen3).
                            let norms = attn.q_norm.as_ref().zip(attn.k_norm.as_ref());
                            let (q, k) = match norms {
                                Some((qn, kn)) if whole_qk_norm => {
                                    (ops::rms_norm(&q, qn, eps)?, ops::rms_norm(&k, kn, eps)?)
                                }
                                _ => (q, k),
                            };
                            let mut q = q.reshape((n, h, d))?;
                            let mut k = k.reshape((n, kvh, d))?;
                            let v = v.reshape((n, kvh, d))?;
                            let head_norms = norms.filter(|_| !whole_qk_norm);
                            if let Some((qn, kn)) = head_norms.filter(|_| !qk_norm_after_rope) {
                                q = ops::rms_norm(&q, qn, eps)?;
                                k = ops::rms_norm(&k, kn, eps)?;
                            }
                            let rope = |x: &Tensor| match interleaved {
                                true => ops::apply_rope_interleaved(x, cos, sin),
                                false => ops::apply_rope(x, cos, sin),
                            };
                            let (mut q, mut k) = (rope(&q)?, rope(&k)?);
                            // HunYuan norms the rotated heads.
                            if let Some((qn, kn)) = head_norms.filter(|_| qk_norm_after_rope) {
                                q = ops::rms_norm(&q, qn, eps)?;
                                k = ops::rms_norm(&k, kn, eps)?;
                            }
                            ops::write_k(k_cache, &k, slots.clone())?;
                            ops::write_kv(v_cache, &v, slots.clone())?;
                            (q, gate)
                        }
                    };
                    let q = match &query_scale {
                        Some(s) => q.broadcast_mul(s)?,
                        None => q,
                    };
                    let heads = match &attn.sinks {
                        Some(sinks) => ops::paged_attention_with_sinks(
                            &q,
                            k_cache,
                            v_cache,
                            meta.clone(),
                            scale,
                            sinks.clone(),
                            ops::CpuIsa::detect(),
                        )?,
                        None => ops::paged_attention(&q, k_cache, v_cache, meta.clone(), scale)?,
                    };
                    let heads = match &attn.qkv {
                        QkvSource::Latent(l) => l.values(&heads)?,
                        QkvSource::Heads(_) => heads.reshape((n, h * d))?,
                    };
                    let heads = match &gate {
                        Some(g) => ops::sigmoid_gate(&heads, g)?,
                        None => heads,
                    };
                    Some(one(&heads, attn.o.apply(&heads, inv)?, &t_o)?)
                }
                _ => {
                    return Err(DetspecError::param(
                        "num_layers",
                        format!("layer {li}'s cache does not match its kind"),
                    ))
                }
            };
            if let Some(o) = o {
                let o = residual_scale(out_norm(o, &layer.attn_out_norm)?)?;
                let next = match layer.mlp {
                    Some(_) => layer.mlp_norm.as_ref(),
                    None => input_norm(li + 1),
                };
                (x, hn) = add_then_norm(&x, &o, next)?;
            }
            let Some(mlp) = &layer.mlp else { continue };
            let down = match mlp {
                Mlp::Sparse(moe) => moe.forward(&hn, inv, !batch.fast_experts)?,
                // (adapters of its up projection are refused at load)
                Mlp::Ungated { up, down, act } => {
                    let u = up.apply(&hn, inv)?;
                    // relu(u)² per element: the same bits in any batch.
                    let act = match act {
                        UngatedAct::Xielu(p) => ops::xielu(&u, p.act())?,
                        UngatedAct::Relu2 => u.relu()?.sqr()?,
                    };
                    one(&act, down.apply(&act, inv)?, &t_down)?
                }
                Mlp::Dense { gate_up, down } => {
                    let act = match gate_up {
                        Projection::Stacked { linear, .. } => {
                            let targets = [t_gate[0], t_up[0]];
                            let gu = one(&hn, linear.apply(&hn, inv)?, &targets)?;
                            ops::gated_halves(&gu, cfg.hidden_act)?
                        }
                        Projection::Apart(gate_up) => {
                            let [gate, up] = gate_up.as_slice() else {
                                return Err(DetspecError::param(
                                    "weights",
                                    "gate/up are two layers",
                                ));
                            };
                            let outs = vec![
                                (gate.apply(&hn, inv)?, &t_gate[..]),
                                (up.apply(&hn, inv)?, &t_up[..]),
                            ];
                            let [gate, up]: [Tensor; 2] =
                                with_lora(&hn, outs)?.try_into().map_err(|_| {
                                    DetspecError::param("weights", "gate/up are two layers")
                                })?;
                            ops::gated(&gate, &up, cfg.hidden_act)?
                        }
                    };
                    one(&act, down.apply(&act, inv)?, &t_down)?
                }
            };
            let down = residual_scale(out_norm(down, &layer.mlp_out_norm)?)?;
            (x, hn) = add_then_norm(&x, &down, input_norm(li + 1))?;
        }
        if batch.logit_rows.is_empty() {
            // A chunk that samples nothing ran for its KV writes. A GPU cannot launch over zero
            // rows (a grid of 0 blocks is an invalid launch), so no op runs on the empty set.
            return Ok(no_rows(cfg.hidden_size)?);
        }
        let rows = Tensor::from_slice(&batch.logit_rows, batch.logit_rows.len(), dev)?;
        Ok(hn.index_select(&rows, 0)?)
    }
}

/// `v` as a scalar of `like`'s dtype on its device, to broadcast over it.
fn scalar(v: f64, like: &Tensor) -> candle_core::Result<Tensor> {
    Tensor::new(v as f32, like.device())?.to_dtype(like.dtype())
}

/// `[0, width]` f32 rows on the host: the result of a forward with no logit rows, on any device.
fn no_rows(width: usize) -> candle_core::Result<Tensor> {
    Tensor::zeros((0, width), DType::F32, &Device::Cpu)
}

/// cos/sin of `position * inv_freq` for every position up to the model's context, in f32 as
/// transformers computes them (times YaRN's or LongRoPE's attention factor, when it has one),
/// for `rope` (the model's, or its sliding-window layers'): `rotary_dim / 2` columns, one per
/// rotating pair.
fn rope_tables(rope: &RopeConfig, cfg: &ModelConfig, dev: &Device) -> Result<(Tensor, Tensor)> {
    let inv = rope.inv_freq(cfg.rotary_dim);
    let scale = rope.attention_factor();
    let n = cfg.max_context();
    let half = inv.len();
    let mut cos = Vec::with_capacity(n * half);
    let mut sin = Vec::with_capacity(n * half);
    for p in 0..n {
        for &f in &inv {
            let a = p as f32 * f;
            // `x * 1.0` is `x`: models without the factor keep their tables' bits.
            cos.push(libm::cosf(a) * scale);
            sin.push(libm::sinf(a) * scale);
        }
    }
    Ok((
        Tensor::from_vec(cos, (n, half), dev)?,
        Tensor::from_vec(sin, (n, half), dev)?,
    ))
}
