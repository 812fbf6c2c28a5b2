//! A backend's float primitive as a dispatch tensor and back: what the extension ops'
//! implementations (gelu, LayerNorm, linear, attention) wrap to run tensor code and unwrap to
//! return, as `Self::tensor(x)` and `Self::prim(y)` (the rank is inferred).

use burn::backend::{tensor::FloatTensor, Backend, DispatchKindConversion, DispatchTensor};
use burn::tensor::Tensor;

/// A backend whose primitives a dispatch tensor can hold (every concrete backend).
pub(crate) trait Primitive: Backend {
    /// The primitive `x` as a tensor of rank `D`.
    fn tensor<const D: usize>(x: FloatTensor<Self>) -> Tensor<D>;
    /// A tensor computed on this backend as its primitive.
    fn prim<const D: usize>(t: Tensor<D>) -> FloatTensor<Self>;
}

impl<B: Backend> Primitive for B
where
    DispatchTensor: DispatchKindConversion<B>,
{
    fn tensor<const D: usize>(x: FloatTensor<B>) -> Tensor<D> {
        Tensor::from_primitive::<B>(x)
    }

    fn prim<const D: usize>(t: Tensor<D>) -> FloatTensor<B> {
        t.try_into_primitive::<B>()
            .expect("an op's result left the backend of its inputs")
    }
}
