//! What a non-finite loss, gradient or update does to a training run (`--skip-nonfinite`,
//! `max_consecutive_skips`), apart from the loop that applies it.

use crate::config::TrainConfig;
use crate::error::{Error, Result};
use crate::train::dist_optim::StepOutcome;

/// What a non-finite loss, gradient or update does to the run: an update that made the weights
/// non-finite stops it (nothing of the step is saved); a skipped step (non-finite loss or
/// gradient) stops it unless `--skip-nonfinite`, and then only past `max_consecutive_skips`
/// in a row.
#[derive(Debug, Default)]
pub struct NonFinitePolicy {
    pub consecutive_skips: u64,
    /// Whether the run has a checkpoint to resume from (it resumed, or saved one): the
    /// messages offer `--resume` only then (a fresh run stopped at step 2 offered it).
    pub saved: bool,
}

impl NonFinitePolicy {
    /// A policy for a run that has a checkpoint to resume from (`saved`) or not yet.
    pub fn with_checkpoint(saved: bool) -> Self {
        Self {
            consecutive_skips: 0,
            saved,
        }
    }

    /// What a run stopped here can do next, after `advice`.
    fn then(&self, advice: &str) -> String {
        match self.saved {
            true => format!("{advice} (the last checkpoint resumes with --resume)"),
            false => format!(
                "{advice} (no checkpoint was saved: start again with --overwrite, which \
                 replaces what this run wrote)"
            ),
        }
    }

    pub fn check(
        &mut self,
        out: &StepOutcome,
        loss: f64,
        step: u64,
        t: &TrainConfig,
    ) -> Result<()> {
        let (norm, finite) = (out.grad_norm, out.applied);
        if !out.params_finite {
            // Nothing of this step is saved: the last checkpoint (if any) stays `latest`.
            return Err(Error::Invalid(format!(
                "step {step}: the update made the weights non-finite (NaN/Inf) although loss {loss} \
                 and gradient norm {norm} were finite: --lr {} is far too high. The run stops \
                 without saving this step; start again with a lower --lr",
                crate::error::short_num(t.lr)
            )));
        }
        self.consecutive_skips = if finite {
            0
        } else {
            self.consecutive_skips + 1
        };
        let skips = self.consecutive_skips;
        if !finite && t.skip_nonfinite && skips > t.max_consecutive_skips {
            return Err(Error::Invalid(format!(
                "step {step}: {skips} consecutive steps had a non-finite (or overflowing) loss \
                 or gradient (limit `max_consecutive_skips` = {}); the run is diverging or the \
                 data is broken: {}",
                t.max_consecutive_skips,
                self.then("lower --lr or check the data")
            )));
        }
        if !finite && !t.skip_nonfinite {
            let what = if loss.is_finite() && norm.is_finite() {
                // Finite, but past what AdamW's f32 moments hold (`MAX_UPDATE_NORM`).
                format!(
                    "gradient norm {norm:.3e} is too large for the optimizer (its square \
                     overflows AdamW's f32 moments); lower --lr, clip with --max-grad-norm, \
                     check the data,"
                )
            } else {
                format!(
                    "loss {loss} / gradient norm {norm} is not finite; lower --lr, check the data,"
                )
            };
            return Err(Error::Invalid(format!(
                "step {step}: {}",
                self.then(&format!(
                    "{what} or pass --skip-nonfinite to skip such steps"
                ))
            )));
        }
        Ok(())
    }

    /// A non-finite validation loss stops the run before saving, skips or not. After skipped
    /// steps, a non-finite validation loss says the weights themselves are
    /// broken, not a batch (a finite update of 1e29 made every later forward NaN): the run
    /// stops before saving. `--lr 1e30 --skip-nonfinite --steps 8` skipped 7 steps, stayed
    /// under `max_consecutive_skips`, saved the broken weights and exited 0. A save after
    /// skipped steps in a run without a validation split is said (`saving`).
    pub fn check_validation(
        &self,
        val: Option<f64>,
        what: &str,
        step: u64,
        saving: bool,
        t: &TrainConfig,
    ) -> Result<()> {
        let skips = self.consecutive_skips;
        if skips == 0 {
            // No step was skipped, yet the weights give non-finite losses: an update of
            // finite but enormous values, which the next forward turns into NaN.
            return match val {
                Some(v) if !v.is_finite() => Err(Error::Invalid(format!(
                    "step {step}: {what} is {v}: the last update left weights whose forward \
                     is non-finite (--lr {} is far too high). The run stops without saving \
                     this step; start it again with a lower --lr (a resume keeps the run's \
                     --lr)",
                    crate::error::short_num(t.lr)
                ))),
                _ => Ok(()),
            };
        }
        match val {
            Some(v) if !v.is_finite() => Err(Error::Invalid(format!(
                "step {step}: the last {skips} step(s) were skipped (non-finite loss or \
                 gradient) and {what} is {v}: the weights themselves give non-finite losses, \
                 so skipping batches cannot help. The run stops without saving this step; \
                 start it again with a lower --lr (now {}; a resume keeps the run's --lr)",
                crate::error::short_num(t.lr)
            ))),
            None if saving => {
                eprintln!(
                    "warning: step {step}: saved after {skips} skipped step(s) (non-finite loss \
                     or gradient); with no validation split (--val-fraction 0) whether the \
                     weights are sound was not checked"
                );
                Ok(())
            }
            _ => Ok(()),
        }
    }
}
