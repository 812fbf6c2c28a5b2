//! FlashAttention-2 as burn tensor ops on non-autodiff tiles: the reference algorithm of the
//! op (`flash.rs`) for dtypes and backends without a fused kernel. Forward: query blocks outer,
//! key blocks inner with an online softmax. Backward: key blocks outer, query blocks inner;
//! each tile's probabilities are recomputed from the saved log-sum-exp. Either direction only
//! ever forms `[b, h, ≤ block_q, ≤ block_k]` score tiles, created by [`Tile`], which
//! `debug_assert!`s that bound.

use burn::tensor::{Bool, Device, Int, Tensor, TensorData};

use super::flash::FlashParams;
use super::probe::record;

/// One score tile: query rows `[qs, qs + nq)` against key columns `[ks, ks + nk)`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tile {
    qs: usize,
    nq: usize,
    ks: usize,
    nk: usize,
}

/// What causality says about a tile.
#[derive(Debug, PartialEq)]
pub(crate) enum Causal {
    /// Every key is visible to every query (or the attention is not causal).
    Full,
    /// The tile crosses the diagonal: some keys come after some queries.
    Diagonal,
    /// Every key comes after every query: the tile contributes nothing.
    Skip,
}

impl Tile {
    pub(crate) fn new(qs: usize, nq: usize, ks: usize, nk: usize, p: &FlashParams) -> Self {
        // The bound that proves no sq × sk (or other oversized) score tensor exists.
        debug_assert!(
            nq <= p.block_q && nk <= p.block_k,
            "tile exceeds the blocks"
        );
        record(|s| {
            s.max_tile_rows = s.max_tile_rows.max(nq);
            s.max_tile_cols = s.max_tile_cols.max(nk);
        });
        Self { qs, nq, ks, nk }
    }

    pub(crate) fn causal(&self, p: &FlashParams) -> Causal {
        let p = &p.opts;
        if !p.causal {
            return Causal::Full;
        }
        let (q_first, q_last) = (p.q_offset + self.qs, p.q_offset + self.qs + self.nq - 1);
        let (k_first, k_last) = (p.k_offset + self.ks, p.k_offset + self.ks + self.nk - 1);
        if k_first > q_last {
            Causal::Skip
        } else if k_last > q_first {
            Causal::Diagonal
        } else {
            Causal::Full
        }
    }

    /// `pos_q − pos_k` over the tile, `[1, 1, nq, nk]` (exact integers, then float).
    fn distance(&self, p: &FlashParams, device: &Device) -> Tensor<4> {
        let q0 = (p.opts.q_offset + self.qs) as i64;
        let k0 = (p.opts.k_offset + self.ks) as i64;
        let shape = [1, 1, self.nq, self.nk];
        let qp = Tensor::<1, Int>::arange(q0..q0 + self.nq as i64, device)
            .reshape([1, 1, self.nq, 1])
            .expand(shape);
        let kp = Tensor::<1, Int>::arange(k0..k0 + self.nk as i64, device)
            .reshape([1, 1, 1, self.nk])
            .expand(shape);
        (qp - kp).float()
    }

    /// Scaled scores of the tile plus the ALiBi bias, with keys after queries set to −∞ on
    /// diagonal tiles: `[b, h, nq, nk]`.
    pub(crate) fn scores(
        &self,
        q_blk: &Tensor<4>,
        k_blk: &Tensor<4>,
        neg_slopes: Option<&Tensor<4>>,
        scale: f64,
        p: &FlashParams,
    ) -> Tensor<4> {
        let [b, h, _, _] = q_blk.dims();
        let shape = [b, h, self.nq, self.nk];
        let mut s = q_blk.clone().matmul(k_blk.clone().swap_dims(2, 3)) * scale;
        let diagonal = self.causal(p) == Causal::Diagonal;
        if neg_slopes.is_none() && !diagonal {
            return s;
        }
        let device = s.device();
        let dist = self.distance(p, &device).cast(s.dtype());
        if let Some(neg_slopes) = neg_slopes {
            // bias = −slope_h · (i − j) causal, −slope_h · |i − j| otherwise: [1, h, nq, nk].
            let d = if p.opts.causal {
                dist.clone()
            } else {
                dist.clone().abs()
            };
            let bias = d.expand([1, h, self.nq, self.nk]) * neg_slopes.clone();
            s = s + bias.expand(shape);
        }
        if diagonal {
            let mask: Tensor<4, Bool> = dist.lower_elem(0.0);
            s = s.mask_fill(mask.expand(shape), f32::NEG_INFINITY);
        }
        s
    }
}

/// The negated slopes `−slope_h` as `[1, h, 1, 1]`, broadcast over a tile.
pub(crate) fn neg_slopes_tensor(p: &FlashParams, like: &Tensor<4>) -> Option<Tensor<4>> {
    p.opts.alibi.as_ref().map(|s| {
        let h = s.len();
        let data: Vec<f32> = s.iter().map(|&x| -x as f32).collect();
        Tensor::<4>::from_data(TensorData::new(data, [1, h, 1, 1]), &like.device())
            .cast(like.dtype())
    })
}

/// The last key index (exclusive) any query of `[qs, qs + nq)` can see.
pub(crate) fn key_end(qs: usize, nq: usize, sk: usize, p: &FlashParams) -> usize {
    let o = &p.opts;
    if o.causal {
        (o.q_offset + qs + nq).saturating_sub(o.k_offset).min(sk)
    } else {
        sk
    }
}

/// FlashAttention-2 forward over non-autodiff tensors: `(o, lse)`.
pub(crate) fn tiled_forward(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    p: &FlashParams,
) -> (Tensor<4>, Tensor<3>) {
    let [_, _, sq, d] = q.dims();
    let sk = k.dims()[2];
    let scale = 1.0 / (d as f64).sqrt();
    let neg_slopes = neg_slopes_tensor(p, &q);
    record(|s| s.forward_calls += 1);
    let mut outs = Vec::new();
    let mut lses = Vec::new();
    for qs in (0..sq).step_by(p.block_q) {
        let nq = p.block_q.min(sq - qs);
        let q_blk = q.clone().narrow(2, qs, nq);
        // Running row max m, row sum l, accumulator acc; None until the first key block.
        let mut state: Option<(Tensor<4>, Tensor<4>, Tensor<4>)> = None;
        // Key blocks after `k_end` are entirely in the future of this query block: skipped.
        let k_end = key_end(qs, nq, sk, p);
        for ks in (0..k_end).step_by(p.block_k) {
            let nk = p.block_k.min(k_end - ks);
            let tile = Tile::new(qs, nq, ks, nk, p);
            if tile.causal(p) == Causal::Skip {
                continue;
            }
            let k_blk = k.clone().narrow(2, ks, nk);
            let v_blk = v.clone().narrow(2, ks, nk);
            let s = tile.scores(&q_blk, &k_blk, neg_slopes.as_ref(), scale, p);
            let row_max = s.clone().max_dim(3);
            state = Some(match state {
                None => {
                    let pr = (s - row_max.clone()).exp();
                    let l = pr.clone().sum_dim(3);
                    (row_max, l, pr.matmul(v_blk))
                }
                Some((m, l, acc)) => {
                    let m_new = m.clone().max_pair(row_max);
                    let pr = (s - m_new.clone()).exp();
                    let alpha = (m - m_new.clone()).exp();
                    let l = l * alpha.clone() + pr.clone().sum_dim(3);
                    let acc = acc * alpha + pr.matmul(v_blk);
                    (m_new, l, acc)
                }
            });
        }
        let (m, l, acc) = state.unwrap_or_else(|| {
            // No visible key at all (k_offset beyond every query): the naive softmax is 0/0.
            let [b, h, _, _] = q_blk.dims();
            let dv = v.dims()[3];
            let nan = Tensor::<4>::full([b, h, nq, 1], f32::NAN, &q.device());
            (nan.clone(), nan.clone(), nan.expand([b, h, nq, dv]))
        });
        outs.push(acc / l.clone());
        lses.push((m + l.log()).squeeze_dim::<3>(3));
    }
    (Tensor::cat(outs, 2), Tensor::cat(lses, 2))
}

/// FlashAttention-2 backward over non-autodiff tensors: `(dq, dk, dv)`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn tiled_backward(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    o: Tensor<4>,
    lse: Tensor<3>,
    d_o: Tensor<4>,
    p: &FlashParams,
) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
    let [_, _, sq, d] = q.dims();
    let sk = k.dims()[2];
    let scale = 1.0 / (d as f64).sqrt();
    let neg_slopes = neg_slopes_tensor(p, &q);
    record(|s| s.backward_calls += 1);
    // D = rowsum(dO ∘ O): [b, h, sq, 1]; L as [b, h, sq, 1].
    let delta = (d_o.clone() * o).sum_dim(3);
    let lse = lse.unsqueeze_dim::<4>(3);
    let q_starts: Vec<usize> = (0..sq).step_by(p.block_q).collect();
    let mut dq_blocks: Vec<Option<Tensor<4>>> = vec![None; q_starts.len()];
    let mut dks = Vec::new();
    let mut dvs = Vec::new();
    for ks in (0..sk).step_by(p.block_k) {
        let nk = p.block_k.min(sk - ks);
        let k_blk = k.clone().narrow(2, ks, nk);
        let v_blk = v.clone().narrow(2, ks, nk);
        let mut dk = k_blk.zeros_like();
        let mut dv = v_blk.zeros_like();
        for (qi, &qs) in q_starts.iter().enumerate() {
            let nq = p.block_q.min(sq - qs);
            let tile = Tile::new(qs, nq, ks, nk, p);
            if tile.causal(p) == Causal::Skip {
                continue;
            }
            let q_blk = q.clone().narrow(2, qs, nq);
            let do_blk = d_o.clone().narrow(2, qs, nq);
            let s = tile.scores(&q_blk, &k_blk, neg_slopes.as_ref(), scale, p);
            // P = exp(S − L); masked entries are −∞ in S, hence exactly 0 here.
            let pr = (s - lse.clone().narrow(2, qs, nq)).exp();
            dv = dv + pr.clone().swap_dims(2, 3).matmul(do_blk.clone());
            let dp = do_blk.matmul(v_blk.clone().swap_dims(2, 3));
            let ds = pr * (dp - delta.clone().narrow(2, qs, nq));
            let dq_part = ds.clone().matmul(k_blk.clone()) * scale;
            dq_blocks[qi] = Some(match dq_blocks[qi].take() {
                Some(acc) => acc + dq_part,
                None => dq_part,
            });
            dk = dk + ds.swap_dims(2, 3).matmul(q_blk) * scale;
        }
        dks.push(dk);
        dvs.push(dv);
    }
    let dq: Vec<Tensor<4>> = dq_blocks
        .into_iter()
        .zip(&q_starts)
        .map(|(blk, &qs)| {
            // A query block that sees no key at all gets a zero gradient.
            blk.unwrap_or_else(|| q.clone().narrow(2, qs, p.block_q.min(sq - qs)).zeros_like())
        })
        .collect();
    (Tensor::cat(dq, 2), Tensor::cat(dks, 2), Tensor::cat(dvs, 2))
}
