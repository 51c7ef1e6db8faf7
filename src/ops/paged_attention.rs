//! Causal attention of a flat varlen batch against the paged KV cache.
//!
//! Each (query row, head) pair is computed by one task that walks that row's keys page by page
//! in increasing position order, with an online (blockwise) softmax. The order of every
//! reduction is therefore fixed by the row's own position, which makes this kernel
//! batch-invariant, position-invariant and thread-count-invariant. The fast path's split-KV
//! variant (a batch-dependent schedule) is added by the scheduler issue.

use std::sync::Arc;

use candle_core::{bail, CpuStorage, CustomOp3, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::contiguous_f32;

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
}

struct PagedAttention {
    meta: Arc<AttentionMetadata>,
    scale: f32,
}

impl PagedAttention {
    /// Checks every page lookup the kernel will make, so the parallel loop cannot index out of
    /// bounds.
    fn check(&self, rows: usize, page_size: usize, num_pages: usize) -> candle_core::Result<()> {
        let m = &self.meta;
        if m.positions.len() != rows || m.row_seq.len() != rows {
            bail!("paged_attention: metadata for {} rows, query has {rows}", m.positions.len());
        }
        for (&pos, &seq) in m.positions.iter().zip(&m.row_seq) {
            let Some(bt) = m.block_tables.get(seq as usize) else {
                bail!("paged_attention: row refers to sequence {seq}, only {} given", m.block_tables.len());
            };
            let needed = pos as usize / page_size + 1;
            if bt.len() < needed {
                bail!("paged_attention: position {pos} needs {needed} pages, block table has {}", bt.len());
            }
            if let Some(&p) = bt[..needed].iter().find(|&&p| p as usize >= num_pages) {
                bail!("paged_attention: page {p} out of range ({num_pages} pages)");
            }
        }
        Ok(())
    }
}

impl CustomOp3 for PagedAttention {
    fn name(&self) -> &'static str {
        "detspec-paged-attention"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let q = contiguous_f32(qs, ql, "paged_attention q")?;
        let k_cache = contiguous_f32(ks, kl, "paged_attention k_cache")?;
        let v_cache = contiguous_f32(vs, vl, "paged_attention v_cache")?;
        let (rows, heads, dim) = match ql.dims() {
            [t, h, d] => (*t, *h, *d),
            dims => bail!("paged_attention: q must be [tokens, heads, head_dim], got {dims:?}"),
        };
        let (num_pages, page_size, kv_heads) = match kl.dims() {
            [p, s, h, d] if *d == dim => (*p, *s, *h),
            dims => bail!("paged_attention: k_cache must be [pages, page_size, kv_heads, {dim}], got {dims:?}"),
        };
        if vl.dims() != kl.dims() {
            bail!("paged_attention: v_cache {:?} differs from k_cache {:?}", vl.dims(), kl.dims());
        }
        if kv_heads == 0 || heads % kv_heads != 0 {
            bail!("paged_attention: {heads} query heads not a multiple of {kv_heads} kv heads");
        }
        self.check(rows, page_size, num_pages)?;
        let group = heads / kv_heads;
        let meta = &self.meta;
        let scale = self.scale;
        let mut out = vec![0f32; q.len()];
        out.par_chunks_mut(dim).enumerate().for_each(|(idx, o)| {
            let (row, head) = (idx / heads, idx % heads);
            let kvh = head / group;
            let qv = &q[idx * dim..(idx + 1) * dim];
            let pos = meta.positions[row] as usize;
            let bt = &meta.block_tables[meta.row_seq[row] as usize];
            let start = meta.sliding_window.map_or(0, |w| (pos + 1).saturating_sub(w));
            attend_one(
                qv,
                o,
                |j| {
                    let slot = bt[j / page_size] as usize * page_size + j % page_size;
                    (slot * kv_heads + kvh) * dim
                },
                k_cache,
                v_cache,
                start..pos + 1,
                page_size,
                scale,
            );
        });
        Ok((CpuStorage::F32(out), ql.shape().clone()))
    }
}

/// One query vector against keys `range`, blockwise online softmax in page-sized blocks aligned
/// to absolute positions (so the blocking, too, depends only on the row's own positions).
#[allow(clippy::too_many_arguments)]
fn attend_one(
    q: &[f32],
    out: &mut [f32],
    offset_of: impl Fn(usize) -> usize,
    k_cache: &[f32],
    v_cache: &[f32],
    range: std::ops::Range<usize>,
    block: usize,
    scale: f32,
) {
    let dim = q.len();
    let mut running_max = f32::NEG_INFINITY;
    let mut denom = 0f32;
    out.fill(0.0);
    let mut scores = vec![0f32; block];
    let mut j = range.start;
    while j < range.end {
        let block_end = ((j / block + 1) * block).min(range.end);
        let n = block_end - j;
        let mut block_max = f32::NEG_INFINITY;
        for (i, s) in scores[..n].iter_mut().enumerate() {
            let off = offset_of(j + i);
            let k = &k_cache[off..off + dim];
            let mut dot = 0f32;
            for (a, b) in q.iter().zip(k) {
                dot += a * b;
            }
            *s = dot * scale;
            block_max = block_max.max(*s);
        }
        let new_max = running_max.max(block_max);
        let correction = (running_max - new_max).exp();
        denom *= correction;
        for o in out.iter_mut() {
            *o *= correction;
        }
        for (i, &s) in scores[..n].iter().enumerate() {
            let p = (s - new_max).exp();
            denom += p;
            let off = offset_of(j + i);
            for (o, &v) in out.iter_mut().zip(&v_cache[off..off + dim]) {
                *o += p * v;
            }
        }
        running_max = new_max;
        j = block_end;
    }
    if denom > 0.0 {
        let inv = 1.0 / denom;
        for o in out.iter_mut() {
            *o *= inv;
        }
    }
}

/// Attention output `[tokens, heads, head_dim]` for queries `q` `[tokens, heads, head_dim]`
/// against the paged `k_cache`/`v_cache` `[pages, page_size, kv_heads, head_dim]`.
pub fn paged_attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    meta: Arc<AttentionMetadata>,
    scale: f32,
) -> candle_core::Result<Tensor> {
    q.contiguous()?
        .apply_op3_no_bwd(k_cache, v_cache, &PagedAttention { meta, scale })
}
