//! The geometry of [`KernelKey::GemmSkinnyA8`], the small-batch `wgmma` kernel
//! (`kernels/gemm.cuh`'s `gemm_skinny_a8`): its tiles, stages and shared memory, how its launches
//! share their (tile, column group) units among blocks (stream-K) or thread-block clusters, and
//! the slots of split sums that takes. The kernel's template arguments and the runtime's grid
//! both come from here.

use crate::formats::WFormat;
#[cfg(doc)]
use crate::keys::KernelKey;

/// Output features of a block of [`KernelKey::GemmSkinnyA8`] (one warpgroup's m64n128
/// `wgmma`): every output count of a launch it stands in for is a multiple of it.
pub const A8_FEATURES: usize = 128;

/// The most rows of a [`KernelKey::GemmSkinnyA8`] launch (the `wgmma`'s M).
pub const A8_ROWS: usize = 64;

/// Shared-memory stages of [`KernelKey::GemmSkinnyA8`]: each holds a 128-column group of the
/// input rows and of the block's weight rows, and their scales.
pub(crate) const A8_STAGES: usize = 4;

/// The dynamic shared memory of a [`KernelKey::GemmSkinnyA8`] block (`kernels/gemm.cuh`'s
/// layout: the stages' tiles, their scales, and room to align the tiles to 1024 bytes).
pub const A8_SMEM: usize = A8_STAGES * (A8_ROWS * 128 + A8_FEATURES * 128 + (A8_ROWS + A8_FEATURES) * 4) + 1024;

/// Blocks of a [`KernelKey::GemmSkinnyA8`] launch an SM holds at once (their shared memory).
pub const A8_BLOCKS_PER_SM: usize = 2;

/// Blocks of a [`KernelKey::GemmSkinnyA8`] launch: [`A8_BLOCKS_PER_SM`] on each of an H100 /
/// H200's 132 streaming multiprocessors, so the weights stream from every SM to the end.
pub const A8_BLOCKS: usize = A8_BLOCKS_PER_SM * 132;

/// The bytes of a weight row's group of a [`KernelKey::GemmSkinnyA8`] stage (128 E4M3 codes or
/// 64 16-bit weights): the functions below take a row's bytes `kb`, `k` times the weight's size.
pub(crate) const A8_GROUP_BYTES: usize = 128;

/// The (128-feature tile, 128-byte column group) units of a [`KernelKey::GemmSkinnyA8`] launch
/// of weight rows of `kb` bytes and `n` outputs in all.
fn a8_units(kb: usize, n: usize) -> usize {
    (n / A8_FEATURES) * (kb / A8_GROUP_BYTES)
}

/// The blocks a [`KernelKey::GemmSkinnyA8`] launch shares its units among (stream-K): at most
/// [`A8_BLOCKS`], and four units a block at least (fewer blocks to a tile, whose split sums
/// they add in shares). The blocks of a shared tile wait for each other at the kernel's end,
/// so a launch must not have more blocks than fit the GPU at once: the runtime runs the kernel
/// only where [`A8_BLOCKS`] fit (its `a8_fits`).
pub fn a8_blocks(kb: usize, n: usize) -> usize {
    (a8_units(kb, n) / 4).clamp(1, A8_BLOCKS)
}

/// The most blocks of a thread-block cluster that is portable across GPUs (CUDA's limit
/// without an opt-in).
const A8_CLUSTER_MAX: usize = 8;

/// The blocks of a [`KernelKey::GemmSkinnyA8`] tile's cluster (0: stream-K over all the units,
/// no clusters): where stream-K would spread every tile over 2 or more blocks (few tiles,
/// e.g. the 7B's o and q|k|v at seven blocks a tile, its down projection at nine, capped to
/// eight), each tile instead gets that many blocks as one cluster, an even share of its
/// groups each, and their sums meet in distributed shared memory (`kernels/gemm.cuh`'s
/// `a8_cluster_sum`) rather than through global memory behind fences and waits.
pub fn a8_cluster(kb: usize, n: usize) -> usize {
    let (tiles, groups) = (n / A8_FEATURES, kb / A8_GROUP_BYTES);
    let cl = (a8_blocks(kb, n) / tiles.max(1)).min(A8_CLUSTER_MAX).min(groups);
    if cl >= 2 {
        cl
    } else {
        0
    }
}

/// The grid of a [`KernelKey::GemmSkinnyA8`] launch: a cluster of `cl` blocks per tile, or
/// (`cl` 0) [`a8_blocks`].
pub fn a8_grid(kb: usize, n: usize, cl: usize) -> usize {
    match cl {
        0 => a8_blocks(kb, n),
        cl => n / A8_FEATURES * cl,
    }
}

/// The most blocks that share one output tile of a [`KernelKey::GemmSkinnyA8`] launch (its
/// slots of split sums), by the kernel's own split: block `b` takes units
/// `b * units / blocks ..`.
pub fn a8_slots(kb: usize, n: usize) -> usize {
    let (units, blocks, groups) = (a8_units(kb, n), a8_blocks(kb, n), kb / A8_GROUP_BYTES);
    let block_of = |u: usize| (0..blocks).rev().find(|b| b * units / blocks <= u).unwrap_or(0);
    (0..n / A8_FEATURES).map(|t| block_of(t * groups + groups - 1) - block_of(t * groups) + 1).max().unwrap_or(1)
}

/// The bytes of a weight row of `k` weights of format `wf` (E4M3 or 16-bit) in a
/// [`KernelKey::GemmSkinnyA8`] launch.
pub fn a8_row_bytes(k: usize, wf: WFormat) -> usize {
    if wf == WFormat::E4m3 {
        k
    } else {
        2 * k
    }
}

#[cfg(test)]
mod tests {
    use super::{a8_blocks, a8_slots, A8_BLOCKS, A8_SMEM};

    /// The blocks of a shared tile of the wgmma kernel wait for each other (`kernels/gemm.cuh`), which ends only
    /// if every block of a launch is resident at once: two blocks' shared memory fit an H100 /
    /// H200 SM (228 KB), and no launch has more than two blocks for each of its 132 SMs.
    #[test]
    fn w8a8_launches_fit_the_gpu_at_once() {
        const { assert!(2 * A8_SMEM <= 228 * 1024 && A8_BLOCKS <= 2 * 132) };
        for (k, n) in [(896, 1152), (896, 9728), (4864, 896), (3584, 4608), (3584, 37888), (18944, 3584)] {
            assert!(a8_blocks(k, n) <= A8_BLOCKS, "k {k} n {n}");
            assert!(a8_slots(k, n) >= 1, "k {k} n {n}");
        }
    }
}
