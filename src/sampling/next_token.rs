//! The next token of a sequence from one row of logits: the one call the fast path and the DVR
//! verifier share, so equal logits give equal tokens and logprobs.

use super::bad_words;
use super::params::SamplingParams;
use super::processors::mask_disallowed;
use super::sampler::{sample, SampleInput};
use crate::output::TokenLogprobs;
use crate::Result;

/// Samples the token that follows `output` (the sequence's output so far, or a prefix of it
/// when the verifier replays) from `row`, and ranks it. `min_tokens` bans EOS (unless ignored)
/// and the stop token ids, as in vLLM, and `bad_words` the tokens that would complete one.
/// `allowed` is the structured-output mask of this
/// position (see [`super::structured`]): tokens outside it get `-inf` before anything else, so
/// logprobs, ranks and top alternatives are those of the constrained distribution.
pub fn sample_next(
    params: &SamplingParams,
    seed: u64,
    prompt: &[u32],
    output: &[u32],
    row: &[f32],
    eos: &[u32],
    allowed: Option<&[u32]>,
) -> Result<TokenLogprobs> {
    let masked;
    let row = match allowed {
        Some(bits) => {
            masked = mask_disallowed(row, bits);
            &masked[..]
        }
        None => row,
    };
    let mut banned = if output.len() < params.min_tokens {
        let mut banned = params.stop_token_ids.clone();
        if !params.ignore_eos {
            banned.extend_from_slice(eos);
        }
        banned
    } else {
        Vec::new()
    };
    banned.extend(bad_words::banned_next(&params.bad_words_token_ids, output));
    let s = sample(&SampleInput {
        logits: row,
        params,
        seed,
        position: (prompt.len() + output.len()) as u64,
        prompt_tokens: prompt,
        output_tokens: output,
        banned_tokens: &banned,
    })?;
    Ok(TokenLogprobs {
        token: s.token,
        logprob: s.logprob,
        rank: s.rank,
        top: s.top_logprobs,
    })
}
