//! Weight loading, the decoder forward pass, and parameters by name (weight updates).

mod decoder;
mod fp8;
mod fused_experts;
mod gated_delta_net;
mod linear;
mod loader;
mod lora;
mod mamba2;
mod memory;
mod mla;
mod moe;
mod moe_names;
mod mxfp4;
mod nemotron_h_names;
mod param_hash;
mod params;
mod short_conv;
mod update;
mod weights;
mod xielu;

pub use decoder::{ForwardBatch, Model};
pub use loader::keeps_quantized;
pub use lora::{LoraAdapter, LoraBase};
pub use memory::{
    available_memory, check_fits, forward_headroom, kv_bytes_for_utilization, weight_bytes,
};
pub use moe_names::{fused_expert_shapes, held_stacked, unfuse_experts};
pub use params::{check_update, param_shapes};
pub use weights::{engine_name, Checkpoint};
