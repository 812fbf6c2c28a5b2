//! Training metrics: `RUN/metrics.jsonl` (one JSON object per step), FLOP counting and peak
//! memory.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::ModelConfig;
use crate::error::{Error, Result};
pub use crate::host_memory::{peak_rss_mib, rss_mib};

/// One line of metrics.jsonl.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    pub step: u64,
    /// NaN/Inf (a skipped step) is written as null and read back as NaN.
    #[serde(with = "nan_as_null")]
    pub loss: f64,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub val_loss: Option<f64>,
    pub lr: f64,
    #[serde(with = "nan_as_null")]
    pub grad_norm: f64,
    /// Target tokens (next-token predictions) in the step.
    pub tokens: u64,
    pub tokens_per_s: f64,
    pub tflops: f64,
    pub peak_rss_mib: f64,
    pub elapsed_s: f64,
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub skipped_nonfinite: bool,
    /// Elements this rank sent in Ulysses all-to-alls per layer and micro-batch, forward only
    /// (q, k, v and the output: 4·b·s·h/P with b the rank's rows).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub sp_sent_per_layer: Option<u64>,
    /// Seconds rank 0 spent inside communicator calls during the step's forward, backward and
    /// update (moving data, and waiting for the other ranks); absent on one rank.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub comm_wait_s: Option<f64>,
    /// Bytes that left rank 0 in communication during the step's forward, backward and
    /// update, over every group, counted as the ring algorithms move them (an all-reduce of
    /// B bytes over n ranks sends 2(n−1)/n·B); what `--quantize-weights`/`--quantize-grads`
    /// shrink. Absent on one rank.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub comm_bytes: Option<u64>,
    /// Under PP: each stage's seconds computing and waiting in the step's pipeline (rank 0's
    /// pipeline group, in stage order), and the bubble, idle over busy summed over the stages
    /// (compare with the schedule's (P − 1)/m, or (P − 1)/(m·V) interleaved).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub pp_busy_s: Option<Vec<f64>>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub pp_idle_s: Option<Vec<f64>>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub pp_bubble: Option<f64>,
    /// Under PP: each stage's process peak resident memory so far, MiB (taken as the step's
    /// pipeline ends, so it covers the earlier steps' updates; one process per stage under
    /// mpirun).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub pp_peak_rss_mib: Option<Vec<f64>>,
    /// On a GPU backend, rank 0's device memory in use (MiB): the largest of the samples taken
    /// where the step peaks (before each layer's backward and the head's, and after the
    /// update; inside burn's backward the working gradients add to it), and what is in use as
    /// the step ends (weights, optimizer state unless offloaded, anything else kept between
    /// steps). Thread ranks sharing one device share its memory. Absent on the CPU.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub device_peak_mib: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub device_in_use_mib: Option<f64>,
    /// What rank 0 holds at the step's update (other ranks hold the same up to one padding
    /// block per ZeRO unit).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub memory: Option<RankMemory>,
}

/// One rank's memory by kind, in bytes: fp32 parameters (ZeRO-3: its shard; otherwise the full
/// working copy, which is also the fp32 master), gradients when the update runs (ZeRO-2/3: its
/// reduce-scattered chunk), Adam moments, and activations: the rest of the peak resident memory
/// (the process's peak divided by the ranks it runs, less the three others).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RankMemory {
    pub params_bytes: u64,
    pub grads_bytes: u64,
    pub optimizer_bytes: u64,
    pub activations_bytes: u64,
}

impl RankMemory {
    /// From the bytes of the rank's state (`Engine::held_bytes`) and the process's peak
    /// (`peak_mib`, as [`peak_rss_mib`] reads it).
    pub fn new(
        (params, grads, opt): (usize, usize, usize),
        peak_mib: f64,
        ranks_in_process: usize,
    ) -> Self {
        let (p, g, o) = (params as u64, grads as u64, opt as u64);
        let peak = (peak_mib * 1048576.0) as u64 / ranks_in_process.max(1) as u64;
        Self {
            params_bytes: p,
            grads_bytes: g,
            optimizer_bytes: o,
            activations_bytes: peak.saturating_sub(p + g + o),
        }
    }
}

/// JSON has no NaN: non-finite values are written as null and read back as NaN.
mod nan_as_null {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        if v.is_finite() {
            s.serialize_f64(*v)
        } else {
            s.serialize_none()
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
    }
}

/// Training FLOPs of one sequence of `s` tokens, forward + backward (backward = 2 × forward):
///
///   per layer, per token, forward: 2·(3h·h + h·h + 2·h·i)   (QKV, output projection, MLP)
///                                + 2·2·s·h                  (q·kᵀ and p·v over s keys)
///   output layer, per token:       2·h·V
///   total = 3 · s · [L·(2·(4h² + 2hi) + 4sh) + 2hV]
///
/// Attention is counted over all s keys (the naive kernel computes them all, as in Megatron's
/// formula), not halved for causality.
pub fn train_flops_per_sequence(m: &ModelConfig, s: usize) -> f64 {
    let (h, i, v, l, s) = (
        m.hidden_size as f64,
        m.intermediate_size as f64,
        m.vocab_size as f64,
        m.num_layers as f64,
        s as f64,
    );
    let per_token_fwd = l * (2.0 * (4.0 * h * h + 2.0 * h * i) + 4.0 * s * h) + 2.0 * h * v;
    3.0 * s * per_token_fwd
}

/// Appends metrics lines to `RUN/metrics.jsonl`.
pub struct MetricsLog {
    path: PathBuf,
    file: std::fs::File,
}

impl MetricsLog {
    /// Opens the log; when resuming at `keep_through`, drops lines of later steps first (they
    /// belong to the interrupted run and will be produced again).
    pub fn open(path: &Path, keep_through: Option<u64>) -> Result<Self> {
        crate::error::file_or_missing(path, "the run's metrics log")?;
        if let Some(last) = keep_through {
            // A missing log is an empty one: the note says its rows are gone.
            let text = if path.exists() {
                std::fs::read(path).map_err(|e| Error::io(path, e))?
            } else {
                Vec::new()
            };
            let (kept, dropped) = rows_through(&text, last);
            if let Some(note) = dropped {
                eprintln!("warning: {}: {note}", path.display());
            }
            crate::atomic::write_bytes(path, &kept)?;
        } else if path.exists() {
            std::fs::remove_file(path).map_err(|e| Error::io(path, e))?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| Error::io(path, e))?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
        })
    }

    pub fn write(&mut self, m: &StepMetrics) -> Result<()> {
        let line = serde_json::to_string(m).map_err(|e| Error::Invalid(e.to_string()))?;
        writeln!(self.file, "{line}").map_err(|e| Error::io(&self.path, e))
    }
}

/// The rows of a metrics log up to step `last` (the rest are the interrupted run's, made
/// again), and a note naming the lines dropped because they are no metrics row. A last line
/// without its newline is a write the kill cut short and goes without a note; any other line
/// that does not parse was damaged or written by someone else, and the user hears which.
fn rows_through(text: &[u8], last: u64) -> (Vec<u8>, Option<String>) {
    let mut kept = Vec::with_capacity(text.len());
    let mut bad = Vec::new();
    let mut steps = std::collections::BTreeSet::new();
    let lines: Vec<&[u8]> = text.split_inclusive(|&b| b == b'\n').collect();
    for (i, line) in lines.iter().enumerate() {
        let complete = line.ends_with(b"\n");
        let body = line.strip_suffix(b"\n").unwrap_or(line);
        let body = body.strip_suffix(b"\r").unwrap_or(body);
        if body.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match serde_json::from_slice::<StepMetrics>(body) {
            Ok(m) if m.step <= last => {
                steps.insert(m.step);
                kept.extend_from_slice(body);
                kept.push(b'\n');
            }
            Ok(_) => {}
            Err(_) if !complete && i + 1 == lines.len() => {}
            Err(_) => bad.push(i + 1),
        }
    }
    let mut notes = Vec::new();
    if !bad.is_empty() {
        notes.push(format!(
            "{} line(s) are not metrics rows and were dropped on resume (line {})",
            bad.len(),
            crate::error::first_five(&bad)
        ));
    }
    // Every step writes its row before its checkpoint: fewer rows than the checkpoint's steps
    // is a file cut short or edited, whose curve would start late without a word.
    let have = steps.range(1..=last).count() as u64;
    if have < last {
        notes.push(format!(
            "it holds rows for {have} of the {last} steps the checkpoint has done (cut short or \
             edited?); the curves miss the others"
        ));
    }
    let note = (!notes.is_empty()).then(|| notes.join("; "));
    (kept, note)
}

/// Reads a metrics file back (tests, tools).
pub fn read_metrics(path: &Path) -> Result<Vec<StepMetrics>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    text.lines()
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l)
                .map_err(|e| Error::Invalid(format!("{}:{}: {e}", path.display(), i + 1)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flops_match_six_n_plus_attention() {
        // 25M shape at s = 2048: non-embedding matmul params N = L·(4h² + 2hi) + hV,
        // FLOPs = 6·N·s + 12·L·h·s² (forward + backward over all keys).
        let m = crate::config::Config::load(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/genslm-25m.toml"),
        )
        .unwrap()
        .model;
        let (l, h, i, v, s) = (8.0, 512.0, 2048.0, 69.0, 2048.0);
        let n = l * (4.0 * h * h + 2.0 * h * i) + h * v;
        let expect = 6.0 * n * s + 12.0 * l * h * s * s;
        let got = train_flops_per_sequence(&m, 2048);
        assert!((got - expect).abs() / expect < 1e-12, "{got} vs {expect}");
    }

    /// A JSON row as the trainer writes it, at `step`.
    fn row(step: u64) -> String {
        let m = StepMetrics {
            step,
            loss: 1.5,
            ..serde_json::from_str(
                r#"{"step":0,"loss":0,"lr":0,"grad_norm":0,"tokens":0,"tokens_per_s":0,
                "tflops":0,"peak_rss_mib":0,"elapsed_s":0}"#,
            )
            .unwrap()
        };
        serde_json::to_string(&m).unwrap()
    }

    #[test]
    fn resume_keeps_rows_through_its_step_and_names_the_lines_it_drops() {
        let (r1, r2, r3) = (row(1), row(2), row(3));
        // Complete: nothing dropped but the later step, and no note.
        let text = format!("{r1}\n{r2}\n{r3}\n");
        let (kept, note) = rows_through(text.as_bytes(), 2);
        assert_eq!(String::from_utf8(kept).unwrap(), format!("{r1}\n{r2}\n"));
        assert_eq!(note, None);
        // A half-written last line (killed mid-write) goes quietly, but a step without its row
        // is said (the file cut short, or emptied: its curve started at the checkpoint).
        let text = format!("{r1}\n{r2}\n{{\"step\":3,\"lo");
        let (kept, note) = rows_through(text.as_bytes(), 2);
        assert_eq!(String::from_utf8(kept).unwrap(), format!("{r1}\n{r2}\n"));
        assert_eq!(note, None);
        let (_, note) = rows_through(text.as_bytes(), 3);
        let note = note.expect("a note");
        assert!(note.contains("rows for 2 of the 3 steps"), "{note}");
        let (_, note) = rows_through(b"", 3);
        assert!(note.unwrap().contains("rows for 0 of the 3 steps"));
        // Damage in the middle (and bytes that are not UTF-8) is named by line.
        let text = [
            format!("{r1}\n").into_bytes(),
            b"garbage\n\xff\xfe\n".to_vec(),
            format!("{r2}\r\n").into_bytes(),
        ]
        .concat();
        let (kept, note) = rows_through(&text, 2);
        assert_eq!(String::from_utf8(kept).unwrap(), format!("{r1}\n{r2}\n"));
        let note = note.expect("a note");
        assert!(
            note.contains("2 line(s)") && note.contains("line 2, 3"),
            "{note}"
        );
    }

    #[test]
    fn peak_memory_is_read() {
        assert!(peak_rss_mib() > 1.0);
        assert!(peak_rss_mib() >= rss_mib() * 0.99);
    }
}
