//! Checkpoint manifests: the sha256 of every file genslm writes into a checkpoint, kept in
//! `checksums.sha256` beside them and checked when genslm loads the checkpoint again.
//!
//! safetensors has no checksum of its own: a flipped byte inside tensor data still parses and
//! loads as a different model. The manifest is in `sha256sum`'s format, so
//! `sha256sum -c checksums.sha256` in the checkpoint directory checks it without genslm.
//! A directory without a manifest loads as before when it is a foreign model (a Hugging Face
//! directory, a Hugging Face Trainer checkpoint); one that is plainly genslm's own checkpoint
//! (optimizer shards, or `trainer_state.json` beside `genslm.toml`) is refused without one,
//! and so is any file such a checkpoint's manifest does not list: otherwise deleting or
//! trimming the manifest would switch every check off.

use std::collections::HashMap;
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// The manifest's file name inside a checkpoint directory.
pub const MANIFEST_FILE: &str = "checksums.sha256";

/// Files only a genslm training checkpoint holds (`train::checkpoint` and
/// `train::optim_shards` name theirs with these): their presence makes the manifest mandatory.
pub(crate) const GENSLM_STATE_FILE: &str = "trainer_state.json";
pub(crate) const GENSLM_SHARD_PREFIX: &str = "optimizer-rank";
pub(crate) const GENSLM_SETTINGS_FILE: &str = "genslm.toml";

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
    crate::error::file_or_missing(path, "a checkpoint file")?;
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
    // A named pipe in its place would block the read for ever.
    crate::error::file_or_missing(&path, "the model's sha256 manifest")?;
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(&path, e)),
    };
    // Read with the model's files, and needed to load them again: no output may replace it.
    crate::atomic::note_input(&path);
    let mut listed = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        // sha256sum writes "HASH  name", or "HASH *name" in binary mode.
        let entry = (line.len() > 66 && line.is_char_boundary(64))
            .then(|| (&line[..64], &line[64..]))
            .and_then(|(h, rest)| {
                let name = rest
                    .strip_prefix("  ")
                    .or_else(|| rest.strip_prefix(" *"))?;
                let ok = h.bytes().all(|b| b.is_ascii_hexdigit()) && !name.is_empty();
                ok.then_some((h, name))
            });
        let Some((hash, name)) = entry else {
            return Err(Error::Invalid(format!(
                "{}: line {}: not a sha256sum line ('<64 hex digits>  <file>')",
                path.display(),
                i + 1
            )));
        };
        // `sha256sum -c` reads "./name" as "name", and checks every line: a file listed twice
        // with two hashes cannot match both, so the manifest is refused, not read by its last
        // line (a wrong line placed first was ignored).
        let name = name.strip_prefix("./").unwrap_or(name);
        let hash = hash.to_ascii_lowercase();
        if let Some(before) = listed.insert(name.to_string(), hash.clone()) {
            if before != hash {
                return Err(Error::Invalid(format!(
                    "{}: line {}: {name} is listed again with another hash; the file cannot \
                     match both",
                    path.display(),
                    i + 1
                )));
            }
        }
    }
    Ok(Some(listed))
}

/// The file names `dir`'s manifest lists (sorted); `None` without a readable manifest.
pub fn listed_names(dir: &Path) -> Option<Vec<String>> {
    let mut names: Vec<String> = manifest(dir).ok()??.into_keys().collect();
    names.sort();
    Some(names)
}

/// The entries of `dir` that are neither its manifest nor listed in it (sorted); `None` when
/// `dir` has no readable manifest. A checkpoint genslm wrote has none: anything else in it
/// is somebody else's, which pruning must not delete.
pub fn unlisted_entries(dir: &Path) -> Option<Vec<String>> {
    let listed = manifest(dir).ok()??;
    let mut other: Vec<String> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != MANIFEST_FILE && !listed.contains_key(n))
        .collect();
    other.sort();
    Some(other)
}

fn mismatch(path: &Path, got: &str, want: &str) -> Error {
    Error::Invalid(format!(
        "{}: corrupt checkpoint: its sha256 is {got}, but {MANIFEST_FILE} (written with the \
         checkpoint) records {want}; the file changed after genslm wrote it",
        path.display()
    ))
}

/// What makes `dir` a genslm training checkpoint, if anything: an optimizer shard, or the
/// trainer state beside genslm's settings. (`trainer_state.json` alone is no sign: the
/// Hugging Face Trainer writes one into every checkpoint of its own.)
fn genslm_marker(dir: &Path) -> Option<String> {
    if dir.join(GENSLM_STATE_FILE).exists() && dir.join(GENSLM_SETTINGS_FILE).exists() {
        return Some(format!("{GENSLM_STATE_FILE} and {GENSLM_SETTINGS_FILE}"));
    }
    std::fs::read_dir(dir).ok()?.flatten().find_map(|e| {
        let name = e.file_name().to_string_lossy().into_owned();
        name.starts_with(GENSLM_SHARD_PREFIX).then_some(name)
    })
}

/// A manifest (file name → hex sha256) and what makes its directory genslm's, if anything.
type Manifest = (HashMap<String, String>, Option<String>);

/// The manifest of `dir`, or an error when `dir` is a genslm checkpoint without one.
fn required_manifest(dir: &Path) -> Result<Option<Manifest>> {
    let marker = genslm_marker(dir);
    match (manifest(dir)?, marker) {
        (Some(m), marker) => Ok(Some((m, marker))),
        (None, None) => Ok(None),
        // Without its weights too, it is what a stopped copy or removal left: no manifest
        // written now could make it whole.
        (None, Some(marker)) if !dir.join("model.safetensors").exists() => {
            Err(Error::Invalid(format!(
                "{}: an incomplete genslm checkpoint (it holds {marker}, but neither \
                 model.safetensors nor its {MANIFEST_FILE}): a copy or a removal stopped part \
                 way; use another checkpoint",
                dir.display()
            )))
        }
        (None, Some(marker)) => Err(Error::Invalid(format!(
            "{}: a genslm checkpoint (it holds {marker}) without its {MANIFEST_FILE}: its files \
             cannot be checked, so it is refused. Restore the manifest from a copy; if you trust \
             the files as they are, write one with `sha256sum` over them (its format)",
            dir.display()
        ))),
    }
}

/// A file a genslm checkpoint's manifest does not list.
fn unlisted(path: &Path, marker: &str) -> Error {
    Error::Invalid(format!(
        "{}: not listed in {MANIFEST_FILE} of this genslm checkpoint (it holds {marker}), so it \
         cannot be checked and is refused; the manifest was edited or belongs to other files",
        path.display()
    ))
}

/// Checks `files` (names inside `dir`) against `dir`'s manifest, reading each from disk. No
/// manifest: nothing to check, unless `dir` is a genslm checkpoint (an error). A file the
/// manifest lists whose content differs is an error naming the file; so is a file that exists
/// but is not listed, in a genslm checkpoint.
pub fn verify(dir: &Path, files: &[&str]) -> Result<()> {
    let Some((listed, marker)) = required_manifest(dir)? else {
        return Ok(());
    };
    for name in files {
        let Some(want) = listed.get(*name) else {
            // A file that is not there is not read (callers treat absent optional files,
            // such as genslm.toml, themselves).
            match &marker {
                Some(m) if dir.join(name).exists() => return Err(unlisted(&dir.join(name), m)),
                _ => continue,
            }
        };
        let path = dir.join(name);
        if !path.is_file() {
            return Err(Error::Invalid(match crate::error::not_a_file(&path) {
                "missing" => format!(
                    "{}: missing, but {MANIFEST_FILE} lists it (incomplete checkpoint)",
                    path.display()
                ),
                what => format!(
                    "{}: {what}, where {MANIFEST_FILE} lists a file",
                    path.display()
                ),
            }));
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
/// list: nothing to check, unless the directory is a genslm checkpoint (as in [`verify`]).
pub fn verify_read(path: &Path, bytes: &[u8]) -> Result<()> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name().and_then(|n| n.to_str())) else {
        return Ok(());
    };
    let Some((mut listed, marker)) = required_manifest(dir)? else {
        return Ok(());
    };
    let Some(want) = listed.remove(name) else {
        return match marker {
            Some(m) => Err(unlisted(path, &m)),
            None => Ok(()),
        };
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

    #[test]
    fn a_genslm_checkpoint_needs_a_manifest_that_lists_what_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("model.safetensors"), b"weights").unwrap();
        std::fs::write(d.join("genslm.toml"), b"[train]").unwrap();
        // A foreign directory: no manifest, nothing to check.
        verify(d, &["model.safetensors"]).unwrap();
        for marker in [
            "trainer_state.json",
            "optimizer-rank00000-of-00001.safetensors",
        ] {
            std::fs::write(d.join(marker), b"{}").unwrap();
            let e = verify(d, &["model.safetensors"]).unwrap_err().to_string();
            assert!(
                e.contains(marker) && e.contains("without its checksums"),
                "{e}"
            );
            let e = verify_read(&d.join("model.safetensors"), b"weights").unwrap_err();
            assert!(e.to_string().contains(marker), "{e}");
            std::fs::remove_file(d.join(marker)).unwrap();
        }
        // A Hugging Face Trainer checkpoint has a trainer_state.json but no genslm.toml: it
        // loads unchecked, as any foreign directory.
        std::fs::rename(d.join("genslm.toml"), d.join("other.toml")).unwrap();
        std::fs::write(d.join("trainer_state.json"), b"{}").unwrap();
        verify(d, &["model.safetensors"]).unwrap();
        std::fs::rename(d.join("other.toml"), d.join("genslm.toml")).unwrap();
        // A manifest that leaves out a file the command reads (here genslm.toml) checks it
        // no longer: refused, and an empty manifest likewise.
        write_manifest(d, &["model.safetensors", "trainer_state.json"]).unwrap();
        verify(d, &["model.safetensors"]).unwrap();
        let e = verify(d, &["model.safetensors", "genslm.toml"]).unwrap_err();
        assert!(e.to_string().contains("genslm.toml: not listed"), "{e}");
        std::fs::write(d.join(MANIFEST_FILE), b"").unwrap();
        assert!(verify_read(&d.join("model.safetensors"), b"weights").is_err());
    }

    #[test]
    fn sha256sum_binary_mode_lines_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("abc"), b"abc").unwrap();
        // FIPS 180-2's digest of "abc", as `sha256sum -b abc` writes it.
        let line = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad *abc\n";
        std::fs::write(d.join(MANIFEST_FILE), line).unwrap();
        verify(d, &["abc"]).unwrap();
        std::fs::write(d.join("abc"), b"abd").unwrap();
        assert!(verify(d, &["abc"]).is_err());
    }

    /// As `sha256sum -c` reads a manifest: "./abc" is abc, and a file listed twice with two
    /// hashes fails whichever line comes first (the last line used to win).
    #[test]
    fn dot_slash_names_are_read_and_a_file_listed_twice_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("abc"), b"abc").unwrap();
        let good = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        let bad = "0".repeat(64);
        std::fs::write(d.join(MANIFEST_FILE), format!("{good}  ./abc\n")).unwrap();
        verify(d, &["abc"]).unwrap();
        std::fs::write(
            d.join(MANIFEST_FILE),
            format!("{good}  abc\n{good}  ./abc\n"),
        )
        .unwrap();
        verify(d, &["abc"]).unwrap();
        for text in [
            format!("{bad}  abc\n{good}  abc\n"),
            format!("{good}  abc\n{bad}  ./abc\n"),
        ] {
            std::fs::write(d.join(MANIFEST_FILE), text).unwrap();
            let e = verify(d, &["abc"]).unwrap_err().to_string();
            assert!(e.contains("line 2") && e.contains("listed again"), "{e}");
        }
    }
}
