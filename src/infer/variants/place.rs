//! Placing a variant on its record: checking REF against the reference, deciding whether the
//! change lies inside the CDS, annotating it, and building its REF and ALT windows (the job
//! that `delta` scores).

use crate::config::Position;
use crate::model::GenSlm;
use crate::tokenizer::CodonTokenizer;

use super::annotate::{annotate, Annotation, Consequence, Edit};
use super::delta::{window_start, Job};
use super::vcf::Variant;

fn codon_tokens(tok: &CodonTokenizer, bases: &[u8]) -> Vec<u32> {
    bases
        .chunks_exact(3)
        .map(|c| tok.codon_to_id(&[c[0], c[1], c[2]]))
        .collect()
}

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
    let mut ann = annotate(cds_seq, &edit);
    if edit.codon() >= n || edit.at + edit.reference.len() > 3 * n {
        // A change that reaches the CDS's incomplete last codon: no whole codons to score.
        ann.consequence = Consequence::Incomplete;
        return Ok((Some(ann), None));
    }
    let c = edit.codon();
    let a = window_start(c, n, w);
    // W codons, or more when the change runs past them (a long deletion or MNV), so that the
    // window always holds the whole change and ALT is exactly its bases with the change made.
    let end_c = (a + w.min(n - a))
        .max((edit.at + edit.reference.len()).div_ceil(3))
        .min(n);
    let win_end = 3 * end_c;
    let alt_cds = edit.apply(cds_seq);
    let alt_end = win_end + edit.alt.len() - edit.reference.len();
    // A vocabulary with [BOS] (genslm71) saw it before a record's first codon in training: a
    // window that starts there starts with it, and the window's codons shift by one.
    let bos: Vec<u32> = tok
        .bos_id()
        .filter(|_| s == 0 && a == 0)
        .into_iter()
        .collect();
    let shift = bos.len();
    let with_bos = |bases: &[u8]| {
        let mut t = bos.clone();
        t.extend(codon_tokens(tok, bases));
        t
    };
    let reference = with_bos(&cds_seq[3 * a..win_end]);
    let alt = with_bos(&alt_cds[3 * a..alt_end]);
    let longest = reference.len().max(alt.len());
    let table = model.cfg.max_position_embeddings;
    if model.cfg.position == Position::Learned && longest > table {
        // The change itself (REF or ALT, in codons) may be what no window can hold.
        let change = edit.reference.len().max(edit.alt.len()).div_ceil(3);
        let fix = if change + shift >= table {
            format!("the change alone spans {change} codons, so no --window holds it")
        } else {
            "lower --window".into()
        };
        return Err(format!(
            "the variant's window is {longest} codons long, more than the model's {table} \
             learned positions; {fix}"
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
