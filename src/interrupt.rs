//! Ctrl-C, `kill` and a closed terminal (SIGINT, SIGTERM, SIGHUP) remove this process's
//! temporary outputs before it dies of the signal: a stopped `embed`, `generate` or
//! `tokenize` left its `.NAME.tmp-PID` (megabytes of a half-written file) until the next run
//! to the same path swept it, and that run may never come.
//!
//! The handler itself only writes the signal's number to a pipe (`write` is one of the few
//! calls a signal handler may make); a thread reads it, removes the registered paths, restores
//! the default action and raises the signal again, so the exit status is the signal's (130,
//! 143) as shells and Slurm expect. A second signal within 3 s of the first lets the cleanup
//! finish; a later one (a cleanup that seems stuck) ends the process at once. What a thread
//! registers once the cleanup has begun it removes itself, then waits for the end.
//! `kill -9` cannot be caught: the next writer's sweep stays the answer to it.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::Mutex;

/// What a signal does to a registered path.
#[derive(Debug)]
enum Undo {
    /// Removes a file (`false`) or a directory and everything in it (`true`).
    Remove(bool),
    /// Renames it back to this path (an entry moved aside), replacing what is there.
    RenameTo(PathBuf),
}

/// Paths undone on a signal, by registration number, in that order.
static PATHS: Mutex<Vec<(u64, PathBuf, Undo)>> = Mutex::new(Vec::new());
static NEXT: AtomicU64 = AtomicU64::new(0);
/// The pipe's write end, -1 until [`install`].
static PIPE: AtomicI32 = AtomicI32::new(-1);
static FIRED: AtomicBool = AtomicBool::new(false);
/// When the first signal came (CLOCK_MONOTONIC, ns): a second within [`GRACE_NS`] waits for
/// the cleanup, a later one ends the process at once.
static FIRST_NS: AtomicU64 = AtomicU64::new(0);
/// Ctrl-C pressed twice in a row killed the process in the middle of its cleanup, leaving the
/// temporaries the first press was removing; a cleanup still running after this is stuck.
const GRACE_NS: u64 = 3_000_000_000;

/// CLOCK_MONOTONIC in ns (`clock_gettime` is async-signal-safe).
fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into `ts`.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64).saturating_mul(1_000_000_000) + ts.tv_nsec as u64
}

const SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// A path removed if a signal ends the process while this lives; dropped once the path is
/// renamed into place or removed.
#[derive(Debug)]
pub struct Registered(u64);

/// Registers `path` (a file, or with `dir` a directory and everything in it).
pub fn register(path: PathBuf, dir: bool) -> Registered {
    push(path, Undo::Remove(dir))
}

/// Registers `aside` to be renamed back to `to` (what stood there is removed first).
pub fn register_rename(aside: PathBuf, to: PathBuf) -> Registered {
    push(aside, Undo::RenameTo(to))
}

/// Held by a [`critical`] section, and by the signal's thread before it undoes anything.
static CRITICAL: Mutex<()> = Mutex::new(());

thread_local! {
    /// Whether this thread is inside a [`critical`] section (its registrations proceed: the
    /// signal's cleanup waits for the section's end).
    static IN_CRITICAL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f`, a few steps that must happen all or none (a checkpoint's rename and the move of
/// `latest`), without a signal's cleanup in between: the cleanup waits for its end. The main
/// thread went on while the cleanup ran: a staging directory emptied by the cleanup was then
/// renamed to `step-N`, an empty checkpoint that blocked every resume. After a signal no
/// section begins: the thread waits for the end.
pub fn critical<T>(f: impl FnOnce() -> T) -> T {
    let guard = CRITICAL.lock().unwrap_or_else(|p| p.into_inner());
    if fired() {
        drop(guard);
        wait_for_the_end();
    }
    IN_CRITICAL.with(|c| c.set(true));
    let r = f();
    IN_CRITICAL.with(|c| c.set(false));
    drop(guard);
    r
}

/// Parks this thread: the signal's thread is ending the process.
fn wait_for_the_end() -> ! {
    loop {
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
}

fn push(path: PathBuf, undo: Undo) -> Registered {
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    let mut paths = PATHS.lock().unwrap_or_else(|p| p.into_inner());
    if fired() && !IN_CRITICAL.with(|c| c.get()) {
        // Made while (or after) the signal's cleanup ran, which may have missed it (a file
        // created in a staging directory being removed): undone here, and this thread waits
        // for the signal's thread to end the process.
        undo_one(&path, &undo);
        drop(paths);
        wait_for_the_end();
    }
    paths.push((id, path, undo));
    Registered(id)
}

impl Drop for Registered {
    fn drop(&mut self) {
        PATHS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(id, _, _)| *id != self.0);
    }
}

extern "C" fn on_signal(sig: libc::c_int) {
    // SAFETY: signal, raise and write are async-signal-safe; nothing else is touched.
    unsafe {
        if FIRED.swap(true, Ordering::SeqCst) {
            // Asked twice: within the grace period the cleanup goes on (it ends the process
            // itself); after it the cleanup may be stuck: die now.
            // 0: the first signal's time is not stored yet, so it came just now.
            let first = FIRST_NS.load(Ordering::SeqCst);
            if first == 0 || now_ns().saturating_sub(first) < GRACE_NS {
                return;
            }
            libc::signal(sig, libc::SIG_DFL);
            libc::raise(sig);
            return;
        }
        FIRST_NS.store(now_ns(), Ordering::SeqCst);
        let b = sig as u8;
        let fd = PIPE.load(Ordering::SeqCst);
        if fd < 0 || libc::write(fd, (&b as *const u8).cast(), 1) != 1 {
            libc::signal(sig, libc::SIG_DFL);
            libc::raise(sig);
        }
    }
}

/// Whether a signal has arrived: the process is about to die of it. An error the signal
/// caused in another thread (a file removed under a writer) is not reported then.
pub fn fired() -> bool {
    FIRED.load(Ordering::SeqCst)
}

/// Removes every registered path, or renames it back (best effort: the process is ending),
/// newest first: a temporary file inside a registered directory goes before the directory.
pub fn remove_registered() {
    let paths = PATHS.lock().unwrap_or_else(|p| p.into_inner());
    for (_, p, undo) in paths.iter().rev() {
        undo_one(p, undo);
    }
}

fn undo_one(p: &std::path::Path, undo: &Undo) {
    let _ = match undo {
        Undo::Remove(true) => remove_dir_racing(p),
        Undo::Remove(false) => std::fs::remove_file(p),
        Undo::RenameTo(to) => {
            // A new run's file of the same name (its dataset) is replaced by the rename; a
            // directory must go first.
            if std::fs::symlink_metadata(to).is_ok_and(|m| m.is_dir()) {
                let _ = std::fs::remove_dir_all(to);
            }
            std::fs::rename(p, to)
        }
    };
}

/// Removes a directory while other threads of the process may still write into it (a
/// checkpoint's shards): a file made after the listing fails the removal, so it is tried again.
fn remove_dir_racing(p: &std::path::Path) -> std::io::Result<()> {
    let mut r = std::fs::remove_dir_all(p);
    for _ in 0..20 {
        match &r {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                std::thread::sleep(std::time::Duration::from_millis(5));
                r = std::fs::remove_dir_all(p);
            }
            _ => break,
        }
    }
    r
}

/// Installs the handlers, once, at the start of `main`. A signal the process was started
/// ignoring (`nohup` ignores SIGHUP) stays ignored. Without a pipe or a thread nothing is
/// installed and the signals act as before.
pub fn install() {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: pipe2 writes two descriptors into the array it is given.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return;
    }
    let read_end = fds[0];
    let reader = std::thread::Builder::new()
        .name("genslm-signals".into())
        .spawn(move || loop {
            let mut b = 0u8;
            // SAFETY: reads one byte into `b` from the descriptor this thread owns.
            let n = unsafe { libc::read(read_end, (&mut b as *mut u8).cast(), 1) };
            if n != 1 {
                continue;
            }
            // After any critical section running now; held until the process ends.
            let _critical = CRITICAL.lock().unwrap_or_else(|p| p.into_inner());
            remove_registered();
            let sig = libc::c_int::from(b);
            // SAFETY: restores the default action and raises the signal in this thread,
            // which ends the process with the signal's status.
            unsafe {
                libc::signal(sig, libc::SIG_DFL);
                libc::raise(sig);
            }
            std::process::exit(128 + sig);
        });
    if reader.is_err() {
        return;
    }
    PIPE.store(fds[1], Ordering::SeqCst);
    for sig in SIGNALS {
        // SAFETY: sigaction with a zeroed struct, the handler's address and SA_RESTART (so
        // other threads' calls are resumed, not failed with EINTR).
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, std::ptr::null(), &mut old) != 0
                || old.sa_sigaction == libc::SIG_IGN
            {
                continue;
            }
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_signal as *const () as libc::sighandler_t;
            act.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut act.sa_mask);
            libc::sigaction(sig, &act, std::ptr::null_mut());
        }
    }
}
