//! Scaled dot-product attention as ops: the FlashAttention backend extension and its
//! implementations, the fused QKV op, and the naive reference.
//!
//! - `options.rs`: what every implementation reads (offsets, causality, ALiBi slopes);
//! - `naive.rs`: the O(s²) reference every other path is tested against;
//! - `flash.rs`: the op (trait, public functions, autodiff through `ops::autodiff`);
//! - `tiled.rs`: FlashAttention-2 as burn tensor ops on tiles (any dtype, any backend);
//! - `cpu.rs`: the fused f32 CPU kernel; `cube.rs`: the CubeCL kernels' launch;
//! - `decode.rs`: a decoding step's few queries over the key/value cache, read in place;
//! - `qkv/`: self-attention from the fused QKV projection (rotary included) as one op;
//! - `probe.rs`: per-thread counters the tests read (tile sizes, calls); hidden from the docs,
//!   not part of the op's API.

pub(crate) mod cpu;
#[cfg(any(feature = "cuda", feature = "wgpu"))]
mod cube;
pub mod decode;
pub mod flash;
pub mod naive;
pub mod options;
#[doc(hidden)]
pub mod probe;
pub mod qkv;
pub(crate) mod tiled;
