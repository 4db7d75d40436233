// RoPE with the paged KV-cache write, and attention over the paged cache: per row and head
// group (attention_gqa), one token with RoPE fused (attention_rope1), prefill groups of 16 rows
// on tensor cores (attention_fa) and decode rows on tensor cores (attention_dec, its key splits
// merged by attention_dec_merge). Included after fast.cuh.

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

// Rotate-half RoPE of feature x whose partner (the feature ROT / 2 away) is p, with cos c and
// sin s (times the rope scale): the first half's x c - p s, the second half's x c + p s. What
// rope_kv, rope_at and decode attention's own rows all compute.
__device__ __forceinline__ float rope_rotate(float x, float p, float c, float s, bool first_half) {
  return first_half ? x * c - p * s : x * c + p * s;
}

// RoPE on the leading ROT features of each head of q (RQ) and k (RK) at positions pos[t], q
// written to qo (f32), k and v written as h16 into the paged cache at slot slot_of[t]. With NQ
// (NK) each head of q (k) is RMS-normalised first, times the head-sized weight qnw (knw).
// Rows of q, k and v are LQ, LK and LV floats apart (H * D, KVH * D and KVH * D, or the row of
// the packed matrix their linears' launch wrote). grid: T, block: 128.
template <int H, int KVH, int D, int ROT, bool RQ, bool RK, bool NQ, bool NK, typename NWQ, typename NWK, int LQ,
          int LK, int LV>
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
        const float* x = isq ? q + (long)t * LQ + hh * D : k + (long)t * LK + (hh - H) * D;
        rms[hh] = head_rms<D>(x, isq ? qeps : keps);
      }
    }
    __syncthreads();
  }
  // Every value the thread rotates or copies is loaded before any is used, so the row costs one
  // round trip to memory rather than one per pair (the loop would wait on each: stores to qo
  // and the cache may alias the inputs). Pair i: head i / (D / 2) of q then of k.
  constexpr int NT = 128, PAIRS = (H + KVH) * (D / 2), PER = (PAIRS + NT - 1) / NT, VPER = (KVH * D + NT - 1) / NT;
  const auto at = [&](int i, int& head, int& j, int& ja, int& jb) {
    const bool isq = i < H * (D / 2);
    const int ii = isq ? i : i - H * (D / 2);
    head = ii / (D / 2);
    j = ii % (D / 2);
    // a rotated pair (j, j + ROT / 2), or two features past the rotated ones
    ja = j < ROT / 2 ? j : ROT + 2 * (j - ROT / 2);
    jb = j < ROT / 2 ? j + ROT / 2 : ja + 1;
    return isq;
  };
  float xa[PER], xb[PER], fr[PER], vv[VPER];
#pragma unroll
  for (int u = 0; u < PER; u++) {
    const int i = threadIdx.x + u * NT;
    int head, j, ja, jb;
    if (i >= PAIRS) continue;
    const bool isq = at(i, head, j, ja, jb);
    const float* src = isq ? q + (long)t * LQ + head * D : k + (long)t * LK + head * D;
    xa[u] = src[ja];
    xb[u] = src[jb];
    fr[u] = inv_freq && j < ROT / 2 ? inv_freq[j] : 0.0f;
  }
#pragma unroll
  for (int u = 0; u < VPER; u++) {
    const int i = threadIdx.x + u * NT;
    if (i < KVH * D) vv[u] = v[(long)t * LV + i];
  }
#pragma unroll
  for (int u = 0; u < PER; u++) {
    const int i = threadIdx.x + u * NT;
    int head, j, ja, jb;
    if (i >= PAIRS) continue;
    const bool isq = at(i, head, j, ja, jb);
    const bool rot = j < ROT / 2;
    float a = xa[u], b = xb[u];
    if (isq && NQ) {
      a *= rms[head] * to_f32(qnw[ja]);
      b *= rms[head] * to_f32(qnw[jb]);
    } else if (!isq && NK) {
      a *= rms[H + head] * to_f32(knw[ja]);
      b *= rms[H + head] * to_f32(knw[jb]);
    }
    if (rot && (isq ? RQ : RK)) {
      float sn, c;
      sincosf(p * fr[u], &sn, &c);
      sn *= scale;
      c *= scale;
      const float ra = rope_rotate(a, b, c, sn, true), rb = rope_rotate(b, a, c, sn, false);
      a = ra;
      b = rb;
    }
    if (isq) {
      qo[(long)t * H * D + head * D + ja] = a;
      qo[(long)t * H * D + head * D + jb] = b;
    } else {
      kc[dst + head * D + ja] = f32_to_h16(a);
      kc[dst + head * D + jb] = f32_to_h16(b);
    }
  }
#pragma unroll
  for (int u = 0; u < VPER; u++) {
    const int i = threadIdx.x + u * NT;
    if (i < KVH * D) vc[dst + i] = f32_to_h16(vv[u]);
  }
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
__host__ __device__ constexpr int kv16_lanes(int d) {
  int p = 1;
  while (p < d / 16) p <<= 1;
  return p;
}

// How the kv16 kernels split a sequence's keys: kv16_lanes(D) lanes share a key, 16 dims
// each, so a warp scores KPW keys at once; eight warps take STATES keys a pass, U passes are
// loaded at a time.
template <int D>
struct Kv16 {
  static constexpr int G = D / 16, GP = kv16_lanes(D), KPW = 32 / GP, WARPS = 8, STATES = WARPS * KPW, U = 4;
};

// The lane's K and V chunks of the U passes from position p0 (this warp's first key of them;
// keys at n or past are zeros, row -1): their slots, then their rows, loaded before any is
// used, so a short sequence costs two memory round trips rather than two per pass.
template <int KVH, int D>
__device__ __forceinline__ void kv16_load(const h16_t* kc, const h16_t* vc, const int* sl, int p0, int n, int kvh,
                                          long* row, uint4 (*kv)[4]) {
  using S = Kv16<D>;
  const int lane = threadIdx.x & 31, sub = lane % S::GP, grp = lane / S::GP;
#pragma unroll
  for (int u = 0; u < S::U; u++) {
    const int p = p0 + u * S::STATES + grp;
    row[u] = p < n ? (long)sl[p] * (KVH * D) + kvh * D + sub * 16 : -1;
  }
#pragma unroll
  for (int u = 0; u < S::U; u++) {
    const uint4 z = make_uint4(0, 0, 0, 0);
    const uint4* kr = (const uint4*)(kc + row[u]);
    const uint4* vr = (const uint4*)(vc + row[u]);
    const bool ld = row[u] >= 0 && sub < S::G;
    kv[u][0] = ld ? kr[0] : z;
    kv[u][1] = ld ? kr[1] : z;
    kv[u][2] = ld ? vr[0] : z;
    kv[u][3] = ld ? vr[1] : z;
  }
}

// The loaded passes (kv16_load) added to the lane's online-softmax state.
template <int D, unsigned CAP>
__device__ __forceinline__ void kv16_add_passes(const float* qv, const long* row, const uint4 (*kv)[4], float& m,
                                                float& l, float* acc) {
  using S = Kv16<D>;
#pragma unroll
  for (int u = 0; u < S::U; u++) {
    float f[16], s = 0.0f;
    unpack8(kv[u][0], f);
    unpack8(kv[u][1], f + 8);
#pragma unroll
    for (int i = 0; i < 16; i++) s = fmaf(qv[i], f[i], s);
#pragma unroll
    for (int o = S::GP / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    s = softcap<CAP>(s);
    if (row[u] >= 0) {
      unpack8(kv[u][2], f);
      unpack8(kv[u][3], f + 8);
      kv16_add(s, f, m, l, acc);
    }
  }
}

// The keys at positions first..n-1 of a sequence (slots sl[p]) for kv head kvh, split over the
// warps and lane groups of the block (Kv16: eight warps split the keys, U passes at a time):
// each lane's online-softmax state, merged by kv16_merge.
template <int KVH, int D, unsigned CAP>
__device__ __forceinline__ void kv16_scan(const float* qv, const h16_t* kc, const h16_t* vc, const int* sl, int first,
                                         int n, int kvh, float& m, float& l, float* acc) {
  using S = Kv16<D>;
  for (int p0 = first + (threadIdx.x >> 5) * S::KPW; p0 < n; p0 += S::U * S::STATES) {
    long row[S::U];
    uint4 kv[S::U][4];
    kv16_load<KVH, D>(kc, vc, sl, p0, n, kvh, row, kv);
    kv16_add_passes<D, CAP>(qv, row, kv, m, l, acc);
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
  using S = Kv16<D>;
  constexpr int G = S::G, GP = S::GP, KPW = S::KPW, STATES = S::STATES;
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
  return rope_rotate(v, other, c, sn, d < ROT / 2);
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
  using S = Kv16<D>;
  constexpr int G = S::G, GP = S::GP;
  const int h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane % GP, grp = lane / GP;
  const int kvh = h / (H / KVH), n = pos[0] + 1;
  // The first two rounds of passes' cached keys (256 keys at D 128) before waiting for the
  // previous kernel: the position and slots are the step's inputs, uploaded before its first
  // kernel, and the keys before the token's own were cached by earlier steps (as
  // attention_dec's early copies). Added in kv16_scan's order, so the sums are the scan's.
  const int* sl = slots + seq_off[0];
  const int first = WIN ? max(0, n - WIN) : 0, p0 = first + warp * S::KPW;
  long row[2][S::U];
  uint4 kv[2][S::U][4];
#pragma unroll
  for (int b = 0; b < 2; b++) kv16_load<KVH, D>(kc, vc, sl, p0 + b * S::U * S::STATES, n - 1, kvh, row[b], kv[b]);
  pdl_wait();
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
#pragma unroll
  for (int b = 0; b < 2; b++) kv16_add_passes<D, CAP>(qv, row[b], kv[b], m, l, acc);
  kv16_scan<KVH, D, CAP>(qv, kc, vc, sl, first + 2 * S::U * S::STATES, n - 1, kvh, m, l, acc);
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
// The mma.sync A fragments of 16 query rows already rounded to h16: at(r, d) the pair of
// features d and d + 1 of row r (0 past the rows).
template <int D, typename AT>
__device__ __forceinline__ void fa_q_h16(unsigned (&qf)[D / 16][4], AT at) {
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int ks = 0; ks < D / 16; ks++)
#pragma unroll
    for (int e = 0; e < 4; e++) qf[ks][e] = at(g + (e & 1) * 8, ks * 16 + 2 * c + (e >> 1) * 8);
}

// The mma.sync A fragments of 16 query rows (feature d of row r: at(r, d), 0 past the rows),
// times qs, rounded to h16: the Q of attention_fa and attention_dec.
template <int D, typename AT>
__device__ __forceinline__ void fa_q(unsigned (&qf)[D / 16][4], AT at, float qs) {
  fa_q_h16<D>(qf, [&](int r, int d) { return pack_h16x2(at(r, d) * qs, at(r, d + 1) * qs); });
}

// fa_q's features of query rows stored whole: row r at row(r), null past the rows.
template <typename ROW>
__device__ __forceinline__ auto fa_rows(ROW row) {
  return [=](int r, int d) {
    const float* src = row(r);
    return src ? src[d] : 0.0f;
  };
}

// The slot of key p0 + (lane % 16) of a tile (slots sl; keys at n or past take slot 0's): what
// fa_load takes, read once a key so the lanes copying its rows get it by shuffle.
__device__ __forceinline__ int fa_slot(const int* sl, int p0, int n) {
  const int key = p0 + (threadIdx.x & 15);
  return sl[key < n ? key : 0];
}

// Issues (cp.async, not committed) the copies of 16-byte chunk ch of key `key`'s K and V rows
// (cache slot `slot`, kv head kvh; `bytes` 16, or 0 to zero-fill) into tiles k_s and v_s (rows
// of D + 8): what attention_fa's and attention_dec's tile loads are made of.
template <int KVH, int D>
__device__ __forceinline__ void fa_copy_chunk(const h16_t* kc, const h16_t* vc, int slot, int kvh, int key, int ch,
                                              int bytes, h16_t* k_s, h16_t* v_s) {
  const long src = (long)slot * (KVH * D) + kvh * D + ch * 8;
  cp_async16(smem_addr(k_s + key * (D + 8) + ch * 8), kc + src, bytes);
  cp_async16(smem_addr(v_s + key * (D + 8) + ch * 8), vc + src, bytes);
}

// Issues (cp.async, not committed) one warp's copies of the 16 keys at positions p0.. (their
// slots `mine`, fa_slot's; kv head kvh; keys at n or past are zero-filled) into its K and V
// tiles k_s and v_s.
template <int KVH, int D>
__device__ __forceinline__ void fa_load(const h16_t* kc, const h16_t* vc, int mine, int kvh, int p0, int n,
                                        h16_t* k_s, h16_t* v_s) {
  constexpr int DT = D / 8;
  static_assert(16 * DT % 32 == 0, "every lane takes as many copies");
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = lane; i < 16 * DT; i += 32) {
    const int key = i / DT;
    fa_copy_chunk<KVH, D>(kc, vc, __shfl_sync(0xffffffffu, mine, key), kvh, key, i % DT, p0 + key < n ? 16 : 0, k_s,
                          v_s);
  }
}

// One warp's step over the KEYS keys (a multiple of 16) at positions p0.. staged in k_s and v_s
// (rows of D + 8; copies complete and visible to the warp) for the 16 query rows whose mma A
// fragments are qf (scaled to log2 units): S = Q·Kᵀ, the soft cap, the keys at n or past and
// those `masked(hr, p)` says (row g + 8 hr of the lane's quad, position p) set to -inf, the
// online softmax of rows g and g + 8 (m, l: the quad's max, the lane's partial sum) and
// O += P·V with P rounded to h16: attention_fa's and attention_dec's step. With EDGE false the
// caller knows no key of the tile is masked (nor at n or past), and no mask is computed.
template <int D, unsigned CAP, bool EDGE = true, int KEYS = 16, typename MASK>
__device__ __forceinline__ void fa_step(const unsigned (&qf)[D / 16][4], int p0, int n, const h16_t* k_s,
                                        const h16_t* v_s, MASK masked, float (&m)[2], float (&l)[2],
                                        float (&o)[D / 8][4]) {
  constexpr int S = D + 8, KS = D / 16, DT = D / 8, NT = KEYS / 8;
  static_assert(KEYS % 16 == 0, "keys in mma tiles of 16");
  const int lane = threadIdx.x & 31, c = lane & 3;
  float s[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < KS; ks++) {
#pragma unroll
    for (int kb = 0; kb < KEYS / 16; kb++) {
      unsigned kf[4];
      ldmatrix_x4(kf, smem_addr(k_s + (kb * 16 + (lane & 7) + (lane >> 4) * 8) * S + ks * 16 + ((lane >> 3) & 1) * 8));
      const unsigned b0[2] = {kf[0], kf[1]}, b1[2] = {kf[2], kf[3]};
      mma_h16(s[2 * kb], qf[ks], b0);
      mma_h16(s[2 * kb + 1], qf[ks], b1);
    }
  }
  // the mask, then the online softmax of rows g (hr 0) and g + 8 (hr 1)
  float corr[2];
#pragma unroll
  for (int hr = 0; hr < 2; hr++) {
    float mx = NEG_INF;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const int p = p0 + nt * 8 + 2 * c + e;
        float& v = s[nt][hr * 2 + e];
        // scores are in log2 units here (q was scaled by log2 e)
        if (CAP) v = softcap<CAP>(v * 0.6931471805599453f) * 1.4426950408889634f;
        if (EDGE && (p >= n || masked(hr, p))) v = NEG_INF;
        mx = fmaxf(mx, v);
      }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m[hr], mx);
    const float base = m_new == NEG_INF ? 0.0f : m_new;
    corr[hr] = exp2f(m[hr] - base);
    m[hr] = m_new;
    float sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
      for (int e = 0; e < 2; e++) {
        float& v = s[nt][hr * 2 + e];
        v = exp2f(v - base);
        sum += v;
      }
    l[hr] = l[hr] * corr[hr] + sum;
  }
  // The outputs rescaled only when some row's maximum grew (past the first tiles, rarely).
  if (__any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) {
#pragma unroll
    for (int i = 0; i < DT; i++)
#pragma unroll
      for (int e = 0; e < 4; e++) o[i][e] *= corr[e >> 1];
  }
#pragma unroll
  for (int kb = 0; kb < KEYS / 16; kb++) {
    const unsigned pa[4] = {pack_h16x2(s[2 * kb][0], s[2 * kb][1]), pack_h16x2(s[2 * kb][2], s[2 * kb][3]),
                            pack_h16x2(s[2 * kb + 1][0], s[2 * kb + 1][1]),
                            pack_h16x2(s[2 * kb + 1][2], s[2 * kb + 1][3])};
#pragma unroll
    for (int j = 0; j < D / 16; j++) {
      unsigned vf[4];
      ldmatrix_x4_trans(vf,
                        smem_addr(v_s + (kb * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * S + j * 16 + (lane >> 4) * 8));
      const unsigned b0[2] = {vf[0], vf[1]}, b1[2] = {vf[2], vf[3]};
      mma_h16(o[2 * j], pa, b0);
      mma_h16(o[2 * j + 1], pa, b1);
    }
  }
}

// Transposes an 8x8 matrix of 16-bit pairs held as an mma fragment (lane 4 r + c: row r, columns
// 2c and 2c + 1).
__device__ __forceinline__ unsigned movmatrix_trans(unsigned x) {
  unsigned y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// The Qᵀ fragments of dec_step_t (the mma's B, features x 8 heads): at(h, d) the rounded pair of
// features d and d + 1 of head h (0 past the heads).
template <int D, typename AT>
__device__ __forceinline__ void dec_q_t(unsigned (&qf)[D / 16][2], AT at) {
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int ks = 0; ks < D / 16; ks++)
#pragma unroll
    for (int e = 0; e < 2; e++) qf[ks][e] = at(g, ks * 16 + 2 * c + e * 8);
}

// fa_step transposed, for up to 8 query heads a kv head (decode attention): Sᵀ = K·Qᵀ with the
// tile's 16 keys as the mma's M and the heads as its N (qf: dec_q_t's), the mask and online
// softmax of heads 2c and 2c + 1 (m: their maxima over the keys, l: the lane's partial sums of
// keys g and g + 8), then Pᵀ rounded to h16 and moved into the B layout (movmatrix) and
// Oᵀ += Vᵀ·Pᵀ with the features as M (o[i]: features 16 i.., lane's rows g and g + 8, heads
// 2c and 2c + 1). Half the mma, exponentials and accumulators of fa_step's 16 rows; the mask
// (keys at n or past, and those masked(0, p) says) taken for every tile, so the loop holds one
// copy of the step.
template <int D, unsigned CAP, typename MASK>
__device__ __forceinline__ void dec_step_t(const unsigned (&qf)[D / 16][2], int p0, int n, const h16_t* k_s,
                                           const h16_t* v_s, MASK masked, float (&m)[2], float (&l)[2],
                                           float (&o)[D / 16][4]) {
  constexpr int S = D + 8, KS = D / 16;
  const int lane = threadIdx.x & 31, g = lane >> 2;
  // two accumulators, so each mma waits for the one before last
  float s[4] = {0.0f, 0.0f, 0.0f, 0.0f}, s2[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int ks = 0; ks < KS; ks++) {
    unsigned kf[4];
    ldmatrix_x4(kf, smem_addr(k_s + ((lane & 7) + ((lane >> 3) & 1) * 8) * S + ks * 16 + (lane >> 4) * 8));
    mma_h16(ks % 2 ? s2 : s, kf, qf[ks]);
  }
#pragma unroll
  for (int e = 0; e < 4; e++) s[e] += s2[e];
  // s[e] and s[2 + e]: keys g and g + 8 of head 2c + e
  float corr[2];
#pragma unroll
  for (int e = 0; e < 2; e++) {
    float mx = NEG_INF;
#pragma unroll
    for (int k = 0; k < 2; k++) {
      float& v = s[2 * k + e];
      const int p = p0 + g + 8 * k;
      if (CAP) v = softcap<CAP>(v * 0.6931471805599453f) * 1.4426950408889634f;
      if (p >= n || masked(0, p)) v = NEG_INF;
      mx = fmaxf(mx, v);
    }
#pragma unroll
    for (int x = 4; x < 32; x <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, x));
    const float m_new = fmaxf(m[e], mx);
    const float base = m_new == NEG_INF ? 0.0f : m_new;
    corr[e] = exp2f(m[e] - base);
    m[e] = m_new;
    s[e] = exp2f(s[e] - base);
    s[2 + e] = exp2f(s[2 + e] - base);
    l[e] = l[e] * corr[e] + s[e] + s[2 + e];
  }
  if (__any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) {
#pragma unroll
    for (int i = 0; i < KS; i++)
#pragma unroll
      for (int e = 0; e < 4; e++) o[i][e] *= corr[e & 1];
  }
  // Pᵀ as the B fragment: keys 2c, 2c + 1 (then 8 more) of head g.
  const unsigned pb[2] = {movmatrix_trans(pack_h16x2(s[0], s[1])), movmatrix_trans(pack_h16x2(s[2], s[3]))};
#pragma unroll
  for (int j = 0; j < KS; j++) {
    unsigned vf[4];
    ldmatrix_x4_trans(vf, smem_addr(v_s + ((lane & 7) + (lane >> 4) * 8) * S + j * 16 + ((lane >> 3) & 1) * 8));
    mma_h16(o[j], vf, pb);
  }
}

// fa_load then fa_step, the copies awaited in between: one tile, nothing in flight across
// tiles (attention_fa's loop).
template <int KVH, int D, unsigned CAP, typename MASK>
__device__ __forceinline__ void fa_tile(const unsigned (&qf)[D / 16][4], const h16_t* kc, const h16_t* vc,
                                        const int* sl, int kvh, int p0, int n, h16_t* k_s, h16_t* v_s,
                                        MASK masked, float (&m)[2], float (&l)[2], float (&o)[D / 8][4]) {
  fa_load<KVH, D>(kc, vc, fa_slot(sl, p0, n), kvh, p0, n, k_s, v_s);
  cp_async_commit();
  cp_async_wait<0>();
  __syncwarp();
  fa_step<D, CAP>(qf, p0, n, k_s, v_s, masked, m, l, o);
  __syncwarp();
}

// The threads of an attention_fa block.
constexpr int FA_THREADS = 32 * FA_WARPS;

// The 16-byte chunks of K (and of V) each of attention_fa's FA_THREADS threads copies a
// block-wide tile of FA_KEYS keys: chunk i = threadIdx.x + FA_THREADS it of the tile's
// FA_KEYS * D / 8, key i / (D / 8).
template <int D>
__host__ __device__ constexpr int fa_chunks() {
  return (FA_KEYS * (D / 8) + FA_THREADS - 1) / FA_THREADS;
}

// The slots of the keys whose K and V chunks this thread copies in the tile of keys at
// positions p0.. (fa_chunks); keys at n or past take slot 0's.
template <int D>
__device__ __forceinline__ void fa_block_slots(int (&sn)[fa_chunks<D>()], const int* sl, int p0, int n) {
#pragma unroll
  for (int it = 0; it < fa_chunks<D>(); it++) {
    const int p = p0 + min((int)threadIdx.x + FA_THREADS * it, FA_KEYS * (D / 8) - 1) / (D / 8);
    sn[it] = sl[p < n ? p : 0];
  }
}

// Issues (cp.async, not committed) this thread's copies of the block-wide tile of FA_KEYS keys
// at positions p0.. (slots sn, fa_block_slots'; kv head kvh; keys at n or past zero-filled) into
// k_s and v_s (rows of D + 8).
template <int KVH, int D>
__device__ __forceinline__ void fa_block_load(const h16_t* kc, const h16_t* vc, const int (&sn)[fa_chunks<D>()],
                                              int kvh, int p0, int n, h16_t* k_s, h16_t* v_s) {
  constexpr int DT = D / 8;
#pragma unroll
  for (int it = 0; it < fa_chunks<D>(); it++) {
    const int i = threadIdx.x + FA_THREADS * it, key = i / DT;
    if (FA_KEYS * DT % FA_THREADS != 0 && i >= FA_KEYS * DT) break;
    fa_copy_chunk<KVH, D>(kc, vc, sn[it], kvh, key, i % DT, p0 + key < n ? 16 : 0, k_s, v_s);
  }
}

// Extend attention on tensor cores (FlashAttention-2 style): a block of FA_WARPS warps takes
// 16 FA_WARPS consecutive query rows of one head, a warp 16 of them, when they belong to one
// sequence (rows of a sequence are consecutive, at consecutive positions). Where the block's
// rows are of one sequence, its keys go through shared memory in tiles of FA_KEYS copied once
// for all its warps (cp.async from the paged cache, FA_STAGES tiles in flight); where they are
// not, each warp whose 16 rows are walks its own tiles of 16. S = Q·Kᵀ and O += P·V with
// mma.sync m16n8k16, online softmax in f32 with a causal mask; a warp skips tiles wholly past
// its rows or before their window. Groups of 16 that span two sequences are left to
// attention_gqa<MIXED_ONLY> (or attention_dec). Window and cap as attention_gqa's; sinks as
// attention_gqa's. The blocks of a head's last rows (the most keys) run first.
// grid: (ceil(T / (16 FA_WARPS)), H), block: 32 FA_WARPS, dynamic shared memory: fa_smem's
// (codegen_cuda::schedule). D <= 128.
template <int H, int KVH, int D, typename O, int WIN, unsigned CAP, typename SW>
__device__ void attention_fa(const float* q, const h16_t* kc, const h16_t* vc, const int* slots,
                             const int* seq_off, const int* pos, float scale, O* out, int T, const SW* sinks) {
  constexpr int S = D + 8, KS = D / 16, DT = D / 8, TILE = FA_KEYS * S, ROWS = 16 * FA_WARPS;
  extern __shared__ __align__(16) unsigned char fa_smem[];
  h16_t* smem = (h16_t*)fa_smem;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int h = blockIdx.y, kvh = h / (H / KVH);
  const int b0 = (gridDim.x - 1 - blockIdx.x) * ROWS;
  if (b0 >= T) return;
  const int bl = min(b0 + ROWS - 1, T - 1), r0 = b0 + warp * 16, last = min(r0 + 15, T - 1);
  const bool block = seq_off[b0] == seq_off[bl];
  const bool live = r0 < T && seq_off[r0] == seq_off[last];
  if (!block && !live) return;
  const int* sl = slots + seq_off[block ? b0 : r0];
  const int p_first = live ? pos[r0] : 0, n_keys = live ? pos[last] + 1 : 0;
  const auto masked = [&](int hr, int p) {
    const int row_pos = p_first + g + hr * 8;
    return p > row_pos || (WIN && p <= row_pos - WIN);
  };
  float o[DT][4];
#pragma unroll
  for (int i = 0; i < DT; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
  const float qs = scale * 1.4426950408889634f;
  const auto q_row = [&](int r) { return live && r0 + r < T ? q + ((long)(r0 + r) * H + h) * D : nullptr; };
  unsigned qf[KS][4];
  if (block) {
    const int n = pos[bl] + 1;
    const int p_lo = WIN ? max(0, pos[b0] - WIN + 1) / FA_KEYS * FA_KEYS : 0;
    const auto stage = [&](int i) { return smem + (i % FA_STAGES) * 2 * TILE; };
    int sn[fa_chunks<D>()];
#pragma unroll
    for (int i = 0; i < FA_STAGES - 1; i++) {
      fa_block_slots<D>(sn, sl, p_lo + i * FA_KEYS, n);
      if (p_lo + i * FA_KEYS < n) fa_block_load<KVH, D>(kc, vc, sn, kvh, p_lo + i * FA_KEYS, n, stage(i), stage(i) + TILE);
      cp_async_commit();
    }
    fa_block_slots<D>(sn, sl, p_lo + (FA_STAGES - 1) * FA_KEYS, n);
    // The queries are read while the first tiles' copies are in flight.
    fa_q<D>(qf, fa_rows(q_row), qs);
    for (int p0 = p_lo, i = 0; p0 < n; p0 += FA_KEYS, i++) {
      const int pn = p0 + (FA_STAGES - 1) * FA_KEYS;
      if (pn < n) fa_block_load<KVH, D>(kc, vc, sn, kvh, pn, n, stage(i + FA_STAGES - 1), stage(i + FA_STAGES - 1) + TILE);
      cp_async_commit();
      if (pn + FA_KEYS < n) fa_block_slots<D>(sn, sl, pn + FA_KEYS, n);
      cp_async_wait<FA_STAGES - 1>();
      __syncthreads();
      if (live && p0 < n_keys && (!WIN || p0 + FA_KEYS > p_first - WIN + 1)) {
        const bool edge = p0 + FA_KEYS > p_first || (WIN && p0 <= n_keys - 1 - WIN);
        if (edge)
          fa_step<D, CAP, true, FA_KEYS>(qf, p0, n_keys, stage(i), stage(i) + TILE, masked, m, l, o);
        else
          fa_step<D, CAP, false, FA_KEYS>(qf, p0, n_keys, stage(i), stage(i) + TILE, masked, m, l, o);
      }
      __syncthreads();
    }
    cp_async_wait<0>();
    if (!live) return;
  } else {
    fa_q<D>(qf, fa_rows(q_row), qs);
    h16_t* k_s = smem + warp * 2 * 16 * S;
    for (int p0 = WIN ? max(0, p_first - WIN + 1) & ~15 : 0; p0 < n_keys; p0 += 16)
      fa_tile<KVH, D, CAP>(qf, kc, vc, sl, kvh, p0, n_keys, k_s, k_s + 16 * S, masked, m, l, o);
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

// What a decode attention that applies RoPE and the cache write itself (R::ON) takes for the
// rows alone in their sequence in the step (every decode row): rope_kv's template arguments and
// inputs (q, k, v the linears' rows, LQ, LK and LV floats apart), and the caches to write. NoRope:
// rope_kv ran before it for every row.
template <int ROT_, bool RQ_, bool RK_, bool NQ_, bool NK_, typename NWQ, typename NWK, int LQ_, int LK_, int LV_>
struct DecRope {
  static constexpr bool ON = true, RQ = RQ_, RK = RK_, NQ = NQ_, NK = NK_;
  static constexpr int ROT = ROT_, LQ = LQ_, LK = LK_, LV = LV_;
  const float *q, *k, *v;
  const int* pos;
  const float* inv_freq;
  float rscale;
  const int* slot_of;
  const NWQ* qnw;
  const NWK* knw;
  float qeps, keps;
  h16_t *kc, *vc;
};
struct NoRope {
  static constexpr bool ON = false;
};

// For row t alone in its sequence, by the NT threads of the block: its G query heads from h0
// (normalised where NQ, rotated where RQ, as rope_kv does), times qs, rounded to h16 in sq (rows
// of D: the mma A fragments fa_q reads); where `mine` (the block holds the row's own key) the
// token's k (as q, by NK and RK) and v as the cache holds them (h16) in own (k then v, D each) and
// in the cache at slot_of[t]. A thread takes V consecutive features at a time (four where the
// rows, the rotated half and the row strides allow 16-byte loads) and their partners; every value
// it takes is loaded before any is used (one round trip to memory), the cos and sin of the row's
// position once a frequency (cs, ROT / 2 of them). H200, 4-layer Qwen2.5-7B at 128 rows: this
// prologue was 43% of the kernel's instructions one feature at a time (docs/perf.md, 2026-11-29,
// third session).
template <int KVH, int G, int D, int NT, typename R>
__device__ void dec_own_row(const R& r, int t, int kvh, int h0, bool mine, float qs, h16_t* sq, h16_t* own,
                            float* rms, float2* cs) {
  constexpr int HALF = R::ROT / 2;
  constexpr int V = D % 4 == 0 && HALF % 4 == 0 && R::LQ % 4 == 0 && R::LK % 4 == 0 && R::LV % 4 == 0 ? 4 : 1;
  constexpr int ROWS = G + 2, DV = D / V, ITEMS = ROWS * DV, PER = (ITEMS + NT - 1) / NT;
  // Row i of the G + 2: query head h0 + i, then k and v of kv head kvh.
  const auto src = [&](int i) {
    return i < G ? r.q + (long)t * R::LQ + (h0 + i) * D
                 : i == G ? r.k + (long)t * R::LK + kvh * D : r.v + (long)t * R::LV + kvh * D;
  };
  // A rotated feature's partner (features d..d + V - 1 are all in one half: V divides HALF).
  const auto partner = [](int d) { return d < HALF ? d + HALF : d - HALF; };
  const auto skip = [&](int i) { return i >= ITEMS || (i >= G * DV && !mine); };
  const auto load = [](const float* p, float (&x)[V]) {
    if constexpr (V == 4) {
      const float4 f = *(const float4*)p;
      x[0] = f.x, x[1] = f.y, x[2] = f.z, x[3] = f.w;
    } else {
      x[0] = *p;
    }
  };
  float a[PER][V], b[PER][V];
#pragma unroll
  for (int u = 0; u < PER; u++) {
    const int i = threadIdx.x + u * NT, row = i / DV, d = i % DV * V;
    if (skip(i)) continue;
    load(src(row) + d, a[u]);
    if (row <= G && d < R::ROT) load(src(row) + partner(d), b[u]);
  }
  const float p = (float)r.pos[t];
  if (R::RQ || R::RK)
    for (int j = threadIdx.x; j < HALF; j += NT) {
      float sn, c;
      sincosf(p * r.inv_freq[j], &sn, &c);
      cs[j] = make_float2(c * r.rscale, sn * r.rscale);
    }
  if (R::NQ || R::NK)
    for (int i = threadIdx.x >> 5; i <= G; i += NT / 32)
      if (i < G ? R::NQ : R::NK) rms[i] = head_rms<D>(src(i), i < G ? r.qeps : r.keps);
  __syncthreads();
  const long dst = (long)r.slot_of[t] * (KVH * D) + kvh * D;
#pragma unroll
  for (int u = 0; u < PER; u++) {
    const int i = threadIdx.x + u * NT, row = i / DV, d = i % DV * V;
    if (skip(i)) continue;
    const bool isq = row < G, isk = row == G;
    float vals[V];
#pragma unroll
    for (int e = 0; e < V; e++) {
      float x = a[u][e], y = row <= G && d < R::ROT ? b[u][e] : 0.0f;
      if ((isq && R::NQ) || (isk && R::NK)) {
        const float s = rms[row];
        x *= s * to_f32(isq ? r.qnw[d + e] : r.knw[d + e]);
        y *= s * to_f32(isq ? r.qnw[partner(d + e)] : r.knw[partner(d + e)]);
      }
      if (((isq && R::RQ) || (isk && R::RK)) && d < R::ROT) {
        const float2 c = cs[(d + e) % HALF];
        x = rope_rotate(x, y, c.x, c.y, d < HALF);
      }
      vals[e] = isq ? x * qs : x;
    }
    // Rounded to h16 as the cache holds them: V at once.
    const auto put = [&](h16_t* to) {
      if constexpr (V == 4)
        *(uint2*)to = make_uint2(pack_h16x2(vals[0], vals[1]), pack_h16x2(vals[2], vals[3]));
      else
        *to = f32_to_h16(vals[0]);
    };
    if (isq) {
      put(sq + row * D + d);
    } else {
      put(own + (row - G) * D + d);
      put((isk ? r.kc : r.vc) + dst + d);
    }
  }
  __syncthreads();
}

// The own key's K and V rows (own: k then v, D each) into row `row` of a warp's tiles k_s and
// v_s (rows of D + 8), over the copy of its cache slot (taken before this step's write of it).
template <int D>
__device__ __forceinline__ void dec_put_own(const h16_t* own, int row, h16_t* k_s, h16_t* v_s) {
  constexpr int DT = D / 8;
  for (int i = threadIdx.x & 31; i < 2 * DT; i += 32)
    *(uint4*)((i < DT ? k_s : v_s) + row * (D + 8) + (i % DT) * 8) = *(const uint4*)(own + i * 8);
  __syncwarp();
}

// Decode attention on tensor cores, for rows of any sequences: a block per row t, kv head and
// split of the row's keys (dec_split), whose G = H / KVH query heads (at most 16) are the 16 rows
// of attention_fa's mma.sync tiles (rows past G are zero and not stored), or, up to 8, the 8
// columns of dec_step_t's transposed ones, so each K and V tile feeds every head sharing it.
// The split's tiles go to the WARPS warps in turn; each warp stages DEC_STAGES tiles (cp.async
// into its stages of the dynamic shared memory; the next DEC_STAGES - 1 tiles' copies in flight
// while a tile is used) and runs attention_fa's online softmax (f32, log2 units, P rounded to h16
// for P·V). The warps' states merge through shared memory: into the
// output where the row's keys are one split, else into `part` (each split's unnormalised
// output, max and sum a head), which attention_dec_merge combines. With MIXED_ONLY, only rows
// attention_fa leaves run (fa_row). Window, cap and sinks as attention_fa's. With R::ON
// (DecRope), a row alone in its sequence in the step takes its queries rotated from R's q and its
// own key and value from R's k and v (dec_own_row: the block holding that key writes them to the
// cache), so every one of its key tiles is copied before the previous kernel ends; the other rows
// read q (rotated) and the cache as rope_kv left them.
// grid: T * SPLITS * KVH, row-major (a row's kv heads run together, reading its cache rows
// whole), block: 32 * WARPS, dynamic shared memory:
// WARPS * DEC_STAGES * 2 * 16 * (D + 8) 16-bit values. D <= 128.
template <int H, int KVH, int D, typename O, bool MIXED_ONLY, int WIN, unsigned CAP, typename SW, int SPLITS,
          int WARPS, typename R>
__device__ void attention_dec(const float* q, const h16_t* kc, const h16_t* vc, const int* slots,
                              const int* seq_off, const int* pos, float scale, O* out, int T, const SW* sinks,
                              float* part, const R rope) {
  constexpr int G = H / KVH, KS = D / 16, DT = D / 8, TILE = 16 * (D + 8);
  static_assert(G <= 16 && D % 16 == 0 && D <= 128, "a kv head's query heads fill one mma tile");
  // Up to 8 heads: the transposed form (dec_step_t), its state of heads 2c and 2c + 1 complete
  // in lanes g = 0 (lane l's state slot k is head hd(k)); else fa_step's, rows g and g + 8 in
  // lanes c = 0.
  constexpr bool TR = G <= 8;
  constexpr int QN = TR ? 2 : 4, OT = TR ? KS : DT;
  extern __shared__ __align__(16) unsigned char dec_smem[];
  __shared__ float sm_m[WARPS][16], sm_l[WARPS][16];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const auto hd = [&](int k) { return TR ? 2 * c + k : g + 8 * k; };
  const bool full = (TR ? g : c) == 0;
  const int t = blockIdx.x / (KVH * SPLITS), kvh = blockIdx.x % KVH, split = blockIdx.x / KVH % SPLITS;
  const int h0 = kvh * G;
  if (MIXED_ONLY && fa_row(seq_off, t, T)) return;
  const DecSplit ds = dec_split<WIN, SPLITS>(pos[t]);
  if (split >= ds.splits) return;
  const int* sl = slots + seq_off[t];
  const int j0 = split * ds.per, j1 = min(j0 + ds.per, ds.tiles);
  // Where row t is its sequence's first of the step (every decode row), its keys before its own
  // position were cached by earlier steps: a tile of only those is copied before the previous
  // kernel ends (pdl_wait; the slots and positions are the step's inputs, uploaded before it).
  const bool settled = t == 0 || seq_off[t - 1] != seq_off[t];
  // Row t alone in its sequence, its own key from R's k (with R::ON): none of its tiles waits.
  const bool own = R::ON && settled && (t == T - 1 || seq_off[t + 1] != seq_off[t]);
  const auto early = [&](int j) { return j >= j1 || own || (settled && ds.base + j * 16 + 16 < ds.n); };
  // The warp's stages, each a K tile then a V tile.
  h16_t* stages = (h16_t*)dec_smem + warp * DEC_STAGES * 2 * TILE;
  const auto k_s = [&](int i) { return stages + (i % DEC_STAGES) * 2 * TILE; };
  const auto slot = [&](int j) { return j < j1 ? fa_slot(sl, ds.base + j * 16, ds.n) : 0; };
  const auto load = [&](int j, int i, int mine) {
    if (j < j1) fa_load<KVH, D>(kc, vc, mine, kvh, ds.base + j * 16, ds.n, k_s(i), k_s(i) + TILE);
    cp_async_commit();
  };
  constexpr int AHEAD = (DEC_STAGES - 1) * WARPS;  // tiles from the one used to the one loaded
#pragma unroll
  for (int i = 0; i < DEC_STAGES - 1; i++) {
    const int j = j0 + warp + i * WARPS, mine = slot(j);
    if (!early(j)) pdl_wait();
    load(j, i, mine);
  }
  // The slots of the tiles the next two iterations load, read two iterations ahead: a slot read
  // under the copies' traffic outlasts an iteration, and the copies never wait for one.
  int next = slot(j0 + warp + AHEAD), after = slot(j0 + warp + AHEAD + WARPS);
  pdl_wait();
  // The queries are read (and rotated) while the first tiles' copies are in flight.
  const float qs = scale * 1.4426950408889634f;
  unsigned qf[KS][QN];
  // A row alone in its sequence: its queries, own key and value (dec_own_row).
  __shared__ __align__(16) h16_t own_kv[R::ON ? 2 * D : 8], own_q[R::ON ? G * D : 8];
  __shared__ float own_rms[R::ON ? G + 1 : 1];
  __shared__ float2 own_cs[R::ON ? D / 2 : 1];
  if constexpr (R::ON) {
    if (own) {
      dec_own_row<KVH, G, D, 32 * WARPS>(rope, t, kvh, h0, j1 == ds.tiles, qs, own_q, own_kv, own_rms, own_cs);
      const auto at = [&](int r, int d) { return r < G ? *(const unsigned*)&own_q[r * D + d] : 0u; };
      if constexpr (TR)
        dec_q_t<D>(qf, at);
      else
        fa_q_h16<D>(qf, at);
    }
  }
  if (!own) {
    const auto row = [&](int r) { return q + ((long)t * H + h0 + r) * D; };
    if constexpr (TR)
      dec_q_t<D>(qf, [&](int r, int d) { return r < G ? pack_h16x2(row(r)[d] * qs, row(r)[d + 1] * qs) : 0u; });
    else
      fa_q<D>(qf, fa_rows([&](int r) { return r < G ? row(r) : nullptr; }), qs);
  }
  float o[OT][4];
#pragma unroll
  for (int i = 0; i < OT; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
  for (int i = 0, j = j0 + warp; j < j1; i++, j += WARPS) {
    const int mine = next;
    next = after;
    after = slot(j + AHEAD + 2 * WARPS);
    load(j + AHEAD, i + DEC_STAGES - 1, mine);
    cp_async_wait<DEC_STAGES - 1>();
    __syncwarp();
    const int p0 = ds.base + j * 16;
    if (own && p0 + 16 >= ds.n) dec_put_own<D>(own_kv, ds.n - 1 - p0, k_s(i), k_s(i) + TILE);
    const auto masked = [&](int, int p) { return p < ds.first; };
    if constexpr (TR)
      dec_step_t<D, CAP>(qf, p0, ds.n, k_s(i), k_s(i) + TILE, masked, m, l, o);
    else if (p0 < ds.first || p0 + 16 > ds.n)
      fa_step<D, CAP>(qf, p0, ds.n, k_s(i), k_s(i) + TILE, masked, m, l, o);
    else
      fa_step<D, CAP, false>(qf, p0, ds.n, k_s(i), k_s(i) + TILE, masked, m, l, o);
    __syncwarp();
  }
  cp_async_wait<0>();
  // Each warp's head maxima and sums, then the heads' totals (with the sinks where this block
  // has all the keys; log2 units as m).
#pragma unroll
  for (int k = 0; k < 2; k++) {
    float lt = l[k];
#pragma unroll
    for (int x = TR ? 4 : 1; x < (TR ? 32 : 4); x <<= 1) lt += __shfl_xor_sync(0xffffffffu, lt, x);
    if (full) {
      sm_m[warp][hd(k)] = m[k];
      sm_l[warp][hd(k)] = lt;
    }
  }
  __syncthreads();
  const bool whole = ds.splits == 1;
  float* ml = part + (((long)t * KVH + kvh) * SPLITS + split) * G * (D + 2);
  float f[2];
#pragma unroll
  for (int k = 0; k < 2; k++) {
    const int row = hd(k);
    const float sink = whole && sinks && row < G ? to_f32(sinks[h0 + row]) * 1.4426950408889634f : NEG_INF;
    const float2 merged = merge_states<WARPS, true>(sink, &sm_m[0][row], &sm_l[0][row], 16);
    f[k] = m[k] == NEG_INF ? 0.0f : exp2f(m[k] - merged.x) / (whole ? merged.y : 1.0f);
    if (!whole && warp == 0 && full && row < G) {
      ml[G * D + row] = merged.x;
      ml[G * D + G + row] = merged.y;
    }
  }
  // Each warp's scaled outputs to its own 16 x D floats of shared memory (the stages' space:
  // every warp's copies are done; WARPS * 16 * D floats fit in it), then summed over the
  // warps in order.
  float* so = (float*)dec_smem;
  __syncthreads();
#pragma unroll
  for (int i = 0; i < OT; i++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      // accumulator e: head and feature
      const int k = TR ? e & 1 : e >> 1, d = TR ? i * 16 + g + (e >> 1) * 8 : i * 8 + 2 * c + (e & 1);
      so[warp * 16 * D + hd(k) * D + d] = o[i][e] * f[k];
    }
  __syncthreads();
  for (int i = threadIdx.x; i < G * D; i += WARPS * 32) {
    float v = so[i];
#pragma unroll
    for (int w = 1; w < WARPS; w++) v += so[w * 16 * D + i];
    if (whole)
      store(out + ((long)t * H + h0) * D + i, v);
    else
      ml[i] = v;
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
