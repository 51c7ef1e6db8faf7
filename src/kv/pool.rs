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
    /// (K, V) per layer; empty while the memory is released.
    layers: Vec<(Tensor, Tensor)>,
    page_size: usize,
    num_pages: usize,
    /// What `restore` needs to allocate the layers again.
    num_layers: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    device: Device,
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
        let mut pool = Self {
            layers: Vec::new(),
            page_size,
            num_pages,
            num_layers,
            kv_heads,
            head_dim,
            dtype,
            device: device.clone(),
        };
        pool.restore()?;
        Ok(pool)
    }

    /// Frees every layer's K and V storage; [`KvPool::layer`] returns `None` until
    /// [`KvPool::restore`].
    pub fn release(&mut self) {
        self.layers = Vec::new();
    }

    /// Allocates the layers (zeroed) if they are released; a no-op otherwise.
    pub fn restore(&mut self) -> Result<()> {
        if !self.layers.is_empty() || self.num_layers == 0 {
            return Ok(());
        }
        let k_shape = (self.num_pages, self.kv_heads, self.head_dim, self.page_size);
        let v_shape = (self.num_pages, self.page_size, self.kv_heads, self.head_dim);
        let (dtype, device) = (self.dtype, &self.device);
        self.layers = (0..self.num_layers)
            .map(|_| {
                Ok((
                    Tensor::zeros(k_shape, dtype, device)?,
                    Tensor::zeros(v_shape, dtype, device)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(())
    }

    /// Whether the layers' memory is released.
    pub fn is_released(&self) -> bool {
        self.layers.is_empty() && self.num_layers > 0
    }

    /// Bytes the K and V tensors hold now.
    pub fn allocated_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|(k, v)| (k.elem_count() + v.elem_count()) * self.dtype.size_in_bytes())
            .sum()
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
