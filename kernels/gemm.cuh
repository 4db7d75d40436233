// Tensor-core linears: the tiled GEMM of prefill, the small-batch kernels of decode batches
// (mma.sync over 16-bit or E4M3 weights), and the W8A8 kernel on Hopper's wgmma with TMA tiles.
// Included after fast.cuh, whose cp.async, ldmatrix and mma helpers they use.

// ---- extend linear: tensor-core GEMM (mma.sync m16n8k16 h16, f32 accumulate) ----
// Block tile 128 x 128 x 32, 8 warps as 2 (M) x 4 (N) of 64 x 32, three cp.async stages.
// E4M3 weights (WT fp8_t) and GGUF's (formats.cuh) go through registers instead: each thread
// loads 16 weights' codes of a tile row one stage ahead (a q4_t thread 8 bytes: weights 8h..8h+7
// and 16+8h..16+8h+7 of the tile's run), and after the stage's math writes them, dequantized, as
// h16 (rounded).
// The groups' column tiles are concatenated along grid.x; grid: (tiles, ceil(T / 128)), block: 256.
template <int K, int N0, int N1, int N2, typename WT, typename BT>
__device__ void gemm(const h16_t* x, const WT* w0, const BT* b0, float* o0, const WT* w1, const BT* b1, float* o1,
                     const WT* w2, const BT* b2, float* o2, int T) {
  constexpr int BM = 128, BN = 128, BK = 32, S = 3, KT = K / BK;
  constexpr bool W8 = WFmt<WT>::PER != 8, Q4 = WFmt<WT>::PER == 32;
  __shared__ __align__(128) h16_t sa[S][BM * BK];
  __shared__ __align__(128) h16_t sb[S][BN * BK];
  int tile = blockIdx.x;
  const LinearOut<WT, BT> g =
      pick_group(tile, (N0 + BN - 1) / BN, (N1 + BN - 1) / BN, LinearOut<WT, BT>{w0, b0, o0, N0},
                 LinearOut<WT, BT>{w1, b1, o1, N1}, LinearOut<WT, BT>{w2, b2, o2, N2});
  const WT* w = g.w;
  const BT* bias = g.b;
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
  const unsigned char* w8row = (const unsigned char*)row_codes<K>(w, w8n);
  auto w8_load = [&](int kt) {
    if constexpr (Q4) {
      const uint2 v = *(const uint2*)(w8row + kt * 16 + 8 * w8h);
      return make_uint4(v.x, v.y, 0, 0);
    } else {
      return ld_stream(w8row + kt * BK + 16 * w8h);
    }
  };
  auto w8_store = [&](int st, int kt, uint4 q) {
    uint4 lo = make_uint4(0, 0, 0, 0), hi = lo;
    if constexpr (WFmt<WT>::GGUF) {
      if (n0 + w8r < N) {
        float f[WFmt<WT>::PER];
        WFmt<WT>::f32(q, WFmt<WT>::sm(w8s, Q4 ? kt : 2 * kt + w8h), f);
        f32_h16<8>(f, &lo);
        f32_h16<8>(f + (Q4 ? 16 : 8), &hi);
      }
    } else {
      if (n0 + w8r < N) e4m3x16_h16(q, w8s[kt * BK / W8_GROUP], lo, hi);
    }
    *(uint4*)&sb[st][swz(w8r, Q4 ? w8h : 2 * w8h)] = lo;
    *(uint4*)&sb[st][swz(w8r, Q4 ? 2 + w8h : 2 * w8h + 1)] = hi;
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
        if (rr < T && cc < N)
          out[(long)rr * (N0 + N1 + N2) + cc] = acc[mi][ni][e] + (bias ? to_f32(bias[cc]) : 0.0f);
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
// product is summed apart and added times the rows' scales (exact). GGUF's weights (formats.cuh)
// come in chunks of 4 * PER: lane (g, c) dequantizes its PER weights at k + PER c to h16
// (rounded: each run has its own scale) and multiplies them with the X row's PER values there.
// Eight warps split K and
// reduce through shared memory. Every N_g is a multiple of 16. grid: (N0 + N1 + N2) / 16, block: 256.
template <int K, int N0, int N1, int N2, int NT, typename WT, typename BT>
__device__ void gemm_skinny(const h16_t* x, const WT* w0, const BT* b0, float* o0, const WT* w1, const BT* b1,
                            float* o1, const WT* w2, const BT* b2, float* o2, int T) {
  constexpr int WARPS = 8, PER = WFmt<WT>::PER, CW = 4 * PER, CH = K / CW, RT = NT < 8 ? NT : 8;
  static_assert(NT % RT == 0, "row tiles in whole rounds of the reduction");
  __shared__ float red[WARPS][16][RT * 8 + 1];
  int f0 = blockIdx.x * 16;
  const LinearOut<WT, BT> grp = pick_group(f0, N0, N1, LinearOut<WT, BT>{w0, b0, o0, N0},
                                           LinearOut<WT, BT>{w1, b1, o1, N1}, LinearOut<WT, BT>{w2, b2, o2, N2});
  const BT* bias = grp.b;
  float* out = grp.o;
  const int N = grp.n;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  float acc[NT][4];
#pragma unroll
  for (int i = 0; i < NT; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  const unsigned char* wa = (const unsigned char*)row_codes<K>(grp.w, f0 + g) + 16 * c;
  const unsigned char* wb = (const unsigned char*)row_codes<K>(grp.w, f0 + g + 8) + 16 * c;
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
    if constexpr (WFmt<WT>::GGUF) {
      const int cc = (k + c * PER) / PER;  // the chunk's index in its row
      float f[PER];
      uint4 ha[PER / 8], hb[PER / 8];
      WFmt<WT>::f32(a0, WFmt<WT>::sm(sa, cc), f);
      f32_h16<PER>(f, ha);
      WFmt<WT>::f32(a1, WFmt<WT>::sm(sb, cc), f);
      f32_h16<PER>(f, hb);
#pragma unroll
      for (int i = 0; i < NT; i++)
#pragma unroll
        for (int q = 0; q < PER / 8; q++) {
          uint4 xb = *(const uint4*)(xr[i] + k + 8 * q);
          if (!live[i]) xb = make_uint4(0, 0, 0, 0);
          mma_rows8(acc[i], ha[q], hb[q], xb);
        }
    } else if constexpr (PER == 8) {
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
    const uint4 a0 = ld_stream(wa + wbytes<WT>(k)), a1 = ld_stream(wb + wbytes<WT>(k));
    const uint4 c0 = ld_stream(wa + wbytes<WT>(k2)), c1 = ld_stream(wb + wbytes<WT>(k2));
    chunk(k, a0, a1);
    chunk(k2, c0, c1);
  }
  if (ch < CH) chunk(ch * CW, ld_stream(wa + wbytes<WT>(ch * CW)), ld_stream(wb + wbytes<WT>(ch * CW)));
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
      out[(long)tok * (N0 + N1 + N2) + f0 + f] = v;
    }
  }
}

// ---- small-batch linear on Hopper's tensor cores (wgmma, sm_90a): W8A8, or 16-bit ----
// WT fp8_t: the input quantized by quant_e4m3 with 128-column groups (codes [T, K], read through
// the TMA map mx; scales xs [K / 128, T]); WT h16_t: the 16-bit input rows as they are (mx
// over x [T, K], xs unused), the weights' 16-bit rows, and every group's products added in the
// wgmma's accumulators (m64n128k16, no scales). A group is 128 bytes of a row either way (128
// codes, or 64 16-bit weights), so the stages, the swizzle and the descriptors are one.
// Up to 64 rows. The work is (128-feature tile, 128-byte column group) units, tile by
// tile, shared evenly by BLOCKS blocks (stream-K: a block's units may end one tile and start
// the next), so every SM streams weights to the end whatever the tile count. A block (one
// warpgroup) takes its units a tile at a time: per group, a 64-row box of the input and the 128 weight
// rows (TMA maps mw_g over each [N_g, K] code matrix) go to shared memory by TMA in STAGES stages (one thread
// issues both copies, an mbarrier a stage counts their bytes), in
// wgmma's 128-byte swizzle (16-byte chunk j of row r at j ^ (r % 8), 8-row atoms 1024 bytes apart), four
// m64n128k32 E4M3 wgmma give the group's products, and they are added times the rows' and the
// weight rows' scales (the scales change every group). A tile done by one block is written by
// it; otherwise each of its blocks writes its sums to its slot of part [slots, 64, N0 + N1 +
// N2] and arrives (count[tile]). Past A8_SHARE_ROWS rows each, once its own units are done,
// waits for the tile's other blocks and adds its share of the tile's rows over the slots
// (a8_add_slots), so no one block adds a whole tile; at fewer rows the last to arrive adds them
// all at once (waiting costs more than adding there). Either way the slots are added in slot
// order, so the result does not depend on which block ends first. codegen_cuda's `a8_blocks` picks BLOCKS,
// `a8_slots` says SLOTS (the most a tile has), `A8_SMEM` is the dynamic shared memory.
// With CL (codegen_cuda's `a8_cluster`: 2 to 8, where stream-K would put that many blocks on
// every tile) a tile's groups go instead to one thread-block cluster of CL blocks, an even
// share each, and their sums meet in distributed shared memory (a8_cluster_sum) rather than in
// part: no fence, no arrival count, no wait for blocks outside the cluster (which the GPU
// starts together). Launched as a programmatic dependent launch, a block loads its first
// stages' weights before it waits for the previous kernel (pdl_wait). Every N_g is a multiple
// of 128. grid: BLOCKS (CL: tiles x CL), block: 128.
#define A8_ROWS 64
// Above this many rows the blocks of a shared tile add its sums in shares at the kernel's end.
// H200, 4-layer Qwen2.5-7B FP8 decode graph: shares 985 against 1029 us at 64 rows, but 887
// against 872 at 32 and 814 against 796 at 16, where the last block's whole-tile sum is short
// and the shares' waiting is not (docs/perf.md, 2026-11-28).
#define A8_SHARE_ROWS 32
#define A8_STAGE (A8_ROWS * 128 + 128 * 128)

// The shared-memory descriptor of a K-major tile of 128-byte rows in the 128-byte swizzle: 8-row
// atoms 1024 bytes apart (the leading offset is unused at this swizzle).
__device__ __forceinline__ unsigned long long wg_desc(unsigned addr) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
         (1ull << 62);
}

// One m64n128 wgmma from shared-memory descriptors a and b: d (64 f32 a thread) =
// (acc ? d : 0) + A x Bᵀ. KIND names its shape and types, IMM the immediates after the
// scale-d predicate (the operands' scales, and for 16-bit types their transposes).
#define WGMMA_M64N128(KIND, IMM, d, a, b, acc)                                                                    \
  asm volatile(                                                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                               \
      "wgmma.mma_async.sync.aligned." KIND " "                                                                   \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "    \
      "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, " \
      "%43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
      "%64, %65, p, " IMM ";\n}\n"                                                                             \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),         \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),    \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),  \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),  \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),  \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),  \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),  \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])   \
      : "l"(a), "l"(b), "r"(acc))

// d = (acc ? d : 0) + A (64 x 32 E4M3, K-major, descriptor a) x B (128 x 32, descriptor b)ᵀ.
__device__ __forceinline__ void wgmma_e4m3_n128(float* d, unsigned long long a, unsigned long long b, int acc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  WGMMA_M64N128("m64n128k32.f32.e4m3.e4m3", "1, 1", d, a, b, acc);
#else
  __trap();
#endif
}

// d = (acc ? d : 0) + A (64 x 16 h16_t, K-major, descriptor a) x B (128 x 16, descriptor b)ᵀ.
__device__ __forceinline__ void wgmma_h16_n128(float* d, unsigned long long a, unsigned long long b, int acc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  WGMMA_M64N128("m64n128k16.f32." H16_PTX "." H16_PTX, "1, 1, 0, 0", d, a, b, acc);
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

// The blocks that share tile `tile` of G units: the first's index and how many (BLOCKS blocks
// over U units).
__device__ __forceinline__ int2 a8_tile_blocks(int tile, int G, long U, int B) {
  const int first = a8_block(tile * G, U, B);
  return make_int2(first, a8_block(tile * G + G - 1, U, B) - first + 1);
}

// Waits until count reaches n (every block of a tile wrote its slot); traps after about a
// second, as mbar_wait does.
__device__ __forceinline__ void a8_await(const unsigned* count, int n) {
  for (long spins = 0;; spins++) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(count) : "memory");
    if (v >= (unsigned)n) return;
    if (spins > (1l << 24)) __trap();
  }
}

// Features f..f + 3 of a bias (f32; zeros where bias is null).
__device__ __forceinline__ float4 a8_bias4(const h16_t* bias, int f) {
  if (!bias) return make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  return make_float4(to_f32(bias[f]), to_f32(bias[f + 1]), to_f32(bias[f + 2]), to_f32(bias[f + 3]));
}

// Share `share` of `shares` of a shared tile's sums: its part of the T x 128 outputs (in float4
// columns), each the bias plus the n slots' split sums (slots [n][64][NTOT] from `slots`) added
// in slot order, so the result does not depend on which block ends first. out and bias point
// at the tile's first feature. Every slot's two float4 columns are loaded before any is added.
template <int SLOTS, int NTOT>
__device__ void a8_add_slots(const float* slots, int n, int share, int shares, int T, const h16_t* bias,
                             float* out) {
  // H items a thread at once (their loads all in flight before the first add), up to 16
  // float4 loads a thread: a share of few slots (gate|up's two) is one round trip, not four.
  constexpr int F = 128, H = SLOTS >= 8 ? 2 : 16 / SLOTS;
  const int items = T * (F / 4), per = (items + shares - 1) / shares, lo = share * per;
  const int hi = min(items, lo + per);
  for (int i0 = lo + (int)threadIdx.x; i0 < hi; i0 += 128 * H) {
    float4 p[H][SLOTS];
#pragma unroll
    for (int h = 0; h < H; h++) {
      const int i = min(i0 + 128 * h, hi - 1), tok = i / (F / 4), f = (i % (F / 4)) * 4;
#pragma unroll
      for (int q = 0; q < SLOTS; q++)
        if (q < n) p[h][q] = __ldcg((const float4*)&slots[((long)q * A8_ROWS + tok) * NTOT + f]);
    }
#pragma unroll
    for (int h = 0; h < H; h++) {
      const int i = i0 + 128 * h, tok = i / (F / 4), f = (i % (F / 4)) * 4;
      if (i >= hi) break;
      float4 v = a8_bias4(bias, f);
#pragma unroll
      for (int q = 0; q < SLOTS; q++)
        if (q < n) {
          v.x += p[h][q].x;
          v.y += p[h][q].y;
          v.z += p[h][q].z;
          v.w += p[h][q].w;
        }
      *(float4*)&out[(long)tok * NTOT + f] = v;
    }
  }
}

// A block's sums of a tile (acc: thread (warp, g, c)'s rows r0 and r0 + 8, features 8 j + 2 c
// and + 1, as wgmma leaves them) stored to dst (rows NTOT floats apart) in 16-byte stores: lanes c
// and c ^ 1 swap halves, so the even lane holds four features of row r0 and the odd one four of
// row r0 + 8. `bias` (null: none) is added; rows at T or past are not stored.
template <int NTOT>
__device__ __forceinline__ void a8_store(const float* acc, float* dst, int T, int r0, const h16_t* bias) {
  const int c = threadIdx.x & 3;
  const bool odd = c & 1;
  const int tok = r0 + (odd ? 8 : 0);
#pragma unroll
  for (int j = 0; j < 16; j++) {
    const float s0 = __shfl_xor_sync(0xffffffffu, odd ? acc[4 * j] : acc[4 * j + 2], 1);
    const float s1 = __shfl_xor_sync(0xffffffffu, odd ? acc[4 * j + 1] : acc[4 * j + 3], 1);
    float4 v = odd ? make_float4(s0, s1, acc[4 * j + 2], acc[4 * j + 3])
                   : make_float4(acc[4 * j], acc[4 * j + 1], s0, s1);
    const int f = 8 * j + 2 * (c & ~1);
    if (bias) {
      const float4 b = a8_bias4(bias, f);
      v = make_float4(v.x + b.x, v.y + b.y, v.z + b.z, v.w + b.w);
    }
    if (tok < T) *(float4*)&dst[(long)tok * NTOT + f] = v;
  }
}

// This block's rank in its thread-block cluster.
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Every thread of the cluster's blocks arrives (its shared-memory writes released) and waits
// for the others (theirs acquired).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// Four floats at shared address addr of the cluster's block `rank` (distributed shared memory).
__device__ __forceinline__ float4 ld_cluster_f4(unsigned addr, unsigned rank) {
  unsigned a;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(addr), "r"(rank));
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(a)
               : "memory");
  return v;
}

// A tile's sums over the CL blocks of its cluster (acc: this block's, laid out as a8_store
// says): each block puts its 64 x 128 sums in its own shared memory (sums, rows padded to 132
// floats against bank conflicts; the stages are free by then), and after one cluster barrier
// adds its share of the T rows' float4 columns over the blocks' sums in rank order (so the
// result does not depend on timing), plus the bias, to out (rows NTOT floats apart, at the
// tile's first feature). A second barrier keeps every block's sums until its peers have read
// them.
template <int CL, int NTOT>
__device__ void a8_cluster_sum(const float* acc, float* sums, int T, int r0, const h16_t* bias, float* out) {
  constexpr int F = 128, LD = F + 4;
  const int c = threadIdx.x & 3;
  __syncthreads();  // every warp is past the stages
#pragma unroll
  for (int j = 0; j < 16; j++) {
    const int f = 8 * j + 2 * c;
    *(float2*)&sums[r0 * LD + f] = make_float2(acc[4 * j], acc[4 * j + 1]);
    *(float2*)&sums[(r0 + 8) * LD + f] = make_float2(acc[4 * j + 2], acc[4 * j + 3]);
  }
  cluster_sync();
  // The tile's T x 32 float4 columns in CL even shares, in rank order.
  const int items = T * (F / 4), per = (items + CL - 1) / CL, lo = (int)cluster_rank() * per;
  const int hi = min(items, lo + per);
  const unsigned base = smem_addr(sums);
  for (int i = lo + (int)threadIdx.x; i < hi; i += 128) {
    const int tok = i / (F / 4), f = (i % (F / 4)) * 4;
    float4 p[CL];
#pragma unroll
    for (int q = 0; q < CL; q++) p[q] = ld_cluster_f4(base + (unsigned)(tok * LD + f) * 4u, q);
    float4 v = a8_bias4(bias, f);
#pragma unroll
    for (int q = 0; q < CL; q++) v = make_float4(v.x + p[q].x, v.y + p[q].y, v.z + p[q].z, v.w + p[q].w);
    *(float4*)&out[(long)tok * NTOT + f] = v;
  }
  cluster_sync();
}

template <typename WT, int K, int N0, int N1, int N2, int BLOCKS, int SLOTS, int STAGES, int CL = 0>
__device__ void gemm_skinny_a8(const TmaMap* mx, const float* xs, const WT* w0, const h16_t* b0, float* o0,
                               const WT* w1, const h16_t* b1, float* o1, const WT* w2, const h16_t* b2,
                               float* o2, float* part, unsigned* count, int T, const TmaMap* mw0,
                               const TmaMap* mw1, const TmaMap* mw2) {
  // W8: E4M3 codes with scales per group; else 16-bit weights, no scales. A group is 128 bytes.
  constexpr bool W8 = sizeof(WT) == 1;
  constexpr int F = 128, G = K / (128 / (int)sizeof(WT)), S = STAGES, NTOT = N0 + N1 + N2;
  constexpr long U = (long)(NTOT / F) * G;
  extern __shared__ unsigned char a8_smem[];
  // Stage s: input tile at tiles + s * A8_STAGE, weight tile 8 KB after it, 1024-aligned; then
  // the scales of every stage: input [S][64], weight [S][128].
  const unsigned raw = smem_addr(a8_smem), tiles = (raw + 1023) & ~1023u;
  unsigned char* const gen = a8_smem + (tiles - raw);
  float* const sxs = (float*)(gen + S * A8_STAGE);
  float* const sws = sxs + S * A8_ROWS;
  __shared__ bool last;
  int shared[2], nshared = 0;  // the tiles this block shares with others (its first, its last)
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
  // The block's units: stream-K's even share of all of them, or (CL) its share of its
  // cluster's tile.
  const int ct = blockIdx.x / (CL ? CL : 1), cr = blockIdx.x % (CL ? CL : 1);
  const int u_end = CL ? ct * G + (cr + 1) * G / (CL ? CL : 1) : a8_start(blockIdx.x + 1, U, BLOCKS);
  bool first = true, synced = false;  // synced: every thread is past the last segment's stages
  for (int u = CL ? ct * G + cr * G / (CL ? CL : 1) : a8_start(blockIdx.x, U, BLOCKS); u < u_end;) {
    const int tile = u / G, gs = u % G, gn = min(G - gs, u_end - u);
    u += gn;
    int f0 = tile * F;
    const TmaMap* const mw = f0 >= N0 + N1 ? mw2 : f0 >= N0 ? mw1 : mw0;
    const LinearOut<WT> grp = pick_group(f0, N0, N1, LinearOut<WT>{w0, b0, o0, N0}, LinearOut<WT>{w1, b1, o1, N1},
                                         LinearOut<WT>{w2, b2, o2, N2});
    const int N = grp.n;
    const float* wsc = row_scales<K>(grp.w, N, f0 + tid);
    // Stage st's weight tile and scales (which no kernel writes), and its input tile and
    // scales: the tiles by TMA (thread 0, counted on full[st]), the scales by cp.async. The
    // input box has 64 rows; those past T come as zeros.
    auto stage_w = [&](int st, int gi) {
      if (tid == 0) {
        mbar_expect(smem_addr(&full[st]), A8_STAGE);
        tma_load_2d(tiles + st * A8_STAGE + A8_ROWS * 128, mw, gi * 128, f0, smem_addr(&full[st]));
      }
      if constexpr (W8) cp4(smem_addr(&sws[st * F + tid]), wsc + gi, 4);
    };
    auto stage_x = [&](int st, int gi) {
      if (tid == 0) tma_load_2d(tiles + st * A8_STAGE, mx, gi * 128, 0, smem_addr(&full[st]));
      if constexpr (W8)
        if (tid < T) cp4(smem_addr(&sxs[st * A8_ROWS + tid]), xs + (long)gi * T + tid, 4);
    };
    auto stage = [&](int st, int gi) {
      stage_w(st, gi);
      stage_x(st, gi);
    };
    float acc[64], d[64];
#pragma unroll
    for (int i = 0; i < 64; i++) acc[i] = 0.0f;
    if (!synced) __syncthreads();  // the last segment's stages are read
    synced = false;
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
      if constexpr (W8) {  // the group's products, times the rows' and weight rows' scales
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
      } else {  // 16-bit: the group's products straight into the sums
#pragma unroll
        for (int kk = 0; kk < 4; kk++) wgmma_h16_n128(acc, da + 2 * kk, db + 2 * kk, 1);
        wgmma_commit_wait();
      }
    }
    cp_async_wait<0>();
    if constexpr (CL > 0) {  // the tile's only segment: its sums meet the cluster's others
      a8_cluster_sum<CL, NTOT>(acc, (float*)gen, T, r0, grp.b ? grp.b + f0 : nullptr, grp.o + f0);
      continue;
    }
    // The blocks that share this tile: one writes it; several each write their sums to their
    // slot of part and arrive, and add their share of the slots once all their units are done.
    const int2 blocks = a8_tile_blocks(tile, G, U, BLOCKS);
    const int first = blocks.x, n = blocks.y;
    float* const mine = part + ((long)(blockIdx.x - first) * A8_ROWS) * NTOT + tile * F;
    if (n == 1) {
      a8_store<NTOT>(acc, grp.o + f0, T, r0, grp.b ? grp.b + f0 : nullptr);
      continue;
    }
    a8_store<NTOT>(acc, mine, T, r0, nullptr);
    // The block's slot is written: one thread releases it to the tile's other blocks (as a grid
    // sync does: the barrier orders the block's writes before its fence), or, the last to
    // arrive, acquires theirs.
    __syncthreads();
    if (T > A8_SHARE_ROWS) {
      // A thread of the second warp releases the slot, so thread 0 goes on to the next
      // segment's copies while the fence waits for the block's stores.
      if (tid == 32) {
        __threadfence();
        atomicAdd(&count[tile], 1u);
      }
      if (nshared < 2) shared[nshared++] = tile;
      synced = true;
      continue;
    }
    if (tid == 0) {
      __threadfence();
      last = atomicAdd(&count[tile], 1u) == (unsigned)n - 1;
      if (last) __threadfence();
    }
    __syncthreads();
    if (!last) continue;
    a8_add_slots<SLOTS, NTOT>(part + tile * F, n, 0, 1, T, grp.b ? grp.b + f0 : nullptr, grp.o + f0);
    if (tid == 0) count[tile] = 0;
  }
  // A block shares at most its first and its last tile. It waits for a shared tile's other
  // blocks only here, its own units done, so no block waits on one that waits; every block of a
  // grid this size is resident (a8_blocks), so the waits end.
  for (int i = 0; i < nshared; i++) {
    const int tile = shared[i];
    const int2 blocks = a8_tile_blocks(tile, G, U, BLOCKS);
    const int first = blocks.x, n = blocks.y;
    if (tid == 0) a8_await(&count[tile], n);  // acquires the slots the other blocks released
    __syncthreads();
    int f0 = tile * F;
    const LinearOut<WT> grp = pick_group(f0, N0, N1, LinearOut<WT>{w0, b0, o0, N0}, LinearOut<WT>{w1, b1, o1, N1},
                                         LinearOut<WT>{w2, b2, o2, N2});
    a8_add_slots<SLOTS, NTOT>(part + tile * F, n, blockIdx.x - first, n, T, grp.b ? grp.b + f0 : nullptr,
                              grp.o + f0);
    // The tile's count goes to n again as each block ends its share; the last resets it.
    __syncthreads();
    if (tid == 0 && atomicAdd(&count[tile], 1u) == 2u * n - 1) count[tile] = 0;
  }
}
