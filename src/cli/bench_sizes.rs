//! `genslm bench`'s sizes, checked before any work: a size past what can be computed is
//! refused before arithmetic on it can overflow, and a size with nothing to measure (0
//! sequences, a batch of 0) before a throughput would be invented.

use super::bench::BenchCmd;

/// Refuses a count past `max` (checked before any arithmetic on it can overflow).
fn at_most(flag: &str, v: usize, max: usize) -> anyhow::Result<()> {
    if v > max {
        anyhow::bail!("{flag} {v}: must be at most {max}");
    }
    Ok(())
}

/// Refuses `which`'s sizes that are out of range, naming the flag.
pub fn check_sizes(which: &BenchCmd) -> anyhow::Result<()> {
    let max = genslm::config::MAX_TOKENS;
    match which {
        BenchCmd::Step { seq_len, .. } => at_most("--seq-len", *seq_len, max)?,
        BenchCmd::Train {
            seq_len,
            steps,
            degrees,
            zero,
            ..
        } => {
            // On one rank too: a stage that does not exist was accepted there.
            if *zero > 3 {
                anyhow::bail!("--zero {zero}: ZeRO stages are 0, 1, 2 and 3");
            }
            at_most("--seq-len", *seq_len, max)?;
            at_most("--steps", *steps, 1 << 20)?;
            let d = degrees.degrees();
            for (flag, v) in [
                ("--dp", d.dp),
                ("--sp", d.sp),
                ("--cp", d.cp),
                ("--tp", d.tp),
                // Pipelines run 4·P micro-batches: an unbounded --pp wrapped that product.
                ("--pp", d.pp),
            ] {
                at_most(flag, v, 1 << 10)?;
            }
            // Zero degrees: the topology's own refusal.
            genslm::parallel::Topology::of(0, d)?;
        }
        BenchCmd::Attention {
            seq_lens,
            seq,
            head_dim,
            heads,
            batch,
            iters,
            ..
        } => {
            for &s in seq_lens {
                at_most("--seq-lens", s, max)?;
            }
            at_most("--seq", seq.unwrap_or(0), max)?;
            at_most("--head-dim", *head_dim, 1 << 16)?;
            at_most("--heads", *heads, 1 << 16)?;
            at_most("--batch", *batch, 1 << 16)?;
            at_most("--iters", *iters, 1 << 16)?;
            if *seq == Some(0) || *head_dim == 0 || *heads == 0 || *batch == 0 || *iters == 0 {
                anyhow::bail!(
                    "--seq, --head-dim, --heads, --batch and --iters must each be at least 1"
                );
            }
            // A step needs two codons (one predicted); shorter lengths failed every case.
            if let Some(s) = seq_lens.iter().find(|&&s| s < 2) {
                anyhow::bail!("--seq-lens {s}: each length must be at least 2 codons");
            }
        }
        BenchCmd::Embed {
            seq_len,
            sequences,
            batch_size,
            ..
        } => {
            at_most("--seq-len", *seq_len, max)?;
            at_most("--sequences", *sequences, max)?;
            at_most("--batch-size", *batch_size, max)?;
            // A batch of 0 embedded nothing and still printed a throughput.
            if *seq_len == 0 || *sequences == 0 || *batch_size == 0 {
                anyhow::bail!("--seq-len, --sequences and --batch-size must each be at least 1");
            }
        }
        BenchCmd::Variants {
            window,
            codons,
            batch_size,
            rounds,
            ..
        } => {
            at_most("--window", *window, max)?;
            at_most("--codons", *codons, max)?;
            at_most("--rounds", *rounds, 1000)?;
            // A bench of nothing printed a speed-up of 0/0 (as 0.50x); none of these can be 0.
            for (flag, v) in [
                ("--codons", *codons),
                ("--rounds", *rounds),
                ("--batch-size", *batch_size),
            ] {
                if v == 0 {
                    anyhow::bail!("{flag} 0: must be at least 1");
                }
            }
            if *window < 2 {
                anyhow::bail!(
                    "--window {window}: a window holds at least 2 codons (one predicts the next)"
                );
            }
        }
        BenchCmd::Generate {
            codons, samples, ..
        } => {
            at_most("--codons", *codons, max)?;
            at_most("--samples", *samples, max)?;
            if *codons == 0 || *samples == 0 {
                anyhow::bail!("--codons and --samples must each be at least 1");
            }
        }
        BenchCmd::Ingest {
            mb, record_mb, dir, ..
        } => {
            at_most("--mb", *mb, 1 << 20)?;
            at_most("--record-mb", *record_mb, 1 << 16)?;
            if *record_mb == 0 || *mb == 0 {
                anyhow::bail!("--mb and --record-mb must each be at least 1");
            }
            // Records are written whole: a record larger than the input wrote the record's
            // size, not --mb's (--mb 1 --record-mb 1000 wrote a 1 GB file).
            if record_mb > mb {
                anyhow::bail!(
                    "--record-mb {record_mb} is larger than --mb {mb}: the input is made of \
                     whole records, so it would be {record_mb} MB; lower --record-mb or raise --mb"
                );
            }
            // A benchmark makes no directories of the user's (a mistyped path was created and
            // left behind): its scratch directory goes inside one that exists.
            if let Some(d) = dir.as_ref().filter(|d| !d.is_dir()) {
                anyhow::bail!(
                    "--dir {}: {}; give an existing directory (the benchmark writes its scratch \
                     files in a directory of its own inside it, removed at the end)",
                    d.display(),
                    genslm::error::not_a_file(d)
                );
            }
        }
    }
    Ok(())
}
