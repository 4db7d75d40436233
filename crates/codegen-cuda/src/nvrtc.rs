//! NVRTC: generated CUDA C to PTX or CUBIN, without the CUDA toolkit (only the NVRTC library,
//! found through the dynamic loader's path: `LD_LIBRARY_PATH`). [`compile_kernels`] compiles
//! each kernel as its own program on all cores, straight to CUBIN for the device's arch, and
//! keeps the binaries in a disk cache keyed by (source, arch, NVRTC version, flags), so a second
//! start compiles nothing.

use crate::{CodegenError, KernelKey, Program};
use cudarc::nvrtc::{result, sys};
use std::ffi::{CStr, CString};
use std::path::PathBuf;

const FLAGS: [&str; 1] = ["-std=c++17"];

/// Runs `f`, turning cudarc's panic on a missing NVRTC library into an error.
fn guarded<T>(f: impl FnOnce() -> Result<T, CodegenError> + std::panic::UnwindSafe) -> Result<T, CodegenError> {
    crate::without_panic(f).unwrap_or_else(|| {
        Err(CodegenError::Unsupported(
            "the NVRTC library (libnvrtc.so) was not found: install the CUDA toolkit, or \
             `pip install nvidia-cuda-nvrtc-cu12` and put its lib directory on LD_LIBRARY_PATH \
             (scripts/nvrtc.sh prints one)"
                .into(),
        ))
    })
}

/// Compiles `source` with NVRTC for `arch` (`compute_90` gives PTX, `sm_90` / `sm_90a` CUBIN).
fn compile(source: &str, arch: &str) -> Result<Vec<u8>, CodegenError> {
    let rejected = |e: String| CodegenError::Unsupported(format!("NVRTC rejected the generated source: {e}"));
    let src = CString::new(source).map_err(|e| rejected(e.to_string()))?;
    let prog = result::create_program(&src, None).map_err(|e| rejected(format!("{e:?}")))?;
    let mut opts: Vec<String> = FLAGS.iter().map(|s| s.to_string()).collect();
    opts.push(format!("--gpu-architecture={arch}"));
    let out = unsafe {
        match result::compile_program(prog, &opts) {
            Err(e) => {
                let log =
                    result::get_program_log(prog).map(|l| CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned());
                Err(rejected(format!("{e:?}: {}", log.unwrap_or_default())))
            }
            Ok(()) if arch.starts_with("sm_") => {
                let mut size = 0usize;
                sys::nvrtcGetCUBINSize(prog, &mut size).result().map_err(|e| rejected(format!("{e:?}")))?;
                let mut bin = vec![0u8; size];
                sys::nvrtcGetCUBIN(prog, bin.as_mut_ptr().cast()).result().map_err(|e| rejected(format!("{e:?}")))?;
                Ok(bin)
            }
            Ok(()) => result::get_ptx(prog)
                .map(|p| p.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect())
                .map_err(|e| rejected(format!("{e:?}"))),
        }
    };
    let _ = unsafe { result::destroy_program(prog) };
    out
}

/// Compiles `source` to PTX for `arch` (`compute_90`, ...). A missing NVRTC library, or a
/// source NVRTC rejects, is an error that says so (with NVRTC's log).
pub fn compile_ptx(source: &str, arch: &'static str) -> Result<String, CodegenError> {
    let src = source.to_string();
    let bin = guarded(move || compile(&src, arch))?;
    Ok(String::from_utf8_lossy(&bin).into_owned())
}

/// NVRTC's version, `major.minor`.
pub fn version() -> Result<String, CodegenError> {
    guarded(|| {
        let (mut major, mut minor) = (0, 0);
        unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
            .result()
            .map_err(|e| CodegenError::Unsupported(format!("nvrtcVersion: {e:?}")))?;
        Ok(format!("{major}.{minor}"))
    })
}

/// FNV-1a: a hash that stays the same across builds (the cache key).
fn fnv(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in parts {
        for b in p.bytes().chain([0xff]) {
            h = (h ^ b as u64).wrapping_mul(0x100000001b3);
        }
    }
    h
}

/// The kernel cache: `$ENGINE_CACHE_DIR`, else `$XDG_CACHE_HOME/engine`, else `~/.cache/engine`;
/// binaries live under `cuda/`.
pub fn cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("ENGINE_CACHE_DIR").map(PathBuf::from).or_else(|| {
        std::env::var_os("XDG_CACHE_HOME")
            .map(|d| PathBuf::from(d).join("engine"))
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/engine")))
    })?;
    Some(base.join("cuda"))
}

/// The source of one kernel alone: the templates and its instance.
fn kernel_source(program: &Program, key: &KernelKey) -> Result<String, CodegenError> {
    let common = program.source.split(INSTANCES).next().unwrap_or_default();
    Ok(format!("{common}{INSTANCES}\n{}", key.instance()?))
}

/// The line of a program's source after its shared templates, before one `extern "C"` line a
/// kernel.
pub(crate) const INSTANCES: &str = "// ---- instances ----";

/// The part of a program's `source` that Hopper's own target (`sm_90a`) compiles: its shared
/// templates and the instances of [`KernelKey::GemmSkinnyA8`] (`gemm_skinny_a8_...`,
/// `gemm_skinny_w16_...`: the kernels [`KernelKey::arch`] sends there); `None` where it has
/// none. `engc cuda-check` assembles it, since PTX leaves their inline `wgmma` unchecked.
pub fn hopper_source(source: &str) -> Option<String> {
    let (common, instances) = source.split_once(INSTANCES)?;
    let own = |l: &&str| l.contains(" gemm_skinny_a8_k") || l.contains(" gemm_skinny_w16_k");
    let lines: Vec<&str> = instances.lines().filter(own).collect();
    (!lines.is_empty()).then(|| format!("{common}{INSTANCES}\n{}\n", lines.join("\n")))
}

/// What [`compile_kernels`] did.
#[derive(Debug, Clone, Default)]
pub struct CompileReport {
    /// Kernels compiled now.
    pub compiled: usize,
    /// Kernels found in the cache.
    pub cached: usize,
}

/// One kernel's binary and whether it came from the cache.
type Compiled = Result<(Vec<u8>, bool), CodegenError>;

/// Compiles every kernel of `program` for `arch` (`sm_90`: CUBIN; `compute_90`: PTX; a kernel
/// that needs Hopper's own instructions for [`KernelKey::arch`]'s) on all cores, each its own
/// NVRTC program, through the disk cache. Returns one binary per kernel, in `program.kernels`
/// order.
pub fn compile_kernels(program: &Program, arch: &str) -> Result<(Vec<Vec<u8>>, CompileReport), CodegenError> {
    let version = version()?;
    let dir = cache_dir();
    if let Some(d) = &dir {
        let _ = std::fs::create_dir_all(d);
    }
    let sources: Vec<String> = program.kernels.iter().map(|k| kernel_source(program, k)).collect::<Result<_, _>>()?;
    let flags = FLAGS.join(" ");
    let archs: Vec<String> = program.kernels.iter().map(|k| k.arch(arch)).collect();
    let paths: Vec<Option<PathBuf>> = sources
        .iter()
        .zip(&archs)
        .map(|(s, a)| dir.as_ref().map(|d| d.join(format!("{:016x}.{a}.bin", fnv(&[s, a, &version, &flags])))))
        .collect();
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(4).min(sources.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut out: Vec<Option<Compiled>> = (0..sources.len()).map(|_| None).collect();
    let slots: Vec<std::sync::Mutex<&mut Option<_>>> = out.iter_mut().map(std::sync::Mutex::new).collect();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= sources.len() {
                    break;
                }
                let cached = paths[i].as_ref().and_then(|p| std::fs::read(p).ok()).filter(|b| !b.is_empty());
                let r = match cached {
                    Some(b) => Ok((b, true)),
                    None => {
                        let src = sources[i].clone();
                        let arch = archs[i].clone();
                        guarded(move || compile(&src, &arch)).map(|b| {
                            if let Some(p) = &paths[i] {
                                let tmp = p.with_extension(format!("tmp{}", std::process::id()));
                                if std::fs::write(&tmp, &b).is_ok() {
                                    let _ = std::fs::rename(&tmp, p);
                                }
                            }
                            (b, false)
                        })
                    }
                };
                if let Ok(mut slot) = slots[i].lock() {
                    **slot = Some(r);
                }
            });
        }
    });
    drop(slots);
    let mut report = CompileReport::default();
    let mut bins = Vec::with_capacity(out.len());
    for r in out {
        let (b, hit) = r.unwrap_or_else(|| Err(CodegenError::Unsupported("a kernel compile did not run".into())))?;
        if hit {
            report.cached += 1;
        } else {
            report.compiled += 1;
        }
        bins.push(b);
    }
    Ok((bins, report))
}

#[cfg(test)]
mod tests {
    use super::{hopper_source, INSTANCES};

    /// Hopper's own target compiles the shared templates and the wgmma instances alone.
    #[test]
    fn the_hopper_pass_takes_the_templates_and_the_wgmma_instances() {
        let line = |name: &str| format!("extern \"C\" __global__ void __launch_bounds__(128, 1) {name}(int T) {{ }}");
        let (a8, w16, gemv) =
            (line("gemm_skinny_a8_k256_n128"), line("gemm_skinny_w16_k64_n1024_cl2"), line("gemv_k64"));
        let source = format!("template <int K> void t();\n{INSTANCES}\n{gemv}\n{a8}\n{w16}\n");
        let own = hopper_source(&source).unwrap();
        assert_eq!(own, format!("template <int K> void t();\n{INSTANCES}\n{a8}\n{w16}\n"));
        assert_eq!(hopper_source(&format!("template <int K> void t();\n{INSTANCES}\n{gemv}\n")), None);
        assert_eq!(hopper_source("no instances"), None);
    }
}
