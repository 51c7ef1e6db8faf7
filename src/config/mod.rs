//! Configuration: the checkpoint's `config.json` and the engine's own settings.

mod engine_config;
mod model_config;

pub use engine_config::{DeterminismMode, EngineConfig, VerifyStrategy};
pub use model_config::{Architecture, ModelConfig, RopeConfig, RopeScaling};
