//! The subcommands whose arguments and output need more than a few lines.

pub mod bench;
pub mod bench_sizes;
pub mod device;
pub mod infer;
pub mod plan;
pub mod train;
pub mod variants;

/// A clap value enum mirroring the library enum `$lib` variant for variant, with the conversion
/// into it: the library holds no clap definitions, and clap's derive cannot reach its types.
macro_rules! mirror {
    ($name:ident => $lib:ty { $($(#[$attr:meta])* $v:ident),+ $(,)? }) => {
        #[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
        pub enum $name { $($(#[$attr])* $v),+ }

        impl From<$name> for $lib {
            fn from(a: $name) -> Self {
                match a { $($name::$v => Self::$v),+ }
            }
        }
    };
}
pub(crate) use mirror;

// `--attention` of `train` and `bench step`.
mirror!(AttentionArg => genslm::config::AttentionKind { Flash, Naive });
