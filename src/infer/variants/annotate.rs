//! What a variant does to the protein: the consequence classes `genslm variants` reports and
//! the codons and amino acids it changes.

use super::code::{translate, Edit};
use super::hgvs;

/// The effect class of a variant on a coding sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Consequence {
    Synonymous,
    Missense,
    /// A stop codon where there was none (stop_gained).
    Nonsense,
    StopLost,
    /// A change that leaves the protein and its stop as they were (VEP's
    /// stop_retained_variant): an indel named `=`, or a stop codon for another.
    StopRetained,
    StartLost,
    Frameshift,
    InframeInsertion,
    InframeDeletion,
    /// A codon the change touches is not a whole A/C/G/T codon (an `N`, the CDS's last
    /// incomplete codon).
    Incomplete,
    /// The variant is not (entirely) inside the CDS.
    OutsideCds,
}

impl Consequence {
    pub fn name(self) -> &'static str {
        match self {
            Consequence::Synonymous => "synonymous",
            Consequence::Missense => "missense",
            Consequence::Nonsense => "nonsense",
            Consequence::StopLost => "stop_lost",
            Consequence::StopRetained => "stop_retained",
            Consequence::StartLost => "start_lost",
            Consequence::Frameshift => "frameshift",
            Consequence::InframeInsertion => "inframe_insertion",
            Consequence::InframeDeletion => "inframe_deletion",
            Consequence::Incomplete => "incomplete_codon",
            Consequence::OutsideCds => "outside_cds",
        }
    }
}

/// The protein-level reading of a substitution or indel in `cds`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Annotation {
    pub consequence: Consequence,
    /// The codons the change touches in REF, and the same stretch of ALT (a frameshift: the
    /// first codon touched and ALT's codon there).
    pub ref_codons: String,
    pub alt_codons: String,
    /// One-letter change with 1-based codon numbers, e.g. `N501Y`, `K417N`, `D614G`; an
    /// indel's as HGVS names it (`Y144del`, `R214_D215insEPE`, `E484Kfs*12`: see the `hgvs` module).
    pub aa_change: String,
    /// 0-based codons the change touches (REF side).
    pub codons: std::ops::Range<usize>,
}

/// Annotates `edit` on `cds` (upper-case bases, read from its first base).
pub fn annotate(cds: &[u8], edit: &Edit) -> Annotation {
    annotate_in((cds, &[]), edit)
}

/// [`annotate`] with `after`, the record's bases past the CDS, where a change that removes the
/// stop finds ALT's next one (`*67Qext*12`; `ext*?` where the record ends first).
pub fn annotate_in((cds, after): (&[u8], &[u8]), edit: &Edit) -> Annotation {
    let first = edit.codon();
    let end_base = edit.at + edit.reference.len().max(1);
    let last = (end_base - 1) / 3;
    let codons = first..last + 1;
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let ref_span = &cds[3 * first..(3 * (last + 1)).min(cds.len())];
    let aa = |c: &[u8]| c.chunks(3).map(translate).collect::<Vec<u8>>();
    if !edit.is_substitution() {
        let diff = edit.alt.len() as i64 - edit.reference.len() as i64;
        let alt_text = |len: i64| {
            let len = usize::try_from(len).unwrap_or(0);
            text(&hgvs::alt_bases(cds, edit, first, len).unwrap_or_default())
        };
        // The consequence follows from the protein name: a change that leaves the protein and
        // its stop as they were (`=`) is stop_retained, however the VCF places it (a frameshift
        // after the stop was "frameshift", beside a name saying nothing changed).
        if diff % 3 != 0 {
            let aa_change = hgvs::frameshift((cds, after), edit, first);
            return Annotation {
                consequence: match aa_change == "=" {
                    true => Consequence::StopRetained,
                    false => Consequence::Frameshift,
                },
                ref_codons: text(&cds[3 * first..(3 * first + 3).min(cds.len())]),
                alt_codons: alt_text(3),
                aa_change,
                codons,
            };
        }
        let (aa_change, effect) = hgvs::inframe((cds, after), edit, (first, last + 1));
        let consequence = match effect {
            hgvs::Effect::Unchanged => Consequence::StopRetained,
            hgvs::Effect::Truncated => Consequence::Nonsense,
            hgvs::Effect::StopLost => Consequence::StopLost,
            hgvs::Effect::StartLost => Consequence::StartLost,
            hgvs::Effect::Changed if diff > 0 => Consequence::InframeInsertion,
            hgvs::Effect::Changed => Consequence::InframeDeletion,
        };
        return Annotation {
            consequence,
            ref_codons: text(ref_span),
            alt_codons: alt_text(ref_span.len() as i64 + diff),
            aa_change,
            codons,
        };
    }
    let mut alt_span = ref_span.to_vec();
    let off = edit.at - 3 * first;
    alt_span[off..off + edit.alt.len()].copy_from_slice(&edit.alt);
    let (ra, aa_alt) = (aa(ref_span), aa(&alt_span));
    let consequence =
        if !ref_span.len().is_multiple_of(3) || ra.contains(&b'X') || aa_alt.contains(&b'X') {
            Consequence::Incomplete
        } else if ra
            .iter()
            .zip(&aa_alt)
            .any(|(r, a)| *r != b'*' && *a == b'*')
        {
            Consequence::Nonsense
        } else if ra
            .iter()
            .zip(&aa_alt)
            .any(|(r, a)| *r == b'*' && *a != b'*')
        {
            Consequence::StopLost
        } else if first == 0 && ref_span.starts_with(b"ATG") && aa_alt[0] != b'M' {
            Consequence::StartLost
        } else if ra == aa_alt && ra.contains(&b'*') {
            // A stop codon for another (TAA → TAG): VEP's stop_retained_variant.
            Consequence::StopRetained
        } else if ra == aa_alt {
            Consequence::Synonymous
        } else {
            Consequence::Missense
        };
    let aa_change = ra
        .iter()
        .zip(&aa_alt)
        .enumerate()
        .filter(|(i, (r, a))| r != a || ra == aa_alt && *i == 0)
        .map(|(i, (r, a))| match (*r, *a) {
            // A stop read through: where ALT's next stop is, as HGVS names it.
            (b'*', a) if a != b'*' && a != b'X' => hgvs::stop_lost((cds, after), edit, first + i),
            (r, a) => format!("{}{}{}", r as char, first + i + 1, a as char),
        })
        .collect::<Vec<_>>()
        .join(",");
    Annotation {
        consequence,
        ref_codons: text(ref_span),
        alt_codons: text(&alt_span),
        aa_change,
        codons,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NCBI's table 1 as it is published: amino acids for codons in T, C, A, G order of the
    /// first, second and third base — a representation independent of `translate`'s.
    const TABLE1: &[u8; 64] = b"FFLLSSSSYY**CC*WLLLLPPPPHHQQRRRRIIIMTTTTNNKKSSRRVVVVAAAADDEEGGGG";
    const TCAG: [u8; 4] = *b"TCAG";

    fn table(codon: &[u8]) -> u8 {
        let i = |b| TCAG.iter().position(|&x| x == b).unwrap();
        TABLE1[16 * i(codon[0]) + 4 * i(codon[1]) + i(codon[2])]
    }

    /// Every single-base substitution of every codon (64 × 3 positions × 3 bases = 576),
    /// placed as codon 2 of a CDS, against the published table.
    #[test]
    fn all_576_single_base_substitutions_follow_the_standard_code() {
        let mut seen = 0;
        for &a in &TCAG {
            for &b in &TCAG {
                for &c in &TCAG {
                    let codon = [a, b, c];
                    assert_eq!(translate(&codon), table(&codon));
                    for pos in 0..3 {
                        for &base in TCAG.iter().filter(|&&x| x != codon[pos]) {
                            let mut cds = b"GCT".to_vec();
                            cds.extend_from_slice(&codon);
                            cds.extend_from_slice(b"GCT");
                            let edit = Edit::trimmed(3 + pos, &[codon[pos]], &[base]);
                            let ann = annotate(&cds, &edit);
                            let mut alt = codon;
                            alt[pos] = base;
                            let (r, x) = (table(&codon), table(&alt));
                            let want = if r != b'*' && x == b'*' {
                                Consequence::Nonsense
                            } else if r == b'*' && x != b'*' {
                                Consequence::StopLost
                            } else if r == x && r == b'*' {
                                Consequence::StopRetained
                            } else if r == x {
                                Consequence::Synonymous
                            } else {
                                Consequence::Missense
                            };
                            assert_eq!(ann.consequence, want, "{codon:?} {pos} {base}");
                            assert_eq!(ann.ref_codons.as_bytes(), codon);
                            assert_eq!(ann.alt_codons.as_bytes(), alt);
                            // A stop read through names where ALT's next one is: none
                            // before this CDS ends.
                            let want = match (r, x) {
                                (b'*', x) if x != b'*' => format!("*2{}ext*?", x as char),
                                _ => format!("{}2{}", r as char, x as char),
                            };
                            assert_eq!(ann.aa_change, want);
                            seen += 1;
                        }
                    }
                }
            }
        }
        assert_eq!(seen, 576);
    }

    #[test]
    fn indels_mnvs_and_the_start_codon() {
        let cds = b"ATGAAACCCGGGTAA";
        // VCF-anchored insertion of one base after CDS base 4 (0-based 3): frameshift at codon 2.
        let ins = Edit::trimmed(3, b"A", b"AT");
        assert_eq!(
            (ins.at, ins.reference.len(), ins.alt.as_slice()),
            (4, 0, &b"T"[..])
        );
        assert_eq!(annotate(cds, &ins).consequence, Consequence::Frameshift);
        let del3 = Edit::trimmed(5, b"ACCC", b"A");
        let a = annotate(cds, &del3);
        assert_eq!(
            (a.consequence, a.codons.clone()),
            (Consequence::InframeDeletion, 2..3)
        );
        assert_eq!(
            annotate(cds, &Edit::trimmed(5, b"A", b"ATTT")).consequence,
            Consequence::InframeInsertion
        );
        // In-frame indels that gain or lose a stop codon, or lose the start codon (by hand:
        // ATG AAA CCC GGG TAA).
        for (at, reference, alt, want) in [
            (5, &b"A"[..], &b"ATAA"[..], Consequence::Nonsense), // AAA TAA CCC
            (4, b"A", b"ATAG", Consequence::InframeInsertion),   // AAT AGA: no stop in frame
            (11, b"GTAA", b"G", Consequence::StopLost),          // the stop deleted
            (0, b"ATGA", b"A", Consequence::StartLost),          // ATG deleted: AAA first
            (2, b"GAAA", b"G", Consequence::InframeDeletion),    // ATG kept, AAA deleted
            (11, b"G", b"GTAA", Consequence::StopRetained),      // GGG TAA TAA: one more stop
            (12, b"T", b"TAAT", Consequence::StopRetained),      // T[AAT]AA: the same
            (8, b"C", b"CTAA", Consequence::Nonsense),           // CCC TAA GGG TAA
            (10, b"GG", b"GGTAA", Consequence::StopRetained),    // left-normalised: GG[TAA]G TAA
            (11, b"G", b"GTAAC", Consequence::StopRetained),     // GGG TAA CTA A: shifted after it
        ] {
            let got = annotate(cds, &Edit::trimmed(at, reference, alt)).consequence;
            assert_eq!(got, want, "{at} {reference:?} {alt:?}");
        }
        // The stop read through: ALT's next stop is looked for past the CDS, in the record.
        let stop = Edit::trimmed(12, b"T", b"C");
        assert_eq!(annotate(cds, &stop).aa_change, "*5Qext*?");
        let a = annotate_in((cds, b"GGGTAG"), &stop);
        assert_eq!(
            (a.consequence, a.aa_change.as_str()),
            (Consequence::StopLost, "*5Qext*2")
        );
        // An MNV over two codons: AAA CCC -> AAG GCC (K2K, P3A).
        let mnv = annotate(cds, &Edit::trimmed(5, b"AC", b"GG"));
        assert_eq!(
            (mnv.consequence, mnv.aa_change.as_str()),
            (Consequence::Missense, "P3A")
        );
        assert_eq!(mnv.codons, 1..3);
        assert_eq!(
            annotate(cds, &Edit::trimmed(2, b"G", b"A")).consequence,
            Consequence::StartLost
        );
        assert_eq!(
            annotate(b"ATGNAA", &Edit::trimmed(4, b"A", b"G")).consequence,
            Consequence::Incomplete
        );
        assert_eq!(
            Edit::trimmed(3, b"A", b"AT").apply(cds),
            b"ATGATAACCCGGGTAA"
        );
    }
}
