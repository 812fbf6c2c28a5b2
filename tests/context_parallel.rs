//! Context parallelism (ring attention, zigzag chunks), alone and with Ulysses, DP and ZeRO on
//! top, gives the one-rank run on threads: losses, validation losses and gradient norms over 8
//! optimizer steps (≤ 1e-5 relative) and the final checkpoint, for rotary, ALiBi and learned
//! positions; and sequence lengths that no degree divides train exactly (padded, masked).

mod curves;

use curves::{layouts_match_one_rank, tiny};
use genslm::config::{Config, Position};
use genslm::parallel::Degrees;

/// `(dp, cp, sp, zero, checkpoint_activations)`.
type Layout = (usize, usize, usize, u8, bool);

fn run_layouts(pos: Position, seq: usize, layouts: &[Layout]) {
    run_config(tiny(pos, seq), layouts)
}

fn run_config(cfg: Config, layouts: &[Layout]) {
    let grid: Vec<_> = layouts
        .iter()
        .map(|&(dp, cp, sp, zero, ckpt)| (Degrees::new(dp, cp, sp), zero, ckpt))
        .collect();
    layouts_match_one_rank(&cfg, &grid)
}

#[test]
fn ring_matches_one_rank_with_rotary() {
    run_layouts(
        Position::Rotary,
        32,
        &[
            (1, 2, 1, 0, false),
            (1, 4, 1, 0, false),
            (1, 2, 2, 0, false),
            (2, 2, 1, 1, false),
            (1, 2, 2, 3, true),
        ],
    );
}

#[test]
fn ring_matches_one_rank_with_alibi_and_learned_positions() {
    for pos in [Position::Alibi, Position::Learned] {
        run_layouts(
            pos,
            32,
            &[(1, 2, 1, 0, false), (1, 4, 1, 0, true), (1, 2, 2, 0, false)],
        );
    }
}

/// 37 tokens divide by no degree: every layout pads the sequence's end to its pieces (SP 2:
/// 38; CP 2: 40; SP 3: 39; SP 2 × CP 2: 40) and masks the padding out of the loss.
#[test]
fn lengths_no_degree_divides_train_exactly() {
    for pos in [Position::Rotary, Position::Alibi, Position::Learned] {
        run_layouts(
            pos,
            37,
            &[
                (1, 1, 2, 0, false),
                (1, 2, 1, 0, false),
                (1, 2, 2, 1, false),
            ],
        );
    }
}

/// 3 heads on SP 2: Ulysses pads to 4 heads (one empty) so each rank takes 2; with CP too.
#[test]
fn head_counts_sp_does_not_divide_train_exactly() {
    for pos in [Position::Rotary, Position::Alibi] {
        let mut cfg = tiny(pos, 32);
        cfg.model.hidden_size = 48;
        cfg.model.num_heads = 3;
        cfg.model.intermediate_size = 192;
        run_config(
            cfg,
            &[(1, 1, 2, 0, false), (1, 2, 2, 0, false), (2, 1, 2, 3, true)],
        );
    }
}
