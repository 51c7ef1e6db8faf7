//! The scheduler's view of one request's completion.

use std::sync::Arc;

use crate::kv::{BlockTable, PageAllocator, SequenceStates};
use crate::model::LoraAdapter;
use crate::output::{FinishReason, StopReason, TokenLogprobs};
use crate::sampling::{SamplingParams, TokenConstraint};

/// Engine-internal sequence id (unique per engine, in arrival order).
pub type SequenceId = u64;

/// Token state, KV reservation and sampling settings of one completion of a request.
#[derive(Debug)]
pub struct Sequence {
    pub id: SequenceId,
    pub request_id: String,
    /// Which of the request's `n` completions this sequence is.
    pub completion_index: usize,
    pub prompt: Vec<u32>,
    pub output: Vec<u32>,
    pub logprobs: Vec<TokenLogprobs>,
    pub params: SamplingParams,
    /// Resolved sampling seed (the request's, or one drawn from entropy).
    pub seed: u64,
    /// Tokens whose K/V is in the cache.
    pub num_computed: usize,
    pub block_table: BlockTable,
    pub finish: Option<FinishReason>,
    pub stop_reason: Option<StopReason>,
    /// Longest this sequence may grow (prompt + output), from max_tokens and max_model_len.
    pub max_len: usize,
    pub num_preemptions: usize,
    /// Prompt tokens read from the prefix cache when it was first admitted (vLLM's
    /// `num_cached_tokens`).
    pub num_cached_tokens: usize,
    /// The request asked for bitwise-reproducible output (`SamplingParams::deterministic`,
    /// accepted by the determinism policy); how it gets it is the policy's business.
    pub deterministic: bool,
    /// Output tokens committed; tokens at index ≥ `verified` are speculative (only under the
    /// replay strategy). Written only by `crate::dvr`.
    pub verified: usize,
    /// Output tokens already sent to the client (never decreases, also across preemption).
    pub emitted: usize,
    pub dvr: DvrState,
    /// The grammar state of a structured output (`params.structured_outputs`); it follows
    /// whatever output prefix it is asked about, so rollbacks need no hook.
    pub constraint: Option<TokenConstraint>,
    /// The LoRA adapter it runs with (held until it ends, whatever is loaded by then).
    pub lora: Option<Arc<LoraAdapter>>,
    /// Its request's `cache_salt` hashed (`kv::salt_hash`; 0: none).
    pub cache_salt: u64,
    /// Its recurrent states, where the model has linear-attention layers: held while it runs,
    /// given back when it is preempted or ends.
    pub states: Option<SequenceStates>,
    /// Tokens of its prefix the prefix cache held when it was last admitted, read or not: on
    /// a recurrent model, where its prefill keeps a state for the prompts after it that share
    /// as much (`engine::core::caching`).
    pub shared_prefix: usize,
}

/// Decode–verify–rollback counters and state of one sequence (owned by `crate::dvr`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DvrState {
    pub verify_passes: usize,
    pub rollbacks: usize,
    pub rolled_back_tokens: usize,
    /// Rows of its verify windows that carried no token: W less its rows, summed over its
    /// passes. A group's dummy sequences belong to no request (engine-wide stats only).
    pub padded_rows: usize,
    /// Engine step at which the sequence, finished on the fast path with speculative tokens,
    /// began waiting for its verify pass (`verify_finish_wait`).
    pub wait_since: Option<u64>,
    /// Input rows its next verify window waits for (0: W); set by an adaptive verifier.
    pub window: usize,
}

impl Sequence {
    /// Gives back its pages and recurrent states: it computes from its first token again
    /// (preempted, or not admitted after all).
    pub fn restart(&mut self, alloc: &dyn PageAllocator) {
        self.block_table.free(alloc);
        self.num_computed = 0;
        if let Some(states) = &mut self.states {
            states.release();
        }
    }

    /// Takes its recurrent states where the model keeps them (admission); false where the
    /// pool has no room for them now.
    pub fn acquire_states(&mut self) -> bool {
        self.states.as_mut().is_none_or(SequenceStates::acquire)
    }

    /// Prompt plus output tokens.
    pub fn len(&self) -> usize {
        self.prompt.len() + self.output.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Finished with every output token verified: nothing of it will change again.
    pub fn is_done(&self) -> bool {
        self.finish.is_some() && self.verified == self.output.len()
    }

    /// Speculative (not yet verified) output tokens.
    pub fn num_speculative(&self) -> usize {
        self.output.len() - self.verified
    }

    /// The prefix-cache namespace of its KV: pages computed with an adapter hold other
    /// values than the base model's for the same tokens, and a salted request's pages are its
    /// salt's alone (0: the base model, unsalted).
    pub fn cache_namespace(&self) -> u64 {
        crate::kv::namespace(
            self.lora.as_ref().map_or(0, |a| a.content_hash()),
            self.cache_salt,
        )
    }

    /// Token at absolute position `pos`.
    pub fn token(&self, pos: usize) -> Option<u32> {
        if pos < self.prompt.len() {
            self.prompt.get(pos).copied()
        } else {
            self.output.get(pos - self.prompt.len()).copied()
        }
    }

    /// Whether output token `idx` ends the sequence: EOS, stop token ids, max_tokens and
    /// context length, in vLLM's order of precedence.
    pub fn finish_at(&self, idx: usize, eos: &[u32]) -> Option<(FinishReason, Option<StopReason>)> {
        let p = &self.params;
        let token = *self.output.get(idx)?;
        let count = idx + 1;
        let past_min = count >= p.min_tokens;
        if past_min && !p.ignore_eos && eos.contains(&token) {
            return Some((FinishReason::Stop, Some(StopReason::Token(token))));
        }
        if past_min && p.stop_token_ids.contains(&token) {
            return Some((FinishReason::Stop, Some(StopReason::Token(token))));
        }
        if count >= p.max_tokens || self.prompt.len() + count >= self.max_len {
            return Some((FinishReason::Length, None));
        }
        None
    }
}
