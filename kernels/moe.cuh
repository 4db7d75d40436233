// Mixture of experts (ir::Op::Moe) for any batch: the routing of each token, then per
// (token, chosen expert) the gate and up projections with the activation, then per token the
// down projections of its experts weighted and summed. Each chosen expert's rows are read once
// per (token, expert): at batch 1 the step reads exactly the chosen experts' weights; larger
// batches re-read an expert for every token that chose it (a grouped GEMM over tokens sorted
// by expert is the faster path there).

// x as the 16-bit float would hold it (RX), or as it is.
template <bool RX>
__device__ __forceinline__ float moe_x(float x) {
  return RX ? to_f32(f32_to_h16(x)) : x;
}

// A lane's part of a warp's dot product of x (f32, H; rounded to 16 bits first with RX, as the
// experts' inputs are on every path) with one weight row w (H): lanes stride 8 values at a time
// with 16-byte loads where the row allows it. H is a constant, so the loop unrolls and a warp
// has all its loads in flight at once.
template <int H, typename W, bool RX = false>
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
        for (int j = 0; j < 8; j++) s = fmaf(f[j], moe_x<RX>(x[c + j]), s);
      }
    }
  } else {
#pragma unroll 8
    for (int c = lane; c < H; c += 32) s = fmaf(to_f32(w[c]), moe_x<RX>(x[c]), s);
  }
  return s;
}

// The routing of one token (ir::moe::route) from its E logits, by one warp: the K experts of
// the largest logits (on equal logits the lower index first) in pe, weighted (pw) by the
// softmax of the logits over the chosen ones (NORM) or over all E; every lane gets them.
// LD loads a logit: LdPlain, or LdL2 (through L2 only, for logits another kernel may have
// written while this one runs).
struct LdPlain {
  template <typename L>
  __device__ __forceinline__ float operator()(const L* p) const { return to_f32(*p); }
};
struct LdL2 {
  __device__ __forceinline__ float operator()(const float* p) const { return ld_cg(p); }
};
template <int E, int K, bool NORM, typename L, typename LD = LdPlain>
__device__ __forceinline__ void moe_choose(const L* logits, int* pe, float* pw, LD ld = LD()) {
  constexpr int PER = (E + 31) / 32;
  const int lane = threadIdx.x & 31;
  float v[PER];
  bool taken[PER];
#pragma unroll
  for (int j = 0; j < PER; j++) {
    const int e = lane + 32 * j;
    v[j] = e < E ? ld(logits + e) : NEG_INF;
    taken[j] = e >= E;
  }
  float pl[K];
#pragma unroll
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
#pragma unroll
  for (int k = 0; k < K; k++) pw[k] = expf(pl[k] - m) / z;
}

// The routing of token t written out (lane 0): ids[t K + k], weights[t K + k].
template <int E, int K, bool NORM, typename L>
__device__ __forceinline__ void moe_pick(const L* logits, int t, int* ids, float* weights) {
  int pe[K];
  float pw[K];
  moe_choose<E, K, NORM>(logits, pe, pw);
  if ((threadIdx.x & 31) == 0)
#pragma unroll
    for (int k = 0; k < K; k++) {
      ids[t * K + k] = pe[k];
      weights[t * K + k] = pw[k];
    }
}

// The routing of token blockIdx.x from its router logits. grid: T, block: 32.
template <int E, int K, bool NORM, typename L>
__device__ void moe_route(const L* logits, int* ids, float* weights) {
  moe_pick<E, K, NORM>(logits + (long)blockIdx.x * E, blockIdx.x, ids, weights);
}

// Where the router's f32 input rows come from: x as it is (RouterX), or an RMS norm (with its
// residual add when ADD) the router launch applies itself at one token (RouterNorm): every
// block normalises row t into shared memory exactly as add_rms_norm would (norm_row, after the
// block's router rows are loaded), and the blocks of blockIdx.y 0 write the normalised row to
// x (the experts' input) and the sum to s. Both wait for the previous kernel.
struct RouterX {};
template <typename WN, bool ADD>
struct RouterNorm {
  const float *a, *b;
  float* s;
  const WN* nw;
  float eps;
  float* x;
};
template <int H>
__device__ __forceinline__ const float* router_rows(const float* x, int t, RouterX) {
  pdl_wait();
  return x + (long)t * H;
}
template <int H, typename WN, bool ADD>
__device__ __forceinline__ const float* router_rows(const float*, int t, RouterNorm<WN, ADD> n) {
  __shared__ __align__(16) float xs[H];
  const long o = (long)t * H;
  norm_row<H>(n.a + o, ADD ? n.b + o : nullptr, ADD && blockIdx.y == 0 ? n.s + o : nullptr, n.nw, xs, n.eps);
  __syncthreads();
  if (blockIdx.y == 0)
    for (int c = threadIdx.x; c < H; c += blockDim.x) n.x[o + c] = xs[c];
  return xs;
}

// A mixture of experts' router logits: w[e] · x[t] (+ bias[e]) in f32 from the f32 input (its
// rows by N: RouterX or RouterNorm), for token t = blockIdx.x and experts blockIdx.y * 8 + warp:
// one warp per (token, expert), the same sums at any batch, and at batch 1 the router's rows
// spread over E / 8 blocks. 16-bit rows are loaded before waiting for the previous kernel (the
// sums as moe_dot_part's). grid: (T, ceil(E / 8)), block: 256.
template <int H, int E, typename W, typename B, typename N>
__device__ void moe_router_logits(const float* x, const W* w, const B* bias, float* logits, N rows) {
  const int t = blockIdx.x, lane = threadIdx.x & 31, e = blockIdx.y * 8 + (threadIdx.x >> 5);
  const bool live = e < E;
  constexpr bool WIDE = sizeof(W) == 2 && H % 8 == 0;
  constexpr int L = (H + 255) / 256;
  uint4 wv[WIDE ? L : 1];
  if constexpr (WIDE)
#pragma unroll
    for (int j = 0; j < L; j++)
      if (live && 256 * j + lane * 8 < H) wv[j] = ld_stream_first(w + (long)e * H + 256 * j + lane * 8);
  const float* xr = router_rows<H>(x, t, rows);
  if (!live) return;
  float s = 0.0f;
  if constexpr (WIDE) {
#pragma unroll
    for (int j = 0; j < L; j++) {
      const int c = 256 * j + lane * 8;
      if (c < H) {
        // The lane's 8 inputs in two 16-byte loads (8 scalar loads 32 bytes apart across the
        // warp cost 8 L1 wavefronts each).
        float f[8];
        unpack8(wv[j], f);
        const float4 lo = *(const float4*)(xr + c), hi = *(const float4*)(xr + c + 4);
        const float xv[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
        for (int i = 0; i < 8; i++) s = fmaf(f[i], xv[i], s);
      }
    }
  } else {
    s = moe_dot_part<H>(xr, w + (long)e * H);
  }
  s = warp_sum(s);
  if (lane == 0) logits[(long)t * E + e] = s + (bias ? to_f32(bias[e]) : 0.0f);
}

// Row r = blockIdx.x of the T·K (token, chosen expert) pairs (token r / K, expert ids[r]):
// a[r][i] = act(gate[e][i] · x + gb[e][i], up[e][i] · x + ub[e][i]) (biases where non-null),
// one warp per feature i. With 16-bit experts x and a are rounded to 16 bits as the grouped
// kernels hold them, so a token's experts compute the same at any batch up to the order of
// the sums.
// grid: (T·K, ceil(I / 8)), block: 256.
template <int H, int I, int K, typename W, typename B, typename ACT>
__device__ void moe_up(const float* x, const int* ids, const W* gate, const W* up, const B* gb, const B* ub, float* a,
                       ACT act) {
  const int r = blockIdx.x, lane = threadIdx.x & 31, i = blockIdx.y * 8 + (threadIdx.x >> 5);
  if (i >= I) return;
  const int e = ids[r];
  const float* xr = x + (long)(r / K) * H;
  const long row = (long)e * I + i;
  constexpr bool R16 = sizeof(W) == 2;
  const float gp = moe_dot_part<H, W, R16>(xr, gate + row * H), up_part = moe_dot_part<H, W, R16>(xr, up + row * H);
  float g = warp_sum(gp), u = warp_sum(up_part);
  if (lane == 0) {
    if (gb) g += to_f32(gb[row]);
    if (ub) u += to_f32(ub[row]);
    a[(long)r * I + i] = moe_x<R16>(act(g, u));
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

// ---- grouped experts: the step's (token, chosen expert) pairs sorted by expert ----
// Above a few tokens a step routes several tokens to the same expert: sorted by expert, each
// chosen expert's weights are read once per step, by tensor-core tiles of up to MOE_TILE pairs
// (the mma_rows8 scheme of gemm_skinny, with the pairs' rows gathered). MOE_TILE (a multiple
// of 8, at most 64: a block's 256 threads write 4 rows of 16 features each) is defined by the
// generated source (codegen_cuda::schedule::MOE_TILE).

// How many of the P pairs chose expert e = blockIdx.x. grid: E, block: 256.
__device__ void moe_count(const int* ids, long P, int* cnt) {
  const int e = blockIdx.x;
  float c = 0.0f;
  for (long r = threadIdx.x; r < P; r += blockDim.x) c += ids[r] == e ? 1.0f : 0.0f;
  c = block_sum(c);
  if (threadIdx.x == 0) cnt[e] = (int)c;
}

// The pairs of expert e = blockIdx.x at their sorted positions (experts in order, pairs in
// order within one): perm[pos] = pair, pos_of[pair] = pos; and its tiles of up to MOE_TILE
// pairs: tile j is tiles[1 + 3j ..] = (first position, expert, pairs), tiles[0] the count.
// grid: E, block: 256.
template <int E>
__device__ void moe_sort(const int* ids, long P, const int* cnt, int* perm, int* pos_of, int* tiles) {
  const int e = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __shared__ int before_s[2], wc[8];
  if (threadIdx.x == 0) {
    int off = 0, toff = 0;
    for (int j = 0; j < e; j++) {
      off += cnt[j];
      toff += (cnt[j] + MOE_TILE - 1) / MOE_TILE;
    }
    before_s[0] = off;
    before_s[1] = toff;
  }
  __syncthreads();
  const int n = cnt[e], toff = before_s[1];
  int base = before_s[0];
  for (int m = threadIdx.x; m * MOE_TILE < n; m += blockDim.x) {
    int* t = tiles + 1 + 3 * (toff + m);
    t[0] = base + m * MOE_TILE;
    t[1] = e;
    t[2] = min(MOE_TILE, n - m * MOE_TILE);
  }
  if (e == E - 1 && threadIdx.x == 0) tiles[0] = toff + (n + MOE_TILE - 1) / MOE_TILE;
  for (long r0 = 0; r0 < P; r0 += blockDim.x) {
    const long r = r0 + threadIdx.x;
    const bool hit = r < P && ids[r] == e;
    const unsigned m = __ballot_sync(0xffffffffu, hit);
    if (lane == 0) wc[warp] = __popc(m);
    __syncthreads();
    int pos = base, all = 0;
    for (int w = 0; w < 8; w++) {
      pos += w < warp ? wc[w] : 0;
      all += wc[w];
    }
    if (hit) {
      pos += __popc(m & ((1u << lane) - 1u));
      perm[pos] = (int)r;
      pos_of[r] = pos;
    }
    __syncthreads();
    base += all;
  }
}

// This block's tile (blockIdx.y): false past the count.
struct MoeTile {
  int p0, e, n;
};
__device__ __forceinline__ bool moe_tile(const int* tiles, MoeTile& t) {
  const int j = blockIdx.y;
  if (j >= tiles[0]) return false;
  t = MoeTile{tiles[1 + 3 * j], tiles[2 + 3 * j], tiles[3 + 3 * j]};
  return true;
}

// Lane (g, c)'s row pointers of a tile (xr[i]: row 8i + g at column 8c, clamped to the tile's
// last pair; dead rows are zeroed by moe_tile_dots): row_of(position) rows of KD in base.
template <int KD, typename RowOf>
__device__ __forceinline__ void moe_tile_rows(const h16_t* base, const MoeTile& t, RowOf row_of, const h16_t** xr) {
  const int g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
#pragma unroll
  for (int i = 0; i < MOE_TILE / 8; i++) xr[i] = base + (long)row_of(t.p0 + min(i * 8 + g, t.n - 1)) * KD + 8 * c;
}

// The products of NW weights' 16 rows (w[j]: lane (g, c)'s row g at column 8c; row g + 8 is 8K
// further) with a tile's n rows (xr[i]: lane's row 8i + g at column 8c, clamped to a live one;
// dead rows read as zeros), over this warp's 32-wide chunks of K: acc[j][i] as mma_rows8 leaves
// them. Tiles of 8 rows past n are skipped.
template <int K, int NW>
__device__ __forceinline__ void moe_tile_dots(const h16_t* const* w, const h16_t* const* xr, int n,
                                              float (*acc)[MOE_TILE / 8][4]) {
  constexpr int NT = MOE_TILE / 8, CH = K / 32, WARPS = 8;
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
#pragma unroll
  for (int j = 0; j < NW; j++)
#pragma unroll
    for (int i = 0; i < NT; i++) acc[j][i][0] = acc[j][i][1] = acc[j][i][2] = acc[j][i][3] = 0.0f;
  auto load = [&](int k, uint4 (*a)[2]) {
#pragma unroll
    for (int j = 0; j < NW; j++) {
      a[j][0] = ld_stream(w[j] + k);
      a[j][1] = ld_stream(w[j] + 8L * K + k);
    }
  };
  auto chunk = [&](int k, uint4 (*a)[2]) {
#pragma unroll
    for (int i = 0; i < NT; i++) {
      if (i * 8 < n) {
        uint4 xb = *(const uint4*)(xr[i] + k);
        if (i * 8 + g >= n) xb = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int j = 0; j < NW; j++) mma_rows8(acc[j][i], a[j][0], a[j][1], xb);
      }
    }
  };
  // Two chunks' weights in flight at once.
  uint4 a[NW][2], b[NW][2];
  int ch = warp;
  for (; ch + WARPS < CH; ch += 2 * WARPS) {
    load(ch * 32, a);
    load((ch + WARPS) * 32, b);
    chunk(ch * 32, a);
    chunk((ch + WARPS) * 32, b);
  }
  if (ch < CH) {
    load(ch * 32, a);
    chunk(ch * 32, a);
  }
}

// The tile's sums over the 8 warps: v[j][q] for (row, feature) = (idx >> 4, idx & 15) of
// idx = threadIdx.x + 256 q (rows past n left as they are).
template <int NW>
__device__ __forceinline__ void moe_tile_sums(float (*acc)[MOE_TILE / 8][4], int n, float (*v)[4]) {
  __shared__ float red[8][16][MOE_TILE + 1];
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int j = 0; j < NW; j++) {
    if (j) __syncthreads();
    rows8_spill<MOE_TILE / 8>(red[warp], acc[j]);
    __syncthreads();
#pragma unroll
    for (int q = 0; q < 4; q++) {
      const int idx = threadIdx.x + 256 * q, row = idx >> 4, f = idx & 15;
      float s = 0.0f;
      if (row < n)
#pragma unroll
        for (int w = 0; w < 8; w++) s += red[w][f][row];
      v[j][q] = s;
    }
  }
}

// Gate and up with the activation for the pairs of one tile (blockIdx.y) and 16 features
// (blockIdx.x): a[pos][i] = act(gate[e][i] · x[t] + gb[e][i], up[e][i] · x[t] + ub[e][i]) as
// h16, t the pair's token, x its 16-bit input. grid: (I / 16, tiles), block: 256.
template <int H, int I, int K, typename B, typename ACT>
__device__ void moe_up_grouped(const h16_t* x, const int* perm, const int* tiles, const h16_t* gate, const h16_t* up,
                               const B* gb, const B* ub, h16_t* a, ACT act) {
  MoeTile t;
  if (!moe_tile(tiles, t)) return;
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, f0 = blockIdx.x * 16;
  const long row = (long)t.e * I + f0 + g;
  const h16_t* w[2] = {gate + row * H + 8 * c, up + row * H + 8 * c};
  const h16_t* xr[MOE_TILE / 8];
  moe_tile_rows<H>(x, t, [&](int p) { return perm[p] / K; }, xr);
  float acc[2][MOE_TILE / 8][4], v[2][4];
  moe_tile_dots<H, 2>(w, xr, t.n, acc);
  moe_tile_sums<2>(acc, t.n, v);
#pragma unroll
  for (int q = 0; q < 4; q++) {
    const int idx = threadIdx.x + 256 * q, r = idx >> 4, f = f0 + (idx & 15);
    if (r < t.n) {
      const long wi = (long)t.e * I + f;
      const float gv = v[0][q] + (gb ? to_f32(gb[wi]) : 0.0f), uv = v[1][q] + (ub ? to_f32(ub[wi]) : 0.0f);
      a[(long)(t.p0 + r) * I + f] = f32_to_h16(act(gv, uv));
    }
  }
}

// The down projections of one tile's pairs (blockIdx.y) for 16 output features (blockIdx.x),
// times the pair's routing weight: y[pos][h] = weights[pair] · (down[e][h] · a[pos] + db[e][h]).
// grid: (H / 16, tiles), block: 256.
template <int H, int I, typename B>
__device__ void moe_down_grouped(const h16_t* a, const int* perm, const int* tiles, const float* weights,
                                 const h16_t* down, const B* db, float* y) {
  MoeTile t;
  if (!moe_tile(tiles, t)) return;
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, f0 = blockIdx.x * 16;
  const h16_t* w[1] = {down + ((long)t.e * H + f0 + g) * I + 8 * c};
  const h16_t* xr[MOE_TILE / 8];
  moe_tile_rows<I>(a, t, [](int p) { return p; }, xr);
  float acc[1][MOE_TILE / 8][4], v[1][4];
  moe_tile_dots<I, 1>(w, xr, t.n, acc);
  moe_tile_sums<1>(acc, t.n, v);
#pragma unroll
  for (int q = 0; q < 4; q++) {
    const int idx = threadIdx.x + 256 * q, r = idx >> 4, h = f0 + (idx & 15);
    if (r < t.n) {
      const float b = db ? to_f32(db[(long)t.e * H + h]) : 0.0f;
      y[(long)(t.p0 + r) * H + h] = weights[perm[t.p0 + r]] * (v[0][q] + b);
    }
  }
}

// Each token's K weighted expert outputs summed in the order of its choices:
// out[t][h] = Σ_k y[pos_of[t·K + k]][h]. grid: T, block: 256.
template <int H, int K>
__device__ void moe_combine(const float* y, const int* pos_of, float* out) {
  const int t = blockIdx.x;
  int pos[K];
#pragma unroll
  for (int k = 0; k < K; k++) pos[k] = pos_of[t * K + k];
  for (int h = threadIdx.x; h < H; h += blockDim.x) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) s += y[(long)pos[k] * H + h];
    out[(long)t * H + h] = s;
  }
}

// ---- grouped experts, few pairs a tile (decode): a warp per (expert's feature, tile) ----
// The feature's weight rows are loaded once (all of a lane's chunks in flight at once, as the
// GEMVs do) and dotted with each of the tile's pairs' rows in turn, four pairs at a time.

// Gate and up with the activation as moe_up_grouped computes them, a warp per feature i of
// the tile's expert. grid: (I / warps, tiles), block: warps of 32
// (codegen_cuda::schedule::MOE_UP_ROWS_WARPS).
template <int H, int I, int K, typename B, typename ACT>
__device__ void moe_up_rows(const h16_t* x, const int* perm, const int* tiles, const h16_t* gate, const h16_t* up,
                            const B* gb, const B* ub, h16_t* a, ACT act) {
  MoeTile t;
  if (!moe_tile(tiles, t)) return;
  using Part = RowPart<H, 1, h16_t>;
  const Part part;
  const int lane = threadIdx.x & 31, i = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const long row = (long)t.e * I + i;
  uint4 w[2][Part::L];  // gate, up
  part.load((const uint4*)(gate + row * H), nullptr, w[0], nullptr);
  part.load((const uint4*)(up + row * H), nullptr, w[1], nullptr);
  const float bg = gb ? to_f32(gb[row]) : 0.0f, bu = ub ? to_f32(ub[row]) : 0.0f;
  for (int r0 = 0; r0 < t.n; r0 += 4) {
    float sg[4], su[4];
#pragma unroll
    for (int q = 0; q < 4; q++) {
      const h16_t* xr = x + (long)(perm[t.p0 + min(r0 + q, t.n - 1)] / K) * H;
      float s[2];
      part.template dot<1, 2>(xr, w, nullptr, 1, s);
      sg[q] = s[0];
      su[q] = s[1];
    }
#pragma unroll
    for (int q = 0; q < 4; q++) {
      const float g = warp_sum(sg[q]) + bg, u = warp_sum(su[q]) + bu;
      if (lane == 0 && r0 + q < t.n) a[(long)(t.p0 + r0 + q) * I + i] = f32_to_h16(act(g, u));
    }
  }
}

// The down projections times the routing weights as moe_down_grouped computes them, a warp
// per output feature h of the tile's expert. grid: (H / 8, tiles), block: 256.
template <int H, int I, typename B>
__device__ void moe_down_rows(const h16_t* a, const int* perm, const int* tiles, const float* weights,
                              const h16_t* down, const B* db, float* y) {
  MoeTile t;
  if (!moe_tile(tiles, t)) return;
  using Part = RowPart<I, 1, h16_t>;
  const Part part;
  const int lane = threadIdx.x & 31, h = blockIdx.x * 8 + (threadIdx.x >> 5);
  const long row = (long)t.e * H + h;
  uint4 wd[Part::L];
  part.load((const uint4*)(down + row * I), nullptr, wd, nullptr);
  const float b = db ? to_f32(db[row]) : 0.0f;
  for (int r0 = 0; r0 < t.n; r0 += 4) {
    float s[4];
#pragma unroll
    for (int q = 0; q < 4; q++) part.template dot<1>(a + (long)(t.p0 + min(r0 + q, t.n - 1)) * I, &wd, nullptr, 1, s + q);
#pragma unroll
    for (int q = 0; q < 4; q++) {
      const float v = warp_sum(s[q]);
      if (lane == 0 && r0 + q < t.n) y[(long)(t.p0 + r0 + q) * H + h] = weights[perm[t.p0 + r0 + q]] * (v + b);
    }
  }
}

// ---- direct experts (a step of few tokens): no sort, each pair's expert read where it is ----
// At batch 1 a token's K experts are K distinct experts: the grouped kernels' count, sort and
// combine launches (and the input's 16-bit copy) only add latency. The pairs stay in token
// order (pair t K + k); the sums are the warp-per-feature kernels' (moe_up_rows,
// moe_down_rows + moe_combine) bit for bit.

// The routing of the pair's token (every warp picks from the logits once), then gate and
// up with the activation, a warp per feature i of the pair's expert in turn (i from blockIdx.x *
// 8 + warp, gridDim.x * 8 apart: the blocks of a step fit the GPU at once, so the routing's
// latency is paid once and not again each wave; the next feature's rows are loaded while a
// feature's sums are reduced and stored): a[r][i] for pair r = blockIdx.y, its 16-bit input
// staged in shared memory. grid: (at most I / 8, T K), block: 256.
template <int H, int I, int K, int E, bool NORM, typename B, typename ACT>
__device__ void moe_up_direct(const float* x, const float* logits, const h16_t* gate,
                              const h16_t* up, const B* gb, const B* ub, h16_t* a, ACT act) {
  __shared__ __align__(16) h16_t xs[H];
  const int r = blockIdx.y, t = r / K, k = r % K, lane = threadIdx.x & 31, step = gridDim.x * 8;
  for (int c = threadIdx.x; c < H; c += blockDim.x) xs[c] = f32_to_h16(x[(long)t * H + c]);
  int pe[K];
  float pw[K];
  moe_choose<E, K, NORM>(logits + (long)t * E, pe, pw);
  int e = pe[0];
#pragma unroll
  for (int j = 1; j < K; j++)
    if (j == k) e = pe[j];
  using Part = RowPart<H, 1, h16_t>;
  const Part part;
  uint4 w[2][Part::L];  // gate, up
  const auto load = [&](int i) {
    const long row = (long)e * I + i;
    part.load((const uint4*)(gate + row * H), nullptr, w[0], nullptr);
    part.load((const uint4*)(up + row * H), nullptr, w[1], nullptr);
  };
  int i = blockIdx.x * 8 + (threadIdx.x >> 5);
  load(i);
  __syncthreads();
  for (; i < I; i += step) {
    const long row = (long)e * I + i;
    const float bg = gb ? to_f32(gb[row]) : 0.0f, bu = ub ? to_f32(ub[row]) : 0.0f;
    float s[2];
    part.template dot<1, 2>(xs, w, nullptr, 1, s);
    if (i + step < I) load(i + step);
    const float g = warp_sum(s[0]) + bg, u = warp_sum(s[1]) + bu;
    if (lane == 0) a[(long)r * I + i] = f32_to_h16(act(g, u));
  }
}

// The weights of a token's experts that moe_down_direct loads at once: all K where a lane's
// chunks of their rows fit 24 registers of 16 bytes, else fewer.
template <int L, int K>
__host__ __device__ constexpr int moe_direct_group() {
  return L * K <= 24 ? K : (24 / L > 0 ? 24 / L : 1);
}

// out[t][h] = Σ_k weights[t][k] · (down[e_k][h] · a[t K + k] + db[e_k][h]), a warp per output
// feature h of token t = blockIdx.y, the experts' rows loaded in groups (moe_direct_group). The
// token's experts and weights are moe_up_direct's, chosen again from the router's logits
// before waiting for moe_up_direct (which lets this launch start only once all its blocks have
// waited for the logits' kernel: KernelKey's PDL entry), so the first group's rows load while
// moe_up_direct still runs. grid: (H / 8, T), block: 256.
template <int H, int I, int K, int E, bool NORM, typename B>
__device__ void moe_down_direct(const float* logits, const h16_t* a, const h16_t* down, const B* db, float* out) {
  using Part = RowPart<I, 1, h16_t>;
  constexpr int G = moe_direct_group<Part::L, K>();
  const Part part;
  const int t = blockIdx.y, lane = threadIdx.x & 31, h = blockIdx.x * 8 + (threadIdx.x >> 5);
  // The choice by warp 0, for the block through shared memory (registers are the rows').
  __shared__ int pe[K];
  __shared__ float pw[K];
  if (threadIdx.x < 32) {
    int e[K];
    float w[K];
    moe_choose<E, K, NORM>(logits + (long)t * E, e, w, LdL2());
    if (lane == 0)
#pragma unroll
      for (int k = 0; k < K; k++) {
        pe[k] = e[k];
        pw[k] = w[k];
      }
  }
  __syncthreads();
  float sum = 0.0f;
#pragma unroll
  for (int k0 = 0; k0 < K; k0 += G) {
    uint4 wd[G][Part::L];
    long row[G];
#pragma unroll
    for (int j = 0; j < G; j++)
      if (k0 + j < K) {
        row[j] = (long)pe[k0 + j] * H + h;
        part.load((const uint4*)(down + row[j] * I), nullptr, wd[j], nullptr);
      }
    if (k0 == 0) pdl_wait();
#pragma unroll
    for (int j = 0; j < G; j++)
      if (k0 + j < K) {
        float s;
        part.template dot<1>(a + ((long)t * K + k0 + j) * I, &wd[j], nullptr, 1, &s);
        const float v = warp_sum(s), b = db ? to_f32(db[row[j]]) : 0.0f;
        sum += __fmul_rn(pw[k0 + j], v + b);
      }
  }
  if (lane == 0) out[(long)t * H + h] = sum;
}
