//! The DP × PP × CP × SP × TP grid and the groups it names (docs/ARCHITECTURE.md §5).
//!
//! rank = (((dp_rank · pp + pp_rank) · cp + cp_rank) · sp + sp_rank) · tp + tp_rank: TP groups
//! are contiguous ranks (tensor parallelism all-reduces twice per layer, so it stays inside a
//! node), SP groups stride by `tp` (Ulysses' all-to-all, next closest), CP groups by `sp · tp`
//! (the ring crosses nodes), pipeline stages by `cp · sp · tp` (one activation per micro-batch
//! between neighbours: little traffic, fine across nodes), DP replicas by `pp · cp · sp · tp`
//! (Megatron-Core's `tp-cp-pp-dp` order; its default puts PP outermost instead). Every group but TP's joins ranks of one TP rank: they hold the same
//! slices of the weights; every group but PP's joins ranks of one stage. One sequence is held by the `cp · sp` ranks of a *sequence
//! group*: CP splits it into `2·cp` chunks and gives CP rank c chunks c and 2·cp−1−c (zigzag:
//! equal causal work on every rank), SP then splits that rank's tokens contiguously.

use crate::error::{Error, Result};
pub use crate::model::position::Span;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Topology {
    pub world: usize,
    pub rank: usize,
    /// Data-parallel degree.
    pub dp: usize,
    /// Sequence-parallel (Ulysses) degree.
    pub sp: usize,
    /// Context-parallel (ring) degree.
    pub cp: usize,
    /// Tensor-parallel (Megatron) degree.
    pub tp: usize,
    /// Pipeline stages.
    pub pp: usize,
}

/// The degrees of a layout, as the command line gives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Degrees {
    pub dp: usize,
    pub cp: usize,
    pub sp: usize,
    pub tp: usize,
    /// Pipeline stages (1: no pipeline).
    pub pp: usize,
}

impl Degrees {
    /// DP × CP × SP without tensor or pipeline parallelism.
    pub fn new(dp: usize, cp: usize, sp: usize) -> Self {
        Self {
            dp,
            cp,
            sp,
            tp: 1,
            pp: 1,
        }
    }

    /// Ranks in the layout.
    pub fn world(&self) -> usize {
        self.dp * self.pp * self.cp * self.sp * self.tp
    }

    /// The pieces each sequence is cut into: SP, and 2·CP zigzag chunks each cut over SP, each
    /// cut again over TP (Megatron sequence parallelism). Saturating: degrees near usize::MAX,
    /// each of which alone fits the world, overflowed the product.
    pub fn pieces(&self) -> usize {
        let chunks = if self.cp > 1 {
            self.cp.saturating_mul(2)
        } else {
            1
        };
        self.tp.saturating_mul(self.sp).saturating_mul(chunks)
    }
}

impl Topology {
    /// A DP × CP × SP grid (TP = 1).
    pub fn grid(rank: usize, dp: usize, cp: usize, sp: usize) -> Result<Self> {
        Self::of(rank, Degrees::new(dp, cp, sp))
    }

    /// Rank `rank` of the grid `d`.
    pub fn of(rank: usize, d: Degrees) -> Result<Self> {
        let Degrees { dp, cp, sp, tp, pp } = d;
        if dp == 0 || sp == 0 || cp == 0 || tp == 0 || pp == 0 {
            return Err(Error::Invalid(format!(
                "--dp {dp} --pp {pp} --cp {cp} --sp {sp} --tp {tp}: degrees must be positive"
            )));
        }
        let world = dp
            .checked_mul(sp)
            .and_then(|n| n.checked_mul(cp))
            .and_then(|n| n.checked_mul(tp))
            .and_then(|n| n.checked_mul(pp))
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "--dp {dp} × --pp {pp} × --cp {cp} × --sp {sp} × --tp {tp} overflow"
                ))
            })?;
        if rank >= world {
            return Err(Error::Invalid(format!(
                "rank {rank} outside a world of {world}"
            )));
        }
        Ok(Self {
            world,
            rank,
            dp,
            sp,
            cp,
            tp,
            pp,
        })
    }

    /// The degrees of this grid.
    pub fn degrees(&self) -> Degrees {
        Degrees {
            dp: self.dp,
            cp: self.cp,
            sp: self.sp,
            tp: self.tp,
            pp: self.pp,
        }
    }

    pub fn single() -> Self {
        Self::of(0, Degrees::new(1, 1, 1)).expect("the 1×1×1 grid")
    }

    pub fn tp_rank(&self) -> usize {
        self.rank % self.tp
    }

    pub fn sp_rank(&self) -> usize {
        (self.rank / self.tp) % self.sp
    }

    pub fn cp_rank(&self) -> usize {
        (self.rank / (self.tp * self.sp)) % self.cp
    }

    pub fn pp_rank(&self) -> usize {
        (self.rank / (self.tp * self.sp * self.cp)) % self.pp
    }

    pub fn dp_rank(&self) -> usize {
        self.rank / (self.tp * self.sp * self.cp * self.pp)
    }

    /// The world rank at these coordinates.
    fn at(&self, dp: usize, pp: usize, cp: usize, sp: usize, tp: usize) -> usize {
        (((dp * self.pp + pp) * self.cp + cp) * self.sp + sp) * self.tp + tp
    }

    /// Ranks that hold one sequence between them (CP × SP).
    pub fn seq_degree(&self) -> usize {
        self.sp * self.cp
    }

    /// Whether this rank is in world rank 0's TP group (DP, CP and SP rank 0): the ranks that
    /// gather a whole TP slice of the state for a checkpoint and hand it to rank 0.
    pub fn gathers_slices(&self) -> bool {
        self.rank < self.tp
    }

    /// Whether this rank is DP, CP and SP rank 0 of its stage: under PP, the ranks that move
    /// the stages' weights for a checkpoint (senders on the later stages, receivers on stage 0).
    pub fn leads_stage(&self) -> bool {
        self.dp_rank() == 0 && self.cp_rank() == 0 && self.sp_rank() == 0
    }

    /// World ranks of this rank's TP group (contiguous).
    pub fn tp_group(&self) -> Vec<usize> {
        let base = self.rank - self.tp_rank();
        (base..base + self.tp).collect()
    }

    /// World ranks of this rank's SP group (same TP rank, stride tp).
    pub fn sp_group(&self) -> Vec<usize> {
        let base = self.rank - self.sp_rank() * self.tp;
        (0..self.sp).map(|s| base + s * self.tp).collect()
    }

    /// World ranks of this rank's CP ring (same DP replica, stage, SP and TP rank, stride
    /// sp · tp).
    pub fn cp_group(&self) -> Vec<usize> {
        let (d, p, s, t) = (
            self.dp_rank(),
            self.pp_rank(),
            self.sp_rank(),
            self.tp_rank(),
        );
        (0..self.cp).map(|c| self.at(d, p, c, s, t)).collect()
    }

    /// World ranks of this rank's sequence group (same DP replica, stage and TP rank: CP × SP).
    pub fn seq_group(&self) -> Vec<usize> {
        let (d, p, t) = (self.dp_rank(), self.pp_rank(), self.tp_rank());
        (0..self.cp)
            .flat_map(|c| (0..self.sp).map(move |s| (c, s)))
            .map(|(c, s)| self.at(d, p, c, s, t))
            .collect()
    }

    /// World ranks holding the same parameter shards as this one: the same stage, SP and TP
    /// rank in every DP replica and CP rank (the group that sums the SP-split position table's
    /// gradients and shards ZeRO-1's optimizer state).
    pub fn dp_group(&self) -> Vec<usize> {
        let (p, s, t) = (self.pp_rank(), self.sp_rank(), self.tp_rank());
        (0..self.dp)
            .flat_map(|d| (0..self.cp).map(move |c| (d, c)))
            .map(|(d, c)| self.at(d, p, c, s, t))
            .collect()
    }

    /// World ranks holding the same TP slices of the same stage's weights: every DP × CP × SP
    /// rank of this stage and TP rank (the group that sums gradients; the whole world without
    /// TP and PP).
    pub fn data_group(&self) -> Vec<usize> {
        let (p, t) = (self.pp_rank(), self.tp_rank());
        (0..self.dp)
            .flat_map(|d| (0..self.cp * self.sp).map(move |j| (d, j)))
            .map(|(d, j)| self.at(d, p, j / self.sp, j % self.sp, t))
            .collect()
    }

    /// World ranks of this rank's pipeline: the same DP, CP, SP and TP rank at every stage, in
    /// stage order (stride cp · sp · tp).
    pub fn pp_group(&self) -> Vec<usize> {
        let (d, c, s, t) = (
            self.dp_rank(),
            self.cp_rank(),
            self.sp_rank(),
            self.tp_rank(),
        );
        (0..self.pp).map(|p| self.at(d, p, c, s, t)).collect()
    }

    /// The padded sequence length a step of `seq_len` tokens runs at: a multiple of the number
    /// of pieces the sequence group cuts it into (SP, and 2·CP zigzag chunks each cut over SP),
    /// each cut again over TP (Megatron sequence parallelism splits a rank's tokens over TP).
    /// Padding goes at the end; causal attention never lets a real token see it, and it carries
    /// no loss, so any record length trains exactly as on one rank.
    pub fn padded_len(&self, seq_len: usize) -> usize {
        let pieces = self.degrees().pieces();
        seq_len.div_ceil(pieces) * pieces
    }

    /// The global positions this rank's tokens sit at, in the order it holds them, for a
    /// padded length `padded` (see [`Topology::padded_len`]).
    pub fn spans(&self, padded: usize) -> Vec<Span> {
        let (c, cp, r, sp) = (self.cp_rank(), self.cp, self.sp_rank(), self.sp);
        // This CP rank's tokens as runs of the global sequence, then SP's contiguous cut of them.
        let runs: Vec<Span> = if cp == 1 {
            vec![Span {
                start: 0,
                len: padded,
            }]
        } else {
            let chunk = padded / (2 * cp);
            [c, 2 * cp - 1 - c]
                .into_iter()
                .map(|k| Span {
                    start: k * chunk,
                    len: chunk,
                })
                .collect()
        };
        let local: usize = runs.iter().map(|s| s.len).sum();
        let (from, to) = (r * local / sp, (r + 1) * local / sp);
        let mut out = Vec::new();
        let mut at = 0;
        for s in runs {
            let (lo, hi) = (from.max(at), to.min(at + s.len));
            if lo < hi {
                out.push(Span {
                    start: s.start + lo - at,
                    len: hi - lo,
                });
            }
            at += s.len;
        }
        out
    }

    /// Checks the global batch against the layout before any work starts. (Any head count
    /// works with any SP degree: Ulysses pads the heads; any sequence length: the sequence is
    /// padded.)
    pub fn validate(&self, batch: usize) -> Result<()> {
        if !batch.is_multiple_of(self.dp) {
            return Err(Error::Invalid(format!(
                "--dp {}: --batch-size {batch} (the global batch) does not divide by it",
                self.dp
            )));
        }
        Ok(())
    }
}

/// Checks of a layout against the run it serves (`train::setup::validate_layout`).
impl Topology {
    /// Refuses a sequence group that cuts a window into at least twice as many pieces as it has
    /// tokens. Such a layout runs, exactly (ranks holding only padding included, which the tests
    /// cover), but on a sequence padded to the piece count, so most of every step is padding:
    /// `--cp 256` on 128 tokens trained 512 positions, 384 of them padding. Fewer pieces than
    /// that pad less than half the window.
    pub fn check_pieces(&self, seq_len: usize, heads: usize) -> Result<()> {
        let (cp, sp, tp) = (self.cp, self.sp, self.tp);
        let pieces = self.degrees().pieces();
        let most = seq_len.saturating_mul(2) - 1;
        if pieces <= most {
            return Ok(());
        }
        let cut = if cp > 1 {
            format!("2·cp·sp·tp = 2·{cp}·{sp}·{tp}")
        } else {
            format!("sp·tp = {sp}·{tp}")
        };
        Err(Error::Invalid(format!(
            "--seq-len {seq_len}: the layout cuts every window into {pieces} pieces ({cut}), at \
             least twice its {seq_len} tokens, so most of every step would be padding; use a longer \
             --seq-len or fewer ranks ({} here)",
            self.fewer_pieces(most, heads)
        )))
    }

    /// The change of degrees nearest to this layout that cuts a window into at most `most` pieces:
    /// fewer CP ranks first, then none, then fewer SP ranks, then fewer TP ranks. (Each degree
    /// named is one that moves: "at most --sp 1" with --sp already 1 helped nobody; a TP degree
    /// divides the `heads`.)
    fn fewer_pieces(&self, most: usize, heads: usize) -> String {
        let (cp, sp, tp) = (self.cp, self.sp, self.tp);
        if cp > 1 {
            let c = most / sp.saturating_mul(tp).saturating_mul(2);
            if c >= 2 {
                return format!("at most --cp {c}");
            }
            if sp.saturating_mul(tp) <= most {
                return "--cp 1".into();
            }
        }
        let mut fix = Vec::new();
        if cp > 1 {
            fix.push("--cp 1".to_string());
        }
        if tp <= most {
            fix.push(format!("at most --sp {}", most / tp));
        } else {
            if sp > 1 {
                fix.push("--sp 1".into());
            }
            let t = (1..=most)
                .rev()
                .find(|t| heads.is_multiple_of(*t))
                .unwrap_or(1);
            fix.push(format!("at most --tp {t}"));
        }
        fix.join(" and ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups() {
        let t = Topology::grid(5, 2, 1, 4).unwrap();
        assert_eq!((t.sp_rank(), t.dp_rank()), (1, 1));
        assert_eq!(t.sp_group(), vec![4, 5, 6, 7]);
        assert_eq!(t.dp_group(), vec![1, 5]);
        assert!(Topology::grid(8, 2, 1, 4).is_err());
        assert!(t.validate(4).is_ok());
        assert!(t
            .validate(3)
            .unwrap_err()
            .to_string()
            .contains("--batch-size 3"));
    }

    #[test]
    fn grid_groups() {
        // dp 2 × cp 2 × sp 2: rank 6 = (1·2 + 1)·2 + 0.
        let t = Topology::grid(6, 2, 2, 2).unwrap();
        assert_eq!((t.dp_rank(), t.cp_rank(), t.sp_rank()), (1, 1, 0));
        assert_eq!(t.sp_group(), vec![6, 7]);
        assert_eq!(t.cp_group(), vec![4, 6]);
        assert_eq!(t.seq_group(), vec![4, 5, 6, 7]);
        assert_eq!(t.dp_group(), vec![0, 2, 4, 6]);
        assert_eq!(t.tp_group(), vec![6]);
        assert_eq!(t.data_group(), (0..8).collect::<Vec<_>>());
    }

    #[test]
    fn tensor_parallel_groups() {
        // dp 2 × cp 1 × sp 2 × tp 2: rank 7 = ((1·1 + 0)·2 + 1)·2 + 1.
        let d = Degrees {
            dp: 2,
            cp: 1,
            sp: 2,
            tp: 2,
            pp: 1,
        };
        let t = Topology::of(7, d).unwrap();
        assert_eq!(
            (t.dp_rank(), t.cp_rank(), t.sp_rank(), t.tp_rank()),
            (1, 0, 1, 1)
        );
        assert_eq!(t.tp_group(), vec![6, 7]);
        assert_eq!(t.sp_group(), vec![5, 7]);
        assert_eq!(t.cp_group(), vec![7]);
        assert_eq!(t.seq_group(), vec![5, 7]);
        assert_eq!(t.dp_group(), vec![3, 7]);
        assert_eq!(t.data_group(), vec![1, 3, 5, 7]);
        // Every group lists ranks that agree with this one on the other coordinates.
        for r in 0..8 {
            let u = Topology::of(r, d).unwrap();
            assert!(u.tp_group().contains(&r) && u.sp_group().contains(&r));
            assert!(u.seq_group().contains(&r) && u.dp_group().contains(&r));
        }
    }

    /// With pipeline stages: every group but PP's stays inside one stage, the PP group crosses
    /// the stages at fixed other coordinates, and each kind of group partitions the world
    /// (every rank is in its own group, and every member names the same group).
    #[test]
    fn pipeline_groups() {
        let d = Degrees {
            dp: 2,
            cp: 2,
            sp: 2,
            tp: 2,
            pp: 3,
        };
        let n = d.world();
        assert_eq!(n, 48);
        // rank 15 = (((0·3 + 1)·2 + 1)·2 + 1)·2 + 1.
        let t = Topology::of(15, d).unwrap();
        assert_eq!(
            (
                t.dp_rank(),
                t.pp_rank(),
                t.cp_rank(),
                t.sp_rank(),
                t.tp_rank()
            ),
            (0, 1, 1, 1, 1)
        );
        assert_eq!(t.pp_group(), vec![7, 15, 23]);
        assert_eq!(t.cp_group(), vec![11, 15]);
        assert_eq!(t.seq_group(), vec![9, 11, 13, 15]);
        assert_eq!(t.dp_group(), vec![11, 15, 35, 39]);
        assert_eq!(t.data_group(), vec![9, 11, 13, 15, 33, 35, 37, 39]);
        assert_eq!(t.sp_group(), vec![13, 15]);
        assert_eq!(t.tp_group(), vec![14, 15]);
        let groups: [fn(&Topology) -> Vec<usize>; 7] = [
            Topology::tp_group,
            Topology::sp_group,
            Topology::cp_group,
            Topology::seq_group,
            Topology::dp_group,
            Topology::data_group,
            Topology::pp_group,
        ];
        for (k, g) in groups.iter().enumerate() {
            for r in 0..n {
                let u = Topology::of(r, d).unwrap();
                let members = g(&u);
                assert!(members.contains(&r), "group {k} of rank {r}");
                for &m in &members {
                    let v = Topology::of(m, d).unwrap();
                    assert_eq!(g(&v), members, "group {k}: {r} and {m} disagree");
                    // Only the PP group crosses stages.
                    if k != 6 {
                        assert_eq!(v.pp_rank(), u.pp_rank(), "group {k} of {r} holds {m}");
                    }
                }
            }
        }
    }

    /// Every position of the padded sequence is held by exactly one rank of a sequence group;
    /// the zigzag gives each CP rank chunk c and 2·cp−1−c.
    #[test]
    fn spans_cover_the_sequence_once() {
        for (cp, sp) in [(1, 1), (1, 3), (2, 1), (4, 1), (2, 2), (3, 2), (2, 3)] {
            let probe = Topology::grid(0, 1, cp, sp).unwrap();
            let padded = probe.padded_len(1001);
            let pieces = if cp > 1 { 2 * cp * sp } else { sp };
            assert!(padded >= 1001 && padded.is_multiple_of(pieces));
            let mut seen = vec![0u8; padded];
            for rank in 0..cp * sp {
                let t = Topology::grid(rank, 1, cp, sp).unwrap();
                let spans = t.spans(padded);
                let n: usize = spans.iter().map(|s| s.len).sum();
                assert_eq!(n, padded / (cp * sp), "cp {cp} sp {sp} rank {rank}");
                for s in spans {
                    seen[s.start..s.start + s.len]
                        .iter_mut()
                        .for_each(|x| *x += 1);
                }
            }
            assert!(seen.iter().all(|&x| x == 1), "cp {cp} sp {sp}");
        }
        let t = Topology::grid(1, 1, 4, 1).unwrap();
        let spans = t.spans(64);
        assert_eq!(
            spans,
            vec![Span { start: 8, len: 8 }, Span { start: 48, len: 8 }]
        );
    }
}
