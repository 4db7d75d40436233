//! Block (quantized) weights on the CPU: the layout the kernels read, repacked once at load from
//! GGUF's blocks (`ir::quant`), and the Cranelift code that turns a block into f32 weights in
//! registers, four at a time, exactly as `ir::quant::value` defines them.
//!
//! Layout, per block of 32 weights along a row (rows stay whole and in order):
//! - Q4_0 and Q4_1: 24 bytes: `d` (f32), `m` (f32; Q4_0's is `-8·d`), then GGUF's 16 bytes of
//!   nibbles (weight `i` in byte `i`'s low nibble, weight `i + 16` in its high one); a Q4_K
//!   super-block becomes eight such blocks (`d·sc`, `-(dmin·m)`: `ir::quant::q4_k_sub_blocks`);
//! - Q8_0: 36 bytes: `d` (f32), then the 32 `i8` values;
//! - Q5_K: 40 bytes per sub-block: `d·sc` (f32), `-(dmin·m)` (f32), then its 32 5-bit values
//!   one per byte (`ir::quant::q5_k_sub_blocks`); Q5_0 and Q5_1 blocks the same (`d`, `m`:
//!   `ir::quant::q5_block`);
//! - Q6_K: 40 bytes per run of 32 values: the scales of its two halves (`d·sc`, f32 each), then
//!   the 32 values `q - 32` as `i8` (`ir::quant::q6_k_sub_blocks`).
//!
//! The scales are widened to f32 once here because Cranelift has no f16 conversion on x86.

use cranelift_codegen::ir::{types, ConstantData, Endianness, InstBuilder, MemFlagsData, Value};
use cranelift_frontend::FunctionBuilder;
use ir::quant::{nibbles, value};
use ir::{DType, BLOCK};

/// Whether the kernels read `dtype` as blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, and the k-quants
/// Q4_K, Q5_K, Q6_K as blocks of 32 of their sub-blocks); the other block types (FP8) are
/// dequantized to f32 at load.
pub fn reads(dtype: DType) -> bool {
    dtype.is_block() && dtype != DType::F8_E4M3
}

/// Bytes of one block of 32 weights in the CPU layout.
pub fn layout_bytes(dtype: DType) -> usize {
    match dtype {
        DType::Q8_0 => 36,
        DType::Q5_0 | DType::Q5_1 | DType::Q5_K | DType::Q6_K => 40,
        _ => 24,
    }
}

/// Whether a block's values are bytes (not nibbles) in the CPU layout.
fn byte_values(dtype: DType) -> bool {
    matches!(dtype, DType::Q8_0 | DType::Q5_0 | DType::Q5_1 | DType::Q5_K | DType::Q6_K)
}

/// Whether a block's values are signed bytes scaled without offset (`q·d`).
fn signed(dtype: DType) -> bool {
    matches!(dtype, DType::Q8_0 | DType::Q6_K)
}

/// Bytes of a weight row of `k` values: dense, or whole blocks in the CPU layout.
pub fn row_bytes(k: usize, dtype: DType) -> usize {
    if dtype.is_block() {
        k / BLOCK * layout_bytes(dtype)
    } else {
        k * dtype.size()
    }
}

/// Repacks whole GGUF blocks of `dtype` into the CPU layout (`ir::quant::runs`: Q8_0's run
/// keeps one scale).
pub fn repack(dtype: DType, gguf: &[u8]) -> Vec<u8> {
    let (_, size) = dtype.block().unwrap_or_else(|| panic!("{dtype} is not a block type"));
    let mut out = Vec::with_capacity(gguf.len() / size * layout_bytes(dtype));
    ir::quant::runs(dtype, gguf, |a, b, codes| {
        out.extend(a.to_le_bytes());
        if dtype != DType::Q8_0 {
            out.extend(b.to_le_bytes());
        }
        out.extend(codes);
    });
    out
}

/// Dequantizes a row (whole blocks, CPU layout) into `out` (32 values per block).
pub fn dequant_row(dtype: DType, row: &[u8], out: &mut [f32]) {
    let f32_at = |b: &[u8], at: usize| f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    for (b, o) in row.chunks_exact(layout_bytes(dtype)).zip(out.chunks_exact_mut(BLOCK)) {
        let d = f32_at(b, 0);
        match dtype {
            DType::Q8_0 => o.iter_mut().zip(&b[4..]).for_each(|(o, &q)| *o = value(dtype, q, d, 0.0)),
            // The second f32 is Q6_K's scale of values 16..32, the others' offset.
            DType::Q5_0 | DType::Q5_1 | DType::Q5_K | DType::Q6_K => {
                let e = f32_at(b, 4);
                for (l, (o, &q)) in o.iter_mut().zip(&b[8..]).enumerate() {
                    *o = match dtype {
                        DType::Q6_K => value(dtype, q, if l < BLOCK / 2 { d } else { e }, 0.0),
                        _ => value(dtype, q, d, e),
                    };
                }
            }
            _ => {
                let m = f32_at(b, 4);
                o.iter_mut().zip(nibbles(&b[8..])).for_each(|(o, q)| *o = value(dtype, q, d, m));
            }
        }
    }
}

/// Reads of the weights: unaligned, never written, so placed next to their use.
fn loadf() -> MemFlagsData {
    MemFlagsData::new().with_notrap().with_readonly().with_can_move()
}

fn lanes() -> MemFlagsData {
    MemFlagsData::new().with_endianness(Endianness::Little)
}

/// The `pshufb` mask taking bytes `4g .. 4g + 4` of 16 into four i32 lanes: each in its lane's
/// low byte (unsigned values), or in its high byte for `signed` ones (the lane is `q·2²⁴`).
pub(crate) fn lane_mask(signed: bool, g: usize) -> [u8; 16] {
    let at = if signed { 3 } else { 0 };
    std::array::from_fn(|i| if i % 4 == at { (4 * g + i / 4) as u8 } else { 0x80 })
}

/// Emits the dequantization of blocks: the shuffle masks, made once per function.
pub(crate) struct Dequant {
    dtype: DType,
    /// `pshufb` masks: group `g` of 4 bytes into the four i32 lanes (unsigned values: each byte
    /// in its lane's low byte; signed (Q8_0, Q6_K): in its high byte, so the lane is `q·2²⁴` as
    /// a signed integer).
    masks: [Value; 4],
    /// Sixteen bytes of 0x0F.
    low4: Value,
}

/// One block of one weight row, opened: its scales splat, its value bytes in registers.
pub(crate) struct Open {
    /// The scale, splat (the signed types' times 2⁻²⁴, as their values come out times 2²⁴).
    d: Value,
    /// The offset `m`, splat (the unsigned types), or Q6_K's scale of values 16..32.
    m: Value,
    src: [Value; 2],
}

impl Dequant {
    /// The constants for `dtype` (a block type).
    pub(crate) fn new(b: &mut FunctionBuilder, dtype: DType) -> Dequant {
        let masks = [0, 1, 2, 3].map(|g| {
            let c = b.func.dfg.constants.insert(ConstantData::from(&lane_mask(signed(dtype), g)[..]));
            b.ins().vconst(types::I8X16, c)
        });
        let f = b.ins().iconst(types::I8, 0x0F);
        let low4 = b.ins().splat(types::I8X16, f);
        Dequant { dtype, masks, low4 }
    }

    /// Opens the block at `p` (CPU layout): its scales, its value bytes.
    pub(crate) fn open(&self, b: &mut FunctionBuilder, p: Value) -> Open {
        let d = b.ins().load(types::F32, loadf(), p, 0);
        // The signed types' lanes hold q·2²⁴: d·2⁻²⁴ makes the product q·d, rounded once.
        let unscale = |b: &mut FunctionBuilder, d: Value| {
            let k = b.ins().f32const(1.0 / 16_777_216.0);
            b.ins().fmul(d, k)
        };
        if self.dtype == DType::Q8_0 {
            let d = unscale(b, d);
            let d = b.ins().splat(types::F32X4, d);
            let lo = b.ins().load(types::I8X16, loadf(), p, 4);
            let hi = b.ins().load(types::I8X16, loadf(), p, 20);
            return Open { d, m: d, src: [lo, hi] };
        }
        let m = b.ins().load(types::F32, loadf(), p, 4);
        let (d, m) = if signed(self.dtype) { (unscale(b, d), unscale(b, m)) } else { (d, m) };
        let (d, m) = (b.ins().splat(types::F32X4, d), b.ins().splat(types::F32X4, m));
        if byte_values(self.dtype) {
            let lo = b.ins().load(types::I8X16, loadf(), p, 8);
            let hi = b.ins().load(types::I8X16, loadf(), p, 24);
            return Open { d, m, src: [lo, hi] };
        }
        let qs = b.ins().load(types::I8X16, loadf(), p, 8);
        // Weights 0-15 (the low nibbles) and 16-31 (the high ones, moved down) as bytes.
        let lo = b.ins().band(qs, self.low4);
        let wide = b.ins().bitcast(types::I16X8, lanes(), qs);
        let shifted = b.ins().ushr_imm_u(wide, 4);
        let hi = b.ins().bitcast(types::I8X16, lanes(), shifted);
        let hi = b.ins().band(hi, self.low4);
        Open { d, m, src: [lo, hi] }
    }

    /// Weights `4g .. 4g + 4` (g < 8) of an open block as an f32x4, exactly
    /// `ir::quant::value`: `fma(q, d, m)` for the unsigned types, `(q·2²⁴)·(d·2⁻²⁴)` = `q·d`
    /// rounded once for the signed ones (Q6_K's second scale from value 16 on).
    pub(crate) fn group(&self, b: &mut FunctionBuilder, blk: &Open, g: usize) -> Value {
        let bytes = b.ins().x86_pshufb(blk.src[g / 4], self.masks[g % 4]);
        let q = b.ins().bitcast(types::I32X4, lanes(), bytes);
        let f = b.ins().fcvt_from_sint(types::F32X4, q);
        match self.dtype {
            DType::Q8_0 => b.ins().fmul(f, blk.d),
            DType::Q6_K => b.ins().fmul(f, if g < 4 { blk.d } else { blk.m }),
            _ => b.ins().fma(f, blk.d, blk.m),
        }
    }
}

/// `count` super-blocks of `dtype` (a k-quant) made from deterministic bytes (`seed`), with
/// small normal f16 scales (Q4_K / Q5_K: `d`, `dmin` at 0; Q6_K: `d` at 208): weights for tests
/// and benchmarks (the engine reads k-quants, it does not make them).
pub fn k_quant_sample(dtype: DType, count: usize, seed: u32) -> Vec<u8> {
    let size = dtype.block().expect("a block type").1;
    let mut gguf: Vec<u8> =
        (0..(size * count) as u32).map(|i| (i.wrapping_add(seed).wrapping_mul(2654435761) >> 13) as u8).collect();
    let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
    for sb in gguf.chunks_exact_mut(size) {
        if dtype == DType::Q6_K {
            sb[208..210].copy_from_slice(&f16(2e-3));
        } else {
            sb[..2].copy_from_slice(&f16(3e-3));
            sb[2..4].copy_from_slice(&f16(1e-3));
        }
    }
    gguf
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repacked_k_quant_rows_dequantize_as_the_ir_does() {
        for dtype in [DType::Q4_K, DType::Q5_K, DType::Q6_K] {
            let gguf = k_quant_sample(dtype, 2, 0);
            let mut out = vec![0.0; 512];
            dequant_row(dtype, &repack(dtype, &gguf), &mut out);
            let want = dtype.to_f32(&gguf);
            assert!(out.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{dtype} repacked differs");
        }
    }

    #[test]
    fn repacked_rows_dequantize_as_the_ir_does() {
        let x: Vec<f32> = (0..128).map(|i| ((i * 53 % 41) as f32 - 20.0) / 9.0).collect();
        for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1] {
            let gguf = dtype.from_f32(&x);
            let mut out = vec![0.0; x.len()];
            dequant_row(dtype, &repack(dtype, &gguf), &mut out);
            assert_eq!(out, dtype.to_f32(&gguf), "{dtype}");
        }
    }
}
