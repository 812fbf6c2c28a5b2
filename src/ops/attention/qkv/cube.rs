//! The fused QKV attention on CubeCL backends: the composed steps of `mod.rs` around the
//! FlashAttention op.

use burn::backend::tensor::FloatTensor;

use crate::ops::primitive::Primitive;

use super::*;

#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl QkvAttentionKernels for burn::backend::Cube {
    fn qkv_attention_fwd(
        qkv: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        params: QkvParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (o, lse) = fwd_composed(
            Self::tensor(qkv),
            &Self::tensor(cos),
            &Self::tensor(sin),
            &params,
        );
        (Self::prim(o), Self::prim(lse))
    }

    fn qkv_attention_bwd(
        qkv: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        o: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_o: FloatTensor<Self>,
        params: QkvParams,
    ) -> FloatTensor<Self> {
        Self::prim(bwd_composed(
            Self::tensor(qkv),
            &Self::tensor(cos),
            &Self::tensor(sin),
            Self::tensor(o),
            Self::tensor(lse),
            Self::tensor(d_o),
            &params,
        ))
    }
}
