//! W8A8 on FP8 tensor cores through cuBLASLt for the tensor-core linears of E4M3 weights
//! (`KernelKey::Gemm` / `GemmSkinny` with `w8`): the launch's 16-bit input is quantized to E4M3
//! first (`KernelKey::QuantE4M3`, per token, or per token and 128 columns), then cuBLASLt
//! multiplies codes by codes with both operands' scales applied in its epilogue (outer-vector
//! scales for per-channel weights, 1 x 128 and 128 x 128 block scales for block-wise ones).
//! Our own W8A8 small-batch kernel (`launch_a8`: `KernelKey::GemmSkinnyA8`, E4M3 x E4M3 on
//! `mma.sync`) reads the same quantized input. Both are timed against our W8A16 kernel (the
//! codes converted on the CUDA cores) at load per shape and row bucket, after a check of their
//! results (`w8a8_refusals`), and run where faster (`blas`).

use super::blas::Gemm;
use super::profile::Profile;
use super::{driver, CudaBackend};
use crate::RuntimeError;
use codegen_cuda::{Arg, KernelKey, Launch, Step, WFormat, A8_FEATURES, W8_GROUP};
use cudarc::driver::sys::CUtensorMap as TmaMap;
use cudarc::driver::{CudaSlice, LaunchConfig};

/// How an E4M3 weight's scales (`fp8_device_layout`: one per row and 128 columns) map onto
/// cuBLASLt's FP8 scale modes, and so how the input is quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Fp8Scales {
    /// One scale per output channel (`--quant fp8`, compressed-tensors per channel): outer-vector
    /// scales on both operands, the input quantized per token.
    Rows,
    /// 128 x 128 blocks (transformers' fine-grained FP8): the weight's block scales, the input
    /// quantized per token and 128 columns.
    Blocks,
}

impl Fp8Scales {
    /// Columns per input scale ([`KernelKey::QuantE4M3`]'s `group`) for `k` input features.
    pub(crate) fn group(self, k: usize) -> usize {
        match self {
            Fp8Scales::Rows => k,
            Fp8Scales::Blocks => W8_GROUP,
        }
    }

    /// The mode of a weight's scales `[n, k / 128]` and the compact scales cuBLASLt reads:
    /// `[n]`, or `[n / 128, k / 128]` row by row, each row padded with zeros to a multiple of
    /// four (the layout torch's `_scaled_mm` hands cuBLASLt for 128 x 128 blocks); `None` for
    /// any other pattern.
    pub(crate) fn of(scales: &[f32], n: usize, k: usize) -> Option<(Fp8Scales, Vec<f32>)> {
        let g = k / W8_GROUP;
        if g == 0 || scales.len() != n * g {
            return None;
        }
        let rows: Vec<&[f32]> = scales.chunks_exact(g).collect();
        if rows.iter().all(|r| r.iter().all(|&s| s == r[0])) {
            return Some((Fp8Scales::Rows, rows.iter().map(|r| r[0]).collect()));
        }
        let blocks = n.is_multiple_of(W8_GROUP) && rows.chunks(W8_GROUP).all(|b| b.iter().all(|r| *r == b[0]));
        let pad = g.next_multiple_of(4) - g;
        let padded = |r: &[f32]| r.iter().copied().chain(std::iter::repeat_n(0.0, pad)).collect::<Vec<f32>>();
        blocks.then(|| (Fp8Scales::Blocks, rows.iter().step_by(W8_GROUP).flat_map(|r| padded(r)).collect()))
    }

    /// Whether cuBLASLt takes a launch of `t` rows in this mode: 1 x 128 block scales want a
    /// multiple of four (it answered NOT_SUPPORTED at 257 rows); other row counts run ours.
    pub(crate) fn takes(self, t: usize) -> bool {
        self == Fp8Scales::Rows || t.is_multiple_of(4)
    }

    /// cuBLASLt's `cublasLtMatmulMatrixScale_t` for the weight and for the input (OUTER_VEC_32F
    /// 3, VEC128_32F 4, BLK128x128_32F 5: cuBLAS 12.9 and later, Hopper).
    pub(crate) fn modes(self) -> (i32, i32) {
        match self {
            Fp8Scales::Rows => (3, 3),
            Fp8Scales::Blocks => (5, 4),
        }
    }
}

/// The device buffers of W8A8 launches: the quantized input (codes `[tokens, k]` and scales,
/// [`CudaBackend::quantize_input`]), and `gemm_skinny_a8`'s split sums (`[slots, 64, n]` for
/// the largest of the program's launches, `codegen_cuda::a8_slots`) with one arrival count per
/// output tile (zero between launches: the tile's last block to finish resets it).
pub(crate) struct W8Input {
    q: CudaSlice<u8>,
    s: CudaSlice<f32>,
    sums: CudaSlice<f32>,
    count: CudaSlice<u32>,
}

/// What cuBLASLt reads of a W8A8 launch's quantized input besides its codes: the scales' device
/// pointer and their mode.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fp8In {
    pub scales: u64,
    pub mode: Fp8Scales,
}

impl CudaBackend {
    /// Compact cuBLASLt scales of every E4M3 weight a tensor-core launch reads
    /// ([`Fp8Scales::of`]); a weight whose scales fit neither mode is left out, and its launches
    /// stay with ours (`launch_blas` refuses them, so the timing at load keeps ours).
    pub(super) fn convert_w8_scales(&mut self) -> Result<(), RuntimeError> {
        for (w, k, n) in w8_linear_weights(&self.program) {
            let Some(dev) = self.weights.view(w) else { continue };
            let at = n * k;
            let view = dev.slice(at..at + n * (k / W8_GROUP) * 4);
            let bytes = self.stream.clone_dtoh(&view).map_err(driver("reading E4M3 scales"))?;
            let f: Vec<f32> = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            if let Some((mode, compact)) = Fp8Scales::of(&f, n, k) {
                let d = self.stream.clone_htod(&compact).map_err(driver("uploading E4M3 scales"))?;
                self.w8_scales.insert(w, (mode, d));
            }
        }
        Ok(())
    }

    /// Why GEMM `g` (cuBLASLt's or ours) of launch `l` at `t` rows is not to be used, if it
    /// is not: each linear's output against ours (W8A16, or 16-bit) on a random input, the rms
    /// of the difference within a tenth of the rms of ours for W8A8 (activation quantization
    /// costs a few percent; a scale layout read otherwise than written costs all of it), a
    /// hundredth for cuBLASLt on the 16-bit copy (`w16`) and for 16-bit weights (no activation
    /// quantization). Checked once per shape at load, before the timing, so a wrong result
    /// never runs.
    pub(super) fn w8a8_disagrees(&mut self, l: &Launch, t: usize, g: Gemm) -> Result<Option<String>, RuntimeError> {
        let (Some(&Arg::Buf(xb)), KernelKey::Gemm { k, n, .. } | KernelKey::GemmSkinny { k, n, .. }) =
            (l.args.first(), l.key)
        else {
            return Ok(Some("not a linear launch".into()));
        };
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let x: Vec<f32> = (0..t * k)
            .map(|_| {
                seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                (seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
            })
            .collect();
        let bytes = self.program.half.from_f32(&x);
        let mut view = self.bufs[xb].slice_mut(..bytes.len().div_ceil(4));
        let words: Vec<f32> = bytes
            .chunks(4)
            .map(|b| f32::from_le_bytes(std::array::from_fn(|i| b.get(i).copied().unwrap_or(0))))
            .collect();
        self.stream.memcpy_htod(&words, &mut view).map_err(driver("a W8A8 check's input"))?;
        // The launch's outputs: one matrix of t rows of every linear's columns (packed).
        let Some(&Arg::Buf(out)) = l.args.get(3) else {
            return Ok(Some("a linear launch without its output".into()));
        };
        let ntot: usize = n.iter().sum();
        let read =
            |be: &Self| be.stream.clone_dtoh(&be.bufs[out].slice(..t * ntot)).map_err(driver("a W8A8 check's output"));
        self.launch(l, t, t, &[0; 6])?;
        let ours = read(self)?;
        if let Err(e) = self.run_gemm(l, t, g) {
            return Ok(Some(e.to_string()));
        }
        let theirs = read(self)?;
        // Each linear apart: its columns of every row.
        let mut at = 0;
        for &cols in n.iter().filter(|&&c| c > 0) {
            let of =
                |v: &[f32]| -> Vec<f32> { v.chunks(ntot).flat_map(|row| row[at..at + cols].iter().copied()).collect() };
            let (a, b) = (of(&ours), of(&theirs));
            let rms =
                |v: &mut dyn Iterator<Item = f32>| (v.map(|x| (x as f64).powi(2)).sum::<f64>() / a.len() as f64).sqrt();
            let (d, r) = (rms(&mut a.iter().zip(&b).map(|(x, y)| x - y)), rms(&mut a.iter().copied()));
            // NaN counts as off. The 16-bit copy's only error is its weights' rounding (a few
            // thousandths), 16-bit weights' none but the order of the sums: a hundredth is
            // already a wrong bias or layout.
            let exact = g == Gemm::Blas16 || !l.key.w8_tensor_core();
            let limit = if exact { 0.01 } else { 0.1 };
            if d.is_nan() || d > limit * r {
                return Ok(Some(format!("its result is off by {:.3} of ours (rms)", d / r)));
            }
            at += cols;
        }
        Ok(None)
    }

    /// The candidates refused for a shape of E4M3 weights, or of 16-bit ones that our `wgmma`
    /// kernel may run: each kernel variant of its
    /// `launches` (the small-batch ones per row tiles, the tiled one) is checked at the first
    /// bucket it runs ([`CudaBackend::w8a8_disagrees`]); a refusal is noted in the log `line`.
    pub(super) fn w8a8_refusals(
        &mut self,
        launches: &[(usize, Launch)],
        line: &mut String,
    ) -> Result<Vec<Gemm>, RuntimeError> {
        let (mut refused, mut seen) = (launches.first().map_or(vec![], |(_, l)| self.w16_refused(l)), vec![]);
        for (t, l) in launches {
            if seen.contains(&l.key) {
                continue;
            }
            seen.push(l.key);
            let todo: Vec<Gemm> = super::blas::candidates(l, &refused).collect();
            for g in todo {
                if let Some(why) = self.w8a8_disagrees(l, *t, g)? {
                    let who = match g {
                        Gemm::A8 => "our wgmma kernel",
                        Gemm::A8c => "our wgmma kernel's clusters",
                        Gemm::Tiled => "tiled GEMM",
                        Gemm::Blas16 => "cuBLASLt on the 16-bit copy",
                        _ => "cuBLASLt",
                    };
                    line.push_str(&format!(" [{who} refused at t={t}: {why}]"));
                    refused.push(g);
                }
            }
        }
        Ok(refused)
    }

    /// The widest input of the program's E4M3 tensor-core linears (0: none).
    fn w8_k_max(&self) -> usize {
        let k = |key: &KernelKey| match *key {
            KernelKey::Gemm { k, wf: WFormat::E4m3, .. } | KernelKey::GemmSkinny { k, wf: WFormat::E4m3, .. } => k,
            _ => 0,
        };
        self.program.kernels.iter().map(k).max().unwrap_or(0)
    }

    /// Room for `tokens` quantized input rows (codes and scales), and for the split sums of our
    /// `wgmma` kernel ([`W8Input`]), where the program has E4M3 tensor-core linears or that kernel.
    pub(super) fn ensure_w8_input(&mut self, tokens: usize) -> Result<(), RuntimeError> {
        let k = self.w8_k_max();
        let (mut sums, mut tiles, mut any) = (1, 1, false);
        for key in &self.program.kernels {
            if let (KernelKey::GemmSkinnyA8 { n, cl: 0, .. }, Some((_, slots))) = (key, key.a8_split()) {
                let n: usize = n.iter().sum();
                if slots > 1 {
                    sums = sums.max(slots * codegen_cuda::A8_ROWS * n);
                }
                tiles = tiles.max(n / codegen_cuda::A8_FEATURES);
                any = true;
            }
        }
        if k == 0 && !any {
            return Ok(());
        }
        self.w8_input = Some(W8Input {
            q: self.stream.alloc_zeros::<u8>((tokens * k).max(1)).map_err(driver("alloc"))?,
            s: self.stream.alloc_zeros::<f32>(tokens * (k / W8_GROUP).max(1)).map_err(driver("alloc"))?,
            sums: self.stream.alloc_zeros::<f32>(sums).map_err(driver("alloc"))?,
            count: self.stream.alloc_zeros::<u32>(tiles).map_err(driver("alloc"))?,
        });
        Ok(())
    }

    /// The W8A8 buffers ([`CudaBackend::ensure_w8_input`]).
    fn w8_buffers(&self) -> Result<&W8Input, RuntimeError> {
        self.w8_input.as_ref().ok_or_else(|| RuntimeError::Unsupported("no W8A8 / wgmma buffers".into()))
    }

    /// Quantizes the 16-bit input `x` (`[t, k]`) of a W8A8 launch into the codes and scales
    /// buffers with one scale per row and `group` columns; returns the codes' and the scales'
    /// pointers.
    pub(super) fn quantize_input(&self, x: u64, k: usize, t: usize, group: usize) -> Result<(u64, u64), RuntimeError> {
        let W8Input { q, s, .. } = self.w8_buffers()?;
        let blocks = if group == W8_GROUP { k.div_ceil(4 * W8_GROUP) } else { 1 };
        let (qp, sp) = (self.ptr(q), self.ptr(s));
        let (k32, g32) = (k as i32, group as i32);
        let mut params: Vec<*mut std::ffi::c_void> = vec![
            &x as *const u64 as *mut _,
            &qp as *const u64 as *mut _,
            &sp as *const u64 as *mut _,
            &k32 as *const i32 as *mut _,
            &g32 as *const i32 as *mut _,
        ];
        let cfg = LaunchConfig { grid_dim: (t as u32, blocks as u32, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        self.raw_launch(&KernelKey::QuantE4M3, cfg, &mut params)?;
        Ok((qp, sp))
    }

    /// Launches kernel `key` of the program as it is, as a programmatic dependent launch where
    /// the forward step's are (`KernelKey::pdl`); not where `ENGINE_CUDA_SKIP` names it (e.g.
    /// `quant_e4m3_rows`: the GEMM then reads stale codes), as for the plan's launches.
    fn raw_launch(
        &self,
        key: &KernelKey,
        cfg: LaunchConfig,
        params: &mut [*mut std::ffi::c_void],
    ) -> Result<(), RuntimeError> {
        let Some(func) = self.funcs.get(key) else {
            return Err(RuntimeError::Unsupported(format!("the program has no {} kernel", key.name())));
        };
        if !self.skip.is_empty() && super::profile::skipped(&self.skip, &key.name()) {
            return Ok(());
        }
        let pdl = self.pdl && !Profile::per_launch(&self.profile) && key.pdl();
        unsafe { super::device::launch(&self.stream, func, cfg, params, pdl) }.map_err(driver("a W8A8 launch"))
    }

    /// A small-batch launch (`GemmSkinny`) of `t` rows by our `wgmma` kernel
    /// (`KernelKey::GemmSkinnyA8`, `g`'s instance: [`Gemm::a8_key`]), writing the launch's
    /// outputs: of E4M3 weights as W8A8, the input quantized per token and 128 columns first;
    /// of 16-bit weights over the input as it is.
    pub(super) fn launch_a8(&self, l: &Launch, t: usize, g: Gemm) -> Result<(), RuntimeError> {
        let (Some(key @ KernelKey::GemmSkinnyA8 { wf, .. }), KernelKey::GemmSkinny { k, n, .. }) =
            (g.a8_key(&l.key), l.key)
        else {
            return Err(RuntimeError::Unsupported(format!("{} has no wgmma kernel", l.key.name())));
        };
        if !self.wgmma {
            return Err(RuntimeError::Unsupported("our wgmma kernel runs on Hopper (sm_90) only".into()));
        }
        if t > codegen_cuda::A8_ROWS {
            return Err(RuntimeError::Unsupported(format!("{t} rows in a {}-row wgmma kernel", codegen_cuda::A8_ROWS)));
        }
        let (x, kb) = (self.arg_ptr(&l.args[0]), codegen_cuda::a8_row_bytes(k, wf));
        let (x, s) = match wf {
            WFormat::E4m3 => self.quantize_input(x, k, t, W8_GROUP)?,
            _ => (x, 0),
        };
        let W8Input { sums, count, .. } = self.w8_buffers()?;
        let ptrs: Vec<u64> = [s]
            .into_iter()
            .chain((1..10).map(|i| l.args.get(i).map_or(0, |a| self.arg_ptr(a))))
            .chain([self.ptr(sums), self.ptr(count)])
            .collect();
        // The input's 64-row boxes (rows past t read as zeros).
        let mx = tma_map(x, kb, t, codegen_cuda::A8_ROWS as u32)?;
        let mw = self.a8_weight_maps(l, kb, n)?;
        let t32 = t as i32;
        let mut params: Vec<*mut std::ffi::c_void> = vec![&mx as *const TmaMap as *mut _];
        params.extend(ptrs.iter().map(|p| p as *const u64 as *mut std::ffi::c_void));
        params.push(&t32 as *const i32 as *mut _);
        params.extend(mw.iter().map(|m| m as *const TmaMap as *mut std::ffi::c_void));
        let grid = (key.a8_split().map_or(1, |s| s.0) as u32, 1, 1);
        let cfg = LaunchConfig { grid_dim: grid, block_dim: (128, 1, 1), shared_mem_bytes: key.dyn_smem() as u32 };
        self.raw_launch(&key, cfg, &mut params)
    }

    /// The TMA maps of `wgmma` launch `l`'s weights (rows of `kb` bytes, `n` outputs each):
    /// 128-row boxes, 128 bytes wide; a zeroed map where a group is empty.
    fn a8_weight_maps(&self, l: &Launch, kb: usize, n: [usize; 3]) -> Result<Vec<TmaMap>, RuntimeError> {
        (0..3)
            .map(|g| match l.args.get(1 + 3 * g) {
                _ if n[g] == 0 => Ok(unsafe { std::mem::zeroed() }),
                w => tma_map(w.map_or(0, |a| self.arg_ptr(a)), kb, n[g], A8_FEATURES as u32),
            })
            .collect()
    }
}

/// A TMA descriptor of the `rows` x `row_bytes` byte matrix at device address `ptr`, copied in
/// boxes of `box_rows` rows x 128 bytes into shared memory in the 128-byte swizzle `wgmma`
/// reads; rows past the matrix read as zeros.
fn tma_map(ptr: u64, row_bytes: usize, rows: usize, box_rows: u32) -> Result<TmaMap, RuntimeError> {
    use cudarc::driver::sys;
    let mut map: TmaMap = unsafe { std::mem::zeroed() };
    let (dims, strides) = ([row_bytes as u64, rows as u64], [row_bytes as u64]);
    let (boxes, steps) = ([W8_GROUP as u32, box_rows], [1u32, 1]);
    unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
            2,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            steps.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    }
    .result()
    .map_err(driver("a TMA map of W8A8 tiles"))?;
    Ok(map)
}

/// One launch's E4M3 linears: their weights (index, output rows) in the launch's order, and
/// their input features.
pub(super) type Linears = (Vec<(usize, usize)>, usize);

/// Each launch's E4M3 tensor-core linears, once per set of weights (its small-batch, tiled and
/// prefill launches share them), by its first weight.
pub(super) fn w8_launches(program: &codegen_cuda::Program) -> Vec<Linears> {
    let mut out: Vec<Linears> = vec![];
    for step in &program.steps {
        let Step::Kernels { variants, .. } = step else { continue };
        for l in variants.iter().flat_map(|(_, ls)| ls).filter(|l| l.key.w8_tensor_core()) {
            let (KernelKey::Gemm { k, n, .. } | KernelKey::GemmSkinny { k, n, .. }) = l.key else { continue };
            let ws: Vec<(usize, usize)> = n
                .iter()
                .enumerate()
                .filter(|(_, &n)| n > 0)
                .filter_map(|(g, &n)| match l.args.get(1 + 3 * g) {
                    Some(&Arg::Weight(w)) => Some((w, n)),
                    _ => None,
                })
                .collect();
            let whole = !ws.is_empty() && ws.len() == n.iter().filter(|&&n| n > 0).count();
            if whole && !out.iter().any(|o| o.0[0] == ws[0]) {
                out.push((ws, k));
            }
        }
    }
    out
}

/// Each E4M3 weight a tensor-core linear launch of `program` reads (`KernelKey::w8_tensor_core`),
/// once: (weight, its inputs k, its outputs n).
fn w8_linear_weights(program: &codegen_cuda::Program) -> Vec<(usize, usize, usize)> {
    w8_launches(program).into_iter().flat_map(|(ws, k)| ws.into_iter().map(move |(w, n)| (w, k, n))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_channel_and_block_scales_are_told_apart_and_compacted() {
        let (n, k) = (256, 384);
        let rows: Vec<f32> = (0..n).flat_map(|r| std::iter::repeat_n(r as f32 + 1.0, 3)).collect();
        assert_eq!(Fp8Scales::of(&rows, n, k), Some((Fp8Scales::Rows, (1..=n).map(|r| r as f32).collect())));
        let blocks: Vec<f32> = (0..n).flat_map(|r| (0..3).map(move |c| (r / 128 * 3 + c) as f32)).collect();
        let padded = vec![0.0, 1.0, 2.0, 0.0, 3.0, 4.0, 5.0, 0.0];
        assert_eq!(Fp8Scales::of(&blocks, n, k), Some((Fp8Scales::Blocks, padded)));
        let mut mixed = blocks.clone();
        mixed[3 * 5 + 1] = 99.0;
        assert_eq!(Fp8Scales::of(&mixed, n, k), None);
        assert_eq!(Fp8Scales::of(&blocks[..3 * 200], 200, k), None);
        assert_eq!((Fp8Scales::Rows.group(k), Fp8Scales::Blocks.group(k)), (k, 128));
        assert!(Fp8Scales::Rows.takes(257) && !Fp8Scales::Blocks.takes(257) && Fp8Scales::Blocks.takes(256));
    }
}
