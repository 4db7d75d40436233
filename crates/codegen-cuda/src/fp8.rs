//! The device layout of an E4M3 weight, as the kernels of `kernels/fast.cuh` read it (`fp8_t`,
//! `row_scales`): the codes of its `[n, k]` matrix row by row, then one f32 scale per row and
//! [`W8_GROUP`] columns (`[n, k / W8_GROUP]`), little-endian.

use crate::schedule::W8_GROUP;
use crate::CodegenError;
use ir::DType;

/// An `ir::DType::F8_E4M3` weight of `n` rows of `k` (blocks of 32 codes, each led by its f32
/// scale) in the device layout. Every [`W8_GROUP`] columns of a row must share one scale (per
/// tensor, per output channel and 128 x 128 block scales do; `name` is for the error).
pub fn fp8_device_layout(name: &str, bytes: &[u8], n: usize, k: usize) -> Result<Vec<u8>, CodegenError> {
    let (block, block_bytes) = DType::F8_E4M3.block().unwrap_or((ir::BLOCK, 36));
    let err = |m: String| CodegenError::Unsupported(format!("weight `{name}`: {m}"));
    if !k.is_multiple_of(W8_GROUP) || bytes.len() != n * (k / block) * block_bytes {
        return Err(err(format!(
            "{} bytes are not [{n}, {k}] in f8_e4m3 blocks with k a multiple of {W8_GROUP}",
            bytes.len()
        )));
    }
    let mut codes = Vec::with_capacity(n * k + n * (k / W8_GROUP) * 4);
    let mut scales = Vec::with_capacity(n * (k / W8_GROUP) * 4);
    for (row, blocks) in bytes.chunks_exact((k / block) * block_bytes).enumerate() {
        for (g, group) in blocks.chunks_exact(W8_GROUP / block * block_bytes).enumerate() {
            let scale = &group[..4];
            for b in group.chunks_exact(block_bytes) {
                if &b[..4] != scale {
                    return Err(err(format!(
                        "row {row} changes its scale inside columns {}..{}: the CUDA kernels take one scale per \
                         {W8_GROUP} columns",
                        g * W8_GROUP,
                        (g + 1) * W8_GROUP
                    )));
                }
                codes.extend_from_slice(&b[4..]);
            }
            scales.extend_from_slice(scale);
        }
    }
    codes.extend(scales);
    Ok(codes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_then_one_scale_per_row_and_group() {
        let (n, k) = (2, 256);
        let values: Vec<f32> = (0..n * k).map(|i| ((i * 7919) % 113) as f32 / 50.0 - 1.1).collect();
        let blocks = ir::quant::quantize_fp8_rows(&values, k);
        let dev = fp8_device_layout("w", &blocks, n, k).unwrap();
        assert_eq!(dev.len(), n * k + n * (k / W8_GROUP) * 4);
        let (codes, scales) = dev.split_at(n * k);
        let want = ir::quant::dequantize(DType::F8_E4M3, &blocks);
        for (i, w) in want.iter().enumerate() {
            let s = (i / k) * (k / W8_GROUP) + (i % k) / W8_GROUP;
            let scale = f32::from_le_bytes(scales[4 * s..4 * s + 4].try_into().unwrap());
            assert_eq!(ir::quant::e4m3_to_f32(codes[i]) * scale, *w, "weight {i}");
        }
    }

    #[test]
    fn refuses_scales_finer_than_a_group_and_a_wrong_size() {
        let (n, k) = (1, 128);
        let mut blocks = ir::quant::quantize_fp8_rows(&vec![0.5; k], k);
        assert!(fp8_device_layout("w", &blocks[1..], n, k).is_err());
        blocks[36..40].copy_from_slice(&2.0f32.to_le_bytes());
        let e = fp8_device_layout("layers.0.q", &blocks, n, k).unwrap_err().to_string();
        assert!(e.contains("layers.0.q") && e.contains("one scale per 128"), "{e}");
    }
}
