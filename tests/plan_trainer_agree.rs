//! The planner never proposes a layout the trainer refuses (issue 41): for every preset in
//! configs/, every world of 1 to 16 ranks, GPUs and CPU processes, with and without activation
//! checkpointing and for each pipeline schedule, every layout `genslm plan` evaluates (not only
//! the one it recommends) passes the trainer's own layout validation on every rank, at the
//! sequence length the planner gives for it. The two drifted apart once (the search proposed
//! TP with ZeRO-2/3, which the trainer refused); this keeps them together.

use std::path::Path;

use genslm::config::Config;
use genslm::parallel::pipeline::schedule::ScheduleKind;
use genslm::parallel::topology::Topology;
use genslm::plan::request::{PlanDevice, PlanRequest};
use genslm::plan::search::{best_of, evaluate, layouts};
use genslm::train::setup::validate_layout;

fn request(
    config: &Path,
    gpus: usize,
    device: PlanDevice,
    ckpt: bool,
    schedule: ScheduleKind,
) -> PlanRequest {
    PlanRequest {
        config: Some(config.to_path_buf()),
        gpus: Some(gpus),
        gpu_mem_gib: Some(40.0),
        sp: None,
        tp: None,
        cp: None,
        dp: None,
        pp: None,
        pp_schedule: schedule,
        pp_virtual: if schedule == ScheduleKind::Interleaved {
            2
        } else {
            1
        },
        pp_layers: None,
        grad_accum: None,
        zero: None,
        attention: None,
        positions: None,
        shard_positions: true,
        checkpoint_activations: ckpt,
        offload: genslm::config::Offload::None,
        megatron_sp: true,
        precision: None,
        batch_size: 1,
        seq_len: None,
        device,
        gpus_per_node: 8,
        host_mem_gib: None,
        sweep: false,
        json: false,
        compare_published: false,
    }
}

#[test]
fn every_layout_the_planner_evaluates_is_one_the_trainer_runs() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    let mut presets: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    presets.sort();
    assert!(presets.len() >= 7, "presets found: {presets:?}");
    let (mut checked, mut recommended) = (0usize, 0usize);
    let mut with_tp_zero23 = 0usize;
    for path in &presets {
        let cfg = Config::load(path).unwrap();
        for gpus in 1..=16 {
            for device in [PlanDevice::Gpu, PlanDevice::Cpu] {
                for ckpt in [false, true] {
                    for schedule in [ScheduleKind::OneFOneB, ScheduleKind::Interleaved] {
                        let req = request(path, gpus, device, ckpt, schedule);
                        // A world no layout of this model fits (heads) is refused by name.
                        let Ok(found) = layouts(&cfg.model, &req, gpus) else {
                            continue;
                        };
                        let cands = evaluate(&cfg.model, &req, 40.0 * 1073741824.0, found);
                        let best = best_of(cands.clone()).map(|c| c.strategy.layout);
                        for c in &cands {
                            // A layout that fits no sequence at all (0) has nothing to run (plan
                            // says so); the trainer refuses a window shorter than its pieces.
                            if c.max_seq_len == 0 {
                                continue;
                            }
                            let l = c.strategy.layout;
                            let mut run = cfg.clone();
                            run.train.zero = l.zero;
                            run.train.checkpoint_activations = ckpt;
                            run.train.batch_size = req.batch_size * l.dp;
                            run.train.seq_len = c.max_seq_len;
                            if l.pp > 1 {
                                run.train.grad_accum = l.pipeline.micro_batches;
                                run.train.pp_schedule = l.pipeline.schedule;
                                run.train.pp_virtual = l.pipeline.virtual_stages;
                            }
                            for rank in 0..l.degrees.world() {
                                let topo = Topology::of(rank, l.degrees).unwrap();
                                if let Err(e) = validate_layout(&run, &topo) {
                                    panic!(
                                        "{} on {gpus} {device:?} ranks (ckpt {ckpt}, {schedule:?}): \
                                         the planner evaluates {:?} zero {} at seq {} but the \
                                         trainer refuses it on rank {rank}: {e}",
                                        path.display(),
                                        l.degrees,
                                        l.zero,
                                        c.max_seq_len
                                    );
                                }
                            }
                            checked += 1;
                            recommended += usize::from(best == Some(l));
                            with_tp_zero23 += usize::from(l.tp > 1 && l.zero >= 2);
                        }
                    }
                }
            }
        }
    }
    // The search did reach the layouts this guards: many of them, TP with ZeRO-2/3 among them.
    assert!(
        checked > 1000 && recommended > 100,
        "{checked} layouts, {recommended} recommended"
    );
    assert!(
        with_tp_zero23 > 100,
        "{with_tp_zero23} TP × ZeRO-2/3 layouts"
    );
}
