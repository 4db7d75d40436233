//! The CUDA backend (`--device cuda`): runs the bundle plan's launch schedule (`codegen-cuda`:
//! fused kernels, buffers assigned by liveness) on one GPU per rank. At load: every kernel
//! compiled by NVRTC to CUBIN on all cores through the disk cache, weights uploaded from the
//! bundle's mmap, constants uploaded. Each step uploads its inputs in one copy; decode steps
//! (one token per sequence) are padded to a captured batch size and replayed as CUDA graphs,
//! captured on first use of each size. A `--tp N` bundle runs one [`CudaBackend`] per rank,
//! each on its own thread and GPU, the all-reduces over NCCL ([`tp`]). cudarc loads the
//! driver, NVRTC and NCCL at run time, so building needs no CUDA.

use crate::backend::{check_batch, Backend, Fed, StepSeq};
use crate::sampler::{Adjust, RowSampling};
use crate::{Constraint, RuntimeError};
use bundle::Bundle;
use codegen_cuda::{Arg, Count, Dim, Input, KernelKey, Launch, Program, Step};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use ir::Plan;
use std::collections::HashMap;
use std::sync::Arc;

mod blas;
mod device;
mod lt;
pub(crate) mod probe;
mod profile;
mod staging;
pub mod tp;
mod tune;
mod w16;
mod w8a8;
mod weights;

use profile::Profile;
use weights::Weights;

use device::{arch, context};
pub use device::{gpu_present, placement, usable};

fn driver<E: std::fmt::Debug>(what: &str) -> impl Fn(E) -> RuntimeError + '_ {
    move |e| RuntimeError::Unsupported(format!("CUDA: {what}: {e:?}"))
}

/// Decode batch sizes captured as CUDA graphs (a decode batch is padded up to the next one).
pub const CAPTURE_SIZES: [usize; 19] = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256];

/// The CUDA backend (see the module docs).
pub struct CudaBackend {
    plan: Plan,
    program: Arc<Program>,
    stream: Arc<CudaStream>,
    /// This rank's NCCL communicator (tensor-parallel bundles).
    comm: Option<Nccl>,
    /// Peer-memory buffers of the one-shot all-reduce and all-gather, when the ranks' GPUs
    /// reach each other.
    one_shot: Option<tp::OneShot>,
    gather: Option<tp::OneShot>,
    funcs: HashMap<KernelKey, CudaFunction>,
    weights: Weights,
    constants: Vec<CudaSlice<f32>>,
    k_cache: Vec<CudaSlice<u16>>,
    v_cache: Vec<CudaSlice<u16>>,
    slots: usize,
    /// The KV positions the step's sequences hold (its slot table's length, less the scratch
    /// slot's entry), for the profile's bytes.
    positions: usize,
    /// Each mixture of experts' weight stacks: experts per token and experts, for the
    /// profile's bytes (`Plan::moe_stacks`).
    expert_stacks: HashMap<usize, (usize, usize)>,
    /// The schedule's buffers, `cap.0` token rows (or `cap.1` logit rows) each.
    bufs: Vec<CudaSlice<f32>>,
    cap: (usize, usize),
    /// Step inputs: ids, pos, slot_of, seq_off (T each), rows (R), slots.
    inputs: CudaSlice<i32>,
    /// The token chosen for each logits row, and each row's sampling parameters (5 floats).
    tokens: CudaSlice<i32>,
    sample_params: CudaSlice<f32>,
    /// The step's logit adjustments (`Adjust::to_device`), grown on demand.
    adjust: CudaSlice<f32>,
    /// The step's constraint masks (rows, then their masks: `mask_logits`), grown on demand.
    masks: CudaSlice<u32>,
    /// The split argmax's partial results and per-row counters (`KernelKey::Argmax`).
    argmax: ArgmaxScratch,
    /// Logits rows of the last step.
    last_rows: usize,
    graphs: HashMap<usize, Graph>,
    /// Per decode graph size, whether its capture leaves out the launches idle in decode steps
    /// (`Launch::idle_in_decode`; timed both ways before the first capture: `tune`).
    lean: HashMap<usize, bool>,
    use_graphs: bool,
    /// Forward-step kernels launched as programmatic dependent launches (`device::pdl_enabled`).
    pdl: bool,
    /// [`Compiled`]'s `wgmma`: our `wgmma` kernel runs only there.
    wgmma: bool,
    /// cuBLASLt, where it loads; per linear shape, which GEMM runs at each token bucket
    /// (`blas::chosen`) and f32 copies of the biases.
    blas: Option<lt::Blas>,
    blas_choice: HashMap<blas::Shape, Vec<(usize, blas::Choice)>>,
    /// Where the choices are kept between runs (`blas::choices_file`).
    choices_file: Option<std::path::PathBuf>,
    bias_f32: HashMap<usize, CudaSlice<f32>>,
    /// W8A8 ([`w8a8`]): the compact cuBLASLt scales of E4M3 weights, and the quantized input of
    /// a launch with our `wgmma` kernel's split sums.
    w8_scales: HashMap<usize, (w8a8::Fp8Scales, CudaSlice<f32>)>,
    w8_input: Option<w8a8::W8Input>,
    /// 16-bit copies of small E4M3 linears, by a launch's first weight ([`w16`]).
    w16: HashMap<usize, CudaSlice<u8>>,
    /// `ENGINE_CUDA_PROFILE` ([`profile`]).
    profile: Option<Profile>,
    /// `ENGINE_CUDA_SKIP` ([`profile::skip_from_env`]): kernels left out, for timing only.
    skip: Vec<String>,
    /// Pinned host memory for the inputs and tokens, and the steps whose tokens are on their
    /// way back ([`staging`]).
    staging: staging::Staging,
    /// Steps launch ahead of the step before's tokens (`Backend::launch_forward`): one GPU,
    /// not profiled launch by launch, `ENGINE_PIPELINE` not `0`.
    pipelined: bool,
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if let Some(p) = &self.profile {
            p.report();
        }
    }
}

/// A captured graph. cudarc's handle is not `Send` (raw pointers); the backend that owns it is
/// moved to its worker thread once and used only there, and CUDA graph execs may be launched
/// from any thread when calls are serialised, which `&mut self` guarantees.
struct Graph(CudaGraph);
unsafe impl Send for Graph {}

/// An NCCL communicator; not `Send` in cudarc (a raw pointer), used only by the thread of the
/// backend that owns it, like [`Graph`].
struct Nccl(cudarc::nccl::Comm);
unsafe impl Send for Nccl {}

/// A plan's launch schedule and its kernels compiled for one GPU arch (shared by the ranks).
pub(crate) struct Compiled {
    program: Arc<Program>,
    bins: Vec<Vec<u8>>,
    /// Whether the device runs Hopper's own instructions (`sm_90`: our small-batch kernel's `wgmma`).
    wgmma: bool,
}

impl Compiled {
    /// The schedule of `bundle`'s plan (the CUDA it carries) with its kernels compiled for the
    /// arch of `ctx`'s GPU.
    pub(crate) fn new(bundle: &Bundle, ctx: &CudaContext) -> Result<Compiled, RuntimeError> {
        let program = device::program(bundle)?;
        let arch = arch(ctx)?;
        let t = std::time::Instant::now();
        let (bins, report) = codegen_cuda::nvrtc::compile_kernels(&program, &arch)
            .map_err(|e| RuntimeError::Unsupported(e.to_string()))?;
        eprintln!(
            "CUDA kernels for {arch}: {} compiled, {} from the cache, in {:.2}s",
            report.compiled,
            report.cached,
            t.elapsed().as_secs_f64()
        );
        Ok(Compiled { program: Arc::new(program), bins, wgmma: codegen_cuda::hopper(&arch) && a8_fits(ctx) })
    }
}

/// Whether every block of a W8A8 launch (`codegen_cuda::A8_BLOCKS`, `A8_BLOCKS_PER_SM` an SM of
/// an H100 SXM / H200) is resident at once on the device, as the blocks of a shared tile wait for each other
/// (`kernels/gemm.cuh`); GPUs with fewer SMs (H100 PCIe, MIG slices) run the other GEMMs.
fn a8_fits(ctx: &CudaContext) -> bool {
    use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
    ctx.attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .is_ok_and(|sms| codegen_cuda::A8_BLOCKS_PER_SM * sms as usize >= codegen_cuda::A8_BLOCKS)
}

impl CudaBackend {
    /// Compiles the kernels of a tp=1 bundle and uploads its weights to GPU `gpu`.
    pub fn new(bundle: &Bundle, gpu: usize) -> Result<CudaBackend, RuntimeError> {
        if bundle.plan.tp != 1 {
            return Err(RuntimeError::Unsupported(format!(
                "CudaBackend runs one rank; this bundle has tp={} (load it with TpCudaBackend)",
                bundle.plan.tp
            )));
        }
        let ctx = context(gpu)?;
        let compiled = Compiled::new(bundle, &ctx)?;
        CudaBackend::rank(bundle, 0, ctx, None, &compiled)
    }

    /// Rank `rank` of `bundle` on `ctx`'s GPU: joins the NCCL group `comm` (the ranks' shared
    /// unique id and their number) when there is one, loads the kernels, uploads the rank's
    /// weight shard.
    pub(crate) fn rank(
        bundle: &Bundle,
        rank: usize,
        ctx: Arc<CudaContext>,
        comm: Option<(cudarc::nccl::Id, usize)>,
        compiled: &Compiled,
    ) -> Result<CudaBackend, RuntimeError> {
        let plan = bundle.plan.clone();
        ctx.bind_to_thread().map_err(driver("binding the context"))?;
        // One stream, ordered: no per-buffer events (they also break graph capture).
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(driver("creating a stream"))?;
        // The communicator first: the other ranks wait in it for this one.
        let comm = match comm {
            Some((id, n)) => Some(Nccl(
                cudarc::nccl::Comm::from_rank(stream.clone(), rank, n, id).map_err(driver("joining the NCCL group"))?,
            )),
            None => None,
        };
        let program = compiled.program.clone();
        let mut funcs = HashMap::new();
        for (k, bin) in program.kernels.iter().zip(&compiled.bins) {
            let m =
                ctx.load_module(cudarc::nvrtc::Ptx::from_binary(bin.clone())).map_err(driver("loading a kernel"))?;
            let f = m.load_function(&k.name()).map_err(driver("finding a kernel"))?;
            if k.dyn_smem() > 0 {
                use cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX;
                f.set_attribute(MAX, k.dyn_smem() as i32).map_err(driver("a kernel's dynamic shared memory"))?;
            }
            funcs.insert(*k, f);
        }
        let t = std::time::Instant::now();
        let file = bundle.weights(rank)?;
        let (weights, total) = Weights::upload(&stream, &plan, &program, &file)?;
        let constants = program
            .constants
            .iter()
            .map(|c| stream.clone_htod(c))
            .collect::<Result<_, _>>()
            .map_err(driver("upload"))?;
        stream.synchronize().map_err(driver("uploading weights"))?;
        eprintln!(
            "rank {rank}: uploaded {:.2} GB of weights to GPU {} in {:.2}s",
            total as f64 / 1e9,
            ctx.ordinal(),
            t.elapsed().as_secs_f64()
        );
        let inputs = stream.alloc_zeros::<i32>(1 << 16).map_err(driver("alloc"))?;
        let tokens = stream.alloc_zeros::<i32>(1).map_err(driver("alloc"))?;
        let sample_params = stream.alloc_zeros::<f32>(5).map_err(driver("alloc"))?;
        let adjust = stream.alloc_zeros::<f32>(5).map_err(driver("alloc"))?;
        let masks = stream.alloc_zeros::<u32>(1).map_err(driver("alloc"))?;
        let argmax = argmax_scratch(&stream, 1)?;
        let profile = Profile::from_env();
        let use_graphs =
            !Profile::per_launch(&profile) && std::env::var("ENGINE_CUDA_GRAPHS").map_or(true, |v| v != "0");
        let pipelined = comm.is_none()
            && !Profile::per_launch(&profile)
            && std::env::var("ENGINE_PIPELINE").map_or(true, |v| v != "0");
        let expert_stacks = plan.moe_stacks().flat_map(|(ws, k, e)| ws.iter().map(move |&w| (w, (k, e)))).collect();
        let mut be = CudaBackend {
            expert_stacks,
            plan,
            program,
            stream,
            comm,
            one_shot: None,
            gather: None,
            funcs,
            weights,
            constants,
            k_cache: vec![],
            v_cache: vec![],
            slots: 0,
            positions: 0,
            bufs: vec![],
            cap: (0, 0),
            inputs,
            tokens,
            sample_params,
            adjust,
            masks,
            argmax,
            last_rows: 0,
            graphs: HashMap::new(),
            lean: HashMap::new(),
            use_graphs,
            pdl: device::pdl_enabled(&ctx),
            wgmma: compiled.wgmma,
            blas: None,
            blas_choice: HashMap::new(),
            choices_file: None,
            bias_f32: HashMap::new(),
            w8_scales: HashMap::new(),
            w16: HashMap::new(),
            w8_input: None,
            pipelined,
            profile,
            skip: vec![],
            staging: staging::Staging::default(),
        };
        be.ensure_cap(256, 256)?;
        // Not through the profiler: it would time ours with its per-launch sync and the others
        // without, and choose by that.
        let profile = be.profile.take();
        be.choose_gemms()?;
        be.profile = profile;
        // After the GEMM timings, so that ours vs cuBLASLt is chosen on what they really take.
        be.skip = profile::skip_from_env();
        Ok(be)
    }

    /// Grows the buffers to hold `tokens` token rows and `rows` logit rows (dropping captured
    /// graphs, whose pointers change).
    fn ensure_cap(&mut self, tokens: usize, rows: usize) -> Result<(), RuntimeError> {
        if tokens <= self.cap.0 && rows <= self.cap.1 {
            return Ok(());
        }
        let grow = |need: usize, have: usize| if need > have { need.max(have * 2) } else { have };
        let cap = (grow(tokens, self.cap.0), grow(rows, self.cap.1));
        self.graphs.clear();
        self.bufs.clear();
        // The tokens of a step in flight may still be fed to the next one (`FeedTokens`).
        let mut tokens = self.stream.alloc_zeros::<i32>(cap.1).map_err(driver("alloc"))?;
        let kept = self.tokens.len().min(cap.1);
        if kept > 0 {
            self.stream
                .memcpy_dtod(&self.tokens.slice(0..kept), &mut tokens.slice_mut(0..kept))
                .map_err(driver("copying tokens"))?;
        }
        self.tokens = tokens;
        self.sample_params = self.stream.alloc_zeros::<f32>(5 * cap.1).map_err(driver("alloc"))?;
        self.argmax = argmax_scratch(&self.stream, cap.1)?;
        for b in &self.program.buffers {
            let n = if b.per == Count::Tokens { cap.0 } else { cap.1 };
            let oom = |e| {
                RuntimeError::Invalid(format!(
                    "out of GPU memory for a step of {} tokens, {} rows: {e:?}",
                    cap.0, cap.1
                ))
            };
            self.bufs.push(self.stream.alloc_zeros::<f32>((n * b.row_bytes).div_ceil(4).max(1)).map_err(oom)?);
        }
        self.cap = cap;
        self.ensure_w8_input(cap.0)
    }

    /// Packs the inputs of `batch` (checked against the plan and the pool) into the one array a
    /// step uploads; a decode batch is padded to a captured graph size ([`pack_inputs`]).
    pub(crate) fn pack(&self, batch: &[StepSeq]) -> Result<Packed, RuntimeError> {
        check_batch(&self.plan, batch, self.slots)?;
        let graph = self.graph_size(batch);
        let pad = graph.map_or(0, |s| s - batch.len());
        Ok(Packed { graph: graph.is_some(), ..pack_inputs(batch, pad, self.slots) })
    }

    fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _sync) = s.device_ptr(&self.stream);
        p
    }

    /// The device pointer of a buffer, weight or null argument (0 for any other).
    fn arg_ptr(&self, a: &Arg) -> u64 {
        match a {
            Arg::Buf(b) => self.ptr(&self.bufs[*b]),
            Arg::BufAt(b, at) => self.ptr(&self.bufs[*b]) + *at as u64,
            Arg::Weight(w) => self.weights.ptr(&self.stream, *w),
            _ => 0,
        }
    }

    /// Enqueues every launch (and all-reduce) of the schedule for a step of `t` tokens and `r`
    /// logit rows (inputs at `off`); `lean`: every row is a sequence of its own (a decode
    /// graph's step), and the kernels idle in such steps are left out.
    fn enqueue(&mut self, t: usize, r: usize, off: &[usize; 6], lean: bool) -> Result<(), RuntimeError> {
        let program = self.program.clone();
        for step in &program.steps {
            match step {
                Step::AllReduce { buf, cols } => self.all_reduce(*buf, t * cols)?,
                Step::AllGather { src, dst, cols } => self.all_gather(*src, *dst, r, *cols)?,
                Step::Kernels { .. } => {
                    let c = step.count(t, r);
                    for l in step.launches(t, r).iter().filter(|l| !(lean && l.idle_in_decode)) {
                        let shape = blas::gemm_shape(&l.key);
                        // Where the chosen GEMM refuses a row count its choice covers (cuBLASLt's
                        // W8A8 with block scales at rows not a multiple of four), ours runs.
                        let g = shape
                            .and_then(|s| self.blas_choice.get(&s))
                            .map_or(blas::Gemm::Ours, |ch| blas::chosen(ch, c));
                        // ENGINE_CUDA_PROFILE=1 times cuBLASLt's and our W8A8 launches too.
                        let other = || {
                            let bytes = || self.gemm_launch_bytes(l, t, r, g);
                            Profile::launch(
                                &self.profile,
                                &self.stream,
                                || g.label(&l.key),
                                bytes,
                                || self.run_gemm(l, c, g),
                            )
                        };
                        // ENGINE_CUDA_SKIP leaves out cuBLASLt's and our W8A8 launches by their labels too.
                        if g != blas::Gemm::Ours
                            && !self.skip.is_empty()
                            && profile::skipped(&self.skip, &g.label(&l.key))
                        {
                            continue;
                        }
                        if g == blas::Gemm::Ours || other().is_err() {
                            self.launch(l, t, r, off)?;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn launch(&self, l: &Launch, t: usize, r: usize, off: &[usize; 6]) -> Result<(), RuntimeError> {
        enum V {
            P(u64),
            I(i32),
            L(i64),
            F(f32),
        }
        let count = |c: &Count| if *c == Count::Tokens { t } else { r };
        let base = self.ptr(&self.inputs);
        let vals: Vec<V> = l
            .args
            .iter()
            .map(|a| match a {
                Arg::Buf(_) | Arg::BufAt(..) | Arg::Weight(_) | Arg::Null => V::P(self.arg_ptr(a)),
                Arg::Const(c) => V::P(self.ptr(&self.constants[*c])),
                Arg::KCache(layer) => V::P(self.ptr(&self.k_cache[*layer])),
                Arg::VCache(layer) => V::P(self.ptr(&self.v_cache[*layer])),
                Arg::Input(i) => {
                    let k = [Input::Ids, Input::Pos, Input::SlotOf, Input::SeqOff, Input::Rows, Input::Slots]
                        .iter()
                        .position(|x| x == i)
                        .unwrap_or(0);
                    V::P(base + 4 * off[k] as u64)
                }
                Arg::F32(x) => V::F(*x),
                Arg::Count(c) => V::I(count(c) as i32),
                Arg::Elems(c, cols) => V::L((count(c) * cols) as i64),
            })
            .collect();
        let dim = |d: &Dim| d.size(|c| count(&c));
        let (gx, gy) = (dim(&l.grid[0]), dim(&l.grid[1]));
        if gx == 0 || gy == 0 || profile::skipped(&self.skip, &l.key.name()) {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (gx as u32, gy as u32, 1),
            block_dim: (l.block, 1, 1),
            shared_mem_bytes: l.key.dyn_smem() as u32,
        };
        let mut params: Vec<*mut std::ffi::c_void> = vals
            .iter()
            .map(|v| match v {
                V::P(p) => p as *const u64 as *mut _,
                V::I(i) => i as *const i32 as *mut _,
                V::L(x) => x as *const i64 as *mut _,
                V::F(f) => f as *const f32 as *mut _,
            })
            .collect();
        let pdl = self.pdl && !Profile::per_launch(&self.profile) && l.key.pdl();
        Profile::launch(
            &self.profile,
            &self.stream,
            // Decode steps apart from those with prefill rows (a decode step wants every row's
            // logits), whose launches do other work under the same names.
            || if t == r { l.key.name() } else { format!("{} [prefill step]", l.key.name()) },
            || self.launch_bytes(l, t, r),
            || {
                unsafe { device::launch(&self.stream, &self.funcs[&l.key], cfg, &mut params, pdl) }
                    .map_err(driver("launching a kernel"))
            },
        )
    }

    /// The captured batch size a decode batch (one token and one logit row per sequence) is
    /// padded to, if graphs are on and one is large enough.
    fn graph_size(&self, batch: &[StepSeq]) -> Option<usize> {
        let decode = batch.iter().all(|q| q.tokens.len() == 1 && q.rows == [0]);
        let size = *CAPTURE_SIZES.iter().find(|&&s| s >= batch.len())?;
        (self.use_graphs && decode && !batch.is_empty()).then_some(size)
    }
}

impl Backend for CudaBackend {
    fn vocab(&self) -> usize {
        self.plan.vocab
    }

    fn kv_slot_bytes(&self) -> usize {
        2 * self.plan.kv.layers * self.plan.kv.row() * 2
    }

    fn kv_slots(&self) -> usize {
        self.slots
    }

    fn alloc_kv(&mut self, slots: usize) -> Result<(), RuntimeError> {
        self.k_cache.clear();
        self.v_cache.clear();
        self.graphs.clear();
        // One more slot: padded decode rows write there.
        let n = (slots + 1) * self.plan.kv.row();
        for _ in 0..self.plan.kv.layers {
            let oom = |e| RuntimeError::Invalid(format!("out of GPU memory for a KV pool of {slots} slots: {e:?}"));
            self.k_cache.push(self.stream.alloc_zeros::<u16>(n).map_err(oom)?);
            self.v_cache.push(self.stream.alloc_zeros::<u16>(n).map_err(oom)?);
        }
        self.slots = slots;
        Ok(())
    }

    fn free_memory(&self) -> Option<usize> {
        self.stream.context().bind_to_thread().ok()?;
        cudarc::driver::result::mem_get_info().ok().map(|(free, _)| free)
    }

    /// Best of five device-to-device copies of 1 GiB, counting bytes read and written.
    fn copy_bandwidth(&mut self) -> Option<f64> {
        probe::copy(&self.stream, &bench_probe(1 << 30, 0)).ok().map(|r| r.gb_s * 1e9)
    }

    /// Best of five 8192^3 cuBLASLt matmuls in the program's 16-bit type.
    fn matmul_rate(&mut self) -> Option<f64> {
        probe::matmul(&self.stream, self.program.half, &bench_probe(0, 8192)).ok().map(|r| r.tflop_s * 1e12)
    }

    fn forward(&mut self, batch: &[StepSeq]) -> Result<Vec<f32>, RuntimeError> {
        let p = self.pack(batch)?;
        self.execute(&p)?;
        self.logits(p.wanted)
    }

    fn forward_hidden(&mut self, batch: &[StepSeq]) -> Result<Vec<f32>, RuntimeError> {
        let p = self.pack(batch)?;
        self.execute(&p)?;
        self.hidden(p.wanted)
    }

    fn hidden_size(&self) -> usize {
        self.plan.hidden_size()
    }

    fn forward_sample(
        &mut self,
        batch: &[StepSeq],
        rows: &[RowSampling],
        adjust: &[Vec<Adjust>],
        constraints: &[Option<Constraint>],
    ) -> Result<Vec<u32>, RuntimeError> {
        self.staging.none_pending("a step run")?;
        self.launch_forward(batch, &[])?;
        // The GPU runs the step while the host computes the masks.
        self.launch_choice(rows, adjust, constraints)?;
        self.finish_sample()
    }

    fn pipelined(&self) -> bool {
        self.pipelined
    }

    fn launch_forward(&mut self, batch: &[StepSeq], fed: &[Fed]) -> Result<(), RuntimeError> {
        if !fed.is_empty() && self.staging.pending() == 0 {
            return Err(RuntimeError::Invalid("a step feeds tokens from a step before it that has finished".into()));
        }
        Profile::step_start(&self.profile);
        let mut p = self.pack(batch)?;
        p.feed(fed)?;
        self.execute(&p)
    }

    fn launch_choice(
        &mut self,
        rows: &[RowSampling],
        adjust: &[Vec<Adjust>],
        constraints: &[Option<Constraint>],
    ) -> Result<(), RuntimeError> {
        check_rows(self.last_rows, rows)?;
        let masks = crate::constraint::masks(constraints);
        self.launch_sampling(rows, adjust, &masks)
    }

    fn sample_ready(&mut self) -> Result<bool, RuntimeError> {
        self.staging.ready()
    }

    fn finish_sample(&mut self) -> Result<Vec<u32>, RuntimeError> {
        let ids = self.staging.take();
        Profile::step_end(&self.profile);
        ids
    }

    fn resample(&mut self, rows: &[RowSampling], adjust: &[Vec<Adjust>]) -> Result<Option<Vec<u32>>, RuntimeError> {
        check_rows(self.last_rows, rows)?;
        self.sample(rows, adjust, &[]).map(Some)
    }
}

/// What `engrun bench` measures of this GPU's limits: five runs after two warm-ups, of a
/// device copy of `device_bytes` or a square matmul of `matmul_size`.
fn bench_probe(device_bytes: usize, matmul_size: usize) -> crate::probe::ProbeOptions {
    crate::probe::ProbeOptions { host_bytes: 0, device_bytes, matmul_size, reps: 5, warmup: 2, gpus: vec![] }
}

/// The split argmax's partial values and indices, and its per-row counters.
type ArgmaxScratch = (CudaSlice<f32>, CudaSlice<i32>, CudaSlice<u32>);

/// The split argmax's scratch for `rows` logit rows (counters zeroed).
fn argmax_scratch(stream: &Arc<CudaStream>, rows: usize) -> Result<ArgmaxScratch, RuntimeError> {
    let n = rows * codegen_cuda::ARGMAX_BLOCKS;
    Ok((
        stream.alloc_zeros::<f32>(n).map_err(driver("alloc"))?,
        stream.alloc_zeros::<i32>(n).map_err(driver("alloc"))?,
        stream.alloc_zeros::<u32>(rows).map_err(driver("alloc"))?,
    ))
}

/// Checks that a step has one sampling row per logits row.
fn check_rows(wanted: usize, rows: &[RowSampling]) -> Result<(), RuntimeError> {
    if rows.len() == wanted {
        return Ok(());
    }
    Err(RuntimeError::Invalid(format!("{} sampling rows for a step of {wanted} logits rows", rows.len())))
}

/// The step inputs of `batch` in one array (ids, positions, slots written, each token's
/// sequence offset into the slot table, logit rows, the slot table), then `pad` sequences of
/// one token (id 0, position 0) writing scratch slot `scratch` (the pool's size). Each padding
/// row is a sequence of its own, as every decode row is: no 16 rows of a padded decode step are
/// of one sequence, so extend attention has none (`Launch::idle_in_decode`).
fn pack_inputs(batch: &[StepSeq], pad: usize, scratch: usize) -> Packed {
    let wanted: usize = batch.iter().map(|q| q.rows.len()).sum();
    let t: usize = batch.iter().map(|q| q.tokens.len()).sum::<usize>() + pad;
    let r = wanted + pad;
    let s: usize = batch.iter().map(|q| q.slots.len()).sum::<usize>() + pad + 1;
    let off = [0, t, 2 * t, 3 * t, 4 * t, 4 * t + r];
    let mut h = vec![0i32; 4 * t + r + s];
    let (mut tok, mut row, mut slot) = (0, 0, 0);
    for q in batch {
        for (i, &id) in q.tokens.iter().enumerate() {
            h[tok] = id as i32;
            h[off[1] + tok] = (q.start() + i) as i32;
            h[off[2] + tok] = q.slots[q.start() + i] as i32;
            h[off[3] + tok] = slot as i32;
            tok += 1;
        }
        for &x in q.rows {
            h[off[4] + row] = (tok - q.tokens.len() + x) as i32;
            row += 1;
        }
        for &x in q.slots {
            h[off[5] + slot] = x as i32;
            slot += 1;
        }
    }
    for _ in 0..pad {
        h[off[2] + tok] = scratch as i32;
        h[off[3] + tok] = slot as i32;
        h[off[4] + row] = tok as i32;
        h[off[5] + slot] = scratch as i32;
        tok += 1;
        row += 1;
        slot += 1;
    }
    h[off[5] + slot] = scratch as i32;
    Packed { host: h, off, t, r, wanted, graph: false, fed: false }
}

/// A step's inputs as one array, the same for every rank (see [`CudaBackend::pack`]).
pub(crate) struct Packed {
    host: Vec<i32>,
    /// Where ids, pos, slot_of, seq_off, rows and slots start in `host`.
    off: [usize; 6],
    /// Tokens and logit rows, padding included.
    t: usize,
    r: usize,
    /// Logit rows wanted (the first `wanted` of `r`).
    wanted: usize,
    /// Replayed as a captured graph (of `t` rows).
    graph: bool,
    /// Some ids are `-1 - row`: the token chosen for that row of the step before, fed on the
    /// device ([`Packed::feed`]).
    fed: bool,
}

impl Packed {
    /// Marks the tokens of `fed` as those chosen for rows of the step before (`-1 - row`),
    /// replaced on the device before the step runs (`KernelKey::FeedTokens`).
    fn feed(&mut self, fed: &[Fed]) -> Result<(), RuntimeError> {
        for f in fed {
            if f.token >= self.t {
                return Err(RuntimeError::Invalid(format!("fed token {} outside a step of {}", f.token, self.t)));
            }
            self.host[self.off[0] + f.token] = -1 - f.row as i32;
        }
        self.fed = !fed.is_empty();
        Ok(())
    }
}

impl CudaBackend {
    /// Copies the logits of the first `wanted` rows of the last step to the host.
    pub(crate) fn logits(&mut self, wanted: usize) -> Result<Vec<f32>, RuntimeError> {
        let n = wanted * self.plan.vocab;
        let mut logits = vec![0f32; n];
        if n > 0 {
            let src = self.bufs[self.program.output].slice(0..n);
            self.stream.memcpy_dtoh(&src, &mut logits).map_err(driver("copying logits"))?;
        }
        self.stream.synchronize().map_err(driver("running a step"))?;
        Ok(logits)
    }

    /// Copies the final hidden state of the first `wanted` logit rows of the last step to the
    /// host (the gathered rows the lm_head reads, in the program's 16-bit float).
    pub(crate) fn hidden(&mut self, wanted: usize) -> Result<Vec<f32>, RuntimeError> {
        let (h, half) = (self.plan.hidden_size(), self.program.half);
        let Some(buf) = self.program.hidden else {
            return Err(RuntimeError::Unsupported("the plan has no logits op to take a hidden state from".into()));
        };
        // Two 16-bit values per f32 word of the buffer.
        let mut words = vec![0f32; (wanted * h).div_ceil(2)];
        if !words.is_empty() {
            let src = self.bufs[buf].slice(0..words.len());
            self.stream.memcpy_dtoh(&src, &mut words).map_err(driver("copying hidden states"))?;
        }
        self.stream.synchronize().map_err(driver("running a step"))?;
        // Little-endian words: the first value of a pair in the low half.
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let mut h16 = half.to_f32(&bytes);
        h16.truncate(wanted * h);
        Ok(h16)
    }

    /// The token of each of the first logit rows of the last step, one per entry of `rows`,
    /// chosen on the GPU (`kernels/sample.cuh`) after the rows' constraint `masks` (one per
    /// row, or none at all) and `adjust`; waits for them (no step's tokens may be on their way).
    pub(crate) fn sample(
        &mut self,
        rows: &[RowSampling],
        adjust: &[Vec<Adjust>],
        masks: &[Option<Vec<u32>>],
    ) -> Result<Vec<u32>, RuntimeError> {
        self.staging.none_pending("a step sampled")?;
        self.launch_sampling(rows, adjust, masks)?;
        self.staging.take()
    }

    /// Launches the choice of [`CudaBackend::sample`] and queues the tokens' copy to the host
    /// ([`staging::Staging::take`] returns them).
    fn launch_sampling(
        &mut self,
        rows: &[RowSampling],
        adjust: &[Vec<Adjust>],
        masks: &[Option<Vec<u32>>],
    ) -> Result<(), RuntimeError> {
        let wanted = rows.len();
        let src = self.ptr(&self.tokens);
        if wanted == 0 {
            return self.staging.download(&self.stream, src, 0);
        }
        let vocab = self.plan.vocab;
        self.mask_logits(masks, wanted)?;
        self.adjust_logits(adjust, wanted)?;
        // All greedy (the usual case): the split argmax, no parameters to copy.
        let greedy = rows.iter().all(RowSampling::is_greedy);
        if !greedy {
            let params: Vec<f32> = rows.iter().flat_map(|r| r.to_device(vocab)).collect();
            let dst = self.ptr(&self.sample_params);
            self.staging.upload(staging::Upload::Params, &self.stream, &params, dst)?;
        }
        self.staging.tokens_free(&self.stream)?;
        let out = self.bufs[self.program.output].slice(0..wanted * vocab);
        let (key, grid) = if greedy {
            let blocks = codegen_cuda::argmax_blocks(wanted);
            (KernelKey::Argmax { vocab, blocks }, (wanted as u32, blocks as u32, 1))
        } else {
            (KernelKey::Sample { vocab }, (wanted as u32, 1, 1))
        };
        let mut b = self.stream.launch_builder(&self.funcs[&key]);
        b.arg(&out);
        if greedy {
            b.arg(&self.argmax.0).arg(&self.argmax.1).arg(&self.argmax.2);
        } else {
            b.arg(&self.sample_params);
        }
        b.arg(&mut self.tokens);
        let block = if greedy { 256 } else { 1024 };
        let cfg = LaunchConfig { grid_dim: grid, block_dim: (block, 1, 1), shared_mem_bytes: 0 };
        Profile::span(&self.profile, &self.stream, true, || {
            unsafe { b.launch(cfg) }.map(|_| ()).map_err(driver("launching the sampling kernel"))
        })?;
        self.staging.download(&self.stream, src, wanted)
    }

    /// Replaces the step's ids that name a row of the step before (`-1 - row`, [`Packed::feed`])
    /// by the token chosen there, still in `tokens`. A decode graph starts with it (ids of steps
    /// not fed are all tokens, left as they are).
    pub(super) fn feed_tokens(&mut self, t: usize) -> Result<(), RuntimeError> {
        let mut ids = self.inputs.slice_mut(0..t);
        let mut b = self.stream.launch_builder(&self.funcs[&KernelKey::FeedTokens]);
        let n = t as i32;
        b.arg(&mut ids).arg(&self.tokens).arg(&n);
        let cfg =
            LaunchConfig { grid_dim: ((t as u32).div_ceil(256), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(driver("launching the fed tokens"))
    }

    /// Sets the logits of the tokens each masked row's constraint does not allow to -inf (one
    /// launch for all rows): the rows' indices, then their masks of `ceil(vocab / 32)` words.
    fn mask_logits(&mut self, masks: &[Option<Vec<u32>>], wanted: usize) -> Result<(), RuntimeError> {
        let vocab = self.plan.vocab;
        let words = vocab.div_ceil(32);
        let masked: Vec<(usize, &Vec<u32>)> =
            masks.iter().take(wanted).enumerate().filter_map(|(r, m)| Some((r, m.as_ref()?))).collect();
        if masked.is_empty() {
            return Ok(());
        }
        let m = masked.len();
        let mut data = vec![0u32; m + m * words];
        for (j, (r, mask)) in masked.iter().enumerate() {
            data[j] = *r as u32;
            let n = mask.len().min(words);
            data[m + j * words..m + j * words + n].copy_from_slice(&mask[..n]);
        }
        if data.len() > self.masks.len() {
            self.masks = self.stream.alloc_zeros::<u32>(data.len().next_power_of_two()).map_err(driver("alloc"))?;
        }
        let dst = self.ptr(&self.masks);
        self.staging.upload(staging::Upload::Masks, &self.stream, &data, dst)?;
        let mut out = self.bufs[self.program.output].slice_mut(0..wanted * vocab);
        let mut b = self.stream.launch_builder(&self.funcs[&KernelKey::MaskLogits { vocab }]);
        let (m32, w32) = (m as i32, words as i32);
        b.arg(&mut out).arg(&self.masks).arg(&m32).arg(&w32);
        let grid = (m as u32, vocab.div_ceil(codegen_cuda::MASK_SPAN) as u32, 1);
        let cfg = LaunchConfig { grid_dim: grid, block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(driver("launching the constraint masks"))
    }

    /// Applies each row's adjustments to the last step's logits in place (one launch for all).
    fn adjust_logits(&mut self, adjust: &[Vec<Adjust>], wanted: usize) -> Result<(), RuntimeError> {
        let entries: Vec<f32> = adjust
            .iter()
            .take(wanted)
            .enumerate()
            .flat_map(|(r, a)| a.iter().flat_map(move |a| a.to_device(r)))
            .collect();
        if entries.is_empty() {
            return Ok(());
        }
        if entries.len() > self.adjust.len() {
            self.adjust = self.stream.alloc_zeros::<f32>(entries.len().next_power_of_two()).map_err(driver("alloc"))?;
        }
        let dst = self.ptr(&self.adjust);
        self.staging.upload(staging::Upload::Adjust, &self.stream, &entries, dst)?;
        let n = (entries.len() / 5) as i32;
        let vocab = self.plan.vocab;
        let mut out = self.bufs[self.program.output].slice_mut(0..wanted * vocab);
        let mut b = self.stream.launch_builder(&self.funcs[&KernelKey::AdjustLogits { vocab }]);
        b.arg(&mut out).arg(&self.adjust).arg(&n);
        let cfg =
            LaunchConfig { grid_dim: ((n as u32).div_ceil(256), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(driver("launching the logit adjustments"))
    }

    /// Finishes this rank's work and drops its NCCL communicator (and the graphs that use it).
    pub(crate) fn leave_group(&mut self) {
        let _ = self.stream.synchronize();
        self.graphs.clear();
        self.comm.take();
    }

    /// Runs a packed step: grows the buffers, uploads the inputs, replays (capturing on first
    /// use) the decode graph of its size or enqueues its launches.
    pub(crate) fn execute(&mut self, p: &Packed) -> Result<(), RuntimeError> {
        self.last_rows = p.wanted;
        if p.t == 0 {
            return Ok(());
        }
        self.stream.context().bind_to_thread().map_err(driver("binding the context"))?;
        self.ensure_cap(p.t, p.r)?;
        if p.host.len() > self.inputs.len() {
            self.graphs.clear();
            self.inputs = self.stream.alloc_zeros::<i32>(p.host.len() * 2).map_err(driver("alloc"))?;
            self.staging.inputs_read(&self.stream)?;
        }
        let dst = self.ptr(&self.inputs);
        self.staging.upload_inputs(&self.stream, &p.host, dst)?;
        let run = self.run(p);
        // Whatever ran, nothing after this point of the stream reads the inputs.
        self.staging.inputs_read(&self.stream)?;
        run
    }

    /// Queues step `p` (its inputs queued for copying): through its size's graph where it
    /// takes one, capturing the graph first where there is none yet.
    fn run(&mut self, p: &Packed) -> Result<(), RuntimeError> {
        let t = p.t;
        self.positions = (p.host.len() - p.off[5]).saturating_sub(1);
        if !p.graph {
            if p.fed {
                self.feed_tokens(t)?;
            }
            return self.enqueue(t, p.r, &p.off, false);
        }
        if !self.graphs.contains_key(&t) {
            self.tune_graph(p)?;
            self.tune_lean(p)?;
            let start = std::time::Instant::now();
            let graph = self.capture(p)?;
            if self.comm.as_ref().is_none_or(|c| c.0.rank() == 0) {
                eprintln!("captured the decode graph for batch {t} in {:.0} ms", start.elapsed().as_secs_f64() * 1e3);
            }
            self.graphs.insert(t, Graph(graph));
        }
        let graph = &self.graphs[&t].0;
        Profile::span(&self.profile, &self.stream, false, || graph.launch().map_err(driver("replaying a graph")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `fa_row` of `kernels/attention.cuh`: whether extend attention takes row `t`.
    fn fa_row(seq_off: &[i32], t: usize) -> bool {
        let g = t & !15;
        seq_off[g] == seq_off[(g + 15).min(seq_off.len() - 1)]
    }

    #[test]
    fn padded_decode_rows_are_sequences_of_their_own() {
        // 17 decode rows padded to the 40 of a captured size: rows 32..40 are all padding.
        let slots: Vec<Vec<u32>> = (0..17).map(|i| (0..=i).map(|p| 1000 * i + p).collect()).collect();
        let batch: Vec<StepSeq> =
            slots.iter().map(|s| StepSeq { tokens: &[7][..], slots: &s[..], rows: &[0][..] }).collect();
        let n = batch.len();
        let p = pack_inputs(&batch, 40 - n, 9999);
        assert_eq!((p.t, p.r, p.wanted), (40, 40, n));
        let seq_off = &p.host[p.off[3]..p.off[3] + p.t];
        let table = &p.host[p.off[5]..];
        // Every row's offset differs from the others', so extend attention takes none.
        assert!(seq_off.windows(2).all(|w| w[0] < w[1]));
        assert!((0..p.t).all(|t| !fa_row(seq_off, t)));
        // A padding row: position 0, writing the scratch slot, its own table entry the scratch
        // slot, its logits row its token; the table ends with one more scratch entry.
        for t in n..p.t {
            assert_eq!(p.host[p.off[1] + t], 0);
            assert_eq!(p.host[p.off[2] + t], 9999);
            assert_eq!(table[seq_off[t] as usize], 9999);
            assert_eq!(p.host[p.off[4] + t], t as i32);
        }
        assert_eq!(table.len(), batch.iter().map(|q| q.slots.len()).sum::<usize>() + (40 - n) + 1);
        assert_eq!(table.last(), Some(&9999));
        // A real row reads its own slots: its last position is the one it writes.
        let last = batch[3].slots.len() - 1;
        assert_eq!(table[seq_off[3] as usize + last], p.host[p.off[2] + 3]);
    }

    #[test]
    fn a_prefill_sequence_fills_its_groups_of_sixteen() {
        let s: Vec<u32> = (0..40).collect();
        let q = StepSeq { tokens: &[1; 20][..], slots: &s[..], rows: &[19][..] };
        let p = pack_inputs(&[q], 0, 64);
        let seq_off = &p.host[p.off[3]..p.off[3] + p.t];
        assert!(fa_row(seq_off, 0) && fa_row(seq_off, 19));
        assert_eq!(&p.host[p.off[1]..p.off[1] + 2], &[20, 21]);
    }
}
