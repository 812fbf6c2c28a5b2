//! `--backend`, `--device` and `--precision`, shared by train, score, embed and generate.

use genslm::backend::{BackendKind, Compute, DeviceChoice};
use genslm::config::Precision;

use super::mirror;

mirror!(BackendArg => BackendKind { Cpu, Cuda, Wgpu });
mirror!(PrecisionArg => Precision { Fp32, Bf16 });

#[derive(clap::Args, Clone, Debug)]
pub struct DeviceArgs {
    /// Compute backend: cpu; cuda (an NVIDIA GPU; needs a build with the `cuda` feature,
    /// scripts/build-cuda.sh); or wgpu (any Vulkan/Metal/DX12 GPU, or Mesa's lavapipe without
    /// one; needs the `wgpu` feature).
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: BackendArg,
    /// GPU index (default: the launcher's local rank, e.g. OMPI_COMM_WORLD_LOCAL_RANK or
    /// SLURM_LOCALID, else 0).
    #[arg(long)]
    pub device: Option<usize>,
    /// Compute precision (default: bf16 on cuda, fp32 on cpu and wgpu). Master weights,
    /// optimizer state and checkpoints stay fp32 (training computes with bf16 working copies);
    /// norm/softmax statistics, the loss and gradient reductions are fp32 either way.
    #[arg(long, value_enum)]
    pub precision: Option<PrecisionArg>,
}

impl DeviceArgs {
    pub fn choice(&self) -> DeviceChoice {
        DeviceChoice {
            backend: self.backend.into(),
            index: self.device,
        }
    }

    pub fn precision(&self) -> Option<Precision> {
        self.precision.map(Into::into)
    }

    pub fn compute(&self) -> Compute {
        Compute::new(self.choice(), self.precision())
    }
}
