//! Training: the loop, AdamW, the lr schedule, checkpoints and metrics (one file each).

pub mod checkpoint;
pub mod dist_optim;
pub mod engine;
pub mod fault;
pub mod layerwise;
pub mod master;
pub mod memory;
pub mod metrics;
pub mod nonfinite;
pub mod old_run;
pub mod optim;
pub mod optim_cpu;
#[cfg(any(feature = "cuda", feature = "wgpu"))]
pub mod optim_cube;
pub mod optim_shards;
pub mod param_source;
pub mod pipeline;
pub mod rank_loop;
pub mod recompute;
pub mod replica_reduce;
pub mod resume;
pub mod run_dir;
pub mod schedule;
pub mod setup;
pub mod shard;
pub mod step;
pub mod trainer;
pub mod zero_shard;
pub mod zero_units;
