//! Forward passes over given token sequences, outside the scheduler: logits, hidden states,
//! scores of completions, prompt logprobs, audits of stored outputs, embeddings and
//! classifications.
//!
//! They run between engine steps on KV pages they take and return themselves. With
//! `fixed = true` they use the verify-path kernels (fixed attention schedule; the CPU's packed
//! GEMM is invariant to the row count), so every row is a function of its own sequence alone:
//! the numbers equal, bit for bit, those a deterministic request computes for the same tokens
//! however it was batched, chunked or rolled back.
//!
//! They share KV with the prefix cache as a prefill does ([`PrefixUse`]): rows before a
//! sequence's first wanted one come from cached pages where they can, and the pages computed
//! are registered once the forward is done, so a prompt scored first (prompt logprobs, echo,
//! what eval harnesses send) is not computed again by its generation, nor a generated prompt
//! again by `score`.

use std::ops::Range;
use std::sync::Arc;

use crate::dvr::{replay::fixed_shape_passes, ScoringShape};
use crate::error::{DetspecError, Result};
use crate::kv::{BlockTable, PageClass};
use crate::model::{ForwardBatch, LoraAdapter};
use crate::ops::{self, AttentionMetadata, AttentionSchedule};
use crate::output::TokenLogprobs;
use crate::sampling::{self, SamplingParams};

use super::EngineCore;

mod classify;
mod groups;
mod pooling;

pub use classify::Classification;
use groups::{GroupSeq, PrefixUse};
pub use pooling::{EmbedOptions, Pooling};

/// What a standalone forward returns for each wanted row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForwardKind {
    /// `[vocab]` logits.
    Logits,
    /// The last layer's hidden state after the final norm, `[hidden]`.
    Hidden,
}

/// A stored output to re-run: its prompt, parameters, completion index, token ids and the
/// LoRA adapter it ran with.
#[derive(Debug, Clone)]
pub struct AuditInput {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub completion_index: usize,
    pub token_ids: Vec<u32>,
    pub lora: Option<Arc<LoraAdapter>>,
}

/// What a sequence of a standalone forward runs with besides its tokens: its LoRA adapter,
/// and its request's cache salt (`kv::salt_hash`; 0: none), which confines the prefix-cache
/// pages it reads and leaves to its salt's namespace.
#[derive(Debug, Clone, Default)]
pub struct SeqScope {
    pub lora: Option<Arc<LoraAdapter>>,
    pub cache_salt: u64,
}

impl SeqScope {
    /// The base model's scope with `adapter`, unsalted.
    pub fn of_lora(adapter: Option<Arc<LoraAdapter>>) -> Self {
        Self {
            lora: adapter,
            cache_salt: 0,
        }
    }
}

/// Each sequence's scope, by index (shorter than the sequences, or empty: the base model,
/// unsalted, for the rest).
pub type Scopes<'a> = &'a [SeqScope];

/// Sequence `i`'s scope in `scopes`.
pub(super) fn scope_of(scopes: Scopes<'_>, i: usize) -> SeqScope {
    scopes.get(i).cloned().unwrap_or_default()
}

/// Sequence `i`'s adapter in `scopes`.
pub(super) fn lora_of(scopes: Scopes<'_>, i: usize) -> Option<Arc<LoraAdapter>> {
    scopes.get(i).and_then(|s| s.lora.clone())
}

/// The prefix-cache namespace of sequence `i`'s KV (see `Sequence::cache_namespace`).
pub(super) fn namespace_of(scopes: Scopes<'_>, i: usize) -> u64 {
    let s = scopes.get(i);
    crate::kv::namespace(
        s.and_then(|s| s.lora.as_ref())
            .map_or(0, |a| a.content_hash()),
        s.map_or(0, |s| s.cache_salt),
    )
}

impl EngineCore {
    /// Runs each sequence (with its scope in `scopes`) and returns, per sequence, the rows of
    /// `wanted[i]` flattened (`rows × width`, width = vocab or hidden).
    pub fn forward_sequences(
        &mut self,
        seqs: &[Vec<u32>],
        wanted: &[Range<usize>],
        kind: ForwardKind,
        fixed: bool,
        scopes: Scopes<'_>,
    ) -> Result<Vec<Vec<f32>>> {
        let mut out = vec![Vec::new(); seqs.len()];
        self.for_each_row(seqs, wanted, (kind, fixed), scopes, &mut |i, row| {
            out[i].extend_from_slice(row);
            Ok(())
        })?;
        Ok(out)
    }

    /// Runs each sequence and hands `visit` each row of `wanted[i]` as `(i, row)`, a sequence's
    /// rows in order. Sequences run in groups ([`Self::reserve_group`]), and a group's rows are
    /// handed over before the next group runs, so what is held at once is one group's rows,
    /// not every row of the call.
    fn for_each_row(
        &self,
        seqs: &[Vec<u32>],
        wanted: &[Range<usize>],
        (kind, fixed): (ForwardKind, bool),
        scopes: Scopes<'_>,
        visit: RowVisitor<'_>,
    ) -> Result<()> {
        self.check_sequences(seqs)?;
        let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
        let first_wanted: Vec<usize> = wanted.iter().map(|w| w.start).collect();
        let lens: Vec<usize> = seqs.iter().map(Vec::len).collect();
        let prefix = match (fixed, self.policy.scoring_shape()) {
            (false, _) => PrefixUse::new(PageClass::Fast, &first_wanted, &lens),
            (true, ScoringShape::Any) => PrefixUse::new(PageClass::Invariant, &first_wanted, &lens),
            // Where GEMM bits depend on the row count these rows run at a shape no generation
            // runs at: their KV is not a deterministic prefill's, nor theirs a cached page's.
            (true, ScoringShape::Generation { .. }) => PrefixUse::NONE,
        };
        let budget = self.cfg.max_num_batched_tokens.max(1);
        self.in_groups(&refs, &prefix, scopes, budget, &mut |core, group, kv| {
            let seqs: Vec<&[u32]> = group.iter().map(|&i| refs[i]).collect();
            let wanted: Vec<Range<usize>> = group.iter().map(|&i| wanted[i].clone()).collect();
            let group_scopes: Vec<_> = group.iter().map(|&i| scope_of(scopes, i)).collect();
            let (width, rows) =
                core.forward_group(&seqs, &wanted, kv, (kind, fixed), &group_scopes)?;
            for (&i, flat) in group.iter().zip(rows) {
                for row in flat.chunks_exact(width.max(1)) {
                    visit(i, row)?;
                }
            }
            Ok(())
        })
    }

    /// Every sequence fits the context and the vocabulary.
    fn check_sequences(&self, seqs: &[Vec<u32>]) -> Result<()> {
        let max_len = self.info.max_model_len;
        let vocab = self.info.config.vocab_size;
        for (si, p) in seqs.iter().enumerate() {
            if p.is_empty() || p.len() > max_len {
                return Err(invalid(format!(
                    "sequence {si} has {} tokens (allowed 1..={max_len})",
                    p.len()
                )));
            }
            crate::engine::validate::check_token_ids(p, vocab, &format!("sequence {si}"))?;
        }
        Ok(())
    }

    /// One group's forward on the pages (and states) `kv` holds: the width of a row (vocab or
    /// hidden) and, per sequence, its wanted rows flattened.
    fn forward_group(
        &self,
        seqs: &[&[u32]],
        wanted: &[Range<usize>],
        kv: &[GroupSeq],
        (kind, fixed): (ForwardKind, bool),
        scopes: Scopes<'_>,
    ) -> Result<(usize, Vec<Vec<f32>>)> {
        let ps = self.cfg.page_size;
        let schedule = if fixed {
            AttentionSchedule::Fixed
        } else {
            // The rows this group computes: none of those read from the prefix cache.
            AttentionSchedule::split_kv_for_batch(
                seqs.len(),
                seqs.iter()
                    .zip(kv)
                    .map(|(s, g)| s.len() - g.table.num_tokens())
                    .sum(),
                (
                    self.info.config.num_attention_heads,
                    self.info.config.num_key_value_heads,
                ),
                self.model.device(),
            )
        };
        let mut batch = ForwardBatch {
            attention: AttentionMetadata {
                sliding_window: self.info.config.sliding_window,
                schedule,
                ..Default::default()
            },
            invariant_gemm: fixed,
            ..Default::default()
        };
        for (si, ((p, rows), g)) in seqs.iter().zip(wanted).zip(kv).enumerate() {
            let bt = &g.table;
            for (pos, &t) in p.iter().enumerate().skip(bt.num_tokens()) {
                let slot = bt.slot(pos, ps).ok_or_else(|| {
                    DetspecError::param("page_size", "slot missing after reserve")
                })?;
                if rows.contains(&pos) {
                    batch.logit_rows.push(batch.tokens.len() as u32);
                }
                batch.tokens.push(t);
                batch.slots.push(slot);
                batch.attention.positions.push(pos as u32);
                batch.attention.row_seq.push(si as u32);
            }
            batch.attention.block_tables.push(bt.pages().to_vec());
            batch.adapters.push(lora_of(scopes, si));
            batch.states.push(g.state_ref()?);
        }
        if batch.logit_rows.is_empty() {
            return Ok((0, vec![Vec::new(); seqs.len()]));
        }
        let t = match kind {
            ForwardKind::Logits => self.model.forward(&batch, &self.kv)?,
            ForwardKind::Hidden => self.model.final_hidden(&batch, &self.kv)?,
        };
        let width = t.dim(1)?;
        let flat = ops::to_f32_vec(&t)?;
        let mut rest = flat.as_slice();
        let mut out = Vec::with_capacity(seqs.len());
        for (p, rows) in seqs.iter().zip(wanted) {
            let n = rows.end.min(p.len()).saturating_sub(rows.start) * width;
            let (mine, tail) = rest.split_at(n.min(rest.len()));
            out.push(mine.to_vec());
            rest = tail;
        }
        Ok((width, out))
    }

    /// Per-position logits of each prompt, flattened `[len_i × vocab]`, on the verify-path
    /// kernels.
    pub fn prompt_logits(&mut self, prompts: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        self.require_language_model("token logits")?;
        let wanted: Vec<Range<usize>> = prompts.iter().map(|p| 0..p.len()).collect();
        self.forward_sequences(prompts, &wanted, ForwardKind::Logits, true, &[])
    }

    /// Last-layer hidden states (after the final norm) of each prompt, `[len_i × hidden]`.
    pub fn hidden_states(&mut self, prompts: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        let wanted: Vec<Range<usize>> = prompts.iter().map(|p| 0..p.len()).collect();
        self.forward_sequences(prompts, &wanted, ForwardKind::Hidden, true, &[])
    }

    /// Hands `visit` the logits of the rows that predict each completion's tokens, as
    /// `(pair, row)`, a pair's rows in order (the row at position p predicts the token at
    /// p + 1, so the last completion token is predicted, never fed).
    fn for_each_completion_row(
        &self,
        pairs: &[(Vec<u32>, Vec<u32>)],
        fixed: bool,
        scopes: Scopes<'_>,
        visit: RowVisitor<'_>,
    ) -> Result<()> {
        self.require_language_model("scoring completions")?;
        let mut seqs = Vec::with_capacity(pairs.len());
        let mut wanted = Vec::with_capacity(pairs.len());
        for (i, (prompt, completion)) in pairs.iter().enumerate() {
            if prompt.is_empty() {
                return Err(invalid(format!("prompt {i} is empty")));
            }
            let fed = completion.len().saturating_sub(1);
            seqs.push([prompt.as_slice(), &completion[..fed]].concat());
            wanted.push(prompt.len() - 1..prompt.len() - 1 + completion.len());
        }
        match self.policy.scoring_shape() {
            ScoringShape::Generation {
                prefill_rows,
                verify_rows,
                pad_page,
            } if fixed => {
                self.check_sequences(&seqs)?;
                // An empty completion has no row to score.
                let scored: Vec<usize> = (0..pairs.len())
                    .filter(|&i| !pairs[i].1.is_empty())
                    .collect();
                let seqs: Vec<&[u32]> = scored.iter().map(|&i| seqs[i].as_slice()).collect();
                let prompt_lens: Vec<usize> = scored.iter().map(|&i| pairs[i].0.len()).collect();
                // Each prompt's last row predicts its completion's first token.
                let first_wanted: Vec<usize> = prompt_lens.iter().map(|p| p - 1).collect();
                let scored_scopes: Vec<_> = scored.iter().map(|&i| scope_of(scopes, i)).collect();
                self.logits_as_generated(
                    &seqs,
                    (&prompt_lens, &first_wanted),
                    (prefill_rows, verify_rows),
                    pad_page,
                    &scored_scopes,
                    &mut |i, row| visit(scored[i], row),
                )
            }
            _ => self.for_each_row(&seqs, &wanted, (ForwardKind::Logits, fixed), scopes, visit),
        }
    }

    /// Hands `visit` the logits of rows `first_wanted[i]..` of each sequence `seqs[i]` (a
    /// prompt of `prompt_lens[i]` tokens and the completion tokens fed after it; the wanted
    /// rows start in the prompt), as `(i, row)`, computed in the shapes a deterministic
    /// generation of them ran at under replay: the prompts in passes of exactly `prefill_rows`
    /// rows (the isolated prefill), then the completions in passes of exactly `verify_rows`
    /// rows (the verify passes). At a fixed shape a row's bits depend only on its own
    /// sequence, so sequences share passes, as the requests of a verify pass do, and where a
    /// generation's chunks or windows began does not matter; for the same reason a prompt's
    /// rows before the first wanted one come from the prefix cache where a deterministic
    /// prefill left them, and the prompt pages computed here go there. Sequences run in groups
    /// ([`Self::reserve_group`]) of up to `max_num_batched_tokens` tokens or one verify pass.
    fn logits_as_generated(
        &self,
        seqs: &[&[u32]],
        (prompt_lens, first_wanted): (&[usize], &[usize]),
        shapes: (usize, usize),
        pad_page: u32,
        scopes: Scopes<'_>,
        visit: RowVisitor<'_>,
    ) -> Result<()> {
        let prefix = PrefixUse::new(PageClass::Invariant, first_wanted, prompt_lens);
        let budget = self.cfg.max_num_batched_tokens.max(shapes.1);
        self.in_groups(seqs, &prefix, scopes, budget, &mut |core, group, kv| {
            let pick = |of: &[usize]| group.iter().map(|&i| of[i]).collect::<Vec<_>>();
            let group_seqs: Vec<&[u32]> = group.iter().map(|&i| seqs[i]).collect();
            let group_scopes: Vec<_> = group.iter().map(|&i| scope_of(scopes, i)).collect();
            core.packed_logits(
                &group_seqs,
                (&pick(prompt_lens), &pick(first_wanted)),
                (kv, &group_scopes),
                shapes,
                pad_page,
                &mut |k, row| visit(group[k], row),
            )
        })
    }

    /// [`Self::logits_as_generated`] of sequences whose KV pages (and states) `kv` holds, in
    /// one group;
    /// each pass's rows are handed over before the next pass runs.
    fn packed_logits(
        &self,
        seqs: &[&[u32]],
        (prompt_lens, first_wanted): (&[usize], &[usize]),
        (kv, scopes): (&[GroupSeq], Scopes<'_>),
        (prefill_rows, verify_rows): (usize, usize),
        pad_page: u32,
        visit: RowVisitor<'_>,
    ) -> Result<()> {
        let ps = self.cfg.page_size;
        let vocab = self.info.config.vocab_size;
        // Each sequence's recurrent state (in `kv`) is carried from its prompt's passes to its
        // completion's.
        let tables: Vec<&BlockTable> = kv.iter().map(|g| &g.table).collect();
        // Rows `part(i)` of every sequence `i`, in order, as one batch.
        let rows = |part: &dyn Fn(usize) -> Range<usize>| -> Result<ForwardBatch> {
            let mut batch = ForwardBatch::default();
            batch.attention.sliding_window = self.info.config.sliding_window;
            batch.attention.block_tables = tables.iter().map(|t| t.pages().to_vec()).collect();
            batch.adapters = (0..tables.len()).map(|si| lora_of(scopes, si)).collect();
            batch.states = kv.iter().map(GroupSeq::state_ref).collect::<Result<_>>()?;
            for (si, (seq, table)) in seqs.iter().zip(&tables).enumerate() {
                for pos in part(si) {
                    let slot = table.slot(pos, ps).ok_or_else(|| {
                        DetspecError::param("page_size", "slot missing after reserve")
                    })?;
                    batch.tokens.push(seq[pos]);
                    batch.slots.push(slot);
                    batch.attention.positions.push(pos as u32);
                    batch.attention.row_seq.push(si as u32);
                }
            }
            Ok(batch)
        };
        // The prompts past their cached pages, which end before the first wanted row.
        let mut prompts = rows(&|si| tables[si].num_tokens()..prompt_lens[si])?;
        let mut first_row = 0;
        for (si, table) in tables.iter().enumerate() {
            let cached = table.num_tokens();
            let wanted = first_wanted[si].max(cached)..prompt_lens[si];
            prompts
                .logit_rows
                .extend(wanted.map(|pos| (first_row + pos - cached) as u32));
            first_row += prompt_lens[si] - cached;
        }
        // The completions fed after them: every row is wanted.
        let mut completions = rows(&|si| prompt_lens[si]..seqs[si].len())?;
        completions.logit_rows = (0..completions.tokens.len() as u32).collect();
        for (batch, pass_rows) in [(&prompts, prefill_rows), (&completions, verify_rows)] {
            let passes = fixed_shape_passes(batch, pass_rows, pad_page, ps);
            for (k, (pass, wanted)) in passes.iter().enumerate() {
                let logits = self.forward_f32(pass)?;
                for &row in wanted {
                    let si = batch
                        .attention
                        .row_seq
                        .get(k * pass_rows + row)
                        .ok_or_else(|| {
                            candle_core::Error::Msg(format!(
                                "pass {k} wants row {row}, past the batch"
                            ))
                        })?;
                    visit(*si as usize, logits_row(&logits, row, vocab)?)?;
                }
            }
        }
        Ok(())
    }

    /// The logits of a batch's logit rows, flattened.
    fn forward_f32(&self, batch: &ForwardBatch) -> Result<Vec<f32>> {
        Ok(ops::to_f32_vec(&self.model.forward(batch, &self.kv)?)?)
    }

    /// The logprob of every token of each completion given its prompt (the sampler's raw
    /// logprobs), with rank and the `top_n` most likely tokens. `fixed`: on the verify-path
    /// kernels, equal to what a deterministic request generating these tokens reported.
    /// `scopes`: each pair's adapter.
    pub fn score(
        &mut self,
        pairs: &[(Vec<u32>, Vec<u32>)],
        top_n: usize,
        fixed: bool,
        scopes: Scopes<'_>,
    ) -> Result<Vec<Vec<TokenLogprobs>>> {
        let mut out: Vec<Vec<TokenLogprobs>> = pairs
            .iter()
            .map(|(_, c)| Vec::with_capacity(c.len()))
            .collect();
        self.for_each_completion_row(pairs, fixed, scopes, &mut |i, row| {
            let token = pairs[i].1.get(out[i].len()).copied().ok_or_else(|| {
                candle_core::Error::Msg(format!("pair {i}: a row past its completion"))
            })?;
            out[i].push(sampling::score_token(row, token, top_n)?);
            Ok(())
        })?;
        Ok(out)
    }

    /// vLLM's prompt logprobs: for positions 1.. of each prompt, the logprob of the prompt's
    /// token there with its rank and the `top_n` most likely tokens (position 0 has none).
    /// `scopes`: each prompt's adapter.
    pub fn prompt_logprobs(
        &mut self,
        prompts: &[Vec<u32>],
        top_n: usize,
        scopes: Scopes<'_>,
    ) -> Result<Vec<Vec<TokenLogprobs>>> {
        self.require_language_model("prompt logprobs")?;
        if let ScoringShape::Generation {
            prefill_rows,
            verify_rows,
            pad_page,
        } = self.policy.scoring_shape()
        {
            let shapes = (prefill_rows, verify_rows);
            return self.prompt_logprobs_as_prefilled(prompts, top_n, shapes, pad_page, scopes);
        }
        let pairs: Vec<(Vec<u32>, Vec<u32>)> = prompts
            .iter()
            .map(|p| {
                (
                    p[..1.min(p.len())].to_vec(),
                    p.get(1..).unwrap_or_default().to_vec(),
                )
            })
            .collect();
        self.score(&pairs, top_n, true, scopes)
    }

    /// [`Self::prompt_logprobs`] where GEMM bits depend on the row count: every row computed
    /// as a deterministic prefill computes the prompt, in its `prefill_rows`-row passes, so
    /// the prompt pages left in the prefix cache are the ones its generation reads. (On
    /// invariant kernels any shape gives these bits, and the pairs of `prompt_logprobs` do.)
    fn prompt_logprobs_as_prefilled(
        &self,
        prompts: &[Vec<u32>],
        top_n: usize,
        shapes: (usize, usize),
        pad_page: u32,
        scopes: Scopes<'_>,
    ) -> Result<Vec<Vec<TokenLogprobs>>> {
        self.check_sequences(prompts)?;
        // Row j predicts the prompt's token j + 1: the last token is not fed, and a one-token
        // prompt has no row to score.
        let scored: Vec<usize> = (0..prompts.len())
            .filter(|&i| prompts[i].len() > 1)
            .collect();
        let seqs: Vec<&[u32]> = scored
            .iter()
            .map(|&i| &prompts[i][..prompts[i].len() - 1])
            .collect();
        let lens: Vec<usize> = seqs.iter().map(|s| s.len()).collect();
        let scored_scopes: Vec<_> = scored.iter().map(|&i| scope_of(scopes, i)).collect();
        let mut out = vec![Vec::new(); prompts.len()];
        self.logits_as_generated(
            &seqs,
            (&lens, &vec![0; seqs.len()]),
            shapes,
            pad_page,
            &scored_scopes,
            &mut |k, row| {
                let i = scored[k];
                let token = prompts[i].get(out[i].len() + 1).copied().ok_or_else(|| {
                    candle_core::Error::Msg(format!("prompt {i}: a row past its end"))
                })?;
                out[i].push(sampling::score_token(row, token, top_n)?);
                Ok(())
            },
        )?;
        Ok(out)
    }

    /// Re-runs stored outputs on the verify-path kernels with their tokens fed back (teacher
    /// forcing): at each position the sampler draws again from the recomputed logits with the
    /// request's seed and the stored tokens before it. Returns what it drew and reported per
    /// position, for the caller to compare with the stored output.
    pub fn audit(&mut self, items: &[AuditInput]) -> Result<Vec<Vec<TokenLogprobs>>> {
        self.require_language_model("audits of generated outputs")?;
        let mut seeds = Vec::with_capacity(items.len());
        let mut params = Vec::with_capacity(items.len());
        for (i, it) in items.iter().enumerate() {
            it.params.validate()?;
            // Bad words are banned in the re-run as they were in the run.
            let mut p = it.params.clone();
            p.bad_words_token_ids = self.bad_words_token_ids(&p)?;
            params.push(p);
            let seed = match it.params.seed {
                Some(s) => s,
                None if it.params.is_greedy() => 0,
                None => {
                    return Err(DetspecError::param(
                        "seed",
                        format!(
                            "output {i} was sampled with temperature > 0 and no seed: the \
                             engine chose one at random, so it cannot be re-run"
                        ),
                    ))
                }
            };
            seeds.push(sampling::completion_seed(seed, it.completion_index));
        }
        let pairs: Vec<(Vec<u32>, Vec<u32>)> = items
            .iter()
            .map(|it| (it.prompt.clone(), it.token_ids.clone()))
            .collect();
        let eos = self.info.eos_token_ids.clone();
        let grammars = self.grammars().clone();
        // A structured output is re-run under its grammar, which follows the stored tokens as
        // the sampler's history does.
        let mut constraints = items
            .iter()
            .map(|it| {
                it.params
                    .structured_outputs
                    .as_ref()
                    .map(|so| grammars.compile(so))
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        let mut out: Vec<Vec<TokenLogprobs>> = items
            .iter()
            .map(|it| Vec::with_capacity(it.token_ids.len()))
            .collect();
        let scopes: Vec<_> = items
            .iter()
            .map(|it| SeqScope::of_lora(it.lora.clone()))
            .collect();
        self.for_each_completion_row(&pairs, true, &scopes, &mut |i, row| {
            let it = &items[i];
            let before = it.token_ids.get(..out[i].len()).unwrap_or_default();
            let mask = match constraints[i].as_mut() {
                Some(c) => c.mask_after(before)?,
                None => None,
            };
            let drawn = sampling::sample_next(
                &params[i],
                seeds[i],
                &it.prompt,
                before,
                row,
                &eos,
                mask.as_deref(),
            )?;
            out[i].push(drawn);
            Ok(())
        })?;
        Ok(out)
    }
}

/// What a standalone forward hands each wanted row to: `(sequence index, row)`.
type RowVisitor<'a> = &'a mut dyn FnMut(usize, &[f32]) -> Result<()>;

/// Row `row` of a pass's flattened logits.
fn logits_row(logits: &[f32], row: usize, vocab: usize) -> Result<&[f32]> {
    logits.get(row * vocab..(row + 1) * vocab).ok_or_else(|| {
        candle_core::Error::Msg(format!("a fixed-shape pass returned no logits row {row}")).into()
    })
}

fn invalid(message: String) -> DetspecError {
    DetspecError::InvalidRequest {
        request_id: None,
        message,
    }
}
