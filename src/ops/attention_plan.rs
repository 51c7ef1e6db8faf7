//! What a paged-attention call is asked to do besides its tensors: where each query row's keys
//! live and how they are reduced (the batch's plan, built by the engine), and the sizes read off
//! the operands, checked against that plan.
//!
//! Both bodies of the op read these: the CPU kernel (`paged_attention.rs`) and the CUDA one
//! (`cuda_attention.rs`). They live apart from either so neither body imports the other.

use candle_core::{bail, Device, Layout};

/// Keys per online-softmax block, aligned to absolute positions. A constant (not the page size)
/// so the reduction order, and hence the bits, do not depend on how the KV cache is paged.
pub const SOFTMAX_BLOCK: usize = 16;

/// Where each query row's keys live.
#[derive(Debug, Clone, Default)]
pub struct AttentionMetadata {
    /// Absolute position of each query row; the row attends to positions `0..=pos`.
    pub positions: Vec<u32>,
    /// Index into `block_tables` for each query row.
    pub row_seq: Vec<u32>,
    /// Per sequence: logical page index → physical page id.
    pub block_tables: Vec<Vec<u32>>,
    /// Attend only to the last `w` positions (Mistral-style sliding window).
    pub sliding_window: Option<usize>,
    /// Gemma 2's soft cap on the scaled scores, `c · tanh(s / c)` before the softmax.
    pub softcap: Option<f32>,
    pub schedule: AttentionSchedule,
    /// Per sequence (index into `block_tables`): its rows take the fixed schedule whatever
    /// `schedule` says (DVR's inline deterministic rows). Missing entries mean `false`.
    pub fixed_seqs: Vec<bool>,
}

/// How each row's key range is reduced.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AttentionSchedule {
    /// One sequential pass per (row, head): invariant to batch, position and threads.
    #[default]
    Fixed,
    /// Split each row's keys into this many page-aligned chunks (≥ 2) and merge.
    SplitKv { splits: usize },
}

impl AttentionSchedule {
    /// The fast path's heuristic: enough (row, head, split) tasks to occupy every CPU thread a
    /// few times over, or every GPU multiprocessor twice. Depends on the batch, hence
    /// batch-variant. The GPU counts query rows times KV heads (a block per row, KV head's
    /// group of query heads and split: one prompt's thousands of prefill rows fill it unsplit,
    /// where splitting them would only add a merge and partial results); the CPU counts
    /// sequences times query heads, the measure its speed was tuned with (which also splits a
    /// lone prompt's prefill, the prefill batch variance the CPU's negative controls detect).
    pub fn split_kv_for_batch(
        num_seqs: usize,
        num_rows: usize,
        (num_heads, num_kv_heads): (usize, usize),
        device: &Device,
    ) -> Self {
        let (target_tasks, tasks) = if device.is_cpu() {
            (
                4 * rayon::current_num_threads().max(1),
                num_seqs * num_heads,
            )
        } else {
            (2 * gpu_multiprocessors(device), num_rows * num_kv_heads)
        };
        let tasks = tasks.max(1);
        let splits = target_tasks.div_ceil(tasks).clamp(1, 16);
        if splits <= 1 {
            AttentionSchedule::Fixed
        } else {
            AttentionSchedule::SplitKv { splits }
        }
    }
}

#[cfg(feature = "cuda")]
fn gpu_multiprocessors(device: &Device) -> usize {
    super::cuda::multiprocessors(device)
}

#[cfg(not(feature = "cuda"))]
fn gpu_multiprocessors(_device: &Device) -> usize {
    1
}

impl AttentionMetadata {
    /// Checks every page lookup a kernel will make, so its parallel loop cannot index out of
    /// bounds.
    fn check(&self, rows: usize, page_size: usize, num_pages: usize) -> candle_core::Result<()> {
        if self.positions.len() != rows || self.row_seq.len() != rows {
            bail!(
                "paged_attention: metadata for {} rows, query has {rows}",
                self.positions.len()
            );
        }
        for (&pos, &seq) in self.positions.iter().zip(&self.row_seq) {
            let Some(bt) = self.block_tables.get(seq as usize) else {
                bail!(
                    "paged_attention: row refers to sequence {seq}, only {} given",
                    self.block_tables.len()
                );
            };
            let needed = pos as usize / page_size + 1;
            if bt.len() < needed {
                bail!(
                    "paged_attention: position {pos} needs {needed} pages, block table has {}",
                    bt.len()
                );
            }
            if let Some(&p) = bt[..needed].iter().find(|&&p| p as usize >= num_pages) {
                bail!("paged_attention: page {p} out of range ({num_pages} pages)");
            }
        }
        Ok(())
    }
}

/// The sizes of one attention call, read off its operands.
pub(super) struct AttentionShape {
    pub(super) rows: usize,
    pub(super) heads: usize,
    pub(super) dim: usize,
    pub(super) page_size: usize,
    pub(super) kv_heads: usize,
}

impl AttentionShape {
    /// Checks the operands' shapes against each other and `meta` against them.
    pub(super) fn read(
        meta: &AttentionMetadata,
        ql: &Layout,
        kl: &Layout,
        vl: &Layout,
    ) -> candle_core::Result<Self> {
        let (rows, heads, dim) = match ql.dims() {
            [t, h, d] => (*t, *h, *d),
            dims => bail!("paged_attention: q must be [tokens, heads, head_dim], got {dims:?}"),
        };
        let (num_pages, page_size, kv_heads) = match vl.dims() {
            [p, s, h, d] if *d == dim => (*p, *s, *h),
            dims => bail!("paged_attention: v_cache must be [pages, page_size, kv_heads, {dim}], got {dims:?}"),
        };
        if kl.dims() != [num_pages, kv_heads, dim, page_size] {
            bail!(
                "paged_attention: k_cache {:?} must be [pages, kv_heads, head_dim, page_size] = {:?}",
                kl.dims(),
                [num_pages, kv_heads, dim, page_size]
            );
        }
        if kv_heads == 0 || heads % kv_heads != 0 {
            bail!("paged_attention: {heads} query heads not a multiple of {kv_heads} kv heads");
        }
        meta.check(rows, page_size, num_pages)?;
        Ok(Self {
            rows,
            heads,
            dim,
            page_size,
            kv_heads,
        })
    }
}
