//! LayerNorm on CubeCL backends: the composed formulas of `mod.rs`.

use burn::backend::tensor::FloatTensor;

use crate::ops::primitive::Primitive;

use super::*;

#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl LayerNormKernels for burn::backend::Cube {
    fn layer_norm_fwd(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (y, m, r) = fwd_composed(
            Self::tensor(x),
            Self::tensor(gamma),
            Self::tensor(beta),
            eps,
        );
        (Self::prim(y), Self::prim(m), Self::prim(r))
    }

    fn layer_norm_bwd(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (dx, dg, db) = bwd_composed(
            Self::tensor(x),
            Self::tensor(gamma),
            Self::tensor(mean),
            Self::tensor(rstd),
            Self::tensor(dy),
        );
        (Self::prim(dx), Self::prim(dg), Self::prim(db))
    }
}
