//! What a FASTA reader's parse error means for the file that caused it, in words a user can
//! act on (a byte-order mark, blank lines before the first '>', CR line ends, a truncated or
//! damaged file).

use std::path::Path;

use needletail::errors::{ParseError, ParseErrorKind};

/// The message for `e`, raised reading `path` (`compressed`: read through a decompressor).
pub fn describe_parse_error(e: &ParseError, path: &Path, compressed: bool) -> String {
    // The file's first bytes as stored (no decompression: the cases below are plain text),
    // read again only from a regular file: a named pipe whose writer is gone blocks the open
    // for ever (the command hung on a malformed FIFO), and a pipe's bytes are spent.
    let regular = std::fs::metadata(path).ok().filter(|m| m.is_file());
    let head = || -> Vec<u8> {
        use std::io::Read;
        let mut buf = Vec::new();
        if regular.is_some() {
            let _ = std::fs::File::open(path).map(|f| f.take(1 << 16).read_to_end(&mut buf));
        }
        buf
    };
    let size = regular.as_ref().map(|m| m.len());
    match e.kind {
        // One byte that is no '>' (the reader needs two to tell a compressed file).
        ParseErrorKind::EmptyFile if size == Some(1) && !head().starts_with(b">") => {
            "not a FASTA file: it does not start with '>'".into()
        }
        ParseErrorKind::EmptyFile if size.is_some_and(|n| n > 0) => {
            "file holds no record: only '>' marks or blank space, no header and sequence".into()
        }
        ParseErrorKind::EmptyFile if regular.is_none() => {
            "no record: the stream was empty or too short to be FASTA".into()
        }
        ParseErrorKind::UnknownFormat if compressed && decompressed_is_compressed(path) => {
            crate::data::fastx_open::COMPRESSED_TWICE.into()
        }
        ParseErrorKind::UnknownFormat if compressed || regular.is_none() => {
            format!(
                "not a FASTA file: its {}text does not start with '>' (a byte-order mark, \
                 blank lines, or not FASTA)",
                if compressed { "decompressed " } else { "" }
            )
        }
        ParseErrorKind::EmptyFile => "file is empty".into(),
        ParseErrorKind::UnknownFormat => {
            let head = head();
            if head.starts_with(b"\xEF\xBB\xBF") {
                "the file starts with a UTF-8 byte-order mark before its first '>': save it \
                 without one (e.g. sed -i '1s/^\\xEF\\xBB\\xBF//' FILE)"
                    .into()
            } else if head.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'>') {
                "the file has blank lines or spaces before its first '>': remove them (e.g. \
                 sed -i '/[^[:space:]]/,$!d' FILE)"
                    .into()
            } else {
                "not a FASTA file: it does not start with '>' (nor with a gzip/bzip2/xz/zstd \
                 header)"
                    .into()
            }
        }
        ParseErrorKind::UnexpectedEnd
            if {
                let head = head();
                head.contains(&b'\r') && !head.contains(&b'\n')
            } =>
        {
            "the file's lines end in CR alone (old Mac line endings), so it reads as one line: \
             convert it first (e.g. tr '\\r' '\\n' < FILE > FILE.fa)"
                .into()
        }
        ParseErrorKind::Io => format!(
            "read failed, the file may be truncated or its compression corrupt: {}",
            e.msg
        ),
        ParseErrorKind::UnexpectedEnd => {
            format!("file ends inside a record: a header with no sequence, or a truncated file (line {})", e.position.line)
        }
        _ => format!("not valid FASTA: {}", e.msg),
    }
}

/// Whether the regular file at `path`, decompressed once, starts compressed again.
pub fn decompressed_is_compressed(path: &Path) -> bool {
    use std::io::Read;
    if !std::fs::metadata(path).is_ok_and(|m| m.is_file()) {
        return false;
    }
    let Ok(file) = std::fs::File::open(path) else {
        return false;
    };
    let Ok((text, _, _)) = crate::data::fastx_open::text_of(file) else {
        return false;
    };
    let mut head = Vec::new();
    let _ = text.take(4).read_to_end(&mut head);
    head.len() >= 2 && crate::data::fastx_open::is_compressed(&head)
}
