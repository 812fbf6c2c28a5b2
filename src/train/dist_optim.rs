//! The optimizer step across ranks: gradient reductions, global-norm clipping and AdamW, with
//! the optimizer state either replicated or ZeRO-1-sharded over the DP group.

use burn::tensor::Tensor;

use crate::error::Result;
use crate::model::GenSlm;
use crate::parallel::ranks::Ranks;
use crate::parallel::topology::Topology;
use crate::train::master::{fp32, numel_bytes, working};
use crate::train::optim::{
    clip_factor, each_finite, numel, sums_of_squares, update_applies, AdamW, AdamWConfig,
};
use crate::train::optim_shards::MomentRun;
use crate::train::shard::{
    combine_norm, global_grad_norm, is_tp_slice, param_groups, reduce_gradients, reduce_params,
};
use crate::train::zero_shard::ZeroShard;

/// Optimizer state of one rank.
// One per rank, built once: boxing the larger variant would buy nothing.
#[allow(clippy::large_enum_variant)]
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
    /// Whether every parameter is finite after the step (an update can overflow although the
    /// loss and the gradient were finite, e.g. with an absurd learning rate).
    pub params_finite: bool,
}

impl DistOptim {
    /// `state` holds the moments for this rank's parameters (position table already cut to the
    /// rank's rows), fresh or from a checkpoint, and under the bf16 layout their fp32 masters
    /// (cut like the moments for ZeRO-1).
    pub fn new(state: AdamW, model: &GenSlm, ranks: &Ranks, zero: bool) -> Self {
        if !(zero && ranks.dp.size() > 1) {
            return DistOptim::Replicated(state);
        }
        let (replicated, sharded) = param_groups(model);
        let moments = (state.m.as_slice(), state.v.as_slice(), state.step);
        let mut shard = ZeroShard::new(
            state.cfg,
            replicated,
            &model.params,
            ranks.dp.as_ref(),
            Some(moments),
            state.offload,
        );
        if let Some(master) = &state.master {
            shard.opt.set_master(shard.pieces_of(master));
        }
        let pos = sharded.first().map(|&i| {
            let p = std::slice::from_ref(&model.params[i]);
            let mut o = AdamW::placed(state.cfg, p, state.offload);
            o.m = vec![state.m[i].clone()];
            o.v = vec![state.v[i].clone()];
            o.step = state.step;
            if let Some(master) = &state.master {
                o.set_master(vec![master[i].clone()]);
            }
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

    /// Bytes of (parameters, gradients, optimizer state) this rank holds at the update: the
    /// whole model (bf16 or fp32) and its fp32 gradients, and the moments (and masters) it
    /// keeps.
    pub fn held_bytes(&self, model: &GenSlm) -> (usize, usize, usize) {
        let params: usize = model.params.iter().map(numel_bytes).sum();
        let opt = match self {
            DistOptim::Replicated(o) => o.state_bytes(),
            DistOptim::Zero { shard, pos } => {
                shard.opt.state_bytes() + pos.as_ref().map_or(0, |(_, o)| o.state_bytes())
            }
        };
        (params, 4 * numel(&model.params), opt)
    }

    /// Under the bf16 layout, `model` with its fp32 master values in place of the working
    /// copies (ZeRO-1: all-gathered over DP; every DP rank must call it), for a checkpoint;
    /// `None` without masters.
    pub fn master_model(&self, model: &GenSlm, ranks: &Ranks) -> Result<Option<GenSlm>> {
        let mut full = model.clone();
        let on = |t: &Tensor<1>, like: &Tensor<1>| t.clone().to_device(&like.device());
        match self {
            DistOptim::Replicated(o) => {
                let Some(master) = &o.master else {
                    return Ok(None);
                };
                for (p, m) in full.params.iter_mut().zip(master) {
                    *p = on(m, p);
                }
            }
            DistOptim::Zero { shard, pos } => {
                let Some(master) = &shard.opt.master else {
                    return Ok(None);
                };
                let device = model.params[shard.params[0]].device();
                let dp = ranks.dp.as_ref();
                let all = shard.all_gather(master.clone(), dp, ranks.bucket, &device, None)?;
                for (&i, t) in shard.params.iter().zip(all) {
                    full.params[i] = t;
                }
                if let Some((i, o)) = pos {
                    let m = o.master.as_ref().expect("the position table's master");
                    full.params[*i] = on(&m[0], &model.params[*i]);
                }
            }
        }
        full.params = full.params.into_iter().map(fp32).collect();
        Ok(Some(full))
    }

    /// Reduces this rank's local gradients (unless `reduced`: already summed over the ranks,
    /// `train::replica_reduce`), clips by the global norm and updates `model` (unless the loss
    /// or the norm is not finite). Parameters come back as autodiff leaves.
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &mut self,
        model: &mut GenSlm,
        mut grads: Vec<Tensor<1>>,
        reduced: bool,
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
        let (grad_norm, applied) = match self {
            DistOptim::Replicated(opt) => {
                if !reduced {
                    reduce_gradients(&mut grads, model, ranks)?;
                }
                let norm = global_grad_norm(&grads, model, ranks)?;
                let applied = update_applies(loss_finite, norm, max_norm);
                if applied {
                    let k = clip_factor(norm, max_norm);
                    params = opt.update(params, grads, k, &model.layout.specs, lr);
                }
                (norm, applied)
            }
            DistOptim::Zero { shard, pos } => {
                // Replicated: sum over SP here, over DP inside the reduce-scatter.
                let (replicated, sharded) = param_groups(model);
                let chunk = if reduced {
                    // Summed over the whole data group already: this rank's chunk is a cut.
                    shard.pieces_of(&grads)
                } else {
                    // Quantized gradients (pipeline stages) round here over SP, then again
                    // in the reduce-scatter over DP.
                    let q = ranks.quantize.grads;
                    reduce_params(&mut grads, &replicated, ranks.sp.as_ref(), ranks.bucket, q)?;
                    reduce_params(&mut grads, &sharded, ranks.dp.as_ref(), ranks.bucket, q)?;
                    let mine: Vec<Tensor<1>> =
                        replicated.iter().map(|&i| grads[i].clone()).collect();
                    shard.reduce_scatter(&mine, ranks.dp.as_ref(), ranks.bucket, q)?
                };
                // Sums of squares in f64, like the replicated path (an f32 sum over billions
                // of elements loses digits): whole parameters and TP slices apart, each summed
                // over DP (every element in one rank's chunk).
                let mut rep = [0.0f64; 2];
                let sq = sums_of_squares(&chunk.iter().collect::<Vec<_>>());
                for (s, q) in shard.segments.iter().zip(sq) {
                    rep[usize::from(is_tp_slice(model, s.param))] += q;
                }
                ranks.dp.all_reduce_sum_f64(&mut rep)?;
                let pos_sq = (!sharded.is_empty()).then(|| {
                    let mine: Vec<&Tensor<1>> = sharded.iter().map(|&i| &grads[i]).collect();
                    sums_of_squares(&mine).iter().sum()
                });
                let norm = combine_norm(rep[0], rep[1], pos_sq, ranks)?;
                let applied = update_applies(loss_finite, norm, max_norm);
                if applied {
                    let k = clip_factor(norm, max_norm);
                    shard.update(
                        &mut params,
                        chunk,
                        k,
                        &model.layout.specs,
                        lr,
                        ranks.dp.as_ref(),
                        ranks.bucket,
                    )?;
                    if let Some((i, o)) = pos {
                        let new = o.update(
                            vec![params[*i].clone()],
                            vec![grads[*i].clone()],
                            k,
                            std::slice::from_ref(&model.layout.specs[*i]),
                            lr,
                        );
                        params[*i] = new.into_iter().next().expect("one tensor");
                    }
                }
                (norm, applied)
            }
        };
        // Every rank of a stage holds the same parameters, so all agree; the stages agree
        // through the pipeline group.
        let mut params_finite = !applied
            || each_finite(&params.iter().collect::<Vec<_>>())
                .iter()
                .all(|&f| f);
        if ranks.topo.pp > 1 {
            let mut bad = [f64::from(u8::from(!params_finite))];
            ranks.pp.all_reduce_sum_f64(&mut bad)?;
            params_finite = bad[0] == 0.0;
        }
        // ZeRO-1's all-gather brings the new values back in fp32: the working copies' dtype.
        model.params = params
            .into_iter()
            .map(|p| working(model, p).autodiff().require_grad())
            .collect();
        Ok(StepOutcome {
            grad_norm,
            applied,
            params_finite,
        })
    }

    /// The moments this rank writes into a checkpoint (`train::optim_shards`), chosen so that
    /// every value is written by exactly one rank: a parameter replicated over TP ranks by TP
    /// rank 0 only; replicated moments by the first rank of the data group; ZeRO-1's shards by
    /// SP rank 0 (the SP ranks of a replica hold equal shards); the SP-split position rows by
    /// every SP rank of DP replica 0 and CP rank 0.
    pub fn moment_runs(&self, model: &GenSlm, topo: &Topology) -> Vec<MomentRun> {
        let tp_ok = |i: usize| topo.tp_rank() == 0 || is_tp_slice(model, i);
        let (replicated, sharded) = param_groups(model);
        let pos_writer = topo.dp_rank() == 0 && topo.cp_rank() == 0 && topo.tp_rank() == 0;
        match self {
            DistOptim::Replicated(o) => {
                let first = topo.dp_rank() == 0 && topo.cp_rank() == 0 && topo.sp_rank() == 0;
                let replicated = replicated.into_iter().filter(|&i| first && tp_ok(i));
                let sharded = sharded.into_iter().filter(|_| pos_writer);
                let whole = |i: usize| MomentRun::whole(i, &o.m[i], &o.v[i]);
                replicated.chain(sharded).map(whole).collect()
            }
            DistOptim::Zero { shard, pos } => {
                let mine = MomentRun::of_shard(shard);
                let mut runs: Vec<_> = mine
                    .filter(|r| topo.sp_rank() == 0 && tp_ok(r.param))
                    .collect();
                if let (Some((i, o)), true) = (pos, pos_writer) {
                    runs.push(MomentRun::whole(*i, &o.m[0], &o.v[0]));
                }
                runs
            }
        }
    }
}
