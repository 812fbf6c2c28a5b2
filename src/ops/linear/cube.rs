//! Linear layers with a bias on CubeCL backends: burn's own tensor ops.

use burn::backend::tensor::FloatTensor;

use crate::ops::primitive::Primitive;

use super::*;

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

    fn linear_bwd_input(w: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::prim(dx_composed(Self::tensor(w), Self::tensor(dy)))
    }

    fn linear_bwd_weight(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::prim(dw_composed(Self::tensor(x), Self::tensor(dy)))
    }

    fn linear_bwd_bias(dy: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::prim(db_composed(Self::tensor(dy)))
    }
}
