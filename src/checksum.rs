//! Checkpoint manifests: the sha256 of every file genslm writes into a checkpoint, kept in
//! `checksums.sha256` beside them and checked when genslm loads the checkpoint again.
//!
//! safetensors has no checksum of its own: a flipped byte inside tensor data still parses and
//! loads as a different model. The manifest is in `sha256sum`'s format, so
//! `sha256sum -c checksums.sha256` in the checkpoint directory checks it without genslm.
//! A directory without a manifest (a foreign model, or a checkpoint from an older genslm)
//! loads as before.

use std::collections::HashMap;
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// The manifest's file name inside a checkpoint directory.
pub const MANIFEST_FILE: &str = "checksums.sha256";

/// Lower-case hex of a digest (a table lookup per nibble: ingest calls it once per record).
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

/// Hex sha256 of a file, read in 1 MiB pieces.
pub fn sha256_file(path: &Path) -> Result<String> {
    let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut hasher = Sha256::new();
    let mut reader = std::io::BufReader::with_capacity(1 << 20, f);
    std::io::copy(&mut reader, &mut hasher).map_err(|e| Error::io(path, e))?;
    Ok(hex(&hasher.finalize()))
}

/// Writes the manifest of `files` (names inside `dir`), atomically.
pub fn write_manifest(dir: &Path, files: &[&str]) -> Result<()> {
    let mut text = String::new();
    for name in files {
        text += &format!("{}  {name}\n", sha256_file(&dir.join(name))?);
    }
    crate::atomic::write_bytes(&dir.join(MANIFEST_FILE), text.as_bytes())
}

/// `dir`'s manifest as file name → hex sha256; `None` when it has none.
fn manifest(dir: &Path) -> Result<Option<HashMap<String, String>>> {
    let path = dir.join(MANIFEST_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(&path, e)),
    };
    let mut listed = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let entry = line.split_once("  ").filter(|(h, n)| {
            h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()) && !n.is_empty()
        });
        let Some((hash, name)) = entry else {
            return Err(Error::Invalid(format!(
                "{}: line {}: not a sha256sum line ('<64 hex digits>  <file>')",
                path.display(),
                i + 1
            )));
        };
        listed.insert(name.to_string(), hash.to_ascii_lowercase());
    }
    Ok(Some(listed))
}

fn mismatch(path: &Path, got: &str, want: &str) -> Error {
    Error::Invalid(format!(
        "{}: corrupt checkpoint: its sha256 is {got}, but {MANIFEST_FILE} (written with the \
         checkpoint) records {want}; the file changed after genslm wrote it",
        path.display()
    ))
}

/// Checks `files` (names inside `dir`) against `dir`'s manifest, reading each from disk. No
/// manifest: nothing to check. A file the manifest lists whose content differs is an error
/// naming the file.
pub fn verify(dir: &Path, files: &[&str]) -> Result<()> {
    let Some(listed) = manifest(dir)? else {
        return Ok(());
    };
    for name in files {
        let Some(want) = listed.get(*name) else {
            continue;
        };
        let path = dir.join(name);
        if !path.is_file() {
            return Err(Error::Invalid(format!(
                "{}: missing, but {MANIFEST_FILE} lists it (incomplete checkpoint)",
                path.display()
            )));
        }
        let got = sha256_file(&path)?;
        if &got != want {
            return Err(mismatch(&path, &got, want));
        }
    }
    Ok(())
}

/// Checks the `bytes` just read from `path` against the manifest beside it, so a large file
/// is hashed from memory rather than read a second time. No manifest, or a file it does not
/// list: nothing to check.
pub fn verify_read(path: &Path, bytes: &[u8]) -> Result<()> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name().and_then(|n| n.to_str())) else {
        return Ok(());
    };
    let Some(want) = manifest(dir)?.and_then(|mut m| m.remove(name)) else {
        return Ok(());
    };
    let got = hex(&Sha256::digest(bytes));
    if got != want {
        return Err(mismatch(path, &got, &want));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// FIPS 180-2's test vector, not this code's own output.
    #[test]
    fn sha256_of_abc_is_the_published_digest() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("abc");
        std::fs::write(&p, b"abc").unwrap();
        assert_eq!(
            sha256_file(&p).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn a_changed_byte_is_named_and_no_manifest_is_fine() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        verify(d, &["a.bin"]).unwrap();
        std::fs::write(d.join("a.bin"), vec![7u8; 3 << 20]).unwrap();
        std::fs::write(d.join("b.txt"), b"hello").unwrap();
        write_manifest(d, &["a.bin", "b.txt"]).unwrap();
        verify(d, &["a.bin", "b.txt", "not-listed"]).unwrap();
        let mut bytes = std::fs::read(d.join("a.bin")).unwrap();
        bytes[2 << 20] ^= 1;
        std::fs::write(d.join("a.bin"), bytes).unwrap();
        verify(d, &["b.txt"]).unwrap();
        verify_read(&d.join("b.txt"), b"hello").unwrap();
        let e = verify(d, &["a.bin"]).unwrap_err().to_string();
        assert!(
            e.contains("a.bin") && e.contains("corrupt checkpoint"),
            "{e}"
        );
        let bytes = std::fs::read(d.join("a.bin")).unwrap();
        let e = verify_read(&d.join("a.bin"), &bytes)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("a.bin") && e.contains("corrupt checkpoint"),
            "{e}"
        );
        std::fs::write(d.join(MANIFEST_FILE), "nonsense\n").unwrap();
        let e = verify(d, &["a.bin"]).unwrap_err().to_string();
        assert!(e.contains(MANIFEST_FILE) && e.contains("line 1"), "{e}");
    }
}
