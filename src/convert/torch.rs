//! `torch.save` files (PyTorch ≥ 1.6's ZIP layout): `<name>/data.pkl` holds the object graph,
//! `<name>/data/<key>` the raw little-endian bytes of each storage. Tensors appear in the
//! pickle as calls to `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`,
//! which [`pickle`](super::pickle) records without running; this module reads those records
//! and the storages they point at, and nothing else.

use std::path::{Path, PathBuf};

use super::pickle::{self, Value};
use super::zip::ZipReader;
use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DType {
    F64,
    F32,
    F16,
    BF16,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
}

impl DType {
    /// From the legacy storage class names that `torch.save` still writes.
    fn from_storage(name: &str) -> Option<DType> {
        Some(match name {
            "DoubleStorage" => DType::F64,
            "FloatStorage" => DType::F32,
            "HalfStorage" => DType::F16,
            "BFloat16Storage" => DType::BF16,
            "LongStorage" => DType::I64,
            "IntStorage" => DType::I32,
            "ShortStorage" => DType::I16,
            "CharStorage" => DType::I8,
            "ByteStorage" => DType::U8,
            "BoolStorage" => DType::Bool,
            _ => return None,
        })
    }
    /// Whether values of this type can be a model weight (integers and booleans cannot: cast,
    /// they give a model of nonsense that loads).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F64 | DType::F32 | DType::F16 | DType::BF16)
    }
    fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }
    fn to_f32(self, b: &[u8]) -> f32 {
        match self {
            DType::F64 => f64::from_le_bytes(b.try_into().unwrap()) as f32,
            DType::F32 => f32::from_le_bytes(b.try_into().unwrap()),
            DType::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
            DType::BF16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
            DType::I64 => i64::from_le_bytes(b.try_into().unwrap()) as f32,
            DType::I32 => i32::from_le_bytes(b.try_into().unwrap()) as f32,
            DType::I16 => i16::from_le_bytes([b[0], b[1]]) as f32,
            DType::I8 => b[0] as i8 as f32,
            DType::U8 | DType::Bool => b[0] as f32,
        }
    }
}

/// Where a tensor's values are: a view (offset, shape, strides in elements) of one storage.
#[derive(Debug, Clone)]
pub struct TensorRef {
    pub dtype: DType,
    pub storage: String,
    pub offset: usize,
    pub shape: Vec<usize>,
    pub stride: Vec<usize>,
}

/// Dimensions a tensor record may have: GPT-NeoX's weights have one or two.
const MAX_DIMS: usize = 8;

pub struct TorchFile {
    path: PathBuf,
    zip: ZipReader,
    prefix: String,
    pub root: Value,
}

impl TorchFile {
    /// `Ok(None)` when `path` is not a ZIP archive (the caller knows what else to try).
    pub fn open(path: &Path) -> Result<Option<TorchFile>> {
        let Some(mut zip) = ZipReader::open(path)? else {
            return Ok(None);
        };
        let mut pkls: Vec<&str> = zip
            .names()
            .filter(|n| n.ends_with("/data.pkl") && n.matches('/').count() == 1)
            .collect();
        // The archive's entries are a hash map: with two records, which one was read changed
        // from run to run (the weights, or another record's zeros, exit 0 either way).
        pkls.sort_unstable();
        if pkls.len() > 1 {
            return Err(Error::Invalid(format!(
                "{}: the archive holds {} torch.save records ({}): which one is the model is \
                 ambiguous (torch.load refuses such an archive too)",
                path.display(),
                pkls.len(),
                pkls.join(", ")
            )));
        }
        let pkl = pkls.first().map(|s| s.to_string()).ok_or_else(|| {
            Error::Invalid(format!(
                "{}: a ZIP archive without <name>/data.pkl: not written by torch.save",
                path.display()
            ))
        })?;
        let prefix = pkl.trim_end_matches("data.pkl").to_string();
        let order = format!("{prefix}byteorder");
        if zip.names().any(|n| n == order) && zip.read(&order)? != b"little" {
            return Err(Error::Invalid(format!(
                "{}: big-endian tensors are not supported",
                path.display()
            )));
        }
        let bytes = zip.read(&pkl)?;
        let root = pickle::load(&bytes).map_err(|e| {
            Error::Invalid(format!("{}: {pkl}: unreadable pickle: {e}", path.display()))
        })?;
        Ok(Some(TorchFile {
            path: path.to_path_buf(),
            zip,
            prefix,
            root,
        }))
    }

    fn bad(&self, msg: impl std::fmt::Display) -> Error {
        Error::Invalid(format!("{}: {msg}", self.path.display()))
    }

    /// The named tensors of the model: Lightning's `state_dict` entry when the file is a
    /// training checkpoint, else the top-level mapping (`pytorch_model.bin`). Every entry must
    /// be a tensor; anything else is named in the error.
    pub fn state_dict(&self) -> Result<Vec<(String, TensorRef)>> {
        let Value::Dict(top) = &self.root else {
            return Err(self.bad(format!(
                "holds {}, not a checkpoint or a state dict",
                self.root.kind()
            )));
        };
        let top = top.borrow();
        let entry = |k: &str| top.iter().find(|(key, _)| key.as_str() == Some(k));
        let (sd, within) = match entry("state_dict").or_else(|| entry("module")) {
            Some((k, v)) => (v.clone(), format!(" of its {}", k.as_str().unwrap_or("?"))),
            None if top.iter().any(|(_, v)| self.tensor(v).is_ok()) => {
                (self.root.clone(), String::new())
            }
            None => {
                let keys: Vec<&str> = top.iter().filter_map(|(k, _)| k.as_str()).take(8).collect();
                return Err(self.bad(format!(
                    "holds a dict with no state_dict entry and no tensors (keys: {})",
                    keys.join(", ")
                )));
            }
        };
        let Value::Dict(sd) = &sd else {
            return Err(self.bad(format!(
                "the state dict{within} is {}, not a dict",
                sd.kind()
            )));
        };
        let mut out = Vec::new();
        for (k, v) in sd.borrow().iter() {
            let name = k
                .as_str()
                .ok_or_else(|| self.bad(format!("a key{within} is {}, not a name", k.kind())))?;
            let t = self.tensor(v).map_err(|why| {
                self.bad(format!("key '{name}'{within} holds {why}, not a tensor"))
            })?;
            out.push((name.to_string(), t));
        }
        Ok(out)
    }

    /// Reads a `_rebuild_tensor_v2` record (or a parameter wrapping one).
    fn tensor(&self, v: &Value) -> std::result::Result<TensorRef, String> {
        self.tensor_within(v, 0)
    }

    /// `wrapped`: how many parameters around this record; torch writes one, a file may nest
    /// them a million deep, which a recursion without a bound would follow off the stack.
    fn tensor_within(&self, v: &Value, wrapped: usize) -> std::result::Result<TensorRef, String> {
        let Value::Object(o) = v else {
            return Err(v.kind());
        };
        let o = o.borrow();
        match (o.module.as_str(), o.name.as_str()) {
            ("torch._utils", "_rebuild_parameter" | "_rebuild_parameter_with_state") => {
                if wrapped >= 4 {
                    return Err("a parameter of a parameter of ... (nested 5 deep or more)".into());
                }
                let inner = o.args.first().ok_or("a parameter without data")?;
                return self.tensor_within(inner, wrapped + 1);
            }
            ("torch._utils", "_rebuild_tensor_v2" | "_rebuild_tensor") => {}
            _ => return Err(v.kind()),
        }
        let bad = || format!("a malformed tensor record ({}.{})", o.module, o.name);
        let [storage, offset, size, stride, ..] = o.args.as_slice() else {
            return Err(bad());
        };
        let Value::PersId(pid) = storage else {
            return Err(bad());
        };
        // ('storage', torch.<Type>Storage, key, location, numel)
        let pid = pid.items().ok_or_else(bad)?;
        let (Some(Value::Global(class)), Some(key)) =
            (pid.get(1), pid.get(2).and_then(Value::as_str))
        else {
            return Err(bad());
        };
        let dtype = DType::from_storage(&class.1)
            .ok_or_else(|| format!("a tensor of storage type {}.{}", class.0, class.1))?;
        // Checked before the tuple is copied: a pickle can give a million-entry size tuple to
        // every tensor for the cost of one (memo references), 16 bytes an entry each time.
        if [size, stride]
            .iter()
            .any(|v| v.item_count().is_none_or(|n| n > MAX_DIMS))
        {
            return Err(format!(
                "a tensor record whose size or stride is not a tuple of at most {MAX_DIMS} \
                 dimensions"
            ));
        }
        let ints = |v: &Value| -> Option<Vec<usize>> {
            v.items()?
                .iter()
                .map(|x| x.as_int().and_then(|i| usize::try_from(i).ok()))
                .collect()
        };
        let shape = ints(size).ok_or_else(bad)?;
        let stride = ints(stride).ok_or_else(bad)?;
        let offset = offset.as_int().and_then(|i| usize::try_from(i).ok());
        if stride.len() != shape.len() {
            return Err(bad());
        }
        Ok(TensorRef {
            dtype,
            storage: key.to_string(),
            offset: offset.ok_or_else(bad)?,
            shape,
            stride,
        })
    }

    /// The values of `t` in row-major order, as f32 (f64/f16/bf16 converted, integers cast).
    pub fn load(&mut self, name: &str, t: &TensorRef) -> Result<Vec<f32>> {
        let entry = format!("{}data/{}", self.prefix, t.storage);
        let bytes = self.zip.read(&entry)?;
        let es = t.dtype.size();
        let past = || {
            self.bad(format!(
                "tensor '{name}' reaches past the end of its storage {entry} (damaged file?)"
            ))
        };
        // Checked arithmetic: the sizes come from the file, so they may be anything.
        let numel = t
            .shape
            .iter()
            .try_fold(1usize, |a, &n| a.checked_mul(n))
            .ok_or_else(past)?;
        let last = t
            .shape
            .iter()
            .zip(&t.stride)
            .try_fold(t.offset, |a, (&n, &s)| {
                a.checked_add(n.saturating_sub(1).checked_mul(s)?)
            });
        let end = last.and_then(|l| l.checked_add(1)?.checked_mul(es));
        if numel > 0 && end.is_none_or(|e| e > bytes.len()) {
            return Err(past());
        }
        // A stride of 0 repeats elements: a 500-byte file could ask for 2^34 of them (64 GiB).
        // Weights never share elements, so a tensor may not hold more than its storage does.
        if numel > bytes.len() / es {
            return Err(self.bad(format!(
                "tensor '{name}' has {numel} elements but its storage {entry} holds {} \
                 (a broadcast view, stride 0?): not a weight",
                bytes.len() / es
            )));
        }
        let values = self.values(t, &bytes, numel)?;
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            return Err(self.bad(format!(
                "tensor '{name}' holds a value that is not finite as f32 at element {i} (NaN, \
                 infinite, or an F64 beyond f32's range): not a usable weight"
            )));
        }
        Ok(values)
    }

    /// `t`'s `numel` values from its storage's `bytes` (bounds checked by the caller).
    fn values(&self, t: &TensorRef, bytes: &[u8], numel: usize) -> Result<Vec<f32>> {
        let es = t.dtype.size();
        let contiguous = (0..t.shape.len())
            .all(|d| t.shape[d] == 1 || t.stride[d] == t.shape[d + 1..].iter().product::<usize>());
        if contiguous {
            let b = &bytes[t.offset * es..(t.offset + numel) * es];
            return Ok(b.chunks_exact(es).map(|c| t.dtype.to_f32(c)).collect());
        }
        let mut out = Vec::with_capacity(numel);
        let mut idx = vec![0usize; t.shape.len()];
        for _ in 0..numel {
            let at: usize = t.offset + idx.iter().zip(&t.stride).map(|(i, s)| i * s).sum::<usize>();
            out.push(t.dtype.to_f32(&bytes[at * es..(at + 1) * es]));
            // Row-major odometer over the shape.
            for d in (0..idx.len()).rev() {
                idx[d] += 1;
                if idx[d] < t.shape[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// tests/fixtures/torch_views.pt is written by torch.save (scripts/make_pt_fixture.py);
    /// the expected values are the formulas that script builds its tensors from.
    #[test]
    fn reads_what_torch_save_wrote() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/torch_views.pt");
        let mut f = TorchFile::open(&path).unwrap().expect("a zip archive");
        let sd = f.state_dict().unwrap();
        let mut got = HashMap::new();
        for (k, t) in &sd {
            got.insert(k.clone(), (t.shape.clone(), f.load(k, t).unwrap()));
        }
        let a: Vec<f32> = (0..12).map(|x| x as f32).collect();
        let at: Vec<f32> = (0..4)
            .flat_map(|j| (0..3).map(move |i| (4 * i + j) as f32))
            .collect();
        let every: Vec<f32> = (0..3)
            .flat_map(|i| (0..2).map(move |j| (4 * i + 2 * j) as f32))
            .collect();
        let expect: Vec<(&str, Vec<usize>, Vec<f32>)> = vec![
            ("model.a", vec![3, 4], a),
            ("model.a_t", vec![4, 3], at),
            ("model.row", vec![4], vec![4.0, 5.0, 6.0, 7.0]),
            ("model.every_other", vec![3, 2], every),
            ("model.half", vec![5], vec![0.0, 0.5, 1.0, 1.5, 2.0]),
            ("model.bf16", vec![5], vec![-2.0, -1.0, 0.0, 1.0, 2.0]),
            ("model.double", vec![4], vec![0.0, 0.125, 0.25, 0.375]),
            ("model.long", vec![3], vec![0.0, 1000.0, 2000.0]),
            ("model.mask", vec![2, 2], vec![1.0, 0.0, 1.0, 1.0]),
            ("model.scalar", vec![], vec![-3.25]),
        ];
        assert_eq!(sd.len(), expect.len());
        for (k, shape, values) in expect {
            assert_eq!(got[k], (shape, values), "{k}");
        }
    }

    /// A stored (uncompressed) ZIP of `entries`, as torch.save writes one (CRCs left 0: the
    /// reader does not check them).
    fn stored_zip(entries: &[(String, Vec<u8>)]) -> Vec<u8> {
        let (mut out, mut central) = (Vec::new(), Vec::new());
        let le16 = |v: &mut Vec<u8>, x: usize| v.extend_from_slice(&(x as u16).to_le_bytes());
        let le32 = |v: &mut Vec<u8>, x: usize| v.extend_from_slice(&(x as u32).to_le_bytes());
        for (name, data) in entries {
            let at = out.len();
            le32(&mut out, 0x0403_4b50);
            for x in [20, 0, 0, 0, 0] {
                le16(&mut out, x);
            }
            for x in [0, data.len(), data.len()] {
                le32(&mut out, x);
            }
            le16(&mut out, name.len());
            le16(&mut out, 0);
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(data);
            le32(&mut central, 0x0201_4b50);
            for x in [20, 20, 0, 0, 0, 0] {
                le16(&mut central, x);
            }
            for x in [0, data.len(), data.len()] {
                le32(&mut central, x);
            }
            for x in [name.len(), 0, 0, 0, 0] {
                le16(&mut central, x);
            }
            le32(&mut central, 0);
            le32(&mut central, at);
            central.extend_from_slice(name.as_bytes());
        }
        let dir_at = out.len();
        out.extend_from_slice(&central);
        le32(&mut out, 0x0605_4b50);
        for x in [0, 0, entries.len(), entries.len()] {
            le16(&mut out, x);
        }
        le32(&mut out, central.len());
        le32(&mut out, dir_at);
        le16(&mut out, 0);
        out
    }

    /// An archive of two torch.save records is refused naming both: the reader took whichever
    /// its hash map gave first, the weights or the other record's, exit 0 either way. The
    /// same records under one prefix read as the fixture does.
    #[test]
    fn two_records_in_one_archive_are_refused() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/torch_views.pt");
        let mut z = ZipReader::open(&path).unwrap().unwrap();
        let names: Vec<String> = z.names().map(str::to_string).collect();
        let mut records = Vec::new();
        for n in &names {
            let rest = n.split_once('/').unwrap().1.to_string();
            records.push((rest, z.read(n).unwrap()));
        }
        let under = |prefixes: &[&str]| {
            let mut v = Vec::new();
            for p in prefixes {
                v.extend(records.iter().map(|(r, d)| (format!("{p}/{r}"), d.clone())));
            }
            stored_zip(&v)
        };
        let dir = tempfile::tempdir().unwrap();
        let one = dir.path().join("one.pt");
        std::fs::write(&one, under(&["a"])).unwrap();
        let sd = |p: &Path| {
            let mut f = TorchFile::open(p).unwrap().unwrap();
            let sd = f.state_dict().unwrap();
            let mut v: Vec<(String, Vec<f32>)> = sd
                .iter()
                .map(|(k, t)| (k.clone(), f.load(k, t).unwrap()))
                .collect();
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v
        };
        assert_eq!(sd(&one), sd(&path));
        // One record's entries listed twice: refused by name (the last copy was read).
        let twice = dir.path().join("twice.pt");
        std::fs::write(&twice, under(&["a", "a"])).unwrap();
        let e = TorchFile::open(&twice).err().unwrap().to_string();
        assert!(e.contains("is listed twice"), "{e}");
        let two = dir.path().join("two.pt");
        std::fs::write(&two, under(&["a", "b"])).unwrap();
        let e = TorchFile::open(&two).err().unwrap().to_string();
        assert!(
            e.contains("2 torch.save records (a/data.pkl, b/data.pkl)"),
            "{e}"
        );
    }

    /// Truncated or bit-flipped copies of the fixture give an error or values, never a panic.
    #[test]
    fn damaged_files_are_errors_not_panics() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/torch_views.pt");
        let good = std::fs::read(&path).unwrap();
        let dir = std::env::temp_dir().join(format!("genslm-torch-damage-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("x.pt");
        let try_read = |bytes: &[u8]| {
            std::fs::write(&file, bytes).unwrap();
            if let Ok(Some(mut f)) = TorchFile::open(&file) {
                if let Ok(sd) = f.state_dict() {
                    for (k, t) in sd {
                        let _ = f.load(&k, &t);
                    }
                }
            }
        };
        for cut in (0..good.len()).step_by(13) {
            try_read(&good[..cut]);
        }
        for at in (0..good.len()).step_by(3) {
            let mut bad = good.clone();
            bad[at] ^= 0xff;
            try_read(&bad);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
