//! `bundle`: the on-disk format that `engc` writes and `engrun` loads. A bundle is a directory:
//!
//! ```text
//! manifest.json                 format and engine version, model params, tp, dtype, checksum of every other file
//! plan.json                     the compiled plan (ir::Plan)
//! weights/rank{N}.safetensors   per-rank weights, pre-sharded, in the bundle dtype
//! kernels/*.cu                  generated kernels (CUDA backend)
//! tokenizer/                    tokenizer.json, tokenizer_config.json, chat template, generation_config.json
//! ```
//!
//! Checksums are BLAKE3 (hex) from format version 2, sha256 in version 1 (still read).
//! [`BundleWriter`] writes into a temporary sibling directory, records the checksum of every
//! file it writes, and renames the directory into place only when complete, so a failed compile
//! leaves nothing half-written. [`Bundle::open`] refuses a bundle whose format is newer than this
//! build, and one whose files differ from its manifest in any way: a file under the directory
//! that is not listed (`manifest.json` excepted), a listed file that is missing, a checksum that
//! does not match, anything that is not a regular file or a directory (a symlink could point
//! anywhere), or a manifest that does not list `plan.json` and every rank's weights.
#![deny(missing_docs)]

mod reader;
mod writer;

pub use reader::{Bundle, GenerationConfig, WeightFile};
pub use writer::{BundleWriter, TensorEntry};

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The bundle format version this build writes (it reads every version up to it). Version 2:
/// BLAKE3 checksums (version 1: sha256).
pub const FORMAT_VERSION: u32 = 2;

/// The engine version, recorded in every bundle.
pub const ENGINE_VERSION: &str = env!("CARGO_PKG_VERSION");

/// `manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Bundle format version.
    pub format_version: u32,
    /// Version of the engine that wrote it.
    pub engine_version: String,
    /// Model spec name (`qwen2`).
    pub model: String,
    /// Bound parameters of the model.
    pub params: BTreeMap<String, serde_json::Value>,
    /// Tensor-parallel ranks.
    pub tp: usize,
    /// Weight dtype (`bf16`, `f16`, `f32`).
    pub dtype: String,
    /// Checksum (hex) of every other file, by path relative to the bundle root: BLAKE3 from
    /// format version 2, sha256 before.
    pub files: BTreeMap<String, String>,
}

/// Errors reading or writing a bundle.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    /// A file could not be read or written.
    #[error("{path}: {message}")]
    Io {
        /// The path.
        path: String,
        /// The OS error.
        message: String,
    },
    /// The directory is not a bundle.
    #[error("{path} is not a bundle ({message}); create one with `engc compile`")]
    NotABundle {
        /// The path.
        path: String,
        /// Why.
        message: String,
    },
    /// The bundle was written by a newer format.
    #[error("{path} has bundle format {found}, but this engrun reads format {supported} at most; upgrade engrun or re-compile the bundle with this version's engc")]
    NewerFormat {
        /// The path.
        path: String,
        /// Format found.
        found: u32,
        /// Format supported.
        supported: u32,
    },
    /// A file's contents do not match the manifest.
    #[error("{path}: checksum mismatch for `{file}` (the bundle is corrupt or was modified); re-run `engc compile`")]
    Checksum {
        /// The bundle.
        path: String,
        /// The file.
        file: String,
    },
    /// The bundle's files do not match the manifest: a file is missing, not listed, required but
    /// not listed, or not a regular file.
    #[error("{path}: `{file}` {problem} (the bundle is incomplete or was modified); re-run `engc compile`")]
    Integrity {
        /// The bundle.
        path: String,
        /// The file, relative to the bundle root.
        file: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A file is malformed.
    #[error("{path}: {message}")]
    Malformed {
        /// The file.
        path: String,
        /// What is wrong.
        message: String,
    },
}

pub(crate) fn io_err(path: &std::path::Path, e: impl std::fmt::Display) -> BundleError {
    BundleError::Io { path: path.display().to_string(), message: e.to_string() }
}
