//! What a decoder's last hidden state feeds: the language-model head of a `*ForCausalLM`
//! checkpoint, or the `score` layer of a `*ForSequenceClassification` one (reward models and
//! classifiers: transformers' `LlamaForSequenceClassification` and its Mistral and Qwen
//! siblings), whose output at a sequence's last token is one logit per label.

use std::collections::BTreeMap;
use std::path::Path;

use crate::error::{DetspecError, Result};

/// The output layer of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Head {
    /// `lm_head.weight` `[vocab, hidden]` (or the tied embedding): next-token logits.
    LanguageModel,
    /// `score.weight` `[labels, hidden]`, no bias: one logit per label, read at a sequence's
    /// last token. `labels` are `id2label`'s names in id order.
    Classifier { labels: Vec<String> },
}

impl Head {
    /// A classifier's head from `id2label` (`{"0": "negative", "1": "positive"}`); without it
    /// transformers' default of two labels, `LABEL_0` and `LABEL_1`. The ids must be exactly
    /// 0..n.
    pub(super) fn classifier(
        id2label: Option<&BTreeMap<String, String>>,
        path: &Path,
    ) -> Result<Self> {
        let Some(map) = id2label else {
            return Ok(Self::Classifier {
                labels: vec!["LABEL_0".into(), "LABEL_1".into()],
            });
        };
        let err = |message: String| DetspecError::InvalidConfig {
            path: path.to_path_buf(),
            field: "id2label".into(),
            message,
        };
        let mut by_id = BTreeMap::new();
        for (id, name) in map {
            let i: usize = id
                .parse()
                .map_err(|_| err(format!("key \"{id}\" is not a label id (0, 1, ...)")))?;
            by_id.insert(i, name.clone());
        }
        if by_id.is_empty() || by_id.keys().copied().ne(0..by_id.len()) {
            return Err(err(format!(
                "ids must be 0..n without gaps, got {:?}",
                by_id.keys().collect::<Vec<_>>()
            )));
        }
        Ok(Self::Classifier {
            labels: by_id.into_values().collect(),
        })
    }

    /// The output layer's parameter name in a checkpoint.
    pub fn weight_name(&self) -> &'static str {
        match self {
            Self::LanguageModel => "lm_head.weight",
            Self::Classifier { .. } => "score.weight",
        }
    }

    /// Rows of the output layer: the vocabulary, or the labels.
    pub fn rows(&self, vocab_size: usize) -> usize {
        match self {
            Self::LanguageModel => vocab_size,
            Self::Classifier { labels } => labels.len(),
        }
    }

    /// The labels of a classifier.
    pub fn labels(&self) -> Option<&[String]> {
        match self {
            Self::LanguageModel => None,
            Self::Classifier { labels } => Some(labels),
        }
    }
}
