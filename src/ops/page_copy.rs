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
}

/// Copies page `src` onto page `dst` for every pair, in order, inside `cache`
/// (`[num_pages, page_size, kv_heads, head_dim]`, or any shape whose first dimension is pages).
/// All pairs are bounds-checked before the first copy; an out-of-range pair is an error and
/// leaves the cache untouched.
///
/// On CPU this is an in-place custom op; on other devices (until a dedicated kernel lands) it
/// falls back to `narrow` + `slice_set`, which is also in place.
pub fn copy_pages(cache: &Tensor, pairs: &[(u32, u32)]) -> candle_core::Result<()> {
    if pairs.is_empty() {
        return Ok(());
    }
    let num_pages = match cache.dims().first() {
        Some(&n) => n,
        None => bail!("copy_pages: cache must have a page dimension, got a scalar"),
    };
    check_pairs(pairs, num_pages)?;
    if cache.device().is_cpu() {
        return cache.inplace_op1(&PageCopy {
            pairs: Arc::new(pairs.to_vec()),
        });
    }
    for &(s, d) in pairs {
        if s != d {
            let page = cache.narrow(0, s as usize, 1)?.copy()?;
            cache.slice_set(&page, 0, d as usize)?;
        }
    }
    Ok(())
}
