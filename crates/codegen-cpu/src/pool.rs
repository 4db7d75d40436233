//! A persistent pool of worker threads for splitting a kernel call across cores. Spawning
//! threads per call costs more than a small matrix-vector product; waking parked workers
//! through channels costs a few microseconds.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce() + Send>;

/// Worker threads that run the parts of a call; the calling thread runs part 0 itself.
pub struct Pool {
    workers: Vec<(Sender<Job>, JoinHandle<()>)>,
    done: Receiver<()>,
    done_tx: Sender<()>,
}

impl Pool {
    /// A pool that splits work `threads` ways (the caller plus `threads - 1` workers).
    pub fn new(threads: usize) -> Pool {
        let (done_tx, done) = channel();
        let workers = (1..threads.max(1))
            .map(|i| {
                let (tx, rx) = channel::<Job>();
                let handle = std::thread::Builder::new()
                    .name(format!("cpu-worker-{i}"))
                    .spawn(move || {
                        while let Ok(job) = rx.recv() {
                            job();
                        }
                    })
                    .expect("spawning a worker thread");
                (tx, handle)
            })
            .collect();
        Pool { workers, done, done_tx }
    }

    /// A pool with one thread per available core.
    pub fn with_all_cores() -> Pool {
        Pool::new(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }

    /// How many ways work is split.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `part(i)` for every `i` in `0..parts` (`parts <= threads()`), part 0 on the calling
    /// thread, and returns when all are done.
    ///
    /// `part` may borrow from the caller: it is only called before this function returns.
    pub fn run(&self, parts: usize, part: &(dyn Fn(usize) + Sync)) {
        let parts = parts.clamp(1, self.threads());
        // SAFETY: every job sends on `done` after calling `part`, and `WaitAll` below waits for
        // all `parts - 1` of them before this function returns or unwinds, so the borrow
        // outlives every use.
        let part: &'static (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(part) };
        for (i, (tx, _)) in self.workers.iter().take(parts - 1).enumerate() {
            let done = self.done_tx.clone();
            let job: Job = Box::new(move || {
                part(i + 1);
                let _ = done.send(());
            });
            tx.send(job).expect("worker thread alive");
        }
        // Waits for the workers even if part 0 panics, so no worker outlives the borrow.
        let _wait = WaitAll { done: &self.done, n: parts - 1 };
        part(0);
    }
}

struct WaitAll<'a> {
    done: &'a Receiver<()>,
    n: usize,
}

impl Drop for WaitAll<'_> {
    fn drop(&mut self) {
        for _ in 0..self.n {
            // A worker only fails to report if its part panicked; the parts run here are
            // JIT-compiled kernels that do not.
            let _ = self.done.recv();
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        for (tx, handle) in self.workers.drain(..) {
            drop(tx);
            let _ = handle.join();
        }
    }
}
