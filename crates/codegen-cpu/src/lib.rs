//! `codegen-cpu`: plan kernels lowered to Cranelift IR and JIT-compiled to native code when a
//! bundle is loaded for the CPU.
//!
//! Cranelift does no auto-vectorisation or unrolling and has 128-bit SIMD only, so each kernel is
//! emitted as explicit `f32x4` code, unrolled, with the model's shapes (feature sizes) as
//! constants. This first slice is the linear kernel, the one that bounds decode speed; the other
//! ops of the plan follow (see `docs/perf.md` and the CPU backend issue).
#![deny(missing_docs)]

#[cfg(target_arch = "x86_64")]
mod avx2;
pub mod blocks;
mod kernels;
mod linear;
mod map;
mod pool;

pub use kernels::{AttentionKernel, BinaryKernel, BinaryOp, EmbeddingKernel, RmsNormKernel, RopeKernel};
pub use linear::LinearKernel;
pub use map::MapKernel;
pub use pool::Pool;

use cranelift_codegen::settings::{self, Configurable};
use cranelift_jit::{JITBuilder, JITModule};

/// Errors of JIT compilation.
#[derive(Debug, thiserror::Error)]
pub enum JitError {
    /// The host is not supported by Cranelift, or a setting was rejected.
    #[error("cannot set up the Cranelift JIT for this host: {0}")]
    Host(String),
    /// Cranelift rejected a generated function (a bug in the lowering).
    #[error("Cranelift could not compile `{kernel}`: {message}")]
    Compile {
        /// The kernel.
        kernel: String,
        /// Cranelift's message.
        message: String,
    },
    /// A kernel was asked for with shapes or types it does not support.
    #[error("{0}")]
    Unsupported(String),
}

/// `expf`, for kernels: Cranelift has no exp instruction.
extern "C" fn engine_expf(x: f32) -> f32 {
    x.exp()
}

/// How Cranelift optimises a kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Opt {
    /// `opt_level=speed`: the e-graph pass (GVN, LICM, rewrites), which also re-places every
    /// pure instruction at its uses.
    Speed,
    /// `opt_level=none`: instructions stay in the order the kernel emits them (the block
    /// kernels', whose dequantization the e-graph pass spreads into spills).
    None,
}

/// A JIT module set up for the host CPU, with the math functions kernels call.
pub(crate) fn new_module(opt: Opt) -> Result<JITModule, JitError> {
    let host = |e: &dyn std::fmt::Display| JitError::Host(e.to_string());
    let mut flags = settings::builder();
    let level = if opt == Opt::Speed { "speed" } else { "none" };
    for (k, v) in [("opt_level", level), ("use_colocated_libcalls", "false"), ("is_pic", "false")] {
        flags.set(k, v).map_err(|e| host(&e))?;
    }
    let isa =
        cranelift_native::builder().map_err(|e| host(&e))?.finish(settings::Flags::new(flags)).map_err(|e| host(&e))?;
    let mut builder = JITBuilder::with_isa(isa, cranelift_module::default_libcall_names());
    builder.symbol("engine_expf", engine_expf as *const u8);
    Ok(JITModule::new(builder))
}
