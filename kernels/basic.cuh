// Straightforward kernels for ops the fused kernels (fast.cuh) do not cover, specialised by
// template arguments to the model's shapes. Activations are f32 (linear inputs: any type X);
// weights are f32 or h16 (W).

// out[t, :] = table[ids[t], :]. grid: T, block: 256.
template <int H, typename W>
__device__ void embedding(const int* ids, const W* table, float* out) {
  const int t = blockIdx.x;
  const W* row = table + (long)ids[t] * H;
  for (int i = threadIdx.x; i < H; i += blockDim.x) out[(long)t * H + i] = to_f32(row[i]);
}

// out[t, n] = x[t] . w[n] (+ bias[n]) for T rows. One warp per output feature, rows in
// tiles of 8 so each weight chunk is read once per tile. The fallback for shapes the fast
// kernels do not take (f32 weights, K not a multiple of 32). grid: ceil(N / 8), block: 256.
template <int K, int N, typename X, typename W, bool BIAS>
__device__ void linear(const X* x, const W* w, const W* bias, float* out, int T) {
  const int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (n >= N) return;
  const W* wr = w + (long)n * K;
  for (int t0 = 0; t0 < T; t0 += 8) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const int rows = min(8, T - t0);
    for (int k = lane; k < K; k += 32) {
      const float wk = to_f32(wr[k]);
#pragma unroll
      for (int r = 0; r < 8; r++)
        if (r < rows) acc[r] += to_f32(x[(long)(t0 + r) * K + k]) * wk;
    }
#pragma unroll
    for (int r = 0; r < 8; r++) {
      const float s = warp_sum(acc[r]);
      if (lane == 0 && r < rows) out[(long)(t0 + r) * N + n] = s + (BIAS ? to_f32(bias[n]) : 0.0f);
    }
  }
}

// Rotate-half RoPE over the leading ROT features of heads of D within rows of COLS (the rest
// copied), at positions pos[t]; angles in f32 as HF computes them, scaled by the attention
// factor. grid: T, block: 128.
template <int COLS, int D, int ROT>
__device__ void rope(const float* x, const int* pos, const float* inv_freq, float scale, float* out) {
  const int t = blockIdx.x;
  const float p = (float)pos[t];
  for (int i = threadIdx.x; i < COLS / 2; i += blockDim.x) {
    const int head = i / (D / 2), j = i % (D / 2);
    if (j >= ROT / 2) {  // a pair of features past the rotated ones
      const long a = (long)t * COLS + head * D + ROT + 2 * (j - ROT / 2);
      out[a] = x[a];
      out[a + 1] = x[a + 1];
      continue;
    }
    const long a = (long)t * COLS + head * D + j, b = a + ROT / 2;
    float s, c;
    sincosf(p * inv_freq[j], &s, &c);
    s *= scale;
    c *= scale;
    const float xa = x[a], xb = x[b];
    out[a] = xa * c - xb * s;
    out[b] = xb * c + xa * s;
  }
}

// Elementwise ops over n floats. grid: ceil(n / 256), block: 256.
__device__ __forceinline__ long elem() { return (long)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ void add(const float* a, const float* b, float* out, long n) {
  const long i = elem();
  if (i < n) out[i] = a[i] + b[i];
}
__device__ void mul(const float* a, const float* b, float* out, long n) {
  const long i = elem();
  if (i < n) out[i] = a[i] * b[i];
}
__device__ void silu(const float* a, float* out, long n) {
  const long i = elem();
  if (i < n) out[i] = a[i] / (1.0f + __expf(-a[i]));
}

