//! 16-bit copies of small E4M3 linears, for cuBLASLt's 16-bit GEMM (`Gemm::Blas16`). Where a
//! model's weights are small, a batched step is set by launches rather than bytes: the FP8
//! Qwen2.5-0.5B at 64 and 128 rows ran 1.29-1.31x the bf16 bundle's step (docs/perf.md,
//! 2026-11-28), each of its linears paying an input quantization launch and a GEMM on tiny
//! shapes. So where the copies of all the program's E4M3 linears fit `ENGINE_W8_COPY_MB`
//! (default 1024 MB: the 0.5B's take 716; the 7B's 14.6 GB never), each launch's weights are
//! dequantized once at load (codes times their scales, the values every other GEMM multiplies
//! by, as `ir::quant` defines them, rounded to 16 bits) into one 16-bit matrix, and the GEMM
//! choice (timing at load, then the decode graph's) takes it where faster: no activation
//! quantization, so within the 16-bit rounding of the weights of the W8A16 results. Copies no
//! choice can use are freed after the load's timing.

use super::blas::Gemm;
use super::w8a8::{w8_launches, Linears};
use super::{driver, CudaBackend};
use crate::RuntimeError;
use codegen_cuda::{Arg, Launch, W8_GROUP};
use rayon::prelude::*;

impl CudaBackend {
    /// Makes the 16-bit copies where all of them fit the budget (`ENGINE_W8_COPY_MB`); logs
    /// their size. Optional: where one cannot be made, none are, and the log says why.
    pub(super) fn make_w16_copies(&mut self) {
        let budget = std::env::var("ENGINE_W8_COPY_MB").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(1024);
        let launches = w8_launches(&self.program);
        let half = self.program.half.size();
        let bytes: usize = launches.iter().map(|(ws, k)| ws.iter().map(|w| w.1).sum::<usize>() * k * half).sum();
        if launches.is_empty() || bytes > budget << 20 {
            return;
        }
        let start = std::time::Instant::now();
        match launches.iter().try_for_each(|ls| self.make_w16_copy(ls)) {
            Ok(()) => eprintln!(
                "16-bit copies of the E4M3 linears: {} MB in {:.2}s (ENGINE_W8_COPY_MB={budget})",
                bytes >> 20,
                start.elapsed().as_secs_f64()
            ),
            Err(e) => {
                eprintln!("no 16-bit copies of the E4M3 linears: {e}");
                self.w16.clear();
            }
        }
    }

    /// The copy of one launch's linears, end to end.
    fn make_w16_copy(&mut self, (ws, k): &Linears) -> Result<(), RuntimeError> {
        let mut values = Vec::with_capacity(ws.iter().map(|w| w.1).sum::<usize>() * k);
        for &(w, n) in ws {
            let dev =
                self.weights.view(w).ok_or_else(|| RuntimeError::Unsupported(format!("weight {w} is not loaded")))?;
            let stored = self.stream.clone_dtoh(&dev).map_err(driver("reading an E4M3 weight"))?;
            values.extend(dequantize(&stored, n, *k)?);
        }
        let half = self.program.half;
        let bytes: Vec<u8> = values.par_chunks(1 << 16).flat_map_iter(|c| half.from_f32(c)).collect();
        let copy = self.stream.clone_htod(&bytes).map_err(driver("uploading a 16-bit copy"))?;
        self.w16.insert(ws[0].0, copy);
        Ok(())
    }

    /// Frees the copies where no shape's choice lists them as viable (refused or never timed:
    /// their memory goes back to the KV pool).
    pub(super) fn drop_unused_w16(&mut self) {
        let bit = 1 << Gemm::Blas16.mark().2;
        if !self.blas_choice.values().flatten().any(|(_, c)| c.viable & bit != 0) {
            self.w16.clear();
        }
    }

    /// The device address of the 16-bit copy of launch `l`'s weights, if it has one.
    pub(super) fn w16_copy(&self, l: &Launch) -> Option<u64> {
        let Some(Arg::Weight(w)) = l.args.get(1) else { return None };
        self.w16.get(w).map(|c| self.ptr(c))
    }

    /// [`Gemm::Blas16`] where launch `l` has no copy: refused for its shape before any timing.
    pub(super) fn w16_refused(&self, l: &Launch) -> Vec<Gemm> {
        if self.w16_copy(l).is_some() {
            vec![]
        } else {
            vec![Gemm::Blas16]
        }
    }
}

/// The values of an E4M3 weight of `n` rows of `k` in its device layout (`fp8_device_layout`:
/// the codes row by row, then one f32 scale per row and 128 columns), row by row.
fn dequantize(stored: &[u8], n: usize, k: usize) -> Result<Vec<f32>, RuntimeError> {
    let groups = k / W8_GROUP;
    if stored.len() < n * k + n * groups * 4 {
        return Err(RuntimeError::Unsupported(format!("an E4M3 weight of {} bytes is not [{n}, {k}]", stored.len())));
    }
    let (codes, scales) = stored.split_at(n * k);
    let value: [f32; 256] = std::array::from_fn(|q| ir::quant::e4m3_to_f32(q as u8));
    let mut out = vec![0f32; n * k];
    out.par_chunks_mut(k).zip(codes.par_chunks(k)).enumerate().for_each(|(r, (row, codes))| {
        for (g, (out, codes)) in row.chunks_mut(W8_GROUP).zip(codes.chunks(W8_GROUP)).enumerate() {
            let at = 4 * (r * groups + g);
            let s = f32::from_le_bytes([scales[at], scales[at + 1], scales[at + 2], scales[at + 3]]);
            for (o, &q) in out.iter_mut().zip(codes) {
                *o = value[q as usize] * s;
            }
        }
    });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_holds_the_values_ir_quant_defines() {
        // A weight of 3 rows of 256 quantized per row as `--quant fp8` stores it, laid out for
        // the device, then copied: the values `ir::quant` dequantizes from the checkpoint's blocks.
        let (n, k) = (3, 256);
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 37 % 101) as f32 - 50.0) * (1.0 + (i / k) as f32)).collect();
        let blocks = ir::quant::quantize_fp8_rows(&w, k);
        let stored = codegen_cuda::fp8_device_layout("w", &blocks, n, k).unwrap();
        let want = ir::quant::dequantize(ir::DType::F8_E4M3, &blocks);
        assert_eq!(dequantize(&stored, n, k).unwrap(), want);
        assert!(dequantize(&stored[..n * k], n, k).is_err());
    }
}
