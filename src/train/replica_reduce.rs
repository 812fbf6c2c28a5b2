//! A whole replica per rank (ZeRO-0/1) trained layer by layer, so that each unit's gradient
//! reduction starts as soon as the backward has it and travels while the layers below compute
//! (issue 42; DeepSpeed's `overlap_comm` for the data-parallel all-reduce).
//!
//! Every micro-batch runs through the layer-wise executor ([`crate::train::layerwise`]), with
//! or without activation checkpointing; its gradients are added into one slot per parameter.
//! During the step's last micro-batch each unit's slots are complete when the executor hands
//! them over, so their all-reduce is started then (over the data group; the SP-split position
//! table's over the DP group, as `shard::reduce_gradients` does), bucketed as ever. The
//! reductions are waited for after the backward, at most [`REDUCTIONS_IN_FLIGHT`] at a time
//! before that. ZeRO-1 then takes its chunk of the summed gradients without a reduce-scatter
//! (DeepSpeed's stage 1 all-reduces the gradients too; the moments alone are sharded).
//!
//! With `--quantize-grads` each unit's sum is `parallel::quant`'s all-reduce (a quantized
//! all-to-all reduce-scatter, then a quantized all-gather of the sums).
//!
//! With `--no-overlap` the same reductions run in the same order, blocking, so both give the
//! same bits; against the whole-graph backward of a single rank they agree up to rounding.

use burn::tensor::{Device, Tensor};

use crate::data::loader::Batch;
use crate::error::Result;
use crate::model::GenSlm;
use crate::ops::primitive::{host_to_param, tensor_to_vec};
use crate::parallel::progress::{start, Pending};
use crate::parallel::quant::all_reduce_host;
use crate::parallel::ranks::Ranks;
use crate::train::layerwise::{loss_and_grads, Keep, Unit, UnitWeights};
use crate::train::recompute::add_into;
use crate::train::shard::{local_batch, param_groups};
use crate::train::step::{every_gradient, no_gradient, require_micro_batches};

/// Unit reductions started and not yet waited for, beyond which the backward waits for the
/// oldest (each holds a host copy of its unit's gradients).
pub const REDUCTIONS_IN_FLIGHT: usize = 4;

/// Whether a replica on these ranks reduces its gradients layer by layer: gradients must cross
/// ranks (the DP group is part of the data group) through host buffers (NCCL's device path
/// reduces the whole step at once, unless the gradients travel quantized, which is done on
/// the host).
pub fn reduces_by_unit(model: &GenSlm, ranks: &Ranks) -> bool {
    let device = model.device.clone().without_autodiff();
    let host = !ranks.data.on_device(&device) && !ranks.dp.on_device(&device);
    ranks.data.size() > 1 && (host || ranks.quantize.grads.is_some())
}

/// A started all-reduce: the parameters it sums, their device, and the sums (host).
type Started = (Vec<usize>, Device, Pending<Vec<Vec<f32>>>);

struct Reducing<'a> {
    model: &'a GenSlm,
    ranks: &'a Ranks,
    /// The SP-split position table's index (its gradient sums over DP only).
    pos_shard: Option<usize>,
    acc: Vec<Option<Tensor<1>>>,
    /// Whether the micro-batch running is the step's last (its hand-overs complete a unit).
    last: bool,
    started: std::collections::VecDeque<Started>,
}

impl Reducing<'_> {
    /// Waits for the oldest started reduction and puts its sums into the slots.
    fn finish_one(&mut self) -> Result<()> {
        let Some((idx, device, pending)) = self.started.pop_front() else {
            return Ok(());
        };
        for (i, v) in idx.into_iter().zip(pending.wait()?) {
            self.acc[i] = Some(host_to_param(v, &device));
        }
        Ok(())
    }
}

impl UnitWeights for Reducing<'_> {
    fn model(&mut self, _units: &[Unit]) -> Result<GenSlm> {
        Ok(self.model.clone())
    }

    fn take_grads(&mut self, unit: Unit, grads: Vec<Tensor<1>>) -> Result<()> {
        let idx = unit.params(&self.model.layout);
        let device = grads.first().map(Tensor::device);
        for (&i, g) in idx.iter().zip(grads) {
            add_into(&mut self.acc[i], g);
        }
        let Some(device) = device.filter(|_| self.last) else {
            return Ok(());
        };
        let (pos, rest): (Vec<usize>, Vec<usize>) =
            idx.into_iter().partition(|&i| Some(i) == self.pos_shard);
        for (idx, comm) in [(rest, &self.ranks.data), (pos, &self.ranks.dp)] {
            if idx.is_empty() || comm.size() == 1 {
                continue;
            }
            let mut host = Vec::with_capacity(idx.len());
            for &i in &idx {
                let g = self.acc[i]
                    .as_ref()
                    .ok_or_else(|| no_gradient(self.model, i))?;
                host.push(tensor_to_vec(g));
            }
            let (bucket, codec) = (self.ranks.bucket, self.ranks.quantize.grads);
            let pending = start(comm.as_ref(), move |c| {
                let mut host = host;
                all_reduce_host(c, &mut host, codec, bucket)?;
                Ok(host)
            });
            self.started.push_back((idx, device.clone(), pending));
            while self.started.len() > REDUCTIONS_IN_FLIGHT {
                self.finish_one()?;
            }
        }
        Ok(())
    }
}

/// This rank's share of the step's loss over `batches` and the step's gradients already
/// summed over the ranks (see `shard::reduce_gradients`), each unit's sum started as soon as
/// the last micro-batch's backward has it.
pub fn reduced_loss_and_grads(
    model: &GenSlm,
    batches: &[Batch],
    total_targets: usize,
    ranks: &Ranks,
    keep: Keep,
) -> Result<(f64, Vec<Tensor<1>>)> {
    require_micro_batches(batches)?;
    let denom = total_targets.max(1) as f64;
    let layout = model.layout.clone();
    let (_, sharded) = param_groups(model);
    let mut w = Reducing {
        model,
        ranks,
        pos_shard: sharded.first().copied(),
        acc: vec![None; model.params.len()],
        last: false,
        started: Default::default(),
    };
    let mut loss = 0.0;
    for (k, b) in batches.iter().enumerate() {
        w.last = k + 1 == batches.len();
        let lb = local_batch(b, ranks);
        loss += loss_and_grads(&mut w, &layout, &lb, denom, keep)?;
    }
    while !w.started.is_empty() {
        w.finish_one()?;
    }
    Ok((loss, every_gradient(model, w.acc)?))
}
