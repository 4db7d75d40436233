// The weight formats of the fast linears (fast.cuh's GEMVs, gemm.cuh's tensor-core kernels) and
// of the tables and lm_heads of GGUF files (codegen_cuda::WFormat names them). A weight [N, K]
// is its rows' codes, K / PER 16-byte chunks a row (row_codes), then its scales (row_scales):
// - h16_t: 8 16-bit weights a chunk, no scales;
// - fp8_t: 16 E4M3 codes a chunk; one f32 scale per row and W8_GROUP columns
//   (codegen_cuda::fp8_device_layout); weight = code * scale;
// - GGUF's blocks, re-laid by codegen_cuda::block_device_layout: a row's scales are its runs'
//   parameters (a, b), two f32 per 32 weights (ir::quant::runs):
//   q4_t (Q4_0, Q4_1, Q4_K): a chunk is a run, 32 nibbles (weight i in byte i's low nibble,
//     weight i + 16 in its high one); w = fma(q, a, b);
//   q8u_t (Q5_0, Q5_1, Q5_K): a chunk is half a run, a byte a weight; w = fma(q, a, b);
//   q8s_t (Q8_0, Q6_K): a chunk is half a run, an i8 a weight; w = q * a in the first half,
//     q * b in the second.
// The GGUF decoders are plain C (no PTX): a host compiler checks them against ir::quant
// (codegen_cuda's formats tests). Every kernel computes ir::quant::value's weights exactly.

struct fp8_t {
  unsigned char b;
};
#define W8_GROUP 128
struct q4_t {
  unsigned char b;
};
struct q8s_t {
  signed char b;
};
struct q8u_t {
  unsigned char b;
};

// Per format: PER weights a chunk; GGUF, one of GGUF's. GGUF's formats also give the scale and
// offset of chunk c of a row whose scales are p (sm), and a chunk's PER weights as f32 (f32).
template <typename WT>
struct WFmt {
  static constexpr int PER = 8;
  static constexpr bool GGUF = false;
};
template <>
struct WFmt<fp8_t> {
  static constexpr int PER = 16;
  static constexpr bool GGUF = false;
};

// Byte j (0..15) of a chunk.
__device__ __forceinline__ unsigned chunk_byte(uint4 w, int j) {
  const unsigned u = j < 4 ? w.x : j < 8 ? w.y : j < 12 ? w.z : w.w;
  return (u >> (8 * (j & 3))) & 0xffu;
}

template <>
struct WFmt<q4_t> {
  static constexpr int PER = 32;
  static constexpr bool GGUF = true;
  static __device__ __forceinline__ float2 sm(const float* p, int c) { return make_float2(p[2 * c], p[2 * c + 1]); }
  static __device__ __forceinline__ void f32(uint4 w, float2 s, float* f) {
#pragma unroll
    for (int i = 0; i < 16; i++) {
      const unsigned q = chunk_byte(w, i);
      f[i] = fmaf((float)(q & 15u), s.x, s.y);
      f[i + 16] = fmaf((float)(q >> 4), s.x, s.y);
    }
  }
};

template <>
struct WFmt<q8u_t> {
  static constexpr int PER = 16;
  static constexpr bool GGUF = true;
  static __device__ __forceinline__ float2 sm(const float* p, int c) {
    return make_float2(p[2 * (c >> 1)], p[2 * (c >> 1) + 1]);
  }
  static __device__ __forceinline__ void f32(uint4 w, float2 s, float* f) {
#pragma unroll
    for (int i = 0; i < 16; i++) f[i] = fmaf((float)chunk_byte(w, i), s.x, s.y);
  }
};

template <>
struct WFmt<q8s_t> {
  static constexpr int PER = 16;
  static constexpr bool GGUF = true;
  static __device__ __forceinline__ float2 sm(const float* p, int c) { return make_float2(p[c], 0.0f); }
  static __device__ __forceinline__ void f32(uint4 w, float2 s, float* f) {
#pragma unroll
    for (int i = 0; i < 16; i++) f[i] = (float)(int)(signed char)chunk_byte(w, i) * s.x;
  }
};

// Bytes that `elems` weights of a row take in format WT (whole chunks).
template <typename WT>
__device__ __forceinline__ long wbytes(long elems) {
  return elems / WFmt<WT>::PER * 16;
}

// The chunks of row n of a weight of rows of K.
template <int K, typename WT>
__device__ __forceinline__ const uint4* row_codes(const WT* w, long n) {
  return (const uint4*)((const unsigned char*)w + wbytes<WT>(n * K));
}

// The scales of row n of a weight of N rows of K: none for h16, E4M3's per W8_GROUP columns,
// GGUF's run parameters; each after all N rows' codes.
template <int K>
__device__ __forceinline__ const float* row_scales(const h16_t*, int, long) {
  return nullptr;
}
template <int K>
__device__ __forceinline__ const float* row_scales(const fp8_t* w, int N, long n) {
  return (const float*)((const unsigned char*)w + (long)N * K) + n * (K / W8_GROUP);
}
template <int K, typename WT>
__device__ __forceinline__ const float* gguf_scales(const WT* w, int N, long n) {
  return (const float*)((const unsigned char*)w + wbytes<WT>((long)N * K)) + n * (K / 32) * 2;
}
template <int K>
__device__ __forceinline__ const float* row_scales(const q4_t* w, int N, long n) {
  return gguf_scales<K>(w, N, n);
}
template <int K>
__device__ __forceinline__ const float* row_scales(const q8s_t* w, int N, long n) {
  return gguf_scales<K>(w, N, n);
}
template <int K>
__device__ __forceinline__ const float* row_scales(const q8u_t* w, int N, long n) {
  return gguf_scales<K>(w, N, n);
}
