//! Copies whole KV pages inside a paged cache: the data half of copy-on-write
//! (see [`crate::kv::BlockTable::prepare_append`]).

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, InplaceOp1, Layout, Tensor};

struct PageCopy {
    /// `(src, dst)` page pairs, applied in order.
    pairs: Arc<Vec<(u32, u32)>>,
}

/// Checks every pair against the page count before anything is written, so a bad pair leaves the
/// cache untouched.
fn check_pairs(pairs: &[(u32, u32)], num_pages: usize) -> candle_core::Result<()> {
    for &(s, d) in pairs {
        if s as usize >= num_pages || d as usize >= num_pages {
            bail!("copy_pages: pair ({s}, {d}) out of range ({num_pages} pages)");
        }
    }
    Ok(())
}

/// Copies page rows in `data` (`page` elements per page, starting at `start`).
fn copy_rows<T: Copy>(data: &mut [T], start: usize, page: usize, pairs: &[(u32, u32)]) {
    for &(s, d) in pairs {
        if s != d {
            let src = start + s as usize * page;
            data.copy_within(src..src + page, start + d as usize * page);
        }
    }
}

impl InplaceOp1 for PageCopy {
    fn name(&self) -> &'static str {
        "detspec-page-copy"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let dims = layout.dims();
        let Some((&num_pages, rest)) = dims.split_first() else {
            bail!("copy_pages: cache must have a page dimension, got a scalar");
        };
        let page: usize = rest.iter().product();
        check_pairs(&self.pairs, num_pages)?;
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("copy_pages: cache must be contiguous");
        };
        let pairs = &self.pairs[..];
        macro_rules! go {
            ($v:expr) => {{
                if $v.len() < end {
                    bail!(
                        "copy_pages: storage of {} elements for a layout ending at {end}",
                        $v.len()
                    );
                }
                copy_rows($v, start, page, pairs)
            }};
        }
        match storage {
            CpuStorage::U8(v) => go!(v),
            CpuStorage::U32(v) => go!(v),
            CpuStorage::I16(v) => go!(v),
            CpuStorage::I32(v) => go!(v),
            CpuStorage::I64(v) => go!(v),
            CpuStorage::BF16(v) => go!(v),
            CpuStorage::F16(v) => go!(v),
            CpuStorage::F32(v) => go!(v),
            CpuStorage::F64(v) => go!(v),
            CpuStorage::F8E4M3(v) => go!(v),
            other => bail!("copy_pages: unsupported cache dtype {:?}", other.dtype()),
        }
        Ok(())
    }

    /// `cuda/page_copy.cu`: independent pairs in one launch, dependent ones in later launches.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &mut candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<()> {
        use super::cuda::{self, with_float_type};
        use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
        use candle_core::cuda::WrapErr;

        let dims = layout.dims();
        let Some((&num_pages, rest)) = dims.split_first() else {
            bail!("copy_pages: cache must have a page dimension, got a scalar");
        };
        let page: usize = rest.iter().product();
        check_pairs(&self.pairs, num_pages)?;
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("copy_pages: cache must be contiguous");
        };
        let dev = storage.device().clone();
        let f = cuda::kernel(&dev, &cuda::PAGE_COPY, "page_copy", storage.dtype())?;
        let stream = dev.cuda_stream();
        for wave in independent_waves(&self.pairs) {
            let flat: Vec<u32> = wave.iter().flat_map(|&(s, d)| [s, d]).collect();
            let pairs = cuda::upload_u32(&dev, &flat)?;
            let cfg = LaunchConfig {
                grid_dim: (
                    page.div_ceil(256).clamp(1, 1024) as u32,
                    wave.len() as u32,
                    1,
                ),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            with_float_type!(storage.dtype(), "copy_pages", |T| {
                let mut data = storage.as_cuda_slice_mut::<T>()?.slice_mut(start..end);
                let mut b = stream.launch_builder(&f);
                b.arg(&mut data).arg(&pairs).arg(&page);
                // SAFETY: argument types and order match `page_copy_*` in cuda/page_copy.cu;
                // every page id was checked; no page of a wave is written by one pair and
                // touched by another.
                unsafe { b.launch(cfg) }.w()?;
            });
        }
        Ok(())
    }
}

/// `pairs` (minus no-op ones) cut into consecutive runs in which no page written by one pair is
/// read or written by another, so each run can be copied in parallel and the runs in order give
/// the same result as the pairs one by one.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn independent_waves(pairs: &[(u32, u32)]) -> Vec<Vec<(u32, u32)>> {
    let mut waves: Vec<Vec<(u32, u32)>> = Vec::new();
    let mut current: Vec<(u32, u32)> = Vec::new();
    for &(s, d) in pairs.iter().filter(|(s, d)| s != d) {
        let conflicts = current
            .iter()
            .any(|&(cs, cd)| cd == s || cd == d || cs == d);
        if conflicts {
            waves.push(std::mem::take(&mut current));
        }
        current.push((s, d));
    }
    if !current.is_empty() {
        waves.push(current);
    }
    waves
}

/// Copies page `src` onto page `dst` for every pair, in order, inside `cache`
/// (`[num_pages, page_size, kv_heads, head_dim]`, or any shape whose first dimension is pages).
/// All pairs are bounds-checked before the first copy; an out-of-range pair is an error and
/// leaves the cache untouched.
///
/// An in-place custom op on every device.
pub fn copy_pages(cache: &Tensor, pairs: &[(u32, u32)]) -> candle_core::Result<()> {
    if pairs.is_empty() {
        return Ok(());
    }
    let num_pages = match cache.dims().first() {
        Some(&n) => n,
        None => bail!("copy_pages: cache must have a page dimension, got a scalar"),
    };
    check_pairs(pairs, num_pages)?;
    cache.inplace_op1(&PageCopy {
        pairs: Arc::new(pairs.to_vec()),
    })
}

#[cfg(test)]
mod tests {
    use super::independent_waves;
    use proptest::prelude::*;

    /// Applying the waves in order, each wave's copies "in parallel" (all reads before all
    /// writes), gives what the pairs give one by one.
    fn apply_sequential(pages: &mut [u32], pairs: &[(u32, u32)]) {
        for &(s, d) in pairs {
            pages[d as usize] = pages[s as usize];
        }
    }

    fn apply_waves(pages: &mut [u32], pairs: &[(u32, u32)]) {
        for wave in independent_waves(pairs) {
            let read: Vec<u32> = wave.iter().map(|&(s, _)| pages[s as usize]).collect();
            for (&(_, d), v) in wave.iter().zip(read) {
                pages[d as usize] = v;
            }
        }
    }

    proptest! {
        #[test]
        fn waves_preserve_sequential_order(pairs in prop::collection::vec((0u32..8, 0u32..8), 0..24)) {
            let mut a: Vec<u32> = (0..8).collect();
            let mut b = a.clone();
            apply_sequential(&mut a, &pairs);
            apply_waves(&mut b, &pairs);
            prop_assert_eq!(a, b);
        }
    }
}
