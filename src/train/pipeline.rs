//! One pipeline stage's share of a step: its passes of a [`Schedule`] over the micro-batches,
//! run on this rank's chunks of layers (issue 40).
//!
//! A chunk's forward takes the previous chunk's output (chunk 0: the embeddings of the
//! tokens), runs its layers and hands the output to the next chunk's stage; the last chunk
//! computes the loss. A chunk's backward takes the gradient of its output from the next
//! chunk's stage, applies it through the surrogate `Σ out ⊙ g` (whose gradient with respect
//! to `out` is exactly `g`, as in [`crate::train::layerwise`]) and sends the gradient of its
//! input back. By the chain rule the stages' parameter gradients are those of one rank's
//! whole-graph backward, up to float rounding (tests/parallel_pipeline.rs).
//!
//! Each (micro-batch, chunk) keeps its autodiff graph from its F to its B, or with
//! `checkpoint` only its input, the chunk's forward recomputed in B: the schedule decides how
//! many are alive at once (1F1B: at most P on stage 0).
//!
//! ZB splits the backward into B (input gradient, which the previous stage waits for) and W
//! (weight gradient). The chunk runs on a model whose linear layers defer their weight
//! products (`GenSlm::deferring_weight_grads`): B's backward computes the input gradients (and
//! the small LayerNorm, bias and embedding gradients) and sends the chunk's input gradient at
//! once, while the four products `dW = xᵀ·dy` per layer — half a layer's backward — wait in
//! the pass's [`WeightGrads`] until W runs them and adds them into the step's gradients.

use std::borrow::Cow;
use std::collections::HashMap;
use std::time::{Duration, Instant};

use burn::tensor::{Gradients, Tensor, TensorData};

use crate::config::Config;
use crate::error::{Error, Result};
use crate::model::cache::Past;
use crate::model::params::Layout;
use crate::model::GenSlm;
use crate::ops::linear::WeightGrads;
use crate::ops::primitive::{host_to_param, tensor_to_vec, tokens_tensor};
use crate::parallel::comm::Communicator;
use crate::parallel::pipeline::cut_and_schedule;
use crate::parallel::pipeline::mailroom::{Mailroom, Msg};
use crate::parallel::pipeline::schedule::{Op, Pass, Schedule};
use crate::parallel::pipeline::stages::Stages;
use crate::parallel::ranks::Ranks;
use crate::train::layerwise::{embed_units, Unit};
use crate::train::metrics::peak_rss_mib;
use crate::train::recompute::{accumulate, add_into};
use crate::train::shard::{local_nll, LocalBatch};

/// A run's pipeline: the schedule of a step and the cut of the layers into chunks.
#[derive(Debug, Clone)]
pub struct Pipe {
    pub schedule: Schedule,
    pub stages: Stages,
}

impl Pipe {
    /// The pipeline of a run with `pp` stages under `cfg` (`None` for one stage), or why the
    /// settings cannot run: too few micro-batches for the schedule, more chunks than layers,
    /// `pp_layers` that do not fit the model.
    pub fn plan(cfg: &Config, pp: usize) -> Result<Option<Self>> {
        if pp <= 1 {
            return Ok(None);
        }
        let t = &cfg.train;
        let (schedule, stages) = cut_and_schedule(
            cfg.model.num_layers,
            t.pp_layers.as_deref(),
            t.pp_schedule,
            pp,
            t.grad_accum,
            t.pp_virtual,
        )?;
        Ok(Some(Self { schedule, stages }))
    }

    /// Indices of the parameters stage `stage` holds (in a model of `layout`).
    pub fn params_of(&self, layout: &Layout, stage: usize) -> Vec<usize> {
        stage_units(&self.stages, layout, stage)
            .into_iter()
            .flat_map(|u| u.params(layout))
            .collect()
    }
}

/// How a step runs through the pipeline.
#[derive(Debug, Clone, Copy)]
pub struct Pipeline<'a> {
    pub schedule: &'a Schedule,
    pub stages: &'a Stages,
    /// The pipeline group: member `s` runs stage `s`.
    pub comm: &'a dyn Communicator,
    /// Full activation checkpointing: keep each chunk's input only, recompute in B.
    pub checkpoint: bool,
}

/// The parameter units stage `stage` holds: its chunks' layers, the embeddings with chunk 0
/// and the head with the last chunk.
pub fn stage_units(stages: &Stages, layout: &Layout, stage: usize) -> Vec<Unit> {
    let mut units = Vec::new();
    for c in stages.chunks_of(stage) {
        if c == 0 {
            units.extend(embed_units(layout));
        }
        units.extend(stages.layers(c).map(Unit::Layer));
        if stages.is_last(c) {
            units.push(Unit::Head);
        }
    }
    units
}

/// What a chunk's forward produced.
#[derive(Clone)]
enum Out {
    /// The output activation (`[rows, cols, hidden]`, compute dtype).
    Hidden(Tensor<3>),
    /// The last chunk: this micro-batch's loss term `Σ nll / denom`.
    Loss(Tensor<1>),
}

/// A chunk's forward kept for its backward (a few handles; boxing would only add an
/// allocation per pass).
#[allow(clippy::large_enum_variant)]
enum Kept {
    /// The graph: the input leaf (fp32; none on chunk 0, whose input is the tokens), the
    /// output, and where its linear layers leave their weight gradients (split backward).
    Graph(Option<Tensor<3>>, Out, Option<WeightGrads>),
    /// Checkpointing: the input's values only.
    Input(Option<Vec<f32>>),
}

/// What a stage's step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageStep {
    /// The step's loss `Σ nll / denom` over every micro-batch (the same on every stage).
    pub loss: f64,
    /// Seconds this stage computed (its passes, the messages' copies included).
    pub busy_s: f64,
    /// Seconds it waited: for its neighbours' messages, and at the end for the last stage
    /// (the loss's reduction, which every stage leaves together).
    pub idle_s: f64,
}

/// Every stage's busy and idle seconds in one step, in stage order (the pipeline group's).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StageTimes {
    pub busy_s: Vec<f64>,
    pub idle_s: Vec<f64>,
    /// Each stage's process peak resident memory so far (MiB; under mpirun, one process per
    /// stage rank: the per-stage peaks `genslm plan --pp` predicts).
    pub peak_rss_mib: Vec<f64>,
}

impl StageTimes {
    /// Gathers `step`'s times from every stage of `comm` (a collective of the group).
    pub fn gather(step: &StageStep, comm: &dyn Communicator) -> Result<Self> {
        let (n, r) = (comm.size(), comm.rank());
        let mut buf = vec![0.0f64; 3 * n];
        (buf[r], buf[n + r], buf[2 * n + r]) = (step.busy_s, step.idle_s, peak_rss_mib());
        comm.all_reduce_sum_f64(&mut buf)?;
        let peak_rss_mib = buf.split_off(2 * n);
        let idle_s = buf.split_off(n);
        Ok(Self {
            busy_s: buf,
            idle_s,
            peak_rss_mib,
        })
    }

    /// The measured bubble: idle over busy, summed over the stages (the schedules' closed
    /// forms: (P − 1)/m for 1F1B and GPipe, (P − 1)/(m·V) interleaved).
    pub fn bubble(&self) -> f64 {
        let busy: f64 = self.busy_s.iter().sum();
        self.idle_s.iter().sum::<f64>() / busy.max(f64::MIN_POSITIVE)
    }
}

/// This stage's passes of one step over `micro` (this rank's slices of the micro-batches, in
/// order). Parameter gradients of the stage's units are added into `acc` (one slot per
/// parameter of `model`). `model`'s parameters of this stage's units must be autodiff leaves
/// that require gradients; the others are never read.
pub fn stage_loss_and_grads(
    p: &Pipeline<'_>,
    model: &GenSlm,
    micro: &[LocalBatch],
    denom: f64,
    acc: &mut [Option<Tensor<1>>],
) -> Result<StageStep> {
    let start = Instant::now();
    let (sched, stages) = (p.schedule, p.stages);
    if micro.len() != sched.micros {
        return Err(Error::Invalid(format!(
            "a pipeline schedule of {} micro-batches run on {}",
            sched.micros,
            micro.len()
        )));
    }
    let layers = stages.layers(stages.chunks() - 1).end;
    if stages.chunks() != sched.chunks() || layers != model.layout.layers.len() {
        return Err(Error::Invalid(format!(
            "pipeline chunks: {} chunks of {layers} layers for a schedule of {} chunks and a model \
             of {} layers",
            stages.chunks(),
            sched.chunks(),
            model.layout.layers.len()
        )));
    }
    let me = p.comm.rank();
    let len = |m: Msg| activation_shape(&micro[m.micro()], model).iter().product();
    let mut run = Run {
        p,
        model,
        micro,
        denom,
        mail: Mailroom::new(p.comm, sched)?,
        kept: HashMap::new(),
        weight_grads: HashMap::new(),
        loss: 0.0,
        waited: Duration::ZERO,
    };
    for &op in &sched.ops[me] {
        match op.pass {
            Pass::F => run.forward(op, &len)?,
            Pass::B => run.backward(op, &len, acc)?,
            Pass::W => {
                let (grads, deferred) =
                    run.weight_grads
                        .remove(&(op.micro, op.chunk))
                        .ok_or_else(|| {
                            Error::Invalid(format!("pipeline: {op:?} before its input gradient"))
                        })?;
                accumulate(model, &grads, acc);
                for (i, dw) in deferred.take() {
                    let n: usize = dw.dims().iter().product();
                    add_into(&mut acc[i], model.full(dw).reshape([n]));
                }
            }
        }
    }
    if !run.mail.is_done() || !run.kept.is_empty() || !run.weight_grads.is_empty() {
        return Err(Error::Invalid(format!(
            "pipeline stage {me}: the step ended with passes or messages left over"
        )));
    }
    // The loss lives on the last stage; every stage reports the step's.
    let mut loss = [run.loss];
    let reduce = Instant::now();
    p.comm.all_reduce_sum_f64(&mut loss)?;
    let idle = run.waited + reduce.elapsed();
    Ok(StageStep {
        loss: loss[0],
        busy_s: start.elapsed().saturating_sub(idle).as_secs_f64(),
        idle_s: idle.as_secs_f64(),
    })
}

/// One step's state on a stage.
struct Run<'a, 'p> {
    p: &'a Pipeline<'p>,
    model: &'a GenSlm,
    micro: &'a [LocalBatch],
    denom: f64,
    mail: Mailroom<'p>,
    kept: HashMap<(usize, usize), Kept>,
    /// ZB: the parameter gradients B computed, and the weight products it left, waiting for W.
    weight_grads: HashMap<(usize, usize), (Gradients, WeightGrads)>,
    /// This stage's loss terms (non-zero on the last stage only).
    loss: f64,
    /// Time spent waiting for messages.
    waited: Duration,
}

impl Run<'_, '_> {
    /// Message `msg` from its sender, the wait counted as idle.
    fn take(&mut self, msg: Msg, len: &impl Fn(Msg) -> usize) -> Result<Vec<f32>> {
        let t = Instant::now();
        let data = self.mail.take(msg, msg.sender(self.p.schedule), len);
        self.waited += t.elapsed();
        data
    }

    /// Runs `chunk` of `model` on `input` (none: the tokens' embeddings).
    fn chunk(
        &self,
        model: &GenSlm,
        micro: usize,
        chunk: usize,
        input: Option<Tensor<3>>,
    ) -> Result<Out> {
        let lb = &self.micro[micro];
        run_chunk(model, self.p.stages, chunk, lb, input, self.denom)
    }

    fn leaf(&self, micro: usize, data: Vec<f32>, model: &GenSlm) -> Tensor<3> {
        activation(data, &self.micro[micro], model)
    }

    fn forward(&mut self, op: Op, len: &impl Fn(Msg) -> usize) -> Result<()> {
        let Op { micro, chunk, .. } = op;
        let input = if chunk == 0 {
            None
        } else {
            Some(self.take(Msg::Activation { micro, chunk }, len)?)
        };
        let (kept, out) = if self.p.checkpoint {
            let frozen = self.model.without_autodiff();
            let x = input.clone().map(|d| self.leaf(micro, d, &frozen));
            (Kept::Input(input), self.chunk(&frozen, micro, chunk, x)?)
        } else {
            let (model, sink) = self.graph_model();
            let leaf = input.map(|d| self.leaf(micro, d, &model).require_grad());
            let out = self.chunk(&model, micro, chunk, leaf.clone())?;
            (Kept::Graph(leaf, out.clone(), sink), out)
        };
        match out {
            Out::Hidden(x) => {
                if let Some((to, msg)) = Msg::sent_by(op, self.p.schedule) {
                    self.mail.post(to, msg, tensor_to_vec(&x))?;
                }
            }
            Out::Loss(l) => self.loss += tensor_to_vec(&l)[0] as f64,
        }
        self.kept.insert((micro, chunk), kept);
        Ok(())
    }

    fn backward(
        &mut self,
        op: Op,
        len: &impl Fn(Msg) -> usize,
        acc: &mut [Option<Tensor<1>>],
    ) -> Result<()> {
        let Op { micro, chunk, .. } = op;
        let (input, out, sink) = match self.kept.remove(&(micro, chunk)) {
            Some(Kept::Graph(input, out, sink)) => (input, out, sink),
            Some(Kept::Input(data)) => {
                let (model, sink) = self.graph_model();
                let leaf = data.map(|d| self.leaf(micro, d, &model).require_grad());
                let out = self.chunk(&model, micro, chunk, leaf.clone())?;
                (leaf, out, sink)
            }
            None => {
                return Err(Error::Invalid(format!(
                    "pipeline: {op:?} before its forward"
                )))
            }
        };
        crate::backend::sample_device_memory(&self.model.device);
        let mut grads = match out {
            Out::Loss(l) => l.backward(),
            Out::Hidden(out) => {
                let g = self.take(Msg::Gradient { micro, chunk }, len)?;
                let g = self.leaf(micro, g, self.model);
                (self.model.full(out) * g).sum().backward()
            }
        };
        if let Some(input) = input {
            let g = input.grad_remove(&mut grads).ok_or_else(|| {
                Error::Invalid(format!(
                    "pipeline: no gradient reached the input of chunk {chunk}"
                ))
            })?;
            if let Some((to, msg)) = Msg::sent_by(op, self.p.schedule) {
                self.mail.post(to, msg, tensor_to_vec(&g))?;
            }
        }
        match sink {
            Some(sink) => {
                self.weight_grads.insert((micro, chunk), (grads, sink));
            }
            None => accumulate(self.model, &grads, acc),
        }
        Ok(())
    }

    /// The model a pass records its graph on: the stage's own, or under a split backward one
    /// whose linear layers leave their weight products in the returned queue (shared
    /// parameters).
    fn graph_model(&self) -> (Cow<'_, GenSlm>, Option<WeightGrads>) {
        if !self.p.schedule.kind.splits_backward() {
            return (Cow::Borrowed(self.model), None);
        }
        let sink = WeightGrads::default();
        let model = self.model.deferring_weight_grads(sink.clone());
        (Cow::Owned(model), Some(sink))
    }
}

/// Σ nll of `lb` through the pipeline without autodiff (validation): every stage runs its
/// chunks in model order, the last one computes the loss. Returns this stage's share (non-zero
/// on the last stage only; the caller sums over the pipeline group). Every stage of the group
/// must call it with batches of the same shape.
pub fn stage_eval_nll(
    stages: &Stages,
    comm: &dyn Communicator,
    model: &GenSlm,
    lb: &LocalBatch,
) -> Result<f64> {
    let model = model.without_autodiff();
    let me = comm.rank();
    // The activation between two chunks held on this stage (one stage, several chunks).
    let mut local: Option<Tensor<3>> = None;
    for c in (0..stages.chunks()).filter(|&c| stages.stage_of(c) == me) {
        let input = if c == 0 {
            None
        } else if stages.stage_of(c - 1) == me {
            let x = local.take();
            Some(x.ok_or_else(|| Error::Invalid(format!("pipeline eval: no input for chunk {c}")))?)
        } else {
            let mut buf = vec![0.0; activation_shape(lb, &model).iter().product()];
            comm.recv(stages.stage_of(c - 1), &mut buf)?;
            Some(activation(buf, lb, &model))
        };
        match run_chunk(&model, stages, c, lb, input, 1.0)? {
            Out::Loss(nll) => return Ok(tensor_to_vec(&nll)[0] as f64),
            Out::Hidden(x) if stages.stage_of(c + 1) == me => local = Some(x),
            Out::Hidden(x) => comm.send(stages.stage_of(c + 1), &tensor_to_vec(&x))?,
        }
    }
    Ok(0.0)
}

/// Runs `chunk` of `model` on `lb`: from `input` (the previous chunk's activation, cast to
/// the compute dtype here) or, on chunk 0, the tokens' embeddings; the last chunk ends in the
/// loss term `Σ nll / denom`.
fn run_chunk(
    model: &GenSlm,
    stages: &Stages,
    chunk: usize,
    lb: &LocalBatch,
    input: Option<Tensor<3>>,
    denom: f64,
) -> Result<Out> {
    let ctx = model.layer_context_at(&lb.positions);
    let mut x = match input {
        Some(x) => model.compute(x),
        None => model.embed_at(
            tokens_tensor(&lb.tokens, lb.rows, lb.cols, &model.device),
            &lb.positions,
        )?,
    };
    for li in stages.layers(chunk) {
        x = model.layer(li, x, &ctx, Past::None).0;
    }
    if !stages.is_last(chunk) {
        return Ok(Out::Hidden(x));
    }
    let logits = model.logits(model.final_norm(x));
    Ok(Out::Loss(local_nll(model, logits, lb) / denom))
}

/// A received activation (or gradient) of `lb`'s shape between layers, `[rows, cols, hidden]`
/// (under Megatron SP this rank's part of the columns), on `model`'s device, in fp32.
fn activation(data: Vec<f32>, lb: &LocalBatch, model: &GenSlm) -> Tensor<3> {
    Tensor::from_data(
        TensorData::new(data, activation_shape(lb, model)),
        &model.device,
    )
}

/// `[rows, cols, hidden]` of `lb`'s activations between layers (under Megatron SP this rank's
/// part of the columns).
fn activation_shape(lb: &LocalBatch, model: &GenSlm) -> [usize; 3] {
    [lb.rows, model.region_cols(lb.cols).1, model.cfg.hidden_size]
}

/// Every stage's parameters in stage 0's model, for a checkpoint: called by each stage's
/// leading rank (DP, CP and SP rank 0), which sends its own parameters to the stage-0 rank of
/// its pipeline group (under TP, each TP rank its slices). Returns the filled model on stage
/// 0, `None` on the others. Lengths come from the layout (the same on every stage).
pub fn gather_stages(pipe: &Pipe, mut model: GenSlm, ranks: &Ranks) -> Result<Option<GenSlm>> {
    let comm = ranks.pp.as_ref();
    let me = comm.rank();
    if me != 0 {
        for i in pipe.params_of(&model.layout, me) {
            comm.send(0, &tensor_to_vec(&model.params[i]))?;
        }
        return Ok(None);
    }
    for s in 1..comm.size() {
        for i in pipe.params_of(&model.layout, s) {
            let mut buf = vec![0.0; model.layout.specs[i].shape.iter().product()];
            comm.recv(s, &mut buf)?;
            model.params[i] = host_to_param(buf, &model.params[i].device());
        }
    }
    Ok(Some(model))
}
