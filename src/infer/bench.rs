//! `genslm bench embed` and `genslm bench generate`: inference throughput on a freshly
//! initialised model of a given config (speed does not depend on the weights' values).

use std::time::Instant;

use burn::tensor::Device;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::infer::embed::{embed_tokens, Pool};
use crate::infer::generate::{generate, GenerateOptions};
use crate::model::GenSlm;
use crate::rng::SplitMix64;
use crate::train::memory::check_held;

/// Embedding throughput.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbedBench {
    pub sequences: usize,
    pub seq_len: usize,
    pub batch_size: usize,
    pub seconds: f64,
}

impl EmbedBench {
    pub fn sequences_per_s(&self) -> f64 {
        self.sequences as f64 / self.seconds
    }
    pub fn tokens_per_s(&self) -> f64 {
        (self.sequences * self.seq_len) as f64 / self.seconds
    }
}

/// A model's weights as a benchmark initialises them: the host values drawn, then the tensors
/// made from them (f32 both; a 33B model is 264 GB of it, which was allocated until the process
/// aborted).
fn model_bytes(cfg: &ModelConfig) -> f64 {
    8.0 * cfg.param_count() as f64
}

/// Embeds `sequences` random sequences of `seq_len` codons (mean pooling after the final
/// LayerNorm, `batch_size` per forward pass), after one warm-up batch.
pub fn embed(
    cfg: &ModelConfig,
    seq_len: usize,
    sequences: usize,
    batch_size: usize,
) -> Result<EmbedBench> {
    // Before the model and the records are made: at 2^31 sequences or tokens the records alone
    // took all memory. Each record is its ids and a vector's header and allocation (~88
    // bytes), and its embedding (hidden × f32): measured, 10⁶ × 16 codons of tiny took 700 MB
    // where the ids alone were counted (64 MB).
    let records = sequences as f64 * (4.0 * seq_len as f64 + 88.0 + 4.0 * cfg.hidden_size as f64);
    let forward = crate::infer::window::forward_bytes(cfg, batch_size.min(sequences), seq_len);
    check_held(
        model_bytes(cfg) + records + forward,
        &format!(
            "bench embed: the model's weights, --sequences {sequences} × --seq-len {seq_len} \
             token ids with their embeddings, and a forward pass of --batch-size {batch_size}"
        ),
    )?;
    let model = GenSlm::init(cfg.clone(), 0, &Device::flex())?;
    let mut rng = SplitMix64::new(1);
    let recs: Vec<Vec<u32>> = (0..sequences)
        .map(|_| (0..seq_len).map(|_| 5 + rng.below(64) as u32).collect())
        .collect();
    let refs: Vec<&[u32]> = recs.iter().map(Vec::as_slice).collect();
    let layer = cfg.num_layers;
    embed_tokens(
        &model,
        &refs[..batch_size.min(sequences)],
        layer,
        Pool::Mean,
        Some(seq_len),
        batch_size,
    )?;
    let start = Instant::now();
    embed_tokens(&model, &refs, layer, Pool::Mean, Some(seq_len), batch_size)?;
    Ok(EmbedBench {
        sequences,
        seq_len,
        batch_size,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Generation throughput with or without the KV cache.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateBench {
    pub use_cache: bool,
    pub samples: usize,
    /// Codons drawn (prompt excluded).
    pub codons: usize,
    pub seconds: f64,
}

impl GenerateBench {
    pub fn codons_per_s(&self) -> f64 {
        self.codons as f64 / self.seconds
    }
}

/// Draws `samples` sequences of `new_codons` codons after a one-codon prompt (ATG), in one
/// batch, with GenSLM's sampling settings.
pub fn generation(
    cfg: &ModelConfig,
    new_codons: usize,
    samples: usize,
    use_cache: bool,
) -> Result<GenerateBench> {
    if new_codons >= crate::config::MAX_TOKENS {
        return Err(Error::Invalid(format!(
            "--codons {new_codons}: must be below {} (the prompt's codon is counted too)",
            crate::config::MAX_TOKENS
        )));
    }
    // The KV cache of every sample, by the bench's own flags (generate's check names its own);
    // without the cache, the last step's forward pass over the whole sequence instead.
    let kv = 8.0 * (cfg.num_layers * cfg.hidden_size) as f64 * samples as f64;
    let states = if use_cache {
        kv * (new_codons as f64 + 2.0)
    } else {
        crate::infer::window::forward_bytes(cfg, samples, new_codons + 1)
    };
    check_held(
        model_bytes(cfg) + states,
        &format!(
            "bench generate: the model's weights and the {} of --samples {samples} × --codons \
             {new_codons}",
            if use_cache {
                "KV cache"
            } else {
                "forward pass (no cache)"
            }
        ),
    )?;
    let model = GenSlm::init(cfg.clone(), 0, &Device::flex())?;
    let opts = GenerateOptions {
        num: samples,
        max_codons: 1 + new_codons,
        batch_size: samples,
        use_cache,
        ..Default::default()
    };
    let start = Instant::now();
    let mut codons = 0;
    generate(&model, &opts, &mut |g| {
        codons += g.dna.len() / 3 - 1;
        Ok(())
    })?;
    Ok(GenerateBench {
        use_cache,
        samples,
        codons,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Variant scoring throughput, prefix reuse against full recomputation.
#[derive(Debug, Clone, PartialEq)]
pub struct VariantsBench {
    pub variants: usize,
    pub window: usize,
    /// Best of the runs, seconds: full recomputation, prefix reuse.
    pub full_s: f64,
    pub prefix_s: f64,
    /// Largest |Δ LL| difference between the two paths.
    pub max_diff: f64,
}

/// Scores the 9 single-base substitutions of each of `codons` consecutive codons in the middle
/// of a random CDS (windows of `window` codons), both ways, `rounds` times interleaved.
/// `genslm bench variants` refuses sizes with nothing to measure before calling it.
pub fn variants(
    cfg: &ModelConfig,
    window: usize,
    codons: usize,
    batch: usize,
    rounds: usize,
) -> Result<VariantsBench> {
    use crate::infer::variants::delta::{full_recomputation, prefix_reuse, window_start, Job};
    // Every variant's REF and ALT windows are built before timing (9 per codon): two id
    // vectors, a codon list and the job's record (~300 bytes), and each path's result (~200
    // bytes); each pass holds a batch's forward.
    let windows = 9.0 * codons as f64 * (2.0 * 4.0 * window as f64 + 500.0);
    let forward = crate::infer::window::forward_bytes(cfg, batch.max(1), window);
    check_held(
        model_bytes(cfg) + windows + forward,
        &format!(
            "bench variants: the model's weights, 9 × --codons {codons} variants' windows of \
             --window {window} and a forward pass of --batch-size {batch}"
        ),
    )?;
    let model = GenSlm::init(cfg.clone(), 0, &Device::flex())?;
    let mut rng = SplitMix64::new(3);
    let n = 2 * window + codons;
    let cds: Vec<u32> = (0..n).map(|_| 5 + rng.below(64) as u32).collect();
    let mut jobs = Vec::with_capacity(9 * codons);
    for c in window..window + codons {
        let a = window_start(c, n, window);
        let reference = cds[a..a + window].to_vec();
        for k in 0..9u32 {
            let mut alt = reference.clone();
            // A different codon id stands for each substitution; speed does not depend on which.
            alt[c - a] = 5 + (alt[c - a] - 5 + 1 + k) % 64;
            jobs.push(Job {
                start: a,
                reference: reference.clone(),
                alt,
                first: c - a,
                codons: vec![c - a],
            });
        }
    }
    let (mut full_s, mut prefix_s, mut max_diff) = (f64::INFINITY, f64::INFINITY, 0.0f64);
    for _ in 0..rounds.max(1) {
        let t = Instant::now();
        let f = full_recomputation(&model, &jobs)?;
        full_s = full_s.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let p = prefix_reuse(&model, &jobs, batch)?;
        prefix_s = prefix_s.min(t.elapsed().as_secs_f64());
        for (a, b) in f.iter().zip(&p) {
            max_diff = max_diff.max((a.total - b.total).abs());
        }
    }
    Ok(VariantsBench {
        variants: jobs.len(),
        window,
        full_s,
        prefix_s,
        max_diff,
    })
}
