//! The protein change of an indel named as HGVS writes it, in the one-letter short form that
//! variant lists use (`Y144del`, `H69_V70del`, `R214_D215insEPE`, `K4dup`, `L5_D6delinsH`,
//! `E484Kfs*12`, `*67Qext*?`), so a row can be matched against a published mutation by its name.
//!
//! HGVS describes the change between the two proteins, not between the alleles: the same
//! deletion written at any base of a repeat names the same residues, the last ones (the 3′
//! rule). So the residues are compared, not the codons: the shared start is skipped first, which
//! puts the change as far towards the C-terminus as the proteins allow, then the shared end.
//! Residues are read from the CDS codon by codon on demand — a name needs only the residues
//! around the change, and a frameshift's as far as ALT's new stop — so neither protein is
//! translated or copied whole.

use super::code::{translate, Edit};

/// How far past a change a new stop is looked for, in codons.
const READ_THROUGH: usize = 3000;

/// The reference protein and the edited one, residue by residue. Residue `i` is codon `i`'s
/// amino acid (`*` for a stop), `None` past the last whole codon. ALT reads on into `after`,
/// the record's bases past the CDS (`--cds` on a genome), where a stop that a change removed
/// is read through: its new stop is found there, as VEP finds it.
struct Proteins<'a> {
    cds: &'a [u8],
    after: &'a [u8],
    edit: &'a Edit,
}

impl Proteins<'_> {
    fn reference(&self, i: usize) -> Option<u8> {
        self.cds.get(3 * i..3 * i + 3).map(translate)
    }

    /// Base `j` of the edited CDS (`on`: and of the record past it).
    fn alt_base(&self, j: usize, on: bool) -> Option<u8> {
        let e = self.edit;
        if j < e.at {
            self.cds.get(j).copied()
        } else if j < e.at + e.alt.len() {
            Some(e.alt[j - e.at])
        } else {
            let k = j - e.alt.len() + e.reference.len();
            match (self.cds.get(k), on) {
                (Some(&b), _) => Some(b),
                (None, true) => self.after.get(k - self.cds.len()).copied(),
                (None, false) => None,
            }
        }
    }

    /// ALT's residue `i` within the CDS, compared with REF's.
    fn alt(&self, i: usize) -> Option<u8> {
        self.alt_codon(i, false)
    }

    /// ALT's residue `i`, read on into the record past the CDS: only where a new stop is looked
    /// for. Compared with REF's, which ends with the CDS, it named a change in a CDS without a
    /// stop by residues REF does not have (`?4del`).
    fn alt_on(&self, i: usize) -> Option<u8> {
        self.alt_codon(i, true)
    }

    fn alt_codon(&self, i: usize, on: bool) -> Option<u8> {
        let b = |k| self.alt_base(3 * i + k, on);
        Some(translate(&[b(0)?, b(1)?, b(2)?]))
    }

    /// The first residue from `from` on where the proteins differ; `None` when both sequences
    /// end first, or both keep the CDS's last codon as its stop (what follows the protein's end
    /// is no change of it). A stop inside the CDS that both share is read through, as every
    /// name here reads the CDS: ending there named an edit just after it `=`, and the same edit
    /// written one base to the right by what it changes.
    fn first_difference(&self, from: usize) -> Option<usize> {
        let mut i = from;
        loop {
            match (self.reference(i), self.alt(i)) {
                (Some(b'*'), Some(b'*')) if self.reference(i + 1).is_none() => return None,
                (Some(r), Some(a)) if r == a => {}
                (None, None) => return None,
                _ => return Some(i),
            }
            i += 1;
        }
    }

    /// The first stop in ALT from residue `from` on; `None` (named `*?`) where ALT's sequence
    /// ends first, where a codon holding an `N` comes first (it may be the stop), or past
    /// [`READ_THROUGH`] codons (a record without stops in the new frame was read to its end for
    /// every variant: 10,000 frameshifts on a 5 Mb record took 6 minutes).
    fn alt_stop(&self, from: usize) -> Option<usize> {
        for k in from..from.saturating_add(READ_THROUGH) {
            match self.alt_on(k)? {
                b'*' => return Some(k),
                b'X' => return None,
                _ => {}
            }
        }
        None
    }

    /// `XNYfs*M` from residue `a` (REF's `X`, ALT's `Y`), `M` counting `a` as 1 to ALT's
    /// stop (`?` when ALT's sequence ends first); `XNfs` when ALT has no whole codon at `a`.
    fn shifted(&self, a: usize) -> String {
        let here = residue(self.reference(a), a);
        let Some(x) = self.alt(a) else {
            return format!("{here}fs");
        };
        let to = self
            .alt_stop(a)
            .map_or("?".to_string(), |s| (s - a + 1).to_string());
        format!("{here}{}fs*{to}", x as char)
    }

    /// `*N Xext*M`: the reference stop at `t` read through, ALT's next stop `M` residues on
    /// (`?` where [`Proteins::alt_stop`] finds none); `=` where ALT, read on into the record,
    /// has a stop there after all (the stop's last base deleted, the record's next base an A).
    fn extension(&self, t: usize) -> String {
        if self.alt_on(t) == Some(b'*') {
            return "=".into();
        }
        let x = self.alt_on(t).map_or('?', char::from);
        let to = self
            .alt_stop(t + 1)
            .map_or("?".to_string(), |s| (s - t).to_string());
        format!("*{}{x}ext*{to}", t + 1)
    }
}

/// One residue: letter and 1-based number (`?` where a sequence has no whole codon).
fn residue(aa: Option<u8>, i: usize) -> String {
    format!("{}{}", aa.map_or('?', char::from), i + 1)
}

/// Letters of a stretch of residues.
fn letters(aa: &[Option<u8>]) -> String {
    aa.iter().map(|a| a.map_or('?', char::from)).collect()
}

/// What an in-frame indel does to the protein, as its name says it: the consequence follows
/// from the name (they were decided apart, and 200 of 23,000 random rows contradicted each
/// other: `K11*` labelled inframe_deletion, `*38Lext*3` nonsense).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// `=`: nothing translated changes.
    Unchanged,
    /// The protein ends sooner: a name ending in `*`.
    Truncated,
    /// The stop is deleted or replaced: an extension, or a deletion through the stop.
    StopLost,
    /// `M1?`.
    StartLost,
    /// Residues added, removed or replaced (an insertion before the stop included).
    Changed,
}

/// The protein change of an in-frame indel: `edit` adds or removes a multiple of 3 bases and
/// touches REF codons `first..end`.
pub fn inframe(seq: (&[u8], &[u8]), edit: &Edit, (first, end): (usize, usize)) -> (String, Effect) {
    let name = inframe_name(seq, edit, (first, end));
    let effect = match name.as_str() {
        "=" => Effect::Unchanged,
        "M1?" => Effect::StartLost,
        n if n.ends_with('*') => Effect::Truncated,
        n if n.contains("fs") => Effect::StopLost,
        // An extension by an insertion before the stop keeps the stop codon (`*11Lext*1`).
        n if n.contains("ext") && !edit.reference.is_empty() => Effect::StopLost,
        _ => Effect::Changed,
    };
    (name, effect)
}

fn inframe_name((cds, after): (&[u8], &[u8]), edit: &Edit, (first, end): (usize, usize)) -> String {
    let p = Proteins { cds, after, edit };
    let Some(a) = p.first_difference(first) else {
        return "=".into();
    };
    if a == 0 && p.reference(0) == Some(b'M') {
        // HGVS: a change of the start codon leaves the protein unknown.
        return "M1?".into();
    }
    // Beyond the touched codons, ALT's residues are REF's moved by `d`; past a shared start that
    // ran beyond them (a repeat), the changed stretch starts at `a`.
    let d = (edit.alt.len() as i64 - edit.reference.len() as i64) / 3;
    let mut i_end = end.max(a + (-d).max(0) as usize);
    let mut j_end = (i_end as i64 + d) as usize;
    while i_end > a && j_end > a && p.reference(i_end - 1).is_some() && {
        p.reference(i_end - 1) == p.alt(j_end - 1)
    } {
        i_end -= 1;
        j_end -= 1;
    }
    let mut deleted: Vec<_> = (a..i_end).map(|i| p.reference(i)).collect();
    let mut inserted: Vec<_> = (a..j_end).map(|i| p.alt(i)).collect();
    let range = |from: usize, to: usize| {
        let one = residue(p.reference(from), from);
        if to - from == 1 {
            one
        } else {
            format!("{one}_{}", residue(p.reference(to - 1), to - 1))
        }
    };
    let n = inserted.len();
    if deleted.is_empty() && a >= n && (a - n..a).map(|i| p.reference(i)).eq(inserted.clone()) {
        // A copy of the residues before it, the stop's neighbours included (`C4dup`, not an
        // extension).
        return format!("{}dup", range(a - n, a));
    }
    if p.reference(a) == Some(b'*') {
        // The first change is at the stop (an insertion before it, or the stop replaced).
        return p.extension(a);
    }
    if p.alt(a) == Some(b'*') && p.reference(a).is_some() && !inserted.is_empty() {
        // The first changed residue is a new stop: a nonsense change. (A pure deletion before
        // the stop, which only brings REF's own stop forward, stays a `del`, as VEP's
        // inframe_deletion has it: named `W10*`, 188 of 23,000 random rows contradicted their
        // label.)
        return format!("{}*", residue(p.reference(a), a));
    }
    let stop = |v: &[Option<u8>]| v.iter().position(|&x| x == Some(b'*'));
    match (stop(&deleted), stop(&inserted)) {
        // A stop in both: it is kept, and what follows it is not translated (`G4P`; it was
        // named as a frameshift).
        (Some(d), Some(i)) => {
            deleted.truncate(d);
            inserted.truncate(i);
        }
        // HGVS: a deletion from before the stop through it is named as a frameshift.
        (Some(_), None) => return p.shifted(a),
        // Nothing after the new stop is translated.
        (None, Some(i)) => inserted.truncate(i + 1),
        (None, None) => {}
    }
    let ins = letters(&inserted);
    if let ([_], [x]) = (&deleted[..], &inserted[..]) {
        // One residue for another: a substitution.
        return format!("{}{}", residue(p.reference(a), a), letters(&[*x]));
    }
    let i_end = a + deleted.len();
    if deleted.is_empty() {
        if a >= 1 && p.reference(a).is_some() {
            return format!(
                "{}_{}ins{ins}",
                residue(p.reference(a - 1), a - 1),
                residue(p.reference(a), a)
            );
        }
        // After the last residue of a CDS without a stop (or before the first): the one
        // neighbour there is replaced by itself and the insertion.
        let (r, with) = if a == 0 {
            (0, [ins.as_str(), &letters(&[p.reference(0)])].concat())
        } else {
            (
                a - 1,
                [letters(&[p.reference(a - 1)]).as_str(), &ins].concat(),
            )
        };
        return format!("{}delins{with}", residue(p.reference(r), r));
    }
    if inserted.is_empty() {
        format!("{}del", range(a, i_end))
    } else {
        format!("{}delins{ins}", range(a, i_end))
    }
}

/// The protein change of a frameshift from codon `first` on: the first residue that differs,
/// what ALT reads there and the length of ALT's new frame up to its stop (`fs*?` where
/// [`Proteins::alt_stop`] finds none), e.g. `E484Kfs*12`.
pub fn frameshift((cds, after): (&[u8], &[u8]), edit: &Edit, first: usize) -> String {
    let p = Proteins { cds, after, edit };
    let Some(a) = p.first_difference(first) else {
        return "=".into();
    };
    match (p.reference(a), p.alt(a)) {
        (Some(b'M'), _) if a == 0 => "M1?".into(),
        // Past REF's last whole codon (a CDS without a stop): no residue to name.
        (None, _) => "?".into(),
        (Some(b'*'), _) => p.extension(a),
        (_, Some(b'*')) => format!("{}*", residue(p.reference(a), a)),
        _ => p.shifted(a),
    }
}

/// A substitution's read-through of the stop at residue `t`: `*67Qext*12`.
pub fn stop_lost((cds, after): (&[u8], &[u8]), edit: &Edit, t: usize) -> String {
    Proteins { cds, after, edit }.extension(t)
}

/// Bases `3·first ..` of the edited CDS, `len` of them (`None` past its end).
pub fn alt_bases(cds: &[u8], edit: &Edit, first: usize, len: usize) -> Option<Vec<u8>> {
    let p = Proteins {
        cds,
        after: &[],
        edit,
    };
    (3 * first..3 * first + len)
        .map(|j| p.alt_base(j, false))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ATG AAA AAA AAA CTG GAT TAC CAT GTT TGG TAA: M K K K L D Y H V W * (residues 1–11).
    const CDS: &[u8] = b"ATGAAAAAAAAACTGGATTACCATGTTTGGTAA";

    /// `reference` → `alt` at 0-based CDS base `at` (VCF style: untrimmed alleles allowed) on
    /// `cds` and the bases after it, named as `annotate` names it.
    fn name_on(seq: (&[u8], &[u8]), at: usize, reference: &str, alt: &str) -> String {
        let e = Edit::trimmed(at, reference.as_bytes(), alt.as_bytes());
        if (e.alt.len() as i64 - e.reference.len() as i64) % 3 == 0 {
            let end = (e.at + e.reference.len().max(1) - 1) / 3 + 1;
            inframe(seq, &e, (e.codon(), end)).0
        } else {
            frameshift(seq, &e, e.codon())
        }
    }

    fn name(at: usize, reference: &str, alt: &str) -> String {
        name_on((CDS, &[]), at, reference, alt)
    }

    /// Each name worked out by hand from the residues above (and the frames written out in the
    /// comments), as HGVS's recommendations for protein deletions, duplications, insertions,
    /// deletion-insertions, frameshifts and extensions name them.
    #[test]
    fn indels_are_named_as_hgvs_names_them() {
        for (at, r, a, want) in [
            // Any one AAA of the three deleted: the last K (3′ rule).
            (3, "AAAA", "A", "K4del"),
            (2, "GAAA", "G", "K4del"),
            (8, "AAAAC", "AC", "K4del"),
            // Two whole codons: CTG GAT.
            (11, "ACTGGAT", "A", "L5_D6del"),
            // Across a codon boundary: CTG GAT → C[TGG]AT = CAT (H).
            (12, "CTGG", "C", "L5_D6delinsH"),
            // An AAA inserted anywhere in the run: one more K after the last.
            (11, "A", "AAAA", "K4dup"),
            (2, "G", "GAAA", "K4dup"),
            // AAA CTG (K L) inserted after L5: a copy of residues 4–5.
            (14, "G", "GAAACTG", "K4_L5dup"),
            // GGC (G) between L5 and D6.
            (14, "G", "GGGC", "L5_D6insG"),
            // GGC TAA (G, stop) between L5 and D6: nothing after the stop counts.
            (14, "G", "GGGCTAA", "L5_D6insG*"),
            // TAA right after L5: D6 becomes the stop.
            (14, "G", "GTAA", "D6*"),
            // The stop codon deleted: the CDS ends right after, so ALT's new stop is unknown.
            (29, "GTAA", "G", "*11?ext*?"),
            // W10 and the stop deleted together: from before the stop through it, a
            // frameshift (ALT has no codon after V9).
            (26, "TTGGTAA", "T", "W10fs"),
            // W10 deleted: V9 is followed by REF's own stop, brought forward: a deletion.
            (26, "TTGG", "T", "W10del"),
            // GGC (G) inserted before the stop: the protein extended by one residue.
            (29, "G", "GGGC", "*11Gext*1"),
            // A copy of W10 before the stop: a duplication, not an extension.
            (29, "G", "GTGG", "W10dup"),
            // The stop replaced: TAA → TTA TAG (L, stop).
            (30, "TAA", "TTATAG", "*11Lext*1"),
            // Edits that keep the last codon a stop change nothing translated: TAA TAA.
            (29, "G", "GTAA", "="),
            (30, "T", "TAAT", "="),
            (31, "A", "AAAT", "="),
            (29, "G", "GTAGTAA", "="),
            // The stop kept inside a delins: GTT TGG TAA → GTT CCC TAA GGG: W10P.
            (26, "TTGGTAA", "TCCCTAAGGG", "W10P"),
            // The start codon deleted: M1? (HGVS: the protein is unknown).
            (0, "ATGA", "A", "M1?"),
            // D6's T deleted: GAT ACC ATG TTT GGT AA: D T M F G, the shifted frame ends
            // before a stop.
            (16, "AT", "A", "Y7Tfs*?"),
            // One A deleted from the run: ATG AAA AAA AAC TGG ATT ACC ATG TTT GGT AA.
            (3, "AA", "A", "K4Nfs*?"),
            // One base inserted after ATG: ATG TAA ...: the first changed residue is a stop.
            (2, "G", "GT", "K2*"),
            // A C inserted after CAT (H8): CAT CGT TTG GTA A: R L V, then the CDS ends.
            (23, "T", "TC", "V9Rfs*?"),
            // The stop codon's T deleted: ... TGG AA: the stop read through, W unchanged.
            (30, "T", "", "*11?ext*?"),
        ] {
            // A deletion of the anchor itself (empty ALT) is not VCF; build it directly.
            let got = if a.is_empty() {
                let e = Edit {
                    at,
                    reference: r.as_bytes().to_vec(),
                    alt: vec![],
                };
                frameshift((CDS, &[]), &e, e.codon())
            } else {
                name(at, r, a)
            };
            assert_eq!(got, want, "{at} {r} {a}");
        }
    }

    /// An edit next to a stop both proteins keep is named by what it changes after it, as the
    /// same edit written one base to the right is: ATG AAA TAG TCG ATT TAA (M K * S I *).
    #[test]
    fn a_shared_stop_is_read_through() {
        let cds = b"ATGAAATAGTCGATTTAA";
        for (at, r, a, want) in [
            (7, "AGTC", "A", "S4del"),
            (8, "GTCG", "G", "S4del"),
            (7, "A", "AG", "S4Vfs*?"),
            (8, "G", "GG", "S4Vfs*?"),
        ] {
            let got = name_on((cds, &[]), at, r, a);
            assert_eq!(got, want, "{at} {r} {a}");
        }
    }

    /// A frameshift whose new frame meets a stop: counted from the first changed residue (1)
    /// to the stop, as HGVS's `fs*N` counts.
    #[test]
    fn a_frameshift_counts_to_its_new_stop() {
        // ATG GCT AGC TTA AGG: M A S L R; a G inserted after ATG: ATG GGC TAG: M G *.
        let cds = b"ATGGCTAGCTTAAGG";
        let e = Edit::trimmed(2, b"G", b"GG");
        assert_eq!(frameshift((cds, &[]), &e, e.codon()), "A2Gfs*2");
        // A T inserted after GCT: ATG GCT TAG: the stop is the first change.
        let e = Edit::trimmed(5, b"T", b"TT");
        assert_eq!(frameshift((cds, &[]), &e, e.codon()), "S3*");
        // The stop read through by a frameshift: TGG TAA CCC → TGG TAC ACC C.
        let cds = b"ATGTGGTAACCC";
        let e = Edit::trimmed(7, b"A", b"AC");
        assert_eq!(frameshift((cds, &[]), &e, e.codon()), "*3Yext*?");
    }

    /// Past the CDS, ALT reads on into the record: a removed stop's successor is found there.
    /// Only there: a CDS without a stop is compared with ALT within the CDS, as REF ends with it.
    #[test]
    fn a_read_through_stop_finds_the_next_one_in_the_record() {
        // ATG AAA AAA, then AAA TAA in the record: one AAA deleted is K3del, not `?4del`.
        assert_eq!(name_on((b"ATGAAAAAA", b"AAATAA"), 2, "GAAA", "G"), "K3del");
        // The stop's last base deleted, the record's next base an A: still TAA, nothing changes.
        assert_eq!(name_on((b"ATGTGGTAA", b"AGG"), 7, "AA", "A"), "=");
        // ATG TGG TAA, then CAG TGA in the record: the stop deleted gives M W Q *.
        let cds = b"ATGTGGTAA";
        assert_eq!(name_on((cds, &[]), 5, "GTAA", "G"), "*3?ext*?");
        assert_eq!(name_on((cds, b"CAGTGA"), 5, "GTAA", "G"), "*3Qext*1");
        // A base inserted in the stop: TGG TA[C]A CAG TGA → TAC ACA GTG A: no stop before the
        // record ends.
        assert_eq!(name_on((cds, b"CAGTGA"), 7, "A", "AC"), "*3Yext*?");
        // TGG TAC ACA TAA: the new stop two residues past the old one.
        assert_eq!(name_on((cds, b"CATAA"), 7, "A", "AC"), "*3Yext*2");
        // An unknown codon before it: it may be the stop, so the distance is unknown.
        assert_eq!(name_on((cds, b"CANNNTAA"), 7, "A", "AC"), "*3Yext*?");
        // No stop within READ_THROUGH codons: unknown, not a scan to the record's end.
        let far = "GCA".repeat(READ_THROUGH + 1) + "TAA";
        assert_eq!(name_on((cds, far.as_bytes()), 5, "GTAA", "G"), "*3Aext*?");
        let near = "GCA".repeat(READ_THROUGH) + "TAA";
        let want = format!("*3Aext*{READ_THROUGH}");
        assert_eq!(name_on((cds, near.as_bytes()), 5, "GTAA", "G"), want);
    }
}
