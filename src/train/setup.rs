//! Setting a run up before its first step: where the data comes from, the checks that refuse a
//! run before any work (layout, memory), the run directory and the corpus (tokenized once,
//! reused on resume when the inputs are unchanged).

use std::path::{Path, PathBuf};

use crate::backend::DeviceChoice;
use crate::config::Config;
use crate::data::dataset::read_dataset;
use crate::data::fasta::discover;
use crate::data::ingest::{tokenize_to_parquet, IngestOptions};
use crate::data::loader::Corpus;
use crate::error::{Error, Result};
use crate::host_memory::available_bytes;
use crate::parallel::parallelize::check_positions;
use crate::parallel::Topology;
use crate::run_lock::{RunLock, RUN_FILES};
use crate::tokenizer::CodonTokenizer;
use crate::train::checkpoint::{read_saved, Saved};
use crate::train::memory::{
    check_fits, check_fits_device, check_fits_host, check_largest_buffer, check_step_batches,
};
use crate::train::old_run::Pending;
use crate::train::resume::{check_data, check_resume, fasta_stamp, fingerprint};
use crate::train::run_dir::claim;

/// Where training data comes from.
#[derive(Debug, Clone)]
pub enum DataSource {
    /// FASTA files/directories, tokenized into `RUN/data.parquet` first.
    Fasta(Vec<PathBuf>),
    /// A dataset written by `genslm tokenize`.
    Parquet(PathBuf),
}

/// Run-level options that are not model or optimisation settings.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Continue from `RUN/checkpoints/latest`.
    pub resume: bool,
    /// Stop (with a checkpoint) after this many steps in this invocation.
    pub stop_after: Option<u64>,
    /// Show a progress bar.
    pub progress: bool,
    /// Replace the run already in the directory (a fresh run there is refused otherwise).
    pub overwrite: bool,
    /// Start even when the predicted peak memory exceeds the available memory.
    pub skip_memory_check: bool,
    /// The backend and device the ranks of this process compute on.
    pub device: DeviceChoice,
    /// This rank's index among the ranks run as threads of this process (GPU offset).
    pub thread_rank: usize,
    /// Ranks this process runs (threads); 0 or 1 means one (memory accounting).
    pub ranks_in_process: usize,
    /// Ranks as threads talk through a simulated network (`bench train --simulate-network`;
    /// benchmarks and tests only).
    pub network: Option<crate::parallel::netsim::NetSim>,
    /// The `--config` file the settings came from: an input, like the data, which
    /// `--overwrite` refuses to delete where it lies in `--out` (it replaced a user's
    /// `--out/config.toml` with the resolved settings).
    pub config_file: Option<PathBuf>,
    /// The old run `--overwrite` replaces, until rank 0's first checkpoint (set by the
    /// launcher in `trainer`; none otherwise).
    pub old_run: crate::train::old_run::OldRun,
    /// No checkpoint is written, the last step's included (`bench train`, which reads only
    /// the metrics: a 250M model's end checkpoint put 3 GB in TMPDIR).
    pub no_checkpoints: bool,
}

/// Refuses, before any work, a run whose predicted peak memory exceeds what this machine has
/// available (CPU) or what its GPU holds (CUDA, wgpu), unless `--skip-memory-check`; see
/// [`crate::train::memory`].
pub fn check_memory(
    cfg: &Config,
    (dp, sp, pp): (usize, usize, usize),
    in_process: usize,
    opts: &RunOptions,
) -> Result<()> {
    cfg.model.validate().map_err(Error::Invalid)?;
    cfg.train.validate().map_err(Error::Invalid)?;
    if opts.skip_memory_check {
        return Ok(());
    }
    // The step's micro-batches are host memory on every backend.
    let host = available_bytes();
    let batches = match host {
        Some(avail) => check_step_batches(cfg, in_process, avail)?,
        None => 0.0,
    };
    // The CPU backend: the planner's host peak against this machine's available memory. A GPU
    // backend: its device peak against what the device's runtime says it holds.
    use crate::backend::BackendKind;
    let backend = opts.device.backend;
    if backend == BackendKind::Cpu {
        return match host {
            Some(avail) => check_fits(cfg, (dp, sp, pp), in_process, avail - batches),
            None => Ok(()),
        };
    }
    let device = opts.device.open(opts.thread_rank)?;
    let Some(mem) = crate::backend::device_memory(&device) else {
        return Ok(());
    };
    // wgpu without --device puts every thread rank on the one default adapter; CUDA (and wgpu
    // with --device) gives each thread rank its own.
    let sharing = if backend == BackendKind::Wgpu && opts.device.index.is_none() {
        in_process.max(1)
    } else {
        1
    };
    let precision = crate::backend::resolve_precision(cfg.train.precision, backend);
    check_largest_buffer(cfg, (dp, sp), precision, &mem)?;
    // A device with no stated capacity whose buffers are host memory (lavapipe) has what the
    // host has available; a card with none stated is not checked.
    let capacity = match mem.capacity {
        Some(c) => c as f64,
        None if mem.host_backed => match available_bytes() {
            Some(a) => a,
            None => return Ok(()),
        },
        None => return Ok(()),
    };
    let device = (mem.name.as_str(), mem.capacity.is_none());
    check_fits_device(cfg, (dp, sp, pp), sharing, capacity, precision, device)?;
    // What a card's ranks offload lands in host memory (a host-backed device counted it above).
    match (mem.host_backed, available_bytes()) {
        (false, Some(avail)) => {
            check_fits_host(cfg, (dp, sp, pp), in_process, capacity, precision, avail)
        }
        _ => Ok(()),
    }
}

/// Inputs of `RUN/data.parquet` (see [`crate::train::resume`]).
const SOURCES_FILE: &str = "data.sources.json";

/// Checks the parallel layout against the model and the run before any work starts.
pub fn validate_layout(cfg: &Config, topo: &Topology) -> Result<()> {
    let t = &cfg.train;
    topo.validate(t.batch_size)?;
    crate::parallel::tensor_slices::check_degree(&cfg.model, topo.tp)?;
    if topo.pp > 1 && t.zero >= 2 {
        return Err(Error::Invalid(format!(
            "--pp {} with --zero {}: ZeRO-2/3 gather and reduce-scatter every layer over the \
             data group and do not run inside pipeline stages yet; use --zero 0 or 1 with --pp",
            topo.pp, t.zero
        )));
    }
    if let (Some(q), true) = (t.quantize_weights, t.zero != 3) {
        return Err(Error::Invalid(format!(
            "--quantize-weights {q} quantizes ZeRO-3's weight all-gathers, and --zero {} \
             gathers no weights (every rank keeps them whole): use --zero 3, or drop the flag",
            t.zero
        )));
    }
    crate::train::pipeline::Pipe::plan(cfg, topo.pp)?;
    check_positions(&cfg.model, t.seq_len)?;
    topo.check_pieces(t.seq_len, cfg.model.num_heads)?;
    // Under SP alone a learned table is cut by rows; every SP rank needs at least one.
    let m = &cfg.model;
    if m.position == crate::config::Position::Learned && topo.sp > 1 && topo.cp == 1 {
        let padded = topo.padded_len(t.seq_len);
        let rows = m.max_position_embeddings;
        let empty = (0..topo.sp).find(|&r| {
            crate::parallel::parallelize::position_rows(padded, rows, topo.sp, r).1 == 0
        });
        if let Some(r) = empty {
            return Err(Error::Invalid(format!(
                "--sp {} with --seq-len {} (padded to {padded}) leaves SP rank {r} none of the \
                 {rows} rows of the learned position table: use fewer --sp ranks, or a table \
                 longer than the sequence (max_position_embeddings)",
                topo.sp, t.seq_len
            )));
        }
    }
    Ok(())
}

/// Notes settings that run but are probably not what was meant. A warm-up as long as the run;
/// a rotary model trained past its `max_position_embeddings` (learned positions are
/// refused there; rotary ones have no table to run out of): genslm's own score and embed then
/// take the trained window, but Hugging Face readers of the exported config.json take the
/// smaller number as the model's length.
fn setting_notes(cfg: &Config) {
    let t = &cfg.train;
    // A warm-up as long as the run: the schedule never reaches its peak nor decays.
    if t.warmup >= t.steps {
        // What the schedule gives the last step (it said "--lr at most", which only a warm-up
        // of exactly the run's length reaches).
        let last = crate::train::schedule::lr_at(
            t.steps.saturating_sub(1) as usize,
            t.steps as usize,
            t.warmup as usize,
            t.lr,
            t.min_lr_ratio,
        );
        eprintln!(
            "note: --warmup {} is not shorter than --steps {}: the learning rate rises for the \
             whole run, reaching {} ({:.0}% of --lr {}) at its last step, and never decays",
            t.warmup,
            t.steps,
            // As f32 (the optimizer's own precision): 0.0006, not 0.0006000000000000001.
            last as f32,
            100.0 * last / t.lr,
            crate::error::short_num(t.lr)
        );
    }
    let (m, len) = (&cfg.model, t.seq_len);
    if m.position == crate::config::Position::Rotary && len > m.max_position_embeddings {
        eprintln!(
            "note: --seq-len {len} is longer than max_position_embeddings ({}): the rotary \
             positions past it are trained, but the exported config.json states {}; raise \
             max_position_embeddings in the config to say what the model knows",
            m.max_position_embeddings, m.max_position_embeddings
        );
    }
}

impl DataSource {
    /// The files and directories the run reads its data from.
    pub fn inputs(&self) -> Vec<PathBuf> {
        match self {
            DataSource::Fasta(paths) => paths.clone(),
            DataSource::Parquet(p) => vec![p.clone()],
        }
    }
}

/// Checks the config (and, resuming, that the checkpoint can continue under it), loads the
/// corpus, and writes the resolved config into the run directory. The run directory is
/// locked first (`run_lock`): the returned lock must be held until the run ends. A refused
/// resume writes nothing. The old run `--overwrite` replaces is returned still held aside:
/// removed by [`Pending::started`] once the new run has its first checkpoint, put back when
/// the `Pending` is dropped instead (drop it before the lock).
pub fn prepare_run(
    cfg: &Config,
    data: &DataSource,
    run: &Path,
    opts: &RunOptions,
) -> Result<(Corpus, RunLock, Pending)> {
    cfg.model.validate().map_err(Error::Invalid)?;
    cfg.train.validate().map_err(Error::Invalid)?;
    crate::train::fault::check_hooks()?;
    if run.exists() && !run.is_dir() {
        return Err(Error::Invalid(format!(
            "--out {} is a file, not a directory: a run writes a directory (checkpoints, \
             metrics.jsonl, config.toml); choose another --out",
            run.display()
        )));
    }
    // A link whose target is gone: create_dir would fail on the link, and the lock's open
    // said only "No such file or directory" for a file inside it.
    if run.is_symlink() && !run.exists() {
        return Err(Error::Invalid(format!(
            "--out {}: {}; point it at a directory, or choose another --out",
            run.display(),
            crate::error::not_a_file(run)
        )));
    }
    // The file system's root is nobody's run directory (a run's files and checkpoints would
    // land among the system's).
    if run.canonicalize().is_ok_and(|c| c.parent().is_none()) {
        return Err(Error::Invalid(format!(
            "--out {}: the file system's root; a run writes a directory of its own \
             (checkpoints, metrics.jsonl, config.toml): choose one, e.g. runs/demo",
            run.display()
        )));
    }
    // A run inside another run's checkpoints/ is pruned with them, or replaced when that run
    // saves a step of the same name.
    crate::run_lock::check_not_a_runs_file(run)?;
    if opts.resume && !run.is_dir() {
        return Err(Error::Invalid(format!(
            "cannot resume: {} does not exist (start a run there without --resume)",
            run.display()
        )));
    }
    // Whether this process made the directory decides whether a failed start removes it:
    // `create_dir` answers that atomically (two processes can both see it missing).
    if let Some(parent) = run.parent().filter(|p| !p.as_os_str().is_empty()) {
        // A file where a directory of the path must be said so ("File exists" was all).
        if let Some(file) = parent
            .ancestors()
            .find(|a| a.exists())
            .filter(|a| !a.is_dir())
        {
            return Err(Error::Invalid(format!(
                "--out {}: {} is a file, not a directory; choose another --out",
                run.display(),
                file.display()
            )));
        }
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    }
    let created = match std::fs::create_dir(run) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => false,
        Err(e) => return Err(Error::io(run, e)),
    };
    let had_lock = std::fs::symlink_metadata(run.join(crate::run_lock::LOCK_FILE)).is_ok();
    // Refused here, nothing is removed: the directory is another process's from now on.
    let lock = RunLock::acquire(run, "train")?;
    // A lock file added to a directory this start did not make goes with a signal too, until
    // the run stands on its own (a user's directory came back with a `.genslm.lock` in it).
    let new_lock = (!created && !had_lock).then(|| {
        (
            lock.path.clone(),
            crate::interrupt::register(lock.path.clone(), false),
        )
    });
    // Set once the directory is this run's: a fresh run's failed start then removes what it
    // wrote and puts back the run `--overwrite` moved aside.
    let mut claimed = None;
    // A signal before the run starts takes a directory this process made, as an error does
    // below (a SIGTERM while tokenizing left it with a half-written `.data.parquet.new`).
    let _new = created.then(|| crate::interrupt::register(run.to_path_buf(), true));
    let result = (|| {
        crate::train::run_dir::check_replaced_leftovers(run)?;
        let saved = if opts.resume {
            let saved = read_saved(run)?;
            let notes = check_resume(&saved, cfg)?;
            crate::train::run_dir::check_later_checkpoints(run, saved.state.step, cfg.train.steps)?;
            for note in notes {
                eprintln!("note: {note}");
            }
            Some(saved)
        } else {
            None
        };
        let mut inputs: Vec<PathBuf> = data
            .inputs()
            .into_iter()
            .chain(opts.config_file.clone())
            .collect();
        // The inputs are found before `--overwrite` removes the old run: a mistyped --fasta
        // deleted it, then failed on the missing file. Each file found is one (`--fasta RUN`
        // read a genome kept in RUN/checkpoints/ from the old run aside, then deleted it).
        match data {
            DataSource::Fasta(paths) => {
                inputs.extend(discover(paths)?);
            }
            DataSource::Parquet(p) => {
                crate::error::file_or_missing(p, "a tokenized dataset")?;
                std::fs::metadata(p).map_err(|e| Error::io(p, e))?;
            }
        }
        claimed = Some(claim(run, opts.resume, opts.overwrite, &inputs)?);
        let corpus = load_corpus(cfg, data, run, saved.as_ref())?;
        setting_notes(cfg);
        let toml = toml::to_string(cfg).map_err(|e| Error::Invalid(e.to_string()))?;
        crate::atomic::write_bytes(&run.join("config.toml"), toml.as_bytes())?;
        Ok(corpus)
    })();
    match result {
        Ok(corpus) => {
            let pending = claimed.map_or_else(Pending::default, |r| Pending::new(r, run, new_lock));
            Ok((corpus, lock, pending))
        }
        Err(e) if crate::interrupt::fired() => {
            // The signal's thread undoes what this start did (it may be renaming the old run
            // back now): removing the run's files here could remove the old ones. (`claimed`
            // keeps its registrations for that thread: `Replaced`'s drop.)
            drop(claimed);
            std::mem::forget(new_lock);
            drop(lock);
            Err(e)
        }
        Err(e) => {
            // Nothing of a run that never started stays behind; removed while the lock is
            // still held, so no other process is inside.
            if created {
                let _ = std::fs::remove_dir_all(run);
            } else if let Some(mut replaced) = claimed.filter(|_| !opts.resume) {
                // A fresh run's claim left none of a run's names in the directory: what
                // stands there now is this run's. As one section, which a signal's cleanup
                // waits for (it would rename the old run back under these removals).
                crate::interrupt::critical(|| {
                    for name in RUN_FILES {
                        let _ = std::fs::remove_file(run.join(name));
                    }
                    replaced.restore();
                });
            }
            // A lock file this process added to a directory it did not make (a user's empty
            // one, a refused resume): gone too, or the directory reads as a run's.
            if !created && !had_lock {
                let _ = std::fs::remove_file(&lock.path);
            }
            drop(lock);
            Err(e)
        }
    }
}

/// The training corpus. From FASTA, tokenized into `RUN/data.parquet`, which a resume reuses
/// when the inputs are unchanged (`RUN/data.sources.json`); otherwise tokenized afresh into a
/// temporary file that replaces it only when `saved` (resuming) accepts the data. A reused copy
/// that does not serve (damaged, replaced, other data than the checkpoint's) is a cache, not
/// the input: the FASTA is tokenized again, with a warning (the resume was refused, telling
/// the user to resume with the same FASTA, which they had done).
pub fn load_corpus(
    cfg: &Config,
    data: &DataSource,
    run: &Path,
    saved: Option<&Saved>,
) -> Result<Corpus> {
    let mut reused = false;
    match load_corpus_from(cfg, data, run, saved, true, &mut reused) {
        Err(e) if reused => {
            eprintln!(
                "warning: {}, the run's tokenized copy of its unchanged FASTA input, does not \
                 serve this resume ({e}); tokenizing the FASTA again",
                run.join("data.parquet").display()
            );
            load_corpus_from(cfg, data, run, saved, false, &mut reused)
        }
        r => r,
    }
}

/// [`load_corpus`], reusing `RUN/data.parquet` only where `reuse` allows; `reused` says
/// whether it did.
fn load_corpus_from(
    cfg: &Config,
    data: &DataSource,
    run: &Path,
    saved: Option<&Saved>,
    reuse: bool,
    reused: &mut bool,
) -> Result<Corpus> {
    // Removed if a signal ends the process before the fresh dataset is renamed into place
    // (tens of MB were left in a directory that already existed, also while it was read back).
    let mut _partial = None;
    let (path, fresh) = match data {
        DataSource::Parquet(p) => (p.clone(), None),
        DataSource::Fasta(paths) => {
            let out = run.join("data.parquet");
            let stamp_path = run.join(SOURCES_FILE);
            let stamp = fasta_stamp(&discover(paths)?, cfg.model.vocab.name())?;
            crate::error::file_or_missing(&stamp_path, "the list of the run's FASTA inputs")?;
            let unchanged = std::fs::read_to_string(&stamp_path).is_ok_and(|s| s == stamp);
            if reuse && saved.is_some() && unchanged && out.exists() {
                *reused = true;
                (out, None)
            } else {
                let tmp = run.join(".data.parquet.new");
                let opts = IngestOptions {
                    vocab: cfg.model.vocab,
                    ..Default::default()
                };
                _partial = Some(crate::interrupt::register(tmp.clone(), false));
                tokenize_to_parquet(paths, &tmp, &opts)?;
                (tmp, Some((out, stamp_path, stamp)))
            }
        }
    };
    let (vocab, records) = read_dataset(&path)?;
    if vocab != cfg.model.vocab {
        return Err(Error::Invalid(format!(
            "{}: tokenized with {vocab}, but the model uses {}; re-run `genslm tokenize --vocab {}`",
            path.display(),
            cfg.model.vocab,
            cfg.model.vocab
        )));
    }
    let tok = CodonTokenizer::new(vocab)?;
    // One pass over the tokens, each looked up in a table of the model's ids: one past the
    // vocabulary is refused by row and position (as the dataset's other refusals name them);
    // special ids inside a foreign dataset's records are targets like any codon (the loss mask
    // comes from the lengths), said with the first one's place.
    let special: Vec<bool> = (0..cfg.model.vocab_size as u32)
        .map(|id| !tok.writes(id))
        .collect();
    let (mut first_special, mut specials) = (None, 0usize);
    for (row, r) in records.iter().enumerate() {
        for (at, &id) in r.tokens.iter().enumerate() {
            match special.get(id as usize) {
                None => {
                    return Err(Error::Invalid(format!(
                        "{}: row {row}, token {at}: id {id} does not fit the model's \
                         vocab_size {}",
                        path.display(),
                        cfg.model.vocab_size
                    )))
                }
                Some(true) => {
                    specials += 1;
                    first_special.get_or_insert((row, at, id));
                }
                Some(false) => {}
            }
        }
    }
    if let Some((row, at, id)) = first_special {
        eprintln!(
            "warning: {}: {specials} token(s) inside records are special ids genslm's tokenize \
             never writes there (first: row {row}, token {at}: {id} {}); they are trained on as \
             targets like codons",
            path.display(),
            tok.token(id).unwrap_or("?")
        );
    }
    let tokens: Vec<Vec<u32>> = records.into_iter().map(|r| r.tokens).collect();
    let fp = fingerprint(&tokens);
    // What the messages name: the user's input, not the temporary file a FASTA was tokenized
    // into.
    let input = match (data, &fresh) {
        (DataSource::Fasta(paths), Some(_)) => paths
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
        _ => path.display().to_string(),
    };
    let source = if fresh.is_some() {
        format!(
            "the FASTA input ({input}), tokenized afresh because {}",
            if reuse {
                "its files changed since this run read them (files added, removed or modified)"
            } else {
                "the run's copy of it did not serve"
            }
        )
    } else {
        input.clone()
    };
    let checked = saved.map_or(Ok(None), |s| check_data(s, &fp, &source));
    if let Some((out, stamp_path, stamp)) = fresh {
        if checked.is_err() {
            let _ = std::fs::remove_file(&path);
        } else {
            std::fs::rename(&path, &out).map_err(|e| Error::io(&out, e))?;
            crate::atomic::write_bytes(&stamp_path, stamp.as_bytes())?;
        }
    }
    if let Some(w) = checked? {
        eprintln!("warning: {w}");
    }
    let t = &cfg.train;
    let mut corpus = Corpus::new(tokens, t.seq_len, tok.pad_id(), t.val_fraction, t.seed)
        .map_err(|e| Error::Invalid(format!("{input}: {e}")))?;
    if let Some(note) = corpus.split_note(t.val_fraction) {
        eprintln!("note: {note}");
    }
    corpus.fingerprint = fp;
    Ok(corpus)
}

#[cfg(test)]
#[path = "setup_tests.rs"]
mod tests;
