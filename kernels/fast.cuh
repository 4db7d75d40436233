// Fused and tensor-core kernels: what the CUDA backend runs. Inputs of every linear are 16-bit
// activations (h16_t: bf16 or f16, as a 16-bit model computes them); the residual stream, norms,
// softmax and all accumulation are f32. The KV cache is h16_t too. basic.cuh keeps the unfused reference kernels
// for shapes these do not cover.

__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(h16_t* p, float v) { *p = f32_to_h16(v); }

// Two 16-bit floats (one 32-bit word) to f32.
__device__ __forceinline__ void unpack2(unsigned u, float* f) {
#if H16_F16
  asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %2; cvt.f32.f16 %0, lo; cvt.f32.f16 %1, hi; }"
      : "=f"(f[0]), "=f"(f[1]) : "r"(u));
#else
  f[0] = __uint_as_float(u << 16);
  f[1] = __uint_as_float(u & 0xffff0000u);
#endif
}

// 8 16-bit floats (16 bytes) to f32.
__device__ __forceinline__ void unpack8(uint4 u, float* f) {
  unpack2(u.x, f);
  unpack2(u.y, f + 2);
  unpack2(u.z, f + 4);
  unpack2(u.w, f + 6);
}

// A 16-byte load that bypasses L1 (weights are streamed once per step).
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// The same load kept in program order with other volatile asm (the GEMVs issue their weight
// loads before pdl_wait, and the compiler must not sink them below it).
__device__ __forceinline__ uint4 ld_stream_first(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ float dot8(uint4 w, uint4 x) {
  float a[8], b[8];
  unpack8(w, a);
  unpack8(x, b);
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; i++) s = fmaf(a[i], b[i], s);
  return s;
}

// ---- FP8 E4M3 weights ----
// A linear's E4M3 weight [N, K] on the device (a --quant fp8 bundle or an FP8 checkpoint): its
// codes, N * K bytes row by row, then one f32 scale per row and W8_GROUP columns ([N, K / W8_GROUP]);
// weight = code * scale (row_scales). The runtime lays it out so (codegen_cuda::fp8_device_layout).
struct fp8_t {
  unsigned char b;
};
#define W8_GROUP 128

// Weights per 16-byte chunk: 8 h16 or 16 E4M3 codes.
template <typename WT>
struct WFmt {
  static constexpr int PER = 8;
};
template <>
struct WFmt<fp8_t> {
  static constexpr int PER = 16;
};

// Two E4M3 codes (the low byte first) as f16x2, exactly (every E4M3 value is an f16).
__device__ __forceinline__ unsigned e4m3x2_f16x2(unsigned short c) {
  unsigned h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(c));
  return h;
}

// 16 E4M3 codes (16 bytes) to f32.
__device__ __forceinline__ void e4m3x16(uint4 w, float* f) {
  const unsigned u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; i++)
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const unsigned p = e4m3x2_f16x2((unsigned short)(u[i] >> (16 * h)));
      asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %2; cvt.f32.f16 %0, lo; cvt.f32.f16 %1, hi; }"
          : "=f"(f[4 * i + 2 * h]), "=f"(f[4 * i + 2 * h + 1]) : "r"(p));
    }
}

// Two f32 as an h16 pair (lo in the low half), rounded to nearest even.
__device__ __forceinline__ unsigned pack_h16x2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn." H16_PTX "x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// 16 E4M3 codes times s as 16 h16 (two 16-byte chunks, codes 0-7 then 8-15); exact where s is 1.
__device__ __forceinline__ void e4m3x16_h16(uint4 w, float s, uint4& lo, uint4& hi) {
  float f[16];
  e4m3x16(w, f);
  lo = make_uint4(pack_h16x2(f[0] * s, f[1] * s), pack_h16x2(f[2] * s, f[3] * s), pack_h16x2(f[4] * s, f[5] * s),
                  pack_h16x2(f[6] * s, f[7] * s));
  hi = make_uint4(pack_h16x2(f[8] * s, f[9] * s), pack_h16x2(f[10] * s, f[11] * s),
                  pack_h16x2(f[12] * s, f[13] * s), pack_h16x2(f[14] * s, f[15] * s));
}

// Eight f32 as eight E4M3 codes (8 bytes, the first value in the low byte), rounded to nearest
// even and saturated to +-448.
__device__ __forceinline__ uint2 f32x8_e4m3(const float* f) {
  unsigned short c[4];
#pragma unroll
  for (int i = 0; i < 4; i++) asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(c[i]) : "f"(f[2 * i + 1]), "f"(f[2 * i]));
  return make_uint2(c[0] | ((unsigned)c[1] << 16), c[2] | ((unsigned)c[3] << 16));
}

// The activations of an FP8 tensor-core GEMM (W8A8 through cuBLASLt): x's rows of K as E4M3
// codes q ([T, K]) with one f32 scale per row and `group` columns, s = max|x| / 448,
// q = e4m3(x / s); a group of zeros has s = 1. Group K: s [T], cuBLASLt's outer-vector scales;
// group 128: s [K / 128, T] (the rows of a group contiguous), its 1 x 128 block scales.
// grid: (T, ceil(K / 512) for group 128, else 1), block: 128. Group 128: a warp per group, four
// values a lane; else the block over the row.
__device__ void quant_e4m3(const h16_t* __restrict__ x, unsigned char* __restrict__ q, float* __restrict__ s, int K,
                           int group) {
  const long row = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const h16_t* xr = x + row * K;
  unsigned char* qr = q + row * K;
  if (group == 128) {
    const int g = blockIdx.y * 4 + warp;
    if (g * 128 >= K) return;
    const uint2 raw = *reinterpret_cast<const uint2*>(xr + g * 128 + lane * 4);
    const h16_t* h = reinterpret_cast<const h16_t*>(&raw);
    float f[8], m = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) m = fmaxf(m, fabsf(f[i] = to_f32(h[i])));
    m = warp_max(m);
    const float sc = m > 0.0f ? m / 448.0f : 1.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) f[i] /= sc;
    f[4] = f[5] = f[6] = f[7] = 0.0f;
    *reinterpret_cast<unsigned*>(qr + g * 128 + lane * 4) = f32x8_e4m3(f).x;
    if (lane == 0) s[(long)g * gridDim.x + row] = sc;
    return;
  }
  float m = 0.0f;
  for (int i = threadIdx.x * 8; i < K; i += blockDim.x * 8) {
    const uint4 raw = *reinterpret_cast<const uint4*>(xr + i);
    const h16_t* h = reinterpret_cast<const h16_t*>(&raw);
#pragma unroll
    for (int j = 0; j < 8; j++) m = fmaxf(m, fabsf(to_f32(h[j])));
  }
  __shared__ float part[32];
  m = warp_max(m);
  if (lane == 0) part[warp] = m;
  __syncthreads();
  m = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.0f;
  m = warp_max(m);
  const float sc = m > 0.0f ? m / 448.0f : 1.0f;
  for (int i = threadIdx.x * 8; i < K; i += blockDim.x * 8) {
    const uint4 raw = *reinterpret_cast<const uint4*>(xr + i);
    const h16_t* h = reinterpret_cast<const h16_t*>(&raw);
    float f[8];
#pragma unroll
    for (int j = 0; j < 8; j++) f[j] = to_f32(h[j]) / sc;
    *reinterpret_cast<uint2*>(qr + i) = f32x8_e4m3(f);
  }
  if (threadIdx.x == 0) s[row] = sc;
}

// ---- residual add + RMS norm ----
// One row: v = a (+ b), written to s when s is not null; out = v * rsqrt(mean(v^2) + eps) * w.
// With PRE, b is normalised first: v = a + b * rsqrt(mean(b^2) + peps) * pw (Gemma's norm of a
// sublayer's output before the residual add). A block of 256 threads. Every operand is loaded
// before the first reduction, the weights (which no kernel writes) before pdl_wait, so a row
// costs one memory round trip once the previous kernel has ended.
template <int H, typename W, typename O, bool PRE = false, typename PW = float>
__device__ __forceinline__ void norm_row(const float* a, const float* b, float* s, const W* w, O* out, float eps,
                                         const PW* pw = nullptr, float peps = 0.0f) {
  constexpr int PER = (H + 255) / 256;
  float v[PER], u[PER], wv[PER], pv[PER];
#pragma unroll
  for (int j = 0; j < PER; j++) {
    const int i = threadIdx.x + j * 256;
    wv[j] = i < H ? to_f32(w[i]) : 0.0f;
    pv[j] = PRE && i < H ? to_f32(pw[i]) : 0.0f;
  }
  pdl_wait();
#pragma unroll
  for (int j = 0; j < PER; j++) {
    const int i = threadIdx.x + j * 256;
    v[j] = i < H ? a[i] : 0.0f;
    u[j] = i < H && b ? b[i] : 0.0f;
  }
  float pre = 1.0f;
  if (PRE) {
    float sb = 0.0f;
#pragma unroll
    for (int j = 0; j < PER; j++) sb += u[j] * u[j];
    pre = rsqrtf(block_sum(sb) / H + peps);
  }
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < PER; j++) {
    const int i = threadIdx.x + j * 256;
    if (i < H) {
      v[j] = PRE ? v[j] + u[j] * pre * pv[j] : b ? v[j] + u[j] : v[j];
      if (s) s[i] = v[j];
      ss += v[j] * v[j];
    }
  }
  const float r = rsqrtf(block_sum(ss) / H + eps);
#pragma unroll
  for (int j = 0; j < PER; j++) {
    const int i = threadIdx.x + j * 256;
    if (i < H) store(out + i, v[j] * r * wv[j]);
  }
}

// s = a (+ b), written to s when ADD; out = s * rsqrt(mean(s^2) + eps) * w.
// grid: T, block: 256.
template <int H, typename W, bool ADD, typename O>
__device__ void add_rms_norm(const float* a, const float* b, float* s, const W* w, O* out, float eps) {
  const long base = (long)blockIdx.x * H;
  norm_row<H>(a + base, ADD ? b + base : nullptr, ADD ? s + base : nullptr, w, out + base, eps);
}

// s = a + rms_norm(b) with weight pw (eps peps), written to s; out = rms_norm(s) with w.
// grid: T, block: 256.
template <int H, typename W, typename PW, typename O>
__device__ void norm_add_rms_norm(const float* a, const float* b, float* s, const W* w, O* out, float eps,
                                  const PW* pw, float peps) {
  const long base = (long)blockIdx.x * H;
  norm_row<H, W, O, true, PW>(a + base, b + base, s + base, w, out + base, eps, pw, peps);
}

// ---- decode linear: memory-bound GEMV over up to ROWS (<= 8) rows ----
// Where the GEMV's 16-bit input rows come from: X16, the linear's input as it is; XNorm, an RMS
// norm (with its residual add when ADD) whose only readers are this launch's linears: every
// block normalises the rows into shared memory itself (after issuing its weight loads, so the
// two overlap), exactly as add_rms_norm would, and block 0 writes the residual sum s.
struct X16 {
  const h16_t* x;
  template <int K, int ROWS>
  __device__ __forceinline__ const h16_t* rows(int) const { return x; }
};

template <typename W, bool ADD>
struct XNorm {
  const float* a;
  const float* b;
  float* s;
  const W* nw;
  float eps;
  template <int K, int ROWS>
  __device__ __forceinline__ const h16_t* rows(int T) const {
    __shared__ __align__(16) h16_t xs[ROWS * K];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
      if (r < T) {
        const long o = (long)r * K;
        norm_row<K>(a + o, ADD ? b + o : nullptr, ADD && blockIdx.x == 0 ? s + o : nullptr, nw, xs + o, eps);
      }
    __syncthreads();
    return xs;
  }
};

// A warp's share of one weight row: the SPLIT warps of an output each take PART of the row's C
// 16-byte chunks (so a warp's share is at most 2048 weights, gemv_split); lane l holds chunks
// c0 + 32 j (j < L), all loaded before any is used, so a warp waits for one memory round trip.
// WT: h16_t (8 weights a chunk) or fp8_t (16 codes a chunk, with the scale of each chunk).
template <int K, int SPLIT, typename WT>
struct RowPart {
  static constexpr int PER = WFmt<WT>::PER, C = K / PER, PART = (C + SPLIT - 1) / SPLIT, L = (PART + 31) / 32;
  int c0, end;
  __device__ __forceinline__ RowPart() {
    const int part = (threadIdx.x >> 5) % SPLIT;
    c0 = part * PART + (threadIdx.x & 31);
    end = min(C, (part + 1) * PART);
  }
  // The row's chunks, and for E4M3 their scales (ws: the row's scales; unused for h16).
  __device__ __forceinline__ void load(const WT* w, const float* ws, uint4* wv, float* sv) const {
    const uint4* wr = (const uint4*)w;
#pragma unroll
    for (int j = 0; j < L; j++) {
      const bool in = c0 + 32 * j < end;
      wv[j] = in ? ld_stream_first(wr + c0 + 32 * j) : make_uint4(0, 0, 0, 0);
      if (PER == 16) sv[j] = in ? ws[(c0 + 32 * j) * PER / W8_GROUP] : 0.0f;
    }
  }
  // acc[r] = the lane's part of the dot of input row r (of x) with the loaded chunks.
  template <int ROWS>
  __device__ __forceinline__ void dot(const h16_t* x, const uint4* wv, const float* sv, int T, float* acc) const {
#pragma unroll
    for (int r = 0; r < ROWS; r++) acc[r] = 0.0f;
#pragma unroll
    for (int j = 0; j < L; j++)
      if (c0 + 32 * j < end) {
        if constexpr (PER == 8) {
#pragma unroll
          for (int r = 0; r < ROWS; r++)
            if (r < T) acc[r] += dot8(wv[j], ((const uint4*)(x + (long)r * K))[c0 + 32 * j]);
        } else {
          float wf[16];
          e4m3x16(wv[j], wf);
#pragma unroll
          for (int r = 0; r < ROWS; r++)
            if (r < T) {
              const uint4* xr = (const uint4*)(x + (long)r * K) + 2 * (c0 + 32 * j);
              float xf[16];
              unpack8(xr[0], xf);
              unpack8(xr[1], xf + 8);
              float d = 0.0f;
#pragma unroll
              for (int i = 0; i < 16; i++) d = fmaf(wf[i], xf[i], d);
              acc[r] = fmaf(sv[j], d, acc[r]);
            }
        }
      }
  }
};

// The scales of row n of a weight of N rows of K: E4M3's after its codes; none for h16.
template <int K>
__device__ __forceinline__ const float* row_scales(const h16_t*, int, int) { return nullptr; }
template <int K>
__device__ __forceinline__ const float* row_scales(const fp8_t* w, int N, int n) {
  return (const float*)((const unsigned char*)w + (long)N * K) + (long)n * (K / W8_GROUP);
}

// Sums each of v[0..NV) over the warp, then over the SPLIT warps of its output (shared memory).
template <int NV, int SPLIT>
__device__ __forceinline__ void split_sum(float* v) {
#pragma unroll
  for (int i = 0; i < NV; i++) v[i] = warp_sum(v[i]);
  if (SPLIT > 1) {
    __shared__ float part[8][NV];
    const int warp = threadIdx.x >> 5, first = warp - warp % SPLIT;
    if ((threadIdx.x & 31) == 0)
#pragma unroll
      for (int i = 0; i < NV; i++) part[warp][i] = v[i];
    __syncthreads();
#pragma unroll
    for (int i = 0; i < NV; i++) {
      float s = 0.0f;
#pragma unroll
      for (int p = 0; p < SPLIT; p++) s += part[first + p][i];
      v[i] = s;
    }
  }
}

// One linear of a launch that computes up to three sharing an input (weights h16_t or fp8_t).
template <typename WT>
struct LinearOut {
  const WT* w;
  const h16_t* b;
  float* o;
  int n;
};

// The group that index i (over the groups' concatenated units, c0 and c1 units in the first
// two) falls in; i becomes the index inside that group.
template <typename WT>
__device__ __forceinline__ LinearOut<WT> pick_group(int& i, int c0, int c1, LinearOut<WT> g0, LinearOut<WT> g1,
                                                    LinearOut<WT> g2) {
  if (i >= c0 + c1) { i -= c0 + c1; return g2; }
  if (i >= c0) { i -= c0; return g1; }
  return g0;
}

// Up to three linears sharing the input rows x (X16 or XNorm): group g has N_g outputs,
// weight w_g [N_g, K] (h16, or E4M3 with its scales), optional bias b_g, output o_g f32 [T, N_g].
// grid: ceil((N0 + N1 + N2) / (8 / SPLIT)), block: 256.
template <int K, int N0, int N1, int N2, int ROWS, int SPLIT, typename WT, typename X>
__device__ void gemv(const X& x, const WT* w0, const h16_t* b0, float* o0, const WT* w1, const h16_t* b1, float* o1,
                     const WT* w2, const h16_t* b2, float* o2, int T) {
  int n = blockIdx.x * (8 / SPLIT) + (threadIdx.x >> 5) / SPLIT;
  const bool live = n < N0 + N1 + N2;
  n = min(n, N0 + N1 + N2 - 1);
  const LinearOut<WT> g = pick_group(n, N0, N1, LinearOut<WT>{w0, b0, o0, N0}, LinearOut<WT>{w1, b1, o1, N1},
                                     LinearOut<WT>{w2, b2, o2, N2});
  const h16_t* b = g.b;
  float* o = g.o;
  const int N = g.n;
  using Part = RowPart<K, SPLIT, WT>;
  const Part part;
  uint4 wv[Part::L];
  float sv[Part::L];
  part.load(g.w + (long)n * K, row_scales<K>(g.w, N, n), wv, sv);
  pdl_wait();
  float acc[ROWS];
  part.template dot<ROWS>(x.template rows<K, ROWS>(T), wv, sv, T, acc);
  split_sum<ROWS, SPLIT>(acc);
  if (live && (threadIdx.x & 31) == 0 && ((threadIdx.x >> 5) % SPLIT) == 0) {
    const float bias = b ? to_f32(b[n]) : 0.0f;
#pragma unroll
    for (int r = 0; r < ROWS; r++)
      if (r < T) o[(long)r * N + n] = acc[r] + bias;
  }
}

// Gate and up projections with act(gate)·up fused (act: the GLU's activation, a device lambda
// the generated instance passes): input rows x (X16 or XNorm), out h16 [T, N].
// grid: ceil(N / (8 / SPLIT)), block: 256.
template <int K, int N, int ROWS, int SPLIT, typename WT, typename X, typename ACT>
__device__ void gemv_glu(const X& x, const WT* wg, const WT* wu, h16_t* out, int T, ACT act) {
  int n = blockIdx.x * (8 / SPLIT) + (threadIdx.x >> 5) / SPLIT;
  const bool live = n < N;
  n = min(n, N - 1);
  using Part = RowPart<K, SPLIT, WT>;
  const Part part;
  uint4 wgv[Part::L], wuv[Part::L];
  float sg[Part::L], su[Part::L];
  part.load(wg + (long)n * K, row_scales<K>(wg, N, n), wgv, sg);
  part.load(wu + (long)n * K, row_scales<K>(wu, N, n), wuv, su);
  pdl_wait();
  const h16_t* xr = x.template rows<K, ROWS>(T);
  float acc[2 * ROWS];
  part.template dot<ROWS>(xr, wgv, sg, T, acc);
  part.template dot<ROWS>(xr, wuv, su, T, acc + ROWS);
  split_sum<2 * ROWS, SPLIT>(acc);
  if (live && (threadIdx.x & 31) == 0 && ((threadIdx.x >> 5) % SPLIT) == 0) {
#pragma unroll
    for (int r = 0; r < ROWS; r++)
      if (r < T) out[(long)r * N + n] = f32_to_h16(act(acc[r]) * acc[ROWS + r]);
  }
}

// act(a)·b as h16 (after the GEMM path's gate and up), four per thread (16-byte loads).
// grid: ceil(n / 1024), block: 256.
template <typename ACT>
__device__ void glu_mul(const float* a, const float* b, h16_t* out, long n, ACT act) {
  const long i = 4 * ((long)blockIdx.x * blockDim.x + threadIdx.x);
  if (i + 3 < n) {
    const float4 x = *(const float4*)(a + i), y = *(const float4*)(b + i);
    const unsigned lo = f32_to_h16(act(x.x) * y.x) | ((unsigned)f32_to_h16(act(x.y) * y.y) << 16);
    const unsigned hi = f32_to_h16(act(x.z) * y.z) | ((unsigned)f32_to_h16(act(x.w) * y.w) << 16);
    *(uint2*)(out + i) = make_uint2(lo, hi);
  } else {
    for (long j = i; j < n; ++j) out[j] = f32_to_h16(act(a[j]) * b[j]);
  }
}

// f32 to h16. grid: ceil(n / 256), block: 256.
__device__ void to_h16(const float* a, h16_t* out, long n) {
  const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = f32_to_h16(a[i]);
}

// ---- extend linear: tensor-core GEMM (mma.sync m16n8k16 h16, f32 accumulate) ----
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  unsigned r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }
__device__ __forceinline__ void ldmatrix_x4(unsigned* r, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void mma_h16(float* d, const unsigned* a, const unsigned* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." H16_PTX "." H16_PTX ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Tiles of 32 h16 (64 bytes) per row: 16-byte chunk c of row r lives at chunk c ^ ((r >> 1) & 3),
// so the eight rows an ldmatrix reads fall in distinct banks.
__device__ __forceinline__ int swz(int r, int c) { return r * 32 + ((c ^ ((r >> 1) & 3)) << 3); }

// Block tile 128 x 128 x 32, 8 warps as 2 (M) x 4 (N) of 64 x 32, three cp.async stages.
// E4M3 weights (WT fp8_t) go through registers instead: each thread loads 16 codes of a tile one
// stage ahead, and after the stage's math writes them, times their scale, as h16 (rounded).
// The groups' column tiles are concatenated along grid.x; grid: (tiles, ceil(T / 128)), block: 256.
template <int K, int N0, int N1, int N2, typename WT>
__device__ void gemm(const h16_t* x, const WT* w0, const h16_t* b0, float* o0, const WT* w1, const h16_t* b1,
                     float* o1, const WT* w2, const h16_t* b2, float* o2, int T) {
  constexpr int BM = 128, BN = 128, BK = 32, S = 3, KT = K / BK;
  constexpr bool W8 = WFmt<WT>::PER == 16;
  __shared__ __align__(128) h16_t sa[S][BM * BK];
  __shared__ __align__(128) h16_t sb[S][BN * BK];
  int tile = blockIdx.x;
  const LinearOut<WT> g = pick_group(tile, (N0 + BN - 1) / BN, (N1 + BN - 1) / BN, LinearOut<WT>{w0, b0, o0, N0},
                                     LinearOut<WT>{w1, b1, o1, N1}, LinearOut<WT>{w2, b2, o2, N2});
  const WT* w = g.w;
  const h16_t* bias = g.b;
  float* out = g.o;
  const int N = g.n;
  const int n0 = tile * BN, m0 = blockIdx.y * BM;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wm = warp >> 2, wn = warp & 3;
  // E4M3: thread tid holds codes 16 (tid & 1) .. + 15 of tile row tid >> 1.
  const int w8r = tid >> 1, w8h = tid & 1, w8n = min(n0 + w8r, N - 1);
  const float* w8s = W8 ? row_scales<K>(w, N, w8n) : nullptr;

  auto load = [&](int st, int kt) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
      const int id = tid + i * 256, r = id >> 2, c = id & 3;
      const int gm = m0 + r, gn = n0 + r;
      cp_async16(smem_addr(&sa[st][swz(r, c)]), x + (long)min(gm, T - 1) * K + kt * BK + c * 8, gm < T ? 16 : 0);
      if constexpr (!W8)
        cp_async16(smem_addr(&sb[st][swz(r, c)]), w + (long)min(gn, N - 1) * K + kt * BK + c * 8, gn < N ? 16 : 0);
    }
  };
  auto w8_load = [&](int kt) { return ld_stream((const unsigned char*)w + (long)w8n * K + kt * BK + 16 * w8h); };
  auto w8_store = [&](int st, int kt, uint4 q) {
    uint4 lo = make_uint4(0, 0, 0, 0), hi = lo;
    if (n0 + w8r < N) e4m3x16_h16(q, w8s[kt * BK / W8_GROUP], lo, hi);
    *(uint4*)&sb[st][swz(w8r, 2 * w8h)] = lo;
    *(uint4*)&sb[st][swz(w8r, 2 * w8h + 1)] = hi;
  };

  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; i++)
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
      for (int k = 0; k < 4; k++) acc[i][j][k] = 0.0f;

#pragma unroll
  for (int s = 0; s < S - 1; s++) {
    if (s < KT) {
      load(s, s);
      if constexpr (W8) w8_store(s, s, w8_load(s));
    }
    cp_async_commit();
  }
  for (int kt = 0; kt < KT; kt++) {
    cp_async_wait<S - 2>();
    __syncthreads();
    const bool ahead = kt + S - 1 < KT;
    if (ahead) load((kt + S - 1) % S, kt + S - 1);
    cp_async_commit();
    uint4 w8q = make_uint4(0, 0, 0, 0);
    if (W8 && ahead) w8q = w8_load(kt + S - 1);
    const int st = kt % S;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      unsigned af[4][4], bf[4][2];
#pragma unroll
      for (int mi = 0; mi < 4; mi++) {
        const int r = wm * 64 + mi * 16 + (lane & 15), c = (kk >> 3) + (lane >> 4);
        ldmatrix_x4(af[mi], smem_addr(&sa[st][swz(r, c)]));
      }
#pragma unroll
      for (int nj = 0; nj < 2; nj++) {
        const int r = wn * 32 + nj * 16 + ((lane >> 4) << 3) + (lane & 7), c = (kk >> 3) + ((lane >> 3) & 1);
        unsigned q[4];
        ldmatrix_x4(q, smem_addr(&sb[st][swz(r, c)]));
        bf[2 * nj][0] = q[0];
        bf[2 * nj][1] = q[1];
        bf[2 * nj + 1][0] = q[2];
        bf[2 * nj + 1][1] = q[3];
      }
#pragma unroll
      for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++) mma_h16(acc[mi][ni], af[mi], bf[ni]);
    }
    // The stage written here was last read in iteration kt - 1, before this one's barrier.
    if (W8 && ahead) w8_store((kt + S - 1) % S, kt + S - 1, w8q);
  }
  cp_async_wait<0>();

#pragma unroll
  for (int mi = 0; mi < 4; mi++)
#pragma unroll
    for (int ni = 0; ni < 4; ni++) {
      const int r = m0 + wm * 64 + mi * 16 + (lane >> 2);
      const int c = n0 + wn * 32 + ni * 8 + (lane & 3) * 2;
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int rr = r + (e >> 1) * 8, cc = c + (e & 1);
        if (rr < T && cc < N) out[(long)rr * N + cc] = acc[mi][ni][e] + (bias ? to_f32(bias[cc]) : 0.0f);
      }
    }
}

// The products of one 16-byte chunk (8 h16 at k + 8c for lane (g, c)) of weight rows g (a0) and
// g + 8 (a1) with the same chunk of 8 activation rows (xb, row g), added to d: two m16n8k16 over
// the same permutation of k for both operands, so d gets the plain dot products.
__device__ __forceinline__ void mma_rows8(float* d, uint4 a0, uint4 a1, uint4 xb) {
  const unsigned fa[4] = {a0.x, a1.x, a0.y, a1.y}, fb[2] = {xb.x, xb.y};
  const unsigned ga[4] = {a0.z, a1.z, a0.w, a1.w}, gb[2] = {xb.z, xb.w};
  mma_h16(d, fa, fb);
  mma_h16(d, ga, gb);
}

// A warp's mma_rows8 accumulators of 16 weight rows and NT tiles of 8 activation rows into
// red[feature][row] (for a sum over warps through shared memory).
template <int NT>
__device__ __forceinline__ void rows8_spill(float (*red)[NT * 8 + 1], const float (*acc)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int i = 0; i < NT; i++) {
    red[g][i * 8 + 2 * c] = acc[i][0];
    red[g][i * 8 + 2 * c + 1] = acc[i][1];
    red[g + 8][i * 8 + 2 * c] = acc[i][2];
    red[g + 8][i * 8 + 2 * c + 1] = acc[i][3];
  }
}

// ---- small-batch linear: tensor cores over few rows (9..128) ----
// D[feature, token] = W · Xᵀ with mma.sync: W rows are the A operand (16 features per block),
// the step's rows the B operand (NT tiles of 8). Lane (g, c) loads 16 contiguous bytes of a W
// row and of an X row at k + 8c; both fragments use the same permutation of k inside each
// 32-wide chunk, so the sum is the plain dot product. E4M3 weights (WT fp8_t) come in chunks
// of 64: lane (g, c) loads 16 codes at k + 16c and the X row's 16 values there; each chunk's
// product is summed apart and added times the rows' scales (exact). Eight warps split K and
// reduce through shared memory. Every N_g is a multiple of 16. grid: (N0 + N1 + N2) / 16, block: 256.
template <int K, int N0, int N1, int N2, int NT, typename WT>
__device__ void gemm_skinny(const h16_t* x, const WT* w0, const h16_t* b0, float* o0, const WT* w1,
                            const h16_t* b1, float* o1, const WT* w2, const h16_t* b2, float* o2, int T) {
  constexpr int WARPS = 8, PER = WFmt<WT>::PER, CW = 4 * PER, CH = K / CW, RT = NT < 8 ? NT : 8;
  static_assert(NT % RT == 0, "row tiles in whole rounds of the reduction");
  __shared__ float red[WARPS][16][RT * 8 + 1];
  int f0 = blockIdx.x * 16;
  const LinearOut<WT> grp = pick_group(f0, N0, N1, LinearOut<WT>{w0, b0, o0, N0}, LinearOut<WT>{w1, b1, o1, N1},
                                       LinearOut<WT>{w2, b2, o2, N2});
  const h16_t* bias = grp.b;
  float* out = grp.o;
  const int N = grp.n;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  float acc[NT][4];
#pragma unroll
  for (int i = 0; i < NT; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  const WT* wa = grp.w + (long)(f0 + g) * K + c * PER;
  const WT* wb = wa + 8L * K;
  const float* sa = row_scales<K>(grp.w, N, f0 + g);
  const float* sb = row_scales<K>(grp.w, N, f0 + g + 8);
  const h16_t* xr[NT];
  bool live[NT];
#pragma unroll
  for (int i = 0; i < NT; i++) {
    live[i] = i * 8 + g < T;
    xr[i] = x + (long)min(i * 8 + g, T - 1) * K + c * PER;
  }
  auto chunk = [&](int k, uint4 a0, uint4 a1) {
    if constexpr (PER == 8) {
#pragma unroll
      for (int i = 0; i < NT; i++) {
        uint4 xb = *(const uint4*)(xr[i] + k);
        if (!live[i]) xb = make_uint4(0, 0, 0, 0);
        mma_rows8(acc[i], a0, a1, xb);
      }
    } else {
      uint4 h0, h1, h2, h3;
      e4m3x16_h16(a0, 1.0f, h0, h1);
      e4m3x16_h16(a1, 1.0f, h2, h3);
      const float s0 = sa[k / W8_GROUP], s1 = sb[k / W8_GROUP];
#pragma unroll
      for (int i = 0; i < NT; i++) {
        uint4 x0 = *(const uint4*)(xr[i] + k), x1 = *(const uint4*)(xr[i] + k + 8);
        if (!live[i]) x0 = x1 = make_uint4(0, 0, 0, 0);
        float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        mma_rows8(p, h0, h2, x0);
        mma_rows8(p, h1, h3, x1);
        acc[i][0] = fmaf(s0, p[0], acc[i][0]);
        acc[i][1] = fmaf(s0, p[1], acc[i][1]);
        acc[i][2] = fmaf(s1, p[2], acc[i][2]);
        acc[i][3] = fmaf(s1, p[3], acc[i][3]);
      }
    }
  };
  int ch = warp;
  for (; ch + WARPS < CH; ch += 2 * WARPS) {
    const int k = ch * CW, k2 = k + WARPS * CW;
    const uint4 a0 = ld_stream(wa + k), a1 = ld_stream(wb + k), c0 = ld_stream(wa + k2), c1 = ld_stream(wb + k2);
    chunk(k, a0, a1);
    chunk(k2, c0, c1);
  }
  if (ch < CH) chunk(ch * CW, ld_stream(wa + ch * CW), ld_stream(wb + ch * CW));
  // The warps' sums meet in shared memory, RT row tiles at a time (RT * 8 rows fit in it).
#pragma unroll
  for (int h = 0; h < NT; h += RT) {
    if (h > 0) __syncthreads();  // the last rows' sums are read
    rows8_spill<RT>(red[warp], acc + h);
    __syncthreads();
    for (int idx = threadIdx.x; idx < 16 * RT * 8; idx += blockDim.x) {
      const int tok = h * 8 + (idx >> 4), f = idx & 15;
      if (tok >= T) break;
      float v = bias ? to_f32(bias[f0 + f]) : 0.0f;
#pragma unroll
      for (int q = 0; q < WARPS; q++) v += red[q][f][tok - h * 8];
      out[(long)tok * N + f0 + f] = v;
    }
  }
}

// ---- small-batch linear, W8A8 on Hopper's tensor cores (wgmma, sm_90a) ----
// The input quantized by quant_e4m3 with 128-column groups (codes [T, K], read through the TMA
// map mx; scales xs [K / 128, T]), up to 64 rows. The work is (128-feature tile, 128-column group) units, tile by
// tile, shared evenly by BLOCKS blocks (stream-K: a block's units may end one tile and start
// the next), so every SM streams weights to the end whatever the tile count. A block (one
// warpgroup) takes its units a tile at a time: per group, a 64-row box of the input and the 128 weight
// rows (TMA maps mw_g over each [N_g, K] code matrix) go to shared memory by TMA in STAGES stages (one thread
// issues both copies, an mbarrier a stage counts their bytes), in
// wgmma's 128-byte swizzle (16-byte chunk j of row r at j ^ (r % 8), 8-row atoms 1024 bytes apart), four
// m64n128k32 E4M3 wgmma give the group's products, and they are added times the rows' and the
// weight rows' scales (the scales change every group). A tile done by one block is written by
// it; otherwise each of its blocks writes its sums to its slot of part [slots, 64, N0 + N1 +
// N2], and the last to finish (count[tile], which it resets) adds the slots in order, so the
// result does not depend on which block ends first. codegen_cuda's `a8_blocks` picks BLOCKS,
// `a8_slots` says SLOTS (the most a tile has), `A8_SMEM` is the dynamic shared memory.
// Launched as a programmatic dependent launch, a block loads its first stages' weights before
// it waits for the previous kernel (pdl_wait). Every N_g is a multiple of 128. grid: BLOCKS,
// block: 128.
#define A8_ROWS 64
#define A8_STAGE (A8_ROWS * 128 + 128 * 128)

// The shared-memory descriptor of a K-major tile of 128-byte rows in the 128-byte swizzle: 8-row
// atoms 1024 bytes apart (the leading offset is unused at this swizzle).
__device__ __forceinline__ unsigned long long wg_desc(unsigned addr) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
         (1ull << 62);
}

// d = (acc ? d : 0) + A (64 x 32 E4M3, K-major, descriptor a) x B (128 x 32, descriptor b)ᵀ.
__device__ __forceinline__ void wgmma_e4m3_n128(float* d, unsigned long long a, unsigned long long b, int acc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
      "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, "
      "%43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),
        "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "r"(acc));
#else
  __trap();
#endif
}

__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;" ::: "memory");
#endif
}

// A TMA descriptor (CUtensorMap) passed by value as a __grid_constant__ kernel parameter.
struct __align__(64) TmaMap {
  unsigned long long v[16];
};

// An mbarrier in shared memory: `count` arrivals, then the bytes the TMA copies announced.
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Waits until the barrier's phase of parity `parity` completed; traps after about a second
// (a copy that never lands must not hang the process).
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  for (long spins = 0;; spins++) {
    unsigned done;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    if (done) return;
    if (spins > (1l << 24)) __trap();
  }
}
// TMA: the box at (x, y) of the 2-D tensor `map` to shared memory at dst (128-byte swizzle, as
// the map says), its bytes counted on barrier bar.
__device__ __forceinline__ void tma_load_2d(unsigned dst, const TmaMap* map, int x, int y, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}

// The first unit (a tile's 128-column group) of block b when U units are shared by B blocks.
__device__ __forceinline__ int a8_start(int b, long U, int B) { return (int)((long)b * U / B); }

// The block whose units hold unit u.
__device__ __forceinline__ int a8_block(int u, long U, int B) {
  int b = (int)((long)u * B / U);
  while (b + 1 < B && a8_start(b + 1, U, B) <= u) b++;
  return b;
}

template <int K, int N0, int N1, int N2, int BLOCKS, int SLOTS, int STAGES>
__device__ void gemm_skinny_a8(const TmaMap* mx, const float* xs, const fp8_t* w0, const h16_t* b0, float* o0,
                               const fp8_t* w1, const h16_t* b1, float* o1, const fp8_t* w2, const h16_t* b2,
                               float* o2, float* part, unsigned* count, int T, const TmaMap* mw0,
                               const TmaMap* mw1, const TmaMap* mw2) {
  constexpr int F = 128, G = K / W8_GROUP, S = STAGES, NTOT = N0 + N1 + N2;
  constexpr long U = (long)(NTOT / F) * G;
  extern __shared__ unsigned char a8_smem[];
  // Stage s: input tile at tiles + s * A8_STAGE, weight tile 8 KB after it, 1024-aligned; then
  // the scales of every stage: input [S][64], weight [S][128].
  const unsigned raw = smem_addr(a8_smem), tiles = (raw + 1023) & ~1023u;
  unsigned char* const gen = a8_smem + (tiles - raw);
  float* const sxs = (float*)(gen + S * A8_STAGE);
  float* const sws = sxs + S * A8_ROWS;
  __shared__ bool last;
  // full[s]: stage s's two tiles landed (thread 0 arrives announcing their bytes).
  __shared__ __align__(8) unsigned long long full[S];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < S; s++) mbar_init(smem_addr(&full[s]), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  unsigned phases = 0;  // bit s: the parity of stage s's next fill
  // Thread (warp, g, c) holds rows 16 warp + g (+ 8) and features 8 j + 2 c (+ 1), j < 16.
  const int r0 = 16 * warp + g;
  auto cp4 = [](unsigned dst, const void* src, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(bytes));
  };
  const int u_end = a8_start(blockIdx.x + 1, U, BLOCKS);
  bool first = true;
  for (int u = a8_start(blockIdx.x, U, BLOCKS); u < u_end;) {
    const int tile = u / G, gs = u % G, gn = min(G - gs, u_end - u);
    u += gn;
    int f0 = tile * F;
    const TmaMap* const mw = f0 >= N0 + N1 ? mw2 : f0 >= N0 ? mw1 : mw0;
    const LinearOut<fp8_t> grp = pick_group(f0, N0, N1, LinearOut<fp8_t>{w0, b0, o0, N0},
                                            LinearOut<fp8_t>{w1, b1, o1, N1}, LinearOut<fp8_t>{w2, b2, o2, N2});
    const int N = grp.n;
    const float* wsc = row_scales<K>(grp.w, N, f0 + tid);
    // Stage st's weight tile and scales (which no kernel writes), and its input tile and
    // scales: the tiles by TMA (thread 0, counted on full[st]), the scales by cp.async. The
    // input box has 64 rows; those past T come as zeros.
    auto stage_w = [&](int st, int gi) {
      if (tid == 0) {
        mbar_expect(smem_addr(&full[st]), A8_STAGE);
        tma_load_2d(tiles + st * A8_STAGE + A8_ROWS * 128, mw, gi * W8_GROUP, f0, smem_addr(&full[st]));
      }
      cp4(smem_addr(&sws[st * F + tid]), wsc + gi, 4);
    };
    auto stage_x = [&](int st, int gi) {
      if (tid == 0) tma_load_2d(tiles + st * A8_STAGE, mx, gi * W8_GROUP, 0, smem_addr(&full[st]));
      if (tid < T) cp4(smem_addr(&sxs[st * A8_ROWS + tid]), xs + (long)gi * T + tid, 4);
    };
    auto stage = [&](int st, int gi) {
      stage_w(st, gi);
      stage_x(st, gi);
    };
    float acc[64], d[64];
#pragma unroll
    for (int i = 0; i < 64; i++) acc[i] = 0.0f;
    __syncthreads();  // the last segment's stages are read
    if (first) {
      // The first stages' weights load while the previous kernel still runs (the wrapper let
      // this one launch early: pdl_trigger); the inputs after it ended. Groups W0 W1 W2 X0 X1
      // X2: at step i, cp_async_wait<S - 2> has stage i's weights and inputs in.
#pragma unroll
      for (int s = 0; s < S - 1; s++) {
        if (s < gn) stage_w(s, gs + s);
        cp_async_commit();
      }
      pdl_wait();
#pragma unroll
      for (int s = 0; s < S - 1; s++) {
        if (s < gn) stage_x(s, gs + s);
        cp_async_commit();
      }
      first = false;
    } else {
#pragma unroll
      for (int s = 0; s < S - 1; s++) {
        if (s < gn) stage(s, gs + s);
        cp_async_commit();
      }
    }
    for (int i = 0; i < gn; i++) {
      const int st = i % S;
      cp_async_wait<S - 2>();
      mbar_wait(smem_addr(&full[st]), (phases >> st) & 1);
      phases ^= 1u << st;
      __syncthreads();
      if (i + S - 1 < gn) stage((i + S - 1) % S, gs + i + S - 1);
      cp_async_commit();
      const unsigned long long da = wg_desc(tiles + st * A8_STAGE);
      const unsigned long long db = wg_desc(tiles + st * A8_STAGE + A8_ROWS * 128);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; kk++) wgmma_e4m3_n128(d, da + 2 * kk, db + 2 * kk, kk);
      wgmma_commit_wait();
      const float x0 = sxs[st * A8_ROWS + r0], x1 = sxs[st * A8_ROWS + r0 + 8];
#pragma unroll
      for (int j = 0; j < 16; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
          const float w = sws[st * F + 8 * j + 2 * c + e];
          acc[4 * j + e] = fmaf(x0 * w, d[4 * j + e], acc[4 * j + e]);
          acc[4 * j + 2 + e] = fmaf(x1 * w, d[4 * j + 2 + e], acc[4 * j + 2 + e]);
        }
    }
    cp_async_wait<0>();
    // The blocks that share this tile: one writes it; several each write their sums to their
    // slot of part, and the last to arrive adds the slots in order.
    const int first = a8_block(tile * G, U, BLOCKS), n = a8_block(tile * G + G - 1, U, BLOCKS) - first + 1;
    float* const mine = part + ((long)(blockIdx.x - first) * A8_ROWS) * NTOT + tile * F;
#pragma unroll
    for (int j = 0; j < 16; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int tok = r0 + 8 * (e >> 1), f = 8 * j + 2 * c + (e & 1);
        if (tok >= T) continue;
        if (n == 1)
          grp.o[(long)tok * N + f0 + f] = acc[4 * j + e] + (grp.b ? to_f32(grp.b[f0 + f]) : 0.0f);
        else
          mine[(long)tok * NTOT + f] = acc[4 * j + e];
      }
    if (n == 1) continue;
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(&count[tile], 1u) == (unsigned)n - 1;
    __syncthreads();
    if (!last) continue;
    __threadfence();
    // Every slot's sums of two float4 columns are loaded before any is added: the loads are in
    // flight together, not one slot after the other.
    const float* const slots = part + tile * F;
    for (int i0 = tid; i0 < T * (F / 4); i0 += 256) {
      float4 p[2][SLOTS];
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const int i = min(i0 + 128 * h, T * (F / 4) - 1), tok = i / (F / 4), f = (i % (F / 4)) * 4;
#pragma unroll
        for (int q = 0; q < SLOTS; q++)
          if (q < n) p[h][q] = __ldcg((const float4*)&slots[((long)q * A8_ROWS + tok) * NTOT + f]);
      }
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const int i = i0 + 128 * h, tok = i / (F / 4), f = (i % (F / 4)) * 4;
        if (i >= T * (F / 4)) break;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (grp.b)
          v = make_float4(to_f32(grp.b[f0 + f]), to_f32(grp.b[f0 + f + 1]), to_f32(grp.b[f0 + f + 2]),
                          to_f32(grp.b[f0 + f + 3]));
#pragma unroll
        for (int q = 0; q < SLOTS; q++)
          if (q < n) {
            v.x += p[h][q].x;
            v.y += p[h][q].y;
            v.z += p[h][q].z;
            v.w += p[h][q].w;
          }
        *(float4*)&grp.o[(long)tok * N + f0 + f] = v;
      }
    }
    if (tid == 0) count[tile] = 0;
  }
}

// ---- attention ----
// The RMS norm scale of one head row x of D features, rsqrt(mean(x^2) + eps), computed by one
// warp (every lane gets it): the per-head q/k norm a rope_attention fusion applies before
// RoPE (Qwen3, Gemma 3).
template <int D>
__device__ __forceinline__ float head_rms(const float* x, float eps) {
  float s = 0.0f;
  for (int d = threadIdx.x & 31; d < D; d += 32) s += x[d] * x[d];
  return rsqrtf(warp_sum(s) / D + eps);
}

// RoPE on the leading ROT features of each head of q (RQ) and k (RK) at positions pos[t], q
// written to qo (f32), k and v written as h16 into the paged cache at slot slot_of[t]. With NQ
// (NK) each head of q (k) is RMS-normalised first, times the head-sized weight qnw (knw).
// grid: T, block: 128.
template <int H, int KVH, int D, int ROT, bool RQ, bool RK, bool NQ, bool NK, typename NWQ, typename NWK>
__device__ void rope_kv(const float* q, const float* k, const float* v, const int* pos, const float* inv_freq,
                        float scale, const int* slot_of, const NWQ* qnw, const NWK* knw, float qeps, float keps,
                        float* qo, h16_t* kc, h16_t* vc) {
  const int t = blockIdx.x;
  const float p = (float)pos[t];
  const long dst = (long)slot_of[t] * (KVH * D);
  // Each head's norm scale, a warp per head.
  __shared__ float rms[(NQ || NK) ? H + KVH : 1];
  if (NQ || NK) {
    for (int hh = threadIdx.x >> 5; hh < H + KVH; hh += blockDim.x >> 5) {
      const bool isq = hh < H;
      if (isq ? NQ : NK) {
        const float* x = isq ? q + ((long)t * H + hh) * D : k + ((long)t * KVH + hh - H) * D;
        rms[hh] = head_rms<D>(x, isq ? qeps : keps);
      }
    }
    __syncthreads();
  }
  for (int i = threadIdx.x; i < (H + KVH) * (D / 2); i += blockDim.x) {
    const bool isq = i < H * (D / 2);
    const int ii = isq ? i : i - H * (D / 2);
    const int head = ii / (D / 2), j = ii % (D / 2);
    const int cols = isq ? H * D : KVH * D;
    const float* src = (isq ? q : k) + (long)t * cols + head * D;
    // a rotated pair (j, j + ROT / 2), or two features past the rotated ones
    const bool rot = j < ROT / 2;
    const int ja = rot ? j : ROT + 2 * (j - ROT / 2), jb = rot ? j + ROT / 2 : ja + 1;
    float xa = src[ja], xb = src[jb];
    if (isq && NQ) {
      xa *= rms[head] * to_f32(qnw[ja]);
      xb *= rms[head] * to_f32(qnw[jb]);
    } else if (!isq && NK) {
      xa *= rms[H + head] * to_f32(knw[ja]);
      xb *= rms[H + head] * to_f32(knw[jb]);
    }
    if (rot && (isq ? RQ : RK)) {
      float s, c;
      sincosf(p * inv_freq[j], &s, &c);
      s *= scale;
      c *= scale;
      const float ra = xa * c - xb * s, rb = xb * c + xa * s;
      xa = ra;
      xb = rb;
    }
    if (isq) {
      qo[(long)t * cols + head * D + ja] = xa;
      qo[(long)t * cols + head * D + jb] = xb;
    } else {
      kc[dst + head * D + ja] = f32_to_h16(xa);
      kc[dst + head * D + jb] = f32_to_h16(xb);
    }
  }
  for (int i = threadIdx.x; i < KVH * D; i += blockDim.x) vc[dst + i] = f32_to_h16(v[(long)t * KVH * D + i]);
}

// One key of the online softmax: score s (already summed over the G lanes of the key) and the
// lane's 16 values of v.
__device__ __forceinline__ void kv16_add(float s, const float* vf, float& m, float& l, float* acc) {
  const float m2 = fmaxf(m, s), corr = __expf(m - m2), e = __expf(s - m2);
  l = l * corr + e;
#pragma unroll
  for (int i = 0; i < 16; i++) acc[i] = fmaf(acc[i], corr, e * vf[i]);
  m = m2;
}

// A score soft-capped to cap * tanh(s / cap), cap being the f32 whose bits are CAP (no cap
// when 0): ir::scalar::softcap.
template <unsigned CAP>
__device__ __forceinline__ float softcap(float s) {
  if (CAP == 0) return s;
  const float c = __uint_as_float(CAP);
  return c * tanhf(s / c);
}

// Lanes that share one key in the kv16 kernels: a lane per 16 dims of the head (D / 16 of
// them), rounded up to a power of two so that groups tile the warp; the lanes past D / 16 hold
// zeros (head sizes such as 80 or 96).
__device__ constexpr int kv16_lanes(int d) {
  int p = 1;
  while (p < d / 16) p <<= 1;
  return p;
}

// The keys at positions first..n-1 of a sequence (slots sl[p]) for kv head kvh, split over the
// warps and lane groups of the block (kv16_lanes(D) lanes share a key, 16 dims each, so a warp
// scores 32 / kv16_lanes(D) keys at once; eight warps split the keys): each lane's
// online-softmax state, merged by kv16_merge.
// U passes at a time: their slots, then their K and V rows, are loaded before any is used, so
// a short sequence costs two memory round trips rather than two per pass.
template <int KVH, int D, unsigned CAP>
__device__ __forceinline__ void kv16_scan(const float* qv, const h16_t* kc, const h16_t* vc, const int* sl, int first,
                                         int n, int kvh, float& m, float& l, float* acc) {
  constexpr int G = D / 16, GP = kv16_lanes(D), KPW = 32 / GP, WARPS = 8, STATES = WARPS * KPW, U = 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane % GP, grp = lane / GP;
  const bool on = sub < G;
  for (int p0 = first + warp * KPW; p0 < n; p0 += U * STATES) {
    long row[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int p = p0 + u * STATES + grp;
      row[u] = p < n ? (long)sl[p] * (KVH * D) + kvh * D + sub * 16 : -1;
    }
    uint4 kv[U][4];
#pragma unroll
    for (int u = 0; u < U; u++) {
      const uint4 z = make_uint4(0, 0, 0, 0);
      const uint4* kr = (const uint4*)(kc + row[u]);
      const uint4* vr = (const uint4*)(vc + row[u]);
      const bool ld = row[u] >= 0 && on;
      kv[u][0] = ld ? kr[0] : z;
      kv[u][1] = ld ? kr[1] : z;
      kv[u][2] = ld ? vr[0] : z;
      kv[u][3] = ld ? vr[1] : z;
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      float f[16], s = 0.0f;
      unpack8(kv[u][0], f);
      unpack8(kv[u][1], f + 8);
#pragma unroll
      for (int i = 0; i < 16; i++) s = fmaf(qv[i], f[i], s);
#pragma unroll
      for (int o = GP / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      s = softcap<CAP>(s);
      if (row[u] >= 0) {
        unpack8(kv[u][2], f);
        unpack8(kv[u][3], f + 8);
        kv16_add(s, f, m, l, acc);
      }
    }
  }
}

// e^v, or 2^v for logits in base-2 units (EXP2).
template <bool EXP2>
__device__ __forceinline__ float softmax_exp(float v) {
  return EXP2 ? exp2f(v) : __expf(v);
}

// N partial softmax states merged, with a `sink` logit (NEG_INF: none; gpt-oss's attention
// sinks): each state a running max ms[i * stride] (NEG_INF: empty) and a sum ls[i * stride]
// relative to it. Returns the merged max M (x) and the sum of every state's and the sink's
// terms relative to M (y): a state's values then count times exp(ms - M) / y.
template <int N, bool EXP2>
__device__ __forceinline__ float2 merge_states(float sink, const float* ms, const float* ls, int stride) {
  float mm = sink;
#pragma unroll
  for (int s = 0; s < N; s++) mm = fmaxf(mm, ms[s * stride]);
  float ll = sink == NEG_INF ? 0.0f : softmax_exp<EXP2>(sink - mm);
#pragma unroll
  for (int s = 0; s < N; s++) ll += ms[s * stride] == NEG_INF ? 0.0f : ls[s * stride] * softmax_exp<EXP2>(ms[s * stride] - mm);
  return make_float2(mm, ll);
}

// Merges the lanes' states through shared memory and writes the head's output row `o`; a
// finite `sink` is one more logit in the softmax's sum (gpt-oss's attention sinks).
template <int D, typename O>
__device__ __forceinline__ void kv16_merge(float m, float l, const float* acc, O* o, float sink) {
  constexpr int G = D / 16, GP = kv16_lanes(D), KPW = 32 / GP, WARPS = 8, STATES = WARPS * KPW;
  __shared__ float sm_acc[STATES][D];
  __shared__ float sm_m[STATES], sm_l[STATES];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane % GP, grp = lane / GP;
  const int state = warp * KPW + grp;
  if (sub < G) {
#pragma unroll
    for (int i = 0; i < 16; i++) sm_acc[state][sub * 16 + i] = acc[i];
  }
  if (sub == 0) {
    sm_m[state] = m;
    sm_l[state] = l;
  }
  __syncthreads();
  const float2 merged = merge_states<STATES, false>(sink, sm_m, sm_l, 1);
  const float mm = merged.x, ll = merged.y;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float v = 0.0f;
#pragma unroll
    for (int s = 0; s < STATES; s++)
      if (sm_m[s] != NEG_INF) v += sm_acc[s][d] * __expf(sm_m[s] - mm);
    store(o + d, v / ll);
  }
}

// Whether row t is one attention_fa does (its group of 16 rows is of one sequence), which the
// MIXED_ONLY decode kernels leave.
__device__ __forceinline__ bool fa_row(const int* seq_off, int t, int T) {
  return seq_off[t & ~15] == seq_off[min((t & ~15) + 15, T - 1)];
}

// Causal GQA attention of query row t for HB of the query heads that share kv head kvh (all
// G = H / KVH of them, or fewer for more blocks), over the h16 paged cache (positions
// 0..pos[t], slots slots[seq_off[t] + p]): each K and V row is read once for the block's heads.
// The four warps take chunks of 32 keys in turn, each keeping its own online softmax per head:
// a lane scores one key for every head (q in shared memory, read by all lanes at one address),
// the warp takes each head's chunk max and sum by shuffles, then the lanes, two features each
// per 64, accumulate P·V for every head from the chunk's V rows (VB rows loaded before any is
// used). The warps' states merge through shared memory at the end. grid: (T, H / HB), block: 128.
// With MIXED_ONLY, only rows whose group of 16 (see attention_fa) spans two sequences run.
// A sliding window WIN (0: none) keeps the last WIN positions; scores are soft-capped by CAP;
// `sinks` (null: none) gives each head a sink logit.
template <int H, int KVH, int D, int HB, typename O, bool MIXED_ONLY, int WIN, unsigned CAP, typename SW>
__device__ void attention_gqa(const float* q, const h16_t* kc, const h16_t* vc, const int* slots,
                              const int* seq_off, const int* pos, float scale, O* out, int T, const SW* sinks) {
  constexpr int G = HB, WARPS = 4, NP = (D + 63) / 64, VB = NP <= 2 ? 32 : 64 / NP;
  static_assert((H / KVH) % HB == 0 && G * D <= 8192, "a block's query rows fit in shared memory");
  __shared__ __align__(16) float sq[G * D];
  __shared__ float sm[WARPS][G], sl[WARPS][G];
  // h0: the block's first query head, of kv head kvh.
  const int t = blockIdx.x, h0 = blockIdx.y * HB, kvh = h0 / (H / KVH), lane = threadIdx.x & 31,
            warp = threadIdx.x >> 5;
  if (MIXED_ONLY && fa_row(seq_off, t, T)) return;
  const float* qr = q + ((long)t * H + h0) * D;
  for (int i = threadIdx.x; i < G * D; i += WARPS * 32) sq[i] = qr[i] * scale;
  float m[G], l[G], acc[G][2 * NP];
#pragma unroll
  for (int g = 0; g < G; g++) {
    m[g] = NEG_INF;
    l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < 2 * NP; i++) acc[g][i] = 0.0f;
  }
  const int n = pos[t] + 1, first = WIN ? max(0, n - WIN) : 0;
  const int* seq_slots = slots + seq_off[t];
  __syncthreads();
  for (int c0 = first + warp * 32; c0 < n; c0 += WARPS * 32) {
    const int p = c0 + lane;
    const long row = p < n ? (long)seq_slots[p] * (KVH * D) + kvh * D : -1;
    // The scores of key c0 + lane for every head.
    float s[G];
#pragma unroll
    for (int g = 0; g < G; g++) s[g] = 0.0f;
    if (row >= 0) {
      const uint4* kr = (const uint4*)(kc + row);
#pragma unroll 8
      for (int i = 0; i < D / 8; i++) {
        float f[8];
        unpack8(kr[i], f);
#pragma unroll
        for (int g = 0; g < G; g++) {
          const float4 a = *(const float4*)&sq[g * D + i * 8], b = *(const float4*)&sq[g * D + i * 8 + 4];
          s[g] = fmaf(a.x, f[0], fmaf(a.y, f[1], fmaf(a.z, f[2], fmaf(a.w, f[3], s[g]))));
          s[g] = fmaf(b.x, f[4], fmaf(b.y, f[5], fmaf(b.z, f[6], fmaf(b.w, f[7], s[g]))));
        }
      }
    }
    // Per head: the chunk's max joins the running one; the lane's key gets its exponential.
#pragma unroll
    for (int g = 0; g < G; g++) {
      const float sg = row >= 0 ? softcap<CAP>(s[g]) : NEG_INF;
      const float m_new = fmaxf(m[g], warp_max(sg)), corr = __expf(m[g] - m_new);
      s[g] = __expf(sg - m_new);
      l[g] = l[g] * corr + warp_sum(s[g]);
      m[g] = m_new;
#pragma unroll
      for (int i = 0; i < 2 * NP; i++) acc[g][i] *= corr;
    }
    // P·V: lane takes features 2 lane + 64 i, i < NP, of the chunk's keys, VB keys' rows at a time.
#pragma unroll
    for (int j0 = 0; j0 < 32; j0 += VB) {
      unsigned vv[VB][NP];
#pragma unroll
      for (int j = 0; j < VB; j++) {
        const long r = __shfl_sync(0xffffffffu, row, j0 + j);
#pragma unroll
        for (int i = 0; i < NP; i++) {
          const int d = 2 * lane + 64 * i;
          vv[j][i] = r >= 0 && (D % 64 == 0 || d < D) ? *(const unsigned*)(vc + r + d) : 0u;
        }
      }
#pragma unroll
      for (int j = 0; j < VB; j++) {
#pragma unroll
        for (int g = 0; g < G; g++) {
          const float pj = __shfl_sync(0xffffffffu, s[g], j0 + j);
#pragma unroll
          for (int i = 0; i < NP; i++) {
            float v[2];
            unpack2(vv[j][i], v);
            acc[g][2 * i] = fmaf(pj, v[0], acc[g][2 * i]);
            acc[g][2 * i + 1] = fmaf(pj, v[1], acc[g][2 * i + 1]);
          }
        }
      }
    }
  }
  // Merge the warps' states (and the sink) per head, summing their outputs into sq in turn.
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < G; g++) {
      sm[warp][g] = m[g];
      sl[warp][g] = l[g];
    }
  }
  __syncthreads();
  float f[G];
#pragma unroll
  for (int g = 0; g < G; g++) {
    const float sink = sinks ? to_f32(sinks[h0 + g]) : NEG_INF;
    const float2 merged = merge_states<WARPS, false>(sink, &sm[0][g], &sl[0][g], G);
    f[g] = m[g] == NEG_INF ? 0.0f : __expf(m[g] - merged.x) / merged.y;
  }
#pragma unroll
  for (int w = 0; w < WARPS; w++) {
    if (warp == w) {
#pragma unroll
      for (int g = 0; g < G; g++)
#pragma unroll
        for (int i = 0; i < 2 * NP; i++) {
          const int d = 2 * lane + 64 * (i / 2) + (i & 1);
          if (D % 64 == 0 || d < D) sq[g * D + d] = (w ? sq[g * D + d] : 0.0f) + acc[g][i] * f[g];
        }
    }
    __syncthreads();
  }
  for (int i = threadIdx.x; i < G * D; i += WARPS * 32) store(out + ((long)t * H + h0) * D + i, sq[i]);
}

// Dim d of one head row x (f32), normalised with scale r and weight w when N, then rotated as
// rope_kv does (rotate-half of the leading ROT features at position p; cos and sin times
// rscale) when R.
template <int ROT, bool R, bool N, typename W>
__device__ __forceinline__ float rope_at(const float* x, int d, float p, const float* inv_freq, float rscale,
                                         const W* w, float r) {
  const auto at = [&](int i) { return N ? x[i] * r * to_f32(w[i]) : x[i]; };
  const float v = at(d);
  if (!R || d >= ROT) return v;
  const float other = at(d < ROT / 2 ? d + ROT / 2 : d - ROT / 2);
  float sn, c;
  sincosf(p * inv_freq[d % (ROT / 2)], &sn, &c);
  sn *= rscale;
  c *= rscale;
  return d < ROT / 2 ? v * c - other * sn : v * c + other * sn;
}

// A step of one token (decode at batch 1): RoPE, the KV-cache write and attention in one
// kernel. Every block rotates its head of q and the token's own k (its kv head), takes the own
// key from registers (the cache write of another block may not be visible yet), and the first
// block of each kv head writes k and v (h16) to the cache. Window and cap as attention_gqa's;
// per-head norms of q and k (NQ, NK) as rope_kv's; sinks as attention_gqa's. grid: (1, H),
// block: 256.
template <int H, int KVH, int D, int ROT, typename O, bool RQ, bool RK, bool NQ, bool NK, typename NWQ, typename NWK,
          int WIN, unsigned CAP, typename SW>
__device__ void attention_rope1(const float* q, const float* k, const float* v, const int* pos, const float* inv_freq,
                                float rscale, const int* slot_of, const NWQ* qnw, const NWK* knw, float qeps,
                                float keps, h16_t* kc, h16_t* vc, const int* slots, const int* seq_off, float scale,
                                O* out, const SW* sinks) {
  constexpr int G = D / 16, GP = kv16_lanes(D);
  const int h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane % GP, grp = lane / GP;
  const int kvh = h / (H / KVH), n = pos[0] + 1;
  // The head's rotated q and the token's k and v (h16 values, as the cache holds them), once
  // per block through shared memory; the norm scales of the q and k heads first (warps 0, 1).
  __shared__ float sq[D], sk[D], sv[D], rms[2];
  if (NQ || NK) {
    if (NQ && warp == 0) rms[0] = head_rms<D>(q + h * D, qeps);
    if (NK && warp == 1) rms[1] = head_rms<D>(k + kvh * D, keps);
    __syncthreads();
  }
  const float p = (float)pos[0];
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    sq[d] = rope_at<ROT, RQ, NQ>(q + h * D, d, p, inv_freq, rscale, qnw, rms[0]) * scale;
    sk[d] = to_f32(f32_to_h16(rope_at<ROT, RK, NK>(k + kvh * D, d, p, inv_freq, rscale, knw, rms[1])));
    sv[d] = to_f32(f32_to_h16(v[kvh * D + d]));
    if (h % (H / KVH) == 0) {
      const long dst = (long)slot_of[0] * (KVH * D) + kvh * D + d;
      kc[dst] = f32_to_h16(sk[d]);
      vc[dst] = f32_to_h16(sv[d]);
    }
  }
  __syncthreads();
  float qv[16], kf[16], vf[16], acc[16];
#pragma unroll
  for (int i = 0; i < 16; i++) {
    const int d = min(sub, G - 1) * 16 + i;
    qv[i] = sub < G ? sq[d] : 0.0f;
    kf[i] = sub < G ? sk[d] : 0.0f;
    vf[i] = sub < G ? sv[d] : 0.0f;
    acc[i] = 0.0f;
  }
  float m = NEG_INF, l = 0.0f;
  kv16_scan<KVH, D, CAP>(qv, kc, vc, slots + seq_off[0], WIN ? max(0, n - WIN) : 0, n - 1, kvh, m, l, acc);
  if (warp == 0) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; i++) s = fmaf(qv[i], kf[i], s);
#pragma unroll
    for (int o = GP / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    s = softcap<CAP>(s);
    if (grp == 0) kv16_add(s, vf, m, l, acc);
  }
  kv16_merge<D>(m, l, acc, out + (long)h * D, sinks ? to_f32(sinks[h]) : NEG_INF);
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// The mma.sync A fragments of 16 query rows (row r's D features at row(r), null past the
// rows), times qs, rounded to h16: the Q of attention_fa and attention_dec.
template <int D, typename ROW>
__device__ __forceinline__ void fa_q(unsigned (&qf)[D / 16][4], ROW row, float qs) {
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int ks = 0; ks < D / 16; ks++) {
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const float* src = row(g + (e & 1) * 8);
      const int d = ks * 16 + 2 * c + (e >> 1) * 8;
      qf[ks][e] = src ? pack_h16x2(src[d] * qs, src[d + 1] * qs) : pack_h16x2(0.0f, 0.0f);
    }
  }
}

// Issues (cp.async, not committed) one warp's copies of the 16 keys at positions p0.. (slots
// sl, kv head kvh; keys at n or past are zero-filled) into its K and V tiles k_s and v_s.
template <int KVH, int D>
__device__ __forceinline__ void fa_load(const h16_t* kc, const h16_t* vc, const int* sl, int kvh, int p0, int n,
                                        h16_t* k_s, h16_t* v_s) {
  constexpr int S = D + 8, DT = D / 8;
  static_assert(16 * DT % 32 == 0, "every lane takes as many copies");
  const int lane = threadIdx.x & 31;
  // Lane j < 16 reads key j's slot once; the lanes copying its rows take it by shuffle.
  const int mine = p0 + (lane & 15) < n ? sl[p0 + (lane & 15)] : sl[0];
#pragma unroll
  for (int i = lane; i < 16 * DT; i += 32) {
    const int key = i / DT, ch = i % DT;
    const bool valid = p0 + key < n;
    const long src = (long)__shfl_sync(0xffffffffu, mine, key) * (KVH * D) + kvh * D + ch * 8;
    cp_async16(smem_addr(k_s + key * S + ch * 8), kc + src, valid ? 16 : 0);
    cp_async16(smem_addr(v_s + key * S + ch * 8), vc + src, valid ? 16 : 0);
  }
}

// One warp's step over the 16 keys at positions p0.. staged in k_s and v_s (fa_load, copies
// complete and the warp synchronized) for the 16 query rows whose mma A fragments are qf
// (scaled to log2 units): S = Q·Kᵀ, the soft cap, the keys at n or past and those
// `masked(hr, p)` says (row g + 8 hr of the lane's quad, position p) set to -inf, the online
// softmax of rows g and g + 8 (m, l: the quad's max, the lane's partial sum) and O += P·V with
// P rounded to h16: attention_fa's and attention_dec's step.
template <int D, unsigned CAP, typename MASK>
__device__ __forceinline__ void fa_step(const unsigned (&qf)[D / 16][4], int p0, int n, const h16_t* k_s,
                                        const h16_t* v_s, MASK masked, float (&m)[2], float (&l)[2],
                                        float (&o)[D / 8][4]) {
  constexpr int S = D + 8, KS = D / 16, DT = D / 8;
  const int lane = threadIdx.x & 31, c = lane & 3;
  float s[2][4];
#pragma unroll
  for (int nt = 0; nt < 2; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < KS; ks++) {
    unsigned kf[4];
    ldmatrix_x4(kf, smem_addr(k_s + ((lane & 7) + (lane >> 4) * 8) * S + ks * 16 + ((lane >> 3) & 1) * 8));
    const unsigned b0[2] = {kf[0], kf[1]}, b1[2] = {kf[2], kf[3]};
    mma_h16(s[0], qf[ks], b0);
    mma_h16(s[1], qf[ks], b1);
  }
  // the mask, then the online softmax of rows g (hr 0) and g + 8 (hr 1)
#pragma unroll
  for (int hr = 0; hr < 2; hr++) {
    float mx = NEG_INF;
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const int p = p0 + nt * 8 + 2 * c + e;
        float& v = s[nt][hr * 2 + e];
        // scores are in log2 units here (q was scaled by log2 e)
        if (CAP) v = softcap<CAP>(v * 0.6931471805599453f) * 1.4426950408889634f;
        if (p >= n || masked(hr, p)) v = NEG_INF;
        mx = fmaxf(mx, v);
      }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m[hr], mx);
    const float base = m_new == NEG_INF ? 0.0f : m_new;
    const float corr = exp2f(m[hr] - base);
    m[hr] = m_new;
    float sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
      for (int e = 0; e < 2; e++) {
        float& v = s[nt][hr * 2 + e];
        v = exp2f(v - base);
        sum += v;
      }
    l[hr] = l[hr] * corr + sum;
#pragma unroll
    for (int i = 0; i < DT; i++) {
      o[i][hr * 2] *= corr;
      o[i][hr * 2 + 1] *= corr;
    }
  }
  const unsigned pa[4] = {pack_h16x2(s[0][0], s[0][1]), pack_h16x2(s[0][2], s[0][3]),
                          pack_h16x2(s[1][0], s[1][1]), pack_h16x2(s[1][2], s[1][3])};
#pragma unroll
  for (int j = 0; j < D / 16; j++) {
    unsigned vf[4];
    ldmatrix_x4_trans(vf, smem_addr(v_s + ((lane & 7) + ((lane >> 3) & 1) * 8) * S + j * 16 + (lane >> 4) * 8));
    const unsigned b0[2] = {vf[0], vf[1]}, b1[2] = {vf[2], vf[3]};
    mma_h16(o[2 * j], pa, b0);
    mma_h16(o[2 * j + 1], pa, b1);
  }
}

// fa_load then fa_step, the copies awaited in between: one tile, nothing in flight across
// tiles (attention_fa's loop).
template <int KVH, int D, unsigned CAP, typename MASK>
__device__ __forceinline__ void fa_tile(const unsigned (&qf)[D / 16][4], const h16_t* kc, const h16_t* vc,
                                        const int* sl, int kvh, int p0, int n, h16_t* k_s, h16_t* v_s,
                                        MASK masked, float (&m)[2], float (&l)[2], float (&o)[D / 8][4]) {
  fa_load<KVH, D>(kc, vc, sl, kvh, p0, n, k_s, v_s);
  cp_async_commit();
  cp_async_wait<0>();
  __syncwarp();
  fa_step<D, CAP>(qf, p0, n, k_s, v_s, masked, m, l, o);
  __syncwarp();
}

// Extend attention on tensor cores (FlashAttention-2 style, per warp): a warp takes 16
// consecutive query rows of one head; when they belong to one sequence (rows of a sequence are
// consecutive, at consecutive positions), it walks that sequence's keys in tiles of 16 staged
// through shared memory (cp.async from the paged cache), S = Q·Kᵀ and O += P·V with mma.sync
// m16n8k16, online softmax in f32 with a causal mask. Groups that span two sequences are left
// to attention_gqa<MIXED_ONLY>. Window and cap as attention_gqa's (tiles wholly before the
// window are skipped); sinks as attention_gqa's. grid: (ceil(T / 64), H), block: 128. D <= 128.
template <int H, int KVH, int D, typename O, int WIN, unsigned CAP, typename SW>
__device__ void attention_fa(const float* q, const h16_t* kc, const h16_t* vc, const int* slots,
                             const int* seq_off, const int* pos, float scale, O* out, int T, const SW* sinks) {
  constexpr int S = D + 8, KS = D / 16, DT = D / 8;
  __shared__ __align__(16) h16_t sk[4][16 * S];
  __shared__ __align__(16) h16_t sv[4][16 * S];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int h = blockIdx.y, kvh = h / (H / KVH);
  const int r0 = blockIdx.x * 64 + warp * 16;
  if (r0 >= T) return;
  const int last = min(r0 + 15, T - 1);
  if (seq_off[r0] != seq_off[last]) return;
  const int* sl = slots + seq_off[r0];
  const int p_first = pos[r0], n_keys = pos[last] + 1;
  const float qs = scale * 1.4426950408889634f;
  unsigned qf[KS][4];
  fa_q<D>(qf, [&](int r) { return r0 + r < T ? q + ((long)(r0 + r) * H + h) * D : nullptr; }, qs);
  float o[DT][4];
#pragma unroll
  for (int i = 0; i < DT; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
  h16_t* k_s = sk[warp];
  h16_t* v_s = sv[warp];
  const int p_lo = WIN ? max(0, p_first - WIN + 1) & ~15 : 0;
  for (int p0 = p_lo; p0 < n_keys; p0 += 16) {
    const auto masked = [&](int hr, int p) {
      const int row_pos = p_first + g + hr * 8;
      return p > row_pos || (WIN && p <= row_pos - WIN);
    };
    fa_tile<KVH, D, CAP>(qf, kc, vc, sl, kvh, p0, n_keys, k_s, v_s, masked, m, l, o);
  }
#pragma unroll
  for (int hr = 0; hr < 2; hr++) {
    float lt = l[hr];
    lt += __shfl_xor_sync(0xffffffffu, lt, 1);
    lt += __shfl_xor_sync(0xffffffffu, lt, 2);
    const int row = r0 + g + hr * 8;
    if (row >= T) continue;
    // The sink's share, relative to the row's maximum (log2 units, as m).
    if (sinks) lt += exp2f(to_f32(sinks[h]) * 1.4426950408889634f - m[hr]);
    O* dst = out + ((long)row * H + h) * D;
#pragma unroll
    for (int i = 0; i < DT; i++) {
      store(dst + i * 8 + 2 * c, o[i][hr * 2] / lt);
      store(dst + i * 8 + 2 * c + 1, o[i][hr * 2 + 1] / lt);
    }
  }
}

// How decode attention (attention_dec) splits a row's keys: tiles of 16 from the window's
// first key's tile (base) to the row's position (n - 1 its last key), `tiles` in all, `per` to a
// split (at least DEC_SPLIT_MIN), the first
// `splits` of SPLITS holding them.
struct DecSplit {
  int first, n, base, tiles, per, splits;
};
template <int WIN, int SPLITS>
__device__ __forceinline__ DecSplit dec_split(int pos) {
  DecSplit d;
  d.n = pos + 1;
  d.first = WIN ? max(0, d.n - WIN) : 0;
  d.base = d.first & ~15;
  d.tiles = (d.n - d.base + 15) >> 4;
  d.per = max((d.tiles + SPLITS - 1) / SPLITS, DEC_SPLIT_MIN);
  d.splits = (d.tiles + d.per - 1) / d.per;
  return d;
}

// Decode attention on tensor cores, for rows of any sequences: a block per row t, kv head and
// split of the row's keys (dec_split), whose G = H / KVH query heads (at most 16) are the 16 rows
// of attention_fa's mma.sync tiles (rows past G are zero and not stored), so each K and V tile
// feeds every head sharing it. The split's tiles go to the DEC_WARPS warps in turn; each warp
// keeps DEC_STAGES tiles in flight (cp.async into its stages of the dynamic shared memory, the
// next tiles' copies issued before a tile is used) and runs attention_fa's online softmax (f32,
// log2 units, P rounded to h16 for P·V). The warps' states merge through shared memory: into the
// output where the row's keys are one split, else into `part` (each split's unnormalised
// output, max and sum a head), which attention_dec_merge combines. With MIXED_ONLY, only rows
// attention_fa leaves run (fa_row). Window, cap and sinks as attention_fa's.
// grid: T * SPLITS * KVH, row-major (a row's kv heads run together, reading its cache rows
// whole), block: 32 * DEC_WARPS, dynamic shared memory:
// DEC_WARPS * DEC_STAGES * 2 * 16 * (D + 8) 16-bit values. D <= 128.
template <int H, int KVH, int D, typename O, bool MIXED_ONLY, int WIN, unsigned CAP, typename SW, int SPLITS>
__device__ void attention_dec(const float* q, const h16_t* kc, const h16_t* vc, const int* slots,
                              const int* seq_off, const int* pos, float scale, O* out, int T, const SW* sinks,
                              float* part) {
  constexpr int G = H / KVH, S = D + 8, KS = D / 16, DT = D / 8, TILE = 16 * S;
  static_assert(G <= 16 && D % 16 == 0 && D <= 128, "a kv head's query heads fill one mma tile");
  extern __shared__ __align__(16) unsigned char dec_smem[];
  __shared__ float sm_m[DEC_WARPS][16], sm_l[DEC_WARPS][16];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int t = blockIdx.x / (KVH * SPLITS), kvh = blockIdx.x % KVH, split = blockIdx.x / KVH % SPLITS;
  const int h0 = kvh * G;
  if (MIXED_ONLY && fa_row(seq_off, t, T)) return;
  const DecSplit ds = dec_split<WIN, SPLITS>(pos[t]);
  if (split >= ds.splits) return;
  const int* sl = slots + seq_off[t];
  const int j0 = split * ds.per, j1 = min(j0 + ds.per, ds.tiles);
  const float qs = scale * 1.4426950408889634f;
  unsigned qf[KS][4];
  fa_q<D>(qf, [&](int r) { return r < G ? q + ((long)t * H + h0 + r) * D : nullptr; }, qs);
  float o[DT][4];
#pragma unroll
  for (int i = 0; i < DT; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
  // The warp's stages, each a K tile then a V tile.
  h16_t* stages = (h16_t*)dec_smem + warp * DEC_STAGES * 2 * TILE;
  const auto k_s = [&](int i) { return stages + (i % DEC_STAGES) * 2 * TILE; };
  const auto load = [&](int j, int i) {
    if (j < j1) fa_load<KVH, D>(kc, vc, sl, kvh, ds.base + j * 16, ds.n, k_s(i), k_s(i) + TILE);
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < DEC_STAGES - 1; i++) load(j0 + warp + i * DEC_WARPS, i);
  for (int i = 0, j = j0 + warp; j < j1; i++, j += DEC_WARPS) {
    load(j + (DEC_STAGES - 1) * DEC_WARPS, i + DEC_STAGES - 1);
    cp_async_wait<DEC_STAGES - 1>();
    __syncwarp();
    fa_step<D, CAP>(qf, ds.base + j * 16, ds.n, k_s(i), k_s(i) + TILE, [&](int, int p) { return p < ds.first; }, m,
                    l, o);
    __syncwarp();
  }
  cp_async_wait<0>();
  // Each warp's row maxima and sums, then the rows' totals (with the sinks where this block
  // has all the keys; log2 units as m).
#pragma unroll
  for (int hr = 0; hr < 2; hr++) {
    float lt = l[hr];
    lt += __shfl_xor_sync(0xffffffffu, lt, 1);
    lt += __shfl_xor_sync(0xffffffffu, lt, 2);
    if (c == 0) {
      sm_m[warp][g + hr * 8] = m[hr];
      sm_l[warp][g + hr * 8] = lt;
    }
  }
  __syncthreads();
  const bool whole = ds.splits == 1;
  float* ml = part + (((long)t * KVH + kvh) * SPLITS + split) * G * (D + 2);
  float f[2];
#pragma unroll
  for (int hr = 0; hr < 2; hr++) {
    const int row = g + hr * 8;
    const float sink = whole && sinks && row < G ? to_f32(sinks[h0 + row]) * 1.4426950408889634f : NEG_INF;
    const float2 merged = merge_states<DEC_WARPS, true>(sink, &sm_m[0][row], &sm_l[0][row], 16);
    f[hr] = m[hr] == NEG_INF ? 0.0f : exp2f(m[hr] - merged.x) / (whole ? merged.y : 1.0f);
    if (!whole && warp == 0 && c == 0 && row < G) {
      ml[G * D + row] = merged.x;
      ml[G * D + G + row] = merged.y;
    }
  }
  // The warps' outputs summed in turn into shared memory (the first stages' space: every warp's
  // copies are done).
  float* so = (float*)dec_smem;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < DEC_WARPS; w++) {
    if (warp == w) {
#pragma unroll
      for (int i = 0; i < DT; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int idx = (g + (e >> 1) * 8) * D + i * 8 + 2 * c + (e & 1);
          so[idx] = (w ? so[idx] : 0.0f) + o[i][e] * f[e >> 1];
        }
    }
    __syncthreads();
  }
  for (int i = threadIdx.x; i < G * D; i += DEC_WARPS * 32) {
    if (whole)
      store(out + ((long)t * H + h0) * D + i, so[i]);
    else
      ml[i] = so[i];
  }
}

// The splits of attention_dec (SPLITS of them) merged: a block per row t and kv head, a thread
// per (query head, feature) in turn; rows whose keys were one split attention_dec wrote itself.
// The sinks as attention_dec's. grid: T * KVH, block: 128.
template <int H, int KVH, int D, typename O, bool MIXED_ONLY, int WIN, typename SW, int SPLITS>
__device__ void attention_dec_merge(const int* seq_off, const int* pos, O* out, int T, const SW* sinks,
                                    const float* part) {
  constexpr int G = H / KVH, P = G * (D + 2);
  const int t = blockIdx.x / KVH, kvh = blockIdx.x % KVH, h0 = kvh * G;
  if (MIXED_ONLY && fa_row(seq_off, t, T)) return;
  const DecSplit ds = dec_split<WIN, SPLITS>(pos[t]);
  if (ds.splits == 1) return;
  const float* ps = part + ((long)t * KVH + kvh) * SPLITS * P;
  for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
    const int r = i / D;
    const float sink = sinks ? to_f32(sinks[h0 + r]) * 1.4426950408889634f : NEG_INF;
    float mm = sink;
    for (int s = 0; s < ds.splits; s++) mm = fmaxf(mm, ps[s * P + G * D + r]);
    float ll = sink == NEG_INF ? 0.0f : exp2f(sink - mm), acc = 0.0f;
    for (int s = 0; s < ds.splits; s++) {
      const float w = exp2f(ps[s * P + G * D + r] - mm);
      ll += ps[s * P + G * D + G + r] * w;
      acc += ps[s * P + i] * w;
    }
    store(out + ((long)t * H + h0) * D + i, acc / ll);
  }
}

// out[r] = x[rows[r]] for the rows whose logits are wanted. grid: R, block: 256.
template <int H, typename X, typename O>
__device__ void gather(const X* x, const int* rows, O* out) {
  const X* src = x + (long)rows[blockIdx.x] * H;
  for (int i = threadIdx.x; i < H; i += blockDim.x) store(out + (long)blockIdx.x * H + i, to_f32(src[i]));
}
