//! The GenSLM model: GPT-NeoX in burn, its parameters, attention, positions, and Hugging Face
//! compatible checkpoints.

pub mod attention;
pub mod attention_op;
pub mod attn_options;
pub mod cache;
pub(crate) mod fastmath;
pub mod flash;
pub mod flash_backward;
mod flash_cpu;
#[cfg(any(feature = "cuda", feature = "wgpu"))]
mod flash_cube;
pub mod gelu;
pub mod hf;
pub mod hidden;
pub mod io;
pub mod layer_norm;
pub mod linear;
pub mod neox;
pub mod params;
pub mod position;
pub(crate) mod primitive;
pub mod qkv_attention;
pub mod tensor_parallel;
pub mod tensors;

pub use neox::GenSlm;
