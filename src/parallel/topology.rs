//! The DP × SP grid. SP groups are contiguous ranks: rank = dp_rank · sp + sp_rank.

use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Topology {
    pub world: usize,
    pub rank: usize,
    /// Data-parallel degree.
    pub dp: usize,
    /// Sequence-parallel degree.
    pub sp: usize,
}

impl Topology {
    pub fn new(rank: usize, dp: usize, sp: usize) -> Result<Self> {
        if dp == 0 || sp == 0 {
            return Err(Error::Invalid(format!(
                "--dp {dp} --sp {sp}: degrees must be positive"
            )));
        }
        let world = dp
            .checked_mul(sp)
            .ok_or_else(|| Error::Invalid(format!("--dp {dp} × --sp {sp} ranks overflow")))?;
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
        })
    }

    pub fn single() -> Self {
        Self {
            world: 1,
            rank: 0,
            dp: 1,
            sp: 1,
        }
    }

    pub fn sp_rank(&self) -> usize {
        self.rank % self.sp
    }

    pub fn dp_rank(&self) -> usize {
        self.rank / self.sp
    }

    /// World ranks of this rank's SP group (contiguous).
    pub fn sp_group(&self) -> Vec<usize> {
        let base = self.dp_rank() * self.sp;
        (base..base + self.sp).collect()
    }

    /// World ranks of this rank's DP group (same sp_rank, stride sp).
    pub fn dp_group(&self) -> Vec<usize> {
        (0..self.dp).map(|d| d * self.sp + self.sp_rank()).collect()
    }

    /// Checks a model and sequence length against the layout before any work starts.
    pub fn validate(&self, heads: usize, seq_len: usize, batch: usize) -> Result<()> {
        if !heads.is_multiple_of(self.sp) {
            return Err(Error::Invalid(format!(
                "--sp {}: the model's {heads} attention heads do not divide by it; choose an SP \
                 degree that divides {heads}",
                self.sp
            )));
        }
        if !seq_len.is_multiple_of(self.sp) {
            return Err(Error::Invalid(format!(
                "--sp {}: --seq-len {seq_len} does not divide by it; use a multiple of {}",
                self.sp, self.sp
            )));
        }
        if !batch.is_multiple_of(self.dp) {
            return Err(Error::Invalid(format!(
                "--dp {}: --batch-size {batch} (the global batch) does not divide by it",
                self.dp
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups() {
        let t = Topology::new(5, 2, 4).unwrap();
        assert_eq!((t.sp_rank(), t.dp_rank()), (1, 1));
        assert_eq!(t.sp_group(), vec![4, 5, 6, 7]);
        assert_eq!(t.dp_group(), vec![1, 5]);
        assert!(Topology::new(8, 2, 4).is_err());
        let e = t.validate(6, 64, 4).unwrap_err().to_string();
        assert!(e.contains("6 attention heads"), "{e}");
        assert!(t
            .validate(8, 62, 4)
            .unwrap_err()
            .to_string()
            .contains("--seq-len 62"));
        assert!(t
            .validate(8, 64, 3)
            .unwrap_err()
            .to_string()
            .contains("--batch-size 3"));
    }
}
