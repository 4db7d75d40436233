//! Tensor parallelism on the CPU: one [`CpuBackend`] per rank of a `--tp N` bundle, each with
//! its rank's weight shard, KV pool and share of the cores, run on its own thread every step;
//! an in-process all-reduce joins them after each row-parallel linear, and an all-gather joins
//! a vocab-parallel lm_head's logits (a replicated one computes them whole on every rank);
//! rank 0's logits are returned.

use crate::backend::{Backend, StepSeq};
use crate::cpu::{Collective, CpuBackend};
use crate::RuntimeError;
use bundle::Bundle;
use std::sync::{Barrier, Mutex};

/// The collectives of one step between the ranks' threads: each rank deposits its part, waits
/// for the others, and combines the parts in rank order (so every rank holds bit-identical
/// results).
pub(crate) struct Exchange {
    parts: Mutex<Vec<Vec<f32>>>,
    barrier: Barrier,
}

impl Exchange {
    fn new(ranks: usize) -> Exchange {
        Exchange { parts: Mutex::new(vec![Vec::new(); ranks]), barrier: Barrier::new(ranks) }
    }

    /// Replaces `v` (rank `rank`'s part) with `combine` of every rank's part.
    fn exchange(&self, rank: usize, v: &mut Vec<f32>, combine: impl Fn(&[Vec<f32>]) -> Vec<f32>) {
        self.parts.lock().unwrap_or_else(|e| e.into_inner())[rank] = std::mem::take(v);
        self.barrier.wait();
        *v = combine(&self.parts.lock().unwrap_or_else(|e| e.into_inner()));
        // Nobody deposits the next tensor before everyone has read this one.
        self.barrier.wait();
    }
}

/// Rank `.1`'s side of an [`Exchange`].
struct RankComm<'a>(&'a Exchange, usize);

impl Collective for RankComm<'_> {
    fn all_reduce(&self, v: &mut Vec<f32>) {
        self.0.exchange(self.1, v, |parts| {
            let mut sum = parts[0].clone();
            for p in &parts[1..] {
                for (s, x) in sum.iter_mut().zip(p) {
                    *s += x;
                }
            }
            sum
        });
    }

    fn all_gather(&self, v: &mut Vec<f32>, cols: usize) {
        self.0.exchange(self.1, v, |parts| {
            let rows = parts[0].len() / cols.max(1);
            (0..rows)
                .flat_map(|r| parts.iter().flat_map(move |p| p[r * cols..(r + 1) * cols].iter().copied()))
                .collect()
        });
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
        self.forward_ranks(batch, false)
    }

    fn forward_hidden(&mut self, batch: &[StepSeq]) -> Result<Vec<f32>, RuntimeError> {
        self.forward_ranks(batch, true)
    }

    fn hidden_size(&self) -> usize {
        self.ranks[0].hidden_size()
    }
}

impl TpCpuBackend {
    /// Every rank's step on its own thread; rank 0's result (the ranks agree after the last
    /// all-reduce or all-gather).
    fn forward_ranks(&mut self, batch: &[StepSeq], hidden: bool) -> Result<Vec<f32>, RuntimeError> {
        let ex = Exchange::new(self.ranks.len());
        let results: Vec<Result<Vec<f32>, RuntimeError>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .ranks
                .iter_mut()
                .enumerate()
                .map(|(i, r)| {
                    let comm = RankComm(&ex, i);
                    s.spawn(move || r.forward_rank(batch, &comm, hidden))
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
