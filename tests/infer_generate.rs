//! `genslm generate`: decoding with the KV cache against greedy decoding without it (rotary,
//! ALiBi, learned positions), reproducible sampling, stop codons, the FASTA output, and the
//! error messages for bad input.

mod common;

use std::path::Path;

use burn::tensor::Device;
use common::{repo, run};
use genslm::config::{Config, ModelConfig, Position};
use genslm::infer::generate::{generate, GenerateOptions, Generated};
use genslm::infer::sample::SamplingParams;
use genslm::model::io::{load_model_dir, save_model_dir};
use genslm::model::GenSlm;
use genslm::ops::primitive::{tensor_to_vec, tokens_tensor};
use genslm::tokenizer::CodonTokenizer;

fn s(p: &Path) -> String {
    common::arg(p)
}

fn trained() -> &'static Path {
    common::trained_tiny()
}

fn tiny(position: Position, max_pos: usize) -> ModelConfig {
    let mut cfg = Config::load(&repo().join("configs/tiny.toml"))
        .unwrap()
        .model;
    cfg.position = position;
    cfg.max_position_embeddings = max_pos;
    cfg
}

/// Greedy decoding without a cache: a full forward pass over the whole prefix per codon, the
/// argmax of the last position's logits over the codons.
fn greedy_without_cache(model: &GenSlm, prompt: &[u32], total: usize) -> Vec<u32> {
    let tok = CodonTokenizer::new(model.cfg.vocab).unwrap();
    let v = model.cfg.vocab_size;
    let codon = |i: usize| tok.token(i as u32).is_some_and(|t| !t.starts_with('['));
    let mut seq = prompt.to_vec();
    while seq.len() < total {
        let n = seq.len();
        let logits = tensor_to_vec(
            &model
                .forward(tokens_tensor(&seq, 1, n, &model.device), 0)
                .unwrap(),
        );
        let last = &logits[(n - 1) * v..n * v];
        let best = (0..v)
            .filter(|&i| codon(i))
            .max_by(|&a, &b| last[a].total_cmp(&last[b]))
            .unwrap();
        seq.push(best as u32);
    }
    seq
}

fn gen_all(model: &GenSlm, opts: &GenerateOptions) -> Vec<Generated> {
    let mut out = Vec::new();
    generate(model, opts, &mut |g| {
        out.push(g.clone());
        Ok(())
    })
    .unwrap();
    out
}

fn greedy_opts(prompt: &str, max_codons: usize) -> GenerateOptions {
    GenerateOptions {
        prompt: prompt.into(),
        num: 3,
        max_codons,
        sampling: SamplingParams {
            top_k: 1,
            top_p: 0.95,
            temperature: 1.0,
        },
        seed: 5,
        batch_size: 2,
        ..Default::default()
    }
}

#[test]
fn generate_top_k_1_equals_greedy_without_cache() {
    let trained = load_model_dir(trained(), &Device::flex()).unwrap();
    let mut models = vec![("trained rotary", trained)];
    for (name, pos) in [
        ("alibi", Position::Alibi),
        ("learned", Position::Learned),
        ("rotary", Position::Rotary),
    ] {
        let m = GenSlm::init(tiny(pos, 128), 11, &Device::flex()).unwrap();
        models.push((name, m));
    }
    for (name, model) in &models {
        let tok = CodonTokenizer::new(model.cfg.vocab).unwrap();
        let prompt = tok.encode(b"ATGGCTAAA");
        let want = greedy_without_cache(model, &prompt, 40);
        let got = gen_all(model, &greedy_opts("ATGGCTAAA", 40));
        assert_eq!(got.len(), 3);
        for g in &got {
            assert_eq!(
                g.tokens, want,
                "{name}: sample {} differs from greedy",
                g.index
            );
            assert_eq!(g.dna.len(), 120);
            assert!(g.dna.starts_with("ATGGCTAAA"));
        }
        // The cache-free path of `generate` agrees too.
        let slow = gen_all(
            model,
            &GenerateOptions {
                use_cache: false,
                ..greedy_opts("ATGGCTAAA", 40)
            },
        );
        assert_eq!(slow[0].tokens, want, "{name}: use_cache = false");
    }
    // An ALiBi model generates past its training length (max_position_embeddings 16).
    let alibi = GenSlm::init(tiny(Position::Alibi, 16), 3, &Device::flex()).unwrap();
    let prompt = CodonTokenizer::new(alibi.cfg.vocab).unwrap().encode(b"ATG");
    let got = gen_all(&alibi, &greedy_opts("ATG", 40));
    assert_eq!(got[0].tokens, greedy_without_cache(&alibi, &prompt, 40));
}

#[test]
fn sampling_is_reproducible_per_seed() {
    let model = load_model_dir(trained(), &Device::flex()).unwrap();
    let opts = GenerateOptions {
        num: 4,
        max_codons: 30,
        seed: 9,
        batch_size: 3,
        ..Default::default()
    };
    let a = gen_all(&model, &opts);
    let b = gen_all(
        &model,
        &GenerateOptions {
            batch_size: 4,
            ..opts.clone()
        },
    );
    assert_eq!(a, b, "same seed, same samples (whatever the batching)");
    assert!(
        a.iter().any(|g| g.dna != a[0].dna),
        "samples differ from each other"
    );
    let c = gen_all(
        &model,
        &GenerateOptions {
            seed: 10,
            ..opts.clone()
        },
    );
    assert_ne!(a, c);
    for g in &a {
        assert_eq!(g.dna.len(), 90);
        assert!(g.dna.bytes().all(|b| b"ACGT".contains(&b)), "{}", g.dna);
    }
    // Stop codons end a sample (kept), and no earlier in-frame stop codon is left.
    let stop = gen_all(
        &model,
        &GenerateOptions {
            stop_at_stop_codon: true,
            num: 6,
            max_codons: 200,
            ..opts
        },
    );
    for g in &stop {
        let codons: Vec<&str> = (0..g.dna.len() / 3)
            .map(|i| &g.dna[3 * i..3 * i + 3])
            .collect();
        let is_stop = |c: &&str| ["TAA", "TAG", "TGA"].contains(c);
        let last = codons.last().unwrap();
        assert!(is_stop(last) || codons.len() == 200, "{}", g.dna);
        assert!(!codons[..codons.len() - 1].iter().any(is_stop), "{}", g.dna);
    }
}

#[test]
fn generate_cli_writes_fasta_with_settings() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("gen.fa");
    let (ok, _, err) = run(&[
        "generate",
        "--model",
        &s(trained()),
        "--num",
        "3",
        "--max-codons",
        "50",
        "--seed",
        "4",
        "--out",
        &s(&out),
        "--quiet",
    ]);
    assert!(ok, "{err}");
    let text = std::fs::read_to_string(&out).unwrap();
    let headers: Vec<&str> = text.lines().filter(|l| l.starts_with('>')).collect();
    assert_eq!(headers.len(), 3, "{text}");
    assert!(headers[0].starts_with(">genslm_sample_0 codons=50 stop=max_codons prompt=ATG top_k=50 top_p=0.95 temperature=1 seed=4"), "{}", headers[0]);
    let mut n = 0;
    genslm::data::fasta::read_file(&out, Default::default(), &mut |_| {}, &mut |rec, _| {
        assert_eq!(rec.seq.len(), 150);
        assert!(rec.seq.starts_with(b"ATG"));
        n += 1;
        Ok(())
    })
    .unwrap();
    assert_eq!(n, 3);
    // To stdout, the same samples.
    let (ok, stdout, _) = run(&[
        "generate",
        "--model",
        &s(trained()),
        "--num",
        "3",
        "--max-codons",
        "50",
        "--seed",
        "4",
    ]);
    assert!(ok);
    assert_eq!(stdout, text);
}

#[test]
fn generate_bad_input_gives_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let model = s(trained());
    for (args, want) in [
        (
            vec!["generate", "--model", &s(&empty)],
            "not a model directory",
        ),
        (
            vec!["generate", "--model", &model, "--prompt", "ATGNNN"],
            "character 'N' at position 4",
        ),
        (
            vec!["generate", "--model", &model, "--prompt", "ATGA"],
            "multiple of 3",
        ),
        (
            vec!["generate", "--model", &model, "--top-p", "0"],
            "--top-p 0",
        ),
        (
            vec!["generate", "--model", &model, "--top-k", "70"],
            "--top-k 70: the model has only 69 tokens",
        ),
        (
            vec![
                "generate",
                "--model",
                &model,
                "--prompt",
                "ATGAAA",
                "--max-codons",
                "2",
            ],
            "--max-codons 2",
        ),
    ] {
        let (ok, _, err) = run(&args);
        assert!(!ok, "{args:?} should fail");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    // A learned-position model refuses to generate past its table, and generates up to it.
    let learned = dir.path().join("learned");
    std::fs::create_dir(&learned).unwrap();
    let m = GenSlm::init(tiny(Position::Learned, 32), 1, &Device::flex()).unwrap();
    save_model_dir(&m, &learned).unwrap();
    let (ok, _, err) = run(&["generate", "--model", &s(&learned), "--max-codons", "40"]);
    assert!(!ok && err.contains("learned positions"), "{err}");
    let (ok, out, err) = run(&[
        "generate",
        "--model",
        &s(&learned),
        "--max-codons",
        "32",
        "--quiet",
    ]);
    assert!(ok, "{err}");
    let bases: String = out.lines().filter(|l| !l.starts_with('>')).collect();
    assert_eq!(bases.len(), 96);
}

/// A length whose KV cache cannot fit in memory is refused with its size before anything is
/// allocated (it asked for 25.6 GB and aborted the process).
#[test]
fn a_cache_larger_than_memory_is_refused_before_it_is_allocated() {
    let dir = tempfile::tempdir().unwrap();
    let m = GenSlm::init(tiny(Position::Rotary, 64), 1, &Device::flex()).unwrap();
    save_model_dir(&m, dir.path()).unwrap();
    let start = std::time::Instant::now();
    let (ok, _, err) = run(&[
        "generate",
        "--model",
        &s(dir.path()),
        "--max-codons",
        "100000000",
        "--quiet",
    ]);
    // 2 layers × hidden 64 × 2 (K and V) × 4 bytes × 10^8 tokens = 102 GB.
    assert!(
        !ok && err.contains("the KV cache of a batch of 1 needs 95.4 GiB"),
        "{err}"
    );
    assert!(
        !err.contains("panicked") && start.elapsed().as_secs() < 30,
        "{err}"
    );
}

/// A logit that overflows to +∞ made softmax NaN everywhere, and the draw fell on id 0: the
/// sample read NNN ([UNK]) with exit 0, and greedy decoding skipped the token. Both now stop,
/// naming the sample, the codon and the token.
#[test]
fn an_infinite_logit_stops_generation_by_name() {
    use genslm::model::params::Layout;
    let cfg = tiny(Position::Rotary, 64);
    let layout = Layout::new(&cfg);
    let mut values = layout.init_host(3);
    let tok = CodonTokenizer::new(cfg.vocab).unwrap();
    let atg = tok.codon_to_id(b"ATG") as usize;
    let (h, v) = (cfg.hidden_size, cfg.vocab_size);
    // The final LayerNorm outputs ones whatever the input, so ATG's logit is h · 3e38 = +∞.
    values[layout.final_ln_w].iter_mut().for_each(|x| *x = 0.0);
    values[layout.final_ln_b].iter_mut().for_each(|x| *x = 1.0);
    for j in 0..h {
        values[layout.embed_out][j * v + atg] = 3e38;
    }
    let model = GenSlm::from_host(cfg, values, &Device::flex()).unwrap();
    for temperature in [1.0, 0.0] {
        let mut opts = greedy_opts("AAA", 4);
        opts.sampling = SamplingParams {
            top_k: 0,
            top_p: 1.0,
            temperature,
        };
        let err = generate(&model, &opts, &mut |_| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("sample 0, codon 2") && err.contains("logit for ATG is inf"),
            "temperature {temperature}: {err}"
        );
    }
}

/// A sample that draws [EOS] before its first codon (an empty prompt on genslm71) has no
/// sequence: it was written as a bare header, which genslm's own readers refuse. It is left out
/// with a warning, and a run where every sample is empty fails rather than write an empty
/// file. The model path in the header keeps no control character (a terminal escape).
#[test]
fn an_empty_sample_is_not_written_and_the_header_is_printable() {
    use genslm::infer::generate::generate_fasta;
    use genslm::model::params::Layout;
    use genslm::tokenizer::VocabKind;
    let mut cfg = tiny(Position::Rotary, 64);
    cfg.vocab = VocabKind::Genslm71;
    cfg.vocab_size = 71;
    let layout = Layout::new(&cfg);
    let mut values = layout.init_host(3);
    let tok = CodonTokenizer::new(cfg.vocab).unwrap();
    let (eos, atg) = (
        tok.eos_id().unwrap() as usize,
        tok.codon_to_id(b"ATG") as usize,
    );
    let v = cfg.vocab_size;
    values[layout.final_ln_w].iter_mut().for_each(|x| *x = 0.0);
    values[layout.final_ln_b].iter_mut().for_each(|x| *x = 1.0);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("g.fa");
    for (favoured, records) in [(eos, 0), (atg, 2)] {
        let w = &mut values[layout.embed_out];
        w.iter_mut().for_each(|x| *x = 0.0);
        for j in 0..cfg.hidden_size {
            w[j * v + favoured] = 0.5;
        }
        let model = GenSlm::from_host(cfg.clone(), values.clone(), &Device::flex()).unwrap();
        let mdir = dir.path().join(format!("m\x1b[31m{favoured}"));
        std::fs::create_dir(&mdir).unwrap();
        save_model_dir(&model, &mdir).unwrap();
        let mut opts = greedy_opts("", 3);
        opts.num = 2;
        let result = generate_fasta(&mdir, &opts, Some(&out));
        if records == 0 {
            // Nothing to write at all: an error, and no empty file (tokenize refuses one).
            let e = result.unwrap_err().to_string();
            assert!(e.contains("every sample drew [EOS]"), "{e}");
            assert!(!out.exists());
            continue;
        }
        let n = result.unwrap();
        let text = std::fs::read_to_string(&out).unwrap();
        assert_eq!((n, text.matches('>').count()), (records, records), "{text}");
        assert!(!text.contains('\x1b'), "{text:?}");
        if records > 0 {
            assert!(text.contains(&format!("m_[31m{favoured}")), "{text}");
            assert!(text.lines().nth(1) == Some("ATGATGATG"), "{text}");
        }
    }
}
