//! Linear calls read with AVX2 and FMA (x86-64). Block weights, for the calls of fewer than four
//! rows (a decode step's): two output features at a time in the two halves of a 256-bit register,
//! each half computing exactly what the JIT's block kernel computes for its feature (the same
//! weights `ir::quant::value`, the same f32x4 accumulator order, the same horizontal sum), so
//! the results are bit for bit the JIT's and the expanded path's (batch-invariance holds).
//! Cranelift emits 128-bit vectors only; these loops do twice the work per instruction. The
//! block types of the CPU layout are read here (`pairs`), and dense weights (f32, bf16, and the
//! block rows dequantized for a call of four rows or more) in tiles of rows by pairs of features
//! (`dense`), bit for bit the JIT's dense kernel. `ENGINE_CPU_AVX2=0` turns both off.

use crate::blocks;
use ir::{DType, BLOCK};
use std::arch::x86_64::*;

/// How a block type's values are laid out (`crate::blocks`) and become weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Q4_0, Q4_1, Q4_K: `d`, `m` (f32), 16 bytes of nibbles: weight `fma(q, d, m)`.
    Nibbles = 0,
    /// Q5_0, Q5_1, Q5_K: `d`, `m` (f32), 32 bytes: weight `fma(q, d, m)`.
    Bytes = 1,
    /// Q8_0: `d` (f32), 32 `i8`: weight `(q·2²⁴)·(d·2⁻²⁴)`, `q·d` rounded once.
    Q8 = 2,
    /// Q6_K: two scales (f32), 32 `i8`: weights 0..16 times the first, 16..32 the second.
    Q6 = 3,
}

/// The kind this module reads `dtype` as, when the CPU has AVX2 and FMA (and
/// `ENGINE_CPU_AVX2` is not `0`).
pub(crate) fn kind(dtype: DType) -> Option<Kind> {
    let kind = match dtype {
        DType::Q4_0 | DType::Q4_1 | DType::Q4_K => Kind::Nibbles,
        DType::Q5_0 | DType::Q5_1 | DType::Q5_K => Kind::Bytes,
        DType::Q8_0 => Kind::Q8,
        DType::Q6_K => Kind::Q6,
        _ => return None,
    };
    enabled().then_some(kind)
}

/// The CPU has AVX2 and FMA, and `ENGINE_CPU_AVX2` is not `0`.
fn enabled() -> bool {
    let on = std::env::var("ENGINE_CPU_AVX2").map_or(true, |v| v != "0");
    on && is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
}

/// Where a call's operands are: `rows` rows of `k` floats at `x`; weight rows of `row_bytes`
/// bytes at `w` (row `j` at `w + j·row_bytes`); `out` rows of `n` floats.
pub(crate) struct Call {
    pub x: *const f32,
    pub k: usize,
    pub rows: usize,
    pub w: *const u8,
    pub row_bytes: usize,
    /// Bytes of one block (`blocks::layout_bytes`).
    pub block_bytes: usize,
    pub out: *mut f32,
    pub n: usize,
}

/// `blocks::lane_mask` for both 128-bit halves.
fn masks(signed: bool) -> [[u8; 32]; 4] {
    [0, 1, 2, 3].map(|g| {
        let m = blocks::lane_mask(signed, g);
        std::array::from_fn(|i| m[i % 16])
    })
}

/// Features `j0, j0 + 1, ...` in pairs, for every row of the call; returns the first feature
/// left (the last one when `j1 - j0` is odd).
///
/// # Safety
/// The CPU has AVX2 and FMA ([`kind`]); `c` describes valid memory: `c.rows` rows of `c.k`
/// floats at `c.x`, weight rows `j0..j1` of `kind` blocks (`c.k` a multiple of 32), and output
/// rows of `c.n` floats whose columns `j0..j1` no other thread writes.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn pairs(kind: Kind, c: &Call, j0: usize, j1: usize) -> usize {
    match kind {
        Kind::Nibbles => pairs_of::<0>(c, j0, j1),
        Kind::Bytes => pairs_of::<1>(c, j0, j1),
        Kind::Q8 => pairs_of::<2>(c, j0, j1),
        Kind::Q6 => pairs_of::<3>(c, j0, j1),
    }
}

/// [`pairs`] for the kind numbered `K`.
#[target_feature(enable = "avx2,fma")]
unsafe fn pairs_of<const K: u8>(c: &Call, j0: usize, j1: usize) -> usize {
    let m = masks(K >= Kind::Q8 as u8);
    let mask = m.map(|b| _mm256_loadu_si256(b.as_ptr() as *const __m256i));
    let mut j = j0;
    // Four pairs at a time: a feature's sum is one chain of dependent FMAs (its order is the
    // JIT's), so eight features keep the FMA units busy where two would wait on latency.
    while j + 2 <= j1 {
        let p = if j + 2 * PAIRS <= j1 { PAIRS } else { 1 };
        let w: [*const u8; 2 * PAIRS] = std::array::from_fn(|i| c.w.add((j + i.min(2 * p - 1)) * c.row_bytes));
        for t in 0..c.rows {
            let x = c.x.add(t * c.k);
            let acc =
                if p == PAIRS { rows::<K, PAIRS>(x, c, &w, &mask) } else { [rows::<K, 1>(x, c, &w, &mask)[0]; PAIRS] };
            for (i, a) in acc.iter().take(p).enumerate() {
                let (lo, hi) = (_mm256_castps256_ps128(*a), _mm256_extractf128_ps(*a, 1));
                *c.out.add(t * c.n + j + 2 * i) = hsum(lo);
                *c.out.add(t * c.n + j + 2 * i + 1) = hsum(hi);
            }
        }
        j += 2 * p;
    }
    j
}

/// Pairs of features a pass of [`pairs`] computes together.
const PAIRS: usize = 4;

/// The four floats at `p` (any alignment) in both halves.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn bcast4(p: *const f32) -> __m256 {
    let v = _mm_loadu_ps(p);
    _mm256_set_m128(v, v)
}

/// `((l0 + l1) + l2) + l3`: the JIT's horizontal sum.
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: __m128) -> f32 {
    let mut l = [0.0f32; 4];
    _mm_storeu_ps(l.as_mut_ptr(), v);
    ((l[0] + l[1]) + l[2]) + l[3]
}

/// The f32 at `p` of both rows, splat: `pf`'s in the low half, `pg`'s in the high one, times
/// `s`.
#[target_feature(enable = "avx2,fma")]
unsafe fn halves(pf: *const u8, pg: *const u8, s: f32) -> __m256 {
    let rd = |p: *const u8| (p as *const f32).read_unaligned() * s;
    _mm256_set_m128(_mm_set1_ps(rd(pg)), _mm_set1_ps(rd(pf)))
}

/// The 16 bytes at `pf` (low half) and `pg` (high half).
#[target_feature(enable = "avx2,fma")]
unsafe fn bytes(pf: *const u8, pg: *const u8) -> __m256i {
    _mm256_set_m128i(_mm_loadu_si128(pg as *const __m128i), _mm_loadu_si128(pf as *const __m128i))
}

/// One x row against `P` pairs of weight rows (`w[2i]` in the low half of result `i`,
/// `w[2i + 1]` in its high half) of the kind numbered `K`: the JIT's `Dequant::open` and `group`
/// per block, `fma(x, w, acc)` per four weights.
#[target_feature(enable = "avx2,fma")]
unsafe fn rows<const K: u8, const P: usize>(
    x: *const f32,
    c: &Call,
    w: &[*const u8; 2 * PAIRS],
    mask: &[__m256i; 4],
) -> [__m256; P] {
    let mut acc = [_mm256_setzero_ps(); P];
    for blk in 0..c.k / BLOCK {
        let off = blk * c.block_bytes;
        for (i, a) in acc.iter_mut().enumerate() {
            *a = block::<K>(x.add(blk * BLOCK), w[2 * i].add(off), w[2 * i + 1].add(off), mask, *a);
        }
    }
    acc
}

/// The block at `pf` (low half) and the one at `pg` (high half) against their 32 x values at
/// `xb`, added to `acc`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn block<const K: u8>(
    xb: *const f32,
    pf: *const u8,
    pg: *const u8,
    mask: &[__m256i; 4],
    mut acc: __m256,
) -> __m256 {
    // The signed kinds' lanes hold q·2²⁴: their scales times 2⁻²⁴.
    let s = if K >= Kind::Q8 as u8 { 1.0f32 / 16_777_216.0 } else { 1.0 };
    let d = halves(pf, pg, s);
    let m = if K == Kind::Q8 as u8 { d } else { halves(pf.add(4), pg.add(4), s) };
    let (lo, hi) = match K {
        0 => {
            let (qs, low4) = (bytes(pf.add(8), pg.add(8)), _mm256_set1_epi8(0x0F));
            (_mm256_and_si256(qs, low4), _mm256_and_si256(_mm256_srli_epi16(qs, 4), low4))
        }
        2 => (bytes(pf.add(4), pg.add(4)), bytes(pf.add(20), pg.add(20))),
        _ => (bytes(pf.add(8), pg.add(8)), bytes(pf.add(24), pg.add(24))),
    };
    for g in 0..BLOCK / 4 {
        let f = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(if g < 4 { lo } else { hi }, mask[g % 4]));
        let w = match K {
            0 | 1 => _mm256_fmadd_ps(f, d, m),
            2 => _mm256_mul_ps(f, d),
            _ => _mm256_mul_ps(f, if g < 4 { d } else { m }),
        };
        let xv = bcast4(xb.add(4 * g));
        acc = _mm256_fmadd_ps(xv, w, acc);
    }
    acc
}

/// A call over dense weights (f32, or bf16 widened exactly): `rows` rows of `k` floats at `x`,
/// weight row `j` at `w + j·k·size`, `out` rows of `n` floats.
pub(crate) struct DenseCall {
    pub x: *const f32,
    pub k: usize,
    pub rows: usize,
    pub w: *const u8,
    pub bf16: bool,
    pub out: *mut f32,
    pub n: usize,
}

/// Whether the CPU reads dense weights of `dtype` here (f32 and bf16, with AVX2 and FMA, and
/// `ENGINE_CPU_AVX2` not `0`).
pub(crate) fn dense_ok(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::BF16) && enabled()
}

/// Rows of a dense tile.
const TILE_ROWS: usize = 4;
/// Pairs of features of a dense tile.
const TILE_PAIRS: usize = 2;

/// Features `j0, j0 + 1, ...` in pairs for every row of the call, in tiles of [`TILE_ROWS`]
/// rows by [`TILE_PAIRS`] pairs: the JIT's dense kernel's sums bit for bit (each (row, feature)
/// one f32x4 accumulator stepping 4 along k, the same horizontal sum, then the k tail one FMA
/// at a time), each 256-bit register holding two features' accumulators. Returns the first
/// feature left (the last one when `j1 - j0` is odd).
///
/// # Safety
/// The CPU has AVX2 and FMA ([`dense_ok`]); `c` describes valid memory: `c.rows` rows of `c.k`
/// floats at `c.x`, weight rows `j0..j1`, and output rows of `c.n` floats whose columns
/// `j0..j1` no other thread writes.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn dense(c: &DenseCall, j0: usize, j1: usize) -> usize {
    if c.bf16 {
        dense_of::<true>(c, j0, j1)
    } else {
        dense_of::<false>(c, j0, j1)
    }
}

/// [`dense`] for f32 (`BF` false) or bf16 weights.
#[target_feature(enable = "avx2,fma")]
unsafe fn dense_of<const BF: bool>(c: &DenseCall, j0: usize, j1: usize) -> usize {
    let mut j = j0;
    while j + 2 <= j1 {
        let wide = j + 2 * TILE_PAIRS <= j1;
        let mut r = 0;
        while r < c.rows {
            match (c.rows - r >= TILE_ROWS, wide) {
                (true, true) => tile::<BF, TILE_ROWS, TILE_PAIRS>(c, r, j),
                (true, false) => tile::<BF, TILE_ROWS, 1>(c, r, j),
                (false, true) => tile::<BF, 1, TILE_PAIRS>(c, r, j),
                (false, false) => tile::<BF, 1, 1>(c, r, j),
            }
            r += if c.rows - r >= TILE_ROWS { TILE_ROWS } else { 1 };
        }
        j += if wide { 2 * TILE_PAIRS } else { 2 };
    }
    j
}

/// Four weights of row `j` from `kk` as f32 (bf16 widened exactly).
#[target_feature(enable = "avx2,fma")]
unsafe fn w4<const BF: bool>(c: &DenseCall, j: usize, kk: usize) -> __m128 {
    if BF {
        let p = c.w.add((j * c.k + kk) * 2) as *const __m128i;
        _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_loadl_epi64(p)), 16))
    } else {
        _mm_loadu_ps((c.w as *const f32).add(j * c.k + kk))
    }
}

/// bf16 weights `kk + 4h .. kk + 4h + 4` of rows `j` (low half) and `j + 1` (high half) as f32.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn bf16_pair(c: &DenseCall, j: usize, kk: usize, h: usize) -> __m256 {
    let row = |j: usize| _mm_loadu_si128(c.w.add((j * c.k + kk) * 2) as *const __m128i);
    let (a, b) = (row(j), row(j + 1));
    let both = if h == 0 { _mm_unpacklo_epi64(a, b) } else { _mm_unpackhi_epi64(a, b) };
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(both), 16))
}

/// One weight of row `j` at `i` as f32.
unsafe fn w1<const BF: bool>(c: &DenseCall, j: usize, i: usize) -> f32 {
    if BF {
        f32::from_bits(((c.w.add((j * c.k + i) * 2) as *const u16).read_unaligned() as u32) << 16)
    } else {
        (c.w as *const f32).add(j * c.k + i).read_unaligned()
    }
}

/// Rows `r0..r0 + R` against features `j..j + 2P`.
#[target_feature(enable = "avx2,fma")]
unsafe fn tile<const BF: bool, const R: usize, const P: usize>(c: &DenseCall, r0: usize, j: usize) {
    let main = c.k / 4 * 4;
    let mut acc = [[_mm256_setzero_ps(); P]; R];
    let mut step = |kk: usize, w: &[__m256; P]| {
        for (r, a) in acc.iter_mut().enumerate() {
            let xv = bcast4(c.x.add((r0 + r) * c.k + kk));
            for p in 0..P {
                a[p] = _mm256_fmadd_ps(xv, w[p], a[p]);
            }
        }
    };
    // bf16 rows widen 8 weights at a time (two steps of 4, in order).
    let main8 = if BF { c.k / 8 * 8 } else { 0 };
    for kk in (0..main8).step_by(8) {
        let w: [[__m256; P]; 2] = std::array::from_fn(|h| std::array::from_fn(|p| bf16_pair(c, j + 2 * p, kk, h)));
        step(kk, &w[0]);
        step(kk + 4, &w[1]);
    }
    for kk in (main8..main).step_by(4) {
        let w: [__m256; P] =
            std::array::from_fn(|p| _mm256_set_m128(w4::<BF>(c, j + 2 * p + 1, kk), w4::<BF>(c, j + 2 * p, kk)));
        step(kk, &w);
    }
    for (r, a) in acc.iter().enumerate() {
        let x = c.x.add((r0 + r) * c.k);
        for (p, v) in a.iter().enumerate() {
            for (h, half) in [_mm256_castps256_ps128(*v), _mm256_extractf128_ps(*v, 1)].into_iter().enumerate() {
                let f = j + 2 * p + h;
                let mut sum = hsum(half);
                for i in main..c.k {
                    sum = (*x.add(i)).mul_add(w1::<BF>(c, f, i), sum);
                }
                *c.out.add((r0 + r) * c.n + f) = sum;
            }
        }
    }
}
