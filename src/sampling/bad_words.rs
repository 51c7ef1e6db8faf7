//! vLLM's `bad_words`: words the output never contains.
//!
//! Each word is tokenized once at intake, as vLLM does it: as written (leading spaces
//! stripped), and with one leading space where that gives a different first token in as many
//! tokens (a word inside a sentence usually tokenizes with its space). At every step the
//! last token of a tokenized word is banned when the output so far ends with the word's other
//! tokens; a ban depends on the output tokens alone, so the fast path and the verifier ban
//! the same tokens.

use crate::error::{DetspecError, Result};
use crate::tokenizer::Tokenizer;

/// Most token sequences the words of one request may become (vLLM's `VLLM_MAX_NUM_BAD_WORDS`
/// default): each is checked at every step.
pub const MAX_BAD_WORD_SEQUENCES: usize = 128;

/// The token sequences of `words`.
///
/// # Errors
/// `bad_words` named when a word tokenizes to nothing or there are too many sequences.
pub fn tokenize(words: &[String], tokenizer: &Tokenizer) -> Result<Vec<Vec<u32>>> {
    let mut out: Vec<Vec<u32>> = Vec::new();
    for word in words {
        let word = word.trim_start();
        let plain = tokenizer.encode(word, false)?;
        if plain.is_empty() {
            return Err(DetspecError::param(
                "bad_words",
                format!("{word:?} tokenizes to no token"),
            ));
        }
        let spaced = tokenizer.encode(&format!(" {word}"), false)?;
        let distinct = spaced.len() == plain.len() && spaced.first() != plain.first();
        out.push(plain);
        if distinct {
            out.push(spaced);
        }
        if out.len() > MAX_BAD_WORD_SEQUENCES {
            return Err(DetspecError::param(
                "bad_words",
                format!("too many: they tokenize to more than {MAX_BAD_WORD_SEQUENCES} sequences"),
            ));
        }
    }
    Ok(out)
}

/// The tokens banned after `output`: the last token of each sequence whose other tokens end
/// the output.
pub fn banned_next<'a>(
    sequences: &'a [Vec<u32>],
    output: &'a [u32],
) -> impl Iterator<Item = u32> + 'a {
    sequences.iter().filter_map(move |seq| {
        let (&last, prefix) = seq.split_last()?;
        output.ends_with(prefix).then_some(last)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bans_the_token_that_would_complete_a_word() {
        let words = vec![vec![7], vec![3, 4, 5]];
        let banned = |out: &[u32]| banned_next(&words, out).collect::<Vec<_>>();
        assert_eq!(banned(&[]), vec![7]);
        assert_eq!(banned(&[1, 3, 4]), vec![7, 5]);
        assert_eq!(banned(&[3, 4, 1]), vec![7]);
        assert_eq!(banned(&[4]), vec![7]);
    }
}
