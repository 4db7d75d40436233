//! The CPU backend: every op of the plan runs as a kernel JIT-compiled by Cranelift
//! (`codegen-cpu`), specialised to the plan's shapes when the bundle is loaded. Linear,
//! logits and attention are split across cores.

use crate::backend::{check_batch, Backend, HostKv, StepSeq};
use crate::cpu_moe::{MoeInputs, MoeKernels};
use crate::RuntimeError;
use bundle::Bundle;
use codegen_cpu::{
    AttentionKernel, BinaryKernel, BinaryOp, EmbeddingKernel, LinearKernel, MapKernel, Pool, RmsNormKernel, RopeKernel,
};
use ir::{DType, Op, Plan};
use std::collections::HashMap;
use std::sync::Arc;

/// A weight as the kernels read it.
enum Weight {
    /// Matrices (linear, logits, embedding) in their storage dtype (f32 or bf16).
    Raw(Vec<u8>, DType),
    /// Vectors (norm weights, biases) in f32.
    F32(Vec<f32>),
}

/// The compiled kernel of one plan node.
enum Step {
    None,
    Embedding(Arc<EmbeddingKernel>),
    Linear(Arc<LinearKernel>, Option<Arc<BinaryKernel>>),
    RmsNorm(Arc<RmsNormKernel>),
    /// The kernel and the index of its frequencies in `CpuBackend::rope_freqs`.
    Rope(Arc<RopeKernel>, usize),
    Attention(Arc<AttentionKernel>),
    Binary(Arc<BinaryKernel>),
    Map(Arc<MapKernel>),
    Logits(Arc<LinearKernel>),
    Moe(Box<MoeKernels>),
}

/// Kernels compiled once per distinct specialisation (layers share them).
#[derive(Default)]
struct KernelCache {
    linear: HashMap<(usize, usize, DType), Arc<LinearKernel>>,
    binary: HashMap<BinaryOp, Arc<BinaryKernel>>,
    norm: HashMap<(usize, u32), Arc<RmsNormKernel>>,
    rope: HashMap<(usize, usize, usize), Arc<RopeKernel>>,
    attention: HashMap<(usize, usize, u32, Option<u32>), Arc<AttentionKernel>>,
    embedding: HashMap<(usize, DType), Arc<EmbeddingKernel>>,
    /// By expression (as JSON), row width and broadcast inputs.
    map: HashMap<(String, usize, Vec<bool>), Arc<MapKernel>>,
}

fn jit<T>(r: Result<T, codegen_cpu::JitError>) -> Result<Arc<T>, RuntimeError> {
    r.map(Arc::new).map_err(|e| RuntimeError::Unsupported(e.to_string()))
}

macro_rules! cached {
    ($map:expr, $key:expr, $make:expr) => {
        match $map.get(&$key) {
            Some(k) => k.clone(),
            None => {
                let k = jit($make)?;
                $map.insert($key, k.clone());
                k
            }
        }
    };
}

/// The plan with its kernels and weights.
pub struct CpuBackend {
    plan: Plan,
    steps: Vec<Step>,
    weights: Vec<Option<Weight>>,
    kv: HostKv,
    pool: Pool,
    /// Distinct RoPE (inverse frequencies, cos/sin scale) of the plan; layers share them.
    rope_freqs: Vec<(Vec<f32>, f32)>,
    /// Each node's output buffer of the last step, reused by the next: fresh allocations of a
    /// prefill's large activations came back as new pages to fault in and zero, ~10% of it.
    spare: std::sync::Mutex<Vec<Vec<f32>>>,
}

fn matrix_dtype(d: DType) -> DType {
    if d == DType::BF16 {
        DType::BF16
    } else {
        DType::F32
    }
}

impl CpuBackend {
    /// Loads a tp=1 bundle on all cores and JIT-compiles a kernel for every node (a `--tp N`
    /// bundle runs on [`crate::TpCpuBackend`]).
    pub fn new(bundle: &Bundle) -> Result<CpuBackend, RuntimeError> {
        if bundle.plan.tp != 1 {
            return Err(RuntimeError::Unsupported(format!(
                "CpuBackend runs one rank; this bundle has tp={} (load it with TpCpuBackend)",
                bundle.plan.tp
            )));
        }
        CpuBackend::rank(bundle, 0, std::thread::available_parallelism().map_or(1, |n| n.get()))
    }

    /// Loads rank `rank`'s weights of `bundle`, with a pool of `threads` threads.
    pub(crate) fn rank(bundle: &Bundle, rank: usize, threads: usize) -> Result<CpuBackend, RuntimeError> {
        let plan = bundle.plan.clone();
        let file = bundle.weights(rank)?;
        let is_matrix = |i: usize| {
            plan.nodes.iter().any(|n| match n.op {
                Op::Linear { .. } | Op::Logits | Op::Embedding => n.inputs.get(1) == Some(&i),
                Op::Moe { .. } => n.inputs[2..5].contains(&i),
                _ => false,
            })
        };
        let mut weights = Vec::with_capacity(plan.nodes.len());
        for (i, n) in plan.nodes.iter().enumerate() {
            weights.push(match &n.op {
                Op::Weight { name, shape, dtype, .. } if dtype.is_block() => {
                    let bytes = file.bytes_as(name, *dtype, shape)?;
                    if codegen_cpu::blocks::reads(*dtype) {
                        Some(Weight::Raw(codegen_cpu::blocks::repack(*dtype, bytes), *dtype))
                    } else {
                        // Blocks the kernels do not read (FP8 E4M3): f32 weights, exactly
                        // the interpreter's (`ir::quant::dequantize`).
                        Some(Weight::Raw(DType::F32.from_f32(&dtype.to_f32(bytes)), DType::F32))
                    }
                }
                Op::Weight { name, shape, .. } => {
                    let (dtype, got, bytes) = file.raw(name)?;
                    if got != *shape {
                        return Err(RuntimeError::Invalid(format!(
                            "weight `{name}` has shape {got:?}, the plan expects {shape:?}"
                        )));
                    }
                    Some(if is_matrix(i) {
                        let md = matrix_dtype(dtype);
                        let raw = if md == dtype { bytes.to_vec() } else { md.from_f32(&dtype.to_f32(bytes)) };
                        Weight::Raw(raw, md)
                    } else {
                        Weight::F32(dtype.to_f32(bytes))
                    })
                }
                _ => None,
            });
        }
        let mut kc = KernelCache::default();
        let mut rope_freqs: Vec<(Vec<f32>, f32)> = Vec::new();
        let mut steps = Vec::with_capacity(plan.nodes.len());
        for n in &plan.nodes {
            let wdtype = |j: usize| match &weights[n.inputs[j]] {
                Some(Weight::Raw(_, d)) => *d,
                _ => DType::F32,
            };
            let in_cols = |j: usize| plan.nodes[n.inputs[j]].ty.last().unwrap_or(0);
            let cols = n.ty.last().unwrap_or(0);
            let step = match &n.op {
                Op::Tokens | Op::Positions | Op::Weight { .. } | Op::AllReduce | Op::AllGather { .. } => Step::None,
                Op::Embedding => {
                    Step::Embedding(cached!(kc.embedding, (cols, wdtype(1)), EmbeddingKernel::compile(cols, wdtype(1))))
                }
                Op::Linear { bias } => {
                    let key = (in_cols(0), cols, wdtype(1));
                    let lin = cached!(kc.linear, key, LinearKernel::compile(key.0, key.1, key.2));
                    let add = if *bias {
                        Some(cached!(kc.binary, BinaryOp::Add, BinaryKernel::compile(BinaryOp::Add)))
                    } else {
                        None
                    };
                    Step::Linear(lin, add)
                }
                Op::Logits => {
                    let key = (in_cols(0), cols, wdtype(1));
                    Step::Logits(cached!(kc.linear, key, LinearKernel::compile(key.0, key.1, key.2)))
                }
                Op::RmsNorm { eps } => {
                    // A norm in groups of the weight's size (per head) is the kernel over rows of
                    // that size: the `[T, N]` activation read as `[T·N/D, D]`.
                    let d = in_cols(1);
                    Step::RmsNorm(cached!(kc.norm, (d, eps.to_bits()), RmsNormKernel::compile(d, *eps)))
                }
                Op::Rope { head_dim, theta, scaling, .. } => {
                    let rot = n.op.rotary_dim();
                    let k = cached!(kc.rope, (cols, *head_dim, rot), RopeKernel::compile(cols, *head_dim, rot));
                    let (inv, scale) = scaling.inv_freq(rot, *theta);
                    let freqs = (inv.iter().map(|&f| f as f32).collect::<Vec<_>>(), scale as f32);
                    let idx = rope_freqs.iter().position(|f| *f == freqs).unwrap_or_else(|| {
                        rope_freqs.push(freqs);
                        rope_freqs.len() - 1
                    });
                    Step::Rope(k, idx)
                }
                Op::Attention { kv_heads, head_dim, scale, softcap, .. } => {
                    let key = (*head_dim, kv_heads * head_dim, scale.to_bits(), softcap.map(f32::to_bits));
                    Step::Attention(cached!(
                        kc.attention,
                        key,
                        AttentionKernel::compile(key.0, key.1, *scale, *softcap)
                    ))
                }
                Op::Silu => Step::Binary(cached!(kc.binary, BinaryOp::Silu, BinaryKernel::compile(BinaryOp::Silu))),
                Op::Map { expr } => {
                    let bcast: Vec<bool> = n.inputs.iter().map(|&j| plan.nodes[j].ty.shape.len() == 1).collect();
                    let key = (serde_json::to_string(expr).unwrap_or_default(), cols, bcast);
                    Step::Map(cached!(kc.map, key, MapKernel::compile(expr, key.1, &key.2)))
                }
                Op::Moe { top_k, norm_topk, act, .. } => {
                    let (e, i, h) = (in_cols(1), in_cols(4), cols);
                    let wd = wdtype(2);
                    let bcast = vec![false; act.arity()];
                    let key = (serde_json::to_string(act).unwrap_or_default(), i, bcast);
                    Step::Moe(Box::new(MoeKernels {
                        gate: cached!(kc.linear, (h, i, wd), LinearKernel::compile(h, i, wd)),
                        down: cached!(kc.linear, (i, h, wd), LinearKernel::compile(i, h, wd)),
                        act: cached!(kc.map, key, MapKernel::compile(act, key.1, &key.2)),
                        act_inputs: act.arity(),
                        add: cached!(kc.binary, BinaryOp::Add, BinaryKernel::compile(BinaryOp::Add)),
                        top_k: *top_k,
                        norm_topk: *norm_topk,
                        sizes: (e, i, h),
                        wdtype: wd,
                    }))
                }
                Op::Mul => Step::Binary(cached!(kc.binary, BinaryOp::Mul, BinaryKernel::compile(BinaryOp::Mul))),
                Op::Add => Step::Binary(cached!(kc.binary, BinaryOp::Add, BinaryKernel::compile(BinaryOp::Add))),
            };
            steps.push(step);
        }
        let kv = HostKv::new(&plan);
        let spare = std::sync::Mutex::new(Vec::new());
        Ok(CpuBackend { plan, steps, weights, kv, pool: Pool::new(threads), rope_freqs, spare })
    }

    fn raw(&self, node: usize) -> &[u8] {
        match &self.weights[node] {
            Some(Weight::Raw(b, _)) => b,
            _ => &[],
        }
    }

    fn vector(&self, node: usize) -> &[f32] {
        match &self.weights[node] {
            Some(Weight::F32(v)) => v,
            _ => &[],
        }
    }
}

/// Per-row `cos` then `sin` tables for `positions`, as HF computes them (f32 angles), scaled
/// by the attention factor.
fn rope_tables(inv: &[f32], scale: f32, positions: &[usize]) -> Vec<f32> {
    let mut cs = Vec::with_capacity(positions.len() * 2 * inv.len());
    for &p in positions {
        let p = p as f32;
        cs.extend(inv.iter().map(|f| (p * f).cos() * scale));
        cs.extend(inv.iter().map(|f| (p * f).sin() * scale));
    }
    cs
}

impl Backend for CpuBackend {
    fn vocab(&self) -> usize {
        self.plan.vocab
    }

    fn kv_slot_bytes(&self) -> usize {
        self.kv.slot_bytes()
    }

    fn kv_slots(&self) -> usize {
        self.kv.slots
    }

    fn alloc_kv(&mut self, slots: usize) -> Result<(), RuntimeError> {
        self.kv.alloc(slots)
    }

    fn forward(&mut self, batch: &[StepSeq]) -> Result<Vec<f32>, RuntimeError> {
        self.forward_rank(batch, &Alone, false)
    }

    fn forward_hidden(&mut self, batch: &[StepSeq]) -> Result<Vec<f32>, RuntimeError> {
        self.forward_rank(batch, &Alone, true)
    }

    fn hidden_size(&self) -> usize {
        self.plan.hidden_size()
    }
}

/// How one rank's step meets the other ranks' (see [`crate::tp`]).
pub(crate) trait Collective: Sync {
    /// Replaces `v`, this rank's part, with the sum over the ranks.
    fn all_reduce(&self, v: &mut Vec<f32>);
    /// Replaces `v`, this rank's `[rows, cols]` block, with the `[rows, cols * ranks]` rows of
    /// every rank's block in rank order.
    fn all_gather(&self, v: &mut Vec<f32>, cols: usize);
}

/// One rank alone: both collectives are the identity.
struct Alone;

impl Collective for Alone {
    fn all_reduce(&self, _: &mut Vec<f32>) {}
    fn all_gather(&self, _: &mut Vec<f32>, _: usize) {}
}

impl CpuBackend {
    /// One step of this rank; `comm` joins it with the other ranks (nothing at tp=1).
    /// `hidden`: return the final hidden state of the rows instead of their logits.
    pub(crate) fn forward_rank(
        &mut self,
        batch: &[StepSeq],
        comm: &dyn Collective,
        hidden: bool,
    ) -> Result<Vec<f32>, RuntimeError> {
        check_batch(&self.plan, batch, self.kv.slots)?;
        let mut kv = std::mem::replace(&mut self.kv, HostKv::new(&self.plan));
        let result = self.run(&mut kv, batch, comm, hidden);
        self.kv = kv;
        result
    }
}

impl CpuBackend {
    /// Runs one step: the sequences' tokens concatenated, each sequence at its own positions
    /// and slots of the pool. `hidden`: stop at the logits op and return its selected input
    /// rows (the final hidden state; every rank holds all of it).
    fn run(
        &self,
        kv: &mut HostKv,
        batch: &[StepSeq],
        comm: &dyn Collective,
        hidden: bool,
    ) -> Result<Vec<f32>, RuntimeError> {
        let ids: Vec<i32> = batch.iter().flat_map(|c| c.tokens.iter().map(|&t| t as i32)).collect();
        let t_len = ids.len();
        let positions: Vec<usize> = batch.iter().flat_map(|c| c.start()..c.slots.len()).collect();
        let mut offsets = Vec::with_capacity(batch.len());
        let mut rows = Vec::new();
        let mut off = 0;
        for c in batch {
            offsets.push(off);
            rows.extend(c.rows.iter().map(|r| off + r));
            off += c.tokens.len();
        }
        // cos/sin tables for this step's positions, once per distinct RoPE of the plan.
        let tables: Vec<Vec<f32>> =
            self.rope_freqs.iter().map(|(inv, scale)| rope_tables(inv, *scale, &positions)).collect();
        let mut vals: Vec<Vec<f32>> = Vec::with_capacity(self.plan.nodes.len());
        let mut spare = std::mem::take(&mut *self.spare.lock().unwrap_or_else(|e| e.into_inner()));
        spare.resize_with(self.plan.nodes.len(), Vec::new);
        // Node i's output of `len` zeros, in the last step's buffer of node i.
        let mut buf = |i: usize, len: usize| {
            let mut v = std::mem::take(&mut spare[i]);
            v.clear();
            v.resize(len, 0.0);
            v
        };
        for (i, n) in self.plan.nodes.iter().enumerate() {
            let cols = n.ty.last().unwrap_or(0);
            let input = |j: usize| vals[n.inputs[j]].as_slice();
            let out = match (&self.steps[i], &n.op) {
                (Step::Embedding(k), _) => {
                    let mut o = buf(i, t_len * cols);
                    k.run(self.raw(n.inputs[1]), &ids, &mut o);
                    o
                }
                (Step::Linear(k, bias), _) => {
                    let mut o = buf(i, t_len * cols);
                    k.run(&self.pool, input(0), self.raw(n.inputs[1]), &mut o);
                    if let Some(add) = bias {
                        let b = self.vector(n.inputs[2]);
                        for row in o.chunks_mut(cols) {
                            add.run_in_place(row, b);
                        }
                    }
                    o
                }
                (Step::Logits(k), _) => {
                    let x = input(0);
                    let h = x.len() / t_len.max(1);
                    let sel: Vec<f32> = rows.iter().flat_map(|&r| x[r * h..(r + 1) * h].iter().copied()).collect();
                    if hidden {
                        return Ok(sel);
                    }
                    let mut o = buf(i, rows.len() * cols);
                    k.run(&self.pool, &sel, self.raw(n.inputs[1]), &mut o);
                    o
                }
                (Step::RmsNorm(k), _) => {
                    let mut o = buf(i, t_len * cols);
                    k.run(input(0), self.vector(n.inputs[1]), &mut o);
                    o
                }
                (Step::Rope(k, idx), _) => {
                    let mut o = buf(i, t_len * cols);
                    k.run(input(0), &tables[*idx], &mut o);
                    o
                }
                (Step::Moe(k), Op::Moe { bias, .. }) => {
                    let mut o = buf(i, t_len * cols);
                    let w = |j: usize| self.raw(n.inputs[j]);
                    let b = |j: usize| self.vector(n.inputs[j]);
                    let inp = MoeInputs {
                        x: input(0),
                        logits: input(1),
                        weights: [w(2), w(3), w(4)],
                        bias: bias.then(|| [b(5), b(6), b(7)]),
                    };
                    k.run(&self.pool, &inp, &mut o);
                    o
                }
                (Step::Attention(k), Op::Attention { heads, kv_heads, head_dim, layer, window, sinks, .. }) => {
                    let dims = (*heads, *kv_heads, *head_dim);
                    let (q_row, kv_row) = (heads * head_dim, kv_heads * head_dim);
                    let mut o = buf(i, 0);
                    for (c, &off) in batch.iter().zip(&offsets) {
                        for (i, &slot) in c.slots[c.start()..].iter().enumerate() {
                            let (src, dst) = ((off + i) * kv_row, slot as usize * kv_row);
                            kv.k[*layer][dst..dst + kv_row].copy_from_slice(&input(1)[src..src + kv_row]);
                            kv.v[*layer][dst..dst + kv_row].copy_from_slice(&input(2)[src..src + kv_row]);
                        }
                        let q = &input(0)[off * q_row..(off + c.tokens.len()) * q_row];
                        let sinks = sinks.then(|| self.vector(n.inputs[3]));
                        let kv = (&kv.k[*layer][..], &kv.v[*layer][..]);
                        o.extend(self.attention(k, q, kv, (c.slots, sinks), dims, *window));
                    }
                    o
                }
                (Step::Binary(k), _) => {
                    let a = input(0);
                    let b = if n.inputs.len() > 1 { input(1) } else { a };
                    let mut o = buf(i, a.len());
                    k.run(a, b, &mut o);
                    o
                }
                (Step::Map(k), _) => {
                    let ins: Vec<&[f32]> = n
                        .inputs
                        .iter()
                        .map(|&j| if self.weights[j].is_some() { self.vector(j) } else { vals[j].as_slice() })
                        .collect();
                    let rows = ins.iter().map(|x| x.len()).max().unwrap_or(0) / cols.max(1);
                    let mut o = buf(i, rows * cols);
                    k.run(&ins, &mut o);
                    o
                }
                (Step::None, Op::AllReduce) => {
                    let mut v = input(0).to_vec();
                    comm.all_reduce(&mut v);
                    v
                }
                (Step::None, Op::AllGather { .. }) => {
                    let mut v = input(0).to_vec();
                    comm.all_gather(&mut v, self.plan.nodes[n.inputs[0]].ty.last().unwrap_or(1));
                    v
                }
                (Step::None, _) => Vec::new(),
                (Step::Attention(_) | Step::Moe(_), _) => {
                    unreachable!("attention and moe steps are built from their ops")
                }
            };
            vals.push(out);
        }
        let out = vals.swap_remove(self.plan.output);
        *self.spare.lock().unwrap_or_else(|e| e.into_inner()) = vals;
        Ok(out)
    }

    /// Causal GQA attention of one sequence's queries over its slots of the pool (the last
    /// `window` of them where there is one), with each head's sink logit where there are
    /// sinks, heads split across cores.
    fn attention(
        &self,
        k: &AttentionKernel,
        q: &[f32],
        (kc, vc): (&[f32], &[f32]),
        (slots, sinks): (&[u32], Option<&[f32]>),
        (heads, kv_heads, d): (usize, usize, usize),
        window: Option<usize>,
    ) -> Vec<f32> {
        let t_len = q.len() / (heads * d);
        let start = slots.len() - t_len;
        let group = heads / kv_heads;
        let mut out = vec![0.0f32; q.len()];
        let out_ptr = out.as_mut_ptr() as usize;
        let jobs = t_len * heads;
        let parts = if jobs * slots.len() * d < 64 * 1024 { 1 } else { self.pool.threads().min(jobs) };
        self.pool.run(parts, &|part| {
            let mut scores = vec![0.0f32; slots.len()];
            for job in (part..jobs).step_by(parts) {
                let (t, h) = (job / heads, job % heads);
                let kvh = h / group;
                let qrow = &q[(t * heads + h) * d..(t * heads + h + 1) * d];
                // SAFETY: each job writes its own d floats of `out`; every slot was checked to
                // be inside the pool, whose rows hold kv_heads * d floats.
                unsafe {
                    let o = std::slice::from_raw_parts_mut((out_ptr as *mut f32).add((t * heads + h) * d), d);
                    let kv = (kc.as_ptr().add(kvh * d), vc.as_ptr().add(kvh * d));
                    let end = start + t + 1;
                    let first = window.map_or(0, |w| end.saturating_sub(w));
                    let sink = sinks.map_or(f32::NEG_INFINITY, |s| s[h]);
                    k.run(qrow, kv, (&slots[first..end], sink), &mut scores, o);
                }
            }
        });
        out
    }
}
