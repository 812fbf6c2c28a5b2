//! Which device a process computes on: `--backend cpu|cuda|wgpu`, `--device N`, and the local rank a
//! launcher gives each process (one process per GPU).
//!
//! The rest of the program is backend-erased (`burn::tensor::Device`); this file is the one
//! place that knows which backends the build has. A request the build or the machine cannot
//! serve is an error that says what is missing, never a panic inside burn: burn-cuda panics on
//! its first operation when the driver is absent, so the driver is probed here first.

use burn::tensor::Device;

use crate::config::Precision;
use crate::error::{Error, Result};
use crate::launch::{local_rank, local_size};

/// A compute backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// burn's `flex` CPU backend (always built).
    #[default]
    Cpu,
    /// burn-cuda on an NVIDIA GPU (feature `cuda`).
    Cuda,
    /// burn's wgpu backend (feature `wgpu`): any Vulkan, Metal or DX12 GPU, or Mesa's lavapipe
    /// on a machine without one.
    Wgpu,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
            BackendKind::Wgpu => "wgpu",
        }
    }

    /// bf16 compute where the hardware has bf16 matmuls (NVIDIA GPUs); fp32 on CPU, where flex
    /// runs bf16 matmuls through f32 and the casts only cost time, and on wgpu, whose adapters
    /// (Vulkan, Metal, lavapipe) do not all have bf16 arithmetic.
    pub fn default_precision(self) -> Precision {
        match self {
            BackendKind::Cpu | BackendKind::Wgpu => Precision::Fp32,
            BackendKind::Cuda => Precision::Bf16,
        }
    }
}

/// Where a process computes: the backend and, for GPUs, which device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeviceChoice {
    pub backend: BackendKind,
    /// `--device N`: overrides the launcher's local rank.
    pub index: Option<usize>,
}

impl DeviceChoice {
    pub fn cpu() -> Self {
        Self::default()
    }

    /// The GPU index of thread rank `thread_rank` of this process: `--device`, else the local
    /// rank, else 0, plus the thread rank (ranks run as threads take consecutive GPUs). The
    /// text says where the index came from, for error messages.
    pub fn gpu_index(
        &self,
        thread_rank: usize,
        get: impl Fn(&str) -> Option<String>,
    ) -> (usize, String) {
        let (base, from) = match (self.index, local_rank(get)) {
            (Some(i), _) => (i, "--device".to_string()),
            (None, Some((r, var))) => (r, format!("local rank {var}={r}")),
            (None, None) => (0, "the default".to_string()),
        };
        (base + thread_rank, from)
    }

    /// Opens the device for thread rank `thread_rank` of this process.
    pub fn open(&self, thread_rank: usize) -> Result<Device> {
        match self.backend {
            // Taken without a word, it read as if the run were on that GPU.
            BackendKind::Cpu if self.index.is_some() => Err(Error::Invalid(format!(
                "--device {}: the cpu backend has no devices to choose (it uses the cores, see \
                 --threads); --device picks a GPU with --backend cuda or wgpu",
                self.index.unwrap_or_default()
            ))),
            BackendKind::Cpu => Ok(Device::flex()),
            BackendKind::Cuda => {
                if self.index.is_none() {
                    crate::launch::check_local_rank(|k| std::env::var(k).ok())
                        .map_err(Error::Invalid)?;
                }
                let (index, from) = self.gpu_index(thread_rank, |k| std::env::var(k).ok());
                open_cuda(index, &from)
            }
            BackendKind::Wgpu => open_wgpu(self.index.map(|i| i + thread_rank)),
        }
    }

    /// Fails early, before any work, when the backend cannot run here.
    pub fn check(&self) -> Result<()> {
        self.open(0).map(|_| ())
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(index: usize, from: &str) -> Result<Device> {
    let count = cuda_device_count()?;
    if index >= count {
        return Err(Error::Invalid(format!(
            "--backend cuda: GPU {index} requested ({from}), but this machine has {count} \
             visible GPU(s) (CUDA_VISIBLE_DEVICES={})",
            std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into())
        )));
    }
    // The kernel compiler's files: cubecl finds out only at the first kernel, or panics.
    crate::cuda_toolkit::preflight()?;
    Ok(Device::cuda(index))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_index: usize, _from: &str) -> Result<Device> {
    Err(Error::Invalid(
        "--backend cuda: this genslm was built without the CUDA backend. Rebuild with \
         scripts/build-cuda.sh (or `cargo build --release --features cuda,nccl`), or use \
         --backend cpu"
            .into(),
    ))
}

/// `--device N` picks the N-th discrete GPU; without it wgpu takes the best adapter it finds
/// (`CUBECL_WGPU_DEFAULT_DEVICE=Cpu` forces lavapipe/llvmpipe).
#[cfg(feature = "wgpu")]
fn open_wgpu(index: Option<usize>) -> Result<Device> {
    use burn::tensor::DeviceKind;
    Ok(Device::wgpu(match index {
        Some(i) => DeviceKind::DiscreteGpu(i),
        None => DeviceKind::DefaultDevice,
    }))
}

#[cfg(not(feature = "wgpu"))]
fn open_wgpu(_index: Option<usize>) -> Result<Device> {
    Err(Error::Invalid(
        "--backend wgpu: this genslm was built without the wgpu backend. Rebuild with \
         `cargo build --release --features wgpu`, or use --backend cpu"
            .into(),
    ))
}

/// GPUs the CUDA driver sees; an error naming what is missing when there is no driver or no
/// GPU.
#[cfg(feature = "cuda")]
pub fn cuda_device_count() -> Result<usize> {
    use cudarc::driver::{result, sys};
    // SAFETY: only tries to load libcuda; cudarc panics on first use when it is absent.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::Invalid(
            "--backend cuda: the NVIDIA driver library (libcuda.so) was not found: this \
             machine has no NVIDIA driver installed, or it is not on the library path"
                .into(),
        ));
    }
    result::init().map_err(|e| {
        Error::Invalid(format!(
            "--backend cuda: the NVIDIA driver did not initialise ({e:?}): no usable GPU"
        ))
    })?;
    let n = result::device::get_count()
        .map_err(|e| Error::Invalid(format!("--backend cuda: cannot count GPUs ({e:?})")))?;
    if n <= 0 {
        return Err(Error::Invalid(
            "--backend cuda: the NVIDIA driver sees no GPU (check CUDA_VISIBLE_DEVICES)".into(),
        ));
    }
    Ok(n as usize)
}

/// Bytes the memory pools of `t`'s GPU device hold (their high-water mark: pools keep their
/// pages), or `None` on CPU.
pub fn device_reserved_bytes<const D: usize>(t: &burn::tensor::Tensor<D>) -> Option<u64> {
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if let Ok(c) = t.clone().try_into_primitive::<burn::backend::Cube>() {
        return Some(genslm_kernels::reserved_bytes(&c.client));
    }
    let _ = t;
    None
}

/// The bytes in use in `device`'s memory pools on a GPU backend now, or `None` on the CPU.
/// Ranks that share a device share its pools.
pub fn device_bytes_in_use(device: &Device) -> Option<u64> {
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    {
        let probe = burn::tensor::Tensor::<1>::zeros([1], &device.clone().without_autodiff());
        if let Ok(c) = probe.try_into_primitive::<burn::backend::Cube>() {
            return Some(genslm_kernels::pool_bytes(&c.client).1);
        }
    }
    let _ = device;
    None
}

thread_local! {
    /// This thread's peak of sampled device bytes in use (`None`: not watching).
    static DEVICE_PEAK: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

/// Starts (`true`) or stops watching the device memory this thread's samples see. A GPU
/// backend's pools keep no high-water mark of the bytes in use, so the trainer samples them
/// where a step's memory peaks (before each layer's backward, after the update); each sample
/// waits for the device's queue, so only runs on GPU backends watch.
fn watch_device_memory(on: bool) {
    DEVICE_PEAK.set(on.then_some(0));
}

/// Watching for as long as it lives ([`watch_device_memory`]), so that later work on the
/// thread (another command, a benchmark) does not pay for samples.
pub struct DeviceMemoryWatch(());

impl DeviceMemoryWatch {
    /// `GENSLM_DEVICE_MEMORY_SAMPLES=0` turns the samples off, to measure what they cost
    /// (docs/GPU.md: the profile part runs with and without them).
    pub fn start(on: bool) -> Self {
        let off = std::env::var("GENSLM_DEVICE_MEMORY_SAMPLES").is_ok_and(|v| v == "0");
        watch_device_memory(on && !off);
        Self(())
    }
}

impl Drop for DeviceMemoryWatch {
    fn drop(&mut self) {
        watch_device_memory(false);
    }
}

/// Adds the bytes in use in `device`'s pools now to this thread's peak, when watching, and
/// returns them (`None` when not watching or on the CPU).
pub fn sample_device_memory(device: &Device) -> Option<u64> {
    let peak = DEVICE_PEAK.get()?;
    let used = device_bytes_in_use(device)?;
    DEVICE_PEAK.set(Some(peak.max(used)));
    Some(used)
}

/// The peak sampled since the last call (restarting it), or `None` when not watching.
pub fn take_device_peak() -> Option<u64> {
    let peak = DEVICE_PEAK.get();
    if peak.is_some() {
        DEVICE_PEAK.set(Some(0));
    }
    peak
}

/// Where and in what precision an inference command (score, embed, generate) computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Compute {
    pub device: DeviceChoice,
    pub precision: Precision,
}

impl Compute {
    /// The backend's default precision unless one is asked for.
    pub fn new(device: DeviceChoice, precision: Option<Precision>) -> Self {
        Self {
            device,
            precision: resolve_precision(precision, device.backend),
        }
    }

    /// This process's device (the first of its thread ranks).
    pub fn open(&self) -> Result<Device> {
        self.device.open(0)
    }
}

/// Sizes the CPU backend's thread pool once per process: `threads` when given, else
/// `RAYON_NUM_THREADS` when set, else the cores divided among the processes a launcher started
/// on this node (so `mpirun -np 4` on 8 cores does not run 4 × 8 threads).
pub fn set_cpu_threads(threads: Option<usize>) -> Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // The variable goes through the same bounds as the flag (rayon would start any number of
    // threads it names: 3,000 of them aborted the process before a word could be printed).
    // 0 means the default, as it does for rayon.
    let env = std::env::var("RAYON_NUM_THREADS").ok();
    let (asked, what) = match (threads, env.as_deref().map(str::trim)) {
        (Some(n), _) => (Some(n), format!("--threads {n}")),
        (None, Some(v)) => {
            let n = v.parse::<usize>().map_err(|_| {
                Error::Invalid(format!(
                    "RAYON_NUM_THREADS={v}: not a whole number of threads (unset it, or use \
                     --threads)"
                ))
            })?;
            ((n > 0).then_some(n), format!("RAYON_NUM_THREADS={v}"))
        }
        (None, None) => (None, "the CPU thread pool".to_string()),
    };
    let n = match asked {
        Some(0) => return Err(Error::Invalid(format!("{what}: must be at least 1"))),
        // Each thread is a real one with its own stack: an absurd count stalls the machine
        // before any error could come.
        Some(n) if n > max_threads(cores) => {
            return Err(Error::Invalid(format!(
                "{what}: more than {} (4 × the {cores} cores this process may use); more \
                 threads than cores only slow the CPU backend down",
                max_threads(cores)
            )))
        }
        Some(n) => n,
        None => default_threads(cores, |k| std::env::var(k).ok()),
    };
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global()
        .map_err(|e| Error::Invalid(format!("{what}: {e}")))
}

/// The CPU threads of a process given none: all `cores`, or under a launch of several ranks
/// its share of them among the node's ranks. Only under a launch: Slurm sets
/// SLURM_NTASKS_PER_NODE inside any `sbatch --ntasks-per-node=N` script, where one process
/// runs the threaded ranks (`genslm train --dp N`) and got cores / N threads.
fn default_threads(cores: usize, get: impl Fn(&str) -> Option<String>) -> usize {
    match crate::launch::detect(&get) {
        Ok(Some(l)) if l.world > 1 => {
            if let Some(w) = crate::launch::unread_local_size(&get) {
                eprintln!("warning: {w}");
            }
            (cores / local_size(&get).unwrap_or(1)).max(1)
        }
        _ => cores,
    }
}

/// The most `--threads` accepts on `cores` cores.
fn max_threads(cores: usize) -> usize {
    4 * cores
}

/// Threads the CPU backend computes on.
pub fn cpu_threads() -> usize {
    rayon::current_num_threads()
}

/// What a GPU device's runtime says about its memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes it can hold (cubecl's `max_memory`: CUDA's device memory; on Vulkan, with the
    /// SPIR-V path, the largest device-local heap), or `None` where the runtime states none
    /// (wgpu's WGSL path).
    pub capacity: Option<u64>,
    /// Bytes of the largest single buffer (WebGPU's binding limit on wgpu; 128 MiB on
    /// lavapipe).
    pub max_allocation: u64,
    /// No card behind the device (a CPU adapter or a software rasterizer such as Mesa's
    /// lavapipe): its buffers live in host memory.
    pub host_backed: bool,
    /// The device as it names itself.
    pub name: String,
}

/// The memory figures of a GPU backend's device, or `None` on the CPU.
pub fn device_memory(device: &Device) -> Option<DeviceMemory> {
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    {
        let probe = burn::tensor::Tensor::<1>::zeros([1], device);
        if let Ok(t) = probe.try_into_primitive::<burn::backend::Cube>() {
            let p = t.client.properties();
            return Some(DeviceMemory {
                capacity: p.memory.max_memory(),
                max_allocation: p.memory.max_page_size,
                host_backed: p.identity.physical.is_none(),
                name: p.identity.name.clone(),
            });
        }
    }
    let _ = device;
    None
}

/// Where state offloaded from a GPU lives (`--offload`): host memory, as the CPU backend's
/// device. On the CPU backend this is the training device itself, so offloading moves nothing.
pub fn host_device() -> Device {
    Device::flex()
}

/// `t` copied into host memory now (unchanged when it is there already). burn's copy from a
/// CubeCL device to the CPU is lazy: it keeps a binding to the device buffer and reads it on
/// first access, and a binding does not stop an in-place op (the layer's residual sum, when
/// it holds the only handle) from overwriting that buffer first. So the bytes are read here,
/// before anything else runs on the device.
pub fn to_host<const D: usize>(t: burn::tensor::Tensor<D>) -> burn::tensor::Tensor<D> {
    use burn::backend::DispatchDevice;
    if matches!(t.device().as_dispatch(), DispatchDevice::Flex(_)) {
        return t;
    }
    let dtype = t.dtype();
    let lazy = t.into_data();
    let read = burn::tensor::TensorData::from_bytes_vec(
        lazy.as_bytes().to_vec(),
        lazy.shape().clone(),
        lazy.dtype(),
    );
    burn::tensor::Tensor::from_data(read, (&host_device(), dtype))
}

/// The precision to run: the flag/config value, else the backend's default.
pub fn resolve_precision(requested: Option<Precision>, backend: BackendKind) -> Precision {
    requested.unwrap_or(backend.default_precision())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::tests::env;
    use crate::launch::LOCAL_RANK_VARS;

    /// The cores are shared among a node's ranks only under a launch of several: a batch
    /// script's SLURM_NTASKS_PER_NODE (or a stray local size) leaves one process all of them.
    #[test]
    fn threads_are_shared_only_among_launched_ranks() {
        let stray = [
            ("SLURM_NTASKS_PER_NODE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("MPI_LOCALNRANKS", "4"),
            ("SLURM_PROCID", "0"),
        ];
        for v in stray {
            assert_eq!(default_threads(8, env(&[v])), 8, "{v:?}");
        }
        let mpirun = [
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ];
        assert_eq!(default_threads(8, env(&mpirun)), 4);
        let srun = [
            ("SLURM_PROCID", "0"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_NTASKS_PER_NODE", "2"),
        ];
        assert_eq!(default_threads(3, env(&srun)), 1);
        assert_eq!(default_threads(1, env(&mpirun)), 1, "at least one");
    }

    #[test]
    fn the_local_rank_picks_the_gpu_and_device_overrides_it() {
        let cuda = DeviceChoice {
            backend: BackendKind::Cuda,
            index: None,
        };
        assert_eq!(cuda.gpu_index(0, env(&[])).0, 0);
        for var in LOCAL_RANK_VARS {
            assert_eq!(cuda.gpu_index(0, env(&[(var, "3")])).0, 3, "{var}");
        }
        // Open MPI's variable wins over Slurm's when both are set (mpirun inside an allocation).
        let both = [("SLURM_LOCALID", "0"), ("OMPI_COMM_WORLD_LOCAL_RANK", "2")];
        assert_eq!(cuda.gpu_index(0, env(&both)).0, 2);
        // Thread ranks of one process take consecutive GPUs.
        assert_eq!(cuda.gpu_index(1, env(&both)).0, 3);
        let pinned = DeviceChoice {
            index: Some(5),
            ..cuda
        };
        assert_eq!(pinned.gpu_index(0, env(&both)), (5, "--device".to_string()));
        // On the CPU there is nothing to pick: --device is a mistake, named.
        let cpu = DeviceChoice {
            backend: BackendKind::Cpu,
            index: Some(99999),
        };
        let e = cpu.check().unwrap_err().to_string();
        assert!(e.contains("--device 99999: the cpu backend"), "{e}");
    }

    #[test]
    fn absurd_thread_counts_are_refused_before_any_thread_starts() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        for n in [4 * cores + 1, usize::MAX] {
            let e = set_cpu_threads(Some(n)).unwrap_err().to_string();
            assert!(
                e.contains(&format!("--threads {n}: more than {}", 4 * cores)),
                "{e}"
            );
        }
        assert!(set_cpu_threads(Some(0)).is_err());
    }

    #[test]
    fn precision_defaults_follow_the_backend() {
        assert_eq!(resolve_precision(None, BackendKind::Cpu), Precision::Fp32);
        assert_eq!(resolve_precision(None, BackendKind::Cuda), Precision::Bf16);
        assert_eq!(
            resolve_precision(Some(Precision::Fp32), BackendKind::Cuda),
            Precision::Fp32
        );
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_says_how_to_rebuild() {
        let e = DeviceChoice {
            backend: BackendKind::Cuda,
            index: None,
        }
        .check()
        .unwrap_err()
        .to_string();
        assert!(e.contains("--features cuda"), "{e}");
    }
}
