//! Causal attention of a flat varlen batch against the paged KV cache.
//!
//! Two schedules:
//! - [`AttentionSchedule::Fixed`] (the verify schedule): each query (row, head) walks the row's
//!   keys in increasing position order with an online softmax over 16-key blocks aligned to
//!   absolute positions. Every reduction order is fixed by the row's own position, so the
//!   kernel is batch-invariant, position-invariant and thread-count-invariant. Queries that
//!   read the same keys (the heads of one KV head; consecutive rows of a prefill chunk) are
//!   computed together so they share the loads, never the arithmetic: `tests/attention_spec.rs`
//!   checks every query against a scalar write-out of this arithmetic.
//! - [`AttentionSchedule::SplitKv`] (the fast path, flash-decoding style): each row's key range
//!   is cut into `splits` page-aligned chunks computed in parallel and merged afterwards. The
//!   engine picks `splits` from the batch size to keep all threads busy when few sequences
//!   decode, which makes results depend on the batch: fast, and batch-variant on purpose.

use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::Arc;

use candle_core::{bail, CpuStorage, CustomOp3, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::attention_plan::{AttentionMetadata, AttentionSchedule, AttentionShape, SOFTMAX_BLOCK};
use super::{contiguous_f32, exp_nonpositive, tanh, zeroed, CpuIsa};

/// The op: one batch's plan and scale, and the instruction set the CPU body runs with.
struct PagedAttention {
    meta: Arc<AttentionMetadata>,
    scale: f32,
    /// gpt-oss's per-head sink logits ([`paged_attention_with_sinks`]).
    sinks: Option<Arc<[f32]>>,
    isa: CpuIsa,
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
        let AttentionShape {
            rows,
            heads,
            dim,
            page_size,
            kv_heads,
            ..
        } = AttentionShape::read(&self.meta, ql, kl, vl)?;
        macro_rules! run {
            ($k_cache:expr, $v_cache:expr) => {
                attention(
                    &AttentionArgs {
                        q,
                        k_cache: $k_cache,
                        v_cache: $v_cache,
                        meta: &self.meta,
                        scale: self.scale,
                        sinks: self.sinks.as_deref(),
                        rows,
                        heads,
                        kv_heads,
                        dim,
                        page_size,
                    },
                    self.isa,
                )
            };
        }
        // The cache is f32 or bf16 (K and V alike); bf16 is widened exactly as it is loaded.
        let out = match (ks, vs) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => run!(
                contiguous::<f32>(ks, kl, "paged_attention k_cache")?,
                contiguous::<f32>(vs, vl, "paged_attention v_cache")?
            ),
            (CpuStorage::BF16(_), CpuStorage::BF16(_)) => run!(
                contiguous::<half::bf16>(ks, kl, "paged_attention k_cache")?,
                contiguous::<half::bf16>(vs, vl, "paged_attention v_cache")?
            ),
            (k, v) => bail!(
                "paged_attention: K and V caches must both be f32 or both bf16, got {:?} and {:?}",
                candle_core::backend::BackendStorage::dtype(k),
                candle_core::backend::BackendStorage::dtype(v)
            ),
        };
        Ok((CpuStorage::F32(out), ql.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qs: &candle_core::CudaStorage,
        ql: &Layout,
        ks: &candle_core::CudaStorage,
        kl: &Layout,
        vs: &candle_core::CudaStorage,
        vl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        if self.sinks.is_some() {
            bail!("paged_attention: attention sinks have no CUDA kernel (the CPU's only)");
        }
        let shape = AttentionShape::read(&self.meta, ql, kl, vl)?;
        let out = super::cuda_attention::paged_attention(
            &self.meta,
            self.scale,
            &shape,
            (qs, ql),
            (ks, kl),
            (vs, vl),
        )?;
        Ok((out, ql.shape().clone()))
    }
}

/// The contiguous data of a cache operand, or an error naming it.
fn contiguous<'a, T: candle_core::WithDType>(
    s: &'a CpuStorage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<&'a [T]> {
    let data = s.as_slice::<T>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => bail!("{what}: expected a contiguous tensor"),
    }
}

/// Inputs of one attention call, checked by [`AttentionShape::read`]; the KV cache holds
/// elements `E` (f32 or bf16).
#[derive(Clone, Copy)]
struct AttentionArgs<'a, E> {
    q: &'a [f32],
    k_cache: &'a [E],
    v_cache: &'a [E],
    meta: &'a AttentionMetadata,
    scale: f32,
    /// Per query head, a logit that joins every softmax without a value (gpt-oss).
    sinks: Option<&'a [f32]>,
    rows: usize,
    heads: usize,
    kv_heads: usize,
    dim: usize,
    page_size: usize,
}

impl<'a, E: KvElem> AttentionArgs<'a, E> {
    /// What each raw score becomes before the softmax.
    #[inline(always)]
    fn score_map(&self) -> ScoreMap {
        ScoreMap {
            scale: self.scale,
            softcap: self.meta.softcap,
        }
    }

    /// Query head `head`'s sink logit, if the model has sinks.
    #[inline(always)]
    fn sink(&self, head: usize) -> Option<f32> {
        self.sinks.map(|s| s[head])
    }

    /// Query heads per KV head.
    #[inline(always)]
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// The block table of `row`'s sequence.
    #[inline(always)]
    fn block_table(&self, row: usize) -> &'a [u32] {
        &self.meta.block_tables[self.meta.row_seq[row] as usize]
    }

    /// Query `head` of `row`.
    #[inline(always)]
    fn query(&self, row: usize, head: usize) -> &'a [f32] {
        let at = (row * self.heads + head) * self.dim;
        &self.q[at..at + self.dim]
    }

    /// Positions `row` attends to.
    #[inline(always)]
    fn key_range(&self, row: usize) -> Range<usize> {
        let pos = self.meta.positions[row] as usize;
        let start = self
            .meta
            .sliding_window
            .map_or(0, |w| (pos + 1).saturating_sub(w));
        start..pos + 1
    }

    /// (page, slot in page) of key `j` in block table `bt`.
    #[inline(always)]
    fn page_of(&self, bt: &[u32], j: usize) -> (usize, usize) {
        // Page sizes are powers of two in practice: shift and mask instead of a division per
        // key (which cost more than the key's dot product).
        let (page, in_page) = if self.page_size.is_power_of_two() {
            let shift = self.page_size.trailing_zeros();
            (j >> shift, j & (self.page_size - 1))
        } else {
            (j / self.page_size, j % self.page_size)
        };
        (bt[page] as usize, in_page)
    }

    /// Where key `j` of KV head `kvh` starts in the K cache (element `d` is `page_size · d`
    /// further) and in the V cache.
    #[inline(always)]
    fn key_offsets(&self, bt: &[u32], kvh: usize, j: usize) -> (usize, usize) {
        let (page, in_page) = self.page_of(bt, j);
        let k = (page * self.kv_heads + kvh) * self.dim * self.page_size + in_page;
        let v = ((page * self.page_size + in_page) * self.kv_heads + kvh) * self.dim;
        (k, v)
    }

    /// The block of keys `j..end` (`end` at most the next multiple of [`SOFTMAX_BLOCK`]): in
    /// place when its 16 lanes lie in one page (the common case: K is stored transposed per
    /// page, so element `d` of the keys is contiguous), else gathered into `scratch`.
    #[inline(always)]
    fn block<'s>(
        &self,
        bt: &[u32],
        kvh: usize,
        keys: Range<usize>,
        scratch: &'s mut Gathered<E>,
    ) -> Block<'s, E>
    where
        'a: 's,
    {
        let n = keys.len();
        let (k0, v0) = self.key_offsets(bt, kvh, keys.start);
        let (_, in_page) = self.page_of(bt, keys.start);
        if in_page + SOFTMAX_BLOCK <= self.page_size {
            return Block {
                k: &self.k_cache[k0..],
                k_stride: self.page_size,
                v: &self.v_cache[v0..],
                v_stride: self.kv_heads * self.dim,
                n,
            };
        }
        let dim = self.dim;
        scratch.k.resize(dim * SOFTMAX_BLOCK, E::default());
        scratch.v.resize(SOFTMAX_BLOCK * dim, E::default());
        for (i, j) in keys.enumerate() {
            let (k, v) = self.key_offsets(bt, kvh, j);
            for d in 0..dim {
                scratch.k[d * SOFTMAX_BLOCK + i] = self.k_cache[k + d * self.page_size];
            }
            scratch.v[i * dim..(i + 1) * dim].copy_from_slice(&self.v_cache[v..v + dim]);
        }
        Block {
            k: &scratch.k,
            k_stride: SOFTMAX_BLOCK,
            v: &scratch.v,
            v_stride: dim,
            n,
        }
    }

    /// Asks for the keys and values of block `keys` (usually on another, random page), so they
    /// arrive while the current block is computed.
    #[inline(always)]
    fn prefetch_block(&self, bt: &[u32], kvh: usize, keys: Range<usize>) {
        if keys.is_empty() {
            return;
        }
        let (k0, v0) = self.key_offsets(bt, kvh, keys.start);
        if keys.len() == self.page_size {
            // A whole page's keys of this KV head: one contiguous run, one prefetch per line
            // (per element row, short rows asked for each line twice).
            prefetch(self.k_cache, k0, self.dim * self.page_size);
        } else {
            for d in 0..self.dim {
                prefetch(self.k_cache, k0 + d * self.page_size, keys.len());
            }
        }
        let v_stride = self.kv_heads * self.dim;
        let (_, in_page) = self.page_of(bt, keys.start);
        let in_this_page = keys.len().min(self.page_size - in_page);
        for i in 0..in_this_page {
            prefetch(self.v_cache, v0 + i * v_stride, self.dim);
        }
    }

    /// Folds keys `range` of KV head `kvh` into `G` queries' states, block by block (blocks of
    /// [`SOFTMAX_BLOCK`] aligned to absolute positions, so the blocking depends only on the
    /// range).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn fold_range<V: Lanes, const G: usize>(
        &self,
        bt: &[u32],
        kvh: usize,
        qs: &[&[f32]; G],
        out: &mut [f32],
        state: &mut [(f32, f32)],
        range: Range<usize>,
        scratch: &mut Gathered<E>,
    ) {
        let block_end = |j: usize| ((j / SOFTMAX_BLOCK + 1) * SOFTMAX_BLOCK).min(range.end);
        let mut j = range.start;
        while j < range.end {
            let end = block_end(j);
            self.prefetch_block(bt, kvh, end..block_end(end));
            let block = self.block(bt, kvh, j..end, scratch);
            // SAFETY: the caller runs on a CPU with `V`'s instruction set.
            unsafe { fold_block::<V, E, G>(qs, out, state, &block, self.dim, self.score_map()) };
            j = end;
        }
    }

    /// [`Self::fold_range`] for queries `queries` (indices into a tile: query `i` is head
    /// `kvh · group + i % group` of row `first_row + i / group`), in groups of at most
    /// [`MAX_QUERIES`]; `out` and `state` hold the tile's queries.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn fold_queries<V: Lanes>(
        &self,
        kvh: usize,
        first_row: usize,
        queries: Range<usize>,
        out: &mut [f32],
        state: &mut [(f32, f32)],
        range: Range<usize>,
        scratch: &mut Gathered<E>,
    ) {
        let (g, dim) = (self.group(), self.dim);
        let bt = self.block_table(first_row);
        let mut q0 = queries.start;
        while q0 < queries.end {
            let q1 = (q0 + MAX_QUERIES).min(queries.end);
            let mut qs: [&[f32]; MAX_QUERIES] = [&[]; MAX_QUERIES];
            for (i, q) in qs.iter_mut().zip(q0..q1) {
                *i = self.query(first_row + q / g, kvh * g + q % g);
            }
            let out = &mut out[q0 * dim..q1 * dim];
            let state = &mut state[q0..q1];
            let range = range.clone();
            macro_rules! fold_n {
                ($($n:literal)*) => {
                    match q1 - q0 {
                        $($n => {
                            let qs: &[&[f32]; $n] = qs[..$n].try_into().unwrap_or_else(|_| unreachable!());
                            self.fold_range::<V, $n>(bt, kvh, qs, out, state, range, scratch)
                        })*
                        _ => unreachable!("query groups hold 1..=MAX_QUERIES queries"),
                    }
                };
            }
            fold_n!(1 2 3 4 5 6 7 8);
            q0 = q1;
        }
    }

    /// The fixed schedule for `rows` (consecutive positions of one sequence) × the query heads
    /// of KV head `kvh`, normalised into `out` (`[row][head of the group][dim]`, zeroed by
    /// the caller). The rows
    /// share the loads of the key blocks they all attend to in full; every query's arithmetic
    /// is what it would be alone.
    #[inline(always)]
    fn tile_task<V: Lanes>(&self, kvh: usize, rows: Range<usize>, out: &mut [f32]) {
        let g = self.group();
        let mut scratch = Gathered::default();
        let mut state = vec![(f32::NEG_INFINITY, 0f32); rows.len() * g];
        let first = self.key_range(rows.start);
        // Without a sliding window every row's keys start at 0, so the first row's complete
        // blocks are blocks of every later row too.
        let shared_end = if rows.len() > 1 && self.meta.sliding_window.is_none() {
            first.start.max(first.end / SOFTMAX_BLOCK * SOFTMAX_BLOCK)
        } else {
            first.start
        };
        let all = 0..rows.len() * g;
        self.fold_queries::<V>(
            kvh,
            rows.start,
            all,
            out,
            &mut state,
            first.start..shared_end,
            &mut scratch,
        );
        for (r, row) in rows.clone().enumerate() {
            let range = self.key_range(row);
            let from = shared_end.max(range.start);
            self.fold_queries::<V>(
                kvh,
                rows.start,
                r * g..(r + 1) * g,
                out,
                &mut state,
                from..range.end,
                &mut scratch,
            );
        }
        for (i, (o, &st)) in out.chunks_mut(self.dim).zip(&state).enumerate() {
            normalise(o, st, self.sink(kvh * g + i % g));
        }
    }

    /// Split `split` of `splits` of `row`'s query heads of KV head `kvh`, unnormalised into
    /// `acc` (`[head of the group][dim]`) and `state` (`(max, denom)` a head; both reset
    /// here). The heads share each block's loads, never the arithmetic. One split is the
    /// whole fixed fold.
    #[inline(always)]
    fn split_task<V: Lanes>(
        &self,
        row: usize,
        kvh: usize,
        (split, splits): (usize, usize),
        acc: &mut [f32],
        state: &mut [(f32, f32)],
    ) {
        let range = self.key_range(row);
        let blocks = range.len().div_ceil(SOFTMAX_BLOCK);
        let chunk = blocks.div_ceil(splits) * SOFTMAX_BLOCK;
        let lo = (range.start + split * chunk).min(range.end);
        let hi = (lo + chunk).min(range.end);
        acc.fill(0.0);
        state.fill((f32::NEG_INFINITY, 0.0));
        let queries = 0..self.group();
        let scratch = &mut Gathered::default();
        self.fold_queries::<V>(kvh, row, queries, acc, state, lo..hi, scratch);
    }
}

impl<E: KvElem> AttentionArgs<'_, E> {
    /// Whether the fixed schedule runs each decode row as one task over all its KV heads
    /// ([`Self::row_task`]) rather than a task per KV head. One task a row reads a page's
    /// keys (and values) of every KV head as one run and keeps a core's misses in flight on
    /// one row; a task per KV head spreads a lone long row over the threads. So: whenever
    /// there are rows for every thread, or the rows are short enough that a task's start-up
    /// outweighs its work (measurements in docs/performance.md).
    fn row_tasks(&self, tiles: &[Range<usize>]) -> bool {
        const SHORT_ROW_KEYS: usize = 4096;
        self.group() <= MAX_QUERIES
            && (tiles.len() >= rayon::current_num_threads()
                || (0..self.rows).all(|r| self.key_range(r).len() <= SHORT_ROW_KEYS))
    }

    /// One decode row × every query head, normalised into `out` (`[head][dim]`, zeroed by
    /// the caller): blocks outer, KV heads inner. Each query's arithmetic is
    /// [`Self::tile_task`]'s (the same blocks, folded in the same order).
    #[inline(always)]
    fn row_task<V: Lanes>(&self, row: usize, out: &mut [f32]) {
        macro_rules! by_group {
            ($($n:literal)*) => {
                match self.group() {
                    $($n => self.row_fold::<V, $n>(row, out),)*
                    _ => unreachable!("row tasks run for groups of 1..=MAX_QUERIES heads"),
                }
            };
        }
        by_group!(1 2 3 4 5 6 7 8);
    }

    #[inline(always)]
    fn row_fold<V: Lanes, const G: usize>(&self, row: usize, out: &mut [f32]) {
        let (dim, kv_heads) = (self.dim, self.kv_heads);
        let range = self.key_range(row);
        let bt = self.block_table(row);
        let qs: Vec<[&[f32]; G]> = (0..kv_heads)
            .map(|kvh| std::array::from_fn(|i| self.query(row, kvh * G + i)))
            .collect();
        let mut state = vec![(f32::NEG_INFINITY, 0f32); self.heads];
        let mut scratch = Gathered::default();
        let block_end = |j: usize| ((j / SOFTMAX_BLOCK + 1) * SOFTMAX_BLOCK).min(range.end);
        let mut j = range.start;
        while j < range.end {
            let end = block_end(j);
            for kvh in 0..kv_heads {
                self.prefetch_block(bt, kvh, end..block_end(end));
            }
            for (kvh, qs) in qs.iter().enumerate() {
                let block = self.block(bt, kvh, j..end, &mut scratch);
                // SAFETY: the caller runs on a CPU with `V`'s instruction set.
                unsafe {
                    fold_block::<V, E, G>(
                        qs,
                        &mut out[kvh * G * dim..(kvh + 1) * G * dim],
                        &mut state[kvh * G..(kvh + 1) * G],
                        &block,
                        dim,
                        self.score_map(),
                    )
                };
            }
            j = end;
        }
        for (head, (o, &st)) in out.chunks_mut(dim).zip(&state).enumerate() {
            normalise(o, st, self.sink(head));
        }
    }
}

/// Most queries (query heads of one KV head, over one or more rows) folded together: they share
/// each block's key and value loads, and their accumulators fit the vector registers.
const MAX_QUERIES: usize = 8;

/// A block of at most [`SOFTMAX_BLOCK`] keys of one KV head: element `d` of key `i` at
/// `k[d · k_stride + i]` (all 16 lanes readable), value row `i` at `v[i · v_stride..][..dim]`.
struct Block<'s, E> {
    k: &'s [E],
    k_stride: usize,
    v: &'s [E],
    v_stride: usize,
    n: usize,
}

/// A block's keys and values copied out of the cache when they do not sit in one page.
struct Gathered<E> {
    k: Vec<E>,
    v: Vec<E>,
}

impl<E> Default for Gathered<E> {
    fn default() -> Self {
        Self {
            k: Vec::new(),
            v: Vec::new(),
        }
    }
}

/// What a raw score `q · k` becomes before the softmax: times `scale`, then soft-capped
/// (`cap · tanh(s / cap)`, Gemma 2) where there is a cap.
#[derive(Clone, Copy)]
struct ScoreMap {
    scale: f32,
    softcap: Option<f32>,
}

/// `tanh(s / cap) · cap` of the block's `n` scores per query. Out of line: inlined, it made
/// the uncapped models' block fold 10–15 % slower with a bf16 cache (measured, criterion).
#[cold]
#[inline(never)]
fn cap_scores<const G: usize>(scores: &mut [[f32; SOFTMAX_BLOCK]; G], n: usize, cap: f32) {
    for s in scores {
        for v in &mut s[..n] {
            *v = tanh(*v / cap) * cap;
        }
    }
}

/// Folds one block into `G` queries' unnormalised accumulators `out` (`G × dim`) and states
/// `(max, denom)`. Per query: scores as in-order sums over `d` of `q[d] · k[d]` (no FMA), then
/// scaled (and capped); the running maximum and rescale; the probabilities added to the denominator key by
/// key; `p · v` added key by key. The queries only share loads.
///
/// # Safety
/// The CPU has `V`'s instruction set.
#[inline(always)]
unsafe fn fold_block<V: Lanes, E: KvElem, const G: usize>(
    qs: &[&[f32]; G],
    out: &mut [f32],
    state: &mut [(f32, f32)],
    b: &Block<E>,
    dim: usize,
    map: ScoreMap,
) {
    let n = b.n;
    // The hot loops below read lanes without a bounds check per load (they were a third of
    // the instructions of a decode block); these checks cover every read they make.
    assert!(
        (1..=SOFTMAX_BLOCK).contains(&n) && b.k.len() >= (dim - 1) * b.k_stride + SOFTMAX_BLOCK
    );
    assert!(b.v.len() >= (n - 1) * b.v_stride + dim);
    assert!(qs.iter().all(|q| q.len() >= dim) && out.len() >= G * dim);
    // SAFETY (every `V` operation below): the caller vouches for the instruction set.
    let mut scores = [[0f32; SOFTMAX_BLOCK]; G];
    unsafe {
        let mut acc = [V::zero(); G];
        for d in 0..dim {
            // SAFETY: d·k_stride + 16 <= b.k.len() (asserted above).
            let k = E::load::<V>(lanes_unchecked(b.k, d * b.k_stride));
            for (acc, q) in acc.iter_mut().zip(qs) {
                // SAFETY: d < dim <= q.len().
                *acc = acc.add(V::splat(*q.get_unchecked(d)).mul(k));
            }
        }
        for (s, acc) in scores.iter_mut().zip(acc) {
            acc.mul(V::splat(map.scale)).store(s);
        }
    }
    if let Some(cap) = map.softcap {
        cap_scores(&mut scores, n, cap);
    }
    // The running maxima and denominators below are sequential chains per query, in the same
    // order as for a query alone; the loops interleave the G queries' chains (lane index outer)
    // so they overlap instead of each waiting out the latency of its own.
    for s in &mut scores {
        // Lanes past the block's keys hold whatever the page holds there.
        s[n..].fill(f32::NEG_INFINITY);
    }
    // The block's maximum by halving (16 → 8 → 4 → 2 → 1 lanes, vector operations): the value
    // of the in-order fold, since a NaN-ignoring maximum is exact in any order (only a tie of
    // -0 and +0 may pick the other zero, and s - max, hence every output, is the same for both).
    let new_max: [f32; G] = std::array::from_fn(|h| {
        let s = &scores[h];
        let m8: [f32; 8] = std::array::from_fn(|i| s[i].max(s[i + 8]));
        let m4: [f32; 4] = std::array::from_fn(|i| m8[i].max(m8[i + 4]));
        let m2 = [m4[0].max(m4[2]), m4[1].max(m4[3])];
        state[h].0.max(m2[0].max(m2[1]))
    });
    let mut probs = [[0f32; SOFTMAX_BLOCK]; G];
    let mut correction = [0f32; G];
    let mut denom = [0f32; G];
    for h in 0..G {
        let (max, d) = state[h];
        correction[h] = exp_nonpositive(max - new_max[h]);
        denom[h] = d * correction[h];
        for (p, &s) in probs[h].iter_mut().zip(scores[h].iter()) {
            *p = exp_nonpositive(s - new_max[h]);
        }
    }
    for i in 0..n {
        for (d, p) in denom.iter_mut().zip(&probs) {
            *d += p[i];
        }
    }
    for ((st, &m), &d) in state.iter_mut().zip(&new_max).zip(&denom) {
        *st = (m, d);
    }
    // The accumulators 16 lanes of `dim` at a time, held in registers across the keys.
    let whole = dim / SOFTMAX_BLOCK * SOFTMAX_BLOCK;
    for c in (0..whole).step_by(SOFTMAX_BLOCK) {
        unsafe {
            let mut acc = [V::zero(); G];
            for (h, acc) in acc.iter_mut().enumerate() {
                *acc = V::load(lanes(out, h * dim + c)).mul(V::splat(correction[h]));
            }
            for i in 0..n {
                // SAFETY: i·v_stride + c + 16 <= (n-1)·v_stride + dim <= b.v.len().
                let v = E::load::<V>(lanes_unchecked(b.v, i * b.v_stride + c));
                for (acc, p) in acc.iter_mut().zip(&probs) {
                    // SAFETY: i < n <= SOFTMAX_BLOCK.
                    *acc = acc.add(V::splat(*p.get_unchecked(i)).mul(v));
                }
            }
            for (h, acc) in acc.iter().enumerate() {
                acc.store(lanes_mut(out, h * dim + c));
            }
        }
    }
    for d in whole..dim {
        for (h, p) in probs.iter().enumerate() {
            let mut a = out[h * dim + d] * correction[h];
            for (i, &p) in p[..n].iter().enumerate() {
                a += p * b.v[i * b.v_stride + d].to_f32();
            }
            out[h * dim + d] = a;
        }
    }
}

/// The [`SOFTMAX_BLOCK`] elements of `s` from `at`, as an array (so the loops over them
/// compile to whole-vector operations).
#[inline(always)]
fn lanes<T>(s: &[T], at: usize) -> &[T; SOFTMAX_BLOCK] {
    match s[at..at + SOFTMAX_BLOCK].first_chunk() {
        Some(lanes) => lanes,
        None => unreachable!("a slice of SOFTMAX_BLOCK floats"),
    }
}

/// [`lanes`] without the bounds check.
///
/// # Safety
/// `at + SOFTMAX_BLOCK <= s.len()`.
#[inline(always)]
unsafe fn lanes_unchecked<T>(s: &[T], at: usize) -> &[T; SOFTMAX_BLOCK] {
    debug_assert!(at + SOFTMAX_BLOCK <= s.len());
    // SAFETY: the caller's contract; `[T; N]` has `T`'s alignment.
    unsafe { &*(s.as_ptr().add(at) as *const [T; SOFTMAX_BLOCK]) }
}

/// [`lanes`], writable.
#[inline(always)]
fn lanes_mut(s: &mut [f32], at: usize) -> &mut [f32; SOFTMAX_BLOCK] {
    match s[at..at + SOFTMAX_BLOCK].first_chunk_mut() {
        Some(lanes) => lanes,
        None => unreachable!("a slice of SOFTMAX_BLOCK floats"),
    }
}

/// Sixteen f32 lanes and the operations the kernel needs, each rounded on its own (no FMA), so
/// every implementation gives the same bits.
///
/// # Safety
/// Every method needs the CPU to have the implementation's instruction set.
trait Lanes: Copy {
    unsafe fn zero() -> Self;
    unsafe fn splat(x: f32) -> Self;
    unsafe fn load(a: &[f32; SOFTMAX_BLOCK]) -> Self;
    /// Sixteen bf16 values widened to f32 (exact: the bits shifted into the high half).
    unsafe fn load_bf16(a: &[half::bf16; SOFTMAX_BLOCK]) -> Self;
    unsafe fn store(self, a: &mut [f32; SOFTMAX_BLOCK]);
    unsafe fn add(self, b: Self) -> Self;
    unsafe fn mul(self, b: Self) -> Self;
}

/// An element of the KV cache: f32, or bf16 widened exactly to f32 as it is loaded, so
/// attention over a bf16 cache computes the f32 kernel's bits over the cache's f32 values (and
/// accumulates in f32).
trait KvElem: Copy + Default + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    /// # Safety
    /// The CPU has `V`'s instruction set.
    unsafe fn load<V: Lanes>(a: &[Self; SOFTMAX_BLOCK]) -> V;
}

impl KvElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    unsafe fn load<V: Lanes>(a: &[f32; SOFTMAX_BLOCK]) -> V {
        // SAFETY: forwarded from the caller.
        unsafe { V::load(a) }
    }
}

impl KvElem for half::bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        super::bf16_to_f32(self.to_bits())
    }
    #[inline(always)]
    unsafe fn load<V: Lanes>(a: &[half::bf16; SOFTMAX_BLOCK]) -> V {
        // SAFETY: forwarded from the caller.
        unsafe { V::load_bf16(a) }
    }
}

/// Plain arrays: any CPU.
#[derive(Clone, Copy)]
struct Portable([f32; SOFTMAX_BLOCK]);

impl Lanes for Portable {
    #[inline(always)]
    unsafe fn zero() -> Self {
        Portable([0.0; SOFTMAX_BLOCK])
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        Portable([x; SOFTMAX_BLOCK])
    }
    #[inline(always)]
    unsafe fn load(a: &[f32; SOFTMAX_BLOCK]) -> Self {
        Portable(*a)
    }
    #[inline(always)]
    unsafe fn load_bf16(a: &[half::bf16; SOFTMAX_BLOCK]) -> Self {
        Portable(std::array::from_fn(|l| a[l].to_f32()))
    }
    #[inline(always)]
    unsafe fn store(self, a: &mut [f32; SOFTMAX_BLOCK]) {
        *a = self.0;
    }
    #[inline(always)]
    unsafe fn add(self, b: Self) -> Self {
        Portable(std::array::from_fn(|l| self.0[l] + b.0[l]))
    }
    #[inline(always)]
    unsafe fn mul(self, b: Self) -> Self {
        Portable(std::array::from_fn(|l| self.0[l] * b.0[l]))
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Lanes, SOFTMAX_BLOCK};
    use std::arch::x86_64::*;

    /// One AVX-512 register.
    #[derive(Clone, Copy)]
    pub(super) struct Avx512(__m512);

    impl Lanes for Avx512 {
        #[inline(always)]
        unsafe fn zero() -> Self {
            Avx512(unsafe { _mm512_setzero_ps() })
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            Avx512(unsafe { _mm512_set1_ps(x) })
        }
        #[inline(always)]
        unsafe fn load(a: &[f32; SOFTMAX_BLOCK]) -> Self {
            Avx512(unsafe { _mm512_loadu_ps(a.as_ptr()) })
        }
        #[inline(always)]
        unsafe fn load_bf16(a: &[half::bf16; SOFTMAX_BLOCK]) -> Self {
            unsafe {
                let bits = _mm256_loadu_si256(a.as_ptr().cast());
                Avx512(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(
                    _mm512_cvtepu16_epi32(bits),
                )))
            }
        }
        #[inline(always)]
        unsafe fn store(self, a: &mut [f32; SOFTMAX_BLOCK]) {
            unsafe { _mm512_storeu_ps(a.as_mut_ptr(), self.0) }
        }
        #[inline(always)]
        unsafe fn add(self, b: Self) -> Self {
            Avx512(unsafe { _mm512_add_ps(self.0, b.0) })
        }
        #[inline(always)]
        unsafe fn mul(self, b: Self) -> Self {
            Avx512(unsafe { _mm512_mul_ps(self.0, b.0) })
        }
    }

    /// Two AVX2 registers.
    #[derive(Clone, Copy)]
    pub(super) struct Avx2(__m256, __m256);

    impl Lanes for Avx2 {
        #[inline(always)]
        unsafe fn zero() -> Self {
            unsafe { Avx2(_mm256_setzero_ps(), _mm256_setzero_ps()) }
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            unsafe { Avx2(_mm256_set1_ps(x), _mm256_set1_ps(x)) }
        }
        #[inline(always)]
        unsafe fn load(a: &[f32; SOFTMAX_BLOCK]) -> Self {
            unsafe {
                Avx2(
                    _mm256_loadu_ps(a.as_ptr()),
                    _mm256_loadu_ps(a.as_ptr().add(8)),
                )
            }
        }
        #[inline(always)]
        unsafe fn load_bf16(a: &[half::bf16; SOFTMAX_BLOCK]) -> Self {
            unsafe {
                let widen = |at: usize| {
                    let bits = _mm_loadu_si128(a.as_ptr().add(at).cast());
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(bits)))
                };
                Avx2(widen(0), widen(8))
            }
        }
        #[inline(always)]
        unsafe fn store(self, a: &mut [f32; SOFTMAX_BLOCK]) {
            unsafe {
                _mm256_storeu_ps(a.as_mut_ptr(), self.0);
                _mm256_storeu_ps(a.as_mut_ptr().add(8), self.1);
            }
        }
        #[inline(always)]
        unsafe fn add(self, b: Self) -> Self {
            unsafe { Avx2(_mm256_add_ps(self.0, b.0), _mm256_add_ps(self.1, b.1)) }
        }
        #[inline(always)]
        unsafe fn mul(self, b: Self) -> Self {
            unsafe { Avx2(_mm256_mul_ps(self.0, b.0), _mm256_mul_ps(self.1, b.1)) }
        }
    }
}

/// Scales `o`, a query's values summed with weights `exp(s - max)`, into the softmax's
/// weighted mean, given its `(max, denom)` (when anything was attended). A `sink` logit joins
/// the softmax without a value (gpt-oss): it adds `exp(sink - max)` to the denominator, taken
/// from the larger of the two so no exponent is positive (transformers subtracts the max of
/// the scores and the sink alike). A function of the final state alone, so every schedule that
/// reaches the same state gives the same bits.
#[inline(always)]
fn normalise(o: &mut [f32], (max, denom): (f32, f32), sink: Option<f32>) {
    if denom <= 0.0 {
        return;
    }
    let inv = match sink {
        None => 1.0 / denom,
        Some(s) if s <= max => 1.0 / (denom + exp_nonpositive(s - max)),
        Some(s) => {
            let r = exp_nonpositive(max - s);
            r / (denom * r + 1.0)
        }
    };
    o.iter_mut().for_each(|x| *x *= inv);
}

// Per-task entry points compiled for each instruction set: the rayon closures below are
// compiled for baseline x86-64, so the vectorised work must sit behind a function that carries
// the target features (the arithmetic is the same in every build).
macro_rules! isa_entry_points {
    ($($features:literal, $lanes:ty => $tile:ident, $split:ident, $row:ident;)*) => {$(
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $row<E: KvElem>(a: &AttentionArgs<E>, row: usize, out: &mut [f32]) {
            a.row_task::<$lanes>(row, out)
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $tile<E: KvElem>(
            a: &AttentionArgs<E>,
            kvh: usize,
            rows: Range<usize>,
            out: &mut [f32],
        ) {
            a.tile_task::<$lanes>(kvh, rows, out)
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $split<E: KvElem>(
            a: &AttentionArgs<E>,
            row: usize,
            kvh: usize,
            split: (usize, usize),
            acc: &mut [f32],
            state: &mut [(f32, f32)],
        ) {
            a.split_task::<$lanes>(row, kvh, split, acc, state)
        }
    )*};
}

isa_entry_points! {
    "avx512f,avx2,fma", x86::Avx512 => tile_task_avx512, split_task_avx512, row_task_avx512;
    "avx2,fma", x86::Avx2 => tile_task_avx2, split_task_avx2, row_task_avx2;
}

impl<E: KvElem> AttentionArgs<'_, E> {
    /// [`Self::row_task`] with instruction set `isa` (one this CPU has).
    fn row_task_isa(&self, isa: CpuIsa, row: usize, out: &mut [f32]) {
        // SAFETY: `isa` is one this CPU has (checked by `paged_attention_with_isa`).
        unsafe {
            match isa {
                #[cfg(target_arch = "x86_64")]
                CpuIsa::Avx512 => row_task_avx512(self, row, out),
                #[cfg(target_arch = "x86_64")]
                CpuIsa::Avx2Fma => row_task_avx2(self, row, out),
                _ => self.row_task::<Portable>(row, out),
            }
        }
    }

    /// [`Self::tile_task`] with instruction set `isa` (one this CPU has).
    fn tile_task_isa(&self, isa: CpuIsa, kvh: usize, rows: Range<usize>, out: &mut [f32]) {
        // SAFETY: `isa` is one this CPU has (checked by `paged_attention_with_isa`).
        unsafe {
            match isa {
                #[cfg(target_arch = "x86_64")]
                CpuIsa::Avx512 => tile_task_avx512(self, kvh, rows, out),
                #[cfg(target_arch = "x86_64")]
                CpuIsa::Avx2Fma => tile_task_avx2(self, kvh, rows, out),
                _ => self.tile_task::<Portable>(kvh, rows, out),
            }
        }
    }

    /// [`Self::split_task`] with instruction set `isa` (one this CPU has).
    fn split_task_isa(
        &self,
        isa: CpuIsa,
        (row, kvh): (usize, usize),
        split: (usize, usize),
        acc: &mut [f32],
        state: &mut [(f32, f32)],
    ) {
        // SAFETY: as above.
        unsafe {
            match isa {
                #[cfg(target_arch = "x86_64")]
                CpuIsa::Avx512 => split_task_avx512(self, row, kvh, split, acc, state),
                #[cfg(target_arch = "x86_64")]
                CpuIsa::Avx2Fma => split_task_avx2(self, row, kvh, split, acc, state),
                _ => self.split_task::<Portable>(row, kvh, split, acc, state),
            }
        }
    }

    /// Runs of consecutive rows of one sequence at consecutive positions (a prefill chunk),
    /// at most enough rows that their heads of one KV head fill [`MAX_QUERIES`].
    fn tiles(&self) -> Vec<Range<usize>> {
        let per_tile = (MAX_QUERIES / self.group()).max(1);
        let (seq, pos) = (&self.meta.row_seq, &self.meta.positions);
        let mut tiles = Vec::new();
        let mut start = 0;
        while start < self.rows {
            let mut end = start + 1;
            while end < self.rows
                && end - start < per_tile
                && seq[end] == seq[start]
                && pos[end] == pos[end - 1] + 1
            {
                end += 1;
            }
            tiles.push(start..end);
            start = end;
        }
        tiles
    }
}

/// A task of the fixed schedule, with the part of the output it writes.
enum FixedTask<'o> {
    /// A decode row over all its KV heads (`[head][dim]`).
    Row(usize, &'o mut [MaybeUninit<f32>]),
    /// One KV head of a tile of rows (`[row][head of the group][dim]`).
    Head(usize, Range<usize>, &'o mut [MaybeUninit<f32>]),
}

/// Runs the batch's schedule on the rayon pool with instruction set `isa` (one this CPU has).
fn attention<E: KvElem>(a: &AttentionArgs<E>, isa: CpuIsa) -> Vec<f32> {
    let (dim, heads, meta) = (a.dim, a.heads, a.meta);
    match meta.schedule {
        AttentionSchedule::Fixed => {
            // Tiles are runs of consecutive rows, in order, so each tile's part of the output
            // is one range of it. A decode row (a tile of one) is one task over all its KV
            // heads, block by block, writing its row in place; the rows of a prefill tile are
            // a task per KV head (they share each block's loads), written KV head by KV head
            // into the tile's range and put in row order afterwards.
            let g = a.group();
            let tiles = a.tiles();
            let by_row = a.row_tasks(&tiles);
            let row_len = heads * dim;
            let mut out: Vec<f32> = Vec::with_capacity(a.q.len());
            let mut tasks = Vec::with_capacity(a.kv_heads * tiles.len());
            let mut rest = &mut out.spare_capacity_mut()[..a.q.len()];
            for rows in &tiles {
                let (tile, tail) = rest.split_at_mut(rows.len() * row_len);
                rest = tail;
                if by_row && rows.len() == 1 {
                    tasks.push(FixedTask::Row(rows.start, tile));
                } else {
                    for (kvh, o) in tile.chunks_mut(rows.len() * g * dim).enumerate() {
                        tasks.push(FixedTask::Head(kvh, rows.clone(), o));
                    }
                }
            }
            // Each task zeroes its own part (a whole-buffer zeroing ran on one thread alone).
            tasks.into_par_iter().for_each(|task| match task {
                FixedTask::Row(row, o) => a.row_task_isa(isa, row, zeroed(o)),
                FixedTask::Head(kvh, rows, o) => a.tile_task_isa(isa, kvh, rows, zeroed(o)),
            });
            // SAFETY: the tiles cover every row once, and each tile's range is covered by its
            // tasks' slices, each zeroed by its task.
            unsafe { out.set_len(a.q.len()) };
            let mut several = Vec::new();
            let mut rest = &mut out[..];
            for rows in &tiles {
                let (tile, tail) = rest.split_at_mut(rows.len() * row_len);
                rest = tail;
                if rows.len() > 1 {
                    several.push((rows.len(), tile));
                }
            }
            let part = g * dim;
            several.into_par_iter().for_each(|(n, tile)| {
                let by_head = tile.to_vec(); // [kv head][row][head of the group][dim]
                for (kvh, rows) in by_head.chunks(n * part).enumerate() {
                    for (r, x) in rows.chunks(part).enumerate() {
                        tile[(r * a.kv_heads + kvh) * part..][..part].copy_from_slice(x);
                    }
                }
            });
            out
        }
        AttentionSchedule::SplitKv { splits } => {
            // Partial (max, denominator, accumulator) per (row, split, head), each task a
            // KV head's query heads (sharing the loads), then an in-order merge per (row,
            // head). Rows of fixed sequences (DVR's inline rows) take the fixed schedule
            // itself.
            let g = a.group();
            let is_fixed = |row: usize| {
                let seq = meta.row_seq[row] as usize;
                meta.fixed_seqs.get(seq).copied().unwrap_or(false)
            };
            let mut accs = vec![0f32; a.q.len() * splits];
            let mut stats = vec![(f32::NEG_INFINITY, 0f32); a.rows * heads * splits];
            accs.par_chunks_mut(g * dim)
                .zip(stats.par_chunks_mut(g))
                .enumerate()
                .for_each(|(t, (acc, st))| {
                    let (row_split, kvh) = (t / a.kv_heads, t % a.kv_heads);
                    let (row, split) = (row_split / splits, row_split % splits);
                    if !is_fixed(row) {
                        a.split_task_isa(isa, (row, kvh), (split, splits), acc, st);
                    }
                });
            let mut out = vec![0f32; a.q.len()];
            out.par_chunks_mut(g * dim).enumerate().for_each(|(t, o)| {
                let (row, kvh) = (t / a.kv_heads, t % a.kv_heads);
                if is_fixed(row) {
                    let mut state = vec![(f32::NEG_INFINITY, 0f32); g];
                    a.split_task_isa(isa, (row, kvh), (0, 1), o, &mut state);
                    for (i, (o, &st)) in o.chunks_mut(dim).zip(&state).enumerate() {
                        normalise(o, st, a.sink(kvh * g + i));
                    }
                    return;
                }
                for (i, o) in o.chunks_mut(dim).enumerate() {
                    let head = kvh * g + i;
                    let part = |s: usize| (row * splits + s) * heads + head;
                    let m = (0..splits).fold(f32::NEG_INFINITY, |m, s| m.max(stats[part(s)].0));
                    let mut denom = 0f32;
                    for s in 0..splits {
                        let (pm, pd) = stats[part(s)];
                        if pd == 0.0 {
                            continue;
                        }
                        let w = exp_nonpositive(pm - m);
                        denom += pd * w;
                        for (o, &a) in o.iter_mut().zip(&accs[part(s) * dim..][..dim]) {
                            *o += a * w;
                        }
                    }
                    normalise(o, (m, denom), a.sink(head));
                }
            });
            out
        }
    }
}

/// Hints the CPU to load `data[off..off + len]` into cache (a no-op elsewhere), as
/// `prefetcht2`: a block's 64 lines asked for into L1 (`prefetcht0`) stalled the core on its
/// few L1 miss buffers (a quarter of the kernel's samples sat behind the prefetches), the
/// outer levels take them without waiting (decode at batch 64 over the engine's working set:
/// 1.3–1.5× with the row tasks, docs/performance.md).
#[inline(always)]
fn prefetch<T>(data: &[T], off: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let line = (64 / std::mem::size_of::<T>()).max(1); // elements per 64-byte cache line
        let mut i = off;
        while i < (off + len).min(data.len()) {
            // SAFETY: a prefetch never faults; the address is inside `data`.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T2 }>(
                    data.as_ptr().add(i) as *const i8,
                )
            };
            i += line;
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

/// [`paged_attention_with_isa`] with attention sinks (gpt-oss): `sinks[h]` is query head
/// `h`'s learned logit, which joins each of its softmaxes as a key without a value, so a
/// head can attend to nothing. CPU only.
pub fn paged_attention_with_sinks(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    meta: Arc<AttentionMetadata>,
    scale: f32,
    sinks: Arc<[f32]>,
    isa: CpuIsa,
) -> candle_core::Result<Tensor> {
    let heads = q.dims().get(1).copied().unwrap_or(0);
    if sinks.len() != heads {
        bail!(
            "paged_attention: {} sinks for {heads} query heads",
            sinks.len()
        );
    }
    run(q, k_cache, v_cache, meta, scale, Some(sinks), isa)
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
    run(q, k_cache, v_cache, meta, scale, None, isa)
}

fn run(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    meta: Arc<AttentionMetadata>,
    scale: f32,
    sinks: Option<Arc<[f32]>>,
    isa: CpuIsa,
) -> candle_core::Result<Tensor> {
    if !CpuIsa::available().contains(&isa) {
        bail!("paged_attention: this CPU cannot run {isa:?}");
    }
    let op = PagedAttention {
        meta,
        scale,
        sinks,
        isa,
    };
    q.contiguous()?.apply_op3_no_bwd(k_cache, v_cache, &op)
}
