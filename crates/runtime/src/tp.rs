//! Tensor parallelism on the CPU: one [`CpuBackend`] per rank of a `--tp N` bundle, each with
//! its rank's weight shard, KV pool and share of the cores, run on its own thread every step;
//! an in-process all-reduce joins them after each row-parallel linear. The lm_head is
//! replicated, so every rank computes the full logits and rank 0's are returned.

use crate::backend::{Backend, StepSeq};
use crate::cpu::CpuBackend;
use crate::RuntimeError;
use bundle::Bundle;
use std::sync::{Barrier, Mutex};

/// Sums a tensor across the ranks of one step: each rank deposits its part, waits for the
/// others, and adds the parts in rank order (so every rank holds bit-identical sums).
pub(crate) struct AllReduce {
    parts: Mutex<Vec<Vec<f32>>>,
    barrier: Barrier,
}

impl AllReduce {
    fn new(ranks: usize) -> AllReduce {
        AllReduce { parts: Mutex::new(vec![Vec::new(); ranks]), barrier: Barrier::new(ranks) }
    }

    /// Replaces `v` (rank `rank`'s part) with the sum over all ranks.
    pub fn reduce(&self, rank: usize, v: &mut Vec<f32>) {
        self.parts.lock().unwrap_or_else(|e| e.into_inner())[rank] = std::mem::take(v);
        self.barrier.wait();
        {
            let parts = self.parts.lock().unwrap_or_else(|e| e.into_inner());
            let mut sum = parts[0].clone();
            for p in &parts[1..] {
                for (s, x) in sum.iter_mut().zip(p) {
                    *s += x;
                }
            }
            *v = sum;
        }
        // Nobody deposits the next tensor before everyone has read this one.
        self.barrier.wait();
    }
}

/// The ranks of a tensor-parallel bundle on the CPU.
pub struct TpCpuBackend {
    ranks: Vec<CpuBackend>,
}

impl TpCpuBackend {
    /// Loads every rank of `bundle`, splitting the cores between them.
    pub fn new(bundle: &Bundle) -> Result<TpCpuBackend, RuntimeError> {
        let tp = bundle.plan.tp;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let ranks = (0..tp).map(|r| CpuBackend::rank(bundle, r, (cores / tp).max(1))).collect::<Result<Vec<_>, _>>()?;
        Ok(TpCpuBackend { ranks })
    }
}

impl Backend for TpCpuBackend {
    fn vocab(&self) -> usize {
        self.ranks[0].vocab()
    }

    fn kv_slot_bytes(&self) -> usize {
        self.ranks.iter().map(|r| r.kv_slot_bytes()).sum()
    }

    fn kv_slots(&self) -> usize {
        self.ranks[0].kv_slots()
    }

    fn alloc_kv(&mut self, slots: usize) -> Result<(), RuntimeError> {
        self.ranks.iter_mut().try_for_each(|r| r.alloc_kv(slots))
    }

    fn forward(&mut self, batch: &[StepSeq]) -> Result<Vec<f32>, RuntimeError> {
        let ar = AllReduce::new(self.ranks.len());
        let results: Vec<Result<Vec<f32>, RuntimeError>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .ranks
                .iter_mut()
                .enumerate()
                .map(|(i, r)| {
                    let ar = &ar;
                    s.spawn(move || r.forward_rank(batch, &|v: &mut Vec<f32>| ar.reduce(i, v)))
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
        });
        let mut results = results.into_iter();
        let first = results.next().expect("at least one rank");
        results.try_for_each(|r| r.map(drop))?;
        first
    }
}
