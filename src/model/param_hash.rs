//! The content hashes of a model's parameters, which the fingerprint's weights hash is made
//! of: each parameter's values as the engine holds them, by name, so that an update follows
//! them and restoring old weights restores the hash.

use std::collections::BTreeMap;

use candle_core::Tensor;
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

use crate::error::Result;
use crate::ops::{bf16_to_f32, with_bf16_bits, with_f32_values};

/// xxh3 of a tensor's values as f32 (exact for every engine dtype), as little-endian bytes.
/// bf16 values are widened a chunk at a time (the same digest as one call over all of them),
/// so hashing a large bf16 matrix allocates no f32 copy of it.
pub fn tensor_hash(t: &Tensor) -> Result<u64> {
    match with_bf16_bits(t, bf16_hash)? {
        Some(h) => Ok(h),
        None => Ok(with_f32_values(t, |v| xxh3_64(bytemuck::cast_slice(v)))?),
    }
}

/// [`tensor_hash`] of bf16 values given as bits.
pub(super) fn bf16_hash(bits: &[u16]) -> u64 {
    let mut h = Xxh3::new();
    let mut buf = [0f32; 4096];
    for chunk in bits.chunks(buf.len()) {
        for (d, &b) in buf.iter_mut().zip(chunk) {
            *d = bf16_to_f32(b);
        }
        h.update(bytemuck::cast_slice(&buf[..chunk.len()]));
    }
    h.digest()
}

/// Content hash of each parameter, by HF name (the tied LM head is the embedding's entry).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParamHashes(BTreeMap<String, u64>);

impl ParamHashes {
    /// Records `name`'s hash, replacing the one it had (a weight update).
    pub(super) fn insert(&mut self, name: String, hash: u64) {
        self.0.insert(name, hash);
    }

    /// One hash of all parameters: names and hashes in name order.
    pub fn combined(&self) -> u64 {
        let mut h = Xxh3::new();
        for (name, v) in &self.0 {
            h.update(name.as_bytes());
            h.update(&[0]);
            h.update(&v.to_le_bytes());
        }
        h.digest()
    }
}
