//! The KV page pool, allocated once when the engine starts. An attention layer keeps a K tensor
//! `[num_pages, kv_heads, head_dim, page_size]` (keys transposed per page, for the attention
//! kernel's vector loop over a page's keys) and a V tensor `[num_pages, page_size, kv_heads,
//! head_dim]`; an LFM2 convolution layer one row per token, `[num_pages, page_size, 1, width]`
//! (its convolution's input, which the next tokens' outputs read). A page is contiguous in
//! each, so page copies do not care, and every per-token state lives in pages: rollback,
//! prefix sharing and preemption treat a convolution layer as they treat attention.
//! A recurrent layer (Qwen3.5's gated DeltaNet) keeps nothing in pages: its state is per
//! sequence, in the pool's [`StatePool`].

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::config::ModelConfig;
use crate::error::{DetspecError, Result};
use crate::ops::copy_pages;

use super::{PageId, StatePool};

/// What one layer keeps per token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerCacheShape {
    /// A key and a value of `kv_heads` heads of `head_dim`.
    Attention { kv_heads: usize, head_dim: usize },
    /// One row of `width` values.
    Rows { width: usize },
    /// Nothing per token: a state of `values` floats per sequence.
    Recurrent { values: usize },
    /// Nothing at all: a layer without a token mixer (Nemotron-H's MLP blocks).
    Stateless,
}

impl LayerCacheShape {
    /// Values one token takes.
    fn per_token(self) -> usize {
        match self {
            Self::Attention { kv_heads, head_dim } => 2 * kv_heads * head_dim,
            Self::Rows { width } => width,
            Self::Recurrent { .. } | Self::Stateless => 0,
        }
    }

    /// Bytes one sequence's recurrent states take across `shapes` (0: none keeps one).
    pub fn state_bytes(shapes: &[Self]) -> usize {
        let values: usize = shapes
            .iter()
            .map(|s| match *s {
                Self::Recurrent { values } => values,
                _ => 0,
            })
            .sum();
        values * std::mem::size_of::<f32>()
    }

    /// Each layer's shape for a model: a convolution layer's row is its hidden size.
    pub fn of_model(cfg: &ModelConfig) -> Vec<Self> {
        (0..cfg.num_hidden_layers)
            .map(
                |i| match (&cfg.short_conv, &cfg.linear_attention, &cfg.mamba) {
                    _ if !cfg.has_mixer(i) => Self::Stateless,
                    (Some(conv), ..) if conv.is_conv(i) => Self::Rows {
                        width: cfg.hidden_size,
                    },
                    (_, Some(la), _) if la.is_linear(i) => Self::Recurrent {
                        values: la.dims.state_values(),
                    },
                    (.., Some(m)) if m.is_mamba(i) => Self::Recurrent {
                        values: m.dims.state_values(),
                    },
                    _ => Self::Attention {
                        kv_heads: cfg.num_key_value_heads,
                        head_dim: cfg.head_dim,
                    },
                },
            )
            .collect()
    }
}

/// One layer's storage.
#[derive(Debug)]
pub enum LayerCache {
    Attention {
        k: Tensor,
        v: Tensor,
    },
    Rows(Tensor),
    /// Its state is in [`KvPool::states`].
    Recurrent,
    /// The layer mixes no tokens.
    Stateless,
}

impl LayerCache {
    fn tensors(&self) -> impl Iterator<Item = &Tensor> {
        let (a, b) = match self {
            Self::Attention { k, v } => (Some(k), Some(v)),
            Self::Rows(rows) => (Some(rows), None),
            Self::Recurrent | Self::Stateless => (None, None),
        };
        a.into_iter().chain(b)
    }
}

/// KV storage for every layer.
#[derive(Debug)]
pub struct KvPool {
    /// Empty while the memory is released.
    layers: Vec<LayerCache>,
    /// What `restore` allocates.
    shapes: Vec<LayerCacheShape>,
    page_size: usize,
    num_pages: usize,
    dtype: DType,
    device: Device,
    /// The recurrent layers' per-sequence states (empty where there are none).
    states: Arc<StatePool>,
}

impl KvPool {
    /// Bytes one page takes across all layers.
    pub fn bytes_per_page(shapes: &[LayerCacheShape], page_size: usize, dtype: DType) -> usize {
        let per_token: usize = shapes.iter().map(|s| s.per_token()).sum();
        per_token * page_size * dtype.size_in_bytes()
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
        shapes: Vec<LayerCacheShape>,
        num_pages: usize,
        page_size: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if num_pages == 0 {
            return Err(DetspecError::param("num_kv_pages", "must be > 0"));
        }
        let per_layer: Vec<usize> = shapes
            .iter()
            .map(|s| match *s {
                LayerCacheShape::Recurrent { values } => values,
                _ => 0,
            })
            .collect();
        let mut pool = Self {
            layers: Vec::new(),
            states: StatePool::new(&per_layer),
            shapes,
            page_size,
            num_pages,
            dtype,
            device: device.clone(),
        };
        pool.restore()?;
        Ok(pool)
    }

    /// Frees every layer's storage; [`KvPool::layer`] returns `None` until
    /// [`KvPool::restore`].
    pub fn release(&mut self) {
        self.layers = Vec::new();
    }

    /// Allocates the layers (zeroed) if they are released; a no-op otherwise.
    pub fn restore(&mut self) -> Result<()> {
        if !self.layers.is_empty() || self.shapes.is_empty() {
            return Ok(());
        }
        let (pages, page) = (self.num_pages, self.page_size);
        let (dtype, device) = (self.dtype, &self.device);
        self.layers = self
            .shapes
            .iter()
            .map(|shape| {
                Ok(match *shape {
                    LayerCacheShape::Attention { kv_heads, head_dim } => LayerCache::Attention {
                        k: Tensor::zeros((pages, kv_heads, head_dim, page), dtype, device)?,
                        v: Tensor::zeros((pages, page, kv_heads, head_dim), dtype, device)?,
                    },
                    LayerCacheShape::Rows { width } => {
                        LayerCache::Rows(Tensor::zeros((pages, page, 1, width), dtype, device)?)
                    }
                    LayerCacheShape::Recurrent { .. } => LayerCache::Recurrent,
                    LayerCacheShape::Stateless => LayerCache::Stateless,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(())
    }

    /// Whether the layers' memory is released.
    pub fn is_released(&self) -> bool {
        self.layers.is_empty() && !self.shapes.is_empty()
    }

    /// Bytes the layers' tensors hold now.
    pub fn allocated_bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(LayerCache::tensors)
            .map(|t| t.elem_count() * self.dtype.size_in_bytes())
            .sum()
    }

    /// The recurrent layers' per-sequence states.
    pub fn states(&self) -> &Arc<StatePool> {
        &self.states
    }

    /// Layer `i`'s storage.
    pub fn layer(&self, i: usize) -> Option<&LayerCache> {
        self.layers.get(i)
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    /// Copies page `src` onto page `dst` in every layer's tensors: the data half of
    /// copy-on-write for the pairs returned by [`super::BlockTable::prepare_append`].
    pub fn copy_pages(&self, pairs: &[(PageId, PageId)]) -> Result<()> {
        if pairs.is_empty() {
            return Ok(());
        }
        for t in self.layers.iter().flat_map(LayerCache::tensors) {
            copy_pages(t, pairs)?;
        }
        Ok(())
    }
}
