//! A small team of helper threads that stay awake between short parallel sections: the
//! fork-join of a decoding step.
//!
//! A decoding step of genslm-25m runs 32 products of one token by a weight matrix (each about
//! 0.1 ms over two cores) and 8 attention rows, separated by LayerNorms and adds of a few
//! microseconds. Split over rayon, every one of them paid for waking a sleeping worker: about
//! 0.1 ms on the dev VM (a futex wake through the hypervisor), as long as the work itself, so
//! two threads ran no faster than one (measured 2026-11-27). OpenMP runtimes — what PyTorch
//! decodes with — keep their threads spinning for a while after each section; this does the
//! same for the sections that ask for it: helpers spin for [`SPIN`] after their last task, then
//! sleep until the next section wakes them. Nothing else runs on them, so rayon's pool and the
//! helpers only compete while a decoding loop is running, when rayon has nothing to do.
//!
//! [`for_each_task`] runs `f(0..tasks)` on the calling thread and the helpers, each taking the
//! next task index from a counter, and returns when every task has finished. A second caller
//! while a section runs (thread ranks decoding side by side) runs its tasks itself.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::TryLockError;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a helper keeps looking for the next section before it sleeps.
const SPIN: Duration = Duration::from_millis(2);

/// One parallel section: its tasks, the claimed and finished counts, and the caller's closure.
struct Section {
    tasks: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    /// The first task's panic, raised again by the caller.
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    /// The caller's `&dyn Fn(usize) + Sync`, its lifetime erased: called only for a claimed
    /// index below `tasks`, and the caller does not return before every such call has.
    f: *const (dyn Fn(usize) + Sync + 'static),
}

// SAFETY: `f` points to a `Sync` closure, and is only called while the caller waits for it.
unsafe impl Send for Section {}
unsafe impl Sync for Section {}

impl Section {
    /// Claims and runs tasks until none are left.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.tasks {
                return;
            }
            // SAFETY: `i` is a claimed task below `tasks`, so the caller is still waiting for it
            // (it returns only when `done` reaches `tasks`) and its closure is alive.
            let f = unsafe { &*self.f };
            if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(i))) {
                let mut first = self.panic.lock().unwrap_or_else(|p| p.into_inner());
                first.get_or_insert(payload);
            }
            self.done.fetch_add(1, Ordering::Release);
        }
    }
}

struct Team {
    /// Helper threads started.
    helpers: AtomicUsize,
    /// Bumped for every section; helpers spin on it.
    epoch: AtomicU64,
    /// The current section, for helpers to take a reference to.
    current: Mutex<Option<Arc<Section>>>,
    /// Held by the one caller whose section is running.
    busy: Mutex<()>,
    /// Helpers asleep, and what wakes them.
    sleepers: AtomicUsize,
    wake: Condvar,
    sleep_lock: Mutex<()>,
}

static TEAM: OnceLock<Team> = OnceLock::new();

/// The team, its helpers started at the first call (the pool's size minus the caller; as many
/// as the system lets start).
fn team() -> &'static Team {
    static STARTED: OnceLock<()> = OnceLock::new();
    let t = TEAM.get_or_init(|| Team {
        helpers: AtomicUsize::new(0),
        epoch: AtomicU64::new(0),
        current: Mutex::new(None),
        busy: Mutex::new(()),
        sleepers: AtomicUsize::new(0),
        wake: Condvar::new(),
        sleep_lock: Mutex::new(()),
    });
    STARTED.get_or_init(|| {
        for _ in 1..rayon::current_num_threads() {
            let spawned = std::thread::Builder::new()
                .name("genslm-team".into())
                .spawn(move || helper(t));
            if spawned.is_err() {
                break; // fewer helpers: the sections still run, on fewer threads
            }
            t.helpers.fetch_add(1, Ordering::Relaxed);
        }
    });
    t
}

fn helper(t: &'static Team) {
    let mut seen = 0;
    let mut idle_since = Instant::now();
    loop {
        let e = t.epoch.load(Ordering::Acquire);
        if e != seen {
            seen = e;
            let s = t.current.lock().unwrap_or_else(|p| p.into_inner()).clone();
            if let Some(s) = s {
                s.work();
            }
            idle_since = Instant::now();
        } else if idle_since.elapsed() < SPIN {
            std::hint::spin_loop();
        } else {
            let guard = t.sleep_lock.lock().unwrap_or_else(|p| p.into_inner());
            t.sleepers.fetch_add(1, Ordering::SeqCst);
            // Re-check under the lock: a section published before this helper counted itself
            // asleep would otherwise wait for the next one.
            let guard = if t.epoch.load(Ordering::SeqCst) == seen {
                t.wake.wait(guard).unwrap_or_else(|p| p.into_inner())
            } else {
                guard
            };
            t.sleepers.fetch_sub(1, Ordering::SeqCst);
            drop(guard);
            idle_since = Instant::now();
        }
    }
}

/// Runs `f(i)` for every `i < tasks`, on the calling thread and the team's helpers; returns when
/// all have run. A panic in a task is raised again here.
pub fn for_each_task(tasks: usize, f: impl Fn(usize) + Sync) {
    let t = team();
    // A poisoned lock only means an earlier section panicked; the team is intact.
    let guard = (tasks > 1 && t.helpers.load(Ordering::Relaxed) > 0)
        .then(|| match t.busy.try_lock() {
            Ok(g) => Some(g),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        })
        .flatten();
    let Some(busy) = guard else {
        (0..tasks).for_each(f);
        return;
    };
    let f: &(dyn Fn(usize) + Sync) = &f;
    // SAFETY: the erased reference is only called for claimed tasks, and this function waits
    // below until every claimed task has finished (see `Section::f`).
    let f: *const (dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(f) };
    let s = Arc::new(Section {
        tasks,
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        panic: Mutex::new(None),
        f,
    });
    *t.current.lock().unwrap_or_else(|p| p.into_inner()) = Some(s.clone());
    t.epoch.fetch_add(1, Ordering::SeqCst);
    if t.sleepers.load(Ordering::SeqCst) > 0 {
        let _lock = t.sleep_lock.lock().unwrap_or_else(|p| p.into_inner());
        t.wake.notify_all();
    }
    s.work();
    let mut spins = 0u32;
    while s.done.load(Ordering::Acquire) < tasks {
        // A helper holding the last task may have been preempted: after a while, let it run.
        spins += 1;
        if spins < 1 << 14 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
    *t.current.lock().unwrap_or_else(|p| p.into_inner()) = None;
    drop(busy);
    let payload = s.panic.lock().unwrap_or_else(|p| p.into_inner()).take();
    if let Some(payload) = payload {
        std::panic::resume_unwind(payload);
    }
}

/// Threads a section runs on: the caller and the helpers.
pub fn threads() -> usize {
    team().helpers.load(Ordering::Relaxed) + 1
}

/// [`for_each_task`] over the chunks of `data` (`chunk` elements each, the last one shorter):
/// `f(i, chunk i)`.
pub fn for_each_chunk_mut<T: Send>(
    data: &mut [T],
    chunk: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let (len, chunk) = (data.len(), chunk.max(1));
    // The chunks are disjoint; the pointer crosses threads as an address.
    let base = data.as_mut_ptr() as usize;
    for_each_task(len.div_ceil(chunk), |i| {
        let first = i * chunk;
        // SAFETY: chunk i is `first..min(first + chunk, len)` of `data`, which outlives the
        // section (borrowed mutably for this call); each index runs once, so no two calls
        // share an element.
        let part = unsafe {
            std::slice::from_raw_parts_mut((base as *mut T).add(first), chunk.min(len - first))
        };
        f(i, part)
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every task runs exactly once, whatever the number of tasks, with sections back to back,
    /// after the helpers have gone to sleep, and from several callers at once.
    #[test]
    fn every_task_runs_once() {
        let check = |tasks: usize| {
            let counts: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            for_each_task(tasks, |i| {
                counts[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                counts.iter().all(|c| c.load(Ordering::Relaxed) == 1),
                "{tasks} tasks"
            );
        };
        for tasks in [0, 1, 2, 3, 17, 1000] {
            check(tasks);
        }
        std::thread::sleep(SPIN * 3);
        check(64);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| (0..200).for_each(|i| check(i % 9)));
            }
        });
    }

    #[test]
    fn chunks_are_the_slices_chunks() {
        for (len, chunk) in [(0, 3), (10, 3), (12, 4), (5, 9)] {
            let mut v = vec![usize::MAX; len];
            for_each_chunk_mut(&mut v, chunk, |i, part| {
                for (j, x) in part.iter_mut().enumerate() {
                    *x = i * chunk + j;
                }
            });
            assert_eq!(v, (0..len).collect::<Vec<_>>(), "{len} by {chunk}");
        }
    }

    #[test]
    fn a_panicking_task_panics_the_caller() {
        let r = std::panic::catch_unwind(|| for_each_task(8, |i| assert!(i != 5, "task 5")));
        let payload = r.expect_err("the section panics");
        let msg = payload
            .downcast_ref::<&str>()
            .copied()
            .or(payload.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("");
        assert!(msg.contains("task 5"), "the task's own message: {msg:?}");
        // The team still works after it.
        let sum = AtomicUsize::new(0);
        for_each_task(10, |i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 45);
    }
}
