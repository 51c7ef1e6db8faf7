//! Writes new K or V rows into the paged cache at their slots.

use std::sync::Arc;

use candle_core::{bail, CpuStorage, InplaceOp2, Layout, Tensor};

use super::contiguous_f32;

struct CacheWrite {
    /// Flat slot (page * page_size + offset) for each input row.
    slots: Arc<Vec<u32>>,
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
        let (num_slots, row) = match cl.dims() {
            [p, s, h, d] => (p * s, h * d),
            dims => bail!(
                "cache_write: cache must be [pages, page_size, kv_heads, head_dim], got {dims:?}"
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
            let dst = start + slot * row;
            data[dst..dst + row].copy_from_slice(&src[i * row..(i + 1) * row]);
        }
        Ok(())
    }
}

/// Copies row `i` of `src` (`[tokens, kv_heads, head_dim]`) into `cache` at `slots[i]`.
pub fn write_kv(cache: &Tensor, src: &Tensor, slots: Arc<Vec<u32>>) -> candle_core::Result<()> {
    cache.inplace_op2(&src.contiguous()?, &CacheWrite { slots })
}

/// Writes new keys into the K cache, stored transposed per page
/// (`[pages, kv_heads, head_dim, page_size]`: element `d` of the keys of one page and head is
/// contiguous across slots, so attention scores a page's keys with vector multiply-adds).
struct KeyCacheWrite {
    slots: Arc<Vec<u32>>,
}

impl InplaceOp2 for KeyCacheWrite {
    fn name(&self) -> &'static str {
        "detspec-key-cache-write"
    }

    fn cpu_fwd(
        &self,
        cache: &mut CpuStorage,
        cl: &Layout,
        src: &CpuStorage,
        sl: &Layout,
    ) -> candle_core::Result<()> {
        let src = contiguous_f32(src, sl, "key cache_write source")?;
        let (pages, heads, dim, page_size) = match cl.dims() {
            [p, h, d, s] => (*p, *h, *d, *s),
            dims => bail!(
                "key cache_write: cache must be [pages, kv_heads, head_dim, page_size], got {dims:?}"
            ),
        };
        let row = heads * dim;
        if src.len() != self.slots.len() * row {
            bail!(
                "key cache_write: {} slots for a source of {:?} (row of {row})",
                self.slots.len(),
                sl.dims()
            );
        }
        let Some((start, _)) = cl.contiguous_offsets() else {
            bail!("key cache_write: cache must be contiguous");
        };
        let CpuStorage::F32(data) = cache else {
            bail!("key cache_write: cache must be f32");
        };
        for (i, &slot) in self.slots.iter().enumerate() {
            let slot = slot as usize;
            if slot >= pages * page_size {
                bail!(
                    "key cache_write: slot {slot} out of range ({} slots)",
                    pages * page_size
                );
            }
            let (page, t) = (slot / page_size, slot % page_size);
            for (hd, &x) in src[i * row..(i + 1) * row].iter().enumerate() {
                data[start + (page * row + hd) * page_size + t] = x;
            }
        }
        Ok(())
    }
}

/// Copies key row `i` of `src` (`[tokens, kv_heads, head_dim]`) into the transposed K `cache`
/// at `slots[i]`.
pub fn write_k(cache: &Tensor, src: &Tensor, slots: Arc<Vec<u32>>) -> candle_core::Result<()> {
    cache.inplace_op2(&src.contiguous()?, &KeyCacheWrite { slots })
}
