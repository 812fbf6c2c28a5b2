//! Large collectives in fixed-size buckets.
//!
//! MPI counts are `i32`: one call over all gradients of a 2.5B model (2³¹ elements and more)
//! does not fit, and one flat copy of them costs as much memory again. These helpers move any
//! amount of data in calls of at most `bucket` elements, through one staging buffer allocated
//! once per call, and write results back into the caller's buffers in place. Every rank must
//! call them with the same lengths and bucket size (the buckets then line up).

use burn::tensor::{Device, Tensor};

use crate::error::{Error, Result};
use crate::parallel::comm::{check_blocks, Communicator};

pub use crate::config::DEFAULT_BUCKET;

fn check_bucket(bucket: usize) -> Result<()> {
    if bucket == 0 || bucket > i32::MAX as usize {
        return Err(Error::Invalid(format!(
            "reduce bucket of {bucket} elements: must be between 1 and {}",
            i32::MAX
        )));
    }
    Ok(())
}

/// Sums every buffer of `bufs` over `comm`, in place. Small buffers are packed together into
/// one staging bucket; a stretch of a large one that fills a whole bucket is reduced where it
/// lies, without a copy.
pub fn all_reduce_bucketed(
    comm: &dyn Communicator,
    bufs: &mut [&mut [f32]],
    bucket: usize,
) -> Result<()> {
    check_bucket(bucket)?;
    if comm.size() == 1 {
        return Ok(());
    }
    let mut staging: Vec<f32> = Vec::with_capacity(bucket.min(bufs.iter().map(|b| b.len()).sum()));
    // (buffer, start, len) of each piece currently in `staging`, in order.
    let mut pieces: Vec<(usize, usize, usize)> = Vec::new();
    for i in 0..bufs.len() {
        let mut at = 0;
        while at < bufs[i].len() {
            let left = bufs[i].len() - at;
            if staging.is_empty() && left >= bucket {
                comm.all_reduce_sum(&mut bufs[i][at..at + bucket])?;
                at += bucket;
                continue;
            }
            let n = left.min(bucket - staging.len());
            staging.extend_from_slice(&bufs[i][at..at + n]);
            pieces.push((i, at, n));
            at += n;
            if staging.len() == bucket {
                flush(comm, &mut staging, &mut pieces, bufs)?;
            }
        }
    }
    flush(comm, &mut staging, &mut pieces, bufs)
}

fn flush(
    comm: &dyn Communicator,
    staging: &mut Vec<f32>,
    pieces: &mut Vec<(usize, usize, usize)>,
    bufs: &mut [&mut [f32]],
) -> Result<()> {
    if staging.is_empty() {
        return Ok(());
    }
    comm.all_reduce_sum(staging)?;
    let mut from = 0;
    for &(i, at, n) in pieces.iter() {
        bufs[i][at..at + n].copy_from_slice(&staging[from..from + n]);
        from += n;
    }
    staging.clear();
    pieces.clear();
    Ok(())
}

/// Elements per rank in one call, so that a call moves at most `bucket` elements in all.
fn piece(bucket: usize, size: usize) -> usize {
    (bucket / size).max(1)
}

/// Reduce-scatter of `flat` (`size · out.len()` elements on every rank): `out` receives block
/// `rank` of the sum. Done in pieces: piece k takes the k-th stretch of every rank's block.
pub fn reduce_scatter_bucketed(
    comm: &dyn Communicator,
    flat: &[f32],
    out: &mut [f32],
    bucket: usize,
) -> Result<()> {
    check_bucket(bucket)?;
    let (size, block) = (comm.size(), out.len());
    check_blocks("reduce_scatter", flat.len(), block, size)?;
    let c = piece(bucket, size);
    if block <= c {
        return comm.reduce_scatter_sum(flat, out);
    }
    let mut staging = vec![0.0; c * size];
    for o in (0..block).step_by(c) {
        let n = c.min(block - o);
        for j in 0..size {
            staging[j * n..(j + 1) * n].copy_from_slice(&flat[j * block + o..j * block + o + n]);
        }
        comm.reduce_scatter_sum(&staging[..n * size], &mut out[o..o + n])?;
    }
    Ok(())
}

/// Every rank's `mine` (lengths may differ between ranks) concatenated in rank order, on every
/// rank (`root: None`) or on `root` only (`None` elsewhere). The lengths travel first; the
/// data then moves in equal blocks padded to the longest, as MPI and NCCL require.
pub fn gather_unequal(
    comm: &dyn Communicator,
    mine: &[f32],
    root: Option<usize>,
    bucket: usize,
) -> Result<Option<Vec<f32>>> {
    let size = comm.size();
    let mut lens = vec![0.0f64; size];
    lens[comm.rank()] = mine.len() as f64;
    comm.all_reduce_sum_f64(&mut lens)?;
    let lens: Vec<usize> = lens.iter().map(|&n| n as usize).collect();
    let block = lens.iter().copied().max().unwrap_or(0);
    let mut padded = mine.to_vec();
    padded.resize(block, 0.0);
    let receives = root.is_none_or(|r| r == comm.rank());
    let mut full = receives.then(|| vec![0.0f32; block * size]);
    gather_bucketed(comm, &padded, full.as_deref_mut(), root, bucket)?;
    Ok(full.map(|f| {
        (0..size)
            .flat_map(|j| f[j * block..j * block + lens[j]].iter().copied())
            .collect()
    }))
}

/// All-gather of equal blocks (`root: None`; `full`, `size · mine.len()` elements, receives
/// every rank's `mine` in rank order) or gather to `root` only (`full` is `Some` there, `None`
/// elsewhere), in pieces of at most `bucket` elements.
pub fn gather_bucketed(
    comm: &dyn Communicator,
    mine: &[f32],
    mut full: Option<&mut [f32]>,
    root: Option<usize>,
    bucket: usize,
) -> Result<()> {
    check_bucket(bucket)?;
    let (size, block) = (comm.size(), mine.len());
    let receives = root.is_none_or(|r| r == comm.rank());
    if let Some(f) = full.as_deref() {
        check_blocks("all_gather", f.len(), block, size)?;
    } else if receives {
        return Err(Error::Invalid(
            "gather: the receiving rank has no buffer".into(),
        ));
    }
    let c = piece(bucket, size);
    let mut staging = vec![0.0; if receives { c.min(block) * size } else { 0 }];
    for o in (0..block.max(1)).step_by(c) {
        let n = c.min(block - o.min(block));
        let send = &mine[o..o + n];
        let recv = &mut staging[..if receives { n * size } else { 0 }];
        match root {
            None => comm.all_gather_into(send, recv)?,
            Some(r) => comm.gather_into(send, receives.then_some(recv), r)?,
        }
        if let Some(f) = full.as_deref_mut() {
            for j in 0..size {
                f[j * block + o..j * block + o + n].copy_from_slice(&staging[j * n..(j + 1) * n]);
            }
        }
    }
    Ok(())
}

/// The device-side twin of the staging buffers above, for groups whose tensors stay on the
/// device (NCCL): `parts` concatenated and zero-padded to `len` elements.
pub fn pack(parts: impl Iterator<Item = Tensor<1>>, len: usize, device: &Device) -> Tensor<1> {
    let mut v: Vec<Tensor<1>> = parts.filter(|t| t.dims()[0] > 0).collect();
    let real: usize = v.iter().map(|t| t.dims()[0]).sum();
    if len > real {
        v.push(Tensor::zeros([len - real], device));
    }
    if v.is_empty() {
        return Tensor::zeros([0], device);
    }
    Tensor::cat(v, 0)
}

/// `flat` cut into consecutive pieces of `lens` elements (an empty piece is an empty tensor:
/// burn cannot narrow to length 0).
pub fn unpack(flat: &Tensor<1>, lens: impl Iterator<Item = usize>) -> Vec<Tensor<1>> {
    let device = flat.device();
    let mut at = 0;
    lens.map(|n| {
        let t = if n == 0 {
            Tensor::zeros([0], &device)
        } else {
            flat.clone().narrow(0, at, n)
        };
        at += n;
        t
    })
    .collect()
}

/// The host twin of [`unpack`]: `flat` cut into consecutive vectors of `lens` elements.
pub fn unpack_host(flat: &[f32], lens: impl Iterator<Item = usize>) -> Vec<Vec<f32>> {
    let mut at = 0;
    lens.map(|n| {
        at += n;
        flat[at - n..at].to_vec()
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::threads::thread_group;
    use std::time::Duration;

    /// Runs `f(rank comm)` on `n` thread ranks.
    fn on_ranks<T: Send + 'static>(
        n: usize,
        f: impl Fn(&dyn Communicator) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let f = std::sync::Arc::new(f);
        let hs: Vec<_> = thread_group(n, Duration::from_secs(20))
            .into_iter()
            .map(|c| {
                let f = f.clone();
                std::thread::spawn(move || f(&c))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    }

    /// Rank r's value at element k of buffer i: distinct everywhere, exact in f32 sums.
    fn value(r: usize, i: usize, k: usize) -> f32 {
        (r * 1000 + i * 100 + k) as f32
    }

    /// Buffers of awkward lengths (empty, shorter and longer than a bucket) summed over 3
    /// ranks with buckets of 1, 4 and 7 elements give the naive element-wise sum.
    #[test]
    fn bucketed_all_reduce_matches_a_naive_sum_across_bucket_boundaries() {
        let lens = [3usize, 0, 9, 1, 16, 5];
        for bucket in [1usize, 4, 7, 1000] {
            let out = on_ranks(3, move |c| {
                let mut bufs: Vec<Vec<f32>> = lens
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| (0..n).map(|k| value(c.rank(), i, k)).collect())
                    .collect();
                let mut views: Vec<&mut [f32]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
                all_reduce_bucketed(c, &mut views, bucket).unwrap();
                bufs
            });
            for bufs in out {
                for (i, b) in bufs.iter().enumerate() {
                    let naive: Vec<f32> = (0..lens[i])
                        .map(|k| (0..3).map(|r| value(r, i, k)).sum())
                        .collect();
                    assert_eq!(b, &naive, "bucket {bucket}, buffer {i}");
                }
            }
        }
    }

    #[test]
    fn bucketed_reduce_scatter_and_gathers_match_their_definitions() {
        for bucket in [1usize, 2, 5, 6, 100] {
            let out = on_ranks(3, move |c| {
                let block = 5;
                let flat: Vec<f32> = (0..3 * block).map(|k| value(c.rank(), 0, k)).collect();
                let mut mine = vec![0.0; block];
                reduce_scatter_bucketed(c, &flat, &mut mine, bucket).unwrap();
                let mut full = vec![0.0; 3 * block];
                gather_bucketed(c, &mine, Some(&mut full[..]), None, bucket).unwrap();
                let mut at_root = (c.rank() == 1).then(|| vec![0.0; 3 * block]);
                gather_bucketed(c, &mine, at_root.as_deref_mut(), Some(1), bucket).unwrap();
                (mine, full, at_root)
            });
            let sum: Vec<f32> = (0..15)
                .map(|k| (0..3).map(|r| value(r, 0, k)).sum())
                .collect();
            for (rank, (mine, full, at_root)) in out.into_iter().enumerate() {
                assert_eq!(mine, sum[rank * 5..(rank + 1) * 5], "bucket {bucket}");
                assert_eq!(full, sum, "bucket {bucket}");
                assert_eq!(at_root.is_some(), rank == 1);
                if let Some(g) = at_root {
                    assert_eq!(g, sum);
                }
            }
        }
    }

    #[test]
    fn unequal_pieces_are_gathered_in_rank_order() {
        for root in [None, Some(2)] {
            let out = on_ranks(3, move |c| {
                let mine: Vec<f32> = (0..2 * c.rank() + 1)
                    .map(|k| value(c.rank(), 0, k))
                    .collect();
                gather_unequal(c, &mine, root, 2).unwrap()
            });
            let expect: Vec<f32> = (0..3)
                .flat_map(|r| (0..2 * r + 1).map(move |k| value(r, 0, k)))
                .collect();
            for (rank, got) in out.into_iter().enumerate() {
                match root {
                    Some(r) if r != rank => assert!(got.is_none()),
                    _ => assert_eq!(got.unwrap(), expect),
                }
            }
        }
    }
}
