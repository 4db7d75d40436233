// EXPERIMENT (not landed): attention_fa with 32 query rows a warp (two m16 tiles), as
// FlashAttention-2 lays it out: each K and V fragment read from shared memory feeds two mmas.
// A block of FA2_WARPS warps takes 32 FA2_WARPS rows of one head and sequence (else returns:
// the caller keeps attention_fa for such blocks). Keys in block-wide tiles of FA_KEYS, handled
// in sub-steps of FA2_SUB keys (the scores of 32 rows x FA2_SUB keys in registers).
#define FA2_WARPS 4
#define FA2_SUB 32
template <int D, unsigned CAP, bool EDGE, typename MASK>
__device__ __forceinline__ void fa2_step(const h16_t* q_s, int p0, int n, const h16_t* k_s,
                                         const h16_t* v_s, MASK masked, float (&m)[2][2], float (&l)[2][2],
                                         float (&o)[2][D / 8][4]) {
  constexpr int S = D + 8, KS = D / 16, DT = D / 8, NT = FA2_SUB / 8;
  const int lane = threadIdx.x & 31, c = lane & 3;
  float s[2][NT][4];
#pragma unroll
  for (int mt = 0; mt < 2; mt++)
#pragma unroll
    for (int nt = 0; nt < NT; nt++) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < KS; ks++) {
    unsigned qf[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++) ldmatrix_x4(qf[mt], smem_addr(q_s + (mt * 16 + (lane & 15)) * S + ks * 16 + (lane >> 4) * 8));
#pragma unroll
    for (int kb = 0; kb < FA2_SUB / 16; kb++) {
      unsigned kf[4];
      ldmatrix_x4(kf, smem_addr(k_s + (kb * 16 + (lane & 7) + (lane >> 4) * 8) * S + ks * 16 + ((lane >> 3) & 1) * 8));
      const unsigned b0[2] = {kf[0], kf[1]}, b1[2] = {kf[2], kf[3]};
#pragma unroll
      for (int mt = 0; mt < 2; mt++) {
        mma_h16(s[mt][2 * kb], qf[mt], b0);
        mma_h16(s[mt][2 * kb + 1], qf[mt], b1);
      }
    }
  }
  float corr[2][2];
#pragma unroll
  for (int mt = 0; mt < 2; mt++)
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
      float mx = NEG_INF;
#pragma unroll
      for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
          const int p = p0 + nt * 8 + 2 * c + e;
          float& v = s[mt][nt][hr * 2 + e];
          if (CAP) v = softcap<CAP>(v * 0.6931471805599453f) * 1.4426950408889634f;
          if (EDGE && (p >= n || masked(mt, hr, p))) v = NEG_INF;
          mx = fmaxf(mx, v);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[mt][hr], mx);
      const float base = m_new == NEG_INF ? 0.0f : m_new;
      corr[mt][hr] = exp2f(m[mt][hr] - base);
      m[mt][hr] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
          float& v = s[mt][nt][hr * 2 + e];
          v = exp2f(v - base);
          sum += v;
        }
      l[mt][hr] = l[mt][hr] * corr[mt][hr] + sum;
    }
  if (__any_sync(0xffffffffu, corr[0][0] != 1.0f || corr[0][1] != 1.0f || corr[1][0] != 1.0f || corr[1][1] != 1.0f)) {
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
      for (int i = 0; i < DT; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[mt][i][e] *= corr[mt][e >> 1];
  }
#pragma unroll
  for (int kb = 0; kb < FA2_SUB / 16; kb++) {
    unsigned pa[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
      pa[mt][0] = pack_h16x2(s[mt][2 * kb][0], s[mt][2 * kb][1]);
      pa[mt][1] = pack_h16x2(s[mt][2 * kb][2], s[mt][2 * kb][3]);
      pa[mt][2] = pack_h16x2(s[mt][2 * kb + 1][0], s[mt][2 * kb + 1][1]);
      pa[mt][3] = pack_h16x2(s[mt][2 * kb + 1][2], s[mt][2 * kb + 1][3]);
    }
#pragma unroll
    for (int j = 0; j < D / 16; j++) {
      unsigned vf[4];
      ldmatrix_x4_trans(vf,
                        smem_addr(v_s + (kb * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * S + j * 16 + (lane >> 4) * 8));
      const unsigned b0[2] = {vf[0], vf[1]}, b1[2] = {vf[2], vf[3]};
#pragma unroll
      for (int mt = 0; mt < 2; mt++) {
        mma_h16(o[mt][2 * j], pa[mt], b0);
        mma_h16(o[mt][2 * j + 1], pa[mt], b1);
      }
    }
  }
}

template <int D>
__host__ __device__ constexpr int fa2_chunks() {
  return (FA_KEYS * (D / 8) + 32 * FA2_WARPS - 1) / (32 * FA2_WARPS);
}

template <int H, int KVH, int D, typename O, int WIN, unsigned CAP, typename SW>
__device__ void attention_fa2(const float* q, const h16_t* kc, const h16_t* vc, const int* slots,
                              const int* seq_off, const int* pos, float scale, O* out, int T, const SW* sinks) {
  constexpr int S = D + 8, DT = D / 8, TILE = FA_KEYS * S, ROWS = 32 * FA2_WARPS, NTH = 32 * FA2_WARPS;
  constexpr int CH = fa2_chunks<D>();
  extern __shared__ __align__(16) unsigned char fa_smem[];
  h16_t* smem = (h16_t*)fa_smem;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int h = blockIdx.y, kvh = h / (H / KVH);
  const int b0 = (gridDim.x - 1 - blockIdx.x) * ROWS;
  if (b0 >= T) return;
  const int bl = min(b0 + ROWS - 1, T - 1);
  if (seq_off[b0] != seq_off[bl]) return;
  const int r0 = b0 + warp * 32, last = min(r0 + 31, T - 1);
  const bool live = r0 < T;
  const int* sl = slots + seq_off[b0];
  const int p_first = live ? pos[r0] : 0, n_keys = live ? pos[last] + 1 : 0;
  const auto masked = [&](int mt, int hr, int p) {
    const int row_pos = p_first + mt * 16 + g + hr * 8;
    return p > row_pos || (WIN && p <= row_pos - WIN);
  };
  float o[2][DT][4];
#pragma unroll
  for (int mt = 0; mt < 2; mt++)
#pragma unroll
    for (int i = 0; i < DT; i++) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.0f;
  float m[2][2] = {{NEG_INF, NEG_INF}, {NEG_INF, NEG_INF}}, l[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
  const float qs = scale * 1.4426950408889634f;
  const int n = pos[bl] + 1;
  const int p_lo = WIN ? max(0, pos[b0] - WIN + 1) / FA_KEYS * FA_KEYS : 0;
  const auto stage = [&](int i) { return smem + (i % FA_STAGES) * 2 * TILE; };
  int sn[CH];
  const auto slots_of = [&](int p0) {
#pragma unroll
    for (int it = 0; it < CH; it++) {
      const int p = p0 + min((int)threadIdx.x + NTH * it, FA_KEYS * DT - 1) / DT;
      sn[it] = sl[p < n ? p : 0];
    }
  };
  const auto load = [&](int p0, h16_t* k_s) {
#pragma unroll
    for (int it = 0; it < CH; it++) {
      const int i = threadIdx.x + NTH * it, key = i / DT, ch = i % DT;
      if (FA_KEYS * DT % NTH != 0 && i >= FA_KEYS * DT) break;
      const long src = (long)sn[it] * (KVH * D) + kvh * D + ch * 8;
      const int bytes = p0 + key < n ? 16 : 0;
      cp_async16(smem_addr(k_s + key * S + ch * 8), kc + src, bytes);
      cp_async16(smem_addr(k_s + TILE + key * S + ch * 8), vc + src, bytes);
    }
  };
#pragma unroll
  for (int i = 0; i < FA_STAGES - 1; i++) {
    slots_of(p_lo + i * FA_KEYS);
    if (p_lo + i * FA_KEYS < n) load(p_lo + i * FA_KEYS, stage(i));
    cp_async_commit();
  }
  slots_of(p_lo + (FA_STAGES - 1) * FA_KEYS);
  // The warp's 32 query rows, scaled to log2 units and rounded to 16 bits, in shared memory
  // past the stages (rows of D + 8), read back as mma fragments at every key step.
  h16_t* q_s = smem + FA_STAGES * 2 * TILE + warp * 32 * S;
  for (int i = lane; i < 32 * D / 2; i += 32) {
    const int r = i / (D / 2), d = 2 * (i % (D / 2));
    const bool ok = live && r0 + r < T;
    const float* src = q + ((long)(r0 + r) * H + h) * D + d;
    *(unsigned*)(q_s + r * S + d) = ok ? pack_h16x2(src[0] * qs, src[1] * qs) : 0u;
  }
  __syncwarp();
  for (int p0 = p_lo, i = 0; p0 < n; p0 += FA_KEYS, i++) {
    const int pn = p0 + (FA_STAGES - 1) * FA_KEYS;
    if (pn < n) load(pn, stage(i + FA_STAGES - 1));
    cp_async_commit();
    if (pn + FA_KEYS < n) slots_of(pn + FA_KEYS);
    cp_async_wait<FA_STAGES - 1>();
    __syncthreads();
#pragma unroll
    for (int sub = 0; sub < FA_KEYS; sub += FA2_SUB) {
      const int ps = p0 + sub;
      if (live && ps < n_keys && (!WIN || ps + FA2_SUB > p_first - WIN + 1)) {
        const h16_t* k_s = stage(i) + sub * S;
        if (ps + FA2_SUB > p_first || (WIN && ps <= n_keys - 1 - WIN))
          fa2_step<D, CAP, true>(q_s, ps, n_keys, k_s, k_s + TILE, masked, m, l, o);
        else
          fa2_step<D, CAP, false>(q_s, ps, n_keys, k_s, k_s + TILE, masked, m, l, o);
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();
  if (!live) return;
#pragma unroll
  for (int mt = 0; mt < 2; mt++)
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
      float lt = l[mt][hr];
      lt += __shfl_xor_sync(0xffffffffu, lt, 1);
      lt += __shfl_xor_sync(0xffffffffu, lt, 2);
      const int row = r0 + mt * 16 + g + hr * 8;
      if (row >= T) continue;
      if (sinks) lt += exp2f(to_f32(sinks[h]) * 1.4426950408889634f - m[mt][hr]);
      O* dst = out + ((long)row * H + h) * D;
#pragma unroll
      for (int i = 0; i < DT; i++) {
        store(dst + i * 8 + 2 * c, o[mt][i][hr * 2] / lt);
        store(dst + i * 8 + 2 * c + 1, o[mt][i][hr * 2 + 1] / lt);
      }
    }
}
