//! The KV page pool, allocated once when the engine starts: per layer a K tensor
//! `[num_pages, kv_heads, head_dim, page_size]` (keys transposed per page, for the attention
//! kernel's vector loop over a page's keys) and a V tensor `[num_pages, page_size, kv_heads,
//! head_dim]`. A page is contiguous in both, so page copies do not care.

use candle_core::{DType, Device, Tensor};

use crate::error::{DetspecError, Result};
use crate::ops::copy_pages;

use super::PageId;

/// KV storage for every layer.
#[derive(Debug)]
pub struct KvPool {
    /// (K, V) per layer.
    layers: Vec<(Tensor, Tensor)>,
    page_size: usize,
    num_pages: usize,
}

impl KvPool {
    /// Bytes one page takes across all layers (K and V).
    pub fn bytes_per_page(
        num_layers: usize,
        page_size: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: DType,
    ) -> usize {
        2 * num_layers * page_size * kv_heads * head_dim * dtype.size_in_bytes()
    }

    /// Pool size in pages from the user's settings: `num_kv_pages` when given, otherwise as many
    /// pages of `bytes_per_page` as fit in the `kv_cache_bytes` budget. A budget smaller than one
    /// page is an error rather than a silent 1-page pool, since nothing useful runs in it.
    pub fn num_pages_for(
        num_kv_pages: Option<usize>,
        kv_cache_bytes: usize,
        bytes_per_page: usize,
    ) -> Result<usize> {
        match num_kv_pages {
            Some(0) => Err(DetspecError::param("num_kv_pages", "must be > 0")),
            Some(n) if n > PageId::MAX as usize => Err(DetspecError::param(
                "num_kv_pages",
                format!("{n} exceeds the maximum of {} pages", PageId::MAX),
            )),
            Some(n) => Ok(n),
            None if bytes_per_page == 0 => Err(DetspecError::param(
                "kv_cache_bytes",
                "page size in bytes is 0",
            )),
            None => match kv_cache_bytes / bytes_per_page {
                0 => Err(DetspecError::param(
                    "kv_cache_bytes",
                    format!(
                        "{kv_cache_bytes} bytes is less than one KV page ({bytes_per_page} bytes)"
                    ),
                )),
                n => Ok(n.min(PageId::MAX as usize)),
            },
        }
    }

    pub fn new(
        num_layers: usize,
        num_pages: usize,
        page_size: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if num_pages == 0 {
            return Err(DetspecError::param("num_kv_pages", "must be > 0"));
        }
        let k_shape = (num_pages, kv_heads, head_dim, page_size);
        let v_shape = (num_pages, page_size, kv_heads, head_dim);
        let layers = (0..num_layers)
            .map(|_| {
                Ok((
                    Tensor::zeros(k_shape, dtype, device)?,
                    Tensor::zeros(v_shape, dtype, device)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            page_size,
            num_pages,
        })
    }

    /// (K, V) of layer `i`.
    pub fn layer(&self, i: usize) -> Option<&(Tensor, Tensor)> {
        self.layers.get(i)
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    /// Copies page `src` onto page `dst` in every layer's K and V: the data half of
    /// copy-on-write for the pairs returned by [`super::BlockTable::prepare_append`].
    pub fn copy_pages(&self, pairs: &[(PageId, PageId)]) -> Result<()> {
        if pairs.is_empty() {
            return Ok(());
        }
        for (k, v) in &self.layers {
            copy_pages(k, pairs)?;
            copy_pages(v, pairs)?;
        }
        Ok(())
    }
}
