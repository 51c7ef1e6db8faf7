//! The fingerprint: one string that names everything that can change a deterministic output's
//! bits, so two outputs are comparable exactly when their fingerprints are equal.
//!
//! `detspec-<weights>-m<model>-<dtype>-<device>-k<kernels>-<determinism>`:
//! - `weights`: the content hash of every parameter as the engine holds it (it follows weight
//!   updates; restoring old weights restores it);
//! - `model`: the config values the forward reads (architecture, sizes, head layout, norm eps,
//!   rope settings with LongRoPE's factor set, which follows `max_model_len`, the rotating
//!   share of each head, sliding window, biases, q/k norm, tied embeddings, a sparse model's
//!   experts and routing, latent attention's ranks and widths, a sequence classifier's
//!   labels), the EOS ids, and the bytes of the
//!   tokenizer, its config, the chat template and the generation config;
//! - `dtype`, `device`: what the weights and KV are held in, and where;
//! - `kernels`: [`KERNEL_VERSION`] plus the CPU kernel profile when it is not the invariant one,
//!   plus `-abf16` in the bf16-activation mode (`activation_dtype="bfloat16"`: the linear layers
//!   round their inputs to bf16 and multiply bf16 by bf16, another function of the same weights)
//!   or `-abf16amx` in its AMX variant (`"bfloat16_amx"`: the tile instruction's own order,
//!   reproducible on AMX-BF16 CPUs only);
//! - `determinism`: the determinism policy's label (mode, strategy, W and B where they matter).
//!
//! A request run with a LoRA adapter reports `detspec-lora<adapter>-<weights>-…`, `adapter`
//! being the content hash of the adapter's weights as applied ([`with_adapter`]).
//!
//! Every hash is xxh3 with its fixed default key: the same inputs give the same fingerprint on
//! every machine and run.

use std::path::Path;

use xxhash_rust::xxh3::Xxh3;

use crate::config::{Activation, ActivationDtype, KernelProfile, ModelConfig};
use crate::error::{DetspecError, Result};

/// Bumped whenever a kernel's reduction order changes, so fingerprints tell old outputs apart.
/// 2: the CPU's packed fixed-order GEMM (`ops::gemm`) in every linear layer; attention scores
/// over a per-page transposed K cache; polynomial `exp` in attention and log-sum-exp.
/// 3: SwiGLU's `exp` is that polynomial too (`ops::silu`), not libm's `expf`.
/// 4: the rope tables' `sin`/`cos`/`pow` come from the `libm` crate (the same code on every
/// machine), not from the C library, whose variant glibc picks by CPU at run time.
/// 5: a GPU runs q/k/v and gate/up as one stacked GEMM each, and cuBLAS picks its kernel (and
/// so the bits) by shape; the CPU's bits are version 4's.
pub const KERNEL_VERSION: u32 = 5;

/// Files of a model directory whose content changes what a request's text or tokens become.
const TOKENIZER_FILES: [&str; 5] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    // A processor's (multimodal checkpoints keep their chat template here).
    "chat_template.json",
    "generation_config.json",
];

/// Hash of the config values the forward reads, the EOS ids and the tokenizer files of `dir`.
pub fn model_digest(cfg: &ModelConfig, dir: &Path, eos: &[u32]) -> Result<u64> {
    let mut h = Xxh3::new();
    let forward = format!(
        "{:?}|h{}|i{}|l{}|a{}|kv{}|d{}|v{}|eps{:016x}|{:?}|tie{}|qkvb{}|ob{}|mb{}|qkn{}|sw{:?}",
        cfg.architecture,
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.vocab_size,
        cfg.rms_norm_eps.to_bits(),
        cfg.rope,
        cfg.tie_word_embeddings,
        cfg.qkv_bias,
        cfg.o_bias,
        cfg.mlp_bias,
        cfg.qk_norm,
        cfg.sliding_window,
    );
    h.update(forward.as_bytes());
    // Only sparse models add this, so dense models' fingerprints are what they were.
    if let Some(moe) = &cfg.moe {
        h.update(format!("|moe{moe:?}").as_bytes());
    }
    // Likewise latent attention (DeepSeek-V3).
    if let Some(mla) = &cfg.mla {
        h.update(format!("|mla{mla:?}").as_bytes());
    }
    // Likewise LFM2's convolution layers.
    if let Some(conv) = &cfg.short_conv {
        h.update(format!("|conv{conv:?}").as_bytes());
    }
    // Likewise the recurrent layers (Qwen3.5's DeltaNets, Mamba2 mixers) and Nemotron-H's
    // one-sublayer layers.
    if let Some(la) = &cfg.linear_attention {
        h.update(format!("|delta{la:?}").as_bytes());
    }
    if let Some(m) = &cfg.mamba {
        h.update(format!("|mamba{m:?}").as_bytes());
    }
    if let Some(sublayers) = &cfg.sublayers {
        h.update(format!("|sublayers{sublayers:?}").as_bytes());
    }
    // Likewise models whose layers are of two kinds (which slide, and their rope).
    if let Some(sliding) = &cfg.sliding_layers {
        h.update(format!("|slides{sliding:?}|rope_sliding{:?}", cfg.rope_sliding).as_bytes());
    }
    // Likewise layers without rope.
    if let Some(rope_layers) = &cfg.rope_layers {
        h.update(format!("|rope_layers{rope_layers:?}").as_bytes());
    }
    // Likewise heads that rotate in part (Phi-4-mini). LongRoPE's factor set in use is in
    // `cfg.rope` above: it follows the engine's `max_model_len`.
    if cfg.rotary_dim != cfg.head_dim {
        h.update(format!("|rot{}", cfg.rotary_dim).as_bytes());
    }
    // Likewise Granite's multipliers.
    if let Some(g) = &cfg.granite {
        h.update(format!("|granite{g:?}").as_bytes());
    }
    // Likewise a gate other than SiLU, and Gemma's attention scale (its `1 + w` norms and
    // √hidden embedding scale come with the architecture's name).
    if cfg.hidden_act != Activation::Silu {
        h.update(format!("|act{:?}", cfg.hidden_act).as_bytes());
    }
    if let Some((beta, original)) = cfg.query_scale_beta {
        h.update(format!("|qscale{:016x}/{:016x}", beta.to_bits(), original.to_bits()).as_bytes());
    }
    if let Some(q) = cfg.query_pre_attn_scalar {
        h.update(format!("|qpas{:016x}", q.to_bits()).as_bytes());
    }
    for (name, cap) in [
        ("attncap", cfg.attn_logit_softcapping),
        ("finalcap", cfg.final_logit_softcapping),
    ] {
        if let Some(c) = cap {
            h.update(format!("|{name}{:016x}", c.to_bits()).as_bytes());
        }
    }
    // Likewise classifiers: their labels (the `score` matrix itself is in the weights hash).
    if let Some(labels) = cfg.head.labels() {
        h.update(format!("|classifier{labels:?}").as_bytes());
    }
    h.update(format!("|eos{eos:?}").as_bytes());
    for name in TOKENIZER_FILES {
        let path = dir.join(name);
        if path.is_file() {
            let bytes = std::fs::read(&path).map_err(|e| DetspecError::io(&path, e))?;
            h.update(format!("|{name}:{}:", bytes.len()).as_bytes());
            h.update(&bytes);
        }
    }
    Ok(h.digest())
}

/// Everything after the weights hash.
pub fn tail(
    model_digest: u64,
    dtype: &str,
    device: &str,
    profile: KernelProfile,
    activations: ActivationDtype,
    determinism: &str,
) -> String {
    let profile = match profile {
        KernelProfile::Invariant => "",
        KernelProfile::ShapeDependent => "-shapedep",
    };
    let act = match activations {
        ActivationDtype::Auto | ActivationDtype::F32 => "",
        ActivationDtype::Bf16 => "-abf16",
        ActivationDtype::Bf16Amx => "-abf16amx",
    };
    format!(
        "m{:08x}-{dtype}-{device}-k{KERNEL_VERSION}{profile}{act}-{determinism}",
        model_digest as u32
    )
}

/// `fingerprint` of a request run with a LoRA adapter whose content hash is `adapter`: the
/// adapter's hash after the weights'.
pub fn with_adapter(fingerprint: &str, adapter: u64) -> String {
    let rest = fingerprint.strip_prefix("detspec-").unwrap_or(fingerprint);
    format!("detspec-lora{adapter:016x}-{rest}")
}

/// The whole fingerprint.
pub fn fingerprint_of(weights_hash: u64, tail: &str) -> String {
    format!("detspec-{weights_hash:016x}-{tail}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_digest_follows_every_file_that_shapes_a_requests_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = ModelConfig::from_json_str(
            r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
            "vocab_size": 10}"#,
            &dir.path().join("config.json"),
        )
        .unwrap();
        let digest = || model_digest(&cfg, dir.path(), &[2]).unwrap();
        let mut seen = vec![digest()];
        for name in TOKENIZER_FILES {
            std::fs::write(dir.path().join(name), "{}").unwrap();
            let d = digest();
            assert!(!seen.contains(&d), "{name} left the digest as it was");
            seen.push(d);
        }
        assert_ne!(
            model_digest(&cfg, dir.path(), &[3]).unwrap(),
            digest(),
            "EOS ids"
        );
    }
}
