//! The thread group's collectives, mailboxes and failure paths.

use super::*;

fn run<T: Send + 'static>(n: usize, f: impl Fn(ThreadComm) -> T + Send + Sync + 'static) -> Vec<T> {
    let f = Arc::new(f);
    let hs: Vec<_> = thread_group(n, Duration::from_secs(10))
        .into_iter()
        .map(|c| {
            let f = f.clone();
            std::thread::spawn(move || f(c))
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn collectives_match_their_definitions() {
    let out = run(3, |c| {
        let r = c.rank() as f32;
        let mut s = vec![r, 10.0 * r];
        c.all_reduce_sum(&mut s).unwrap();
        let g = c.all_gather(&[r]).unwrap();
        let mut rs = vec![0.0; 2];
        c.reduce_scatter_sum(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &mut rs)
            .unwrap();
        let a2a = c
            .all_to_all((0..3).map(|j| vec![r * 10.0 + j as f32]).collect())
            .unwrap();
        let mut b = if c.rank() == 2 {
            vec![7.0, 8.0]
        } else {
            vec![]
        };
        c.broadcast(&mut b, 2).unwrap();
        c.barrier().unwrap();
        let ring = c.ring_pass(&[r, r + 0.5]).unwrap();
        (s, g, rs, a2a, b, ring)
    });
    for (rank, (s, g, rs, a2a, b, ring)) in out.into_iter().enumerate() {
        let prev = ((rank + 2) % 3) as f32;
        assert_eq!(ring, vec![prev, prev + 0.5]);
        assert_eq!(s, vec![3.0, 30.0]);
        assert_eq!(g, vec![vec![0.0], vec![1.0], vec![2.0]]);
        let expect_rs = [vec![3.0, 6.0], vec![9.0, 12.0], vec![15.0, 18.0]];
        assert_eq!(rs, expect_rs[rank]);
        let expect_a2a: Vec<Vec<f32>> = (0..3)
            .map(|src| vec![src as f32 * 10.0 + rank as f32])
            .collect();
        assert_eq!(a2a, expect_a2a);
        assert_eq!(b, vec![7.0, 8.0]);
    }
}

/// MPI_Allgather/ncclAllGather need equal counts: the thread group refuses what they would
/// truncate or misalign (dc757c5 accepted unequal ZeRO chunks here).
#[test]
fn unequal_counts_are_refused_like_mpi() {
    let out = run(3, |c| {
        let n = if c.rank() == 2 { 1 } else { 2 };
        let g = c.all_gather(&vec![1.0; n]).map(|_| ());
        let mut s = vec![1.0; n];
        let r = c.all_reduce_sum(&mut s);
        let mut o = vec![0.0; 1];
        let rs = c.reduce_scatter_sum(&vec![1.0; n + 1], &mut o);
        let a2a = c.all_to_all(
            (0..3)
                .map(|j| vec![0.0; if j == 1 { 2 } else { 1 }])
                .collect(),
        );
        (g, r, rs, a2a.map(|_| ()))
    });
    for (g, r, rs, a2a) in out {
        for e in [g, r, rs, a2a] {
            let e = e.unwrap_err().to_string();
            assert!(e.contains("equal"), "{e}");
        }
    }
}

/// A slow rank makes a bounded wait time out but not an unbounded one (rank 0 writing a
/// checkpoint of many GB while the others wait; dc757c5 gave up after a fixed 60 s).
#[test]
fn long_phases_wait_without_a_deadline() {
    let run_with = |unbounded: bool| {
        let hs: Vec<_> = thread_group(2, Duration::from_millis(100))
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    if c.rank() == 0 {
                        std::thread::sleep(Duration::from_millis(400));
                    }
                    if unbounded {
                        c.barrier_unbounded()
                    } else {
                        c.barrier()
                    }
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    };
    assert!(run_with(true).iter().all(|r| r.is_ok()));
    let timed = run_with(false);
    let e = timed[1].as_ref().unwrap_err().to_string();
    assert!(
        e.contains("no answer") && e.contains("rank_timeout_s"),
        "{e}"
    );
}

#[test]
fn a_failed_rank_stops_the_others() {
    let out = run(3, |c| {
        if c.rank() == 1 {
            c.abort("disk full");
            return Err(Error::Invalid("disk full".into()));
        }
        c.barrier()?;
        c.barrier()
    });
    for (rank, r) in out.iter().enumerate() {
        let e = r.as_ref().unwrap_err().to_string();
        if rank != 1 {
            assert!(e.contains("rank 1 failed: disk full"), "{e}");
        }
    }
}

/// A pipeline's traffic: each rank passes its activations on to the next and gradients back
/// to the previous with `send_recv`, several messages in a row arriving in order; a wrong
/// length, a missing peer, a silent sender and a failed rank are errors with their reason.
#[test]
fn point_to_point_delivers_in_order_and_reports_misuse() {
    let out = run(4, |c| {
        let (r, n) = (c.rank(), c.size());
        for step in 0..3 {
            let act = vec![(10 * r + step) as f32; 2];
            let mut got = vec![0.0; 2];
            if r + 1 < n {
                c.send(r + 1, &act).unwrap();
            }
            if r > 0 {
                c.recv(r - 1, &mut got).unwrap();
                assert_eq!(
                    got,
                    vec![(10 * (r - 1) + step) as f32; 2],
                    "rank {r} step {step}"
                );
            }
        }
        // Gradients back and activations forward at once, around the ring.
        let mut back = vec![0.0; 3];
        c.send_recv((r + n - 1) % n, &[r as f32; 3], (r + 1) % n, &mut back)
            .unwrap();
        assert_eq!(back, vec![((r + 1) % n) as f32; 3]);
        back[0]
    });
    assert_eq!(out, vec![1.0, 2.0, 3.0, 0.0]);
    let errs = run(2, |c| {
        let mut buf = vec![0.0; 2];
        if c.rank() == 0 {
            c.send(1, &[1.0; 3]).unwrap();
            c.send(5, &[1.0]).unwrap_err().to_string()
        } else {
            c.recv(0, &mut buf).unwrap_err().to_string()
        }
    });
    assert!(
        errs[0].contains("rank 5 does not exist in a group of 2"),
        "{}",
        errs[0]
    );
    assert!(
        errs[1].contains("expected 2 elements from rank 0, which sent 3"),
        "{}",
        errs[1]
    );
    let hs: Vec<_> = thread_group(2, Duration::from_millis(100))
        .into_iter()
        .map(|c| {
            std::thread::spawn(move || {
                if c.rank() == 1 {
                    c.recv(0, &mut [0.0]).unwrap_err().to_string()
                } else {
                    String::new()
                }
            })
        })
        .collect();
    let silent = hs
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect::<Vec<_>>();
    assert!(
        silent[1].contains("no answer from the other ranks"),
        "{}",
        silent[1]
    );
    let stopped = run(2, |c| {
        if c.rank() == 0 {
            c.abort("out of memory");
            String::new()
        } else {
            c.recv(0, &mut [0.0]).unwrap_err().to_string()
        }
    });
    assert!(stopped[1].contains("out of memory"), "{}", stopped[1]);
}

/// A rank whose wait timed out (the others late) takes its deposit back: its next collective,
/// which the others do join, is a round of its own with everyone's data. Before, the stale
/// deposit counted the rank twice and the round panicked ("deposited").
#[test]
fn a_timed_out_rank_joins_the_next_round_cleanly() {
    let comms = thread_group(2, Duration::from_millis(500));
    // Rank 1 joins only once rank 0 has timed out on its own.
    let (timed_out, go) = std::sync::mpsc::channel::<()>();
    let go = std::sync::Mutex::new(Some(go));
    let hs: Vec<_> = comms
        .into_iter()
        .map(|c| {
            let tx = timed_out.clone();
            let rx = (c.rank() == 1).then(|| go.lock().unwrap().take()).flatten();
            std::thread::spawn(move || {
                if c.rank() == 0 {
                    let mut x = vec![1.0f32];
                    let e = c.all_reduce_sum(&mut x).unwrap_err().to_string();
                    assert!(e.contains("no answer from the other ranks"), "{e}");
                    tx.send(()).unwrap();
                } else {
                    rx.expect("rank 1 waits").recv().unwrap();
                }
                let mut y = vec![10.0 * (c.rank() + 1) as f32];
                c.all_reduce_sum(&mut y).map(|()| y)
            })
        })
        .collect();
    for h in hs {
        assert_eq!(h.join().unwrap().unwrap(), vec![30.0]);
    }
}
