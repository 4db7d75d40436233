//! `runtime`: runs compiled bundles. It loads a bundle onto a backend ([`load`]) and serves
//! requests with an [`Engine`]: a [`Scheduler`](crate::engine) doing continuous batching with
//! chunked prefill over a paged KV pool ([`PagePool`]) with a radix prefix cache
//! ([`RadixCache`]), and a worker thread that runs the backend and samples
//! ([`RequestSampler`]). Backends see only the bundle's plan and weights, never the compiler:
//! the reference interpreter (`--device ref`) and the Cranelift JIT ([`CpuBackend`],
//! `--device cpu`), and CUDA ([`CudaBackend`], `--device cuda`: the generated kernels compiled
//! by NVRTC), all behind the same [`Backend`] trait.

pub mod alone;
mod backend;
pub mod bench;
mod constraint;
mod cpu;
mod cpu_moe;
mod cuda;
mod engine;
mod handle;
mod pipeline;
mod pool;
pub mod probe;
mod radix;
mod request;
mod sampler;
mod scheduler;
mod sequences;
mod tp;
mod worker;

pub use backend::{check_batch, load, resolve, Backend, Device, Fed, RefBackend, StepSeq};
pub use constraint::{allows, Constraint, TokenConstraint};
pub use cpu::CpuBackend;
pub use cuda::tp::{Bootstrap, InProcess, TpCudaBackend};
pub use cuda::CudaBackend;
pub use engine::{Engine, EngineConfig, StepRecord};
pub use handle::{EngineHandle, Sink, Snapshot};
pub use pipeline::HostPipeline;
pub use pool::PagePool;
pub use radix::{NodeId, RadixCache};
pub use request::{Event, Finish, FinishReason, Output, Pooling, ReqId, Request};
pub use sampler::{adjusted, pick, Adjust, Logprobs, RequestSampler, RowSampling, Sampler, SamplingParams};
pub use scheduler::{Policy, PoolUsage, SchedStats};
pub use sequences::{SeqChunk, SeqId, Sequences};
pub use tp::TpCpuBackend;

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
