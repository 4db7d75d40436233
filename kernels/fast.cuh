// Fused kernels: what the CUDA backend runs, with gemm.cuh (tensor-core linears) and
// attention.cuh (RoPE + KV write, attention) after it. Inputs of every linear are 16-bit
// activations (h16_t: bf16 or f16, as a 16-bit model computes them); the residual stream, norms,
// softmax and all accumulation are f32. The KV cache is h16_t too. This file holds the E4M3
// helpers and the input quantizer, the add + RMS norms, the decode GEMVs, the GLU multiply, row
// gathers and the tensor-core helpers the other two build on. basic.cuh keeps the unfused
// reference kernels for shapes these do not cover.

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

// ---- FP8 E4M3 weights (the format: formats.cuh) ----
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

// ---- GGUF's blocks (the formats: formats.cuh) ----
// PER f32 weights as PER / 8 chunks of h16, rounded to nearest even (the tensor-core kernels'
// operands).
template <int PER>
__device__ __forceinline__ void f32_h16(const float* f, uint4* h) {
#pragma unroll
  for (int q = 0; q < PER / 8; q++)
    h[q] = make_uint4(pack_h16x2(f[8 * q], f[8 * q + 1]), pack_h16x2(f[8 * q + 2], f[8 * q + 3]),
                      pack_h16x2(f[8 * q + 4], f[8 * q + 5]), pack_h16x2(f[8 * q + 6], f[8 * q + 7]));
}

// out[t, :] = the weights of row ids[t] of a table of ROWS rows of H in one of GGUF's formats.
// grid: T, block: 256.
template <int H, int ROWS, typename WT>
__device__ void embedding_blocks(const int* ids, const WT* table, float* out) {
  constexpr int PER = WFmt<WT>::PER;
  const long id = ids[blockIdx.x];
  const uint4* codes = row_codes<H>(table, id);
  const float* p = row_scales<H>(table, ROWS, id);
  float* o = out + (long)blockIdx.x * H;
  for (int c = threadIdx.x; c < H / PER; c += blockDim.x) {
    float f[PER];
    WFmt<WT>::f32(codes[c], WFmt<WT>::sm(p, c), f);
#pragma unroll
    for (int i = 0; i < PER; i++) o[c * PER + i] = f[i];
  }
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
// WT: h16_t (8 weights a chunk), fp8_t (16 codes a chunk, with the scale of each chunk) or one
// of GGUF's formats (formats.cuh: each chunk's scale and offset).
template <int K, int SPLIT, typename WT>
struct RowPart {
  static constexpr int PER = WFmt<WT>::PER, C = K / PER, PART = (C + SPLIT - 1) / SPLIT, L = (PART + 31) / 32;
  int c0, end;
  __device__ __forceinline__ RowPart() {
    const int part = (threadIdx.x >> 5) % SPLIT;
    c0 = part * PART + (threadIdx.x & 31);
    end = min(C, (part + 1) * PART);
  }
  // The row's chunks (wr: row_codes), and for E4M3 and GGUF their scales (ws: row_scales).
  __device__ __forceinline__ void load(const uint4* wr, const float* ws, uint4* wv, float2* sv) const {
#pragma unroll
    for (int j = 0; j < L; j++) {
      const bool in = c0 + 32 * j < end;
      wv[j] = in ? ld_stream_first(wr + c0 + 32 * j) : make_uint4(0, 0, 0, 0);
      if constexpr (WFmt<WT>::GGUF) {
        sv[j] = in ? WFmt<WT>::sm(ws, c0 + 32 * j) : make_float2(0.0f, 0.0f);
      } else if constexpr (PER == 16) {
        sv[j] = make_float2(in ? ws[(c0 + 32 * j) * PER / W8_GROUP] : 0.0f, 0.0f);
      }
    }
  }
  // acc[w * ROWS + r] = the lane's part of the dot of input row r (of x) with the loaded chunks
  // wv[w] (scales sv[w]) of each of NW weights sharing the input (gate and up): each weight
  // chunk and each input chunk is unpacked once, and every sum is added in the same order as
  // with one weight.
  template <int ROWS, int NW = 1>
  __device__ __forceinline__ void dot(const h16_t* x, const uint4 (*wv)[L], const float2 (*sv)[L], int T,
                                      float* acc) const {
#pragma unroll
    for (int i = 0; i < NW * ROWS; i++) acc[i] = 0.0f;
#pragma unroll
    for (int j = 0; j < L; j++)
      if (c0 + 32 * j < end) {
        float wf[NW][PER];
#pragma unroll
        for (int w = 0; w < NW; w++) {
          if constexpr (PER == 8) {
            unpack8(wv[w][j], wf[w]);
          } else if constexpr (WFmt<WT>::GGUF) {
            WFmt<WT>::f32(wv[w][j], sv[w][j], wf[w]);
          } else {
            e4m3x16(wv[w][j], wf[w]);
          }
        }
#pragma unroll
        for (int r = 0; r < ROWS; r++)
          if (r < T) {
            const uint4* xr = (const uint4*)(x + (long)r * K) + (PER / 8) * (c0 + 32 * j);
            float d[NW];
#pragma unroll
            for (int w = 0; w < NW; w++) d[w] = 0.0f;
#pragma unroll
            for (int q = 0; q < PER / 8; q++) {
              float xf[8];
              unpack8(xr[q], xf);
#pragma unroll
              for (int w = 0; w < NW; w++)
#pragma unroll
                for (int i = 0; i < 8; i++) d[w] = fmaf(wf[w][8 * q + i], xf[i], d[w]);
            }
#pragma unroll
            for (int w = 0; w < NW; w++) {
              if constexpr (PER == 16 && !WFmt<WT>::GGUF)
                acc[w * ROWS + r] = fmaf(sv[w][j].x, d[w], acc[w * ROWS + r]);
              else
                acc[w * ROWS + r] += d[w];
            }
          }
      }
  }
};

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

// One linear of a launch that computes up to three sharing an input (weights in any format; a
// 16-bit bias, or an f32 one as GGUF files store them: BT).
template <typename WT, typename BT = h16_t>
struct LinearOut {
  const WT* w;
  const BT* b;
  float* o;
  int n;
};

// The group that index i (over the groups' concatenated units, c0 and c1 units in the first
// two) falls in; i becomes the index inside that group.
template <typename WT, typename BT>
__device__ __forceinline__ LinearOut<WT, BT> pick_group(int& i, int c0, int c1, LinearOut<WT, BT> g0,
                                                        LinearOut<WT, BT> g1, LinearOut<WT, BT> g2) {
  if (i >= c0 + c1) { i -= c0 + c1; return g2; }
  if (i >= c0) { i -= c0; return g1; }
  return g0;
}

// Up to three linears sharing the input rows x (X16 or XNorm): group g has N_g outputs,
// weight w_g [N_g, K] (any format: formats.cuh), optional bias b_g (BT). The outputs are one
// packed f32 matrix [T, N0 + N1 + N2], o_g pointing at group g's first column (codegen_cuda's
// `Builder::packed`); so is every linear launch of the GEMMs below.
// grid: ceil((N0 + N1 + N2) / (8 / SPLIT)), block: 256.
template <int K, int N0, int N1, int N2, int ROWS, int SPLIT, typename WT, typename X, typename BT>
__device__ void gemv(const X& x, const WT* w0, const BT* b0, float* o0, const WT* w1, const BT* b1, float* o1,
                     const WT* w2, const BT* b2, float* o2, int T) {
  int n = blockIdx.x * (8 / SPLIT) + (threadIdx.x >> 5) / SPLIT;
  const bool live = n < N0 + N1 + N2;
  n = min(n, N0 + N1 + N2 - 1);
  const LinearOut<WT, BT> g = pick_group(n, N0, N1, LinearOut<WT, BT>{w0, b0, o0, N0},
                                         LinearOut<WT, BT>{w1, b1, o1, N1}, LinearOut<WT, BT>{w2, b2, o2, N2});
  const BT* b = g.b;
  float* o = g.o;
  const int N = g.n;
  using Part = RowPart<K, SPLIT, WT>;
  const Part part;
  uint4 wv[1][Part::L];
  float2 sv[1][Part::L];
  part.load(row_codes<K>(g.w, n), row_scales<K>(g.w, N, n), wv[0], sv[0]);
  pdl_wait();
  float acc[ROWS];
  part.template dot<ROWS>(x.template rows<K, ROWS>(T), wv, sv, T, acc);
  split_sum<ROWS, SPLIT>(acc);
  if (live && (threadIdx.x & 31) == 0 && ((threadIdx.x >> 5) % SPLIT) == 0) {
    const float bias = b ? to_f32(b[n]) : 0.0f;
#pragma unroll
    for (int r = 0; r < ROWS; r++)
      if (r < T) o[(long)r * (N0 + N1 + N2) + n] = acc[r] + bias;
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
  uint4 wv[2][Part::L];  // gate, up
  float2 sv[2][Part::L];
  part.load(row_codes<K>(wg, n), row_scales<K>(wg, N, n), wv[0], sv[0]);
  part.load(row_codes<K>(wu, n), row_scales<K>(wu, N, n), wv[1], sv[1]);
  pdl_wait();
  const h16_t* xr = x.template rows<K, ROWS>(T);
  float acc[2 * ROWS];
  // Gate and up share each unpacked input chunk where both weights' unpacked chunks fit the
  // registers of three blocks an SM: 16-bit weights, and E4M3 at one row. Measured on an H200,
  // 7B shape (docs/perf.md): E4M3 at 2 rows went from 70 to 89 registers and 4% slower; GGUF's
  // formats (their scales and offsets too) went to 95-96 (q4_t at 1 row, q8s_t / q8u_t at 1).
  if constexpr (Part::PER == 8 || (!WFmt<WT>::GGUF && ROWS == 1)) {
    part.template dot<ROWS, 2>(xr, wv, sv, T, acc);
  } else {
    part.template dot<ROWS>(xr, wv, sv, T, acc);
    part.template dot<ROWS>(xr, wv + 1, sv + 1, T, acc + ROWS);
  }
  split_sum<2 * ROWS, SPLIT>(acc);
  if (live && (threadIdx.x & 31) == 0 && ((threadIdx.x >> 5) % SPLIT) == 0) {
#pragma unroll
    for (int r = 0; r < ROWS; r++)
      if (r < T) out[(long)r * N + n] = f32_to_h16(act(acc[r]) * acc[ROWS + r]);
  }
}

// act(a)·b as h16 (after the GEMM path's gate and up): a and b are the columns 0..N and N..2N
// of one packed [T, 2N] f32 matrix (rows of 2N), out [T, N]; four per thread (16-byte loads)
// where N is a multiple of 4. grid: ceil(T * N / 1024), block: 256.
template <int N, typename ACT>
__device__ void glu_mul(const float* a, const float* b, h16_t* out, long n, ACT act) {
  const long i = 4 * ((long)blockIdx.x * blockDim.x + threadIdx.x);
  const auto src = [](long j) { return (j / N) * (2 * N) + j % N; };
  if (N % 4 == 0 && i + 3 < n) {
    const float4 x = *(const float4*)(a + src(i)), y = *(const float4*)(b + src(i));
    const unsigned lo = f32_to_h16(act(x.x) * y.x) | ((unsigned)f32_to_h16(act(x.y) * y.y) << 16);
    const unsigned hi = f32_to_h16(act(x.z) * y.z) | ((unsigned)f32_to_h16(act(x.w) * y.w) << 16);
    *(uint2*)(out + i) = make_uint2(lo, hi);
  } else {
    for (long j = i; j < n && j < i + 4; ++j) out[j] = f32_to_h16(act(a[src(j)]) * b[src(j)]);
  }
}

// f32 to h16. grid: ceil(n / 256), block: 256.
__device__ void to_h16(const float* a, h16_t* out, long n) {
  const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = f32_to_h16(a[i]);
}

// ---- tensor-core helpers (cp.async, ldmatrix, mma.sync m16n8k16 h16 with f32 accumulation) ----
// What gemm.cuh and attention.cuh build on.
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

// out[r] = x[rows[r]] for the rows whose logits are wanted. grid: R, block: 256.
template <int H, typename X, typename O>
__device__ void gather(const X* x, const int* rows, O* out) {
  const X* src = x + (long)rows[blockIdx.x] * H;
  for (int i = threadIdx.x; i < H; i += blockDim.x) store(out + (long)blockIdx.x * H + i, to_f32(src[i]));
}
