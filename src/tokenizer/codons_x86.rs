//! Codons to one-byte ids sixteen at a time with SSSE3 byte shuffles, for ingest, where the
//! per-codon table walk was a quarter of the reading thread's time.
//!
//! Same mapping as the scalar `byte_index` walk: A, C, G, T (and U for T) in either case are
//! bases, a codon holding anything else is `[UNK]`.

use std::arch::x86_64::*;

/// Writes the ids of the first `n` whole codons of `bases` (3·n bytes) after `out`'s end, with
/// `ids` the 128-entry table the scalar walk indexes (codes 0..63, then 64 [UNK] entries).
/// Returns how many codons it did (a multiple of 16; the caller finishes the rest), or 0 below
/// the avx2 tier (`GENSLM_SIMD=scalar`, or a CPU without AVX2).
pub fn encode(bases: &[u8], ids: &[u8; 128], out: &mut Vec<u8>) -> usize {
    // SSSE3 comes with every AVX2 CPU: the shuffles run from the avx2 tier up (`isa`).
    if !crate::isa::avx2() {
        return 0;
    }
    let n = bases.len() / 48 * 16;
    out.reserve(n);
    // SAFETY: SSSE3 is present; `ssse3` reads bases[..3n] and writes n bytes of reserved room.
    unsafe {
        ssse3(&bases[..3 * n], ids, out.as_mut_ptr().add(out.len()));
        out.set_len(out.len() + n);
    }
    n
}

/// `pshufb` control that moves byte `3j + base` of a 48-byte group, when it lies in the group's
/// 16-byte part `part`, to lane j (lanes whose byte lies elsewhere get 0).
const fn gather(part: usize, base: usize) -> [u8; 16] {
    let mut m = [0x80u8; 16];
    let mut j = 0;
    while j < 16 {
        let at = 3 * j + base;
        if at >= 16 * part && at < 16 * (part + 1) {
            m[j] = (at - 16 * part) as u8;
        }
        j += 1;
    }
    m
}
const GATHER: [[[u8; 16]; 3]; 3] = {
    let mut g = [[[0u8; 16]; 3]; 3];
    let mut base = 0;
    while base < 3 {
        let mut part = 0;
        while part < 3 {
            g[base][part] = gather(part, base);
            part += 1;
        }
        base += 1;
    }
    g
};
/// By the low nibble of an upper-cased byte: its base code (A 0, C 1, G 2, T and U 3) ...
const CODE: [u8; 16] = [0, 0, 0, 1, 3, 3, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0];
/// ... and the byte that nibble must come from for the code to hold (0xFF: none; an
/// upper-cased byte never has bit 5 set, so never equals it).
const EXPECT: [u8; 16] = [
    0xFF, b'A', 0xFF, b'C', b'T', b'U', 0xFF, b'G', 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF,
];

#[target_feature(enable = "ssse3")]
unsafe fn ssse3(bases: &[u8], ids: &[u8; 128], dst: *mut u8) {
    let v = |a: &[u8; 16]| _mm_loadu_si128(a.as_ptr() as *const __m128i);
    let (code_t, expect_t) = (v(&CODE), v(&EXPECT));
    let quarter = |q: usize| _mm_loadu_si128(ids.as_ptr().add(16 * q) as *const __m128i);
    let tables = [quarter(0), quarter(1), quarter(2), quarter(3)];
    let unk = _mm_set1_epi8(ids[64] as i8);
    let (upper, nibble, three, bad) = (
        _mm_set1_epi8(0xDFu8 as i8),
        _mm_set1_epi8(0x0F),
        _mm_set1_epi8(3),
        _mm_set1_epi8(0x40),
    );
    let gather_t = GATHER.map(|g| g.map(|m| v(&m)));
    for (k, group) in bases.chunks_exact(48).enumerate() {
        // Per byte: base code in bits 0-1, bit 6 set when the byte is not a base.
        let mut parts = [_mm_setzero_si128(); 3];
        for (p, part) in parts.iter_mut().enumerate() {
            let x = _mm_loadu_si128(group.as_ptr().add(16 * p) as *const __m128i);
            let u = _mm_and_si128(x, upper);
            let lo = _mm_and_si128(u, nibble);
            let ok = _mm_cmpeq_epi8(u, _mm_shuffle_epi8(expect_t, lo));
            *part = _mm_or_si128(_mm_shuffle_epi8(code_t, lo), _mm_andnot_si128(ok, bad));
        }
        // First, second and third bases of the sixteen codons, one lane each.
        let pick = |base: usize| {
            let g = &gather_t[base];
            _mm_or_si128(
                _mm_or_si128(
                    _mm_shuffle_epi8(parts[0], g[0]),
                    _mm_shuffle_epi8(parts[1], g[1]),
                ),
                _mm_shuffle_epi8(parts[2], g[2]),
            )
        };
        let (b0, b1, b2) = (pick(0), pick(1), pick(2));
        let flagged = _mm_and_si128(_mm_or_si128(_mm_or_si128(b0, b1), b2), bad);
        // 16·c0 + 4·c1 + c2 (each below 4, so 16-bit shifts cannot carry between lanes).
        let code = _mm_or_si128(
            _mm_or_si128(
                _mm_slli_epi16(_mm_and_si128(b0, three), 4),
                _mm_slli_epi16(_mm_and_si128(b1, three), 2),
            ),
            _mm_and_si128(b2, three),
        );
        // The 64-entry lookup as four 16-entry shuffles, each kept where the code's top two
        // bits name its quarter.
        let quarter_of = _mm_and_si128(_mm_srli_epi16(code, 4), three);
        let mut id = _mm_setzero_si128();
        for (q, table) in tables.iter().enumerate() {
            let here = _mm_cmpeq_epi8(quarter_of, _mm_set1_epi8(q as i8));
            id = _mm_or_si128(id, _mm_and_si128(here, _mm_shuffle_epi8(*table, code)));
        }
        let is_bad = _mm_cmpeq_epi8(flagged, bad);
        let id = _mm_or_si128(_mm_andnot_si128(is_bad, id), _mm_and_si128(is_bad, unk));
        _mm_storeu_si128(dst.add(16 * k) as *mut __m128i, id);
    }
}
