//! Linear layers with a bias, `y = x·W + b`, as one op with a hand-written backward.
//!
//! burn composes `linear` from a matmul and a broadcast add, and on CPU the matmul pays twice
//! for its output: flex allocates it as a byte vector, then copies that into a 16-byte-aligned
//! buffer (`FlexTensor::empty` → `Bytes::from_bytes_vec`), so every product is written, copied
//! and page-faulted twice: about a tenth of a genslm-25m training step at 2048 tokens on the
//! 2-core dev VM (perf, 2026-11-24). Here the forward writes each row's bias into a buffer it
//! owns and lets gemm accumulate the product onto it; the backward is two gemm calls into new
//! buffers (`dx = dy·Wᵀ`, `dW = xᵀ·dy` over all rows at once) and one pass of column sums
//! for `db`. Products without a bias (the output head, tensor-parallel row slices) stay burn's
//! `linear` (the extension macro takes no optional tensors).
//!
//! Same extension pattern as `gelu.rs`: the loops for f32 `Flex` tensors, a [`Backward`] for
//! `Autodiff`, burn's own linear ops for CubeCL backends and other dtypes.

use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
    Autodiff,
};
use burn::backend::{backend_extension, tensor::FloatTensor, Backend, Dispatch, Flex};
use burn::tensor::{DType, Tensor, TensorData};
use rayon::prelude::*;

use super::primitive::Primitive;
use super::simd::{dispatched, host_f32, matmul, matmul_new, values, Threads};

/// The op on `x: [b, s, n]`, `w: [n, m]`, `b: [m]`: under autodiff it saves the input and the
/// weight, and its backward is [`LinearKernels::linear_bwd`]; elsewhere it is the forward.
#[backend_extension(Flex, Autodiff, Cube: cfg(any(feature = "cuda", feature = "wgpu")))]
pub trait LinearOps: Backend {
    fn linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

/// The op's kernels, on the backends that compute.
pub trait LinearKernels: Backend {
    /// `x·w + b`: `[b, s, m]`.
    fn linear_fwd(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
    /// `(dx, dw, db)` from the input, the weight and `dy`.
    fn linear_bwd(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

impl<B: LinearKernels> LinearOps for B {
    fn linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        B::linear_fwd(x, w, b)
    }
}

/// `x·w (+ b)` for `x: [b, s, n]`, `w: [n, m]`, `b: [m]`, differentiable on an autodiff device.
pub fn linear(x: Tensor<3>, w: Tensor<2>, b: Option<Tensor<1>>) -> Tensor<3> {
    match b {
        Some(b) => Tensor::from_dispatch(<Dispatch as LinearOps>::linear(
            x.into_dispatch(),
            w.into_dispatch(),
            b.into_dispatch(),
        )),
        None => burn::tensor::module::linear(x, w, None),
    }
}

/// The backward from burn's tensor ops (CubeCL backends and non-f32 CPU tensors).
fn bwd_composed(x: Tensor<3>, w: Tensor<2>, dy: Tensor<3>) -> (Tensor<3>, Tensor<2>, Tensor<1>) {
    let [b, s, n] = x.dims();
    let m = w.dims()[1];
    let dx = dy.clone().matmul(w.transpose().unsqueeze::<3>());
    let rows = dy.reshape([b * s, m]);
    let dw = x.reshape([b * s, n]).transpose().matmul(rows.clone());
    let db = rows.sum_dim(0).reshape([m]);
    (dx, dw, db)
}

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

/// `x (rows×n) · w (n×m) + b`, row-major.
fn fwd_slices(x: &[f32], w: &[f32], b: &[f32], (rows, n, m): (usize, usize, usize)) -> Vec<f32> {
    let mut y = Vec::with_capacity(rows * m);
    for _ in 0..rows {
        y.extend_from_slice(b);
    }
    let t = threads(rows, m, n);
    matmul((rows, m, n), &mut y, m, true, x, (n, 1), w, (m, 1), t);
    y
}

/// `(dx, dw, db)` for [`fwd_slices`]' shapes.
fn bwd_slices(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    (rows, n, m): (usize, usize, usize),
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    // dx = dy (rows×m) · wᵀ (m×n); element (k, j) of wᵀ is w[j·m + k].
    let dx = matmul_new((rows, n, m), (dy, (m, 1)), (w, (1, m)), threads(rows, n, m));
    // dw = xᵀ (n×rows) · dy (rows×m), the sum over every row in one product; element (i, r) of
    // xᵀ is x[r·n + i].
    let dw = matmul_new((n, m, rows), (x, (1, n)), (dy, (m, 1)), threads(n, m, rows));
    (dx, dw, column_sums(dy, m))
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

    fn linear_bwd(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (x, w, dy): (Tensor<3>, Tensor<2>, Tensor<3>) =
            (Self::tensor(x), Self::tensor(w), Self::tensor(dy));
        let (dx, dw, db) = if [x.dtype(), w.dtype(), dy.dtype()] == [DType::F32; 3] {
            let ([bs, s, n], m, device) = (x.dims(), w.dims()[1], x.device());
            let (xs, ws, dys) = (host_f32(x), host_f32(w), host_f32(dy));
            let (dx, dw, db) = bwd_slices(values(&xs), values(&ws), values(&dys), (bs * s, n, m));
            (
                Tensor::<3>::from_data(TensorData::new(dx, [bs, s, n]), &device),
                Tensor::<2>::from_data(TensorData::new(dw, [n, m]), &device),
                Tensor::<1>::from_data(TensorData::new(db, [m]), &device),
            )
        } else {
            bwd_composed(x, w, dy)
        };
        (Self::prim(dx), Self::prim(dw), Self::prim(db))
    }
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl LinearKernels for burn::backend::Cube {
    fn linear_fwd(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let x = Self::tensor::<3>(x);
        Self::prim(burn::tensor::module::linear(
            x,
            Self::tensor(w),
            Some(Self::tensor(b)),
        ))
    }

    fn linear_bwd(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (dx, dw, db) = bwd_composed(Self::tensor(x), Self::tensor(w), Self::tensor(dy));
        (Self::prim(dx), Self::prim(dw), Self::prim(db))
    }
}

impl<B: LinearKernels, Ck: CheckpointStrategy> LinearOps for Autodiff<B, Ck> {
    fn linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct LinearBackward;

        impl<B: LinearKernels> Backward<B, 3> for LinearBackward {
            // The input and the weight.
            type State = (FloatTensor<B>, FloatTensor<B>);

            fn backward(
                self,
                ops: Ops<Self::State, 3>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let dy = grads.consume::<B>(&ops.node);
                let (x, w) = ops.state;
                let (dx, dw, db) = B::linear_bwd(x, w, dy);
                for (node, g) in ops.parents.into_iter().zip([dx, dw, db]) {
                    if let Some(node) = node {
                        grads.register::<B>(node.id, g);
                    }
                }
            }
        }

        match LinearBackward
            .prepare::<Ck>([x.node(), w.node(), b.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (xp, wp) = (x.primitive().clone(), w.primitive().clone());
                let y = B::linear_fwd(xp.clone(), wp.clone(), b.into_primitive());
                prep.finish((xp, wp), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(<B as LinearOps>::linear(
                x.into_primitive(),
                w.into_primitive(),
                b.into_primitive(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: f32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 * 0.618_034 + seed).fract() - 0.5) * 2.0)
            .collect()
    }

    /// The naive triple loops in f64: `(y, dx, dw, db)`.
    #[allow(clippy::type_complexity)]
    fn reference(
        x: &[f32],
        w: &[f32],
        b: &[f32],
        dy: &[f32],
        (rows, n, m): (usize, usize, usize),
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
        let (mut y, mut dx) = (vec![0f64; rows * m], vec![0f64; rows * n]);
        let (mut dw, mut db) = (vec![0f64; n * m], vec![0f64; m]);
        for r in 0..rows {
            for j in 0..m {
                let mut acc = b[j] as f64;
                for i in 0..n {
                    acc += x[r * n + i] as f64 * w[i * m + j] as f64;
                    dx[r * n + i] += dy[r * m + j] as f64 * w[i * m + j] as f64;
                    dw[i * m + j] += x[r * n + i] as f64 * dy[r * m + j] as f64;
                }
                y[r * m + j] = acc;
                db[j] += dy[r * m + j] as f64;
            }
        }
        (y, dx, dw, db)
    }

    fn assert_close(got: &[f32], want: &[f64], what: &str) {
        assert_eq!(got.len(), want.len(), "{what} length");
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g as f64 - w).abs() < 1e-4 * (1.0 + w.abs()),
                "{what} at {i}: {g} vs {w}"
            );
        }
    }

    /// The loops against f64, on a product small enough for the calling thread and on one
    /// split over the pool (odd sizes throughout).
    #[test]
    fn slices_match_f64_loops() {
        for dims @ (rows, n, m) in [(37, 19, 23), (211, 131, 89)] {
            let (x, w, bias, dy) = (
                data(rows * n, 0.1),
                data(n * m, 0.4),
                data(m, 0.7),
                data(rows * m, 0.9),
            );
            let (y_ref, dx_ref, dw_ref, db_ref) = reference(&x, &w, &bias, &dy, dims);
            assert_close(&fwd_slices(&x, &w, &bias, dims), &y_ref, "y");
            let (dx, dw, db) = bwd_slices(&x, &w, &dy, dims);
            assert_close(&dx, &dx_ref, "dx");
            assert_close(&dw, &dw_ref, "dw");
            assert_close(&db, &db_ref, "db");
        }
    }

    /// Under autodiff, the output and every gradient equal burn differentiating its own
    /// `linear` (a matmul and a broadcast add); without a bias, `linear` is burn's.
    #[test]
    fn autodiff_gradients_equal_burn_linear() {
        let ad = burn::tensor::Device::flex().autodiff();
        let ([bs, s, n], m) = ([2, 5, 7], 3);
        type Out = (Vec<f32>, Vec<f32>, Vec<f32>, Option<Vec<f32>>);
        let run = |fused: bool, with_bias: bool| -> Out {
            let t = |v: Vec<f32>| {
                let n = v.len();
                TensorData::new(v, [n])
            };
            let x = Tensor::<1>::from_data(t(data(bs * s * n, 0.2)), &ad)
                .reshape([bs, s, n])
                .require_grad();
            let w = Tensor::<1>::from_data(t(data(n * m, 0.5)), &ad)
                .reshape([n, m])
                .require_grad();
            let b = Tensor::<1>::from_data(t(data(m, 0.8)), &ad).require_grad();
            let weights = Tensor::<1>::from_data(t(data(bs * s * m, 0.3)), &ad).reshape([bs, s, m]);
            let bias = with_bias.then(|| b.clone());
            let y = if fused {
                linear(x.clone(), w.clone(), bias)
            } else {
                burn::tensor::module::linear(x.clone(), w.clone(), bias)
            };
            let grads = (y.clone() * weights).sum().backward();
            let v = |t: Tensor<1>| t.into_data().try_into_vec::<f32>().unwrap();
            let flat3 = |t: Tensor<3>| {
                let n: usize = t.dims().iter().product();
                v(t.reshape([n]))
            };
            (
                flat3(y.without_autodiff()),
                flat3(x.grad(&grads).expect("dx")),
                v(w.grad(&grads).expect("dw").reshape([n * m])),
                b.grad(&grads).map(v),
            )
        };
        for with_bias in [true, false] {
            let (got, want) = (run(true, with_bias), run(false, with_bias));
            let close = |a: &[f32], b: &[f32], what: &str| {
                assert_eq!(a.len(), b.len());
                for (i, (x, y)) in a.iter().zip(b).enumerate() {
                    assert!(
                        (x - y).abs() < 1e-5 * (1.0 + y.abs()),
                        "{what} at {i}: {x} vs {y}"
                    );
                }
            };
            close(&got.0, &want.0, "y");
            close(&got.1, &want.1, "dx");
            close(&got.2, &want.2, "dw");
            assert_eq!(got.3.is_some(), with_bias, "db exists iff there is a bias");
            if let (Some(a), Some(b)) = (&got.3, &want.3) {
                close(a, b, "db");
            }
        }
    }
}
