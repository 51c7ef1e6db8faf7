//! The CPU GEMM with bfloat16 weights: `x @ W` where `x` is f32 and `W` is held in bf16,
//! packed once at load. Activations, products and accumulation are f32.
//!
//! Same kernel as the f32 GEMM (`ops::gemm`: same panels, register block, task split and
//! driver); only a panel's storage differs. Each k step of a panel holds its [`NR`] = 32
//! weights as 16 `u32` words, word `c` = bf16 bits of column `c` in the low half and of column
//! `c + 16` in the high half. One 64-byte load gives both halves of the step's columns in f32
//! with one shift (`word << 16`: columns 0..16) and one mask (`word & 0xffff0000`: columns
//! 16..32); both are exact, as every bf16 value is an f32 with the low 16 bits zero.
//!
//! So every output element is the same FMA chain as in the f32 kernel, over the exactly widened
//! weights: `c[i][j] = fma(a[i][K-1], w[K-1][j], … fma(a[i][0], w[0][j], 0.0))`. The bf16 GEMM
//! gives **the f32 GEMM's bits on bf16-valued weights**, and with them its invariances: batch-,
//! position- and thread-invariant, the same bits on AVX-512, AVX2+FMA and the portable path
//! (`tests/gemm_bf16.rs` asserts the equality over random shapes and every model (K, N)).
//!
//! Not used here: `VDPBF16PS` (AVX-512 BF16) and AMX. Both multiply bf16 by bf16, so the
//! activations have to be rounded to bf16 first (a different model numerically): that is the
//! opt-in bf16-activation mode's GEMM (`ops::gemm_abf16`, `activation_dtype`), with its own
//! fingerprint. Widening keeps f32 activations and one set of bits everywhere; what bf16 buys
//! here is half the weight bytes, which is what limits decode (docs/performance.md).

use std::sync::Arc;

use candle_core::{bail, Tensor};

use super::gemm::{apply_packed, fold_steps, matmul_panels, PanelSteps, Panels, Reduction, NR};
use super::CpuIsa;
use crate::config::KernelProfile;

/// Words per panel step: two bf16 weights each.
const WORDS: usize = NR / 2;

/// A `[K, N]` weight in bf16, packed into column panels for [`packed_matmul_bf16`].
#[derive(Debug)]
pub struct PackedWeightBf16 {
    k: usize,
    n: usize,
    data: Vec<[u32; WORDS]>,
}

impl PackedWeightBf16 {
    /// Packs `W^T` given as the bf16 bits of the row-major `[n, k]` matrix `wt` (a checkpoint's
    /// `[out, in]`).
    pub fn from_transposed_bits(wt: &[u16], n: usize, k: usize) -> candle_core::Result<Self> {
        Self::pack(wt.len(), k, n, |kk, j| wt[j * k + kk])
    }

    /// Packs the bf16 bits of a row-major `[k, n]` matrix (`w[kk * n + j]`).
    pub fn from_row_major_bits(w: &[u16], k: usize, n: usize) -> candle_core::Result<Self> {
        Self::pack(w.len(), k, n, |kk, j| w[kk * n + j])
    }

    /// Panels from `w(kk, j)`, the bits of the element at row `kk`, column `j` of `W`
    /// (`len` values in all).
    fn pack(
        len: usize,
        k: usize,
        n: usize,
        w: impl Fn(usize, usize) -> u16 + Sync,
    ) -> candle_core::Result<Self> {
        use rayon::prelude::*;
        if len != k * n || k == 0 || n == 0 {
            bail!("packed bf16 weight: {len} values for a [{k}, {n}] matrix");
        }
        let mut data = vec![[0u32; WORDS]; n.div_ceil(NR) * k];
        data.par_chunks_mut(k).enumerate().for_each(|(p, panel)| {
            let c0 = p * NR;
            let bits = |kk: usize, c: usize| {
                if c0 + c < n {
                    u32::from(w(kk, c0 + c))
                } else {
                    0
                }
            };
            for (kk, step) in panel.iter_mut().enumerate() {
                for (c, word) in step.iter_mut().enumerate() {
                    *word = bits(kk, c) | bits(kk, c + WORDS) << 16;
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

    /// Bytes the packed weight holds (2 per element, plus the last panel's padding).
    pub fn bytes(&self) -> usize {
        std::mem::size_of_val(self.data.as_slice())
    }
}

impl PanelSteps for &[[u32; WORDS]] {
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
        let widened = self.iter().map(|step| {
            let mut out = [0f32; NR];
            let (lo, hi) = out.split_at_mut(WORDS);
            for ((l, h), &word) in lo.iter_mut().zip(hi.iter_mut()).zip(step) {
                *l = f32::from_bits(word << 16);
                *h = f32::from_bits(word & 0xffff_0000);
            }
            out
        });
        // SAFETY: forwarded from the caller.
        unsafe { fold_steps::<R, C0, C>(widened, a, lda, k, acc) }
    }
}

impl Panels for PackedWeightBf16 {
    type Panel<'a> = &'a [[u32; WORDS]];
    const OP_NAME: &'static str = "detspec-packed-matmul-bf16";

    fn k(&self) -> usize {
        self.k
    }

    fn n(&self) -> usize {
        self.n
    }

    fn panel(&self, p: usize, _rows: usize) -> &[[u32; WORDS]] {
        &self.data[p * self.k..(p + 1) * self.k]
    }
}

/// `a[m, k] @ w` into a new `[m, n]` buffer, with the given instruction set.
pub fn packed_matmul_bf16_with(
    a: &[f32],
    m: usize,
    w: &PackedWeightBf16,
    isa: CpuIsa,
) -> candle_core::Result<Vec<f32>> {
    matmul_panels(a, m, w, isa, Reduction::Sequential)
}

/// `a[m, k] @ w` with the best instruction set of this CPU.
pub fn packed_matmul_bf16(
    a: &[f32],
    m: usize,
    w: &PackedWeightBf16,
) -> candle_core::Result<Vec<f32>> {
    packed_matmul_bf16_with(a, m, w, CpuIsa::detect())
}

/// `x[m, k] @ w` as a candle op (CPU; `x` f32, output f32), with the invariant reduction.
pub fn matmul_packed_bf16(x: &Tensor, w: &Arc<PackedWeightBf16>) -> candle_core::Result<Tensor> {
    matmul_packed_bf16_profiled(x, w, KernelProfile::Invariant, false)
}

/// `x[m, k] @ w` as a candle op (CPU; `x` f32, output f32), with the reduction `profile`
/// picks for M rows (`invariant`: the batch-invariant mode's fixed-block GEMM).
pub fn matmul_packed_bf16_profiled(
    x: &Tensor,
    w: &Arc<PackedWeightBf16>,
    profile: KernelProfile,
    invariant: bool,
) -> candle_core::Result<Tensor> {
    apply_packed(x, w, profile, invariant)
}
