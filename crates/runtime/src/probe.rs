//! Hardware-limit probes (`engrun probe`): the rates `docs/perf.md` divides measured speeds by.
//! On the host: copy bandwidth with one thread and with all cores (the worker [`Pool`] the CPU
//! backend splits its kernels over). On each GPU asked for: device-to-device copy bandwidth
//! and the dense 16-bit matmul rate through cuBLASLt (the runtime's own GEMM call), both timed
//! with CUDA events (`cuda/probe.rs`).
//!
//! Conventions (the ones perf.md and `bench` use): a copy of N bytes counts 2N bytes (read +
//! written) per second; a matmul of m x n x k counts 2mnk FLOP. Each figure is the best of
//! `reps` timed runs after warm-up runs; the mean is reported beside it.

use crate::RuntimeError;
use codegen_cpu::Pool;
use serde::Serialize;
use std::fmt;
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

/// How the rates count, as written into the report.
pub const CONVENTION: &str =
    "copy: bytes read + written (2 x buffer) per second, 1 GB = 1e9 B; matmul: 2*m*n*k FLOP per second; \
     rates from the best run, means beside them";

/// What to measure, and how much.
#[derive(Debug, Clone)]
pub struct ProbeOptions {
    /// Bytes of the host copy's source buffer (and of its destination).
    pub host_bytes: usize,
    /// Bytes of the device copy's source buffer (and of its destination).
    pub device_bytes: usize,
    /// m = n = k of the matmul.
    pub matmul_size: usize,
    /// Timed runs of each measurement.
    pub reps: usize,
    /// Untimed runs before the timed ones on a GPU (clocks ramp up, cuBLASLt picks its
    /// algorithm); the host copies run one.
    pub warmup: usize,
    /// The GPUs to probe (none: the host only).
    pub gpus: Vec<usize>,
}

/// The times of a measurement's runs.
#[derive(Debug, Clone, Serialize)]
pub struct Timing {
    /// Untimed runs before the timed ones.
    pub warmup: usize,
    /// Timed runs.
    pub reps: usize,
    /// The fastest timed run.
    pub best_ms: f64,
    /// The mean of the timed runs.
    pub mean_ms: f64,
}

impl Timing {
    /// From the milliseconds of each timed run (at least one).
    pub(crate) fn from_ms(warmup: usize, ms: &[f64]) -> Timing {
        let best_ms = ms.iter().copied().fold(f64::INFINITY, f64::min);
        Timing { warmup, reps: ms.len(), best_ms, mean_ms: ms.iter().sum::<f64>() / ms.len().max(1) as f64 }
    }
}

/// A copy's bandwidth.
#[derive(Debug, Clone, Serialize)]
pub struct CopyRate {
    /// Bytes of the source (and of the destination).
    pub bytes: usize,
    /// The runs' times.
    #[serde(flatten)]
    pub timing: Timing,
    /// Bytes read + written per second of the best run, in GB/s (1e9 bytes).
    pub gb_s: f64,
}

impl CopyRate {
    pub(crate) fn new(bytes: usize, timing: Timing) -> CopyRate {
        let gb_s = 2.0 * bytes as f64 / (timing.best_ms * 1e-3) / 1e9;
        CopyRate { bytes, timing, gb_s }
    }
}

/// A matmul's rate.
#[derive(Debug, Clone, Serialize)]
pub struct MatmulRate {
    /// What runs, e.g. "cuBLASLt bf16 x bf16 -> f32, f32 compute".
    pub kernel: String,
    /// The 16-bit input type (`bf16` or `f16`).
    pub dtype: String,
    /// Output rows, output columns and the reduced dimension.
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// The runs' times.
    #[serde(flatten)]
    pub timing: Timing,
    /// 2mnk FLOP per second of the best run, in TFLOP/s.
    pub tflop_s: f64,
}

impl MatmulRate {
    pub(crate) fn new(kernel: String, dtype: String, (m, n, k): (usize, usize, usize), timing: Timing) -> MatmulRate {
        let tflop_s = 2.0 * m as f64 * n as f64 * k as f64 / (timing.best_ms * 1e-3) / 1e12;
        MatmulRate { kernel, dtype, m, n, k, timing, tflop_s }
    }
}

/// The host's copy bandwidth.
#[derive(Debug, Clone, Serialize)]
pub struct HostReport {
    /// The CPU's model name (`/proc/cpuinfo`), where there is one.
    pub cpu: Option<String>,
    /// Threads of the all-cores copy (the CPU backend's pool size).
    pub threads: usize,
    /// One thread's `memcpy`.
    pub one_thread: CopyRate,
    /// The buffer split into one contiguous part per thread, copied at once.
    pub all_cores: CopyRate,
}

/// One GPU's limits.
#[derive(Debug, Clone, Serialize)]
pub struct GpuReport {
    /// The GPU's ordinal (`--devices`).
    pub ordinal: usize,
    /// The device name the driver reports.
    pub name: String,
    /// Device-to-device copy (`cuMemcpyDtoDAsync`).
    pub copy: CopyRate,
    /// The square matmul, bf16 then f16.
    pub matmul: Vec<MatmulRate>,
}

/// Everything `engrun probe` measured.
#[derive(Debug, Clone, Serialize)]
pub struct ProbeReport {
    /// How the rates count ([`CONVENTION`]).
    pub convention: &'static str,
    /// The host.
    pub host: HostReport,
    /// Each GPU asked for, in the order given.
    pub gpus: Vec<GpuReport>,
}

/// Runs the probes: the GPUs first (so a missing GPU fails before the host copies run), then the
/// host.
pub fn run(opts: &ProbeOptions) -> Result<ProbeReport, RuntimeError> {
    check(opts)?;
    let gpus = opts.gpus.iter().map(|&g| crate::cuda::probe::gpu(g, opts)).collect::<Result<Vec<_>, _>>()?;
    Ok(ProbeReport { convention: CONVENTION, host: host(opts)?, gpus })
}

/// Refuses sizes and counts of zero.
fn check(opts: &ProbeOptions) -> Result<(), RuntimeError> {
    let zero = [
        ("the host copy's size", opts.host_bytes),
        ("the device copy's size", opts.device_bytes),
        ("the matmul size", opts.matmul_size),
        ("the repetitions", opts.reps),
    ];
    match zero.iter().find(|(_, v)| *v == 0) {
        Some((what, _)) => Err(RuntimeError::Invalid(format!("probe: {what} must be at least 1"))),
        None => Ok(()),
    }
}

/// The host's copy bandwidth, one thread and all cores, over the same two buffers.
fn host(opts: &ProbeOptions) -> Result<HostReport, RuntimeError> {
    let src = filled(opts.host_bytes, 1)?;
    let mut dst = filled(opts.host_bytes, 2)?;
    let all = Pool::with_all_cores();
    let one_thread = host_copy(&Pool::new(1), &src, &mut dst, opts.reps);
    let all_cores = host_copy(&all, &src, &mut dst, opts.reps);
    Ok(HostReport { cpu: cpu_name(), threads: all.threads(), one_thread, all_cores })
}

/// The host's one-thread copy bandwidth over `bytes`-byte buffers (best of `reps`), in bytes read
/// + written per second: what `engrun bench` divides a CPU decode's bytes by.
pub fn host_copy_bandwidth(bytes: usize, reps: usize) -> Result<f64, RuntimeError> {
    let src = filled(bytes, 1)?;
    let mut dst = filled(bytes, 2)?;
    Ok(host_copy(&Pool::new(1), &src, &mut dst, reps.max(1)).gb_s * 1e9)
}

/// A buffer of `bytes` bytes, every page written (so no copy reads the shared zero page or
/// faults pages in).
fn filled(bytes: usize, value: u8) -> Result<Vec<u8>, RuntimeError> {
    let mut v = Vec::new();
    v.try_reserve_exact(bytes)
        .map_err(|e| RuntimeError::Invalid(format!("probe: cannot allocate {bytes} bytes for the host copy: {e}")))?;
    v.resize(bytes, value);
    Ok(v)
}

/// The bandwidth of copying `src` to `dst` split over `pool`'s threads: one untimed run, then
/// the best of `reps`.
fn host_copy(pool: &Pool, src: &[u8], dst: &mut [u8], reps: usize) -> CopyRate {
    copy_split(pool, src, dst);
    let ms: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            copy_split(pool, src, dst);
            std::hint::black_box(&mut *dst);
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    CopyRate::new(src.len(), Timing::from_ms(1, &ms))
}

/// Copies `src` into `dst` (of the same length), one contiguous part per thread of `pool`.
fn copy_split(pool: &Pool, src: &[u8], dst: &mut [u8]) {
    let part = part_len(src.len(), pool.threads());
    let dsts: Vec<Mutex<&mut [u8]>> = dst.chunks_mut(part).map(Mutex::new).collect();
    pool.run(dsts.len(), &|i| {
        let mut d = dsts[i].lock().unwrap_or_else(PoisonError::into_inner);
        let n = d.len();
        d.copy_from_slice(&src[i * part..i * part + n]);
    });
}

/// The length of each of at most `threads` parts of `len` bytes: whole cache lines (64 bytes),
/// so no two threads write one line.
fn part_len(len: usize, threads: usize) -> usize {
    len.div_ceil(threads.max(1)).next_multiple_of(64).max(64)
}

/// The CPU's model name from `/proc/cpuinfo`.
fn cpu_name() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("model name"))?;
    Some(line.split_once(':')?.1.trim().to_string())
}

impl fmt::Display for ProbeReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let h = &self.host;
        let t = &h.one_thread.timing;
        writeln!(
            f,
            "host {}: copy of {} MiB (bytes read + written, best of {}): {:.1} GB/s one thread, {:.1} GB/s with {} threads",
            h.cpu.as_deref().unwrap_or("(unknown CPU)"),
            h.one_thread.bytes >> 20,
            t.reps,
            h.one_thread.gb_s,
            h.all_cores.gb_s,
            h.threads
        )?;
        for g in &self.gpus {
            let c = &g.copy;
            writeln!(
                f,
                "GPU {} {}: device copy of {} MiB (bytes read + written, best of {}): {:.2} TB/s",
                g.ordinal,
                g.name,
                c.bytes >> 20,
                c.timing.reps,
                c.gb_s / 1e3
            )?;
            for m in &g.matmul {
                writeln!(
                    f,
                    "GPU {} {}: {}x{}x{} {} (best of {} after {}): {:.1} TFLOP/s (mean {:.3} ms)",
                    g.ordinal,
                    g.name,
                    m.m,
                    m.n,
                    m.k,
                    m.kernel,
                    m.timing.reps,
                    m.timing.warmup,
                    m.tflop_s,
                    m.timing.mean_ms
                )?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The split copy moves every byte, whatever the length and thread count (a part left out
    /// would inflate the bandwidth).
    #[test]
    fn split_copy_copies_everything() {
        for threads in [1, 2, 3, 5] {
            let pool = Pool::new(threads);
            for len in [1, 63, 64, 65, 1000, 4096 + 7, 100_003] {
                let src: Vec<u8> = (0..len).map(|i| (i % 251) as u8 + 1).collect();
                let mut dst = vec![0u8; len];
                copy_split(&pool, &src, &mut dst);
                assert!(dst == src, "{len} bytes over {threads} threads");
                assert!(
                    len.div_ceil(part_len(len, threads)) <= threads,
                    "{len} bytes, {threads} threads: too many parts"
                );
            }
        }
    }

    #[test]
    fn rates_count_bytes_read_and_written() {
        let c = CopyRate::new(1 << 30, Timing::from_ms(1, &[200.0, 100.0, 150.0]));
        assert_eq!(c.timing.best_ms, 100.0);
        assert_eq!(c.timing.mean_ms, 150.0);
        assert!((c.gb_s - 2.0 * (1u64 << 30) as f64 / 0.1 / 1e9).abs() < 1e-9, "{}", c.gb_s);
        let m = MatmulRate::new("k".into(), "bf16".into(), (8192, 8192, 8192), Timing::from_ms(10, &[1.5]));
        assert!((m.tflop_s - 2.0 * 8192f64.powi(3) / 1.5e-3 / 1e12).abs() < 1e-9, "{}", m.tflop_s);
    }

    #[test]
    fn zero_sizes_are_refused() {
        let opts = ProbeOptions { host_bytes: 1, device_bytes: 1, matmul_size: 1, reps: 0, warmup: 0, gpus: vec![] };
        let e = run(&opts).unwrap_err().to_string();
        assert!(e.contains("repetitions must be at least 1"), "{e}");
    }
}
