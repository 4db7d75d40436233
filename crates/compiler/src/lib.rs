//! `compiler`: turns a bound model into a plan and writes the bundle. Stages, in
//! [`driver::compile`]: read the checkpoint ([`checkpoint`]), bind the spec, validate the
//! checkpoint against it, lower the graph statements into the IR ([`lower`]), run the pass
//! pipeline ([`passes`]), linearise into a [`ir::Plan`], and write per-rank weights
//! ([`shard`]) and the tokenizer into a bundle. It runs nothing.
#![deny(missing_docs)]

pub mod arrange;
pub mod checkpoint;
pub mod driver;
pub mod fp8;
pub mod fuse;
pub mod fusion;
pub mod gguf;
pub mod gguf_tokenizer;
pub mod lower;
pub mod passes;
pub mod select;
pub mod shard;

pub use driver::{compile, plan_for_config, plan_for_config_quant, CompileOptions, CompileReport};
pub use passes::{LmHead, Quant};
pub use select::{find_model, model_dirs};

/// Errors of compilation. Each names the file, tensor or pass it concerns.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    /// The model YAML is wrong.
    #[error(transparent)]
    Spec(#[from] spec::SpecError),
    /// The checkpoint cannot be read.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// File or directory.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// A tensor the model names is not in the checkpoint.
    #[error("{at}: weight `{key}` needs tensor `{name}`, which is missing from the checkpoint {checkpoint}")]
    MissingTensor {
        /// Tensor name.
        name: String,
        /// YAML key.
        key: String,
        /// Where in the YAML.
        at: String,
        /// The checkpoint directory.
        checkpoint: String,
    },
    /// A tensor's shape differs from the YAML's.
    #[error("{at}: tensor `{name}` has shape {found:?} in the checkpoint, but the model expects {expected:?}")]
    ShapeMismatch {
        /// Tensor name.
        name: String,
        /// Where in the YAML.
        at: String,
        /// Shape from the YAML.
        expected: Vec<usize>,
        /// Shape in the checkpoint.
        found: Vec<usize>,
    },
    /// A tensor's dtype is not bf16, f16 or f32 (nor a GGUF block type, nor FP8 E4M3 with its
    /// scales).
    #[error("tensor `{name}` has dtype {dtype}, which is not supported (supported: bf16, f16, f32, GGUF's block types, F8_E4M3 weights with their scale tensors under a quantization_config of fp8 or compressed-tensors)")]
    UnsupportedDtype {
        /// Tensor name.
        name: String,
        /// Its dtype.
        dtype: String,
    },
    /// A graph statement cannot be lowered.
    #[error("{at}: in `{statement}`: {message}")]
    Graph {
        /// Where in the YAML.
        at: String,
        /// The statement.
        statement: String,
        /// What is wrong.
        message: String,
    },
    /// A pass (or the verifier after it) failed.
    #[error("pass `{pass}`: {source}")]
    Pass {
        /// The pass.
        pass: String,
        /// The IR error.
        source: ir::IrError,
    },
    /// tp does not divide the heads.
    #[error("--tp {tp} does not divide the {heads} attention heads; choose a tp that divides them")]
    TpHeads {
        /// Requested ranks.
        tp: usize,
        /// Head count.
        heads: usize,
    },
    /// A weight cannot be split over the ranks.
    #[error("cannot shard `{weight}`: {message}")]
    Tp {
        /// Tensor name.
        weight: String,
        /// Why.
        message: String,
    },
    /// Writing the bundle failed.
    #[error(transparent)]
    Bundle(#[from] bundle::BundleError),
    /// A bad option.
    #[error("{0}")]
    Usage(String),
}
