//! One sequence's position in its grammar, and the masks of allowed tokens it yields.

use std::collections::VecDeque;
use std::sync::Arc;

use llguidance::Matcher;

use crate::error::{DetspecError, Result};

/// Allowed-token bitset of one position: bit `t % 32` of word `t / 32` is set when token `t`
/// may come next.
pub type TokenMask = Arc<[u32]>;

/// How many recent masks a sequence keeps. The replay verifier asks again for the masks of
/// the speculative window the fast path already computed; 64 covers any window the engine
/// runs (an older one is recomputed, not wrong).
const MASK_CACHE: usize = 64;

/// The parser state of one sequence's constraint.
///
/// The state is a function of the output prefix it was last synced to: [`Self::mask_after`]
/// takes the prefix the caller is about to sample after, rolls the parser back to where that
/// prefix and the tokens it consumed agree, and feeds the rest. So a rollback, a preemption
/// or the verifier looking at an earlier position needs no hook: the next call rewinds.
pub struct TokenConstraint {
    matcher: Matcher,
    /// The tokens the parser consumed, in order.
    fed: Vec<u32>,
    /// Masks by output index (`(i, mask after the first i tokens)`), of prefixes of `fed`.
    masks: VecDeque<(usize, TokenMask)>,
    vocab_size: usize,
    /// The constraint starts after this run of tokens' first occurrence
    /// (`StructuredOutputs::starts_after`); the parser sees only the output after it.
    starts_after: Option<Arc<[u32]>>,
}

impl std::fmt::Debug for TokenConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenConstraint")
            .field("fed", &self.fed.len())
            .field("cached_masks", &self.masks.len())
            .finish()
    }
}

impl Clone for TokenConstraint {
    /// An independent copy (for the `n` completions of one request).
    fn clone(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
            fed: self.fed.clone(),
            masks: self.masks.clone(),
            vocab_size: self.vocab_size,
            starts_after: self.starts_after.clone(),
        }
    }
}

impl TokenConstraint {
    pub(super) fn new(matcher: Matcher, vocab_size: usize, starts_after: Option<Vec<u32>>) -> Self {
        Self {
            matcher,
            fed: Vec::new(),
            masks: VecDeque::new(),
            vocab_size,
            starts_after: starts_after.map(Into::into),
        }
    }

    /// The tokens allowed after `prefix` (a sequence's output so far, or a prefix of it);
    /// `None` while the constraint has not started (`starts_after` not yet in `prefix`:
    /// any token may come). The gate is a function of the prefix too, so a rollback past
    /// the gate's tokens closes it again.
    ///
    /// Once the grammar is complete only EOS is allowed (the sequence then ends by the usual
    /// EOS rule); tokens after that are not fed to the parser.
    ///
    /// # Errors
    /// `InvalidParameter` naming `structured_outputs` when `prefix` holds a token the grammar
    /// does not allow (it was not sampled under this constraint) or the parser gives up (its
    /// step limits).
    pub fn mask_after(&mut self, prefix: &[u32]) -> Result<Option<TokenMask>> {
        let prefix = match &self.starts_after {
            None => prefix,
            Some(gate) => match prefix.windows(gate.len()).position(|w| w == &gate[..]) {
                Some(at) => &prefix[at + gate.len()..],
                None => return Ok(None),
            },
        };
        let common = self
            .fed
            .iter()
            .zip(prefix)
            .take_while(|(a, b)| a == b)
            .count();
        self.masks.retain(|(i, _)| *i <= common);
        let target = prefix.len();
        if let Some((_, mask)) = self.masks.iter().find(|(i, _)| *i == target) {
            return Ok(Some(mask.clone()));
        }
        if common < self.fed.len() {
            self.matcher
                .rollback(self.fed.len() - common)
                .map_err(|e| failure(format!("rewinding the grammar: {e}")))?;
            self.fed.truncate(common);
        }
        for (i, &t) in prefix.iter().enumerate().skip(common) {
            if self.matcher.is_stopped() {
                break;
            }
            self.matcher.consume_token(t).map_err(|e| {
                failure(format!(
                    "output token {t} at index {i} breaks the grammar: {e}"
                ))
            })?;
            self.fed.push(t);
        }
        let mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| failure(format!("computing the allowed tokens: {e}")))?;
        let mut words = mask.as_slice().to_vec();
        words.resize(self.vocab_size.div_ceil(32), 0);
        let mask: TokenMask = words.into();
        if self.masks.len() == MASK_CACHE {
            self.masks.pop_front();
        }
        self.masks.push_back((target, mask.clone()));
        Ok(Some(mask))
    }

    /// Whether the grammar has reached its end (only EOS may follow).
    pub fn is_complete(&self) -> bool {
        self.matcher.is_stopped()
    }
}

fn failure(message: String) -> DetspecError {
    DetspecError::param("structured_outputs", message)
}
