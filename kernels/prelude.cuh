// Prelude of every generated program. No CUDA toolkit header is included (a machine may have
// only the driver and the NVRTC library): 16-bit floats are handled as their bits.
//
// h16_t is the program's 16-bit float: bf16, or IEEE f16 where the generator defines H16_F16 1
// (a bundle compiled with --dtype f16). Activations that feed linears, 16-bit weights and the KV
// cache use it; H16_PTX is its name in PTX instructions.
#ifndef H16_F16
#define H16_F16 0
#endif
#if H16_F16
#define H16_PTX "f16"
#else
#define H16_PTX "bf16"
#endif
typedef unsigned short h16_t;
#define NEG_INF __int_as_float(0xff800000u)

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(h16_t v) {
#if H16_F16
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
  return f;
#else
  return __uint_as_float(((unsigned)v) << 16);
#endif
}

// Programmatic dependent launch (sm_90): the runtime launches the model's kernels with the
// PDL attribute, so a kernel's blocks may be scheduled while the kernel before it still runs.
// Each kernel first lets the next one launch (pdl_trigger), then waits until the previous grid
// has finished and its writes are visible (pdl_wait) before reading what it wrote; the GEMVs
// load their weights (which no kernel writes) in between, decode attention the KV rows of
// earlier steps. Launched without the attribute, both are no-ops.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_enter() {
  pdl_trigger();
  pdl_wait();
}

// Loads through L2 only (not the SM's L1): what another kernel wrote while this one may run
// (comm.cuh's peers' rows; moe_down_direct's router logits, read before its PDL wait).
__device__ __forceinline__ float4 ld_cg4(const float* p) {
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ float ld_cg(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over a block of up to 1024 threads (every thread gets the result).
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float part[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) part[warp] = v;
  __syncthreads();
  const int warps = (blockDim.x + 31) >> 5;
  v = lane < warps ? part[lane] : 0.0f;
  return warp_sum(v);
}

// f32 to the 16-bit float, rounding to nearest even.
__device__ __forceinline__ h16_t f32_to_h16(float f) {
  h16_t r;
  asm("cvt.rn." H16_PTX ".f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}
