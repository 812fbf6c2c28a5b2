//! AdamW on burn's CubeCL backends (`--backend cuda`, `--backend wgpu`): one launch of the
//! fused kernel of `genslm-kernels` per parameter tensor (kernels/src/adamw.rs) instead of the
//! ~15 element-wise launches the composed update takes. The CPU has its own loop
//! (`optim_cpu`); anything else (a dtype or device the kernel does not take) keeps the
//! composed update, which gives the same values.

use burn::backend::Cube;
use burn::tensor::{DType, Shape, Tensor};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use genslm_kernels::Dtype;

pub use genslm_kernels::AdamWStep;

/// `(p, m, v, working)` after one AdamW step of the fp32 value `p` with gradient `g` and
/// moments `m`, `v`; `working` is the new value in `working_dtype` (the model's copy under
/// mixed precision, `p` itself when that is f32). `None` when the tensors are not all f32 on
/// one CubeCL device, or the device cannot store `working_dtype`.
pub fn adamw(
    p: &Tensor<1>,
    g: &Tensor<1>,
    m: &Tensor<1>,
    v: &Tensor<1>,
    step: &AdamWStep,
    working_dtype: DType,
) -> Option<[Tensor<1>; 4]> {
    let working = match working_dtype {
        DType::F32 => Dtype::F32,
        DType::BF16 => Dtype::Bf16,
        DType::F16 => Dtype::F16,
        _ => return None,
    };
    let cube = |t: &Tensor<1>| -> Option<CubeTensor> {
        let c = t.clone().try_into_primitive::<Cube>().ok()?;
        (c.dtype == DType::F32).then(|| into_contiguous(c))
    };
    let (p, g, m, v) = (cube(p)?, cube(g)?, cube(m)?, cube(v)?);
    let n = p.meta.shape()[0];
    if [&g, &m, &v]
        .iter()
        .any(|t| t.meta.shape()[0] != n || t.device != p.device)
    {
        return None;
    }
    let (hp, hm, hv, hw) = genslm_kernels::adamw(
        &p.client, n, &p.handle, &g.handle, &m.handle, &v.handle, step, working,
    )
    .ok()?;
    let wrap = |h, dtype| {
        Tensor::from_primitive::<Cube>(CubeTensor::new_contiguous(
            p.client.clone(),
            p.device.clone(),
            Shape::from(vec![n]),
            h,
            dtype,
        ))
    };
    let new_p = wrap(hp, DType::F32);
    let w = match hw {
        Some(h) => wrap(h, working_dtype),
        None => new_p.clone(),
    };
    Some([new_p, wrap(hm, DType::F32), wrap(hv, DType::F32), w])
}
