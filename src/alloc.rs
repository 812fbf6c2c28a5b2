//! The process's allocator policy: fixed glibc mmap and trim thresholds, so that which freed
//! tensors stay resident — and with them the peak memory — does not depend on what the run
//! happened to free before.
//!
//! glibc serves a request below its mmap threshold from the heap, where freed memory stays
//! resident for reuse, and a larger one from its own mapping, returned on free. By default the
//! threshold starts at 128 KiB and is dynamic: freeing a mapped block of at most 32 MiB raises
//! it to that block's size. Which blocks a run frees first depends on its layout (a ZeRO-1
//! rank's reduce-scatter block, a gathered layer), so the same model kept or returned its
//! 16 MiB activations depending on the rank count: measured under mpirun on genslm-25m at seq
//! 2048, rank 0 peaked at 941 MiB or at 1046–1110 MiB for the same layout. A fixed threshold
//! makes the peak a function of the shapes alone, which the planner (`plan::cpu`) models.
//!
//! The threshold is pinned at 32 MiB, the ceiling of glibc's dynamic threshold: every tensor
//! below it is reused from the heap instead of being mapped and faulted in afresh. Measured on
//! the 2-core Xeon, genslm-25m, seq 2048 (`genslm bench train`, interleaved, 2026-11-24):
//! 829–834 tokens/s and peak 1087–1099 MiB pinned at 32 MiB, against 803–808 tokens/s and
//! 1110–1113 MiB with the dynamic default, and 736–750 tokens/s pinned at 12 MiB. Trimming is
//! off (see [`NEVER_TRIM`]): with the fused optimizer step, 953–993 tokens/s against 914–954
//! with glibc's 64 MiB trim threshold (same runs interleaved, 2026-11-24), peak unchanged.

/// Requests of at least this many bytes are mapped and returned to the system on free.
pub const MMAP_THRESHOLD: usize = 32 << 20;

/// The trim threshold that turns trimming off (mallopt(3)): free memory at the top of the heap
/// stays resident. Each training step frees its activations after the backward and allocates
/// them again in the next forward; trimmed, those pages went back to the kernel and were
/// faulted in and zeroed afresh every step (`clear_page` was 12% of a genslm-25m step at seq
/// 2048). Kept, the process holds its peak heap between steps, which it needs again anyway.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const NEVER_TRIM: std::os::raw::c_int = -1;

#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod glibc {
    use std::os::raw::c_int;

    // <malloc.h>
    pub const M_TRIM_THRESHOLD: c_int = -1;
    pub const M_MMAP_THRESHOLD: c_int = -3;

    extern "C" {
        pub fn mallopt(param: c_int, value: c_int) -> c_int;
    }
}

/// Fixes glibc's mmap and trim thresholds for this process (a no-op on other C libraries,
/// whose allocators the planner's CPU terms were not measured with).
pub fn pin_thresholds() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; a value glibc refuses leaves the
    // default in place.
    unsafe {
        glibc::mallopt(glibc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as _);
        glibc::mallopt(glibc::M_TRIM_THRESHOLD, NEVER_TRIM);
    }
}
