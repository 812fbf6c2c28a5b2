//! `genslm bench attention --seq N`: the attention op alone — genslm's FlashAttention (the
//! fused kernels on cuda/wgpu, the tiled op on cpu) or, with `--impl cubek`, burn's own
//! cubek-attention on the same device as the baseline.

use crate::error::{Error, Result};

/// One timed call: forward seconds, and forward+backward seconds where the implementation
/// has a backward for the case.
type Step<'a> = Box<dyn FnMut() -> Result<(f64, Option<f64>)> + 'a>;

/// Which attention the op bench times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnImpl {
    /// genslm's FlashAttention op.
    Genslm,
    /// cubek-attention 0.3.1 (CubeCL backends only).
    Cubek,
}

/// What `genslm bench attention --seq N` measured.
#[derive(Debug, Clone)]
pub struct AttnBench {
    /// Seconds per forward (best of the timed iterations).
    pub fwd_s: f64,
    /// Seconds per forward + backward (best of the timed iterations); `None` where the
    /// implementation has no backward for the case (cubek's runs in f32 only).
    pub fwd_bwd_s: Option<f64>,
    pub tflops_fwd: f64,
    pub tflops_fwd_bwd: Option<f64>,
    /// Peak memory in MiB: the device's memory pools on GPU backends, peak RSS on CPU.
    pub peak_mib: f64,
    pub peak_of: &'static str,
    /// The routine that ran (cubek picks among several; genslm has one).
    pub routine: String,
}

/// The attention shape and options `bench attention --seq` times.
#[derive(Debug, Clone, Copy)]
pub struct AttnBenchCase {
    pub batch: usize,
    pub heads: usize,
    pub seq: usize,
    pub head_dim: usize,
    pub dtype: burn::tensor::DType,
    pub causal: bool,
    /// ALiBi biases (GPT-NeoX's slopes for `heads`), built inside the kernels' tiles.
    pub alibi: bool,
    pub iters: usize,
    pub imp: AttnImpl,
}

impl AttnBenchCase {
    /// FlashAttention's convention: 4·b·h·s²·d for the forward, halved when causal.
    pub fn fwd_flops(&self) -> f64 {
        let f = 4.0 * (self.batch * self.heads) as f64 * (self.seq as f64).powi(2);
        f * self.head_dim as f64 * if self.causal { 0.5 } else { 1.0 }
    }
}

/// Times the forward and forward+backward of `c.imp` on `compute`'s device, on random inputs.
pub fn attention_op(compute: &crate::backend::Compute, c: &AttnBenchCase) -> Result<AttnBench> {
    use crate::ops::attention::flash::{
        flash_attention_backward, flash_attention_forward, DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q,
    };
    use crate::ops::attention::options::AttnOptions;
    use crate::ops::primitive::tensor_to_vec;
    use burn::tensor::{Distribution, Tensor};
    if c.seq == 0 || c.head_dim == 0 || c.batch == 0 || c.heads == 0 || c.iters == 0 {
        return Err(Error::Invalid(format!("bench attention: empty case {c:?}")));
    }
    // q, k, v, dO, the output and the three gradients, f32 on the host: refused up front
    // where they cannot fit (an allocation of terabytes aborts the process without a word).
    let elements = [c.batch, c.heads, c.seq, c.head_dim]
        .iter()
        .try_fold(8usize, |a, &x| a.checked_mul(x));
    let need = elements.map_or(f64::INFINITY, |e| 4.0 * e as f64);
    let avail = crate::host_memory::available_bytes();
    if compute.device.backend == crate::backend::BackendKind::Cpu && avail.is_some_and(|a| need > a)
    {
        return Err(Error::Invalid(format!(
            "bench attention: --seq {} × {} heads × head dim {} (batch {}) needs about {:.1} GiB \
             for q, k, v, dO, the output and the gradients; {:.1} GiB are available",
            c.seq,
            c.heads,
            c.head_dim,
            c.batch,
            need / f64::from(1u32 << 30),
            avail.unwrap_or(0.0) / f64::from(1u32 << 30)
        )));
    }
    let device = compute.open()?;
    let shape = [c.batch, c.heads, c.seq, c.head_dim];
    let rand = || Tensor::<4>::random(shape, Distribution::Default, &device).cast(c.dtype);
    let (q, k, v, d_o) = (rand(), rand(), rand(), rand());
    if c.alibi && c.imp == AttnImpl::Cubek {
        return Err(Error::Invalid(
            "bench attention --alibi: cubek-attention has no ALiBi; time it without --alibi".into(),
        ));
    }
    let opts = AttnOptions {
        causal: c.causal,
        alibi: c
            .alibi
            .then(|| crate::model::position::alibi_slopes(c.heads)),
        ..Default::default()
    };
    let (bq, bk) = (DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K);
    // Reading one value back waits for the device.
    let wait = |t: &Tensor<4>| {
        let _ = tensor_to_vec(
            &t.clone()
                .slice([0..1, 0..1, 0..1, 0..1])
                .cast(burn::tensor::DType::F32),
        );
    };
    let genslm_fwd = || flash_attention_forward(q.clone(), k.clone(), v.clone(), &opts, bq, bk);
    let (routine, mut step): (String, Step) = match c.imp {
        AttnImpl::Genslm => (
            "genslm FlashAttention (fused kernels on cuda/wgpu and, for f32, on cpu)".into(),
            Box::new(|| {
                let t = std::time::Instant::now();
                let (o, lse) = genslm_fwd();
                wait(&o);
                let f = t.elapsed().as_secs_f64();
                let (dq, _, _) = flash_attention_backward(
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    o,
                    lse,
                    d_o.clone(),
                    &opts,
                    bq,
                    bk,
                );
                wait(&dq);
                Ok((f, Some(t.elapsed().as_secs_f64())))
            }),
        ),
        // cubek's backward needs a log-sum-exp its forward does not write: genslm's, made
        // once before timing.
        AttnImpl::Cubek => cubek_step(c, [&q, &k, &v, &d_o], genslm_fwd().1, wait)?,
    };
    let (mut fwd, mut both) = (f64::INFINITY, None::<f64>);
    // One untimed warm-up (kernel compilation), then `iters` timed runs.
    for i in 0..=c.iters {
        let (f, b) = step()?;
        if i > 0 {
            fwd = fwd.min(f);
            both = b.map(|b| both.map_or(b, |x: f64| x.min(b)));
        }
    }
    let (peak_mib, peak_of) = match crate::backend::device_reserved_bytes(&q) {
        Some(b) => (b as f64 / (1 << 20) as f64, "device memory pools"),
        None => (crate::train::metrics::peak_rss_mib(), "peak RSS"),
    };
    let flops = c.fwd_flops();
    Ok(AttnBench {
        fwd_s: fwd,
        fwd_bwd_s: both,
        tflops_fwd: flops / fwd / 1e12,
        tflops_fwd_bwd: both.map(|b| 3.5 * flops / b / 1e12),
        peak_mib,
        peak_of,
        routine,
    })
}

/// cubek's fastest forward routine for the case (each that takes it timed once after a
/// warm-up), and a step running it and, in f32, cubek's backward.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
fn cubek_step<'a>(
    c: &AttnBenchCase,
    [q, k, v, d_o]: [&'a burn::tensor::Tensor<4>; 4],
    lse: burn::tensor::Tensor<3>,
    wait: impl Fn(&burn::tensor::Tensor<4>) + 'a,
) -> Result<(String, Step<'a>)> {
    use super::cubek;
    let causal = c.causal;
    let mut best: Option<(f64, cubek::Routine)> = None;
    let mut refused = Vec::new();
    for r in cubek::routines() {
        match cubek::forward(q, k, v, causal, &r) {
            Ok(o) => wait(&o),
            Err(e) => {
                // A backend without CubeCL refuses every routine with the same words.
                let e = e.to_string();
                if !refused.contains(&e) {
                    refused.push(e);
                }
                continue;
            }
        }
        let t = std::time::Instant::now();
        wait(&cubek::forward(q, k, v, causal, &r)?);
        let s = t.elapsed().as_secs_f64();
        if best.as_ref().is_none_or(|(b, _)| s < *b) {
            best = Some((s, r));
        }
    }
    let Some((_, routine)) = best else {
        return Err(Error::Invalid(format!(
            "cubek-attention takes none of its routines for this case: {}",
            refused.join("; ")
        )));
    };
    let has_backward = c.dtype == burn::tensor::DType::F32;
    let name = if has_backward {
        format!("cubek-attention {}", routine.name)
    } else {
        format!(
            "cubek-attention {} (forward only: its backward runs in f32 only)",
            routine.name
        )
    };
    let step = move || {
        let t = std::time::Instant::now();
        let o = cubek::forward(q, k, v, causal, &routine)?;
        wait(&o);
        let f = t.elapsed().as_secs_f64();
        if !has_backward {
            return Ok((f, None));
        }
        let [dq, _, _] = cubek::backward([q, k, v, &o, d_o], &lse, causal)?;
        wait(&dq);
        Ok((f, Some(t.elapsed().as_secs_f64())))
    };
    Ok((name, Box::new(step)))
}

#[cfg(not(any(feature = "cuda", feature = "wgpu")))]
fn cubek_step<'a>(
    _: &AttnBenchCase,
    _: [&'a burn::tensor::Tensor<4>; 4],
    _: burn::tensor::Tensor<3>,
    _: impl Fn(&burn::tensor::Tensor<4>) + 'a,
) -> Result<(String, Step<'a>)> {
    Err(Error::Invalid(
        "--impl cubek: this genslm was built without a CubeCL backend (--features cuda or wgpu)"
            .into(),
    ))
}
