//! The tensor-level collectives that NCCL runs on device memory, exercised on CPU: a group that
//! claims its tensors stay on the device takes the packing path of the gradient reduction and
//! the tensor all-to-all; both must equal a naive host computation.

use std::sync::Arc;
use std::time::Duration;

use burn::tensor::{Device, Tensor, TensorData};
use genslm::ops::primitive::tensor_to_vec;
use genslm::parallel::comm::Communicator;
use genslm::parallel::threads::thread_group;
use genslm::train::shard::reduce_params;

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
                    let comm = Forward(Arc::new(c));
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
                    reduce_params(&mut grads, &[0, 1, 2, 4, 5], &comm, bucket, None).unwrap();
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

/// Three ZeRO-1 steps of the tiny model on DP 3 (its parameter count does not divide by 3,
/// so the flat vector is padded), through the on-device packing path (flat reduce-scatter and
/// all-gather tensors) and through the host buckets: the same parameters.
#[test]
fn zero_on_device_path_equals_the_host_path() {
    use genslm::config::Config;
    use genslm::data::loader::{Corpus, Loader};
    use genslm::model::GenSlm;
    use genslm::parallel::ranks::{thread_ranks, Ranks};
    use genslm::rng::SplitMix64;
    use genslm::train::dist_optim::DistOptim;
    use genslm::train::step::loss_and_grads;

    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
    let cfg = Config::load(&path).unwrap();
    let run = |wrap: bool| -> Vec<Vec<Vec<f32>>> {
        let handles: Vec<_> = thread_ranks(3, 1, Duration::from_secs(60))
            .into_iter()
            .map(|ranks| {
                let cfg = cfg.clone();
                std::thread::spawn(move || {
                    let ranks = if wrap {
                        let w = |c: &Arc<dyn Communicator>| -> Arc<dyn Communicator> {
                            Arc::new(Forward(c.clone()))
                        };
                        Ranks {
                            world: w(&ranks.world),
                            sp: w(&ranks.sp),
                            dp: w(&ranks.dp),
                            ..ranks
                        }
                    } else {
                        ranks
                    };
                    let ad = Device::flex().autodiff();
                    let mut model = GenSlm::init(cfg.model.clone(), 3, &ad).unwrap();
                    model.params = model.params.into_iter().map(|p| p.require_grad()).collect();
                    let mut opt = DistOptim::fresh(Default::default(), &model, &ranks, true);
                    let mut g = SplitMix64::new(7);
                    let recs: Vec<Vec<u32>> = (0..12)
                        .map(|_| (0..32).map(|_| 5 + g.below(64) as u32).collect())
                        .collect();
                    let corpus = Corpus::new(recs, 32, 3, 0.0, 1).unwrap();
                    let mut loader = Loader::new(1, 0);
                    for _ in 0..3 {
                        // Each DP rank takes its own rows of the global batch of 3.
                        let batch = loader.next_batch(&corpus, 3);
                        let (_, grads) = loss_and_grads(
                            &model,
                            std::slice::from_ref(&batch),
                            batch.n_targets(),
                            &ranks,
                            genslm::train::layerwise::Keep::Graphs,
                        )
                        .unwrap();
                        opt.step(&mut model, grads, false, 1e-2, 1.0, true, &ranks)
                            .unwrap();
                    }
                    model.params.iter().map(tensor_to_vec).collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    };
    let (device, host) = (run(true), run(false));
    for (r, (a, b)) in device.iter().zip(&host).enumerate() {
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            let worst = x
                .iter()
                .zip(y)
                .map(|(p, q)| (p - q).abs())
                .fold(0f32, f32::max);
            assert!(worst <= 1e-6, "rank {r}, parameter {i}: differs by {worst}");
        }
    }
}

/// Any communicator, claiming its tensors stay on the device: callers then pack tensors and use
/// the tensor collectives, which it serves through host copies (the trait's defaults).
#[derive(Debug)]
struct Forward(Arc<dyn Communicator>);

impl Communicator for Forward {
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
    fn reduce_scatter_sum(&self, b: &[f32], o: &mut [f32]) -> genslm::Result<()> {
        self.0.reduce_scatter_sum(b, o)
    }
    fn gather_into(&self, s: &[f32], r: Option<&mut [f32]>, root: usize) -> genslm::Result<()> {
        self.0.gather_into(s, r, root)
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
