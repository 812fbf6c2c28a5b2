//! Host side: shape checks, block sizes, buffer allocation and the launches.

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::adamw::adamw_step;
use crate::backward::{flash_backward_dkdv, flash_backward_dq, flash_backward_prepass};
use crate::forward::flash_forward;
use crate::MAX_HEAD_DIM;

/// Element type of q, k, v, o, dO and the gradients (statistics are always f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    F32,
    Bf16,
    F16,
}

impl Dtype {
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }

    /// Whether `client`'s device stores this type in buffers and converts it to f32 (the
    /// kernels do all arithmetic in f32).
    pub fn supported(self, client: &Client) -> bool {
        use cubecl::features::TypeUsage;
        let uses = client.features().type_usage(self.elem());
        uses.contains(TypeUsage::Buffer) && uses.contains(TypeUsage::Conversion)
    }

    fn elem(self) -> ElemType {
        match self {
            Dtype::F32 => f32::elem_type_native(),
            Dtype::Bf16 => half::bf16::elem_type_native(),
            Dtype::F16 => half::f16::elem_type_native(),
        }
    }
}

/// `[batch, heads, seq_q, head_dim]` queries against `[batch, heads, seq_k, head_dim]` keys and
/// values, all contiguous.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShape {
    pub batch: usize,
    pub heads: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub head_dim: usize,
}

impl AttnShape {
    fn q_len(&self) -> usize {
        self.batch * self.heads * self.seq_q * self.head_dim
    }
    fn k_len(&self) -> usize {
        self.batch * self.heads * self.seq_k * self.head_dim
    }
    fn rows(&self) -> usize {
        self.batch * self.heads * self.seq_q
    }
}

/// Masking and bias: the CPU op's `AttnOptions`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AttnConfig {
    pub causal: bool,
    /// One ALiBi slope per head.
    pub alibi: Option<Vec<f32>>,
    pub q_offset: usize,
    pub k_offset: usize,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KernelError {
    #[error(
        "flash attention kernels support head dims 1..={MAX_HEAD_DIM}, got {0} \
         (use a config whose hidden size / heads is at most {MAX_HEAD_DIM}, or --backend cpu)"
    )]
    HeadDim(usize),
    #[error("flash attention: {0}")]
    Shape(String),
    #[error(
        "flash attention kernels: this device ({device}) cannot load and store {dtype:?} \
         buffers; use f32 (--precision fp32)"
    )]
    Dtype { dtype: Dtype, device: String },
    #[error(
        "flash attention kernels need {need} bytes of shared memory for head dim {head_dim}; \
         this device offers {have}"
    )]
    SharedMemory {
        need: usize,
        have: usize,
        head_dim: usize,
    },
}

/// Block sizes for one launch. `block_q` rows per cube (one unit each); `block_k` key rows per
/// shared-memory tile in the forward and dQ (and key rows per cube in dK/dV, whose query tiles
/// are `block_q` rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    pub block_q: usize,
    pub block_k: usize,
}

/// Units per cube: 64 keeps every backend's work-group limit (≥ 256) far away and leaves
/// registers for the per-row accumulators.
const UNITS: usize = 64;
/// Shared memory the kernels plan for at most: WebGPU's guaranteed minimum is 16 KiB, most
/// GPUs offer 48 KiB or more; 32 KiB keeps two cubes resident per SM on small parts.
const SHARED_BUDGET: usize = 32 * 1024;

impl Plan {
    /// Tiles sized to the device: two `tile × head_dim` f32 tiles (K and V, or Q and dO, plus
    /// two f32 per query row) must fit the shared memory.
    pub fn for_device(client: &Client, head_dim: usize) -> Result<Plan, KernelError> {
        if head_dim == 0 || head_dim > MAX_HEAD_DIM {
            return Err(KernelError::HeadDim(head_dim));
        }
        let have = client.properties().hardware.max_shared_memory_size;
        let budget = have.min(SHARED_BUDGET);
        let per_row = 2 * head_dim * 4 + 8;
        let mut tile = 64;
        while tile > 4 && tile * per_row > budget {
            tile /= 2;
        }
        if tile * per_row > budget {
            return Err(KernelError::SharedMemory {
                need: tile * per_row,
                have,
                head_dim,
            });
        }
        // The dK/dV kernel stages `block_q` query rows: keep it the same tile size.
        Ok(Plan {
            block_q: UNITS,
            block_k: tile,
        })
    }
}

fn check(
    client: &Client,
    dtype: Dtype,
    shape: &AttnShape,
    cfg: &AttnConfig,
) -> Result<(), KernelError> {
    if !dtype.supported(client) {
        return Err(KernelError::Dtype {
            dtype,
            device: client.name().to_string(),
        });
    }
    if shape.head_dim == 0 || shape.head_dim > MAX_HEAD_DIM {
        return Err(KernelError::HeadDim(shape.head_dim));
    }
    if shape.batch == 0 || shape.heads == 0 || shape.seq_q == 0 || shape.seq_k == 0 {
        return Err(KernelError::Shape(format!("empty shape {shape:?}")));
    }
    if let Some(s) = &cfg.alibi {
        if s.len() != shape.heads {
            return Err(KernelError::Shape(format!(
                "{} ALiBi slopes for {} heads",
                s.len(),
                shape.heads
            )));
        }
    }
    let limit = 1usize << 24;
    if cfg.q_offset + shape.seq_q > limit || cfg.k_offset + shape.seq_k > limit {
        return Err(KernelError::Shape(format!(
            "positions beyond {limit} (q offset {} + {}, k offset {} + {})",
            cfg.q_offset, shape.seq_q, cfg.k_offset, shape.seq_k
        )));
    }
    addressable(shape)?;
    let bh = shape.batch * shape.heads;
    if bh > 65_535 {
        return Err(KernelError::Shape(format!(
            "batch × heads = {bh} exceeds a grid dimension (65535)"
        )));
    }
    Ok(())
}

/// The kernels index their buffers with 32-bit offsets (cubecl's default address type): a
/// q/o or k/v buffer of 2³² elements or more would wrap the offset of a late row onto an early
/// one and write other heads' output without any error, so such shapes are refused. The last
/// offset a kernel forms is one past a row's end, at most the buffer's length.
fn addressable(shape: &AttnShape) -> Result<(), KernelError> {
    let elems = |seq: usize| {
        [shape.batch, shape.heads, seq, shape.head_dim]
            .into_iter()
            .try_fold(1u64, |a, x| a.checked_mul(x as u64))
    };
    for (name, seq) in [("q", shape.seq_q), ("k/v", shape.seq_k)] {
        match elems(seq) {
            Some(n) if n <= u64::from(u32::MAX) => {}
            n => {
                return Err(KernelError::Shape(format!(
                    "{name} holds {} elements (batch {} × heads {} × seq {seq} × head dim {}), \
                     at or past 2^32, which the kernels' 32-bit offsets cannot address; use \
                     smaller batches, more sequence-parallel ranks (--sp) or shorter sequences",
                    n.map_or("more than 2^64".to_string(), |n| n.to_string()),
                    shape.batch,
                    shape.heads,
                    shape.head_dim
                )))
            }
        }
    }
    Ok(())
}

/// AdamW's hyper-parameters for one update, in f64 (rounded to f32 for the kernel).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// Factor applied to the gradient first (the clip factor).
    pub grad_scale: f64,
    pub beta1: f64,
    pub beta2: f64,
    /// `1 − lr·wd`, or 1 without decay.
    pub decay: f64,
    /// Bias corrections `1 − βᵗ`.
    pub bc1: f64,
    pub bc2: f64,
    pub eps: f64,
    pub lr: f64,
}

/// Updated `(p, m, v, working)` for `n` f32 elements of parameter `p`, gradient `g` and
/// moments `m`, `v` (new buffers; the inputs are not written). `working` is `p`'s new value in
/// `working` dtype, or `None` when that is f32 (then `p` is the value the model uses).
#[allow(clippy::too_many_arguments)]
pub fn adamw(
    client: &Client,
    n: usize,
    p: &Handle,
    g: &Handle,
    m: &Handle,
    v: &Handle,
    step: &AdamWStep,
    working: Dtype,
) -> Result<(Handle, Handle, Handle, Option<Handle>), KernelError> {
    let n32 = u32::try_from(n).map_err(|_| {
        KernelError::Shape(format!(
            "AdamW on {n} elements: at or past 2^32, which the kernel's offsets cannot address"
        ))
    })?;
    if !working.supported(client) {
        return Err(KernelError::Dtype {
            dtype: working,
            device: client.name().to_string(),
        });
    }
    let s = step;
    let scalars: Vec<f32> = [
        s.grad_scale,
        s.beta1,
        1.0 - s.beta1,
        s.beta2,
        1.0 - s.beta2,
        s.decay,
        s.bc1,
        s.bc2,
        s.eps,
        s.lr,
    ]
    .iter()
    .map(|&x| x as f32)
    .collect();
    let scalars = client.create_from_slice(f32::as_bytes(&scalars));
    let (p_out, m_out, v_out) = (
        client.empty(n * 4),
        client.empty(n * 4),
        client.empty(n * 4),
    );
    let with_working = working != Dtype::F32;
    // A one-element placeholder when there is no working copy (the kernel never writes it).
    let w_out = client.empty(if with_working { n * working.size() } else { 4 });
    let cubes = n.div_ceil(UNITS).clamp(1, 65_535);
    // SAFETY: every buffer holds `n` elements (the placeholder is never indexed: `working`
    // is false then); the kernel stops at `n`.
    unsafe {
        adamw_step::launch_unchecked(
            client,
            CubeCount::Static(cubes as u32, 1, 1),
            CubeDim::new_1d(UNITS as u32),
            buf(p, n),
            buf(g, n),
            buf(m, n),
            buf(v, n),
            buf(&p_out, n),
            buf(&m_out, n),
            buf(&v_out, n),
            buf(&w_out, if with_working { n } else { 1 }),
            buf(&scalars, 10),
            n32,
            (cubes * UNITS) as u32,
            with_working,
            if with_working {
                working.elem()
            } else {
                Dtype::F32.elem()
            },
        )
    };
    Ok((p_out, m_out, v_out, with_working.then_some(w_out)))
}

fn u32_of(x: usize) -> u32 {
    u32::try_from(x).expect("checked by `check`")
}

fn buf(handle: &Handle, len: usize) -> BufferArg {
    // SAFETY: every handle passed here was allocated (or checked by the caller) for `len`
    // elements of the kernel's element type.
    unsafe { BufferArg::from_raw_parts(handle.clone(), len) }
}

fn slopes(client: &Client, shape: &AttnShape, cfg: &AttnConfig) -> Handle {
    match &cfg.alibi {
        Some(s) => client.create_from_slice(f32::as_bytes(s)),
        None => client.create_from_slice(f32::as_bytes(&vec![0.0f32; shape.heads])),
    }
}

/// Forward: `(o, lse)` for contiguous `q`, `k`, `v` of `dtype`; `o` has q's shape and dtype,
/// `lse` is `[batch, heads, seq_q]` f32.
pub fn forward(
    client: &Client,
    dtype: Dtype,
    shape: AttnShape,
    cfg: &AttnConfig,
    q: &Handle,
    k: &Handle,
    v: &Handle,
) -> Result<(Handle, Handle), KernelError> {
    check(client, dtype, &shape, cfg)?;
    let plan = Plan::for_device(client, shape.head_dim)?;
    let o = client.empty(shape.q_len() * dtype.size());
    let lse = client.empty(shape.rows() * 4);
    let slopes = slopes(client, &shape, cfg);
    let bh = u32_of(shape.batch * shape.heads);
    let count = CubeCount::Static(u32_of(shape.seq_q.div_ceil(plan.block_q)), bh, 1);
    // SAFETY: buffer lengths match the shape checked above; the kernel bounds-checks rows.
    unsafe {
        flash_forward::launch_unchecked(
            client,
            count,
            CubeDim::new_1d(u32_of(plan.block_q)),
            buf(q, shape.q_len()),
            buf(k, shape.k_len()),
            buf(v, shape.k_len()),
            buf(&slopes, shape.heads),
            buf(&o, shape.q_len()),
            buf(&lse, shape.rows()),
            u32_of(shape.seq_q),
            u32_of(shape.seq_k),
            u32_of(shape.heads),
            u32_of(cfg.q_offset),
            u32_of(cfg.k_offset),
            1.0 / (shape.head_dim as f32).sqrt(),
            shape.head_dim,
            plan.block_q,
            plan.block_k,
            cfg.causal,
            cfg.alibi.is_some(),
            dtype.elem(),
        )
    };
    Ok((o, lse))
}

/// Backward: `(dq, dk, dv)` (dtype of the inputs) from the forward's inputs, its `o` and
/// f32 `lse`, and the output gradient `d_o`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    client: &Client,
    dtype: Dtype,
    shape: AttnShape,
    cfg: &AttnConfig,
    q: &Handle,
    k: &Handle,
    v: &Handle,
    o: &Handle,
    lse: &Handle,
    d_o: &Handle,
) -> Result<(Handle, Handle, Handle), KernelError> {
    check(client, dtype, &shape, cfg)?;
    let plan = Plan::for_device(client, shape.head_dim)?;
    let (ql, kl, rows) = (shape.q_len(), shape.k_len(), shape.rows());
    let delta = client.empty(rows * 4);
    let dq = client.empty(ql * dtype.size());
    let dk = client.empty(kl * dtype.size());
    let dv = client.empty(kl * dtype.size());
    let slopes = slopes(client, &shape, cfg);
    let bh = u32_of(shape.batch * shape.heads);
    let scale = 1.0 / (shape.head_dim as f32).sqrt();
    let d = shape.head_dim;
    // SAFETY: as in `forward`.
    unsafe {
        flash_backward_prepass::launch_unchecked(
            client,
            CubeCount::Static(u32_of(rows.div_ceil(UNITS)), 1, 1),
            CubeDim::new_1d(UNITS as u32),
            buf(o, ql),
            buf(d_o, ql),
            buf(&delta, rows),
            u32_of(rows),
            d,
            dtype.elem(),
        );
        flash_backward_dq::launch_unchecked(
            client,
            CubeCount::Static(u32_of(shape.seq_q.div_ceil(plan.block_q)), bh, 1),
            CubeDim::new_1d(u32_of(plan.block_q)),
            buf(q, ql),
            buf(k, kl),
            buf(v, kl),
            buf(d_o, ql),
            buf(lse, rows),
            buf(&delta, rows),
            buf(&slopes, shape.heads),
            buf(&dq, ql),
            u32_of(shape.seq_q),
            u32_of(shape.seq_k),
            u32_of(shape.heads),
            u32_of(cfg.q_offset),
            u32_of(cfg.k_offset),
            scale,
            d,
            plan.block_q,
            plan.block_k,
            cfg.causal,
            cfg.alibi.is_some(),
            dtype.elem(),
        );
        flash_backward_dkdv::launch_unchecked(
            client,
            CubeCount::Static(u32_of(shape.seq_k.div_ceil(plan.block_q)), bh, 1),
            CubeDim::new_1d(u32_of(plan.block_q)),
            buf(q, ql),
            buf(k, kl),
            buf(v, kl),
            buf(d_o, ql),
            buf(lse, rows),
            buf(&delta, rows),
            buf(&slopes, shape.heads),
            buf(&dk, kl),
            buf(&dv, kl),
            u32_of(shape.seq_q),
            u32_of(shape.seq_k),
            u32_of(shape.heads),
            u32_of(cfg.q_offset),
            u32_of(cfg.k_offset),
            scale,
            d,
            plan.block_k,
            plan.block_q,
            cfg.causal,
            cfg.alibi.is_some(),
            dtype.elem(),
        );
    }
    Ok((dq, dk, dv))
}

/// Bytes the device's memory pools hold for `client` (every stream). Pools keep their pages
/// until a cleanup, so after a workload this is its high-water mark on the device.
pub fn reserved_bytes(client: &Client) -> u64 {
    pool_bytes(client).0
}

/// Bytes the device's memory pools hold for `client` (every stream), and the bytes of the
/// allocations alive in them now.
pub fn pool_bytes(client: &Client) -> (u64, u64) {
    let u = client.memory_report(cubecl::MemoryScope::Device).usage();
    (u.bytes_reserved, u.bytes_in_use)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(batch: usize, heads: usize, seq_q: usize, seq_k: usize, d: usize) -> AttnShape {
        AttnShape {
            batch,
            heads,
            seq_q,
            seq_k,
            head_dim: d,
        }
    }

    #[test]
    fn offsets_must_fit_32_bits() {
        // 2^32 - 128 elements: the last row's end is exactly the buffer length, < 2^32.
        assert!(addressable(&shape(1, 1, (1 << 25) - 1, 1, 128)).is_ok());
        // u32::MAX elements (3 · 5 · 17 · 257 · 65537): the largest buffer that fits.
        assert!(addressable(&shape(3, 5, 17 * 257 * 65537, 1, 1)).is_ok());
        // The example, b·h·s·d = 1·32·2^20·128 = 2^32, on either side.
        let e = addressable(&shape(1, 32, 1 << 20, 1, 128)).unwrap_err();
        assert!(e.to_string().contains("q holds 4294967296 elements"), "{e}");
        let e = addressable(&shape(1, 32, 1, 1 << 20, 128)).unwrap_err();
        assert!(e.to_string().contains("k/v holds 4294967296"), "{e}");
        // A product past 2^64 is refused, not wrapped.
        assert!(addressable(&shape(1 << 40, 1 << 20, 1, 1, 1 << 10)).is_err());
    }
}
