//! Sequence classification (reward models, classifiers: `*ForSequenceClassification`
//! checkpoints, whose `score` layer replaces the LM head): the head's logits at a sequence's
//! last token, as transformers pools an unpadded sequence, and vLLM's `classify` activation of
//! them (softmax over two or more labels, the logistic function of a single one).
//!
//! The activation is a plain loop in a fixed order over the engine's own exponential
//! (`ops::exp_nonpositive`), so deterministic probabilities are a function of the logits' bits
//! alone, on every instruction set; a libm's `exp` may round differently from one to another.

use std::ops::Range;

use crate::config::Head;
use crate::error::{DetspecError, Result};
use crate::ops::{exp_nonpositive, sigmoid};

use super::{ForwardKind, Scopes};
use crate::engine::EngineCore;

/// One sequence's classification.
#[derive(Debug, Clone, PartialEq)]
pub struct Classification {
    /// The `score` layer's output at the last token, one per label (a reward model's reward).
    pub logits: Vec<f32>,
    /// `softmax(logits)`, or `sigmoid` of a single logit (vLLM's `probs`).
    pub probs: Vec<f32>,
}

impl EngineCore {
    /// Each sequence's classification (with its scope in `scopes`), on the verify-path kernels
    /// where `deterministic` (the same bits whatever else runs), else the fast path.
    pub fn classify(
        &mut self,
        seqs: &[Vec<u32>],
        deterministic: bool,
        scopes: Scopes<'_>,
    ) -> Result<Vec<Classification>> {
        if self.info.config.head.labels().is_none() {
            return Err(DetspecError::param(
                "model",
                format!(
                    "{} is a language model (`lm_head`): classification needs a \
                     *ForSequenceClassification checkpoint (a `score` layer)",
                    self.info.model_dir.display()
                ),
            ));
        }
        let wanted: Vec<Range<usize>> = seqs
            .iter()
            .map(|s| s.len().saturating_sub(1)..s.len())
            .collect();
        let mut logits = vec![Vec::new(); seqs.len()];
        let kind = (ForwardKind::Logits, deterministic);
        self.for_each_row(seqs, &wanted, kind, scopes, &mut |i, row| {
            logits[i] = row.to_vec();
            Ok(())
        })?;
        Ok(logits
            .into_iter()
            .map(|logits| Classification {
                probs: activation(&logits),
                logits,
            })
            .collect())
    }

    /// Refuses `what` (generation, scoring, logprobs) on a classifier, whose head's rows are
    /// labels, not tokens; naming the model and what it does instead.
    pub(crate) fn require_language_model(&self, what: &str) -> Result<()> {
        match &self.info.config.head {
            Head::LanguageModel => Ok(()),
            Head::Classifier { labels } => Err(DetspecError::param(
                "model",
                format!(
                    "{} is a sequence classifier ({} labels, a `score` layer instead of \
                     `lm_head`): it does not support {what}; classify with LLM.classify or \
                     POST /classify",
                    self.info.model_dir.display(),
                    labels.len()
                ),
            )),
        }
    }
}

/// vLLM's classification activation: the logistic function of a single logit, else softmax
/// (max subtracted, sums in label order).
fn activation(logits: &[f32]) -> Vec<f32> {
    if let [x] = logits {
        return vec![sigmoid(*x)];
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = logits.iter().map(|&x| exp_nonpositive(x - max)).collect();
    let sum = e.iter().fold(0f32, |s, &v| s + v);
    e.into_iter().map(|v| v / sum).collect()
}

#[cfg(test)]
mod tests {
    use super::activation;

    #[test]
    fn the_activation_is_softmax_or_the_logistic_of_one_logit() {
        let p = activation(&[1.0, 2.0, 0.5]);
        let z: f64 = [1.0f64, 2.0, 0.5].iter().map(|x| x.exp()).sum();
        for (pi, x) in p.iter().zip([1.0f64, 2.0, 0.5]) {
            assert!((f64::from(*pi) - x.exp() / z).abs() < 1e-6, "{p:?}");
        }
        assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let s = activation(&[0.3])[0];
        assert!((f64::from(s) - 1.0 / (1.0 + (-0.3f64).exp())).abs() < 1e-6);
        // Large logits neither overflow nor give NaN.
        assert_eq!(activation(&[1e30, 0.0]), vec![1.0, 0.0]);
        assert_eq!(activation(&[-1e30])[0], 0.0);
    }
}
