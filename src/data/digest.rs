//! The per-record digest a dataset stores beside each record's tokens: a hex hash of the
//! upper-cased bases without line breaks, to find duplicates and to tell records apart across
//! datasets.
//!
//! Two kinds, one column named after the kind:
//! - `xxh3` (the default): XXH3-128, 32 hex digits. A non-cryptographic hash with the same
//!   128-bit width as MD5, so the same odds of two different records colliding; a dataset's
//!   digest is for telling records apart, not for resisting someone forging a collision, which
//!   MD5 no longer does either. It hashes at memory speed, where MD5 on one core was the slowest
//!   stage of ingest (~600–800 MB/s, the floor of `genslm tokenize` on two cores).
//! - `md5`: as GenSLM's tooling and `md5sum` compute it, for datasets that must match them
//!   (`genslm embed` writes `md5` too, so joins on it need `--digest md5` here).

use md5::{Digest as _, Md5};
use xxhash_rust::xxh3::Xxh3;

use crate::checksum::hex;

/// Which hash a dataset's digest column holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DigestKind {
    #[default]
    Xxh3,
    Md5,
}

impl DigestKind {
    /// The column's name in the dataset.
    pub fn column(self) -> &'static str {
        match self {
            DigestKind::Xxh3 => "xxh3",
            DigestKind::Md5 => "md5",
        }
    }

    /// Every kind, in the order a reader looks for their columns.
    pub const ALL: [DigestKind; 2] = [DigestKind::Xxh3, DigestKind::Md5];
}

/// A running hash of one record's bases.
pub enum Hasher {
    Xxh3(Box<Xxh3>),
    Md5(Md5),
}

impl Hasher {
    pub fn new(kind: DigestKind) -> Self {
        match kind {
            DigestKind::Xxh3 => Hasher::Xxh3(Box::new(Xxh3::new())),
            DigestKind::Md5 => Hasher::Md5(Md5::new()),
        }
    }

    pub fn update(&mut self, bytes: &[u8]) {
        match self {
            Hasher::Xxh3(h) => h.update(bytes),
            Hasher::Md5(h) => h.update(bytes),
        }
    }

    /// The record's digest in hex; the hasher starts over for the next record.
    pub fn finish_hex(&mut self) -> String {
        match self {
            Hasher::Xxh3(h) => {
                let v = h.digest128();
                h.reset();
                format!("{v:032x}")
            }
            Hasher::Md5(h) => hex(&h.finalize_reset()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both kinds against reference values: MD5's RFC 1321 test suite, and XXH3-128 (the xxHash
    /// C library's) of the empty input and of two patterns, one hashed whole and in pieces (a record arrives in 64 KB
    /// pieces: the pieces must not change the digest).
    #[test]
    fn digests_match_published_values_whole_and_in_pieces() {
        let mut h = Hasher::new(DigestKind::Md5);
        assert_eq!(h.finish_hex(), "d41d8cd98f00b204e9800998ecf8427e");
        h.update(b"abc");
        assert_eq!(h.finish_hex(), "900150983cd24fb0d6963f7d28e17f72");
        let mut x = Hasher::new(DigestKind::Xxh3);
        // XXH3_128bits of the empty input (xxHash's reference: 99aa06d3014798d86001c324468d497f).
        assert_eq!(x.finish_hex(), "99aa06d3014798d86001c324468d497f");
        let data: Vec<u8> = (0..4096u32)
            .map(|i| b"ACGT"[(i * 7 % 4) as usize])
            .collect();
        x.update(&data);
        let whole = x.finish_hex();
        // The same bytes through the xxHash C library (Python's `xxhash` 3.x, xxh3_128_hexdigest).
        assert_eq!(whole, "c0d1fd01712fe039cef1a51d33ac68f3");
        x.update(b"ACGTACGTNN");
        assert_eq!(x.finish_hex(), "f0e6642ed118d466781d0d65f624a161");
        for piece in [1, 3, 64, 1000] {
            for c in data.chunks(piece) {
                x.update(c);
            }
            assert_eq!(x.finish_hex(), whole, "pieces of {piece}");
        }
    }
}
