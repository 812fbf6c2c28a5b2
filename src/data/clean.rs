//! Cleaning a record's raw sequence lines: validation against the IUPAC nucleotide alphabet,
//! upper-casing, dropping line breaks and alignment gaps, counting G and C, in one pass.
//!
//! Three tiers, fastest first: a vector pass for blocks of A/C/G/T/N in either case and line
//! breaks (almost every real genome), a line-by-line pass for the other IUPAC letters, and a
//! byte-by-byte pass that also removes gaps and names the first bad byte.

/// Byte classes for the validation pass.
const SKIP: u8 = 0; // line breaks and blanks: formatting, not sequence
const BAD: u8 = 1; // outside the IUPAC nucleotide alphabet
const NUL: u8 = 2;
const GAP: u8 = 3; // alignment gap ('-' or '.'): removed, so later codons stay in frame
/// Maps each byte to its upper-case IUPAC letter, or to SKIP / BAD / NUL / GAP. RNA's U reads
/// as T: the codon vocabulary is DNA's, and an RNA genome is the same sequence of codons.
const fn class_table() -> [u8; 256] {
    let mut t = [BAD; 256];
    t[0] = NUL;
    t[b'\n' as usize] = SKIP;
    t[b'\r' as usize] = SKIP;
    t[b' ' as usize] = SKIP;
    t[b'\t' as usize] = SKIP;
    let iupac = b"ACGTRYSWKMBDHVN";
    let mut i = 0;
    while i < iupac.len() {
        let u = iupac[i];
        t[u as usize] = u;
        t[u.to_ascii_lowercase() as usize] = u;
        i += 1;
    }
    t[b'U' as usize] = b'T';
    t[b'u' as usize] = b'T';
    t[b'-' as usize] = GAP;
    t[b'.' as usize] = GAP;
    t
}
static CLASS: [u8; 256] = class_table();

/// Why a record's sequence was rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqProblem {
    pub msg: String,
}

/// What cleaning a sequence found besides the bases.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cleaned {
    /// Bases kept.
    pub bases: u64,
    /// Count of G and C bases.
    pub gc: u64,
    /// Alignment gaps ('-', '.') removed.
    pub gaps: u64,
}

/// Raw sequence bytes cleaned at a time: the cleaned copy of a record never exceeds this, so
/// a chromosome-sized record costs no second copy of itself.
const CLEAN_BLOCK: usize = 1 << 16;

/// Upper-cases `raw` into `out` (cleared first), dropping line breaks and blanks, reading U as
/// T and removing alignment gaps. `first_line` is the file line of the first sequence line,
/// for messages.
pub fn clean_sequence(
    raw: &[u8],
    first_line: u64,
    out: &mut Vec<u8>,
) -> std::result::Result<Cleaned, SeqProblem> {
    out.clear();
    out.reserve(raw.len());
    let mut scratch = Vec::new();
    clean_chunks(raw, first_line, &mut scratch, &mut |c| {
        out.extend_from_slice(c)
    })
}

/// Cleans `raw` as [`clean_sequence`] does, handing the bases to `sink` in pieces of at most
/// [`CLEAN_BLOCK`] bytes (`scratch` holds the piece). On a problem, `sink` may already have seen
/// the bases before it.
pub fn clean_chunks(
    raw: &[u8],
    first_line: u64,
    scratch: &mut Vec<u8>,
    sink: &mut dyn FnMut(&[u8]),
) -> std::result::Result<Cleaned, SeqProblem> {
    let mut c = Cleaned::default();
    let mut line = first_line;
    for (k, block) in raw.chunks(CLEAN_BLOCK).enumerate() {
        scratch.clear();
        match clean_fast(block, scratch) {
            Some((newlines, gc)) => {
                line += newlines;
                c.gc += gc;
            }
            None => {
                let at = Position {
                    line,
                    base: c.bases,
                    byte: (k * CLEAN_BLOCK) as u64,
                };
                scratch.clear();
                let before = &raw[..k * CLEAN_BLOCK];
                line = clean_slow(block, before, at, &mut c.gaps, scratch)?;
                c.gc += scratch.iter().filter(|&&b| b == b'G' || b == b'C').count() as u64;
            }
        }
        c.bases += scratch.len() as u64;
        sink(scratch);
    }
    if c.bases == 0 {
        return Err(SeqProblem {
            msg: if c.gaps > 0 {
                "record holds only alignment gaps, no bases".into()
            } else {
                "record has a header but no sequence".into()
            },
        });
    }
    Ok(c)
}

/// Where a block starts within its record, for messages.
struct Position {
    line: u64,
    base: u64,
    byte: u64,
}

/// Translates a block line by line; `None` when anything besides IUPAC letters and line ends
/// (blanks inside a line, gaps, bad bytes, or a CR cut from its LF by the block edge) sends it
/// to [`clean_slow`]. Returns the line breaks passed and the G/C count.
fn clean_fast(block: &[u8], out: &mut Vec<u8>) -> Option<(u64, u64)> {
    if let Some(found) = vector::clean_acgtn(block, out) {
        return Some(found);
    }
    let mut flags = 0u8;
    let (mut newlines, mut gc) = (0, 0);
    let mut rest = block;
    loop {
        let (line, next) = match memchr::memchr(b'\n', rest) {
            Some(i) => (&rest[..i], Some(&rest[i + 1..])),
            None => (rest, None),
        };
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let start = out.len();
        if upper_acgt(line) {
            // The common line needs no translation: a copy and a count, both vectorised.
            out.extend_from_slice(line);
        } else {
            out.extend(line.iter().map(|&b| {
                let c = CLASS[b as usize];
                flags |= u8::from(c < b'-');
                c
            }));
        }
        gc += out[start..]
            .iter()
            .filter(|&&b| b == b'G' || b == b'C')
            .count() as u64;
        match next {
            Some(n) => {
                rest = n;
                newlines += 1;
            }
            None => break,
        }
    }
    (flags == 0).then_some((newlines, gc))
}

/// True when `line` holds only upper-case A, C, G and T (no early exit, so it vectorises).
fn upper_acgt(line: &[u8]) -> bool {
    line.iter()
        .fold(true, |ok, &b| ok & matches!(b, b'A' | b'C' | b'G' | b'T'))
}

/// Byte-by-byte cleaning of a block that needs it; returns the line after the block.
/// `before` is the record's text before the block (read only to place a bad byte in its line).
fn clean_slow(
    block: &[u8],
    before: &[u8],
    at: Position,
    gaps: &mut u64,
    out: &mut Vec<u8>,
) -> std::result::Result<u64, SeqProblem> {
    let mut line = at.line;
    for (i, &b) in block.iter().enumerate() {
        let base = at.base + out.len() as u64 + 1;
        match CLASS[b as usize] {
            SKIP => line += u64::from(b == b'\n'),
            GAP => *gaps += 1,
            NUL => {
                return Err(SeqProblem {
                    msg: format!(
                        "NUL byte at base {base} (line {line}): the file looks binary or corrupt"
                    ),
                })
            }
            BAD => {
                let shown = if b.is_ascii_graphic() {
                    format!("'{}'", b as char)
                } else {
                    format!("byte 0x{b:02x}")
                };
                // Its column in its line (the byte offset in the record's text, line breaks
                // included, sent users to the wrong place).
                let column = match block[..i].iter().rposition(|&b| b == b'\n') {
                    Some(nl) => i - nl,
                    None => {
                        let start = before
                            .iter()
                            .rposition(|&b| b == b'\n')
                            .map_or(0, |n| n + 1);
                        before.len() - start + i + 1
                    }
                };
                debug_assert_eq!(at.byte as usize, before.len());
                return Err(SeqProblem {
                    msg: format!(
                        "invalid character {shown} at base {base} (line {line}, column \
                         {column}): not an IUPAC nucleotide code (ACGTURYSWKMBDHVN, gaps - .)"
                    ),
                });
            }
            c => out.push(c),
        }
    }
    Ok(line)
}

/// The vector tier: blocks that hold only A, C, G, T and N (either case) and line breaks.
mod vector {
    /// Appends `block` upper-cased without its line breaks (LF, and CR wherever it stands, as
    /// the slower tiers drop it too) to `out` and returns (LF count, G/C count); `None`, with
    /// `out` unchanged, when the block holds any other byte or the tier is below avx2 (`isa`).
    pub fn clean_acgtn(block: &[u8], out: &mut Vec<u8>) -> Option<(u64, u64)> {
        #[cfg(target_arch = "x86_64")]
        if crate::isa::avx2() {
            // SAFETY: AVX2 is present (the tier is never above what the CPU has).
            return unsafe { avx2::clean(block, out) };
        }
        let _ = (block, out);
        None
    }

    #[cfg(target_arch = "x86_64")]
    mod avx2 {
        use std::arch::x86_64::*;

        /// 32 bytes at a time: five compares classify them, one mask says where line breaks
        /// are, and the bases between breaks are moved with overlapping 32-byte stores (so
        /// `out` gets 32 bytes of slack), which costs one store per line, not one per byte.
        #[target_feature(enable = "avx2")]
        pub unsafe fn clean(block: &[u8], out: &mut Vec<u8>) -> Option<(u64, u64)> {
            let len = block.len();
            out.reserve(len + 32);
            let start = out.len();
            // SAFETY (whole function): every load reads src[i + k .. i + k + 32] with k < 32
            // while i + 64 <= len, so inside `block`; every store writes dst[n .. n + 32] with
            // n at most the bytes consumed so far, so inside the reserved len + 32.
            let dst = out.as_mut_ptr().add(start);
            let src = block.as_ptr();
            let load = |at: usize| _mm256_loadu_si256(src.add(at) as *const __m256i);
            let splat = |b: u8| _mm256_set1_epi8(b as i8);
            // Clearing bit 5 upper-cases letters and leaves LF and CR as they are.
            let (upper, lf, cr) = (splat(0xDF), splat(b'\n'), splat(b'\r'));
            let (a, c, g, t, n_) = (
                splat(b'A'),
                splat(b'C'),
                splat(b'G'),
                splat(b'T'),
                splat(b'N'),
            );
            let (mut n, mut i) = (0usize, 0usize);
            let (mut newlines, mut gc) = (0u64, 0u64);
            while i + 64 <= len {
                let v = load(i);
                let u = _mm256_and_si256(v, upper);
                let is_lf = _mm256_cmpeq_epi8(v, lf);
                let breaks = _mm256_or_si256(is_lf, _mm256_cmpeq_epi8(v, cr));
                let is_gc = _mm256_or_si256(_mm256_cmpeq_epi8(u, c), _mm256_cmpeq_epi8(u, g));
                let is_at = _mm256_or_si256(_mm256_cmpeq_epi8(u, a), _mm256_cmpeq_epi8(u, t));
                let ok = _mm256_or_si256(
                    _mm256_or_si256(is_gc, is_at),
                    _mm256_or_si256(_mm256_cmpeq_epi8(u, n_), breaks),
                );
                if _mm256_movemask_epi8(ok) != -1 {
                    return None;
                }
                gc += u64::from((_mm256_movemask_epi8(is_gc) as u32).count_ones());
                newlines += u64::from((_mm256_movemask_epi8(is_lf) as u32).count_ones());
                let mut m = _mm256_movemask_epi8(breaks) as u32;
                if m == 0 {
                    _mm256_storeu_si256(dst.add(n) as *mut __m256i, u);
                    n += 32;
                } else {
                    // Each run of bases between breaks: one load from its first byte, one store.
                    let mut from = 0usize;
                    loop {
                        let to = if m == 0 {
                            32
                        } else {
                            m.trailing_zeros() as usize
                        };
                        if to > from {
                            let run = _mm256_and_si256(load(i + from), upper);
                            _mm256_storeu_si256(dst.add(n) as *mut __m256i, run);
                            n += to - from;
                        }
                        if m == 0 {
                            break;
                        }
                        from = to + 1;
                        m &= m - 1;
                    }
                }
                i += 32;
            }
            for &b in &block[i..] {
                match b & 0xDF {
                    _ if b == b'\n' => newlines += 1,
                    _ if b == b'\r' => {}
                    u @ (b'A' | b'T' | b'N') => {
                        *dst.add(n) = u;
                        n += 1;
                    }
                    u @ (b'C' | b'G') => {
                        *dst.add(n) = u;
                        n += 1;
                        gc += 1;
                    }
                    _ => return None,
                }
            }
            out.set_len(start + n);
            Some((newlines, gc))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cleans_and_counts() {
        let mut out = Vec::new();
        let c = clean_sequence(b"acgT\r\nNNgc\n", 2, &mut out).unwrap();
        assert_eq!(out, b"ACGTNNGC");
        assert_eq!(
            c,
            Cleaned {
                bases: 8,
                gc: 4,
                gaps: 0
            }
        );
        let err = clean_sequence(b"ACGT\nAC*T", 2, &mut out).unwrap_err();
        assert!(
            err.msg.contains("'*' at base 7 (line 3, column 3)"),
            "{}",
            err.msg
        );
        // The column is the line's, CRLF or not, in a later block as in the first (it was
        // the offset in the record's text, line breaks counted).
        let err = clean_sequence(b"ACGT\r\nACGTA\r\nCGXAA", 2, &mut out).unwrap_err();
        assert!(err.msg.contains("line 4, column 3)"), "{}", err.msg);
        let line = [b"ACGTACGTAC".as_slice(), b"\n"].concat();
        let mut text = line.repeat(CLEAN_BLOCK / line.len() + 1);
        text.extend_from_slice(b"ACGT#");
        let lines = (CLEAN_BLOCK / line.len() + 1) as u64;
        let err = clean_sequence(&text, 2, &mut out).unwrap_err();
        let want = format!("line {}, column 5)", 2 + lines);
        assert!(err.msg.contains(&want), "{want}: {}", err.msg);
        // A line that starts in one block and goes bad in the next.
        let mut text = vec![b'A'; CLEAN_BLOCK - 3];
        text.push(b'\n');
        text.extend_from_slice(b"CCCCCC@");
        let err = clean_sequence(&text, 2, &mut out).unwrap_err();
        assert!(err.msg.contains("line 3, column 7)"), "{}", err.msg);
        let mut text = vec![b'A'; CLEAN_BLOCK + 5];
        text.push(b'@');
        let err = clean_sequence(&text, 2, &mut out).unwrap_err();
        let want = format!("line 2, column {})", CLEAN_BLOCK + 6);
        assert!(err.msg.contains(&want), "{want}: {}", err.msg);
    }

    /// RNA reads as DNA (dc757c5 accepted U, then tokenized every codon holding one as
    /// [UNK]); alignment gaps are removed so the codons after them stay in frame.
    #[test]
    fn rna_reads_as_dna_and_gaps_leave_the_frame_intact() {
        let mut out = Vec::new();
        let c = clean_sequence(b"AUGgcu\nUAA", 2, &mut out).unwrap();
        assert_eq!(out, b"ATGGCTTAA");
        assert_eq!(c.gaps, 0);
        let c = clean_sequence(b"ATG--GC.T\nT-AA", 2, &mut out).unwrap();
        assert_eq!(out, b"ATGGCTTAA");
        assert_eq!(
            c,
            Cleaned {
                bases: 9,
                gc: 3,
                gaps: 4
            }
        );
        let e = clean_sequence(b"---\n..", 2, &mut out).unwrap_err();
        assert!(e.msg.contains("only alignment gaps"), "{}", e.msg);
    }

    /// Records longer than a cleaning block: CRLF cut by a block edge, lower case, gaps and U
    /// in later blocks, against a naive byte filter; an error in a later block names the
    /// global base, line and byte.
    #[test]
    fn long_records_clean_across_blocks() {
        let mut raw = Vec::new();
        let mut line = 0u64;
        while raw.len() < 3 * CLEAN_BLOCK {
            // A first line of 21 letters, then 59, each with CRLF: the first block ends between
            // a CR and its LF.
            let n = if line == 0 { 21 } else { 59 };
            let l: Vec<u8> = (0..n)
                .map(|i| b"acgtUGCA-N"[(i + line as usize) % 10])
                .collect();
            raw.extend_from_slice(&l);
            raw.extend_from_slice(b"\r\n");
            line += 1;
        }
        assert_eq!(raw[CLEAN_BLOCK - 1], b'\r');
        let want: Vec<u8> = raw
            .iter()
            .filter(|b| !b"\r\n-".contains(b))
            .map(|b| match b.to_ascii_uppercase() {
                b'U' => b'T',
                u => u,
            })
            .collect();
        let mut out = Vec::new();
        let c = clean_sequence(&raw, 5, &mut out).unwrap();
        assert!(out == want);
        assert_eq!(c.bases, want.len() as u64);
        assert_eq!(c.gaps, raw.iter().filter(|&&b| b == b'-').count() as u64);
        let gc = want.iter().filter(|&&b| b == b'G' || b == b'C').count();
        assert_eq!(c.gc, gc as u64);

        let at = 2 * CLEAN_BLOCK + 100;
        let mut bad = raw.clone();
        bad[at] = b'*';
        let line = 5 + bad[..at].iter().filter(|&&b| b == b'\n').count();
        let base = bad[..at].iter().filter(|b| !b"\r\n-".contains(b)).count() + 1;
        let column = at
            - bad[..at]
                .iter()
                .rposition(|&b| b == b'\n')
                .map_or(0, |n| n + 1)
            + 1;
        let e = clean_sequence(&bad, 5, &mut out).unwrap_err();
        let expect = format!("'*' at base {base} (line {line}, column {column})");
        assert!(e.msg.contains(&expect), "{} vs {expect}", e.msg);
    }
    /// The naive definition of cleaning for inputs without gaps or bad bytes: drop CR and LF,
    /// upper-case, read U as T; count G and C.
    fn naive(raw: &[u8]) -> (Vec<u8>, u64) {
        let out: Vec<u8> = raw
            .iter()
            .filter(|b| !b"\r\n".contains(b))
            .map(|b| match b.to_ascii_uppercase() {
                b'U' => b'T',
                u => u,
            })
            .collect();
        let gc = out.iter().filter(|&&b| b == b'G' || b == b'C').count() as u64;
        (out, gc)
    }

    /// Random sequences over alphabets that do and do not stay in the vector tier (line breaks
    /// at random places, runs of breaks, CRLF, lower case, N, then R and U that leave it),
    /// lengths around the 32- and 64-byte edges and across blocks, against the naive filter.
    #[test]
    fn every_tier_cleans_like_the_naive_filter() {
        let mut rng = crate::rng::SplitMix64::new(7);
        let alphabets: [&[u8]; 5] = [b"ACGT", b"ACGTacgtNn", b"ACGTN\n", b"acgt\r\n", b"ACGTRYU"];
        let mut out = Vec::new();
        for case in 0..400 {
            let alphabet = alphabets[case % alphabets.len()];
            let len = match case % 4 {
                0 => rng.below(70) as usize,
                1 => 60 + rng.below(80) as usize,
                2 => rng.below(2000) as usize,
                _ => CLEAN_BLOCK - 40 + rng.below(200) as usize,
            };
            let line = 1 + rng.below(100) as usize;
            let mut raw: Vec<u8> = (0..len)
                .map(|_| alphabet[rng.below(alphabet.len() as u64) as usize])
                .collect();
            for k in (line..raw.len()).step_by(line + 1) {
                raw[k] = b'\n';
            }
            let (want, gc) = naive(&raw);
            match clean_sequence(&raw, 1, &mut out) {
                Ok(c) => {
                    assert!(out == want, "case {case}: {len} bytes, lines of {line}");
                    assert_eq!(
                        (c.bases, c.gc, c.gaps),
                        (want.len() as u64, gc, 0),
                        "case {case}"
                    );
                }
                Err(e) => assert!(want.is_empty(), "case {case}: {}", e.msg),
            }
        }
    }

    /// The vector tier takes the common blocks (so the test above exercised it, where the CPU
    /// has it) and leaves every other byte to the slower tiers.
    #[test]
    fn vector_tier_takes_acgtn_and_nothing_else() {
        let mut out = b"kept".to_vec();
        let raw = b"ACGTNacgtn\r\n".repeat(20);
        let found = vector::clean_acgtn(&raw, &mut out);
        #[cfg(target_arch = "x86_64")]
        if crate::isa::avx2() {
            let (want, gc) = naive(&raw);
            assert_eq!(found, Some((20, gc)));
            assert!(out[4..] == want[..]);
        } else {
            // Below the avx2 tier (GENSLM_SIMD=scalar, or no AVX2) the vector tier stays off.
            assert_eq!(found, None);
        }
        for other in *b"URYSWKMBDHV-. \t*\0" {
            for at in [0, 31, 32, 100, 250] {
                let mut raw = b"ACGT\n".repeat(52);
                raw[at] = other;
                let mut out = b"kept".to_vec();
                assert_eq!(vector::clean_acgtn(&raw, &mut out), None, "{other} at {at}");
                assert_eq!(out, b"kept");
            }
        }
    }
}
