//! `genslm bench`: the benchmark subcommands and their tables.

use std::path::PathBuf;

use anyhow::Context;
use clap::Subcommand;

use super::AttentionArg;

#[derive(Clone, Copy, clap::ValueEnum, PartialEq, Debug)]
pub enum DtypeArg {
    Fp32,
    Bf16,
    F16,
}

super::mirror!(ImplArg => genslm::bench::AttnImpl { Genslm, Cubek });

#[derive(Subcommand)]
pub enum BenchCmd {
    /// Without --seq: peak memory and time of one training step per sequence length, flash vs
    /// naive attention (each case in its own process, since peak memory is per process).
    /// With --seq: the FlashAttention op alone on --backend (the fused kernels on cuda/wgpu):
    /// forward and forward+backward time, TFLOPS (4·b·h·s²·d forward, 3.5× that for
    /// forward+backward as FlashAttention-2 counts, halved when causal) and peak memory.
    Attention {
        /// Model config: a TOML file, or a built-in preset (tiny, genslm-25m, genslm-250m,
        /// genslm-2.5b, genslm-25b, genslm-33b). Not with --seq: the op alone takes --heads
        /// and --head-dim (a config was ignored there).
        #[arg(long, default_value = "tiny", conflicts_with = "seq")]
        config: PathBuf,
        /// Sequence lengths (codons).
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "1024,2048,4096,8192,16384"
        )]
        seq_lens: Vec<usize>,
        /// Skip naive attention above this length (its s² scores may not fit).
        #[arg(long, default_value_t = 16384)]
        naive_max: usize,
        /// Also run each flash case with full activation checkpointing ("flash+ckpt").
        #[arg(long)]
        checkpoint_activations: bool,
        /// Time the attention op alone at this sequence length (see above; not with
        /// --seq-lens, which steps the whole model).
        #[arg(long, conflicts_with = "seq_lens")]
        seq: Option<usize>,
        /// Op mode: head dimension.
        #[arg(long, default_value_t = 128)]
        head_dim: usize,
        /// Op mode: heads.
        #[arg(long, default_value_t = 16)]
        heads: usize,
        /// Op mode: batch size.
        #[arg(long, default_value_t = 1)]
        batch: usize,
        /// Op mode: element type of q, k, v (statistics are f32 either way).
        #[arg(long, value_enum, default_value = "fp32")]
        dtype: DtypeArg,
        /// Op mode: full (bidirectional) attention instead of causal.
        #[arg(long)]
        no_causal: bool,
        /// Op mode: ALiBi position biases (GPT-NeoX's slopes; genslm's kernels only).
        #[arg(long)]
        alibi: bool,
        /// Op mode: timed iterations (after one warm-up); the best is reported.
        #[arg(long, default_value_t = 3)]
        iters: usize,
        /// Op mode: whose attention: genslm's, or cubek-attention (the CubeCL attention burn
        /// ships; cuda/wgpu only) as the baseline on the same device.
        #[arg(long = "impl", value_enum, default_value = "genslm")]
        imp: ImplArg,
        #[command(flatten)]
        device: super::device::DeviceArgs,
    },
    /// Training throughput: tokens/s, model GFLOP/s (beside a 1024³ matmul's) and peak RSS of
    /// AdamW steps at one sequence length, batch 1 (the PyTorch peer:
    /// scripts/bench_torch_train.py). With any degree above 1, or --simulate-network, the steps
    /// run through the trainer on that many ranks as threads, on random codons, one sequence
    /// per DP rank, and the time in communication is reported.
    Train {
        /// Model config: a TOML file, or a built-in preset (tiny, genslm-25m, genslm-250m,
        /// genslm-2.5b, genslm-25b, genslm-33b).
        #[arg(long, default_value = "genslm-25m")]
        config: PathBuf,
        #[arg(long, default_value_t = 2048)]
        seq_len: usize,
        /// Timed steps (after one warm-up step).
        #[arg(long, default_value_t = 3)]
        steps: usize,
        #[command(flatten)]
        degrees: super::train::DegreeArgs,
        /// Every message between the ranks waits LATENCY + its bytes / BANDWIDTH first, e.g.
        /// `20ms,1GB/s`: a slow network simulated on one machine.
        #[arg(long, value_name = "LATENCY,BANDWIDTH")]
        simulate_network: Option<String>,
        /// Several ranks: the ZeRO stage.
        #[arg(long, default_value_t = 1)]
        zero: u8,
        /// Several ranks: blocking collectives instead of communication overlapped with compute.
        #[arg(long)]
        no_overlap: bool,
        /// Several ranks, ZeRO-3: layers gathered ahead of their use.
        #[arg(long, default_value_t = 1)]
        prefetch_layers: usize,
        /// Full activation checkpointing (one rank too: the step then runs through the
        /// trainer, as several ranks' do).
        #[arg(long)]
        checkpoint_activations: bool,
        /// Several ranks, ZeRO-3: weight all-gathers quantized (int8 or bf16).
        #[arg(long, value_name = "int8|bf16|fp32")]
        quantize_weights: Option<super::train::QuantArg>,
        /// Several ranks: gradient reductions quantized (int8 or bf16).
        #[arg(long, value_name = "int8|bf16|fp32")]
        quantize_grads: Option<super::train::QuantArg>,
        #[command(flatten)]
        device: super::device::DeviceArgs,
    },
    /// One training step in this process (used by `bench attention`).
    #[command(hide = true)]
    Step {
        #[arg(long)]
        config: PathBuf,
        #[arg(long)]
        seq_len: usize,
        #[arg(long, value_enum)]
        attention: AttentionArg,
        #[arg(long)]
        checkpoint_activations: bool,
    },
    /// Embedding throughput (sequences/s) on random sequences with a fresh model.
    Embed {
        /// Model config: a TOML file, or a built-in preset (tiny, genslm-25m, genslm-250m,
        /// genslm-2.5b, genslm-25b, genslm-33b).
        #[arg(long, default_value = "genslm-25m")]
        config: PathBuf,
        /// Codons per sequence.
        #[arg(long, default_value_t = 2048)]
        seq_len: usize,
        /// Sequences to embed.
        #[arg(long, default_value_t = 8)]
        sequences: usize,
        #[arg(long, default_value_t = 1)]
        batch_size: usize,
    },
    /// Variant scoring (variants/s): the 9 single-base substitutions of each of --codons codons
    /// of a random CDS, the REF prefix's keys/values reused against full recomputation of REF
    /// and ALT (interleaved, best of --rounds), and the largest Δ difference between the two.
    Variants {
        /// Model config: a TOML file, or a built-in preset (tiny, genslm-25m, genslm-250m,
        /// genslm-2.5b, genslm-25b, genslm-33b).
        #[arg(long, default_value = "genslm-25m")]
        config: PathBuf,
        /// Window in codons around each variant.
        #[arg(long, default_value_t = 512)]
        window: usize,
        /// Codons mutated (9 variants each).
        #[arg(long, default_value_t = 8)]
        codons: usize,
        /// ALT suffixes decoded together.
        #[arg(long, default_value_t = 16)]
        batch_size: usize,
        #[arg(long, default_value_t = 2)]
        rounds: usize,
    },
    /// Generation throughput (codons/s) with and without the KV cache.
    Generate {
        /// Model config: a TOML file, or a built-in preset (tiny, genslm-25m, genslm-250m,
        /// genslm-2.5b, genslm-25b, genslm-33b).
        #[arg(long, default_value = "genslm-25m")]
        config: PathBuf,
        /// Codons to draw per sample.
        #[arg(long, default_value_t = 256)]
        codons: usize,
        /// Samples decoded together.
        #[arg(long, default_value_t = 1)]
        samples: usize,
        /// Skip the run without the cache (it is O(s²) per codon).
        #[arg(long)]
        cache_only: bool,
    },
    /// FASTA → parquet throughput (MB/s) on synthetic plain and gzip FASTA.
    Ingest {
        /// Megabytes of FASTA to generate.
        #[arg(long, default_value_t = 256)]
        mb: usize,
        /// Megabases per record (one record of 200 shows the memory a chromosome takes).
        #[arg(long, default_value_t = 1)]
        record_mb: usize,
        /// Where the scratch files go (a directory of their own inside it, removed afterwards,
        /// or by the next run when this one is killed; default: the system temporary
        /// directory). Refused when its disk cannot hold them (about 2.5 × --mb).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

/// Runs a benchmark whose sizes `cli::bench_sizes::check_sizes` accepted.
pub fn run(which: BenchCmd) -> anyhow::Result<()> {
    // Every figure below depends on the CPU and on the instruction-set tier the loops ran
    // (GENSLM_SIMD can force a lower one): say both first. `bench step` is read by
    // `bench attention`'s own process and prints only its numbers.
    if !matches!(which, BenchCmd::Step { .. }) {
        println!("cpu: {}", genslm::isa::describe());
    }
    match which {
        BenchCmd::Train {
            config,
            seq_len,
            steps,
            degrees,
            simulate_network,
            zero,
            no_overlap,
            prefetch_layers,
            checkpoint_activations,
            quantize_weights,
            quantize_grads,
            device,
        } => {
            let cfg = genslm::config::Config::load_model(&config, "genslm bench")?;
            let compute = device.compute();
            let degrees = degrees.degrees();
            let (quantize_weights, quantize_grads) = (
                quantize_weights.and_then(|q| q.0),
                quantize_grads.and_then(|q| q.0),
            );
            let genslm::parallel::Degrees { dp, cp, sp, tp, pp } = degrees;
            let one_rank = degrees.world() == 1 && simulate_network.is_none();
            if one_rank && (quantize_weights.is_some() || quantize_grads.is_some()) {
                anyhow::bail!(
                    "--quantize-weights/--quantize-grads quantize collectives between ranks: give \
                     several (--dp, --sp, ...), as one rank moves nothing"
                );
            }
            if one_rank && (zero != 1 || no_overlap || prefetch_layers != 1) {
                // They were ignored on one rank, silently: the figure was not what they asked.
                anyhow::bail!(
                    "--zero, --no-overlap and --prefetch-layers shape what passes between ranks: \
                     give several (--dp, --sp, ...), as one rank has nothing to shard or overlap"
                );
            }
            // Checkpointing runs through the trainer, on one rank too (the one-rank step had
            // none, and printed a figure without it).
            if !one_rank || checkpoint_activations {
                let net = simulate_network
                    .as_deref()
                    .map(str::parse::<genslm::parallel::netsim::NetSim>)
                    .transpose()?;
                let knobs = genslm::bench::RankKnobs {
                    zero,
                    overlap: !no_overlap,
                    prefetch_layers,
                    checkpoint_activations,
                    quantize_weights,
                    quantize_grads,
                };
                let r = genslm::bench::train_ranks(
                    &cfg, seq_len, steps, degrees, net, &compute, knobs,
                )
                .map_err(|e| {
                    // The trainer's checks speak of `genslm train`'s flags, some of which
                    // bench has not (--grad-accum, --skip-memory-check, --pp-virtual).
                    anyhow::anyhow!(
                        "{e}\n(bench train runs genslm train's checks: flags named above are \
                         train's; here the batch is --dp sequences, and micro-batches per step: {})",
                        if pp > 1 { 4 * pp } else { 1 }
                    )
                })?;
                let quantized = [("weights", quantize_weights), ("grads", quantize_grads)]
                    .iter()
                    .filter_map(|(w, q)| q.map(|q| format!(" {q} {w}")))
                    .collect::<String>();
                println!(
                    "genslm {} seq {seq_len} dp {dp} pp {pp} cp {cp} sp {sp} tp {tp} zero {zero}{}{}{quantized} {} \
                     network {}: \
                     {:.1} tokens/s, {:.3} s/step, {:.3} s/step in communication, {:.3} MB/step \
                     sent (rank 0){} [simd {}]",
                    cfg.name,
                    if no_overlap { " no-overlap" } else { " overlap" },
                    if checkpoint_activations { " checkpointed" } else { "" },
                    compute.device.backend.name(),
                    simulate_network.as_deref().unwrap_or("none"),
                    r.tokens_per_s,
                    r.secs_per_step,
                    // A clock's rounding gave one rank "-0.000 s/step".
                    r.comm_wait_s.max(0.0),
                    r.comm_bytes / 1e6,
                    r.pp_bubble
                        .map(|b| format!(", pipeline bubble {b:.3} ({} micro-batches)", 4 * pp))
                        .unwrap_or_default(),
                    genslm::isa::tier()
                );
                return Ok(());
            }
            let r = genslm::bench::train_steps(&cfg, seq_len, steps, &compute)?;
            println!(
                "genslm {} seq {seq_len} {} {} threads {}: {:.1} tokens/s, {:.3} s/step, \
                 {:.1} GFLOP/s (1024³ matmul here: {:.1} GFLOP/s, {:.0}%), peak RSS {:.0} MiB \
                 [simd {}]",
                cfg.name,
                compute.device.backend.name(),
                compute.precision,
                genslm::backend::cpu_threads(),
                r.tokens_per_s,
                r.secs_per_step,
                r.gflops,
                r.matmul_gflops,
                100.0 * r.gflops / r.matmul_gflops,
                r.peak_rss_mib,
                genslm::isa::tier()
            );
        }
        BenchCmd::Step {
            config,
            seq_len,
            attention,
            checkpoint_activations,
        } => {
            let mut cfg = genslm::config::Config::load_model(&config, "genslm bench")?;
            cfg.attention = attention.into();
            let (secs, peak) = genslm::bench::train_step(&cfg, seq_len, 1, checkpoint_activations)?;
            println!("{secs} {peak}");
        }
        BenchCmd::Attention {
            seq: Some(seq),
            head_dim,
            heads,
            batch,
            dtype,
            no_causal,
            alibi,
            iters,
            imp,
            device,
            ..
        } => {
            let compute = device.compute();
            let case = genslm::bench::AttnBenchCase {
                batch,
                heads,
                seq,
                head_dim,
                dtype: match dtype {
                    DtypeArg::Fp32 => burn::tensor::DType::F32,
                    DtypeArg::Bf16 => burn::tensor::DType::BF16,
                    DtypeArg::F16 => burn::tensor::DType::F16,
                },
                causal: !no_causal,
                alibi,
                iters,
                imp: imp.into(),
            };
            let r = genslm::bench::attention_op(&compute, &case)?;
            let fwd_bwd = match (r.fwd_bwd_s, r.tflops_fwd_bwd) {
                (Some(s), Some(t)) => format!("{s:.4} s ({t:.3} TFLOPS)"),
                _ => "n/a".into(),
            };
            println!(
                "attention {} {dtype:?} b {batch} h {heads} seq {seq} d {head_dim} causal {} \
                 alibi {alibi} [{}]: fwd {:.4} s ({:.3} TFLOPS), fwd+bwd {fwd_bwd}, peak {:.1} MiB ({})",
                compute.device.backend.name(),
                case.causal,
                r.routine,
                r.fwd_s,
                r.tflops_fwd,
                r.peak_mib,
                r.peak_of
            );
        }
        BenchCmd::Attention {
            config,
            seq_lens,
            naive_max,
            checkpoint_activations,
            ..
        } => {
            let exe = std::env::current_exe().context("locating the genslm binary")?;
            println!("seq_len  attention     step_s  tokens/s  peak_MiB");
            let cases: &[&str] = if checkpoint_activations {
                &["flash", "flash+ckpt", "naive"]
            } else {
                &["flash", "naive"]
            };
            let (mut ran, mut failed) = (0, 0);
            for &s in &seq_lens {
                for &case in cases {
                    if case == "naive" && s > naive_max {
                        println!("{s:>7}  {case:<10}  skipped (--naive-max {naive_max})");
                        continue;
                    }
                    let kind = case.trim_end_matches("+ckpt");
                    let mut cmd = std::process::Command::new(&exe);
                    // The step runs on the threads this benchmark was given, not on every core.
                    cmd.arg("--threads")
                        .arg(genslm::backend::cpu_threads().to_string());
                    die_with_parent(&mut cmd);
                    cmd.args(["bench", "step", "--config"]).arg(&config).args([
                        "--seq-len",
                        &s.to_string(),
                        "--attention",
                        kind,
                    ]);
                    if case.ends_with("+ckpt") {
                        cmd.arg("--checkpoint-activations");
                    }
                    let out = cmd.output().context("running a benchmark step")?;
                    let text = String::from_utf8_lossy(&out.stdout);
                    let v: Vec<f64> = text
                        .split_whitespace()
                        .filter_map(|x| x.parse().ok())
                        .collect();
                    ran += 1;
                    if !out.status.success() || v.len() != 2 {
                        failed += 1;
                        println!(
                            "{s:>7}  {case:<10}  failed: {}",
                            String::from_utf8_lossy(&out.stderr).trim()
                        );
                        continue;
                    }
                    // Four decimals: short test sequences step in milliseconds.
                    println!(
                        "{s:>7}  {case:<10}  {:>8.4}  {:>8.0}  {:>8.0}",
                        v[0],
                        s as f64 / v[0],
                        v[1]
                    );
                }
            }
            // Naive attention running out of memory at long lengths is a finding; every case
            // failing is not a measurement.
            if ran > 0 && failed == ran {
                anyhow::bail!("bench attention: every case failed (the reasons above)");
            }
        }
        BenchCmd::Embed {
            config,
            seq_len,
            sequences,
            batch_size,
        } => {
            let cfg = genslm::config::Config::load_model(&config, "genslm bench")?;
            learned_positions(&cfg, "--seq-len", seq_len, seq_len)?;
            let b = genslm::infer::bench::embed(&cfg, seq_len, sequences, batch_size)?;
            println!("model  seq_len  sequences  batch  seconds  sequences/s  tokens/s");
            println!(
                "{}  {}  {}  {}  {:.2}  {:.3}  {:.0}",
                cfg.name,
                b.seq_len,
                b.sequences,
                b.batch_size,
                b.seconds,
                b.sequences_per_s(),
                b.tokens_per_s()
            );
        }
        BenchCmd::Variants {
            config,
            window,
            codons,
            batch_size,
            rounds,
        } => {
            let cfg = genslm::config::Config::load_model(&config, "genslm bench")?;
            learned_positions(&cfg, "--window", window, window)?;
            let b = genslm::infer::bench::variants(&cfg, window, codons, batch_size, rounds)?;
            println!("model  window  variants  full_s  prefix_reuse_s  full_variants/s  prefix_variants/s  speedup  max_|diff|");
            println!(
                "{}  {}  {}  {:.2}  {:.2}  {:.2}  {:.2}  {:.2}x  {:.1e}",
                cfg.name,
                b.window,
                b.variants,
                b.full_s,
                b.prefix_s,
                b.variants as f64 / b.full_s,
                b.variants as f64 / b.prefix_s,
                b.full_s / b.prefix_s,
                b.max_diff
            );
        }
        BenchCmd::Generate {
            config,
            codons,
            samples,
            cache_only,
        } => {
            let cfg = genslm::config::Config::load_model(&config, "genslm bench")?;
            // The sample's first token is its prompt's.
            learned_positions(&cfg, "--codons", codons, codons.saturating_add(1))?;
            println!("model  kv_cache  samples  codons  seconds  codons/s");
            for use_cache in [true, false] {
                if !use_cache && cache_only {
                    continue;
                }
                let b = genslm::infer::bench::generation(&cfg, codons, samples, use_cache)?;
                println!(
                    "{}  {}  {}  {}  {:.2}  {:.1}",
                    cfg.name,
                    if use_cache { "yes" } else { "no" },
                    b.samples,
                    b.codons,
                    b.seconds,
                    b.codons_per_s()
                );
            }
        }
        BenchCmd::Ingest { mb, record_mb, dir } => {
            // Its own directory inside --dir: the user's files there (a `bench.fa` of theirs)
            // are never replaced, and nothing is left behind, not even by a killed run.
            let scratch = genslm::bench::scratch::create(
                dir.as_deref(),
                genslm::bench::scratch::ingest_disk_bytes(mb, record_mb),
                "--mb",
            )?;
            let dir = scratch.path().to_path_buf();
            println!(
                "case   fasta_MB  input_MB  seconds  MB/s(fasta)  MB/s(input)  Mbases/s  peak_MiB"
            );
            for c in genslm::bench::ingest(&dir, mb, record_mb)? {
                let s = &c.summary;
                let secs = s.elapsed.as_secs_f64();
                let peak = c.peak_mib.map_or("-".into(), |p| format!("{p:.0}"));
                println!(
                    "{:<6} {:>8.1}  {:>8.1}  {:>7.3}  {:>11.1}  {:>11.1}  {:>8.1}  {:>8}",
                    c.name,
                    c.fasta_bytes as f64 / 1e6,
                    s.input_bytes as f64 / 1e6,
                    secs,
                    c.fasta_bytes as f64 / 1e6 / secs,
                    s.mb_per_s(),
                    s.mbases_per_s(),
                    peak
                );
            }
        }
    }
    Ok(())
}

/// Has the kernel stop a measuring child when this process dies: killed by its id, the parent
/// left steps of naive attention running, gigabytes each, with no one to read them.
fn die_with_parent(cmd: &mut std::process::Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

/// A bench longer than a learned position table is refused under the bench's own flag, before
/// the header is printed (the library's message named score's `--seq-len` or generate's
/// `--max-codons`, after it). Rotary and ALiBi run at any length: the weights are random, so
/// only the timing is measured.
fn learned_positions(
    cfg: &genslm::config::ModelConfig,
    flag: &str,
    value: usize,
    tokens: usize,
) -> anyhow::Result<()> {
    let max = cfg.max_position_embeddings;
    if cfg.position == genslm::config::Position::Learned && tokens > max {
        anyhow::bail!(
            "{flag} {value}: {tokens} tokens go past the {max} learned positions of {} \
             (max_position_embeddings); give at most {}",
            cfg.name,
            value - (tokens - max)
        );
    }
    Ok(())
}
