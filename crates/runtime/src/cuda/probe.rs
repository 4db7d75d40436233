//! The GPU half of `engrun probe` ([`crate::probe`]): device-to-device copy bandwidth
//! (`cuMemcpyDtoDAsync`) and the dense square matmul rate through cuBLASLt, with the runtime's
//! own GEMM call ([`Blas::gemm`]: 16-bit inputs, f32 compute and output), bf16 then f16, on
//! random inputs (zeros draw less power and run faster). Each run is timed between CUDA events
//! recorded on one stream, the runs queued back to back so the GPU never waits on the host;
//! every buffer is freed when its measurement returns.

use super::device::context;
use super::driver;
use super::lt::{Blas, Part};
use crate::probe::{CopyRate, GpuReport, MatmulRate, ProbeOptions, Timing};
use crate::RuntimeError;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use ir::DType;
use std::sync::Arc;

/// Measures GPU `ordinal`.
pub(crate) fn gpu(ordinal: usize, opts: &ProbeOptions) -> Result<GpuReport, RuntimeError> {
    let ctx = context(ordinal)?;
    // One stream, ordered: no per-buffer events.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().map_err(driver("creating a stream"))?;
    let name = ctx.name().map_err(driver("reading the device name"))?;
    let copy = copy(&stream, opts)?;
    let matmul = [DType::BF16, DType::F16].iter().map(|&h| matmul(&stream, h, opts)).collect::<Result<_, _>>()?;
    stream.synchronize().map_err(driver("finishing the probe"))?;
    Ok(GpuReport { ordinal, name, copy, matmul })
}

/// The bandwidth of copying one buffer of `opts.device_bytes` into another (also what
/// `engrun bench` divides a GPU decode's bytes by: `CudaBackend::copy_bandwidth`).
pub(crate) fn copy(stream: &Arc<CudaStream>, opts: &ProbeOptions) -> Result<CopyRate, RuntimeError> {
    let bytes = opts.device_bytes;
    let src = stream.alloc_zeros::<u8>(bytes).map_err(driver("allocating the device copy's source"))?;
    let mut dst = stream.alloc_zeros::<u8>(bytes).map_err(driver("allocating the device copy's destination"))?;
    let ms =
        timed(stream, opts.warmup, opts.reps, || stream.memcpy_dtod(&src, &mut dst).map_err(driver("device copy")))?;
    Ok(CopyRate::new(bytes, Timing::from_ms(opts.warmup, &ms)))
}

/// The rate of `out = x · wᵀ` with x and w square `opts.matmul_size` matrices of `half`
/// (bf16 or f16) (also what `engrun bench` divides a decode step's matmul FLOPs by:
/// `CudaBackend::matmul_rate`).
pub(crate) fn matmul(stream: &Arc<CudaStream>, half: DType, opts: &ProbeOptions) -> Result<MatmulRate, RuntimeError> {
    let s = opts.matmul_size;
    let elems = s
        .checked_mul(s)
        .filter(|e| e.checked_mul(4).is_some())
        .ok_or_else(|| RuntimeError::Invalid(format!("probe: a {s} x {s} matmul does not fit in memory")))?;
    let Some(blas) = Blas::new(stream, half)? else {
        return Err(RuntimeError::Unsupported(
            "cuBLASLt (libcublasLt.so) was not found: the matmul rate needs it (put CUDA's lib64 on \
             LD_LIBRARY_PATH)"
                .into(),
        ));
    };
    let x = random(stream, half, elems, 1)?;
    let w = random(stream, half, elems, 2)?;
    let out = stream.alloc_zeros::<f32>(elems).map_err(driver("allocating the matmul's output"))?;
    let part = Part { w: ptr(stream, &w), bias: 0, out: ptr(stream, &out), n: s, ld: s, w_scales: 0 };
    let x = ptr(stream, &x);
    let ms = timed(stream, opts.warmup, opts.reps, || {
        blas.gemm(stream, x, None, s, s, &[part]).map_err(RuntimeError::Unsupported)
    })?;
    let kernel = format!("cuBLASLt {half} x {half} -> f32, f32 compute");
    Ok(MatmulRate::new(kernel, half.to_string(), (s, s, s), Timing::from_ms(opts.warmup, &ms)))
}

/// `elems` values of `half` uniform in [-1, 1) from a fixed xorshift sequence, on the device.
fn random(stream: &Arc<CudaStream>, half: DType, elems: usize, seed: u64) -> Result<CudaSlice<u8>, RuntimeError> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let values: Vec<f32> = (0..elems)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect();
    stream.clone_htod(&half.from_f32(&values)).map_err(driver("uploading the matmul's inputs"))
}

/// The device address of `s` (no events: tracking is off).
fn ptr<T>(stream: &CudaStream, s: &CudaSlice<T>) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

/// Milliseconds of each of `reps` runs of `work` on `stream`, after `warmup` untimed ones; the
/// runs are queued back to back, each between two events, and read after one synchronize.
fn timed(
    stream: &CudaStream,
    warmup: usize,
    reps: usize,
    mut work: impl FnMut() -> Result<(), RuntimeError>,
) -> Result<Vec<f64>, RuntimeError> {
    for _ in 0..warmup {
        work()?;
    }
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let mut events = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = stream.record_event(flags).map_err(driver("recording an event"))?;
        work()?;
        events.push((start, stream.record_event(flags).map_err(driver("recording an event"))?));
    }
    stream.synchronize().map_err(driver("waiting for the timed runs"))?;
    events.iter().map(|(a, b)| a.elapsed_ms(b).map(f64::from).map_err(driver("reading an event"))).collect()
}
