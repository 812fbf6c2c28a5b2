//! FlashAttention against the naive reference: outputs and the gradients of q, k, v, on random
//! inputs, for causal / non-causal, with / without ALiBi, odd head counts, lengths that are not
//! multiples of the blocks, KV-cache offsets and length 1. Plus two checks of the op itself: the
//! autodiff backward is the hand-written one, and no `sq × sk` buffer is ever allocated.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use burn::tensor::{Device, Tensor, TensorData};
use genslm::model::position::alibi_slopes;
use genslm::ops::attention::flash::{
    flash_attention, flash_attention_backward, flash_attention_forward, DEFAULT_BLOCK_K,
    DEFAULT_BLOCK_Q,
};
use genslm::ops::attention::naive::naive_attention;
use genslm::ops::attention::options::AttnOptions;
use genslm::ops::attention::probe::{reset_tile_stats, tile_stats};
use genslm::rng::SplitMix64;

// ---- A per-thread "largest single allocation" probe (tests run on parallel threads). ----

struct LargestAlloc;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let _ = LARGEST.try_with(|c| {
        if size > c.get() {
            c.set(size)
        }
    });
}

unsafe impl GlobalAlloc for LargestAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        System.realloc(ptr, layout, new_size)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static ALLOC: LargestAlloc = LargestAlloc;

// ---- Helpers. ----

#[derive(Debug, Clone)]
struct Case {
    b: usize,
    h: usize,
    sq: usize,
    sk: usize,
    d: usize,
    causal: bool,
    alibi: bool,
    q_offset: usize,
    k_offset: usize,
    block_q: usize,
    block_k: usize,
}

impl Case {
    #[allow(clippy::too_many_arguments)]
    fn new(b: usize, h: usize, sq: usize, sk: usize, d: usize, bq: usize, bk: usize) -> Self {
        Self {
            b,
            h,
            sq,
            sk,
            d,
            causal: false,
            alibi: false,
            // A KV cache: the queries are the last sq positions of the sk keys.
            q_offset: sk - sq,
            k_offset: 0,
            block_q: bq,
            block_k: bk,
        }
    }

    fn opts(&self) -> AttnOptions {
        AttnOptions {
            causal: self.causal,
            alibi: self.alibi.then(|| alibi_slopes(self.h)),
            q_offset: self.q_offset,
            k_offset: self.k_offset,
        }
    }
}

fn random(rng: &mut SplitMix64, shape: [usize; 4]) -> TensorData {
    let n = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.next_f64() as f32 * 2.0 - 1.0).collect();
    TensorData::new(v, shape)
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.try_into_vec_as::<f32>().unwrap()
}

/// max|a − b| / max|ref|.
fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let diff = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let scale = want.iter().map(|x| x.abs()).fold(0f32, f32::max);
    assert!(diff.is_finite(), "non-finite result");
    // Floor the scale: some gradients are exactly zero (one visible key: softmax ≡ 1).
    diff / scale.max(1e-3)
}

type Attn<'a> = &'a dyn Fn(Tensor<4>, Tensor<4>, Tensor<4>) -> Tensor<4>;

/// Output and (dq, dk, dv) of `sum(attn(q, k, v) ∘ w)` on an autodiff device.
fn out_and_grads(f: Attn, data: &[TensorData; 4]) -> [Vec<f32>; 4] {
    let dev = Device::flex().autodiff();
    let q = Tensor::<4>::from_data(data[0].clone(), &dev).require_grad();
    let k = Tensor::<4>::from_data(data[1].clone(), &dev).require_grad();
    let v = Tensor::<4>::from_data(data[2].clone(), &dev).require_grad();
    let w = Tensor::<4>::from_data(data[3].clone(), &dev);
    let out = f(q.clone(), k.clone(), v.clone());
    let grads = (out.clone() * w).sum().backward();
    [
        values(out),
        values(q.grad(&grads).expect("dq")),
        values(k.grad(&grads).expect("dk")),
        values(v.grad(&grads).expect("dv")),
    ]
}

const TOL: f32 = 1e-4;

/// Checks one case; returns the largest relative error seen.
fn check(c: &Case, seed: u64) -> f32 {
    let mut rng = SplitMix64::new(seed);
    let qs = [c.b, c.h, c.sq, c.d];
    let ks = [c.b, c.h, c.sk, c.d];
    let data = [
        random(&mut rng, qs),
        random(&mut rng, ks),
        random(&mut rng, ks),
        random(&mut rng, qs),
    ];
    let opts = c.opts();
    let (bq, bk) = (c.block_q, c.block_k);

    // Plain device: forward only.
    let dev = Device::flex();
    let t = |i: usize| Tensor::<4>::from_data(data[i].clone(), &dev);
    let want = values(naive_attention(t(0), t(1), t(2), &opts));
    let got = values(flash_attention(t(0), t(1), t(2), &opts, bq, bk));
    let mut worst = rel_err(&got, &want);
    assert!(worst <= TOL, "{c:?}: plain forward error {worst}");

    // Autodiff: output and the gradients of q, k, v.
    reset_tile_stats();
    let got = out_and_grads(&|q, k, v| flash_attention(q, k, v, &opts, bq, bk), &data);
    let stats = tile_stats();
    let want = out_and_grads(&|q, k, v| naive_attention(q, k, v, &opts), &data);
    for (name, (g, w)) in ["out", "dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
        let e = rel_err(g, w);
        assert!(e <= TOL, "{c:?}: {name} error {e}");
        worst = worst.max(e);
    }
    // The op ran once forward and once through the hand-written backward, in tiles no larger
    // than the blocks.
    assert_eq!((stats.forward_calls, stats.backward_calls), (1, 1), "{c:?}");
    assert!(
        stats.max_tile_rows <= bq && stats.max_tile_cols <= bk,
        "{c:?}: {stats:?}"
    );
    worst
}

/// Every shape under the four combinations of causal × ALiBi.
fn check_all(cases: &[Case]) {
    let mut worst = 0f32;
    for (i, base) in cases.iter().enumerate() {
        for (j, (causal, alibi)) in [(false, false), (true, false), (false, true), (true, true)]
            .into_iter()
            .enumerate()
        {
            let c = Case {
                causal,
                alibi,
                ..base.clone()
            };
            let e = check(&c, 1000 + 10 * i as u64 + j as u64);
            worst = worst.max(e);
        }
    }
    println!("largest relative error: {worst:e}");
}

// ---- The comparisons. ----

#[test]
fn matches_naive_square() {
    check_all(&[
        Case::new(2, 1, 1, 1, 8, 16, 8),     // length 1
        Case::new(1, 3, 5, 5, 8, 16, 8),     // shorter than one block
        Case::new(2, 4, 37, 37, 16, 16, 8),  // not a multiple of either block
        Case::new(1, 6, 64, 64, 32, 32, 16), // an exact multiple
        Case::new(1, 3, 100, 100, 16, 32, 16),
        Case::new(1, 4, 100, 100, 8, 16, 8),
        Case::new(1, 3, 37, 37, 8, 7, 5), // odd blocks
        Case::new(1, 6, 37, 37, 16, DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K), // one tile
    ]);
}

#[test]
fn matches_naive_across_row_groups_and_key_panels() {
    // The CPU kernel runs each tile's products per group of 64 query rows and per 64-key panel
    // (ops::tile): sequences spanning several of each, panel tails, blocks that do not line up
    // with the panels, head dims on the vector kernels (64, 32) and off them (24).
    let mut shifted = Case::new(1, 2, 150, 200, 16, 64, 64);
    (shifted.q_offset, shifted.k_offset) = (70, 5);
    check_all(&[
        Case::new(1, 2, 300, 300, 64, DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K),
        Case::new(1, 2, 200, 200, 32, 96, 80),
        Case::new(1, 1, 130, 290, 64, 128, 160), // a cached prefix: q_offset 160
        Case::new(1, 1, 150, 150, 24, 128, 128),
        shifted,
    ]);
}

#[test]
fn matches_naive_kv_cache() {
    // q_offset = sk − sq, as decoding with a cache does.
    check_all(&[
        Case::new(1, 1, 1, 1, 8, 16, 8),
        Case::new(2, 3, 1, 100, 16, 32, 16), // one decode step
        Case::new(1, 3, 5, 37, 8, 16, 8),
        Case::new(1, 6, 37, 64, 32, 32, 16),
        Case::new(1, 4, 64, 100, 16, 16, 8),
    ]);
}

#[test]
fn matches_naive_shifted_positions() {
    // Both offsets non-zero (a sequence shard): causal masks by global position.
    let mut a = Case::new(1, 3, 37, 37, 16, 16, 8);
    (a.q_offset, a.k_offset) = (50, 50);
    let mut b = Case::new(1, 4, 20, 52, 8, 16, 8);
    (b.q_offset, b.k_offset) = (40, 8);
    let mut c = Case::new(2, 1, 33, 40, 8, 8, 16);
    (c.q_offset, c.k_offset) = (100, 61);
    check_all(&[a, b, c]);
}

#[test]
fn forward_and_backward_entry_points_match_autodiff() {
    // The op boundary (forward -> (o, lse), backward -> (dq, dk, dv)) called directly on a plain
    // device gives what autodiff gets through the registered backward.
    let mut c = Case::new(1, 3, 37, 53, 16, 16, 8);
    c.causal = true;
    c.alibi = true;
    let opts = c.opts();
    let mut rng = SplitMix64::new(7);
    let data = [
        random(&mut rng, [1, 3, 37, 16]),
        random(&mut rng, [1, 3, 53, 16]),
        random(&mut rng, [1, 3, 53, 16]),
        random(&mut rng, [1, 3, 37, 16]),
    ];
    let dev = Device::flex();
    let t = |i: usize| Tensor::<4>::from_data(data[i].clone(), &dev);
    let (o, lse) = flash_attention_forward(t(0), t(1), t(2), &opts, 16, 8);
    assert_eq!(lse.dims(), [1, 3, 37]);
    let (dq, dk, dv) =
        flash_attention_backward(t(0), t(1), t(2), o.clone(), lse, t(3), &opts, 16, 8);
    let want = out_and_grads(&|q, k, v| flash_attention(q, k, v, &opts, 16, 8), &data);
    for (g, w) in [values(o), values(dq), values(dk), values(dv)]
        .iter()
        .zip(&want)
    {
        assert!(rel_err(g, w) <= 1e-6);
    }
}

#[test]
fn never_allocates_a_score_matrix() {
    // sq = sk = 512: one f32 score matrix is 1 MiB; q, k, v, o are 16 KiB each and a 64×64 tile
    // is 16 KiB. Forward + backward through autodiff, non-causal with ALiBi (every tile works).
    let (s, d, blk) = (512, 8, 64);
    let matrix_bytes = s * s * 4;
    let mut rng = SplitMix64::new(3);
    let data: Vec<TensorData> = (0..4).map(|_| random(&mut rng, [1, 1, s, d])).collect();
    let opts = AttnOptions {
        causal: false,
        alibi: Some(alibi_slopes(1)),
        q_offset: 0,
        k_offset: 0,
    };
    let largest = |f: Attn| {
        let dev = Device::flex().autodiff();
        let t = |i: usize| Tensor::<4>::from_data(data[i].clone(), &dev).require_grad();
        let (q, k, v) = (t(0), t(1), t(2));
        let w = Tensor::<4>::from_data(data[3].clone(), &dev);
        // gemm keeps a per-thread packing buffer (1–2 MiB here) made on its first call on each
        // thread (burn's matmul; the attention tiles too where the tier sends them to gemm):
        // make them now, with one untimed pass of the same function.
        let _ = values(Tensor::<2>::ones([8, 8], &dev).matmul(Tensor::ones([8, 8], &dev)));
        let _ = (f(t(0), t(1), t(2)) * w.clone()).sum().backward();
        reset_tile_stats();
        LARGEST.with(|c| c.set(0));
        let grads = (f(q.clone(), k.clone(), v.clone()) * w).sum().backward();
        let dq = values(q.grad(&grads).unwrap());
        let big = LARGEST.with(|c| c.get());
        assert_eq!(dq.len(), s * d);
        big
    };
    let flash = largest(&|q, k, v| flash_attention(q, k, v, &opts, blk, blk));
    let stats = tile_stats();
    let naive = largest(&|q, k, v| naive_attention(q, k, v, &opts));
    println!("largest allocation: flash {flash} B, naive {naive} B, score matrix {matrix_bytes} B");
    // The probe sees the naive path's score matrix...
    assert!(
        naive >= matrix_bytes,
        "probe missed the naive scores: {naive}"
    );
    // ...and nothing even a quarter that size in the flash path.
    assert!(flash < matrix_bytes / 4, "flash allocated {flash} bytes");
    assert_eq!((stats.max_tile_rows, stats.max_tile_cols), (blk, blk));
    assert_eq!((stats.forward_calls, stats.backward_calls), (1, 1));
}

#[test]
fn checkpointing_device_and_partial_grads() {
    // A gradient-checkpointing autodiff device, and only q tracked (k, v constants).
    let mut c = Case::new(2, 3, 29, 45, 16, 16, 8);
    c.causal = true;
    c.alibi = true;
    let opts = c.opts();
    let mut rng = SplitMix64::new(11);
    let data = [
        random(&mut rng, [2, 3, 29, 16]),
        random(&mut rng, [2, 3, 45, 16]),
        random(&mut rng, [2, 3, 45, 16]),
        random(&mut rng, [2, 3, 29, 16]),
    ];
    let dq = |f: Attn| {
        let dev = Device::flex().autodiff().gradient_checkpointing();
        let t = |i: usize| Tensor::<4>::from_data(data[i].clone(), &dev);
        let q = t(0).require_grad();
        let (k, v) = (t(1), t(2));
        let grads = (f(q.clone(), k.clone(), v) * t(3)).sum().backward();
        assert!(k.grad(&grads).is_none());
        values(q.grad(&grads).expect("dq"))
    };
    let got = dq(&|q, k, v| flash_attention(q, k, v, &opts, 16, 8));
    let want = dq(&|q, k, v| naive_attention(q, k, v, &opts));
    assert!(rel_err(&got, &want) <= TOL);
}

#[test]
#[ignore = "timing only: cargo test --test ops_flash_attention timing -- --ignored --nocapture"]
fn timing() {
    use std::time::Instant;
    let (b, h, s, d) = (1, 8, 1024, 64);
    let opts = AttnOptions {
        causal: true,
        alibi: Some(alibi_slopes(h)),
        q_offset: 0,
        k_offset: 0,
    };
    let mut rng = SplitMix64::new(5);
    let data = [
        random(&mut rng, [b, h, s, d]),
        random(&mut rng, [b, h, s, d]),
        random(&mut rng, [b, h, s, d]),
        random(&mut rng, [b, h, s, d]),
    ];
    let run = |name: &str, f: Attn| {
        let t0 = Instant::now();
        let r = out_and_grads(f, &data);
        println!("{name}: forward+backward {:?}", t0.elapsed());
        r
    };
    let naive = run("naive", &|q, k, v| naive_attention(q, k, v, &opts));
    for blk in [64, 128, 256] {
        let got = run(&format!("flash {blk}x{blk}"), &|q, k, v| {
            flash_attention(q, k, v, &opts, blk, blk)
        });
        for (g, w) in got.iter().zip(&naive) {
            assert!(rel_err(g, w) <= TOL);
        }
    }
}
