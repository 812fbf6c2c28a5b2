//! Every schedule as data: order, dependencies, activation bounds and bubbles against the
//! closed forms.

use super::*;

/// The grid of the issue: P ∈ {2, 4}, m ∈ {P, 2P, 8}, V ∈ {1, 2} (V = 2 for interleaved).
fn grid() -> Vec<(ScheduleKind, usize, usize, usize)> {
    let mut g = vec![];
    for kind in ScheduleKind::ALL {
        for p in [2, 4] {
            for m in [p, 2 * p, 8] {
                let vs: &[usize] = if kind == ScheduleKind::Interleaved {
                    &[1, 2]
                } else {
                    &[1]
                };
                for &v in vs {
                    g.push((kind, p, m, v));
                }
            }
        }
    }
    g
}

/// Costs in units where a forward through one chunk is 1 (a stage's forward is V) and a
/// whole backward twice that; split, B and W take half the backward each.
fn unit(kind: ScheduleKind) -> impl Fn(Pass) -> u64 {
    move |pass| match (pass, kind.splits_backward()) {
        (Pass::F, _) => 1,
        (Pass::B, false) => 2,
        (Pass::B, true) | (Pass::W, _) => 1,
    }
}

#[test]
fn every_schedule_is_complete_ordered_and_runs() {
    for (kind, p, m, v) in grid() {
        let s = Schedule::build(kind, p, m, v).unwrap();
        let what = format!("{kind} P {p} m {m} V {v}");
        // Forward before backward before weight pass, per micro-batch and chunk, on its stage.
        for ops in &s.ops {
            let pos = |o: Op| ops.iter().position(|x| *x == o);
            for o in ops.iter().filter(|o| o.pass != Pass::F) {
                let before = Op {
                    pass: if o.pass == Pass::W { Pass::B } else { Pass::F },
                    ..*o
                };
                assert!(pos(before) < pos(*o), "{what}: {before:?} after {o:?}");
            }
        }
        // Every pass once, on its stage, and the cross-stage dependencies satisfiable.
        simulate(&s, unit(kind)).unwrap_or_else(|e| panic!("{what}: {e}"));
    }
}

/// Stage 0 holds at most the schedule's bound of micro-batches: 1F1B and ZB-H1 P, GPipe m,
/// interleaved Megatron's `2(P − 1) + (V − 1)P + 1` chunks' worth (m = P: all m·V).
#[test]
fn in_flight_activations_stay_within_the_bound() {
    for (kind, p, m, v) in grid() {
        let s = Schedule::build(kind, p, m, v).unwrap();
        let t = simulate(&s, unit(kind)).unwrap();
        let bound = match kind {
            ScheduleKind::GPipe => m,
            ScheduleKind::OneFOneB | ScheduleKind::ZeroBubble => p,
            ScheduleKind::Interleaved if m == p => m * v,
            ScheduleKind::Interleaved => 2 * (p - 1) + (v - 1) * p + 1,
        };
        assert_eq!(
            t.peak_in_flight[0],
            bound.min(m * v),
            "{kind} P {p} m {m} V {v}"
        );
        for (stage, &peak) in t.peak_in_flight.iter().enumerate() {
            assert!(
                peak <= t.peak_in_flight[0],
                "{kind} P {p} m {m}: stage {stage} holds {peak}"
            );
        }
    }
}

/// The idle time of a unit-cost run against the closed forms, idle / busy on every stage:
/// GPipe and 1F1B (P − 1)/m, interleaved (P − 1)/(m·V), ZB-H1 (P − 1)(F + B − W) idle, a
/// third of 1F1B's when F, B and W cost the same.
#[test]
fn bubbles_equal_the_closed_forms() {
    for (kind, p, m, v) in grid() {
        let s = Schedule::build(kind, p, m, v).unwrap();
        let t = simulate(&s, unit(kind)).unwrap();
        let what = format!("{kind} P {p} m {m} V {v}");
        // Busy: m micro-batches × V chunks × (F + B) = 3mV units on every stage.
        for stage in 0..p {
            assert_eq!(t.busy[stage], 3 * (m * v) as u64, "{what}");
            let want = match kind {
                // Idle / busy = (P − 1)/(m·V) (V = 1 but interleaved's: (P − 1)/m) of 3mV busy units.
                ScheduleKind::GPipe | ScheduleKind::OneFOneB | ScheduleKind::Interleaved => {
                    3 * (p as u64 - 1)
                }
                ScheduleKind::ZeroBubble => p as u64 - 1,
            };
            assert_eq!(t.idle(stage), want, "{what}: stage {stage}");
        }
    }
}

#[test]
fn impossible_layouts_are_refused_with_the_reason() {
    let err = |k, p, m, v| Schedule::build(k, p, m, v).unwrap_err().to_string();
    assert!(err(ScheduleKind::OneFOneB, 4, 3, 1).contains("at least 4 micro-batches"));
    assert!(err(ScheduleKind::Interleaved, 4, 6, 2).contains("not a multiple of 4"));
    assert!(err(ScheduleKind::OneFOneB, 2, 4, 2).contains("needs --pp-schedule interleaved"));
    assert!(err(ScheduleKind::GPipe, 0, 4, 1).contains("at least 1"));
    // Absurd sizes are refused before any list is built (and without overflowing).
    assert!(err(ScheduleKind::Interleaved, 2, 2, 1 << 40).contains("passes per step"));
    assert!(err(ScheduleKind::GPipe, usize::MAX, 1, 1).contains("passes per step"));
    assert!(err(ScheduleKind::OneFOneB, 4, 1 << 24, 1).contains("passes per step"));
    assert!(
        Schedule::build(ScheduleKind::GPipe, 4, 2, 1).is_ok(),
        "GPipe runs any m"
    );
    assert!("2f2b"
        .parse::<ScheduleKind>()
        .unwrap_err()
        .to_string()
        .contains("expected one of"));
}

/// A schedule whose orders deadlock, a missing pass and a repeated one are caught.
#[test]
fn the_simulation_catches_broken_schedules() {
    let mut s = Schedule::build(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
    // Stage 1 runs micro-batch 1's backward before its forward of micro-batch 0.
    s.ops[1].swap(0, 3);
    assert!(simulate(&s, |_| 1)
        .unwrap_err()
        .to_string()
        .contains("deadlocks"));
    let mut s = Schedule::build(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
    s.ops[0].pop();
    assert!(simulate(&s, |_| 1)
        .unwrap_err()
        .to_string()
        .contains("needed"));
    let mut s = Schedule::build(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
    let first = s.ops[0][0];
    s.ops[0].push(first);
    assert!(simulate(&s, |_| 1)
        .unwrap_err()
        .to_string()
        .contains("twice"));
}
