// Mixture of experts (ir::Op::Moe) for any batch: the routing of each token, then per
// (token, chosen expert) the gate and up projections with the activation, then per token the
// down projections of its experts weighted and summed. Each chosen expert's rows are read once
// per (token, expert): at batch 1 the step reads exactly the chosen experts' weights; larger
// batches re-read an expert for every token that chose it (a grouped GEMM over tokens sorted
// by expert is the faster path there).

// A lane's part of a warp's dot product of x (f32, H) with one weight row w (H): lanes stride
// 8 values at a time with 16-byte loads where the row allows it. H is a constant, so the
// loop unrolls and a warp has all its loads in flight at once.
template <int H, typename W>
__device__ __forceinline__ float moe_dot_part(const float* x, const W* w) {
  const int lane = threadIdx.x & 31;
  float s = 0.0f;
  if constexpr (sizeof(W) == 2 && H % 8 == 0) {
#pragma unroll
    for (int c0 = 0; c0 < H; c0 += 256) {
      const int c = c0 + lane * 8;
      if (c < H) {
        float f[8];
        unpack8(ld_stream(w + c), f);
#pragma unroll
        for (int j = 0; j < 8; j++) s = fmaf(f[j], x[c + j], s);
      }
    }
  } else {
#pragma unroll 8
    for (int c = lane; c < H; c += 32) s = fmaf(to_f32(w[c]), x[c], s);
  }
  return s;
}

// The dot product of a warp (every lane gets it).
template <int H, typename W>
__device__ __forceinline__ float moe_dot(const float* x, const W* w) {
  return warp_sum(moe_dot_part<H>(x, w));
}

// The routing of token t (ir::moe::route) from its E logits, by one warp: the K experts of
// the largest logits (on equal logits the lower index first), weighted by the softmax of the
// logits over the chosen ones (NORM) or over all E.
template <int E, int K, bool NORM, typename L>
__device__ __forceinline__ void moe_pick(const L* logits, int t, int* ids, float* weights) {
  constexpr int PER = (E + 31) / 32;
  const int lane = threadIdx.x & 31;
  float v[PER];
  bool taken[PER];
#pragma unroll
  for (int j = 0; j < PER; j++) {
    const int e = lane + 32 * j;
    v[j] = e < E ? to_f32(logits[e]) : NEG_INF;
    taken[j] = e >= E;
  }
  int pe[K];
  float pl[K];
  for (int k = 0; k < K; k++) {
    float bv = NEG_INF;
    int be = E;
#pragma unroll
    for (int j = 0; j < PER; j++) {
      const int e = lane + 32 * j;
      if (!taken[j] && (v[j] > bv || (v[j] == bv && e < be))) {
        bv = v[j];
        be = e;
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oe = __shfl_xor_sync(0xffffffffu, be, o);
      if (ov > bv || (ov == bv && oe < be)) {
        bv = ov;
        be = oe;
      }
    }
    pe[k] = be;
    pl[k] = bv;
#pragma unroll
    for (int j = 0; j < PER; j++)
      if (lane + 32 * j == be) taken[j] = true;
  }
  // The first chosen logit is the largest of all.
  const float m = pl[0];
  float z = 0.0f;
  if (NORM) {
    for (int k = 0; k < K; k++) z += expf(pl[k] - m);
  } else {
#pragma unroll
    for (int j = 0; j < PER; j++)
      if (lane + 32 * j < E) z += expf(v[j] - m);
    z = warp_sum(z);
  }
  if (lane == 0) {
    for (int k = 0; k < K; k++) {
      ids[t * K + k] = pe[k];
      weights[t * K + k] = expf(pl[k] - m) / z;
    }
  }
}

// The routing of token blockIdx.x from its router logits. grid: T, block: 32.
template <int E, int K, bool NORM, typename L>
__device__ void moe_route(const L* logits, int* ids, float* weights) {
  moe_pick<E, K, NORM>(logits + (long)blockIdx.x * E, blockIdx.x, ids, weights);
}

// A mixture of experts' router logits: w[e] · x[t] (+ bias[e]) in f32 from the f32 input, for
// token t = blockIdx.x and experts blockIdx.y * 8 + warp: one warp per (token, expert), the
// same sums at any batch, and at batch 1 the router's rows spread over E / 8 blocks.
// grid: (T, ceil(E / 8)), block: 256.
template <int H, int E, typename W, typename B>
__device__ void moe_router_logits(const float* x, const W* w, const B* bias, float* logits) {
  const int t = blockIdx.x, lane = threadIdx.x & 31, e = blockIdx.y * 8 + (threadIdx.x >> 5);
  if (e >= E) return;
  const float s = moe_dot<H>(x + (long)t * H, w + (long)e * H);
  if (lane == 0) logits[(long)t * E + e] = s + (bias ? to_f32(bias[e]) : 0.0f);
}

// Row r = blockIdx.x of the T·K (token, chosen expert) pairs (token r / K, expert ids[r]):
// a[r][i] = act(gate[e][i] · x + gb[e][i], up[e][i] · x + ub[e][i]) (biases where non-null),
// one warp per feature i. grid: (T·K, ceil(I / 8)), block: 256.
template <int H, int I, int K, typename W, typename B, typename ACT>
__device__ void moe_up(const float* x, const int* ids, const W* gate, const W* up, const B* gb, const B* ub, float* a,
                       ACT act) {
  const int r = blockIdx.x, lane = threadIdx.x & 31, i = blockIdx.y * 8 + (threadIdx.x >> 5);
  if (i >= I) return;
  const int e = ids[r];
  const float* xr = x + (long)(r / K) * H;
  const long row = (long)e * I + i;
  const float gp = moe_dot_part<H>(xr, gate + row * H), up_part = moe_dot_part<H>(xr, up + row * H);
  float g = warp_sum(gp), u = warp_sum(up_part);
  if (lane == 0) {
    if (gb) g += to_f32(gb[row]);
    if (ub) u += to_f32(ub[row]);
    a[(long)r * I + i] = act(g, u);
  }
}

// out[t][h] = Σ_k weights[t][k] · (down[e_k][h] · a[t·K + k] + db[e_k][h]) for token
// t = blockIdx.x, one warp per output feature h. grid: (T, ceil(H / 8)), block: 256.
template <int H, int I, int K, typename W, typename B>
__device__ void moe_down(const float* a, const int* ids, const float* weights, const W* down, const B* db, float* out) {
  const int t = blockIdx.x, lane = threadIdx.x & 31, h = blockIdx.y * 8 + (threadIdx.x >> 5);
  if (h >= H) return;
  // The K experts' rows at once (their loads in flight together), then their sums.
  float part[K];
#pragma unroll
  for (int k = 0; k < K; k++) {
    const int e = ids[t * K + k];
    part[k] = moe_dot_part<I>(a + ((long)t * K + k) * I, down + ((long)e * H + h) * I);
  }
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < K; k++) {
    float y = warp_sum(part[k]);
    if (db) y += to_f32(db[(long)ids[t * K + k] * H + h]);
    sum = fmaf(weights[t * K + k], y, sum);
  }
  if (lane == 0) out[(long)t * H + h] = sum;
}
