//! Bad input: each case exits non-zero with a message that names the problem and where, and a
//! failed compile leaves no bundle (complete or partial) behind.

use e2e::*;
use std::path::{Path, PathBuf};

struct Case {
    dir: tempfile::TempDir,
}

impl Case {
    fn new() -> Case {
        Case { dir: tempfile::tempdir().unwrap() }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// A model YAML derived from qwen2.yaml by replacing `from` with `to`.
    fn yaml(&self, from: &str, to: &str) -> PathBuf {
        let src = std::fs::read_to_string(repo().join("models/qwen2.yaml")).unwrap();
        assert!(src.contains(from), "qwen2.yaml has no `{from}`");
        let p = self.path("bad.yaml");
        std::fs::write(&p, src.replacen(from, to, 1)).unwrap();
        p
    }

    /// A checkpoint directory with tiny-qwen2's weights and an edited config.json.
    fn checkpoint(&self, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
        let d = self.path("ckpt");
        std::fs::create_dir_all(&d).unwrap();
        let src = fixture("tiny-qwen2");
        let mut cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
        edit(&mut cfg);
        std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
        std::os::unix::fs::symlink(src.join("model.safetensors"), d.join("model.safetensors")).unwrap();
        d
    }

    /// Runs `engc compile` and checks it fails with every `needle` in its message and leaves
    /// nothing behind.
    fn compile_fails(&self, yaml: &Path, ckpt: &Path, extra: &[&str], needles: &[&str]) {
        let out = self.path("out.bundle");
        let mut args = vec![
            "compile",
            yaml.to_str().unwrap(),
            "--checkpoint",
            ckpt.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let o = run("engc", &args);
        let err = stderr(&o);
        assert!(!o.status.success(), "expected failure, got success: {err}");
        for n in needles {
            assert!(err.contains(n), "message lacks `{n}`: {err}");
        }
        assert!(!out.exists(), "a failed compile left {}", out.display());
        let partial: Vec<_> = std::fs::read_dir(self.dir.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().contains("partial"))
            .collect();
        assert!(partial.is_empty(), "a failed compile left a partial bundle");
    }
}

fn qwen() -> PathBuf {
    repo().join("models/qwen2.yaml")
}

#[test]
fn malformed_yaml_names_line_and_column() {
    let c = Case::new();
    let y = c.yaml("  hidden: hidden_size\n", "  hidden: [hidden_size\n");
    c.compile_fails(&y, &fixture("tiny-qwen2"), &[], &["bad.yaml:", "malformed model YAML", "line", "column"]);
}

#[test]
fn unknown_op_is_named_with_its_line() {
    let c = Case::new();
    let y = c.yaml("silu(linear(h, gate_proj))", "swish(linear(h, gate_proj))");
    c.compile_fails(&y, &fixture("tiny-qwen2"), &[], &["bad.yaml:49", "unknown op or function `swish`", "gelu_tanh"]);
}

#[test]
fn missing_config_key_without_default() {
    let c = Case::new();
    let ck = c.checkpoint(|cfg| {
        cfg.as_object_mut().unwrap().remove("num_attention_heads");
    });
    c.compile_fails(&qwen(), &ck, &[], &["qwen2.yaml:", "parameter `heads`", "num_attention_heads", "no default"]);
}

#[test]
fn missing_tensor() {
    let c = Case::new();
    let y = c.yaml("model.norm.weight", "model.final_norm.weight");
    c.compile_fails(
        &y,
        &fixture("tiny-qwen2"),
        &[],
        &["bad.yaml:", "model.final_norm.weight", "missing from the checkpoint"],
    );
}

#[test]
fn shape_mismatch() {
    let c = Case::new();
    let ck = c.checkpoint(|cfg| cfg["intermediate_size"] = 256.into());
    c.compile_fails(&qwen(), &ck, &[], &["model.layers.0.mlp.gate_proj.weight", "[192, 64]", "[256, 64]"]);
}

#[test]
fn unsupported_dtype() {
    let c = Case::new();
    let d = c.path("f64ckpt");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::copy(fixture("tiny-qwen2").join("config.json"), d.join("config.json")).unwrap();
    let data = vec![0u8; 1024 * 64 * 8];
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F64, vec![1024, 64], &data).unwrap();
    safetensors::serialize_to_file([("model.embed_tokens.weight", view)], &None, &d.join("model.safetensors")).unwrap();
    c.compile_fails(&qwen(), &d, &[], &["model.embed_tokens.weight", "F64", "not supported"]);
}

/// Without an index, a `model.safetensors` is the whole checkpoint (as HF loads it): a file
/// beside it holding the same name is not read. Without either, every safetensors file of the
/// directory is, and a tensor name in two of them is refused, naming both.
#[test]
fn tensor_in_two_files() {
    let c = Case::new();
    let d = c.checkpoint(|_| {});
    let data = vec![0u8; 1024 * 64 * 2];
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![1024, 64], &data).unwrap();
    safetensors::serialize_to_file([("model.embed_tokens.weight", view)], &None, &d.join("stray.safetensors")).unwrap();
    let out = c.path("beside.bundle");
    let yaml = qwen();
    let args = ["compile", yaml.to_str().unwrap(), "--checkpoint", d.to_str().unwrap(), "-o", out.to_str().unwrap()];
    let o = run("engc", &args);
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::rename(d.join("model.safetensors"), d.join("a.safetensors")).unwrap();
    c.compile_fails(&qwen(), &d, &[], &["model.embed_tokens.weight", "stray.safetensors", "a.safetensors"]);
}

/// A weight beyond f16's range cannot become an f16 bundle (it would be infinity).
#[test]
fn weight_beyond_f16_range() {
    let c = Case::new();
    let d = c.path("bigckpt");
    std::fs::create_dir_all(&d).unwrap();
    let src = fixture("tiny-qwen2");
    std::fs::copy(src.join("config.json"), d.join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> =
        st.tensors().into_iter().map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec())).collect();
    let norm = tensors.iter_mut().find(|t| t.0 == "model.norm.weight").expect("model.norm.weight");
    let big: Vec<u8> = match norm.1 {
        safetensors::Dtype::BF16 => (((1e5f32.to_bits() >> 16) as u16).to_le_bytes()).to_vec(),
        safetensors::Dtype::F32 => 1e5f32.to_le_bytes().to_vec(),
        other => panic!("fixture dtype {other:?}"),
    };
    norm.3[..big.len()].copy_from_slice(&big);
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, dt, sh, data)| (n.clone(), safetensors::tensor::TensorView::new(*dt, sh.clone(), data).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, &None, &d.join("model.safetensors")).unwrap();
    c.compile_fails(&qwen(), &d, &["--dtype", "f16"], &["model.norm.weight", "beyond f16", "--dtype bf16"]);
}

#[test]
fn checkpoint_directory_missing() {
    let c = Case::new();
    let missing = c.path("nope");
    c.compile_fails(&qwen(), &missing, &[], &["nope", "does not exist"]);
}

#[test]
fn tp_that_does_not_divide_heads() {
    let c = Case::new();
    c.compile_fails(
        &repo().join("models/llama.yaml"),
        &fixture("tiny-llama"),
        &["--tp", "3"],
        &["--tp 3", "4 attention heads"],
    );
}

#[test]
fn architecture_mismatch() {
    let c = Case::new();
    c.compile_fails(&qwen(), &fixture("tiny-llama"), &[], &["LlamaForCausalLM", "qwen2.yaml"]);
}

/// Without a YAML, `engc compile` takes the model whose `architectures` names the checkpoint's,
/// and a checkpoint of an unknown architecture gets an error listing the known ones.
#[test]
fn model_chosen_by_architecture() {
    let c = Case::new();
    for (name, model) in [("tiny-llama", "llama"), ("tiny-qwen2", "qwen2")] {
        let out = c.path(&format!("{name}.bundle"));
        let (ck, o) = (fixture(name), out.to_str().unwrap());
        let r = run("engc", &["compile", "--checkpoint", ck.to_str().unwrap(), "-o", o]);
        assert!(r.status.success(), "{}", stderr(&r));
        assert!(stderr(&r).contains(&format!("{model}.yaml")), "{}", stderr(&r));
        assert_eq!(bundle::Bundle::open(&out).unwrap().manifest.model, model);
    }
    let ck = c.checkpoint(|cfg| cfg["architectures"] = serde_json::json!(["MambaForCausalLM"]));
    let r = run("engc", &["compile", "--checkpoint", ck.to_str().unwrap(), "-o", c.path("m.bundle").to_str().unwrap()]);
    let err = stderr(&r);
    assert!(!r.status.success(), "{err}");
    for needle in ["MambaForCausalLM", "known architectures", "LlamaForCausalLM (", "Qwen2ForCausalLM ("] {
        assert!(err.contains(needle), "message lacks `{needle}`: {err}");
    }
}

fn good_bundle(c: &Case) -> PathBuf {
    let out = c.path("good.bundle");
    let o = run(
        "engc",
        &[
            "compile",
            qwen().to_str().unwrap(),
            "--checkpoint",
            fixture("tiny-qwen2").to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    out
}

fn engrun_fails(args: &[&str], needles: &[&str]) {
    let o = run("engrun", args);
    let err = stderr(&o);
    assert!(!o.status.success(), "expected failure: {err}");
    for n in needles {
        assert!(err.contains(n), "message lacks `{n}`: {err}");
    }
}

/// Flips the bits of a bundle file's last byte.
fn flip_last_byte(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x55;
    std::fs::write(path, bytes).unwrap();
}

/// `engrun logits` on bundle `b` with two ids.
fn logits_fails(c: &Case, b: &Path, needles: &[&str]) {
    let out = c.path("l.st");
    engrun_fails(&["logits", b.to_str().unwrap(), "--ids", "1,2", "-o", out.to_str().unwrap()], needles);
}

#[test]
fn bundle_with_bad_checksum_is_refused() {
    let c = Case::new();
    let b = good_bundle(&c);
    flip_last_byte(&b.join("weights/rank0.safetensors"));
    let bs = b.to_str().unwrap();
    engrun_fails(
        &["generate", bs, "--prompt", "hi"],
        &["checksum mismatch", "weights/rank0.safetensors", "engc compile"],
    );
    logits_fails(&c, &b, &["checksum mismatch"]);
    // Every other kind of file is verified too (one bundle each: the first refusal stops `open`).
    for file in ["plan.json", "kernels/model.cu", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"] {
        let c = Case::new();
        let b = good_bundle(&c);
        flip_last_byte(&b.join(file));
        logits_fails(&c, &b, &["checksum mismatch", &format!("`{file}`"), "engc compile"]);
    }
}

/// Issue 23: with its manifest entry removed, an altered weights file used to load.
#[test]
fn bundle_with_unlisted_altered_weights_is_refused() {
    let c = Case::new();
    let b = good_bundle(&c);
    let m = b.join("manifest.json");
    let mut manifest: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&m).unwrap()).unwrap();
    let files = manifest["files"].as_object_mut().unwrap();
    assert!(files.remove("weights/rank0.safetensors").is_some());
    std::fs::write(&m, manifest.to_string()).unwrap();
    flip_last_byte(&b.join("weights/rank0.safetensors"));
    logits_fails(
        &c,
        &b,
        &["`weights/rank0.safetensors` is in the bundle but not listed in manifest.json", "engc compile"],
    );
}

#[test]
fn bundle_with_added_or_deleted_files_is_refused() {
    let c = Case::new();
    let b = good_bundle(&c);
    std::fs::write(b.join("tokenizer/extra.json"), "{}").unwrap();
    logits_fails(&c, &b, &["`tokenizer/extra.json` is in the bundle but not listed", "engc compile"]);
    let c = Case::new();
    let b = good_bundle(&c);
    std::fs::remove_file(b.join("kernels/model.cu")).unwrap();
    engrun_fails(
        &["generate", b.to_str().unwrap(), "--prompt", "hi"],
        &["`kernels/model.cu` is listed in manifest.json but missing", "engc compile"],
    );
}

#[test]
fn bundle_with_newer_format_is_refused() {
    let c = Case::new();
    let b = good_bundle(&c);
    let m = b.join("manifest.json");
    let text = std::fs::read_to_string(&m).unwrap().replace("\"format_version\": 2", "\"format_version\": 99");
    std::fs::write(&m, text).unwrap();
    engrun_fails(&["generate", b.to_str().unwrap(), "--prompt", "hi"], &["format 99", "upgrade engrun"]);
    let o = run("engc", &["inspect", b.to_str().unwrap()]);
    assert!(!o.status.success() && stderr(&o).contains("format 99"));
}

#[test]
fn not_a_bundle() {
    engrun_fails(&["generate", "/nonexistent/x.bundle", "--prompt", "hi"], &["/nonexistent/x.bundle", "not a bundle"]);
}

#[test]
fn bad_runtime_arguments() {
    let c = Case::new();
    let b = good_bundle(&c);
    let bs = b.to_str().unwrap();
    let out = c.path("l.st");
    let os = out.to_str().unwrap();
    engrun_fails(&["logits", bs, "--ids", "1,x,3", "-o", os], &["`x` is not a token id"]);
    engrun_fails(&["logits", bs, "--ids", "1,999999999", "-o", os], &["999999999", "outside the vocabulary"]);
    engrun_fails(&["generate", bs, "--prompt", "hi", "--max-tokens", "5000"], &["exceeds the context length 4096"]);
    engrun_fails(&["generate", bs, "--prompt", "hi", "--temperature=-1"], &["temperature"]);
    engrun_fails(&["generate", bs, "--prompt", "hi", "--device", "gpu9"], &["unknown device `gpu9`"]);
}

/// A minimal GGUF v3 file: `general.architecture = llama` and one 2x32 tensor of type `ty`
/// whose data is `data_len` bytes.
fn gguf_bytes(magic: &[u8; 4], ty: u32, data_len: usize) -> Vec<u8> {
    let mut b = magic.to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(1u64.to_le_bytes()); // tensors
    b.extend(1u64.to_le_bytes()); // metadata
    let s = |b: &mut Vec<u8>, t: &str| {
        b.extend((t.len() as u64).to_le_bytes());
        b.extend(t.as_bytes());
    };
    s(&mut b, "general.architecture");
    b.extend(8u32.to_le_bytes());
    s(&mut b, "llama");
    s(&mut b, "token_embd.weight");
    b.extend(2u32.to_le_bytes());
    b.extend(32u64.to_le_bytes());
    b.extend(2u64.to_le_bytes());
    b.extend(ty.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    while !b.len().is_multiple_of(32) {
        b.push(0);
    }
    b.extend(vec![0u8; data_len]);
    b
}

#[test]
fn bad_gguf_files() {
    let c = Case::new();
    let llama = repo().join("models/llama.yaml");
    let write = |name: &str, bytes: Vec<u8>| {
        let p = c.path(name);
        std::fs::write(&p, bytes).unwrap();
        p
    };
    let magic = write("magic.gguf", gguf_bytes(b"GGJT", 0, 256));
    c.compile_fails(&llama, &magic, &[], &["magic.gguf", "wrong magic", "GGUF"]);
    // 16 is IQ2_XXS, a type the engine does not read.
    let quant = write("quant.gguf", gguf_bytes(b"GGUF", 16, 256));
    c.compile_fails(&llama, &quant, &[], &["quant.gguf", "token_embd.weight", "quantization type 16", "not supported"]);
    let truncated = write("truncated.gguf", gguf_bytes(b"GGUF", 0, 100));
    c.compile_fails(&llama, &truncated, &[], &["truncated.gguf", "token_embd.weight", "truncated"]);
    let mut header_cut = gguf_bytes(b"GGUF", 0, 256);
    header_cut.truncate(40);
    let cut = write("cut.gguf", header_cut);
    c.compile_fails(&llama, &cut, &[], &["cut.gguf", "truncated"]);
}
