//! VCF input for `genslm variants`: plain or compressed text (gzip/bgzip, bzip2, xz, zstd),
//! one [`Variant`] per ALT allele.
//!
//! Only the first five columns are read (CHROM, POS, ID, REF, ALT; the rest may be absent, as
//! in the minimal files people write by hand). REF and ALT are bases (A/C/G/T, any case; N in
//! REF where the reference has it, never in ALT: an unknown base has no effect to score);
//! symbolic alleles (`<DEL>`), the missing allele `*`/`.` and breakends cannot be scored and
//! are refused by name. Every problem names the file and line.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Longest line accepted: a VCF line is a few hundred bytes; a longer one is not a VCF (or a
/// structural variant spelled out in bases, which a codon model cannot window anyway).
const MAX_LINE: u64 = 1 << 20;

/// One ALT allele of one VCF line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Variant {
    /// 1-based line number in the (decompressed) file.
    pub line: usize,
    pub chrom: String,
    /// 1-based position of REF's first base.
    pub pos: u64,
    pub id: String,
    /// Upper-case bases.
    pub reference: String,
    pub alt: String,
}

/// A line that could not be read as a variant, with the reason (for `--on-invalid skip`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadLine {
    pub line: usize,
    pub msg: String,
}

/// Opens `path`, decompressing gzip/bgzip, bzip2, xz or zstd (recognised by their magic
/// bytes, whatever the name; every stream of a multi-stream file, as bgzip writes them).
/// The file's text and whether it was compressed.
fn open(path: &Path) -> Result<(Box<dyn BufRead>, bool)> {
    let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    crate::atomic::note_input(path);
    let (text, compressed, _) =
        crate::data::fastx_open::text_of(f).map_err(|e| Error::io(path, e))?;
    Ok((Box::new(BufReader::new(text)), compressed))
}

fn bases(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| matches!(b.to_ascii_uppercase(), b'A' | b'C' | b'G' | b'T' | b'N'))
}

/// Parses one data line into its alleles: the line's own fields must hold (else the whole
/// line is bad), and each ALT allele is read on its own (a bad one is named among the second
/// list, and the line's other alleles still count).
fn parse_line(text: &str, line: usize) -> std::result::Result<(Vec<Variant>, Vec<String>), String> {
    let cols: Vec<&str> = text.split('\t').collect();
    if cols.len() < 5 {
        return Err(format!(
            "{} tab-separated column(s); a VCF line has at least CHROM, POS, ID, REF, ALT",
            cols.len()
        ));
    }
    let (chrom, pos, id, reference, alts) = (cols[0], cols[1], cols[2], cols[3], cols[4]);
    if chrom.is_empty() {
        return Err("empty CHROM".into());
    }
    let pos: u64 = match pos.parse() {
        Ok(p) if p >= 1 => p,
        _ => return Err(format!("POS '{pos}' is not a positive integer")),
    };
    if !bases(reference) {
        return Err(format!("REF '{reference}' is not bases (A, C, G, T, N)"));
    }
    let reference = reference.to_ascii_uppercase();
    let (mut out, mut bad) = (Vec::new(), Vec::new());
    for alt in alts.split(',') {
        match check_allele(alt, &reference) {
            Ok(alt) => out.push(Variant {
                line,
                chrom: chrom.to_string(),
                pos,
                id: id.to_string(),
                reference: reference.clone(),
                alt,
            }),
            Err(msg) => bad.push(msg),
        }
    }
    Ok((out, bad))
}

/// One ALT allele, upper-cased, or why it cannot be scored.
fn check_allele(alt: &str, reference: &str) -> std::result::Result<String, String> {
    // A single breakend (VCF 4.x: `G.`, `.G`) is a dot beside bases, not a malformed allele.
    let single_breakend = alt.len() > 1 && (alt.starts_with('.') || alt.ends_with('.'));
    if alt.starts_with('<')
        || alt.contains('[')
        || alt.contains(']')
        || alt == "*"
        || single_breakend
    {
        return Err(format!(
            "ALT '{alt}' is a symbolic allele or breakend; only sequence alleles can be scored"
        ));
    }
    if alt == "." {
        return Err("ALT '.' (no alternate allele): nothing to score".into());
    }
    if !bases(alt) {
        return Err(format!("ALT '{alt}' is not bases (A, C, G, T, N)"));
    }
    let alt = alt.to_ascii_uppercase();
    if alt.contains('N') {
        // The model reads a codon holding N as [UNK]: a Δ against it scores the unknown
        // token, not a base change.
        return Err(format!(
            "ALT '{alt}' holds N (an unknown base): the model has no codon for it, so there \
             is no effect to score; give the base"
        ));
    }
    if alt == reference {
        return Err(format!("ALT '{alt}' equals REF: not a variant"));
    }
    Ok(alt)
}

/// Reads every variant of `path` (on CHROM `chrom` only, when given: the lines of a
/// whole-genome VCF on other chromosomes are neither held nor checked). A malformed line or
/// allele is an error naming the file and line, or, with `skip`, is returned among the bad
/// lines and left out (a bad allele alone: the line's other alleles are read; they were
/// dropped with it, unsaid).
pub fn read_vcf(
    path: &Path,
    skip: bool,
    chrom: Option<&str>,
) -> Result<(Vec<Variant>, Vec<BadLine>)> {
    let (mut reader, compressed) = open(path)?;
    let err = |line: usize, msg: String| {
        Error::Invalid(format!("{}: line {line}: {msg}", path.display()))
    };
    let mut buf = Vec::new();
    let (mut out, mut bad) = (Vec::new(), Vec::new());
    let mut line = 0usize;
    loop {
        buf.clear();
        let n = (&mut reader)
            .take(MAX_LINE + 1)
            .read_until(b'\n', &mut buf)
            .map_err(|e| match compressed {
                // A decompressor's "unexpected end of file" said nothing of where or why.
                true => err(
                    line + 1,
                    format!(
                        "read failed, the file may be truncated or its compression corrupt \
                         (or bytes follow its last compressed member): {e}"
                    ),
                ),
                false => Error::io(PathBuf::from(path), e),
            })?;
        if n == 0 {
            break;
        }
        line += 1;
        // Another chromosome's line is passed over unread, whatever its bytes or length (the
        // first line is always read: a file compressed twice is said as such). Its first
        // field ends at a tab, a space or the line's end: a space-separated line of the CHROM
        // asked for, or its CHROM alone, is not another chromosome's, and is refused below.
        let other = |b: &[u8]| {
            let first = b
                .split(|&x| matches!(x, b'\t' | b' ' | b'\r' | b'\n'))
                .next()
                .unwrap_or_default();
            chrom.is_some_and(|c| !b.starts_with(b"#") && first != c.as_bytes())
        };
        if line > 1 && other(&buf) {
            // The rest of a line longer than `buf` holds, a piece at a time.
            let mut ended = buf.last() == Some(&b'\n');
            while !ended {
                buf.clear();
                let more = (&mut reader)
                    .take(MAX_LINE)
                    .read_until(b'\n', &mut buf)
                    .map_err(|e| Error::io(PathBuf::from(path), e))?;
                ended = more == 0 || buf.last() == Some(&b'\n');
            }
            continue;
        }
        if n as u64 > MAX_LINE && buf.last() != Some(&b'\n') {
            return Err(err(
                line,
                format!("longer than {MAX_LINE} bytes: not a VCF line"),
            ));
        }
        while matches!(buf.last(), Some(b'\n' | b'\r')) {
            buf.pop();
        }
        let Ok(mut text) = std::str::from_utf8(&buf) else {
            if line == 1 && compressed && crate::data::fastx_open::is_compressed(&buf) {
                return Err(err(line, crate::data::fastx_open::COMPRESSED_TWICE.into()));
            }
            return Err(err(line, "not UTF-8 text (is this a VCF?)".into()));
        };
        if line == 1 {
            // A byte-order mark (some Windows editors write one) is not the header's.
            text = text.strip_prefix('\u{feff}').unwrap_or(text);
        }
        if text.is_empty() || text.starts_with('#') {
            continue;
        }
        match parse_line(text, line) {
            Ok((_, alleles)) if !skip && !alleles.is_empty() => {
                return Err(err(line, alleles[0].clone()))
            }
            Ok((v, alleles)) => {
                out.extend(v);
                bad.extend(alleles.into_iter().map(|msg| BadLine { line, msg }));
            }
            Err(msg) if skip => bad.push(BadLine { line, msg }),
            Err(msg) => return Err(err(line, msg)),
        }
    }
    Ok((out, bad))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_become_one_variant_per_allele() {
        let (v, bad) = parse_line("chr1\t12\trs1\tac\tG,AT\t.\tPASS\t.", 7).unwrap();
        assert!(bad.is_empty());
        assert_eq!(v.len(), 2);
        assert_eq!(
            (
                v[0].chrom.as_str(),
                v[0].pos,
                v[0].id.as_str(),
                v[0].reference.as_str()
            ),
            ("chr1", 12, "rs1", "AC")
        );
        assert_eq!(
            (v[0].alt.as_str(), v[1].alt.as_str(), v[1].line),
            ("G", "AT", 7)
        );
        for (line, want) in [
            ("chr1\t12\trs1\tA", "column"),
            ("chr1\t0\t.\tA\tG", "POS '0'"),
            ("chr1\tx\t.\tA\tG", "POS 'x'"),
            ("chr1\t5\t.\tR\tA", "REF 'R'"),
        ] {
            let e = parse_line(line, 1).unwrap_err();
            assert!(e.contains(want), "{line}: {e}");
        }
        // A bad allele is the allele's fault: the line's other alleles stand.
        for (line, want) in [
            ("chr1\t5\t.\tA\t<DEL>", "symbolic"),
            ("chr1\t5\t.\tA\t*", "symbolic"),
            ("chr1\t5\t.\tA\t.", "no alternate"),
            ("chr1\t5\t.\tA\tA", "equals REF"),
            ("chr1\t5\t.\tA\tn", "ALT 'N' holds N"),
            ("chr1\t5\t.\tA\tG,AN", "ALT 'AN' holds N"),
            ("chr1\t5\t.\tA\tG]chr2:5]", "breakend"),
            ("chr1\t5\t.\tA\t.A", "breakend"),
            ("chr1\t5\t.\tA\tA.", "breakend"),
            ("chr1\t5\t.\tA\tA.G", "not bases"),
        ] {
            let (_, bad) = parse_line(line, 1).unwrap();
            assert!(bad.len() == 1 && bad[0].contains(want), "{line}: {bad:?}");
        }
    }

    /// `--on-invalid skip` leaves out a bad allele, not its line (the valid alleles of `G
    /// T,C,N` went with the N, unsaid); without it, the bad allele stops the run by line. A
    /// byte-order mark before the header is no part of it.
    #[test]
    fn a_bad_allele_is_skipped_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.vcf");
        let text = "\u{feff}##fileformat=VCFv4.2\nc\t3\t.\tG\tT,C,N\nc\t9\t.\tA\tA,<DEL>\n";
        std::fs::write(&path, text).unwrap();
        let (v, bad) = read_vcf(&path, true, None).unwrap();
        let alts: Vec<&str> = v.iter().map(|v| v.alt.as_str()).collect();
        assert_eq!(alts, ["T", "C"]);
        let why: Vec<(usize, bool)> = bad
            .iter()
            .map(|b| (b.line, b.msg.contains("ALT")))
            .collect();
        assert_eq!(why, [(2, true), (3, true), (3, true)]);
        let e = read_vcf(&path, false, None).unwrap_err().to_string();
        assert!(e.contains("line 2: ALT 'N' holds N"), "{e}");
    }

    /// With a CHROM asked for, the lines on other chromosomes are passed over unread: neither
    /// held (a whole-genome VCF is mostly other chromosomes) nor refused when malformed.
    #[test]
    fn lines_on_other_chromosomes_are_passed_over() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("g.vcf");
        let text = "#CHROM\tPOS\tID\tREF\tALT\na\t3\t.\tG\tT\nb\tx\t.\tA\tG\nab\t4\t.\tA\tG\n\
                    a\t5\t.\tC\tA,G\n";
        // Not UTF-8, and longer than any VCF line: neither is read.
        let mut bytes = text.as_bytes().to_vec();
        bytes.extend(b"b\t7\t.\tA\tC\t.\t.\t.\xff\xfe\n");
        bytes.extend(b"b\t9\t.\tA\t");
        bytes.extend(std::iter::repeat_n(b'C', 3 << 20));
        bytes.extend(b"\na\t8\t.\tA\tT\n");
        std::fs::write(&path, &bytes).unwrap();
        let (v, bad) = read_vcf(&path, false, Some("a")).unwrap();
        let got: Vec<(usize, &str, u64)> = v
            .iter()
            .map(|v| (v.line, v.chrom.as_str(), v.pos))
            .collect();
        assert_eq!(got, [(2, "a", 3), (5, "a", 5), (5, "a", 5), (8, "a", 8)]);
        assert!(bad.is_empty());
        let e = read_vcf(&path, false, None).unwrap_err().to_string();
        assert!(e.contains("line 3: POS 'x'"), "{e}");
        // A space-separated line of the CHROM asked for is its line, and refused as one (it
        // was dropped unsaid, its whole text taken for another CHROM).
        for line in ["a 4 . A C", "a", "a\r"] {
            std::fs::write(&path, format!("##fileformat=VCFv4.2\n{line}\n")).unwrap();
            let e = read_vcf(&path, false, Some("a")).unwrap_err().to_string();
            assert!(
                e.contains("line 2: 1 tab-separated column"),
                "{line:?}: {e}"
            );
        }
    }

    /// A VCF compressed by any of the tools bioinformatics uses (bgzip writes gzip members;
    /// bzip2, xz, zstd in two streams each) gives the plain file's variants.
    #[test]
    fn compressed_vcfs_are_read_whole() {
        use std::io::Write;
        let head = "##fileformat=VCFv4.2\n#CHROM\tPOS\tID\tREF\tALT\n";
        let first = format!("{head}c\t3\ta\tA\tG\n");
        let second = "c\t9\tb\tT\tC,TA\n";
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("v.vcf");
        std::fs::write(&plain, format!("{first}{second}")).unwrap();
        let (want, _) = read_vcf(&plain, false, None).unwrap();
        assert_eq!(want.len(), 3);
        type Packer = fn(&[u8]) -> Vec<u8>;
        let packers: [(&str, Packer); 4] = [
            ("gz", |t| {
                let mut e = flate2::write::GzEncoder::new(Vec::new(), Default::default());
                e.write_all(t).unwrap();
                e.finish().unwrap()
            }),
            ("bz2", |t| {
                let mut e = bzip2::write::BzEncoder::new(Vec::new(), Default::default());
                e.write_all(t).unwrap();
                e.finish().unwrap()
            }),
            ("xz", |t| {
                let mut e = liblzma::write::XzEncoder::new(Vec::new(), 1);
                e.write_all(t).unwrap();
                e.finish().unwrap()
            }),
            ("zst", |t| zstd::encode_all(t, 1).unwrap()),
        ];
        for (name, pack) in packers {
            let mut bytes = pack(first.as_bytes());
            bytes.extend(pack(second.as_bytes()));
            // Named .vcf: the bytes say what they are.
            let path = dir.path().join(format!("{name}.vcf"));
            std::fs::write(&path, bytes).unwrap();
            let (got, bad) = read_vcf(&path, false, None).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(bad.is_empty(), "{name}");
            let key = |v: &Variant| (v.pos, v.id.clone(), v.alt.clone());
            assert_eq!(
                got.iter().map(key).collect::<Vec<_>>(),
                want.iter().map(key).collect::<Vec<_>>(),
                "{name}"
            );
        }
    }
}
