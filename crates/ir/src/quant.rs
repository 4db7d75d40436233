//! The block (quantized) weight types' values: what a block of GGUF's Q8_0, Q4_0, Q4_1, Q5_0,
//! Q5_1, of its k-quants Q4_K, Q5_K, Q6_K, and of FP8 E4M3 with f32 scales means, declared once. The reference interpreter dequantizes
//! with [`dequantize`]; every backend kernel that reads blocks must produce exactly these f32
//! weights.
//!
//! The k-quants are dequantized as llama.cpp's gguf-py does (`gguf.quants.Q4_K` etc., float32
//! numpy, the order of operations of ggml's `dequantize_row_q4_K`): `(d·sc)·q - dmin·m`, each
//! operation rounded to f32 on its own. Their products are exact in f32 (an f16 scale's 11
//! significant bits times a 6- or 7-bit sub-block scale times a value of at most 6 bits fit in
//! f32's 24), so a Q4_K / Q5_K value is the one rounding of the difference and a Q6_K value is
//! exact: bit for bit gguf-py's (and ggml's, fused multiply-add or not;
//! `tests/fixtures/tiny-kquant/reference/dequant_samples.json` holds gguf-py's values).

use crate::types::{DType, BLOCK};

fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The scale `d`, the offset `m` and the byte offset of the values of one block: `w =
/// fma(q, d, m)` for the 4-bit types (Q4_0's `m` is `-8·d`: `fma(q, d, -8d)` rounds `(q - 8)·d`
/// once, as its definition does), `w = q·d` for Q8_0 (`m` = 0).
pub fn block_params(ty: DType, b: &[u8]) -> (f32, f32, usize) {
    match ty {
        DType::Q8_0 => (f16_at(b, 0), 0.0, 2),
        DType::Q4_0 => (f16_at(b, 0), -8.0 * f16_at(b, 0), 2),
        DType::Q4_1 => (f16_at(b, 0), f16_at(b, 2), 4),
        d => panic!("{d} is not a block type"),
    }
}

/// The 32 values `q` of one 4-bit block (16 bytes: element `i` in byte `i`'s low nibble,
/// element `i + 16` in its high one).
pub fn nibbles(qs: &[u8]) -> [u8; BLOCK] {
    let mut q = [0u8; BLOCK];
    for (i, &x) in qs[..BLOCK / 2].iter().enumerate() {
        q[i] = x & 0x0F;
        q[i + BLOCK / 2] = x >> 4;
    }
    q
}

/// One weight from its block's `d`, `m` ([`block_params`], [`q5_block`], or a k-quant
/// sub-block's: [`q4_k_sub_blocks`], [`q5_k_sub_blocks`], [`q6_k_sub_blocks`]) and its value `q` (Q8_0's
/// and Q6_K's `q` is an `i8`'s byte, `m` unused): the one formula every reader of these blocks
/// computes.
pub fn value(ty: DType, q: u8, d: f32, m: f32) -> f32 {
    if matches!(ty, DType::Q8_0 | DType::Q6_K) {
        q as i8 as f32 * d
    } else {
        (q as f32).mul_add(d, m)
    }
}

/// The 6-bit scale `sc` and min `m` of sub-block `j` (0..8) of a Q4_K or Q5_K super-block,
/// from its 12 bytes of scales `s` (llama.cpp's `get_scale_min_k4`): sub-blocks 0..3 are the
/// low 6 bits of `s[j]` (scale) and `s[j + 4]` (min); sub-blocks 4..7 take their low 4 bits
/// from `s[j + 4]` (scale: low nibble, min: high nibble) and their high 2 bits from the top
/// bits of `s[j - 4]` (scale) and `s[j]` (min).
pub fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// The eight sub-blocks of a Q4_K super-block (144 bytes: f16 `d` at 0, f16 `dmin` at 2, 12
/// bytes of scales at 4, 128 bytes `qs` at 16): sub-block `j` (32 values) has the scale and
/// min [`scale_min_k4`]`(j)`, its value `l` is `q = (qs[32·(j/2) + l] >> 4·(j%2)) & 15` (the
/// low nibbles of 32 bytes, then their high nibbles). Each comes as `(d·sc, -(dmin·m), q)`,
/// both products exact in f32, so that `w = fma(q, d·sc, -(dmin·m))` ([`value`]): one rounding,
/// equal to llama.cpp's `(d·sc)·q - dmin·m`, whose product `(d·sc)·q` is exact too. The CPU
/// kernels read these sub-blocks as Q4_1 blocks.
pub fn q4_k_sub_blocks(b: &[u8]) -> [(f32, f32, [u8; BLOCK]); 8] {
    let (d, dmin, scales, qs) = (f16_at(b, 0), f16_at(b, 2), &b[4..16], &b[16..144]);
    std::array::from_fn(|j| {
        let (sc, m) = scale_min_k4(j, scales);
        let shift = 4 * (j % 2);
        let q = std::array::from_fn(|l| (qs[32 * (j / 2) + l] >> shift) & 0x0F);
        (d * sc as f32, -(dmin * m as f32), q)
    })
}

/// One Q4_K super-block into 256 values ([`q4_k_sub_blocks`]).
fn q4_k(b: &[u8], out: &mut Vec<f32>) {
    for (dj, mj, q) in q4_k_sub_blocks(b) {
        out.extend(q.iter().map(|&q| value(DType::Q4_K, q, dj, mj)));
    }
}

/// The eight sub-blocks of a Q5_K super-block (176 bytes: Q4_K's `d`, `dmin` and 12 bytes of
/// scales, then 32 bytes `qh` at 16 and 128 bytes `qs` at 48): Q4_K's sub-blocks, scales and
/// nibbles, with a fifth bit, bit `j` of `qh[l]`, for value `l` of sub-block `j`:
/// `q = ((qs[32·(j/2) + l] >> 4·(j%2)) & 15) | (((qh[l] >> j) & 1) << 4)`. Each comes as
/// `(d·sc, -(dmin·m), q)` as [`q4_k_sub_blocks`]' do: `w = fma(q, d·sc, -(dmin·m))`
/// ([`value`]), llama.cpp's `(d·sc)·q - dmin·m` (an exact product, the difference rounded once).
pub fn q5_k_sub_blocks(b: &[u8]) -> [(f32, f32, [u8; BLOCK]); 8] {
    let (d, dmin, scales, qh, qs) = (f16_at(b, 0), f16_at(b, 2), &b[4..16], &b[16..48], &b[48..176]);
    std::array::from_fn(|j| {
        let (sc, m) = scale_min_k4(j, scales);
        let shift = 4 * (j % 2);
        let q = std::array::from_fn(|l| ((qs[32 * (j / 2) + l] >> shift) & 0x0F) | (((qh[l] >> j) & 1) << 4));
        (d * sc as f32, -(dmin * m as f32), q)
    })
}

/// One Q5_K super-block into 256 values ([`q5_k_sub_blocks`]).
fn q5_k(b: &[u8], out: &mut Vec<f32>) {
    for (dj, mj, q) in q5_k_sub_blocks(b) {
        out.extend(q.iter().map(|&q| value(DType::Q5_K, q, dj, mj)));
    }
}

/// A Q5_0 or Q5_1 block as `(d, m, q)` (Q5_0: 22 bytes, f16 `d`, 4 bytes `qh`, 16 bytes `qs`,
/// and `m = -16·d`; Q5_1: 24 bytes, f16 `d`, f16 `m`, then `qh` and `qs`): value `l < 16` is
/// `(qs[l] & 15) | (bit l of qh) << 4`, value `l + 16` is `(qs[l] >> 4) | (bit l + 16 of qh) << 4`
/// (`qh` little-endian). `w = fma(q, d, m)` ([`value`]): for a finite `d`, Q5_0's `(q - 16)·d`
/// is exact (a 5-bit integer times an f16), as llama.cpp's is (but for the sign of a zero: +0 where a negative
/// `d` gives llama.cpp -0); Q5_1's `q·d + m` rounds once, its product being exact.
pub fn q5_block(ty: DType, b: &[u8]) -> (f32, f32, [u8; BLOCK]) {
    let d = f16_at(b, 0);
    let (m, at) = match ty {
        DType::Q5_0 => (-16.0 * d, 2),
        DType::Q5_1 => (f16_at(b, 2), 4),
        t => panic!("{t} is not Q5_0 or Q5_1"),
    };
    let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let lo = nibbles(&b[at + 4..at + 4 + BLOCK / 2]);
    (d, m, std::array::from_fn(|l| lo[l] | (((qh >> l) & 1) << 4) as u8))
}

/// The eight runs of 32 values of a Q6_K super-block (210 bytes: 128 bytes `ql` at 0, 64 bytes
/// `qh` at 128, sixteen `i8` scales `sc` at 192, f16 `d` at 208), in element order: run `i`
/// holds elements `32·i ..`, half `c = i / 4`, row `r = i % 4`; its value `l` has the low 4
/// bits `(ql[64·c + 32·(r%2) + l] >> 4·(r/2)) & 15` and the high 2 bits
/// `(qh[32·c + l] >> 2·r) & 3`, and `q` is their 6-bit number minus 32 (as an `i8`'s byte).
/// Each run comes as `(d·sc[2i], d·sc[2i + 1], q)`, the scales of its two halves of 16
/// (exact products): `w = q·(d·sc)` ([`value`]), exact, as llama.cpp's `d·sc·q`.
pub fn q6_k_sub_blocks(b: &[u8]) -> [(f32, f32, [u8; BLOCK]); 8] {
    let (ql, qh, scales, d) = (&b[..128], &b[128..192], &b[192..208], f16_at(b, 208));
    let scale = |j: usize| d * scales[j] as i8 as f32;
    std::array::from_fn(|i| {
        let (c, r) = (i / 4, i % 4);
        let q = std::array::from_fn(|l| {
            let lo = (ql[64 * c + 32 * (r % 2) + l] >> (4 * (r / 2))) & 0x0F;
            let hi = (qh[32 * c + l] >> (2 * r)) & 3;
            ((lo | (hi << 4)) as i8 - 32) as u8
        });
        (scale(2 * i), scale(2 * i + 1), q)
    })
}

/// One Q6_K super-block into 256 values ([`q6_k_sub_blocks`]).
fn q6_k(b: &[u8], out: &mut Vec<f32>) {
    for (d0, d1, q) in q6_k_sub_blocks(b) {
        out.extend(q.iter().enumerate().map(|(l, &q)| value(DType::Q6_K, q, if l < 16 { d0 } else { d1 }, 0.0)));
    }
}

/// The GGUF block types' weights in runs of 32 along the row, in order: `f(a, b, codes)` per
/// run, the one decomposition every backend's re-laid blocks are made of (the CPU's
/// `codegen_cpu::blocks::repack`, CUDA's `codegen_cuda::block_device_layout`). For the
/// unsigned types (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K) weight `l` is `fma(q, a, b)`; for the
/// signed ones (Q8_0, Q6_K) it is `q·a` for `l < 16` and `q·b` from 16 on (Q8_0's `a` and `b`
/// are both its `d`): [`value`]. `codes` are GGUF's 16 bytes of nibbles for the 4-bit types
/// (weight `l` in byte `l`'s low nibble, `l + 16` in its high one: [`nibbles`]), else one byte
/// a weight (the 5-bit `q` of Q5_0, Q5_1 and Q5_K, Q8_0's and Q6_K's `i8` bytes).
pub fn runs(ty: DType, gguf: &[u8], mut f: impl FnMut(f32, f32, &[u8])) {
    let (_, size) = ty.block().unwrap_or_else(|| panic!("{ty} is not a block type"));
    for b in gguf.chunks_exact(size) {
        match ty {
            DType::Q4_K => {
                for (d, m, q) in q4_k_sub_blocks(b) {
                    let packed: [u8; BLOCK / 2] = std::array::from_fn(|i| q[i] | (q[i + BLOCK / 2] << 4));
                    f(d, m, &packed);
                }
            }
            DType::Q5_K => q5_k_sub_blocks(b).iter().for_each(|(d, m, q)| f(*d, *m, q)),
            DType::Q5_0 | DType::Q5_1 => {
                let (d, m, q) = q5_block(ty, b);
                f(d, m, &q);
            }
            DType::Q6_K => q6_k_sub_blocks(b).iter().for_each(|(d0, d1, q)| f(*d0, *d1, q)),
            DType::Q8_0 => {
                let (d, _, at) = block_params(ty, b);
                f(d, d, &b[at..]);
            }
            DType::Q4_0 | DType::Q4_1 => {
                let (d, m, at) = block_params(ty, b);
                f(d, m, &b[at..]);
            }
            DType::F8_E4M3 | DType::F32 | DType::F16 | DType::BF16 | DType::I32 => {
                panic!("{ty} is not a GGUF block type")
            }
        }
    }
}

/// Dequantizes whole blocks of a block type to f32 (trailing bytes short of a block are
/// ignored: callers pass whole blocks, [`DType::bytes`]).
pub fn dequantize(ty: DType, bytes: &[u8]) -> Vec<f32> {
    let (len, size) = ty.block().unwrap_or_else(|| panic!("{ty} is not a block type"));
    let mut out = Vec::with_capacity(bytes.len() / size * len);
    for b in bytes.chunks_exact(size) {
        match ty {
            DType::Q8_0 => {
                let (d, m, at) = block_params(ty, b);
                out.extend(b[at..].iter().map(|&q| value(ty, q, d, m)));
            }
            DType::Q4_0 | DType::Q4_1 => {
                let (d, m, at) = block_params(ty, b);
                out.extend(nibbles(&b[at..]).iter().map(|&q| value(ty, q, d, m)));
            }
            DType::Q5_0 | DType::Q5_1 => {
                let (d, m, q) = q5_block(ty, b);
                out.extend(q.iter().map(|&q| value(ty, q, d, m)));
            }
            DType::Q4_K => q4_k(b, &mut out),
            DType::Q5_K => q5_k(b, &mut out),
            DType::Q6_K => q6_k(b, &mut out),
            DType::F8_E4M3 => {
                let s = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                out.extend(b[4..].iter().map(|&q| e4m3_to_f32(q) * s));
            }
            DType::F32 | DType::F16 | DType::BF16 | DType::I32 => unreachable!("not a block type"),
        }
    }
    out
}

/// An FP8 E4M3 value as f32 (exact: every E4M3 value is an f32; 0x7F and 0xFF are NaN).
pub fn e4m3_to_f32(q: u8) -> f32 {
    let (e, m) = ((q >> 3) & 0x0F, q & 7);
    let mag = match (e, m) {
        (15, 7) => f32::NAN,
        (0, _) => m as f32 / 512.0,
        _ => (8 + m) as f32 * f32::powi(2.0, e as i32 - 10),
    };
    if q & 0x80 != 0 {
        -mag
    } else {
        mag
    }
}

/// The E4M3 value nearest `v` (ties to even), saturated to ±448; NaN to 0x7F.
pub fn f32_to_e4m3(v: f32) -> u8 {
    if v.is_nan() {
        return 0x7F;
    }
    let sign = if v.is_sign_negative() { 0x80 } else { 0 };
    let a = v.abs();
    if a >= 448.0 {
        return sign | 0x7E;
    }
    if a < 1.0 / 64.0 {
        // Subnormal: steps of 2^-9 (the code is the step count; 8 steps is the first normal).
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // Normal: 2^e·(1 + m/8). The mantissa rounded in [8, 16] carries into the exponent by
    // itself (up to 448, 0x7E).
    let e = (a.to_bits() >> 23) as i32 - 127;
    let m = (a * f32::powi(2.0, 3 - e)).round_ties_even() as i32 - 8;
    let code = ((e + 7) << 3) + m;
    sign | code as u8
}

/// Quantizes rows of `k` values (whole blocks) to FP8 E4M3 with one scale per row (each
/// block of the row carries it): `s = max|row| / 448`, `q = e4m3(w / s)`.
pub fn quantize_fp8_rows(values: &[f32], k: usize) -> Vec<u8> {
    assert!(k.is_multiple_of(BLOCK) && values.len().is_multiple_of(k), "rows of {k} are not whole blocks");
    let mut out = Vec::with_capacity(values.len() / BLOCK * 36);
    for row in values.chunks_exact(k) {
        let amax = row.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let s = if amax > 0.0 { amax / 448.0 } else { 1.0 };
        for blk in row.chunks_exact(BLOCK) {
            out.extend(s.to_le_bytes());
            out.extend(blk.iter().map(|&w| f32_to_e4m3(w / s)));
        }
    }
    out
}

/// Quantizes f32 values (whole blocks) as llama.cpp's reference quantizers do
/// (`quantize_row_q8_0_ref`, `..._q4_0_ref`, `..._q4_1_ref`, `..._q5_0_ref`, `..._q5_1_ref`):
/// for making test weights. The
/// k-quants are only read, never made here (their quantizers search scales iteratively):
/// asking for one panics.
pub fn quantize(ty: DType, values: &[f32]) -> Vec<u8> {
    if matches!(ty, DType::Q4_K | DType::Q5_K | DType::Q6_K) {
        panic!("quantizing to {ty} is not implemented (the engine reads k-quants, it does not make them)");
    }
    if ty == DType::F8_E4M3 {
        return quantize_fp8_rows(values, BLOCK);
    }
    assert!(values.len().is_multiple_of(BLOCK), "{} values are not whole blocks of {BLOCK}", values.len());
    let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
    let mut out = Vec::new();
    for x in values.chunks_exact(BLOCK) {
        match ty {
            DType::Q8_0 => {
                let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16(d));
                out.extend(x.iter().map(|v| (v * id).round() as i8 as u8));
            }
            DType::Q4_0 => {
                let (d, id) = symmetric(x, 8.0);
                out.extend(f16(d));
                let q = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
                out.extend((0..BLOCK / 2).map(|i| q(x[i]) | (q(x[i + BLOCK / 2]) << 4)));
            }
            DType::Q4_1 => {
                let (d, id, min) = affine(x, 15.0);
                out.extend(f16(d));
                out.extend(f16(min));
                let q = |v: f32| (((v - min) * id + 0.5) as i8).min(15) as u8;
                out.extend((0..BLOCK / 2).map(|i| q(x[i]) | (q(x[i + BLOCK / 2]) << 4)));
            }
            DType::Q5_0 => {
                let (d, id) = symmetric(x, 16.0);
                out.extend(f16(d));
                out.extend(five_bits(x, |v| ((v * id + 16.5) as i8).min(31) as u8));
            }
            DType::Q5_1 => {
                let (d, id, min) = affine(x, 31.0);
                out.extend(f16(d));
                out.extend(f16(min));
                out.extend(five_bits(x, |v| ((v - min) * id + 0.5) as u8));
            }
            d => panic!("{d} is not a block type"),
        }
    }
    out
}

/// The scale `d` of a block of Q4_0 / Q5_0 (`half`: 8 / 16 levels each side) as llama.cpp's
/// reference quantizers take it, the value of largest magnitude over `-half`, and its inverse
/// (0 for an all-zero block).
fn symmetric(x: &[f32], half: f32) -> (f32, f32) {
    let max = x.iter().copied().fold(0.0f32, |a, v| if v.abs() > a.abs() { v } else { a });
    let d = max / -half;
    (d, if d != 0.0 { 1.0 / d } else { 0.0 })
}

/// The scale `d` of a block of Q4_1 / Q5_1 (`steps`: 15 / 31) over its range, its inverse (0 for
/// a constant block) and its minimum, the offset, as llama.cpp's reference quantizers take them.
fn affine(x: &[f32], steps: f32) -> (f32, f32, f32) {
    let (min, max) = x.iter().fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    let d = (max - min) / steps;
    (d, if d != 0.0 { 1.0 / d } else { 0.0 }, min)
}

/// A block's 5-bit values `q(x)` packed as Q5_0 and Q5_1 store them: `qh` (each value's fifth
/// bit, little-endian), then the low 4 bits as Q4_0's nibbles.
fn five_bits(x: &[f32], q: impl Fn(f32) -> u8) -> Vec<u8> {
    let q: Vec<u8> = x.iter().map(|&v| q(v)).collect();
    let qh = q.iter().enumerate().fold(0u32, |h, (l, &v)| h | (u32::from(v >> 4) << l));
    let lo = (0..BLOCK / 2).map(|i| (q[i] & 0x0F) | ((q[i + BLOCK / 2] & 0x0F) << 4));
    qh.to_le_bytes().into_iter().chain(lo).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dequantizes_blocks() {
        let d = half::f16::from_f32(0.5).to_le_bytes();
        let m = half::f16::from_f32(-1.0).to_le_bytes();
        let mut q41 = vec![d[0], d[1], m[0], m[1]];
        q41.extend([0x21u8; 16]);
        let v = dequantize(DType::Q4_1, &q41);
        assert_eq!((v.len(), v[0], v[16]), (32, 0.5 * 1.0 - 1.0, 0.5 * 2.0 - 1.0));
        let mut q40 = vec![d[0], d[1]];
        q40.extend([0xF0u8; 16]);
        let v = dequantize(DType::Q4_0, &q40);
        assert_eq!((v[0], v[16]), (-4.0, 3.5));
        let mut q8 = vec![d[0], d[1]];
        q8.extend([0xF0u8; 32]);
        assert_eq!(dequantize(DType::Q8_0, &q8)[0], -8.0);
        // Q5_0 / Q5_1: the fifth bits of values 0 and 16 set (bits 0 and 16 of qh).
        let qh = (1u32 | 1 << 16).to_le_bytes();
        let mut q50 = vec![d[0], d[1]];
        q50.extend(qh);
        q50.extend([0x21u8; 16]);
        let v = dequantize(DType::Q5_0, &q50);
        assert_eq!((v.len(), v[0], v[1], v[16], v[17]), (32, 0.5, -7.5, 1.0, -7.0));
        let mut q51 = vec![d[0], d[1], m[0], m[1]];
        q51.extend(qh);
        q51.extend([0x21u8; 16]);
        let v = dequantize(DType::Q5_1, &q51);
        assert_eq!((v[0], v[1], v[16], v[17]), (7.5, -0.5, 8.0, 0.0));
    }

    /// gguf-py's dequantization of two super-blocks per k-quant (`scripts/make-kquant-gguf.py`:
    /// one with the fixture's scales, one of random bytes, its f16 scales included), bit for bit.
    #[test]
    fn k_quants_and_q5_dequantize_as_gguf_py_does() {
        let path =
            concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/tiny-kquant/reference/dequant_samples.json");
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let samples: serde_json::Value = serde_json::from_str(&text).unwrap();
        let hex = |s: &str, n: usize| -> Vec<u32> {
            (0..s.len() / n).map(|i| u32::from_str_radix(&s[i * n..(i + 1) * n], 16).unwrap()).collect()
        };
        // Two super-blocks of each k-quant, eight blocks of Q5_0 and Q5_1.
        for (ty, n) in [(DType::Q4_K, 2), (DType::Q5_K, 2), (DType::Q6_K, 2), (DType::Q5_0, 8), (DType::Q5_1, 8)] {
            let s = &samples[ty.to_string()];
            let bytes: Vec<u8> = hex(s["hex"].as_str().unwrap(), 2).into_iter().map(|b| b as u8).collect();
            let want = hex(s["bits"].as_str().unwrap(), 8);
            let (len, size) = ty.block().unwrap();
            assert_eq!((bytes.len(), want.len()), (n * size, n * len), "{ty}");
            let got = dequantize(ty, &bytes);
            assert_eq!(got.len(), want.len(), "{ty}");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                // A zero weight's sign aside: Q5_0's `fma(16, d, -16·d)` is +0 where gguf-py's
                // `(16 - 16)·d` of a negative `d` is -0; either adds nothing to a dot product.
                let zeros = ty == DType::Q5_0 && *g == 0.0 && f32::from_bits(*w) == 0.0;
                assert!(g.to_bits() == *w || zeros, "{ty} value {i}: ours {g:e}, gguf-py's {:e}", f32::from_bits(*w));
            }
        }
    }

    #[test]
    fn k_quant_scales_and_mins_unpack_as_get_scale_min_k4() {
        // Sub-blocks 0..3: low 6 bits of bytes 0..3 (scales) and 4..7 (mins); 4..7: a nibble of
        // bytes 8..11 and the top 2 bits of bytes 0..3 (scales) or 4..7 (mins).
        let s = [0xC1, 0x02, 0x03, 0x04, 0x85, 0x06, 0x07, 0x08, 0x9A, 0x0B, 0x0C, 0x0D];
        assert_eq!(scale_min_k4(0, &s), (1, 5));
        assert_eq!(scale_min_k4(4, &s), (0x0A | 0x30, 0x09 | 0x20));
        assert_eq!(scale_min_k4(5, &s), (0x0B, 0x00));
    }

    #[test]
    fn quantizing_then_dequantizing_stays_within_a_step() {
        let x: Vec<f32> = (0..64).map(|i| ((i * 37 % 29) as f32 - 14.0) / 7.0).collect();
        // x spans [-2, 2]: one step of each type's grid over it, half of it as the bound (Q4_0's
        // grid is one-sided, so a whole step).
        let grids = [
            (DType::Q8_0, 1.0 / 127.0),
            (DType::Q4_0, 0.25),
            (DType::Q4_1, 0.5 * 4.0 / 15.0),
            (DType::Q5_0, 0.125),
            (DType::Q5_1, 0.5 * 4.0 / 31.0),
        ];
        for (ty, bound) in grids {
            let back = dequantize(ty, &quantize(ty, &x));
            let err = x.iter().zip(&back).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(err <= bound * 1.01, "{ty}: max error {err}");
        }
    }

    #[test]
    fn e4m3_codes_round_trip_and_round_to_nearest_even() {
        for c in (0..=255u8).filter(|c| c & 0x7F != 0x7F) {
            assert_eq!(f32_to_e4m3(e4m3_to_f32(c)), c, "code {c:#04x}");
        }
        assert!(e4m3_to_f32(0x7F).is_nan() && e4m3_to_f32(0xFF).is_nan());
        let cases = [
            (1.0, 0x38),
            (448.0, 0x7E),
            (460.0, 0x7E),
            (1e9, 0x7E),
            (-1e9, 0xFE),
            (f32::INFINITY, 0x7E),
            (2f32.powi(-9), 0x01),
            (2f32.powi(-11), 0x00),
            (15.0 / 1024.0, 0x08),
        ];
        for (v, c) in cases {
            assert_eq!(f32_to_e4m3(v), c, "{v}");
        }
        // Ties go to the even code: 1.0625 between 1.0 (0x38) and 1.125; 17 between 16 (0x58) and 18.
        assert_eq!((f32_to_e4m3(1.0625), f32_to_e4m3(17.0), f32_to_e4m3(1.0626)), (0x38, 0x58, 0x39));
    }

    #[test]
    fn fp8_rows_keep_one_scale_per_row_within_a_sixteenth() {
        let x: Vec<f32> = (0..128).map(|i| ((i * 37 % 29) as f32 - 14.0) / 7.0 * (1 + i / 64) as f32).collect();
        let q = quantize_fp8_rows(&x, 64);
        assert_eq!(q.len(), 4 * 36);
        assert_eq!(q[..4], q[36..40], "every block of a row carries the row's scale");
        assert_eq!(f32::from_le_bytes([q[72], q[73], q[74], q[75]]), 4.0 / 448.0);
        for (a, b) in x.iter().zip(dequantize(DType::F8_E4M3, &q)) {
            assert!((a - b).abs() <= a.abs() / 16.0 + 1e-6, "{a} vs {b}");
        }
    }
}
