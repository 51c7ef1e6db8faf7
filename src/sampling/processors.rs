//! Logits processors: penalties, bans, temperature and the top-k / top-p / min-p filters.
//!
//! Each processor rewrites one row of logits in place; a filtered-out token becomes `-inf`.
//! [`process_logits`] applies them in the order the sampler needs:
//! repetition penalty → frequency/presence penalties → logit bias → banned ids → temperature →
//! top-k → top-p → min-p. The allowed-token mask of a structured output comes before all of
//! them ([`mask_disallowed`]): it defines the distribution the logprobs are reported in.
//!
//! Determinism: the same row must give the same bits whether it is sampled on the fast path or
//! by the verifier, on any thread count. So every reduction here is a plain sequential loop in a
//! fixed order (no rayon, no SIMD-reassociated sums that decide anything: the top-p filter's
//! lane sums only bound the definition's, see `nucleus`), and every sort uses a *total* order
//! (`f32::total_cmp`, ties broken by token id), which makes the kept set unique even when
//! several tokens share a logit and independent of the sorting algorithm's stability.
//!
//! Token ids at or beyond the row length are ignored here; [`crate::sampling::sample`] rejects
//! them with an error before calling these.

pub use super::nucleus::apply_top_p;
use super::params::SamplingParams;
use super::rank::rank_key;

/// Sorted, de-duplicated copy of the ids that are inside the row.
fn distinct_in_range(ids: impl Iterator<Item = u32>, len: usize) -> Vec<u32> {
    let mut v: Vec<u32> = ids.filter(|&t| (t as usize) < len).collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// HF / CTRL repetition penalty: every distinct token seen in the prompt or the output has its
/// logit divided by `penalty` if positive, multiplied by it otherwise, so `penalty > 1`
/// always makes a seen token less likely. Each token is penalised once however often it occurs.
pub fn apply_repetition_penalty(
    logits: &mut [f32],
    prompt_tokens: &[u32],
    output_tokens: &[u32],
    penalty: f32,
) {
    if penalty == 1.0 {
        return;
    }
    let seen = distinct_in_range(
        prompt_tokens.iter().chain(output_tokens).copied(),
        logits.len(),
    );
    for t in seen {
        let l = &mut logits[t as usize];
        *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
    }
}

/// OpenAI / vLLM frequency and presence penalties over the generated tokens only:
/// `logit -= frequency_penalty * count + presence_penalty * (count > 0)`.
pub fn apply_frequency_presence_penalties(
    logits: &mut [f32],
    output_tokens: &[u32],
    frequency_penalty: f32,
    presence_penalty: f32,
) {
    if frequency_penalty == 0.0 && presence_penalty == 0.0 {
        return;
    }
    let mut sorted: Vec<u32> = output_tokens
        .iter()
        .copied()
        .filter(|&t| (t as usize) < logits.len())
        .collect();
    sorted.sort_unstable();
    for run in sorted.chunk_by(|a, b| a == b) {
        let count = run.len() as f32;
        logits[run[0] as usize] -= frequency_penalty * count + presence_penalty;
    }
}

/// OpenAI's `logit_bias`: adds each bias to its token's logit (ids in ascending order; one
/// addition per token, so the order cannot change a bit).
pub fn apply_logit_bias(logits: &mut [f32], bias: &std::collections::BTreeMap<u32, f32>) {
    for (&t, &b) in bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += b;
        }
    }
}

/// vLLM's `allowed_token_ids`: every other token's logit becomes `-inf`.
pub fn keep_allowed(logits: &mut [f32], allowed: Option<&[u32]>) {
    let Some(allowed) = allowed else { return };
    // The few allowed values aside, the row masked whole, the values put back: no
    // vocabulary-sized scratch per row.
    let kept: Vec<(usize, f32)> = allowed
        .iter()
        .filter_map(|&t| logits.get(t as usize).map(|&l| (t as usize, l)))
        .collect();
    logits.fill(f32::NEG_INFINITY);
    for (t, l) in kept {
        logits[t] = l;
    }
}

/// A copy of `logits` with every token not in `allowed` (bit `t % 32` of word `t / 32`) set
/// to `-inf`: the row a constrained request samples from and reports logprobs in (vLLM masks
/// before its sampler too).
pub fn mask_disallowed(logits: &[f32], allowed: &[u32]) -> Vec<f32> {
    logits
        .iter()
        .enumerate()
        .map(|(t, &l)| {
            let word = allowed.get(t / 32).copied().unwrap_or(0);
            if word >> (t % 32) & 1 == 1 {
                l
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect()
}

/// Sets the given tokens to `-inf` (e.g. EOS while fewer than `min_tokens` were generated; the
/// engine decides which ids, because it knows the tokenizer's EOS set and the output length).
pub fn ban_tokens(logits: &mut [f32], ids: &[u32]) {
    for &t in ids {
        if let Some(l) = logits.get_mut(t as usize) {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// Divides every logit by `temperature` (callers skip this for greedy requests, where the
/// temperature may be 0).
pub fn apply_temperature(logits: &mut [f32], temperature: f32) {
    if temperature == 1.0 {
        return;
    }
    for l in logits.iter_mut() {
        *l /= temperature;
    }
}

/// Keeps exactly the `k` most likely tokens (ties by lower id); `k <= 0` disables the filter.
pub fn apply_top_k(logits: &mut [f32], k: i32) {
    if k <= 0 || k as usize >= logits.len() {
        return;
    }
    let k = k as usize;
    let mut keys: Vec<u64> = logits
        .iter()
        .enumerate()
        .map(|(t, &l)| rank_key(t, l))
        .collect();
    // The keys are distinct, so the k smallest form a unique set and the unstable selection
    // is still deterministic.
    keys.select_nth_unstable(k - 1);
    for &key in &keys[k..] {
        logits[key as u32 as usize] = f32::NEG_INFINITY;
    }
}

/// Min-p filter: drops tokens whose probability is below `min_p` times the largest probability.
/// `min_p <= 0` disables it.
///
/// `p_i / p_max = exp(l_i - l_max)` whatever the normalisation, so this needs only the maximum
/// (and is unaffected by what earlier filters removed); the most likely token always survives.
pub fn apply_min_p(logits: &mut [f32], min_p: f32) {
    if min_p <= 0.0 {
        return;
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return;
    }
    let (max, min_p) = (f64::from(max), f64::from(min_p));
    // `exp(d) < min_p` is `d < ln(min_p)` but for the rounding of `exp` and `ln` (relative
    // 1e-16, absolute below 1e-13 here): a logit further than `MARGIN` from the cut is decided by
    // the comparison, and only the few near it need the `exp` that defines the filter.
    const MARGIN: f64 = 1e-9;
    let cut = min_p.ln();
    for l in logits.iter_mut() {
        if *l == f32::NEG_INFINITY {
            continue;
        }
        let d = f64::from(*l) - max;
        let below = if d < cut - MARGIN {
            true
        } else if d > cut + MARGIN {
            false
        } else {
            d.exp() < min_p
        };
        if below {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// Whether [`process_logits`] changes a greedy request's logits besides banning tokens (its
/// penalties; temperature and the filters do not apply to greedy).
pub fn changes_greedy_logits(params: &SamplingParams) -> bool {
    params.repetition_penalty != 1.0
        || params.frequency_penalty != 0.0
        || params.presence_penalty != 0.0
        || !params.logit_bias.is_empty()
        || params.allowed_token_ids.is_some()
}

/// Applies every processor in the sampler's order.
///
/// For greedy requests only the penalties and bans run: temperature would divide by ~0, and the
/// filters always keep the argmax, so skipping them cannot change the greedy choice.
pub fn process_logits(
    logits: &mut [f32],
    params: &SamplingParams,
    prompt_tokens: &[u32],
    output_tokens: &[u32],
    banned_tokens: &[u32],
) {
    apply_repetition_penalty(
        logits,
        prompt_tokens,
        output_tokens,
        params.repetition_penalty,
    );
    apply_frequency_presence_penalties(
        logits,
        output_tokens,
        params.frequency_penalty,
        params.presence_penalty,
    );
    apply_logit_bias(logits, &params.logit_bias);
    keep_allowed(logits, params.allowed_token_ids.as_deref());
    ban_tokens(logits, banned_tokens);
    if params.is_greedy() {
        return;
    }
    apply_temperature(logits, params.temperature);
    apply_top_k(logits, params.top_k);
    apply_top_p(logits, params.top_p);
    apply_min_p(logits, params.min_p);
}

#[cfg(test)]
mod tests {
    use super::super::nucleus::nucleus_len;
    use super::super::rank::{alive_ids_by_rank, rank_desc};
    use super::*;
    use crate::sampling::test_rows::{mask_every, tied_logits};

    const NEG: f32 = f32::NEG_INFINITY;

    /// The nucleus filter over every alive token, none left out of the sort and the sum.
    fn top_p_over_every_token(logits: &mut [f32], top_p: f32) {
        let idx = alive_ids_by_rank(logits, |_| true);
        if top_p >= 1.0 || idx.is_empty() {
            return;
        }
        let max = f64::from(logits[idx[0] as usize]);
        let keep = nucleus_len(logits, &idx, max, top_p);
        for &t in &idx[keep..] {
            logits[t as usize] = NEG;
        }
    }

    /// The min-p filter by its definition: `exp` of every alive token.
    fn min_p_by_exp(logits: &mut [f32], min_p: f32) {
        let max = logits.iter().copied().fold(NEG, f32::max);
        if min_p <= 0.0 || max == NEG {
            return;
        }
        for l in logits.iter_mut() {
            if *l > NEG && (f64::from(*l) - f64::from(max)).exp() < f64::from(min_p) {
                *l = NEG;
            }
        }
    }

    fn bits(logits: &[f32]) -> Vec<u32> {
        logits.iter().map(|l| l.to_bits()).collect()
    }

    #[test]
    fn keep_allowed_masks_every_other_token() {
        let mut row = vec![1.0f32, 2.0, 3.0, 4.0];
        keep_allowed(&mut row, None);
        assert_eq!(row, [1.0, 2.0, 3.0, 4.0]);
        // Out-of-vocabulary ids are the validator's to refuse; here they allow nothing.
        keep_allowed(&mut row, Some(&[3, 1, 9]));
        assert_eq!(row, [NEG, 2.0, NEG, 4.0]);
        let params = SamplingParams {
            temperature: 0.0,
            allowed_token_ids: Some(vec![1]),
            ..Default::default()
        };
        // The greedy shortcut must not skip it.
        assert!(changes_greedy_logits(&params));
        let mut row = vec![5.0f32, 2.0, 3.0];
        process_logits(&mut row, &params, &[], &[], &[]);
        assert_eq!(row, [NEG, 2.0, NEG]);
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(400))]

        /// Spreads from a few logits to hundreds (so that many tokens are negligible), ties,
        /// ±0, masks; `top_p` near 1 too, where the tail decides.
        #[test]
        fn top_p_is_the_filter_over_every_token(
            values in proptest::collection::vec(-4000i32..4000, 1..2000),
            scale in proptest::sample::select(vec![1e-3f32, 0.01, 0.05, 0.2, 1.0]),
            masked_every in 0usize..4,
            top_p in proptest::sample::select(vec![0.01f32, 0.5, 0.9, 0.95, 0.999, 0.999_999_94]),
        ) {
            let mut logits: Vec<f32> = values.iter().map(|&v| v as f32 * scale).collect();
            mask_every(&mut logits, masked_every);
            let mut want = logits.clone();
            top_p_over_every_token(&mut want, top_p);
            apply_top_p(&mut logits, top_p);
            proptest::prop_assert_eq!(bits(&logits), bits(&want));
        }

        /// Ties, ±0, NaN-free masks; every k from 1 to past the row.
        #[test]
        fn top_k_keeps_the_k_first_in_rank_order(
            values in proptest::collection::vec(-6i32..6, 1..600),
            k in 1i32..700,
            masked_every in 0usize..4,
        ) {
            let mut logits = tied_logits(&values, 0.25);
            mask_every(&mut logits, masked_every);
            let mut want = logits.clone();
            if (k as usize) < want.len() {
                let mut ids: Vec<u32> = (0..want.len() as u32).collect();
                ids.sort_by(|&a, &b| rank_desc(&want, a, b));
                for &t in &ids[k as usize..] {
                    want[t as usize] = NEG;
                }
            }
            apply_top_k(&mut logits, k);
            proptest::prop_assert_eq!(bits(&logits), bits(&want));
        }

        /// Logits placed on the cut `max + ln(min_p)` and a few ulps either side, among others.
        #[test]
        fn min_p_is_its_definition(
            values in proptest::collection::vec(-2000i32..2000, 1..500),
            near in proptest::collection::vec(-4i32..=4, 0..50),
            min_p in proptest::sample::select(vec![1e-30f32, 1e-4, 0.05, 0.1, 0.3333, 0.9, 1.0]),
        ) {
            let mut logits: Vec<f32> = values.iter().map(|&v| v as f32 * 0.01).collect();
            let max = logits.iter().copied().fold(NEG, f32::max);
            let cut = (f64::from(max) + f64::from(min_p).ln()) as f32;
            for &k in &near {
                logits.push(f32::from_bits((cut.to_bits() as i32 + k) as u32));
            }
            let mut want = logits.clone();
            min_p_by_exp(&mut want, min_p);
            apply_min_p(&mut logits, min_p);
            proptest::prop_assert_eq!(bits(&logits), bits(&want));
        }
    }

    fn kept(logits: &[f32]) -> Vec<usize> {
        (0..logits.len()).filter(|&i| logits[i] > NEG).collect()
    }

    #[test]
    fn repetition_then_frequency_presence_numbers() {
        let mut l = vec![2.0f32, -2.0, 1.0, 0.5, 3.0];
        // Token 1 occurs in both prompt and output but is penalised once.
        apply_repetition_penalty(&mut l, &[0, 1], &[1, 2, 2], 2.0);
        assert_eq!(l, vec![1.0, -4.0, 0.5, 0.5, 3.0]);
        apply_frequency_presence_penalties(&mut l, &[1, 2, 2], 0.5, 0.25);
        // token 1: -4 - 0.5*1 - 0.25; token 2: 0.5 - 0.5*2 - 0.25.
        assert_eq!(l, vec![1.0, -4.75, -0.75, 0.5, 3.0]);
    }

    #[test]
    fn repetition_penalty_below_one_boosts_and_zero_stays_zero() {
        let mut l = vec![2.0f32, -2.0, 0.0];
        apply_repetition_penalty(&mut l, &[0, 1, 2], &[], 0.5);
        assert_eq!(l, vec![4.0, -1.0, 0.0]);
    }

    #[test]
    fn presence_only_and_negative_penalties() {
        let mut l = vec![0.0f32; 4];
        apply_frequency_presence_penalties(&mut l, &[3, 3, 3, 0], 0.0, 1.5);
        assert_eq!(l, vec![-1.5, 0.0, 0.0, -1.5]);
        let mut l = vec![0.0f32; 4];
        apply_frequency_presence_penalties(&mut l, &[3, 3, 3, 0], -1.0, 0.0);
        assert_eq!(l, vec![1.0, 0.0, 0.0, 3.0]);
    }

    #[test]
    fn penalties_ignore_out_of_range_ids() {
        let mut l = vec![1.0f32, 1.0];
        apply_repetition_penalty(&mut l, &[5], &[7], 2.0);
        apply_frequency_presence_penalties(&mut l, &[9], 1.0, 1.0);
        ban_tokens(&mut l, &[2]);
        assert_eq!(l, vec![1.0, 1.0]);
    }

    #[test]
    fn ban_and_temperature() {
        let mut l = vec![1.0f32, 2.0, -3.0];
        ban_tokens(&mut l, &[1]);
        assert_eq!(l, vec![1.0, NEG, -3.0]);
        apply_temperature(&mut l, 0.5);
        assert_eq!(l, vec![2.0, NEG, -6.0]);
    }

    #[test]
    fn top_k_keeps_k_with_ties_by_id() {
        let mut l = vec![0.5f32, 3.0, 1.0, 3.0, 1.0, -1.0];
        apply_top_k(&mut l, 3);
        assert_eq!(kept(&l), vec![1, 2, 3]);
        let mut l = vec![1.0f32, 2.0];
        apply_top_k(&mut l, 0);
        apply_top_k(&mut l, -1);
        apply_top_k(&mut l, 5);
        assert_eq!(kept(&l), vec![0, 1]);
    }

    #[test]
    fn top_p_keeps_expected_set() {
        // Probabilities 0.1, 0.5, 0.15, 0.25 (indices deliberately not in rank order).
        let base: Vec<f32> = [0.1f64, 0.5, 0.15, 0.25]
            .iter()
            .map(|p| p.ln() as f32)
            .collect();
        for (p, want) in [
            (0.3f32, vec![1]),
            (0.7, vec![1, 3]),
            (0.8, vec![1, 2, 3]),
            (0.95, vec![0, 1, 2, 3]),
            (1.0, vec![0, 1, 2, 3]),
        ] {
            let mut l = base.clone();
            apply_top_p(&mut l, p);
            assert_eq!(kept(&l), want, "top_p {p}");
        }
        // Kept logits are untouched.
        let mut l = base.clone();
        apply_top_p(&mut l, 0.7);
        assert_eq!(l[1].to_bits(), base[1].to_bits());
    }

    #[test]
    fn top_p_ties_by_id_and_at_least_one() {
        let mut l = vec![1.0f32; 4];
        apply_top_p(&mut l, 0.5);
        assert_eq!(kept(&l), vec![0, 1]);
        let mut l = vec![0.0f32, 10.0, 0.0];
        apply_top_p(&mut l, 1e-9);
        assert_eq!(kept(&l), vec![1]);
        let mut l = vec![NEG, NEG];
        apply_top_p(&mut l, 0.5);
        assert_eq!(kept(&l), Vec::<usize>::new());
    }

    #[test]
    fn top_p_after_top_k_renormalises() {
        // Probabilities 0.4, 0.3, 0.2, 0.1. After top-k=2 the renormalised masses are 4/7, 3/7;
        // top_p=0.5 then keeps only the first, top_p=0.6 keeps both.
        let base: Vec<f32> = [0.4f64, 0.3, 0.2, 0.1]
            .iter()
            .map(|p| p.ln() as f32)
            .collect();
        let mut l = base.clone();
        apply_top_k(&mut l, 2);
        apply_top_p(&mut l, 0.5);
        assert_eq!(kept(&l), vec![0]);
        let mut l = base.clone();
        apply_top_k(&mut l, 2);
        apply_top_p(&mut l, 0.6);
        assert_eq!(kept(&l), vec![0, 1]);
    }

    #[test]
    fn min_p_keeps_expected_set() {
        // Relative probabilities 1, 0.5, 0.1, 0.05.
        let base: Vec<f32> = [0.05f64, 1.0, 0.1, 0.5]
            .iter()
            .map(|p| p.ln() as f32)
            .collect();
        for (p, want) in [
            (0.0f32, vec![0, 1, 2, 3]),
            (0.08, vec![1, 2, 3]),
            (0.2, vec![1, 3]),
            (0.6, vec![1]),
            (1.0, vec![1]),
        ] {
            let mut l = base.clone();
            apply_min_p(&mut l, p);
            assert_eq!(kept(&l), want, "min_p {p}");
        }
    }

    #[test]
    fn process_logits_greedy_skips_temperature_and_filters() {
        let p = SamplingParams {
            temperature: 0.0,
            top_k: 1,
            repetition_penalty: 2.0,
            ..Default::default()
        };
        let mut l = vec![4.0f32, 3.0, 1.0];
        process_logits(&mut l, &p, &[0], &[], &[2]);
        assert_eq!(l, vec![2.0, 3.0, NEG]);
    }

    #[test]
    fn process_logits_full_pipeline() {
        let p = SamplingParams {
            temperature: 0.5,
            top_k: 3,
            top_p: 0.9,
            frequency_penalty: 1.0,
            ..Default::default()
        };
        let mut l = vec![1.0f32, 2.0, 0.0, 1.5, -1.0];
        process_logits(&mut l, &p, &[], &[1], &[4]);
        // Penalty: token 1 -> 1.0. Temperature: [2, 2, 0, 3, -inf]. Top-3: ids 3, 0, 1.
        // Top-p over e^3, e^2, e^2 (0.576, 0.212, 0.212): 0.9 needs all three.
        assert_eq!(l, vec![2.0, 2.0, NEG, 3.0, NEG]);
    }
}
