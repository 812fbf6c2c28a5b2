//! Tensors to and from the host, and a backend's float primitive as a dispatch tensor and back.
//!
//! The primitive side is what the extension ops' implementations (gelu, LayerNorm, linear,
//! attention) wrap to run tensor code and unwrap to return, as `Self::tensor(x)` and
//! `Self::prim(y)` (the rank is inferred). The host side is what checkpoints, collectives and
//! the optimizer move: parameters as flat `Vec<f32>`s, tokens as `u32`s.

use burn::backend::{tensor::FloatTensor, Backend, DispatchKindConversion, DispatchTensor};
use burn::tensor::{Device, Int, Tensor, TensorData};

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

/// Host tokens `[b, s]` to an Int tensor.
pub fn tokens_tensor(tokens: &[u32], b: usize, s: usize, device: &Device) -> Tensor<2, Int> {
    let v: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
    Tensor::from_data(TensorData::new(v, [b, s]), device)
}

/// A host vector as a parameter tensor on `device`.
pub fn host_to_param(v: Vec<f32>, device: &Device) -> Tensor<1> {
    let n = v.len();
    Tensor::from_data(TensorData::new(v, [n]), device)
}

/// A tensor's values on the host (f32).
pub fn tensor_to_vec<const D: usize>(t: &Tensor<D>) -> Vec<f32> {
    t.clone()
        .try_into_vec_as::<f32>()
        .expect("float tensors convert to f32")
}
