//! The queue between two of ingest's threads: cleaned bases and finished rows, in file order.
//!
//! Ingest runs three threads in a line: the reader parses, cleans and tokenizes; the hasher
//! takes the cleaned bases through this queue and computes each record's digest
//! (`data::digest`: XXH3-128, or MD5, which is about as much work as the reader's; one record's
//! hash cannot be split); the writer takes the hashed
//! rows through a second queue of this kind, without bases, and encodes parquet. Bases travel
//! in batches of about 1 MiB and rows ride in the same batches, so a genome of small records
//! costs a few wake-ups per megabyte rather than one per record. The queue is bounded in
//! bytes, so a few chromosome-sized records never pile up; one larger than the bound passes
//! alone.

use std::sync::mpsc;
use std::sync::{Condvar, Mutex};

use crate::error::{Error, Result};

/// Cleaned bases per batch.
const BATCH_BYTES: usize = 1 << 20;
/// Rows per batch.
const BATCH_ROWS: usize = 512;
/// Bytes (bases and token ids) in flight between the threads.
const QUEUE_BYTES: usize = 32 << 20;

/// One message: bases, then the rows whose records end inside them.
pub struct Batch<R> {
    bases: Vec<u8>,
    /// `(end, row)`: the record ending at offset `end` of `bases` (it began after the previous
    /// end, possibly in an earlier batch); `None` for a record that was dropped.
    ends: Vec<(usize, Option<R>)>,
    /// Bytes this batch holds against the budget.
    cost: usize,
}

/// What the writer thread sees, in order.
pub enum Item<'a, R> {
    /// Cleaned bases of the current record.
    Bases(&'a [u8]),
    /// The current record ended: its row, or `None` if it was dropped.
    End(Option<R>),
}

/// Bytes queued, with a cap the reader waits on.
pub struct Budget {
    state: Mutex<(usize, bool)>,
    room: Condvar,
    cap: usize,
}

impl Default for Budget {
    fn default() -> Self {
        Self::new(QUEUE_BYTES)
    }
}

impl Budget {
    pub fn new(cap: usize) -> Self {
        Self {
            state: Mutex::new((0, false)),
            room: Condvar::new(),
            cap,
        }
    }

    /// Waits until `n` more bytes fit (or nothing is queued, or the writer is gone).
    pub fn acquire(&self, n: usize) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while s.0 > 0 && s.0 + n > self.cap && !s.1 {
            s = self.room.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        s.0 += n;
    }

    pub fn release(&self, n: usize) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.0 = s.0.saturating_sub(n);
        self.room.notify_one();
    }

    /// The writer stopped: nobody waits for room any more.
    pub fn close(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).1 = true;
        self.room.notify_all();
    }
}

/// The reader's end: fills batches and sends them when full.
pub struct Sender<'a, R> {
    tx: mpsc::Sender<Batch<R>>,
    /// Emptied base buffers coming back, so 1 MiB buffers are not mapped afresh each time.
    spare: mpsc::Receiver<Vec<u8>>,
    budget: &'a Budget,
    batch: Batch<R>,
    closed: bool,
}

/// The writer's end.
pub struct Receiver<'a, R> {
    rx: mpsc::Receiver<Batch<R>>,
    spare: mpsc::Sender<Vec<u8>>,
    budget: &'a Budget,
}

pub fn queue<R>(budget: &Budget) -> (Sender<'_, R>, Receiver<'_, R>) {
    let (tx, rx) = mpsc::channel();
    let (spare_tx, spare_rx) = mpsc::channel();
    let sender = Sender {
        tx,
        spare: spare_rx,
        budget,
        batch: Batch {
            bases: Vec::with_capacity(BATCH_BYTES),
            ends: Vec::new(),
            cost: 0,
        },
        closed: false,
    };
    let receiver = Receiver {
        rx,
        spare: spare_tx,
        budget,
    };
    (sender, receiver)
}

fn stopped() -> Error {
    Error::Invalid("the parquet writer stopped".into())
}

impl<R> Sender<'_, R> {
    /// Queues cleaned bases of the current record. A failure to send (the writer stopped) is
    /// reported by the next [`end`](Self::end) or [`flush`](Self::flush).
    pub fn bases(&mut self, piece: &[u8]) {
        self.batch.bases.extend_from_slice(piece);
        if self.batch.bases.len() >= BATCH_BYTES {
            let _ = self.flush();
        }
    }

    /// Ends the current record; `cost` is the bytes `row` holds (its token ids).
    pub fn end(&mut self, row: Option<R>, cost: usize) -> Result<()> {
        self.batch.ends.push((self.batch.bases.len(), row));
        self.batch.cost += cost;
        if self.batch.ends.len() >= BATCH_ROWS || self.batch.cost >= BATCH_BYTES {
            self.flush()?;
        }
        if self.closed {
            return Err(stopped());
        }
        Ok(())
    }

    /// Sends what is batched.
    pub fn flush(&mut self) -> Result<()> {
        if self.closed {
            return Err(stopped());
        }
        if self.batch.bases.is_empty() && self.batch.ends.is_empty() {
            return Ok(());
        }
        let bases = self
            .spare
            .try_recv()
            .unwrap_or_else(|_| Vec::with_capacity(BATCH_BYTES));
        let mut batch = std::mem::replace(
            &mut self.batch,
            Batch {
                bases,
                ends: Vec::new(),
                cost: 0,
            },
        );
        batch.cost += batch.bases.len();
        self.budget.acquire(batch.cost);
        if self.tx.send(batch).is_err() {
            self.closed = true;
            return Err(stopped());
        }
        Ok(())
    }
}

impl<R> Receiver<'_, R> {
    /// Hands every item to `f` in order until the reader hangs up or `f` fails. Closes the
    /// budget on the way out, so a reader waiting for room wakes whatever happened.
    pub fn drain(self, mut f: impl FnMut(Item<'_, R>) -> Result<()>) -> Result<()> {
        let result = self.rx.iter().try_for_each(|mut batch| {
            let mut at = 0;
            for (end, row) in batch.ends.drain(..) {
                f(Item::Bases(&batch.bases[at..end]))?;
                f(Item::End(row))?;
                at = end;
            }
            f(Item::Bases(&batch.bases[at..]))?;
            self.budget.release(batch.cost);
            batch.bases.clear();
            let _ = self.spare.send(batch.bases);
            Ok(())
        });
        self.budget.close();
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    /// The reader waits for room, a batch larger than the cap passes alone, and a writer that
    /// stops (release or close) wakes it.
    #[test]
    fn budget_blocks_until_room_or_close() {
        for wake_by_close in [false, true] {
            let budget = Budget::new(10);
            budget.acquire(25); // larger than the cap, but nothing queued: passes
            let got = AtomicBool::new(false);
            std::thread::scope(|s| {
                s.spawn(|| {
                    budget.acquire(1);
                    got.store(true, Ordering::SeqCst);
                });
                std::thread::sleep(Duration::from_millis(50));
                assert!(!got.load(Ordering::SeqCst), "acquired past the cap");
                if wake_by_close {
                    budget.close();
                } else {
                    budget.release(25);
                }
            });
            assert!(got.load(Ordering::SeqCst));
        }
    }

    /// Records split across batches arrive whole and in order; dropped ones arrive as `None`.
    #[test]
    fn records_arrive_whole_and_in_order() {
        let budget = Budget::default();
        let (mut tx, rx) = queue::<usize>(&budget);
        let sizes = [3usize, 0, BATCH_BYTES + 7, 5, 2 * BATCH_BYTES, 1];
        let mut got: Vec<(Vec<u8>, Option<usize>)> = Vec::new();
        std::thread::scope(|s| {
            s.spawn(move || {
                for (i, &n) in sizes.iter().enumerate() {
                    let bytes: Vec<u8> = (0..n).map(|k| (k * 7 + i) as u8).collect();
                    for piece in bytes.chunks(70_000) {
                        tx.bases(piece);
                    }
                    tx.end((i != 1).then_some(i), 0).unwrap();
                }
                tx.flush().unwrap();
            });
            let mut cur = Vec::new();
            rx.drain(|item| {
                match item {
                    Item::Bases(b) => cur.extend_from_slice(b),
                    Item::End(row) => got.push((std::mem::take(&mut cur), row)),
                }
                Ok(())
            })
            .unwrap();
        });
        assert_eq!(got.len(), sizes.len());
        for (i, (bytes, row)) in got.iter().enumerate() {
            assert_eq!(*row, (i != 1).then_some(i));
            let want: Vec<u8> = (0..sizes[i]).map(|k| (k * 7 + i) as u8).collect();
            assert!(*bytes == want, "record {i}");
        }
    }
}
