//! What a model needs in memory, checked before loading: a checkpoint too large for the
//! machine fails with an error that says how much it needs instead of being killed mid-load.

use std::path::Path;

use candle_core::{DType, Device};

use crate::config::ModelConfig;
use crate::error::{gib, DetspecError, Result};

use super::params::param_shapes;

/// Bytes the engine holds for a `cfg` model's weights in `dtype` on `device`: matrices in
/// `dtype`, vectors (norms, biases) in the activations' dtype (f32 on the CPU). A tied LM head
/// counts twice: it is packed (CPU) or transposed (GPU) apart from the embedding. Also the
/// largest single matrix, which loading holds twice for a moment (read, then packed).
pub fn weight_bytes(cfg: &ModelConfig, dtype: DType, device: &Device) -> (u64, u64) {
    let vector = if device.is_cpu() { DType::F32 } else { dtype };
    let mut total = 0u64;
    let mut largest = 0u64;
    for shape in param_shapes(cfg).values() {
        let elems: u64 = shape.iter().map(|&d| d as u64).product();
        let bytes = elems * if shape.len() == 2 { dtype } else { vector }.size_in_bytes() as u64;
        total += bytes;
        largest = largest.max(bytes);
    }
    (total, largest)
}

/// Memory the system can still give this process (`MemAvailable` of `/proc/meminfo`, which
/// counts reclaimable page cache), or `None` where that is not known.
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Fails, before anything is allocated, if the weights of the `cfg` model in `dir` (in `dtype`)
/// plus a KV pool of `kv_bytes` need more than the memory available. CPU only (a GPU's memory
/// is the GPU's to refuse); skipped where the available memory is unknown.
pub fn check_fits(
    dir: &Path,
    cfg: &ModelConfig,
    dtype: DType,
    kv_bytes: u64,
    device: &Device,
) -> Result<()> {
    if !device.is_cpu() {
        return Ok(());
    }
    let Some(available) = available_memory() else {
        return Ok(());
    };
    let (weights, largest) = weight_bytes(cfg, dtype, device);
    let needed = weights + largest + kv_bytes;
    if needed <= available {
        return Ok(());
    }
    Err(DetspecError::OutOfMemory {
        path: dir.to_path_buf(),
        needed,
        available,
        detail: format!(
            "weights {} in {}, KV cache {}, loading {} more for its largest tensor",
            gib(weights),
            dtype.as_str(),
            gib(kv_bytes),
            gib(largest)
        ),
    })
}
