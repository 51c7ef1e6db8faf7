//! Turning one row of logits into a token (plus its logprobs).
//!
//! [`sample`] is a pure function of its input: the same logits, parameters, seed, position and
//! token history always give the same token and the same logprob bits. The fast path and the
//! DVR verifier (docs/architecture.md, "Replay") both call it, so a verified token differs from
//! the speculative one only if the *logits* differ.
//!
//! Random sampling uses the Gumbel-max trick with counter-based noise ([`super::rng`]): the token
//! is `argmax_i (l_i + g(seed, position, i))` over the processed (temperature-scaled, filtered)
//! logits `l_i`. This draws exactly from `softmax(l)`, needs no cumulative sum over the vocabulary
//! (whose rounding would depend on summation order), and ties the noise of each token to its own
//! id rather than to a shared stream.

use std::borrow::Cow;

use super::params::SamplingParams;
use super::processors::{changes_greedy_logits, process_logits};
use super::rank::{max_in_lanes, rank_desc, row_max, LANES};
use super::rng::{RowNoise, GUMBEL_MAX};
use crate::ops::{exp_nonpositive, isa_kernel, CpuIsa};
use crate::output::TokenLogprobs;
use crate::{DetspecError, Result};

/// Everything [`sample`] needs for one row.
#[derive(Debug, Clone, Copy)]
pub struct SampleInput<'a> {
    /// Raw logits of one row; the length is the vocabulary size.
    pub logits: &'a [f32],
    /// The request's sampling parameters (assumed validated).
    pub params: &'a SamplingParams,
    /// Resolved seed: `params.seed`, or an entropy seed the engine chose once for the request.
    pub seed: u64,
    /// Absolute position of the token being sampled (prompt length + output index). Keying the
    /// noise by absolute position is what makes replays after rollback draw the same noise.
    pub position: u64,
    /// Prompt token ids (for the repetition penalty).
    pub prompt_tokens: &'a [u32],
    /// Tokens generated so far (for all penalties).
    pub output_tokens: &'a [u32],
    /// Ids that must not be sampled, e.g. EOS while the output is shorter than `min_tokens`.
    pub banned_tokens: &'a [u32],
}

/// The chosen token and its logprobs.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledToken {
    /// The sampled token id.
    pub token: u32,
    /// `log_softmax(raw logits)[token]`.
    pub logprob: f32,
    /// 1-based rank of `token` under the raw logits (1 + how many are larger).
    pub rank: u32,
    /// The `params.logprobs` most likely tokens under the raw logits with their logprobs, most
    /// likely first, ties by lower id.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// Samples one token from a row of logits.
///
/// Pipeline: penalties → banned ids → (unless greedy) temperature → top-k → top-p → min-p →
/// Gumbel-max; greedy requests take the argmax of the penalised logits (ties → lowest id).
///
/// Logprobs follow vLLM v1's default ("raw"): they are the log-softmax of the logits *before*
/// penalties, temperature and filtering, by a fixed-order log-sum-exp (`log_sum_exp`), rounded to
/// f32 once at the end.
///
/// # Errors
/// [`DetspecError::InvalidParameter`] when the row is empty, contains NaN or `+inf` (or overflows
/// to `+inf` after penalties/temperature), a token id is out of the vocabulary, or every token
/// has been filtered out or banned.
pub fn sample(input: &SampleInput) -> Result<SampledToken> {
    let logits = input.logits;
    let vocab = logits.len();
    let max = check_row(logits)?;
    check_ids("prompt_tokens", input.prompt_tokens, vocab)?;
    check_ids("output_tokens", input.output_tokens, vocab)?;
    check_ids("banned_tokens", input.banned_tokens, vocab)?;

    let params = input.params;
    // Greedy without penalties or bans leaves the logits as they are (the common case of a
    // batch): no copy, no second scan.
    let processed: Cow<[f32]> =
        if params.is_greedy() && !changes_greedy_logits(params) && input.banned_tokens.is_empty() {
            Cow::Borrowed(logits)
        } else {
            let mut processed = logits.to_vec();
            process_logits(
                &mut processed,
                params,
                input.prompt_tokens,
                input.output_tokens,
                input.banned_tokens,
            );
            if let Some(i) = first_nan_or_inf(CpuIsa::detect(), &processed) {
                return Err(DetspecError::param(
                    "logits",
                    format!(
                        "value at index {i} became {} after penalties/temperature (raw logit {})",
                        processed[i], logits[i]
                    ),
                ));
            }
            Cow::Owned(processed)
        };

    let token = if params.is_greedy() {
        match &processed {
            // The raw row's maximum is known already.
            Cow::Borrowed(_) => argmax_of(logits, max),
            Cow::Owned(processed) => argmax(processed),
        }
    } else {
        gumbel_argmax(&processed, input.seed, input.position)
    }
    .ok_or_else(|| {
        DetspecError::param(
            "logits",
            "every token was filtered out or banned; nothing left to sample",
        )
    })?;

    // The chosen token has a finite processed logit, hence a finite raw logit, so the
    // log-sum-exp below is finite.
    let lse = log_sum_exp(CpuIsa::detect(), logits, max);
    let logprob_of = |t: u32| (f64::from(logits[t as usize]) - lse) as f32;
    let top_logprobs = top_n(logits, params.logprobs.unwrap_or(0))
        .into_iter()
        .map(|t| (t, logprob_of(t)))
        .collect();
    Ok(SampledToken {
        token,
        logprob: logprob_of(token),
        rank: rank_under(logits, token, max),
        top_logprobs,
    })
}

/// The numbers the sampler reports for `token` in `logits` when it is given rather than
/// sampled (scoring, prompt logprobs, audits): `log_softmax(raw logits)[token]` by the same
/// log-sum-exp as [`sample`], so a token scored from the same logits has the same logprob bits
/// as when it was sampled; its 1-based rank; and the `top_n` most likely tokens.
///
/// # Errors
/// [`DetspecError::InvalidParameter`] when the row is empty or holds NaN/`+inf`, or `token` is
/// outside the vocabulary.
pub fn score_token(logits: &[f32], token: u32, top_n_count: usize) -> Result<TokenLogprobs> {
    let max = check_row(logits)?;
    check_ids("token_ids", &[token], logits.len())?;
    let lse = log_sum_exp(CpuIsa::detect(), logits, max);
    let logprob_of = |t: u32| (f64::from(logits[t as usize]) - lse) as f32;
    Ok(TokenLogprobs {
        token,
        logprob: logprob_of(token),
        rank: rank_under(logits, token, max),
        top: top_n(logits, top_n_count)
            .into_iter()
            .map(|t| (t, logprob_of(t)))
            .collect(),
    })
}

/// 1-based rank of `token` by raw logit (1 + how many tokens have a larger logit).
pub fn rank_of(logits: &[f32], token: u32) -> u32 {
    let chosen = logits
        .get(token as usize)
        .copied()
        .unwrap_or(f32::NEG_INFINITY);
    1 + count_greater(CpuIsa::detect(), logits, chosen)
}

/// [`rank_of`] for a token inside a row whose maximum `max` is known: the most likely token
/// (every greedy one) needs no pass over the row.
fn rank_under(logits: &[f32], token: u32, max: f32) -> u32 {
    let chosen = logits[token as usize];
    if chosen == max {
        1
    } else {
        1 + count_greater(CpuIsa::detect(), logits, chosen)
    }
}

isa_kernel! {
    /// How many values of `row` are greater than `x`.
    fn count_greater(isa: CpuIsa, row: &[f32], x: f32) -> u32 {
        row.iter().map(|&v| u32::from(v > x)).sum()
    }
}

/// A row must be non-empty and free of NaN and `+inf` (which would make the log-sum-exp NaN);
/// `-inf` is a legitimate mask. Returns the row's maximum, found in the same pass.
fn check_row(logits: &[f32]) -> Result<f32> {
    if logits.is_empty() {
        return Err(DetspecError::param("logits", "row is empty"));
    }
    let (max, clean) = checked_row_max(CpuIsa::detect(), logits);
    if clean {
        return Ok(max);
    }
    let i = first_nan_or_inf(CpuIsa::detect(), logits).unwrap_or(0);
    Err(DetspecError::param(
        "logits",
        format!(
            "value at index {i} is {} (NaN and +inf are not allowed)",
            logits[i]
        ),
    ))
}

isa_kernel! {
    /// The row's maximum (as [`max_in_lanes`]) and whether it is free of NaN and `+inf`.
    #[allow(clippy::neg_cmp_op_on_partial_ord)]
    fn checked_row_max(isa: CpuIsa, logits: &[f32]) -> (f32, bool) {
        // As `max_in_lanes`, with the check in the same pass: `!(x < inf)` holds exactly for
        // NaN and +inf (the negated comparison is the point: it is what catches NaN, and this
        // form vectorises where `&=` of the positive one did not: 94 against 66 µs a row).
        let mut maxes = [f32::NEG_INFINITY; LANES];
        let mut bad = [0u32; LANES];
        let (chunks, rest) = logits.as_chunks::<LANES>();
        for c in chunks {
            for l in 0..LANES {
                maxes[l] = if c[l] > maxes[l] { c[l] } else { maxes[l] };
                bad[l] |= u32::from(!(c[l] < f32::INFINITY));
            }
        }
        for (l, &x) in rest.iter().enumerate() {
            maxes[l] = if x > maxes[l] { x } else { maxes[l] };
            bad[l] |= u32::from(!(x < f32::INFINITY));
        }
        let max = maxes.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        (max, bad.iter().all(|&b| b == 0))
    }
}

/// Errors if any id is outside the vocabulary, naming the list it came from.
fn check_ids(name: &str, ids: &[u32], vocab: usize) -> Result<()> {
    match ids.iter().find(|&&t| t as usize >= vocab) {
        Some(t) => Err(DetspecError::param(
            name,
            format!("token id {t} is out of range for a vocabulary of {vocab}"),
        )),
        None => Ok(()),
    }
}

/// Index of the largest finite logit, lowest id on ties; `None` if all are `-inf`.
fn argmax(logits: &[f32]) -> Option<u32> {
    // The maximum (exact, in vector lanes), then its first occurrence: the lowest id among the
    // largest logits, as a sequential strict-greater scan would pick.
    argmax_of(logits, row_max(CpuIsa::detect(), logits))
}

/// [`argmax`] of a row whose maximum `max` is known.
fn argmax_of(logits: &[f32], max: f32) -> Option<u32> {
    if max == f32::NEG_INFINITY {
        return None;
    }
    first_equal(CpuIsa::detect(), logits, max).map(|i| i as u32)
}

/// Rows are scanned in chunks of this many values: a chunk is tested without an early exit
/// (so the test compiles to vector compares), and only the chunk that holds the value is
/// searched element by element. Twice a 64-byte line of floats × the 16 AVX-512 lanes.
const SCAN_CHUNK: usize = 128;

/// The index of the first element of `row` for which `hit` holds, chunk by chunk.
#[inline(always)]
fn first_where(row: &[f32], hit: impl Fn(f32) -> bool) -> Option<usize> {
    row.chunks(SCAN_CHUNK).enumerate().find_map(|(c, chunk)| {
        // `|` and not `||`: no early exit, so the fold is a vector reduction.
        let any = chunk.iter().fold(false, |a, &l| a | hit(l));
        if any {
            chunk
                .iter()
                .position(|&l| hit(l))
                .map(|i| c * SCAN_CHUNK + i)
        } else {
            None
        }
    })
}

isa_kernel! {
    /// The first NaN or `+inf` of a row.
    fn first_nan_or_inf(isa: CpuIsa, row: &[f32]) -> Option<usize> {
        first_where(row, |l| l.is_nan() | (l == f32::INFINITY))
    }
}

isa_kernel! {
    /// The first element equal to `x` (`-0 == +0`).
    fn first_equal(isa: CpuIsa, row: &[f32], x: f32) -> Option<usize> {
        first_where(row, |l| l == x)
    }
}

/// Gumbel-max over the finite logits, lowest id on ties; `None` if all are `-inf`.
///
/// The same token as scoring every finite logit `l + gumbel(seed, position, i)` (in f64) and
/// taking the first maximum, with the two logarithms of the noise computed for only a few
/// tokens. One pass bounds every token's score from a table ([`RowNoise::bounds`]): `floor`
/// is the best lower bound so far, a lower bound on the winning score, and a token whose upper
/// bound is below it cannot win or tie. The tokens that survive the pass are then filtered
/// against the final `floor` and scored exactly. Adding a logit is monotone in f64, so
/// `l + lower <= l + g <= l + upper` holds after rounding too, and every token that reaches the
/// maximum score survives: the lowest id among them is the sequential scan's choice.
fn gumbel_argmax(logits: &[f32], seed: u64, position: u64) -> Option<u32> {
    let noise = RowNoise::new(seed, position);
    let survivors = gumbel_survivors(CpuIsa::detect(), logits, &noise);
    let floor = survivors.floor;
    let mut best: Option<(u32, f64)> = None;
    for (i, upper) in survivors.tokens {
        if upper < floor {
            continue;
        }
        let score = f64::from(logits[i as usize]) + noise.gumbel(u64::from(i));
        if best.is_none_or(|(_, b)| score > b) {
            best = Some((i, score));
        }
    }
    best.map(|(i, _)| i)
}

/// The tokens [`gumbel_argmax`]'s bounding pass keeps, each with its upper bound, and the
/// pass's final `floor`.
struct GumbelSurvivors {
    tokens: Vec<(u32, f64)>,
    floor: f64,
}

/// Tokens are bounded this many at a time: the bounds of a chunk are computed without branches
/// (so they compile to vector code), and only a chunk whose best upper bound reaches `floor` is
/// looked at token by token.
const NOISE_CHUNK: usize = 32;

isa_kernel! {
    fn gumbel_survivors(isa: CpuIsa, logits: &[f32], noise: &RowNoise) -> GumbelSurvivors {
        let mut floor = f64::NEG_INFINITY;
        let mut tokens: Vec<(u32, f64)> = Vec::new();
        let mut lower = [0f64; NOISE_CHUNK];
        let mut upper = [0f64; NOISE_CHUNK];
        for (c, chunk) in logits.chunks(NOISE_CHUNK).enumerate() {
            // A chunk filtered out (all `-inf`) or far below `floor` needs no noise at all.
            let top = f64::from(max_in_lanes(chunk));
            if top == f64::NEG_INFINITY || top + GUMBEL_MAX < floor {
                continue;
            }
            let base = c * NOISE_CHUNK;
            let mut bucket = [0u32; NOISE_CHUNK];
            for (j, b) in bucket.iter_mut().enumerate() {
                *b = noise.bucket((base + j) as u64);
            }
            let mut reach = f64::NEG_INFINITY;
            for (j, &l) in chunk.iter().enumerate() {
                let (lo, hi) = noise.bounds(bucket[j]);
                // `-inf` logits get `-inf` bounds and never survive.
                lower[j] = f64::from(l) + lo;
                upper[j] = f64::from(l) + hi;
                reach = reach.max(upper[j]);
            }
            if reach < floor {
                continue;
            }
            for j in 0..chunk.len() {
                if upper[j] < floor || upper[j] == f64::NEG_INFINITY {
                    continue;
                }
                floor = floor.max(lower[j]);
                tokens.push(((base + j) as u32, upper[j]));
            }
        }
        GumbelSurvivors { tokens, floor }
    }
}

isa_kernel! {
    /// Max-shifted log-sum-exp of a row: `exp` by a fixed polynomial in plain f32 arithmetic,
    /// summed in 16 lanes (lane `l` takes the indices ≡ l mod 16, in order) that are then added
    /// pairwise, and `ln` of the sum in f64. No step depends on threads or the instruction set
    /// (no reassociation, no FMA contraction), so the SIMD builds give the portable build's
    /// bits; a sequential libm `exp` per vocabulary entry cost as much as a third of a batch-64
    /// decode step.
    fn log_sum_exp(isa: CpuIsa, logits: &[f32], max: f32) -> f64 {
        log_sum_exp_in_lanes(logits, max)
    }
}

#[inline(always)]
/// `max` is the row's maximum ([`max_in_lanes`]), which the caller has at hand.
fn log_sum_exp_in_lanes(logits: &[f32], max: f32) -> f64 {
    let (chunks, rest) = logits.as_chunks::<LANES>();
    let mut sums = [0f32; LANES];
    for c in chunks {
        for l in 0..LANES {
            sums[l] += exp_nonpositive(c[l] - max);
        }
    }
    for (l, &x) in rest.iter().enumerate() {
        sums[l] += exp_nonpositive(x - max);
    }
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            sums[l] += sums[l + width];
        }
        width /= 2;
    }
    f64::from(max) + f64::from(sums[0]).ln()
}

/// The `n` most likely token ids (logit descending, ties by lower id), most likely first;
/// tokens at `-inf` are left out.
///
/// A single pass with a small sorted buffer: `n <= 20`, so this is O(vocab) with no allocation
/// proportional to the vocabulary; once the buffer is full, whole chunks below its last entry
/// are passed over after one vector maximum.
fn top_n(logits: &[f32], n: usize) -> Vec<u32> {
    let n = n.min(logits.len());
    let mut top: Vec<u32> = Vec::with_capacity(n + 1);
    if n == 0 {
        return top;
    }
    for (c, chunk) in logits.chunks(SCAN_CHUNK).enumerate() {
        // Once `n` are held, a chunk whose values are all strictly below the `n`-th cannot
        // enter (equal values go the slow way: ties and -0/+0 are `rank_desc`'s to decide).
        if top.len() == n && row_max(CpuIsa::detect(), chunk) < logits[top[n - 1] as usize] {
            continue;
        }
        let base = (c * SCAN_CHUNK) as u32;
        for t in base..base + chunk.len() as u32 {
            // A token masked to -inf (a structured output's disallowed ones) is no alternative.
            if logits[t as usize] == f32::NEG_INFINITY {
                continue;
            }
            if top.len() == n && rank_desc(logits, t, top[n - 1]).is_gt() {
                continue;
            }
            let at = top.partition_point(|&u| rank_desc(logits, u, t).is_lt());
            top.insert(at, t);
            top.truncate(n);
        }
    }
    top
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::test_rows::{mask_every, tied_logits};

    #[test]
    fn argmax_is_the_first_strictly_greatest_finite_logit() {
        // The sequential definition it replaced: strictly greater wins, so the lowest id wins
        // ties; -inf never; ±0 compare equal.
        let reference = |row: &[f32]| {
            let mut best: Option<(u32, f32)> = None;
            for (i, &l) in row.iter().enumerate() {
                if l > f32::NEG_INFINITY && best.is_none_or(|(_, b)| l > b) {
                    best = Some((i as u32, l));
                }
            }
            best.map(|(i, _)| i)
        };
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as u32
        };
        let palette = [f32::NEG_INFINITY, -0.0, 0.0, 1.5, -2.0, 3.25, 3.25, 7.0];
        for case in 0..2000 {
            let len = 1 + next() as usize % 70;
            let row: Vec<f32> = (0..len)
                .map(|_| match case % 3 {
                    0 => palette[next() as usize % palette.len()],
                    1 => (next() % 5) as f32 - 2.0,
                    _ => f32::NEG_INFINITY,
                })
                .collect();
            assert_eq!(argmax(&row), reference(&row), "{row:?}");
        }
    }

    #[test]
    fn exp_polynomial_is_within_two_ulp_of_f64_exp() {
        let mut x = 0.0f32;
        while x > -87.0 {
            let want = f64::from(x).exp();
            let got = f64::from(exp_nonpositive(x));
            assert!(
                ((got - want) / want).abs() < 2.5e-7,
                "exp({x}) = {got}, want {want}"
            );
            x -= 0.0137;
        }
        assert_eq!(exp_nonpositive(-90.0), 0.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpositive(0.0), 1.0);
    }

    #[test]
    fn chunked_scans_find_the_first_hit_on_every_instruction_set() {
        // Rows longer and shorter than a chunk, hits in the first, a middle and the last
        // chunk, in a chunk's last lane, and none at all.
        let mut state = 0x2545_f491u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for case in 0..3000 {
            let len = 1 + next() as usize % 700;
            let mut row: Vec<f32> = (0..len).map(|i| (i % 13) as f32 - 6.0).collect();
            for _ in 0..case % 3 {
                let at = next() as usize % len;
                row[at] = [f32::NAN, f32::INFINITY, -f32::NAN][next() as usize % 3];
            }
            let x = [-0.0, 6.0, -6.0, 99.0][case % 4];
            let bad = row.iter().position(|l| l.is_nan() || *l == f32::INFINITY);
            let equal = row.iter().position(|&l| l == x);
            for isa in CpuIsa::available() {
                assert_eq!(first_nan_or_inf(isa, &row), bad, "{isa:?} case {case}");
                assert_eq!(first_equal(isa, &row, x), equal, "{isa:?} case {case}");
            }
        }
    }

    #[test]
    fn log_sum_exp_is_accurate_and_the_same_on_every_instruction_set() {
        let mut state = 0x1234_5678u64;
        for len in [1usize, 7, 16, 33, 1000, 32000] {
            let row: Vec<f32> = (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state >> 40) as f32 / (1u64 << 24) as f32 * 40.0 - 20.0
                })
                .collect();
            let max = row
                .iter()
                .fold(f64::NEG_INFINITY, |m, &l| m.max(f64::from(l)));
            let want = max
                + row
                    .iter()
                    .map(|&l| (f64::from(l) - max).exp())
                    .sum::<f64>()
                    .ln();
            let row_max = max_in_lanes(&row);
            assert_eq!(checked_row_max(CpuIsa::Portable, &row), (row_max, true));
            let got = log_sum_exp_in_lanes(&row, row_max);
            assert!((got - want).abs() < 1e-5, "len {len}: {got} vs {want}");
            assert_eq!(
                log_sum_exp(CpuIsa::detect(), &row, row_max).to_bits(),
                got.to_bits(),
                "len {len}"
            );
            for isa in CpuIsa::available() {
                assert_eq!(checked_row_max(isa, &row), (row_max, true), "{isa:?}");
                let simd = log_sum_exp(isa, &row, row_max);
                assert_eq!(simd.to_bits(), got.to_bits(), "len {len} {isa:?}");
            }
        }
    }

    const LOGITS8: [f32; 8] = [1.0, 0.5, 2.0, -1.0, 0.0, 1.5, -0.5, 0.3];

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            ..Default::default()
        }
    }

    fn input<'a>(logits: &'a [f32], p: &'a SamplingParams, seed: u64, pos: u64) -> SampleInput<'a> {
        SampleInput {
            logits,
            params: p,
            seed,
            position: pos,
            prompt_tokens: &[],
            output_tokens: &[],
            banned_tokens: &[],
        }
    }

    fn softmax(l: &[f32], t: f64) -> Vec<f64> {
        let m = l
            .iter()
            .fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64 / t));
        let e: Vec<f64> = l.iter().map(|&x| (x as f64 / t - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|x| x / s).collect()
    }

    fn counts(logits: &[f32], p: &SamplingParams, seed: u64, n: u64) -> Vec<u64> {
        let mut c = vec![0u64; logits.len()];
        for pos in 0..n {
            c[sample(&input(logits, p, seed, pos)).unwrap().token as usize] += 1;
        }
        c
    }

    fn chi_square(counts: &[u64], probs: &[f64]) -> f64 {
        let n: u64 = counts.iter().sum();
        counts
            .iter()
            .zip(probs)
            .map(|(&c, &p)| {
                let e = p * n as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum()
    }

    fn param_name(r: Result<SampledToken>) -> String {
        match r {
            Err(DetspecError::InvalidParameter { name, .. }) => name,
            other => panic!("expected InvalidParameter, got {other:?}"),
        }
    }

    #[test]
    fn greedy_picks_argmax_lowest_id_on_ties() {
        let p = params(0.0);
        assert_eq!(sample(&input(&LOGITS8, &p, 0, 0)).unwrap().token, 2);
        let tied = [1.0f32, 3.0, 0.0, 3.0];
        for pos in 0..10 {
            assert_eq!(sample(&input(&tied, &p, pos, pos)).unwrap().token, 1);
        }
    }

    #[test]
    fn greedy_sees_penalties_and_bans() {
        let p = SamplingParams {
            temperature: 0.0,
            repetition_penalty: 2.0,
            ..Default::default()
        };
        // Token 2 (2.0) is halved to 1.0, so token 5 (1.5) wins.
        let mut inp = input(&LOGITS8, &p, 0, 0);
        inp.output_tokens = &[2];
        assert_eq!(sample(&inp).unwrap().token, 5);
        inp.output_tokens = &[];
        inp.banned_tokens = &[2, 5];
        assert_eq!(sample(&inp).unwrap().token, 0);
    }

    #[test]
    fn same_seed_and_position_same_token_different_seeds_differ() {
        let logits = vec![0.0f32; 64];
        let p = params(1.0);
        let mut differ = 0;
        for pos in 0..200 {
            let a = sample(&input(&logits, &p, 1, pos)).unwrap().token;
            assert_eq!(a, sample(&input(&logits, &p, 1, pos)).unwrap().token);
            let b = sample(&input(&logits, &p, 2, pos)).unwrap().token;
            differ += usize::from(a != b);
        }
        // Independent uniform draws over 64 tokens agree with probability 1/64.
        assert!(differ > 180, "only {differ} of 200 differ");
        // Different positions of the same seed also vary.
        let distinct: std::collections::HashSet<u32> = (0..200)
            .map(|pos| sample(&input(&logits, &p, 1, pos)).unwrap().token)
            .collect();
        assert!(distinct.len() > 40);
    }

    /// 0.999 quantile of chi-square with 7 degrees of freedom.
    const CHI2_7_999: f64 = 24.322;
    /// 0.999 quantile of chi-square with 1 degree of freedom.
    const CHI2_1_999: f64 = 10.828;

    #[test]
    fn chi_square_temperature_1() {
        let p = params(1.0);
        let c = counts(&LOGITS8, &p, 12345, 20_000);
        let stat = chi_square(&c, &softmax(&LOGITS8, 1.0));
        assert!(stat < CHI2_7_999, "chi2 {stat}, counts {c:?}");
    }

    #[test]
    fn chi_square_temperature_half() {
        let p = params(0.5);
        let c = counts(&LOGITS8, &p, 987, 20_000);
        let stat = chi_square(&c, &softmax(&LOGITS8, 0.5));
        assert!(stat < CHI2_7_999, "chi2 {stat}, counts {c:?}");
    }

    #[test]
    fn top_k_2_yields_only_top_two_in_renormalised_proportion() {
        let p = SamplingParams {
            top_k: 2,
            ..Default::default()
        };
        let c = counts(&LOGITS8, &p, 5, 20_000);
        for (i, &n) in c.iter().enumerate() {
            if i != 2 && i != 5 {
                assert_eq!(n, 0, "token {i} sampled under top_k=2");
            }
        }
        let renorm = softmax(&[LOGITS8[2], LOGITS8[5]], 1.0);
        let stat = chi_square(&[c[2], c[5]], &renorm);
        assert!(stat < CHI2_1_999, "chi2 {stat}, counts {c:?}");
    }

    #[test]
    fn top_p_and_min_p_only_sample_kept_sets() {
        // Probabilities 0.1, 0.5, 0.15, 0.25.
        let logits: Vec<f32> = [0.1f64, 0.5, 0.15, 0.25]
            .iter()
            .map(|p| p.ln() as f32)
            .collect();
        let top_p = SamplingParams {
            top_p: 0.7,
            ..Default::default()
        };
        let c = counts(&logits, &top_p, 11, 5_000);
        assert_eq!((c[0], c[2]), (0, 0), "{c:?}");
        let stat = chi_square(&[c[1], c[3]], &[2.0 / 3.0, 1.0 / 3.0]);
        assert!(stat < CHI2_1_999, "chi2 {stat}, counts {c:?}");

        let min_p = SamplingParams {
            min_p: 0.25,
            ..Default::default()
        };
        let c = counts(&logits, &min_p, 11, 5_000);
        assert_eq!(c[0], 0, "{c:?}");
        assert!(c[1] > 0 && c[2] > 0 && c[3] > 0, "{c:?}");
    }

    #[test]
    fn logprobs_match_f64_reference_and_are_raw() {
        let logits: Vec<f32> = (0..100)
            .map(|i| ((i * 37) % 23) as f32 * 0.37 - 3.0)
            .collect();
        let lse = {
            let m = logits.iter().cloned().fold(f32::MIN, f32::max) as f64;
            m + logits
                .iter()
                .map(|&l| (l as f64 - m).exp())
                .sum::<f64>()
                .ln()
        };
        let reference: Vec<f32> = logits.iter().map(|&l| (l as f64 - lse) as f32).collect();
        // Penalties, temperature and filters must not change the reported logprobs.
        let p = SamplingParams {
            temperature: 0.7,
            top_k: 10,
            repetition_penalty: 1.3,
            frequency_penalty: 0.5,
            logprobs: Some(5),
            ..Default::default()
        };
        let mut inp = input(&logits, &p, 3, 9);
        inp.prompt_tokens = &[1, 2, 3];
        inp.output_tokens = &[4, 4];
        let out = sample(&inp).unwrap();
        assert!((out.logprob - reference[out.token as usize]).abs() < 1e-6);
        assert_eq!(out.top_logprobs.len(), 5);
        let mut order: Vec<u32> = (0..100).collect();
        order.sort_by(|&a, &b| {
            logits[b as usize]
                .partial_cmp(&logits[a as usize])
                .unwrap()
                .then(a.cmp(&b))
        });
        for (k, &(t, lp)) in out.top_logprobs.iter().enumerate() {
            assert_eq!(t, order[k]);
            assert!((lp - reference[t as usize]).abs() < 1e-6);
        }
        let total: f64 = reference.iter().map(|&l| (l as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
    }

    #[test]
    fn top_logprobs_ties_by_id_and_capped_by_vocab() {
        let logits = [0.0f32, 1.0, 1.0, 0.5, 1.0];
        let p = SamplingParams {
            temperature: 0.0,
            logprobs: Some(4),
            ..Default::default()
        };
        let out = sample(&input(&logits, &p, 0, 0)).unwrap();
        let ids: Vec<u32> = out.top_logprobs.iter().map(|x| x.0).collect();
        assert_eq!(ids, vec![1, 2, 4, 3]);
        assert_eq!(out.token, 1);
        let p = SamplingParams {
            logprobs: Some(20),
            ..p
        };
        assert_eq!(
            sample(&input(&logits, &p, 0, 0))
                .unwrap()
                .top_logprobs
                .len(),
            5
        );
        let p = SamplingParams {
            logprobs: None,
            ..p
        };
        assert!(sample(&input(&logits, &p, 0, 0))
            .unwrap()
            .top_logprobs
            .is_empty());
    }

    #[test]
    fn bitwise_reproducible() {
        let logits: Vec<f32> = (0..5000)
            .map(|i| ((i as f32) * 0.618).sin() * 8.0)
            .collect();
        let p = SamplingParams {
            temperature: 0.8,
            top_p: 0.95,
            min_p: 0.01,
            presence_penalty: 0.3,
            repetition_penalty: 1.1,
            logprobs: Some(20),
            ..Default::default()
        };
        for pos in 100..140 {
            let mut inp = input(&logits, &p, 77, pos);
            inp.prompt_tokens = &[5, 6, 7];
            inp.output_tokens = &[10, 11, 10];
            let a = sample(&inp).unwrap();
            let b = sample(&inp).unwrap();
            assert_eq!(a.token, b.token);
            assert_eq!(a.logprob.to_bits(), b.logprob.to_bits());
            let bits = |s: &SampledToken| -> Vec<(u32, u32)> {
                s.top_logprobs
                    .iter()
                    .map(|&(t, l)| (t, l.to_bits()))
                    .collect()
            };
            assert_eq!(bits(&a), bits(&b));
        }
    }

    /// Scores every finite logit exactly and takes the first maximum: what [`gumbel_argmax`]
    /// must return.
    fn exhaustive_gumbel_argmax(logits: &[f32], seed: u64, pos: u64) -> Option<u32> {
        let mut best: Option<(u32, f64)> = None;
        for (i, &l) in logits.iter().enumerate() {
            if l == f32::NEG_INFINITY {
                continue;
            }
            let score = f64::from(l) + crate::sampling::rng::gumbel(seed, pos, i as u64);
            if best.is_none_or(|(_, b)| score > b) {
                best = Some((i as u32, score));
            }
        }
        best.map(|(i, _)| i)
    }

    #[test]
    fn gumbel_pruning_matches_exhaustive_argmax() {
        let logits: Vec<f32> = (0..3000)
            .map(|i| ((i * 7919) % 101) as f32 * 0.9 - 40.0)
            .collect();
        let p = params(1.0);
        for pos in 0..50 {
            let s = sample(&input(&logits, &p, 4, pos)).unwrap();
            assert_eq!(Some(s.token), exhaustive_gumbel_argmax(&logits, 4, pos));
            assert_eq!(s.rank, rank_of(&logits, s.token));
        }
        let greedy = sample(&input(&logits, &params(0.0), 4, 0)).unwrap();
        assert_eq!((greedy.rank, rank_of(&logits, greedy.token)), (1, 1));
    }

    /// The `n` best by a full sort in `rank_desc` order: what [`top_n`] must return.
    fn top_n_by_sort(logits: &[f32], n: usize) -> Vec<u32> {
        let mut ids: Vec<u32> = (0..logits.len() as u32)
            .filter(|&t| logits[t as usize] > f32::NEG_INFINITY)
            .collect();
        ids.sort_by(|&a, &b| rank_desc(logits, a, b));
        ids.truncate(n);
        ids
    }

    #[test]
    fn checked_row_max_finds_nan_and_inf_in_every_lane_and_the_tail() {
        for len in [1usize, 15, 16, 17, 40] {
            for at in 0..len {
                for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                    let mut row: Vec<f32> = (0..len).map(|i| i as f32 * 0.5 - 3.0).collect();
                    row[at] = bad;
                    let want_max = row
                        .iter()
                        .copied()
                        .filter(|x| x.is_finite())
                        .fold(f32::NEG_INFINITY, f32::max);
                    for isa in CpuIsa::available() {
                        let (max, clean) = checked_row_max(isa, &row);
                        assert_eq!(clean, bad == f32::NEG_INFINITY, "{len} {at} {bad} {isa:?}");
                        if clean {
                            assert_eq!(max, want_max);
                        }
                    }
                    assert_eq!(check_row(&row).is_ok(), bad == f32::NEG_INFINITY);
                }
            }
        }
    }

    #[test]
    fn rank_of_counts_the_larger_logits() {
        let row = [1.0f32, 3.0, -0.0, 0.0, 3.0, f32::NEG_INFINITY, 2.0];
        let ranks: Vec<u32> = (0..row.len() as u32).map(|t| rank_of(&row, t)).collect();
        assert_eq!(ranks, vec![4, 1, 5, 5, 1, 7, 3]);
        assert_eq!(rank_of(&row, 99), 7);
    }

    #[test]
    fn top_n_sees_plus_zero_after_a_chunk_of_minus_zeros() {
        // +0 ranks ahead of -0 (`total_cmp`) although the two compare equal.
        let mut logits = vec![-0.0f32; 300];
        logits[150] = 0.0;
        assert_eq!(top_n(&logits, 5), vec![150, 0, 1, 2, 3]);
        assert_eq!(top_n(&logits, 5), top_n_by_sort(&logits, 5));
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(300))]

        /// Ties (few distinct values), ±0 and masks across chunk boundaries.
        #[test]
        fn top_n_is_the_sorted_prefix(
            values in proptest::collection::vec(-4i32..4, 1..1500),
            n in 1usize..25,
            masked_every in 0usize..4,
        ) {
            let mut logits = tied_logits(&values, 0.5);
            mask_every(&mut logits, masked_every);
            proptest::prop_assert_eq!(top_n(&logits, n), top_n_by_sort(&logits, n));
        }

        /// Rows of every spread (all within one noise bucket's width of each other, up to far
        /// beyond `GUMBEL_MAX`), sorted either way or not, with ties and `-inf` masks.
        #[test]
        fn bounded_gumbel_argmax_is_the_exhaustive_one(
            values in proptest::collection::vec(-1000i32..1000, 1..3000),
            scale in proptest::sample::select(vec![1e-6f32, 1e-3, 0.01, 0.1, 1.0, 5.0, 100.0]),
            order in 0u8..3,
            masked_every in 0usize..5,
            seed in proptest::prelude::any::<u64>(),
            pos in 0u64..100_000,
        ) {
            let mut logits: Vec<f32> = values.iter().map(|&v| v as f32 * scale).collect();
            match order {
                1 => logits.sort_by(f32::total_cmp),
                2 => logits.sort_by(|a, b| b.total_cmp(a)),
                _ => {}
            }
            mask_every(&mut logits, masked_every);
            proptest::prop_assert_eq!(
                gumbel_argmax(&logits, seed, pos),
                exhaustive_gumbel_argmax(&logits, seed, pos)
            );
        }
    }

    #[test]
    fn errors_not_panics() {
        let p = params(1.0);
        assert_eq!(param_name(sample(&input(&[], &p, 0, 0))), "logits");
        assert_eq!(
            param_name(sample(&input(&[0.0, f32::NAN], &p, 0, 0))),
            "logits"
        );
        assert_eq!(
            param_name(sample(&input(&[0.0, f32::INFINITY], &p, 0, 0))),
            "logits"
        );
        let all_masked = [f32::NEG_INFINITY; 3];
        assert_eq!(param_name(sample(&input(&all_masked, &p, 0, 0))), "logits");
        let mut inp = input(&[0.0, 1.0], &p, 0, 0);
        inp.banned_tokens = &[0, 1];
        assert_eq!(param_name(sample(&inp)), "logits");
        inp.banned_tokens = &[2];
        assert_eq!(param_name(sample(&inp)), "banned_tokens");
        inp.banned_tokens = &[];
        inp.prompt_tokens = &[9];
        assert_eq!(param_name(sample(&inp)), "prompt_tokens");
        inp.prompt_tokens = &[];
        inp.output_tokens = &[2];
        assert_eq!(param_name(sample(&inp)), "output_tokens");
        // Overflow to +inf through a tiny repetition penalty is an error, not a NaN.
        let p = SamplingParams {
            repetition_penalty: 1e-38,
            ..Default::default()
        };
        let mut inp = input(&[1e3, 0.0], &p, 0, 0);
        inp.prompt_tokens = &[0];
        assert_eq!(param_name(sample(&inp)), "logits");
    }

    #[test]
    fn neg_inf_raw_logits_are_a_valid_mask() {
        let logits = [f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY, 0.0];
        let p = SamplingParams {
            logprobs: Some(4),
            ..Default::default()
        };
        for pos in 0..50 {
            let out = sample(&input(&logits, &p, 1, pos)).unwrap();
            assert!(out.token == 1 || out.token == 3);
            assert!((out.logprob - (0.5f32).ln()).abs() < 1e-7);
            // Masked tokens are no alternatives: only the two live ones are listed.
            assert_eq!(out.top_logprobs.len(), 2);
            assert!(out.top_logprobs.iter().all(|(t, _)| *t == 1 || *t == 3));
        }
    }
}
