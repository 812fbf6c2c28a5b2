//! The options every attention implementation reads (naive, FlashAttention, the ring, Ulysses),
//! in a file of their own so that the implementations and the dispatcher in `attention.rs`
//! import them without importing each other.

/// What shapes the attention pattern besides q, k, v: positions are global (query i at
/// `q_offset + i`, key j at `k_offset + j`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AttnOptions {
    pub causal: bool,
    /// Per-head ALiBi slopes for the heads in this call (a rank's head group under SP).
    pub alibi: Option<Vec<f64>>,
    pub q_offset: usize,
    pub k_offset: usize,
}
