//! `ENGINE_CUDA_PROFILE`: `1` times every launch with events (graphs off) and prints a
//! per-kernel summary at exit, with the bytes each launch must move and the bandwidth that makes
//! (`CudaBackend::launch_bytes`); `steps` keeps graphs and PDL and times each decode step replayed
//! from a graph: the replay and the sampling kernel on the GPU (events around each) against
//! the step's wall time on the host (inputs, replay, sampling, the tokens' copy back), so the
//! parts can be told apart.
//!
//! `ENGINE_CUDA_SKIP=a,b` leaves out every launch whose kernel name contains `a` or `b`, graphs
//! and PDL kept: what a kind of kernel costs inside the step as it runs (the TPOT with and
//! without it), where no profiler can see into CUDA graphs. The outputs are then wrong: for
//! timing experiments only, and said so on stderr.

use super::CudaBackend;
use crate::RuntimeError;
use codegen_cuda::{Arg, Count, Input, Launch};
use cudarc::driver::{CudaEvent, CudaStream};
use std::cell::RefCell;
use std::collections::HashMap;
use std::time::Instant;

/// The kernel-name parts of `ENGINE_CUDA_SKIP` (none when unset), announced on stderr.
pub(super) fn skip_from_env() -> Vec<String> {
    let parts: Vec<String> = std::env::var("ENGINE_CUDA_SKIP")
        .unwrap_or_default()
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    if !parts.is_empty() {
        eprintln!("ENGINE_CUDA_SKIP: kernels named with any of {parts:?} are not launched: outputs are wrong");
    }
    parts
}

/// Whether kernel `name` is left out (`ENGINE_CUDA_SKIP`).
pub(super) fn skipped(skip: &[String], name: &str) -> bool {
    skip.iter().any(|s| name.contains(s.as_str()))
}

/// What is being profiled.
pub(super) enum Profile {
    /// Per kernel name: total ms, calls and bytes.
    Kernels(RefCell<HashMap<String, (f64, usize, f64)>>),
    /// Graph-replayed steps.
    Steps(RefCell<Steps>),
}

/// Per graph-replayed step, its times (ms; reported as medians, so that the few steps that span
/// a pause of the host, a batch changing size or requests arriving, do not spread over the
/// others), and the step under way.
#[derive(Default)]
pub(super) struct Steps {
    /// The replay's GPU time, the sampling kernel's, the step's host wall time.
    replay_ms: Vec<f64>,
    sample_ms: Vec<f64>,
    wall_ms: Vec<f64>,
    /// The steps under way, oldest first (two where a step launches before the one before
    /// it finishes: `Backend::launch_forward`).
    open: std::collections::VecDeque<OpenStep>,
    /// When the last step finished (`worker::step_time`).
    last_end: Option<Instant>,
    /// The GPU time from one replayed step's replay start to the next's, for each pair of
    /// consecutive replayed steps: against the replay and the sampling, what the GPU spends
    /// between steps (the inputs' copy, idling for the host).
    period_ms: Vec<f64>,
    /// The last counted step's replay start event, while the steps are replayed in a row.
    last_replay: Option<CudaEvent>,
}

/// A step's start on the host, and the events around its replay and its sampling.
struct OpenStep {
    start: Instant,
    replay: Option<(CudaEvent, CudaEvent)>,
    sample: Option<(CudaEvent, CudaEvent)>,
}

fn profiling(e: cudarc::driver::DriverError) -> RuntimeError {
    RuntimeError::Unsupported(format!("CUDA profiling: {e:?}"))
}

/// Runs `work` between two timing events recorded on `stream`.
fn between(
    stream: &CudaStream,
    work: impl FnOnce() -> Result<(), RuntimeError>,
) -> Result<(CudaEvent, CudaEvent), RuntimeError> {
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let start = stream.record_event(flags).map_err(profiling)?;
    work()?;
    Ok((start, stream.record_event(flags).map_err(profiling)?))
}

impl Profile {
    /// From `ENGINE_CUDA_PROFILE`.
    pub(super) fn from_env() -> Option<Profile> {
        match std::env::var("ENGINE_CUDA_PROFILE").as_deref() {
            Ok("1") => Some(Profile::Kernels(Default::default())),
            Ok("steps") => Some(Profile::Steps(Default::default())),
            _ => None,
        }
    }

    /// Whether launches are timed one by one (graphs and PDL off).
    pub(super) fn per_launch(this: &Option<Profile>) -> bool {
        matches!(this, Some(Profile::Kernels(_)))
    }

    /// Times `launch`, which moves `bytes` (kernel mode).
    pub(super) fn launch(
        this: &Option<Profile>,
        stream: &CudaStream,
        name: impl FnOnce() -> String,
        bytes: impl FnOnce() -> usize,
        launch: impl FnOnce() -> Result<(), RuntimeError>,
    ) -> Result<(), RuntimeError> {
        let Some(Profile::Kernels(p)) = this else { return launch() };
        let (start, end) = between(stream, launch)?;
        end.synchronize().map_err(profiling)?;
        let ms = start.elapsed_ms(&end).map_err(profiling)?;
        let mut p = p.borrow_mut();
        let e = p.entry(name()).or_insert((0.0, 0, 0.0));
        e.0 += f64::from(ms);
        e.1 += 1;
        e.2 += bytes() as f64;
        Ok(())
    }

    /// A step starts on the host (steps mode).
    pub(super) fn step_start(this: &Option<Profile>) {
        if let Some(Profile::Steps(s)) = this {
            s.borrow_mut().open.push_back(OpenStep { start: Instant::now(), replay: None, sample: None });
        }
    }

    /// Runs `work` (a graph replay, or with `sample` the sampling kernel) between events (steps
    /// mode).
    pub(super) fn span(
        this: &Option<Profile>,
        stream: &CudaStream,
        sample: bool,
        work: impl FnOnce() -> Result<(), RuntimeError>,
    ) -> Result<(), RuntimeError> {
        let Some(Profile::Steps(s)) = this else { return work() };
        let events = between(stream, work)?;
        if let Some(open) = s.borrow_mut().open.back_mut() {
            *(if sample { &mut open.sample } else { &mut open.replay }) = Some(events);
        }
        Ok(())
    }

    /// The oldest step's results are on the host (steps mode): counts it if it was replayed
    /// from a graph.
    pub(super) fn step_end(this: &Option<Profile>) {
        let Some(Profile::Steps(s)) = this else { return };
        let mut s = s.borrow_mut();
        let Some(OpenStep { start, replay, sample }) = s.open.pop_front() else { return };
        let wall = crate::worker::step_time(start, &mut s.last_end);
        let Some(replay) = replay else {
            s.last_replay = None;
            return;
        };
        let ms = |(a, b): &(CudaEvent, CudaEvent)| a.elapsed_ms(b).map(f64::from).unwrap_or(0.0);
        s.replay_ms.push(ms(&replay));
        s.sample_ms.push(sample.as_ref().map_or(0.0, ms));
        s.wall_ms.push(wall.as_secs_f64() * 1e3);
        if let Some(Ok(period)) = s.last_replay.as_ref().map(|prev| prev.elapsed_ms(&replay.0)) {
            s.period_ms.push(f64::from(period));
        }
        s.last_replay = Some(replay.0);
    }

    /// The summary, on stderr.
    pub(super) fn report(&self) {
        match self {
            Profile::Kernels(p) => {
                let p = p.borrow();
                let total: f64 = p.values().map(|v| v.0).sum();
                let mut rows: Vec<_> = p.iter().collect();
                rows.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
                eprintln!(
                    "CUDA kernel time: {total:.2} ms in all (MB a call it must move at least, experts as many \
                     as its tokens choose at uniform routing, and at what rate)"
                );
                for (name, (ms, n, bytes)) in rows.iter().take(30) {
                    eprintln!(
                        "{:>9.3} ms {:>5.1}% {n:>7} calls {:>8.2} us/call {:>9.3} MB/call {:>8.1} GB/s  {name}",
                        ms,
                        100.0 * ms / total,
                        1e3 * ms / *n as f64,
                        bytes / 1e6 / *n as f64,
                        if *ms > 0.0 { bytes / 1e6 / ms } else { 0.0 }
                    );
                }
            }
            Profile::Steps(s) => {
                let s = s.borrow();
                let us = |ms: &[f64]| 1e3 * crate::bench::median(ms.to_vec());
                eprintln!(
                    "CUDA graph steps: {} steps, medians: replay {:.1} us/step on the GPU, sampling {:.1} us/step, \
                     {:.1} us/step wall on the host (inputs, replay, sampling, copy back); GPU period {:.1} us/step \
                     (a replay's start to the next's)",
                    s.replay_ms.len(),
                    us(&s.replay_ms),
                    us(&s.sample_ms),
                    us(&s.wall_ms),
                    us(&s.period_ms)
                );
            }
        }
    }
}

impl CudaBackend {
    /// The bytes launch `l` of `t` tokens and `r` logit rows must move at the least
    /// ([`launch_bytes`]; not the arguments it need not read in a decode step,
    /// `KernelKey::unread_in_decode`; of a mixture of experts' stacks the experts `t` tokens
    /// choose, `ir::chosen_share`), for the profile's bandwidth column.
    pub(super) fn launch_bytes(&self, l: &Launch, t: usize, r: usize) -> usize {
        let weight = |w: usize| {
            let len = self.weights.len(w);
            let share = |&(k, e): &(usize, usize)| (len as f64 * ir::chosen_share(k, e, t)).round() as usize;
            self.expert_stacks.get(&w).map_or(len, share)
        };
        let kv = KvRead { positions: self.positions, row_bytes: self.plan.kv.row() * 2 };
        let unread = l.key.unread_in_decode();
        let args: Vec<Arg> = l.args.iter().enumerate().filter(|(i, _)| !unread.contains(i)).map(|(_, a)| *a).collect();
        launch_bytes(&args, t, r, kv, &self.program.buffers, weight)
    }

    /// The same for linear launch `l` through GEMM `g`: through cuBLASLt on a 16-bit copy
    /// (`w16`), the copy's bytes in place of the E4M3 weights'.
    pub(super) fn gemm_launch_bytes(&self, l: &Launch, t: usize, r: usize, g: super::blas::Gemm) -> usize {
        let all = self.launch_bytes(l, t, r);
        let copy = match (g, l.args.get(1)) {
            (super::blas::Gemm::Blas16, Some(Arg::Weight(w))) => self.w16.get(w),
            _ => None,
        };
        let Some(copy) = copy else { return all };
        let e4m3: usize = (0..3)
            .filter_map(|i| match l.args.get(1 + 3 * i) {
                Some(&Arg::Weight(w)) => Some(self.weights.len(w)),
                _ => None,
            })
            .sum();
        all.saturating_sub(e4m3) + copy.len()
    }
}

/// What a step's KV caches hold: the positions of its sequences, and the bytes of one position
/// of one layer's K (or V) cache.
#[derive(Debug, Clone, Copy)]
pub(super) struct KvRead {
    pub positions: usize,
    pub row_bytes: usize,
}

/// The bytes a launch with `args` of `t` tokens and `r` logit rows must move at the least: its
/// weights (`weight` gives a weight's bytes), its buffers' rows (each once, read or written;
/// a packed buffer's whole rows by the argument at its start, none by those from an offset on),
/// and of each KV cache every position of the step's sequences where it reads the slot table
/// (attention), the step's own tokens where it only writes them. A kernel that reads something
/// twice (prefill attention's KV, once per query tile) moves more.
pub(super) fn launch_bytes(
    args: &[Arg],
    t: usize,
    r: usize,
    kv: KvRead,
    buffers: &[codegen_cuda::Buffer],
    weight: impl Fn(usize) -> usize,
) -> usize {
    let kv_rows = if args.contains(&Arg::Input(Input::Slots)) { kv.positions } else { t };
    let arg = |a: &Arg| match *a {
        Arg::Weight(w) => weight(w),
        Arg::Buf(b) => buffers.get(b).map_or(0, |buf| buf.row_bytes * if buf.per == Count::Tokens { t } else { r }),
        Arg::KCache(_) | Arg::VCache(_) => kv_rows * kv.row_bytes,
        _ => 0,
    };
    args.iter().map(arg).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use codegen_cuda::Buffer;

    /// Weights once, buffers by their rows (tokens or logit rows), and the KV caches by every
    /// position where the launch reads the slot table, by the step's tokens where it writes.
    #[test]
    fn a_launch_moves_its_weights_rows_and_the_kv_it_reads() {
        let buffers = [Buffer { row_bytes: 100, per: Count::Tokens }, Buffer { row_bytes: 10, per: Count::Rows }];
        let kv = KvRead { positions: 1000, row_bytes: 4 };
        let weight = |w: usize| 1 << (10 + w);
        let (t, r) = (7, 3);
        let linear = [Arg::Buf(0), Arg::Weight(2), Arg::Null, Arg::Buf(1), Arg::Count(Count::Tokens)];
        assert_eq!(launch_bytes(&linear, t, r, kv, &buffers, weight), 700 + 4096 + 30);
        let write = [Arg::Buf(0), Arg::Input(Input::SlotOf), Arg::KCache(0), Arg::VCache(0)];
        assert_eq!(launch_bytes(&write, t, r, kv, &buffers, weight), 700 + 2 * 7 * 4);
        let attention = [Arg::Buf(0), Arg::KCache(0), Arg::VCache(0), Arg::Input(Input::Slots), Arg::Buf(0)];
        assert_eq!(launch_bytes(&attention, t, r, kv, &buffers, weight), 1400 + 2 * 1000 * 4);
    }
}
