//! GPT-NeoX rotary embedding applied to queries or keys (rotate-half on the first `rot` dims of
//! each head), as composed tensor ops: the plain model's path, and the reference the fused QKV
//! op's loops are tested against. The cos/sin tables are built by `model::position`.

use burn::tensor::Tensor;

/// Applies NeoX rotary to `x: [b, heads, s, d]` on its first `rot` dims.
pub fn apply_rotary(x: Tensor<4>, cos: &Tensor<4>, sin: &Tensor<4>, rot: usize) -> Tensor<4> {
    let d = x.dims()[3];
    if rot == 0 {
        return x;
    }
    let x_rot = x.clone().narrow(3, 0, rot);
    let half = rot / 2;
    let x1 = x_rot.clone().narrow(3, 0, half);
    let x2 = x_rot.clone().narrow(3, half, half);
    let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
    let out = x_rot * cos.clone() + rotated * sin.clone();
    if rot == d {
        out
    } else {
        Tensor::cat(vec![out, x.narrow(3, rot, d - rot)], 3)
    }
}
