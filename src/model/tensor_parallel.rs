//! The one trait through which tensor parallelism reaches the model, and the parts of the model
//! that read it: which slice of each weight a rank holds, and the vocabulary-parallel
//! embedding lookup and cross-entropy.
//!
//! Megatron's layout (docs/ARCHITECTURE.md §5): the QKV projection and the MLP's first linear
//! are split by output columns (whole heads, `4h/T` columns), the attention output and the
//! MLP's second linear by input rows, so a layer needs two sums per pass: the row-parallel
//! outputs are summed over the group forward (`g`), and the gradient entering each
//! column-parallel block is summed backward (`f`). The embedding and the output head are split
//! by vocabulary rows: a rank looks up only its ids and the partial embeddings are summed; the
//! head's logits stay split, and the loss is computed from three per-position sums over the
//! group (max, Σexp, the target's logit), so no rank ever holds the full `[b, s, vocab]` logits.
//!
//! Megatron sequence parallelism (Korthikanti et al. 2022), on by default with TP: between the
//! layers' column- and row-parallel blocks (LayerNorms, the residual, the embedding's output)
//! each TP rank holds only its `1/T` of the sequence. `f` becomes an all-gather of the
//! sequence before a column-parallel block and `g` a reduce-scatter after a row-parallel one
//! (the same bytes as the all-reduce they replace, activations `1/T` between them). A parameter
//! used in that region (LayerNorms, row-parallel biases, learned positions) then sees only its
//! rank's tokens, so its gradient is summed over the group ([`TensorParallel::region_param`]).
//! `parallel/` implements the trait; the model names no communicator.

use burn::tensor::{Int, Tensor, TensorData};

/// The collectives the model needs from a tensor-parallel group.
pub trait TensorParallel: std::fmt::Debug + Send + Sync {
    /// Ranks in the group.
    fn degree(&self) -> usize;
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// Megatron's `f`: `x` unchanged forward; its gradient summed over the group backward.
    /// Entered before every column-parallel linear.
    fn copy_in(&self, x: Tensor<3>) -> Tensor<3>;
    /// Megatron's `g`: `x` summed over the group forward; the gradient unchanged backward. Left
    /// through after every row-parallel linear.
    fn sum_out(&self, x: Tensor<3>) -> Tensor<3>;
    /// Element-wise maximum over the group, outside autodiff (the loss's softmax shift).
    fn max_over(&self, x: Tensor<3>) -> Tensor<3>;
    /// Whether the region between the layers' blocks is split over the sequence (Megatron SP).
    fn seq_split(&self) -> bool;
    /// Every rank's `[b, c, h]` joined along the sequence, `[b, T·c, h]` in rank order; the
    /// gradient reduce-scattered back.
    fn gather_seq(&self, x: Tensor<3>) -> Tensor<3>;
    /// `[b, T·c, h]` summed over the group, this rank's `[b, c, h]` of the sequence kept; the
    /// gradient all-gathered back.
    fn scatter_seq(&self, x: Tensor<3>) -> Tensor<3>;
    /// `p` unchanged forward; its gradient summed over the group backward.
    fn sum_grad(&self, p: Tensor<1>) -> Tensor<1>;
    /// Under Megatron SP, a column-parallel linear on this rank's part of the sequence:
    /// `gather_seq(x)·w + b`, keeping only `x` for the backward (the gathered input is
    /// gathered again there).
    fn seq_linear(&self, x: Tensor<3>, w: Tensor<2>, b: Tensor<1>) -> Tensor<3>;

    /// The activation between layers entering a column-parallel block: `f`, or under
    /// Megatron SP the all-gather of the sequence.
    fn col_in(&self, x: Tensor<3>) -> Tensor<3> {
        if self.seq_split() {
            self.gather_seq(x)
        } else {
            self.copy_in(x)
        }
    }
    /// A row-parallel block's partial sums entering the region between layers: `g`, or under
    /// Megatron SP the reduce-scatter over the sequence.
    fn row_out(&self, x: Tensor<3>) -> Tensor<3> {
        if self.seq_split() {
            self.scatter_seq(x)
        } else {
            self.sum_out(x)
        }
    }
    /// A parameter used between the blocks (whole on every rank): under Megatron SP each rank
    /// sees only its tokens, so the gradient is summed over the group.
    fn region_param(&self, p: Tensor<1>) -> Tensor<1> {
        if self.seq_split() {
            self.sum_grad(p)
        } else {
            p
        }
    }
}

/// Rank `r`'s slice `(start, len)` of `n` items cut into `parts`: balanced, the first slices
/// no longer than the last (vocabularies need not divide; heads and MLP columns do).
pub fn split_range(n: usize, parts: usize, r: usize) -> (usize, usize) {
    let (a, b) = (r * n / parts, (r + 1) * n / parts);
    (a, b - a)
}

/// The embedding of `tokens` through this rank's vocabulary rows `table: [v_local, h]`
/// starting at id `first`: ids outside the slice contribute zeros, so the group's sum is the
/// full lookup (under Megatron SP, reduce-scattered: this rank's part of the sequence).
pub fn vocab_embedding(
    table: Tensor<2>,
    tokens: Tensor<2, Int>,
    first: usize,
    tp: &dyn TensorParallel,
) -> Tensor<3> {
    let rows = table.dims()[0] as i64;
    let local = tokens.sub_scalar(first as i64);
    let inside = local
        .clone()
        .greater_equal_elem(0)
        .bool_and(local.clone().lower_elem(rows));
    let e = burn::tensor::module::embedding(table, local.clamp(0, (rows - 1).max(0)));
    let [b, s, h] = e.dims();
    let mask = inside.float().unsqueeze_dim::<3>(2).expand([b, s, h]);
    tp.row_out(e * mask)
}

/// Σ −log softmax(logits)[target] · weight when each rank holds the vocabulary columns
/// `[first, first + v_local)` of `logits: [rows, cols, v_local]` (fp32): the same value on every
/// rank of the group, and each rank's gradient is that of its own columns.
///
/// Per position: `m` = max over the group (a constant shift, no gradient), `Σ exp(l − m)` and
/// the target's `l − m` (zero on the ranks that do not hold the target) summed with `g`, whose
/// identity backward hands each rank `softmax − onehot` for its columns.
pub fn vocab_parallel_nll(
    logits: Tensor<3>,
    targets: &[i64],
    weights: Vec<f32>,
    first: usize,
    tp: &dyn TensorParallel,
) -> Tensor<1> {
    let [rows, cols, v] = logits.dims();
    let device = logits.device();
    let shift = tp.max_over(logits.clone().detach().max_dim(2));
    let z = logits - shift.expand([rows, cols, v]);
    let sum_exp = tp.sum_out(z.clone().exp().sum_dim(2));
    let (mut local, mut held) = (Vec::with_capacity(targets.len()), Vec::new());
    for &t in targets {
        let i = t - first as i64;
        let inside = (0..v as i64).contains(&i);
        local.push(if inside { i } else { 0 });
        held.push(if inside { 1.0f32 } else { 0.0 });
    }
    let local: Tensor<3, Int> = Tensor::from_data(TensorData::new(local, [rows, cols, 1]), &device);
    let held: Tensor<3> = Tensor::from_data(TensorData::new(held, [rows, cols, 1]), &device);
    let target = tp.sum_out(z.gather(2, local) * held);
    let weights: Tensor<3> = Tensor::from_data(TensorData::new(weights, [rows, cols, 1]), &device);
    ((sum_exp.log() - target) * weights).sum()
}

#[cfg(test)]
mod tests {
    use super::split_range;

    #[test]
    fn ranges_cover_once() {
        for (n, parts) in [(69, 2), (69, 4), (8, 4), (3, 3), (70, 3)] {
            let mut next = 0;
            for r in 0..parts {
                let (a, len) = split_range(n, parts, r);
                assert_eq!(a, next);
                next = a + len;
            }
            assert_eq!(next, n);
        }
        assert_eq!(split_range(8, 4, 2), (4, 2));
    }
}
