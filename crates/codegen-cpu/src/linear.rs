//! `out[t, j] = Σₖ x[t, k] · w[j, k]`: the linear kernel, specialised to `k` (input features),
//! `n` (output features) and the weight dtype, and split across threads by output rows.

use crate::blocks::{self, Dequant};
use crate::kernels::{at, compile_opt, counted, hsum, Compiled};
use crate::{JitError, Opt, Pool};
use cranelift_codegen::ir::{types, InstBuilder, MemFlagsData, Value};
use cranelift_frontend::{FunctionBuilder, Variable};
use ir::{DType, BLOCK};

/// `fn(x, w, out, rows, j0, j1)`: rows `0..rows` of x, output features `j0..j1`.
type LinearFn = unsafe extern "C" fn(*const f32, *const u8, *mut f32, i64, i64, i64);

/// `fn(w, out, j0, j1)`: weight rows `j0..j1` of a block type as f32 rows at `out`.
type ExpandFn = unsafe extern "C" fn(*const u8, *mut f32, i64, i64);

/// Rows of x per kernel call: 16 rows of a 4096-wide layer are 256 KiB of f32.
const ROW_BLOCK: usize = 16;

/// A compiled linear kernel.
pub struct LinearKernel {
    f: LinearFn,
    k: usize,
    n: usize,
    wdtype: DType,
    // Owns the code `f` points into.
    _code: Compiled,
    /// For a block type: its rows dequantized and the f32 kernel, for calls of 4 rows or more.
    expand: Option<Expand>,
    /// For a block type the CPU reads with AVX2 (`crate::avx2`): calls of fewer rows, in pairs
    /// of features.
    #[cfg(target_arch = "x86_64")]
    avx2: Option<crate::avx2::Kind>,
    /// Dense (f32, bf16) weights read in AVX2 tiles (`crate::avx2::dense`), bit for bit `f`.
    #[cfg(target_arch = "x86_64")]
    dense_avx2: bool,
}

/// A block type's weight rows dequantized to f32 (exactly: `ir::quant::value`) and the f32
/// kernel over them: the same sums as the block kernel (batch-invariance holds across the two),
/// the f32 kernel optimised for speed (the block kernel cannot be: [`LinearKernel::compile`]).
struct Expand {
    f: ExpandFn,
    dense: Box<LinearKernel>,
    _code: Compiled,
}

/// Calls with at least this many rows run on the weights dequantized: a row's block kernel
/// costs about what dequantizing them costs.
const EXPAND_ROWS: usize = 4;

fn flags() -> MemFlagsData {
    MemFlagsData::trusted()
}

/// Loads of x and of the weights: nothing the kernel writes, so Cranelift may place each
/// next to its use (a load in the function's side-effect order would be issued at the top of
/// the loop body, its value kept, or spilled, until the arithmetic that uses it).
fn read() -> MemFlagsData {
    MemFlagsData::trusted().with_readonly().with_can_move()
}

/// Loads 8 weights at `p + off` (in elements) as two `f32x4`.
fn load_w8(b: &mut FunctionBuilder, wdtype: DType, p: Value, off: usize) -> [Value; 2] {
    match wdtype {
        DType::BF16 => {
            let v = b.ins().load(types::I16X8, read(), p, (off * 2) as i32);
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
        _ => [0, 4].map(|d| b.ins().load(types::F32X4, read(), p, ((off + d) * 4) as i32)),
    }
}

/// Loads one weight at `p + off` (in elements) as f32.
fn load_w1(b: &mut FunctionBuilder, wdtype: DType, p: Value, off: usize) -> Value {
    match wdtype {
        DType::BF16 => {
            let h = b.ins().uload16(types::I32, read(), p, (off * 2) as i32);
            let s = b.ins().ishl_imm_u(h, 16);
            b.ins().bitcast(types::F32, MemFlagsData::new(), s)
        }
        _ => b.ins().load(types::F32, read(), p, (off * 4) as i32),
    }
}

/// Emits the kernel: output features in groups of four (each weight row is read once per
/// call), the batch rows in blocks of 4 (4 rows x 2 features: one weight load feeds four FMAs,
/// one x load two), then the remaining rows one by one (1 row x 4 features).
///
/// Every path computes each `out[t, j]` in the same order (one f32x4 accumulator over k, a
/// horizontal sum, then the k tail), so a row's result does not depend on which other rows
/// share the call: the kernel is batch-invariant, and a sequence gives the same logits alone
/// as in any batch.
fn build(b: &mut FunctionBuilder, p: &[Value], k: usize, n: usize, wdtype: DType) {
    let (x, w, out, rows, j0, j1) = (p[0], p[1], p[2], p[3], p[4], p[5]);
    let zero = b.ins().iconst(types::I64, 0);
    let deq = wdtype.is_block().then(|| Dequant::new(b, wdtype));
    // Block weights take rows one by one (four rows and more run on them dequantized).
    let rows4 = if deq.is_some() { zero } else { b.ins().band_imm_s(rows, !3) };
    let d = Dims { k, n, wdtype, row_bytes: blocks::row_bytes(k, wdtype), deq };
    let span = b.ins().isub(j1, j0);
    let quads = b.ins().band_imm_s(span, !3);
    let quads_end = b.ins().iadd(j0, quads);
    counted(b, j0, quads_end, 4, |b, j| {
        counted(b, zero, rows4, 4, |b, t| {
            emit_block(b, &d, (4, 2), t, j, [x, w, out]);
            let j2 = b.ins().iadd_imm_s(j, 2);
            emit_block(b, &d, (4, 2), t, j2, [x, w, out]);
        });
        counted(b, rows4, rows, 1, |b, t| emit_block(b, &d, (1, 4), t, j, [x, w, out]));
    });
    counted(b, quads_end, j1, 1, |b, j| {
        counted(b, zero, rows4, 4, |b, t| emit_block(b, &d, (4, 1), t, j, [x, w, out]));
        counted(b, rows4, rows, 1, |b, t| emit_block(b, &d, (1, 1), t, j, [x, w, out]));
    });
}

/// The body of an [`ExpandFn`]: weight rows `j0..j1` of a block type as f32 (row-major) at `out`.
fn build_expand(b: &mut FunctionBuilder, p: &[Value], k: usize, wdtype: DType) {
    let (w, out, j0, j1) = (p[0], p[1], p[2], p[3]);
    let deq = Dequant::new(b, wdtype);
    let row_bytes = blocks::row_bytes(k, wdtype);
    let (zero, nblk) = (b.ins().iconst(types::I64, 0), b.ins().iconst(types::I64, (k / BLOCK) as i64));
    counted(b, j0, j1, 1, |b, j| {
        let wrow = at(b, w, j, row_bytes as i64);
        let rel = b.ins().isub(j, j0);
        let orow = at(b, out, rel, (k * 4) as i64);
        counted(b, zero, nblk, 1, |b, blk| {
            let bp = at(b, wrow, blk, blocks::layout_bytes(wdtype) as i64);
            let op = at(b, orow, blk, (BLOCK * 4) as i64);
            let open = deq.open(b, bp);
            for g in 0..BLOCK / 4 {
                let wv = deq.group(b, &open, g);
                b.ins().store(flags(), wv, op, (g * 16) as i32);
            }
        });
    });
}

/// Loads 4 weights at `p + off` (in elements) as one `f32x4`.
fn load_w4(b: &mut FunctionBuilder, wdtype: DType, p: Value, off: usize) -> Value {
    match wdtype {
        DType::BF16 => {
            let h = b.ins().uload16x4(read(), p, (off * 2) as i32);
            let s = b.ins().ishl_imm_u(h, 16);
            b.ins().bitcast(
                types::F32X4,
                MemFlagsData::new().with_endianness(cranelift_codegen::ir::Endianness::Little),
                s,
            )
        }
        _ => b.ins().load(types::F32X4, read(), p, (off * 4) as i32),
    }
}

struct Dims {
    k: usize,
    n: usize,
    wdtype: DType,
    /// Bytes of one weight row (a block type's in the CPU layout, `crate::blocks`).
    row_bytes: usize,
    /// A block type's dequantization.
    deq: Option<Dequant>,
}

/// `out[t + r, j + f]` for `r < rows`, `f < feats`, from the sums of [`dense_sums`] or
/// [`block_sums`] (indexed `r * feats + f`).
fn emit_block(b: &mut FunctionBuilder, d: &Dims, (rows, feats): (usize, usize), t: Value, j: Value, p: [Value; 3]) {
    let [x, w, out] = p;
    let wrow = at(b, w, j, d.row_bytes as i64);
    let xt = at(b, x, t, (d.k * 4) as i64);
    let sums = match &d.deq {
        Some(deq) => block_sums(b, d, deq, (rows, feats), wrow, xt),
        None => dense_sums(b, d, (rows, feats), wrow, xt),
    };
    for r in 0..rows {
        for f in 0..feats {
            let tr = b.ins().iadd_imm_s(t, r as i64);
            let orow = b.ins().imul_imm_s(tr, d.n as i64);
            let jf = b.ins().iadd_imm_s(j, f as i64);
            let oidx = b.ins().iadd(orow, jf);
            let op = at(b, out, oidx, 4);
            b.ins().store(flags(), sums[r * feats + f], op, 0);
        }
    }
}

/// Zeroed f32x4 accumulators.
fn zeros(b: &mut FunctionBuilder, n: usize) -> Vec<Variable> {
    let fz = b.ins().f32const(0.0);
    let vz = b.ins().splat(types::F32X4, fz);
    (0..n)
        .map(|_| {
            let a = b.declare_var(types::F32X4);
            b.def_var(a, vz);
            a
        })
        .collect()
}

/// `acc = fma(x, w, acc)`.
fn fma_into(b: &mut FunctionBuilder, acc: Variable, x: Value, w: Value) {
    let a = b.use_var(acc);
    let v = b.ins().fma(x, w, a);
    b.def_var(acc, v);
}

/// Dense weights: one f32x4 accumulator per (row, feature) stepping 4 along k, then a
/// horizontal sum and the k tail (unrolled at compile time).
fn dense_sums(b: &mut FunctionBuilder, d: &Dims, (rows, feats): (usize, usize), wrow: Value, xt: Value) -> Vec<Value> {
    let main = d.k / 4 * 4;
    let acc = zeros(b, rows * feats);
    // k in steps of 8 (bf16 weights widened 8 at a time), two FMAs into the same accumulator
    // per step, then one step of 4 if k % 8 >= 4: the same order as stepping by 4 throughout.
    let main8 = d.k / 8 * 8;
    let fma_step = |b: &mut FunctionBuilder, wv: &[Value], xp: Value, half: usize| {
        for r in 0..rows {
            let xv = b.ins().load(types::F32X4, read(), xp, ((r * d.k + half * 4) * 4) as i32);
            for f in 0..feats {
                fma_into(b, acc[r * feats + f], xv, wv[f]);
            }
        }
    };
    if main8 > 0 {
        let (zero, end) = (b.ins().iconst(types::I64, 0), b.ins().iconst(types::I64, main8 as i64));
        counted(b, zero, end, 8, |b, kk| {
            let wp = at(b, wrow, kk, d.wdtype.size() as i64);
            let xp = at(b, xt, kk, 4);
            let w8: Vec<[Value; 2]> = (0..feats).map(|f| load_w8(b, d.wdtype, wp, f * d.k)).collect();
            for half in 0..2 {
                let wv: Vec<Value> = w8.iter().map(|w| w[half]).collect();
                fma_step(b, &wv, xp, half);
            }
        });
    }
    if main > main8 {
        let wv: Vec<Value> = (0..feats).map(|f| load_w4(b, d.wdtype, wrow, f * d.k + main8)).collect();
        let xp = b.ins().iadd_imm_s(xt, (main8 * 4) as i64);
        fma_step(b, &wv, xp, 0);
    }
    let mut sums = Vec::with_capacity(rows * feats);
    for r in 0..rows {
        for f in 0..feats {
            let v = b.use_var(acc[r * feats + f]);
            let mut sum = hsum(b, v);
            for i in main..d.k {
                let xs = b.ins().load(types::F32, read(), xt, ((r * d.k + i) * 4) as i32);
                let ws = load_w1(b, d.wdtype, wrow, f * d.k + i);
                sum = b.ins().fma(xs, ws, sum);
            }
            sums.push(sum);
        }
    }
    sums
}

/// Block weights, opened in registers: each (row, feature) one f32x4 accumulator stepping 4
/// along k over the exact weights (`ir::quant::value`), then a horizontal sum: the order of
/// [`dense_sums`] over the same weights dequantized. Features are opened one after the other
/// (few live registers; out-of-order execution overlaps their chains).
fn block_sums(
    b: &mut FunctionBuilder,
    d: &Dims,
    deq: &Dequant,
    (rows, feats): (usize, usize),
    wrow: Value,
    xt: Value,
) -> Vec<Value> {
    let acc = zeros(b, rows * feats);
    let (zero, end) = (b.ins().iconst(types::I64, 0), b.ins().iconst(types::I64, (d.k / BLOCK) as i64));
    counted(b, zero, end, 1, |b, blk| {
        let bp = at(b, wrow, blk, blocks::layout_bytes(d.wdtype) as i64);
        let xp = at(b, xt, blk, (BLOCK * 4) as i64);
        for f in 0..feats {
            let fp = b.ins().iadd_imm_s(bp, (f * d.row_bytes) as i64);
            let open = deq.open(b, fp);
            for g in 0..BLOCK / 4 {
                let wv = deq.group(b, &open, g);
                for r in 0..rows {
                    let xv = b.ins().load(types::F32X4, read(), xp, ((r * d.k + g * 4) * 4) as i32);
                    fma_into(b, acc[r * feats + f], xv, wv);
                }
            }
        }
    });
    (0..rows * feats)
        .map(|i| {
            let v = b.use_var(acc[i]);
            hsum(b, v)
        })
        .collect()
}

impl LinearKernel {
    /// Compiles the kernel for `k` input features, `n` output features and weights stored as
    /// `wdtype` (f32, bf16, or a block type in the CPU layout of [`crate::blocks`]).
    pub fn compile(k: usize, n: usize, wdtype: DType) -> Result<LinearKernel, JitError> {
        let blocks_ok = blocks::reads(wdtype) && k.is_multiple_of(BLOCK);
        if !matches!(wdtype, DType::F32 | DType::BF16) && !blocks_ok {
            return Err(JitError::Unsupported(format!(
                "linear: {wdtype} weights of {k} columns are not supported by the CPU JIT (f32, bf16, and \
                 GGUF's block types in whole blocks of 32 are)"
            )));
        }
        // Block kernels keep the order they are emitted in (`Opt::None`): the e-graph pass moves
        // each block's dequantization away from the FMAs that use it and spills (measured:
        // SmolLM2 Q4_1 decode 47 vs 55 tok/s, prefill 142 vs 205 on 2 cores); dense ones gain
        // from it (f32 prefill 283 vs 186).
        let opt = if wdtype.is_block() { Opt::None } else { Opt::Speed };
        let c = compile_opt(&format!("linear_k{k}_n{n}_{wdtype}"), (3, 3), opt, |b, env| {
            build(b, &env.params, k, n, wdtype)
        })?;
        // SAFETY: the function was compiled with exactly this signature.
        let f = unsafe { std::mem::transmute::<*const u8, LinearFn>(c.code) };
        let expand = match wdtype.is_block() {
            true => {
                let code = compile_opt(&format!("expand_k{k}_{wdtype}"), (2, 2), Opt::None, |b, env| {
                    build_expand(b, &env.params, k, wdtype)
                })?;
                // SAFETY: the function was compiled with exactly this signature.
                let f = unsafe { std::mem::transmute::<*const u8, ExpandFn>(code.code) };
                Some(Expand { f, dense: Box::new(LinearKernel::compile(k, n, DType::F32)?), _code: code })
            }
            false => None,
        };
        Ok(LinearKernel {
            f,
            k,
            n,
            wdtype,
            _code: c,
            expand,
            #[cfg(target_arch = "x86_64")]
            avx2: blocks_ok.then(|| crate::avx2::kind(wdtype)).flatten(),
            #[cfg(target_arch = "x86_64")]
            dense_avx2: crate::avx2::dense_ok(wdtype),
        })
    }

    /// `out[t, j] = x[t] · w[j]` for every row of `x` (`rows × k` floats) and every `j` in
    /// `0..n`, split across the pool's threads by output features. `w` holds `n × k` weights
    /// of the kernel's dtype (little-endian bytes; a block type's rows in the CPU layout).
    pub fn run(&self, pool: &Pool, x: &[f32], w: &[u8], out: &mut [f32]) {
        let rows = x.len() / self.k;
        assert_eq!(x.len(), rows * self.k, "x is not whole rows of {}", self.k);
        assert_eq!(w.len(), self.n * blocks::row_bytes(self.k, self.wdtype), "weight size");
        assert_eq!(out.len(), rows * self.n, "output size");
        // Small problems are not worth waking workers for.
        let parts = if self.n * self.k * rows < 32 * 1024 { 1 } else { pool.threads().min(self.n) };
        let chunk = self.n.div_ceil(parts);
        let out_ptr = out.as_mut_ptr() as usize;
        pool.run(parts, &|i| {
            let (j0, j1) = (i * chunk, ((i + 1) * chunk).min(self.n));
            match &self.expand {
                Some(e) if rows >= EXPAND_ROWS => self.run_expanded(e, x, w, out_ptr, (j0, j1)),
                _ => {
                    let j = self.run_pairs(x, w, out_ptr, (j0, j1));
                    self.run_rows(x, w.as_ptr(), out_ptr, (j, j1))
                }
            }
        });
    }

    /// Output features from `j0` on in pairs through `crate::avx2` where it reads the weights;
    /// returns the first feature left for the JIT's kernel.
    #[cfg(target_arch = "x86_64")]
    fn run_pairs(&self, x: &[f32], w: &[u8], out: usize, (j0, j1): (usize, usize)) -> usize {
        let Some(kind) = self.avx2 else { return j0 };
        let rows = x.len() / self.k;
        let row_bytes = blocks::row_bytes(self.k, self.wdtype);
        let call = crate::avx2::Call {
            x: x.as_ptr(),
            k: self.k,
            rows,
            w: w.as_ptr(),
            row_bytes,
            block_bytes: blocks::layout_bytes(self.wdtype),
            out: out as *mut f32,
            n: self.n,
        };
        // SAFETY: `kind` is set only where the CPU has AVX2 and FMA; `run` checked the sizes
        // of x, w (whole blocks: `compile` required k to be a multiple of 32) and out; callers
        // give disjoint columns j0..j1 of out.
        unsafe { crate::avx2::pairs(kind, &call, j0, j1) }
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn run_pairs(&self, _: &[f32], _: &[u8], _: usize, (j0, _): (usize, usize)) -> usize {
        j0
    }

    /// Output features `j0..j1` of every row of x over weights `w` (row `j` at `w + j·row
    /// bytes`): in AVX2 tiles where this kernel reads dense weights so, then by its JIT function.
    fn run_rows(&self, x: &[f32], w: *const u8, out: usize, (j0, j1): (usize, usize)) {
        let rows = x.len() / self.k;
        // Rows in blocks that stay in cache while every weight row of the part streams past
        // them (the kernel is batch-invariant, so blocking changes no result).
        for r0 in (0..rows).step_by(ROW_BLOCK) {
            let nr = ROW_BLOCK.min(rows - r0);
            // SAFETY: `run` checked the sizes; callers give disjoint columns j0..j1 of out
            // and weight rows j0..j1 at `w`; rows r0..r0 + nr are inside x and out.
            unsafe {
                let xb = x.as_ptr().add(r0 * self.k);
                let ob = (out as *mut f32).add(r0 * self.n);
                let j = self.dense_tiles(xb, nr, w, ob, (j0, j1));
                if j < j1 {
                    (self.f)(xb, w, ob, nr as i64, j as i64, j1 as i64)
                }
            }
        }
    }

    /// Features from `j0` on through `crate::avx2::dense` where this kernel reads its dense
    /// weights so; returns the first feature left for the JIT's function.
    ///
    /// # Safety
    /// As for the JIT's function: `nr` rows at `x`, weight rows `j0..j1` at `w`, output rows
    /// at `out` whose columns `j0..j1` no other thread writes.
    #[cfg(target_arch = "x86_64")]
    unsafe fn dense_tiles(
        &self,
        x: *const f32,
        nr: usize,
        w: *const u8,
        out: *mut f32,
        (j0, j1): (usize, usize),
    ) -> usize {
        if !self.dense_avx2 {
            return j0;
        }
        let call =
            crate::avx2::DenseCall { x, k: self.k, rows: nr, w, bf16: self.wdtype == DType::BF16, out, n: self.n };
        crate::avx2::dense(&call, j0, j1)
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn dense_tiles(&self, _: *const f32, _: usize, _: *const u8, _: *mut f32, (j0, _): (usize, usize)) -> usize {
        j0
    }

    /// Output features `j0..j1` from block weights dequantized, a few rows at a time, into this
    /// thread's scratch, then the f32 kernel over them.
    fn run_expanded(&self, e: &Expand, x: &[f32], w: &[u8], out: usize, (j0, j1): (usize, usize)) {
        // About 128 KiB of f32 weights at a time: they stay in cache for every row.
        let per = (32 * 1024 / self.k).max(4) / 4 * 4;
        SCRATCH.with_borrow_mut(|scratch| {
            scratch.resize(per * self.k, 0.0);
            for c0 in (j0..j1).step_by(per) {
                let c1 = (c0 + per).min(j1);
                // SAFETY: rows c0..c1 of w exist (`run` checked its size); the scratch holds
                // `per` rows of k floats.
                unsafe { (e.f)(w.as_ptr(), scratch.as_mut_ptr(), c0 as i64, c1 as i64) };
                // The f32 kernel finds row j at `base + j·k·4`: row c0 at the scratch's start.
                let base = (scratch.as_ptr() as *const u8).wrapping_sub(c0 * self.k * 4);
                e.dense.run_rows(x, base, out, (c0, c1));
            }
        })
    }
}

thread_local! {
    /// Each thread's room for block weights dequantized ([`LinearKernel::run_expanded`]).
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
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
        for &(k, n, rows) in &[
            (64, 192, 1),
            (576, 37, 3),
            (13, 5, 2),
            (16, 1, 4),
            (100, 64, 5),
            (576, 1000, 8),
            (64, 33, 7),
            (24, 9, 13),
        ] {
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
    fn rows_do_not_depend_on_the_batch() {
        for &(k, n) in &[(64, 37), (13, 9), (576, 130)] {
            for dtype in [DType::F32, DType::BF16] {
                let kernel = LinearKernel::compile(k, n, dtype).unwrap();
                let w = dtype.from_f32(&values(n * k, 3));
                let x = values(9 * k, 5);
                let pool = Pool::new(2);
                let mut batch = vec![0.0; 9 * n];
                kernel.run(&pool, &x, &w, &mut batch);
                for (t, row) in x.chunks(k).enumerate() {
                    let mut alone = vec![0.0; n];
                    kernel.run(&Pool::new(3), row, &w, &mut alone);
                    assert_eq!(alone, batch[t * n..(t + 1) * n], "k={k} n={n} {dtype} row {t}");
                }
            }
        }
    }

    /// GGUF blocks `gguf` of `dtype` as an `n x k` weight, repacked: the kernel's `rows` rows
    /// equal the reference over the dequantized weights, and each row alone equals the batch.
    fn check_blocks(dtype: DType, gguf: &[u8], (k, n, rows): (usize, usize, usize)) {
        let (wf, w) = (dtype.to_f32(gguf), blocks::repack(dtype, gguf));
        let x = values(rows * k, 1);
        let kernel = LinearKernel::compile(k, n, dtype).unwrap();
        let mut out = vec![f32::NAN; rows * n];
        kernel.run(&Pool::new(2), &x, &w, &mut out);
        let want = reference(&x, &wf, k);
        let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        let err = out.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max) / scale;
        assert!(err < 1e-5, "k={k} n={n} rows={rows} {dtype}: rel err {err}");
        for (t, row) in x.chunks(k).enumerate() {
            let mut alone = vec![0.0; n];
            kernel.run(&Pool::new(3), row, &w, &mut alone);
            assert_eq!(alone, out[t * n..(t + 1) * n], "k={k} n={n} {dtype} row {t}");
        }
    }

    /// Block weights quantized from `values` ([`check_blocks`]).
    #[test]
    fn block_weights_match_their_dequantization_in_any_batch() {
        for &(k, n, rows) in &[(64, 192, 1), (576, 37, 3), (32, 5, 13), (576, 130, 9), (64, 33, 7)] {
            for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1] {
                check_blocks(dtype, &dtype.from_f32(&values(n * k, 7)), (k, n, rows));
            }
        }
    }

    /// k-quant weights from deterministic bytes ([`check_blocks`]).
    #[test]
    fn k_quant_weights_match_their_dequantization_in_any_batch() {
        for &(k, n, rows) in &[(256, 40, 1), (512, 33, 5)] {
            for dtype in [DType::Q4_K, DType::Q5_K, DType::Q6_K] {
                check_blocks(dtype, &blocks::k_quant_sample(dtype, n * k / 256, 5), (k, n, rows));
            }
        }
    }

    /// Where the CPU has AVX2 and FMA, every block type runs in pairs of features through
    /// `crate::avx2`, bit for bit the JIT's block kernel (an odd feature left to it).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_pairs_equal_the_jit_bit_for_bit() {
        let cpu = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        let on = std::env::var("ENGINE_CPU_AVX2").map_or(true, |v| v != "0");
        let cases = [(64, 6, 1), (576, 9, 3), (32, 1, 2), (256, 5, 1), (512, 4, 3)];
        let types =
            [DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q4_K, DType::Q5_K, DType::Q6_K];
        for dtype in types {
            for (k, n, rows) in cases.into_iter().filter(|c| c.0 % dtype.block().map_or(32, |b| b.0) == 0) {
                let kernel = LinearKernel::compile(k, n, dtype).unwrap();
                assert_eq!(kernel.avx2.is_some(), cpu && on, "{dtype}");
                let gguf = match dtype {
                    DType::Q4_K | DType::Q5_K | DType::Q6_K => blocks::k_quant_sample(dtype, n * k / 256, 9),
                    _ => dtype.from_f32(&values(n * k, 11)),
                };
                let w = blocks::repack(dtype, &gguf);
                let x = values(rows * k, 4);
                let (mut fast, mut jit) = (vec![f32::NAN; rows * n], vec![f32::NAN; rows * n]);
                let done = kernel.run_pairs(&x, &w, fast.as_mut_ptr() as usize, (0, n));
                assert_eq!(done, if kernel.avx2.is_some() { n / 2 * 2 } else { 0 }, "{dtype}");
                kernel.run_rows(&x, w.as_ptr(), fast.as_mut_ptr() as usize, (done, n));
                kernel.run_rows(&x, w.as_ptr(), jit.as_mut_ptr() as usize, (0, n));
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&fast), bits(&jit), "k={k} n={n} rows={rows} {dtype}");
            }
        }
    }

    /// `crate::avx2::dense` (f32 and bf16 weights, and the dequantized block weights of
    /// prefill), bit for bit the JIT's dense kernel: tiles of 4 rows and single rows, pairs and
    /// an odd feature left to the JIT, k tails.
    #[test]
    fn avx2_dense_tiles_equal_the_jit_bit_for_bit() {
        let cpu = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        let on = std::env::var("ENGINE_CPU_AVX2").map_or(true, |v| v != "0");
        let cases = [(64, 6, 1), (576, 9, 7), (13, 5, 4), (100, 8, 9), (6, 3, 2), (512, 17, 16)];
        for dtype in [DType::F32, DType::BF16] {
            for (k, n, rows) in cases {
                let kernel = LinearKernel::compile(k, n, dtype).unwrap();
                assert_eq!(kernel.dense_avx2, cpu && on, "{dtype}");
                let w = dtype.from_f32(&values(n * k, 11));
                let x = values(rows * k, 4);
                let (mut fast, mut jit) = (vec![f32::NAN; rows * n], vec![f32::NAN; rows * n]);
                kernel.run_rows(&x, w.as_ptr(), fast.as_mut_ptr() as usize, (0, n));
                // SAFETY: x, w and jit hold rows x k, n x k and rows x n values.
                unsafe { (kernel.f)(x.as_ptr(), w.as_ptr(), jit.as_mut_ptr(), rows as i64, 0, n as i64) };
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&fast), bits(&jit), "k={k} n={n} rows={rows} {dtype}");
            }
        }
    }

    #[test]
    fn rejects_f16_weights() {
        assert!(LinearKernel::compile(16, 16, DType::F16).is_err());
    }
}
