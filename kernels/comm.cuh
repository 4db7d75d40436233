// ---- Collectives between the GPUs of one host ------------------------------------------------

// One-shot all-reduce of a small f32 message over peer (NVLink) memory, for R ranks, graph-safe.
// `table` holds every rank's staging buffer (two halves of `cap` floats, alternated by epoch
// parity) and then every rank's flag array (AR_MAXB blocks x R sources, u32). Block b of every
// rank owns the same elements: it copies them into its staging half, tells block b of each peer
// (release store of the epoch into the peer's flag), waits for the peers' flags (acquire), then
// sums the R staging halves in rank order, so every rank holds bit-identical sums. `counters`
// (AR_MAXB u32, this rank's) give each block its epoch without the host. A rank cannot reuse a
// half before every peer has read it: that would take it two epochs ahead, past a wait.
#define AR_MAXB 32

__device__ __forceinline__ void st_release_sys(unsigned* p, unsigned v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned ld_acquire_sys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Block b's epoch for this launch: its counter, bumped once per launch.
__device__ __forceinline__ unsigned oneshot_epoch(unsigned* counters) {
  __shared__ unsigned epoch;
  if (threadIdx.x == 0) epoch = ++counters[blockIdx.x];
  __syncthreads();
  return epoch;
}

// Tells block b of every peer that this rank's staging half of epoch e is written, then waits
// until every peer has told this rank the same.
template <int R>
__device__ __forceinline__ void oneshot_exchange(const unsigned long long* table, int rank, unsigned e) {
  __syncthreads();
  const int peer = threadIdx.x;
  if (peer < R && peer != rank) {
    __threadfence_system();
    st_release_sys((unsigned*)table[R + peer] + blockIdx.x * R + rank, e);
    const unsigned* flag = (const unsigned*)table[R + rank] + blockIdx.x * R + peer;
    while (ld_acquire_sys(flag) < e) {
    }
  }
  __syncthreads();
}

template <int R>
__device__ void all_reduce_oneshot(float* x, long n, const unsigned long long* table, int rank, long cap,
                                   unsigned* counters) {
  const unsigned e = oneshot_epoch(counters);
  const long half = (long)(e & 1) * cap;
  float* mine = (float*)table[rank] + half;
  const long first = (long)blockIdx.x * blockDim.x + threadIdx.x, stride = (long)gridDim.x * blockDim.x;
  const long n4 = n / 4;
  for (long i = first; i < n4; i += stride) ((float4*)mine)[i] = ((const float4*)x)[i];
  for (long i = 4 * n4 + first; i < n; i += stride) mine[i] = x[i];
  oneshot_exchange<R>(table, rank, e);
  for (long i = first; i < n4; i += stride) {
    float4 s = ld_cg4((const float*)table[0] + half + 4 * i);
#pragma unroll
    for (int r = 1; r < R; r++) {
      const float4 v = ld_cg4((const float*)table[r] + half + 4 * i);
      s.x += v.x;
      s.y += v.y;
      s.z += v.z;
      s.w += v.w;
    }
    ((float4*)x)[i] = s;
  }
  for (long i = 4 * n4 + first; i < n; i += stride) {
    float s = ld_cg((const float*)table[0] + half + i);
    for (int r = 1; r < R; r++) s += ld_cg((const float*)table[r] + half + i);
    x[i] = s;
  }
}

// One-shot all-gather of f32 rows over peer memory, completed on rank 0 only (the rank that
// reads logits): x is this rank's [rows, cols] block, out the [rows, R * cols] rows, rank r's
// block at column r * cols. Same staging protocol as the all-reduce, with buffers of its own
// and always AR_MAXB blocks, so every block's epoch stays the same. Ranks other than 0 stage
// their block and signal; rank 0 signals (its staging unused) and copies.
template <int R>
__device__ void all_gather_oneshot(const float* x, float* out, long rows, long cols, const unsigned long long* table,
                                   int rank, long cap, unsigned* counters) {
  const unsigned e = oneshot_epoch(counters);
  const long half = (long)(e & 1) * cap;
  const long first = (long)blockIdx.x * blockDim.x + threadIdx.x, stride = (long)gridDim.x * blockDim.x;
  const long n = rows * cols;
  if (rank != 0) {
    float* mine = (float*)table[rank] + half;
    const long n4 = n / 4;
    for (long i = first; i < n4; i += stride) ((float4*)mine)[i] = ((const float4*)x)[i];
    for (long i = 4 * n4 + first; i < n; i += stride) mine[i] = x[i];
  }
  oneshot_exchange<R>(table, rank, e);
  if (rank != 0) return;
  if (cols % 4 == 0) {
    const long c4 = cols / 4, n4 = n / 4;
    for (long i = first; i < n4; i += stride) {
      float4* o = (float4*)(out + (i / c4) * cols * R) + i % c4;
      o[0] = ((const float4*)x)[i];
#pragma unroll
      for (int r = 1; r < R; r++) o[r * c4] = ld_cg4((const float*)table[r] + half + 4 * i);
    }
  } else {
    for (long i = first; i < n; i += stride) {
      float* o = out + (i / cols) * cols * R + i % cols;
      o[0] = x[i];
      for (int r = 1; r < R; r++) o[r * cols] = ld_cg((const float*)table[r] + half + i);
    }
  }
}
