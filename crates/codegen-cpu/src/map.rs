//! The elementwise map kernel (`ir::Op::Map`): its expression rendered as Cranelift code, one
//! element at a time. Functions with a native instruction (`ir::scalar::Native`) become that
//! instruction; the others call their `eval`, the very function the reference interpreter
//! runs, so the two agree bit for bit.

use crate::kernels::{at, compile, counted, Compiled};
use crate::JitError;
use cranelift_codegen::ir::{types, AbiParam, InstBuilder, MemFlagsData, Signature, Value};
use cranelift_frontend::FunctionBuilder;
use ir::scalar::{Native, Scalar};

/// `fn(ins, out, rows)`: `out[r, c] = expr(x0[r, c], x1[r, c] or x1[c], ...)` over `rows` rows
/// of `cols`, `ins` pointing at the inputs' data pointers.
pub struct MapKernel {
    c: Compiled,
    cols: usize,
    bcast: Vec<bool>,
}

impl MapKernel {
    /// Compiles `expr` for rows of `cols`; `bcast[j]`: input `j` is one row applied to every row.
    pub fn compile(expr: &Scalar, cols: usize, bcast: &[bool]) -> Result<MapKernel, JitError> {
        expr.check().map_err(JitError::Unsupported)?;
        if expr.arity() > bcast.len() {
            return Err(JitError::Unsupported(format!(
                "`{expr}` reads {} inputs, {} given",
                expr.arity(),
                bcast.len()
            )));
        }
        let flags = bcast.to_vec();
        let c = compile("map", 2, 1, |b, env| {
            let (pins, pout, rows) = (env.params[0], env.params[1], env.params[2]);
            let mf = MemFlagsData::trusted();
            let ptrs: Vec<Value> =
                (0..flags.len()).map(|j| b.ins().load(types::I64, mf, pins, (j * 8) as i32)).collect();
            let zero = b.ins().iconst(types::I64, 0);
            let n_cols = b.ins().iconst(types::I64, cols as i64);
            counted(b, zero, rows, 1, |b, r| {
                counted(b, zero, n_cols, 1, |b, c| {
                    let row_start = b.ins().imul_imm_s(r, cols as i64);
                    let i = b.ins().iadd(row_start, c);
                    let x: Vec<Value> = ptrs
                        .iter()
                        .zip(&flags)
                        .map(|(&p, &vector)| {
                            let a = at(b, p, if vector { c } else { i }, 4);
                            b.ins().load(types::F32, mf, a, 0)
                        })
                        .collect();
                    let v = render(b, expr, &x);
                    let o = at(b, pout, i, 4);
                    b.ins().store(mf, v, o, 0);
                });
            });
        })?;
        Ok(MapKernel { c, cols, bcast: bcast.to_vec() })
    }

    /// Runs over every row of `out`; each input holds as many floats as `out` (or `cols`
    /// where it broadcasts).
    pub fn run(&self, ins: &[&[f32]], out: &mut [f32]) {
        assert_eq!(ins.len(), self.bcast.len(), "map inputs");
        assert_eq!(out.len() % self.cols.max(1), 0, "whole rows");
        for (x, &vector) in ins.iter().zip(&self.bcast) {
            assert_eq!(x.len(), if vector { self.cols } else { out.len() }, "map input length");
        }
        let ptrs: Vec<*const f32> = ins.iter().map(|x| x.as_ptr()).collect();
        // SAFETY: the signature matches `compile`; every input holds the floats checked above.
        unsafe {
            let f: unsafe extern "C" fn(*const *const f32, *mut f32, i64) = std::mem::transmute(self.c.code);
            f(ptrs.as_ptr(), out.as_mut_ptr(), (out.len() / self.cols.max(1)) as i64)
        }
    }
}

/// The expression's value from the inputs' values `x`.
pub(crate) fn render(b: &mut FunctionBuilder, e: &Scalar, x: &[Value]) -> Value {
    match e {
        Scalar::Arg(i) => x[*i],
        Scalar::Const(c) => b.ins().f32const(*c),
        Scalar::Call(f, args) => {
            let a: Vec<Value> = args.iter().map(|a| render(b, a, x)).collect();
            let def = f.def();
            match def.native {
                Some(Native::Add) => b.ins().fadd(a[0], a[1]),
                Some(Native::Sub) => b.ins().fsub(a[0], a[1]),
                Some(Native::Mul) => b.ins().fmul(a[0], a[1]),
                Some(Native::Div) => b.ins().fdiv(a[0], a[1]),
                Some(Native::Neg) => b.ins().fneg(a[0]),
                Some(Native::Sqrt) => b.ins().sqrt(a[0]),
                Some(Native::Min) => b.ins().fmin(a[0], a[1]),
                Some(Native::Max) => b.ins().fmax(a[0], a[1]),
                None => {
                    let mut sig = Signature::new(b.func.signature.call_conv);
                    sig.params.extend([AbiParam::new(types::F32); 3]);
                    sig.returns.push(AbiParam::new(types::F32));
                    let sig = b.import_signature(sig);
                    let callee = b.ins().iconst(types::I64, def.eval as usize as i64);
                    let zero = b.ins().f32const(0.0);
                    let args: Vec<Value> = (0..3).map(|j| a.get(j).copied().unwrap_or(zero)).collect();
                    let call = b.ins().call_indirect(sig, callee, &args);
                    b.inst_results(call)[0]
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir::Fun;

    fn call(name: &str, args: Vec<Scalar>) -> Scalar {
        Scalar::Call(Fun::named(name).unwrap(), args)
    }

    /// Every function of `ir::scalar::FUNCTIONS`, natively or by call, gives the interpreter's
    /// value bit for bit; a `[cols]` input applies to every row.
    #[test]
    fn every_function_matches_its_eval() {
        let xs: Vec<f32> = (0..24).map(|i| (i as f32 - 11.5) * 0.37).collect();
        let ys: Vec<f32> = (0..24).map(|i| 0.5 + (i as f32 * 0.7).sin()).collect();
        let w: Vec<f32> = (0..6).map(|i| 1.0 + i as f32 * 0.1).collect();
        for f in ir::scalar::FUNCTIONS {
            let args: Vec<Scalar> =
                (0..f.arity).map(|j| if j < 2 { Scalar::Arg(j) } else { Scalar::Const(2.0) }).collect();
            let expr = call(f.name, args);
            let k = MapKernel::compile(&expr, 6, &[false, false]).unwrap();
            let mut out = vec![0.0; 24];
            k.run(&[&xs, &ys], &mut out);
            for i in 0..24 {
                let want = expr.eval(&[xs[i], ys[i]]);
                assert_eq!(out[i].to_bits(), want.to_bits(), "{} at {}: {} vs {want}", f.name, xs[i], out[i]);
            }
        }
        // x0 * (1 + x1) with x1 a [6] vector
        let expr = call("*", vec![Scalar::Arg(0), call("+", vec![Scalar::Const(1.0), Scalar::Arg(1)])]);
        let k = MapKernel::compile(&expr, 6, &[false, true]).unwrap();
        let mut out = vec![0.0; 24];
        k.run(&[&xs, &w], &mut out);
        for i in 0..24 {
            assert_eq!(out[i], xs[i] * (1.0 + w[i % 6]), "element {i}");
        }
    }
}
