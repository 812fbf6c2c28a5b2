//! Point-to-point calls under mpirun (issue 40: pipeline stages hand activations forward and
//! gradients back): `mpirun -np 4 target/debug/examples/mpi_point_to_point`, run by
//! scripts/test.sh whole and with every MPI call cut into pieces (`GENSLM_MPI_MAX_COUNT=3`).
//! Each rank checks what it received against what its neighbour sent by construction, and
//! exits 1 with the difference otherwise.

use genslm::error::{Error, Result};
use genslm::parallel::mpi::{init, mpi_ranks};
use genslm::parallel::Degrees;

fn check(what: &str, got: &[f32], want: &[f32]) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "{what}: got {got:?}, want {want:?}"
        )))
    }
}

fn main() -> Result<()> {
    let universe = init()?;
    let ranks = mpi_ranks(&universe, Degrees::new(1, 1, 1))?;
    let c = &ranks.world;
    let (r, n) = (c.rank(), c.size());
    // Activations forward along the stages, several messages in a row, arriving in order.
    for step in 0..3 {
        let act: Vec<f32> = (0..7).map(|i| (100 * r + 10 * step + i) as f32).collect();
        if r + 1 < n {
            c.send(r + 1, &act)?;
        }
        if r > 0 {
            let mut got = vec![0.0; 7];
            c.recv(r - 1, &mut got)?;
            let want: Vec<f32> = (0..7)
                .map(|i| (100 * (r - 1) + 10 * step + i) as f32)
                .collect();
            check(&format!("rank {r} step {step}"), &got, &want)?;
        }
    }
    // Gradients back while activations go forward, around the ring, with lengths that differ
    // between the two directions (5 back, 9 forward).
    let back = [r as f32; 5];
    let mut from_next = vec![0.0; 5];
    c.send_recv((r + n - 1) % n, &back, (r + 1) % n, &mut from_next)?;
    check("send_recv back", &from_next, &[((r + 1) % n) as f32; 5])?;
    let fwd = [-(r as f32); 9];
    let mut from_prev = vec![0.0; 9];
    c.send_recv((r + 1) % n, &fwd, (r + n - 1) % n, &mut from_prev)?;
    check(
        "send_recv forward",
        &from_prev,
        &[-(((r + n - 1) % n) as f32); 9],
    )?;
    // Both neighbours send before either receives, with messages far past MPI's eager limit
    // (256 KiB): blocking sends would each wait for a receive that never comes (1F1B's
    // steady state, where a stage sends an activation forward while the next one sends a
    // gradient back). Sends must not wait for their receives.
    let big = 1 << 16;
    let mine: Vec<f32> = (0..big).map(|i| (r * big + i) as f32).collect();
    c.send((r + 1) % n, &mine)?;
    c.send((r + n - 1) % n, &mine)?;
    for from in [(r + n - 1) % n, (r + 1) % n] {
        let mut got = vec![0.0; big];
        c.recv(from, &mut got)?;
        let want: Vec<f32> = (0..big).map(|i| (from * big + i) as f32).collect();
        if got != want {
            return Err(Error::Invalid(format!(
                "rank {r}: the large message from rank {from} differs"
            )));
        }
    }
    c.barrier()?;
    println!("rank {r} of {n}: point-to-point ok");
    Ok(())
}
