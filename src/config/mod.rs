//! Configuration: the checkpoint's `config.json` and the engine's own settings.

mod device;
mod engine_config;
mod head;
pub(crate) mod json;
mod linear_attention;
mod mamba;
mod mla_config;
mod model_config;
mod moe_config;
mod nemotron_h;
mod quant;
mod rope;
mod short_conv;
mod text_config;

pub use device::{cuda_device_count, device_label, device_memory, DeviceSpec};
pub use engine_config::{
    ActivationDtype, DTypeSpec, DeterminismMode, EngineConfig, KernelProfile, VerifyStrategy,
    DEFAULT_KV_CACHE_BYTES,
};
pub use head::Head;
pub use linear_attention::{DeltaNetDims, DeltaNetProjections, LinearAttentionConfig};
pub use mamba::{MambaConfig, MambaDims};
pub use mla_config::MlaConfig;
pub use model_config::{
    Activation, Architecture, ClampedSwiglu, DenseMlpNames, Fused, GraniteScales, ModelConfig,
    UngatedMlp,
};
pub use moe_config::{DeepSeekRouting, ExpertNaming, MoeConfig, Scoring};
pub use nemotron_h::Sublayer;
pub use quant::Fp8Weights;
pub use rope::{RopeConfig, RopeScaling};
pub use short_conv::ShortConvConfig;
