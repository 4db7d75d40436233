//! The non-GEMM kernels of a plan, each a Cranelift function specialised to the model's feature
//! sizes: elementwise add / mul / silu, rms_norm, rope, one attention row, embedding.
//! Semantics are those of `ir::Op` (the reference interpreter is their oracle).

use crate::{new_module, JitError, Opt};
use cranelift_codegen::ir::condcodes::IntCC;
use cranelift_codegen::ir::{types, AbiParam, FuncRef, InstBuilder, MemFlagsData, Signature, UserFuncName, Value};
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext};
use cranelift_jit::JITModule;
use cranelift_module::{Linkage, Module};
use ir::DType;

fn mf() -> MemFlagsData {
    MemFlagsData::trusted()
}

/// A compiled function and the module that owns its code.
pub(crate) struct Compiled {
    pub(crate) code: *const u8,
    _module: JITModule,
}

// SAFETY: the code is immutable after finalisation and touches only the pointers it is given.
unsafe impl Send for Compiled {}
// SAFETY: as above.
unsafe impl Sync for Compiled {}

/// What a kernel body can use besides the builder: its parameters and the exp function.
pub(crate) struct Env {
    pub(crate) params: Vec<Value>,
    pub(crate) expf: FuncRef,
}

/// Compiles one function with `ptrs` pointer parameters followed by `ints` i64 parameters,
/// optimised for speed.
pub(crate) fn compile(
    name: &str,
    ptrs: usize,
    ints: usize,
    body: impl FnOnce(&mut FunctionBuilder, &Env),
) -> Result<Compiled, JitError> {
    compile_opt(name, (ptrs, ints), Opt::Speed, body)
}

/// [`compile`] with the optimisation `opt`. `ENGINE_JIT_DISASM=TEXT` prints the machine code of
/// every kernel whose name contains TEXT to stderr.
pub(crate) fn compile_opt(
    name: &str,
    (ptrs, ints): (usize, usize),
    opt: Opt,
    body: impl FnOnce(&mut FunctionBuilder, &Env),
) -> Result<Compiled, JitError> {
    let err = |m: String| JitError::Compile { kernel: name.to_string(), message: m };
    let mut module = new_module(opt)?;
    let ptr = module.target_config().pointer_type();
    let mut ctx = module.make_context();
    ctx.func.signature.params.extend((0..ptrs).map(|_| AbiParam::new(ptr)));
    ctx.func.signature.params.extend((0..ints).map(|_| AbiParam::new(types::I64)));
    let id = module.declare_function(name, Linkage::Local, &ctx.func.signature).map_err(|e| err(e.to_string()))?;
    let mut exp_sig = Signature::new(module.target_config().default_call_conv);
    exp_sig.params.push(AbiParam::new(types::F32));
    exp_sig.returns.push(AbiParam::new(types::F32));
    let exp_id = module.declare_function("engine_expf", Linkage::Import, &exp_sig).map_err(|e| err(e.to_string()))?;
    ctx.func.name = UserFuncName::user(0, id.as_u32());
    let expf = module.declare_func_in_func(exp_id, &mut ctx.func);
    let target = module.target_config();
    let mut fctx = FunctionBuilderContext::new();
    {
        let mut b = FunctionBuilder::new(&mut ctx.func, &mut fctx);
        let entry = b.create_block();
        b.append_block_params_for_function_params(entry);
        b.switch_to_block(entry);
        let env = Env { params: b.block_params(entry).to_vec(), expf };
        body(&mut b, &env);
        b.ins().return_(&[]);
        b.seal_all_blocks();
        b.finalize(target);
    }
    let disasm = std::env::var("ENGINE_JIT_DISASM").is_ok_and(|k| name.contains(&k));
    ctx.set_disasm(disasm);
    module.define_function(id, &mut ctx).map_err(|e| err(format!("{e:?}")))?;
    if let Some(v) = ctx.compiled_code().and_then(|c| c.vcode.as_ref()).filter(|_| disasm) {
        eprintln!("{name}:\n{v}");
    }
    module.clear_context(&mut ctx);
    module.finalize_definitions().map_err(|e| err(e.to_string()))?;
    Ok(Compiled { code: module.get_finalized_function(id), _module: module })
}

/// Emits `for i in (start..end).step_by(step) { body(i) }` and continues after the loop.
pub(crate) fn counted(
    b: &mut FunctionBuilder,
    start: Value,
    end: Value,
    step: i64,
    mut body: impl FnMut(&mut FunctionBuilder, Value),
) {
    let var = b.declare_var(types::I64);
    b.def_var(var, start);
    let [head, blk, exit] = [(); 3].map(|_| b.create_block());
    b.ins().jump(head, &[]);
    b.switch_to_block(head);
    let i = b.use_var(var);
    let more = b.ins().icmp(IntCC::SignedLessThan, i, end);
    b.ins().brif(more, blk, &[], exit, &[]);
    b.switch_to_block(blk);
    let i = b.use_var(var);
    body(b, i);
    let next = b.ins().iadd_imm_s(i, step);
    b.def_var(var, next);
    b.ins().jump(head, &[]);
    b.switch_to_block(exit);
}

/// `base + index * scale` as a pointer.
pub(crate) fn at(b: &mut FunctionBuilder, base: Value, index: Value, scale: i64) -> Value {
    let off = b.ins().imul_imm_s(index, scale);
    b.ins().iadd(base, off)
}

/// Horizontal sum of an f32x4.
pub(crate) fn hsum(b: &mut FunctionBuilder, v: Value) -> Value {
    let mut s = b.ins().extractlane(v, 0);
    for lane in 1..4u8 {
        let l = b.ins().extractlane(v, lane);
        s = b.ins().fadd(s, l);
    }
    s
}

/// Dot product of `n` floats at `a` and `b` (n known), in one f32x4 accumulator plus a tail.
fn dot(b: &mut FunctionBuilder, pa: Value, pb: Value, n: usize) -> Value {
    let z = b.ins().f32const(0.0);
    let mut acc = b.ins().splat(types::F32X4, z);
    for i in (0..n / 4 * 4).step_by(4) {
        let x = b.ins().load(types::F32X4, mf(), pa, (i * 4) as i32);
        let y = b.ins().load(types::F32X4, mf(), pb, (i * 4) as i32);
        acc = b.ins().fma(x, y, acc);
    }
    let mut s = hsum(b, acc);
    for i in n / 4 * 4..n {
        let x = b.ins().load(types::F32, mf(), pa, (i * 4) as i32);
        let y = b.ins().load(types::F32, mf(), pb, (i * 4) as i32);
        s = b.ins().fma(x, y, s);
    }
    s
}

/// Elementwise operations over `len` floats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    /// `out = a + b`
    Add,
    /// `out = a * b`
    Mul,
    /// `out = a · sigmoid(a)` (b unused)
    Silu,
}

/// `fn(a, b, out, len)`.
pub struct BinaryKernel {
    c: Compiled,
}

impl BinaryKernel {
    /// Compiles the kernel for `op`.
    pub fn compile(op: BinaryOp) -> Result<BinaryKernel, JitError> {
        let c = compile(&format!("{op:?}").to_lowercase(), 3, 1, |b, env| {
            let (pa, pb, po, len) = (env.params[0], env.params[1], env.params[2], env.params[3]);
            let zero = b.ins().iconst(types::I64, 0);
            let vec_end = b.ins().band_imm_s(len, !3);
            if op != BinaryOp::Silu {
                counted(b, zero, vec_end, 4, |b, i| {
                    let (a, bb, o) = (at(b, pa, i, 4), at(b, pb, i, 4), at(b, po, i, 4));
                    let x = b.ins().load(types::F32X4, mf(), a, 0);
                    let y = b.ins().load(types::F32X4, mf(), bb, 0);
                    let r = if op == BinaryOp::Add { b.ins().fadd(x, y) } else { b.ins().fmul(x, y) };
                    b.ins().store(mf(), r, o, 0);
                });
            }
            let start = if op == BinaryOp::Silu { zero } else { vec_end };
            counted(b, start, len, 1, |b, i| {
                let (a, bb, o) = (at(b, pa, i, 4), at(b, pb, i, 4), at(b, po, i, 4));
                let x = b.ins().load(types::F32, mf(), a, 0);
                let r = match op {
                    BinaryOp::Silu => {
                        let nx = b.ins().fneg(x);
                        let call = b.ins().call(env.expf, &[nx]);
                        let e = b.inst_results(call)[0];
                        let one = b.ins().f32const(1.0);
                        let den = b.ins().fadd(one, e);
                        b.ins().fdiv(x, den)
                    }
                    BinaryOp::Add | BinaryOp::Mul => {
                        let y = b.ins().load(types::F32, mf(), bb, 0);
                        if op == BinaryOp::Add {
                            b.ins().fadd(x, y)
                        } else {
                            b.ins().fmul(x, y)
                        }
                    }
                };
                b.ins().store(mf(), r, o, 0);
            });
        })?;
        Ok(BinaryKernel { c })
    }

    /// Runs over `out.len()` floats (`b` is ignored for silu but must be as long).
    pub fn run(&self, a: &[f32], b: &[f32], out: &mut [f32]) {
        assert!(a.len() == out.len() && b.len() == out.len(), "operand lengths");
        // SAFETY: the signature matches `compile`; all three buffers hold `len` floats.
        unsafe {
            let f: unsafe extern "C" fn(*const f32, *const f32, *mut f32, i64) = std::mem::transmute(self.c.code);
            f(a.as_ptr(), b.as_ptr(), out.as_mut_ptr(), out.len() as i64)
        }
    }

    /// `a = a op b` in place (each element is read before it is written, so the output may
    /// alias the first operand).
    pub fn run_in_place(&self, a: &mut [f32], b: &[f32]) {
        assert_eq!(a.len(), b.len(), "operand lengths");
        // SAFETY: the signature matches `compile`; both buffers hold `len` floats, and the
        // kernel loads a[i..i+4] before storing out[i..i+4], so out may alias a.
        unsafe {
            let f: unsafe extern "C" fn(*const f32, *const f32, *mut f32, i64) = std::mem::transmute(self.c.code);
            let p = a.as_mut_ptr();
            f(p, b.as_ptr(), p, a.len() as i64)
        }
    }
}

/// `fn(x, w, out, rows)`: rms_norm over rows of `n` floats with f32 weights. A norm over groups
/// of `n` features (per head) runs it over the groups as rows.
pub struct RmsNormKernel {
    c: Compiled,
    n: usize,
}

impl RmsNormKernel {
    /// Compiles the kernel for rows of `n` and this `eps`.
    pub fn compile(n: usize, eps: f32) -> Result<RmsNormKernel, JitError> {
        let c = compile(&format!("rms_norm_{n}"), 3, 1, |b, env| {
            let (px, pw, po, rows) = (env.params[0], env.params[1], env.params[2], env.params[3]);
            let zero = b.ins().iconst(types::I64, 0);
            counted(b, zero, rows, 1, |b, t| {
                let x = at(b, px, t, (n * 4) as i64);
                let o = at(b, po, t, (n * 4) as i64);
                let ss = dot(b, x, x, n);
                let inv_n = b.ins().f32const(1.0 / n as f32);
                let ms = b.ins().fmul(ss, inv_n);
                let e = b.ins().f32const(eps);
                let var = b.ins().fadd(ms, e);
                let sd = b.ins().sqrt(var);
                let one = b.ins().f32const(1.0);
                let r = b.ins().fdiv(one, sd);
                let rv = b.ins().splat(types::F32X4, r);
                for i in (0..n / 4 * 4).step_by(4) {
                    let xv = b.ins().load(types::F32X4, mf(), x, (i * 4) as i32);
                    let wv = b.ins().load(types::F32X4, mf(), pw, (i * 4) as i32);
                    let y = b.ins().fmul(xv, rv);
                    let y = b.ins().fmul(y, wv);
                    b.ins().store(mf(), y, o, (i * 4) as i32);
                }
                for i in n / 4 * 4..n {
                    let xv = b.ins().load(types::F32, mf(), x, (i * 4) as i32);
                    let wv = b.ins().load(types::F32, mf(), pw, (i * 4) as i32);
                    let y = b.ins().fmul(xv, r);
                    let y = b.ins().fmul(y, wv);
                    b.ins().store(mf(), y, o, (i * 4) as i32);
                }
            });
        })?;
        Ok(RmsNormKernel { c, n })
    }

    /// Normalises every row of `x` into `out`.
    pub fn run(&self, x: &[f32], w: &[f32], out: &mut [f32]) {
        assert!(w.len() == self.n && x.len() == out.len() && x.len().is_multiple_of(self.n), "rms_norm sizes");
        // SAFETY: the signature matches `compile`; sizes were checked.
        unsafe {
            let f: unsafe extern "C" fn(*const f32, *const f32, *mut f32, i64) = std::mem::transmute(self.c.code);
            f(x.as_ptr(), w.as_ptr(), out.as_mut_ptr(), (x.len() / self.n) as i64)
        }
    }
}

/// `fn(x, cs, out, rows)`: rotate-half RoPE on rows of `cols` floats (heads of `head_dim`);
/// `cs` holds per row `head_dim / 2` cosines then as many sines (scaling already applied).
pub struct RopeKernel {
    c: Compiled,
    cols: usize,
    half: usize,
}

impl RopeKernel {
    /// Compiles the kernel for rows of `cols` and heads of `head_dim` whose leading `rot`
    /// features rotate (the rest are copied).
    pub fn compile(cols: usize, head_dim: usize, rot: usize) -> Result<RopeKernel, JitError> {
        let half = rot / 2;
        if !head_dim.is_multiple_of(2) || !cols.is_multiple_of(head_dim) || !rot.is_multiple_of(2) || rot > head_dim {
            return Err(JitError::Unsupported(format!(
                "rope: {cols} features are not whole heads of even size {head_dim} with {rot} rotated"
            )));
        }
        let c = compile(&format!("rope_{cols}_{head_dim}_{rot}"), 3, 1, |b, env| {
            let (px, pcs, po, rows) = (env.params[0], env.params[1], env.params[2], env.params[3]);
            let zero = b.ins().iconst(types::I64, 0);
            let heads = b.ins().iconst(types::I64, (cols / head_dim) as i64);
            counted(b, zero, rows, 1, |b, t| {
                let x = at(b, px, t, (cols * 4) as i64);
                let o = at(b, po, t, (cols * 4) as i64);
                let cs = at(b, pcs, t, (half * 8) as i64);
                counted(b, zero, heads, 1, |b, h| {
                    let xh = at(b, x, h, (head_dim * 4) as i64);
                    let oh = at(b, o, h, (head_dim * 4) as i64);
                    let (vec, ty) = if half.is_multiple_of(4) { (4, types::F32X4) } else { (1, types::F32) };
                    for i in (0..half).step_by(vec) {
                        let a = b.ins().load(ty, mf(), xh, (i * 4) as i32);
                        let bb = b.ins().load(ty, mf(), xh, ((i + half) * 4) as i32);
                        let c = b.ins().load(ty, mf(), cs, (i * 4) as i32);
                        let s = b.ins().load(ty, mf(), cs, ((i + half) * 4) as i32);
                        let ac = b.ins().fmul(a, c);
                        let bs = b.ins().fmul(bb, s);
                        let lo = b.ins().fsub(ac, bs);
                        let bc = b.ins().fmul(bb, c);
                        let as_ = b.ins().fmul(a, s);
                        let hi = b.ins().fadd(bc, as_);
                        b.ins().store(mf(), lo, oh, (i * 4) as i32);
                        b.ins().store(mf(), hi, oh, ((i + half) * 4) as i32);
                    }
                    for i in rot..head_dim {
                        let v = b.ins().load(types::F32, mf(), xh, (i * 4) as i32);
                        b.ins().store(mf(), v, oh, (i * 4) as i32);
                    }
                });
            });
        })?;
        Ok(RopeKernel { c, cols, half })
    }

    /// Rotates every row of `x` into `out` with the per-row tables `cs`.
    pub fn run(&self, x: &[f32], cs: &[f32], out: &mut [f32]) {
        let rows = x.len() / self.cols;
        assert!(x.len() == rows * self.cols && out.len() == x.len() && cs.len() == rows * 2 * self.half, "rope sizes");
        // SAFETY: the signature matches `compile`; sizes were checked.
        unsafe {
            let f: unsafe extern "C" fn(*const f32, *const f32, *mut f32, i64) = std::mem::transmute(self.c.code);
            f(x.as_ptr(), cs.as_ptr(), out.as_mut_ptr(), rows as i64)
        }
    }
}

/// `fn(q, k, v, out, scores, slots, sink, n)`: one query head against `n` cached positions:
/// scores `q · k[s] · scale` (soft-capped when asked: `ir::scalar::softcap`), softmax (f32,
/// max-subtracted) with the sink logit `*sink` in its sum (−∞: none), `out = Σ p[s] v[s]`.
/// `k` and `v` point at the KV head's slice of position 0; positions are `stride` floats apart.
pub struct AttentionKernel {
    c: Compiled,
    d: usize,
}

impl AttentionKernel {
    /// Compiles the kernel for heads of `d`, KV rows of `stride` floats, this scale and score
    /// soft-capping.
    pub fn compile(d: usize, stride: usize, scale: f32, softcap: Option<f32>) -> Result<AttentionKernel, JitError> {
        let cap = softcap.map(ir::scalar::softcap);
        let c = compile(&format!("attention_{d}_{stride}"), 7, 1, |b, env| {
            let (pq, pk, pv, po, psc, pslots, psink, n) = (
                env.params[0],
                env.params[1],
                env.params[2],
                env.params[3],
                env.params[4],
                env.params[5],
                env.params[6],
                env.params[7],
            );
            // The KV row of position s is slots[s] (a paged pool's token slot).
            let row = |b: &mut FunctionBuilder, base: Value, s: Value| {
                let sp = at(b, pslots, s, 4);
                let slot = b.ins().uload32(mf(), sp, 0);
                at(b, base, slot, (stride * 4) as i64)
            };
            let zero = b.ins().iconst(types::I64, 0);
            let mx = b.declare_var(types::F32);
            let sink = b.ins().load(types::F32, mf(), psink, 0);
            b.def_var(mx, sink);
            counted(b, zero, n, 1, |b, s| {
                let k = row(b, pk, s);
                let dt = dot(b, pq, k, d);
                let sc = b.ins().f32const(scale);
                let v = b.ins().fmul(dt, sc);
                let v = match &cap {
                    Some(e) => crate::map::render(b, e, &[v]),
                    None => v,
                };
                let p = at(b, psc, s, 4);
                b.ins().store(mf(), v, p, 0);
                let m = b.use_var(mx);
                let m2 = b.ins().fmax(m, v);
                b.def_var(mx, m2);
            });
            let sum = b.declare_var(types::F32);
            let fz = b.ins().f32const(0.0);
            let m = b.use_var(mx);
            let x = b.ins().fsub(sink, m);
            // exp(-inf - m) = 0 without a sink (m is finite: n > 0 scores).
            let call = b.ins().call(env.expf, &[x]);
            let e = b.inst_results(call)[0];
            b.def_var(sum, e);
            counted(b, zero, n, 1, |b, s| {
                let p = at(b, psc, s, 4);
                let v = b.ins().load(types::F32, mf(), p, 0);
                let m = b.use_var(mx);
                let x = b.ins().fsub(v, m);
                let call = b.ins().call(env.expf, &[x]);
                let e = b.inst_results(call)[0];
                b.ins().store(mf(), e, p, 0);
                let acc = b.use_var(sum);
                let acc2 = b.ins().fadd(acc, e);
                b.def_var(sum, acc2);
            });
            let chunks = d / 4;
            let accs: Vec<_> = (0..chunks.max(1)).map(|_| b.declare_var(types::F32X4)).collect();
            let tails: Vec<_> = (chunks * 4..d).map(|_| b.declare_var(types::F32)).collect();
            let vz = b.ins().splat(types::F32X4, fz);
            for &a in &accs {
                b.def_var(a, vz);
            }
            for &t in &tails {
                b.def_var(t, fz);
            }
            let total = b.use_var(sum);
            let one = b.ins().f32const(1.0);
            let inv = b.ins().fdiv(one, total);
            counted(b, zero, n, 1, |b, s| {
                let p = at(b, psc, s, 4);
                let e = b.ins().load(types::F32, mf(), p, 0);
                let w = b.ins().fmul(e, inv);
                let wv = b.ins().splat(types::F32X4, w);
                let v = row(b, pv, s);
                for (c, &a) in accs.iter().enumerate().take(chunks) {
                    let x = b.ins().load(types::F32X4, mf(), v, (c * 16) as i32);
                    let cur = b.use_var(a);
                    let r = b.ins().fma(wv, x, cur);
                    b.def_var(a, r);
                }
                for (i, &t) in tails.iter().enumerate() {
                    let x = b.ins().load(types::F32, mf(), v, ((chunks * 4 + i) * 4) as i32);
                    let cur = b.use_var(t);
                    let r = b.ins().fma(w, x, cur);
                    b.def_var(t, r);
                }
            });
            for (c, &a) in accs.iter().enumerate().take(chunks) {
                let v = b.use_var(a);
                b.ins().store(mf(), v, po, (c * 16) as i32);
            }
            for (i, &t) in tails.iter().enumerate() {
                let v = b.use_var(t);
                b.ins().store(mf(), v, po, ((chunks * 4 + i) * 4) as i32);
            }
        })?;
        Ok(AttentionKernel { c, d })
    }

    /// Attends one query head (`q`, `d` floats) over the positions whose KV rows are `slots`
    /// (row `slots[s]` of `k`/`v`, which start at the KV head of row 0), writing `d` floats to
    /// `out`; `scores` is scratch for `slots.len()` floats; `sink` is the head's sink logit
    /// (`f32::NEG_INFINITY` for none).
    ///
    /// # Safety
    /// `k` and `v` must hold `slot * stride + d` floats from their start for every slot.
    pub unsafe fn run(
        &self,
        q: &[f32],
        (k, v): (*const f32, *const f32),
        (slots, sink): (&[u32], f32),
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        let n = slots.len();
        assert!(q.len() >= self.d && out.len() >= self.d && scores.len() >= n && n > 0, "attention sizes");
        // SAFETY: the signature matches `compile`; the caller guarantees the KV extent.
        unsafe {
            type Kernel = unsafe extern "C" fn(
                *const f32,
                *const f32,
                *const f32,
                *mut f32,
                *mut f32,
                *const u32,
                *const f32,
                i64,
            );
            let f: Kernel = std::mem::transmute(self.c.code);
            f(q.as_ptr(), k, v, out.as_mut_ptr(), scores.as_mut_ptr(), slots.as_ptr(), &sink, n as i64)
        }
    }
}

/// `fn(table, ids, out, rows)`: rows of an f32 or bf16 table gathered into f32.
pub struct EmbeddingKernel {
    /// The gather of dense rows; `None` for a block type's table (rows dequantized in Rust).
    c: Option<Compiled>,
    h: usize,
    dtype: DType,
}

impl EmbeddingKernel {
    /// Compiles the gather for rows of `h` stored as `dtype` (a block type's rows in the CPU
    /// layout of [`crate::blocks`]).
    pub fn compile(h: usize, dtype: DType) -> Result<EmbeddingKernel, JitError> {
        if crate::blocks::reads(dtype) && h.is_multiple_of(ir::BLOCK) {
            return Ok(EmbeddingKernel { c: None, h, dtype });
        }
        if !matches!(dtype, DType::F32 | DType::BF16) {
            return Err(JitError::Unsupported(format!(
                "embedding: {dtype} tables of {h} columns are not supported by the CPU JIT"
            )));
        }
        let es = dtype.size();
        let c = compile(&format!("embedding_{h}_{dtype}"), 3, 1, |b, env| {
            let (ptab, pids, po, rows) = (env.params[0], env.params[1], env.params[2], env.params[3]);
            let zero = b.ins().iconst(types::I64, 0);
            counted(b, zero, rows, 1, |b, t| {
                let idp = at(b, pids, t, 4);
                let id = b.ins().sload32(mf(), idp, 0);
                let src = at(b, ptab, id, (h * es) as i64);
                let dst = at(b, po, t, (h * 4) as i64);
                for i in 0..h {
                    let v = if dtype == DType::BF16 {
                        let raw = b.ins().uload16(types::I32, mf(), src, (i * 2) as i32);
                        let sh = b.ins().ishl_imm_u(raw, 16);
                        b.ins().bitcast(types::F32, MemFlagsData::new(), sh)
                    } else {
                        b.ins().load(types::F32, mf(), src, (i * 4) as i32)
                    };
                    b.ins().store(mf(), v, dst, (i * 4) as i32);
                }
            });
        })?;
        Ok(EmbeddingKernel { c: Some(c), h, dtype })
    }

    /// Gathers rows `ids` of `table` (`vocab × h` values of the kernel's dtype) into `out`.
    /// Ids must be checked against the vocabulary by the caller.
    pub fn run(&self, table: &[u8], ids: &[i32], out: &mut [f32]) {
        let row = crate::blocks::row_bytes(self.h, self.dtype);
        let vocab = table.len() / row;
        assert!(
            out.len() == ids.len() * self.h && ids.iter().all(|&i| i >= 0 && (i as usize) < vocab),
            "embedding sizes"
        );
        let Some(c) = &self.c else {
            for (&id, o) in ids.iter().zip(out.chunks_exact_mut(self.h)) {
                let id = id as usize;
                crate::blocks::dequant_row(self.dtype, &table[id * row..(id + 1) * row], o);
            }
            return;
        };
        // SAFETY: the signature matches `compile`; ids are in range and sizes were checked.
        unsafe {
            let f: unsafe extern "C" fn(*const u8, *const i32, *mut f32, i64) = std::mem::transmute(c.code);
            f(table.as_ptr(), ids.as_ptr(), out.as_mut_ptr(), ids.len() as i64)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vals(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 9) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    fn close(a: &[f32], b: &[f32]) {
        let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        let err = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max) / scale;
        assert!(err < 1e-5, "rel err {err}");
    }

    #[test]
    fn elementwise() {
        for len in [1, 7, 64, 101] {
            let (a, b) = (vals(len, 1), vals(len, 2));
            let mut out = vec![0.0; len];
            BinaryKernel::compile(BinaryOp::Add).unwrap().run(&a, &b, &mut out);
            close(&out, &a.iter().zip(&b).map(|(x, y)| x + y).collect::<Vec<_>>());
            BinaryKernel::compile(BinaryOp::Mul).unwrap().run(&a, &b, &mut out);
            close(&out, &a.iter().zip(&b).map(|(x, y)| x * y).collect::<Vec<_>>());
            let mut in_place = a.clone();
            BinaryKernel::compile(BinaryOp::Add).unwrap().run_in_place(&mut in_place, &b);
            close(&in_place, &a.iter().zip(&b).map(|(x, y)| x + y).collect::<Vec<_>>());
            BinaryKernel::compile(BinaryOp::Silu).unwrap().run(&a, &b, &mut out);
            close(&out, &a.iter().map(|x| x / (1.0 + (-x).exp())).collect::<Vec<_>>());
        }
    }

    #[test]
    fn rms_norm_and_rope_and_embedding() {
        for n in [64, 66] {
            let (x, w) = (vals(3 * n, 3), vals(n, 4));
            let mut out = vec![0.0; 3 * n];
            RmsNormKernel::compile(n, 1e-6).unwrap().run(&x, &w, &mut out);
            let want: Vec<f32> = x
                .chunks(n)
                .flat_map(|r| {
                    let inv = 1.0 / (r.iter().map(|v| v * v).sum::<f32>() / n as f32 + 1e-6).sqrt();
                    r.iter().zip(&w).map(move |(v, g)| v * inv * g).collect::<Vec<_>>()
                })
                .collect();
            close(&out, &want);
        }
        // (head, rotated): whole heads, and the leading half of a head (Phi-3's partial rotary;
        // the rest of the head is copied: `want` starts as `x`).
        for (d, rot) in [(8, 8), (6, 6), (16, 8)] {
            let cols = 3 * d;
            let x = vals(2 * cols, 5);
            let cs = vals(2 * rot, 6);
            let mut out = vec![0.0; 2 * cols];
            RopeKernel::compile(cols, d, rot).unwrap().run(&x, &cs, &mut out);
            let half = rot / 2;
            let mut want = x.clone();
            for t in 0..2 {
                for h in 0..3 {
                    for i in 0..half {
                        let base = t * cols + h * d;
                        let (a, b) = (x[base + i], x[base + i + half]);
                        let (c, s) = (cs[t * rot + i], cs[t * rot + half + i]);
                        want[base + i] = a * c - b * s;
                        want[base + i + half] = b * c + a * s;
                    }
                }
            }
            close(&out, &want);
        }
        for dtype in [DType::F32, DType::BF16] {
            let table = vals(10 * 5, 7);
            let bytes = dtype.from_f32(&table);
            let mut out = vec![0.0; 2 * 5];
            EmbeddingKernel::compile(5, dtype).unwrap().run(&bytes, &[7, 2], &mut out);
            let t = dtype.to_f32(&bytes);
            assert_eq!(out, [&t[35..40], &t[10..15]].concat());
        }
    }

    #[test]
    fn attention_row() {
        let ninf = f32::NEG_INFINITY;
        for (d, stride, n, cap, sink) in [
            (16, 32, 5, None, ninf),
            (6, 12, 3, None, ninf),
            (64, 64, 40, None, ninf),
            (16, 32, 9, Some(0.05), ninf),
            (16, 32, 9, None, 0.3),
            (16, 32, 9, Some(0.05), 2.5),
        ] {
            let q = vals(d, 8);
            let (k, v) = (vals(n * stride, 9), vals(n * stride, 10));
            let scale = 1.0 / (d as f32).sqrt();
            let kern = AttentionKernel::compile(d, stride, scale, cap).unwrap();
            let mut scores = vec![0.0; n];
            let mut out = vec![0.0; d];
            // Positions in reverse row order, as a paged pool may hold them.
            let slots: Vec<u32> = (0..n as u32).rev().collect();
            // SAFETY: k and v hold n rows of `stride` floats.
            unsafe { kern.run(&q, (k.as_ptr(), v.as_ptr()), (&slots, sink), &mut scores, &mut out) };
            let s: Vec<f32> = (0..n)
                .map(|p| q.iter().zip(&k[(n - 1 - p) * stride..]).map(|(a, b)| a * b).sum::<f32>() * scale)
                .map(|x| cap.map_or(x, |c: f32| (x / c).tanh() * c))
                .collect();
            let m = s.iter().copied().fold(sink, f32::max);
            let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f32 = e.iter().sum::<f32>() + (sink - m).exp();
            let want: Vec<f32> = (0..d).map(|i| (0..n).map(|p| e[p] / z * v[(n - 1 - p) * stride + i]).sum()).collect();
            close(&out, &want);
        }
    }
}
