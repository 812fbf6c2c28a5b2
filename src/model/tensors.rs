//! Named f32 tensors to and from safetensors files (atomic writes, checked reads).
//!
//! Reads accept F32, F16 and BF16 (GenSLM's published weights are half precision) and always
//! return f32. Every failure names the file and, where there is one, the tensor.

use std::collections::HashMap;
use std::path::Path;

use safetensors::{Dtype, SafeTensors};

use crate::error::{Error, Result};

/// A named host tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// Writes `tensors` (and string `metadata`) to `path` atomically.
pub fn write_safetensors(
    path: &Path,
    tensors: &[HostTensor],
    metadata: HashMap<String, String>,
) -> Result<()> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|t| t.data.iter().flat_map(|v| v.to_le_bytes()).collect())
        .collect();
    let mut views = Vec::with_capacity(tensors.len());
    for (t, b) in tensors.iter().zip(&bytes) {
        let view = safetensors::tensor::TensorView::new(Dtype::F32, t.shape.clone(), b)
            .map_err(|e| Error::Invalid(format!("{}: tensor {}: {e}", path.display(), t.name)))?;
        views.push((t.name.clone(), view));
    }
    let meta = (!metadata.is_empty()).then_some(metadata);
    let out = safetensors::serialize(views, meta)
        .map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))?;
    crate::atomic::write_bytes(path, &out)
}

/// Reads every tensor of a safetensors file as f32, with the file's metadata.
pub fn read_safetensors(
    path: &Path,
) -> Result<(HashMap<String, HostTensor>, HashMap<String, String>)> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let corrupt =
        |msg: String| Error::Invalid(format!("{}: corrupt checkpoint: {msg}", path.display()));
    let st = SafeTensors::deserialize(&bytes).map_err(|e| corrupt(e.to_string()))?;
    let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| corrupt(e.to_string()))?;
    let metadata = meta.metadata().clone().unwrap_or_default();
    let mut out = HashMap::new();
    for name in st.names() {
        let view = st
            .tensor(name)
            .map_err(|e| corrupt(format!("tensor {name}: {e}")))?;
        let raw = view.data();
        let data: Vec<f32> = match view.dtype() {
            Dtype::F32 => raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::F16 => raw
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::BF16 => raw
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => {
                return Err(Error::Invalid(format!(
                    "{}: tensor {name} has dtype {other:?}; genslm reads F32, F16 and BF16",
                    path.display()
                )))
            }
        };
        if data.iter().any(|v| !v.is_finite()) {
            return Err(corrupt(format!(
                "tensor {name} holds NaN or infinite values"
            )));
        }
        out.insert(
            name.to_string(),
            HostTensor {
                name: name.to_string(),
                shape: view.shape().to_vec(),
                data,
            },
        );
    }
    Ok((out, metadata))
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
        write_safetensors(&p, std::slice::from_ref(&t), meta.clone()).unwrap();
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
        std::fs::write(&p, b"garbage").unwrap();
        assert!(read_safetensors(&p)
            .unwrap_err()
            .to_string()
            .contains("corrupt"));
    }
}
