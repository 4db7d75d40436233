//! A persistent pool of worker threads for splitting a kernel call across cores. A decode step
//! makes a few hundred calls of tens of microseconds each, so waking a parked thread per call
//! (a futex round trip, tens of microseconds on a VM) would cost as much as the work: workers
//! spin on the call counter for a while after each call and park only when calls stop coming.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks.
const SPIN: Duration = Duration::from_micros(50);

type Part = &'static (dyn Fn(usize) + Sync);

struct Shared {
    /// The current call's parts, written by the caller before it publishes the call in `call`.
    job: UnsafeCell<Option<Part>>,
    /// `epoch << 8 | parts` of the latest call (one word, so a worker never pairs one call's
    /// epoch with another's part count).
    call: AtomicU64,
    /// Workers that have not finished their part of the current call.
    pending: AtomicUsize,
    /// Workers parked (or about to park) on `wake`.
    sleepers: AtomicUsize,
    stop: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
    /// A worker's part that panicked: its payload, re-raised on the calling thread.
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

// SAFETY: `job` is written only by the calling thread while no worker runs a part (before the
// call is published, after every part of the previous call finished) and read by the workers
// of the published call only.
unsafe impl Sync for Shared {}

/// Worker threads that run the parts of a call; the calling thread runs part 0 itself.
pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl Pool {
    /// A pool that splits work `threads` ways (the caller plus `threads - 1` workers).
    pub fn new(threads: usize) -> Pool {
        let shared = Arc::new(Shared {
            job: UnsafeCell::new(None),
            call: AtomicU64::new(0),
            pending: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            panic: Mutex::new(None),
        });
        let workers = (1..threads.clamp(1, 255))
            .map(|i| {
                let s = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("cpu-worker-{i}"))
                    .spawn(move || work(&s, i))
                    .expect("spawning a worker thread")
            })
            .collect();
        Pool { shared, workers }
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
        if parts == 1 {
            return part(0);
        }
        let s = &*self.shared;
        // SAFETY: the borrow is used by the workers of this call only, and `WaitAll` below waits
        // for all `parts - 1` of them before this function returns or unwinds.
        let part: Part = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Part>(part) };
        // SAFETY: no worker runs a part now (the previous call waited for all of them).
        unsafe { *s.job.get() = Some(part) };
        s.pending.store(parts - 1, SeqCst);
        let epoch = (s.call.load(SeqCst) >> 8) + 1;
        s.call.store(epoch << 8 | parts as u64, SeqCst);
        if s.sleepers.load(SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        {
            let _wait = WaitAll(s);
            part(0);
        }
        if let Some(payload) = s.panic.lock().unwrap_or_else(|e| e.into_inner()).take() {
            std::panic::resume_unwind(payload);
        }
    }
}

/// A worker: waits for each call (spinning, then parked), runs its part if the call has one.
fn work(s: &Shared, i: usize) {
    let mut seen = 0u64;
    loop {
        let call = wait_for_call(s, seen);
        if s.stop.load(SeqCst) {
            return;
        }
        seen = call >> 8;
        if i < (call & 0xFF) as usize {
            // SAFETY: published before `call`; unchanged until this part reports done.
            let part = unsafe { *s.job.get() };
            if let Some(part) = part {
                // A panicking part still reports, so the caller never waits forever, and the
                // caller panics with its payload.
                if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| part(i))) {
                    *s.panic.lock().unwrap_or_else(|e| e.into_inner()) = Some(payload);
                }
            }
            s.pending.fetch_sub(1, SeqCst);
        }
    }
}

/// The first call after epoch `seen` (or any value once the pool stops).
fn wait_for_call(s: &Shared, seen: u64) -> u64 {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        let call = s.call.load(SeqCst);
        if call >> 8 != seen || s.stop.load(SeqCst) {
            return call;
        }
        spins = spins.wrapping_add(1);
        if !spins.is_multiple_of(64) || start.elapsed() < SPIN {
            std::hint::spin_loop();
            continue;
        }
        let mut g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
        s.sleepers.fetch_add(1, SeqCst);
        while s.call.load(SeqCst) >> 8 == seen && !s.stop.load(SeqCst) {
            g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        s.sleepers.fetch_sub(1, SeqCst);
        return s.call.load(SeqCst);
    }
}

/// Waits (spinning, then yielding) until every worker of the current call is done.
struct WaitAll<'a>(&'a Shared);

impl Drop for WaitAll<'_> {
    fn drop(&mut self) {
        let mut spins = 0u32;
        while self.0.pending.load(SeqCst) > 0 {
            spins = spins.saturating_add(1);
            // A short spin, then yield: where the cores are oversubscribed, spinning on would
            // take the core the late worker needs.
            if spins < 1 << 11 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.store(true, SeqCst);
        {
            let _g = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn a_worker_part_that_panics_panics_the_caller_and_the_pool_goes_on() {
        let pool = Pool::new(2);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(2, &|i| assert!(i == 0, "part {i} fails"));
        }));
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        pool.run(2, &|_| {
            n.fetch_add(1, SeqCst);
        });
        assert_eq!(n.load(SeqCst), 2);
    }

    #[test]
    fn every_part_runs_once_per_call_and_parked_workers_wake() {
        let pool = Pool::new(3);
        let hits: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
        for round in 0..2000 {
            let parts = 1 + round % 3;
            pool.run(parts, &|i| {
                hits[i].fetch_add(1, SeqCst);
            });
            if round == 1000 {
                std::thread::sleep(SPIN * 4); // the workers park; the next call wakes them
            }
        }
        let want: Vec<usize> = (0..3).map(|i| (0..2000).filter(|r| i < 1 + r % 3).count()).collect();
        assert_eq!(hits.iter().map(|h| h.load(SeqCst)).collect::<Vec<_>>(), want);
    }
}
