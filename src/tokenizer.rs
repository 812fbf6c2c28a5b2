//! GenSLM-compatible codon tokenizer.
//!
//! The vocabularies are Hugging Face `tokenizers` JSON files in `tokenizers/` whose ids equal
//! GenSLM's `codon_wordlevel_69vocab.json` / `codon_wordlevel_71vocab.json`. They are embedded
//! in the binary and parsed at start-up, so the ids come from one place only.
//!
//! Splitting follows GenSLM: upper-case, non-overlapping 3-mers from position 0; a codon with
//! any base outside ACGT (U counts as T) becomes `[UNK]`; a trailing 1–2 bases become one `[UNK]` (or are
//! dropped with [`Trailing::Drop`]). The 71-token vocabulary wraps each sequence in
//! `[BOS]` … `[EOS]`, as GenSLM's post-processor does.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

#[cfg(target_arch = "x86_64")]
mod codons_x86;

/// Which GenSLM vocabulary to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum VocabKind {
    /// 69 tokens: 5 specials then 64 codons (GenSLM's default).
    #[default]
    #[serde(rename = "genslm69")]
    Genslm69,
    /// 71 tokens: 7 specials including `[BOS]`/`[EOS]`, then 64 codons.
    #[serde(rename = "genslm71")]
    Genslm71,
}

impl VocabKind {
    fn json(self) -> &'static str {
        match self {
            VocabKind::Genslm69 => include_str!("../tokenizers/genslm69.json"),
            VocabKind::Genslm71 => include_str!("../tokenizers/genslm71.json"),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            VocabKind::Genslm69 => "genslm69",
            VocabKind::Genslm71 => "genslm71",
        }
    }
}

impl fmt::Display for VocabKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for VocabKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "genslm69" => Ok(VocabKind::Genslm69),
            "genslm71" => Ok(VocabKind::Genslm71),
            other => Err(Error::Invalid(format!(
                "unknown vocabulary '{other}': expected genslm69 or genslm71"
            ))),
        }
    }
}

/// What to do with a trailing partial codon (1 or 2 bases).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Trailing {
    /// Emit one `[UNK]` (GenSLM's behaviour).
    #[default]
    Unk,
    /// Drop the partial codon.
    Drop,
}

/// 2-bit code of an upper- or lower-case base, or `NOT_ACGT`.
const NOT_ACGT: u8 = 0xFF;
const fn base_codes() -> [u8; 256] {
    let mut t = [NOT_ACGT; 256];
    t[b'A' as usize] = 0;
    t[b'C' as usize] = 1;
    t[b'G' as usize] = 2;
    t[b'T' as usize] = 3;
    t[b'a' as usize] = 0;
    t[b'c' as usize] = 1;
    t[b'g' as usize] = 2;
    t[b't' as usize] = 3;
    // RNA: U is T's base (the FASTA reader already maps it; this covers direct callers).
    t[b'U' as usize] = 3;
    t[b'u' as usize] = 3;
    t
}
static BASE_CODE: [u8; 256] = base_codes();
const BASES: [u8; 4] = *b"ACGT";

/// A codon tokenizer over one GenSLM vocabulary.
#[derive(Debug, Clone)]
pub struct CodonTokenizer {
    kind: VocabKind,
    /// Token id of codon `16·b0 + 4·b1 + b2` (bases coded A=0, C=1, G=2, T=3).
    codon_id: [u32; 64],
    /// The same ids as bytes, then 64 times `[UNK]`: index 64 + anything is a codon with a
    /// base outside ACGT, so one lookup serves every codon without a branch.
    byte_id: [u8; 128],
    /// Text of every token id.
    tokens: Vec<String>,
    unk: u32,
    pad: u32,
    bos: Option<u32>,
    eos: Option<u32>,
    trailing: Trailing,
}

#[derive(serde::Deserialize)]
struct HfTokenizerFile {
    model: HfWordLevel,
}
#[derive(serde::Deserialize)]
struct HfWordLevel {
    vocab: HashMap<String, u32>,
}

impl CodonTokenizer {
    pub fn new(kind: VocabKind) -> Result<Self> {
        Self::from_json(kind, kind.json())
    }

    /// Builds a tokenizer from a Hugging Face WordLevel tokenizer file's text.
    pub fn from_json(kind: VocabKind, text: &str) -> Result<Self> {
        let file: HfTokenizerFile = serde_json::from_str(text)
            .map_err(|e| Error::Invalid(format!("vocabulary {kind}: not a tokenizer file: {e}")))?;
        let vocab = file.model.vocab;
        let n = vocab.len();
        let mut tokens = vec![String::new(); n];
        for (tok, &id) in &vocab {
            let slot = tokens.get_mut(id as usize).ok_or_else(|| {
                Error::Invalid(format!(
                    "vocabulary {kind}: id {id} of '{tok}' out of range"
                ))
            })?;
            *slot = tok.clone();
        }
        let get = |t: &str| {
            vocab
                .get(t)
                .copied()
                .ok_or_else(|| Error::Invalid(format!("vocabulary {kind}: missing token {t}")))
        };
        let mut codon_id = [0u32; 64];
        for (code, slot) in codon_id.iter_mut().enumerate() {
            let codon = [BASES[code >> 4], BASES[(code >> 2) & 3], BASES[code & 3]];
            *slot = get(std::str::from_utf8(&codon).expect("ACGT is ASCII"))?;
        }
        let (bos, eos) = match kind {
            VocabKind::Genslm69 => (None, None),
            VocabKind::Genslm71 => (Some(get("[BOS]")?), Some(get("[EOS]")?)),
        };
        let unk = get("[UNK]")?;
        let mut byte_id = [unk as u8; 128];
        for (b, &id) in byte_id.iter_mut().zip(&codon_id) {
            *b = id as u8;
        }
        Ok(Self {
            kind,
            codon_id,
            byte_id,
            tokens,
            unk,
            pad: get("[PAD]")?,
            bos,
            eos,
            trailing: Trailing::Unk,
        })
    }

    pub fn with_trailing(mut self, trailing: Trailing) -> Self {
        self.trailing = trailing;
        self
    }

    pub fn kind(&self) -> VocabKind {
        self.kind
    }
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }
    pub fn unk_id(&self) -> u32 {
        self.unk
    }
    /// Whether genslm's tokenize writes `id` inside a record: a codon, `[UNK]`, or the
    /// vocabulary's `[BOS]`/`[EOS]` (never `[PAD]`, `[CLS]`, `[SEP]` or `[MASK]`).
    pub fn writes(&self, id: u32) -> bool {
        id == self.unk
            || Some(id) == self.bos
            || Some(id) == self.eos
            || self.codon_id.contains(&id)
    }
    pub fn pad_id(&self) -> u32 {
        self.pad
    }
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }
    /// The text of a token id (`None` when out of range).
    pub fn token(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }
    /// The id of a codon given as three bases (any case); `[UNK]` when not ACGT.
    pub fn codon_to_id(&self, codon: &[u8; 3]) -> u32 {
        let (a, b, c) = (
            BASE_CODE[codon[0] as usize],
            BASE_CODE[codon[1] as usize],
            BASE_CODE[codon[2] as usize],
        );
        if a > 3 || b > 3 || c > 3 {
            self.unk
        } else {
            self.codon_id[((a as usize) << 4) | ((b as usize) << 2) | c as usize]
        }
    }

    /// Number of tokens `encode` produces for `n_bases` bases.
    pub fn n_tokens(&self, n_bases: usize) -> usize {
        let partial = usize::from(!n_bases.is_multiple_of(3) && self.trailing == Trailing::Unk);
        let specials = usize::from(self.bos.is_some()) + usize::from(self.eos.is_some());
        n_bases / 3 + partial + specials
    }

    /// Appends the token ids of `seq` (bases in any case) to `out`.
    pub fn encode_into(&self, seq: &[u8], out: &mut Vec<u32>) {
        out.reserve(self.n_tokens(seq.len()));
        out.extend(self.bos);
        let rest = self.encode_codons(seq, |id| out.push(id));
        if !rest.is_empty() && self.trailing == Trailing::Unk {
            out.push(self.unk);
        }
        out.extend(self.eos);
    }

    /// Calls `push` with the id of every whole codon of `seq`; returns the 0–2 bases left over.
    fn encode_codons<'s>(&self, seq: &'s [u8], mut push: impl FnMut(u32)) -> &'s [u8] {
        let mut chunks = seq.chunks_exact(3);
        for c in &mut chunks {
            let code = (BASE_CODE[c[0] as usize] as u32) << 16
                | (BASE_CODE[c[1] as usize] as u32) << 8
                | BASE_CODE[c[2] as usize] as u32;
            // Any NOT_ACGT byte sets a high bit of its lane.
            if code & 0x00FC_FCFC != 0 {
                push(self.unk);
            } else {
                let idx = ((code >> 12) & 0x30) | ((code >> 6) & 0x0C) | (code & 0x03);
                push(self.codon_id[idx as usize]);
            }
        }
        chunks.remainder()
    }

    /// Starts encoding a sequence that arrives in pieces into one-byte ids (the GenSLM
    /// vocabularies have fewer than 256 tokens; a larger one is refused).
    pub fn stream(&self) -> Result<CodonStream<'_>> {
        if self.vocab_size() > 256 {
            return Err(Error::Invalid(format!(
                "vocabulary {} has {} tokens: too many for one-byte ids",
                self.kind,
                self.vocab_size()
            )));
        }
        Ok(CodonStream {
            tok: self,
            carry: [0; 3],
            n_carry: 0,
            started: false,
        })
    }

    pub fn encode(&self, seq: &[u8]) -> Vec<u32> {
        let mut out = Vec::new();
        self.encode_into(seq, &mut out);
        out
    }

    /// Token ids back to DNA. Codons decode to their bases, `[UNK]` to `NNN`, and the other
    /// special tokens (BOS/EOS/PAD/CLS/SEP/MASK) are skipped. Unknown ids are an error.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let mut out = String::with_capacity(ids.len() * 3);
        for &id in ids {
            let tok = self
                .token(id)
                .ok_or_else(|| Error::Invalid(format!("token id {id} is not in {}", self.kind)))?;
            if id == self.unk {
                out.push_str("NNN");
            } else if !tok.starts_with('[') {
                out.push_str(tok);
            }
        }
        Ok(out)
    }
}

/// Index into `byte_id` of a codon: its 6-bit code, plus 64 when any base is not ACGT
/// (`NOT_ACGT` has the top bit set).
#[inline]
fn byte_index(c: &[u8]) -> usize {
    let (a, b, c) = (
        BASE_CODE[c[0] as usize],
        BASE_CODE[c[1] as usize],
        BASE_CODE[c[2] as usize],
    );
    let code = ((a & 3) << 4) | ((b & 3) << 2) | (c & 3);
    (code | (((a | b | c) >> 7) << 6)) as usize
}

/// Encodes one sequence handed over in pieces of any length (codons may straddle them), into
/// one-byte ids: [`CodonTokenizer::encode`]'s output without a whole-sequence buffer.
pub struct CodonStream<'t> {
    tok: &'t CodonTokenizer,
    carry: [u8; 3],
    n_carry: usize,
    started: bool,
}

impl CodonStream<'_> {
    /// Appends the ids of the next piece's complete codons.
    pub fn push(&mut self, mut bases: &[u8], out: &mut Vec<u8>) {
        if !self.started {
            self.started = true;
            out.extend(self.tok.bos.map(|b| b as u8));
        }
        // Complete a codon begun in the previous piece.
        while self.n_carry > 0 && !bases.is_empty() {
            self.carry[self.n_carry] = bases[0];
            bases = &bases[1..];
            self.n_carry += 1;
            if self.n_carry == 3 {
                out.push(self.tok.codon_to_id(&self.carry) as u8);
                self.n_carry = 0;
            }
        }
        if self.n_carry > 0 {
            return; // the piece ended inside that codon
        }
        // Whole groups of sixteen codons in vector registers where the CPU allows.
        #[cfg(target_arch = "x86_64")]
        let bases = &bases[3 * codons_x86::encode(bases, &self.tok.byte_id, out)..];
        let codons = bases.chunks_exact(3);
        let rest = codons.remainder();
        // `extend` over an exact-size map writes without a capacity check per id.
        out.extend(codons.map(|c| self.tok.byte_id[byte_index(c)]));
        self.carry[..rest.len()].copy_from_slice(rest);
        self.n_carry = rest.len();
    }

    /// Appends the trailing partial codon's id (per [`Trailing`]) and EOS.
    pub fn finish(mut self, out: &mut Vec<u8>) {
        self.push(&[], out);
        if self.n_carry > 0 && self.tok.trailing == Trailing::Unk {
            out.push(self.tok.unk as u8);
        }
        out.extend(self.tok.eos.map(|e| e as u8));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_of_known_codons() {
        // Values read off GenSLM's codon_wordlevel_69vocab.json.
        let t = CodonTokenizer::new(VocabKind::Genslm69).unwrap();
        assert_eq!(t.encode(b"GGCATGTAG"), vec![5, 10, 68]);
        assert_eq!(t.encode(b"atgNNNat"), vec![10, 0, 0]);
        let t = CodonTokenizer::new(VocabKind::Genslm71).unwrap();
        assert_eq!(t.encode(b"GGCTAG"), vec![2, 7, 70, 3]);
    }

    /// `writes` holds exactly the ids encoding can produce: every codon, `NNN`, and a record's
    /// `[BOS]`/`[EOS]` where the vocabulary has them.
    #[test]
    fn the_ids_tokenize_writes_are_those_encoding_produces() {
        for kind in [VocabKind::Genslm69, VocabKind::Genslm71] {
            let t = CodonTokenizer::new(kind).unwrap();
            let mut produced = std::collections::BTreeSet::new();
            for a in b"ACGT" {
                for b in b"ACGT" {
                    for c in b"ACGT" {
                        produced.extend(t.encode(&[*a, *b, *c]));
                    }
                }
            }
            produced.extend(t.encode(b"NNN"));
            let writes: std::collections::BTreeSet<u32> = (0..t.vocab_size() as u32)
                .filter(|&i| t.writes(i))
                .collect();
            assert_eq!(writes, produced, "{kind:?}");
            assert!(!t.writes(t.pad_id()));
        }
    }

    #[test]
    fn drop_trailing() {
        let t = CodonTokenizer::new(VocabKind::Genslm69)
            .unwrap()
            .with_trailing(Trailing::Drop);
        assert_eq!(t.encode(b"ATGAT"), vec![10]);
        assert_eq!(t.n_tokens(5), 1);
    }

    /// Pieces of any size give the ids of the whole sequence, checked against a naive
    /// codon-by-codon reference, for both vocabularies and both trailing rules.
    #[test]
    fn streamed_pieces_equal_the_whole_sequence() {
        let mut rng = crate::rng::SplitMix64::new(7);
        let alphabet = b"ACGTNacgtRY";
        for kind in [VocabKind::Genslm69, VocabKind::Genslm71] {
            for trailing in [Trailing::Unk, Trailing::Drop] {
                let t = CodonTokenizer::new(kind).unwrap().with_trailing(trailing);
                for len in [0usize, 1, 2, 3, 4, 5, 17, 100, 1001] {
                    let seq: Vec<u8> = (0..len)
                        .map(|_| alphabet[rng.below(alphabet.len() as u64) as usize])
                        .collect();
                    let mut want: Vec<u32> = t.bos.into_iter().collect();
                    for c in seq.chunks(3) {
                        match c {
                            [a, b, c] => want.push(t.codon_to_id(&[*a, *b, *c])),
                            _ if trailing == Trailing::Unk => want.push(t.unk),
                            _ => {}
                        }
                    }
                    want.extend(t.eos);
                    let mut got = Vec::new();
                    let mut s = t.stream().unwrap();
                    let mut rest = &seq[..];
                    while !rest.is_empty() {
                        let n = 1 + rng.below(rest.len().min(7) as u64) as usize;
                        s.push(&rest[..n], &mut got);
                        rest = &rest[n..];
                    }
                    s.finish(&mut got);
                    let got: Vec<u32> = got.into_iter().map(u32::from).collect();
                    assert_eq!(got, want, "{kind} {trailing:?} len {len}");
                    assert_eq!(t.encode(&seq), want);
                }
            }
        }
    }

    /// The vector path maps every byte as the scalar walk does: all 256 byte values, and runs
    /// of bases with a sprinkling of other letters, at lengths around its 48-byte groups.
    #[test]
    fn vector_codons_match_the_scalar_walk() {
        let t = CodonTokenizer::new(VocabKind::Genslm69).unwrap();
        let mut rng = crate::rng::SplitMix64::new(11);
        let mut cases: Vec<Vec<u8>> = vec![(0..=255u8).collect::<Vec<u8>>().repeat(3)];
        for len in [0usize, 3, 47, 48, 49, 95, 96, 144, 1000] {
            cases.push(
                (0..len)
                    .map(|_| match rng.below(20) {
                        0 => b"NnRYx-\0\xC1"[rng.below(8) as usize],
                        r => b"ACGTUacgtu"[(r % 10) as usize],
                    })
                    .collect(),
            );
        }
        for seq in cases {
            let want: Vec<u8> = seq
                .chunks_exact(3)
                .map(|c| t.byte_id[byte_index(c)])
                .collect();
            let mut got = vec![9u8];
            #[cfg(target_arch = "x86_64")]
            {
                let n = codons_x86::encode(&seq, &t.byte_id, &mut got);
                if crate::isa::avx2() {
                    assert_eq!(n, seq.len() / 48 * 16);
                }
                assert_eq!(got[1..], want[..n], "{} bases", seq.len());
            }
            let mut streamed = Vec::new();
            let mut s = t.stream().unwrap();
            s.push(&seq, &mut streamed);
            assert_eq!(streamed, want, "{} bases", seq.len());
        }
    }
}
