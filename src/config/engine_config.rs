//! Engine settings chosen by the user (not by the checkpoint).

use candle_core::DType;

use super::DeviceSpec;
use crate::error::{DetspecError, Result};

/// The dtype of weights and KV cache (on a GPU activations follow; on the CPU activations and
/// accumulation are f32, and bf16 weights are read by a bf16 GEMM, unless `activation_dtype`
/// asks for the bf16-activation mode).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DTypeSpec {
    /// The checkpoint's own dtype (`torch_dtype`) where the device runs it: bf16 checkpoints run
    /// in bf16 (CPU and GPU), f16 ones in f16 on a GPU; anything else in f32. As the KV cache's
    /// dtype (`kv_cache_dtype`): the model's dtype.
    #[default]
    Auto,
    F32,
    Bf16,
    F16,
}

impl DTypeSpec {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "float32" | "f32" => Ok(Self::F32),
            "bfloat16" | "bf16" => Ok(Self::Bf16),
            "float16" | "f16" | "half" => Ok(Self::F16),
            other => Err(DetspecError::param(
                "dtype",
                format!("unknown dtype `{other}` (auto, float32, bfloat16, float16)"),
            )),
        }
    }

    /// The dtype to run in on `device` for a checkpoint that declares `checkpoint` (config.json's
    /// `torch_dtype`).
    pub fn resolve(self, device: DeviceSpec, checkpoint: Option<&str>) -> Result<DType> {
        match (self, device) {
            (Self::F16, DeviceSpec::Cpu) => Err(DetspecError::param(
                "dtype",
                "the CPU backend runs float32 and bfloat16; float16 needs a CUDA device",
            )),
            (Self::Auto, DeviceSpec::Cpu) => Ok(match checkpoint {
                Some("bfloat16") => DType::BF16,
                _ => DType::F32,
            }),
            (Self::Auto, _) => Ok(match checkpoint {
                Some("bfloat16") => DType::BF16,
                Some("float16") => DType::F16,
                _ => DType::F32,
            }),
            (Self::F32, _) => Ok(DType::F32),
            (Self::Bf16, _) => Ok(DType::BF16),
            (Self::F16, _) => Ok(DType::F16),
        }
    }

    /// The KV cache's dtype (`kv_cache_dtype`) for a model running in `model`: `Auto` follows
    /// the model. The CPU stores f32 or bf16 whatever the weights (attention reads either and
    /// accumulates in f32); a GPU's kernels need the model's own dtype.
    pub fn resolve_kv(self, device: DeviceSpec, model: DType) -> Result<DType> {
        let kv = match self {
            Self::Auto => return Ok(model),
            Self::F32 => DType::F32,
            Self::Bf16 => DType::BF16,
            Self::F16 => DType::F16,
        };
        match device {
            DeviceSpec::Cpu if kv == DType::F16 => Err(DetspecError::param(
                "kv_cache_dtype",
                "the CPU backend stores the KV cache in float32 or bfloat16",
            )),
            DeviceSpec::Cpu => Ok(kv),
            _ if kv != model => Err(DetspecError::param(
                "kv_cache_dtype",
                format!(
                    "on a GPU the KV cache is in the model's dtype ({}); use \"auto\"",
                    model.as_str()
                ),
            )),
            _ => Ok(kv),
        }
    }
}

/// How the engine treats `deterministic=True` requests (docs/determinism.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DeterminismMode {
    /// Fast path for everyone; decode–verify–rollback for deterministic requests.
    #[default]
    Dvr,
    /// Every request on invariant kernels, no verification (baseline).
    BatchInvariant,
    /// Fast path only; deterministic requests are rejected.
    Off,
}

impl DeterminismMode {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "dvr" => Ok(Self::Dvr),
            "batch_invariant" => Ok(Self::BatchInvariant),
            "off" => Ok(Self::Off),
            other => Err(DetspecError::param(
                "determinism",
                format!("unknown mode `{other}` (dvr, batch_invariant, off)"),
            )),
        }
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Dvr => "dvr",
            Self::BatchInvariant => "batch_invariant",
            Self::Off => "off",
        }
    }
}

/// How DVR makes a deterministic request's decode tokens reproducible (docs/determinism.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum VerifyStrategy {
    /// `Inline` where the backend's fast-path GEMMs are proven batch-invariant (CPU), else
    /// `Replay`.
    #[default]
    Auto,
    /// Decode on the fast path, replay every window through fixed-shape B × W verify passes,
    /// commit what matches, roll back the rest.
    Replay,
    /// Compute deterministic rows inside the fast batch with the verify-path kernels (fixed
    /// attention schedule; the GEMMs are batch-invariant on this backend), so every token is
    /// committed as it is sampled and nothing is replayed. Only valid on a backend whose
    /// fast-path GEMM is batch- and position-invariant (asserted by `tests/gemm.rs`).
    Inline,
}

impl VerifyStrategy {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "replay" => Ok(Self::Replay),
            "inline" => Ok(Self::Inline),
            other => Err(DetspecError::param(
                "verify_strategy",
                format!("unknown strategy `{other}` (auto, replay, inline)"),
            )),
        }
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Replay => "replay",
            Self::Inline => "inline",
        }
    }
}

/// What the CPU's GEMMs promise about their reduction order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KernelProfile {
    /// The packed fixed-order GEMM: a row's bits never depend on the number of rows M, its
    /// neighbours or the thread count, which is what DVR's inline strategy needs.
    #[default]
    Invariant,
    /// For testing the replay strategy without a GPU: every GEMM's reduction order depends on
    /// M the way a vendor library's kernel choice does (a split-K factor picked from M, partial
    /// sums rounded to bfloat16 as a bf16 GPU kernel's are), so fast-path tokens really differ
    /// from the verifier's and rollbacks happen by themselves. `inline` is refused under it.
    ShapeDependent,
}

impl KernelProfile {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "invariant" => Ok(Self::Invariant),
            "shape_dependent" => Ok(Self::ShapeDependent),
            other => Err(DetspecError::param(
                "kernel_profile",
                format!("unknown profile `{other}` (invariant, shape_dependent)"),
            )),
        }
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Invariant => "invariant",
            Self::ShapeDependent => "shape_dependent",
        }
    }
}

/// What the CPU's linear layers multiply the weights by (`activation_dtype`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ActivationDtype {
    /// f32 on the CPU (bf16 weights widened exactly, f32 FMA chain); the model's dtype on a GPU.
    #[default]
    Auto,
    /// f32 activations (the CPU's default, named explicitly).
    F32,
    /// The opt-in bf16-activation mode (CPU, bf16 weights): each linear layer rounds its input
    /// to bf16 once and multiplies bf16 by bf16 with f32 accumulation in `VDPBF16PS`'s order,
    /// on the instruction or its bit-exact emulation (`ops::gemm_abf16`). Another numeric
    /// contract: the fingerprint says `-abf16`.
    Bf16,
    /// As `Bf16`, on AMX tiles (`TDPBF16PS`): faster at batch ≥ 16, but the tile instruction
    /// accumulates in its own order, so the bits are another contract again, reproducible on
    /// AMX-BF16 CPUs only: the fingerprint says `-abf16amx`, and a CPU without AMX refuses it.
    Bf16Amx,
}

impl ActivationDtype {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "float32" | "f32" => Ok(Self::F32),
            "bfloat16" | "bf16" => Ok(Self::Bf16),
            "bfloat16_amx" => Ok(Self::Bf16Amx),
            other => Err(DetspecError::param(
                "activation_dtype",
                format!(
                    "unknown activation dtype `{other}` (auto, float32, bfloat16, bfloat16_amx)"
                ),
            )),
        }
    }

    /// The bf16-activation mode, on AMX or not (the linear layers take bf16 × bf16 weights).
    pub fn is_bf16(&self) -> bool {
        matches!(self, Self::Bf16 | Self::Bf16Amx)
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::F32 => "float32",
            Self::Bf16 => "bfloat16",
            Self::Bf16Amx => "bfloat16_amx",
        }
    }

    /// What the linear layers run for weights in `weights` on `device`: `F32` (also for
    /// `Auto`), `Bf16` or `Bf16Amx`; the setting's combinations the engine cannot run are
    /// errors.
    pub fn resolve(
        self,
        device: DeviceSpec,
        weights: DType,
        profile: KernelProfile,
    ) -> Result<Self> {
        match (self, device) {
            (Self::Auto, _) => Ok(Self::F32),
            (_, DeviceSpec::Cuda(_)) => Err(DetspecError::param(
                "activation_dtype",
                "selects the CPU linear layers' arithmetic; on a GPU activations follow dtype                  (use \"auto\")",
            )),
            (Self::F32, DeviceSpec::Cpu) => Ok(Self::F32),
            (_, DeviceSpec::Cpu) if weights != DType::BF16 => Err(DetspecError::param(
                "activation_dtype",
                format!(
                    "\"bfloat16\" multiplies bf16 weights; the weights are {} (set \
                     dtype=\"bfloat16\")",
                    weights.as_str()
                ),
            )),
            (_, DeviceSpec::Cpu) if profile != KernelProfile::Invariant => {
                Err(DetspecError::param(
                    "activation_dtype",
                    "the bf16-activation modes run the invariant kernel profile only",
                ))
            }
            (Self::Bf16Amx, DeviceSpec::Cpu) if !crate::ops::DotIsa::amx_available() => {
                Err(DetspecError::param(
                    "activation_dtype",
                    "\"bfloat16_amx\" needs a CPU with AMX-BF16 (use \"bfloat16\": the same \
                     arithmetic's definition on every CPU)",
                ))
            }
            (mode, DeviceSpec::Cpu) => Ok(mode),
        }
    }
}

/// Settings for an [`crate::Engine`].
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Where the engine runs (`cpu`, `cuda:N`).
    pub device: DeviceSpec,
    /// Weights (and, by default, KV-cache) dtype.
    pub dtype: DTypeSpec,
    /// KV-cache dtype; `Auto` follows the model's dtype.
    pub kv_cache_dtype: DTypeSpec,
    /// Tokens per KV page.
    pub page_size: usize,
    /// Number of KV pages in the pool; `None` sizes the pool from `kv_cache_bytes`.
    pub num_kv_pages: Option<usize>,
    /// Memory budget for the KV pool when `num_kv_pages` is not given; `None`: on a GPU with
    /// `gpu_memory_utilization` set, what that leaves, else [`DEFAULT_KV_CACHE_BYTES`].
    pub kv_cache_bytes: Option<usize>,
    /// vLLM's `gpu_memory_utilization`: the share of the GPU's memory this engine may hold
    /// (weights, KV pool, a forward's activations). On a GPU, without `num_kv_pages` or
    /// `kv_cache_bytes`, the KV pool takes what the loaded weights and a forward's headroom
    /// leave of it. No effect on the CPU (vLLM's CPU build ignores it too).
    pub gpu_memory_utilization: Option<f64>,
    /// Most sequences decoded together in one step.
    pub max_num_seqs: usize,
    /// Most tokens (prefill + decode) in one forward pass. The default, 512, chunks long
    /// prefills so running decodes keep streaming: with 64 requests of 128 prompt tokens at
    /// once, 8192 prefilled everything in one step (time to first token = the whole batch's
    /// prefill, one multi-second inter-token gap for everyone) at no throughput gain on CPU,
    /// where a 512-row GEMM is already at full efficiency (docs/performance.md).
    pub max_num_batched_tokens: usize,
    /// Longest prompt + output; `None` uses the model's `max_position_embeddings`.
    pub max_model_len: Option<usize>,
    /// Largest prefill chunk of one sequence per step; `None` = the whole token budget.
    pub max_prefill_chunk: Option<usize>,
    pub determinism: DeterminismMode,
    /// W: input rows per request in a verify pass (the last committed token plus up to W−1
    /// speculative ones), so a pass commits at most W tokens per request.
    pub verify_window: usize,
    /// B: requests per verify pass (topped up with dummies), so every pass has B×W rows.
    /// Where rows cost arithmetic (the CPU) a smaller B wastes fewer rows on padding; on a GPU
    /// a pass's rows ride on the weights' read, and fuller passes may win (docs/performance.md).
    pub verify_group: usize,
    /// How `dvr` mode verifies deterministic requests.
    pub verify_strategy: VerifyStrategy,
    /// The CPU GEMMs' reduction-order promise (`shape_dependent`: the replay test profile).
    pub kernel_profile: KernelProfile,
    /// What the CPU's linear layers multiply the weights by (`bfloat16`: the opt-in
    /// bf16-activation mode).
    pub activation_dtype: ActivationDtype,
    /// Steps a deterministic request that finished on the fast path may wait for more ready
    /// requests before its verify pass runs (0: verify in the step it finished). Waiting fills
    /// groups with real rows instead of padding — fewer, fuller passes — at the cost of up to
    /// this many steps of latency on that request's final tokens. Output never depends on it.
    pub verify_finish_wait: usize,
    /// After a rollback, verify that request after fewer speculative tokens (twice the tokens
    /// the rolled-back window kept, at least W/8), doubling back towards W after each window
    /// that matched throughout: where mismatches are frequent, less is decoded only to be
    /// thrown away. Every pass keeps its B × W shape, so committed tokens, which are the
    /// verifier's, do not depend on where windows end: output never depends on it. On by
    /// default: without rollbacks it never acts, and where they are frequent (an 8B model with
    /// random weights on an H200: one per ~13 deterministic tokens) it took DVR from 0.49 to
    /// 0.73 × the throughput of no deterministic requests at a 2 % share (docs/performance.md).
    pub verify_window_adaptive: bool,
    /// Share of verify windows forced to mismatch (tests and benchmarks of the rollback path).
    pub fault_injection: f64,
    /// Worker threads for the engine's kernels (its own pool); `None`: one per available core
    /// (or `RAYON_NUM_THREADS`). Every engine has its own pool, so several engines working at
    /// once in one process should split the cores between them.
    pub num_threads: Option<usize>,
    /// Reuse KV pages of earlier prompts and answers with the same prefix. A deterministic
    /// request reads only pages computed as a deterministic prefill computes them
    /// (`kv::PageClass`), so its bits do not change.
    pub enable_prefix_caching: bool,
    /// Most LoRA adapters loaded at once (`Engine::load_lora`); 0 refuses adapters. Rows of
    /// any number of them share a forward.
    pub max_loras: usize,
    /// Largest LoRA rank an adapter may have.
    pub max_lora_rank: usize,
    /// Most top logprobs a request may ask for, per generated token (`logprobs`) and per
    /// prompt token (`prompt_logprobs`): vLLM's `max_logprobs`. `None`: the vocabulary (vLLM's
    /// -1). Bounding it keeps a token's output small and its top-n selection cheap.
    pub max_logprobs: Option<usize>,
}

/// The KV pool's budget when nothing sizes it (`kv_cache_bytes`, `num_kv_pages`,
/// `gpu_memory_utilization` on a GPU): 1 GiB.
pub const DEFAULT_KV_CACHE_BYTES: usize = 1 << 30;

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            device: DeviceSpec::Cpu,
            dtype: DTypeSpec::Auto,
            kv_cache_dtype: DTypeSpec::Auto,
            page_size: 16,
            num_kv_pages: None,
            kv_cache_bytes: None,
            gpu_memory_utilization: None,
            max_num_seqs: 256,
            max_num_batched_tokens: 512,
            max_model_len: None,
            max_prefill_chunk: None,
            determinism: DeterminismMode::Dvr,
            verify_window: 64,
            verify_group: 8,
            verify_strategy: VerifyStrategy::Auto,
            kernel_profile: KernelProfile::Invariant,
            activation_dtype: ActivationDtype::Auto,
            verify_finish_wait: 0,
            verify_window_adaptive: true,
            fault_injection: 0.0,
            num_threads: None,
            enable_prefix_caching: true,
            max_loras: 0,
            max_lora_rank: 64,
            max_logprobs: Some(crate::sampling::DEFAULT_MAX_LOGPROBS),
        }
    }
}

impl EngineConfig {
    /// Rejects settings the engine cannot run with, naming the parameter.
    pub fn validate(&self) -> Result<()> {
        if self.page_size == 0 || self.page_size > 1024 {
            return Err(DetspecError::param(
                "page_size",
                format!("must be in 1..=1024, got {}", self.page_size),
            ));
        }
        if self.num_kv_pages == Some(0) {
            return Err(DetspecError::param("num_kv_pages", "must be > 0"));
        }
        if self.num_kv_pages.is_none() && self.kv_cache_bytes == Some(0) {
            return Err(DetspecError::param("kv_cache_bytes", "must be > 0"));
        }
        if let Some(u) = self.gpu_memory_utilization {
            if !(u > 0.0 && u <= 1.0) {
                return Err(DetspecError::param(
                    "gpu_memory_utilization",
                    format!("must be in (0, 1], got {u}"),
                ));
            }
        }
        if self.max_num_seqs == 0 {
            return Err(DetspecError::param("max_num_seqs", "must be > 0"));
        }
        if self.max_num_batched_tokens == 0 {
            return Err(DetspecError::param("max_num_batched_tokens", "must be > 0"));
        }
        if self.verify_window < 2 || self.verify_window > 1024 {
            return Err(DetspecError::param(
                "verify_window",
                format!("must be in 2..=1024, got {}", self.verify_window),
            ));
        }
        if self.verify_group == 0 || self.verify_group > 256 {
            return Err(DetspecError::param(
                "verify_group",
                format!("must be in 1..=256, got {}", self.verify_group),
            ));
        }
        if !(0.0..=1.0).contains(&self.fault_injection) {
            return Err(DetspecError::param(
                "fault_injection",
                format!("must be in [0, 1], got {}", self.fault_injection),
            ));
        }
        if self.max_prefill_chunk == Some(0) {
            return Err(DetspecError::param("max_prefill_chunk", "must be > 0"));
        }
        if self.max_model_len == Some(0) {
            return Err(DetspecError::param("max_model_len", "must be > 0"));
        }
        if self.max_lora_rank == 0 || self.max_lora_rank > 1024 {
            return Err(DetspecError::param(
                "max_lora_rank",
                format!("must be in 1..=1024, got {}", self.max_lora_rank),
            ));
        }
        Ok(())
    }
}
