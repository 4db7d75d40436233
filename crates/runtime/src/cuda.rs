//! The CUDA backend (`--device cuda`), first version: the bundle's generated kernels
//! (`kernels/model.cu`, see `codegen-cuda`) compiled by NVRTC at load, weights uploaded from the
//! bundle, a paged f32 KV pool, and one launch per kernel of each plan node. cudarc loads the
//! driver and NVRTC at run time, so building needs no CUDA. Not yet: CUDA graphs, per-batch
//! specialisation, fused and tensor-core kernels, tensor parallelism over NCCL.

use crate::backend::{check_batch, Backend, StepSeq};
use crate::RuntimeError;
use bundle::Bundle;
use codegen_cuda::{KernelKey, Program};
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use ir::{DType, Op, Plan};
use std::collections::HashMap;
use std::sync::Arc;

fn driver<E: std::fmt::Debug>(what: &str) -> impl Fn(E) -> RuntimeError + '_ {
    move |e| RuntimeError::Unsupported(format!("CUDA: {what}: {e:?}"))
}

/// A weight on the device, in the dtype its kernels read.
enum DevWeight {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
}

/// The CUDA backend (see the module docs).
pub struct CudaBackend {
    plan: Plan,
    program: Program,
    stream: Arc<CudaStream>,
    funcs: HashMap<KernelKey, CudaFunction>,
    weights: Vec<Option<DevWeight>>,
    /// Per RoPE node: inverse frequencies on the device and the attention scale.
    rope: HashMap<usize, (CudaSlice<f32>, f32)>,
    k_cache: Vec<CudaSlice<f32>>,
    v_cache: Vec<CudaSlice<f32>>,
    slots: usize,
    /// Stands in for an absent bias.
    dummy: (CudaSlice<f32>, CudaSlice<u16>),
}

/// Creates the context of GPU 0, turning a missing driver (cudarc panics) into an error.
fn context() -> Result<Arc<CudaContext>, RuntimeError> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = std::panic::catch_unwind(|| CudaContext::new(0));
    std::panic::set_hook(hook);
    match r {
        Ok(Ok(ctx)) => Ok(ctx),
        Ok(Err(e)) => Err(RuntimeError::Unsupported(format!("no usable GPU: {e:?}; use --device cpu"))),
        Err(_) => Err(RuntimeError::Unsupported(
            "the CUDA driver (libcuda.so) was not found: no GPU on this machine? use --device cpu".into(),
        )),
    }
}

impl CudaBackend {
    /// Compiles the bundle's kernels with NVRTC and uploads rank 0's weights to GPU 0.
    pub fn new(bundle: &Bundle) -> Result<CudaBackend, RuntimeError> {
        let plan = bundle.plan.clone();
        if plan.tp != 1 {
            return Err(RuntimeError::Unsupported(format!(
                "the CUDA backend runs one rank for now; this bundle has tp={}",
                plan.tp
            )));
        }
        let ctx = context()?;
        let stream = ctx.default_stream();
        let program = codegen_cuda::emit(&plan).map_err(|e| RuntimeError::Unsupported(e.to_string()))?;
        let t = std::time::Instant::now();
        let arch: &'static str = match std::env::var("ENGINE_CUDA_ARCH") {
            Ok(a) => Box::leak(a.into_boxed_str()),
            Err(_) => "compute_90",
        };
        let ptx = codegen_cuda::nvrtc::compile_ptx(&program.source, arch)
            .map_err(|e| RuntimeError::Unsupported(e.to_string()))?;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx)).map_err(driver("loading the kernels"))?;
        let mut funcs = HashMap::new();
        for k in &program.kernels {
            funcs.insert(*k, module.load_function(&k.name()).map_err(driver("finding a kernel"))?);
        }
        eprintln!("compiled {} CUDA kernels for {arch} in {:.2}s", funcs.len(), t.elapsed().as_secs_f64());
        let file = bundle.weights(0)?;
        let mut weights = Vec::with_capacity(plan.nodes.len());
        for n in &plan.nodes {
            weights.push(match &n.op {
                Op::Weight { name, .. } => {
                    let (dtype, _, bytes) = file.raw(name)?;
                    Some(match dtype {
                        DType::BF16 => {
                            let v: Vec<u16> = bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
                            DevWeight::Bf16(stream.clone_htod(&v).map_err(driver("uploading weights"))?)
                        }
                        d => DevWeight::F32(stream.clone_htod(&d.to_f32(bytes)).map_err(driver("uploading weights"))?),
                    })
                }
                _ => None,
            });
        }
        let mut rope = HashMap::new();
        for (i, n) in plan.nodes.iter().enumerate() {
            if let Op::Rope { head_dim, theta, scaling } = &n.op {
                let (inv, scale) = scaling.inv_freq(*head_dim, *theta);
                let inv: Vec<f32> = inv.iter().map(|&f| f as f32).collect();
                rope.insert(i, (stream.clone_htod(&inv).map_err(driver("uploading RoPE"))?, scale as f32));
            }
        }
        let dummy = (
            stream.alloc_zeros::<f32>(1).map_err(driver("alloc"))?,
            stream.alloc_zeros::<u16>(1).map_err(driver("alloc"))?,
        );
        Ok(CudaBackend {
            plan,
            program,
            stream,
            funcs,
            weights,
            rope,
            k_cache: vec![],
            v_cache: vec![],
            slots: 0,
            dummy,
        })
    }

    fn f(&self, k: &KernelKey) -> &CudaFunction {
        &self.funcs[k]
    }
}

fn grid(x: usize, y: usize, block: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (x.max(1) as u32, y.max(1) as u32, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 }
}

/// Host-side inputs of a step.
struct StepInputs {
    ids: Vec<i32>,
    pos: Vec<i32>,
    slot_of: Vec<i32>,
    slots: Vec<i32>,
    seq_off: Vec<i32>,
    rows: Vec<i32>,
}

fn inputs(batch: &[StepSeq]) -> StepInputs {
    let mut s = StepInputs { ids: vec![], pos: vec![], slot_of: vec![], slots: vec![], seq_off: vec![], rows: vec![] };
    for q in batch {
        let off = s.slots.len() as i32;
        let base = s.ids.len();
        s.slots.extend(q.slots.iter().map(|&x| x as i32));
        for (i, &t) in q.tokens.iter().enumerate() {
            s.ids.push(t as i32);
            s.pos.push((q.start() + i) as i32);
            s.slot_of.push(q.slots[q.start() + i] as i32);
            s.seq_off.push(off);
        }
        s.rows.extend(q.rows.iter().map(|&r| (base + r) as i32));
    }
    s
}

impl Backend for CudaBackend {
    fn vocab(&self) -> usize {
        self.plan.vocab
    }

    fn kv_slot_bytes(&self) -> usize {
        2 * self.plan.kv.layers * self.plan.kv.row() * 4
    }

    fn kv_slots(&self) -> usize {
        self.slots
    }

    fn alloc_kv(&mut self, slots: usize) -> Result<(), RuntimeError> {
        self.k_cache.clear();
        self.v_cache.clear();
        let n = slots * self.plan.kv.row();
        for _ in 0..self.plan.kv.layers {
            let oom = |e| RuntimeError::Invalid(format!("out of GPU memory for a KV pool of {slots} slots: {e:?}"));
            self.k_cache.push(self.stream.alloc_zeros::<f32>(n).map_err(oom)?);
            self.v_cache.push(self.stream.alloc_zeros::<f32>(n).map_err(oom)?);
        }
        self.slots = slots;
        Ok(())
    }

    fn forward(&mut self, batch: &[StepSeq]) -> Result<Vec<f32>, RuntimeError> {
        check_batch(&self.plan, batch, self.slots)?;
        let h = inputs(batch);
        let up = |v: &Vec<i32>| self.stream.clone_htod(if v.is_empty() { &[0][..] } else { v });
        let e = driver("copying step inputs");
        let (ids, pos, slot_of) = (up(&h.ids).map_err(&e)?, up(&h.pos).map_err(&e)?, up(&h.slot_of).map_err(&e)?);
        let (slots, seq_off, rows) = (up(&h.slots).map_err(&e)?, up(&h.seq_off).map_err(&e)?, up(&h.rows).map_err(&e)?);
        let t_len = h.ids.len();
        let r_len = h.rows.len();
        let mut vals: Vec<Option<CudaSlice<f32>>> = Vec::with_capacity(self.plan.nodes.len());
        let launch = driver("launching a kernel");
        for (i, n) in self.plan.nodes.iter().enumerate() {
            let cols = n.ty.last().unwrap_or(0);
            let keys = &self.program.nodes[i];
            let input = |j: usize| vals[n.inputs[j]].as_ref().expect("an activation input");
            let alloc = |len: usize| self.stream.alloc_zeros::<f32>(len.max(1)).map_err(driver("alloc"));
            let out = match &n.op {
                Op::Tokens | Op::Positions | Op::Weight { .. } => None,
                Op::AllReduce => Some(self.stream.clone_dtod(input(0)).map_err(driver("copy"))?),
                Op::Embedding => {
                    let mut o = alloc(t_len * cols)?;
                    let mut b = self.stream.launch_builder(self.f(&keys[0]));
                    b.arg(&ids);
                    self.push_weight(&mut b, n.inputs[1]);
                    b.arg(&mut o);
                    unsafe { b.launch(grid(t_len, 1, 256)) }.map_err(&launch)?;
                    Some(o)
                }
                Op::Linear { bias } => {
                    let mut o = alloc(t_len * cols)?;
                    let x = input(0);
                    let mut b = self.stream.launch_builder(self.f(&keys[0]));
                    b.arg(x);
                    self.push_weight(&mut b, n.inputs[1]);
                    if *bias {
                        self.push_weight(&mut b, n.inputs[2]);
                    } else {
                        self.push_dummy(&mut b, n.inputs[1]);
                    }
                    let t = t_len as i32;
                    b.arg(&mut o);
                    b.arg(&t);
                    unsafe { b.launch(grid(cols.div_ceil(8), 1, 256)) }.map_err(&launch)?;
                    Some(o)
                }
                Op::RmsNorm { eps } => {
                    let mut o = alloc(t_len * cols)?;
                    let mut b = self.stream.launch_builder(self.f(&keys[0]));
                    b.arg(input(0));
                    self.push_weight(&mut b, n.inputs[1]);
                    b.arg(&mut o);
                    b.arg(eps);
                    unsafe { b.launch(grid(t_len, 1, 256)) }.map_err(&launch)?;
                    Some(o)
                }
                Op::Rope { .. } => {
                    let mut o = alloc(t_len * cols)?;
                    let (inv, scale) = &self.rope[&i];
                    let mut b = self.stream.launch_builder(self.f(&keys[0]));
                    b.arg(input(0));
                    b.arg(&pos);
                    b.arg(inv);
                    b.arg(scale);
                    b.arg(&mut o);
                    unsafe { b.launch(grid(t_len, 1, 128)) }.map_err(&launch)?;
                    Some(o)
                }
                Op::Attention { heads, scale, layer, .. } => {
                    let (kc, vc) = (&self.k_cache[*layer], &self.v_cache[*layer]);
                    let mut w = self.stream.launch_builder(self.f(&keys[0]));
                    w.arg(input(1));
                    w.arg(input(2));
                    w.arg(kc);
                    w.arg(vc);
                    w.arg(&slot_of);
                    unsafe { w.launch(grid(t_len, 1, 128)) }.map_err(&launch)?;
                    let mut o = alloc(t_len * cols)?;
                    let mut b = self.stream.launch_builder(self.f(&keys[1]));
                    b.arg(input(0));
                    b.arg(kc);
                    b.arg(vc);
                    b.arg(&slots);
                    b.arg(&seq_off);
                    b.arg(&pos);
                    b.arg(scale);
                    b.arg(&mut o);
                    unsafe { b.launch(grid(t_len, *heads, 32)) }.map_err(&launch)?;
                    Some(o)
                }
                Op::Silu | Op::Mul | Op::Add => {
                    let len = (t_len * cols) as i64;
                    let mut o = alloc(t_len * cols)?;
                    let mut b = self.stream.launch_builder(self.f(&keys[0]));
                    b.arg(input(0));
                    if !matches!(n.op, Op::Silu) {
                        b.arg(input(1));
                    }
                    b.arg(&mut o);
                    b.arg(&len);
                    unsafe { b.launch(grid((len as usize).div_ceil(256), 1, 256)) }.map_err(&launch)?;
                    Some(o)
                }
                Op::Logits => {
                    let hidden = self.plan.nodes[n.inputs[0]].ty.last().unwrap_or(0);
                    let mut sel = alloc(r_len * hidden)?;
                    let mut g = self.stream.launch_builder(self.f(&keys[0]));
                    g.arg(input(0));
                    g.arg(&rows);
                    g.arg(&mut sel);
                    unsafe { g.launch(grid(r_len, 1, 256)) }.map_err(&launch)?;
                    let mut o = alloc(r_len * cols)?;
                    let r = r_len as i32;
                    let mut b = self.stream.launch_builder(self.f(&keys[1]));
                    b.arg(&sel);
                    self.push_weight(&mut b, n.inputs[1]);
                    self.push_dummy(&mut b, n.inputs[1]);
                    b.arg(&mut o);
                    b.arg(&r);
                    if r_len > 0 {
                        unsafe { b.launch(grid(cols.div_ceil(8), 1, 256)) }.map_err(&launch)?;
                    }
                    Some(o)
                }
            };
            vals.push(out);
        }
        let out = vals[self.plan.output].as_ref().expect("logits");
        let mut logits = self.stream.clone_dtoh(out).map_err(driver("copying logits"))?;
        logits.truncate(r_len * self.plan.vocab);
        Ok(logits)
    }
}

impl CudaBackend {
    fn push_weight<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>, node: usize) {
        match &self.weights[node] {
            Some(DevWeight::F32(w)) => b.arg(w),
            Some(DevWeight::Bf16(w)) => b.arg(w),
            None => b.arg(&self.dummy.0),
        };
    }

    fn push_dummy<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>, like: usize) {
        match &self.weights[like] {
            Some(DevWeight::Bf16(_)) => b.arg(&self.dummy.1),
            _ => b.arg(&self.dummy.0),
        };
    }
}
