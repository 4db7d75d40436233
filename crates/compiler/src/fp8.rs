//! FP8 checkpoints as published in safetensors: E4M3 weights (`F8_E4M3`) each with a scale
//! tensor beside it, in one of two formats that `config.json`'s `quantization_config` names:
//!
//! - transformers' fine-grained FP8 (`quant_method: fp8`, e.g. Qwen/Qwen3-8B-FP8): `X.weight`
//!   and `X.weight_scale_inv`, one scale per `weight_block_size` block (`[128, 128]`), or one
//!   for the whole matrix when the block size is null;
//! - compressed-tensors (`quant_method: compressed-tensors`, `format: float-quantized`, the
//!   `-FP8-dynamic` releases): `X.weight` and `X.weight_scale`, per tensor (`[1]`), per output
//!   channel (`[n, 1]`) or per block (`[ceil(n / bn), ceil(k / bk)]`), as each config group's
//!   `weights.strategy` says.
//!
//! A weight is `code * scale` for the scale of its block of the scale grid ([`Grid`]): read as
//! f32 by [`dequantize`], or kept as it is stored by [`blocks`]: `ir::DType::F8_E4M3`'s blocks
//! of 32, each led by its f32 scale, which holds any grid whose column block is a multiple of 32
//! exactly (the same codes, the same scales). [`scheme`] refuses what it cannot read exactly,
//! naming the config key. Static activation scales (`input_scale`, `activation_scale`) are not
//! used: activations are not quantized by them here.

use ir::BLOCK;
use serde_json::Value;

/// The FP8 layout a checkpoint's `quantization_config` declares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scheme {
    /// What a weight's scale tensor adds to its name: `_scale_inv` (fine-grained FP8:
    /// `X.weight_scale_inv`) or `_scale` (compressed-tensors: `X.weight_scale`).
    pub scale_suffix: &'static str,
    /// The scale granularities the config allows; a scale tensor's shape picks one.
    pub scales: Vec<Granularity>,
}

/// How many weights of a matrix one scale covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Granularity {
    /// The whole matrix.
    Tensor,
    /// One output channel (a row).
    Channel,
    /// A block of `rows` x `cols` (the last ones of a row or column may be partial).
    Block(usize, usize),
}

/// Which scale each weight of an FP8 tensor (one matrix `[n, k]`, or a stack of them) takes:
/// weight `(i, j)` of matrix `m` takes scale `(m · sr + i / rows) · sc + j / cols`, with
/// `sr = ceil(n / rows)` and `sc = ceil(k / cols)` scales per matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grid {
    /// Rows of a matrix.
    pub n: usize,
    /// Columns of a matrix.
    pub k: usize,
    /// Rows one scale covers.
    pub rows: usize,
    /// Columns one scale covers.
    pub cols: usize,
}

/// The name endings of static activation scales: checkpoint tensors that belong to an FP8
/// weight's linear, not used here.
pub const ACTIVATION_SCALES: [&str; 2] = [".input_scale", ".activation_scale"];

/// What the refusals list as readable.
const SUPPORTED: &str = "FP8 E4M3 weights with per-tensor, per-channel or block scales whose column block is a \
                         multiple of 32";

/// The FP8 scheme of a `config.json`: `None` without a `quantization_config`, or with one whose
/// tensors are dense (`gguf`: transformers' record of a model loaded from a GGUF file). A
/// scheme the engine cannot read exactly is an error naming the config key and its value.
pub fn scheme(config: &Value) -> Result<Option<Scheme>, String> {
    let Some(q) = config.get("quantization_config").filter(|q| !q.is_null()) else {
        return Ok(None);
    };
    let key = "quantization_config.quant_method";
    match q.get("quant_method").and_then(Value::as_str) {
        Some("fp8") => fine_grained(q).map(Some),
        Some("compressed-tensors") => compressed_tensors(q).map(Some),
        Some("gguf") => Ok(None),
        _ => Err(refuse(
            key,
            q.get("quant_method").unwrap_or(&Value::Null),
            "fp8 (transformers' fine-grained FP8), compressed-tensors (FP8 float-quantized)",
        )),
    }
}

/// `KEY is VALUE: not supported (supported: ...)`.
fn refuse(key: &str, value: &Value, supported: &str) -> String {
    format!("{key} is {value}: not supported (supported: {supported})")
}

/// Checks that `q[field]` is absent, null, or one of `ok`.
fn one_of(q: &Value, at: &str, field: &str, ok: &[&str]) -> Result<(), String> {
    match q.get(field) {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(s)) if ok.contains(&s.as_str()) => Ok(()),
        Some(v) => Err(refuse(&format!("{at}.{field}"), v, &ok.join(", "))),
    }
}

/// A block size `[rows, cols]` from the config, its column block a multiple of 32 (each of the
/// engine's blocks of 32 under one scale).
fn block_size(v: &Value, key: &str) -> Result<Granularity, String> {
    let dims: Option<Vec<usize>> =
        v.as_array().map(|a| a.iter().filter_map(|d| d.as_u64().map(|d| d as usize)).collect());
    match dims.as_deref() {
        Some(&[rows, cols]) if rows > 0 && cols > 0 && cols.is_multiple_of(BLOCK) => Ok(Granularity::Block(rows, cols)),
        _ => Err(refuse(key, v, &format!("[rows, cols] with cols a multiple of {BLOCK}: {SUPPORTED}"))),
    }
}

/// transformers' `FineGrainedFP8Config` (`utils/quantization_config.py`) as `save_pretrained`
/// writes it, or as Qwen's releases spell it (`fmt: e4m3`).
fn fine_grained(q: &Value) -> Result<Scheme, String> {
    let at = "quantization_config";
    one_of(q, at, "fmt", &["e4m3"])?;
    one_of(q, at, "activation_scheme", &["dynamic", "static"])?;
    one_of(q, at, "scale_fmt", &["float"])?;
    one_of(q, at, "expert_dtype", &["fp8"])?;
    let scales = match q.get("weight_block_size") {
        None | Some(Value::Null) => Granularity::Tensor,
        Some(v) => block_size(v, &format!("{at}.weight_block_size"))?,
    };
    Ok(Scheme { scale_suffix: "_scale_inv", scales: vec![scales] })
}

/// compressed-tensors' `QuantizationConfig` (`quant_config.py`) with float8 weights: every
/// config group's `weights` (`QuantizationArgs`) 8-bit, float, symmetric, static, per tensor,
/// channel or block.
fn compressed_tensors(q: &Value) -> Result<Scheme, String> {
    const FORMATS: [&str; 2] = ["float-quantized", "naive-quantized"];
    let at = "quantization_config";
    one_of(q, at, "format", &FORMATS)?;
    for (field, inert) in [("sparsity_config", "format"), ("transform_config", "")] {
        let v = q.get(field).filter(|v| v.as_object().is_some_and(|o| !o.is_empty()));
        let dense = v.and_then(|v| v.get(inert)).and_then(Value::as_str) == Some("dense");
        if let Some(v) = v.filter(|_| !dense) {
            return Err(refuse(&format!("{at}.{field}"), v, "none: {} or a dense sparsity format"));
        }
    }
    let groups = q.get("config_groups").and_then(Value::as_object).filter(|g| !g.is_empty());
    let groups = groups.ok_or_else(|| refuse(&format!("{at}.config_groups"), &Value::Null, "a map of groups"))?;
    let mut scales = Vec::new();
    for (name, group) in groups {
        let at = format!("{at}.config_groups.{name}");
        one_of(group, &at, "format", &FORMATS)?;
        match group.get("weights") {
            None | Some(Value::Null) => {}
            Some(w) => scales.push(weight_args(w, &format!("{at}.weights"))?),
        }
    }
    Ok(Scheme { scale_suffix: "_scale", scales })
}

/// The granularity of one config group's `weights` (compressed-tensors' `QuantizationArgs`),
/// refused unless float8, symmetric and static.
fn weight_args(w: &Value, at: &str) -> Result<Granularity, String> {
    let field = |f: &str| w.get(f).unwrap_or(&Value::Null);
    if field("num_bits").as_u64() != Some(8) {
        return Err(refuse(&format!("{at}.num_bits"), field("num_bits"), &format!("8: {SUPPORTED}")));
    }
    if field("type").as_str() != Some("float") {
        return Err(refuse(&format!("{at}.type"), field("type"), &format!("float: {SUPPORTED}")));
    }
    if field("symmetric") == &Value::Bool(false) {
        return Err(refuse(&format!("{at}.symmetric"), field("symmetric"), &format!("true: {SUPPORTED}")));
    }
    if !matches!(field("dynamic"), Value::Null | Value::Bool(false)) {
        let why = format!("false (weights with stored scales): {SUPPORTED}");
        return Err(refuse(&format!("{at}.dynamic"), field("dynamic"), &why));
    }
    // compressed-tensors infers a missing strategy from group_size: none is per tensor, -1 per
    // channel, and a positive size per group.
    let strategy = match (field("strategy").as_str(), field("group_size").as_i64()) {
        (Some(s), _) => s,
        (None, None) => "tensor",
        (None, Some(-1)) => "channel",
        (None, Some(_)) => "group",
    };
    match strategy {
        "tensor" => Ok(Granularity::Tensor),
        "channel" => Ok(Granularity::Channel),
        "block" => block_size(field("block_structure"), &format!("{at}.block_structure")),
        s => Err(refuse(&format!("{at}.strategy"), &Value::from(s), &format!("tensor, channel, block: {SUPPORTED}"))),
    }
}

/// The shapes a scale tensor of `g` has for a weight of `shape` (`[.., n, k]`), and the grid
/// each gives.
fn expected(g: Granularity, shape: &[usize]) -> Vec<(Vec<usize>, Grid)> {
    let (lead, n, k) = (&shape[..shape.len() - 2], shape[shape.len() - 2], shape[shape.len() - 1]);
    let with = |tail: &[usize]| [lead, tail].concat();
    match g {
        Granularity::Tensor => {
            let grid = Grid { n, k, rows: n.max(1), cols: k.max(1) };
            vec![(with(&[]), grid), (with(&[1]), grid), (with(&[1, 1]), grid)]
        }
        Granularity::Channel => {
            let grid = Grid { n, k, rows: 1, cols: k.max(1) };
            vec![(with(&[n, 1]), grid), (with(&[n]), grid)]
        }
        Granularity::Block(rows, cols) => {
            vec![(with(&[n.div_ceil(rows), k.div_ceil(cols)]), Grid { n, k, rows, cols })]
        }
    }
}

/// The grid of the FP8 tensor `weight` (of `shape`) whose scale tensor `scale` has
/// `scale_shape`: the first of the scheme's granularities that shape fits; an error naming both
/// tensors when none does.
pub fn grid(
    s: &Scheme,
    (weight, shape): (&str, &[usize]),
    (scale, scale_shape): (&str, &[usize]),
) -> Result<Grid, String> {
    if shape.len() < 2 {
        return Err(format!("FP8 tensor `{weight}` has shape {shape:?}: only matrices (or stacks of them) are read"));
    }
    let options: Vec<(Vec<usize>, Grid)> = s.scales.iter().flat_map(|&g| expected(g, shape)).collect();
    if let Some((_, grid)) = options.iter().find(|(want, _)| want == scale_shape) {
        return Ok(*grid);
    }
    let want: Vec<String> = options.iter().map(|(w, _)| format!("{w:?}")).collect();
    Err(format!(
        "scale tensor `{scale}` has shape {scale_shape:?}, which does not fit the FP8 weight `{weight}` {shape:?} under \
         quantization_config's {:?} scales (expected {})",
        s.scales,
        want.join(" or ")
    ))
}

impl Grid {
    /// The index of the scale of weight `(i, j)` of matrix `m`.
    fn scale(&self, m: usize, i: usize, j: usize) -> usize {
        let (sr, sc) = (self.n.div_ceil(self.rows), self.k.div_ceil(self.cols));
        (m * sr + i / self.rows) * sc + j / self.cols
    }

    /// Every row of every matrix, as (matrix, row within it).
    fn rows(&self, codes: &[u8]) -> impl Iterator<Item = (usize, usize)> {
        let n = self.n.max(1);
        (0..codes.len() / self.k.max(1)).map(move |r| (r / n, r % n))
    }
}

/// The f32 weights of FP8 `codes` under their `scales` (`grid`): `e4m3(code) · scale`, one
/// rounding, as `ir::quant::dequantize` computes an `F8_E4M3` block's and transformers'
/// `Fp8Dequantize` in float32.
pub fn dequantize(codes: &[u8], scales: &[f32], grid: Grid) -> Vec<f32> {
    let mut out = Vec::with_capacity(codes.len());
    for ((m, i), row) in grid.rows(codes).zip(codes.chunks_exact(grid.k.max(1))) {
        out.extend(row.iter().enumerate().map(|(j, &q)| ir::quant::e4m3_to_f32(q) * scales[grid.scale(m, i, j)]));
    }
    out
}

/// FP8 `codes` and their `scales` (`grid`) as `ir::DType::F8_E4M3` blocks, exactly: each row's
/// `k / 32` blocks of its f32 scale then its 32 codes (`k` a multiple of 32, the grid's column
/// block too: [`scheme`] refuses others).
pub fn blocks(codes: &[u8], scales: &[f32], grid: Grid) -> Vec<u8> {
    let mut out = Vec::with_capacity(codes.len() / BLOCK * (BLOCK + 4));
    for ((m, i), row) in grid.rows(codes).zip(codes.chunks_exact(grid.k.max(1))) {
        for (b, block) in row.chunks_exact(BLOCK).enumerate() {
            out.extend(scales[grid.scale(m, i, b * BLOCK)].to_le_bytes());
            out.extend_from_slice(block);
        }
    }
    out
}

/// Whether a tensor is a static activation scale ([`ACTIVATION_SCALES`]).
pub fn is_activation_scale(name: &str) -> bool {
    ACTIVATION_SCALES.iter().any(|s| name.ends_with(s))
}

/// The warning for `count` static activation scales left unused.
pub fn activation_scales_note(count: usize) -> String {
    format!(
        "{count} static activation scale(s) ({}) not used: activations are not quantized by them here (FP8 weights \
         are read with 16-bit activations; W8A8 prefill quantizes each token at run time)",
        ACTIVATION_SCALES.map(|s| s.trim_start_matches('.')).join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir::DType;
    use serde_json::json;

    fn fine(extra: Value) -> Value {
        let mut q = json!({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]});
        q.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        json!({ "quantization_config": q })
    }

    fn compressed(weights: Value) -> Value {
        let mut w = json!({"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true, "dynamic": false});
        w.as_object_mut().unwrap().extend(weights.as_object().unwrap().clone());
        json!({"quantization_config": {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "input_activations": null}},
        }})
    }

    fn refused(config: Value) -> String {
        scheme(&config).expect_err("refused")
    }

    #[test]
    fn reads_both_formats_and_their_granularities() {
        let s = scheme(&fine(json!({"fmt": "e4m3"}))).unwrap().unwrap();
        assert_eq!(s, Scheme { scale_suffix: "_scale_inv", scales: vec![Granularity::Block(128, 128)] });
        let s = scheme(&fine(json!({"weight_block_size": null}))).unwrap().unwrap();
        assert_eq!(s.scales, vec![Granularity::Tensor]);
        for (w, g) in [
            (json!({}), Granularity::Channel),
            (json!({"strategy": "tensor"}), Granularity::Tensor),
            (json!({"strategy": null, "group_size": -1}), Granularity::Channel),
            (json!({"strategy": "block", "block_structure": [128, 64]}), Granularity::Block(128, 64)),
        ] {
            assert_eq!(scheme(&compressed(w)).unwrap().unwrap().scales, vec![g]);
        }
        assert_eq!(scheme(&json!({"hidden_size": 8})).unwrap(), None);
        assert_eq!(scheme(&json!({"quantization_config": {"quant_method": "gguf"}})).unwrap(), None);
    }

    #[test]
    fn refuses_e5m2_and_blocks_that_split_ours() {
        let e = refused(fine(json!({"fmt": "e5m2"})));
        assert!(e.contains("quantization_config.fmt is \"e5m2\"") && e.contains("e4m3"), "{e}");
        let e = refused(fine(json!({"weight_block_size": [128, 48]})));
        assert!(e.contains("weight_block_size is [128,48]") && e.contains("multiple of 32"), "{e}");
        let e = refused(fine(json!({"scale_fmt": "ue8m0"})));
        assert!(e.contains("scale_fmt is \"ue8m0\""), "{e}");
    }

    #[test]
    fn refuses_int_group_asymmetric_and_other_bit_widths() {
        let at = "quantization_config.config_groups.group_0.weights";
        for (w, key) in [
            (json!({"type": "int"}), "type is \"int\""),
            (json!({"num_bits": 4}), "num_bits is 4"),
            (json!({"strategy": "group", "group_size": 128}), "strategy is \"group\""),
            (json!({"strategy": null, "group_size": 64}), "strategy is \"group\""),
            (json!({"symmetric": false}), "symmetric is false"),
            (json!({"dynamic": true}), "dynamic is true"),
        ] {
            let e = refused(compressed(w));
            assert!(e.contains(&format!("{at}.{key}")) && e.contains("supported"), "{e}");
        }
    }

    #[test]
    fn refuses_other_formats_and_methods() {
        let mut c = compressed(json!({}));
        c["quantization_config"]["format"] = json!("pack-quantized");
        assert!(refused(c).contains("quantization_config.format is \"pack-quantized\""));
        let e = refused(json!({"quantization_config": {"quant_method": "awq", "bits": 4}}));
        assert!(e.contains("quant_method is \"awq\"") && e.contains("compressed-tensors"), "{e}");
        let mut c = compressed(json!({}));
        c["quantization_config"]["sparsity_config"] = json!({"format": "sparse-24-bitmask"});
        assert!(refused(c).contains("sparsity_config"));
    }

    #[test]
    fn scale_shapes_pick_the_grid_and_must_fit() {
        let block = Scheme { scale_suffix: "_scale_inv", scales: vec![Granularity::Block(128, 128)] };
        let g = grid(&block, ("w", &[576, 256]), ("s", &[5, 2])).unwrap();
        assert_eq!(g, Grid { n: 576, k: 256, rows: 128, cols: 128 });
        let e = grid(&block, ("w", &[576, 256]), ("s", &[4, 2])).unwrap_err();
        assert!(e.contains("`s` has shape [4, 2]") && e.contains("[5, 2]"), "{e}");
        let ct = Scheme { scale_suffix: "_scale", scales: vec![Granularity::Channel, Granularity::Tensor] };
        assert_eq!(grid(&ct, ("w", &[8, 64]), ("s", &[8, 1])).unwrap().rows, 1);
        assert_eq!(grid(&ct, ("w", &[8, 64]), ("s", &[])).unwrap().rows, 8);
        assert!(grid(&ct, ("w", &[64]), ("s", &[])).is_err());
    }

    /// A partial last block (rows 0..192 under two scale rows of 128, columns 0..96 under one
    /// scale column of 64 and a partial one): read as f32 and as blocks of 32, the same values.
    #[test]
    fn partial_blocks_dequantize_as_the_kept_blocks_do() {
        let g = Grid { n: 192, k: 96, rows: 128, cols: 64 };
        let codes: Vec<u8> = (0..192 * 96).map(|v| (v * 7 % 251) as u8 & 0xF7).collect();
        let scales = [0.5, 2.0, 0.25, 4.0];
        let f = dequantize(&codes, &scales, g);
        assert_eq!(f[63], ir::quant::e4m3_to_f32(codes[63]) * 0.5);
        assert_eq!(f[64], ir::quant::e4m3_to_f32(codes[64]) * 2.0);
        assert_eq!(f[128 * 96 + 95], ir::quant::e4m3_to_f32(codes[128 * 96 + 95]) * 4.0);
        let b = blocks(&codes, &scales, g);
        assert_eq!(b.len(), 192 * 3 * 36);
        assert_eq!((&b[72..76], &b[76..108]), (&2.0f32.to_le_bytes()[..], &codes[64..96]));
        let back = DType::F8_E4M3.to_f32(&b);
        assert!(back.iter().zip(&f).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}
