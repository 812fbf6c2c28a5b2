//! Where a model that holds one tensor-parallel slice of the weights computes differently from
//! a plain one — the only methods that read `GenSlm::tp`, which `parallel::parallelize` sets
//! from outside: row-parallel linears summed over the TP group, the column-parallel input whose
//! gradient is summed, the vocabulary-parallel embedding and cross-entropy, and the slice of
//! the heads this rank computes, and under Megatron SP the sequence split between the layers'
//! blocks. Without TP each is the plain computation.

use burn::tensor::module::embedding;
use burn::tensor::{Int, Tensor};

use crate::model::neox::{masked_nll, GenSlm};
use crate::model::tensor_parallel::{split_range, vocab_embedding, vocab_parallel_nll};

impl GenSlm {
    /// A row-parallel linear layer: the product of this rank's input rows, summed over the TP
    /// group before the bias is added once.
    /// Under Megatron SP the sum is reduce-scattered over the sequence.
    pub(super) fn dense_out(&self, x: Tensor<3>, w: usize, b: usize) -> Tensor<3> {
        match &self.tp {
            None => self.dense(x, w, Some(b)),
            Some(tp) => {
                tp.row_out(self.dense(x, w, None)) + self.compute(self.region_vec(b)).unsqueeze()
            }
        }
    }

    /// `x` entering a column-parallel linear (its gradient summed over the TP group; under
    /// Megatron SP the sequence gathered first).
    pub(super) fn copy_in(&self, x: Tensor<3>) -> Tensor<3> {
        match &self.tp {
            None => x,
            Some(tp) => tp.col_in(x),
        }
    }

    /// A column-parallel linear with a bias on the activation between layers `x`: the plain
    /// linear of `copy_in(x)`, or under Megatron SP one op that gathers the sequence and keeps
    /// only this rank's part of it for the backward.
    pub(super) fn col_dense(&self, x: Tensor<3>, w: usize, b: usize) -> Tensor<3> {
        match &self.tp {
            Some(tp) if tp.seq_split() => tp.seq_linear(
                self.compute(x),
                self.compute(self.mat(w)),
                self.compute(self.vec(b)),
            ),
            _ => self.dense(self.copy_in(x), w, Some(b)),
        }
    }

    /// Parameter `i` used between the layers' blocks (LayerNorms, row-parallel biases, learned
    /// positions): under Megatron SP its gradient is summed over the TP group.
    pub(super) fn region_vec(&self, i: usize) -> Tensor<1> {
        match &self.tp {
            None => self.vec(i),
            Some(tp) => tp.region_param(self.vec(i)),
        }
    }

    /// The sequence split between the layers: `(first, count)` of a rank's `cols` columns that
    /// its activations hold there (all of them without Megatron SP).
    pub fn region_cols(&self, cols: usize) -> (usize, usize) {
        match &self.tp {
            Some(tp) if tp.seq_split() => {
                let n = cols / tp.degree();
                (tp.rank() * n, n)
            }
            _ => (0, cols),
        }
    }

    /// The first vocabulary id of this rank's embedding and head slices.
    pub(super) fn vocab_first(&self) -> usize {
        self.rank_slice(self.cfg.vocab_size).0
    }

    /// [`masked_nll`] of this model's `logits` (under TP: each rank's vocabulary columns, the
    /// sum the same on every rank of the group).
    pub fn nll(&self, logits: Tensor<3>, targets: Vec<i64>, weights: Vec<f32>) -> Tensor<1> {
        match &self.tp {
            None => masked_nll(logits, targets, weights),
            Some(tp) => {
                vocab_parallel_nll(logits, &targets, weights, self.vocab_first(), tp.as_ref())
            }
        }
    }

    /// The token embedding: the table's rows of `tokens` (under TP, this rank's vocabulary rows,
    /// summed over the group).
    pub(super) fn token_embedding(&self, table: Tensor<2>, tokens: Tensor<2, Int>) -> Tensor<3> {
        match &self.tp {
            None => embedding(table, tokens),
            Some(tp) => vocab_embedding(table, tokens, self.vocab_first(), tp.as_ref()),
        }
    }

    /// `(first, count)` of `n` things split over the TP group (heads, vocabulary ids) that this
    /// rank holds: all of them, or its slice (whole items, in order).
    pub(super) fn rank_slice(&self, n: usize) -> (usize, usize) {
        self.tp
            .as_ref()
            .map_or((0, n), |tp| split_range(n, tp.degree(), tp.rank()))
    }
}
