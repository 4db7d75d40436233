//! The weight formats the fast linear kernels read ([`WFormat`]: the program's 16-bit float,
//! E4M3, and GGUF's block types re-laid for the GPU), and the device layout of the GGUF ones
//! ([`block_device_layout`]; E4M3's is [`crate::fp8_device_layout`]).
//!
//! A GGUF weight `[n, k]` on the device, as `kernels/formats.cuh` reads it: first its codes,
//! row by row, `k / PER` 16-byte chunks a row, then its run parameters, row by row, two f32
//! `(a, b)` per run of 32 weights (`ir::quant::runs`, the decomposition the CPU layout is made
//! of too). A chunk is a run of 32 for the 4-bit types (`q4_t`: Q4_0, Q4_1, Q4_K; GGUF's
//! nibbles, `w = fma(q, a, b)`) and half a run for the byte types (`q8u_t`: Q5_0, Q5_1 and
//! Q5_K, `w = fma(q, a, b)`; `q8s_t`: Q8_0 and Q6_K, `w = q·a` for the first half and `q·b` for the second). So a
//! weight takes 6 bits (4-bit types) or 10 bits (byte types), the parameters widened to f32
//! once so that the kernels compute `ir::quant::value` exactly.

use crate::CodegenError;
use ir::DType;

/// How a fast linear's weight is stored on the device: the C type the kernels are
/// instantiated with (`kernels/formats.cuh`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WFormat {
    /// The program's 16-bit float (`h16_t`).
    H16,
    /// FP8 E4M3 codes with f32 scales per row and 128 columns (`fp8_t`).
    E4m3,
    /// GGUF's 4-bit blocks (Q4_0, Q4_1, Q4_K) as 4-bit codes and a scale and offset per 32
    /// (`q4_t`).
    Q4,
    /// GGUF's signed byte blocks (Q8_0, Q6_K) as `i8` codes and a scale per 16 (`q8s_t`).
    S8,
    /// GGUF's Q5_0, Q5_1 and Q5_K as `u8` codes and a scale and offset per 32 (`q8u_t`).
    U8,
}

impl WFormat {
    /// Every format, in the order launches of one input are emitted.
    pub const ALL: [WFormat; 5] = [WFormat::H16, WFormat::E4m3, WFormat::Q4, WFormat::S8, WFormat::U8];

    /// The format the fast kernels read a weight of `dtype` in, in a program whose 16-bit
    /// float is `half`; `None` for one they do not (f32, the other 16-bit float).
    pub fn of(dtype: DType, half: DType) -> Option<WFormat> {
        match dtype {
            DType::F8_E4M3 => Some(WFormat::E4m3),
            d if d == half => Some(WFormat::H16),
            d => WFormat::gguf_of(d),
        }
    }

    /// The GGUF format the kernels read a GGUF block type in; `None` for any other type.
    pub fn gguf_of(dtype: DType) -> Option<WFormat> {
        match dtype {
            DType::Q4_0 | DType::Q4_1 | DType::Q4_K => Some(WFormat::Q4),
            DType::Q8_0 | DType::Q6_K => Some(WFormat::S8),
            DType::Q5_0 | DType::Q5_1 | DType::Q5_K => Some(WFormat::U8),
            _ => None,
        }
    }

    /// Whether this is one of GGUF's block formats.
    pub fn gguf(self) -> bool {
        matches!(self, WFormat::Q4 | WFormat::S8 | WFormat::U8)
    }

    /// The kernels' C type of the weight.
    pub fn ctype(self) -> &'static str {
        match self {
            WFormat::H16 => "h16_t",
            WFormat::E4m3 => "fp8_t",
            WFormat::Q4 => "q4_t",
            WFormat::S8 => "q8s_t",
            WFormat::U8 => "q8u_t",
        }
    }

    /// The suffix of kernel names of this format (none for the 16-bit float).
    pub fn suffix(self) -> &'static str {
        match self {
            WFormat::H16 => "",
            WFormat::E4m3 => "_f8",
            WFormat::Q4 => "_q4",
            WFormat::S8 => "_s8",
            WFormat::U8 => "_u8",
        }
    }

    /// Weights in one 16-byte chunk of codes (`WFmt<WT>::PER` of `kernels/formats.cuh`).
    pub fn per_chunk(self) -> usize {
        match self {
            WFormat::H16 => 8,
            WFormat::Q4 => 32,
            WFormat::E4m3 | WFormat::S8 | WFormat::U8 => 16,
        }
    }

    /// Whether the small-batch tensor-core kernel takes rows of `k` weights: each warp of it
    /// reads four chunks of a row at a time.
    pub fn skinny_takes(self, k: usize) -> bool {
        k.is_multiple_of(4 * self.per_chunk())
    }

    /// The number the GEMM choices file records the format under (0 and 1 were its `w8`
    /// column's values).
    pub fn number(self) -> usize {
        self as usize
    }

    /// The format recorded as [`WFormat::number`] `n`.
    pub fn from_number(n: usize) -> Option<WFormat> {
        WFormat::ALL.get(n).copied()
    }
}

/// A GGUF block weight (`dtype` Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K) of `n` rows of `k` in the
/// device layout (module docs); `name` is for the error.
pub fn block_device_layout(
    name: &str,
    dtype: DType,
    bytes: &[u8],
    n: usize,
    k: usize,
) -> Result<Vec<u8>, CodegenError> {
    let format = WFormat::gguf_of(dtype);
    let want = dtype.bytes(n * k).filter(|_| k.is_multiple_of(dtype.block().map_or(1, |b| b.0)));
    let Some(format) = format.filter(|_| want == Some(bytes.len())) else {
        return Err(CodegenError::Unsupported(format!(
            "weight `{name}`: {} bytes are not [{n}, {k}] in whole {dtype} blocks",
            bytes.len()
        )));
    };
    let mut codes = Vec::with_capacity(n * k * 16 / format.per_chunk() + n * k / 4);
    let mut params = Vec::with_capacity(n * k / 4);
    ir::quant::runs(dtype, bytes, |a, b, q| {
        codes.extend_from_slice(q);
        params.extend(a.to_le_bytes());
        params.extend(b.to_le_bytes());
    });
    codes.extend(params);
    Ok(codes)
}

#[cfg(test)]
mod tests {
    use super::{block_device_layout, WFormat};
    use ir::DType;

    /// Random bytes of `blocks` blocks of `dtype` whose f16 scales are normal numbers.
    pub(crate) fn random_blocks(dtype: DType, blocks: usize, seed: u64) -> Vec<u8> {
        let (_, size) = dtype.block().unwrap();
        let mut s = seed;
        let mut next = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 33) as u8
        };
        let mut out: Vec<u8> = (0..blocks * size).map(|_| next()).collect();
        // The f16 fields: d (and Q4_1's and Q5_1's m, the k-quants' dmin) between 2^-10 and 2^-6.
        let f16_at: &[usize] = match dtype {
            DType::Q8_0 | DType::Q4_0 | DType::Q5_0 => &[0],
            DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
            DType::Q6_K => &[208],
            _ => unreachable!(),
        };
        for b in out.chunks_exact_mut(size) {
            for &at in f16_at {
                let v = half::f16::from_f32((1 + b[at + 1] % 15) as f32 / 1024.0);
                b[at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        out
    }

    /// The weights the layout holds: chunk `c` of row `r` with its run's parameters, decoded as
    /// `kernels/formats.cuh` decodes it.
    pub(crate) fn decode(format: WFormat, dev: &[u8], n: usize, k: usize) -> Vec<f32> {
        let row_codes = k / format.per_chunk() * 16;
        let (codes, params) = dev.split_at(n * row_codes);
        let f = |at: usize| f32::from_le_bytes(params[4 * at..4 * at + 4].try_into().unwrap());
        let mut out = Vec::with_capacity(n * k);
        for r in 0..n {
            for c in 0..k / format.per_chunk() {
                let chunk = &codes[r * row_codes + 16 * c..][..16];
                let run = r * (k / 32) + c * format.per_chunk() / 32;
                let (a, b) = (f(2 * run), f(2 * run + 1));
                match format {
                    WFormat::Q4 => {
                        out.extend(chunk.iter().map(|&q| ((q & 15) as f32).mul_add(a, b)));
                        out.extend(chunk.iter().map(|&q| ((q >> 4) as f32).mul_add(a, b)));
                    }
                    WFormat::U8 => out.extend(chunk.iter().map(|&q| (q as f32).mul_add(a, b))),
                    WFormat::S8 => {
                        let s = if c % 2 == 0 { a } else { b };
                        out.extend(chunk.iter().map(|&q| q as i8 as f32 * s));
                    }
                    _ => unreachable!(),
                }
            }
        }
        out
    }

    /// Every GGUF block type's device layout holds exactly `ir::quant::dequantize`'s weights.
    #[test]
    fn device_layouts_hold_the_blocks_weights() {
        for dtype in
            [DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q4_K, DType::Q5_K, DType::Q6_K]
        {
            let format = WFormat::gguf_of(dtype).unwrap();
            let (n, k) = (3, 512);
            let bytes = random_blocks(dtype, n * k / dtype.block().unwrap().0, 7);
            let dev = block_device_layout("w", dtype, &bytes, n, k).unwrap();
            assert_eq!(dev.len(), n * k * 16 / format.per_chunk() + n * k / 4, "{dtype}");
            let want = ir::quant::dequantize(dtype, &bytes);
            let got = decode(format, &dev, n, k);
            assert!(want.iter().all(|v| v.is_finite()));
            assert_eq!(got.len(), want.len());
            let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{dtype}: the device layout's weights differ from the blocks'");
        }
    }

    /// A weight whose bytes are not its shape's blocks is refused, naming it.
    #[test]
    fn wrong_sizes_are_refused() {
        let bytes = random_blocks(DType::Q4_K, 2, 1);
        let e = block_device_layout("layers.0.q", DType::Q4_K, &bytes, 3, 256).unwrap_err().to_string();
        assert!(e.contains("layers.0.q") && e.contains("q4_k"), "{e}");
        assert!(block_device_layout("w", DType::F8_E4M3, &bytes, 1, 256).is_err());
    }

    /// The formats' numbers keep the choices file's old `w8` column (0: 16-bit, 1: E4M3).
    #[test]
    fn format_numbers_round_trip() {
        assert_eq!(WFormat::H16.number(), 0);
        assert_eq!(WFormat::E4m3.number(), 1);
        for f in WFormat::ALL {
            assert_eq!(WFormat::from_number(f.number()), Some(f));
        }
    }

    /// The host's C++ compiler (`$CXX`, else `c++`) over `kernels/formats.cuh` with a shim for
    /// the CUDA qualifiers and vector types: a program that decodes a device layout of `n` rows
    /// of `k` (512 or 96; format given by its C type, bytes on stdin) into f32 bits on stdout.
    const HOST_MAIN: &str = r#"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
template <typename WT, int K>
static void decode(const WT* w, int n, float* out) {
  constexpr int PER = WFmt<WT>::PER;
  for (int r = 0; r < n; r++) {
    const uint4* codes = row_codes<K>(w, r);
    const float* p = row_scales<K>(w, n, r);
    for (int c = 0; c < K / PER; c++) WFmt<WT>::f32(codes[c], WFmt<WT>::sm(p, c), out + (long)r * K + c * PER);
  }
}
template <int K>
static int decode_as(const char* ctype, const uint4* buf, int n, float* out) {
  if (!strcmp(ctype, "q4_t")) decode<q4_t, K>((const q4_t*)buf, n, out);
  else if (!strcmp(ctype, "q8s_t")) decode<q8s_t, K>((const q8s_t*)buf, n, out);
  else if (!strcmp(ctype, "q8u_t")) decode<q8u_t, K>((const q8u_t*)buf, n, out);
  else return 2;
  return 0;
}
int main(int argc, char** argv) {
  const int n = atoi(argv[2]), k = atoi(argv[3]);
  std::vector<uint4> buf(1 << 20);
  const size_t got = fread(buf.data(), 1, buf.size() * sizeof(uint4), stdin);
  (void)got;
  std::vector<float> out((size_t)n * k);
  const int rc = k == 512 ? decode_as<512>(argv[1], buf.data(), n, out.data())
               : k == 96  ? decode_as<96>(argv[1], buf.data(), n, out.data())
                          : 2;
  if (rc) return rc;
  fwrite(out.data(), sizeof(float), out.size(), stdout);
  return 0;
}
"#;

    const HOST_SHIM: &str = "#include <cmath>\n#define __device__\n#define __forceinline__ inline\n\
        struct uint4 { unsigned x, y, z, w; };\nstruct float2 { float x, y; };\n\
        static inline float2 make_float2(float x, float y) { return {x, y}; }\n\
        struct h16_t { unsigned short b; };\n";

    /// The kernels' GGUF decoders (`kernels/formats.cuh`, compiled for the host) read every
    /// block type's device layout as `ir::quant::dequantize` dequantizes its blocks, bit for
    /// bit.
    #[test]
    fn the_kernels_decoders_give_the_blocks_weights() {
        use std::io::Write;
        use std::process::{Command, Stdio};
        let dir = std::env::temp_dir().join(format!("formats-host-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("formats.cpp");
        std::fs::write(&src, format!("{HOST_SHIM}{}{HOST_MAIN}", crate::FORMATS)).unwrap();
        let exe = dir.join("formats");
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let o = Command::new(&cxx)
            .args(["-std=c++17", "-O1", "-ffp-contract=off", "-o"])
            .arg(&exe)
            .arg(&src)
            .output()
            .unwrap_or_else(|e| panic!("running the host C++ compiler `{cxx}`: {e}"));
        assert!(
            o.status.success(),
            "formats.cuh does not compile for the host: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        for dtype in
            [DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q4_K, DType::Q5_K, DType::Q6_K]
        {
            let format = WFormat::gguf_of(dtype).unwrap();
            // Rows of whole super-blocks, and (for the types of blocks of 32) rows of 96, as
            // llama.cpp's k-quant mixes give Q5_0 / Q8_0 tensors whose rows are not.
            let shapes = [(5, 512), (3, 96)].into_iter().filter(|(_, k)| k % dtype.block().unwrap().0 == 0);
            for (n, k) in shapes {
                let bytes = random_blocks(dtype, n * k / dtype.block().unwrap().0, 11);
                let dev = block_device_layout("w", dtype, &bytes, n, k).unwrap();
                let mut child = Command::new(&exe)
                    .args([format.ctype(), &n.to_string(), &k.to_string()])
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .spawn()
                    .unwrap();
                child.stdin.take().unwrap().write_all(&dev).unwrap();
                let out = child.wait_with_output().unwrap();
                assert!(out.status.success(), "{dtype} k={k}: the host decoder failed");
                let got: Vec<f32> =
                    out.stdout.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
                let want = ir::quant::dequantize(dtype, &bytes);
                assert_eq!(got.len(), want.len(), "{dtype} k={k}");
                let bad = got.iter().zip(&want).position(|(a, b)| a.to_bits() != b.to_bits());
                assert!(
                    bad.is_none(),
                    "{dtype} k={k}: weight {bad:?} decodes to {:?}, not {:?}",
                    bad.map(|i| got[i]),
                    bad.map(|i| want[i])
                );
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
