//! ZeRO-2 and ZeRO-3 over the data group, DP × CP × SP (DeepSpeed's stages; the group spans
//! SP and CP ranks too, because they hold replicas of every weight). Under TP each TP rank's
//! slices are sharded over its own data group, as Megatron-DeepSpeed does: the units are the
//! TP-cut layers, and the gradient norm adds the TP slices over the TP group.
//!
//! Each unit of parameters ([`Unit`]: the embeddings, every layer, the head) is one
//! [`ZeroShard`]: its flat concatenation padded to N equal blocks, rank r owning block r of
//! the fp32 values and of the Adam moments. The learned-position table under SP is already
//! split by rows over the SP group, so its unit is sharded over the DP group only.
//!
//! - Gradients (both stages) are reduce-scattered unit by unit as soon as the layer-wise
//!   backward ([`crate::train::layerwise`]) has them: one reduce-scatter over DP×SP both sums
//!   over every rank and leaves each rank its chunk, so the whole model's gradients never exist
//!   at once. With several micro-batches each one's chunk is added to the step's.
//! - ZeRO-2: every rank keeps the full working weights; after AdamW on its chunk, each unit's
//!   new values are all-gathered.
//! - ZeRO-3: a rank keeps only its blocks. A unit's full weights are all-gathered just before
//!   it runs and dropped after: in the forward, again for the backward's recompute under
//!   `--checkpoint-activations`; without checkpointing, a layer's gathered weights stay alive
//!   in its autodiff graph until its backward (see `layerwise`).
//!
//! Overlap (issue 42; `parallel::progress`, off with `--no-overlap` and on NCCL): a unit's
//! gradient reduce-scatter is started when the backward hands its gradients over and waited
//! for later (at most [`COLLECTIVES_IN_FLIGHT`] at once, all before the update), so it runs
//! while the layers below compute theirs. Under ZeRO-3 the executor says which units it will
//! ask for ([`UnitWeights::will_ask`]), and the gathers of the next `prefetch` of them are
//! started before the current one is waited for: with `--prefetch-layers 1` at most two
//! units' gathered weights exist at a time (under `--checkpoint-activations`; without it the
//! autodiff graphs keep every layer's, as above). ZeRO-2's all-gathers of the updated values
//! overlap the next units' AdamW. Every rank starts the same collectives in the same order,
//! so the results are those of the blocking calls, bit for bit.

use std::collections::VecDeque;
use std::sync::Arc;

use burn::tensor::{Device, Tensor};

use crate::error::{Error, Result};
use crate::model::GenSlm;
use crate::ops::primitive::{host_to_param, tensor_to_vec};
use crate::parallel::comm::Communicator;
use crate::parallel::parallelize::{gather_shard_to_root, join_tp_slices};
use crate::parallel::progress::{start, Pending};
use crate::parallel::ranks::{Quantized, Ranks};
use crate::parallel::topology::Topology;
use crate::train::dist_optim::StepOutcome;
use crate::train::layerwise::{Unit, UnitWeights};
use crate::train::master::{layout_on, numel_bytes, working};
use crate::train::optim::{
    clip_factor, each_finite, sums_of_squares, update_applies, AdamW, AdamWConfig,
};
use crate::train::optim_shards::MomentRun;
use crate::train::shard::{combine_norm, is_tp_slice};
use crate::train::zero_shard::ZeroShard;

/// Parameter `i`'s values as a rank holds them and their Adam moments (`None`: zeros).
pub type Fetched = (Tensor<1>, Option<(Tensor<1>, Tensor<1>)>);
/// Where [`ZeroUnits::build`] gets each parameter.
pub type Fetch<'a> = dyn FnMut(usize) -> Result<Fetched> + 'a;

/// One unit's shard on this rank.
#[derive(Debug)]
struct UnitShard {
    unit: Unit,
    /// The sharding group: all DP × CP × SP ranks, or the DP group for the SP-split position
    /// table.
    comm: Arc<dyn Communicator>,
    shard: ZeroShard,
    /// ZeRO-3: this rank's pieces of the fp32 values (one per segment of `shard`). ZeRO-2:
    /// empty between steps (the full working copy in the model holds the values).
    values: Vec<Tensor<1>>,
    /// This step's gradient chunk so far (one per segment).
    grad: Option<Vec<Tensor<1>>>,
}

/// Started reduce-scatters of gradients (and ZeRO-2's gathers of updated values) waited for
/// beyond this many at a time (each holds a unit's flat host buffer until it finishes).
pub const COLLECTIVES_IN_FLIGHT: usize = 2;

/// A group of units' gathers started ahead: each unit's blocks from every rank (host).
type GroupGather = (Vec<Unit>, Vec<Pending<Vec<f32>>>);

/// Collectives started and not yet waited for (issue 42).
#[derive(Debug, Default)]
struct InFlight {
    /// ZeRO-3: the unit groups the executor will ask for next, in order, not yet started.
    upcoming: VecDeque<Vec<Unit>>,
    /// ZeRO-3: gathers started ahead of their use (one per unit of the group), in order.
    gathers: VecDeque<GroupGather>,
    /// Reduce-scatters not yet added to their unit's chunk, oldest first.
    scatters: VecDeque<(Unit, Device, Pending<Vec<f32>>)>,
}

/// A model trained with ZeRO-2 or ZeRO-3 on one rank.
#[derive(Debug)]
pub struct ZeroUnits {
    pub stage: u8,
    /// ZeRO-2: the full working weights (autodiff leaves). ZeRO-3: the model with every
    /// parameter empty; a unit's weights are gathered into a copy of it when the unit runs.
    pub model: GenSlm,
    units: Vec<UnitShard>,
    bucket: usize,
    /// Which of its collectives travel quantized (`parallel::quant`).
    quantize: Quantized,
    /// ZeRO-3: unit groups gathered ahead of their use (`--prefetch-layers`; 0 with
    /// `--no-overlap`, where a gather ahead would only block earlier).
    pub prefetch: usize,
    flight: InFlight,
}

impl ZeroUnits {
    /// Shards `model` (already cut for SP) and its full `moments` (our layout, position rows
    /// already cut) for this rank. `stage` is 2 or 3.
    pub fn new(model: GenSlm, moments: AdamW, stage: u8, ranks: &Ranks) -> Self {
        let params = model.params.clone();
        let (cfg, step, offload) = (moments.cfg, moments.step, moments.offload);
        let mut fetch = |i: usize| -> Result<Fetched> {
            Ok((
                params[i].clone(),
                Some((moments.m[i].clone(), moments.v[i].clone())),
            ))
        };
        let opt = (cfg, step, offload);
        Self::build(model, opt, &mut fetch, stage, ranks)
            .expect("fetching from tensors in memory cannot fail")
    }

    /// Builds this rank's shards unit by unit from `fetch(i)`, parameter `i` as this rank
    /// holds it (position rows cut under SP) with its moments (`None`: zeros), so that only one
    /// unit's full values exist at a time. `model` gives the layout and groups (a skeleton
    /// from `GenSlm::empty` will do: its parameters are replaced). `opt`: AdamW's settings,
    /// its step count and whether its state (with ZeRO-3's fp32 pieces) is offloaded.
    pub fn build(
        mut model: GenSlm,
        (cfg, step, offload): (AdamWConfig, u64, bool),
        fetch: &mut Fetch<'_>,
        stage: u8,
        ranks: &Ranks,
    ) -> Result<Self> {
        let layout = model.layout.clone();
        let pos_split = model.position_shard().is_some();
        let device = model.device.clone();
        let empty = || host_to_param(Vec::new(), &device);
        model.params = model.params.iter().map(|_| empty()).collect();
        let mut units = Vec::new();
        for unit in Unit::all(&layout) {
            // The ranks holding the same TP slices (the world without TP).
            let comm = if unit == Unit::Pos && pos_split {
                ranks.dp.clone()
            } else {
                ranks.data.clone()
            };
            let params = unit.params(&layout);
            // Full values (and moments) of this unit only, at their indices.
            let n = model.params.len();
            let (mut all, mut m, mut v) = (vec![empty(); n], vec![empty(); n], vec![empty(); n]);
            let mut resumed = true;
            for &i in &params {
                let (x, moments) = fetch(i)?;
                all[i] = x;
                match moments {
                    Some((mi, vi)) => (m[i], v[i]) = (mi, vi),
                    None => resumed = false,
                }
            }
            let moments = resumed.then_some((m.as_slice(), v.as_slice(), step));
            let shard = ZeroShard::new(cfg, params, &all, comm.as_ref(), moments, offload);
            // ZeRO-2's fp32 values are the full working copy's (cut again at each update);
            // ZeRO-3's are the master shard, offloaded with the moments.
            // Under the bf16 layout ZeRO-2's fp32 pieces become the shard's masters and the
            // working copy is their bf16 rounding; ZeRO-3's fp32 values are the masters.
            let mut shard = shard;
            let values = if stage >= 3 {
                let pieces = shard.pieces_of(&all).into_iter();
                pieces.map(|t| shard.opt.to_state_device(t)).collect()
            } else {
                if layout_on(&model) {
                    shard.opt.set_master(shard.pieces_of(&all));
                }
                for &i in &shard.params {
                    let w = working(&model, all[i].clone());
                    model.params[i] = w.autodiff().require_grad();
                }
                Vec::new()
            };
            units.push(UnitShard {
                unit,
                comm,
                shard,
                values,
                grad: None,
            });
        }
        Ok(Self {
            stage,
            model,
            units,
            bucket: ranks.bucket,
            quantize: ranks.quantize,
            prefetch: 0,
            flight: InFlight::default(),
        })
    }

    fn unit_mut(&mut self, unit: Unit) -> &mut UnitShard {
        self.units
            .iter_mut()
            .find(|u| u.unit == unit)
            .expect("every unit has a shard")
    }

    /// Starts the all-gather of `unit`'s ZeRO-3 pieces (host buffers; see `UnitWeights::model`).
    fn start_gather(&mut self, unit: Unit) -> Pending<Vec<f32>> {
        let (bucket, codec) = (self.bucket, self.quantize.weights);
        let u = self.unit_mut(unit);
        let job = u.shard.gather_host(&u.values, bucket, codec);
        start(u.comm.as_ref(), job)
    }

    /// Starts the gathers of the announced unit groups until `prefetch` groups are ahead
    /// (host buffers: groups on device memory, NCCL, run without a communication thread and
    /// with `prefetch` 0).
    fn top_up(&mut self) {
        while self.flight.gathers.len() < self.prefetch {
            let Some(next) = self.flight.upcoming.pop_front() else {
                break;
            };
            let started = next.iter().map(|&u| self.start_gather(u)).collect();
            self.flight.gathers.push_back((next, started));
        }
    }

    /// Waits for the oldest started reduce-scatter and adds its chunk to the unit's.
    fn finish_scatter(&mut self) -> Result<()> {
        let Some((unit, device, pending)) = self.flight.scatters.pop_front() else {
            return Ok(());
        };
        let mine = pending.wait()?;
        let u = self.unit_mut(unit);
        let chunk = u.shard.chunk_of(&mine, &device);
        u.add_grad(chunk);
        Ok(())
    }

    pub fn step_count(&self) -> u64 {
        self.units[0].shard.opt.step
    }

    /// Bytes of parameters (ZeRO-2: the full working copy, fp32 or bf16; ZeRO-3: its fp32
    /// pieces, the masters), fp32 gradient chunks and Adam state (moments, and ZeRO-2's masters
    /// under the bf16 layout) this rank holds at a step's update.
    pub fn held_bytes(&self) -> (usize, usize, usize) {
        let mut held = (0, 0, 0);
        for u in &self.units {
            let chunk: usize = u.shard.segments.iter().map(|s| s.len).sum();
            held.0 += 4 * chunk;
            held.1 += 4 * chunk;
            held.2 += u.shard.opt.state_bytes();
        }
        if self.stage == 2 {
            held.0 = self.model.params.iter().map(numel_bytes).sum();
        }
        held
    }

    /// Clips by the global gradient norm and updates every unit (unless the loss or the norm
    /// is not finite). Every rank must call it once per step, after the micro-batches.
    pub fn step(
        &mut self,
        lr: f64,
        max_norm: f64,
        loss_finite: bool,
        ranks: &Ranks,
    ) -> Result<StepOutcome> {
        while !self.flight.scatters.is_empty() {
            self.finish_scatter()?;
        }
        let mut chunks = Vec::with_capacity(self.units.len());
        for u in &mut self.units {
            chunks.push(u.grad.take().ok_or_else(|| {
                Error::Invalid(format!("ZeRO: no gradient reached {:?}", u.unit))
            })?);
        }
        // Every element of this TP rank's slices is in exactly one chunk of its data group;
        // squares summed in f64, TP slices then summed over the TP group (a parameter whole on
        // every TP rank counts once).
        let mut sq = [0.0f64; 2];
        let (params, pieces): (Vec<usize>, Vec<&Tensor<1>>) = self
            .units
            .iter()
            .zip(&chunks)
            .flat_map(|(u, chunk)| u.shard.segments.iter().map(|s| s.param).zip(chunk))
            .unzip();
        for (param, q) in params.into_iter().zip(sums_of_squares(&pieces)) {
            sq[usize::from(is_tp_slice(&self.model, param))] += q;
        }
        ranks.data.all_reduce_sum_f64(&mut sq)?;
        let norm = combine_norm(sq[0], sq[1], None, ranks)?;
        let applied = update_applies(loss_finite, norm, max_norm);
        let mut bad = [0.0f64];
        if applied {
            let k_clip = clip_factor(norm, max_norm);
            let specs = self.model.layout.specs.clone();
            let device = self.model.device.clone();
            // ZeRO-2: unit k's new values travel while unit k + 1 is updated.
            let mut gathers: VecDeque<(usize, Pending<Vec<f32>>)> = VecDeque::new();
            for (k, chunk) in chunks.into_iter().enumerate() {
                let u = &mut self.units[k];
                let pieces = if self.stage >= 3 {
                    std::mem::take(&mut u.values)
                } else {
                    u.shard.pieces_of(&self.model.params)
                };
                u.values = u.shard.update_pieces(pieces, chunk, k_clip, &specs, lr);
                bad[0] += each_finite(&u.values.iter().collect::<Vec<_>>())
                    .iter()
                    .filter(|&&f| !f)
                    .count() as f64;
                if self.stage == 2 {
                    let values = std::mem::take(&mut u.values);
                    if u.comm.on_device(&device) {
                        let full = u.shard.all_gather(
                            values,
                            u.comm.as_ref(),
                            self.bucket,
                            &device,
                            None,
                        )?;
                        self.set_params(k, full);
                        continue;
                    }
                    // ZeRO-2's gathers set the working copy the next steps update: fp32.
                    let job = u.shard.gather_host(&values, self.bucket, None);
                    gathers.push_back((k, start(u.comm.as_ref(), job)));
                    if gathers.len() > COLLECTIVES_IN_FLIGHT {
                        self.finish_gather(gathers.pop_front(), &device)?;
                    }
                }
            }
            while let Some(g) = gathers.pop_front() {
                self.finish_gather(Some(g), &device)?;
            }
        }
        ranks.world.all_reduce_sum_f64(&mut bad)?;
        Ok(StepOutcome {
            grad_norm: norm,
            applied,
            params_finite: bad[0] == 0.0,
        })
    }

    /// ZeRO-2: unit `k`'s gathered new values as the working weights.
    fn set_params(&mut self, k: usize, full: Vec<Tensor<1>>) {
        for (&i, t) in self.units[k].shard.params.iter().zip(full) {
            self.model.params[i] = working(&self.model, t).autodiff().require_grad();
        }
    }

    /// Waits for a started ZeRO-2 gather of unit `k` and installs it.
    fn finish_gather(
        &mut self,
        started: Option<(usize, Pending<Vec<f32>>)>,
        device: &Device,
    ) -> Result<()> {
        if let Some((k, pending)) = started {
            let flat = pending.wait()?;
            let full = self.units[k].shard.params_of(&flat, device);
            self.set_params(k, full);
        }
        Ok(())
    }

    /// The whole model's weights on world rank 0 (`None` on the others), for a checkpoint:
    /// every unit gathered to its group's rank 0, then the position rows over the SP group,
    /// then under TP the slices over world rank 0's TP group. Every rank must call it; no rank
    /// but the root ever holds more than its own share (a TP group's roots: their slices).
    pub fn gather_weights(&self, ranks: &Ranks) -> Result<Option<GenSlm>> {
        let mut params: Vec<Option<Vec<f32>>> = vec![None; self.model.params.len()];
        let device = self.model.device.clone();
        for u in &self.units {
            let (c, b) = (u.comm.as_ref(), self.bucket);
            let pieces = match &u.shard.opt.master {
                _ if self.stage >= 3 => u.values.clone(),
                Some(master) => master.clone(),
                None => u.shard.pieces_of(&self.model.params),
            };
            let Some(vals) = u.shard.gather_to_root(&pieces, c, b)? else {
                continue;
            };
            let split_rows = u.unit == Unit::Pos && self.model.position_shard().is_some();
            for (i, x) in vals {
                params[i] = if split_rows {
                    // This rank holds its SP rank's rows: join them over the SP group.
                    let t = host_to_param(x, &device);
                    gather_shard_to_root(&t, ranks)?.map(|t| tensor_to_vec(&t))
                } else {
                    Some(x)
                };
            }
        }
        if !ranks.topo.gathers_slices() {
            return Ok(None);
        }
        let missing = || Error::Invalid("ZeRO: a unit did not reach rank 0".into());
        let mut model = self.model.clone();
        model.params = params
            .into_iter()
            .map(|x| x.map(|x| host_to_param(x, &device)).ok_or_else(missing))
            .collect::<Result<_>>()?;
        if let Some(pos) = model.layout.embed_pos {
            model.layout.specs[pos].shape[0] = model.cfg.max_position_embeddings;
        }
        model.sp = None;
        join_tp_slices(model, ranks)
    }

    /// The moments this rank writes into a checkpoint: all it holds (every unit's shard is
    /// its own within its data group; the SP ranks' position rows differ), except that a
    /// parameter whole on every TP rank is written by TP rank 0 only.
    pub fn moment_runs(&self, topo: &Topology) -> Vec<MomentRun> {
        let shards = self.units.iter().map(|u| &u.shard);
        shards
            .flat_map(MomentRun::of_shard)
            .filter(|r| topo.tp_rank() == 0 || is_tp_slice(&self.model, r.param))
            .collect()
    }
}

impl UnitShard {
    /// Adds a micro-batch's gradient chunk to the step's.
    fn add_grad(&mut self, chunk: Vec<Tensor<1>>) {
        self.grad = Some(match self.grad.take() {
            Some(acc) => acc.into_iter().zip(chunk).map(|(a, c)| a + c).collect(),
            None => chunk,
        });
    }
}

impl UnitWeights for ZeroUnits {
    fn will_ask(&mut self, order: Vec<Vec<Unit>>) {
        if self.stage >= 3 && self.prefetch > 0 {
            self.flight.upcoming = order.into();
        }
    }

    fn model(&mut self, units: &[Unit]) -> Result<GenSlm> {
        let mut m = self.model.clone();
        if self.stage < 3 {
            return Ok(m);
        }
        let device = self.model.device.clone();
        // This request's gathers: started ahead when it is the one announced next; otherwise
        // the announced order no longer holds and the gathers started for it are dropped
        // (every rank drops the same ones; each still completes on its thread).
        let ahead = match self.flight.gathers.front() {
            Some((next, _)) if next == units => self.flight.gathers.pop_front().map(|g| g.1),
            _ => None,
        };
        if ahead.is_none() {
            self.flight.gathers.clear();
            if self.flight.upcoming.front().map(Vec::as_slice) == Some(units) {
                self.flight.upcoming.pop_front();
            } else {
                self.flight.upcoming.clear();
            }
        }
        let full: Vec<Vec<Tensor<1>>> = match ahead {
            Some(pending) => {
                // The next groups start before this one is waited for: the communication
                // thread goes straight on to them.
                self.top_up();
                let mut full = Vec::with_capacity(units.len());
                for (&unit, p) in units.iter().zip(pending) {
                    let flat = p.wait()?;
                    full.push(self.unit_mut(unit).shard.params_of(&flat, &device));
                }
                full
            }
            None => {
                // Gathered now (on device memory where the group has it, as NCCL does), then
                // the next groups started.
                let (bucket, codec) = (self.bucket, self.quantize.weights);
                let mut full = Vec::with_capacity(units.len());
                for &unit in units {
                    let u = self.unit_mut(unit);
                    let values = u.values.clone();
                    full.push(u.shard.all_gather(
                        values,
                        u.comm.as_ref(),
                        bucket,
                        &device,
                        codec,
                    )?);
                }
                self.top_up();
                full
            }
        };
        for (&unit, full) in units.iter().zip(full) {
            for (&i, t) in self.unit_mut(unit).shard.params.iter().zip(full) {
                m.params[i] = working(&m, t).autodiff().require_grad();
            }
        }
        Ok(m)
    }

    fn take_grads(&mut self, unit: Unit, grads: Vec<Tensor<1>>) -> Result<()> {
        let (bucket, codec) = (self.bucket, self.quantize.grads);
        let u = self.unit_mut(unit);
        let device = grads[0].device();
        if codec.is_none() && u.comm.on_device(&device) {
            let chunk = u
                .shard
                .reduce_scatter(&grads, u.comm.as_ref(), bucket, None)?;
            u.add_grad(chunk);
            return Ok(());
        }
        let flat = u.shard.grads_flat(&grads, u.comm.size());
        drop(grads);
        let pending = start(u.comm.as_ref(), u.shard.scatter_host(flat, bucket, codec));
        self.flight.scatters.push_back((unit, device, pending));
        while self.flight.scatters.len() > COLLECTIVES_IN_FLIGHT {
            self.finish_scatter()?;
        }
        Ok(())
    }
}
