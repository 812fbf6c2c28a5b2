//! The codecs against naive references written here (bf16 rounding chosen by comparing both
//! neighbours in f64; int8 codes from an f64 scale), and the collectives on thread ranks
//! against the f64 sum of what each rank's contribution decodes to.

use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::parallel::threads::thread_group;

fn lcg(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed;
    move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// The bf16 nearest to `x` (ties to the even mantissa), chosen among its two bf16 neighbours
/// by their distance in f64.
fn naive_bf16(x: f32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    let down = f32::from_bits(x.to_bits() & 0xffff_0000);
    let up = f32::from_bits((x.to_bits() & 0xffff_0000).wrapping_add(0x1_0000));
    // Past bf16's largest finite value the next step up is 2^128, which IEEE rounds to ∞.
    let up_value = if up.is_infinite() {
        up.signum() as f64 * 2f64.powi(128)
    } else {
        up as f64
    };
    let (dd, du) = ((x as f64 - down as f64).abs(), (up_value - x as f64).abs());
    if dd < du || (dd == du && (down.to_bits() >> 16) & 1 == 0) {
        down
    } else {
        up
    }
}

/// Each value's int8 decoding by the f64 definition: blocks of `QBLOCK` from the start, scale
/// `max |x| / 127`, code `x / scale` rounded to the nearest (ties to even).
fn naive_int8(xs: &[f32]) -> Vec<(f64, f64)> {
    let mut out = Vec::new();
    for b in xs.chunks(QBLOCK) {
        let max = b.iter().fold(0.0f64, |m, &x| m.max((x as f64).abs()));
        let scale = max / 127.0;
        for &x in b {
            let q = if scale > 0.0 {
                (x as f64 / scale).round_ties_even()
            } else {
                0.0
            };
            out.push((q * scale, scale));
        }
    }
    out
}

/// Whether decoded `g` carries the f64 definition's code for `x` (decoded `want`, `scale`):
/// the same multiple of the scale, unless `x / scale` lies within 1e-4 of a half-way point,
/// where f32 and f64 arithmetic may round to either neighbour.
fn same_code(x: f32, g: f32, (want, scale): (f64, f64)) -> bool {
    if scale == 0.0 {
        return g == 0.0;
    }
    let r = (x as f64 / scale).abs();
    let near_tie = ((r - r.floor()) - 0.5).abs() < 1e-4;
    near_tie || ((g as f64 - want) / scale).abs() < 1e-3
}

/// [`naive_int8`] of each piece of `piece` values, as a reduce-scatter in pieces encodes.
fn naive_int8_pieces(xs: &[f32], piece: usize) -> Vec<(f64, f64)> {
    xs.chunks(piece).flat_map(naive_int8).collect()
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut r = lcg(seed);
    // Blocks of very different magnitudes, as a layer's gradients have.
    (0..n)
        .map(|i| r() * 10f32.powi((i / QBLOCK % 7) as i32 - 4))
        .collect()
}

#[test]
fn bf16_rounds_to_the_nearest_ties_to_even() {
    let mut xs = values(5000, 1);
    xs.extend([
        0.0,
        -0.0,
        1.0,
        f32::MAX,
        f32::MIN_POSITIVE,
        1e-40,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::from_bits(0x3f80_8000), // exactly half-way, even below: rounds down
        f32::from_bits(0x3f81_8000), // half-way, odd below: rounds up
        f32::from_bits(0x3f80_8001),
    ]);
    let got = round_trip(Quantize::Bf16, &xs);
    for (&x, &g) in xs.iter().zip(&got) {
        assert_eq!(
            g.to_bits(),
            naive_bf16(x).to_bits(),
            "{x:e} ({:#x})",
            x.to_bits()
        );
    }
    assert!(round_trip(Quantize::Bf16, &[f32::NAN])[0].is_nan());
    assert_eq!(encoded_len(Quantize::Bf16, 5011), 2506);
}

#[test]
fn int8_blocks_decode_within_half_a_step_of_the_value() {
    for n in [1, 3, 255, 256, 257, 1000, 4096] {
        let xs = values(n, n as u64);
        let got = round_trip(Quantize::Int8, &xs);
        assert_eq!(
            encoded_len(Quantize::Int8, n),
            n.div_ceil(QBLOCK) + n.div_ceil(4)
        );
        for ((&x, &g), (want, scale)) in xs.iter().zip(&got).zip(naive_int8(&xs)) {
            let err = (x as f64 - g as f64).abs();
            assert!(
                err <= 0.5 * scale * (1.0 + 1e-5) + 1e-30,
                "n {n}: {x} -> {g}"
            );
            assert!(
                same_code(x, g, (want, scale)),
                "n {n}: {x} -> {g}, not {want}"
            );
        }
    }
    // An all-zero block stays exactly zero; a non-finite value poisons its block only.
    let mut xs = values(3 * QBLOCK, 9);
    xs[..QBLOCK].fill(0.0);
    xs[QBLOCK + 7] = f32::INFINITY;
    let got = round_trip(Quantize::Int8, &xs);
    assert!(got[..QBLOCK].iter().all(|&x| x == 0.0));
    assert!(got[QBLOCK..2 * QBLOCK].iter().all(|x| x.is_nan()));
    assert!(got[2 * QBLOCK..].iter().all(|x| x.is_finite()));
    xs[2 * QBLOCK] = f32::NAN;
    assert!(round_trip(Quantize::Int8, &xs)[2 * QBLOCK + 1].is_nan());
}

#[test]
fn a_decode_of_the_wrong_length_is_refused() {
    let mut out = vec![0.0; 10];
    let err = decode(Quantize::Int8, &[0.0; 3], &mut out, false).unwrap_err();
    assert!(err
        .to_string()
        .contains("3 encoded words arrived for 10 values"));
}

/// Runs `f(rank, comm)` on `n` thread ranks and returns the results in rank order.
fn on_ranks<T: Send + 'static>(
    n: usize,
    f: impl Fn(usize, &dyn Communicator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let handles: Vec<_> = thread_group(n, Duration::from_secs(30))
        .into_iter()
        .enumerate()
        .map(|(r, c)| {
            let f = f.clone();
            std::thread::spawn(move || f(r, &c))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Every bit pattern (NaNs of every kind, subnormals, each byte value in each position)
/// arrives as sent through the plain copies the encoded words travel by.
#[test]
fn any_bits_travel_unchanged() {
    let mut words: Vec<u32> = vec![0x7f80_0001, 0xff80_0001, 0x7fc0_0000, 0xffff_ffff, 1, 0];
    words.extend((0..256u32).map(|b| b | (b << 8) | (b << 16) | (b << 24)));
    words.extend((0..256u32).map(|b| 0x7f80_0000 | (b << 8) | b));
    let sent: Vec<f32> = words.iter().map(|&w| f32::from_bits(w)).collect();
    let got = on_ranks(3, move |r, c| {
        let mut all = vec![0.0f32; sent.len() * 3];
        c.all_gather_into(&sent, &mut all).unwrap();
        let back = c.all_to_all(vec![sent.clone(); 3]).unwrap();
        (r, all, back)
    });
    for (_, all, back) in got {
        for (i, x) in all.iter().enumerate() {
            assert_eq!(x.to_bits(), words[i % words.len()], "all-gather word {i}");
        }
        for b in back {
            let bits: Vec<u32> = b.iter().map(|x| x.to_bits()).collect();
            assert_eq!(bits, words, "all-to-all");
        }
    }
}

/// The quantized reduce-scatter gives each rank the f64 sum of the ranks' int8 decodings of
/// their contribution to its block (and so lies within half a step per rank of the exact
/// sum): one piece per block, pieces of one scale block, and pieces of 333 values (scale
/// blocks restart at each piece: 256 + 77 values).
#[test]
fn reduce_scatter_sums_every_ranks_decoded_contribution() {
    let (size, block) = (3usize, 1000usize);
    for bucket in [1 << 20, 3, 1000] {
        let piece = (bucket / size).max(QBLOCK);
        let got = on_ranks(size, move |r, c| {
            let flat = values(size * block, 100 + r as u64);
            let mut out = vec![0.0f32; block];
            reduce_scatter_quantized(c, &flat, &mut out, Quantize::Int8, bucket).unwrap();
            out
        });
        for (j, out) in got.iter().enumerate() {
            let mut want = vec![0.0f64; block];
            let mut exact = vec![0.0f64; block];
            let mut bound = vec![0.0f64; block];
            for r in 0..size {
                let flat = values(size * block, 100 + r as u64);
                let mine = &flat[j * block..(j + 1) * block];
                let decoded = naive_int8_pieces(mine, piece);
                for (i, ((d, s), &x)) in decoded.into_iter().zip(mine).enumerate() {
                    want[i] += d;
                    exact[i] += x as f64;
                    bound[i] += 0.5 * s;
                }
            }
            for i in 0..block {
                let g = out[i] as f64;
                assert!(
                    (g - want[i]).abs() <= 2e-4 * bound[i] + 1e-6 * want[i].abs() + 1e-30,
                    "bucket {bucket} rank {j} value {i}: {g} vs {}",
                    want[i]
                );
                assert!((g - exact[i]).abs() <= bound[i] * 1.0001 + 1e-6 * exact[i].abs());
            }
        }
    }
}

/// The quantized all-reduce leaves identical bits on every rank, close to the exact sum; the
/// quantized all-gather gives every rank every block's decoding.
#[test]
fn all_reduce_and_all_gather_agree_on_every_rank() {
    let size = 4;
    let lens = [5usize, 700, 1, 333];
    let got = on_ranks(size, move |r, c| {
        let mut bufs: Vec<Vec<f32>> = lens
            .iter()
            .enumerate()
            .map(|(k, &n)| values(n, (r * 10 + k) as u64))
            .collect();
        all_reduce_quantized(c, &mut bufs, Quantize::Bf16, 64).unwrap();
        let gathered = all_gather_quantized(c, &values(300, r as u64), Quantize::Int8, 50).unwrap();
        (bufs, gathered)
    });
    let bits = |v: &Vec<Vec<f32>>| -> Vec<u32> { v.concat().iter().map(|x| x.to_bits()).collect() };
    for (bufs, gathered) in &got {
        assert_eq!(
            bits(bufs),
            bits(&got[0].0),
            "every rank holds the same sums"
        );
        for (k, &n) in lens.iter().enumerate() {
            let contributions: Vec<Vec<f32>> =
                (0..size).map(|r| values(n, (r * 10 + k) as u64)).collect();
            for (i, &got) in bufs[k].iter().enumerate() {
                let exact: f64 = contributions.iter().map(|c| c[i] as f64).sum();
                let mag: f64 = contributions.iter().map(|c| (c[i] as f64).abs()).sum();
                // bf16 keeps 8 bits: each contribution and the sum within 2^-8 relative.
                let tol = (mag + exact.abs()) * 2f64.powi(-8) + 1e-30;
                assert!((got as f64 - exact).abs() <= tol, "buffer {k} value {i}");
            }
        }
        for r in 0..size {
            let mine = values(300, r as u64);
            for (i, reference) in naive_int8(&mine).into_iter().enumerate() {
                let g = gathered[r * 300 + i];
                assert!(same_code(mine[i], g, reference), "block {r} value {i}");
            }
        }
    }
}
