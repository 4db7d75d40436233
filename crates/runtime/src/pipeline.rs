//! [`HostPipeline`]: the pipelined interface of a backend ([`Backend::launch_forward`],
//! [`Backend::launch_choice`]) over any backend, on the host, so the worker's pipelined path
//! runs (and is tested) without a device.

use crate::backend::{choose_rows, Backend, Fed, StepSeq};
use crate::sampler::{Adjust, RowSampling};
use crate::{Constraint, RuntimeError};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A backend whose steps launch ahead of their tokens: `launch_forward` runs the forward pass
/// at once on the inner backend (its fed tokens taken from the step launched before, which
/// must not be finished yet, as a device's would be), `launch_choice` chooses from its logits
/// by the backends' rule ([`choose_rows`]) and keeps the tokens until `finish_sample`;
/// `sample_ready` says yes only `latency` after the choice's launch, as a device busy with the
/// step would. Every other call goes to the inner backend, and only with no step unfinished.
pub struct HostPipeline {
    inner: Box<dyn Backend>,
    /// The logits of the forward pass launched and not yet chosen from.
    logits: Option<Vec<f32>>,
    /// Tokens of the steps launched and not finished, oldest first, and when each launched.
    unfinished: VecDeque<(Vec<u32>, Instant)>,
    latency: Duration,
    /// Tokens fed from the step before, counted over every launch.
    fed: Arc<AtomicUsize>,
}

impl HostPipeline {
    /// Wraps `inner`, its steps ready `latency` after their launch.
    pub fn new(inner: Box<dyn Backend>, latency: Duration) -> HostPipeline {
        HostPipeline { inner, logits: None, unfinished: VecDeque::new(), latency, fed: Arc::new(AtomicUsize::new(0)) }
    }

    /// The count of tokens fed from a step before, over every launch so far (shared).
    pub fn fed_tokens(&self) -> Arc<AtomicUsize> {
        self.fed.clone()
    }

    fn idle(&self, what: &str) -> Result<(), RuntimeError> {
        if self.unfinished.is_empty() && self.logits.is_none() {
            return Ok(());
        }
        Err(RuntimeError::Invalid(format!(
            "{what} called with {} step(s) launched and not finished",
            self.unfinished.len()
        )))
    }
}

impl Backend for HostPipeline {
    fn vocab(&self) -> usize {
        self.inner.vocab()
    }
    fn kv_slot_bytes(&self) -> usize {
        self.inner.kv_slot_bytes()
    }
    fn kv_slots(&self) -> usize {
        self.inner.kv_slots()
    }
    fn alloc_kv(&mut self, slots: usize) -> Result<(), RuntimeError> {
        self.idle("alloc_kv")?;
        self.inner.alloc_kv(slots)
    }
    fn forward(&mut self, batch: &[StepSeq]) -> Result<Vec<f32>, RuntimeError> {
        self.idle("forward")?;
        self.inner.forward(batch)
    }
    fn forward_hidden(&mut self, batch: &[StepSeq]) -> Result<Vec<f32>, RuntimeError> {
        self.idle("forward_hidden")?;
        self.inner.forward_hidden(batch)
    }
    fn hidden_size(&self) -> usize {
        self.inner.hidden_size()
    }
    fn forward_sample(
        &mut self,
        batch: &[StepSeq],
        rows: &[RowSampling],
        adjust: &[Vec<Adjust>],
        constraints: &[Option<Constraint>],
    ) -> Result<Vec<u32>, RuntimeError> {
        self.idle("forward_sample")?;
        self.inner.forward_sample(batch, rows, adjust, constraints)
    }
    fn pipelined(&self) -> bool {
        true
    }
    fn launch_forward(&mut self, batch: &[StepSeq], fed: &[Fed]) -> Result<(), RuntimeError> {
        if self.logits.is_some() {
            return Err(RuntimeError::Invalid("a forward pass launched before the last one's choice".into()));
        }
        let mut tokens: Vec<Vec<u32>> = batch.iter().map(|s| s.tokens.to_vec()).collect();
        if !fed.is_empty() {
            let (before, _) = self.unfinished.back().ok_or_else(|| {
                RuntimeError::Invalid("a step feeds tokens from a step before it that has finished".into())
            })?;
            let mut at: Vec<(usize, usize)> = Vec::new();
            for (i, t) in tokens.iter().enumerate() {
                at.extend((0..t.len()).map(|j| (i, j)));
            }
            for f in fed {
                let (&(i, j), &token) = at.get(f.token).zip(before.get(f.row)).ok_or_else(|| {
                    RuntimeError::Invalid(format!("fed token {f:?} outside the step or the step before"))
                })?;
                tokens[i][j] = token;
            }
            self.fed.fetch_add(fed.len(), Ordering::Relaxed);
        }
        let steps: Vec<StepSeq> =
            batch.iter().zip(&tokens).map(|(s, t)| StepSeq { tokens: t, slots: s.slots, rows: s.rows }).collect();
        self.logits = Some(self.inner.forward(&steps)?);
        Ok(())
    }
    fn launch_choice(
        &mut self,
        rows: &[RowSampling],
        adjust: &[Vec<Adjust>],
        constraints: &[Option<Constraint>],
    ) -> Result<(), RuntimeError> {
        let logits =
            self.logits.take().ok_or_else(|| RuntimeError::Invalid("a choice launched with no forward pass".into()))?;
        let ids = choose_rows(&logits, self.inner.vocab(), rows, adjust, constraints);
        self.unfinished.push_back((ids, Instant::now()));
        Ok(())
    }
    fn sample_ready(&mut self) -> Result<bool, RuntimeError> {
        Ok(self.unfinished.front().is_none_or(|(_, at)| at.elapsed() >= self.latency))
    }
    fn finish_sample(&mut self) -> Result<Vec<u32>, RuntimeError> {
        let (ids, _) =
            self.unfinished.pop_front().ok_or_else(|| RuntimeError::Invalid("no step launched to finish".into()))?;
        Ok(ids)
    }
    fn free_memory(&self) -> Option<usize> {
        self.inner.free_memory()
    }
}
