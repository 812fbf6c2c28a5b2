//! The library's error type. Every message names the file, record, field or rank involved.

use std::path::{Path, PathBuf};

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    // The io error is part of the message, not a chained source, so it prints once.
    #[error("{}: {err}{}", path.display(), io_hint(path, err))]
    Io { path: PathBuf, err: std::io::Error },
    /// A FASTA file or one of its records is unusable.
    #[error("{}{}: {msg}", file.display(), record.as_ref().map(|r| format!(", record '{}'", short_id(r))).unwrap_or_default())]
    Fasta {
        file: PathBuf,
        record: Option<String>,
        msg: String,
    },
    /// A config file or field is wrong.
    #[error("{}: {msg}", file.display())]
    Config { file: PathBuf, msg: String },
    /// A dataset (parquet) file could not be read or written.
    #[error("{}: {msg}", path.display())]
    Dataset { path: PathBuf, msg: String },
    /// Anything else the user asked for that cannot be done, with the reason.
    #[error("{0}")]
    Invalid(String),
    /// Standard output, the command's only output, was closed by its reader (`| head`): the
    /// command ends quietly with what it wrote, as the shell's own tools do.
    #[error("standard output was closed by its reader")]
    ReaderGone,
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            err: source,
        }
    }

    /// A failed write of `what` to standard output when it is the command's only output: a
    /// reader that stopped early is [`Error::ReaderGone`], anything else (a full disk) an error.
    pub fn stdout_only(what: &str, e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            Error::ReaderGone
        } else {
            Error::Invalid(format!("writing {what} to standard output: {e}"))
        }
    }
}

/// What an io error's message adds: `-` is no file name here (the Unix convention for
/// standard input is kept by FASTA inputs only, which say so); a missing `-` said only "No such
/// file or directory".
fn io_hint(path: &Path, err: &std::io::Error) -> &'static str {
    if path.as_os_str() == "-" && err.kind() == std::io::ErrorKind::NotFound {
        "; `-` is read as a file name here, not as standard input: give the file"
    } else {
        ""
    }
}

/// `v` as a message shows it: plainly in a readable range, else in scientific notation
/// (`--lr 1e300` was echoed as a 301-digit number).
pub fn short_num(v: f64) -> String {
    if v == 0.0 || !v.is_finite() || (1e-4..1e6).contains(&v.abs()) {
        format!("{v}")
    } else {
        format!("{v:e}")
    }
}

/// An error message as the terminal gets it: control characters other than line breaks and
/// tabs escaped, and past 16 KiB cut. A message quotes what it refuses — a TOML line, a
/// parquet column's name, a tensor's — and hostile files put escape sequences there (they
/// reached the terminal raw), or names of megabytes (a 30 MB shard name in an index printed
/// 62 MB).
pub fn for_terminal(msg: &str) -> String {
    const MAX: usize = 16 << 10;
    let mut out = String::with_capacity(msg.len().min(MAX) + 64);
    for (i, c) in msg.char_indices() {
        if out.len() >= MAX {
            out.push_str(&format!(
                "… ({} more bytes of this message cut)",
                msg.len() - i
            ));
            break;
        }
        match c {
            '\n' | '\t' => out.push(c),
            // Control characters, and the invisible format characters that reorder or hide
            // text (bidirectional overrides and isolates, zero-width marks, the BOM).
            c if c.is_control()
                || matches!(c, '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}'
                    | '\u{2060}'..='\u{2069}' | '\u{FEFF}') =>
            {
                out.extend(c.escape_default())
            }
            c => out.push(c),
        }
    }
    out
}

/// At most `max` of `names`, each as [`short_id`] shows it, and how many were left out.
pub fn list_some(names: &[String], max: usize) -> String {
    let shown: Vec<String> = names.iter().take(max).map(|n| short_id(n)).collect();
    match names.len().saturating_sub(max) {
        0 => shown.join(", "),
        more => format!("{}, … and {more} more", shown.join(", ")),
    }
}

/// A record id as a message shows it: control characters escaped (an escape sequence in a
/// FASTA header reached the terminal), and past 80 characters cut to its first 60 and last 16
/// (ids that differ at their end stay told apart), with the full length (a 100 KB header was
/// printed whole in every message that named the record).
pub fn short_id(id: &str) -> String {
    const KEEP: usize = 80;
    const HEAD: usize = 60;
    const TAIL: usize = 16;
    let shown = |s: &str| -> String {
        s.chars()
            .flat_map(|c| {
                let esc: Vec<char> = if c.is_control() {
                    c.escape_default().collect()
                } else {
                    vec![c]
                };
                esc
            })
            .collect()
    };
    let n = id.chars().count();
    if n <= KEEP {
        return shown(id);
    }
    let head: String = id.chars().take(HEAD).collect();
    let tail: String = id.chars().skip(n - TAIL).collect();
    format!("{}…{} ({n} characters)", shown(&head), shown(&tail))
}

/// The first five of `items`, comma-separated, then `…` when there are more: how a message
/// names a long list of records or lines.
pub fn first_five<T: std::fmt::Display>(items: &[T]) -> String {
    let mut s: Vec<String> = items.iter().take(5).map(|x| x.to_string()).collect();
    if items.len() > 5 {
        s.push("…".into());
    }
    s.join(", ")
}

/// The message a panic carried (`panic!` with a literal gives a `&str`, with a format a
/// `String`); `None` for other payloads.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> Option<&str> {
    payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
}

/// The bytes of `path` when it holds at most `max`; `None` when it holds more, found without
/// reading the rest (a file that should be small may be a multi-gigabyte stranger).
pub fn read_capped(path: &Path, max: u64) -> Result<Option<Vec<u8>>> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut bytes = Vec::new();
    file.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io(path, e))?;
    Ok((bytes.len() as u64 <= max).then_some(bytes))
}

/// Refuses `path` when it exists as anything but a regular file (itself or through a link):
/// opening a named pipe to read waits for a writer that may never come, and a directory or a
/// device is no file of ours. `what` says what the file is for, in the message.
pub fn file_or_missing(path: &Path, what: &str) -> Result<()> {
    match not_a_file(path) {
        "missing" | "a file" => Ok(()),
        kind => Err(Error::Invalid(format!(
            "{}: {kind}; genslm reads it as {what}",
            path.display()
        ))),
    }
}

/// What `path` is, when a directory was expected there ([`not_a_file`]'s words turned around:
/// "a file, not a directory", "a named pipe (FIFO), not a directory").
pub fn not_a_directory(path: &Path) -> String {
    match not_a_file(path) {
        "a file" => "a file, not a directory".into(),
        "a directory, not a file" => "a directory".into(),
        other => other.replace(", not a file", ", not a directory"),
    }
}

/// What `path` is, when a regular file was expected there: for messages that would otherwise
/// call a named pipe, a directory or a symbolic-link loop "missing".
pub fn not_a_file(path: &Path) -> &'static str {
    #[cfg(unix)]
    use std::os::unix::fs::FileTypeExt;
    let linked = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    let Ok(m) = std::fs::metadata(path) else {
        return if linked {
            "a symbolic link that leads nowhere (a loop, or its target is gone)"
        } else {
            "missing"
        };
    };
    let t = m.file_type();
    #[cfg(unix)]
    {
        if t.is_fifo() && anonymous_pipe(path) {
            return "a pipe (a command's output, as <(…) or stdin give), not a file";
        }
        if t.is_fifo() {
            return "a named pipe (FIFO), not a file";
        }
        if t.is_socket() {
            return "a socket, not a file";
        }
        if t.is_block_device() || t.is_char_device() {
            return "a device, not a file";
        }
    }
    if t.is_dir() {
        "a directory, not a file"
    } else if t.is_file() {
        "a file"
    } else {
        "not a regular file"
    }
}

/// Whether `path` leads, through its links, to an anonymous pipe (`/dev/stdin` under `cmd |`,
/// `/dev/fd/63` from `<(…)`): Linux names those link targets `pipe:[inode]`. Calling them
/// named pipes sent users looking for a `mkfifo` they never ran.
fn anonymous_pipe(path: &Path) -> bool {
    let mut p = path.to_path_buf();
    for _ in 0..40 {
        let Ok(target) = std::fs::read_link(&p) else {
            return false;
        };
        if target.to_string_lossy().starts_with("pipe:[") {
            return true;
        }
        p = match p.parent() {
            Some(dir) if target.is_relative() => dir.join(target),
            _ => target,
        };
    }
    false
}

#[cfg(test)]
mod panic_tests {
    use super::panic_message;

    #[test]
    fn panic_message_reads_literal_and_formatted_payloads() {
        let literal = std::panic::catch_unwind(|| panic!("plain")).unwrap_err();
        let formatted = std::panic::catch_unwind(|| panic!("rank {}", 3)).unwrap_err();
        let other = std::panic::catch_unwind(|| std::panic::panic_any(7u8)).unwrap_err();
        assert_eq!(panic_message(literal.as_ref()), Some("plain"));
        assert_eq!(panic_message(formatted.as_ref()), Some("rank 3"));
        assert_eq!(panic_message(other.as_ref()), None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A missing `-` says it is no standard input here; any other missing file, or `-` that
    /// exists and fails otherwise, keeps the plain message.
    #[test]
    fn a_missing_dash_is_named_as_no_standard_input() {
        let gone = || std::io::Error::from(std::io::ErrorKind::NotFound);
        let dash = Error::io("-", gone()).to_string();
        assert!(
            dash.starts_with("-: ") && dash.contains("not as standard input"),
            "{dash}"
        );
        assert!(!Error::io("x.vcf", gone())
            .to_string()
            .contains("standard input"));
        let denied = std::io::Error::from(std::io::ErrorKind::PermissionDenied);
        assert!(!Error::io("-", denied)
            .to_string()
            .contains("standard input"));
    }

    #[test]
    fn extreme_numbers_are_short() {
        for (v, s) in [
            (1e300, "1e300"),
            (1e-300, "1e-300"),
            (-2.5e7, "-2.5e7"),
            (0.9, "0.9"),
            (1000.0, "1000"),
            (0.0, "0"),
            (f64::INFINITY, "inf"),
        ] {
            assert_eq!(short_num(v), s);
        }
    }

    /// Record ids in messages: short ones as they are, control characters escaped, long ones
    /// cut to their first 60 and last 16 characters (counted in characters, not bytes) with
    /// the full length.
    #[test]
    fn record_ids_are_shown_short_and_printable() {
        assert_eq!(short_id("NC_045512.2"), "NC_045512.2");
        assert_eq!(short_id("a\u{1b}[2Jb\0"), "a\\u{1b}[2Jb\\u{0}");
        let long = "é".repeat(99_999) + "z";
        let e = Error::Fasta {
            file: "x.fa".into(),
            record: Some(long),
            msg: "bad".into(),
        }
        .to_string();
        let want = format!(
            "x.fa, record '{}…{}z (100000 characters)': bad",
            "é".repeat(60),
            "é".repeat(15)
        );
        assert_eq!(e, want);
    }

    /// Messages reach the terminal with line breaks and tabs kept, other control characters
    /// escaped, and cut past 16 KiB with the number of bytes cut; lists name 20 and count the rest.
    #[test]
    fn messages_are_printable_and_bounded() {
        assert_eq!(
            for_terminal("line 1: k\u{1b}[31m = \u{7}\n\tnext"),
            "line 1: k\\u{1b}[31m = \\u{7}\n\tnext"
        );
        assert_eq!(for_terminal("chr\u{202e}1 é"), "chr\\u{202e}1 é");
        let long = "x".repeat(100_000);
        let shown = for_terminal(&long);
        assert!(shown.starts_with(&"x".repeat(16 << 10)));
        assert!(shown.ends_with(&format!(
            "… ({} more bytes of this message cut)",
            100_000 - (16 << 10)
        )));
        let names: Vec<String> = (0..50).map(|i| format!("c{i}")).collect();
        assert_eq!(list_some(&names[..2], 20), "c0, c1");
        assert!(list_some(&names, 20).ends_with("c19, … and 30 more"));
    }
}
