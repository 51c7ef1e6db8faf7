//! Writes new K or V rows into the paged cache at their slots.
//!
//! V (and any row cache) is `[pages, page_size, kv_heads, head_dim]`: a slot's row is
//! contiguous. K is stored transposed per page, `[pages, kv_heads, head_dim, page_size]`:
//! element `d` of one page's keys is contiguous across slots, so attention scores a page's keys
//! with vector multiply-adds. One op writes both; only where an element lands differs.

use std::sync::Arc;

use candle_core::{bail, CpuStorage, InplaceOp2, Layout, Tensor};

use super::contiguous_f32;

/// How a cache lays out a page.
#[derive(Clone, Copy)]
enum PageLayout {
    /// `[page_size, kv_heads, head_dim]`: rows.
    Rows,
    /// `[kv_heads, head_dim, page_size]`: keys transposed.
    Transposed,
}

struct CacheWrite {
    /// Flat slot (page * page_size + offset) for each input row.
    slots: Arc<Vec<u32>>,
    layout: PageLayout,
}

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
        let (num_slots, page_size, row) = match (self.layout, cl.dims()) {
            (PageLayout::Rows, [p, s, h, d]) => (p * s, *s, h * d),
            (PageLayout::Transposed, [p, h, d, s]) => (p * s, *s, h * d),
            (PageLayout::Rows, dims) => bail!(
                "cache_write: cache must be [pages, page_size, kv_heads, head_dim], got {dims:?}"
            ),
            (PageLayout::Transposed, dims) => bail!(
                "cache_write: key cache must be [pages, kv_heads, head_dim, page_size], got {dims:?}"
            ),
        };
        if src.len() != self.slots.len() * row {
            bail!(
                "cache_write: {} slots for a source of {:?} (row of {row})",
                self.slots.len(),
                sl.dims()
            );
        }
        let Some((start, _)) = cl.contiguous_offsets() else {
            bail!("cache_write: cache must be contiguous");
        };
        let CpuStorage::F32(data) = cache else {
            bail!("cache_write: cache must be f32");
        };
        for (i, &slot) in self.slots.iter().enumerate() {
            let slot = slot as usize;
            if slot >= num_slots {
                bail!("cache_write: slot {slot} out of range ({num_slots} slots)");
            }
            let values = &src[i * row..(i + 1) * row];
            match self.layout {
                PageLayout::Rows => {
                    let dst = start + slot * row;
                    data[dst..dst + row].copy_from_slice(values);
                }
                PageLayout::Transposed => {
                    let (page, t) = (slot / page_size, slot % page_size);
                    for (hd, &x) in values.iter().enumerate() {
                        data[start + (page * row + hd) * page_size + t] = x;
                    }
                }
            }
        }
        Ok(())
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
