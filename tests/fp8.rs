//! `engc compile --quant fp8` on the tiny Qwen3 fixture: every linear's weight (not the
//! embedding, the norms or the lm_head) stored as FP8 E4M3 with one f32 scale per output
//! channel, in 0.5625x the bytes those weights take in bf16; the CPU backend (which dequantizes
//! them at load) gives the reference interpreter's logits on the same bundle within 1e-4, at
//! tp 1 and tp 2 (a row-parallel slice keeps its rows' scales); the quantization moves the
//! logits from the bf16 bundle's by ~8% of the largest logit on these random weights (checked
//! below 20%); the CUDA codegen refuses the plan by weight name.
//!
//! FP8 checkpoints as published (scripts/make-fp8-fixtures.py): `tiny-qwen3-fp8-block`
//! (transformers' fine-grained FP8, 128x128 blocks with f32 `weight_scale_inv`; its k_proj and
//! v_proj stay bf16, as transformers' quantizer leaves weights that are not whole blocks) and
//! `tiny-qwen3-fp8-channel` (compressed-tensors, one bf16 `weight_scale` per output channel).
//! Compiled without --dtype, their FP8 weights stay f8_e4m3 with the checkpoint's own codes and
//! scales; the reference interpreter and the CPU backend give HF's float32 logits of the
//! dequantized model within 1e-4, at tp 1 and tp 2, as a `--dtype f32` bundle of the same
//! checkpoint does; schemes that cannot be read exactly are refused by config key; static
//! activation scales are folded with one warning; an FP8 embedding is dequantized (only linears'
//! weights stay FP8).

use e2e::*;
use std::path::{Path, PathBuf};

const PROMPT: [u32; 12] = [1, 17, 250, 3, 99, 311, 42, 7, 128, 64, 200, 11];
const DECODE: [u32; 3] = [45, 310, 2];

fn compile(dir: &Path, tp: usize, quant: Option<compiler::Quant>) -> PathBuf {
    let out = dir.join(format!("q3-tp{tp}-{}.bundle", if quant.is_some() { "fp8" } else { "bf16" }));
    compile_to("qwen3", &fixture("tiny-qwen3"), &out, |o| {
        o.tp = tp;
        o.dtype = Some(ir::DType::BF16);
        o.quant = quant;
    })
}

#[test]
fn fp8_linears_match_their_dequantization_in_fewer_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let fp8 = bundle::Bundle::open(&compile(dir.path(), 1, Some(compiler::Quant::Fp8))).unwrap();
    let bf16 = bundle::Bundle::open(&compile(dir.path(), 1, None)).unwrap();
    let (mut quantized, mut fp8_bytes, mut bf16_bytes) = (0, 0, 0);
    for ((name, shape, d), (_, _, before)) in fp8.plan.weights().zip(bf16.plan.weights()) {
        let linear = name.contains("_proj");
        assert_eq!(d == ir::DType::F8_E4M3, linear, "{name} is {d}");
        if linear {
            quantized += 1;
            let n: usize = shape.iter().product();
            fp8_bytes += d.bytes(n).unwrap();
            bf16_bytes += before.bytes(n).unwrap();
        }
    }
    assert!(quantized >= 7 && fp8_bytes * 10 <= bf16_bytes * 6, "{quantized} weights: {fp8_bytes} vs {bf16_bytes}");

    let run = |b: Box<dyn runtime::Backend>| prefill_then_decode(&mut seqs_of(b), &PROMPT, &DECODE);
    let want = run(Box::new(runtime::RefBackend::new(&fp8).unwrap()));
    let cpu = run(Box::new(runtime::CpuBackend::new(&fp8).unwrap()));
    let tp2 = bundle::Bundle::open(&compile(dir.path(), 2, Some(compiler::Quant::Fp8))).unwrap();
    let cpu2 = run(runtime::load(&tp2, runtime::Device::Cpu, &[]).unwrap());
    let unquantized = run(Box::new(runtime::RefBackend::new(&bf16).unwrap()));
    for (step, w) in want.iter().enumerate() {
        let (e1, e2) = (rel_err(&cpu[step], w), rel_err(&cpu2[step], w));
        assert!(e1 < 1e-4 && e2 < 1e-4, "step {step}: CPU tp1 {e1}, tp2 {e2} against the reference");
        let moved = rel_err(w, &unquantized[step]);
        // Random weights, E4M3's 3 mantissa bits: ~8% of the largest logit measured; a wrong scale
        // or a misread code moves them by their own size.
        assert!(moved > 0.0 && moved < 0.2, "step {step}: fp8 moved the logits by {moved}");
    }
    let refused = codegen_cuda::emit(&fp8.plan).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(refused.contains("is f8_e4m3"), "{refused}");
}

fn seqs_of(b: Box<dyn runtime::Backend>) -> runtime::Sequences {
    runtime::Sequences::new(b, 4096).expect("KV pool")
}

/// The FP8 checkpoint fixtures and what their scale tensors add to a weight's name.
const CHECKPOINTS: [(&str, &str); 2] = [("tiny-qwen3-fp8-block", "_scale_inv"), ("tiny-qwen3-fp8-channel", "_scale")];

/// Relative tolerance against HF's float32 logits.
const TOL: f32 = 1e-4;

/// Compiling `checkpoint` with models/qwen3.yaml into `out`: one rank, its own dtype.
fn options(checkpoint: &Path, out: &Path) -> compiler::CompileOptions {
    compile_options("qwen3", checkpoint, out)
}

fn compile_fp8(name: &str, out: &Path, with: impl FnOnce(&mut compiler::CompileOptions)) -> compiler::CompileReport {
    let mut opts = options(&fixture(name), out);
    with(&mut opts);
    compiler::compile(&opts).unwrap_or_else(|e| panic!("compiling {name}: {e}"))
}

/// A checkpoint's safetensors file, read directly.
struct Stored(Vec<u8>);

impl Stored {
    fn open(dir: &Path) -> Stored {
        Stored(std::fs::read(dir.join("model.safetensors")).expect("model.safetensors"))
    }

    /// A tensor's safetensors dtype, shape and bytes.
    fn get(&self, name: &str) -> Option<(String, Vec<usize>, Vec<u8>)> {
        let st = safetensors::SafeTensors::deserialize(&self.0).expect("valid safetensors");
        let t = st.tensor(name).ok()?;
        Some((format!("{:?}", t.dtype()), t.shape().to_vec(), t.data().to_vec()))
    }

    /// A bf16 or f32 tensor as f32.
    fn f32(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        let (dtype, shape, data) = self.get(name).unwrap_or_else(|| panic!("{name} is stored"));
        (shape, ir::DType::from_safetensors_name(&dtype).expect("a float").to_f32(&data))
    }
}

#[test]
fn fp8_checkpoints_keep_their_codes_and_scales() {
    let dir = tempfile::tempdir().unwrap();
    for (name, suffix) in CHECKPOINTS {
        let report = compile_fp8(name, &dir.path().join(name), |_| {});
        let scales: Vec<&String> = report.warnings.iter().filter(|w| w.contains("_scale")).collect();
        assert!(scales.is_empty(), "{name}: scale tensors reported: {scales:?}");
        let b = bundle::Bundle::open(&report.out).unwrap();
        let quant = bundle::Bundle::open(
            &compile_fp8(name, &dir.path().join("q"), |o| o.quant = Some(compiler::Quant::Fp8)).out,
        )
        .unwrap();
        let ckpt = Stored::open(&fixture(name));
        let (weights, requantized) = (b.weights(0).unwrap(), quant.weights(0).unwrap());
        let mut kept = Vec::new();
        for ((w, shape, dtype), (_, _, quantized)) in b.plan.weights().zip(quant.plan.weights()) {
            let (stored, ..) = ckpt.get(w).unwrap_or_else(|| panic!("{w} is a checkpoint tensor"));
            assert_eq!(dtype == ir::DType::F8_E4M3, stored == "F8_E4M3", "{name}: {w} is {dtype}, stored {stored}");
            if w.contains("_proj") {
                assert_eq!(quantized, ir::DType::F8_E4M3, "{name} --quant fp8: {w}");
            }
            if dtype != ir::DType::F8_E4M3 {
                continue;
            }
            let bytes = weights.bytes_as(w, dtype, shape).unwrap();
            assert_blocks_are_stored(&ckpt, (w, &format!("{w}{suffix}")), shape, bytes);
            // --quant fp8 quantizes the bf16 linears; those stored FP8 stay as they are.
            assert_eq!(requantized.bytes_as(w, dtype, shape).unwrap(), bytes, "{name} --quant fp8: {w}");
            kept.push(w.to_string());
        }
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture(name).join("reference.json")).unwrap()).unwrap();
        let listed: Vec<&str> = meta["fp8_weights"].as_array().unwrap().iter().filter_map(|v| v.as_str()).collect();
        kept.sort();
        assert_eq!(kept, listed, "{name}: the weights kept FP8");
    }
}

/// A kept weight's bundle blocks: each row's blocks of 32 are the checkpoint's codes, led by
/// the scale of their block of the checkpoint's scale grid, bit for bit.
fn assert_blocks_are_stored(ckpt: &Stored, (w, scale): (&str, &str), shape: &[usize], bytes: &[u8]) {
    let (n, k) = (shape[0], shape[1]);
    let (_, _, codes) = ckpt.get(w).unwrap();
    let (grid, scales) = ckpt.f32(scale);
    let (sr, sc) = (grid[0], grid.get(1).copied().unwrap_or(1));
    let (rows, cols) = (n.div_ceil(sr), k.div_ceil(sc));
    assert_eq!(bytes.len(), n * k / 32 * 36, "{w}");
    for (at, block) in bytes.chunks_exact(36).enumerate() {
        let (i, j) = (at / (k / 32), at % (k / 32) * 32);
        let s = f32::from_le_bytes([block[0], block[1], block[2], block[3]]);
        assert_eq!(s.to_bits(), scales[i / rows * sc + j / cols].to_bits(), "{w}: scale of row {i}, column {j}");
        assert_eq!(block[4..], codes[i * k + j..i * k + j + 32], "{w}: codes of row {i}, columns {j}..");
    }
}

/// One fixture's HF reference (reference.json, reference.safetensors).
struct Reference {
    prompt: Vec<u32>,
    positions: Vec<usize>,
    greedy: Vec<u32>,
    /// The logits at `positions`, then those each greedy token after the first was picked
    /// from (the first one's are the last position's).
    rows: Vec<Vec<f32>>,
}

impl Reference {
    fn load(name: &str) -> Reference {
        let dir = fixture(name);
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
        let st = dir.join("reference.safetensors");
        let (shape, logits) = read_f32(&st, "logits");
        let (_, greedy) = read_f32(&st, "greedy_logits");
        let rows = logits.chunks(shape[1]).chain(greedy.chunks(shape[1]).skip(1)).map(<[f32]>::to_vec).collect();
        let positions = ids(&meta["positions"]).into_iter().map(|p| p as usize).collect();
        Reference { prompt: ids(&meta["prompt"]), positions, greedy: ids(&meta["greedy"]), rows }
    }

    /// A backend's logits at the reference's rows: the prompt's positions in one prefill, then
    /// HF's greedy tokens fed one by one (the last one's logits are not recorded).
    fn logits_of(&self, b: Box<dyn runtime::Backend>) -> Vec<Vec<f32>> {
        let mut s = seqs_of(b);
        let got = s.forward(0, &self.prompt, &self.positions).unwrap();
        let mut rows: Vec<Vec<f32>> = got.chunks(got.len() / self.positions.len()).map(<[f32]>::to_vec).collect();
        for &t in &self.greedy[..self.greedy.len() - 1] {
            rows.push(s.forward(0, &[t], &[0]).unwrap());
        }
        rows
    }
}

/// The largest relative error of `got`'s rows against `want`'s, asserted below `tol`.
fn assert_close(got: &[Vec<f32>], want: &[Vec<f32>], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: rows");
    let mut worst = 0.0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = rel_err(g, w);
        assert!(err < tol, "{what}: row {i} rel err {err}");
        worst = worst.max(err);
    }
    eprintln!("{what}: worst rel err {worst:.2e}");
}

#[test]
fn fp8_checkpoints_match_hf_at_tp1_and_tp2_and_dequantized() {
    let dir = tempfile::tempdir().unwrap();
    for (name, _) in CHECKPOINTS {
        let r = Reference::load(name);
        let open = |out: &str, with: &dyn Fn(&mut compiler::CompileOptions)| {
            bundle::Bundle::open(&compile_fp8(name, &dir.path().join(out), with).out).unwrap()
        };
        let kept = open("kept", &|_| {});
        let tp2 = open("tp2", &|o| o.tp = 2);
        let f32 = open("f32", &|o| o.dtype = Some(ir::DType::F32));
        assert!(tp2.plan.weights().any(|(_, _, d)| d == ir::DType::F8_E4M3));
        assert!(f32.plan.weights().all(|(_, _, d)| d == ir::DType::F32));
        let interpreter = r.logits_of(Box::new(runtime::RefBackend::new(&kept).unwrap()));
        assert_close(&interpreter, &r.rows, TOL, &format!("{name} reference interpreter"));
        let cpu = r.logits_of(Box::new(runtime::CpuBackend::new(&kept).unwrap()));
        assert_close(&cpu, &r.rows, TOL, &format!("{name} CPU"));
        let cpu2 = r.logits_of(runtime::load(&tp2, runtime::Device::Cpu, &[]).unwrap());
        assert_close(&cpu2, &r.rows, TOL, &format!("{name} CPU tp 2"));
        let cpu_f32 = r.logits_of(Box::new(runtime::CpuBackend::new(&f32).unwrap()));
        let ref_f32 = r.logits_of(Box::new(runtime::RefBackend::new(&f32).unwrap()));
        for (what, got, want) in
            [("CPU tp 2", &cpu2, &cpu), ("CPU --dtype f32", &cpu_f32, &cpu), ("--dtype f32", &ref_f32, &interpreter)]
        {
            let err = got.iter().zip(want).map(|(g, w)| rel_err(g, w)).fold(0.0f32, f32::max);
            assert!(err < 1e-5, "{name}: {what} against the kept bundle: rel err {err}");
        }
    }
}

/// A tensor added to a checkpoint: name, dtype, shape, bytes.
type Added = (String, safetensors::Dtype, Vec<usize>, Vec<u8>);

/// A copy of a fixture's checkpoint with its config's `quantization_config` changed by `edit`
/// and its tensors filtered by `keep`, extended by `add`.
fn variant(
    name: &str,
    edit: impl Fn(&mut serde_json::Value),
    keep: impl Fn(&str) -> bool,
    add: &[Added],
) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let src = fixture(name);
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(&mut config["quantization_config"]);
    std::fs::write(dir.path().join("config.json"), serde_json::to_string_pretty(&config).unwrap()).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::tensor::TensorView)> =
        st.tensors().into_iter().filter(|(n, _)| keep(n)).collect();
    for (n, dtype, shape, data) in add {
        tensors.push((n.clone(), safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap()));
    }
    safetensors::serialize_to_file(tensors, &None, &dir.path().join("model.safetensors")).unwrap();
    dir
}

fn refusal(name: &str, dir: &Path) -> String {
    let opts = options(dir, &dir.join("out.bundle"));
    compiler::compile(&opts).err().unwrap_or_else(|| panic!("{name}: compiled")).to_string()
}

/// Sets the field at a JSON pointer (its parent object must exist).
fn set(q: &mut serde_json::Value, path: &str, v: &serde_json::Value) {
    let (parent, key) = path.rsplit_once('/').expect("a pointer");
    let object = q.pointer_mut(parent).and_then(|p| p.as_object_mut()).expect("the parent object");
    object.insert(key.to_string(), v.clone());
}

#[test]
fn unsupported_fp8_schemes_are_refused_by_config_key() {
    use serde_json::json;
    let (block, channel) = ("tiny-qwen3-fp8-block", "tiny-qwen3-fp8-channel");
    let cases = [
        (block, "/fmt", json!("e5m2"), "quantization_config.fmt is \"e5m2\""),
        (block, "/weight_block_size", json!([128, 48]), "quantization_config.weight_block_size is [128,48]"),
        (block, "/quant_method", json!("awq"), "quantization_config.quant_method is \"awq\""),
        // Blocks that do not fit the scale tensors: the first FP8 weight's scale is named.
        (block, "/weight_block_size", json!([64, 64]), "weight_scale_inv` has shape [1, 2], which does not fit"),
        (channel, "/config_groups/group_0/weights/strategy", json!("group"), "weights.strategy is \"group\""),
        (channel, "/config_groups/group_0/weights/type", json!("int"), "weights.type is \"int\""),
        (channel, "/config_groups/group_0/weights/num_bits", json!(4), "weights.num_bits is 4"),
        (channel, "/config_groups/group_0/weights/symmetric", json!(false), "weights.symmetric is false"),
        (channel, "/format", json!("pack-quantized"), "quantization_config.format is \"pack-quantized\""),
    ];
    for (name, path, value, want) in cases {
        let dir = variant(name, |q| set(q, path, &value), |_| true, &[]);
        let e = refusal(name, dir.path());
        assert!(e.contains(want), "{name}: `{want}` not in: {e}");
    }
    let scale = "model.layers.1.mlp.down_proj.weight_scale";
    let dir = variant("tiny-qwen3-fp8-channel", |_| {}, |n| n != scale, &[]);
    let e = refusal("missing scale", dir.path());
    assert!(e.contains("FP8 weight `model.layers.1.mlp.down_proj.weight` has no scale tensor"), "{e}");
}

/// Static activation scales (`input_scale`) belong to their linears: not reported as unused,
/// one warning saying how many are not used and why.
#[test]
fn static_activation_scales_are_folded_with_one_warning() {
    let ckpt = Stored::open(&fixture("tiny-qwen3-fp8-channel"));
    let st = safetensors::SafeTensors::deserialize(&ckpt.0).unwrap();
    let scales: Vec<Added> = st
        .names()
        .into_iter()
        .filter_map(|n| n.strip_suffix(".weight_scale"))
        .map(|base| (format!("{base}.input_scale"), safetensors::Dtype::F32, vec![1], 0.02f32.to_le_bytes().to_vec()))
        .collect();
    let static_acts = |q: &mut serde_json::Value| {
        q["config_groups"]["group_0"]["input_activations"] = serde_json::json!({"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": true, "dynamic": false});
    };
    let dir = variant("tiny-qwen3-fp8-channel", static_acts, |_| true, &scales);
    let mut opts = options(dir.path(), &dir.path().join("out.bundle"));
    let report = compiler::compile(&opts).unwrap();
    assert!(report.warnings.iter().all(|w| !w.contains("unused")), "{:?}", report.warnings);
    let notes: Vec<&String> = report.warnings.iter().filter(|w| w.contains("activation scale")).collect();
    assert_eq!(notes.len(), 1, "{:?}", report.warnings);
    assert!(notes[0].starts_with(&format!("{} static activation scale(s)", scales.len())), "{}", notes[0]);
    opts.dtype = Some(ir::DType::F32);
    opts.out = dir.path().join("f32.bundle");
    compiler::compile(&opts).unwrap();
}

/// An FP8 embedding (per-row scales) is not a linear's weight: it is dequantized into the plan's
/// bf16, each value `bf16(e4m3(code) · scale)`, and the model runs.
#[test]
fn an_fp8_embedding_is_dequantized() {
    let name = "tiny-qwen3-fp8-channel";
    let embed = "model.embed_tokens.weight";
    let (shape, values) = Stored::open(&fixture(name)).f32(embed);
    let k = shape[1];
    let scales: Vec<f32> = values.chunks(k).map(|r| r.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 448.0).collect();
    let codes: Vec<u8> = values.iter().enumerate().map(|(i, v)| ir::quant::f32_to_e4m3(v / scales[i / k])).collect();
    let scale_bytes: Vec<u8> = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
    let add = [
        (embed.to_string(), safetensors::Dtype::F8_E4M3, shape.clone(), codes.clone()),
        (format!("{embed}_scale"), safetensors::Dtype::F32, vec![shape[0], 1], scale_bytes),
    ];
    let dir = variant(name, |_| {}, |n| n != embed, &add);
    let report = compiler::compile(&options(dir.path(), &dir.path().join("out.bundle"))).unwrap();
    let b = bundle::Bundle::open(&report.out).unwrap();
    let dtype = b.plan.weights().find(|(w, ..)| *w == embed).map(|(_, _, d)| d);
    assert_eq!(dtype, Some(ir::DType::BF16));
    let stored = b.weights(0).unwrap().f32(embed, &shape, ir::DType::BF16).unwrap();
    for (i, (got, q)) in stored.iter().zip(&codes).enumerate() {
        let bf16 = ir::DType::BF16;
        let want = bf16.to_f32(&bf16.from_f32(&[ir::quant::e4m3_to_f32(*q) * scales[i / k]]))[0];
        assert_eq!(got.to_bits(), want.to_bits(), "embedding value {i}");
    }
    let logits = prefill_then_decode(&mut seqs_of(Box::new(runtime::CpuBackend::new(&b).unwrap())), &PROMPT, &DECODE);
    assert!(logits.iter().flatten().all(|v| v.is_finite()));
}
