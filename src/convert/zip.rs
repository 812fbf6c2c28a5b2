//! Just enough of the ZIP format to read `torch.save` archives: the central directory
//! (ZIP64 included, for checkpoints over 4 GiB) and entries that are stored uncompressed,
//! which is how PyTorch always writes them. An entry's bytes are read from its offset on
//! demand, so a large checkpoint is never held in memory whole.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

const EOCD: u32 = 0x0605_4b50;
const ZIP64_LOCATOR: u32 = 0x0706_4b50;
const ZIP64_EOCD: u32 = 0x0606_4b50;
const CENTRAL: u32 = 0x0201_4b50;
const LOCAL: u32 = 0x0403_4b50;

/// Where one stored entry's header starts and how long its data is.
#[derive(Debug, Clone, Copy)]
struct Entry {
    header: u64,
    size: u64,
}

pub struct ZipReader {
    path: PathBuf,
    file: File,
    entries: HashMap<String, Entry>,
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

impl ZipReader {
    /// Opens `path`; `Ok(None)` when it is not a ZIP archive at all (no end-of-directory
    /// record), so the caller can say what else it might be.
    pub fn open(path: &Path) -> Result<Option<Self>> {
        let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        // The end record is 22 bytes plus a comment of at most 65535.
        let tail_len = len.min(22 + 65535);
        let tail = read_at(&mut file, path, len - tail_len, tail_len as usize)?;
        let Some(eocd) = (0..tail.len().saturating_sub(21))
            .rev()
            .find(|&i| u32_at(&tail, i) == EOCD)
        else {
            return Ok(None);
        };
        let bad =
            |what: &str| Error::Invalid(format!("{}: damaged ZIP archive: {what}", path.display()));
        let mut count = u16_at(&tail, eocd + 10) as u64;
        let mut dir_size = u32_at(&tail, eocd + 12) as u64;
        let mut dir_at = u32_at(&tail, eocd + 16) as u64;
        let loc = eocd as i64 - 20;
        if loc >= 0 && u32_at(&tail, loc as usize) == ZIP64_LOCATOR {
            let at = u64_at(&tail, loc as usize + 8);
            let rec = read_at(&mut file, path, at, 56)?;
            if u32_at(&rec, 0) != ZIP64_EOCD {
                return Err(bad("ZIP64 end record missing"));
            }
            count = u64_at(&rec, 32);
            dir_size = u64_at(&rec, 40);
            dir_at = u64_at(&rec, 48);
        }
        if dir_at.checked_add(dir_size).is_none_or(|end| end > len) {
            return Err(bad(
                "central directory past the end of the file (truncated?)",
            ));
        }
        let dir = read_at(&mut file, path, dir_at, dir_size as usize)?;
        let mut entries = HashMap::new();
        let mut at = 0usize;
        for _ in 0..count {
            if at + 46 > dir.len() || u32_at(&dir, at) != CENTRAL {
                return Err(bad("central directory entry"));
            }
            let method = u16_at(&dir, at + 10);
            let mut size = u32_at(&dir, at + 24) as u64;
            let (n, e, c) = (
                u16_at(&dir, at + 28) as usize,
                u16_at(&dir, at + 30) as usize,
                u16_at(&dir, at + 32) as usize,
            );
            let mut header = u32_at(&dir, at + 42) as u64;
            if at + 46 + n + e + c > dir.len() {
                return Err(bad("central directory entry"));
            }
            let name = String::from_utf8_lossy(&dir[at + 46..at + 46 + n]).into_owned();
            // ZIP64 extra field: 64-bit values for those header fields that are saturated,
            // in the order uncompressed size, compressed size, header offset.
            let extra = &dir[at + 46 + n..at + 46 + n + e];
            let mut x = 0;
            while x + 4 <= extra.len() {
                let (id, len) = (u16_at(extra, x), u16_at(extra, x + 2) as usize);
                if id == 1 {
                    let mut f = x + 4;
                    let mut next = || {
                        let v = (f + 8 <= extra.len()).then(|| u64_at(extra, f));
                        f += 8;
                        v
                    };
                    if size == u32::MAX as u64 {
                        size = next().ok_or_else(|| bad("ZIP64 size"))?;
                    }
                    if u32_at(&dir, at + 20) == u32::MAX {
                        next();
                    }
                    if header == u32::MAX as u64 {
                        header = next().ok_or_else(|| bad("ZIP64 offset"))?;
                    }
                }
                x += 4 + len;
            }
            if method != 0 {
                return Err(Error::Invalid(format!(
                    "{}: entry {name} is compressed (method {method}); PyTorch archives store \
                     entries uncompressed — was this file re-zipped?",
                    path.display()
                )));
            }
            // Two entries of one name: which is read was the last listed (a copy of zeros
            // after the weights converted with exit 0); torch.save never writes one twice.
            if entries.contains_key(&name) {
                return Err(bad(&format!("entry {name} is listed twice")));
            }
            entries.insert(name, Entry { header, size });
            at += 46 + n + e + c;
        }
        Ok(Some(ZipReader {
            path: path.to_path_buf(),
            file,
            entries,
        }))
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// The bytes of entry `name`.
    pub fn read(&mut self, name: &str) -> Result<Vec<u8>> {
        let entry = *self.entries.get(name).ok_or_else(|| {
            Error::Invalid(format!(
                "{}: the archive has no entry {name} (truncated or not written by torch.save?)",
                self.path.display()
            ))
        })?;
        let len = self
            .file
            .metadata()
            .map_err(|e| Error::io(&self.path, e))?
            .len();
        if entry.size > len {
            return Err(Error::Invalid(format!(
                "{}: entry {name} claims {} bytes, more than the file holds (damaged archive?)",
                self.path.display(),
                entry.size
            )));
        }
        let local = read_at(&mut self.file, &self.path, entry.header, 30)?;
        if u32_at(&local, 0) != LOCAL {
            return Err(Error::Invalid(format!(
                "{}: damaged ZIP archive: no local header for {name}",
                self.path.display()
            )));
        }
        let data = entry.header + 30 + u16_at(&local, 26) as u64 + u16_at(&local, 28) as u64;
        read_at(&mut self.file, &self.path, data, entry.size as usize)
    }
}

fn read_at(file: &mut File, path: &Path, at: u64, len: usize) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    file.seek(SeekFrom::Start(at))
        .and_then(|_| file.read_exact(&mut buf))
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => Error::Invalid(format!(
                "{}: ends early (truncated archive?)",
                path.display()
            )),
            _ => Error::io(path, e),
        })?;
    Ok(buf)
}
