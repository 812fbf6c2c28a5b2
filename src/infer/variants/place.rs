//! Placing a variant on its record: checking REF against the reference, deciding whether the
//! change lies inside the CDS, annotating it, and building its REF and ALT windows (the job
//! that `delta` scores).

use crate::config::Position;
use crate::model::GenSlm;
use crate::tokenizer::CodonTokenizer;

use super::annotate::{annotate_in, Annotation, Consequence};
use super::code::Edit;
use super::delta::{window_start, Job};
use super::vcf::Variant;

fn codon_tokens(tok: &CodonTokenizer, bases: &[u8]) -> Vec<u32> {
    bases
        .chunks_exact(3)
        .map(|c| tok.codon_to_id(&[c[0], c[1], c[2]]))
        .collect()
}

/// How far past `max(--window, max_position_embeddings)` a window may stretch to hold a long
/// change before the variant is refused as structural.
pub(super) const MAX_STRETCH: usize = 8;

/// A variant placed on its record: its annotation and, when it can be scored, its job.
pub(super) fn place(
    v: &Variant,
    seq: &[u8],
    cds: (u64, u64),
    w: usize,
    tok: &CodonTokenizer,
    model: &GenSlm,
) -> std::result::Result<(Option<Annotation>, Option<Job>), String> {
    let p = usize::try_from(v.pos - 1).unwrap_or(usize::MAX);
    let r = v.reference.as_bytes();
    let Some(found) = seq.get(p..p.saturating_add(r.len())) else {
        return Err(format!(
            "REF '{}' at {}:{} runs past the record's end ({} bases)",
            v.reference,
            v.chrom,
            v.pos,
            seq.len()
        ));
    };
    if found != r {
        return Err(format!(
            "REF '{}' does not match the reference at {}:{} ('{}')",
            v.reference,
            v.chrom,
            v.pos,
            String::from_utf8_lossy(found)
        ));
    }
    let (s, e) = ((cds.0 - 1) as usize, cds.1 as usize);
    // Inside or outside the CDS by the change itself: a VCF anchor base just before the CDS
    // does not put a deletion of the start codon outside it. An insertion is inside when it
    // falls between two CDS bases.
    let t = Edit::trimmed(p, r, v.alt.as_bytes());
    let inside = if t.reference.is_empty() {
        s < t.at && t.at < e
    } else {
        s <= t.at && t.at + t.reference.len() <= e
    };
    if !inside || s >= e {
        return Ok((None, None));
    }
    let cds_seq = &seq[s..e];
    let edit = Edit {
        at: t.at - s,
        reference: t.reference,
        alt: t.alt,
    };
    let n = cds_seq.len() / 3;
    // The record past the CDS too: a change that removes the stop finds ALT's next one there.
    let mut ann = annotate_in((cds_seq, &seq[e..]), &edit);
    if edit.codon() >= n || edit.at + edit.reference.len() > 3 * n {
        // A change that reaches the CDS's incomplete last codon: no whole codons to score.
        ann.consequence = Consequence::Incomplete;
        return Ok((Some(ann), None));
    }
    let c = edit.codon();
    let table = model.cfg.max_position_embeddings;
    let alt_cds = edit.apply(cds_seq);
    // Where the CDS starts at the record's first base, and where it is the whole record.
    let ends = (s == 0, s == 0 && e == seq.len());
    let build = |w: usize| build_windows((cds_seq, &alt_cds), &edit, w, ends, tok, model);
    let mut win = build(w);
    // A learned table holds no more than its positions, and it is the default --window: a
    // window that [BOS] or an insertion's codons take past it (every insertion, and every
    // variant at a genslm71 record's start, was refused) is shortened by the excess, REF and
    // ALT alike, as training's windows there held [BOS] and one codon fewer.
    let mut w_used = w;
    while model.cfg.position == Position::Learned && win.longest() > table && w_used > 2 {
        w_used = w_used.saturating_sub(win.longest() - table).max(2);
        win = build(w_used);
    }
    let longest = win.longest();
    let Windows {
        start: a,
        end_c,
        shift,
        reference,
        alt,
    } = win;
    if model.cfg.position == Position::Learned && longest > table {
        // Shortened as far as it goes: the change itself (REF or ALT, in codons) is what no
        // window of the table holds.
        let change = edit.reference.len().max(edit.alt.len()).div_ceil(3);
        return Err(format!(
            "the change spans {change} codons and its shortest window {longest}, more than \
             the model's {table} learned positions: no --window holds it"
        ));
    }
    // A change so long that its window dwarfs what the model was made for is a structural
    // variant to it: a 900 kb deletion stretched its window to 300,000 codons, whose forward
    // (quadratic in the window) ran for hours on one VCF line.
    let most = MAX_STRETCH.saturating_mul(w.max(table));
    if longest > most {
        let change = edit.reference.len().max(edit.alt.len()).div_ceil(3);
        return Err(format!(
            "the change spans {change} codons and its window {longest}, more than \
             {MAX_STRETCH}× the window asked for or the model's {table} positions ({most}): \
             a structural variant this model was not made to score; remove the line, or pass \
             --on-invalid skip"
        ));
    }
    if reference.len() < 2 || alt.len() < 2 {
        // Nothing to predict in one of the windows (a deletion of almost the whole CDS).
        return Ok((Some(ann), None));
    }
    let codons = if edit.is_substitution() {
        ann.codons
            .clone()
            .filter(|&x| x < end_c)
            .map(|x| x - a + shift)
            .collect()
    } else {
        vec![c - a + shift]
    };
    let job = Job {
        start: a,
        reference,
        alt,
        first: c - a + shift,
        codons,
    };
    Ok((Some(ann), Some(job)))
}

/// A variant's REF and ALT windows at `--window` `w` (see [`place`]).
struct Windows {
    /// First codon of the window, and one past its last whole codon, in the CDS.
    start: usize,
    end_c: usize,
    /// 1 where the window starts with `[BOS]`.
    shift: usize,
    reference: Vec<u32>,
    alt: Vec<u32>,
}

impl Windows {
    fn longest(&self) -> usize {
        self.reference.len().max(self.alt.len())
    }
}

/// The REF and ALT windows of `edit` on the CDS (`cds.0`; `cds.1` with the edit made) at `w`
/// codons; `ends`: whether the CDS starts at the record's first base, and whether it is the
/// whole record.
fn build_windows(
    cds: (&[u8], &[u8]),
    edit: &Edit,
    w: usize,
    ends: (bool, bool),
    tok: &CodonTokenizer,
    model: &GenSlm,
) -> Windows {
    let (cds_seq, alt_cds) = cds;
    let n = cds_seq.len() / 3;
    let a = window_start(edit.codon(), n, w);
    // A vocabulary with [BOS] (genslm71) saw it before a record's first codon in training: a
    // window that starts there starts with it, and the window's codons shift by one.
    let bos: Vec<u32> = tok
        .bos_id()
        .filter(|_| ends.0 && a == 0)
        .into_iter()
        .collect();
    let shift = bos.len();
    // W codons, or more when the change runs past them (a long deletion or MNV), so that the
    // window always holds the whole change and ALT is exactly its bases with the change made.
    let end_c = (a + w.min(n - a))
        .max((edit.at + edit.reference.len()).div_ceil(3))
        .min(n);
    let win_end = 3 * end_c;
    let alt_end = win_end + edit.alt.len() - edit.reference.len();
    let with_bos = |bases: &[u8]| {
        let mut t = bos.clone();
        t.extend(codon_tokens(tok, bases));
        t
    };
    // The same at the end: a window that reaches the end of a record that is the CDS ends as
    // the record did in training, with its last bases (a partial codon as `[UNK]`, which an
    // indel can make or unmake) and `[EOS]` where the vocabulary has one: a stop codon lost or
    // gained there changes how likely the record is to end. A window covering the whole record
    // is then exactly its tokens. Elsewhere, the window's whole codons only.
    let to_end = ends.1 && end_c == n;
    let whole = (
        with_bos(&cds_seq[3 * a..win_end]),
        with_bos(&alt_cds[3 * a..alt_end]),
    );
    let (reference, alt) = if to_end {
        let to_end = |bases: &[u8]| {
            let mut t = with_bos(bases);
            if !bases.len().is_multiple_of(3) {
                t.push(tok.unk_id());
            }
            t.extend(tok.eos_id());
            t
        };
        let ends = (to_end(&cds_seq[3 * a..]), to_end(&alt_cds[3 * a..]));
        // A learned table that holds the whole codons but not the end's tokens keeps the
        // window as it was (the default --window of such a model is its table: every window
        // at a record's end was refused).
        let table = model.cfg.max_position_embeddings;
        let fits = |t: &(Vec<u32>, Vec<u32>)| t.0.len().max(t.1.len()) <= table;
        if model.cfg.position != Position::Learned || fits(&ends) || !fits(&whole) {
            ends
        } else {
            whole
        }
    } else {
        whole
    };
    Windows {
        start: a,
        end_c,
        shift,
        reference,
        alt,
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use burn::tensor::Device;

    use super::*;
    use crate::config::Config;
    use crate::infer::variants::delta::{full_recomputation, prefix_reuse};
    use crate::infer::variants::tests::variant;
    use crate::ops::primitive::{tensor_to_vec, tokens_tensor};
    use crate::tokenizer::VocabKind;

    /// tiny.toml's model with `kind`'s vocabulary (71 rows, room for either), `position` and
    /// a table of `table` positions, and its tokenizer.
    fn tiny_model(
        kind: VocabKind,
        position: Position,
        table: usize,
        seed: u64,
    ) -> (GenSlm, CodonTokenizer) {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
        let mut cfg = Config::load(&path).unwrap().model;
        cfg.vocab = kind;
        cfg.vocab_size = 71;
        cfg.position = position;
        cfg.max_position_embeddings = table;
        let model = GenSlm::init(cfg, seed, &Device::flex()).unwrap();
        (model, CodonTokenizer::new(kind).unwrap())
    }

    /// Σ log p of a record's tokens as training wrote them (`encode`: `[BOS]`, codons, a
    /// partial codon's `[UNK]`, `[EOS]`), by a log-softmax in f64 over the model's logits.
    fn record_ll(model: &GenSlm, tok: &CodonTokenizer, seq: &[u8]) -> f64 {
        let mut ids = Vec::new();
        tok.encode_into(seq, &mut ids);
        tokens_ll(model, &ids)
    }

    /// Σ log p of `ids` from the second on, by a log-softmax in f64 over the model's logits.
    fn tokens_ll(model: &GenSlm, ids: &[u32]) -> f64 {
        let x = tokens_tensor(ids, 1, ids.len(), &model.device);
        let logits = tensor_to_vec(&model.forward(x, 0).unwrap());
        let v = model.cfg.vocab_size;
        (1..ids.len())
            .map(|t| {
                let row: Vec<f64> = logits[(t - 1) * v..t * v]
                    .iter()
                    .map(|&x| x as f64)
                    .collect();
                let max = row.iter().cloned().fold(f64::MIN, f64::max);
                let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
                row[ids[t] as usize] - lse
            })
            .sum()
    }

    /// A window that covers a record which is the CDS is the record's own tokens, with both
    /// vocabularies: Δ equals the difference of the two whole records' log-likelihoods as
    /// training tokenized them — `[EOS]` after a stop codon lost or gained, `[UNK]` for the
    /// partial codon a frameshift leaves or a record ends with (variants windows had neither:
    /// genslm71's `[EOS]` was never scored).
    #[test]
    fn a_window_over_the_whole_record_is_the_record_as_trained() {
        let whole = b"ATGGCTAAACTGGAATTCCGTTACGCTAAACTGGAATTCTAA".to_vec();
        let mut partial = whole.clone();
        partial.extend(b"GC");
        let changes = [
            (41u64, "A", "T"), // stop lost: TAA -> TTA
            (38, "T", "A"),    // TTC -> TAC, missense near the end
            (37, "TT", "T"),   // frameshift by a deletion
            (35, "A", "AGC"),  // frameshift by an insertion
            (21, "TTAC", "T"), // in-frame deletion
            (10, "C", "T"),    // far from the end (the window still covers all)
        ];
        for kind in [VocabKind::Genslm69, VocabKind::Genslm71] {
            let (model, tok) = tiny_model(kind, Position::Rotary, 2048, 7);
            for seq in [&whole, &partial] {
                let n = seq.len() as u64;
                let mut jobs = Vec::new();
                let mut want = Vec::new();
                for &(pos, r, a) in &changes {
                    let v = variant(pos, r, a);
                    let (_, job) = place(&v, seq, (1, n), 64, &tok, &model).unwrap();
                    jobs.push(job.unwrap());
                    let p = pos as usize - 1;
                    let mut alt = seq[..p].to_vec();
                    alt.extend(a.as_bytes());
                    alt.extend(&seq[p + r.len()..]);
                    want.push(record_ll(&model, &tok, &alt) - record_ll(&model, &tok, seq));
                }
                let full = full_recomputation(&model, &jobs).unwrap();
                let fast = prefix_reuse(&model, &jobs, 4).unwrap();
                for (i, w) in want.iter().enumerate() {
                    let what = format!("{kind:?}, {} bases, change {:?}", n, changes[i]);
                    assert!(
                        (full[i].total - w).abs() < 1e-4,
                        "{what}: {} vs {w}",
                        full[i].total
                    );
                    assert!(
                        (fast[i].total - w).abs() < 1e-4,
                        "{what}: {} vs {w}",
                        fast[i].total
                    );
                }
            }
        }
    }

    /// A change whose window would stretch past 8× max(--window, positions) is refused, by
    /// line, as a structural variant; one under the bound is scored.
    #[test]
    fn a_structural_change_is_refused_not_run_for_hours() {
        let (model, tok) = tiny_model(VocabKind::Genslm69, Position::Rotary, 8, 1);
        let seq: Vec<u8> = (0..1200).map(|i| b"ACGT"[(i * 7 + i / 5) % 4]).collect();
        let n = seq.len() as u64;
        let del = |len: usize| {
            let base = |r: std::ops::Range<usize>| String::from_utf8(seq[r].to_vec()).unwrap();
            variant(301, &base(300..301 + len), &base(300..301))
        };
        // Bound: 8 × max(4, 8) = 64 codons.
        let e = place(&del(300), &seq, (1, n), 4, &tok, &model).unwrap_err();
        assert!(
            e.contains("structural variant") && e.contains("(64)"),
            "{e}"
        );
        let (_, job) = place(&del(150), &seq, (1, n), 4, &tok, &model).unwrap();
        assert!(job.unwrap().reference.len() <= 64);
    }

    /// A learned table that holds a window's codons but not the record end's tokens keeps the
    /// window of whole codons (its default --window is the table: every window at a record's
    /// end was refused once [EOS] was added); a table with room takes them.
    #[test]
    fn a_learned_table_full_of_codons_keeps_the_window_at_the_record_end() {
        let seq = b"ATGGCTAAACTGGAATTCCGTTACGCTAAACTGGAATTCTAA";
        let n = seq.len() as u64;
        let stop_lost = variant(41, "A", "T");
        for (table, eos) in [(8, false), (10, true)] {
            let (model, tok) = tiny_model(VocabKind::Genslm71, Position::Learned, table, 3);
            let (_, job) = place(&stop_lost, seq, (1, n), 8, &tok, &model).unwrap();
            let job = job.unwrap();
            assert_eq!(
                job.reference.last() == tok.eos_id().as_ref(),
                eos,
                "table {table}"
            );
            assert!(job.reference.len() <= table && job.alt.len() <= table);
        }
    }

    /// A learned genslm71 model at its default --window (its table) scores a variant near a
    /// record's start, as training saw it: [BOS] and one codon fewer than the table (the window
    /// was one position too long and every such variant was refused). Δ equals the difference
    /// of the two windows' log-likelihoods computed here from their tokens.
    #[test]
    fn a_learned_table_holds_bos_and_one_codon_fewer_at_the_record_start() {
        let seq = b"ATGGCTAAACTGGAATTCCGTTACGCTAAACTGGAATTCTAA";
        let n = seq.len() as u64;
        let table = 8;
        let (model, tok) = tiny_model(VocabKind::Genslm71, Position::Learned, table, 5);
        let (_, job) = place(&variant(5, "C", "T"), seq, (1, n), table, &tok, &model).unwrap();
        let job = job.unwrap();
        let window = |bases: &[u8]| {
            let mut ids = vec![tok.bos_id().unwrap()];
            ids.extend(codon_tokens(&tok, &bases[..3 * (table - 1)]));
            ids
        };
        let mut alt = seq.to_vec();
        alt[4] = b'T';
        assert_eq!((job.start, job.first), (0, 2));
        assert_eq!(job.reference, window(seq));
        assert_eq!(job.alt, window(&alt));
        let want = tokens_ll(&model, &window(&alt)) - tokens_ll(&model, &window(seq));
        let full = full_recomputation(&model, std::slice::from_ref(&job)).unwrap();
        assert!(
            (full[0].total - want).abs() < 1e-4,
            "{} vs {want}",
            full[0].total
        );
        // A window past the start keeps all of the table's codons, without [BOS].
        let (_, later) = place(&variant(35, "A", "T"), seq, (1, n), table, &tok, &model).unwrap();
        let later = later.unwrap();
        assert_eq!(later.reference.len(), table);
        assert_ne!(later.reference[0], tok.bos_id().unwrap());
    }

    /// The same for an in-frame insertion anywhere: at a learned model's default --window
    /// (its table) ALT was 3 bases longer than the table and every insertion was refused. The
    /// window is one codon shorter, REF and ALT alike, and Δ is that of those two windows.
    #[test]
    fn a_learned_table_shortens_the_window_to_hold_an_insertion() {
        let seq = b"ATGGCTAAACTGGAATTCCGTTACGCTAAACTGGAATTCTAA";
        let n = seq.len() as u64;
        let table = 8;
        let (model, tok) = tiny_model(VocabKind::Genslm69, Position::Learned, table, 6);
        // GCA inserted after base 20, inside codon 7 (1-based): 7 codons from codon 4.
        let (ann, job) =
            place(&variant(20, "G", "GGCA"), seq, (1, n), table, &tok, &model).unwrap();
        assert_eq!(ann.unwrap().consequence, Consequence::InframeInsertion);
        let job = job.unwrap();
        let mut alt = seq[..20].to_vec();
        alt.extend(b"GCA");
        alt.extend(&seq[20..]);
        let (want_ref, want_alt) = (
            codon_tokens(&tok, &seq[9..30]),
            codon_tokens(&tok, &alt[9..33]),
        );
        assert_eq!((job.start, job.first), (3, 3));
        assert_eq!((&job.reference, &job.alt), (&want_ref, &want_alt));
        let want = tokens_ll(&model, &want_alt) - tokens_ll(&model, &want_ref);
        let full = full_recomputation(&model, std::slice::from_ref(&job)).unwrap();
        let fast = prefix_reuse(&model, std::slice::from_ref(&job), 4).unwrap();
        assert!(
            (full[0].total - want).abs() < 1e-4,
            "{} vs {want}",
            full[0].total
        );
        assert!(
            (fast[0].total - want).abs() < 1e-4,
            "{} vs {want}",
            fast[0].total
        );
        // A rotary model keeps the window asked for (it extrapolates past its table).
        let (rotary, _) = tiny_model(VocabKind::Genslm69, Position::Rotary, table, 6);
        let (_, job) = place(&variant(20, "G", "GGCA"), seq, (1, n), table, &tok, &rotary).unwrap();
        assert_eq!(job.unwrap().alt.len(), table + 1);
    }
}
