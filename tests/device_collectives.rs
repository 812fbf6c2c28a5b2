//! The tensor-level collectives that NCCL runs on device memory, exercised on CPU: a group that
//! claims its tensors stay on the device takes the packing path of the gradient reduction and
//! the tensor all-to-all; both must equal a naive host computation.

use std::sync::Arc;
use std::time::Duration;

use burn::tensor::{Device, Tensor, TensorData};
use genslm::model::neox::tensor_to_vec;
use genslm::parallel::comm::Communicator;
use genslm::parallel::threads::{thread_group, ThreadComm};
use genslm::train::shard::reduce_params;

/// A thread rank that reports every device as "on device", so callers pack tensors and use
/// the tensor collectives (which it serves through host copies, as the trait's defaults do).
#[derive(Debug)]
struct OnDevice(ThreadComm);

impl Communicator for OnDevice {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn size(&self) -> usize {
        self.0.size()
    }
    fn all_reduce_sum(&self, b: &mut [f32]) -> genslm::Result<()> {
        self.0.all_reduce_sum(b)
    }
    fn all_reduce_sum_f64(&self, b: &mut [f64]) -> genslm::Result<()> {
        self.0.all_reduce_sum_f64(b)
    }
    fn all_gather_into(&self, s: &[f32], r: &mut [f32]) -> genslm::Result<()> {
        self.0.all_gather_into(s, r)
    }
    fn all_to_all(&self, s: Vec<Vec<f32>>) -> genslm::Result<Vec<Vec<f32>>> {
        self.0.all_to_all(s)
    }
    fn broadcast(&self, b: &mut Vec<f32>, root: usize) -> genslm::Result<()> {
        self.0.broadcast(b, root)
    }
    fn barrier(&self) -> genslm::Result<()> {
        self.0.barrier()
    }
    fn abort(&self, why: &str) {
        self.0.abort(why)
    }
    fn on_device(&self, _device: &Device) -> bool {
        true
    }
}

/// Rank r's value of element i of gradient g.
fn value(r: usize, g: usize, i: usize) -> f32 {
    ((r * 31 + g * 7 + i * 3) % 17) as f32 - 8.0
}

#[test]
fn device_packed_gradient_reduction_equals_the_naive_sum() {
    let lens = [3usize, 0, 9, 1, 16, 5];
    let n = 3;
    for bucket in [1usize, 4, 7, 1000] {
        let handles: Vec<_> = thread_group(n, Duration::from_secs(60))
            .into_iter()
            .enumerate()
            .map(|(r, c)| {
                std::thread::spawn(move || {
                    let comm = OnDevice(c);
                    let d = Device::flex();
                    let mut grads: Vec<Tensor<1>> = lens
                        .iter()
                        .enumerate()
                        .map(|(g, &l)| {
                            let v: Vec<f32> = (0..l).map(|i| value(r, g, i)).collect();
                            Tensor::from_data(TensorData::new(v, [l]), &d)
                        })
                        .collect();
                    // Every gradient but the fourth is reduced (idx skips index 3).
                    reduce_params(&mut grads, &[0, 1, 2, 4, 5], &comm, bucket).unwrap();
                    grads.iter().map(tensor_to_vec).collect::<Vec<_>>()
                })
            })
            .collect();
        for (r, h) in handles.into_iter().enumerate() {
            let got = h.join().unwrap();
            for (g, &l) in lens.iter().enumerate() {
                let want: Vec<f32> = (0..l)
                    .map(|i| {
                        if g == 3 {
                            value(r, g, i)
                        } else {
                            (0..n).map(|q| value(q, g, i)).sum()
                        }
                    })
                    .collect();
                assert_eq!(got[g], want, "bucket {bucket}, rank {r}, gradient {g}");
            }
        }
    }
}

#[test]
fn tensor_all_to_all_delivers_chunk_j_to_rank_j() {
    let n = 3;
    let handles: Vec<_> = thread_group(n, Duration::from_secs(60))
        .into_iter()
        .map(|c| {
            std::thread::spawn(move || {
                let comm: Arc<dyn Communicator> = Arc::new(c);
                let r = comm.rank();
                let d = Device::flex();
                // Chunk j of rank r holds 100·r + j in every element.
                let send: Vec<Tensor<4>> = (0..n)
                    .map(|j| Tensor::<4>::ones([1, 2, 2, 3], &d) * (100 * r + j) as f64)
                    .collect();
                let got = comm.all_to_all_tensors(send).unwrap();
                got.iter()
                    .map(|t| (t.dims(), tensor_to_vec(t)))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for (r, h) in handles.into_iter().enumerate() {
        for (q, (dims, v)) in h.join().unwrap().into_iter().enumerate() {
            assert_eq!(dims, [1, 2, 2, 3]);
            assert!(
                v.iter().all(|&x| x == (100 * q + r) as f32),
                "rank {r} from {q}"
            );
        }
    }
}
