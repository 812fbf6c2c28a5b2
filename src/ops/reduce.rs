//! Column sums of a `[rows, cols]` tensor (the bias and LayerNorm parameter gradients).
//!
//! burn's `sum_dim(0)` gives each column to one unit, which then walks every row: `cols`
//! units in all (512 at genslm-25m's hidden size), far too few to fill a GPU. In the profile
//! of a genslm-25m step on an H200 (2026-11-28) these reductions took 100–300 µs each, ~15 ms
//! of the step's 88 ms of kernels outside the optimizer's checks. On CubeCL backends the rows
//! are summed in strips of `STRIP` first (`rows / STRIP × cols` units), then the strips' sums.
//! The CPU keeps the single pass (its own loops are elsewhere; its results stay bit for bit).

use burn::backend::DispatchDevice;
use burn::tensor::Tensor;

/// Rows per partial sum of the first stage.
const STRIP: usize = 64;

/// `Σ_rows t[r, c]` for every column `c`.
pub fn col_sum(t: Tensor<2>) -> Tensor<1> {
    let [rows, cols] = t.dims();
    let on_cpu = matches!(t.device().as_dispatch(), DispatchDevice::Flex(_));
    if on_cpu || rows < 2 * STRIP {
        return t.sum_dim(0).reshape([cols]);
    }
    let strips = rows / STRIP;
    let head = t
        .clone()
        .narrow(0, 0, strips * STRIP)
        .reshape([strips, STRIP, cols])
        .sum_dim(1)
        .reshape([strips, cols])
        .sum_dim(0);
    let sum = if rows > strips * STRIP {
        head + t
            .narrow(0, strips * STRIP, rows - strips * STRIP)
            .sum_dim(0)
    } else {
        head
    };
    sum.reshape([cols])
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, TensorData};

    /// Both paths against an f64 column sum: the CPU's single pass, and on lavapipe the
    /// strips, with row counts below, at and across the strip boundaries.
    #[test]
    fn column_sums_match_f64() {
        #[allow(unused_mut)]
        let mut devices = vec![Device::flex()];
        #[cfg(feature = "wgpu")]
        devices.push(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice));
        for dev in &devices {
            for (rows, cols) in [(1, 5), (127, 3), (128, 7), (2048, 512), (2053, 33)] {
                let v: Vec<f32> = (0..rows * cols)
                    .map(|i| ((i * 7919) % 4001) as f32 / 2000.0 - 1.0)
                    .collect();
                let t = Tensor::<2>::from_data(TensorData::new(v.clone(), [rows, cols]), dev);
                let got = crate::ops::primitive::tensor_to_vec(&col_sum(t));
                assert_eq!(got.len(), cols);
                for (c, g) in got.iter().enumerate() {
                    let want: f64 = (0..rows).map(|r| f64::from(v[r * cols + c])).sum();
                    let scale: f64 = (0..rows).map(|r| f64::from(v[r * cols + c]).abs()).sum();
                    let err = (f64::from(*g) - want).abs();
                    assert!(
                        err <= 1e-6 * scale,
                        "{rows}x{cols} column {c}: {g} vs {want}"
                    );
                }
            }
        }
    }
}
