//! What a model needs in memory, checked before loading: a checkpoint too large for the
//! machine fails with an error that says how much it needs instead of being killed mid-load.

use std::path::Path;

use candle_core::{DType, Device};

use crate::config::ModelConfig;
use crate::error::{gib, DetspecError, Result};

use super::params::param_shapes;

/// Bytes the engine holds for a `cfg` model's weights in `dtype` on `device`: matrices in
/// `dtype` (gpt-oss's stacked experts too), vectors (norms, biases) in the activations' dtype
/// (f32 on the CPU). Where `keeps_quantized` (the CPU's quantized GEMMs run them as stored):
/// MXFP4 experts in 17 bytes a 32 weights, an FP8 checkpoint's layer matrices in a byte a
/// weight (its LM head and embedding, which such checkpoints leave unquantized, in `dtype`). A tied LM head counts twice: it is packed (CPU) or transposed (GPU)
/// apart from the embedding. Also the largest single matrix, which loading holds twice for a
/// moment (read, then packed).
pub fn weight_bytes(
    cfg: &ModelConfig,
    dtype: DType,
    device: &Device,
    keeps_quantized: bool,
) -> (u64, u64) {
    let vector = if device.is_cpu() { DType::F32 } else { dtype };
    let mut total = 0u64;
    let mut largest = 0u64;
    for (name, shape) in param_shapes(cfg) {
        let elems: u64 = shape.iter().map(|&d| d as u64).product();
        let mxfp4 = cfg.mxfp4_experts && shape.len() == 3 && name.contains(".mlp.experts.");
        let fp8 =
            cfg.fp8_weights.is_some() && shape.len() == 2 && name.starts_with("model.layers.");
        let bytes = if mxfp4 && keeps_quantized {
            elems * 17 / 32
        } else if fp8 && keeps_quantized {
            elems
        } else {
            elems * if shape.len() >= 2 { dtype } else { vector }.size_in_bytes() as u64
        };
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

/// Fails, before anything is allocated, if the weights of the `cfg` model in `dir` (in `dtype`,
/// quantized weights kept so where `keeps_quantized`)
/// plus a KV pool of `kv_bytes` need more than the memory available. CPU only (a GPU's memory
/// is the GPU's to refuse); skipped where the available memory is unknown.
pub fn check_fits(
    dir: &Path,
    cfg: &ModelConfig,
    dtype: DType,
    keeps_quantized: bool,
    kv_bytes: u64,
    device: &Device,
) -> Result<()> {
    if !device.is_cpu() {
        return Ok(());
    }
    let Some(available) = available_memory() else {
        return Ok(());
    };
    let (weights, largest) = weight_bytes(cfg, dtype, device, keeps_quantized);
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

/// Device bytes a forward of `rows` rows of a `cfg` model in `dtype` may hold beyond the
/// weights and the KV pool: its activations (a few hidden-, attention- and intermediate-sized
/// rows each, twice over for the temporaries between ops), its logits (in `dtype` and widened to
/// f32), and 512 MiB for the BLAS library's workspace and the allocator's slack.
pub fn forward_headroom(cfg: &ModelConfig, rows: usize, dtype: DType) -> u64 {
    let attention = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim;
    let per_row = 4 * cfg.hidden_size + attention + 3 * cfg.intermediate_size;
    let size = dtype.size_in_bytes() as u64;
    let activations = 2 * rows as u64 * per_row as u64 * size;
    let logits = rows as u64 * cfg.vocab_size as u64 * (size + 4);
    activations + logits + (512 << 20)
}

/// The KV pool's budget on a GPU under vLLM's `gpu_memory_utilization`: the share `utilization`
/// of the device's `total` bytes, less what is in use once the weights are loaded (`total -
/// free`: the weights, the CUDA context, other processes) and `headroom` for a forward
/// ([`forward_headroom`]). An error names the setting and the numbers where nothing is left.
pub fn kv_bytes_for_utilization(
    utilization: f64,
    (free, total): (u64, u64),
    headroom: u64,
) -> Result<usize> {
    let budget = (utilization * total as f64) as u64;
    let used = total.saturating_sub(free);
    match budget.checked_sub(used + headroom).filter(|&kv| kv > 0) {
        Some(kv) => Ok(usize::try_from(kv).unwrap_or(usize::MAX)),
        None => Err(DetspecError::param(
            "gpu_memory_utilization",
            format!(
                "{utilization} of the GPU's {} is {}, but {} is in use with the weights loaded \
                 and a forward needs {} more: nothing is left for the KV cache (raise it, or set \
                 kv_cache_bytes or num_kv_pages)",
                gib(total),
                gib(budget),
                gib(used),
                gib(headroom)
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kv_budget_is_the_share_less_what_is_in_use_and_the_headroom() {
        let gib = 1u64 << 30;
        // 80 GiB GPU, 17 GiB in use after loading (16 of weights), 1 GiB of headroom.
        let kv = kv_bytes_for_utilization(0.9, (63 * gib, 80 * gib), gib).unwrap();
        assert_eq!(kv as u64, (0.9 * (80 * gib) as f64) as u64 - 18 * gib);
        let e = kv_bytes_for_utilization(0.2, (63 * gib, 80 * gib), gib).unwrap_err();
        assert_eq!(e.param_name(), Some("gpu_memory_utilization"));
        assert!(e.to_string().contains("in use"), "{e}");
    }

    #[test]
    fn a_forwards_headroom_grows_with_its_rows_and_the_vocabulary() {
        let cfg = ModelConfig::from_json_str(
            r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256}"#,
            Path::new("/m/config.json"),
        )
        .unwrap();
        let h512 = forward_headroom(&cfg, 512, DType::BF16);
        // Llama-3.1-8B at 512 rows: ~0.4 GiB of logits and activations over the fixed 512 MiB.
        assert!(h512 > (512 << 20) + (300 << 20) && h512 < 2 << 30, "{h512}");
        assert!(forward_headroom(&cfg, 1024, DType::BF16) > h512);
    }
}
