//! The subcommands whose arguments and output need more than a few lines.

pub mod bench;
pub mod device;
pub mod infer;
pub mod plan;
pub mod train;

use clap::ValueEnum;

/// `--attention` of `train` and `bench step`.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq)]
pub enum AttentionArg {
    Flash,
    Naive,
}

impl From<AttentionArg> for genslm::config::AttentionKind {
    fn from(a: AttentionArg) -> Self {
        match a {
            AttentionArg::Flash => Self::Flash,
            AttentionArg::Naive => Self::Naive,
        }
    }
}
