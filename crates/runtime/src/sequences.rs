//! Sequences without a scheduler: each sequence gets pages of the pool as it grows, until it
//! is released. `engrun logits` and the backend tests use it; serving goes through
//! [`crate::Engine`].

use crate::{Adjust, Backend, PagePool, RowSampling, RuntimeError, StepSeq};
use std::collections::HashMap;

/// Identifies a sequence of a [`Sequences`].
pub type SeqId = u64;

/// One sequence's part of a batched step: its new tokens and the rows (indices into `tokens`)
/// whose logits are wanted.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    /// The sequence (created on first use).
    pub seq: SeqId,
    /// Its tokens in this step, at its next positions.
    pub tokens: &'a [u32],
    /// Rows of `tokens` whose logits are returned.
    pub rows: &'a [usize],
}

/// A backend with a simple per-sequence allocation of its KV pool.
pub struct Sequences {
    backend: Box<dyn Backend>,
    pool: PagePool,
    seqs: HashMap<SeqId, (Vec<u32>, usize)>,
}

impl Sequences {
    /// Allocates a pool of `slots` token slots (pages of 16) on `backend`.
    pub fn new(mut backend: Box<dyn Backend>, slots: usize) -> Result<Sequences, RuntimeError> {
        let pool = PagePool::new(slots.next_multiple_of(16), 16)?;
        backend.alloc_kv(pool.total() * 16)?;
        Ok(Sequences { backend, pool, seqs: HashMap::new() })
    }

    /// Vocabulary size.
    pub fn vocab(&self) -> usize {
        self.backend.vocab()
    }

    /// Runs `tokens` for `seq` at its next positions; returns the logits of `rows`.
    pub fn forward(&mut self, seq: SeqId, tokens: &[u32], rows: &[usize]) -> Result<Vec<f32>, RuntimeError> {
        self.forward_batch(&[SeqChunk { seq, tokens, rows }])
    }

    /// The backend's [`Backend::resample`] of the last step's logits.
    pub fn resample(&mut self, rows: &[RowSampling], adjust: &[Vec<Adjust>]) -> Result<Option<Vec<u32>>, RuntimeError> {
        self.backend.resample(rows, adjust)
    }

    /// Runs one step over several sequences; returns every chunk's logits rows, in order. A
    /// failed step leaves every sequence as it was.
    pub fn forward_batch(&mut self, batch: &[SeqChunk]) -> Result<Vec<f32>, RuntimeError> {
        for (i, c) in batch.iter().enumerate() {
            if batch[..i].iter().any(|o| o.seq == c.seq) {
                return Err(RuntimeError::Invalid(format!("sequence {} appears twice in the batch", c.seq)));
            }
        }
        let mut grown: Vec<(SeqId, Vec<u32>)> = Vec::new();
        let mut slots = Vec::with_capacity(batch.len());
        for c in batch {
            let (pages, len) = self.seqs.get(&c.seq).cloned().unwrap_or_default();
            let need = self.pool.pages_for(len + c.tokens.len()).saturating_sub(pages.len());
            let Some(new) = self.pool.alloc(need) else {
                for (_, p) in &grown {
                    self.pool.free(p);
                }
                return Err(RuntimeError::Invalid(format!(
                    "the KV pool ({} slots) is full",
                    self.pool.total() * self.pool.page_size()
                )));
            };
            let all = [pages, new.clone()].concat();
            slots.push(self.pool.slots(&all, len + c.tokens.len()));
            grown.push((c.seq, new));
        }
        let steps: Vec<StepSeq> =
            batch.iter().zip(&slots).map(|(c, s)| StepSeq { tokens: c.tokens, slots: s, rows: c.rows }).collect();
        match self.backend.forward(&steps) {
            Ok(logits) => {
                for (c, (_, new)) in batch.iter().zip(grown) {
                    let e = self.seqs.entry(c.seq).or_default();
                    e.0.extend(new);
                    e.1 += c.tokens.len();
                }
                Ok(logits)
            }
            Err(e) => {
                for (_, p) in &grown {
                    self.pool.free(p);
                }
                Err(e)
            }
        }
    }

    /// Positions cached for `seq` (0 if unknown).
    pub fn seq_len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.1)
    }

    /// Frees the pages of `seq`.
    pub fn release(&mut self, seq: SeqId) {
        if let Some((pages, _)) = self.seqs.remove(&seq) {
            self.pool.free(&pages);
        }
    }
}
