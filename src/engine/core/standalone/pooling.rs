//! Embeddings: a sequence's last-layer hidden states (after the final norm) pooled into one
//! vector, optionally cut to its first dimensions and L2-normalised (vLLM's embedding models:
//! last-token pooling for decoder embedders such as Qwen3-Embedding or e5-mistral).
//!
//! The pooling and the norm are plain loops in a fixed order (rows in position order,
//! dimensions in index order, f32): with the rows from the verify-path kernels, an embedding is
//! the same bits whatever else ran and on every instruction set; a library's norm (BLAS, numpy)
//! would pick its own order by CPU.

use std::ops::Range;

use crate::error::{DetspecError, Result};

use super::{ForwardKind, Scopes};
use crate::engine::EngineCore;

/// How a sequence's hidden states become one vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The last position's (decoder embedding models).
    Last,
    /// The mean over every position.
    Mean,
}

impl Pooling {
    /// `"last"` or `"mean"`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "last" => Ok(Self::Last),
            "mean" => Ok(Self::Mean),
            other => Err(DetspecError::param(
                "pooling",
                format!("\"{other}\": expected \"last\" or \"mean\""),
            )),
        }
    }
}

/// What an embedding call asks for.
#[derive(Debug, Clone, Copy)]
pub struct EmbedOptions {
    pub pooling: Pooling,
    /// Keep the first `dimensions` values (Matryoshka embeddings), before normalising.
    pub dimensions: Option<usize>,
    /// Divide by the L2 norm.
    pub normalize: bool,
    /// On the verify-path kernels (bitwise reproducible); else the fast path, whose bits
    /// depend on the sequences computed together in the call.
    pub deterministic: bool,
}

impl EngineCore {
    /// One embedding per sequence (with its scope in `scopes`).
    pub fn embed(
        &mut self,
        seqs: &[Vec<u32>],
        opts: EmbedOptions,
        scopes: Scopes<'_>,
    ) -> Result<Vec<Vec<f32>>> {
        let hidden = self.info.config.hidden_size;
        let dims = opts.dimensions.unwrap_or(hidden);
        if dims == 0 || dims > hidden {
            return Err(DetspecError::param(
                "dimensions",
                format!("must be in 1..={hidden} (the model's hidden size), got {dims}"),
            ));
        }
        let wanted: Vec<Range<usize>> = seqs
            .iter()
            .map(|s| match opts.pooling {
                Pooling::Last => s.len().saturating_sub(1)..s.len(),
                Pooling::Mean => 0..s.len(),
            })
            .collect();
        let mut sums = vec![vec![0f32; hidden]; seqs.len()];
        let kind = (ForwardKind::Hidden, opts.deterministic);
        self.for_each_row(seqs, &wanted, kind, scopes, &mut |i, row| {
            for (acc, &v) in sums[i].iter_mut().zip(row) {
                *acc += v;
            }
            Ok(())
        })?;
        Ok(sums
            .into_iter()
            .zip(&wanted)
            .map(|(mut v, rows)| {
                let n = rows.len().max(1) as f32;
                v.truncate(dims);
                if opts.pooling == Pooling::Mean {
                    v.iter_mut().for_each(|x| *x /= n);
                }
                if opts.normalize {
                    let norm = v.iter().fold(0f32, |s, x| s + x * x).sqrt();
                    if norm > 0.0 {
                        v.iter_mut().for_each(|x| *x /= norm);
                    }
                }
                v
            })
            .collect())
    }
}
