//! Tensor parallelism with ZeRO-2 and ZeRO-3 (issue 41): each TP rank's slices sharded over its
//! own data group (DP × CP × SP), as Megatron-DeepSpeed runs them. Every layout gives the
//! one-rank run on threads (losses, validation losses and gradient norms over 8 steps within
//! 1e-5 relative, and the final checkpoint), with rotary, ALiBi and learned positions, with
//! activation checkpointing; its checkpoints resume on other layouts and the reverse.

mod curves;

use curves::{grid, layouts_match_one_rank, resumes_match_one_rank, tiny};
use genslm::config::Position;
use genslm::parallel::Degrees;

/// `--tp 2 --zero 3 --dp 2` and `--tp 2 --zero 2 --sp 2` (the two), ZeRO-3 with
/// checkpointed activations, ZeRO-2 over DP, and ZeRO-3 over a CP ring.
#[test]
fn tp_with_zero2_and_zero3_matches_one_rank_with_rotary() {
    layouts_match_one_rank(
        &tiny(Position::Rotary, 32),
        &[
            (grid(2, 1, 1, 2), 3, false),
            (grid(1, 1, 2, 2), 2, false),
            (grid(2, 1, 1, 2), 3, true),
            (grid(2, 1, 1, 2), 2, false),
            (grid(1, 2, 1, 2), 3, false),
        ],
    );
}

/// Learned positions under SP put the table's rows in their own unit, sharded over DP only;
/// ALiBi has no position parameters at all.
#[test]
fn tp_with_zero_matches_one_rank_with_alibi_and_learned_positions() {
    for pos in [Position::Alibi, Position::Learned] {
        layouts_match_one_rank(
            &tiny(pos, 32),
            &[(grid(1, 1, 2, 2), 3, false), (grid(2, 1, 1, 2), 2, true)],
        );
    }
}

/// A TP 2 × DP 2 ZeRO-3 run resumes on one rank and under TP 2 × SP 2 ZeRO-2; a one-rank run
/// resumes under TP 2 × DP 2 ZeRO-3: the checkpoint (weights and the sharded moments) does not
/// depend on the layout.
#[test]
fn tp_zero_checkpoints_resume_on_other_layouts() {
    let mut cfg = tiny(Position::Learned, 32);
    cfg.train.zero = 3;
    let single = Degrees::new(1, 1, 1);
    resumes_match_one_rank(
        &cfg,
        &[
            ("tp2dp2z3-to-1", grid(2, 1, 1, 2), single),
            ("1-to-tp2dp2z3", single, grid(2, 1, 1, 2)),
        ],
    );
    cfg.train.zero = 2;
    resumes_match_one_rank(
        &cfg,
        &[("tp2dp2z2-to-tp2sp2z2", grid(2, 1, 1, 2), grid(1, 1, 2, 2))],
    );
}
