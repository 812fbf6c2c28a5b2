//! `genslm bench`: ingest (FASTA → parquet throughput on synthetic genomes), training steps,
//! and the attention op alone (attention.rs, with cubek-attention's baseline in cubek.rs).
//!
//! Ingest writes random DNA as 60-column FASTA (plain and gzip) into a scratch directory, runs
//! the same pipeline as `genslm tokenize`, and reports MB/s (scratch.rs: that directory).

mod attention;
#[cfg(any(feature = "cuda", feature = "wgpu"))]
mod cubek;
pub mod scratch;
mod train_ranks;

pub use attention::{attention_op, AttnBench, AttnBenchCase, AttnImpl};
pub use train_ranks::{train_ranks, RankKnobs, RanksBench};

use std::io::Write;
use std::path::Path;

use crate::data::ingest::{tokenize_to_parquet, IngestOptions, IngestSummary};
use crate::error::{Error, Result};
use crate::rng::SplitMix64;

/// Writes about `mb` megabytes of FASTA (records of `record_mb` Mb, 60 bases per line) to `w`.
pub fn write_synthetic_fasta(
    w: &mut dyn Write,
    mb: usize,
    record_mb: usize,
    seed: u64,
) -> std::io::Result<()> {
    let mut rng = SplitMix64::new(seed);
    let target = mb * 1_000_000;
    let mut written = 0usize;
    let mut rec = 0;
    let mut line = [0u8; 61];
    line[60] = b'\n';
    while written < target {
        let header = format!(">synthetic_{rec} random genome\n");
        w.write_all(header.as_bytes())?;
        written += header.len();
        for _ in 0..(record_mb * 1_000_000 / 60) {
            let mut bits = 0u64;
            for (i, b) in line[..60].iter_mut().enumerate() {
                if i % 32 == 0 {
                    bits = rng.next_u64();
                }
                *b = b"ACGT"[(bits & 3) as usize];
                bits >>= 2;
            }
            w.write_all(&line)?;
            written += 61;
        }
        rec += 1;
    }
    Ok(())
}

/// Result of one benchmark case.
pub struct BenchCase {
    pub name: &'static str,
    pub summary: IngestSummary,
    /// Uncompressed FASTA bytes.
    pub fasta_bytes: u64,
    /// Peak resident memory during the case (MiB), where the kernel lets us reset the peak;
    /// `None` elsewhere.
    pub peak_mib: Option<f64>,
}

/// Resets this process's peak-RSS mark (Linux `clear_refs` 5); false where unsupported.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn io(p: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::io(p, e)
}

/// Runs the plain and gzip cases with `mb` megabytes of FASTA, in records of `record_mb`
/// megabases, in `dir`.
pub fn ingest(dir: &Path, mb: usize, record_mb: usize) -> Result<Vec<BenchCase>> {
    let plain = dir.join("bench.fa");
    let gz = dir.join("bench.fa.gz");
    {
        let f = std::fs::File::create(&plain).map_err(io(&plain))?;
        let mut w = std::io::BufWriter::new(f);
        write_synthetic_fasta(&mut w, mb, record_mb, 42).map_err(io(&plain))?;
        w.flush().map_err(io(&plain))?;
    }
    {
        // Streamed, so the cases' peak memory is ingest's own.
        let mut data = std::fs::File::open(&plain).map_err(io(&plain))?;
        let f = std::fs::File::create(&gz).map_err(io(&gz))?;
        let mut enc = flate2::write::GzEncoder::new(f, flate2::Compression::new(6));
        std::io::copy(&mut data, &mut enc).map_err(io(&gz))?;
        enc.finish().map_err(io(&gz))?;
    }
    let fasta_bytes = std::fs::metadata(&plain).map_err(io(&plain))?.len();
    let opts = IngestOptions::default();
    let mut cases = Vec::new();
    for (name, input) in [("plain", &plain), ("gzip", &gz)] {
        let out = dir.join(format!("bench-{name}.parquet"));
        let reset = reset_peak_rss();
        let summary = tokenize_to_parquet(std::slice::from_ref(input), &out, &opts)?;
        cases.push(BenchCase {
            name,
            summary,
            fasta_bytes,
            peak_mib: reset.then(crate::train::metrics::peak_rss_mib),
        });
    }
    Ok(cases)
}

/// Refuses, before anything is built, a one-rank training step on the CPU that the trainer
/// would refuse: more tokens than a step may take, or a predicted peak past the memory
/// available (the allocation aborted the process, or the OOM killer ended it, minutes in).
fn check_cpu_step(
    model: &crate::config::ModelConfig,
    seq_len: usize,
    checkpoint: bool,
    on_cpu: bool,
) -> Result<()> {
    let cfg = crate::config::Config {
        model: model.clone(),
        train: crate::config::TrainConfig {
            seq_len,
            batch_size: 1,
            grad_accum: 1,
            checkpoint_activations: checkpoint,
            ..Default::default()
        },
    };
    cfg.train.validate().map_err(Error::Invalid)?;
    match crate::host_memory::available_bytes() {
        // Without train's --skip-memory-check, which bench has not.
        Some(avail) if on_cpu => crate::train::memory::check_fits_or(&cfg, (1, 1, 1), 1, avail, ""),
        _ => Ok(()),
    }
}

/// One training step (forward + backward, batch 1) of `model` at `seq_len` on random tokens:
/// seconds taken and this process's peak resident memory afterwards (MiB).
///
/// Peak memory is per process, so `genslm bench attention` runs each case in a child process.
pub fn train_step(
    cfg: &crate::config::ModelConfig,
    seq_len: usize,
    seed: u64,
    checkpoint: bool,
) -> Result<(f64, f64)> {
    if seq_len < 2 {
        return Err(crate::error::Error::Invalid(format!(
            "--seq-len {seq_len}: a training step needs at least 2 tokens"
        )));
    }
    check_cpu_step(cfg, seq_len, checkpoint, true)?;
    let device = burn::tensor::Device::flex().autodiff();
    let model = crate::model::GenSlm::init(cfg.clone(), seed, &device)?;
    let params: Vec<_> = model
        .params
        .iter()
        .map(|p| p.clone().require_grad())
        .collect();
    let model = crate::model::GenSlm { params, ..model };
    let mut rng = SplitMix64::new(seed);
    let batch = crate::data::loader::Batch {
        batch: 1,
        seq_len,
        tokens: (0..seq_len).map(|_| 5 + rng.below(64) as u32).collect(),
        mask: vec![1u8; seq_len],
    };
    let start = std::time::Instant::now();
    // The trainer's own forward and backward (whole-graph or checkpointed) on one rank.
    let (_, grads) = crate::train::step::loss_and_grads(
        &model,
        std::slice::from_ref(&batch),
        batch.n_targets(),
        &crate::parallel::ranks::Ranks::single(),
        crate::train::layerwise::Keep::of(checkpoint, false),
    )?;
    // Touch one gradient so all work is done before the clock stops.
    let _ = crate::ops::primitive::tensor_to_vec(&grads[0]);
    Ok((
        start.elapsed().as_secs_f64(),
        crate::train::metrics::peak_rss_mib(),
    ))
}

/// What `genslm bench train` measured.
#[derive(Debug, Clone)]
pub struct TrainBench {
    pub secs_per_step: f64,
    /// Predicted tokens per second (seq_len − 1 per step, as the trainer counts them).
    pub tokens_per_s: f64,
    /// Model FLOPs per second of the training steps (the trainer's 6N-style count).
    pub gflops: f64,
    /// A 1024³ f32 matmul on the same device in the same run, for scale.
    pub matmul_gflops: f64,
    pub peak_rss_mib: f64,
}

/// `steps` AdamW training steps (after one warm-up step) of a fresh model at `seq_len`, batch
/// 1, on random codons, on `compute`'s device and precision.
pub fn train_steps(
    cfg: &crate::config::ModelConfig,
    seq_len: usize,
    steps: usize,
    compute: &crate::backend::Compute,
) -> Result<TrainBench> {
    use crate::ops::primitive::tensor_to_vec;
    use crate::train::optim::{AdamW, AdamWConfig};
    if seq_len < 2 || steps == 0 {
        return Err(Error::Invalid(format!(
            "--seq-len {seq_len} --steps {steps}: a training step needs at least 2 tokens and \
             one step"
        )));
    }
    let on_cpu = compute.device.backend == crate::backend::BackendKind::Cpu;
    check_cpu_step(cfg, seq_len, false, on_cpu)?;
    let device = compute.open()?;
    let matmul_gflops = matmul_rate(&device);
    let ad = device.autodiff();
    let mut model =
        crate::model::GenSlm::init(cfg.clone(), 0, &ad)?.with_precision(compute.precision);
    model.params = model.params.into_iter().map(|p| p.require_grad()).collect();
    let mut opt = AdamW::new(AdamWConfig::default(), &model.params);
    let mut rng = SplitMix64::new(1);
    let batch = crate::data::loader::Batch {
        batch: 1,
        seq_len,
        tokens: (0..seq_len).map(|_| 5 + rng.below(64) as u32).collect(),
        mask: vec![1u8; seq_len],
    };
    let single = crate::parallel::ranks::Ranks::single();
    let mut start = std::time::Instant::now();
    for step in 0..=steps {
        if step == 1 {
            start = std::time::Instant::now();
        }
        let (_, grads) = crate::train::step::loss_and_grads(
            &model,
            std::slice::from_ref(&batch),
            batch.n_targets(),
            &single,
            crate::train::layerwise::Keep::Graphs,
        )?;
        let params = model
            .params
            .iter()
            .map(|p| p.clone().without_autodiff())
            .collect();
        let new = opt.update(params, grads, 1.0, &model.layout.specs, 1e-4);
        // Reading one value waits for the step's work on lazy backends.
        let _ = tensor_to_vec(&new[0].clone().sum());
        model.params = new
            .into_iter()
            .map(|p| p.autodiff().require_grad())
            .collect();
    }
    let secs = start.elapsed().as_secs_f64() / steps as f64;
    let flops = crate::train::metrics::train_flops_per_sequence(cfg, seq_len);
    Ok(TrainBench {
        secs_per_step: secs,
        tokens_per_s: (seq_len - 1) as f64 / secs,
        gflops: flops / secs / 1e9,
        matmul_gflops,
        peak_rss_mib: crate::train::metrics::peak_rss_mib(),
    })
}

/// GFLOP/s of a 1024³ f32 matmul on `device` (best of 5 after a warm-up).
fn matmul_rate(device: &burn::tensor::Device) -> f64 {
    use burn::tensor::{Distribution, Tensor};
    let n = 1024;
    let a = Tensor::<2>::random([n, n], Distribution::Default, device);
    let b = Tensor::<2>::random([n, n], Distribution::Default, device);
    let _ = crate::ops::primitive::tensor_to_vec(&a.clone().matmul(b.clone()).sum());
    (0..5)
        .map(|_| {
            let t = std::time::Instant::now();
            let _ = crate::ops::primitive::tensor_to_vec(&a.clone().matmul(b.clone()).sum());
            2.0 * (n * n * n) as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}
