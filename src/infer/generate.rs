//! `genslm generate`: sample DNA from a model, codon by codon, with a KV cache.
//!
//! Each sample starts from the prompt (`ATG` by default; `[BOS]` is put in front with the
//! 71-token vocabulary) and grows one codon per step until it has `max_codons` codons (prompt
//! included, like Hugging Face's `max_length`), draws `[EOS]` (71-token vocabulary), or, with
//! `stop_at_stop_codon`, draws TAA/TAG/TGA (kept in the output; a stop codon in the prompt
//! was not drawn and does not end it). Only codons (and `[EOS]`) can
//! be drawn: the other special tokens are masked out before sampling. Sample `i` draws from its
//! own stream `SplitMix64::stream(seed, Domain::Sample, i)`, so a seed reproduces every sample.
//!
//! Samples run in batches of `batch_size` sharing one [`KvCache`]: each step feeds only the new
//! token (O(s) per codon). `use_cache: false` recomputes the whole prefix every step (O(s²) per
//! codon); it exists for the benchmark and as a cross-check.

use std::io::Write;
use std::path::Path;

use crate::atomic::AtomicFile;
use crate::backend::Compute;
use crate::config::Position;
use crate::error::{Error, Result};
use crate::infer::sample::{sample, SamplingParams};
use crate::model::cache::KvCache;
use crate::model::decode::next_logits;
use crate::model::io::load_model_dir;
use crate::model::GenSlm;
use crate::ops::primitive::{tensor_to_vec, tokens_tensor};
use crate::rng::{Domain, SplitMix64};
use crate::tokenizer::CodonTokenizer;

/// Settings of one `generate` run.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    /// DNA to start from (A/C/G/T, a multiple of 3 bases).
    pub prompt: String,
    /// Samples to draw.
    pub num: usize,
    /// Codons per sample, prompt included.
    pub max_codons: usize,
    pub sampling: SamplingParams,
    pub seed: u64,
    pub stop_at_stop_codon: bool,
    /// Samples decoded together.
    pub batch_size: usize,
    pub use_cache: bool,
    pub progress: bool,
    pub compute: Compute,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            prompt: "ATG".into(),
            num: 1,
            max_codons: 1024,
            sampling: SamplingParams::default(),
            seed: 0,
            stop_at_stop_codon: false,
            batch_size: 8,
            use_cache: true,
            progress: false,
            compute: Compute::default(),
        }
    }
}

/// Why a sample ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    MaxCodons,
    StopCodon,
    Eos,
}

impl StopReason {
    pub fn name(self) -> &'static str {
        match self {
            StopReason::MaxCodons => "max_codons",
            StopReason::StopCodon => "stop_codon",
            StopReason::Eos => "eos",
        }
    }
}

/// One generated sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    pub index: usize,
    /// Token ids: `[BOS]` if the vocabulary has it, the prompt, then the drawn codons.
    pub tokens: Vec<u32>,
    /// The DNA (prompt included).
    pub dna: String,
    pub stop: StopReason,
}

/// Validates a prompt and returns its token ids (with `[BOS]` in front where the vocabulary
/// has one).
pub fn prompt_tokens(prompt: &str, tok: &CodonTokenizer) -> Result<Vec<u32>> {
    let p = prompt.trim().to_ascii_uppercase();
    // Counted in characters, not bytes (a 'é' put the next position one too far).
    if let Some((i, c)) = p
        .chars()
        .enumerate()
        .find(|(_, c)| !matches!(c, 'A' | 'C' | 'G' | 'T'))
    {
        return Err(Error::Invalid(format!(
            "--prompt: character '{}' at position {}: the prompt must be DNA (A, C, G, T only)",
            c.escape_debug(),
            i + 1
        )));
    }
    if !p.len().is_multiple_of(3) {
        return Err(Error::Invalid(format!(
            "--prompt: {} bases is not a whole number of codons (a multiple of 3)",
            p.len()
        )));
    }
    let mut ids: Vec<u32> = tok.bos_id().into_iter().collect();
    if p.is_empty() && ids.is_empty() {
        return Err(Error::Invalid(format!(
            "--prompt is empty: the {} vocabulary has no [BOS] token to start from; give at \
             least one codon (GenSLM uses ATG)",
            tok.kind()
        )));
    }
    for c in p.as_bytes().chunks_exact(3) {
        ids.push(tok.codon_to_id(&[c[0], c[1], c[2]]));
    }
    Ok(ids)
}

/// Which ids may be drawn: the 64 codons and `[EOS]`; not the other special tokens, nor ids
/// past the tokenizer's vocabulary.
pub fn allowed_tokens(tok: &CodonTokenizer, vocab_size: usize) -> Vec<bool> {
    (0..vocab_size as u32)
        .map(|id| match tok.token(id) {
            Some(t) => !t.starts_with('[') || Some(id) == tok.eos_id(),
            None => false,
        })
        .collect()
}

/// Checks that a model can produce sequences of `max_codons` codons; returns a warning when it
/// can but was not trained that long (rotary).
pub fn check_length(
    model: &GenSlm,
    prompt: &[u32],
    tok: &CodonTokenizer,
    max_codons: usize,
) -> Result<Option<String>> {
    let bos = usize::from(tok.bos_id().is_some());
    let prompt_codons = prompt.len() - bos;
    if max_codons <= prompt_codons {
        return Err(Error::Invalid(format!(
            "--max-codons {max_codons}: must be larger than the prompt's {prompt_codons} codon(s)"
        )));
    }
    let tokens = bos + max_codons;
    let max_pos = model.cfg.max_position_embeddings;
    if tokens <= max_pos {
        return Ok(None);
    }
    match model.cfg.position {
        Position::Learned => Err(Error::Invalid(format!(
            "--max-codons {max_codons}: this model uses learned positions and knows only \
             {max_pos} of them; it cannot generate longer sequences (ALiBi models can)"
        ))),
        Position::Rotary => Ok(Some(format!(
            "--max-codons {max_codons} goes past the model's max_position_embeddings \
             ({max_pos}); rotary models are untested beyond their training length"
        ))),
        Position::Alibi => Ok(None),
    }
}

/// Draws `opts.num` samples, handing each to `on_sample` as soon as its batch is done.
/// The KV cache of one batch is allocated whole at its first step (`KvCache::with_capacity`):
/// on the CPU, a length that cannot fit in the memory available is refused before, with the
/// figure, instead of an allocation that aborts the process. (GPU memory is the device's, not
/// read here.)
fn check_cache_memory(
    model: &GenSlm,
    batch: usize,
    prompt: usize,
    tokens: usize,
    codons: usize,
) -> Result<()> {
    let Some(available) = crate::infer::window::cpu_memory_available(model) else {
        return Ok(());
    };
    // Keys and values of every layer, f32, for every sample of the batch and token; beside
    // them the forward over the prompt (later steps' single tokens take less). The cache alone
    // was checked: a batch of a million passed with 4.1 of 5.4 GiB and aborted at its prompt.
    let c = &model.cfg;
    let need = 2.0 * 4.0 * (c.num_layers * c.hidden_size) as f64 * batch as f64 * tokens as f64
        + crate::infer::window::forward_bytes(c, batch, prompt.max(1));
    if need <= available {
        return Ok(());
    }
    let gib = |b: f64| b / f64::from(1u32 << 30);
    Err(Error::Invalid(format!(
        "--max-codons {codons}: the KV cache of a batch of {batch} needs {:.1} GiB, more than \
         the {:.1} GiB available here; lower --max-codons or --batch-size",
        gib(need),
        gib(available)
    )))
}

pub fn generate(
    model: &GenSlm,
    opts: &GenerateOptions,
    on_sample: &mut dyn FnMut(&Generated) -> Result<()>,
) -> Result<()> {
    opts.sampling.validate()?;
    if opts.sampling.top_k > model.cfg.vocab_size {
        return Err(Error::Invalid(format!(
            "--top-k {}: the model has only {} tokens (0 turns top-k filtering off)",
            opts.sampling.top_k, model.cfg.vocab_size
        )));
    }
    if opts.num == 0 || opts.batch_size == 0 {
        return Err(Error::Invalid(
            "--num and --batch-size must be at least 1".into(),
        ));
    }
    let max = crate::config::MAX_TOKENS;
    if opts.num > max || opts.max_codons > max {
        return Err(Error::Invalid(format!(
            "--num {} / --max-codons {}: each must be at most {max}",
            opts.num, opts.max_codons
        )));
    }
    let tok = CodonTokenizer::new(model.cfg.vocab)?;
    let prompt = prompt_tokens(&opts.prompt, &tok)?;
    check_length(model, &prompt, &tok, opts.max_codons)?;
    let allowed = allowed_tokens(&tok, model.cfg.vocab_size);
    let bos = usize::from(tok.bos_id().is_some());
    let stops: Vec<u32> = [b"TAA", b"TAG", b"TGA"]
        .iter()
        .map(|c| tok.codon_to_id(c))
        .collect();
    let new_per_sample = opts.max_codons - (prompt.len() - bos);
    let batch = opts.batch_size.min(opts.num);
    check_cache_memory(
        model,
        batch,
        prompt.len(),
        prompt.len() + new_per_sample,
        opts.max_codons,
    )?;
    let bar = crate::progress::bar(
        opts.progress,
        Some((opts.num as u64).saturating_mul(new_per_sample as u64)),
        "generate {bar:40} {pos}/{len} codons {per_sec} eta {eta}",
    );
    let v = model.cfg.vocab_size;
    for first in (0..opts.num).step_by(opts.batch_size) {
        let nb = opts.batch_size.min(opts.num - first);
        let mut rngs: Vec<SplitMix64> = (first..first + nb)
            .map(|i| SplitMix64::stream(opts.seed, Domain::Sample, i as u64))
            .collect();
        let mut seqs: Vec<Vec<u32>> = vec![prompt.clone(); nb];
        let mut ended: Vec<Option<(usize, StopReason)>> = vec![None; nb];
        // Room for every token a sample can reach, so decoding never reallocates the cache.
        let mut cache = KvCache::with_capacity(prompt.len() + new_per_sample);
        let flat: Vec<u32> = seqs.concat();
        let mut input = tokens_tensor(&flat, nb, prompt.len(), &model.device);
        while ended.iter().any(Option::is_none) {
            let logits = if opts.use_cache {
                next_logits(model, input, &mut cache)?
            } else {
                let s = seqs[0].len();
                let all = tokens_tensor(&seqs.concat(), nb, s, &model.device);
                model
                    .forward(all, 0)?
                    .narrow(1, s - 1, 1)
                    .squeeze_dim::<2>(1)
            };
            let host = tensor_to_vec(&logits);
            let mut next = Vec::with_capacity(nb);
            for r in 0..nb {
                if ended[r].is_some() {
                    next.push(tok.pad_id());
                    seqs[r].push(tok.pad_id());
                    continue;
                }
                let mut row = host[r * v..(r + 1) * v].to_vec();
                // A NaN or +∞ logit is a broken model (overflowed or NaN weights): softmax
                // over it is NaN everywhere, and the draw fell on id 0 ([UNK], written as NNN).
                // Masking it instead would change the distribution without a word.
                if let Some(id) =
                    (0..v).find(|&i| allowed[i] && (row[i].is_nan() || row[i] == f32::INFINITY))
                {
                    return Err(Error::Invalid(format!(
                        "sample {}, codon {}: the model's logit for {} is {} (overflowed or NaN \
                         weights?); score the model to see where it breaks",
                        first + r,
                        seqs[r].len() - bos + 1,
                        tok.token(id as u32).unwrap_or("?"),
                        row[id]
                    )));
                }
                for (x, ok) in row.iter_mut().zip(&allowed) {
                    if !ok {
                        *x = f32::NEG_INFINITY;
                    }
                }
                if row.iter().all(|x| !x.is_finite()) {
                    return Err(Error::Invalid(format!(
                        "sample {}: the model gave no finite logit for any codon",
                        first + r
                    )));
                }
                let t = sample(&row, &opts.sampling, &mut rngs[r]) as u32;
                seqs[r].push(t);
                next.push(t);
                bar.inc(1);
                let codons = seqs[r].len() - bos;
                if Some(t) == tok.eos_id() {
                    ended[r] = Some((seqs[r].len() - 1, StopReason::Eos));
                } else if opts.stop_at_stop_codon && stops.contains(&t) {
                    ended[r] = Some((seqs[r].len(), StopReason::StopCodon));
                } else if codons >= opts.max_codons {
                    ended[r] = Some((seqs[r].len(), StopReason::MaxCodons));
                }
                if ended[r].is_some() {
                    bar.inc(opts.max_codons.saturating_sub(codons) as u64);
                }
            }
            input = tokens_tensor(&next, nb, 1, &model.device);
        }
        for (r, (seq, end)) in seqs.into_iter().zip(ended).enumerate() {
            // The loop above only ends when every sample has ended.
            let (len, stop) = end.unwrap_or((seq.len(), StopReason::MaxCodons));
            let tokens = seq[..len].to_vec();
            let dna = tok.decode(&tokens)?;
            on_sample(&Generated {
                index: first + r,
                tokens,
                dna,
                stop,
            })?;
        }
    }
    bar.finish_and_clear();
    Ok(())
}

/// The FASTA record of a sample: its settings in the header, 60 bases per line.
pub fn fasta_record(g: &Generated, opts: &GenerateOptions, model: &str) -> String {
    let s = &opts.sampling;
    let mut out = format!(
        ">genslm_sample_{} codons={} stop={} prompt={} top_k={} top_p={} temperature={} seed={} \
         max_codons={} model={}\n",
        g.index,
        g.dna.len() / 3,
        g.stop.name(),
        opts.prompt.trim().to_ascii_uppercase(),
        s.top_k,
        crate::error::short_num(s.top_p),
        crate::error::short_num(s.temperature),
        opts.seed,
        opts.max_codons,
        model
    );
    for line in g.dna.as_bytes().chunks(60) {
        out.push_str(std::str::from_utf8(line).unwrap_or_default());
        out.push('\n');
    }
    out
}

/// `genslm generate`: loads `model_dir`, samples, and writes FASTA to `out` (atomically) or
/// to stdout. Returns the number of samples written.
pub fn generate_fasta(
    model_dir: &Path,
    opts: &GenerateOptions,
    out: Option<&Path>,
) -> Result<usize> {
    let model =
        load_model_dir(model_dir, &opts.compute.open()?)?.with_precision(opts.compute.precision);
    let tok = CodonTokenizer::new(model.cfg.vocab)?;
    let prompt = prompt_tokens(&opts.prompt, &tok)?;
    // Printed under --quiet too: --quiet silences progress and summaries, not warnings.
    if let Some(w) = check_length(&model, &prompt, &tok, opts.max_codons)? {
        eprintln!("warning: {w}");
    }
    // The header is one line of printable text: a control character in the path (a terminal
    // escape) would reach every reader's terminal.
    let label = model_dir
        .display()
        .to_string()
        .replace(|c: char| c.is_whitespace() || c.is_control(), "_");
    // A sample that drew [EOS] before any codon (an empty prompt) has no sequence, and a FASTA
    // record without one is invalid (tokenize and score refuse it): it is left out, saying so.
    let written = |g: &Generated| {
        if g.dna.is_empty() {
            eprintln!(
                "warning: sample {} ended at [EOS] before its first codon; it is not written \
                 (a FASTA record needs a sequence)",
                g.index
            );
        }
        !g.dna.is_empty()
    };
    let mut n = 0;
    match out {
        Some(path) => {
            let (guard, file) = AtomicFile::create(path)?;
            let mut w = std::io::BufWriter::new(file);
            let werr = |e| Error::io(path, e);
            generate(&model, opts, &mut |g| {
                if !written(g) {
                    return Ok(());
                }
                n += 1;
                w.write_all(fasta_record(g, opts, &label).as_bytes())
                    .map_err(werr)
            })?;
            if n == 0 {
                return Err(nothing_written());
            }
            let file = w
                .into_inner()
                .map_err(|e| Error::io(path, e.into_error()))?;
            guard.commit(file)?;
        }
        None => {
            let stdout = std::io::stdout();
            let mut w = stdout.lock();
            generate(&model, opts, &mut |g| {
                if !written(g) {
                    return Ok(());
                }
                n += 1;
                w.write_all(fasta_record(g, opts, &label).as_bytes())
                    .and_then(|_| w.flush())
                    .map_err(|e| Error::stdout_only("sequences", e))
            })?;
            if n == 0 {
                return Err(nothing_written());
            }
        }
    }
    Ok(n)
}

/// Every sample ended at [EOS] before a codon: an empty FASTA is no answer (tokenize refuses
/// it as empty), so the run fails, saying what to change.
fn nothing_written() -> Error {
    Error::Invalid(
        "every sample drew [EOS] before its first codon, so there is nothing to write: give a \
         --prompt of at least one codon (GenSLM uses ATG)"
            .into(),
    )
}
