//! `genslm bench train` on several ranks (threads of this process), through the trainer itself,
//! optionally behind a simulated network (`--simulate-network 20ms,1GB/s`, issue 42): the step
//! time and the time rank 0 spent in communication (`comm_wait_s`), so that what overlap hides
//! can be seen without a cluster.

use std::io::Write;

use crate::backend::Compute;
use crate::config::{Config, ModelConfig, Quantize, TrainConfig};
use crate::error::{Error, Result};
use crate::parallel::netsim::NetSim;
use crate::parallel::Degrees;
use crate::rng::SplitMix64;
use crate::train::metrics::read_metrics;
use crate::train::setup::{check_memory, DataSource, RunOptions};
use crate::train::trainer::train_grid;

/// The trainer's settings a multi-rank benchmark varies (the rest are `TrainConfig`'s
/// defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankKnobs {
    pub zero: u8,
    pub overlap: bool,
    pub prefetch_layers: usize,
    pub checkpoint_activations: bool,
    pub quantize_weights: Option<Quantize>,
    pub quantize_grads: Option<Quantize>,
}

impl Default for RankKnobs {
    fn default() -> Self {
        let t = TrainConfig::default();
        Self {
            zero: t.zero,
            overlap: t.overlap,
            prefetch_layers: t.prefetch_layers,
            checkpoint_activations: t.checkpoint_activations,
            quantize_weights: t.quantize_weights,
            quantize_grads: t.quantize_grads,
        }
    }
}

/// Steps' means over the timed steps.
#[derive(Debug, Clone, PartialEq)]
pub struct RanksBench {
    pub secs_per_step: f64,
    pub tokens_per_s: f64,
    /// Seconds rank 0 spent inside communicator calls per step.
    pub comm_wait_s: f64,
    /// Bytes that left rank 0 per step (`comm_bytes`).
    pub comm_bytes: f64,
    /// Under PP: the measured bubble (idle over busy summed over the stages, `pp_bubble`).
    pub pp_bubble: Option<f64>,
}

/// `steps` timed training steps (after one warm-up step; the run's last step, which also
/// validates, is not timed) of a fresh `model` at `seq_len` on `d` ranks as threads, one
/// sequence per DP rank (and, under PP, 4·P micro-batches a step), on random codons written
/// to a temporary FASTA.
pub fn train_ranks(
    model: &ModelConfig,
    seq_len: usize,
    steps: usize,
    d: Degrees,
    network: Option<NetSim>,
    compute: &Compute,
    knobs: RankKnobs,
) -> Result<RanksBench> {
    if seq_len < 2 || steps == 0 {
        return Err(Error::Invalid(format!(
            "--seq-len {seq_len} --steps {steps}: a training step needs at least 2 tokens and \
             one step"
        )));
    }
    // Pipeline stages run 4·P micro-batches a step (1F1B's bubble (P − 1)/(4P)).
    let grad_accum = if d.pp > 1 { 4 * d.pp } else { 1 };
    // Enough records of one window each for every step's batch, with some held out.
    let records = d.dp * grad_accum * (steps + 2) * 2 + 8;
    let cfg = Config {
        model: model.clone(),
        train: TrainConfig {
            steps: steps as u64 + 2,
            seq_len,
            batch_size: d.dp,
            grad_accum,
            val_every: 0,
            // A short warm-up: the default (10) outlasts the bench's steps, and the trainer's
            // note about that named a --warmup this command does not have, once per case.
            warmup: 1,
            precision: Some(compute.precision),
            zero: knobs.zero,
            overlap: knobs.overlap,
            prefetch_layers: knobs.prefetch_layers,
            checkpoint_activations: knobs.checkpoint_activations,
            quantize_weights: knobs.quantize_weights,
            quantize_grads: knobs.quantize_grads,
            ..TrainConfig::default()
        },
    };
    let opts = RunOptions {
        device: compute.device,
        network,
        no_checkpoints: true,
        ..RunOptions::default()
    };
    // The trainer's own checks (tokens per step, the memory a step peaks at), before the
    // records are written: at --seq-len 2^31 their text alone filled the memory.
    let topo = crate::parallel::Topology::of(0, d)?;
    check_memory(&cfg, (d.dp, topo.seq_degree(), d.pp), d.world(), &opts)?;
    let text_bytes = (records as f64) * (3.0 * seq_len as f64 + 20.0);
    crate::train::memory::check_held(text_bytes, "the benchmark's random records (FASTA text)")?;
    let tmp = crate::atomic::temp_dir();
    // The FASTA, the run's dataset (about a third of it) and the run's small files.
    let need = (text_bytes * 1.5) as u64 + (64 << 20);
    if let Some(free) = crate::bench::scratch::free_disk_bytes(&tmp).filter(|&f| need > f) {
        return Err(Error::Invalid(format!(
            "--steps {steps} --seq-len {seq_len}: the benchmark writes about {:.1} GB of random \
             records and their dataset, but the disk of {} (TMPDIR, or /tmp) has {:.1} GB free",
            need as f64 / 1e9,
            tmp.display(),
            free as f64 / 1e9
        )));
    }
    let dir = tempfile::Builder::new()
        .prefix("genslm-bench-train-")
        .tempdir_in(&tmp)
        .map_err(|e| Error::io(&tmp, e))?;
    // Ctrl-C or SIGTERM mid-run removes it (hundreds of MB were left, under a random name).
    let _registered = crate::interrupt::register(dir.path().to_path_buf(), true);
    let fasta = dir.path().join("random.fa");
    let mut rng = SplitMix64::new(7);
    let mut text = String::with_capacity(records * (3 * seq_len + 20));
    for r in 0..records {
        text.push_str(&format!(">r{r}\n"));
        text.extend((0..3 * seq_len).map(|_| b"ACGT"[rng.below(4) as usize] as char));
        text.push('\n');
    }
    std::fs::File::create(&fasta)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(|e| Error::io(&fasta, e))?;
    let run = dir.path().join("run");
    train_grid(&cfg, &DataSource::Fasta(vec![fasta]), &run, &opts, d)?;
    let m = read_metrics(&run.join("metrics.jsonl"))?;
    let timed = &m[1..m.len() - 1];
    let n = timed.len() as f64;
    let secs: f64 = timed
        .iter()
        .map(|x| x.tokens as f64 / x.tokens_per_s)
        .sum::<f64>()
        / n;
    Ok(RanksBench {
        secs_per_step: secs,
        tokens_per_s: timed.iter().map(|x| x.tokens as f64).sum::<f64>() / n / secs,
        comm_wait_s: timed.iter().filter_map(|x| x.comm_wait_s).sum::<f64>() / n,
        comm_bytes: timed.iter().filter_map(|x| x.comm_bytes).sum::<u64>() as f64 / n,
        pp_bubble: (d.pp > 1).then(|| timed.iter().filter_map(|x| x.pp_bubble).sum::<f64>() / n),
    })
}
