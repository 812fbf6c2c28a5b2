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

/// Embeds `sequences` random sequences of `seq_len` codons (mean pooling after the final
/// LayerNorm, `batch_size` per forward pass), after one warm-up batch.
pub fn embed(
    cfg: &ModelConfig,
    seq_len: usize,
    sequences: usize,
    batch_size: usize,
) -> Result<EmbedBench> {
    let model = GenSlm::init(cfg.clone(), 0, &Device::flex())?;
    // Before the records are made: at 2^31 sequences or tokens they alone took all memory.
    let forward = crate::infer::window::forward_bytes(&model, batch_size.min(sequences), seq_len);
    check_held(
        4.0 * sequences as f64 * seq_len as f64 + forward,
        &format!(
            "bench embed: --sequences {sequences} × --seq-len {seq_len} token ids and a forward \
             pass of --batch-size {batch_size}"
        ),
    )?;
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
    // The KV cache of every sample, by the bench's own flags (generate's check names its own).
    let kv = 8.0 * (cfg.num_layers * cfg.hidden_size) as f64 * samples as f64;
    check_held(
        kv * (new_codons as f64 + 2.0),
        &format!("bench generate: the KV cache of --samples {samples} × --codons {new_codons}"),
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
    let model = GenSlm::init(cfg.clone(), 0, &Device::flex())?;
    // Every variant's REF and ALT windows are built before timing (9 per codon), and each
    // pass holds a batch's forward.
    let windows = 9.0 * codons as f64 * 2.0 * 4.0 * window as f64;
    let forward = crate::infer::window::forward_bytes(&model, batch.max(1), window);
    check_held(
        windows + forward,
        &format!(
            "bench variants: 9 × --codons {codons} variants' windows of --window {window} and a \
             forward pass of --batch-size {batch}"
        ),
    )?;
    let mut rng = SplitMix64::new(3);
    let n = 2 * window + codons;
    let cds: Vec<u32> = (0..n).map(|_| 5 + rng.below(64) as u32).collect();
    let mut jobs = Vec::new();
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
