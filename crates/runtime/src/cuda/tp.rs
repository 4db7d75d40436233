//! Tensor parallelism on GPUs: a `--tp N` bundle as N [`CudaBackend`]s, one per rank, each
//! with its own GPU, weight shard, KV pool and captured graphs, joined by an NCCL communicator.
//! Rank 0 runs on the caller's (the engine worker's) thread; ranks 1.. each on a thread of its
//! own that owns its backend. Every step rank 0 packs the inputs once, hands them to the other
//! ranks, and all ranks enqueue the same schedule; the all-reduces after the row-parallel
//! linears (NCCL kernels, captured into the decode graphs like the rest) keep them in step.
//! The lm_head is replicated, so rank 0 alone reads the logits and samples.

use super::{context, placement, Compiled, CudaBackend, Packed};
use crate::backend::{Backend, StepSeq};
use crate::RuntimeError;
use bundle::Bundle;
use cudarc::nccl::Id;
use std::ffi::c_char;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Whether the NCCL library can be loaded.
pub fn nccl_present() -> bool {
    codegen_cuda::without_panic(|| unsafe { cudarc::nccl::sys::is_culib_present() }).unwrap_or(false)
}

/// How the ranks of one model learn the NCCL unique id rank 0 creates. In one process a copy
/// is enough ([`InProcess`]); a transport between hosts (TCP, a shared file) can carry the
/// same 128 bytes behind this trait.
pub trait Bootstrap: Sync {
    /// The unique id, as rank `rank` receives it.
    fn unique_id(&self, rank: usize) -> Result<[c_char; 128], RuntimeError>;
}

/// The ranks are threads of this process: rank 0 (the loading thread) creates the id, the
/// others read it.
pub struct InProcess {
    id: [c_char; 128],
}

impl InProcess {
    /// Creates the unique id (loading NCCL: a missing library is a clear error).
    pub fn new() -> Result<InProcess, RuntimeError> {
        if !nccl_present() {
            return Err(RuntimeError::Unsupported(
                "tensor parallelism on GPUs needs NCCL: libnccl.so was not found (install NCCL, \
                 or add its directory to LD_LIBRARY_PATH)"
                    .into(),
            ));
        }
        let id = codegen_cuda::without_panic(Id::new)
            .ok_or_else(|| RuntimeError::Unsupported("NCCL could not be loaded".into()))?
            .map_err(|e| RuntimeError::Unsupported(format!("NCCL: creating the unique id: {e:?}")))?;
        Ok(InProcess { id: *id.internal() })
    }
}

impl Bootstrap for InProcess {
    fn unique_id(&self, _rank: usize) -> Result<[c_char; 128], RuntimeError> {
        Ok(self.id)
    }
}

/// Loads `bundle` on the GPUs `gpus` (`--devices`; empty: `0..tp`).
pub fn load(bundle: &Bundle, gpus: &[usize]) -> Result<Box<dyn Backend>, RuntimeError> {
    let gpus = placement(bundle.plan.tp, gpus)?;
    if bundle.plan.tp == 1 {
        return Ok(Box::new(CudaBackend::new(bundle, gpus[0])?));
    }
    Ok(Box::new(TpCudaBackend::new(bundle, &gpus, &InProcess::new()?)?))
}

/// Work for one rank's thread; the result goes back on the rank's reply channel.
type Job = Box<dyn FnOnce(&mut CudaBackend) -> Result<usize, RuntimeError> + Send>;

/// A rank other than 0: its thread, which owns the rank's backend and runs the jobs it is sent.
struct Rank {
    jobs: Option<Sender<Job>>,
    done: Receiver<Result<usize, RuntimeError>>,
    thread: Option<JoinHandle<()>>,
}

impl Rank {
    fn spawn(mut backend: CudaBackend, rank: usize) -> Rank {
        let (jobs, rx) = channel::<Job>();
        let (tx, done) = channel();
        let thread = std::thread::Builder::new()
            .name(format!("rank-{rank}"))
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    if tx.send(job(&mut backend)).is_err() {
                        break;
                    }
                }
            })
            .expect("spawning a rank thread");
        Rank { jobs: Some(jobs), done, thread: Some(thread) }
    }
}

impl Drop for Rank {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The ranks of a tensor-parallel bundle on GPUs (see the module docs).
pub struct TpCudaBackend {
    lead: CudaBackend,
    ranks: Vec<Rank>,
}

impl TpCudaBackend {
    /// Compiles the kernels once (every rank has the same shard shapes), then loads every rank
    /// on its GPU in parallel, joining them in one NCCL group through `boot`.
    pub fn new(bundle: &Bundle, gpus: &[usize], boot: &dyn Bootstrap) -> Result<TpCudaBackend, RuntimeError> {
        let tp = bundle.plan.tp;
        let ctxs = gpus.iter().map(|&g| context(g)).collect::<Result<Vec<_>, _>>()?;
        let compiled = Compiled::new(&bundle.plan, &ctxs[0])?;
        let ids = (0..tp).map(|r| boot.unique_id(r)).collect::<Result<Vec<_>, _>>()?;
        let loaded: Vec<Result<CudaBackend, RuntimeError>> = std::thread::scope(|s| {
            let handles: Vec<_> = ctxs
                .iter()
                .zip(ids)
                .enumerate()
                .map(|(rank, (ctx, id))| {
                    let (ctx, compiled) = (ctx.clone(), &compiled);
                    s.spawn(move || CudaBackend::rank(bundle, rank, ctx, Some((Id::uninit(id), tp)), compiled))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(RuntimeError::Unsupported("a rank panicked".into()))))
                .collect()
        });
        let mut backends = loaded.into_iter().collect::<Result<Vec<_>, _>>()?;
        let lead = backends.remove(0);
        let ranks = backends.into_iter().enumerate().map(|(i, b)| Rank::spawn(b, i + 1)).collect();
        let mut be = TpCudaBackend { lead, ranks };
        // NCCL connects lazily: one eager all-reduce of each size class before any capture.
        be.on_all(|b| b.warm_up().map(|_| 0))?;
        Ok(be)
    }

    /// Runs `job` on every rank at once (rank 0 on this thread); the results in rank order.
    fn on_all(
        &mut self,
        job: impl Fn(&mut CudaBackend) -> Result<usize, RuntimeError> + Send + Clone + 'static,
    ) -> Result<Vec<usize>, RuntimeError> {
        for r in &self.ranks {
            let j = job.clone();
            let sent = r.jobs.as_ref().is_some_and(|tx| tx.send(Box::new(j)).is_ok());
            if !sent {
                return Err(RuntimeError::Unsupported("a tensor-parallel rank thread has stopped".into()));
            }
        }
        let first = job(&mut self.lead);
        let mut out = vec![first];
        for r in &self.ranks {
            out.push(r.done.recv().unwrap_or_else(|_| {
                Err(RuntimeError::Unsupported("a tensor-parallel rank thread has stopped".into()))
            }));
        }
        out.into_iter().collect()
    }

    /// Runs `batch` on every rank; the logits are then on rank 0.
    fn step(&mut self, batch: &[StepSeq]) -> Result<usize, RuntimeError> {
        let p: Arc<Packed> = Arc::new(self.lead.pack(batch)?);
        let wanted = p.wanted;
        self.on_all(move |b| b.execute(&p).map(|_| 0))?;
        Ok(wanted)
    }
}

impl Backend for TpCudaBackend {
    fn vocab(&self) -> usize {
        self.lead.vocab()
    }

    /// Bytes of one slot on each GPU (every rank holds its KV heads' share).
    fn kv_slot_bytes(&self) -> usize {
        self.lead.kv_slot_bytes()
    }

    fn kv_slots(&self) -> usize {
        self.lead.kv_slots()
    }

    fn alloc_kv(&mut self, slots: usize) -> Result<(), RuntimeError> {
        self.on_all(move |b| b.alloc_kv(slots).map(|_| 0)).map(drop)
    }

    /// The least free memory of the ranks' GPUs.
    fn free_memory(&self) -> Option<usize> {
        let mut free = self.lead.free_memory()?;
        for r in &self.ranks {
            r.jobs.as_ref()?.send(Box::new(|b: &mut CudaBackend| Ok(b.free_memory().unwrap_or(0)))).ok()?;
            free = free.min(r.done.recv().ok()?.ok()?);
        }
        Some(free)
    }

    fn copy_bandwidth(&mut self) -> Option<f64> {
        self.lead.copy_bandwidth()
    }

    fn forward(&mut self, batch: &[StepSeq]) -> Result<Vec<f32>, RuntimeError> {
        let wanted = self.step(batch)?;
        self.lead.logits(wanted)
    }

    fn forward_argmax(&mut self, batch: &[StepSeq]) -> Result<Option<Vec<u32>>, RuntimeError> {
        let wanted = self.step(batch)?;
        self.lead.argmax(wanted).map(Some)
    }
}
