//! The replay batch ("Grouped, fixed-shape verification" and "Replay" in docs/architecture.md).
//!
//! For a sequence with committed output index V and speculative tokens u_0…u_{n−1}, the input is
//! [last committed token, u_0, …, u_{n−1}] at their absolute positions, attending to the committed
//! prefix; its KV overwrites the fast path's in the same slots. Every request is padded to W rows
//! and the group to B requests with padding rows that write to and read from the pad page, so every
//! pass has the same B × W shape and runs on the fixed attention schedule.

use crate::error::{DetspecError, Result};
use crate::kv::PageAllocator;
use crate::model::ForwardBatch;
use crate::ops::AttentionSchedule;
use crate::sched::{Scheduler, SequenceId};

use super::VerifyShape;

/// One sequence's part of a replay batch: `n` speculative tokens (n + 1 logit rows).
#[derive(Debug, Clone, Copy)]
pub struct ReplayWindow {
    pub seq: SequenceId,
    pub n: usize,
    /// Index of the window's first row among the pass's logit rows.
    pub first_row: usize,
}

/// A B × W batch ready for the forward pass.
#[derive(Debug)]
pub struct ReplayBatch {
    pub batch: ForwardBatch,
    /// Real windows, in batch order.
    pub windows: Vec<ReplayWindow>,
    /// Rows that carry no real token.
    pub padded_rows: usize,
}

/// Builds the replay batch of `members` (at most B), reserving KV for the verifier's writes.
pub fn build_replay_batch(
    sched: &mut Scheduler,
    alloc: &dyn PageAllocator,
    members: &[SequenceId],
    shape: &VerifyShape,
    pad_page: u32,
) -> Result<ReplayBatch> {
    let (w, b, ps) = (shape.window, shape.group, shape.page_size);
    let pad_slot = pad_page * ps as u32;
    let mut batch = ForwardBatch::default();
    batch.attention.sliding_window = shape.sliding_window;
    batch.attention.schedule = AttentionSchedule::Fixed;
    // Sequence index `b` of the batch is the dummy sequence owning the reserved page.
    let mut tables: Vec<Vec<u32>> = Vec::with_capacity(b + 1);
    let mut windows = Vec::with_capacity(members.len());
    for (si, &id) in members.iter().enumerate() {
        let Some(seq) = sched.get_mut(id) else {
            continue;
        };
        let (l, v) = (seq.prompt.len(), seq.verified);
        let first_row = if shape.project_all_rows {
            batch.tokens.len()
        } else {
            batch.logit_rows.len()
        };
        let mut n = seq.num_speculative().min(w - 1);
        // The verifier writes KV at positions l+v-1 ..= l+v-1+n.
        if seq.block_table.reserve(l + v + n, ps, alloc).is_err() {
            n = n.min(seq.block_table.capacity(ps).saturating_sub(l + v));
        }
        for j in 0..=n {
            let pos = l + v - 1 + j;
            let slot =
                seq.block_table
                    .slot(pos, ps)
                    .ok_or_else(|| DetspecError::InvalidRequest {
                        request_id: Some(seq.request_id.clone()),
                        message: format!("verify: position {pos} has no KV slot"),
                    })?;
            if !shape.project_all_rows {
                batch.logit_rows.push(batch.tokens.len() as u32);
            }
            batch.tokens.push(seq.output[v - 1 + j]);
            batch.slots.push(slot);
            batch.attention.positions.push(pos as u32);
            batch.attention.row_seq.push(si as u32);
        }
        for _ in n + 1..w {
            push_pad_row(&mut batch, pad_slot, b as u32);
        }
        tables.push(seq.block_table.pages().to_vec());
        batch.adapters.push(seq.lora.clone());
        batch
            .states
            .push(seq.states.as_ref().map(|s| s.replay(n + 1)).transpose()?);
        windows.push(ReplayWindow {
            seq: id,
            n,
            first_row,
        });
    }
    for _ in windows.len()..b {
        tables.push(Vec::new());
        for _ in 0..w {
            push_pad_row(&mut batch, pad_slot, b as u32);
        }
    }
    tables.push(vec![pad_page]);
    batch.attention.block_tables = tables;
    let real_rows: usize = windows.iter().map(|w| w.n + 1).sum();
    let padded_rows = b * w - real_rows;
    if shape.project_all_rows {
        batch.logit_rows = (0..(b * w) as u32).collect();
    }
    Ok(ReplayBatch {
        batch,
        windows,
        padded_rows,
    })
}

/// `batch` (rows of one or more sequences, in order, with their block tables) cut into passes
/// of exactly `rows` rows, padded on the pad page, every row projected in a pass that holds
/// one of `batch`'s logit rows (the others skip the LM head): the deterministic prefill on
/// GEMMs whose bits depend on M. Each row's KV and logits are then computed at M = `rows`
/// whoever runs the prompt, wherever its chunks begin and whatever rows share its pass, so
/// its pages are the same bits for every request with that prefix. Row `r` of `batch` is
/// row `r % rows` of pass `r / rows`. Returns each pass with the indices in it of `batch`'s
/// logit rows that fall in it, in order.
pub fn fixed_shape_passes(
    batch: &ForwardBatch,
    rows: usize,
    pad_page: u32,
    page_size: usize,
) -> Vec<(ForwardBatch, Vec<usize>)> {
    let n = batch.tokens.len();
    // Padding rows attend through a table of their own, after the sequences'.
    let mut tables = batch.attention.block_tables.clone();
    let pad_seq = tables.len() as u32;
    tables.push(vec![pad_page]);
    let mut passes = Vec::with_capacity(n.div_ceil(rows.max(1)));
    for start in (0..n).step_by(rows.max(1)) {
        let end = (start + rows).min(n);
        let mut pass = ForwardBatch::default();
        pass.attention.sliding_window = batch.attention.sliding_window;
        pass.attention.schedule = AttentionSchedule::Fixed;
        pass.attention.block_tables = tables.clone();
        pass.adapters = batch.adapters.clone();
        pass.states = batch.states.clone();
        pass.tokens.extend_from_slice(&batch.tokens[start..end]);
        pass.slots.extend_from_slice(&batch.slots[start..end]);
        pass.attention
            .positions
            .extend_from_slice(&batch.attention.positions[start..end]);
        pass.attention
            .row_seq
            .extend_from_slice(&batch.attention.row_seq[start..end]);
        for _ in end - start..rows {
            push_pad_row(&mut pass, pad_page * page_size as u32, pad_seq);
        }
        let wanted: Vec<usize> = batch
            .logit_rows
            .iter()
            .map(|&r| r as usize)
            .filter(|r| (start..end).contains(r))
            .map(|r| r - start)
            .collect();
        // A pass none of whose logits are wanted skips the LM head: its KV (all a later pass
        // reads) does not depend on it.
        if !wanted.is_empty() {
            pass.logit_rows = (0..rows as u32).collect();
        }
        passes.push((pass, wanted));
    }
    passes
}

/// A padding row: writes to and reads from the pad page only.
pub(crate) fn push_pad_row(batch: &mut ForwardBatch, pad_slot: u32, dummy_seq: u32) {
    batch.tokens.push(0);
    batch.slots.push(pad_slot);
    batch.attention.positions.push(0);
    batch.attention.row_seq.push(dummy_seq);
}
