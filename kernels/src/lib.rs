//! Fused FlashAttention-2 forward and backward kernels, written once in CubeCL.
//!
//! The same kernel source compiles for every CubeCL runtime burn drives: CUDA on NVIDIA GPUs,
//! wgpu (Vulkan, Metal, DX12) elsewhere, and Mesa's software Vulkan driver (lavapipe) on a
//! machine without a GPU, which is how `scripts/test-kernels.sh` proves them.
//!
//! Semantics are those of genslm's CPU op (`src/model/flash.rs`): `softmax(q kᵀ/√d + bias,
//! masked) v` over `[batch, heads, seq, head_dim]` tensors, where query `i` sits at global
//! position `q_offset + i` and key `j` at `k_offset + j`; causal attention hides keys after the
//! query; ALiBi adds `−slope_h · (pos_q − pos_k)` (`|pos_q − pos_k|` when not causal), built
//! per tile inside the kernel from one slope per head. A query row that sees no key at all
//! (only possible with offsets) gets `O = 0` and a log-sum-exp of [`NO_KEY_LSE`].
//!
//! - [`forward`]: one cube per (`block_q` query rows, batch·head); each unit owns a query row
//!   and keeps its running max, sum and output row in registers while the cube streams K/V
//!   tiles through shared memory (online softmax). Writes `O` and the row log-sum-exp.
//! - [`backward`]: the pre-pass `D = rowsum(dO ∘ O)`, then a dQ kernel (query rows own their
//!   dQ, K/V tiles streamed) and a dK/dV kernel (key rows own their dK and dV, Q/dO/lse/D tiles
//!   streamed); both recompute `P = exp(S − lse)`, so no `seq × seq` buffer exists and no
//!   atomics are needed.
//! - Causal: key tiles after the last query of a block (and query tiles before the first key
//!   of a block, in dK/dV) are never loaded.
//!
//! Loops over the head dimension are unrolled (`d` is a compile-time value): on GPUs that keeps
//! a unit's row arrays in registers, and on lavapipe it keeps each invocation under llvmpipe's
//! cap of 65535 iterations per loop nest (loops past it silently stop, which a d-loop inside
//! the key loop reached at ~240 keys of head dim 128). What is left of a nest iterates over
//! keys (or queries) and tile loads, so lavapipe runs sequences up to ~40K.
//!
//! Inputs are f32, bf16 or f16 (contiguous, one dtype for q, k, v, o, dO); every dot product,
//! softmax statistic and accumulator is f32; `lse` is always f32.

mod adamw;
mod backward;
mod forward;
mod launch;

pub use launch::{
    adamw, backward, forward, pool_bytes, reserved_bytes, AdamWStep, AttnConfig, AttnShape, Dtype,
    KernelError, Plan,
};

/// The log-sum-exp written for a query row that sees no key: finite (shader compilers may
/// assume there are no infinities) and far below any real score.
pub const NO_KEY_LSE: f32 = -1.0e30;

/// Largest head dimension the kernels accept: a unit keeps its query (or key) row, its output
/// accumulator and a tile of scores in registers, and the tiles of K and V must fit in shared
/// memory.
pub const MAX_HEAD_DIM: usize = 256;
