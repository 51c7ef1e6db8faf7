//! The CPU GEMM of every linear layer: `x @ W` with `W` packed once at load.
//!
//! Why our own: the model's weights never change between steps, so they are packed once into
//! column panels that the kernel streams sequentially (no per-call packing), and the reduction
//! order is fixed by construction, which is what DVR needs:
//!
//! every output element `c[i][j]` is `fma(a[i][K-1], w[K-1][j], … fma(a[i][0], w[0][j], 0.0))`,
//! one fused multiply-add per `k` in increasing order, whatever the number of rows M, the row's
//! index, its neighbours, the thread count or the instruction set (AVX-512, AVX2+FMA or the
//! scalar `mul_add` fallback all compute the same correctly rounded FMA chain). Threads split
//! the *columns* (panels), never the reduction. So the GEMM is batch-invariant,
//! position-invariant and thread-invariant; `tests/ops.rs` asserts it bitwise over every
//! (K, N) the model uses and many M.
//!
//! The `shape_dependent` kernel profile runs the same kernel with [`Reduction::SplitK`]: the K
//! sum split in parts whose count depends on M, as a vendor GEMM picks its kernel by shape.
//!
//! Layout: panel `p` holds columns `p*NR .. p*NR+NR` of `W` for every `k`, k-major
//! (`panel[k*NR + c] = W[k][p*NR + c]`), zero-padded past N. The microkernel keeps a
//! block of accumulators in registers (up to 8 rows × NR columns with AVX-512's 32 registers,
//! 6 rows × NR/2 with AVX2's 16: [`Blocking`]) and walks k once.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::{bail, CpuStorage, CustomOp1, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::{contiguous_f32, CpuIsa, INVARIANT_GEMM_ROWS};
use crate::config::KernelProfile;

/// Columns per panel (two AVX-512 vectors, four AVX2 vectors).
pub const NR: usize = 32;
/// Rows of A kept hot while all panels pass (64 rows × K ≤ 1408 floats ≈ 360 KB, in L2).
const ROW_BLOCK: usize = 64;

/// How each output element's sum over k is ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduction {
    /// One FMA chain over k = 0..K: the invariant GEMM.
    Sequential,
    /// `parts` FMA chains over contiguous ranges of k, each rounded to bfloat16, added in
    /// order, the sum rounded to bfloat16: a bf16 split-K kernel. Only the `shape_dependent`
    /// test profile uses it, with `parts` from [`split_k_parts`].
    SplitK(usize),
}

impl Reduction {
    /// The reduction a linear layer runs under `profile` for an `m`-row input. `invariant`:
    /// the batch-invariant mode, which pads GEMMs to fixed blocks of
    /// [`INVARIANT_GEMM_ROWS`] rows (on this kernel, whose rows are independent, that is the
    /// kernel chosen for that M applied to every row).
    pub fn for_rows(profile: KernelProfile, m: usize, invariant: bool) -> Self {
        match profile {
            KernelProfile::Invariant => Self::Sequential,
            KernelProfile::ShapeDependent if invariant => {
                Self::SplitK(split_k_parts(INVARIANT_GEMM_ROWS))
            }
            KernelProfile::ShapeDependent => Self::SplitK(split_k_parts(m)),
        }
    }
}

/// The split-K factor of an `m`-row product, from M's power-of-two bucket the way a vendor
/// heuristic picks a kernel per shape: 2, 3 or 4 parts, changing at every power of two.
pub fn split_k_parts(m: usize) -> usize {
    2 + (m.max(1).ilog2() as usize % 3)
}

/// `x` rounded to the nearest bfloat16 (ties to even).
#[inline(always)]
fn round_bf16(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

/// A `[K, N]` weight packed into column panels for [`packed_matmul`].
#[derive(Debug)]
pub struct PackedWeight {
    k: usize,
    n: usize,
    data: Vec<f32>,
}

impl PackedWeight {
    /// Packs a row-major `[k, n]` matrix (`w[kk * n + j]`).
    pub fn from_row_major(w: &[f32], k: usize, n: usize) -> candle_core::Result<Self> {
        Self::pack(w, k, n, |kk, j| w[kk * n + j])
    }

    /// Packs `W^T` given as the row-major `[n, k]` matrix `wt` (a checkpoint's `[out, in]`).
    pub fn from_transposed(wt: &[f32], n: usize, k: usize) -> candle_core::Result<Self> {
        Self::pack(wt, k, n, |kk, j| wt[j * k + kk])
    }

    /// Panels from `w(kk, j)`, the element at row `kk`, column `j` of `W` (`values` holds the
    /// k × n of them in some order).
    fn pack(
        values: &[f32],
        k: usize,
        n: usize,
        w: impl Fn(usize, usize) -> f32 + Sync,
    ) -> candle_core::Result<Self> {
        if values.len() != k * n || k == 0 || n == 0 {
            bail!(
                "packed weight: {} values for a [{k}, {n}] matrix",
                values.len()
            );
        }
        let mut data = vec![0f32; n.div_ceil(NR) * k * NR];
        data.par_chunks_mut(k * NR)
            .enumerate()
            .for_each(|(p, panel)| {
                let c0 = p * NR;
                for (kk, dst) in panel.chunks_exact_mut(NR).enumerate() {
                    for (c, d) in dst[..NR.min(n - c0)].iter_mut().enumerate() {
                        *d = w(kk, c0 + c);
                    }
                }
            });
        Ok(Self { k, n, data })
    }

    /// Inner dimension K.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Output columns N.
    pub fn n(&self) -> usize {
        self.n
    }
}

/// A weight packed into column panels of [`NR`] columns, k-major: what the microkernel walks.
/// f32 panels ([`PackedWeight`]), bf16 panels (`gemm_bf16::PackedWeightBf16`) and MXFP4
/// panels (`gemm_mxfp4::PackedWeightMxfp4`) share the kernel; only how a panel's k steps are
/// stored, and widened to NR f32 values, differs. The widening is exact, so the arithmetic
/// (one FMA per k, in order) is the same for all.
pub(super) trait Panels: Sync {
    /// One panel's k steps as stored.
    type Panel<'a>: PanelSteps
    where
        Self: 'a;
    /// Inner dimension K.
    fn k(&self) -> usize;
    /// Output columns N.
    fn n(&self) -> usize;
    /// Panel `p`'s K steps, for a GEMM of `rows` rows (which passes the panel once per
    /// register block of them).
    fn panel(&self, p: usize, rows: usize) -> Self::Panel<'_>;
    /// The candle op's name.
    const OP_NAME: &'static str;
}

/// A panel widened whole to f32: its steps, and which it is (weight number, panel index).
struct WidenedPanel {
    key: Option<(u64, usize)>,
    steps: Vec<[f32; NR]>,
}

thread_local! {
    /// The last panel this thread widened whole ([`fold_widened_panel`]).
    static WIDENED: RefCell<WidenedPanel> = const {
        RefCell::new(WidenedPanel { key: None, steps: Vec::new() })
    };
}

/// Numbers for weights whose panels [`fold_widened_panel`] keeps (never reused, unlike an
/// address).
static NEXT_WEIGHT: AtomicU64 = AtomicU64::new(0);

/// A number for a new packed weight, by which [`fold_widened_panel`] knows its panels.
pub(super) fn new_weight_number() -> u64 {
    NEXT_WEIGHT.fetch_add(1, Ordering::Relaxed)
}

/// Rows past which a GEMM passes a panel more than once (its largest register block): where a
/// quantized panel is widened whole once ([`fold_widened_panel`]) rather than run by run.
pub(super) const WIDEN_WHOLE_PAST: usize = 8;

/// [`PanelSteps::fold`] for a quantized panel that several register blocks read: the panel
/// `key` (weight number, panel index) widened whole into this thread's buffer by `widen`
/// (its `k_total` steps) unless it is the one already there, then its steps `range` folded
/// as f32 steps. The GEMM passes a panel once per block of rows, so a panel widened
/// whole once serves them all, where widening it run by run inside each block would repeat
/// the work (MXFP4's, FP8's panels). The same widened values, so the same bits.
///
/// # Safety
/// As for [`PanelSteps::fold`].
#[inline(always)]
pub(super) unsafe fn fold_widened_panel<const R: usize, const C0: usize, const C: usize>(
    key: (u64, usize),
    k_total: usize,
    widen: impl FnOnce(&mut [[f32; NR]]),
    range: std::ops::Range<usize>,
    a: *const f32,
    lda: usize,
    acc: [[f32; C]; R],
) -> [[f32; C]; R] {
    // Not in a closure (`with_borrow_mut`): a closure does not inherit the caller's target
    // features, and the microkernel inlined into one ran scalar (150x slower).
    let cell: *const RefCell<WidenedPanel> = WIDENED.with(|c| c as *const _);
    // SAFETY: this thread's own value, alive as long as the thread.
    let mut panel = unsafe { &*cell }.borrow_mut();
    if panel.key != Some(key) {
        panel.steps.resize(k_total, [0f32; NR]);
        widen(&mut panel.steps);
        panel.key = Some(key);
    }
    let k = range.len();
    let steps: &[[f32; NR]] = &panel.steps[range];
    // SAFETY: the caller's contract; `steps` holds its k steps.
    unsafe { steps.fold::<R, C0, C>(a, lda, k, acc) }
}

/// The k steps of one panel.
pub(super) trait PanelSteps: Copy {
    /// The steps from `k0` on.
    fn skip_steps(self, k0: usize) -> Self;

    /// `acc` (R rows × columns `C0..C0+C`) with the FMA chain over steps `0..k` continued:
    /// `acc[r][c] = fma(a[r][kk], w[kk][C0 + c], acc[r][c])` for kk in order ([`fold_steps`]
    /// over the widened steps). Storage may widen its steps as it likes, never change this
    /// arithmetic.
    ///
    /// # Safety
    /// `a` must address `R` rows of `k` readable floats at stride `lda`; the panel holds `k`
    /// steps.
    unsafe fn fold<const R: usize, const C0: usize, const C: usize>(
        self,
        a: *const f32,
        lda: usize,
        k: usize,
        acc: [[f32; C]; R],
    ) -> [[f32; C]; R];
}

/// [`PanelSteps::fold`] over `steps`, a panel's steps widened to NR f32 weights each.
///
/// # Safety
/// As for [`PanelSteps::fold`].
#[inline(always)]
pub(super) unsafe fn fold_steps<const R: usize, const C0: usize, const C: usize>(
    steps: impl Iterator<Item = [f32; NR]>,
    a: *const f32,
    lda: usize,
    k: usize,
    mut acc: [[f32; C]; R],
) -> [[f32; C]; R] {
    // The columns outside C0..C0+C are widened for nothing and dropped by the compiler.
    for (kk, bk) in steps.enumerate().take(k) {
        for (r, acc_r) in acc.iter_mut().enumerate() {
            // SAFETY: r < R and kk < k, inside the rows the caller vouches for.
            let av = unsafe { *a.add(r * lda + kk) };
            for c in 0..C {
                acc_r[c] = av.mul_add(bk[C0 + c], acc_r[c]);
            }
        }
    }
    acc
}

impl PanelSteps for &[[f32; NR]] {
    #[inline(always)]
    fn skip_steps(self, k0: usize) -> Self {
        &self[k0..]
    }

    #[inline(always)]
    unsafe fn fold<const R: usize, const C0: usize, const C: usize>(
        self,
        a: *const f32,
        lda: usize,
        k: usize,
        acc: [[f32; C]; R],
    ) -> [[f32; C]; R] {
        // SAFETY: forwarded from the caller.
        unsafe { fold_steps::<R, C0, C>(self.iter().copied(), a, lda, k, acc) }
    }
}

impl Panels for PackedWeight {
    type Panel<'a> = &'a [[f32; NR]];
    const OP_NAME: &'static str = "detspec-packed-matmul";

    fn k(&self) -> usize {
        self.k
    }

    fn n(&self) -> usize {
        self.n
    }

    fn panel(&self, p: usize, _rows: usize) -> &[[f32; NR]] {
        self.data[p * self.k * NR..(p + 1) * self.k * NR]
            .as_chunks::<NR>()
            .0
    }
}

/// `R` rows of A (row stride `lda`, `k` columns) times columns `C0..C0+C` of one packed panel:
/// the R × C block.
///
/// # Safety
/// `a` must address `R` rows of `k` readable floats at stride `lda`; `panel` holds `k` steps.
#[inline(always)]
unsafe fn microkernel<P: PanelSteps, const R: usize, const C0: usize, const C: usize>(
    a: *const f32,
    lda: usize,
    panel: P,
    k: usize,
) -> [[f32; C]; R] {
    // SAFETY: forwarded from the caller.
    unsafe { panel.fold::<R, C0, C>(a, lda, k, [[0f32; C]; R]) }
}

/// [`microkernel`] over `parts` contiguous ranges of k, combined as [`Reduction::SplitK`] says.
///
/// # Safety
/// As for [`microkernel`].
#[inline(always)]
unsafe fn split_k_microkernel<P: PanelSteps, const R: usize, const C0: usize, const C: usize>(
    a: *const f32,
    lda: usize,
    panel: P,
    k: usize,
    parts: usize,
) -> [[f32; C]; R] {
    let mut sum = [[0f32; C]; R];
    for part in 0..parts {
        let (k0, k1) = (part * k / parts, (part + 1) * k / parts);
        // SAFETY: columns k0..k1 of the caller's rows, and the panel's steps k0..k1.
        let acc =
            unsafe { microkernel::<P, R, C0, C>(a.add(k0), lda, panel.skip_steps(k0), k1 - k0) };
        for (s, acc) in sum.iter_mut().zip(&acc) {
            for (s, &x) in s.iter_mut().zip(acc) {
                *s += round_bf16(x);
            }
        }
    }
    for s in sum.iter_mut().flatten() {
        *s = round_bf16(*s);
    }
    sum
}

/// How [`panel_rows`] cuts a panel into register blocks: the accumulators of one block, its
/// weight vectors and an activation broadcast must fit the vector registers, or the compiler
/// spills accumulators to the stack and every FMA becomes a load, an FMA and a store. Only
/// speed depends on it: every element is the same FMA chain whatever the block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Blocking {
    /// Up to 8 rows × all [`NR`] columns: 16 accumulators of 32 AVX-512 registers.
    Wide,
    /// AVX2's 16 registers: blocks of up to 6 rows × half a panel (12
    /// accumulators, 2 weight vectors, 1 broadcast), or up to 3 rows × the whole panel for the
    /// last rows (a decode step's few rows), where two passes over the panel would read its
    /// weights twice.
    Narrow,
}

/// Computes columns of panel `p` for all `m` rows of `a` into `out` (row stride `n`).
///
/// # Safety
/// `out` must address `m × n` writable floats that no other thread writes in this panel's
/// columns; `a` holds `m × k` floats.
#[inline(always)]
unsafe fn panel_rows<W: Panels>(
    a: &[f32],
    m: usize,
    w: &W,
    p: usize,
    out: *mut f32,
    reduction: Reduction,
    blocking: Blocking,
) {
    const HALF: usize = NR / 2;
    let (k, n) = (w.k(), w.n());
    let panel = w.panel(p, m);
    let c0 = p * NR;
    let width = NR.min(n - c0);
    // Writes rows r0.. of the block `acc`, whose columns start at panel column `first`.
    let store = |r0: usize, first: usize, acc: &[&[f32]]| {
        let cols = width.saturating_sub(first);
        for (r, acc_r) in acc.iter().enumerate() {
            // SAFETY: row r0 + r < m, columns c0+first..c0+first+cols < n; exclusive per
            // panel (raw writes: the buffer may be uninitialised).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    acc_r.as_ptr(),
                    out.add((r0 + r) * n + c0 + first),
                    cols.min(acc_r.len()),
                )
            };
        }
    };
    let mut r0 = 0;
    while r0 < m {
        let left = m - r0;
        let a_ptr = a[r0 * k..].as_ptr();
        // A block of $r rows × columns $c0..$c0+$c.
        macro_rules! block {
            ($r:literal, $c0:expr, $c:expr) => {{
                // SAFETY: rows r0..r0+$r of `a` exist (m × k floats).
                let acc = unsafe {
                    match reduction {
                        Reduction::Sequential => {
                            microkernel::<W::Panel<'_>, $r, { $c0 }, { $c }>(a_ptr, k, panel, k)
                        }
                        Reduction::SplitK(parts) => split_k_microkernel::<
                            W::Panel<'_>,
                            $r,
                            { $c0 },
                            { $c },
                        >(
                            a_ptr, k, panel, k, parts.clamp(1, k)
                        ),
                    }
                };
                let rows: [&[f32]; $r] = std::array::from_fn(|r| &acc[r][..]);
                store(r0, $c0, &rows);
                $r
            }};
        }
        // $r rows × both half panels.
        macro_rules! halves {
            ($r:literal) => {{
                block!($r, 0, HALF);
                if width > HALF {
                    block!($r, HALF, HALF);
                }
                $r
            }};
        }
        r0 += match (blocking, left) {
            (Blocking::Wide, 8..) => block!(8, 0, NR),
            (Blocking::Wide, 7) => block!(7, 0, NR),
            (Blocking::Wide, 6) => block!(6, 0, NR),
            (Blocking::Wide, 5) => block!(5, 0, NR),
            (Blocking::Wide, 4) => block!(4, 0, NR),
            (Blocking::Narrow, 6..) => halves!(6),
            (Blocking::Narrow, 5) => halves!(5),
            (Blocking::Narrow, 4) => halves!(4),
            (_, 3) => block!(3, 0, NR),
            (_, 2) => block!(2, 0, NR),
            _ => block!(1, 0, NR),
        };
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn panel_rows_avx512<W: Panels>(
    a: &[f32],
    m: usize,
    w: &W,
    p: usize,
    out: *mut f32,
    reduction: Reduction,
) {
    // SAFETY: forwarded from the caller.
    unsafe { panel_rows(a, m, w, p, out, reduction, Blocking::Wide) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn panel_rows_avx2<W: Panels>(
    a: &[f32],
    m: usize,
    w: &W,
    p: usize,
    out: *mut f32,
    reduction: Reduction,
) {
    // SAFETY: forwarded from the caller.
    unsafe { panel_rows(a, m, w, p, out, reduction, Blocking::Narrow) }
}

/// The output buffer shared by the panel tasks, each writing only its own columns.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint column ranges (one panel each) of the buffer.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Through a method, so closures capture the whole (Sync) wrapper, not the raw field.
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// `a[m, k] @ w` into a new `[m, n]` buffer, with the given instruction set.
pub fn packed_matmul_with(
    a: &[f32],
    m: usize,
    w: &PackedWeight,
    isa: CpuIsa,
) -> candle_core::Result<Vec<f32>> {
    matmul_panels(a, m, w, isa, Reduction::Sequential)
}

/// `a[m, k] @ w` with the given instruction set and reduction order.
pub fn packed_matmul_reduced(
    a: &[f32],
    m: usize,
    w: &PackedWeight,
    isa: CpuIsa,
    reduction: Reduction,
) -> candle_core::Result<Vec<f32>> {
    matmul_panels(a, m, w, isa, reduction)
}

/// `a[m, k] @ w` for any panel storage: the one driver of the f32 and bf16 GEMMs.
pub(super) fn matmul_panels<W: Panels>(
    a: &[f32],
    m: usize,
    w: &W,
    isa: CpuIsa,
    reduction: Reduction,
) -> candle_core::Result<Vec<f32>> {
    let (k, n) = (w.k(), w.n());
    if a.len() != m * k {
        bail!(
            "packed matmul: input has {} values, expected [{m}, {k}]",
            a.len()
        );
    }
    Ok(for_each_block(m, n, k, ROW_BLOCK, |r0, rows, p, out| {
        let a_block = &a[r0 * k..(r0 + rows) * k];
        // SAFETY: `out` is row r0 of the m × n buffer and rows r0..r0+rows of panel p are
        // this task's alone; the instruction set is one this CPU has.
        unsafe {
            match isa {
                #[cfg(target_arch = "x86_64")]
                CpuIsa::Avx512 => panel_rows_avx512(a_block, rows, w, p, out, reduction),
                #[cfg(target_arch = "x86_64")]
                CpuIsa::Avx2Fma => panel_rows_avx2(a_block, rows, w, p, out, reduction),
                _ => panel_rows(a_block, rows, w, p, out, reduction, Blocking::Wide),
            }
        }
    }))
}

/// Runs `run(r0, rows, panel, out_row_r0)` over every (block of `row_block` rows, panel of
/// [`NR`] columns) of an `[m, n]` product with inner size `k`, and returns the `[m, n]` buffer
/// the tasks filled (each writes rows r0..r0+rows of its panel's columns, every element once:
/// no zeroing first).
///
/// Tasks are row-block-major: a block of A stays in L2 while the panels stream past it
/// (without this a prefill of thousands of rows re-read all of A once per panel), and rayon's
/// halving split hands each thread whole runs of one row block. One parallel region for the
/// whole product; small products are not worth waking other threads for.
pub(super) fn for_each_block(
    m: usize,
    n: usize,
    k: usize,
    row_block: usize,
    run: impl Fn(usize, usize, usize, *mut f32) + Sync,
) -> Vec<f32> {
    let mut out: Vec<f32> = Vec::with_capacity(m * n);
    let ptr = OutPtr(out.as_mut_ptr());
    let panels = n.div_ceil(NR);
    let task = |t: usize| {
        let (r0, p) = ((t / panels) * row_block, t % panels);
        // SAFETY: r0 < m, so row r0 is inside the m × n allocation.
        let row = unsafe { ptr.get().add(r0 * n) };
        run(r0, row_block.min(m - r0), p, row);
    };
    let tasks = m.div_ceil(row_block) * panels;
    if m * k * n < 1 << 16 {
        (0..tasks).for_each(task);
    } else {
        (0..tasks).into_par_iter().for_each(task);
    }
    // SAFETY: the tasks wrote every row of every panel's columns, i.e. all m × n values.
    unsafe { out.set_len(m * n) };
    out
}

/// `a[m, k] @ w` with the best instruction set of this CPU.
pub fn packed_matmul(a: &[f32], m: usize, w: &PackedWeight) -> candle_core::Result<Vec<f32>> {
    packed_matmul_with(a, m, w, CpuIsa::detect())
}

/// The packed GEMM as a candle op, for any panel storage, with the reduction `profile` picks
/// for the input's row count (`invariant`: the batch-invariant mode's fixed-block GEMM).
pub(super) struct PackedMatmul<W> {
    pub(super) w: Arc<W>,
    pub(super) profile: KernelProfile,
    pub(super) invariant: bool,
}

impl<W: Panels + Send + 'static> CustomOp1 for PackedMatmul<W> {
    fn name(&self) -> &'static str {
        W::OP_NAME
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(s, l, "matmul input")?;
        let (wk, wn) = (self.w.k(), self.w.n());
        let (m, k) = match l.dims() {
            [m, k] => (*m, *k),
            dims => bail!("matmul: input must be [rows, {wk}], got {dims:?}"),
        };
        if k != wk {
            bail!("matmul: input has {k} columns, weight has {wk} rows");
        }
        let reduction = Reduction::for_rows(self.profile, m, self.invariant);
        let out = matmul_panels(x, m, self.w.as_ref(), CpuIsa::detect(), reduction)?;
        Ok((CpuStorage::F32(out), Shape::from((m, wn))))
    }
}

/// `x[m, k] @ w` as a candle op (CPU), with the invariant reduction.
pub fn matmul_packed(x: &Tensor, w: &Arc<PackedWeight>) -> candle_core::Result<Tensor> {
    matmul_packed_profiled(x, w, KernelProfile::Invariant, false)
}

/// `x[m, k] @ w` as a candle op (CPU), with the reduction `profile` picks for M rows
/// (`invariant`: the batch-invariant mode's fixed-block GEMM).
pub fn matmul_packed_profiled(
    x: &Tensor,
    w: &Arc<PackedWeight>,
    profile: KernelProfile,
    invariant: bool,
) -> candle_core::Result<Tensor> {
    apply_packed(x, w, profile, invariant)
}

/// [`PackedMatmul`] applied to `x`, for any panel storage.
pub(super) fn apply_packed<W: Panels + Send + 'static>(
    x: &Tensor,
    w: &Arc<W>,
    profile: KernelProfile,
    invariant: bool,
) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op1_no_bwd(&PackedMatmul {
        w: w.clone(),
        profile,
        invariant,
    })
}
