//! Weight loading and the decoder forward pass.

mod decoder;
mod weights;

pub use decoder::{ForwardBatch, Model};
pub use weights::Checkpoint;
