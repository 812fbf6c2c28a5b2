//! AdamW over the model's flat parameter list, with global gradient-norm clipping.
//!
//! Written here rather than taken from burn-optim because genslm needs what burn's optimizer
//! does not offer: clipping by the *global* norm, state saved by parameter name (so a checkpoint
//! resumes under any layout), and (for ZeRO) moments that can be sharded by slicing flat vectors.
//! The update is PyTorch's `torch.optim.AdamW`:
//!   p ← p·(1 − lr·wd);  m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²;
//!   p ← p − lr · (m / (1−β1ᵗ)) / (√(v / (1−β2ᵗ)) + ε)
//! with weight decay only on parameters marked `decay` (matrices, not LayerNorm or biases).

use burn::tensor::Tensor;

use crate::backend::{host_device, to_host};
use crate::model::params::ParamSpec;
use crate::ops::primitive::tensor_to_vec;
use crate::train::master::fp32;
use crate::train::optim_cpu;

#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl AdamWConfig {
    /// The optimizer settings of a run's `[train]` section.
    pub fn of(t: &crate::config::TrainConfig) -> Self {
        Self {
            beta1: t.beta1,
            beta2: t.beta2,
            eps: t.eps,
            weight_decay: t.weight_decay,
        }
    }
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// AdamW moments for every parameter (plain, non-autodiff tensors).
#[derive(Debug, Clone)]
pub struct AdamW {
    pub cfg: AdamWConfig,
    /// Completed updates (t in the bias corrections).
    pub step: u64,
    pub m: Vec<Tensor<1>>,
    pub v: Vec<Tensor<1>>,
    /// The moments live in host memory whatever device the parameters are on (ZeRO-Offload,
    /// `--offload optimizer`): each update brings the parameter and its gradient to the host,
    /// runs the fused CPU update there and sends the new values back.
    pub offload: bool,
    /// fp32 master values of the parameters (bf16 layout, `train::master`), beside the moments
    /// and placed like them. With masters, [`AdamW::update`] updates them and hands back
    /// their new values cast to the working parameters' dtype; the values it is given only
    /// say that dtype and device.
    pub master: Option<Vec<Tensor<1>>>,
}

impl AdamW {
    /// Zero moments beside `params`.
    pub fn new(cfg: AdamWConfig, params: &[Tensor<1>]) -> Self {
        Self::placed(cfg, params, false)
    }

    /// Zero moments for `params`, in host memory with `offload` (never allocated on the
    /// device: at 25B parameters the moments alone would not fit there), else beside them.
    pub fn placed(cfg: AdamWConfig, params: &[Tensor<1>], offload: bool) -> Self {
        let zeros = |p: &Tensor<1>| {
            let p = p.clone().without_autodiff();
            if offload {
                Tensor::zeros([p.dims()[0]], &host_device())
            } else {
                p.zeros_like()
            }
        };
        Self {
            cfg,
            step: 0,
            m: params.iter().map(zeros).collect(),
            v: params.iter().map(zeros).collect(),
            offload,
            master: None,
        }
    }

    /// Keeps `values` (fp32) as the master values, where the moments live.
    pub fn set_master(&mut self, values: Vec<Tensor<1>>) {
        let place = |t: Tensor<1>| self.to_state_device(fp32(t.without_autodiff()));
        self.master = Some(values.into_iter().map(place).collect());
    }

    /// Bytes of the state: the moments, and the masters when it keeps them.
    pub fn state_bytes(&self) -> usize {
        let masters = self.master.as_deref().map_or(0, |m| 4 * numel(m));
        4 * (numel(&self.m) + numel(&self.v)) + masters
    }

    /// `t` where this optimizer's state lives.
    pub fn to_state_device(&self, t: Tensor<1>) -> Tensor<1> {
        if self.offload {
            to_host(t)
        } else {
            t
        }
    }

    /// One update of `params` (plain tensors) with `grads` scaled by `grad_scale` (the clip
    /// factor). Returns the new parameter values.
    pub fn update(
        &mut self,
        params: Vec<Tensor<1>>,
        grads: Vec<Tensor<1>>,
        grad_scale: f64,
        specs: &[ParamSpec],
        lr: f64,
    ) -> Vec<Tensor<1>> {
        self.step += 1;
        let c = self.cfg;
        let t = self.step as i32;
        let bc1 = 1.0 - c.beta1.powi(t);
        let bc2 = 1.0 - c.beta2.powi(t);
        let mut out = Vec::with_capacity(params.len());
        for (i, (p, g)) in params.into_iter().zip(grads).enumerate() {
            let decays = specs[i].decay && c.weight_decay != 0.0;
            // Offloaded: the update runs beside the moments, the new values go back. With
            // masters the update runs on the fp32 master and the working copy is its rounding.
            let (home, dtype) = (self.offload.then(|| p.device()), p.dtype());
            let p = match &self.master {
                Some(master) => master[i].clone(),
                None => self.to_state_device(p),
            };
            let g = self.to_state_device(fp32(g));
            let master = &mut self.master;
            let mut back = |t: Tensor<1>| {
                if let Some(master) = master.as_mut() {
                    master[i] = t.clone();
                }
                let t = match &home {
                    Some(d) => t.to_device(d),
                    None => t,
                };
                t.cast(dtype)
            };
            if optim_cpu::on_flex(&p) && optim_cpu::on_flex(&g) {
                let s = optim_cpu::AdamScalars {
                    grad_scale: grad_scale as f32,
                    beta1: c.beta1 as f32,
                    beta2: c.beta2 as f32,
                    decay: if decays {
                        (1.0 - lr * c.weight_decay) as f32
                    } else {
                        1.0
                    },
                    bc1: bc1 as f32,
                    bc2: bc2 as f32,
                    eps: c.eps as f32,
                    lr: lr as f32,
                };
                out.push(back(optim_cpu::adamw(
                    &p,
                    &g,
                    &mut self.m[i],
                    &mut self.v[i],
                    s,
                )));
                continue;
            }
            #[cfg(any(feature = "cuda", feature = "wgpu"))]
            {
                let step = crate::train::optim_cube::AdamWStep {
                    grad_scale,
                    beta1: c.beta1,
                    beta2: c.beta2,
                    decay: if decays {
                        1.0 - lr * c.weight_decay
                    } else {
                        1.0
                    },
                    bc1,
                    bc2,
                    eps: c.eps,
                    lr,
                };
                let (m, v) = (&self.m[i], &self.v[i]);
                if let Some([p, m, v, w]) =
                    crate::train::optim_cube::adamw(&p, &g, m, v, &step, dtype)
                {
                    self.m[i] = m;
                    self.v[i] = v;
                    if let Some(master) = self.master.as_mut() {
                        master[i] = p;
                    }
                    out.push(w);
                    continue;
                }
            }
            let g = if grad_scale == 1.0 { g } else { g * grad_scale };
            let m = self.m[i].clone() * c.beta1 + g.clone() * (1.0 - c.beta1);
            let v = self.v[i].clone() * c.beta2 + g.clone() * g * (1.0 - c.beta2);
            let p = if decays {
                p * (1.0 - lr * c.weight_decay)
            } else {
                p
            };
            let denom = (v.clone() / bc2).sqrt() + c.eps;
            let p = p - (m.clone() / bc1) / denom * lr;
            self.m[i] = m;
            self.v[i] = v;
            out.push(back(p));
        }
        out
    }
}

/// Σ g² of one gradient tensor (the building block of every global-norm computation).
pub fn sum_of_squares(g: &Tensor<1>) -> f64 {
    sums_of_squares(&[g])[0]
}

/// Σ g² of each tensor: genslm's own f64 loop on the CPU, [`device_sums`] on a GPU.
pub fn sums_of_squares(ts: &[&Tensor<1>]) -> Vec<f64> {
    if ts.iter().all(|t| optim_cpu::on_flex(t)) {
        return ts.iter().map(|t| optim_cpu::sum_of_squares(t)).collect();
    }
    device_sums(ts, |x| x.clone() * x)
}

/// Whether every element of `t` is finite: 0·x is 0 for finite x and NaN for ±Inf and NaN, so
/// one exact reduction answers (x² could overflow for large finite values).
pub fn all_finite(t: &Tensor<1>) -> bool {
    each_finite(&[t])[0]
}

/// [`all_finite`] of each tensor, with one device read on a GPU ([`device_sums`] of 0·x).
pub fn each_finite(ts: &[&Tensor<1>]) -> Vec<bool> {
    if ts.iter().all(|t| optim_cpu::on_flex(t)) {
        return ts.iter().map(|t| optim_cpu::all_finite(t)).collect();
    }
    device_sums(ts, |x| x * 0.0)
        .into_iter()
        .map(f64::is_finite)
        .collect()
}

/// Elements per row of [`device_sums`]' first stage.
const SUM_ROW: usize = 1024;

/// Σ f(x) of each tensor on a GPU backend: f(x) in fp32 summed in rows of `SUM_ROW` elements
/// (one parallel reduction per tensor), every tensor's row sums read to the host at once and
/// added there in f64. A whole-tensor `sum()` and a read per parameter (the earlier path, for
/// the norm and again for the finiteness of the new weights) ran as one-block reductions of
/// 1–4 ms each and a device sync each: 200 a step at genslm-25m, over half the step's GPU time
/// on an H200 (cubecl's kernel profile, docs/gpu-runs/2026-11-28-h200.md).
fn device_sums(ts: &[&Tensor<1>], f: impl Fn(Tensor<1>) -> Tensor<1>) -> Vec<f64> {
    let mut parts = Vec::new();
    // How many of the values read back belong to each tensor: its row sums and its tail's.
    let mut counts = Vec::with_capacity(ts.len());
    for t in ts {
        let n = t.dims()[0];
        let y = f(fp32((*t).clone()));
        let rows = n / SUM_ROW;
        let mut count = 0;
        if rows > 0 {
            let head = y
                .clone()
                .narrow(0, 0, rows * SUM_ROW)
                .reshape([rows, SUM_ROW]);
            parts.push(head.sum_dim(1).reshape([rows]));
            count += rows;
        }
        if n > rows * SUM_ROW {
            parts.push(y.narrow(0, rows * SUM_ROW, n - rows * SUM_ROW).sum());
            count += 1;
        }
        counts.push(count);
    }
    if parts.is_empty() {
        return vec![0.0; ts.len()];
    }
    let sums = tensor_to_vec(&Tensor::cat(parts, 0));
    let mut at = 0;
    counts
        .iter()
        .map(|&c| {
            let s = sums[at..at + c].iter().map(|&v| f64::from(v)).sum();
            at += c;
            s
        })
        .collect()
}

/// Elements of a list of flat tensors.
pub fn numel(ts: &[Tensor<1>]) -> usize {
    ts.iter().map(|t| t.dims()[0]).sum()
}

/// The largest (clipped) gradient norm an update takes. AdamW's second moment adds `g²` in
/// f32, which overflows past |g| ≈ 1.8e19: an unclipped gradient of norm 2.5e30 (finite, the
/// norm is summed in f64) left the weights finite but the moments infinite, and the checkpoint
/// saved after it was refused as corrupt at the resume. Every element is at most the norm.
pub const MAX_UPDATE_NORM: f64 = 1e19;

/// Whether a step's update is applied: a finite loss, and a gradient whose norm (after
/// clipping to `max_norm`) is finite and at most [`MAX_UPDATE_NORM`]. Otherwise the step is
/// skipped (or stops the run), as a non-finite one is.
pub fn update_applies(loss_finite: bool, norm: f64, max_norm: f64) -> bool {
    loss_finite && norm.is_finite() && norm * clip_factor(norm, max_norm) <= MAX_UPDATE_NORM
}

/// Factor that brings a gradient of norm `norm` down to `max_norm` (1 when already below).
pub fn clip_factor(norm: f64, max_norm: f64) -> f64 {
    if max_norm > 0.0 && norm > max_norm {
        max_norm / (norm + 1e-6)
    } else {
        1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, FloatDType, TensorData};

    fn t(v: &[f32]) -> Tensor<1> {
        Tensor::from_data(TensorData::new(v.to_vec(), [v.len()]), &Device::flex())
    }

    #[test]
    fn matches_hand_computed_adamw_steps() {
        let spec = ParamSpec {
            name: "w".into(),
            shape: vec![2],
            hf_transposed: false,
            init: crate::model::params::Init::Zeros,
            decay: true,
        };
        let cfg = AdamWConfig {
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let mut opt = AdamW::new(cfg, &[t(&[0.0, 0.0])]);
        let mut p = vec![t(&[1.0, -2.0])];
        let (mut m, mut v, mut pr) = ([0f64; 2], [0f64; 2], [1.0f64, -2.0]);
        let gs = [[0.5f64, -1.0], [0.25, 3.0]];
        for (step, g) in gs.iter().enumerate() {
            p = opt.update(
                p,
                // Twice the gradient, halved by the clip factor.
                vec![t(&[2.0 * g[0] as f32, 2.0 * g[1] as f32])],
                0.5,
                std::slice::from_ref(&spec),
                0.1,
            );
            // Reference: torch.optim.AdamW written out in f64.
            let tt = step as i32 + 1;
            for k in 0..2 {
                pr[k] *= 1.0 - 0.1 * 0.1;
                m[k] = 0.9 * m[k] + 0.1 * g[k];
                v[k] = 0.99 * v[k] + 0.01 * g[k] * g[k];
                let mh = m[k] / (1.0 - 0.9f64.powi(tt));
                let vh = v[k] / (1.0 - 0.99f64.powi(tt));
                pr[k] -= 0.1 * mh / (vh.sqrt() + 1e-8);
            }
            let got = tensor_to_vec(&p[0]);
            for k in 0..2 {
                assert!(
                    (got[k] as f64 - pr[k]).abs() < 1e-6,
                    "step {step}: {got:?} vs {pr:?}"
                );
            }
        }
    }

    /// bf16 round-to-nearest-even of `x`, by its bits (NaN aside).
    fn round_bf16(x: f32) -> f32 {
        let b = x.to_bits();
        f32::from_bits((b + 0x7fff + ((b >> 16) & 1)) & 0xffff_0000)
    }

    /// With masters (the bf16 layout) the update runs on the fp32 master, which follows
    /// torch's AdamW written in f64, and the working copy handed back is its bf16 rounding.
    #[test]
    fn masters_take_the_update_and_the_working_copy_is_their_rounding() {
        let spec = ParamSpec {
            name: "w".into(),
            shape: vec![3],
            hf_transposed: false,
            init: crate::model::params::Init::Zeros,
            decay: true,
        };
        let cfg = AdamWConfig::default();
        // Values bf16 cannot hold: the master keeps them, the working copy rounds them.
        let start = [1.0f32 + 1e-3, -2.0 + 3e-3, 0.3];
        let mut opt = AdamW::new(cfg, &[t(&start)]);
        opt.set_master(vec![t(&start)]);
        let mut p = vec![t(&start).cast(FloatDType::BF16)];
        let mut pr: Vec<f64> = start.iter().map(|&x| f64::from(x)).collect();
        let (mut m, mut v) = ([0f64; 3], [0f64; 3]);
        let gs = [[0.5f64, -1.0, 1e-3], [0.25, 3.0, -2e-3], [-0.5, 0.1, 0.0]];
        let lr = 1e-3;
        for (step, g) in gs.iter().enumerate() {
            let grad: Vec<f32> = g.iter().map(|&x| x as f32).collect();
            // The gradient arrives in bf16, as the backward leaves it.
            let grad = t(&grad).cast(FloatDType::BF16);
            p = opt.update(p, vec![grad], 1.0, std::slice::from_ref(&spec), lr);
            let tt = step as i32 + 1;
            for k in 0..3 {
                let gk = f64::from(round_bf16(g[k] as f32));
                pr[k] *= 1.0 - lr * cfg.weight_decay;
                m[k] = cfg.beta1 * m[k] + (1.0 - cfg.beta1) * gk;
                v[k] = cfg.beta2 * v[k] + (1.0 - cfg.beta2) * gk * gk;
                let mh = m[k] / (1.0 - cfg.beta1.powi(tt));
                let vh = v[k] / (1.0 - cfg.beta2.powi(tt));
                pr[k] -= lr * mh / (vh.sqrt() + cfg.eps);
            }
            assert_eq!(p[0].dtype(), burn::tensor::DType::BF16);
            let master = tensor_to_vec(&opt.master.as_ref().unwrap()[0]);
            let working = tensor_to_vec(&p[0]);
            for k in 0..3 {
                assert!(
                    (f64::from(master[k]) - pr[k]).abs() < 1e-6,
                    "step {step}: master {master:?} vs {pr:?}"
                );
                assert_eq!(working[k], round_bf16(master[k]), "step {step}, {k}");
            }
        }
        assert_eq!(opt.state_bytes(), 3 * 12);
    }

    #[test]
    fn norm_and_clip() {
        let n = (sum_of_squares(&t(&[3.0])) + sum_of_squares(&t(&[0.0, 4.0]))).sqrt();
        assert!((n - 5.0).abs() < 1e-9);
        assert!((clip_factor(5.0, 1.0) - 1.0 / (5.0 + 1e-6)).abs() < 1e-12);
        assert_eq!(clip_factor(0.5, 1.0), 1.0);
        // A norm whose square overflows f32 is applied only once clipping brings it down.
        assert!(update_applies(true, 1e18, 0.0) && !update_applies(true, 2e19, 0.0));
        assert!(update_applies(true, 2.5e30, 1.0) && !update_applies(true, 2.5e30, 1e20));
        assert!(!update_applies(false, 1.0, 1.0) && !update_applies(true, f64::NAN, 1.0));
        assert!(((f32::MAX as f64).sqrt() > MAX_UPDATE_NORM) && (1e19f32 * 1e19f32).is_finite());
        // Over many chunks, against an f64 sum.
        let xs: Vec<f32> = (0..100_003)
            .map(|i| ((i % 977) as f32 - 488.0) * 1e-3)
            .collect();
        let want: f64 = xs.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        assert!((sum_of_squares(&t(&xs)) - want).abs() < 1e-9 * want);
    }

    #[test]
    fn finiteness_sees_every_element() {
        let mut xs = vec![1.0f32; 70_001];
        xs[3] = f32::MAX;
        assert!(all_finite(&t(&xs)));
        for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            let mut ys = xs.clone();
            ys[70_000] = bad;
            assert!(!all_finite(&t(&ys)), "{bad}");
        }
    }

    /// The GPU path (row sums on the device, one read, f64 on the host) against an f64 sum,
    /// on lavapipe: lengths below, at and across the row length, and a parameter-sized one.
    #[cfg(feature = "wgpu")]
    #[test]
    fn sums_of_squares_on_a_gpu_backend_match_f64() {
        let dev = Device::wgpu(burn::tensor::DeviceKind::DefaultDevice);
        let sizes = [1usize, 1023, 1024, 1025, 4103, 300_001];
        let vals: Vec<Vec<f32>> = sizes
            .iter()
            .enumerate()
            .map(|(k, &n)| {
                let at = |i: usize| ((i * 7919 + k * 13) % 2001) as f32 / 1000.0 - 1.0;
                (0..n).map(at).collect()
            })
            .collect();
        let ts: Vec<Tensor<1>> = vals
            .iter()
            .map(|v| Tensor::from_data(TensorData::new(v.clone(), [v.len()]), &dev))
            .collect();
        let got = sums_of_squares(&ts.iter().collect::<Vec<_>>());
        assert_eq!(got.len(), sizes.len());
        for ((v, g), n) in vals.iter().zip(got).zip(sizes) {
            let want: f64 = v.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
            assert!(
                (g - want).abs() <= 1e-6 * want,
                "{n} elements: {g} vs {want}"
            );
        }
        // Finiteness: a NaN among the rows, an Inf in the tail, and the clean tensors.
        let mut bad = vals.clone();
        bad[4][10] = f32::NAN;
        bad[5][300_000] = f32::INFINITY;
        let ts: Vec<Tensor<1>> = bad
            .iter()
            .map(|v| Tensor::from_data(TensorData::new(v.clone(), [v.len()]), &dev))
            .collect();
        let finite = each_finite(&ts.iter().collect::<Vec<_>>());
        assert_eq!(finite, [true, true, true, true, false, false]);
    }
}
