// Standalone check of gemm_skinny_a8 with CL (cluster sums) against CL = 0 (stream-K) and a CPU
// reference. Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a harness.cu -lcuda
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <vector>
#include <random>
#include <algorithm>

#include "prelude.cuh"
#include "basic.cuh"
#include "formats.cuh"
#include "fast.cuh"
#include "gemm.cuh"

#define PARAMS                                                                                                   \
  const __grid_constant__ TmaMap mx, const float *xs, const fp8_t *w0, const h16_t *b0, float *o0, const fp8_t *w1, \
      const h16_t *b1, float *o1, const fp8_t *w2, const h16_t *b2, float *o2, float *part, unsigned *count, int T, \
      const __grid_constant__ TmaMap mw0, const __grid_constant__ TmaMap mw1, const __grid_constant__ TmaMap mw2
#define CALL(K, N0, N1, N2, B, S, CL) \
  pdl_trigger();                      \
  gemm_skinny_a8<K, N0, N1, N2, B, S, 4, CL>(&mx, xs, w0, b0, o0, w1, b1, o1, w2, b2, o2, part, count, T, &mw0, &mw1, &mw2);

// Instances, as codegen writes them (BLOCKS, SLOTS from a8_blocks / a8_slots; checked on the host).
extern "C" __global__ void __launch_bounds__(128, 1) ref_o(PARAMS) { CALL(3584, 3584, 0, 0, 196, 7, 0) }
extern "C" __global__ void __launch_bounds__(128, 1) __cluster_dims__(7, 1, 1) cl_o(PARAMS) { CALL(3584, 3584, 0, 0, 196, 7, 7) }
extern "C" __global__ void __launch_bounds__(128, 1) ref_qkv(PARAMS) { CALL(3584, 3584, 512, 512, 252, 7, 0) }
extern "C" __global__ void __launch_bounds__(128, 1) __cluster_dims__(7, 1, 1) cl_qkv(PARAMS) { CALL(3584, 3584, 512, 512, 252, 7, 7) }
extern "C" __global__ void __launch_bounds__(128, 1) ref_down(PARAMS) { CALL(18944, 3584, 0, 0, 264, 11, 0) }
extern "C" __global__ void __launch_bounds__(128, 1) __cluster_dims__(8, 1, 1) cl_down(PARAMS) { CALL(18944, 3584, 0, 0, 264, 11, 8) }
extern "C" __global__ void __launch_bounds__(128, 1) ref_d05(PARAMS) { CALL(4864, 896, 0, 0, 66, 11, 0) }
extern "C" __global__ void __launch_bounds__(128, 1) __cluster_dims__(8, 1, 1) cl_d05(PARAMS) { CALL(4864, 896, 0, 0, 66, 11, 8) }
extern "C" __global__ void __launch_bounds__(128, 1) ref_small(PARAMS) { CALL(1024, 256, 0, 0, 4, 2, 0) }
extern "C" __global__ void __launch_bounds__(128, 1) __cluster_dims__(2, 1, 1) cl_small(PARAMS) { CALL(1024, 256, 0, 0, 4, 2, 2) }

typedef void (*Kern)(PARAMS);

#define CK(x)                                                                         \
  do {                                                                                \
    cudaError_t e = (x);                                                              \
    if (e != cudaSuccess) {                                                           \
      printf("CUDA error %s at %s:%d: %s\n", #x, __FILE__, __LINE__, cudaGetErrorString(e)); \
      exit(1);                                                                        \
    }                                                                                 \
  } while (0)

// ---- host mirrors of codegen_cuda's a8_* ----
static const int A8_BLOCKS = 264, SMEM = 4 * (64 * 128 + 128 * 128 + (64 + 128) * 4) + 1024;
static int h_units(int k, int n) { return (n / 128) * (k / 128); }
static int h_blocks(int k, int n) { return std::min(std::max(h_units(k, n) / 4, 1), A8_BLOCKS); }
static int h_slots(int k, int n) {
  long units = h_units(k, n), blocks = h_blocks(k, n), groups = k / 128;
  auto block_of = [&](long u) {
    for (long b = blocks - 1; b >= 0; b--)
      if (b * units / blocks <= u) return b;
    return 0L;
  };
  long m = 1;
  for (long t = 0; t < n / 128; t++) m = std::max(m, block_of(t * groups + groups - 1) - block_of(t * groups) + 1);
  return (int)m;
}
static int h_cluster(int k, int n) {
  int tiles = n / 128, groups = k / 128;
  int cl = std::min(std::min(h_blocks(k, n) / std::max(tiles, 1), 8), groups);
  return cl >= 2 ? cl : 0;
}
static int h_grid(int k, int n) { int cl = h_cluster(k, n); return cl ? n / 128 * cl : h_blocks(k, n); }

static float e4m3(unsigned char c) {
  int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
  float v = e ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp(m / 8.0f, -6);
  return s ? -v : v;
}
static unsigned char rand_code(std::mt19937& r) {
  unsigned s = r() & 1, e = 4 + r() % 6, m = r() % 8;
  return (unsigned char)((s << 7) | (e << 3) | m);
}
static float bf16f(unsigned short b) { unsigned u = (unsigned)b << 16; float f; memcpy(&f, &u, 4); return f; }

static CUtensorMap tmap(void* ptr, int row_bytes, int rows, int box_rows) {
  CUtensorMap m;
  cuuint64_t dims[2] = {(cuuint64_t)row_bytes, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)row_bytes};
  cuuint32_t box[2] = {128, (cuuint32_t)box_rows}, steps[2] = {1, 1};
  CUresult r = cuTensorMapEncodeTiled(&m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, ptr, dims, strides, box, steps,
                                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) { printf("tmap failed %d\n", (int)r); exit(1); }
  return m;
}

struct Cfg {
  const char* name;
  int K, N[3], blocks, slots, cl;
  Kern ref, clk;
};

static int failures = 0;

static void launch(Kern k, int grid, bool pdl, cudaStream_t st, void** args) {
  cudaLaunchConfig_t c = {};
  c.gridDim = dim3(grid);
  c.blockDim = dim3(128);
  c.dynamicSmemBytes = SMEM;
  c.stream = st;
  cudaLaunchAttribute a[1];
  a[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a[0].val.programmaticStreamSerializationAllowed = 1;
  c.attrs = a;
  c.numAttrs = pdl ? 1 : 0;
  CK(cudaLaunchKernelExC(&c, (const void*)k, args));
}

static void run(const Cfg& c, bool bias_all) {
  const int K = c.K, NT = c.N[0] + c.N[1] + c.N[2], G = K / 128;
  if (h_blocks(K, NT) != c.blocks || h_slots(K, NT) != c.slots || h_cluster(K, NT) != c.cl) {
    printf("%s: template args differ from host mirror: blocks %d slots %d cl %d\n", c.name, h_blocks(K, NT),
           h_slots(K, NT), h_cluster(K, NT));
    failures++;
    return;
  }
  CK(cudaFuncSetAttribute((const void*)c.ref, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
  CK(cudaFuncSetAttribute((const void*)c.clk, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
  {
    cudaLaunchConfig_t lc = {};
    lc.gridDim = dim3(h_grid(K, NT));
    lc.blockDim = dim3(128);
    lc.dynamicSmemBytes = SMEM;
    int ncl = -1;
    cudaError_t e = cudaOccupancyMaxActiveClusters(&ncl, (const void*)c.clk, &lc);
    cudaFuncAttributes fa;
    CK(cudaFuncGetAttributes(&fa, (const void*)c.clk));
    cudaFuncAttributes fr;
    CK(cudaFuncGetAttributes(&fr, (const void*)c.ref));
    printf("%s: K %d N %d+%d+%d G %d cl %d grid %d (ref %d) maxActiveClusters %d (%s) regs cl %d ref %d local cl %zu ref %zu static smem %zu\n",
           c.name, K, c.N[0], c.N[1], c.N[2], G, c.cl, h_grid(K, NT), c.blocks, ncl, cudaGetErrorString(e),
           fa.numRegs, fr.numRegs, fa.localSizeBytes, fr.localSizeBytes, fa.sharedSizeBytes);
  }
  std::mt19937 r(1234 + K + NT);
  std::vector<unsigned char> wall;  // per group: codes [N_g, K] then scales [N_g, G] f32
  std::vector<size_t> woff(3);
  std::vector<std::vector<unsigned char>> wq(3);
  std::vector<std::vector<float>> ws(3);
  std::vector<std::vector<unsigned short>> bias(3);
  for (int g = 0; g < 3; g++) {
    int n = c.N[g];
    wq[g].resize((size_t)n * K);
    ws[g].resize((size_t)n * G);
    for (auto& v : wq[g]) v = rand_code(r);
    for (auto& v : ws[g]) v = 0.5f + (r() % 1000) / 1000.0f;
    bias[g].resize(n);
    for (auto& v : bias[g]) { float f = ((int)(r() % 2001) - 1000) / 100.0f; unsigned u; memcpy(&u, &f, 4); v = u >> 16; }
  }
  std::vector<unsigned char> xq((size_t)64 * K);
  std::vector<float> xsm((size_t)G * 64);
  for (auto& v : xq) v = rand_code(r);
  for (auto& v : xsm) v = 0.5f + (r() % 1000) / 1000.0f;
  bool has_bias[3] = {true, bias_all, bias_all};
  // CPU reference over all 64 rows, every 5th feature (and the tile's last).
  std::vector<double> ref((size_t)64 * NT, 0.0);
  std::vector<char> checked(NT, 0);
  for (int f = 0; f < NT; f++) checked[f] = (f % 5 == 0) || (f % 128 == 127) || (f % 128 < 4);
  {
    int f = 0;
    for (int g = 0; g < 3; g++)
      for (int n = 0; n < c.N[g]; n++, f++) {
        if (!checked[f]) continue;
        for (int t = 0; t < 64; t++) {
          double acc = has_bias[g] ? bf16f(bias[g][n]) : 0.0;
          for (int gi = 0; gi < G; gi++) {
            double d = 0;
            for (int kk = 0; kk < 128; kk++)
              d += (double)e4m3(xq[(size_t)t * K + gi * 128 + kk]) * e4m3(wq[g][(size_t)n * K + gi * 128 + kk]);
            acc += d * xsm[gi * 64 + t] * ws[g][(size_t)n * G + gi];
          }
          ref[(size_t)t * NT + f] = acc;
        }
      }
  }
  // Device buffers.
  unsigned char* dw[3] = {};
  unsigned short* db[3] = {};
  for (int g = 0; g < 3; g++) {
    if (!c.N[g]) continue;
    size_t cb = (size_t)c.N[g] * K, sb = (size_t)c.N[g] * G * 4;
    CK(cudaMalloc(&dw[g], cb + sb));
    CK(cudaMemcpy(dw[g], wq[g].data(), cb, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dw[g] + cb, ws[g].data(), sb, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&db[g], c.N[g] * 2));
    CK(cudaMemcpy(db[g], bias[g].data(), c.N[g] * 2, cudaMemcpyHostToDevice));
  }
  unsigned char* dxq;
  float *dxs, *dout, *dpart;
  unsigned* dcount;
  CK(cudaMalloc(&dxq, (size_t)64 * K));
  CK(cudaMalloc(&dxs, (size_t)G * 64 * 4));
  CK(cudaMalloc(&dout, (size_t)64 * NT * 4));
  CK(cudaMalloc(&dpart, (size_t)c.slots * 64 * NT * 4));
  CK(cudaMalloc(&dcount, (NT / 128) * 4));
  CK(cudaMemset(dcount, 0, (NT / 128) * 4));
  CK(cudaMemcpy(dxq, xq.data(), (size_t)64 * K, cudaMemcpyHostToDevice));
  CUtensorMap mw[3];
  memset(mw, 0, sizeof mw);
  for (int g = 0; g < 3; g++)
    if (c.N[g]) mw[g] = tmap(dw[g], K, c.N[g], 128);
  // One launch's arguments at T rows: the input's scales for T rows copied to the device, its
  // TMA map, the packed outputs and the biases; a.p points into a, so a stays where it is made.
  struct Args {
    int T;
    CUtensorMap mx;
    float *o0, *o1, *o2;
    const h16_t *b0, *b1, *b2;
    void* p[17];
  };
  auto set_args = [&](Args& a, int T) {
    std::vector<float> xs((size_t)G * T);
    for (int gi = 0; gi < G; gi++)
      for (int t = 0; t < T; t++) xs[(size_t)gi * T + t] = xsm[gi * 64 + t];
    CK(cudaMemcpy(dxs, xs.data(), xs.size() * 4, cudaMemcpyHostToDevice));
    a.T = T;
    a.mx = tmap(dxq, K, T, 64);
    a.o0 = dout;
    a.o1 = dout + c.N[0];
    a.o2 = dout + c.N[0] + c.N[1];
    a.b0 = has_bias[0] ? db[0] : nullptr;
    a.b1 = has_bias[1] ? db[1] : nullptr;
    a.b2 = has_bias[2] ? db[2] : nullptr;
    void* p[] = {&a.mx, &dxs, &dw[0], &a.b0, &a.o0, &dw[1], &a.b1, &a.o1, &dw[2], &a.b2, &a.o2, &dpart, &dcount, &a.T,
                 &mw[0], &mw[1], &mw[2]};
    memcpy(a.p, p, sizeof p);
  };
  const int Ts[] = {1, 2, 3, 7, 8, 9, 16, 31, 32, 33, 47, 56, 63, 64};
  std::vector<float> outr((size_t)64 * NT), outc((size_t)64 * NT);
  for (int T : Ts) {
    Args a;
    set_args(a, T);
    void** args = a.p;
    for (int which = 0; which < 2; which++) {
      CK(cudaMemset(dout, 0xff, (size_t)64 * NT * 4));
      CK(cudaDeviceSynchronize());
      if (which == 0) launch(c.ref, c.blocks, true, 0, args);
      else launch(c.clk, h_grid(K, NT), true, 0, args);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(which ? outc.data() : outr.data(), dout, (size_t)64 * NT * 4, cudaMemcpyDeviceToHost));
    }
    double maxref = 0, err_r = 0, err_c = 0, diff_rc = 0;
    long bad_tail = 0, nan_head = 0;
    for (int t = 0; t < 64; t++)
      for (int f = 0; f < NT; f++) {
        size_t i = (size_t)t * NT + f;
        unsigned ur, uc;
        memcpy(&ur, &outr[i], 4);
        memcpy(&uc, &outc[i], 4);
        if (t >= T) {
          if (uc != 0xffffffffu || ur != 0xffffffffu) bad_tail++;
          continue;
        }
        if (std::isnan(outc[i]) || std::isnan(outr[i])) { nan_head++; continue; }
        diff_rc = std::max(diff_rc, (double)std::fabs(outc[i] - outr[i]));
        if (checked[f]) {
          maxref = std::max(maxref, std::fabs(ref[i]));
          err_r = std::max(err_r, std::fabs(outr[i] - ref[i]));
          err_c = std::max(err_c, std::fabs(outc[i] - ref[i]));
        }
      }
    bool ok = bad_tail == 0 && nan_head == 0 && err_c <= 1e-5 * maxref + 1e-3 && diff_rc <= 1e-5 * maxref + 1e-3;
    if (!ok) failures++;
    printf("  T=%2d  max|ref| %.3e  err stream-K %.3e  err cluster %.3e  |cl-sk| %.3e  tail-writes %ld  nans %ld  %s\n", T,
           maxref, err_r, err_c, diff_rc, bad_tail, nan_head, ok ? "ok" : "FAIL");
  }
  // Timing: 200 back-to-back PDL launches of each, T = 1 and 64.
  for (int T : {1, 64}) {
    Args a;
    set_args(a, T);
    void** args = a.p;
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    float ms[3];
    for (int which = 0; which < 3; which++) {  // 0 ref, 1 cluster, 2 alternating ref/cluster
      auto one = [&](int i) {
        bool clk = which == 1 || (which == 2 && (i & 1));
        launch(clk ? c.clk : c.ref, clk ? h_grid(K, NT) : c.blocks, true, st, args);
      };
      for (int i = 0; i < 20; i++) one(i);
      CK(cudaEventRecord(e0, st));
      for (int i = 0; i < 200; i++) one(i);
      CK(cudaEventRecord(e1, st));
      CK(cudaStreamSynchronize(st));
      CK(cudaGetLastError());
      CK(cudaEventElapsedTime(&ms[which], e0, e1));
    }
    printf("  timing T=%d: stream-K %.2f us, cluster %.2f us, alternating %.2f us per launch\n", T, ms[0] * 5, ms[1] * 5,
           ms[2] * 5);
    CK(cudaStreamDestroy(st));
  }
  for (int g = 0; g < 3; g++) { cudaFree(dw[g]); cudaFree(db[g]); }
  cudaFree(dxq); cudaFree(dxs); cudaFree(dout); cudaFree(dpart); cudaFree(dcount);
}

int main() {
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  printf("%s, %d SMs\n", p.name, p.multiProcessorCount);
  Cfg cfgs[] = {
      {"small", 1024, {256, 0, 0}, 4, 2, 2, ref_small, cl_small},
      {"o", 3584, {3584, 0, 0}, 196, 7, 7, ref_o, cl_o},
      {"qkv", 3584, {3584, 512, 512}, 252, 7, 7, ref_qkv, cl_qkv},
      {"down7b", 18944, {3584, 0, 0}, 264, 11, 8, ref_down, cl_down},
      {"down05b", 4864, {896, 0, 0}, 66, 11, 8, ref_d05, cl_d05},
  };
  for (auto& c : cfgs) run(c, std::string(c.name) == "qkv" ? false : true);
  printf(failures ? "FAILURES: %d\n" : "ALL OK\n", failures);
  return failures ? 1 : 0;
}
