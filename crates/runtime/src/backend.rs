//! The backend interface and the reference backend.

use crate::RuntimeError;
use bundle::Bundle;
use ir::{Interpreter, KvCache};
use std::collections::HashMap;
use std::str::FromStr;

/// Identifies a sequence whose KV cache a backend holds.
pub type SeqId = u64;

/// Where a plan runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The reference interpreter (f32, slow, the oracle).
    Ref,
    /// The Cranelift JIT backend.
    Cpu,
    /// The CUDA backend.
    Cuda,
}

impl FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ref" => Ok(Device::Ref),
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda),
            other => Err(format!("unknown device `{other}` (expected ref, cpu or cuda)")),
        }
    }
}

/// One sequence's part of a batched step: its new tokens and the rows (indices into `tokens`)
/// whose logits are wanted.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    /// The sequence.
    pub seq: SeqId,
    /// Its tokens in this step, at its next positions.
    pub tokens: &'a [u32],
    /// Rows of `tokens` whose logits are returned.
    pub rows: &'a [usize],
}

/// A loaded model that runs forward steps for sequences.
pub trait Backend {
    /// Vocabulary size (columns of the logits).
    fn vocab(&self) -> usize;
    /// Runs `tokens` for sequence `seq` (created on first use) at its next positions and
    /// returns the logits of the rows `rows` (indices into `tokens`), `rows.len() × vocab`.
    fn forward(&mut self, seq: SeqId, tokens: &[u32], rows: &[usize]) -> Result<Vec<f32>, RuntimeError>;
    /// Runs one step over several sequences and returns the logits of every chunk's rows, chunk
    /// after chunk. Backends that batch (the CPU and CUDA ones) run all the chunks' tokens
    /// through each weight once; this default runs the chunks one by one.
    fn forward_batch(&mut self, batch: &[SeqChunk]) -> Result<Vec<f32>, RuntimeError> {
        let mut out = Vec::new();
        for c in batch {
            out.extend(self.forward(c.seq, c.tokens, c.rows)?);
        }
        Ok(out)
    }
    /// Number of positions cached for `seq` (0 if unknown).
    fn seq_len(&self, seq: SeqId) -> usize;
    /// Drops the KV cache of `seq`.
    fn release(&mut self, seq: SeqId);
}

/// The reference interpreter as a backend: one f32 KV cache per sequence.
pub struct RefBackend {
    interp: Interpreter,
    caches: HashMap<SeqId, KvCache>,
}

impl RefBackend {
    /// Loads rank 0's weights of `bundle` as f32.
    pub fn new(bundle: &Bundle) -> Result<RefBackend, RuntimeError> {
        let weights = bundle.weights(0)?;
        let interp =
            Interpreter::new(bundle.plan.clone(), |name, shape| weights.f32(name, shape).map_err(|e| e.to_string()))?;
        Ok(RefBackend { interp, caches: HashMap::new() })
    }
}

impl Backend for RefBackend {
    fn vocab(&self) -> usize {
        self.interp.plan().vocab
    }

    fn forward(&mut self, seq: SeqId, tokens: &[u32], rows: &[usize]) -> Result<Vec<f32>, RuntimeError> {
        let cache = self.caches.entry(seq).or_insert_with(|| self.interp.new_cache());
        Ok(self.interp.forward(cache, tokens, rows)?)
    }

    fn seq_len(&self, seq: SeqId) -> usize {
        self.caches.get(&seq).map_or(0, KvCache::len)
    }

    fn release(&mut self, seq: SeqId) {
        self.caches.remove(&seq);
    }
}

/// Loads `bundle` onto `device`.
pub fn load(bundle: &Bundle, device: Device) -> Result<Box<dyn Backend>, RuntimeError> {
    match device {
        Device::Ref => Ok(Box::new(RefBackend::new(bundle)?)),
        Device::Cpu => Ok(Box::new(crate::CpuBackend::new(bundle)?)),
        Device::Cuda => {
            Err(RuntimeError::Unsupported("the CUDA backend is not part of this build yet; use --device cpu".into()))
        }
    }
}
