//! The subcommands whose arguments and output need more than a few lines.

pub mod bench;
pub mod infer;
pub mod train;
