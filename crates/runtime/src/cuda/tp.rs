//! Tensor parallelism on GPUs: a `--tp N` bundle as N [`CudaBackend`]s, one per rank, each
//! with its own GPU, weight shard, KV pool and captured graphs, joined by an NCCL communicator.
//! Rank 0 runs on the caller's (the engine worker's) thread; ranks 1.. each on a thread of its
//! own that owns its backend. Every step rank 0 packs the inputs once, hands them to the other
//! ranks, and all ranks enqueue the same schedule; the all-reduces after the row-parallel
//! linears (NCCL kernels, captured into the decode graphs like the rest) keep them in step.
//! A vocab-parallel lm_head leaves each rank a block of the logits columns, which an all-gather
//! joins on rank 0; rank 0 alone reads the logits and samples.
//!
//! All-reduces of up to [`ONE_SHOT_ROWS`] rows (every decode step) run as one kernel that reads
//! the peers' partial sums straight from their memory over NVLink ([`OneShot`]): NCCL's ring
//! costs ~15 µs per call at these sizes, two calls per layer. Larger ones (prefill chunks), and
//! all of them where the GPUs cannot reach each other or `ENGINE_ALLREDUCE=nccl`, go to NCCL.

use super::{check_rows, context, driver, placement, Compiled, CudaBackend, Packed};
use crate::backend::{Backend, StepSeq};
use crate::sampler::{Adjust, RowSampling};
use crate::{Constraint, RuntimeError};
use bundle::Bundle;
use codegen_cuda::{KernelKey, Step, ALL_REDUCE_MAX_BLOCKS};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
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
        let compiled = Compiled::new(bundle, &ctxs[0])?;
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
        OneShot::set_up(&mut backends)?;
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

impl Drop for TpCudaBackend {
    /// Every rank leaves the NCCL group at once: a communicator torn down while another rank's
    /// thread still holds its own waits for it forever.
    fn drop(&mut self) {
        let _ = self.on_all(|b| {
            b.leave_group();
            Ok(0)
        });
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

    fn matmul_rate(&mut self) -> Option<f64> {
        self.lead.matmul_rate()
    }

    fn forward(&mut self, batch: &[StepSeq]) -> Result<Vec<f32>, RuntimeError> {
        let wanted = self.step(batch)?;
        self.lead.logits(wanted)
    }

    fn forward_hidden(&mut self, batch: &[StepSeq]) -> Result<Vec<f32>, RuntimeError> {
        let wanted = self.step(batch)?;
        self.lead.hidden(wanted)
    }

    fn hidden_size(&self) -> usize {
        self.lead.hidden_size()
    }

    fn forward_sample(
        &mut self,
        batch: &[StepSeq],
        rows: &[RowSampling],
        adjust: &[Vec<Adjust>],
        constraints: &[Option<Constraint>],
    ) -> Result<Vec<u32>, RuntimeError> {
        let wanted = self.step(batch)?;
        check_rows(wanted, rows)?;
        let masks = crate::constraint::masks(constraints);
        self.lead.sample(rows, adjust, &masks)
    }

    fn resample(&mut self, rows: &[RowSampling], adjust: &[Vec<Adjust>]) -> Result<Option<Vec<u32>>, RuntimeError> {
        self.lead.resample(rows, adjust)
    }
}

/// Rows (tokens) up to which an all-reduce runs as the one-shot kernel.
pub const ONE_SHOT_ROWS: usize = 256;

/// One rank's buffers of the one-shot all-reduce (`kernels/comm.cuh`): a staging buffer of two
/// halves that the peers read, flags the peers write, per-block epoch counters, and the table of
/// every rank's staging and flag pointers.
pub(crate) struct OneShot {
    /// Floats per staging half: the largest message.
    pub(crate) cap: usize,
    /// Held for the peers, which read it through `table`.
    _staging: CudaSlice<f32>,
    /// Held for the peers, which write it through `table`.
    _flags: CudaSlice<u32>,
    counters: CudaSlice<u32>,
    table: CudaSlice<u64>,
    ranks: usize,
    rank: usize,
}

/// Enables access from `a`'s GPU to `b`'s memory; false where the GPUs cannot reach each other.
fn enable_peer(a: &cudarc::driver::CudaContext, b: &cudarc::driver::CudaContext) -> Result<bool, RuntimeError> {
    use cudarc::driver::sys::{
        cuCtxEnablePeerAccess, cuDeviceCanAccessPeer, cuDeviceGetDefaultMemPool, cuMemPoolSetAccess, CUmemAccessDesc,
        CUmemAccess_flags, CUmemLocation, CUmemLocationType, CUresult,
    };
    let mut can = 0;
    unsafe { cuDeviceCanAccessPeer(&mut can, a.cu_device(), b.cu_device()) }.result().map_err(driver("peer access"))?;
    if can == 0 {
        return Ok(false);
    }
    a.bind_to_thread().map_err(driver("binding the context"))?;
    match unsafe { cuCtxEnablePeerAccess(b.cu_ctx(), 0) } {
        CUresult::CUDA_SUCCESS | CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
        e => return Err(RuntimeError::Unsupported(format!("CUDA: enabling peer access: {e:?}"))),
    }
    // cudarc allocates from the device's stream-ordered memory pool, whose memory peers reach
    // only once the pool grants them access (context peer access does not cover it).
    let mut pool = std::ptr::null_mut();
    if unsafe { cuDeviceGetDefaultMemPool(&mut pool, b.cu_device()) } == CUresult::CUDA_SUCCESS {
        let desc = CUmemAccessDesc {
            location: CUmemLocation { type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: a.ordinal() as i32 },
            flags: CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        unsafe { cuMemPoolSetAccess(pool, &desc, 1) }.result().map_err(driver("granting a peer the memory pool"))?;
    }
    Ok(true)
}

impl OneShot {
    /// Gives every rank its one-shot buffers when all GPUs reach each other (else the
    /// collectives stay on NCCL, said on stderr): one set for the all-reduces, one for the
    /// gather of a vocab-parallel lm_head's logits.
    fn set_up(ranks: &mut [CudaBackend]) -> Result<(), RuntimeError> {
        if std::env::var("ENGINE_ALLREDUCE").is_ok_and(|v| v == "nccl") {
            return Ok(());
        }
        let program = ranks[0].program.clone();
        let reduce = program
            .steps
            .iter()
            .filter_map(|s| if let Step::AllReduce { cols, .. } = s { Some(*cols) } else { None })
            .max();
        let gather =
            program.steps.iter().find_map(|s| if let Step::AllGather { cols, .. } = s { Some(*cols) } else { None });
        if reduce.is_none() && gather.is_none() {
            return Ok(());
        }
        for a in 0..ranks.len() {
            for b in 0..ranks.len() {
                if a != b && !enable_peer(ranks[a].stream.context(), ranks[b].stream.context())? {
                    eprintln!("GPUs {a} and {b} cannot access each other's memory: collectives over NCCL only");
                    return Ok(());
                }
            }
        }
        if let Some(cols) = reduce {
            let sets = OneShot::alloc(ranks, ONE_SHOT_ROWS * cols)?;
            for (r, o) in ranks.iter_mut().zip(sets) {
                r.one_shot = Some(o);
            }
            eprintln!("all-reduces of up to {ONE_SHOT_ROWS} rows: one-shot over peer memory; larger: NCCL");
        }
        if let Some(cols) = gather {
            let sets = OneShot::alloc(ranks, ONE_SHOT_GATHER_ROWS * cols)?;
            for (r, o) in ranks.iter_mut().zip(sets) {
                r.gather = Some(o);
            }
            eprintln!("logits gathers of up to {ONE_SHOT_GATHER_ROWS} rows: one-shot over peer memory; larger: NCCL");
        }
        Ok(())
    }

    /// One set of buffers per rank, staging halves of `cap` floats.
    fn alloc(ranks: &[CudaBackend], cap: usize) -> Result<Vec<OneShot>, RuntimeError> {
        let cap = cap.div_ceil(4) * 4;
        let n = ranks.len();
        let mut parts = Vec::with_capacity(n);
        for r in ranks {
            r.stream.context().bind_to_thread().map_err(driver("binding the context"))?;
            let alloc = |e| RuntimeError::Invalid(format!("out of GPU memory for the collectives' buffers: {e:?}"));
            let staging = r.stream.alloc_zeros::<f32>(2 * cap).map_err(alloc)?;
            let flags = r.stream.alloc_zeros::<u32>(ALL_REDUCE_MAX_BLOCKS * n).map_err(alloc)?;
            let counters = r.stream.alloc_zeros::<u32>(ALL_REDUCE_MAX_BLOCKS).map_err(alloc)?;
            parts.push((staging, flags, counters));
        }
        let mut table: Vec<u64> = parts.iter().zip(ranks).map(|(p, r)| r.ptr(&p.0)).collect();
        table.extend(parts.iter().zip(ranks).map(|(p, r)| r.ptr(&p.1)));
        let mut out = Vec::with_capacity(n);
        for (rank, (r, (staging, flags, counters))) in ranks.iter().zip(parts).enumerate() {
            r.stream.context().bind_to_thread().map_err(driver("binding the context"))?;
            let table = r.stream.clone_htod(&table).map_err(driver("uploading the collectives' table"))?;
            r.stream.synchronize().map_err(driver("collectives' buffers"))?;
            out.push(OneShot { cap, _staging: staging, _flags: flags, counters, table, ranks: n, rank });
        }
        Ok(out)
    }
}

/// Logit rows up to which a vocab-parallel lm_head's gather runs as the one-shot kernel.
pub const ONE_SHOT_GATHER_ROWS: usize = 64;

impl CudaBackend {
    /// Sums the first `n` floats of buffer `buf` over the ranks: the one-shot kernel where the
    /// message fits its buffers, else NCCL.
    pub(super) fn all_reduce(&mut self, buf: usize, n: usize) -> Result<(), RuntimeError> {
        if let Some(o) = self.one_shot.as_ref().filter(|o| n <= o.cap) {
            let x = self.ptr(&self.bufs[buf]);
            let (table, counters) = (self.ptr(&o.table), self.ptr(&o.counters));
            let (n, rank, cap) = (n as i64, o.rank as i32, o.cap as i64);
            let blocks = (n as usize).div_ceil(4 * 512).clamp(1, ALL_REDUCE_MAX_BLOCKS);
            let mut b = self.stream.launch_builder(&self.funcs[&KernelKey::AllReduce { ranks: o.ranks }]);
            b.arg(&x).arg(&n).arg(&table).arg(&rank).arg(&cap).arg(&counters);
            return one_shot_launch(b, blocks, "all-reduce");
        }
        let comm = nccl(&self.comm)?;
        let mut part = self.bufs[buf].slice_mut(0..n);
        comm.all_reduce_in_place(&mut part, &cudarc::nccl::ReduceOp::Sum).map_err(driver("all-reduce (NCCL)")).map(drop)
    }

    /// Joins the ranks' `[rows, cols]` blocks in `src` into `[rows, cols * ranks]` rows in `dst`:
    /// the one-shot kernel (rank 0's `dst` only) where they fit its buffers, else one NCCL
    /// all-gather per row, in groups of up to [`ONE_SHOT_GATHER_ROWS`] (every rank's `dst`).
    pub(super) fn all_gather(&mut self, src: usize, dst: usize, rows: usize, cols: usize) -> Result<(), RuntimeError> {
        if let Some(o) = self.gather.as_ref().filter(|o| rows * cols <= o.cap) {
            let (x, out) = (self.ptr(&self.bufs[src]), self.ptr(&self.bufs[dst]));
            let (table, counters) = (self.ptr(&o.table), self.ptr(&o.counters));
            let (rows, cols, rank, cap) = (rows as i64, cols as i64, o.rank as i32, o.cap as i64);
            let mut b = self.stream.launch_builder(&self.funcs[&KernelKey::AllGather { ranks: o.ranks }]);
            b.arg(&x).arg(&out).arg(&rows).arg(&cols).arg(&table).arg(&rank).arg(&cap).arg(&counters);
            return one_shot_launch(b, ALL_REDUCE_MAX_BLOCKS, "all-gather");
        }
        let comm = nccl(&self.comm)?;
        let whole = cols * comm.world_size();
        let (s, d) = two(&mut self.bufs, src, dst);
        let err = driver("all-gather (NCCL)");
        for first in (0..rows).step_by(ONE_SHOT_GATHER_ROWS) {
            cudarc::nccl::result::group_start().map_err(&err)?;
            let gathered = (first..rows.min(first + ONE_SHOT_GATHER_ROWS)).try_for_each(|r| {
                let mut out = d.slice_mut(r * whole..(r + 1) * whole);
                comm.all_gather(&s.slice(r * cols..(r + 1) * cols), &mut out).map(drop)
            });
            let ended = cudarc::nccl::result::group_end();
            gathered.map_err(&err)?;
            ended.map_err(&err)?;
        }
        Ok(())
    }

    /// One eager NCCL all-reduce of one row and of many, and one gather (NCCL sets up its
    /// connections per protocol on first use, which must not happen inside a graph capture).
    pub(crate) fn warm_up(&mut self) -> Result<(), RuntimeError> {
        let program = self.program.clone();
        let (one_shot, gather) = (self.one_shot.take(), self.gather.take());
        // One of each kind is enough: the connections are the communicator's, not the step's.
        let reduce = program.steps.iter().find(|s| matches!(s, Step::AllReduce { .. }));
        let gather_step = program.steps.iter().find(|s| matches!(s, Step::AllGather { .. }));
        let mut warm = || -> Result<(), RuntimeError> {
            if let Some(&Step::AllReduce { buf, cols }) = reduce {
                for rows in [1, self.cap.0] {
                    self.all_reduce(buf, rows * cols)?;
                }
            }
            if let Some(&Step::AllGather { src, dst, cols }) = gather_step {
                self.all_gather(src, dst, 1, cols)?;
            }
            Ok(())
        };
        let result = warm();
        (self.one_shot, self.gather) = (one_shot, gather);
        result?;
        self.stream.synchronize().map_err(driver("warming up NCCL"))
    }
}

fn nccl(comm: &Option<super::Nccl>) -> Result<&cudarc::nccl::Comm, RuntimeError> {
    comm.as_ref()
        .map(|c| &c.0)
        .ok_or_else(|| RuntimeError::Unsupported("a collective without an NCCL communicator".into()))
}

/// `v[a]` to read and `v[b]` to write (`a != b`).
fn two<T>(v: &mut [T], a: usize, b: usize) -> (&T, &mut T) {
    assert_ne!(a, b, "a gather's source and destination share a buffer");
    if a < b {
        let (l, r) = v.split_at_mut(b);
        (&l[a], &mut r[0])
    } else {
        let (l, r) = v.split_at_mut(a);
        (&r[0], &mut l[b])
    }
}

fn one_shot_launch(mut b: cudarc::driver::LaunchArgs, blocks: usize, what: &str) -> Result<(), RuntimeError> {
    let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (512, 1, 1), shared_mem_bytes: 0 };
    unsafe { b.launch(cfg) }.map_err(driver(&format!("launching the one-shot {what}"))).map(drop)
}
