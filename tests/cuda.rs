//! The generated CUDA: every kernel of tiny-qwen2, tiny-llama and the Qwen2.5-0.5B / 7B shapes
//! (tp 1 and 2) compiles with NVRTC to PTX for sm_90 (the NVRTC library comes from PyPI through
//! scripts/nvrtc.sh; no GPU and no CUDA toolkit needed), and the source is a text golden.

use e2e::*;
use std::process::Command;

fn nvrtc_lib() -> String {
    let o = Command::new("bash").arg(repo().join("scripts/nvrtc.sh")).output().expect("run scripts/nvrtc.sh");
    assert!(o.status.success(), "installing NVRTC failed: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap().trim().to_string()
}

fn cuda_check(args: &[&str], lib: Option<&str>) -> std::process::Output {
    let mut c = Command::new(bin("engc"));
    c.arg("cuda-check").args(args).env_remove("LD_LIBRARY_PATH");
    if let Some(l) = lib {
        c.env("LD_LIBRARY_PATH", l);
    }
    c.output().expect("run engc cuda-check")
}

#[test]
fn generated_kernels_compile_with_nvrtc_for_sm90() {
    let lib = nvrtc_lib();
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "cuda-nvrtc");
    let mut runs: Vec<Vec<String>> = vec![];
    for name in ["tiny-qwen2", "tiny-llama"] {
        runs.push(vec![compile_fixture(name, &dir, 1, None).display().to_string()]);
    }
    for shape in ["qwen2.5-0.5b", "qwen2.5-7b"] {
        for tp in ["1", "2"] {
            let config = repo().join(format!("tests/configs/{shape}.json")).display().to_string();
            let model = repo().join("models/qwen2.yaml").display().to_string();
            runs.push(vec!["--model".into(), model, "--config".into(), config, "--tp".into(), tp.into()]);
        }
    }
    for args in runs {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = cuda_check(&[&args[..], &["--arch", "compute_90"]].concat(), Some(&lib));
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        let out = String::from_utf8_lossy(&o.stdout);
        // Every op's kernel: 17 with linear biases (Qwen2), 16 without (Llama).
        let n: usize = out.split_whitespace().nth(1).and_then(|n| n.parse().ok()).unwrap_or(0);
        assert!(out.starts_with("compiled") && n >= 16, "{args:?}: {out}");
    }
}

#[test]
fn missing_nvrtc_is_a_clear_error() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "cuda-missing");
    let b = compile_fixture("tiny-llama", &dir, 1, None);
    let o = cuda_check(&[b.to_str().unwrap()], None);
    if !o.status.success() {
        assert!(stderr(&o).contains("NVRTC library (libnvrtc.so) was not found"), "{}", stderr(&o));
    }
}

#[test]
fn cuda_source_golden() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "cuda-golden");
    let b = compile_fixture("tiny-qwen2", &dir, 1, None);
    let source = std::fs::read_to_string(b.join("kernels/model.cu")).unwrap();
    // The model-specific part: the header line and the instances (the templates are kernels/).
    let (head, instances) = source.split_once("// ---- instances ----").expect("an instances section");
    let got = format!("{}\n{instances}", head.lines().next().unwrap_or_default());
    let path = repo().join("tests/golden/tiny-qwen2.tp1.instances.cu");
    if std::env::var_os("BLESS").is_some() {
        std::fs::write(&path, &got).unwrap();
        return;
    }
    let want =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e} (BLESS=1 creates it)", path.display()));
    assert!(got == want, "{} differs from the generated source (BLESS=1 to accept)", path.display());
}

#[test]
fn no_gpu_is_a_clear_error() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "cuda-nogpu");
    let b = compile_fixture("tiny-llama", &dir, 1, None);
    let out = dir.join("logits.safetensors");
    let o = run(
        "engrun",
        &["logits", b.to_str().unwrap(), "--device", "cuda", "--ids", "1,2", "-o", out.to_str().unwrap()],
    );
    if !o.status.success() {
        let e = stderr(&o);
        assert!(e.contains("CUDA driver (libcuda.so) was not found") || e.contains("no usable GPU"), "{e}");
    }
}
