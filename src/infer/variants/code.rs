//! The standard genetic code and a variant as an edit of a CDS: what both the consequence
//! classes (`annotate`) and the protein names (`hgvs`) read.
//!
//! Alleles are trimmed first: VCF indels carry an anchor base that REF and ALT share (REF `A`,
//! ALT `AT` at POS inserts a `T` after POS), so the shared prefix and suffix are removed before
//! deciding which codon changes and how.

/// The amino acid (one letter; `*` = stop) of a codon of upper-case A/C/G/T, or `X` for
/// anything else (an `N`, an incomplete codon). The standard code (NCBI translation table 1).
pub fn translate(codon: &[u8]) -> u8 {
    let [a, b, c] = match codon {
        [a, b, c] => [*a, *b, *c],
        _ => return b'X',
    };
    let purine = |x: u8| matches!(x, b'A' | b'G');
    let pyrimidine = |x: u8| matches!(x, b'C' | b'T');
    if !(purine(c) || pyrimidine(c)) {
        return b'X';
    }
    // By first two bases; the third decides within a box where the box is split.
    match (a, b) {
        (b'T', b'T') => {
            if pyrimidine(c) {
                b'F'
            } else {
                b'L'
            }
        }
        (b'T', b'C') => b'S',
        (b'T', b'A') => {
            if pyrimidine(c) {
                b'Y'
            } else {
                b'*'
            }
        }
        (b'T', b'G') => match c {
            b'A' => b'*',
            b'G' => b'W',
            _ => b'C',
        },
        (b'C', b'T') => b'L',
        (b'C', b'C') => b'P',
        (b'C', b'A') => {
            if pyrimidine(c) {
                b'H'
            } else {
                b'Q'
            }
        }
        (b'C', b'G') => b'R',
        (b'A', b'T') => match c {
            b'G' => b'M',
            _ => b'I',
        },
        (b'A', b'C') => b'T',
        (b'A', b'A') => {
            if pyrimidine(c) {
                b'N'
            } else {
                b'K'
            }
        }
        (b'A', b'G') => {
            if pyrimidine(c) {
                b'S'
            } else {
                b'R'
            }
        }
        (b'G', b'T') => b'V',
        (b'G', b'C') => b'A',
        (b'G', b'A') => {
            if pyrimidine(c) {
                b'D'
            } else {
                b'E'
            }
        }
        (b'G', b'G') => b'G',
        _ => b'X',
    }
}

/// A variant placed on a CDS, after trimming the alleles' shared bases.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Edit {
    /// 0-based CDS offset of the first base that differs.
    pub at: usize,
    /// Trimmed REF and ALT (either may be empty: an insertion or a deletion).
    pub reference: Vec<u8>,
    pub alt: Vec<u8>,
}

impl Edit {
    /// `reference`/`alt` as the VCF gives them, REF's first base at CDS offset `at`.
    pub fn trimmed(at: usize, reference: &[u8], alt: &[u8]) -> Edit {
        let prefix = reference
            .iter()
            .zip(alt)
            .take_while(|(a, b)| a == b)
            .count();
        let (r, a) = (&reference[prefix..], &alt[prefix..]);
        let suffix = r
            .iter()
            .rev()
            .zip(a.iter().rev())
            .take_while(|(x, y)| x == y)
            .count();
        Edit {
            at: at + prefix,
            reference: r[..r.len() - suffix].to_vec(),
            alt: a[..a.len() - suffix].to_vec(),
        }
    }

    /// The 0-based codon where the sequences first differ.
    pub fn codon(&self) -> usize {
        self.at / 3
    }

    pub fn is_substitution(&self) -> bool {
        self.reference.len() == self.alt.len()
    }

    /// `cds` with the edit applied.
    pub fn apply(&self, cds: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(cds.len() + self.alt.len());
        out.extend_from_slice(&cds[..self.at]);
        out.extend_from_slice(&self.alt);
        out.extend_from_slice(&cds[self.at + self.reference.len()..]);
        out
    }
}
