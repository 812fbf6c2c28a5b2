//! Helpers the kernel tests share: the device, deterministic inputs, upload/download in each
//! element type, and the relative error measure.
#![allow(dead_code)] // each test file uses a subset

use cubecl::prelude::*;
use cubecl::server::Handle;
use cubecl::wgpu::{WgpuDevice, WgpuDeviceKind};
use genslm_kernels::Dtype;

pub fn client() -> Client {
    let kind = match std::env::var("GENSLM_KERNELS_DEVICE").as_deref() {
        Ok("default") => WgpuDeviceKind::DefaultDevice,
        _ => WgpuDeviceKind::Cpu,
    };
    cubecl::Device::Wgpu(WgpuDevice::new(kind)).client()
}

/// Deterministic values in [-1, 1).
pub fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 11) as f64 / (1u64 << 52) as f64 - 1.0
        })
        .collect()
}

/// Rounds to what `dtype` holds (so the reference sees exactly the kernel's inputs).
pub fn round(xs: &[f64], dtype: Dtype) -> Vec<f64> {
    xs.iter()
        .map(|&x| match dtype {
            Dtype::F32 => x as f32 as f64,
            Dtype::Bf16 => half::bf16::from_f64(x).to_f64(),
            Dtype::F16 => half::f16::from_f64(x).to_f64(),
        })
        .collect()
}

pub fn upload(c: &Client, xs: &[f64], dtype: Dtype) -> Handle {
    match dtype {
        Dtype::F32 => {
            let v: Vec<f32> = xs.iter().map(|&x| x as f32).collect();
            c.create_from_slice(f32::as_bytes(&v))
        }
        Dtype::Bf16 => {
            let v: Vec<u16> = xs
                .iter()
                .map(|&x| half::bf16::from_f64(x).to_bits())
                .collect();
            c.create_from_slice(u16::as_bytes(&v))
        }
        Dtype::F16 => {
            let v: Vec<u16> = xs
                .iter()
                .map(|&x| half::f16::from_f64(x).to_bits())
                .collect();
            c.create_from_slice(u16::as_bytes(&v))
        }
    }
}

pub fn download(c: &Client, h: Handle, dtype: Dtype) -> Vec<f64> {
    let bytes = c.read_one(h).expect("read back a kernel output");
    match dtype {
        Dtype::F32 => f32::from_bytes(&bytes).iter().map(|&x| x as f64).collect(),
        Dtype::Bf16 => u16::from_bytes(&bytes)
            .iter()
            .map(|&b| half::bf16::from_bits(b).to_f64())
            .collect(),
        Dtype::F16 => u16::from_bytes(&bytes)
            .iter()
            .map(|&b| half::f16::from_bits(b).to_f64())
            .collect(),
    }
}

/// `max |got − want| / max |want|`.
pub fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-30);
    let diff = got.iter().zip(want).fold(0.0f64, |m, (a, b)| {
        if a.is_nan() {
            f64::INFINITY
        } else {
            m.max((a - b).abs())
        }
    });
    diff / scale
}

pub fn tolerance(dtype: Dtype) -> f64 {
    match dtype {
        Dtype::F32 => 1e-4,
        Dtype::Bf16 | Dtype::F16 => 2e-2,
    }
}
