//! Causal attention of a flat varlen batch against the paged KV cache.
//!
//! Two schedules:
//! - [`AttentionSchedule::Fixed`] (the verify schedule): each (query row, head) pair is one task
//!   that walks the row's keys page by page in increasing position order with an online
//!   (blockwise) softmax. Every reduction order is fixed by the row's own position, so the
//!   kernel is batch-invariant, position-invariant and thread-count-invariant.
//! - [`AttentionSchedule::SplitKv`] (the fast path, flash-decoding style): each row's key range
//!   is cut into `splits` page-aligned chunks computed in parallel and merged afterwards. The
//!   engine picks `splits` from the batch size to keep all threads busy when few sequences
//!   decode, which makes results depend on the batch: fast, and batch-variant on purpose.

use std::sync::Arc;

use candle_core::{bail, CpuStorage, CustomOp3, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::{contiguous_f32, exp_nonpositive, CpuIsa};

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
    /// The fast path's heuristic: enough (row, head, split) tasks to occupy every thread a few
    /// times over. Depends on how many sequences are in the batch, hence batch-variant.
    pub fn split_kv_for_batch(num_seqs: usize, num_heads: usize) -> Self {
        let target_tasks = 4 * rayon::current_num_threads().max(1);
        let tasks = (num_seqs * num_heads).max(1);
        let splits = target_tasks.div_ceil(tasks).clamp(1, 16);
        if splits <= 1 {
            AttentionSchedule::Fixed
        } else {
            AttentionSchedule::SplitKv { splits }
        }
    }
}

struct PagedAttention {
    meta: Arc<AttentionMetadata>,
    scale: f32,
    isa: CpuIsa,
}

impl PagedAttention {
    /// Checks every page lookup the kernel will make, so the parallel loop cannot index out of
    /// bounds.
    fn check(&self, rows: usize, page_size: usize, num_pages: usize) -> candle_core::Result<()> {
        let m = &self.meta;
        if m.positions.len() != rows || m.row_seq.len() != rows {
            bail!(
                "paged_attention: metadata for {} rows, query has {rows}",
                m.positions.len()
            );
        }
        for (&pos, &seq) in m.positions.iter().zip(&m.row_seq) {
            let Some(bt) = m.block_tables.get(seq as usize) else {
                bail!(
                    "paged_attention: row refers to sequence {seq}, only {} given",
                    m.block_tables.len()
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
        self.check(rows, page_size, num_pages)?;
        let args = AttentionArgs {
            q,
            k_cache,
            v_cache,
            meta: &self.meta,
            scale: self.scale,
            rows,
            heads,
            kv_heads,
            dim,
            page_size,
        };
        let out = attention(&args, self.isa);
        Ok((CpuStorage::F32(out), ql.shape().clone()))
    }
}

/// Inputs of one attention call, checked by [`PagedAttention::check`].
#[derive(Clone, Copy)]
struct AttentionArgs<'a> {
    q: &'a [f32],
    k_cache: &'a [f32],
    v_cache: &'a [f32],
    meta: &'a AttentionMetadata,
    scale: f32,
    rows: usize,
    heads: usize,
    kv_heads: usize,
    dim: usize,
    page_size: usize,
}

impl AttentionArgs<'_> {
    /// Offset in the caches of key `j` of `row`'s sequence, KV head `kvh`.
    #[inline(always)]
    fn offset_of(&self, row: usize, kvh: usize, j: usize) -> KeyOffsets {
        let bt = &self.meta.block_tables[self.meta.row_seq[row] as usize];
        // Page sizes are powers of two in practice: shift and mask instead of a division per
        // key (which cost more than the key's dot product).
        let (page, in_page) = if self.page_size.is_power_of_two() {
            let shift = self.page_size.trailing_zeros();
            (j >> shift, j & (self.page_size - 1))
        } else {
            (j / self.page_size, j % self.page_size)
        };
        let page = bt[page] as usize;
        let slot = page * self.page_size + in_page;
        KeyOffsets {
            k: (page * self.kv_heads + kvh) * self.dim * self.page_size + in_page,
            v: (slot * self.kv_heads + kvh) * self.dim,
        }
    }

    /// Positions `row` attends to.
    #[inline(always)]
    fn key_range(&self, row: usize) -> std::ops::Range<usize> {
        let pos = self.meta.positions[row] as usize;
        let start = self
            .meta
            .sliding_window
            .map_or(0, |w| (pos + 1).saturating_sub(w));
        start..pos + 1
    }

    /// Folds keys `range` of the `acc.len() / dim` consecutive queries from `idx` (= row · heads
    /// + head; all of one KV head) into `acc`; per query `(max, denom)`.
    #[inline(always)]
    fn attend(
        &self,
        idx: usize,
        range: std::ops::Range<usize>,
        acc: &mut [f32],
    ) -> ([f32; MAX_GROUP], [f32; MAX_GROUP]) {
        let (row, head) = (idx / self.heads, idx % self.heads);
        let kvh = head / (self.heads / self.kv_heads);
        let g = acc.len() / self.dim;
        let mut part = Partial::new(acc, g);
        part.attend(
            &self.q[idx * self.dim..(idx + g) * self.dim],
            |j| self.offset_of(row, kvh, j),
            self.k_cache,
            self.v_cache,
            self.page_size,
            range,
            self.scale,
        );
        (part.max, part.denom)
    }

    /// The fixed schedule for the `o.len() / dim` queries of one KV head from query `idx`: all
    /// their keys in one pass, normalised. Each query's arithmetic is the same whether it is
    /// computed alone or with the other heads of its group (they only share the key loads).
    #[inline(always)]
    fn fixed_task(&self, idx: usize, o: &mut [f32]) {
        let range = self.key_range(idx / self.heads);
        for (c, o) in o.chunks_mut(MAX_GROUP * self.dim).enumerate() {
            let (_, denom) = self.attend(idx + c * MAX_GROUP, range.clone(), o);
            for (o, &d) in o.chunks_mut(self.dim).zip(&denom) {
                normalise(o, d);
            }
        }
    }

    /// Split `split` of `splits` of query `idx` (unnormalised); `(max, denom)`.
    #[inline(always)]
    fn split_task(&self, idx: usize, split: usize, splits: usize, acc: &mut [f32]) -> (f32, f32) {
        let range = self.key_range(idx / self.heads);
        let blocks = (range.end - range.start).div_ceil(SOFTMAX_BLOCK);
        let chunk = blocks.div_ceil(splits) * SOFTMAX_BLOCK;
        let lo = (range.start + split * chunk).min(range.end);
        let hi = (lo + chunk).min(range.end);
        let (max, denom) = self.attend(idx, lo..hi, acc);
        (max[0], denom[0])
    }
}

/// Scales `o` by `1 / denom` (when anything was attended).
#[inline(always)]
fn normalise(o: &mut [f32], denom: f32) {
    if denom > 0.0 {
        let inv = 1.0 / denom;
        o.iter_mut().for_each(|x| *x *= inv);
    }
}

// Per-task entry points compiled for each instruction set: the rayon closures below are
// compiled for baseline x86-64, so the vectorised work must sit behind a function that carries
// the target features (the arithmetic is the same in every build).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn fixed_task_avx512(a: &AttentionArgs, idx: usize, o: &mut [f32]) {
    a.fixed_task(idx, o)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fixed_task_avx2(a: &AttentionArgs, idx: usize, o: &mut [f32]) {
    a.fixed_task(idx, o)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn split_task_avx512(
    a: &AttentionArgs,
    idx: usize,
    split: usize,
    splits: usize,
    acc: &mut [f32],
) -> (f32, f32) {
    a.split_task(idx, split, splits, acc)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn split_task_avx2(
    a: &AttentionArgs,
    idx: usize,
    split: usize,
    splits: usize,
    acc: &mut [f32],
) -> (f32, f32) {
    a.split_task(idx, split, splits, acc)
}

/// Runs the batch's schedule on the rayon pool with instruction set `isa` (one this CPU has).
fn attention(a: &AttentionArgs, isa: CpuIsa) -> Vec<f32> {
    let (dim, heads, meta) = (a.dim, a.heads, a.meta);
    let fixed = |idx: usize, o: &mut [f32]| {
        // SAFETY: `isa` is one this CPU has (checked by `paged_attention_with_isa`).
        unsafe {
            match isa {
                #[cfg(target_arch = "x86_64")]
                CpuIsa::Avx512 => fixed_task_avx512(a, idx, o),
                #[cfg(target_arch = "x86_64")]
                CpuIsa::Avx2Fma => fixed_task_avx2(a, idx, o),
                _ => a.fixed_task(idx, o),
            }
        }
    };
    let mut out = vec![0f32; a.q.len()];
    match meta.schedule {
        AttentionSchedule::Fixed => {
            // One task per (row, KV head): the heads sharing its keys load them once.
            let group = heads / a.kv_heads;
            out.par_chunks_mut(group * dim)
                .enumerate()
                .for_each(|(t, o)| fixed(t * group, o));
        }
        AttentionSchedule::SplitKv { splits } => {
            // Partial (max, denominator, accumulator) per (row, head, split), then an
            // in-order merge per (row, head). Rows of fixed sequences (DVR's inline rows)
            // take the fixed schedule itself.
            let is_fixed = |idx: usize| {
                let seq = meta.row_seq[idx / heads] as usize;
                meta.fixed_seqs.get(seq).copied().unwrap_or(false)
            };
            let mut accs = vec![0f32; a.q.len() * splits];
            let mut stats = vec![(f32::NEG_INFINITY, 0f32); a.rows * heads * splits];
            accs.par_chunks_mut(dim)
                .zip(stats.par_iter_mut())
                .enumerate()
                .for_each(|(t, (acc, st))| {
                    let (idx, split) = (t / splits, t % splits);
                    if is_fixed(idx) {
                        return;
                    }
                    // SAFETY: as above.
                    *st = unsafe {
                        match isa {
                            #[cfg(target_arch = "x86_64")]
                            CpuIsa::Avx512 => split_task_avx512(a, idx, split, splits, acc),
                            #[cfg(target_arch = "x86_64")]
                            CpuIsa::Avx2Fma => split_task_avx2(a, idx, split, splits, acc),
                            _ => a.split_task(idx, split, splits, acc),
                        }
                    };
                });
            out.par_chunks_mut(dim).enumerate().for_each(|(idx, o)| {
                if is_fixed(idx) {
                    fixed(idx, o);
                    return;
                }
                let parts = &stats[idx * splits..(idx + 1) * splits];
                let m = parts.iter().fold(f32::NEG_INFINITY, |a, p| a.max(p.0));
                let mut denom = 0f32;
                for (s, &(pm, pd)) in parts.iter().enumerate() {
                    if pd == 0.0 {
                        continue;
                    }
                    let w = exp_nonpositive(pm - m);
                    denom += pd * w;
                    let acc = &accs[(idx * splits + s) * dim..(idx * splits + s + 1) * dim];
                    for (o, &a) in o.iter_mut().zip(acc) {
                        *o += a * w;
                    }
                }
                normalise(o, denom);
            });
        }
    }
    out
}

/// Where one key lives: `k` is the index of its element 0 in the (transposed) K cache, the
/// element `d` being `page_size · d` further; `v` the start of its row in the V cache.
#[derive(Clone, Copy, Default)]
struct KeyOffsets {
    k: usize,
    v: usize,
}

/// Most query heads folded together over one KV head's keys (larger GQA groups are split).
const MAX_GROUP: usize = 8;

/// Running online-softmax state of up to [`MAX_GROUP`] queries over the same keys; `acc`
/// (`g × dim`) is unnormalised. Every query's arithmetic is independent of the others'.
struct Partial<'a> {
    acc: &'a mut [f32],
    g: usize,
    max: [f32; MAX_GROUP],
    denom: [f32; MAX_GROUP],
}

impl<'a> Partial<'a> {
    #[inline(always)]
    fn new(acc: &'a mut [f32], g: usize) -> Self {
        acc.fill(0.0);
        Self {
            acc,
            g: g.min(MAX_GROUP),
            max: [f32::NEG_INFINITY; MAX_GROUP],
            denom: [0.0; MAX_GROUP],
        }
    }

    /// Folds in keys `range`, in blocks of [`SOFTMAX_BLOCK`] aligned to absolute positions (so
    /// the blocking, too, depends only on the range). Keys are stored per page transposed
    /// (`k_cache[page][kv_head][d][slot]`, element `d` of a key `page_size` apart), so the
    /// scores of a block's keys in one page are `head_dim` vector multiply-adds over the keys;
    /// each score is the sum over `d` in order of `q[d] · k[d]` (no FMA), however computed.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn attend(
        &mut self,
        qs: &[f32],
        offset_of: impl Fn(usize) -> KeyOffsets,
        k_cache: &[f32],
        v_cache: &[f32],
        page_size: usize,
        range: std::ops::Range<usize>,
        scale: f32,
    ) {
        let g = self.g;
        let dim = qs.len() / g.max(1);
        let block = SOFTMAX_BLOCK;
        let mut scores = [[0f32; SOFTMAX_BLOCK]; MAX_GROUP];
        let mut offsets = [KeyOffsets::default(); SOFTMAX_BLOCK];
        let mut next = [KeyOffsets::default(); SOFTMAX_BLOCK];
        let block_of = |j: usize, offs: &mut [KeyOffsets; SOFTMAX_BLOCK]| {
            let end = ((j / block + 1) * block).min(range.end);
            for (i, o) in offs[..end - j].iter_mut().enumerate() {
                *o = offset_of(j + i);
            }
            end
        };
        let mut probs = [[0f32; SOFTMAX_BLOCK]; MAX_GROUP];
        let mut j = range.start;
        let mut block_end = if j < range.end {
            block_of(j, &mut offsets)
        } else {
            j
        };
        while j < range.end {
            let n = block_end - j;
            // The next block usually sits on another (random) page: ask for its keys and values
            // now, so they arrive while this block is computed.
            let next_end = if block_end < range.end {
                let end = block_of(block_end, &mut next);
                let m = end - block_end;
                for d in 0..dim {
                    prefetch(k_cache, next[0].k + d * page_size, m);
                }
                for o in &next[..m] {
                    prefetch(v_cache, o.v, dim);
                }
                end
            } else {
                block_end
            };
            // Each score is the sum over d, in order, of q[d] · k[d], then scaled.
            let k0 = offsets[0].k;
            if offsets[..n].iter().enumerate().all(|(i, o)| o.k == k0 + i) {
                // The block's keys share a page: element d of the n keys is contiguous, so
                // each head's scores accumulate in one vector register. A full block is the
                // common case: passing the constant lets it compile without a remainder loop.
                let page = |n: usize, scores: &mut [[f32; SOFTMAX_BLOCK]; MAX_GROUP]| {
                    for (h, q) in qs.chunks_exact(dim).take(g).enumerate() {
                        let mut acc = [0f32; SOFTMAX_BLOCK];
                        for (d, &qd) in q.iter().enumerate() {
                            let kd = &k_cache[k0 + d * page_size..k0 + d * page_size + n];
                            for (a, &k) in acc.iter_mut().zip(kd) {
                                *a += qd * k;
                            }
                        }
                        for (s, a) in scores[h][..n].iter_mut().zip(acc) {
                            *s = a * scale;
                        }
                    }
                };
                if n == SOFTMAX_BLOCK {
                    page(SOFTMAX_BLOCK, &mut scores);
                } else {
                    page(n, &mut scores);
                }
            } else {
                // Pages smaller than a block: key by key.
                for (i, o) in offsets[..n].iter().enumerate() {
                    for (h, q) in qs.chunks_exact(dim).take(g).enumerate() {
                        let mut acc = 0f32;
                        for (d, &qd) in q.iter().enumerate() {
                            acc += qd * k_cache[o.k + d * page_size];
                        }
                        scores[h][i] = acc * scale;
                    }
                }
            }
            let mut new_max = [f32::NEG_INFINITY; MAX_GROUP];
            for h in 0..g {
                let block_max = scores[h][..n]
                    .iter()
                    .fold(f32::NEG_INFINITY, |m, &s| m.max(s));
                new_max[h] = self.max[h].max(block_max);
                let correction = exp_nonpositive(self.max[h] - new_max[h]);
                self.denom[h] *= correction;
                for o in self.acc[h * dim..(h + 1) * dim].iter_mut() {
                    *o *= correction;
                }
            }
            // Probabilities of the whole block at once (vectorised), then the denominators in
            // key order.
            for h in 0..g {
                for (p, &s) in probs[h][..n].iter_mut().zip(&scores[h][..n]) {
                    *p = exp_nonpositive(s - new_max[h]);
                }
                for &p in &probs[h][..n] {
                    self.denom[h] += p;
                }
            }
            for (i, o) in offsets[..n].iter().enumerate() {
                let v = &v_cache[o.v..o.v + dim];
                for (h, acc) in self.acc.chunks_exact_mut(dim).take(g).enumerate() {
                    let p = probs[h][i];
                    for (o, &v) in acc.iter_mut().zip(v) {
                        *o += p * v;
                    }
                }
            }
            self.max = new_max;
            j = block_end;
            block_end = next_end;
            offsets = next;
        }
    }
}

/// Hints the CPU to load `data[off..off + len]` into cache (a no-op elsewhere).
#[inline(always)]
fn prefetch(data: &[f32], off: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        const LINE: usize = 16; // floats per 64-byte cache line
        let mut i = off;
        while i < (off + len).min(data.len()) {
            // SAFETY: a prefetch never faults; the address is inside `data`.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    data.as_ptr().add(i) as *const i8,
                )
            };
            i += LINE;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, off, len);
}

/// Attention output `[tokens, heads, head_dim]` for queries `q` `[tokens, heads, head_dim]`
/// against the paged `k_cache` `[pages, kv_heads, head_dim, page_size]` (keys transposed per
/// page) and `v_cache` `[pages, page_size, kv_heads, head_dim]`.
pub fn paged_attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    meta: Arc<AttentionMetadata>,
    scale: f32,
) -> candle_core::Result<Tensor> {
    paged_attention_with_isa(q, k_cache, v_cache, meta, scale, CpuIsa::detect())
}

/// [`paged_attention`] with a given instruction set (one this CPU has: see
/// [`CpuIsa::available`]); every instruction set gives the same bits.
pub fn paged_attention_with_isa(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    meta: Arc<AttentionMetadata>,
    scale: f32,
    isa: CpuIsa,
) -> candle_core::Result<Tensor> {
    if !CpuIsa::available().contains(&isa) {
        bail!("paged_attention: this CPU cannot run {isa:?}");
    }
    q.contiguous()?
        .apply_op3_no_bwd(k_cache, v_cache, &PagedAttention { meta, scale, isa })
}
