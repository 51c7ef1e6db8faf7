//! The KV page pool: per layer K and V tensors `[num_pages, page_size, kv_heads, head_dim]`,
//! allocated once when the engine starts.

use candle_core::{DType, Device, Tensor};

use crate::error::{DetspecError, Result};

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
    pub fn bytes_per_page(num_layers: usize, page_size: usize, kv_heads: usize, head_dim: usize, dtype: DType) -> usize {
        2 * num_layers * page_size * kv_heads * head_dim * dtype.size_in_bytes()
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
        let shape = (num_pages, page_size, kv_heads, head_dim);
        let layers = (0..num_layers)
            .map(|_| Ok((Tensor::zeros(shape, dtype, device)?, Tensor::zeros(shape, dtype, device)?)))
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
}
