//! Parallelism (docs/ARCHITECTURE.md §5): the rank layout, the communicator trait and its
//! implementations, Ulysses sequence parallelism, and sharded optimizer state.

pub mod bucket;
pub mod comm;
pub mod hooked;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
#[cfg(all(feature = "nccl", feature = "cuda"))]
pub mod nccl_device;
pub mod netsim;
pub mod parallelize;
pub mod pipeline;
pub mod progress;
pub mod quant;
pub mod ranks;
pub mod ring;
pub mod ring_overlap;
pub mod ring_passes;
pub mod seq_linear;
pub mod stream_order;
pub mod tensor;
pub mod tensor_slices;
pub mod threads;
pub mod timed;
pub mod topology;
pub mod ulysses;
pub mod ulysses_overlap;

pub use comm::{Communicator, Solo};
pub use topology::{Degrees, Topology};
