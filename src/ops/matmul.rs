//! Matrix products with a schedule that does not depend on the number of rows.

use candle_core::Tensor;

/// Rows per GEMM call in invariant mode: every matmul runs with exactly this M.
pub const INVARIANT_GEMM_ROWS: usize = 16;

/// `x @ w` computed on zero-padded blocks of exactly [`INVARIANT_GEMM_ROWS`] rows, so the
/// GEMM kernel (and its reduction order) is the same whatever the number of rows. candle's CPU
/// matmul picks a different algorithm by M (gemv for M = 1, blocked GEMM otherwise), which is
/// the batch variance this removes.
pub fn invariant_matmul(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let (m, _) = x.dims2()?;
    let r = INVARIANT_GEMM_ROWS;
    let padded = m.div_ceil(r) * r;
    let x = if padded == m {
        x.clone()
    } else {
        x.pad_with_zeros(0, 0, padded - m)?
    };
    let blocks = (0..padded / r)
        .map(|i| x.narrow(0, i * r, r)?.contiguous()?.matmul(w))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Tensor::cat(&blocks, 0)?.narrow(0, 0, m)
}
