//! The GenSLM model: GPT-NeoX in burn above the ops layer — its parameters, layer, positions,
//! KV cache, the attention dispatch and the traits through which parallelism reaches it, and
//! Hugging Face compatible checkpoints.

pub mod attention;
pub mod cache;
pub mod decode;
pub mod hf;
pub mod hidden;
pub mod io;
pub mod layer;
pub mod neox;
pub mod params;
pub mod position;
pub mod sharded;
pub mod tensor_header;
pub mod tensor_parallel;
pub mod tensors;

pub use neox::GenSlm;
