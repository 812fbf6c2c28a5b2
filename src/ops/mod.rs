//! The ops layer: every backend extension the model runs on and its kernels — fused CPU loops,
//! CubeCL launches, hand-written backwards — each beside the composed reference it is tested
//! against. Ops know tensors, not models: this layer imports burn, `genslm-kernels` and nothing
//! above it (`scripts/check_imports.py` enforces it), so the model, the parallel strategies and
//! the trainer all call down into the same ops.
//!
//! One op is a trait (the backend extension) with its public function and reference; its CPU
//! loops, its autodiff backward and its CubeCL launch sit beside it, and an op that outgrows one
//! file becomes a folder with one role per file (`attention/`).

pub mod attention;
pub mod autodiff;
pub mod gelu;
pub mod layer_norm;
pub mod linear;
pub mod primitive;
pub mod reduce;
pub mod rotary;
pub(crate) mod simd;
pub(crate) mod team;
pub(crate) mod tile;
