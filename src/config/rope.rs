//! Rotary embedding settings of a checkpoint's `config.json`, and the frequencies and the
//! tables' scale derived from them. Both the classic `rope_theta`/`rope_scaling` keys and the
//! newer `rope_parameters` form are accepted, because checkpoints saved by different
//! `transformers` versions use either.

use std::path::Path;

use serde::Deserialize;

use crate::error::{DetspecError, Result};

/// How rotary frequencies are derived from the base frequencies.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (HF "linear").
    Linear {
        factor: f64,
    },
    /// Llama-3's frequency-dependent scaling (HF "llama3").
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// YaRN (HF "yarn"; Qwen2.5's and Qwen3's long-context setting): frequencies blended
    /// between interpolated and original by a ramp over the dimensions, and cos/sin scaled by
    /// `attention_factor`. The model serves `original_max_position_embeddings × factor`
    /// tokens, as vLLM does.
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: f64,
        truncate: bool,
    },
    /// LongRoPE (HF "longrope", earlier "su"; Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini): each
    /// frequency divided by its own rescale factor, from one set for contexts up to
    /// `original_max_position_embeddings` and one beyond, and cos/sin scaled by
    /// `attention_factor`. Which set applies is the engine's, not a sequence's: `long` when
    /// the engine serves more than the original context ([`RopeConfig::serve_up_to`]; vLLM's
    /// rule), so no sequence's cached keys change factors as it grows.
    LongRope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        original_max_position_embeddings: f64,
        attention_factor: f64,
        long: bool,
    },
}

/// Rotary embedding configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub scaling: RopeScaling,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct RawRope {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    rope_theta: Option<f64>,
    factor: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position_embeddings: Option<f64>,
    beta_fast: Option<f64>,
    beta_slow: Option<f64>,
    mscale: Option<f64>,
    mscale_all_dim: Option<f64>,
    attention_factor: Option<f64>,
    truncate: Option<bool>,
    short_factor: Option<Vec<f64>>,
    long_factor: Option<Vec<f64>>,
    /// Ministral 3's query scaling past the original context (read by `ModelConfig`).
    pub(super) llama_4_scaling_beta: Option<f64>,
    partial_rotary_factor: Option<f64>,
    /// HunYuan's NTK stretch of the base ([`RopeDefaults::ntk_alpha`]).
    alpha: Option<f64>,
    /// transformers' `rope_parameters` nested by layer kind (OLMo 3): the settings of the
    /// full-attention layers and of the sliding-window ones.
    full_attention: Option<Box<RawRope>>,
    sliding_attention: Option<Box<RawRope>>,
}

/// The config's top-level keys a rope reading falls back on: `original_max_position_embeddings`
/// wins over the scaling's own (as transformers reads Phi-3's), and `max_position_embeddings`
/// is YaRN's original context when neither names one.
#[derive(Debug, Clone, Copy)]
pub(super) struct RopeDefaults {
    pub rope_theta: Option<f64>,
    /// The sliding-window layers' theta where their own settings name none (Gemma 3's
    /// `rope_local_base_freq`); `None`: `rope_theta`.
    pub sliding_rope_theta: Option<f64>,
    pub original_max_position_embeddings: Option<f64>,
    pub max_position_embeddings: usize,
    /// How many of each head's dimensions rotate ([`rotary_fraction`]); LongRoPE's factor
    /// sets hold one factor per pair of them.
    pub rotary_dim: usize,
    /// HunYuan's reading of `"dynamic"` rope with an `alpha`: a fixed NTK stretch of the base
    /// (`theta · alpha^(d / (d − 2))`), not length-dependent.
    pub ntk_alpha: bool,
}

/// The share of each head that rotates (`partial_rotary_factor`) and the field it was read
/// from, where a config names one: `rope_parameters`' (or its layer kinds'), else
/// `rope_scaling`'s, else the top level's (transformers' order).
pub(super) fn rotary_fraction(
    rope_parameters: Option<&RawRope>,
    rope_scaling: Option<&RawRope>,
    top_level: Option<f64>,
) -> Option<(f64, String)> {
    let inner = |p: &RawRope, field: &str| -> Option<(f64, String)> {
        let kinds = [
            (&p.full_attention, "full_attention"),
            (&p.sliding_attention, "sliding_attention"),
        ];
        p.partial_rotary_factor
            .map(|f| (f, format!("{field}.partial_rotary_factor")))
            .or_else(|| {
                kinds.into_iter().find_map(|(sub, kind)| {
                    let f = sub.as_ref()?.partial_rotary_factor?;
                    Some((f, format!("{field}.{kind}.partial_rotary_factor")))
                })
            })
    };
    rope_parameters
        .and_then(|p| inner(p, "rope_parameters"))
        .or_else(|| rope_scaling.and_then(|p| inner(p, "rope_scaling")))
        .or_else(|| top_level.map(|f| (f, "partial_rotary_factor".to_string())))
}

impl RopeConfig {
    /// Reads rope settings from `rope_parameters` (newer transformers; it wins) or from the
    /// classic `rope_theta` + `rope_scaling` keys: one setting for every layer, or where
    /// `rope_parameters` is nested by layer kind (OLMo 3), the full-attention layers' and the
    /// sliding-window layers' (when given).
    pub(super) fn parse_layers(
        rope_parameters: Option<&RawRope>,
        rope_scaling: Option<&RawRope>,
        top: &RopeDefaults,
        path: &Path,
    ) -> Result<(Self, Option<Self>)> {
        match (rope_parameters, rope_scaling) {
            (Some(p), _) if p.full_attention.is_some() || p.sliding_attention.is_some() => {
                let kind = |sub: &Option<Box<RawRope>>, name: &str, top: &RopeDefaults| {
                    let field = format!("rope_parameters.{name}");
                    Self::parse(sub.as_deref(), &field, top, path)
                };
                let full = kind(&p.full_attention, "full_attention", top)?;
                let sliding_top = RopeDefaults {
                    rope_theta: top.sliding_rope_theta.or(top.rope_theta),
                    ..*top
                };
                let sliding = match &p.sliding_attention {
                    Some(_) => Some(kind(
                        &p.sliding_attention,
                        "sliding_attention",
                        &sliding_top,
                    )?),
                    None => None,
                };
                Ok((full, sliding))
            }
            (Some(p), _) => Ok((Self::parse(Some(p), "rope_parameters", top, path)?, None)),
            (None, scaling) => Ok((Self::parse(scaling, "rope_scaling", top, path)?, None)),
        }
    }

    /// One rope setting from `params` (read as `params_field`), falling back on `top`.
    fn parse(
        params: Option<&RawRope>,
        params_field: &str,
        top: &RopeDefaults,
        path: &Path,
    ) -> Result<Self> {
        let RopeDefaults {
            rope_theta,
            sliding_rope_theta: _,
            original_max_position_embeddings,
            max_position_embeddings,
            rotary_dim,
            ntk_alpha,
        } = *top;
        let err = |field: &str, message: String| DetspecError::InvalidConfig {
            path: path.to_path_buf(),
            field: field.to_string(),
            message,
        };
        let theta = params
            .and_then(|p| p.rope_theta)
            .or(rope_theta)
            .unwrap_or(10_000.0);
        if theta.is_nan() || theta <= 0.0 {
            return Err(err("rope_theta", "must be > 0".into()));
        }
        let rope_type = params
            .and_then(|p| p.rope_type.as_deref().or(p.kind.as_deref()))
            .unwrap_or("default");
        let original = original_max_position_embeddings
            .or(params.and_then(|p| p.original_max_position_embeddings));
        let need = |key: &str, get: fn(&RawRope) -> Option<f64>| -> Result<f64> {
            params
                .and_then(get)
                .ok_or_else(|| err(&format!("{params_field}.{key}"), "missing".into()))
        };
        let alpha = params.and_then(|p| p.alpha).filter(|_| ntk_alpha);
        let (theta, rope_type) = match (rope_type, alpha) {
            ("dynamic", Some(a)) if a.is_finite() && a > 0.0 && rotary_dim > 2 => {
                let d = rotary_dim as f64;
                (theta * a.powf(d / (d - 2.0)), "default")
            }
            ("dynamic", Some(a)) => {
                return Err(err(
                    &format!("{params_field}.alpha"),
                    format!("{a}: must be > 0"),
                ))
            }
            _ => (theta, rope_type),
        };
        let scaling = match rope_type {
            // Qwen2.5-VL's multimodal rope ("mrope", with `mrope_section`) is the plain one on
            // text: its three position streams are then equal.
            "default" | "mrope" => RopeScaling::None,
            "linear" => RopeScaling::Linear {
                factor: need("factor", |p| p.factor)?,
            },
            "llama3" => RopeScaling::Llama3 {
                factor: need("factor", |p| p.factor)?,
                low_freq_factor: need("low_freq_factor", |p| p.low_freq_factor)?,
                high_freq_factor: need("high_freq_factor", |p| p.high_freq_factor)?,
                original_max_position_embeddings: original.ok_or_else(|| {
                    err(
                        &format!("{params_field}.original_max_position_embeddings"),
                        "missing".into(),
                    )
                })?,
            },
            "yarn" => Self::parse_yarn(
                params,
                params_field,
                original.unwrap_or(max_position_embeddings as f64),
                path,
            )?,
            // "su": Phi-3-mini-128k's first configs' name for it.
            "longrope" | "su" => Self::parse_longrope(
                params,
                params_field,
                original.unwrap_or(max_position_embeddings as f64),
                max_position_embeddings,
                rotary_dim,
                path,
            )?,
            other => {
                return Err(err(
                    &format!("{params_field}.rope_type"),
                    format!(
                        "unsupported rope type `{other}` (supported: default, linear, llama3, \
                         yarn, longrope)"
                    ),
                ))
            }
        };
        Ok(Self { theta, scaling })
    }

    /// YaRN's settings with transformers' defaults (`original`: the pre-scaling context, which
    /// falls back to `max_position_embeddings`): `beta_fast`/`beta_slow` 32/1, `truncate` true,
    /// and `attention_factor` to `0.1 ln(factor) + 1` (DeepSeek's `mscale`/`mscale_all_dim`
    /// ratio when both are given).
    fn parse_yarn(
        params: Option<&RawRope>,
        params_field: &str,
        original: f64,
        path: &Path,
    ) -> Result<RopeScaling> {
        let err = |key: &str, message: &str| DetspecError::InvalidConfig {
            path: path.to_path_buf(),
            field: format!("{params_field}.{key}"),
            message: message.to_string(),
        };
        let p = params.ok_or_else(|| err("factor", "missing"))?;
        let factor = p.factor.ok_or_else(|| err("factor", "missing"))?;
        if factor.is_nan() || factor < 1.0 {
            return Err(err("factor", "must be >= 1"));
        }
        if original.is_nan() || original < 1.0 {
            return Err(err("original_max_position_embeddings", "must be >= 1"));
        }
        let (beta_fast, beta_slow) = (p.beta_fast.unwrap_or(32.0), p.beta_slow.unwrap_or(1.0));
        if !(beta_slow > 0.0 && beta_fast >= beta_slow) {
            return Err(err("beta_fast", "needs beta_fast >= beta_slow > 0"));
        }
        let mscale = |m: f64| {
            if factor <= 1.0 {
                1.0
            } else {
                0.1 * m * factor.ln() + 1.0
            }
        };
        let attention_factor = match (p.attention_factor, p.mscale, p.mscale_all_dim) {
            (Some(a), _, _) => a,
            (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => mscale(m) / mscale(all),
            _ => mscale(1.0),
        };
        if attention_factor.is_nan() || attention_factor <= 0.0 {
            return Err(err("attention_factor", "must be > 0"));
        }
        Ok(RopeScaling::Yarn {
            factor,
            original_max_position_embeddings: original,
            beta_fast,
            beta_slow,
            attention_factor,
            truncate: p.truncate.unwrap_or(true),
        })
    }

    /// LongRoPE's settings as transformers reads them: both factor sets, one factor per pair
    /// of the `rotary_dim` rotating dimensions; `factor` where given, else
    /// `max_position_embeddings / original` (Phi-3's configs name none); `attention_factor`
    /// where given, else `√(1 + ln factor / ln original)` (1 for a factor of at most 1). The
    /// set starts as the one an engine serving `max_position_embeddings` uses.
    fn parse_longrope(
        params: Option<&RawRope>,
        params_field: &str,
        original: f64,
        max_position_embeddings: usize,
        rotary_dim: usize,
        path: &Path,
    ) -> Result<RopeScaling> {
        let err = |key: &str, message: String| DetspecError::InvalidConfig {
            path: path.to_path_buf(),
            field: format!("{params_field}.{key}"),
            message,
        };
        let p = params.ok_or_else(|| err("short_factor", "missing".into()))?;
        let factors = |key: &str, got: &Option<Vec<f64>>| -> Result<Vec<f64>> {
            let f = got.clone().ok_or_else(|| err(key, "missing".into()))?;
            if f.len() != rotary_dim / 2 {
                return Err(err(
                    key,
                    format!(
                        "has {} factors; the {rotary_dim} rotating dimensions of each head need \
                         one per pair, {}",
                        f.len(),
                        rotary_dim / 2
                    ),
                ));
            }
            if let Some(bad) = f.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
                return Err(err(key, format!("{bad}: every factor must be > 0")));
            }
            Ok(f)
        };
        let short_factor = factors("short_factor", &p.short_factor)?;
        let long_factor = factors("long_factor", &p.long_factor)?;
        if original.is_nan() || original < 2.0 {
            return Err(err(
                "original_max_position_embeddings",
                format!("{original}: must be >= 2"),
            ));
        }
        let factor = p
            .factor
            .unwrap_or(max_position_embeddings as f64 / original);
        let attention_factor = match p.attention_factor {
            Some(a) => a,
            None if factor <= 1.0 => 1.0,
            None => (1.0 + factor.ln() / original.ln()).sqrt(),
        };
        if !(attention_factor.is_finite() && attention_factor > 0.0) {
            return Err(err(
                "attention_factor",
                format!("{attention_factor}: must be > 0"),
            ));
        }
        Ok(RopeScaling::LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings: original,
            attention_factor,
            long: max_position_embeddings as f64 > original,
        })
    }

    /// Settles what depends on the longest sequence an engine serves, `max_model_len`:
    /// LongRoPE's long factors when it exceeds the original context, else the short ones.
    /// vLLM's rule; transformers instead switches a sequence's factors when it grows past
    /// the original context, leaving the keys already cached on the short ones. So with
    /// `max_model_len` at most the original context, outputs are transformers'; above it, a
    /// sequence longer than the original context is transformers', a shorter one is not.
    pub fn serve_up_to(&mut self, max_model_len: usize) {
        if let RopeScaling::LongRope {
            original_max_position_embeddings,
            long,
            ..
        } = &mut self.scaling
        {
            *long = max_model_len as f64 > *original_max_position_embeddings;
        }
    }

    /// The context the rope was trained for before scaling (YaRN's, llama3's, LongRoPE's
    /// `original_max_position_embeddings`); `None` for an unscaled rope.
    pub fn original_context(&self) -> Option<f64> {
        match &self.scaling {
            RopeScaling::Yarn {
                original_max_position_embeddings,
                ..
            }
            | RopeScaling::Llama3 {
                original_max_position_embeddings,
                ..
            }
            | RopeScaling::LongRope {
                original_max_position_embeddings,
                ..
            } => Some(*original_max_position_embeddings),
            RopeScaling::None | RopeScaling::Linear { .. } => None,
        }
    }

    /// The longest sequence (prompt + output) a model of `max_position_embeddings` serves:
    /// that, or with YaRN the original context times the factor (vLLM's rule: Qwen2.5's
    /// configs keep `max_position_embeddings` at the pre-YaRN 32,768 and scale it by 4).
    pub fn context(&self, max_position_embeddings: usize) -> usize {
        match self.scaling {
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                ..
            } => (original_max_position_embeddings * factor) as usize,
            _ => max_position_embeddings,
        }
    }

    /// The factor the rope tables' cos and sin are multiplied by (YaRN's and LongRoPE's
    /// attention scaling; 1 otherwise).
    pub fn attention_factor(&self) -> f32 {
        match self.scaling {
            RopeScaling::Yarn {
                attention_factor, ..
            }
            | RopeScaling::LongRope {
                attention_factor, ..
            } => attention_factor as f32,
            _ => 1.0,
        }
    }

    /// Rotary inverse frequencies (length rotary_dim/2: `rotary_dim` is the head's dimension,
    /// or the part of it that rotates), computed in f32 the way transformers does so logits
    /// match it closely.
    pub fn inv_freq(&self, rotary_dim: usize) -> Vec<f32> {
        let dim = rotary_dim;
        let base = self.theta as f32;
        let pos_freq = |i: usize| libm::powf(base, (2 * i) as f32 / dim as f32);
        let inv: Vec<f32> = (0..dim / 2).map(|i| 1.0 / pos_freq(i)).collect();
        match &self.scaling {
            RopeScaling::None => inv,
            RopeScaling::Linear { factor } => inv.iter().map(|x| x / *factor as f32).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old_ctx,
            } => {
                let (factor, lff, hff, old_ctx) = (
                    *factor as f32,
                    *low_freq_factor as f32,
                    *high_freq_factor as f32,
                    *old_ctx as f32,
                );
                let low_freq_wavelen = old_ctx / lff;
                let high_freq_wavelen = old_ctx / hff;
                inv.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        if wavelen < high_freq_wavelen {
                            f
                        } else if wavelen > low_freq_wavelen {
                            f / factor
                        } else {
                            let smooth = (old_ctx / wavelen - lff) / (hff - lff);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                // transformers' arithmetic: the correction range in f64, the ramp and the
                // blend in f32, each product and sum rounded on its own.
                let dim_f = dim as f64;
                let correction_dim = |rotations: f64| {
                    dim_f
                        * (*original_max_position_embeddings
                            / (rotations * 2.0 * std::f64::consts::PI))
                            .ln()
                        / (2.0 * self.theta.ln())
                };
                let (mut low, mut high) = (correction_dim(*beta_fast), correction_dim(*beta_slow));
                if *truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(dim_f - 1.0));
                if low == high {
                    high += 0.001;
                }
                let (low32, span32) = (low as f32, (high - low) as f32);
                let factor = *factor as f32;
                inv.iter()
                    .enumerate()
                    .map(|(i, &extrapolated)| {
                        let interpolated = 1.0 / (factor * pos_freq(i));
                        let ramp = ((i as f32 - low32) / span32).clamp(0.0, 1.0);
                        let extrapolation = 1.0 - ramp;
                        interpolated * (1.0 - extrapolation) + extrapolated * extrapolation
                    })
                    .collect()
            }
            RopeScaling::LongRope {
                short_factor,
                long_factor,
                long,
                ..
            } => {
                // transformers: the factors as an f32 tensor, `1 / (factor · base^(2i/dim))`.
                let factors = if *long { long_factor } else { short_factor };
                factors
                    .iter()
                    .enumerate()
                    .map(|(i, &f)| 1.0 / (f as f32 * pos_freq(i)))
                    .collect()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::RopeScaling;
    use crate::config::model_config::tests::{assert_refused, parse, BASE};

    #[test]
    fn classic_and_new_rope_keys_agree() {
        let classic = parse(&format!(
            r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "rope_theta": 500000.0,
            "rope_scaling": {{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}}}"#
        ))
        .unwrap();
        let new = parse(&format!(
            r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "rope_parameters": {{"rope_type": "llama3",
            "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}}}}"#
        ))
        .unwrap();
        assert_eq!(classic.rope, new.rope);
        assert_eq!(classic.num_key_value_heads, 4);
        assert_eq!(classic.head_dim, 16);
    }

    /// A Phi-3.5-mini / Phi-4-mini `rope_scaling` for heads whose `pairs` rotating pairs
    /// each get a short factor `1 + i/10` and a long one `2 + i`.
    fn longrope(kind: &str, pairs: usize) -> String {
        let list = |f: &dyn Fn(usize) -> f64| {
            let v: Vec<String> = (0..pairs).map(|i| format!("{:?}", f(i))).collect();
            v.join(", ")
        };
        format!(
            r#""rope_scaling": {{"type": "{kind}", "short_factor": [{}], "long_factor": [{}]}}"#,
            list(&|i| 1.0 + i as f64 / 10.0),
            list(&|i| 2.0 + i as f64)
        )
    }

    #[test]
    fn longrope_reads_both_factor_sets_and_the_engine_picks_one() {
        // Phi-4-mini's shape in small: three quarters of each 16-wide head rotate (6 pairs),
        // an original context of 4,096 stretched to 131,072.
        let mut c = parse(&format!(
            r#"{{"architectures": ["Phi3ForCausalLM"], {BASE}, "partial_rotary_factor": 0.75,
            "rope_theta": 10000.0, "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096, {}}}"#,
            longrope("longrope", 6)
        ))
        .unwrap();
        assert_eq!(c.rotary_dim, 12);
        let RopeScaling::LongRope {
            attention_factor,
            long,
            original_max_position_embeddings,
            ..
        } = c.rope.scaling.clone()
        else {
            panic!("not LongRoPE: {:?}", c.rope.scaling)
        };
        assert_eq!(original_max_position_embeddings, 4096.0);
        // transformers' default: √(1 + ln(131072/4096) / ln 4096).
        assert_eq!(attention_factor, (1.0 + 32f64.ln() / 4096f64.ln()).sqrt());
        assert_eq!(c.rope.attention_factor(), attention_factor as f32);
        assert_eq!(c.max_context(), 131_072);
        // An engine serving the whole context uses the long factors (vLLM's rule) ...
        assert!(long);
        let base = |i: usize| libm::powf(10000.0, (2 * i) as f32 / 12.0);
        let long_inv: Vec<f32> = (0..6).map(|i| 1.0 / ((2.0 + i as f32) * base(i))).collect();
        assert_eq!(c.rope.inv_freq(12), long_inv);
        // ... one serving at most the original context the short ones, as transformers does
        // for sequences that short.
        c.serve_up_to(4096);
        let short_inv: Vec<f32> = (0..6)
            .map(|i| 1.0 / ((1.0 + i as f64 / 10.0) as f32 * base(i)))
            .collect();
        assert_eq!(c.rope.inv_freq(12), short_inv);
        c.serve_up_to(4097);
        assert_eq!(c.rope.inv_freq(12), long_inv);

        // "su" is the same rope (Phi-3-mini-128k's first configs); a given attention factor
        // or factor wins over the default; whole heads need a factor per pair of all 16.
        let su = parse(&format!(
            r#"{{"architectures": ["Phi3ForCausalLM"], {BASE}, "max_position_embeddings": 512,
            "original_max_position_embeddings": 64, {}}}"#,
            longrope("su", 8)
        ))
        .unwrap();
        assert!(matches!(su.rope.scaling, RopeScaling::LongRope { .. }));
        let given = parse(&format!(
            r#"{{"architectures": ["Phi3ForCausalLM"], {BASE}, "max_position_embeddings": 512,
            "rope_parameters": {{"rope_type": "longrope", "rope_theta": 10000.0,
            "original_max_position_embeddings": 64, "factor": 4.0,
            "short_factor": [1, 1, 1, 1, 1, 1, 1, 1], "long_factor": [2, 2, 2, 2, 2, 2, 2, 2]}}}}"#
        ))
        .unwrap();
        assert_eq!(
            given.rope.attention_factor(),
            (1.0 + 4f64.ln() / 64f64.ln()).sqrt() as f32
        );
        assert_refused(
            "Phi3ForCausalLM",
            &[
                (&longrope("longrope", 6), "rope_scaling.short_factor"),
                (
                    r#""rope_scaling": {"type": "longrope", "short_factor": [1, 1, 1, 1, 1, 1, 1, 1]}"#,
                    "rope_scaling.long_factor",
                ),
                (
                    r#""rope_scaling": {"type": "longrope", "short_factor": [1, 1, 1, 1, 1, 1, 1, 0],
                    "long_factor": [1, 1, 1, 1, 1, 1, 1, 1]}"#,
                    "rope_scaling.short_factor",
                ),
            ],
        );
    }

    #[test]
    fn yarn_reads_both_forms_and_blends_the_frequencies() {
        // Qwen2.5's form: classic `rope_scaling` with `type`.
        let classic = parse(&format!(
            r#"{{"architectures": ["Qwen2ForCausalLM"], {BASE}, "head_dim": 64,
            "rope_theta": 1000000.0, "max_position_embeddings": 32768,
            "rope_scaling": {{"type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 32768}}}}"#
        ))
        .unwrap();
        let new = parse(&format!(
            r#"{{"architectures": ["Qwen2ForCausalLM"], {BASE}, "head_dim": 64,
            "max_position_embeddings": 32768, "rope_parameters": {{"rope_type": "yarn",
            "rope_theta": 1000000.0, "factor": 4.0, "beta_fast": 32, "beta_slow": 1}}}}"#
        ))
        .unwrap();
        assert_eq!(classic.rope, new.rope);
        assert_eq!(classic.max_context(), 131_072);
        let want = (0.1 * 4f64.ln() + 1.0) as f32;
        assert_eq!(classic.rope.attention_factor(), want);

        // Below the correction range a frequency is the original one, above it the
        // interpolated one, and in between it lies between the two.
        let plain = parse(&format!(
            r#"{{"architectures": ["Qwen2ForCausalLM"], {BASE}, "head_dim": 64,
            "rope_theta": 1000000.0}}"#
        ))
        .unwrap();
        let (yarn, orig) = (classic.rope.inv_freq(64), plain.rope.inv_freq(64));
        assert_eq!(yarn.len(), 32);
        let kinds: Vec<char> = yarn
            .iter()
            .zip(&orig)
            .map(|(&y, &o)| {
                if y == o {
                    'o'
                } else if (y - o / 4.0).abs() <= o * 1e-6 {
                    'i'
                } else {
                    assert!(y < o && y > o / 4.0, "{y} not between {o} and {}", o / 4.0);
                    'b'
                }
            })
            .collect();
        let s: String = kinds.iter().collect();
        assert!(
            s.starts_with('o') && s.ends_with('i') && s.contains('b'),
            "{s}"
        );
        assert!(
            !s.contains("io") && !s.contains("bo") && !s.contains("ib"),
            "{s}"
        );

        // DeepSeek's mscale pair, and an explicit attention_factor.
        let ds = parse(&format!(
            r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "rope_scaling": {{"type": "yarn",
            "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
            "mscale_all_dim": 1.0}}}}"#
        ))
        .unwrap();
        assert_eq!(ds.rope.attention_factor(), 1.0);
        assert_eq!(ds.max_context(), 163_840);
        let af = parse(&format!(
            r#"{{"architectures": ["LlamaForCausalLM"], {BASE}, "rope_scaling": {{"type": "yarn",
            "factor": 2.0, "attention_factor": 1.5}}}}"#
        ))
        .unwrap();
        assert_eq!(af.rope.attention_factor(), 1.5);
        assert_eq!(
            af.max_context(),
            8192,
            "original defaults to max_position_embeddings"
        );

        assert_refused(
            "LlamaForCausalLM",
            &[
                (r#""rope_scaling": {"type": "yarn"}"#, "rope_scaling.factor"),
                (
                    r#""rope_scaling": {"type": "yarn", "factor": 0.5}"#,
                    "rope_scaling.factor",
                ),
                (
                    r#""rope_scaling": {"type": "yarn", "factor": 2.0, "beta_fast": 0.5}"#,
                    "rope_scaling.beta_fast",
                ),
                (
                    r#""rope_scaling": {"type": "yarn", "factor": 2.0, "attention_factor": -1.0}"#,
                    "rope_scaling.attention_factor",
                ),
            ],
        );
    }
}
