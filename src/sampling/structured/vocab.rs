//! The tokenizer's vocabulary as llguidance sees it: every token id's bytes, in a token trie.

use std::sync::Arc;

use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::error::{DetspecError, Result};
use crate::tokenizer::Tokenizer;

/// Our tokenizer plus its trie. llguidance needs to tokenize literal strings of a grammar
/// (to force them cheaply); that goes through our tokenizer.
struct TokenizerBridge {
    tokenizer: Arc<Tokenizer>,
    trie: TokTrie,
}

impl TokenizerEnv for TokenizerBridge {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            // Only a fallback for the trie's greedy split: an encoding error leaves it to the
            // greedy tokens.
            self.tokenizer.encode(text, false).unwrap_or_default()
        })
    }
}

/// Builds the token environment of `tokenizer` for logits rows of `vocab_size` entries (ids
/// past the tokenizer's vocabulary are padding the model never should emit: they become
/// special tokens no grammar allows). EOS is every id in `eos_token_ids`.
pub fn token_env(
    tokenizer: &Arc<Tokenizer>,
    vocab_size: usize,
    eos_token_ids: &[u32],
) -> Result<TokEnv> {
    let unsupported = |why: String| {
        DetspecError::param(
            "structured_outputs",
            format!(
                "the tokenizer {} cannot be used for structured outputs: {why}",
                tokenizer.origin().display()
            ),
        )
    };
    let json = tokenizer
        .inner()
        .to_string(false)
        .map_err(|e| unsupported(e.to_string()))?;
    let json: serde_json::Value =
        serde_json::from_str(&json).map_err(|e| unsupported(e.to_string()))?;
    // The byte-level (GPT-2) and byte-fallback (SentencePiece) decodings are what
    // llguidance knows; others are refused with its message.
    let mut words = llguidance::token_bytes_from_tokenizer_json(&json)
        .map_err(|e| unsupported(e.to_string()))?;
    if words.len() > vocab_size {
        return Err(unsupported(format!(
            "it has {} tokens but the model's logits have {vocab_size}",
            words.len()
        )));
    }
    while words.len() < vocab_size {
        let mut name = format!(".<[{}]>", words.len()).into_bytes();
        name[0] = TokTrie::SPECIAL_TOKEN_MARKER;
        words.push(name);
    }
    let eos = eos_token_ids.first().copied().ok_or_else(|| {
        unsupported("the model has no EOS token, so a finished grammar could not end".into())
    })?;
    let info = TokRxInfo::new(vocab_size as u32, eos);
    let mut trie = TokTrie::from(&info, &words);
    if eos_token_ids.len() > 1 {
        trie = trie.with_eos_tokens(eos_token_ids);
    }
    Ok(Arc::new(TokenizerBridge {
        tokenizer: tokenizer.clone(),
        trie,
    }))
}
