//! Named f32 tensors to and from safetensors files (atomic writes, checked reads).
//!
//! Reads accept F32, F16, BF16 and F64 (GenSLM's published weights are half precision) and always
//! return f32. Every failure names the file and, where there is one, the tensor.

use std::collections::HashMap;
use std::path::Path;

use safetensors::{Dtype, SafeTensors};

use crate::error::{Error, Result};
use crate::model::tensor_header as header;

/// A named host tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// A tensor to write whose values are produced only when its turn comes, so that a file of
/// many GB is written while holding one tensor at a time (not the whole model two or three
/// times over, as serialising into one buffer would).
pub struct Streamed<'a> {
    pub name: String,
    pub shape: Vec<usize>,
    pub values: Box<dyn Fn() -> Vec<f32> + 'a>,
}

/// Writes a safetensors file atomically, one tensor at a time: the header (names, F32, shapes,
/// contiguous offsets, padded to 8 bytes as the format recommends), then each tensor's
/// little-endian bytes through a buffered writer.
pub fn write_safetensors_streamed(
    path: &Path,
    tensors: &[Streamed<'_>],
    metadata: HashMap<String, String>,
) -> Result<()> {
    use std::io::Write;
    let bad = |msg: String| Error::Invalid(format!("{}: {msg}", path.display()));
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), serde_json::json!(metadata));
    }
    let mut offset = 0usize;
    for t in tensors {
        let bytes = 4 * t.shape.iter().product::<usize>();
        let entry = serde_json::json!({
            "dtype": "F32",
            "shape": t.shape,
            "data_offsets": [offset, offset + bytes],
        });
        if header.insert(t.name.clone(), entry).is_some() {
            return Err(bad(format!("tensor {} appears twice", t.name)));
        }
        offset += bytes;
    }
    let mut head = serde_json::to_vec(&header).map_err(|e| bad(e.to_string()))?;
    head.resize(head.len().next_multiple_of(8), b' ');
    let (guard, file) = crate::atomic::AtomicFile::create(path)?;
    let io = |e: std::io::Error| Error::io(guard.tmp_path(), e);
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    w.write_all(&(head.len() as u64).to_le_bytes())
        .map_err(io)?;
    w.write_all(&head).map_err(io)?;
    let mut buf = Vec::with_capacity(1 << 18);
    for t in tensors {
        let v = (t.values)();
        if v.len() != t.shape.iter().product::<usize>() {
            return Err(bad(format!(
                "tensor {}: {} values for shape {:?}",
                t.name,
                v.len(),
                t.shape
            )));
        }
        for chunk in v.chunks(1 << 16) {
            buf.clear();
            chunk
                .iter()
                .for_each(|x| buf.extend_from_slice(&x.to_le_bytes()));
            w.write_all(&buf).map_err(io)?;
        }
    }
    let file = w.into_inner().map_err(|e| io(e.into_error()))?;
    guard.commit(file)
}

/// A file's tensors by name, and its string metadata.
pub type Tensors = HashMap<String, HostTensor>;
pub type Metadata = HashMap<String, String>;

/// Reads every tensor of a safetensors file as f32, with the file's metadata; checked against
/// the sha256 manifest beside it when there is one (`crate::checksum`).
pub fn read_safetensors(path: &Path) -> Result<(Tensors, Metadata)> {
    read_safetensors_except(path, &|_| false).map(|(t, m, _)| (t, m))
}

/// [`read_safetensors`] without the tensors `skip` names, which are neither decoded nor checked
/// (a converter's dropped buffers: a BOOL attention mask refused a file whose weights were
/// fine), and how many were skipped.
pub fn read_safetensors_except(
    path: &Path,
    skip: &dyn Fn(&str) -> bool,
) -> Result<(Tensors, Metadata, usize)> {
    crate::error::file_or_missing(path, "a safetensors file")?;
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    crate::atomic::note_input(path);
    // A genslm checkpoint's manifest catches what parses but changed (a flipped data byte).
    crate::checksum::verify_read(path, &bytes)?;
    let corrupt =
        |msg: String| Error::Invalid(format!("{}: corrupt checkpoint: {msg}", path.display()));
    // The header's length is checked first (bounded; inside the file), and a header the crate
    // refuses is explained naming the tensor.
    let Some(n8) = bytes.get(..8) else {
        return Err(corrupt(format!(
            "{} bytes: too short to hold a header",
            bytes.len()
        )));
    };
    let n = header::header_len(path, n8.try_into().unwrap_or_default(), bytes.len() as u64)?;
    let head = &bytes[8..8 + n as usize];
    let st = SafeTensors::deserialize(&bytes).map_err(|e| {
        let data = bytes.len() as u64 - 8 - n;
        header::explain(path, head, data, e.to_string())
    })?;
    let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| corrupt(e.to_string()))?;
    let metadata = meta.metadata().clone().unwrap_or_default();
    let (mut out, mut skipped) = (HashMap::new(), 0);
    for name in st.names() {
        if skip(name) {
            skipped += 1;
            continue;
        }
        let view = st
            .tensor(name)
            .map_err(|e| corrupt(format!("tensor {name}: {e}")))?;
        let data = decode(path, name, view.dtype(), view.data())?;
        out.insert(
            name.to_string(),
            HostTensor {
                name: name.to_string(),
                shape: view.shape().to_vec(),
                data,
            },
        );
    }
    Ok((out, metadata, skipped))
}

/// A tensor's little-endian bytes as f32, refusing dtypes genslm does not read and values
/// that are not finite.
fn decode(path: &Path, name: &str, dtype: Dtype, raw: &[u8]) -> Result<Vec<f32>> {
    let width = match dtype {
        Dtype::F32 => 4,
        Dtype::F16 | Dtype::BF16 => 2,
        // As convert reads F64 from torch.save files (safetensors refused the same weights).
        Dtype::F64 => 8,
        other => {
            return Err(Error::Invalid(format!(
                "{}: tensor {name} has dtype {other:?}; genslm reads F32, F16, BF16 and F64",
                path.display()
            )))
        }
    };
    // Reserved fallibly: a hostile header declaring a 2 GB tensor of a sparse file aborted the
    // process when the f32 copy did not fit (the file's own bytes had been read).
    let mut data: Vec<f32> = Vec::new();
    data.try_reserve_exact(raw.len() / width).map_err(|_| {
        Error::Invalid(format!(
            "{}: tensor {name}: its {} MB as f32 do not fit in memory",
            path.display(),
            (raw.len() / width * 4) >> 20
        ))
    })?;
    let chunks = raw.chunks_exact(width);
    match dtype {
        Dtype::F32 => data.extend(chunks.map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
        Dtype::F16 => data.extend(chunks.map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())),
        Dtype::BF16 => {
            data.extend(chunks.map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()))
        }
        _ => {
            data.extend(chunks.map(|c| {
                f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32
            }))
        }
    }
    if data.iter().any(|v| !v.is_finite()) {
        return Err(Error::Invalid(format!(
            "{}: corrupt checkpoint: tensor {name} holds NaN or infinite values{}",
            path.display(),
            if dtype == Dtype::F64 {
                " (or F64 values beyond f32's range)"
            } else {
                ""
            }
        )));
    }
    Ok(data)
}

/// A safetensors file read one tensor at a time: the header is parsed once and each tensor's
/// bytes are read with a seek, so a rank loading its share of a model of many GB never holds
/// the whole file. It does not check the sha256 manifest (that needs every byte): callers
/// check the files once with `checksum::verify`.
pub struct TensorFile {
    path: std::path::PathBuf,
    /// Where the tensor data starts in the file.
    data_start: u64,
    header: safetensors::tensor::Metadata,
}

impl TensorFile {
    pub fn open(path: &Path) -> Result<Self> {
        use std::io::Read;
        let corrupt =
            |msg: String| Error::Invalid(format!("{}: corrupt checkpoint: {msg}", path.display()));
        crate::error::file_or_missing(path, "a safetensors file")?;
        let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        crate::atomic::note_input(path);
        let size = f.metadata().map_err(|e| Error::io(path, e))?.len();
        let mut n = [0u8; 8];
        f.read_exact(&mut n)
            .map_err(|_| corrupt(format!("{size} bytes: too short to hold a header")))?;
        let n = header::header_len(path, n, size)?;
        let mut head = vec![0u8; n as usize];
        f.read_exact(&mut head)
            .map_err(|e| corrupt(e.to_string()))?;
        let header: safetensors::tensor::Metadata = serde_json::from_slice(&head)
            .map_err(|e| header::explain(path, &head, size - 8 - n, e.to_string()))?;
        if header.data_len() as u64 != size - 8 - n {
            return Err(corrupt(header::data_len_mismatch(
                header.data_len() as u64,
                size - 8 - n,
            )));
        }
        Ok(Self {
            path: path.to_path_buf(),
            data_start: 8 + n,
            header,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's string metadata.
    pub fn metadata(&self) -> HashMap<String, String> {
        self.header.metadata().clone().unwrap_or_default()
    }

    /// Tensor `name` as f32 (an error naming the file when it is absent).
    pub fn read(&self, name: &str) -> Result<HostTensor> {
        use std::io::{Read, Seek, SeekFrom};
        let info = self.header.info(name).ok_or_else(|| {
            Error::Invalid(format!("{}: tensor {name} is missing", self.path.display()))
        })?;
        let (a, b) = info.data_offsets;
        let mut raw = vec![0u8; b - a];
        let mut f = std::fs::File::open(&self.path).map_err(|e| Error::io(&self.path, e))?;
        f.seek(SeekFrom::Start(self.data_start + a as u64))
            .and_then(|_| f.read_exact(&mut raw))
            .map_err(|e| Error::io(&self.path, e))?;
        Ok(HostTensor {
            name: name.to_string(),
            shape: info.shape.clone(),
            data: decode(&self.path, name, info.dtype, &raw)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_corruption() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.safetensors");
        let t = HostTensor {
            name: "a.weight".into(),
            shape: vec![2, 3],
            data: vec![1.0, -2.0, 3.5, 0.0, 1e-3, 7.0],
        };
        let meta = HashMap::from([("k".to_string(), "v".to_string())]);
        let s = Streamed {
            name: t.name.clone(),
            shape: t.shape.clone(),
            values: Box::new(|| t.data.clone()),
        };
        write_safetensors_streamed(&p, &[s], meta.clone()).unwrap();
        let (back, m) = read_safetensors(&p).unwrap();
        assert_eq!(back["a.weight"], t);
        assert_eq!(m, meta);
        // Cut the file: a clear error naming it, no panic.
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 5]).unwrap();
        let e = read_safetensors(&p).unwrap_err().to_string();
        assert!(
            e.contains("corrupt checkpoint") && e.contains("t.safetensors"),
            "{e}"
        );
        // F64 (numpy's default, which some exporters keep) is read as f32, as convert reads
        // it from torch.save files; a value past f32's range is refused.
        let f64_file = |values: &[f64]| {
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            let view = safetensors::tensor::TensorView::new(
                safetensors::Dtype::F64,
                vec![values.len()],
                &bytes,
            )
            .unwrap();
            safetensors::serialize_to_file([("w", view)], None, &p).unwrap();
        };
        f64_file(&[0.25, -1.5e-3, 3.0]);
        let (back, _) = read_safetensors(&p).unwrap();
        assert_eq!(back["w"].data, [0.25f32, -1.5e-3, 3.0]);
        f64_file(&[1e300]);
        let e = read_safetensors(&p).unwrap_err().to_string();
        assert!(e.contains("beyond f32's range"), "{e}");
        std::fs::write(&p, b"garbage").unwrap();
        assert!(read_safetensors(&p)
            .unwrap_err()
            .to_string()
            .contains("corrupt"));
    }

    /// Skipped tensors are neither decoded nor checked: a BOOL mask beside an F32 weight is
    /// refused when read, and left out (counted) when skipped, the weight read either way.
    #[test]
    fn skipped_tensors_are_not_checked() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.safetensors");
        let w: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let mask = [1u8, 0, 1, 1];
        let view = |d, shape, b| safetensors::tensor::TensorView::new(d, shape, b).unwrap();
        safetensors::serialize_to_file(
            [
                ("w", view(safetensors::Dtype::F32, vec![2], &w[..])),
                (
                    "mask",
                    view(safetensors::Dtype::BOOL, vec![2, 2], &mask[..]),
                ),
            ],
            None,
            &p,
        )
        .unwrap();
        let e = read_safetensors(&p).unwrap_err().to_string();
        assert!(e.contains("mask") && e.contains("BOOL"), "{e}");
        let (t, _, skipped) = read_safetensors_except(&p, &|n| n == "mask").unwrap();
        assert_eq!((t.len(), skipped), (1, 1));
        assert_eq!(t["w"].data, [1.5f32, -2.0]);
    }
}
