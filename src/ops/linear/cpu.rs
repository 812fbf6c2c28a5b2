//! Linear layers with a bias on f32 `Flex` tensors: the forward writes each row's bias into
//! its own output buffer and lets gemm accumulate the product onto it; the backward is two gemm
//! calls and one pass of column sums.

use burn::backend::{tensor::FloatTensor, Flex};
use burn::tensor::{DType, Tensor, TensorData};
use rayon::prelude::*;

use crate::ops::primitive::Primitive;
use crate::ops::simd::{dispatched, host_f32, matmul, matmul_new, values, Threads};
use crate::ops::team;

use super::*;

/// Products below this many multiply-adds run on the calling thread (splitting them over the
/// pool costs more than it saves).
const POOL_MIN: usize = 1 << 21;

fn threads(m: usize, n: usize, k: usize) -> Threads {
    if m * n * k >= POOL_MIN {
        Threads::Pool
    } else {
        Threads::Serial
    }
}

/// Rows up to which the forward is [`fwd_few_rows`] rather than gemm: one decoding step of up
/// to 32 samples (`bench generate --samples 32`, genslm-25m, dev VM: 915 codons/s against
/// gemm's 747; at 8 samples 612 against 356).
const FEW_ROWS: usize = 32;

/// `x (rows×n) · w (n×m) + b`, row-major.
pub(super) fn fwd_slices(
    x: &[f32],
    w: &[f32],
    b: &[f32],
    (rows, n, m): (usize, usize, usize),
) -> Vec<f32> {
    if rows <= FEW_ROWS {
        return fwd_few_rows(x, w, b, (rows, n, m));
    }
    let mut y = b.repeat(rows);
    let t = threads(rows, m, n);
    matmul((rows, m, n), &mut y, m, true, x, (n, 1), w, (m, 1), t);
    y
}

/// Rows of `w` per task of [`fwd_few_rows`] at least.
const ROW_BLOCK: usize = 64;

/// [`fwd_slices`] for a few rows (a decoding step's one new token per sequence): the product is
/// bound by reading `w` once, which gemm does on one thread (it does not split a product with
/// one row), while two cores read more than twice as fast as one (PyTorch's sgemv over the
/// 100 MB of genslm-25m's weight shapes on the dev VM: 13.5 GB/s on one core, 30.6 GB/s on
/// two). So the rows of `w` are split in contiguous blocks over the threads of a
/// [`team`] (a decoding step's sections are too short for rayon's wake-ups), each task streams
/// its block once (eight rows at a time) into partial sums of every output, and the partial
/// sums are added to the bias.
fn fwd_few_rows(x: &[f32], w: &[f32], b: &[f32], (rows, n, m): (usize, usize, usize)) -> Vec<f32> {
    assert!(x.len() == rows * n && w.len() == n * m && b.len() == m);
    if rows * n * m == 0 {
        return b.repeat(rows); // an empty sum, or nothing to write
    }
    let tasks = team::threads().min(n / ROW_BLOCK).max(1);
    let per = n.div_ceil(tasks);
    let mut sums = vec![0f32; tasks * rows * m];
    team::for_each_chunk_mut(&mut sums, rows * m, |t, acc| {
        let (first, last) = (t * per, ((t + 1) * per).min(n));
        accumulate_rows(acc, x, &w[first * m..last * m], n, first);
    });
    let mut y = b.repeat(rows);
    for acc in sums.chunks_exact(rows * m) {
        add_row(&mut y, acc);
    }
    y
}

dispatched!(
    accumulate_rows,
    (acc: &mut [f32], x: &[f32], w: &[f32], n: usize, first: usize),
    {
        // `acc` is `[rows, m]`; `w` holds rows `first..` of the weight, `x` is `[rows, n]`.
        let rows = x.len() / n;
        let m = acc.len() / rows;
        let mut ws = w.chunks_exact(m);
        let mut i = first;
        while ws.len() >= 8 {
            let w8: [&[f32]; 8] = std::array::from_fn(|_| ws.next().unwrap());
            for (r, a) in acc.chunks_exact_mut(m).enumerate() {
                let xr = &x[r * n + i..r * n + i + 8];
                for j in 0..m {
                    let lo = xr[0] * w8[0][j] + xr[1] * w8[1][j] + xr[2] * w8[2][j] + xr[3] * w8[3][j];
                    let hi = xr[4] * w8[4][j] + xr[5] * w8[5][j] + xr[6] * w8[6][j] + xr[7] * w8[7][j];
                    a[j] += lo + hi;
                }
            }
            i += 8;
        }
        for wi in ws {
            for (r, a) in acc.chunks_exact_mut(m).enumerate() {
                let xi = x[r * n + i];
                for (a, &wv) in a.iter_mut().zip(wi) {
                    *a += xi * wv;
                }
            }
            i += 1;
        }
    }
);

/// `(dx, dw, db)` for [`fwd_slices`]' shapes.
#[cfg(test)]
pub(super) fn bwd_slices(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    dims @ (_, _, m): (usize, usize, usize),
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    (
        dx_slices(w, dy, dims),
        dw_slices(x, dy, dims),
        column_sums(dy, m),
    )
}

/// `dx = dy (rows×m) · wᵀ (m×n)`; element (k, j) of wᵀ is w[j·m + k].
pub(super) fn dx_slices(w: &[f32], dy: &[f32], (rows, n, m): (usize, usize, usize)) -> Vec<f32> {
    matmul_new((rows, n, m), (dy, (m, 1)), (w, (1, m)), threads(rows, n, m))
}

/// `dw = xᵀ (n×rows) · dy (rows×m)`, the sum over every row in one product; element (i, r) of
/// xᵀ is x[r·n + i].
pub(super) fn dw_slices(x: &[f32], dy: &[f32], (rows, n, m): (usize, usize, usize)) -> Vec<f32> {
    matmul_new((n, m, rows), (x, (1, n)), (dy, (m, 1)), threads(n, m, rows))
}

/// Elements of `dy` per column-sum task.
const CHUNK: usize = 1 << 15;

/// Sums of the columns of a row-major `[rows, m]` slice: per-task partial sums over row
/// chunks, then added together.
fn column_sums(dy: &[f32], m: usize) -> Vec<f32> {
    if m == 0 {
        return Vec::new();
    }
    let rows_per_task = (CHUNK / m).max(1);
    dy.par_chunks(rows_per_task * m)
        .map(|rows| {
            let mut acc = vec![0f32; m];
            for row in rows.chunks_exact(m) {
                add_row(&mut acc, row);
            }
            acc
        })
        .reduce(
            || vec![0f32; m],
            |mut a, b| {
                add_row(&mut a, &b);
                a
            },
        )
}

dispatched!(add_row, (acc: &mut [f32], row: &[f32]), {
    for (a, &r) in acc.iter_mut().zip(row) {
        *a += r;
    }
});

impl LinearKernels for Flex {
    fn linear_fwd(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let (x, w, b): (Tensor<3>, Tensor<2>, Tensor<1>) =
            (Self::tensor(x), Self::tensor(w), Self::tensor(b));
        Self::prim(if [x.dtype(), w.dtype(), b.dtype()] == [DType::F32; 3] {
            let ([bs, s, n], m, device) = (x.dims(), w.dims()[1], x.device());
            let (xs, ws, b) = (host_f32(x), host_f32(w), host_f32(b));
            let y = fwd_slices(values(&xs), values(&ws), values(&b), (bs * s, n, m));
            Tensor::<3>::from_data(TensorData::new(y, [bs, s, m]), &device)
        } else {
            burn::tensor::module::linear(x, w, Some(b))
        })
    }

    fn linear_bwd_input(w: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        let (w, dy): (Tensor<2>, Tensor<3>) = (Self::tensor(w), Self::tensor(dy));
        Self::prim(if [w.dtype(), dy.dtype()] == [DType::F32; 2] {
            let ([bs, s, m], n, device) = (dy.dims(), w.dims()[0], dy.device());
            let (ws, dys) = (host_f32(w), host_f32(dy));
            let dx = dx_slices(values(&ws), values(&dys), (bs * s, n, m));
            Tensor::<3>::from_data(TensorData::new(dx, [bs, s, n]), &device)
        } else {
            dx_composed(w, dy)
        })
    }

    fn linear_bwd_weight(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        let (x, dy): (Tensor<3>, Tensor<3>) = (Self::tensor(x), Self::tensor(dy));
        Self::prim(if [x.dtype(), dy.dtype()] == [DType::F32; 2] {
            let ([bs, s, n], m, device) = (x.dims(), dy.dims()[2], x.device());
            let (xs, dys) = (host_f32(x), host_f32(dy));
            let dw = dw_slices(values(&xs), values(&dys), (bs * s, n, m));
            Tensor::<2>::from_data(TensorData::new(dw, [n, m]), &device)
        } else {
            dw_composed(x, dy)
        })
    }

    fn linear_bwd_bias(dy: FloatTensor<Self>) -> FloatTensor<Self> {
        let dy: Tensor<3> = Self::tensor(dy);
        Self::prim(if dy.dtype() == DType::F32 {
            let (m, device) = (dy.dims()[2], dy.device());
            let dys = host_f32(dy);
            Tensor::<1>::from_data(TensorData::new(column_sums(values(&dys), m), [m]), &device)
        } else {
            db_composed(dy)
        })
    }
}
