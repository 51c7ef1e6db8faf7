//! Writes new K or V rows into the paged cache at their slots.
//!
//! V (and any row cache) is `[pages, page_size, kv_heads, head_dim]`: a slot's row is
//! contiguous. K is stored transposed per page, `[pages, kv_heads, head_dim, page_size]`:
//! element `d` of one page's keys is contiguous across slots, so attention scores a page's keys
//! with vector multiply-adds. One op writes both; only where an element lands differs.

use std::sync::Arc;

use candle_core::{bail, CpuStorage, InplaceOp2, Layout, Tensor};

use super::{bf16_bits, contiguous_f32};

/// How a cache lays out a page.
#[derive(Clone, Copy)]
pub(super) enum PageLayout {
    /// `[page_size, kv_heads, head_dim]`: rows.
    Rows,
    /// `[kv_heads, head_dim, page_size]`: keys transposed.
    Transposed,
}

pub(super) struct CacheWrite {
    /// Flat slot (page * page_size + offset) for each input row.
    pub(super) slots: Arc<Vec<u32>>,
    pub(super) layout: PageLayout,
}

impl CacheWrite {
    /// `(page_size, row)` of a cache of shape `dims` for a source of `src_len` elements, after
    /// checking the shapes and every slot.
    pub(super) fn geometry(
        &self,
        dims: &[usize],
        src_len: usize,
    ) -> candle_core::Result<(usize, usize)> {
        let (num_slots, page_size, row) = match (self.layout, dims) {
            (PageLayout::Rows, [p, s, h, d]) => (p * s, *s, h * d),
            (PageLayout::Transposed, [p, h, d, s]) => (p * s, *s, h * d),
            (PageLayout::Rows, dims) => bail!(
                "cache_write: cache must be [pages, page_size, kv_heads, head_dim], got {dims:?}"
            ),
            (PageLayout::Transposed, dims) => bail!(
                "cache_write: key cache must be [pages, kv_heads, head_dim, page_size], got {dims:?}"
            ),
        };
        if src_len != self.slots.len() * row {
            bail!(
                "cache_write: {} slots for a source of {src_len} elements (row of {row})",
                self.slots.len(),
            );
        }
        if let Some(&slot) = self.slots.iter().find(|&&s| s as usize >= num_slots) {
            bail!("cache_write: slot {slot} out of range ({num_slots} slots)");
        }
        Ok((page_size, row))
    }

    /// Writes every source row at its slot of `data` (a cache of elements `T`, from `start`),
    /// each value through `conv`.
    fn write<T: Copy>(
        &self,
        data: &mut [T],
        start: usize,
        page_size: usize,
        row: usize,
        src: &[f32],
        conv: impl Fn(f32) -> T,
    ) {
        for (i, &slot) in self.slots.iter().enumerate() {
            let slot = slot as usize;
            let values = &src[i * row..(i + 1) * row];
            match self.layout {
                PageLayout::Rows => {
                    let dst = start + slot * row;
                    for (d, &x) in data[dst..dst + row].iter_mut().zip(values) {
                        *d = conv(x);
                    }
                }
                PageLayout::Transposed => {
                    let (page, t) = (slot / page_size, slot % page_size);
                    for (hd, &x) in values.iter().enumerate() {
                        data[start + (page * row + hd) * page_size + t] = conv(x);
                    }
                }
            }
        }
    }
}

/// Device copies of the slots: every layer writes K and V at the same ones.
#[cfg(feature = "cuda")]
pub(super) static SLOTS_ON_DEVICE: super::cuda::UploadCache<
    Vec<u32>,
    candle_core::cuda::cudarc::driver::CudaSlice<u32>,
> = super::cuda::UploadCache::new();

impl InplaceOp2 for CacheWrite {
    fn name(&self) -> &'static str {
        "detspec-cache-write"
    }

    fn cpu_fwd(
        &self,
        cache: &mut CpuStorage,
        cl: &Layout,
        src: &CpuStorage,
        sl: &Layout,
    ) -> candle_core::Result<()> {
        let src = contiguous_f32(src, sl, "cache_write source")?;
        let (page_size, row) = self.geometry(cl.dims(), src.len())?;
        let Some((start, _)) = cl.contiguous_offsets() else {
            bail!("cache_write: cache must be contiguous");
        };
        match cache {
            CpuStorage::F32(data) => self.write(data, start, page_size, row, src, |x| x),
            // Rounded to nearest even by one integer definition (`ops::bf16_bits`): the same
            // bits on every CPU.
            CpuStorage::BF16(data) => self.write(data, start, page_size, row, src, |x| {
                half::bf16::from_bits(bf16_bits(x))
            }),
            other => bail!(
                "cache_write: cache must be f32 or bf16, got {:?}",
                candle_core::backend::BackendStorage::dtype(other)
            ),
        }
        Ok(())
    }

    /// `cuda/cache_write.cu`, one thread per element.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        cache: &mut candle_core::CudaStorage,
        cl: &Layout,
        src: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> candle_core::Result<()> {
        use super::cuda::{self, with_float_type};
        use candle_core::backend::BackendStorage;
        use candle_core::cuda::cudarc::driver::PushKernelArg;
        use candle_core::cuda::WrapErr;

        let n = sl.shape().elem_count();
        let (page_size, row) = self.geometry(cl.dims(), n)?;
        if cache.dtype() != src.dtype() {
            bail!(
                "cache_write: cache {:?} and source {:?} dtypes differ",
                cache.dtype(),
                src.dtype()
            );
        }
        if n == 0 {
            return Ok(());
        }
        let Some((start, end)) = cl.contiguous_offsets() else {
            bail!("cache_write: cache must be contiguous");
        };
        let dev = src.device().clone();
        let slots =
            SLOTS_ON_DEVICE.get_or_upload(&self.slots, &dev, |s| cuda::upload_u32(&dev, s))?;
        let f = cuda::kernel(&dev, &cuda::CACHE_WRITE, "cache_write", src.dtype())?;
        let args = [
            cuda::arg_i32(self.slots.len(), "cache_write rows")?,
            cuda::arg_i32(row, "cache_write row")?,
            cuda::arg_i32(page_size, "cache_write page_size")?,
            i32::from(matches!(self.layout, PageLayout::Transposed)),
        ];
        with_float_type!(src.dtype(), "cache_write", |T| {
            let values = cuda::view::<T>(src, sl, "cache_write source")?;
            let mut dst = cache.as_cuda_slice_mut::<T>()?.slice_mut(start..end);
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&mut dst).arg(&values).arg(slots.as_ref());
            for a in &args {
                b.arg(a);
            }
            // SAFETY: argument types and order match `cache_write_*` in cuda/cache_write.cu;
            // every slot was checked against the cache's size.
            unsafe { b.launch(cuda::grid_1d(n)) }.w()?;
            Ok(())
        })
    }
}

/// Copies row `i` of `src` (`[tokens, kv_heads, head_dim]`) into `cache` at `slots[i]`.
pub fn write_kv(cache: &Tensor, src: &Tensor, slots: Arc<Vec<u32>>) -> candle_core::Result<()> {
    let op = CacheWrite {
        slots,
        layout: PageLayout::Rows,
    };
    cache.inplace_op2(&src.contiguous()?, &op)
}

/// Copies key row `i` of `src` (`[tokens, kv_heads, head_dim]`) into the transposed K `cache`
/// at `slots[i]`.
pub fn write_k(cache: &Tensor, src: &Tensor, slots: Arc<Vec<u32>>) -> candle_core::Result<()> {
    let op = CacheWrite {
        slots,
        layout: PageLayout::Transposed,
    };
    cache.inplace_op2(&src.contiguous()?, &op)
}
