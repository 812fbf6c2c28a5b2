//! Checks of a safetensors header beyond the `safetensors` crate's: a bound on its size (the
//! crate allows 100 MB, which its parser turns into ~1.6 GB of memory with a million tiny
//! entries), and, when the crate refuses a header, which tensor is wrong and how (its
//! messages such as "invalid shape, data type, or offset for tensor" name none).

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::Dtype;
use serde::Deserialize;

use crate::error::{Error, Result};

/// The largest header read. A GPT-NeoX checkpoint holds ~12 tensors per layer, ~150 bytes of
/// header each: 25B's 64 layers need ~120 KB, so 16 MiB leaves room for any model's metadata.
pub const MAX_HEADER_BYTES: u64 = 16 << 20;

fn corrupt(path: &Path, msg: String) -> Error {
    Error::Invalid(format!("{}: corrupt checkpoint: {msg}", path.display()))
}

/// The header length a safetensors file of `size` bytes starts with (`n8`), refused when it
/// cannot be one: past the file's end, or larger than [`MAX_HEADER_BYTES`].
pub fn header_len(path: &Path, n8: [u8; 8], size: u64) -> Result<u64> {
    let n = u64::from_le_bytes(n8);
    if n.saturating_add(8) > size {
        return Err(corrupt(
            path,
            format!("header of {n} bytes in a {size}-byte file (truncated?)"),
        ));
    }
    if n > MAX_HEADER_BYTES {
        return Err(corrupt(
            path,
            format!(
                "a header of {n} bytes; genslm reads headers of at most {MAX_HEADER_BYTES} \
                 (a model's tensor list takes a few hundred KB)"
            ),
        ));
    }
    Ok(n)
}

#[derive(Deserialize)]
struct Info {
    dtype: Dtype,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

/// Why the header `head` (the JSON after the length) is not a valid tensor list, naming the
/// first wrong tensor in offset order; `fallback` (the crate's message) when nothing specific
/// is found.
pub fn explain(path: &Path, head: &[u8], data: u64, fallback: String) -> Error {
    let Ok(entries) = serde_json::from_slice::<BTreeMap<String, serde_json::Value>>(head) else {
        return corrupt(path, fallback);
    };
    let mut infos = Vec::new();
    for (name, v) in entries.into_iter().filter(|(n, _)| n != "__metadata__") {
        match Info::deserialize(&v) {
            Ok(info) => infos.push((name, info)),
            Err(e) => return corrupt(path, format!("tensor {name}: {e}")),
        }
    }
    infos.sort_by_key(|(_, i)| i.data_offsets);
    let mut start = 0;
    for (name, i) in &infos {
        let (s, e) = i.data_offsets;
        if s != start || e < s {
            return corrupt(
                path,
                format!(
                    "tensor {name}: data_offsets [{s}, {e}] do not follow the previous tensor's \
                     end ({start}): tensors must tile the data without gaps or overlaps"
                ),
            );
        }
        let bits = i
            .shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .and_then(|n| n.checked_mul(i.dtype.bitsize() as u64));
        let want = bits.filter(|b| b % 8 == 0).map(|b| b / 8);
        if want != Some(e - s) {
            let need = match want {
                Some(b) => format!("needs {b} bytes"),
                None => "has no whole-byte size".into(),
            };
            return corrupt(
                path,
                format!(
                    "tensor {name}: {:?} of shape {:?} {need}, its data_offsets hold {}",
                    i.dtype,
                    i.shape,
                    e - s
                ),
            );
        }
        start = e;
    }
    // The crate's "incomplete metadata, file not fully covered" for a cut file.
    if start != data {
        return corrupt(path, data_len_mismatch(start, data));
    }
    corrupt(path, fallback)
}

/// The header's tensors and the file's bytes after it disagree, in words.
pub fn data_len_mismatch(described: u64, held: u64) -> String {
    let why = if held < described {
        ": the file is cut short (an interrupted download or copy?)"
    } else {
        ": bytes follow the last tensor"
    };
    format!("the header describes {described} bytes of tensors, the file holds {held}{why}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn why(head: &str) -> String {
        why_with(head, 4)
    }

    /// With `data` bytes of tensors after the header.
    fn why_with(head: &str, data: u64) -> String {
        explain(
            Path::new("m.safetensors"),
            head.as_bytes(),
            data,
            "fallback".into(),
        )
        .to_string()
    }

    #[test]
    fn the_wrong_tensor_is_named() {
        let e = why(
            r#"{"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"b":{"dtype":"F16","shape":[4],"data_offsets":[24,30]}}"#,
        );
        assert!(
            e.contains("tensor b: F16 of shape [4] needs 8 bytes, its data_offsets hold 6"),
            "{e}"
        );
        let e = why(
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#,
        );
        assert!(e.contains("tensor b: data_offsets [8, 12]"), "{e}");
        let e =
            why(r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}}"#);
        assert!(
            e.contains("tensor a") && e.contains("no whole-byte size"),
            "{e}"
        );
        let e = why(r#"{"a":{"dtype":"Q9","shape":[1],"data_offsets":[0,4]}}"#);
        assert!(e.contains("tensor a:"), "{e}");
        // A valid list: the crate's message stands.
        let e = why(r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#);
        assert!(e.contains("fallback"), "{e}");
        // A valid list in a file cut short, or with bytes after it: said, with the sizes (the
        // crate's "incomplete metadata, file not fully covered").
        let head = r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
        let e = why_with(head, 10);
        assert!(
            e.contains("describes 16 bytes of tensors, the file holds 10: the file is cut short"),
            "{e}"
        );
        assert!(why_with(head, 20).contains("bytes follow the last tensor"));
    }

    #[test]
    fn header_lengths_are_bounded() {
        let p = Path::new("m.safetensors");
        assert_eq!(header_len(p, 10u64.to_le_bytes(), 100).unwrap(), 10);
        let e = header_len(p, 200u64.to_le_bytes(), 100)
            .unwrap_err()
            .to_string();
        assert!(e.contains("header of 200 bytes in a 100-byte file"), "{e}");
        let big = MAX_HEADER_BYTES + 1;
        let e = header_len(p, big.to_le_bytes(), 1 << 40)
            .unwrap_err()
            .to_string();
        assert!(e.contains("genslm reads headers of at most"), "{e}");
        let e = header_len(p, u64::MAX.to_le_bytes(), 1 << 40)
            .unwrap_err()
            .to_string();
        assert!(e.contains("truncated"), "{e}");
    }
}
