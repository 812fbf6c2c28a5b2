//! Which slice of each parameter a tensor-parallel rank holds, how it is cut out of the full
//! model and how the slices join again (checkpoints stay one full HF directory whatever the
//! layout).
//!
//! Our matrices are `[in, out]` (params.rs). Column-parallel weights (QKV, the MLP's first
//! linear, the output head over the vocabulary) are cut by output columns, their biases with
//! them; row-parallel weights (the attention output, the MLP's second linear, the embedding
//! over vocabulary rows) by input rows; LayerNorms, row-parallel biases and the learned
//! position table stay whole on every rank. HF's fused QKV keeps each head's `[q | k | v]`
//! together, so a contiguous range of columns is a range of whole heads.

use burn::tensor::Tensor;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::model::params::Layout;
use crate::model::tensor_parallel::split_range;
use crate::ops::primitive::{host_to_param, tensor_to_vec};
use crate::parallel::bucket::{gather_unequal, unpack_host};
use crate::parallel::comm::Communicator;

/// How a parameter is split over the TP group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Output columns of a `[in, out]` matrix, or the whole of a bias over those columns.
    Cols,
    /// Input rows of a `[in, out]` matrix (embedding: vocabulary rows).
    Rows,
}

/// The split of parameter `i` (`None`: whole on every rank).
pub fn split_of(layout: &Layout, i: usize) -> Option<Split> {
    if i == layout.embed_in {
        return Some(Split::Rows);
    }
    if i == layout.embed_out {
        return Some(Split::Cols);
    }
    layout.layers.iter().find_map(|l| {
        if [l.qkv_w, l.qkv_b, l.fc1_w, l.fc1_b].contains(&i) {
            Some(Split::Cols)
        } else if [l.dense_w, l.fc2_w].contains(&i) {
            Some(Split::Rows)
        } else {
            None
        }
    })
}

/// Indices of the parameters split over TP.
pub fn split_params(layout: &Layout) -> Vec<usize> {
    (0..layout.specs.len())
        .filter(|&i| split_of(layout, i).is_some())
        .collect()
}

/// Refuses a TP degree the model cannot be cut by: whole heads and equal MLP slices per rank
/// (the vocabulary may split unevenly).
pub fn check_degree(m: &ModelConfig, tp: usize) -> Result<()> {
    if tp <= 1 {
        return Ok(());
    }
    if !m.num_heads.is_multiple_of(tp) {
        return Err(Error::Invalid(format!(
            "--tp {tp}: the model's {} attention heads do not divide by it (tensor parallelism \
             gives each rank whole heads; use a --tp that divides {})",
            m.num_heads, m.num_heads
        )));
    }
    if !m.intermediate_size.is_multiple_of(tp) {
        return Err(Error::Invalid(format!(
            "--tp {tp}: intermediate_size {} does not divide by it",
            m.intermediate_size
        )));
    }
    if m.vocab_size < tp {
        return Err(Error::Invalid(format!(
            "--tp {tp}: more ranks than the {} vocabulary ids",
            m.vocab_size
        )));
    }
    Ok(())
}

/// The `[rows, cols]` shape of parameter `shape` (a bias is one row).
pub fn as_matrix(shape: &[usize]) -> [usize; 2] {
    match shape {
        [n] => [1, *n],
        [r, c] => [*r, *c],
        _ => unreachable!("parameters are vectors or matrices"),
    }
}

/// TP rank `r` of `tp`'s slice of a parameter of full shape `shape` split `split`: the
/// `(start, len)` along the split dimension and the slice's shape.
pub fn slice_of(shape: &[usize], split: Split, tp: usize, r: usize) -> (usize, usize, Vec<usize>) {
    let [rows, cols] = as_matrix(shape);
    match split {
        Split::Cols => {
            let (a, n) = split_range(cols, tp, r);
            let shape = if shape.len() == 1 {
                vec![n]
            } else {
                vec![rows, n]
            };
            (a, n, shape)
        }
        Split::Rows => {
            let (a, n) = split_range(rows, tp, r);
            (a, n, vec![n, cols])
        }
    }
}

/// Rank `r`'s slice of the flat parameter `t` (full shape `shape`), flat.
pub fn cut(t: &Tensor<1>, shape: &[usize], split: Split, tp: usize, r: usize) -> Tensor<1> {
    let [rows, cols] = as_matrix(shape);
    let (a, n, _) = slice_of(shape, split, tp, r);
    match split {
        Split::Rows => t.clone().narrow(0, a * cols, n * cols),
        Split::Cols => t
            .clone()
            .reshape([rows, cols])
            .narrow(1, a, n)
            .reshape([rows * n]),
    }
}

/// The full flat parameter (shape `shape`) from every rank's slice, in rank order.
pub fn join(parts: &[Vec<f32>], shape: &[usize], split: Split) -> Vec<f32> {
    let [rows, cols] = as_matrix(shape);
    match split {
        Split::Rows => parts.concat(),
        Split::Cols => {
            let widths: Vec<usize> = parts.iter().map(|p| p.len() / rows).collect();
            let mut out = Vec::with_capacity(rows * cols);
            for row in 0..rows {
                for (p, &w) in parts.iter().zip(&widths) {
                    out.extend_from_slice(&p[row * w..(row + 1) * w]);
                }
            }
            out
        }
    }
}

/// The full tensors (shapes of the full layout `full`) from every TP rank's `mine` (one flat
/// tensor per parameter: slices of the split ones, whole ones equal on every rank), on TP rank
/// 0; `None` on the others. Every rank of the group must call it. For checkpoints: the
/// parameters and each Adam moment.
pub fn gather_slices(
    mine: &[Tensor<1>],
    full: &Layout,
    comm: &dyn Communicator,
    bucket: usize,
) -> Result<Option<Vec<Tensor<1>>>> {
    let tp = comm.size();
    let mut out = (comm.rank() == 0).then(|| mine.to_vec());
    for (i, t) in mine.iter().enumerate() {
        let Some(split) = split_of(full, i) else {
            continue;
        };
        let got = gather_unequal(comm, &tensor_to_vec(t), Some(0), bucket)?;
        if let (Some(out), Some(all)) = (out.as_mut(), got) {
            let shape = &full.specs[i].shape;
            let lens = (0..tp).map(|r| slice_of(shape, split, tp, r).2.iter().product());
            let parts = unpack_host(&all, lens);
            out[i] = host_to_param(join(&parts, shape, split), &t.device());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    /// Cutting then joining gives back the parameter, for both splits and uneven slices; a
    /// column slice of a `[in, out]` matrix is the matrix's columns (checked by index).
    #[test]
    fn cut_and_join_round_trip() {
        let dev = Device::flex();
        for (shape, split) in [
            (vec![3, 7], Split::Cols),
            (vec![7, 3], Split::Rows),
            (vec![9], Split::Cols),
        ] {
            let n: usize = shape.iter().product();
            let full: Vec<f32> = (0..n).map(|x| x as f32).collect();
            let t = host_to_param(full.clone(), &dev);
            for tp in 1..=3 {
                let parts: Vec<Vec<f32>> = (0..tp)
                    .map(|r| tensor_to_vec(&cut(&t, &shape, split, tp, r)))
                    .collect();
                assert_eq!(join(&parts, &shape, split), full, "{shape:?} tp {tp}");
            }
        }
        // Columns 4..7 of the 3 × 7 matrix (rank 1 of 2 takes 4 of the 7 columns, from column 3).
        let t = host_to_param((0..21).map(|x| x as f32).collect(), &dev);
        let c = tensor_to_vec(&cut(&t, &[3, 7], Split::Cols, 2, 1));
        assert_eq!(
            c,
            vec![3., 4., 5., 6., 10., 11., 12., 13., 17., 18., 19., 20.]
        );
    }
}
