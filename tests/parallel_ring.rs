//! Context parallelism (ring attention over zigzag chunks), at two levels:
//! - the op: ring attention against naive attention over the whole sequence on one rank — the
//!   output and the gradients of q, k and v, each rank holding its two zigzag chunks, causal
//!   with rotary-style plain scores and with ALiBi, CP 2 / 3 / 4 — plus the work balance the
//!   zigzag exists for: every rank scores the same number of query–key pairs;
//! - the pass itself: a neighbour exchange (as MPI's sendrecv), which waits for the previous
//!   rank only, and refuses blocks of unequal lengths;
//! - the op with work beside it (the MLP's place under overlap, `parallel::ring_overlap`): the
//!   same against naive attention, and the work's parts and gradients against the work undivided;
//! - training: CP alone and with Ulysses, DP and ZeRO on top gives the one-rank run on threads
//!   (losses, validation losses and gradient norms over 8 optimizer steps, ≤ 1e-5 relative, and
//!   the final checkpoint) for rotary, ALiBi and learned positions; and sequence lengths that no
//!   degree divides train exactly (padded, masked).

mod curves;

use std::sync::Arc;
use std::time::Duration;

use burn::tensor::{Device, Tensor, TensorData};
use curves::{layouts_match_one_rank, tiny};
use genslm::config::{Config, Position};
use genslm::model::attention::SequenceParallel;
use genslm::model::position::alibi_slopes;
use genslm::ops::attention::naive::naive_attention;
use genslm::ops::attention::options::AttnOptions;
use genslm::parallel::comm::Communicator;
use genslm::parallel::progress::Progress;
use genslm::parallel::ring::{ring_attention, RingGroup};
use genslm::parallel::ring_overlap::attention_beside;
use genslm::parallel::threads::thread_group;
use genslm::parallel::{Degrees, Topology};
use genslm::rng::SplitMix64;

const B: usize = 2;
const H: usize = 3;
const D: usize = 8;

fn random(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.next_f64() * 2.0 - 1.0) as f32)
        .collect()
}

/// `x: [B, H, s, D]` host values → the columns `cols` of the sequence dim, in that order.
fn take_cols(x: &[f32], s: usize, cols: &[usize]) -> Vec<f32> {
    let mut out = Vec::with_capacity(B * H * cols.len() * D);
    for bh in 0..B * H {
        for &c in cols {
            let at = (bh * s + c) * D;
            out.extend_from_slice(&x[at..at + D]);
        }
    }
    out
}

fn values(t: Tensor<4>) -> Vec<f32> {
    t.try_into_vec_as::<f32>().unwrap()
}

/// Output and (dq, dk, dv) of `Σ attn(q, k, v) ⊙ w`, as host vectors.
fn out_and_grads(
    attn: impl Fn(Tensor<4>, Tensor<4>, Tensor<4>) -> Tensor<4>,
    x: [&[f32]; 4],
    s: usize,
) -> [Vec<f32>; 4] {
    let dev = Device::flex().autodiff();
    let t = |v: &[f32]| Tensor::<4>::from_data(TensorData::new(v.to_vec(), [B, H, s, D]), &dev);
    let (q, k, v) = (
        t(x[0]).require_grad(),
        t(x[1]).require_grad(),
        t(x[2]).require_grad(),
    );
    let out = attn(q.clone(), k.clone(), v.clone());
    let grads = (out.clone() * t(x[3])).sum().backward();
    [
        values(out),
        values(q.grad(&grads).unwrap()),
        values(k.grad(&grads).unwrap()),
        values(v.grad(&grads).unwrap()),
    ]
}

/// Random q, k, v and output weights `w` over a whole sequence of `s` (drawn from `rng`), the
/// causal options, and the reference: naive attention's output and gradients on one rank.
fn whole_sequence(
    rng: &mut SplitMix64,
    s: usize,
    alibi: bool,
) -> (Vec<Vec<f32>>, AttnOptions, [Vec<f32>; 4]) {
    let n = B * H * s * D;
    let data: Vec<Vec<f32>> = (0..4).map(|_| random(rng, n)).collect();
    let opts = AttnOptions {
        causal: true,
        alibi: alibi.then(|| alibi_slopes(H)),
        q_offset: 0,
        k_offset: 0,
    };
    let x = [&data[0][..], &data[1], &data[2], &data[3]];
    let want = out_and_grads(|q, k, v| naive_attention(q, k, v, &opts), x, s);
    (data, opts, want)
}

/// The sequence positions CP rank `rank` of `cp` holds (its two zigzag chunks), in order.
fn zigzag_cols(rank: usize, cp: usize, s: usize) -> Vec<usize> {
    Topology::grid(rank, 1, cp, 1)
        .unwrap()
        .spans(s)
        .iter()
        .flat_map(|sp| sp.start..sp.start + sp.len)
        .collect()
}

/// `got` within 1e-5 of `want`, relative to `want`'s largest magnitude (at least 1).
fn assert_close(ctx: &str, what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{ctx}: {what}");
    let scale = want.iter().fold(1e-3f32, |m, x| m.max(x.abs()));
    let diff = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        diff <= 1e-5 * scale.max(1.0),
        "{ctx}: {what} differs by {diff} (scale {scale})"
    );
}

fn check(cp: usize, s: usize, alibi: bool) {
    let mut rng = SplitMix64::new(cp as u64 * 1000 + s as u64);
    let (data, opts, want) = whole_sequence(&mut rng, s, alibi);

    let comms = thread_group(cp, Duration::from_secs(60));
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let (data, opts) = (data.clone(), opts.clone());
            std::thread::spawn(move || {
                let cols = zigzag_cols(rank, cp, s);
                let mine: Vec<Vec<f32>> = data.iter().map(|d| take_cols(d, s, &cols)).collect();
                let group = RingGroup::new(Arc::new(comm));
                let got = out_and_grads(
                    |q, k, v| ring_attention(q, k, v, &opts, &group),
                    [&mine[0], &mine[1], &mine[2], &mine[3]],
                    cols.len(),
                );
                let scored = group.scored.load(std::sync::atomic::Ordering::Relaxed);
                (cols, got, scored)
            })
        })
        .collect();
    let mut work = Vec::new();
    for h in handles {
        let (cols, got, scored) = h.join().unwrap();
        work.push(scored);
        let ctx = format!("cp {cp} s {s} alibi {alibi}");
        for (what, (g, w)) in ["o", "dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
            assert_close(&ctx, what, g, &take_cols(w, s, &cols));
        }
    }
    // The causal work of the whole sequence, split equally by the zigzag.
    let total = (B * H * s * (s + 1) / 2) as u64;
    assert_eq!(work.iter().sum::<u64>(), total, "cp {cp}: pairs scored");
    let (lo, hi) = (work.iter().min().unwrap(), work.iter().max().unwrap());
    assert!(
        (*hi - *lo) as f64 <= 0.05 * *hi as f64,
        "cp {cp}: per-rank attention work {work:?} differs by more than 5%"
    );
    println!("cp {cp} s {s}: query-key pairs scored per rank {work:?}");
}

#[test]
fn ring_attention_matches_one_rank() {
    for (cp, s) in [(2, 16), (3, 24), (4, 32), (4, 256)] {
        check(cp, s, false);
        check(cp, s, true);
    }
}

/// Ring passes on 4 thread ranks, where rank 3 passes only once rank 1's pass has returned:
/// rank 1 waits for rank 0 alone, so everyone finishes with the previous rank's block (a pass
/// that waited for the whole group would stop here until the timeout). Then a rank whose block
/// has another length is refused, naming both ranks.
#[test]
fn a_ring_pass_waits_for_the_previous_rank_only() {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let rx = std::sync::Mutex::new(Some(rx));
    let handles: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = thread_group(4, Duration::from_secs(20))
            .into_iter()
            .map(|c| {
                let tx = tx.clone();
                let rx = (c.rank() == 3).then(|| rx.lock().unwrap().take().unwrap());
                s.spawn(move || {
                    if let Some(rx) = rx {
                        rx.recv().unwrap();
                    }
                    let r = c.rank() as f32;
                    let got = c.ring_pass(&[r, r + 0.5]).unwrap();
                    if c.rank() == 1 {
                        tx.send(()).unwrap();
                    }
                    got
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, got) in handles.iter().enumerate() {
        let prev = ((rank + 3) % 4) as f32;
        assert_eq!(got, &vec![prev, prev + 0.5], "rank {rank}");
    }
    let errs: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = thread_group(2, Duration::from_secs(20))
            .into_iter()
            .map(|c| s.spawn(move || c.ring_pass(&vec![1.0; 2 + c.rank()]).map(|_| ())))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let e = errs[1].as_ref().unwrap_err().to_string();
    assert!(
        e.contains("rank 1 expected 3 elements from rank 0, which sent 2"),
        "{e}"
    );
    let e = errs[0].as_ref().unwrap_err().to_string();
    assert!(
        e.contains("rank 0 expected 2 elements from rank 1, which sent 3"),
        "{e}"
    );
}

/// Ring attention with work beside it (`ring_overlap::attention_beside`, where the MLP goes
/// under overlap): on ranks with a communication thread, the attention output and the
/// gradients of q, k and v equal naive attention over the whole sequence on one rank, and the
/// side work's parts (`tanh(h) ⊙ a` over row ranges of the rank's `h`, each tied to the ring)
/// equal the same function on all of `h`, with the gradients of `h` and of the shared `a`
/// (summed over the parts), under `Σ o ⊙ w + Σ side ⊙ u`.
fn check_beside(cp: usize, s: usize, alibi: bool) {
    let mut rng = SplitMix64::new(cp as u64 * 7919 + s as u64);
    let (data, opts, want) = whole_sequence(&mut rng, s, alibi);
    let a_host = random(&mut rng, D);
    let comms = thread_group(cp, Duration::from_secs(60));
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let (data, opts, a_host) = (data.clone(), opts.clone(), a_host.clone());
            std::thread::spawn(move || {
                let cols = zigzag_cols(rank, cp, s);
                let mine: Vec<Vec<f32>> = data.iter().map(|d| take_cols(d, s, &cols)).collect();
                let rows = cols.len();
                let group = RingGroup::new(Progress::wrap(Arc::new(comm)));
                assert!(
                    group.hides_work(),
                    "a ring with a communication thread hides work"
                );
                let dev = Device::flex().autodiff();
                let t4 = |v: &[f32]| {
                    Tensor::<4>::from_data(TensorData::new(v.to_vec(), [B, H, rows, D]), &dev)
                };
                let mut rng = SplitMix64::new(100 + rank as u64);
                let (h_host, u_host) = (
                    random(&mut rng, B * rows * D),
                    random(&mut rng, B * rows * D),
                );
                let t3 = |v: &[f32], shape: [usize; 3]| {
                    Tensor::<3>::from_data(TensorData::new(v.to_vec(), shape), &dev)
                };
                let side_loss = |side: Tensor<3>| (side * t3(&u_host, [B, rows, D])).sum();
                // The reference: tanh(h) ⊙ a on all rows, no ring.
                let (h, a) = (
                    t3(&h_host, [B, rows, D]).require_grad(),
                    t3(&a_host, [1, 1, D]).require_grad(),
                );
                let side = h.clone().tanh() * a.clone();
                let grads = side_loss(side.clone()).backward();
                let reference = [
                    side.try_into_vec_as::<f32>().unwrap(),
                    h.grad(&grads).unwrap().try_into_vec_as::<f32>().unwrap(),
                    a.grad(&grads).unwrap().try_into_vec_as::<f32>().unwrap(),
                ];
                // The ring with the parts beside it.
                let (q, k, v) = (
                    t4(&mine[0]).require_grad(),
                    t4(&mine[1]).require_grad(),
                    t4(&mine[2]).require_grad(),
                );
                let (h, a) = (
                    t3(&h_host, [B, rows, D]).require_grad(),
                    t3(&a_host, [1, 1, D]).require_grad(),
                );
                let mut count = 0;
                let mut work = |part: usize, parts: usize, tie: &dyn Fn(Tensor<3>) -> Tensor<3>| {
                    count = parts;
                    let (first, end) = (part * rows / parts, (part + 1) * rows / parts);
                    tie(h.clone().narrow(1, first, end - first)).tanh() * a.clone()
                };
                let (o, parts) =
                    attention_beside(q.clone(), k.clone(), v.clone(), &opts, &group, &mut work);
                assert_eq!((count, parts.len()), (cp + 1, cp + 1), "one part per gap");
                let side = Tensor::cat(parts, 1);
                let loss = (o.clone() * t4(&mine[3])).sum() + side_loss(side.clone());
                let grads = loss.backward();
                let got = [
                    values(o),
                    values(q.grad(&grads).unwrap()),
                    values(k.grad(&grads).unwrap()),
                    values(v.grad(&grads).unwrap()),
                ];
                let side_got = [
                    side.try_into_vec_as::<f32>().unwrap(),
                    h.grad(&grads).unwrap().try_into_vec_as::<f32>().unwrap(),
                    a.grad(&grads).unwrap().try_into_vec_as::<f32>().unwrap(),
                ];
                (cols, got, side_got, reference)
            })
        })
        .collect();
    for h in handles {
        let (cols, got, side_got, reference) = h.join().unwrap();
        let ctx = format!("beside, cp {cp} s {s} alibi {alibi}");
        for (what, (g, w)) in ["o", "dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
            assert_close(&ctx, what, g, &take_cols(w, s, &cols));
        }
        for (what, (g, w)) in ["side", "dh", "da"]
            .iter()
            .zip(side_got.iter().zip(&reference))
        {
            assert_close(&ctx, what, g, w);
        }
    }
}

#[test]
fn ring_beside_work_matches_one_rank() {
    for (cp, s) in [(2, 16), (3, 24), (4, 32)] {
        check_beside(cp, s, false);
        check_beside(cp, s, true);
    }
}

// ---- Training with CP: the one-rank run's curves. ----

/// `(dp, cp, sp, zero, checkpoint_activations)`.
type Layout = (usize, usize, usize, u8, bool);

fn run_layouts(pos: Position, seq: usize, layouts: &[Layout]) {
    run_config(tiny(pos, seq), layouts)
}

fn run_config(cfg: Config, layouts: &[Layout]) {
    let grid: Vec<_> = layouts
        .iter()
        .map(|&(dp, cp, sp, zero, ckpt)| (Degrees::new(dp, cp, sp), zero, ckpt))
        .collect();
    layouts_match_one_rank(&cfg, &grid)
}

#[test]
fn ring_matches_one_rank_with_rotary() {
    run_layouts(
        Position::Rotary,
        32,
        &[
            (1, 2, 1, 0, false),
            (1, 4, 1, 0, false),
            (1, 2, 2, 0, false),
            (2, 2, 1, 1, false),
            (1, 2, 2, 3, true),
        ],
    );
}

#[test]
fn ring_matches_one_rank_with_alibi_and_learned_positions() {
    for pos in [Position::Alibi, Position::Learned] {
        run_layouts(
            pos,
            32,
            &[(1, 2, 1, 0, false), (1, 4, 1, 0, true), (1, 2, 2, 0, false)],
        );
    }
}

/// 37 tokens divide by no degree: every layout pads the sequence's end to its pieces (SP 2:
/// 38; CP 2: 40; SP 3: 39; SP 2 × CP 2: 40) and masks the padding out of the loss.
#[test]
fn lengths_no_degree_divides_train_exactly() {
    for pos in [Position::Rotary, Position::Alibi, Position::Learned] {
        run_layouts(
            pos,
            37,
            &[
                (1, 1, 2, 0, false),
                (1, 2, 1, 0, false),
                (1, 2, 2, 1, false),
            ],
        );
    }
}

/// A short sequence over many ranks: a rank holds fewer rows than the MLP has parts beside
/// the ring (n + 1) or the all-to-alls (2), so some parts are empty (burn cannot narrow to no
/// rows: CP 64 or SP 64 on 64 codons failed inside a rank).
#[test]
fn ranks_with_fewer_rows_than_mlp_parts_match_one_rank() {
    run_layouts(
        Position::Rotary,
        6,
        &[
            (1, 4, 1, 0, false),
            (1, 4, 1, 1, true),
            (1, 1, 4, 0, false),
            (1, 2, 2, 0, false),
        ],
    );
}

/// 3 heads on SP 2: Ulysses pads to 4 heads (one empty) so each rank takes 2; with CP too.
#[test]
fn head_counts_sp_does_not_divide_train_exactly() {
    for pos in [Position::Rotary, Position::Alibi] {
        let mut cfg = tiny(pos, 32);
        cfg.model.hidden_size = 48;
        cfg.model.num_heads = 3;
        cfg.model.intermediate_size = 192;
        run_config(
            cfg,
            &[(1, 1, 2, 0, false), (1, 2, 2, 0, false), (2, 1, 2, 3, true)],
        );
    }
}
