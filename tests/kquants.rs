//! GGUF's k-quants (Q4_K, Q5_K, Q6_K) end to end, on `tests/fixtures/tiny-kquant`
//! (`scripts/make-kquant-gguf.py`, made with llama.cpp's gguf-py): a 1-layer llama whose linears
//! are Q4_K (down Q6_K) and whose tied embedding is Q5_K, against its twin `dequant.gguf`, every
//! tensor F32 as gguf-py dequantizes it. Kept in their blocks, the reference interpreter and the
//! CPU backend give the twin's logits; `engc compile --dtype f32` dequantizes to the same weights.
//! Its Qwen2 twin (`qwen2.gguf`) holds Q8_0, Q5_0, Q5_1 and f32 biases, its Qwen3 twin
//! (`qwen3.gguf`) heads of 128 with per-head q/k norms.

use e2e::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// 20 ids of the vocabulary of 320, then 3 decode steps.
const PROMPT: [u32; 20] = [1, 17, 250, 3, 99, 319, 42, 7, 128, 64, 200, 11, 0, 5, 301, 77, 150, 33, 260, 8];
const DECODE: [u32; 3] = [45, 318, 2];

fn gguf(name: &str) -> PathBuf {
    fixture("tiny-kquant").join(name)
}

/// Compiles a GGUF of the fixture with `models/llama.yaml` (no tokenizer: the tests feed ids).
fn compile(name: &str, dir: &Path, dtype: Option<ir::DType>) -> PathBuf {
    compile_as("llama", name, dir, dtype)
}

/// Compiles a GGUF of the fixture with `models/MODEL.yaml`.
fn compile_as(model: &str, name: &str, dir: &Path, dtype: Option<ir::DType>) -> PathBuf {
    compile_to(model, &gguf(name), &dir.join(format!("{name}.bundle")), |o| o.dtype = dtype)
}

fn dtypes(b: &bundle::Bundle) -> BTreeMap<String, String> {
    b.plan.weights().map(|(name, _, d)| (name.to_string(), d.to_string())).collect()
}

/// The logits of `PROMPT` then `DECODE` on `backend`.
fn logits(backend: impl runtime::Backend + 'static) -> Vec<Vec<f32>> {
    prefill_then_decode(&mut seqs(backend), &PROMPT, &DECODE)
}

/// Every step within `tol` (relative) of `want`; returns the largest error.
fn check(what: &str, got: &[Vec<f32>], want: &[Vec<f32>], tol: f32) -> f32 {
    assert_eq!(got.len(), want.len());
    let mut worst = 0.0f32;
    for (step, (g, w)) in got.iter().zip(want).enumerate() {
        let err = rel_err(g, w);
        assert!(err < tol, "{what}, step {step}: rel err {err}");
        worst = worst.max(err);
    }
    eprintln!("{what}: largest rel err {worst:e} (bit-identical: {})", got == want);
    worst
}

/// The reference logits: the interpreter on the dequantized twin, finite and not all alike.
fn reference(dir: &Path) -> Vec<Vec<f32>> {
    reference_of("llama", "dequant.gguf", dir)
}

/// [`reference`] of the twin `name` of `models/MODEL.yaml`.
fn reference_of(model: &str, name: &str, dir: &Path) -> Vec<Vec<f32>> {
    let f = bundle::Bundle::open(&compile_as(model, name, dir, None)).unwrap();
    assert!(dtypes(&f).values().all(|d| d == "f32"), "{:?}", dtypes(&f));
    let want = logits(runtime::RefBackend::new(&f).unwrap());
    assert_eq!(want[0].len(), PROMPT.len() * 320);
    for row in &want {
        assert!(row.iter().all(|v| v.is_finite()), "non-finite reference logits");
        let spread = row.iter().fold(f32::MIN, |m, &v| m.max(v)) - row.iter().fold(f32::MAX, |m, &v| m.min(v));
        assert!(spread > 1e-3, "flat reference logits");
    }
    want
}

/// Kept in their blocks: the plan says q4_k / q5_k / q6_k per weight, the interpreter (which
/// dequantizes with `ir::quant`) and the CPU backend (which dequantizes them to f32 at load)
/// give the logits of the twin whose weights gguf-py dequantized.
#[test]
fn k_quants_kept_in_blocks_match_gguf_py_dequantized() {
    let dir = tempfile::tempdir().unwrap();
    let want = reference(dir.path());
    let q = bundle::Bundle::open(&compile("kquant.gguf", dir.path(), None)).unwrap();
    let d = dtypes(&q);
    let of = |name: &str| d.get(name).map_or("(none)", String::as_str);
    assert_eq!(of("model.embed_tokens.weight"), "q5_k");
    assert_eq!(of("model.layers.0.mlp.down_proj.weight"), "q6_k");
    for w in
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj"]
    {
        assert_eq!(of(&format!("model.layers.0.{w}.weight")), "q4_k", "{w}");
    }
    assert_eq!(of("model.norm.weight"), "f32");
    let got = logits(runtime::RefBackend::new(&q).unwrap());
    check("reference interpreter on the k-quant bundle", &got, &want, 1e-4);
    let got = logits(runtime::CpuBackend::new(&q).unwrap());
    check("CPU backend on the k-quant bundle", &got, &want, 1e-4);
}

/// `engc compile --dtype f32` dequantizes the k-quants to gguf-py's values.
#[test]
fn engc_dequantizes_k_quants_to_gguf_py_values() {
    let dir = tempfile::tempdir().unwrap();
    let want = reference(dir.path());
    let out = dir.path().join("kquant-f32.bundle");
    let yaml = repo().join("models/llama.yaml");
    let k = gguf("kquant.gguf");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let o = run("engc", &["compile", &s(&yaml), "--checkpoint", &s(&k), "--dtype", "f32", "-o", &s(&out)]);
    assert!(o.status.success(), "engc compile --dtype f32: {}", stderr(&o));
    let b = bundle::Bundle::open(&out).unwrap();
    assert!(dtypes(&b).values().all(|d| d == "f32"), "{:?}", dtypes(&b));
    let got = logits(runtime::RefBackend::new(&b).unwrap());
    check("engc --dtype f32 of the k-quant GGUF", &got, &want, 1e-4);
}

/// The Qwen2 twin (`qwen2.gguf`): hidden 320, rows that are not whole super-blocks of 256, in
/// the types llama.cpp's k-quant mixes fall back to there (a Q4_0 table, Q8_0 q/k/v with f32
/// biases as GGUF files store them, Q5_1 o, Q5_0 gate and up, a Q4_1 lm_head; Q5_K down over
/// rows of 512), kept in its blocks, gives its dequantized twin's logits on the interpreter and the
/// CPU backend; the CUDA program reads the biases as f32 beside the Q8_0 weights.
#[test]
fn qwen2_gguf_of_q8_0_q5_0_q5_1_with_f32_biases_matches_gguf_py_dequantized() {
    let dir = tempfile::tempdir().unwrap();
    let want = reference_of("qwen2", "qwen2-dequant.gguf", dir.path());
    let q = bundle::Bundle::open(&compile_as("qwen2", "qwen2.gguf", dir.path(), None)).unwrap();
    let d = dtypes(&q);
    let of = |name: &str| d.get(name).map_or("(none)", String::as_str);
    let types = [
        ("model.embed_tokens.weight", "q4_0"),
        ("model.layers.0.self_attn.q_proj.weight", "q8_0"),
        ("model.layers.0.self_attn.q_proj.bias", "f32"),
        ("model.layers.0.self_attn.o_proj.weight", "q5_1"),
        ("model.layers.0.mlp.gate_proj.weight", "q5_0"),
        ("model.layers.0.mlp.up_proj.weight", "q5_0"),
        ("model.layers.0.mlp.down_proj.weight", "q5_k"),
        ("lm_head.weight", "q4_1"),
    ];
    for (name, dtype) in types {
        assert_eq!(of(name), dtype, "{name}");
    }
    let got = logits(runtime::RefBackend::new(&q).unwrap());
    check("reference interpreter on the Qwen2 block bundle", &got, &want, 1e-4);
    let got = logits(runtime::CpuBackend::new(&q).unwrap());
    check("CPU backend on the Qwen2 block bundle", &got, &want, 1e-4);
    let program = codegen_cuda::emit(&q.plan).unwrap();
    let names: Vec<String> = program.kernels.iter().map(|k| k.name()).collect();
    // Rows of 320: q|k|v's Q8_0 with f32 biases, the Q5_0 gate|up and Q5_1 o as bytes, the Q4_0
    // table and Q4_1 lm_head as nibbles.
    let wanted = [
        "gemv_k320_n320_160_160_r1_norm_f32_s8_b32",
        "gemm_k320_n320_160_160_s8_b32",
        "gemv_glu_k320_n512_r1_addnorm_f32_silu_u8",
        "gemm_skinny_k320_n512_512_t16_u8",
        "gemm_k320_n320_u8",
        "embedding_h320_v320_q4",
        "gemv_k320_n320_r8_q4",
    ];
    for want in wanted {
        assert!(names.iter().any(|n| n == want), "no {want} kernel in {names:?}");
    }
}

/// The Qwen3 twin (`qwen3.gguf`): heads of 128 (the GGUF's key length, not hidden / heads), the
/// per-head q/k norms (`attn_q_norm`, `attn_k_norm`), a Q8_0 table tied to the lm_head; kept in
/// its blocks it gives its dequantized twin's logits on the interpreter and the CPU backend.
#[test]
fn qwen3_gguf_kept_in_blocks_matches_gguf_py_dequantized() {
    let dir = tempfile::tempdir().unwrap();
    let want = reference_of("qwen3", "qwen3-dequant.gguf", dir.path());
    let q = bundle::Bundle::open(&compile_as("qwen3", "qwen3.gguf", dir.path(), None)).unwrap();
    assert_eq!(q.manifest.params.get("head_dim").and_then(|v| v.as_u64()), Some(128));
    let d = dtypes(&q);
    assert_eq!(d.get("model.layers.0.self_attn.q_norm.weight").map(String::as_str), Some("f32"));
    assert_eq!(d.get("model.embed_tokens.weight").map(String::as_str), Some("q8_0"));
    assert!(!d.contains_key("lm_head.weight"), "the table is tied to the lm_head");
    let got = logits(runtime::RefBackend::new(&q).unwrap());
    check("reference interpreter on the Qwen3 block bundle", &got, &want, 1e-4);
    let got = logits(runtime::CpuBackend::new(&q).unwrap());
    check("CPU backend on the Qwen3 block bundle", &got, &want, 1e-4);
}
