//! `out[t, j] = Σₖ x[t, k] · w[j, k]`: the linear kernel, specialised to `k` (input features),
//! `n` (output features) and the weight dtype, and split across threads by output rows.

use crate::{new_module, JitError, Pool};
use cranelift_codegen::ir::condcodes::IntCC;
use cranelift_codegen::ir::{types, AbiParam, InstBuilder, MemFlagsData, UserFuncName, Value};
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext, Variable};
use cranelift_jit::JITModule;
use cranelift_module::{Linkage, Module};
use ir::DType;

/// `fn(x, w, out, rows, j0, j1)`: rows `0..rows` of x, output features `j0..j1`.
type LinearFn = unsafe extern "C" fn(*const f32, *const u8, *mut f32, i64, i64, i64);

/// Floats consumed per iteration of the inner loop: four `f32x4` accumulators.
const STEP: usize = 16;

/// A compiled linear kernel.
pub struct LinearKernel {
    f: LinearFn,
    k: usize,
    n: usize,
    wdtype: DType,
    // Owns the code `f` points into.
    _module: JITModule,
}

// SAFETY: the compiled function is pure code over the pointers it is given; the module that
// owns it is never mutated after finalisation.
unsafe impl Send for LinearKernel {}
// SAFETY: as above; calls share no state.
unsafe impl Sync for LinearKernel {}

fn flags() -> MemFlagsData {
    MemFlagsData::trusted()
}

/// Loads 8 weights at `p + off` (in elements) as two `f32x4`.
fn load_w8(b: &mut FunctionBuilder, wdtype: DType, p: Value, off: usize) -> [Value; 2] {
    match wdtype {
        DType::BF16 => {
            let v = b.ins().load(types::I16X8, flags(), p, (off * 2) as i32);
            let lo = b.ins().uwiden_low(v);
            let hi = b.ins().uwiden_high(v);
            [lo, hi].map(|h| {
                let s = b.ins().ishl_imm_u(h, 16);
                b.ins().bitcast(
                    types::F32X4,
                    MemFlagsData::new().with_endianness(cranelift_codegen::ir::Endianness::Little),
                    s,
                )
            })
        }
        _ => [0, 4].map(|d| b.ins().load(types::F32X4, flags(), p, ((off + d) * 4) as i32)),
    }
}

/// Loads one weight at `p + off` (in elements) as f32.
fn load_w1(b: &mut FunctionBuilder, wdtype: DType, p: Value, off: usize) -> Value {
    match wdtype {
        DType::BF16 => {
            let h = b.ins().uload16(types::I32, flags(), p, (off * 2) as i32);
            let s = b.ins().ishl_imm_u(h, 16);
            b.ins().bitcast(types::F32, MemFlagsData::new(), s)
        }
        _ => b.ins().load(types::F32, flags(), p, (off * 4) as i32),
    }
}

fn build(b: &mut FunctionBuilder, k: usize, n: usize, wdtype: DType) {
    let es = wdtype.size() as i64;
    let entry = b.create_block();
    b.append_block_params_for_function_params(entry);
    // Loop order: output feature j outer, batch row t inner, so that each weight row is read
    // from memory once and reused from L1 for every row of the batch.
    let [j_head, t_init, t_head, row, k_body, k_done, j_next, exit] = [(); 8].map(|_| b.create_block());
    b.switch_to_block(entry);
    let p = b.block_params(entry).to_vec();
    let (x, w, out, rows, j0, j1) = (p[0], p[1], p[2], p[3], p[4], p[5]);
    let t = b.declare_var(types::I64);
    let j = b.declare_var(types::I64);
    let kk = b.declare_var(types::I64);
    let acc: [Variable; 4] = [(); 4].map(|_| b.declare_var(types::F32X4));
    let zero = b.ins().iconst(types::I64, 0);
    b.def_var(j, j0);
    b.ins().jump(j_head, &[]);

    b.switch_to_block(j_head);
    let jv = b.use_var(j);
    let more_j = b.ins().icmp(IntCC::SignedLessThan, jv, j1);
    b.ins().brif(more_j, t_init, &[], exit, &[]);

    b.switch_to_block(t_init);
    b.def_var(t, zero);
    b.ins().jump(t_head, &[]);

    b.switch_to_block(t_head);
    let tv = b.use_var(t);
    let more_t = b.ins().icmp(IntCC::SignedLessThan, tv, rows);
    b.ins().brif(more_t, row, &[], j_next, &[]);

    // Row set-up: base pointers, zeroed accumulators.
    b.switch_to_block(row);
    let tv = b.use_var(t);
    let jv = b.use_var(j);
    let xoff = b.ins().imul_imm_s(tv, (k * 4) as i64);
    let xrow = b.ins().iadd(x, xoff);
    let woff = b.ins().imul_imm_s(jv, k as i64 * es);
    let wrow = b.ins().iadd(w, woff);
    let fz = b.ins().f32const(0.0);
    let vz = b.ins().splat(types::F32X4, fz);
    for a in acc {
        b.def_var(a, vz);
    }
    b.def_var(kk, zero);
    let main = k / STEP * STEP;
    if main > 0 {
        b.ins().jump(k_body, &[]);
    } else {
        b.ins().jump(k_done, &[]);
    }

    // Inner loop: 16 floats of x against 16 weights, four independent FMA chains.
    b.switch_to_block(k_body);
    let kv = b.use_var(kk);
    let xo = b.ins().imul_imm_s(kv, 4);
    let xp = b.ins().iadd(xrow, xo);
    let wo = b.ins().imul_imm_s(kv, es);
    let wp = b.ins().iadd(wrow, wo);
    for half in 0..2 {
        let wv = load_w8(b, wdtype, wp, half * 8);
        for (q, w4) in wv.into_iter().enumerate() {
            let u = half * 2 + q;
            let xv = b.ins().load(types::F32X4, flags(), xp, (u * 16) as i32);
            let a = b.use_var(acc[u]);
            let r = b.ins().fma(xv, w4, a);
            b.def_var(acc[u], r);
        }
    }
    let next = b.ins().iadd_imm_s(kv, STEP as i64);
    b.def_var(kk, next);
    let more_k = b.ins().icmp_imm_s(IntCC::SignedLessThan, next, main as i64);
    b.ins().brif(more_k, k_body, &[], k_done, &[]);

    // Reduce the accumulators, add the tail (k % 16, unrolled at compile time), store.
    b.switch_to_block(k_done);
    let a: Vec<Value> = acc.iter().map(|&v| b.use_var(v)).collect();
    let s01 = b.ins().fadd(a[0], a[1]);
    let s23 = b.ins().fadd(a[2], a[3]);
    let s = b.ins().fadd(s01, s23);
    let mut sum = b.ins().extractlane(s, 0);
    for lane in 1..4u8 {
        let l = b.ins().extractlane(s, lane);
        sum = b.ins().fadd(sum, l);
    }
    for i in main..k {
        let xs = b.ins().load(types::F32, flags(), xrow, (i * 4) as i32);
        let ws = load_w1(b, wdtype, wrow, i);
        sum = b.ins().fma(xs, ws, sum);
    }
    let tv = b.use_var(t);
    let jv = b.use_var(j);
    let orow = b.ins().imul_imm_s(tv, n as i64);
    let oidx = b.ins().iadd(orow, jv);
    let ooff = b.ins().imul_imm_s(oidx, 4);
    let op = b.ins().iadd(out, ooff);
    b.ins().store(flags(), sum, op, 0);
    let tn = b.ins().iadd_imm_s(tv, 1);
    b.def_var(t, tn);
    b.ins().jump(t_head, &[]);

    b.switch_to_block(j_next);
    let jv = b.use_var(j);
    let jn = b.ins().iadd_imm_s(jv, 1);
    b.def_var(j, jn);
    b.ins().jump(j_head, &[]);

    b.switch_to_block(exit);
    b.ins().return_(&[]);
    b.seal_all_blocks();
}

impl LinearKernel {
    /// Compiles the kernel for `k` input features, `n` output features and weights stored as
    /// `wdtype` (f32 or bf16).
    pub fn compile(k: usize, n: usize, wdtype: DType) -> Result<LinearKernel, JitError> {
        if !matches!(wdtype, DType::F32 | DType::BF16) {
            return Err(JitError::Unsupported(format!(
                "linear: {wdtype} weights are not supported by the CPU JIT (f32, bf16 are)"
            )));
        }
        let name = format!("linear_k{k}_n{n}_{wdtype}");
        let err = |m: &dyn std::fmt::Display| JitError::Compile { kernel: name.clone(), message: m.to_string() };
        let mut module = new_module()?;
        let ptr = module.target_config().pointer_type();
        let mut ctx = module.make_context();
        for _ in 0..3 {
            ctx.func.signature.params.push(AbiParam::new(ptr));
        }
        for _ in 0..3 {
            ctx.func.signature.params.push(AbiParam::new(types::I64));
        }
        let id = module.declare_function(&name, Linkage::Local, &ctx.func.signature).map_err(|e| err(&e))?;
        ctx.func.name = UserFuncName::user(0, id.as_u32());
        let target = module.target_config();
        let mut fctx = FunctionBuilderContext::new();
        {
            let mut b = FunctionBuilder::new(&mut ctx.func, &mut fctx);
            build(&mut b, k, n, wdtype);
            b.finalize(target);
        }
        module.define_function(id, &mut ctx).map_err(|e| err(&format!("{e:?}")))?;
        module.clear_context(&mut ctx);
        module.finalize_definitions().map_err(|e| err(&e))?;
        let code = module.get_finalized_function(id);
        // SAFETY: the function was declared with exactly this signature above.
        let f = unsafe { std::mem::transmute::<*const u8, LinearFn>(code) };
        Ok(LinearKernel { f, k, n, wdtype, _module: module })
    }

    /// `out[t, j] = x[t] · w[j]` for every row of `x` (`rows × k` floats) and every `j` in
    /// `0..n`, split across the pool's threads by output features. `w` holds `n × k` weights
    /// of the kernel's dtype (little-endian bytes).
    pub fn run(&self, pool: &Pool, x: &[f32], w: &[u8], out: &mut [f32]) {
        let rows = x.len() / self.k;
        assert_eq!(x.len(), rows * self.k, "x is not whole rows of {}", self.k);
        assert_eq!(w.len(), self.n * self.k * self.wdtype.size(), "weight size");
        assert_eq!(out.len(), rows * self.n, "output size");
        // Small problems are not worth waking workers for.
        let parts = if self.n * self.k * rows < 32 * 1024 { 1 } else { pool.threads().min(self.n) };
        let chunk = self.n.div_ceil(parts);
        let out_ptr = out.as_mut_ptr() as usize;
        pool.run(parts, &|i| {
            let (j0, j1) = (i * chunk, ((i + 1) * chunk).min(self.n));
            if j0 < j1 {
                // SAFETY: sizes were checked above; parts write disjoint columns j0..j1 of out.
                unsafe { (self.f)(x.as_ptr(), w.as_ptr(), out_ptr as *mut f32, rows as i64, j0 as i64, j1 as i64) }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(x: &[f32], w: &[f32], k: usize) -> Vec<f32> {
        x.chunks(k)
            .flat_map(|r| {
                w.chunks(k)
                    .map(|c| r.iter().zip(c).map(|(a, b)| (*a as f64) * (*b as f64)).sum::<f64>() as f32)
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    fn values(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    #[test]
    fn matches_scalar_reference_for_odd_shapes_and_dtypes() {
        for &(k, n, rows) in &[(64, 192, 1), (576, 37, 3), (13, 5, 2), (16, 1, 4), (100, 64, 5), (576, 1000, 8)] {
            for dtype in [DType::F32, DType::BF16] {
                let x = values(rows * k, 1);
                let wf: Vec<f32> = dtype.to_f32(&dtype.from_f32(&values(n * k, 7)));
                let kernel = LinearKernel::compile(k, n, dtype).unwrap();
                for threads in [1, 2, 3] {
                    let pool = Pool::new(threads);
                    let mut out = vec![f32::NAN; rows * n];
                    kernel.run(&pool, &x, &dtype.from_f32(&wf), &mut out);
                    let want = reference(&x, &wf, k);
                    let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
                    let err = out.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max) / scale;
                    assert!(err < 1e-5, "k={k} n={n} rows={rows} {dtype} threads={threads}: rel err {err}");
                }
            }
        }
    }

    #[test]
    fn rejects_f16_weights() {
        assert!(LinearKernel::compile(16, 16, DType::F16).is_err());
    }
}
