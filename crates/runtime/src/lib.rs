//! `runtime`: runs compiled bundles. It loads a bundle onto a backend ([`load`]), and drives
//! generation ([`generate`]) with a [`Sampler`]. Backends see only the bundle's plan and
//! weights, never the compiler. Backends: the reference interpreter (`--device ref`) and the Cranelift JIT
//! ([`CpuBackend`], `--device cpu`); CUDA plugs in behind the same [`Backend`] trait.

mod backend;
pub mod bench;
mod cpu;
mod generate;
mod sampler;

pub use backend::{load, Backend, Device, RefBackend, SeqChunk, SeqId};
pub use cpu::CpuBackend;
pub use generate::{generate, FinishReason, GenerateOutput, GenerateRequest};
pub use sampler::{Sampler, SamplingParams};

/// Errors of loading and running a bundle.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The bundle cannot be opened.
    #[error(transparent)]
    Bundle(#[from] bundle::BundleError),
    /// The plan failed to run.
    #[error(transparent)]
    Ir(#[from] ir::IrError),
    /// A request is invalid (prompt too long, bad sampling parameter, unknown sequence).
    #[error("{0}")]
    Invalid(String),
    /// The requested device or feature is not available.
    #[error("{0}")]
    Unsupported(String),
}
