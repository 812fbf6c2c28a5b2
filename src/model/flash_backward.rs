//! The FlashAttention-2 backward of the tiled CPU path (see `flash.rs`): key blocks outer,
//! query blocks inner; each tile's probabilities are recomputed from the saved log-sum-exp.
//! Like the forward, it only ever forms `[b, h, ≤ block_q, ≤ block_k]` score tiles.

use burn::tensor::Tensor;

use super::flash::{neg_slopes_tensor, record, Causal, FlashParams, Tile};

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
