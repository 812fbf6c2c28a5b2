//! The optimizer step across ranks: gradient reductions, global-norm clipping and AdamW, with
//! the optimizer state either replicated or ZeRO-1-sharded over the DP group.

use burn::tensor::Tensor;

use crate::error::Result;
use crate::model::GenSlm;
use crate::parallel::ranks::Ranks;
use crate::parallel::zero::ZeroShard;
use crate::train::optim::{clip_factor, sum_of_squares, AdamW, AdamWConfig};
use crate::train::shard::{
    gather_shard, global_grad_norm, param_groups, reduce_gradients, reduce_params,
};

/// Optimizer state of one rank.
#[derive(Debug, Clone)]
pub enum DistOptim {
    /// Every rank holds all moments and applies the same update.
    Replicated(AdamW),
    /// ZeRO-1: replicated parameters' moments sharded over DP; the SP-sharded position table
    /// (if any) keeps its own moments.
    Zero {
        shard: ZeroShard,
        pos: Option<(usize, AdamW)>,
    },
}

/// What a step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutcome {
    pub grad_norm: f64,
    pub applied: bool,
}

impl DistOptim {
    /// `state` holds the moments for this rank's parameters (position table already cut to the
    /// rank's rows), fresh or from a checkpoint.
    pub fn new(state: AdamW, model: &GenSlm, ranks: &Ranks, zero: bool) -> Self {
        if !(zero && ranks.topo.dp > 1) {
            return DistOptim::Replicated(state);
        }
        let (replicated, sharded) = param_groups(model);
        let moments = (state.m.as_slice(), state.v.as_slice(), state.step);
        let shard = ZeroShard::new(state.cfg, replicated, &model.params, ranks, Some(moments));
        let pos = sharded.first().map(|&i| {
            let mut o = AdamW::new(state.cfg, std::slice::from_ref(&model.params[i]));
            o.m = vec![state.m[i].clone()];
            o.v = vec![state.v[i].clone()];
            o.step = state.step;
            (i, o)
        });
        DistOptim::Zero { shard, pos }
    }

    pub fn fresh(cfg: AdamWConfig, model: &GenSlm, ranks: &Ranks, zero: bool) -> Self {
        Self::new(AdamW::new(cfg, &model.params), model, ranks, zero)
    }

    pub fn step_count(&self) -> u64 {
        match self {
            DistOptim::Replicated(o) => o.step,
            DistOptim::Zero { shard, .. } => shard.opt.step,
        }
    }

    /// Reduces this rank's local gradients, clips by the global norm and updates `model`
    /// (unless the loss or the norm is not finite). Parameters come back as autodiff leaves.
    pub fn step(
        &mut self,
        model: &mut GenSlm,
        mut grads: Vec<Tensor<1>>,
        lr: f64,
        max_norm: f64,
        loss_finite: bool,
        ranks: &Ranks,
    ) -> Result<StepOutcome> {
        let mut params: Vec<Tensor<1>> = model
            .params
            .iter()
            .map(|p| p.clone().without_autodiff())
            .collect();
        let outcome = match self {
            DistOptim::Replicated(opt) => {
                reduce_gradients(&mut grads, model, ranks)?;
                let norm = global_grad_norm(&grads, model, ranks)?;
                let applied = loss_finite && norm.is_finite();
                if applied {
                    let k = clip_factor(norm, max_norm);
                    let grads = grads.into_iter().map(|g| g * k).collect();
                    params = opt.update(params, grads, &model.layout.specs, lr);
                }
                StepOutcome {
                    grad_norm: norm,
                    applied,
                }
            }
            DistOptim::Zero { shard, pos } => {
                // Replicated: sum over SP here, over DP inside the reduce-scatter.
                let (replicated, sharded) = param_groups(model);
                reduce_params(&mut grads, &replicated, ranks.sp.as_ref())?;
                reduce_params(&mut grads, &sharded, ranks.dp.as_ref())?;
                let chunk = shard.reduce_scatter(&grads, ranks)?;
                let sq = |t: &Tensor<1>| sum_of_squares(t) as f32;
                let mut rep = [chunk.iter().map(sq).sum::<f32>()];
                ranks.dp.all_reduce_sum(&mut rep)?;
                let mut pos_sq = [sharded.iter().map(|&i| sq(&grads[i])).sum::<f32>()];
                if !sharded.is_empty() {
                    ranks.sp.all_reduce_sum(&mut pos_sq)?;
                }
                let norm = (rep[0] as f64 + pos_sq[0] as f64).sqrt();
                let applied = loss_finite && norm.is_finite();
                if applied {
                    let k = clip_factor(norm, max_norm);
                    let chunk = chunk.into_iter().map(|g| g * k).collect();
                    shard.update(&mut params, chunk, &model.layout.specs, lr, ranks)?;
                    if let Some((i, o)) = pos {
                        let new = o.update(
                            vec![params[*i].clone()],
                            vec![grads[*i].clone() * k],
                            std::slice::from_ref(&model.layout.specs[*i]),
                            lr,
                        );
                        params[*i] = new.into_iter().next().expect("one tensor");
                    }
                }
                StepOutcome {
                    grad_norm: norm,
                    applied,
                }
            }
        };
        model.params = params
            .into_iter()
            .map(|p| p.autodiff().require_grad())
            .collect();
        Ok(outcome)
    }

    /// The full optimizer state (all moments, position rows gathered over SP), as a checkpoint
    /// stores it. Every rank must call it.
    pub fn full_state(&self, model: &GenSlm, ranks: &Ranks) -> Result<AdamW> {
        let mut full = match self {
            DistOptim::Replicated(o) => o.clone(),
            DistOptim::Zero { shard, pos } => {
                let mut o = AdamW::new(shard.opt.cfg, &model.params);
                o.step = shard.opt.step;
                let device = o.m[0].device();
                for (i, m, v) in shard.gather_moments(ranks)? {
                    o.m[i] = crate::model::neox::host_to_param(m, &device);
                    o.v[i] = crate::model::neox::host_to_param(v, &device);
                }
                if let Some((i, p)) = pos {
                    o.m[*i] = p.m[0].clone();
                    o.v[*i] = p.v[0].clone();
                }
                o
            }
        };
        if let (Some(pos), Some(_)) = (model.layout.embed_pos, &model.sp) {
            full.m[pos] = gather_shard(&full.m[pos], ranks)?;
            full.v[pos] = gather_shard(&full.v[pos], ranks)?;
        }
        Ok(full)
    }
}
