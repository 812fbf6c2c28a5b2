//! genslm: genome-scale language models (GenSLM-style GPT-NeoX) over long DNA sequences.
//!
//! Data flow (docs/ARCHITECTURE.md §2): FASTA → [`data::fasta`] → [`tokenizer`] → [`data::dataset`]
//! (parquet) → training. The CLI in `main.rs` only parses arguments and calls this library.

/// `eprintln!` that never panics: with stderr's reader gone (`2>&1 | head`, a closed pipe)
/// every note or warning was a panic, and the panic hook's own message a second one, which
/// aborted the process before its outputs were renamed into place (an orphan `.NAME.tmp-PID`
/// instead of the file). What cannot be said is dropped. Shadows std's macro in every module
/// declared below. Messages go out as [`error::for_terminal`] shows them: warnings quote what
/// they skip (a VCF's CHROM, a file name), and hostile input put escape sequences there.
macro_rules! eprintln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "{}",
            $crate::error::for_terminal(&format!($($arg)*))
        );
    }};
}

pub mod alloc;
pub mod atomic;
pub mod atomic_dir;
pub mod backend;
pub mod bench;
pub mod checksum;
pub mod config;
pub mod convert;
pub mod cuda_toolkit;
pub mod curves;
pub mod data;
pub mod error;
pub mod host_memory;
pub mod infer;
pub mod info;
pub mod interrupt;
pub mod isa;
pub mod launch;
pub mod model;
pub mod ops;
pub mod parallel;
pub mod pca;
pub mod plan;
pub mod plot;
pub mod progress;
pub mod rng;
pub mod run_lock;
pub mod tokenizer;
pub mod train;

pub use error::{Error, Result};
