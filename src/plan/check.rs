//! The checks a layout and its options pass before anything is estimated: degrees, the
//! heads' split, ZeRO stages, pipeline stages, what ring attention needs.

use crate::config::ModelConfig;
use crate::error::{Error, Result};

use crate::config::AttentionKind;

use super::{stages, Mask, Strategy};

/// Checks that the layout fits the model and the options make sense.
pub fn check(model: &ModelConfig, st: &Strategy) -> Result<()> {
    let l = &st.layout;
    if l.tp == 0 || l.sp == 0 || l.cp == 0 || l.dp == 0 {
        return Err(Error::Invalid(format!(
            "parallel degrees must be at least 1 (tp {}, sp {}, cp {}, dp {})",
            l.tp, l.sp, l.cp, l.dp
        )));
    }
    if l.cp > 1 && (st.attention == AttentionKind::Naive || st.mask == Mask::Materialised) {
        return Err(Error::Invalid(format!(
            "cp {}: ring attention runs FlashAttention on K/V blocks (no score matrix, no \
             materialised mask)",
            l.cp
        )));
    }
    if l.zero > 3 {
        return Err(Error::Invalid(format!(
            "ZeRO stage {} does not exist (0, 1, 2 or 3)",
            l.zero
        )));
    }
    let split = l.tp * l.sp;
    if !model.num_heads.is_multiple_of(l.tp) {
        return Err(Error::Invalid(format!(
            "{} heads do not divide over tp {} ranks (each TP rank needs whole heads)",
            model.num_heads, l.tp
        )));
    }
    if !model.num_heads.is_multiple_of(split) {
        // The trainer runs it (Ulysses pads the heads with empty ones); the plan's terms
        // count whole heads per rank and would understate that extra work and memory.
        let per = model.num_heads / l.tp;
        let padded = per.div_ceil(l.sp) * l.sp;
        return Err(Error::Invalid(format!(
            "sp {} does not divide the {per} heads of each TP rank: genslm train runs it with \
             {} empty heads padded in ({:.0}% more attention work), which the planner does not \
             model; plan an sp that divides {per}",
            l.sp,
            padded - per,
            100.0 * (padded - per) as f64 / per as f64
        )));
    }
    if st.batch_size == 0 {
        return Err(Error::Invalid("batch size must be at least 1".into()));
    }
    if l.pp > 1 && l.zero >= 2 {
        return Err(Error::Invalid(format!(
            "pp {} with ZeRO-{}: genslm's trainer runs pipeline stages with ZeRO 0 or 1",
            l.pp, l.zero
        )));
    }
    stages::stage_views(model, l, st.pp_layers.as_deref())?;
    if st.vocab_size == 0 {
        return Err(Error::Invalid("vocabulary size must be at least 1".into()));
    }
    Ok(())
}
