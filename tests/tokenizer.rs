//! Token ids against a fixture made by Hugging Face `tokenizers` (scripts/make_tokenizer_fixture.py),
//! and the tokenize → decode round trip.

use genslm::tokenizer::{CodonTokenizer, Trailing, VocabKind};

#[derive(serde::Deserialize)]
struct Case {
    vocab: String,
    seq: String,
    ids: Vec<u32>,
}

#[test]
fn ids_match_hugging_face_tokenizers() {
    let text = include_str!("fixtures/tokenizer_hf.json");
    let cases: Vec<Case> = serde_json::from_str(text).unwrap();
    assert!(cases.len() >= 20);
    for c in &cases {
        let kind: VocabKind = c.vocab.parse().unwrap();
        let tok = CodonTokenizer::new(kind).unwrap();
        assert_eq!(
            tok.encode(c.seq.as_bytes()),
            c.ids,
            "{} {:?}",
            c.vocab,
            c.seq
        );
        assert_eq!(tok.n_tokens(c.seq.len()), c.ids.len());
    }
}

#[test]
fn vocab_sizes_and_specials() {
    let t69 = CodonTokenizer::new(VocabKind::Genslm69).unwrap();
    assert_eq!(t69.vocab_size(), 69);
    assert_eq!((t69.unk_id(), t69.pad_id()), (0, 3));
    assert_eq!((t69.bos_id(), t69.eos_id()), (None, None));
    let t71 = CodonTokenizer::new(VocabKind::Genslm71).unwrap();
    assert_eq!(t71.vocab_size(), 71);
    assert_eq!((t71.unk_id(), t71.pad_id()), (0, 5));
    assert_eq!((t71.bos_id(), t71.eos_id()), (Some(2), Some(3)));
}

/// Deterministic pseudo-random DNA (xorshift), mixed case.
fn dna(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            b"ACGTacgt"[(x % 8) as usize]
        })
        .collect()
}

#[test]
fn round_trip_tokenize_decode() {
    for kind in [VocabKind::Genslm69, VocabKind::Genslm71] {
        let tok = CodonTokenizer::new(kind).unwrap();
        for n in [0, 3, 99, 3000] {
            let seq = dna(n, n as u64 + 1);
            let ids = tok.encode(&seq);
            let back = tok.decode(&ids).unwrap();
            assert_eq!(
                back.as_bytes(),
                seq.to_ascii_uppercase().as_slice(),
                "{kind} n={n}"
            );
        }
        // Non-ACGT codons come back as NNN; a dropped partial codon does not come back.
        let tok = tok.with_trailing(Trailing::Drop);
        let ids = tok.encode(b"ATGRYKTAGCA");
        assert_eq!(tok.decode(&ids).unwrap(), "ATGNNNTAG");
    }
}

#[test]
fn decode_rejects_unknown_ids() {
    let tok = CodonTokenizer::new(VocabKind::Genslm69).unwrap();
    let err = tok.decode(&[10, 69]).unwrap_err().to_string();
    assert!(err.contains("69") && err.contains("genslm69"), "{err}");
}
