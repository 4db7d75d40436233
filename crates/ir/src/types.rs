//! Element types, dimensions and tensor types.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16.
    BF16,
    /// 32-bit signed integer (token ids, positions).
    I32,
    /// GGUF's Q8_0 block type, a weight's storage only: blocks of 32 along the last
    /// dimension, each an f16 scale `d` and 32 `i8` values `q`; `w = q·d`.
    #[serde(rename = "q8_0")]
    Q8_0,
    /// GGUF's Q4_0: blocks of 32, each an f16 `d` and 16 bytes of 4-bit `q` (byte `i` holds
    /// element `i` in its low nibble and element `i + 16` in its high one); `w = (q - 8)·d`.
    #[serde(rename = "q4_0")]
    Q4_0,
    /// GGUF's Q4_1: blocks of 32, each an f16 `d`, an f16 `m` and the nibbles of Q4_0;
    /// `w = fma(q, d, m)` (one rounding; gguf-py's `d·q + m` rounds twice: within one ulp).
    #[serde(rename = "q4_1")]
    Q4_1,
    /// GGUF's Q5_0: blocks of 32 (22 bytes), each an f16 `d`, 32 bits of each value's fifth
    /// bit (`qh`, little-endian) and Q4_0's 16 bytes of low 4 bits; `w = (q - 16)·d`. llama.cpp
    /// writes it for the tensors of a k-quant file whose rows are not whole super-blocks of 256.
    #[serde(rename = "q5_0")]
    Q5_0,
    /// GGUF's Q5_1: blocks of 32 (24 bytes): f16 `d`, f16 `m`, then Q5_0's `qh` and low bits;
    /// `w = q·d + m`.
    #[serde(rename = "q5_1")]
    Q5_1,
    /// GGUF's Q4_K: super-blocks of 256 (144 bytes): f16 `d` and `dmin`, 12 bytes packing
    /// eight 6-bit sub-block scales `sc` and mins `m`, 128 bytes of 4-bit `q`; each sub-block
    /// of 32 is `w = (d·sc)·q - dmin·m` ([`crate::quant`] says where each bit is).
    #[serde(rename = "q4_k")]
    #[allow(non_camel_case_types)] // GGUF's spelling
    Q4_K,
    /// GGUF's Q5_K: super-blocks of 256 (176 bytes): Q4_K's `d`, `dmin` and scales, 32 bytes
    /// of each value's fifth bit, 128 bytes of its low 4 bits; `w = (d·sc)·q - dmin·m`.
    #[serde(rename = "q5_k")]
    #[allow(non_camel_case_types)] // GGUF's spelling
    Q5_K,
    /// GGUF's Q6_K: super-blocks of 256 (210 bytes): 128 bytes of low 4 bits, 64 of high 2
    /// bits, sixteen `i8` scales `sc` (one per 16 values), f16 `d`; `w = (d·sc)·(q - 32)`.
    #[serde(rename = "q6_k")]
    #[allow(non_camel_case_types)] // GGUF's spelling
    Q6_K,
    /// FP8 E4M3 (OCP: 4 exponent bits, bias 7, 3 mantissa bits, no infinities, ±448 at most)
    /// in blocks of 32 along the row, each led by its f32 scale `s` (36 bytes); `w = e4m3(q)·s`.
    /// One scale per block holds a per-channel, per-tensor or 128x128 block-wise scale exactly.
    #[serde(rename = "f8_e4m3")]
    #[allow(non_camel_case_types)] // the format's spelling
    F8_E4M3,
}

/// The block length (elements) of the legacy block types Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 (the
/// k-quants' super-blocks are 256: [`DType::block`]).
pub const BLOCK: usize = 32;

impl DType {
    /// Every element type, dense first (the text parser's and the checkpoint reader's list).
    pub const ALL: [DType; 13] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::F8_E4M3,
    ];

    /// Size of one element in bytes, for the dense types (a block type has no size per
    /// element: see [`DType::bytes`]; asking is a bug of the caller, and panics).
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            _ => panic!("{self} is a block type: use DType::bytes"),
        }
    }

    /// A block type's block: its length in elements and its size in bytes (GGUF's
    /// `GGML_QUANT_SIZES`); `None` for the dense types.
    pub fn block(self) -> Option<(usize, usize)> {
        match self {
            DType::Q8_0 => Some((BLOCK, 34)),
            DType::Q4_0 => Some((BLOCK, 18)),
            DType::Q4_1 => Some((BLOCK, 20)),
            DType::Q5_0 => Some((BLOCK, 22)),
            DType::Q5_1 => Some((BLOCK, 24)),
            DType::Q4_K => Some((256, 144)),
            DType::Q5_K => Some((256, 176)),
            DType::Q6_K => Some((256, 210)),
            DType::F8_E4M3 => Some((BLOCK, 36)),
            DType::F32 | DType::F16 | DType::BF16 | DType::I32 => None,
        }
    }

    /// Whether this is a block (quantized) type.
    pub fn is_block(self) -> bool {
        self.block().is_some()
    }

    /// Bytes that `n` elements take (for a block type `n` must be whole blocks of its length:
    /// `None` if not).
    pub fn bytes(self, n: usize) -> Option<usize> {
        match self.block() {
            Some((len, b)) => n.is_multiple_of(len).then_some(n / len * b),
            None => Some(n * self.size()),
        }
    }

    /// Parses `bf16`, `f16`, `f32` (and the HF spellings `bfloat16`, `float16`, `float32`).
    pub fn parse_float(s: &str) -> Option<DType> {
        match s {
            "bf16" | "bfloat16" => Some(DType::BF16),
            "f16" | "fp16" | "float16" | "half" => Some(DType::F16),
            "f32" | "fp32" | "float32" | "float" => Some(DType::F32),
            _ => None,
        }
    }

    /// Whether this is a dense floating-point type (elementwise ops read it).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::Q8_0 => "q8_0",
            DType::Q4_0 => "q4_0",
            DType::Q4_1 => "q4_1",
            DType::Q5_0 => "q5_0",
            DType::Q5_1 => "q5_1",
            DType::Q4_K => "q4_k",
            DType::Q5_K => "q5_k",
            DType::Q6_K => "q6_k",
            DType::F8_E4M3 => "f8_e4m3",
        })
    }
}

/// One dimension of a shape: concrete after binding, except the step's token count `T` and the
/// number `R` of rows whose logits the runtime asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Dim {
    /// The number of tokens in the step.
    T,
    /// The number of logit rows requested.
    R,
    /// A concrete size.
    N(usize),
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::T => f.write_str("T"),
            Dim::R => f.write_str("R"),
            Dim::N(n) => write!(f, "{n}"),
        }
    }
}

/// Shape and element type of a value.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorType {
    /// Dimensions, outermost first.
    pub shape: Vec<Dim>,
    /// Element type.
    pub dtype: DType,
}

impl TensorType {
    /// A type from parts.
    pub fn new(shape: Vec<Dim>, dtype: DType) -> Self {
        TensorType { shape, dtype }
    }

    /// A concrete shape.
    pub fn fixed(shape: &[usize], dtype: DType) -> Self {
        TensorType::new(shape.iter().map(|&n| Dim::N(n)).collect(), dtype)
    }

    /// The size of dimension `i` when it is concrete.
    pub fn dim(&self, i: usize) -> Option<usize> {
        match self.shape.get(i) {
            Some(Dim::N(n)) => Some(*n),
            _ => None,
        }
    }

    /// The size of the last dimension when it is concrete.
    pub fn last(&self) -> Option<usize> {
        self.shape.len().checked_sub(1).and_then(|i| self.dim(i))
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dims: Vec<String> = self.shape.iter().map(Dim::to_string).collect();
        write!(f, "[{}] {}", dims.join(", "), self.dtype)
    }
}

impl DType {
    /// Decodes little-endian values of this type into f32 (integers are converted, blocks
    /// dequantized: [`crate::quant::dequantize`]).
    pub fn to_f32(self, bytes: &[u8]) -> Vec<f32> {
        match self {
            DType::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            DType::I32 => bytes.chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f32).collect(),
            DType::BF16 => bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            DType::F16 => bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            DType::Q8_0
            | DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::Q4_K
            | DType::Q5_K
            | DType::Q6_K
            | DType::F8_E4M3 => crate::quant::dequantize(self, bytes),
        }
    }

    /// Encodes f32 values as little-endian values of this type (round to nearest even); a
    /// block type is quantized ([`crate::quant::quantize`]: Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1;
    /// a k-quant panics).
    pub fn from_f32(self, values: &[f32]) -> Vec<u8> {
        let encode: fn(f32, &mut Vec<u8>) = match self {
            DType::F32 => |v, out| out.extend_from_slice(&v.to_le_bytes()),
            DType::I32 => |v, out| out.extend_from_slice(&(v as i32).to_le_bytes()),
            DType::BF16 => |v, out| out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
            DType::F16 => |v, out| out.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
            DType::Q8_0
            | DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::Q4_K
            | DType::Q5_K
            | DType::Q6_K
            | DType::F8_E4M3 => return crate::quant::quantize(self, values),
        };
        let mut out = Vec::with_capacity(values.len() * self.size());
        values.iter().for_each(|&v| encode(v, &mut out));
        out
    }

    /// The safetensors spelling (`BF16`, `F16`, `F32`, `I32`; a block type's bytes are `U8`).
    pub fn safetensors_name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I32 => "I32",
            DType::Q8_0
            | DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::Q4_K
            | DType::Q5_K
            | DType::Q6_K
            | DType::F8_E4M3 => "U8",
        }
    }

    /// Parses the safetensors spelling.
    pub fn from_safetensors_name(s: &str) -> Option<DType> {
        match s {
            "F32" => Some(DType::F32),
            "F16" => Some(DType::F16),
            "BF16" => Some(DType::BF16),
            "I32" => Some(DType::I32),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_round_trip() {
        let v = [1.0f32, -2.5, 0.15625, 65504.0];
        for d in [DType::F32, DType::F16, DType::BF16] {
            let back = d.to_f32(&d.from_f32(&v));
            assert_eq!(back[..3], v[..3], "{d}");
        }
        assert_eq!(DType::BF16.to_f32(&DType::BF16.from_f32(&[1.003_906_3]))[0], 1.0);
    }

    #[test]
    fn k_quants_are_super_blocks_of_256() {
        for (d, name, bytes) in [(DType::Q4_K, "q4_k", 144), (DType::Q5_K, "q5_k", 176), (DType::Q6_K, "q6_k", 210)] {
            assert_eq!((d.to_string(), serde_json::to_string(&d).unwrap()), (name.into(), format!("\"{name}\"")));
            assert_eq!(serde_json::from_str::<DType>(&format!("\"{name}\"")).unwrap(), d);
            assert_eq!((d.block(), d.bytes(512), d.bytes(32)), (Some((256, bytes)), Some(2 * bytes), None));
            assert!(d.is_block() && !d.is_float());
        }
        assert_eq!(
            (DType::Q4_1.block(), DType::Q4_1.bytes(64), DType::F16.block()),
            (Some((BLOCK, 20)), Some(40), None)
        );
        assert_eq!(DType::ALL.iter().filter(|d| d.is_block()).count(), 9);
        for (d, name, bytes) in [(DType::Q5_0, "q5_0", 22), (DType::Q5_1, "q5_1", 24)] {
            assert_eq!(serde_json::from_str::<DType>(&format!("\"{name}\"")).unwrap(), d);
            assert_eq!((d.to_string(), d.block(), d.bytes(64)), (name.into(), Some((BLOCK, bytes)), Some(2 * bytes)));
        }
        assert_eq!((DType::F8_E4M3.block(), DType::F8_E4M3.to_string()), (Some((BLOCK, 36)), "f8_e4m3".into()));
    }
}
