//! The GPUs: driver and context checks with clear errors, the device's arch, which GPU each
//! rank runs on.

use crate::RuntimeError;
use bundle::Bundle;
use cudarc::driver::CudaContext;
use std::sync::Arc;

use super::{driver, tp};

/// The oldest driver the kernels' API level needs (CUDA 12.8).
const MIN_DRIVER: i32 = 12080;

/// Creates the context of GPU `ordinal`, turning a missing driver (cudarc panics), a driver
/// older than the API level we use, or no such GPU into one clear error each.
pub(crate) fn context(ordinal: usize) -> Result<Arc<CudaContext>, RuntimeError> {
    let version = codegen_cuda::without_panic(|| {
        let mut v = 0;
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
        v
    });
    let r = codegen_cuda::without_panic(|| CudaContext::new(ordinal));
    match (version, r) {
        (None, _) | (_, None) => Err(RuntimeError::Unsupported(
            "the CUDA driver (libcuda.so) was not found: no GPU on this machine? use --device cpu".into(),
        )),
        (Some(v), _) if v > 0 && v < MIN_DRIVER => Err(RuntimeError::Unsupported(format!(
            "the CUDA driver is too old: it supports CUDA {}.{}, the CUDA backend needs {}.{} or newer \
             (update the NVIDIA driver, or use --device cpu)",
            v / 1000,
            v % 1000 / 10,
            MIN_DRIVER / 1000,
            MIN_DRIVER % 1000 / 10
        ))),
        (_, Some(Ok(ctx))) => Ok(ctx),
        (_, Some(Err(e))) => {
            Err(RuntimeError::Unsupported(format!("no usable GPU {ordinal}: {e:?}; use --device cpu")))
        }
    }
}

/// How many GPUs the driver sees (0 without a driver).
pub fn gpu_count() -> usize {
    codegen_cuda::without_panic(|| {
        if cudarc::driver::result::init().is_err() {
            return 0;
        }
        CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
    })
    .unwrap_or(0)
}

/// Whether a CUDA driver and a GPU are there (without keeping a context).
pub fn gpu_present() -> bool {
    gpu_count() > 0
}

/// Whether `bundle` can run on the CUDA backend here: a GPU per rank, NCCL when there are
/// several, kernels for its plan.
pub fn usable(bundle: &Bundle, gpus: &[usize]) -> Result<(), String> {
    if !gpu_present() {
        return Err("no GPU".into());
    }
    placement(bundle.plan.tp, gpus).map_err(|e| e.to_string())?;
    if bundle.plan.tp > 1 && !tp::nccl_present() {
        return Err("NCCL (libnccl.so) was not found".into());
    }
    program(bundle).map(|_| ()).map_err(|e| e.to_string())
}

/// The CUDA program `bundle` runs: generated from its plan, and the very source the bundle
/// carries (a bundle from another `engc` whose source differs is refused).
pub fn program(bundle: &Bundle) -> Result<codegen_cuda::Program, RuntimeError> {
    let carried = bundle.kernel_source()?;
    codegen_cuda::emit_for_bundle(&bundle.plan, carried.as_deref()).map_err(|e| match e {
        codegen_cuda::CodegenError::Stale { .. } => RuntimeError::Invalid(e.to_string()),
        other => RuntimeError::Unsupported(other.to_string()),
    })
}

/// The GPU of each of `tp` ranks: `gpus` (`--devices`) or `0..tp`, checked against the GPUs
/// there are.
pub fn placement(tp: usize, gpus: &[usize]) -> Result<Vec<usize>, RuntimeError> {
    let chosen: Vec<usize> = if gpus.is_empty() { (0..tp).collect() } else { gpus.to_vec() };
    if chosen.len() != tp {
        return Err(RuntimeError::Invalid(format!(
            "--devices names {} GPU(s) but the bundle has tp={tp}: give one GPU per rank",
            chosen.len()
        )));
    }
    let have = gpu_count();
    if have == 0 {
        context(0)?; // the error that says why (no driver, too old, no GPU)
    }
    if let Some(g) = chosen.iter().find(|&&g| g >= have) {
        return Err(RuntimeError::Unsupported(format!(
            "the bundle has tp={tp} and needs GPU {g}, but this machine has {have} GPU(s) \
             (compile with a smaller --tp, or choose GPUs with --devices)"
        )));
    }
    let mut seen = chosen.clone();
    seen.sort_unstable();
    seen.dedup();
    if seen.len() != chosen.len() {
        return Err(RuntimeError::Invalid(format!("--devices names a GPU twice: {chosen:?}")));
    }
    Ok(chosen)
}

/// The device's SM arch for NVRTC (`sm_90`), or `ENGINE_CUDA_ARCH`.
pub(crate) fn arch(ctx: &CudaContext) -> Result<String, RuntimeError> {
    if let Ok(a) = std::env::var("ENGINE_CUDA_ARCH") {
        return Ok(a);
    }
    use cudarc::driver::sys::CUdevice_attribute::*;
    let major = ctx.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).map_err(driver("device arch"))?;
    let minor = ctx.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR).map_err(driver("device arch"))?;
    if major < 8 {
        return Err(RuntimeError::Unsupported(format!(
            "GPU compute capability {major}.{minor}: the kernels need 8.0 or newer (bf16 tensor cores)"
        )));
    }
    Ok(format!("sm_{major}{minor}"))
}

/// Whether kernels run as programmatic dependent launches: on sm_90 and newer, unless
/// `ENGINE_PDL=0`.
pub(crate) fn pdl_enabled(ctx: &CudaContext) -> bool {
    use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR;
    let major = ctx.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).unwrap_or(0);
    major >= 9 && std::env::var("ENGINE_PDL").map_or(true, |v| v != "0")
}

/// Launches `func` on `stream`; `params` points at each argument. With `pdl`, as a
/// programmatic dependent launch: its blocks may be scheduled while the previous kernel still
/// runs (the kernel's `pdl_enter` waits for that one's results; captured into a graph, the edge
/// stays programmatic).
///
/// # Safety
/// As for any kernel launch: `params` must match the kernel's parameters.
pub(crate) unsafe fn launch(
    stream: &cudarc::driver::CudaStream,
    func: &cudarc::driver::CudaFunction,
    cfg: cudarc::driver::LaunchConfig,
    params: &mut [*mut std::ffi::c_void],
    pdl: bool,
) -> Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::sys;
    let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: u32::from(pdl),
    };
    sys::cuLaunchKernelEx(&config, func.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()).result()
}

/// Milliseconds per run of `f` on `stream`: one warm-up, then the mean of three between CUDA
/// events (the load's timing of GEMMs and of cuBLASLt's algorithms).
pub(crate) fn mean_ms<E>(
    stream: &cudarc::driver::CudaStream,
    f: impl Fn() -> Result<(), E>,
    err: impl Fn(cudarc::driver::DriverError) -> E,
) -> Result<f64, E> {
    let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    f()?;
    let start = stream.record_event(timing).map_err(&err)?;
    for _ in 0..3 {
        f()?;
    }
    let end = stream.record_event(timing).map_err(&err)?;
    end.synchronize().map_err(&err)?;
    Ok(start.elapsed_ms(&end).map_err(&err)? as f64 / 3.0)
}
