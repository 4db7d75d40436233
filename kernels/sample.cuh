// ---- sampling: one block of 1024 threads per logits row ----
//
// Each row has five parameters: temperature, top_k, top_p, min_p and u (a uniform number in
// [0, 1) from the request's seeded generator). Temperature 0 or top_k 1 is greedy: the argmax,
// lowest index on ties. Otherwise, with m the largest logit, p_i = exp((l_i - m) / T) (the top
// token has p = 1) and the kept tokens are those with p >= thr, thr the largest of:
//   - top_k: the k-th largest p (tokens of equal p are all kept);
//   - top_p: the largest p whose tokens at or above it (within top_k) hold at least top_p of the
//     top-k mass (the smallest set by p that reaches top_p);
//   - min_p: min_p itself (min_p times the top token's p).
// The token is then the kept token where the running mass, in id order, passes u times the kept
// mass. Masses are fixed point (p * 2^40 as 64-bit integers), so a sum does not depend on the
// order threads add in: the same u gives the same token, run after run, and the host's
// `runtime::sampler::pick` applies the very same rule to the same numbers.
//
// Thresholds compare the bit patterns of p (non-negative floats order as their bits). They are
// found by bisection over those bits: over the row itself, or (usually) over the few
// candidates above a pivot (2^-1 to 2^-16), copied to shared memory in one pass, when those are
// known to hold the whole answer.

typedef unsigned long long u64;
#define SAMPLE_CAND 4096
#define P_ONE 0x3f800000u

__device__ __forceinline__ u64 warp_sum_u64(u64 v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float block_max(float v) {
  __shared__ float part[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) part[warp] = v;
  __syncthreads();
  v = lane < (int)(blockDim.x >> 5) ? part[lane] : NEG_INF;
  return warp_max(v);
}

// The sum of `v` over the threads before this one; `total` gets the block's sum.
__device__ __forceinline__ u64 block_exclusive_u64(u64 v, u64* total) {
  __shared__ u64 part[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  u64 inc = v;
  for (int o = 1; o < 32; o <<= 1) {
    const u64 n = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += n;
  }
  __syncthreads();
  if (lane == 31) part[warp] = inc;
  __syncthreads();
  u64 before = 0, all = 0;
  for (int w = 0; w < (int)(blockDim.x >> 5); ++w) {
    if (w < warp) before += part[w];
    all += part[w];
  }
  *total = all;
  return before + inc - v;
}

// exp(x) for x <= 0 from correctly rounded IEEE operations only (products by __fmul_rn, never
// contracted; explicit fmaf; round half to even), so that the host's
// `runtime::sampler::exp_det`, the same operations on the same constants, gives the very same
// bits: the device and the host then keep and pick the same tokens. Range reduction by ln 2
// (Cody-Waite, two parts), a degree-6 Taylor polynomial, the power of two in the exponent.
__device__ __forceinline__ float exp_det(float x) {
  if (x < -87.0f) return 0.0f;
  const float n = rintf(__fmul_rn(x, __int_as_float(0x3fb8aa3b)));
  float r = fmaf(n, -__int_as_float(0x3f317200), x);
  r = fmaf(n, -__int_as_float(0x35bfbe8e), r);
  float p = __int_as_float(0x3ab60b61);
  p = fmaf(p, r, __int_as_float(0x3c088889));
  p = fmaf(p, r, __int_as_float(0x3d2aaaab));
  p = fmaf(p, r, __int_as_float(0x3e2aaaab));
  p = fmaf(p, r, 0.5f);
  p = fmaf(p, r, 1.0f);
  p = fmaf(p, r, 1.0f);
  return __fmul_rn(p, __int_as_float(((int)n + 127) << 23));
}

// The top token's p is exactly 1 (so that min_p = 1 keeps it).
__device__ __forceinline__ float sample_p(float l, float m, float inv_t) {
  return l == m ? 1.0f : exp_det(__fmul_rn(l - m, inv_t));
}
__device__ __forceinline__ u64 sample_mass(float p) { return (u64)(p * 1099511627776.0f); }

// The mass top_p of `total` must reach (at least one unit).
__device__ __forceinline__ u64 top_p_need(float top_p, u64 total) {
  const u64 n = (u64)((double)top_p * (double)total);
  return n > 0 ? n : 1;
}

// Sums of N values over the block, in place (a multiple of 32 threads; all threads get them).
template <int N>
__device__ __forceinline__ void block_sum_u64s(u64 (&v)[N]) {
  __shared__ u64 part[32][N];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = warp_sum_u64(v[j]);
  __syncthreads();
  if (lane == 0)
    for (int j = 0; j < N; ++j) part[warp][j] = v[j];
  __syncthreads();
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = warp_sum_u64(lane < (int)(blockDim.x >> 5) ? part[lane][j] : 0ull);
}

__device__ __forceinline__ u64 block_sum_u64(u64 v) {
  u64 a[1] = {v};
  block_sum_u64s(a);
  return a[0];
}

// Where p is read from: the row (recomputed from the logits, four per 16-byte load where the
// vocabulary allows: a block of one SM needs that many loads in flight) or shared candidates.
template <int V>
struct RowSource {
  const float* row;
  float m, inv_t;
  __device__ float p(float l) const { return sample_p(l, m, inv_t); }
  // f(i, logit) for every token; each thread sees its own subset.
  template <class F>
  __device__ void each_logit(F f) const {
    if constexpr (V % 4 == 0) {
      const float4* r4 = reinterpret_cast<const float4*>(row);
#pragma unroll 4
      for (int i = threadIdx.x; i < V / 4; i += blockDim.x) {
        const float4 v = r4[i];
        f(4 * i, v.x);
        f(4 * i + 1, v.y);
        f(4 * i + 2, v.z);
        f(4 * i + 3, v.w);
      }
    } else {
      for (int i = threadIdx.x; i < V; i += blockDim.x) f(i, row[i]);
    }
  }
  // f(i, p) for every token.
  template <class F>
  __device__ void each(F f) const {
    each_logit([&](int i, float l) { f(i, p(l)); });
  }
  // p of tokens i .. i + 3 (i a multiple of 4; 0 from `end` on).
  __device__ void load4(int i, int end, float (&out)[4]) const {
    if (V % 4 == 0 && i + 3 < end) {
      const float4 v = *reinterpret_cast<const float4*>(row + i);
      out[0] = p(v.x), out[1] = p(v.y), out[2] = p(v.z), out[3] = p(v.w);
    } else {
      for (int j = 0; j < 4; ++j) out[j] = i + j < end ? p(row[i + j]) : 0.0f;
    }
  }
};
struct CandSource {
  const float* cand;
  int n;
  template <class F>
  __device__ void each(F f) const {
    for (int i = threadIdx.x; i < n; i += blockDim.x) f(i, cand[i]);
  }
};

// The largest bit pattern b >= floor for which the tokens with bits(p) >= b weigh at least
// `need` (weight: 1 per token, or its mass). The caller makes sure `floor` qualifies. Each pass
// weighs three probes, so the range shrinks fourfold.
template <class S>
__device__ unsigned largest_bits(const S& src, unsigned floor, u64 need, bool by_mass) {
  unsigned lo = floor, hi = P_ONE;
  while (lo < hi) {
    const u64 span = hi - lo;
    unsigned t[3];
#pragma unroll
    for (int j = 0; j < 3; ++j) t[j] = lo + (unsigned)((span * (j + 1) + 3) / 4);
    u64 w[3] = {0, 0, 0};
    src.each([&](int, float p) {
      const unsigned b = __float_as_uint(p);
      const u64 x = by_mass ? sample_mass(p) : 1ull;
#pragma unroll
      for (int j = 0; j < 3; ++j) w[j] += b >= t[j] ? x : 0ull;
    });
    block_sum_u64s(w);
    if (w[2] >= need) lo = t[2];
    else if (w[1] >= need) lo = t[1], hi = t[2] - 1;
    else if (w[0] >= need) lo = t[0], hi = t[1] - 1;
    else hi = t[0] - 1;
  }
  return lo;
}

// top_k, then top_p within it, over one source that holds every token at or above them.
template <class S>
__device__ unsigned top_k_top_p(const S& src, int top_k, float top_p, u64 all) {
  unsigned thr = 0;
  u64 total = all;
  if (top_k > 0) {
    thr = largest_bits(src, 0u, (u64)top_k, false);
    u64 w = 0;
    src.each([&](int, float p) { w += __float_as_uint(p) >= thr ? sample_mass(p) : 0ull; });
    total = block_sum_u64(w);
  }
  if (top_p < 1.0f) thr = largest_bits(src, thr, top_p_need(top_p, total), true);
  return thr;
}

// Copies the p >= pivot of the row to `cand` (any order); returns how many.
template <int V>
__device__ int gather_candidates(const RowSource<V>& row, unsigned pivot, float* cand) {
  __shared__ int count;
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  const int lane = threadIdx.x & 31;
  // Every thread runs every round (the ballots need whole warps); rounds of four tokens each.
  for (int base = 0; base < V; base += 4 * blockDim.x) {
    const int i = base + 4 * threadIdx.x;
    float p[4];
    row.load4(i, V, p);
    for (int j = 0; j < 4; ++j) {
      const bool keep = i + j < V && __float_as_uint(p[j]) >= pivot;
      const unsigned ballot = __ballot_sync(0xffffffffu, keep);
      int at = 0;
      if (lane == 0 && ballot) at = atomicAdd(&count, __popc(ballot));
      at = __shfl_sync(0xffffffffu, at, 0);
      if (keep) cand[at + __popc(ballot & ((1u << lane) - 1))] = p[j];
    }
  }
  __syncthreads();
  return count;
}

// The top_k / top_p threshold of a row (bits of p). One pass weighs the tokens above four
// pivots; the highest pivot whose tokens hold the answer (the top k, or without top_k, top_p of
// the mass) and fit in shared memory gives the candidates; else the bisection reads the row.
template <int V>
__device__ unsigned sample_threshold(const RowSource<V>& row, int top_k, float top_p) {
  __shared__ float cand[SAMPLE_CAND];
  const unsigned pivots[4] = {0x3f000000u /* 2^-1 */, 0x3d800000u /* 2^-4 */, 0x3b800000u /* 2^-8 */,
                              0x37800000u /* 2^-16 */};
  u64 w[9] = {0, 0, 0, 0, 0, 0, 0, 0, 0};  // count and mass above each pivot, then all
  row.each([&](int, float p) {
    const u64 q = sample_mass(p);
    w[8] += q;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const bool in = __float_as_uint(p) >= pivots[j];
      w[j] += in;
      w[4 + j] += in ? q : 0ull;
    }
  });
  block_sum_u64s(w);
  const u64 all = w[8];
  for (int j = 0; j < 4; ++j) {
    const bool enough = top_k > 0 ? w[j] >= (u64)top_k : w[4 + j] >= top_p_need(top_p, all);
    if (!enough) continue;
    if (w[j] > SAMPLE_CAND) break;
    const CandSource c{cand, gather_candidates<V>(row, pivots[j], cand)};
    return top_k_top_p(c, top_k, top_p, all);
  }
  return top_k_top_p(row, top_k, top_p, all);
}

// Greedy: the index of the largest logit of the row (lowest index on ties).
template <int V>
__device__ int argmax_row(const float* row) {
  __shared__ float best_v[1024];
  __shared__ int best_i[1024];
  float bv = NEG_INF;
  int bi = 0x7fffffff;
  for (int i = threadIdx.x; i < V; i += blockDim.x)
    if (row[i] > bv) { bv = row[i]; bi = i; }
  best_v[threadIdx.x] = bv;
  best_i[threadIdx.x] = bi;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      const float ov = best_v[threadIdx.x + s];
      const int oi = best_i[threadIdx.x + s];
      if (ov > best_v[threadIdx.x] || (ov == best_v[threadIdx.x] && oi < best_i[threadIdx.x])) {
        best_v[threadIdx.x] = ov;
        best_i[threadIdx.x] = oi;
      }
    }
    __syncthreads();
  }
  return best_i[0];
}

// grid: R rows, block: 1024. params: [R][5] (temperature, top_k, top_p, min_p, u). A step whose
// rows are all greedy runs argmax_rows below instead.
template <int V>
__device__ void sample(const float* logits, const float* params, int* out) {
  const float* row = logits + (long)blockIdx.x * V;
  const float* pr = params + blockIdx.x * 5;
  const int k = (int)pr[1], top_k = k > 0 && k < V ? k : 0;
  if (pr[0] == 0.0f || k == 1) {
    const int best = argmax_row<V>(row);
    if (threadIdx.x == 0) out[blockIdx.x] = best;
    return;
  }
  const float top_p = pr[2], min_p = pr[3], u = pr[4];
  float m = NEG_INF;
  RowSource<V>{row, 0.0f, 1.0f}.each_logit([&](int, float l) { m = fmaxf(m, l); });
  const RowSource<V> src{row, block_max(m), 1.0f / pr[0]};
  unsigned thr = __float_as_uint(min_p);
  if (top_k > 0 || top_p < 1.0f) thr = max(thr, sample_threshold<V>(src, top_k, top_p));
  // Each thread sums the kept mass of its own run of ids (a multiple of 4 long); the run holding
  // u * total is walked.
  const int chunk = ((V + 4 * blockDim.x - 1) / (4 * blockDim.x)) * 4;
  const int lo = min((int)threadIdx.x * chunk, V), hi = min(lo + chunk, V);
  u64 mine = 0;
  for (int i = lo; i < hi; i += 4) {
    float p[4];
    src.load4(i, hi, p);
    for (int j = 0; j < 4; ++j) mine += __float_as_uint(p[j]) >= thr ? sample_mass(p[j]) : 0ull;
  }
  u64 total;
  const u64 before = block_exclusive_u64(mine, &total);
  u64 r = (u64)((double)u * (double)total);
  if (r >= total) r = total - 1;
  if (r >= before && r < before + mine) {
    u64 acc = before;
    for (int i = lo; i < hi; ++i) {
      const float p = src.p(row[i]);
      if (__float_as_uint(p) < thr) continue;
      acc += sample_mass(p);
      if (r < acc) {
        out[blockIdx.x] = i;
        break;
      }
    }
  }
}

// ---- greedy sampling of every row: a split argmax ----
// The argmax of each row of V logits (lowest index on ties), over B blocks per row (one block
// would read the whole row alone): block b reduces its share to part_v/part_i [r][b]; the row's
// last block to finish (counted in done[r], which it resets) reduces those into out[r].
// grid: (R, B), block: 256.

__device__ __forceinline__ void argmax_merge(float& bv, int& bi, float v, int i) {
  if (v > bv || (v == bv && i < bi)) {
    bv = v;
    bi = i;
  }
}

// The block's (value, index) argmax; thread 0 gets it.
__device__ __forceinline__ void block_argmax(float& bv, int& bi) {
  __shared__ float sv[32];
  __shared__ int si[32];
  for (int o = 16; o > 0; o >>= 1) argmax_merge(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) {
    sv[warp] = bv;
    si[warp] = bi;
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) argmax_merge(bv, bi, sv[w], si[w]);
}

template <int V, int B>
__device__ void argmax_rows(const float* logits, float* part_v, int* part_i, unsigned* done, int* out) {
  // Each block's share a multiple of four logits, read four at a time where the row is 16-byte
  // aligned (V a multiple of four), the rest one by one.
  constexpr int PER = (V + 4 * B - 1) / (4 * B) * 4;
  const int r = blockIdx.x, b = blockIdx.y;
  const float* row = logits + (long)r * V;
  const int lo = min(V, b * PER), hi = min(V, lo + PER), vec = V % 4 == 0 ? (hi - lo) / 4 : 0;
  float bv = NEG_INF;
  int bi = 0x7fffffff;
#pragma unroll 4
  for (int j = threadIdx.x; j < vec; j += blockDim.x) {
    const float4 v = reinterpret_cast<const float4*>(row + lo)[j];
    const int i = lo + 4 * j;
    argmax_merge(bv, bi, v.x, i);
    argmax_merge(bv, bi, v.y, i + 1);
    argmax_merge(bv, bi, v.z, i + 2);
    argmax_merge(bv, bi, v.w, i + 3);
  }
  for (int i = lo + 4 * vec + threadIdx.x; i < hi; i += blockDim.x) argmax_merge(bv, bi, row[i], i);
  block_argmax(bv, bi);
  __shared__ bool last;
  if (threadIdx.x == 0) {
    part_v[r * B + b] = bv;
    part_i[r * B + b] = bi;
    __threadfence();
    last = atomicAdd(done + r, 1u) == B - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  bv = NEG_INF;
  bi = 0x7fffffff;
  for (int j = threadIdx.x; j < B; j += blockDim.x)
    argmax_merge(bv, bi, ((volatile float*)part_v)[r * B + j], ((volatile int*)part_i)[r * B + j]);
  block_argmax(bv, bi);
  if (threadIdx.x == 0) {
    out[r] = bi < V ? bi : 0;
    done[r] = 0;
  }
}

// Structured outputs: the tokens a row's constraint does not allow set to -inf before a choice,
// as `runtime::constraint::apply` does. masks: the m masked rows' indices, then their masks of
// `words` words each (token t allowed when bit t % 32 of word t / 32 is set; tokens past the
// mask are not). grid: (m, ceil(V / SPAN)), block: 256.
template <int V, int SPAN>
__device__ void mask_logits(float* logits, const unsigned* masks, int m, int words) {
  const int j = blockIdx.x;
  const unsigned* mask = masks + m + (long)j * words;
  float* x = logits + (long)masks[j] * V;
  const int end = min(V, (int)(blockIdx.y + 1) * SPAN);
  for (int t = blockIdx.y * SPAN + threadIdx.x; t < end; t += blockDim.x) {
    const int k = t >> 5;
    if (k >= words || !((mask[k] >> (t & 31)) & 1u)) x[t] = NEG_INF;
  }
}

// Per-token changes to logit rows before a choice, as `runtime::sampler::Adjust::apply` makes
// them, with the same single roundings: x' = (x > 0 ? x / div : x * mul) + add. adjust: [n][5]
// (row, token, div, mul, add; row and token exact in f32). One thread per change; a row's
// tokens are distinct. grid: ceil(n / 256), block: 256.
template <int V>
__device__ void adjust_logits(float* logits, const float* adjust, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float* a = adjust + 5 * (long)i;
  const int row = (int)a[0], token = (int)a[1];
  if (token < 0 || token >= V) return;
  float* x = logits + (long)row * V + token;
  const float v = *x;
  *x = __fadd_rn(v > 0.0f ? __fdiv_rn(v, a[2]) : __fmul_rn(v, a[3]), a[4]);
}

// A step launched before the previous one's tokens reached the host (the worker's pipelined
// steps): each id -1 - r among the step's n token ids is replaced by the token chosen for
// logits row r of the step before, still in `tokens` (where the sampling kernels write).
// grid: ceil(n / 256), block: 256.
__device__ void feed_from_step_before(int* ids, const int* tokens, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n && ids[i] < 0) ids[i] = tokens[-1 - ids[i]];
}
