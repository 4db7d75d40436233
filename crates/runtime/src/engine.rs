//! The engine: a scheduler and a worker. [`Engine::step`] is one turn of SGLang's event loop
//! (get_next_batch_to_run → run_batch → process_batch_result); with overlap scheduling the
//! next step is planned and submitted before the previous step's results are processed, so
//! the CPU's work hides behind the device's.

use crate::scheduler::{Next, PoolUsage, SchedStats, Scheduler, StepPlan};
use crate::worker::Worker;
use crate::{Backend, Event, Output, PagePool, Policy, ReqId, Request, RuntimeError};
use bundle::Bundle;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How the engine schedules and sizes its KV pool.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Token slots per KV page (the radix cache shares whole pages).
    pub page_size: usize,
    /// Token slots in the KV pool; `None`: as many as `kv_budget_bytes` holds.
    pub kv_slots: Option<usize>,
    /// KV pool size in bytes when `kv_slots` is `None` on a host-memory backend.
    pub kv_budget_bytes: usize,
    /// Share of the device's free memory (after weights) the KV pool takes when `kv_slots` is
    /// `None` on a device backend; the rest is for activations and CUDA graphs.
    pub mem_fraction: f64,
    /// Most requests running at once.
    pub max_running_requests: usize,
    /// Most prompt tokens computed in one step.
    pub max_prefill_tokens: usize,
    /// Longest extend chunk of one request in one step.
    pub chunked_prefill_size: usize,
    /// Admission order.
    pub policy: Policy,
    /// Reuse cached prefixes (off: `--disable-radix-cache`).
    pub radix_cache: bool,
    /// Plan step N+1 while step N runs (off: `--disable-overlap`).
    pub overlap: bool,
    /// Context length of the model.
    pub max_context: usize,
    /// The model's eos ids.
    pub eos_ids: Vec<u32>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            page_size: 16,
            kv_slots: None,
            kv_budget_bytes: 1 << 30,
            mem_fraction: 0.85,
            max_running_requests: 256,
            max_prefill_tokens: 16384,
            chunked_prefill_size: 8192,
            policy: Policy::Fcfs,
            radix_cache: true,
            overlap: true,
            max_context: usize::MAX,
            eos_ids: vec![],
        }
    }
}

impl EngineConfig {
    /// The defaults for `device` (a resolved one: not `Auto`) with the bundle's context length
    /// and eos ids. A step's prompt tokens are sized so that one mixed step stays short on the
    /// device: on a GPU, 16384 prompt tokens (chunks of 8192) are tens of milliseconds; on the
    /// CPU they would be tens of seconds, during which no running request decodes, so the CPU
    /// takes 64 per step (a burst of 200 requests starts answering within seconds: the
    /// measurements in docs/server.md).
    pub fn for_device(bundle: &Bundle, device: crate::Device) -> Result<EngineConfig, RuntimeError> {
        let cfg = EngineConfig::for_bundle(bundle)?;
        Ok(match device {
            crate::Device::Cuda | crate::Device::Auto => cfg,
            crate::Device::Cpu | crate::Device::Ref => {
                EngineConfig { chunked_prefill_size: 64, max_prefill_tokens: 64, ..cfg }
            }
        })
    }

    /// The defaults with the bundle's context length and eos ids.
    pub fn for_bundle(bundle: &Bundle) -> Result<EngineConfig, RuntimeError> {
        let max_context =
            bundle.manifest.params.get("max_positions").and_then(|v| v.as_u64()).map_or(usize::MAX, |v| v as usize);
        let eos_ids = bundle.generation_config()?.eos_token_id;
        Ok(EngineConfig { max_context, eos_ids, ..EngineConfig::default() })
    }
}

/// One step as the worker ran it.
#[derive(Debug, Clone, Copy)]
pub struct StepRecord {
    /// Tokens of extend chunks.
    pub extend_tokens: usize,
    /// Sequences in the step.
    pub seqs: usize,
    /// KV positions the step's attention read (all sequences).
    pub kv_positions: usize,
    /// Time the worker spent on it.
    pub elapsed: Duration,
    /// When its results were processed.
    pub done_at: Instant,
}

/// A model being served (see the module docs).
pub struct Engine {
    sched: Scheduler,
    worker: Worker,
    in_flight: usize,
    overlap: bool,
    vocab: usize,
    hidden: usize,
    slot_bytes: usize,
    records: Option<Vec<StepRecord>>,
}

impl Engine {
    /// Sizes the KV pool on `backend` and starts its worker thread.
    pub fn new(mut backend: Box<dyn Backend>, cfg: EngineConfig) -> Result<Engine, RuntimeError> {
        let slot_bytes = backend.kv_slot_bytes().max(1);
        if !(cfg.mem_fraction > 0.0 && cfg.mem_fraction <= 1.0) {
            return Err(RuntimeError::Invalid(format!("mem-fraction must be in (0, 1], got {}", cfg.mem_fraction)));
        }
        let budget =
            backend.free_memory().map_or(cfg.kv_budget_bytes, |free| (free as f64 * cfg.mem_fraction) as usize);
        let slots = cfg.kv_slots.unwrap_or(budget / slot_bytes);
        if cfg.max_running_requests == 0 || cfg.chunked_prefill_size == 0 || cfg.max_prefill_tokens == 0 {
            return Err(RuntimeError::Invalid(
                "max-running-requests, chunked-prefill-size and max-prefill-tokens must be at least 1".into(),
            ));
        }
        let pool = PagePool::new(slots, cfg.page_size)?;
        backend.alloc_kv(pool.total() * pool.page_size())?;
        let (vocab, hidden) = (backend.vocab(), backend.hidden_size());
        let overlap = cfg.overlap;
        Ok(Engine {
            sched: Scheduler::new(cfg, pool),
            worker: Worker::spawn(backend),
            in_flight: 0,
            overlap,
            vocab,
            hidden,
            slot_bytes,
            records: None,
        })
    }

    /// Vocabulary size of the model.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Features of the final hidden state (an embedding's dimensions).
    pub fn hidden_size(&self) -> usize {
        self.hidden
    }

    /// Bytes of KV per token slot.
    pub fn kv_slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Queues a request (checked against the model and the pool).
    pub fn submit(&mut self, req: Request) -> Result<ReqId, RuntimeError> {
        self.sched.submit(req, self.vocab)
    }

    /// Ends a request at once; its pages go back to the cache and the pool. Returns its
    /// `Finished` event, or `None` if it had already ended.
    pub fn abort(&mut self, id: ReqId) -> Option<Event> {
        let e = self.sched.abort(id);
        if e.is_some() {
            self.worker.release(id);
        }
        e
    }

    /// No request is queued, running or in flight.
    pub fn is_idle(&self) -> bool {
        self.sched.is_idle() && self.in_flight == 0
    }

    /// Requests waiting to be admitted.
    pub fn queue_len(&self) -> usize {
        self.sched.queue_len()
    }

    /// Requests admitted and not finished.
    pub fn running_len(&self) -> usize {
        self.sched.running_len()
    }

    /// Pages of the KV pool by state.
    pub fn usage(&self) -> PoolUsage {
        self.sched.usage()
    }

    /// Counters since start.
    pub fn stats(&self) -> SchedStats {
        self.sched.stats
    }

    /// The KV pool's integrity check (every page free, cached or private exactly once; cache
    /// locks match the running requests).
    pub fn check(&self) -> Result<(), RuntimeError> {
        self.sched.check()
    }

    /// Starts keeping a [`StepRecord`] per step (for benchmarks).
    pub fn record_steps(&mut self) {
        self.records = Some(Vec::new());
    }

    /// The steps recorded so far.
    pub fn take_records(&mut self) -> Vec<StepRecord> {
        self.records.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// One turn of the loop: plan and submit a step, process finished ones, and return their
    /// events. When the engine becomes idle it runs the integrity check.
    pub fn step(&mut self) -> Result<Vec<(ReqId, Event)>, RuntimeError> {
        let mut events = Vec::new();
        let planned = loop {
            match self.sched.schedule(self.in_flight > 0) {
                Next::Step(p) => break Some(p),
                Next::Idle => break None,
                Next::Sync => events.extend(self.finish_oldest()?),
            }
        };
        let keep = if let Some(p) = planned {
            self.worker.submit(p)?;
            self.in_flight += 1;
            self.overlap as usize
        } else {
            0
        };
        while self.in_flight > keep {
            events.extend(self.finish_oldest()?);
        }
        if self.is_idle() {
            self.check()?;
        }
        Ok(events)
    }

    fn finish_oldest(&mut self) -> Result<Vec<(ReqId, Event)>, RuntimeError> {
        let (plan, sampled, elapsed) = self.worker.wait()?;
        self.in_flight -= 1;
        self.record(&plan, elapsed);
        let events = self.sched.process(plan, sampled?);
        for (id, e) in &events {
            if matches!(e, Event::Finished(_)) {
                self.worker.release(*id);
            }
        }
        Ok(events)
    }

    fn record(&mut self, plan: &StepPlan, elapsed: Duration) {
        if let Some(r) = &mut self.records {
            r.push(StepRecord {
                extend_tokens: plan.extend_tokens,
                seqs: plan.seqs.len(),
                kv_positions: plan.seqs.iter().map(|s| s.slots.len()).sum(),
                elapsed,
                done_at: Instant::now(),
            });
        }
    }

    /// Runs `reqs` to completion (the offline API): all are queued at once and scheduled
    /// together; returns their outputs in order.
    pub fn generate(&mut self, reqs: Vec<Request>) -> Result<Vec<Output>, RuntimeError> {
        let ids = reqs.into_iter().map(|r| self.submit(r)).collect::<Result<Vec<_>, _>>()?;
        let mut outs: HashMap<ReqId, Output> = HashMap::new();
        let mut done = 0;
        while done < ids.len() {
            for (id, e) in self.step()? {
                let o = outs.entry(id).or_insert_with(|| Output {
                    tokens: vec![],
                    logprobs: vec![],
                    embedding: vec![],
                    finish: crate::Finish {
                        reason: crate::FinishReason::Abort,
                        prompt_tokens: 0,
                        completion_tokens: 0,
                        cached_tokens: 0,
                    },
                });
                match e {
                    Event::Token { id, logprobs } => {
                        o.tokens.push(id);
                        o.logprobs.extend(logprobs);
                    }
                    Event::Embedding(v) => o.embedding = v,
                    Event::Finished(f) => {
                        o.finish = f;
                        done += 1;
                    }
                }
            }
        }
        Ok(ids.iter().map(|id| outs.remove(id).expect("every request finished")).collect())
    }
}
