//! A checkpoint's optimizer state, sharded: every rank writes the Adam moments it holds into
//! its own file (`optimizer-rankRRRRR-of-WWWWW.safetensors`) and no rank ever gathers the whole
//! state. A resume under any layout (another world size, ZeRO stage, SP, CP or TP degree)
//! assembles each parameter's moments from whichever files hold its pieces.
//!
//! A piece is what one rank holds of one parameter: a rectangle of the full matrix (our
//! `[in, out]` layout, a vector being one row) — a TP slice's columns or rows, or an SP rank's
//! learned-position rows — and, under ZeRO, a flat range of that rectangle (row-major). Each
//! file's metadata maps the parameter's Hugging Face name to its piece; the values are the
//! tensors `NAME.exp_avg` and `NAME.exp_avg_sq`, flat. Every value must be covered exactly
//! once across the files; a gap or an overlap is an error naming the parameter.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::model::params::Layout;
use crate::model::tensors::{write_safetensors_streamed, Streamed, TensorFile};
use crate::model::GenSlm;
use crate::ops::primitive::tensor_to_vec;
use crate::parallel::tensor_slices::{as_matrix, slice_of, split_of, Split};
use crate::train::zero_shard::ZeroShard;

/// File names of the shards start with this.
pub const SHARD_PREFIX: &str = crate::checksum::GENSLM_SHARD_PREFIX;
const PIECES_KEY: &str = "genslm_moment_pieces";
const FORMAT_KEY: &str = "format";
const FORMAT: &str = "genslm optimizer shard 1";

/// Elements `[start, start + len)` (row-major) of this rank's tensor of parameter `param`,
/// with their moments.
#[derive(Debug, Clone)]
pub struct MomentRun {
    pub param: usize,
    pub start: usize,
    pub len: usize,
    pub m: Tensor<1>,
    pub v: Tensor<1>,
}

impl MomentRun {
    /// The whole of this rank's tensor of `param`.
    pub fn whole(param: usize, m: &Tensor<1>, v: &Tensor<1>) -> Self {
        Self {
            param,
            start: 0,
            len: m.dims()[0],
            m: m.clone(),
            v: v.clone(),
        }
    }

    /// The runs of a ZeRO shard: one per segment, with its moments.
    pub fn of_shard(shard: &ZeroShard) -> impl Iterator<Item = Self> + '_ {
        let o = &shard.opt;
        shard
            .segments
            .iter()
            .zip(o.m.iter().zip(&o.v))
            .map(|(s, (m, v))| Self {
                param: s.param,
                start: s.start,
                len: s.len,
                m: m.clone(),
                v: v.clone(),
            })
    }
}

/// Where one file's values of a parameter sit in the full parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Piece {
    /// The full parameter as `[rows, cols]`.
    shape: [usize; 2],
    /// `[first row, first column, rows, columns]` of the rank's tensor in the full parameter.
    rect: [usize; 4],
    /// The flat range of that rectangle held here.
    start: usize,
    len: usize,
}

/// The rectangle `[first row, first column, rows, columns]` of the full parameter `i`
/// (of layout `full`) that `model`, one rank's model, holds.
pub fn held_rect(model: &GenSlm, full: &Layout, i: usize) -> [usize; 4] {
    let shape = &full.specs[i].shape;
    let [rows, cols] = as_matrix(shape);
    if let (true, Some(first)) = (Some(i) == full.embed_pos, model.position_shard()) {
        return [first, 0, model.layout.specs[i].shape[0], cols];
    }
    match (&model.tp, split_of(full, i)) {
        (Some(tp), Some(split)) => {
            let (a, n, _) = slice_of(shape, split, tp.degree(), tp.rank());
            match split {
                Split::Cols => [0, a, rows, n],
                Split::Rows => [a, 0, n, cols],
            }
        }
        _ => [0, 0, rows, cols],
    }
}

/// The shard file name of world rank `rank` of `world`.
pub fn shard_name(rank: usize, world: usize) -> String {
    format!("{SHARD_PREFIX}{rank:05}-of-{world:05}.safetensors")
}

/// Writes `runs` (this rank's moments of `model`) into `dir` as world rank `rank`'s shard;
/// returns the file name, or `None` when the rank writes nothing.
pub fn write_shard(
    dir: &Path,
    model: &GenSlm,
    runs: &[MomentRun],
    rank: usize,
    world: usize,
) -> Result<Option<String>> {
    if runs.is_empty() {
        return Ok(None);
    }
    let full = Layout::new(&model.cfg);
    let mut pieces = BTreeMap::new();
    let mut tensors = Vec::with_capacity(2 * runs.len());
    for r in runs {
        let name = &full.specs[r.param].name;
        let piece = Piece {
            shape: as_matrix(&full.specs[r.param].shape),
            rect: held_rect(model, &full, r.param),
            start: r.start,
            len: r.len,
        };
        pieces.insert(name.clone(), piece);
        for (suffix, t) in [("exp_avg", &r.m), ("exp_avg_sq", &r.v)] {
            tensors.push(Streamed {
                name: format!("{name}.{suffix}"),
                shape: vec![r.len],
                values: Box::new(move || tensor_to_vec(t)),
            });
        }
    }
    let json = serde_json::to_string(&pieces).map_err(|e| Error::Invalid(e.to_string()))?;
    let meta = HashMap::from([
        (PIECES_KEY.to_string(), json),
        (FORMAT_KEY.to_string(), FORMAT.to_string()),
    ]);
    let file = shard_name(rank, world);
    write_safetensors_streamed(&dir.join(&file), &tensors, meta)?;
    Ok(Some(file))
}

/// The shard files in checkpoint directory `dir`, sorted.
pub fn shard_files(dir: &Path) -> Result<Vec<String>> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    let mut names = Vec::new();
    for e in entries {
        let e = e.map_err(|e| Error::io(dir, e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(SHARD_PREFIX) && name.ends_with(".safetensors") {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// The optimizer shards of one checkpoint, indexed by parameter: a parameter's moments are
/// assembled when asked for, reading only its pieces (one parameter in memory at a time).
pub struct MomentShards {
    dir: PathBuf,
    /// The shard file names, in `files`' order.
    names: Vec<String>,
    files: Vec<TensorFile>,
    /// Parameter name → (file index, piece) for every piece of it.
    pieces: HashMap<String, Vec<(usize, Piece)>>,
}

impl MomentShards {
    /// Indexes the shard files of checkpoint directory `dir` (headers only) for a model of
    /// `layout`. Their sha256 is not checked here (see [`TensorFile`]).
    pub fn open(dir: &Path, layout: &Layout) -> Result<Self> {
        let names = shard_files(dir)?;
        // A shard the manifest lists but that is gone is named (the coverage check below
        // could only say that some parameter's moments were missing).
        if let Some(listed) = crate::checksum::listed_names(dir) {
            if let Some(gone) = listed
                .iter()
                .find(|n| n.starts_with(SHARD_PREFIX) && !names.contains(n))
            {
                return Err(Error::Invalid(format!(
                    "{}: missing, but {} lists it (an incomplete checkpoint: a rank's optimizer \
                     state is lost); resume from an earlier checkpoint",
                    dir.join(gone).display(),
                    crate::checksum::MANIFEST_FILE
                )));
            }
        }
        if names.is_empty() {
            return Err(Error::Invalid(format!(
                "{}: no optimizer state ({SHARD_PREFIX}*.safetensors); cannot resume from it",
                dir.display()
            )));
        }
        let shapes: HashMap<&str, [usize; 2]> = layout
            .specs
            .iter()
            .map(|s| (s.name.as_str(), as_matrix(&s.shape)))
            .collect();
        let mut files = Vec::with_capacity(names.len());
        let mut pieces: HashMap<String, Vec<(usize, Piece)>> = HashMap::new();
        for name in &names {
            let path = dir.join(name);
            let corrupt = |msg: String| {
                Error::Invalid(format!(
                    "{}: corrupt optimizer shard: {msg}",
                    path.display()
                ))
            };
            let file = TensorFile::open(&path)?;
            let meta = file.metadata();
            let json = meta
                .get(PIECES_KEY)
                .ok_or_else(|| corrupt(format!("no {PIECES_KEY} metadata")))?;
            let held: BTreeMap<String, Piece> =
                serde_json::from_str(json).map_err(|e| corrupt(e.to_string()))?;
            for (param, piece) in held {
                let &want = shapes.get(param.as_str()).ok_or_else(|| {
                    corrupt(format!("it holds {param}, which this model does not have"))
                })?;
                check_piece(&piece, want).map_err(|msg| corrupt(format!("{param}: {msg}")))?;
                pieces.entry(param).or_default().push((files.len(), piece));
            }
            files.push(file);
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            names,
            files,
            pieces,
        })
    }

    /// The shard file names, for checking them against the manifest.
    pub fn file_names(&self) -> &[String] {
        &self.names
    }

    /// Parameter `name`'s full moments `(m, v)` (our layout, `shape`); every value must be held
    /// by exactly one piece.
    pub fn moments(&self, name: &str, shape: &[usize]) -> Result<(Vec<f32>, Vec<f32>)> {
        let n: usize = shape.iter().product();
        let (mut m, mut v, mut seen) = (vec![0.0; n], vec![0.0; n], vec![false; n]);
        for (k, piece) in self.pieces.get(name).map(Vec::as_slice).unwrap_or_default() {
            let file = &self.files[*k];
            let take = |suffix: &str| -> Result<Vec<f32>> {
                let t = file.read(&format!("{name}.{suffix}"))?;
                if t.data.len() != piece.len {
                    return Err(Error::Invalid(format!(
                        "{}: corrupt optimizer shard: {name}.{suffix} holds {} values, its \
                         piece {}",
                        self.dir.display(),
                        t.data.len(),
                        piece.len
                    )));
                }
                Ok(t.data)
            };
            let (pm, pv) = (take("exp_avg")?, take("exp_avg_sq")?);
            place(piece, &pm, &pv, &mut m, &mut v, &mut seen).map_err(|msg| {
                Error::Invalid(format!(
                    "{}: optimizer shards: {name}: {msg}",
                    self.dir.display()
                ))
            })?;
        }
        let covered = seen.iter().filter(|&&x| x).count();
        if covered != n {
            return Err(Error::Invalid(format!(
                "{}: the optimizer shards ({} files) hold {covered} of the {n} moment values of \
                 {name}; a rank's file is missing",
                self.dir.display(),
                self.files.len(),
            )));
        }
        Ok((m, v))
    }
}

/// A piece must lie inside its parameter of shape `want`.
fn check_piece(p: &Piece, want: [usize; 2]) -> std::result::Result<(), String> {
    let [r0, c0, nr, nc] = p.rect;
    if p.shape != want {
        return Err(format!("shape {:?}, the model's is {want:?}", p.shape));
    }
    // Checked sums: the numbers come from a file, and a forged one near 2^64 would wrap past
    // the bounds and index out of range later.
    let within = |a: usize, b: usize, limit: usize| a.checked_add(b).is_some_and(|e| e <= limit);
    let area = nr.checked_mul(nc);
    if !within(r0, nr, want[0])
        || !within(c0, nc, want[1])
        || !area.is_some_and(|a| within(p.start, p.len, a))
    {
        return Err(format!(
            "piece {:?} [{}, +{}) is outside it",
            p.rect, p.start, p.len
        ));
    }
    Ok(())
}

/// Copies a piece's values into the full parameter, row run by row run, marking what it
/// covers; a value already covered is an error.
fn place(
    p: &Piece,
    pm: &[f32],
    pv: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    seen: &mut [bool],
) -> std::result::Result<(), String> {
    let [r0, c0, _, nc] = p.rect;
    let cols = p.shape[1];
    let mut k = 0;
    while k < p.len {
        let (row, col) = ((p.start + k) / nc, (p.start + k) % nc);
        let run = (nc - col).min(p.len - k);
        let at = (r0 + row) * cols + c0 + col;
        if seen[at..at + run].iter().any(|&x| x) {
            return Err(format!(
                "row {} holds values another shard also holds",
                r0 + row
            ));
        }
        seen[at..at + run].fill(true);
        m[at..at + run].copy_from_slice(&pm[k..k + run]);
        v[at..at + run].copy_from_slice(&pv[k..k + run]);
        k += run;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pieces of a column slice, cut into flat ranges, land where the slice's columns are.
    #[test]
    fn flat_ranges_of_a_column_slice_land_in_its_columns() {
        // A [3, 5] parameter; this rank holds columns 1..4 (a [3, 3] rectangle), elements 2..8.
        let p = Piece {
            shape: [3, 5],
            rect: [0, 1, 3, 3],
            start: 2,
            len: 6,
        };
        let vals: Vec<f32> = (0..6).map(|x| x as f32 + 1.0).collect();
        let (mut m, mut v, mut seen) = (vec![0.0; 15], vec![0.0; 15], vec![false; 15]);
        place(&p, &vals, &vals, &mut m, &mut v, &mut seen).unwrap();
        // Rectangle element e sits at row e / 3, column 1 + e % 3 of the full matrix.
        let mut want = vec![0.0; 15];
        for (k, x) in vals.iter().enumerate() {
            let e = 2 + k;
            want[(e / 3) * 5 + 1 + e % 3] = *x;
        }
        assert_eq!(m, want);
        assert_eq!(v, want);
        assert_eq!(seen.iter().filter(|&&s| s).count(), 6);
        // The same piece again overlaps.
        assert!(place(&p, &vals, &vals, &mut m, &mut v, &mut seen).is_err());
        assert!(check_piece(&p, [3, 5]).is_ok());
        assert!(check_piece(&p, [5, 3]).is_err());
        let outside = Piece { len: 8, ..p };
        assert!(check_piece(&outside, [3, 5]).is_err());
        // Forged numbers that wrap around 2^64 are outside too, not a panic.
        let m = usize::MAX;
        for rect in [[m, 1, 2, 3], [0, m, 3, 2], [0, 0, m, m]] {
            assert!(
                check_piece(&Piece { rect, ..p }, [3, 5]).is_err(),
                "{rect:?}"
            );
        }
        assert!(check_piece(&Piece { start: m, ..p }, [3, 5]).is_err());
        assert!(check_piece(&Piece { len: m, ..p }, [3, 5]).is_err());
    }
}
