//! The block (quantized) weight types' values: what a block of GGUF's Q8_0, Q4_0 and Q4_1
//! means, declared once. The reference interpreter dequantizes with [`dequantize`]; every
//! backend kernel that reads blocks must produce exactly these f32 weights.

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

/// One weight from its block's `d`, `m` ([`block_params`]) and its value `q` (Q8_0's `q` is
/// the `i8`'s byte): the one formula every reader of blocks computes.
pub fn value(ty: DType, q: u8, d: f32, m: f32) -> f32 {
    if ty == DType::Q8_0 {
        q as i8 as f32 * d
    } else {
        (q as f32).mul_add(d, m)
    }
}

/// Dequantizes whole blocks of a block type to f32.
pub fn dequantize(ty: DType, bytes: &[u8]) -> Vec<f32> {
    let size = ty.block_bytes().unwrap_or_else(|| panic!("{ty} is not a block type"));
    let mut out = Vec::with_capacity(bytes.len() / size * BLOCK);
    for b in bytes.chunks_exact(size) {
        let (d, m, at) = block_params(ty, b);
        if ty == DType::Q8_0 {
            out.extend(b[at..].iter().map(|&q| value(ty, q, d, m)));
        } else {
            out.extend(nibbles(&b[at..]).iter().map(|&q| value(ty, q, d, m)));
        }
    }
    out
}

/// Quantizes f32 values (whole blocks) as llama.cpp's reference quantizers do
/// (`quantize_row_q8_0_ref`, `..._q4_0_ref`, `..._q4_1_ref`): for making test weights.
pub fn quantize(ty: DType, values: &[f32]) -> Vec<u8> {
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
                let max = x.iter().copied().fold(0.0f32, |a, v| if v.abs() > a.abs() { v } else { a });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16(d));
                let q = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
                out.extend((0..BLOCK / 2).map(|i| q(x[i]) | (q(x[i + BLOCK / 2]) << 4)));
            }
            DType::Q4_1 => {
                let (min, max) = x.iter().fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16(d));
                out.extend(f16(min));
                let q = |v: f32| (((v - min) * id + 0.5) as i8).min(15) as u8;
                out.extend((0..BLOCK / 2).map(|i| q(x[i]) | (q(x[i + BLOCK / 2]) << 4)));
            }
            d => panic!("{d} is not a block type"),
        }
    }
    out
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
    }

    #[test]
    fn quantizing_then_dequantizing_stays_within_a_step() {
        let x: Vec<f32> = (0..64).map(|i| ((i * 37 % 29) as f32 - 14.0) / 7.0).collect();
        // x spans [-2, 2]: one step of each type's grid over it, half of it as the bound (Q4_0's
        // grid is one-sided, so a whole step).
        for (ty, bound) in [(DType::Q8_0, 1.0 / 127.0), (DType::Q4_0, 0.25), (DType::Q4_1, 0.5 * 4.0 / 15.0)] {
            let back = dequantize(ty, &quantize(ty, &x));
            let err = x.iter().zip(&back).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(err <= bound * 1.01, "{ty}: max error {err}");
        }
    }
}
