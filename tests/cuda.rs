//! The generated CUDA: every kernel of tiny-qwen2, tiny-llama, the Qwen2.5-0.5B / 7B shapes,
//! the Qwen3-8B and tiny-qwen3 shapes (per-head q/k norms), Gemma-2-9B, Mistral-7B and the tiny
//! Gemma 2 / 3, Mistral and Phi-3 fixtures, the mixtures of experts (tiny Qwen3-MoE, Mixtral and
//! gpt-oss, the Qwen3-30B-A3B shape) (tp 1 and 2), an FP8 checkpoint and a GGUF kept in its
//! k-quant blocks compiles with NVRTC to
//! PTX for sm_90 (the NVRTC library comes from PyPI through scripts/nvrtc.sh; no GPU and no
//! CUDA toolkit needed), and the source is a text golden.

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

/// The source bundle `b` carries defines each of `kernels` (names with their opening parenthesis).
fn has_kernels(b: &std::path::Path, kernels: &[&str]) {
    let source = std::fs::read_to_string(b.join("kernels/model.cu")).unwrap();
    for kernel in kernels {
        assert!(source.contains(kernel), "{}'s source has no {kernel}", b.display());
    }
}

#[test]
fn generated_kernels_compile_with_nvrtc_for_sm90() {
    let lib = nvrtc_lib();
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "cuda-nvrtc");
    let mut runs: Vec<Vec<String>> = vec![];
    for name in ["tiny-qwen2", "tiny-llama"] {
        runs.push(vec![compile_fixture(name, &dir, 1, None).display().to_string()]);
    }
    // An f16 bundle: the same kernels over IEEE halves (H16_F16).
    let f16 = compile_fixture("tiny-qwen2", &dir.join("f16"), 1, Some(ir::DType::F16));
    let source = std::fs::read_to_string(f16.join("kernels/model.cu")).unwrap();
    assert!(source.contains("#define H16_F16 1"), "the f16 bundle's source does not select f16");
    // Its lm_head's 16-bit wgmma instance (f16 operands) is assembled for sm_90a too.
    has_kernels(&f16, &["gemm_skinny_w16_k64_n1024("]);
    let o = cuda_check(&[f16.to_str().unwrap(), "--arch", "compute_90"], Some(&lib));
    assert!(String::from_utf8_lossy(&o.stdout).contains("assembled for sm_90a (wgmma)"), "f16: {}", stderr(&o));
    runs.push(vec![f16.display().to_string()]);
    // An FP8 checkpoint kept in E4M3: the linears' fp8_t GEMV / GEMM variants and the W8A8 ones (its k and v
    // projections, [64, 128], stayed bf16 in HF's quantizer: their own launch beside q's).
    let fp8 = compile_to("qwen3", &fixture("tiny-qwen3-fp8-block"), &dir.join("fp8.bundle"), |_| {});
    has_kernels(
        &fp8,
        &[
            "gemv_glu_k128_n256_r1_addnorm_bf16_silu_f8(",
            "gemm_skinny_k256_n128_t2_f8(",
            "gemm_k128_n128_f8(",
            "gemm_k128_n64_64(",
            // W8A8 candidates: the input quantizer and the E4M3 x E4M3 small-batch kernel
            // (wgmma, one instance for every row count up to 64).
            "quant_e4m3_rows(",
            "gemm_skinny_a8_k256_n128(",
        ],
    );
    // Its wgmma is assembled for sm_90a besides the PTX for compute_90 (inline assembly that
    // ptxas rejects fails here).
    let o = cuda_check(&[fp8.to_str().unwrap(), "--arch", "compute_90"], Some(&lib));
    assert!(o.status.success(), "fp8: {}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("assembled for sm_90a (wgmma)"), "fp8: no sm_90a pass");
    runs.push(vec![fp8.display().to_string()]);
    // The GGUF fixtures kept in their blocks, each format's kernels: the llama (Q4_K linears, a
    // Q6_K down projection, a Q5_K table tied to the lm_head: every format's GEMV, small-batch
    // and tiled kernels and the block table's gather); its Qwen2 twin (rows of 320: Q8_0 q/k/v
    // with f32 biases, the `_b32` variants; Q5_0 gate/up and a Q5_1 o as bytes, a Q4_0 table and
    // a Q4_1 lm_head); its
    // Qwen3 twin (heads of 128 with per-head q/k norms over Q4_K q/k/v, a tied Q8_0 table).
    let ggufs: [(&str, &str, &[&str]); 3] = [
        (
            "llama",
            "kquant",
            &[
                "embedding_h256_v320_u8(",
                "gemv_k256_n256_128_128_r1_norm_f32_q4(",
                "gemm_skinny_k256_n512_512_t4_q4(",
                "gemm_k512_n256_s8(",
                "gemv_glu_k256_n512_r2_silu_q4(",
                "gemv_k256_n320_r1_u8(",
                "gemm_skinny_k256_n320_t16_u8(",
            ],
        ),
        (
            "qwen2",
            "qwen2",
            &[
                "gemv_k320_n320_160_160_r1_norm_f32_s8_b32(",
                "gemm_skinny_k320_n320_160_160_t4_s8_b32(",
                "embedding_h320_v320_q4(",
                "gemv_glu_k320_n512_r2_silu_u8(",
                "gemm_skinny_k320_n320_t8_u8(",
                "gemv_k320_n320_r1_q4(",
            ],
        ),
        (
            "qwen3",
            "qwen3",
            &["embedding_h256_v320_s8(", "gemv_k256_n512_256_256_r1_norm_f32_q4(", "gemv_k256_n320_r1_s8("],
        ),
    ];
    for (model, file, kernels) in ggufs {
        let gguf = fixture("tiny-kquant").join(format!("{file}.gguf"));
        let b = compile_to(model, &gguf, &dir.join(format!("{file}-gguf.bundle")), |_| {});
        has_kernels(&b, kernels);
        runs.push(vec![b.display().to_string()]);
    }
    let shapes = [
        ("qwen2", "tests/configs/qwen2.5-0.5b.json", "bf16"),
        ("qwen2", "tests/configs/qwen2.5-7b.json", "bf16"),
        ("qwen2", "tests/configs/qwen2.5-7b.json", "f16"),
        ("qwen3", "tests/configs/qwen3-8b.json", "bf16"),
        ("qwen3", "tests/fixtures/tiny-qwen3/config.json", "bf16"),
        // Maps (embedding scale, GeLU, final soft-capping), soft-capped and windowed attention
        // at head_dim 256 (no tensor-core extend kernel) and 32.
        ("gemma2", "tests/configs/gemma-2-9b.json", "bf16"),
        ("gemma2", "tests/fixtures/tiny-gemma2/config.json", "bf16"),
        ("mistral", "tests/configs/mistral-7b.json", "bf16"),
        ("mistral", "tests/fixtures/tiny-mistral/config.json", "f16"),
        // Per-head (1 + w) norms and a RoPE per layer type; RoPE on half of each head.
        ("gemma3", "tests/fixtures/tiny-gemma3/config.json", "bf16"),
        ("phi3", "tests/fixtures/tiny-phi3/config.json", "bf16"),
        // Head sizes that are not powers of two: 96 (Phi-3-mini), 80 with 32 of them rotated.
        ("phi3", "tests/configs/phi-3-mini.json", "bf16"),
        ("phi3", "tests/configs/phi3-head80.json", "bf16"),
        // Mixtures of experts: routing, gated experts (SwiGLU; gpt-oss's clamped one with biases),
        // attention sinks; the Qwen3-30B-A3B shape (128 experts, 8 per token).
        ("qwen3_moe", "tests/fixtures/tiny-qwen3-moe/config.json", "bf16"),
        ("qwen3_moe", "tests/configs/qwen3-30b-a3b.json", "bf16"),
        ("mixtral", "tests/fixtures/tiny-mixtral/config.json", "f16"),
        ("gpt_oss", "tests/fixtures/tiny-gpt-oss/config.json", "bf16"),
    ];
    for (model, config, dtype) in shapes {
        for tp in ["1", "2"] {
            let config = repo().join(config).display().to_string();
            let model = repo().join(format!("models/{model}.yaml")).display().to_string();
            let dtype = dtype.to_string();
            runs.push(vec![
                "--model".into(),
                model,
                "--config".into(),
                config,
                "--tp".into(),
                tp.into(),
                "--dtype".into(),
                dtype,
            ]);
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

/// `engc cuda-check --quant fp8 --launches T --launches-to FILE` writes the launches of a T-token
/// step of the shape with its linears in E4M3 (kernel, blocks, threads, dynamic shared memory):
/// at one token the 7B's q|k|v and o GEMVs (two warps an output, four outputs a block), at 64
/// decode attention's four-warp blocks with their stages (three of K and V tiles a warp).
#[test]
fn cuda_check_writes_a_steps_launches() {
    let lib = nvrtc_lib();
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "cuda-launches");
    let config = repo().join("tests/configs/qwen2.5-7b-l2.json").display().to_string();
    let model = repo().join("models/qwen2.yaml").display().to_string();
    for (t, quant, lines) in [
        (
            "1",
            Some("fp8"),
            &["gemv_k3584_n3584_512_512_r1_f8\t1152\t256\t0", "gemv_k3584_n3584_r1_f8\t896\t256\t0"][..],
        ),
        (
            "64",
            None,
            &["attention_dec_h28_kv4_d128_to_bf16_mixed_x1_w4_rope_11_ld4608_4608_4608\t256\t128\t104448"][..],
        ),
    ] {
        let file = dir.join(format!("launches-{t}.tsv"));
        let mut args = vec!["--model", &model, "--config", &config, "--launches", t, "--launches-to"];
        let path = file.display().to_string();
        args.push(&path);
        if let Some(q) = quant {
            args.extend(["--quant", q]);
        }
        let o = cuda_check(&args, Some(&lib));
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        let table = std::fs::read_to_string(&file).unwrap();
        assert!(table.lines().all(|l| l.split('\t').count() >= 4), "{table}");
        for line in lines {
            assert!(table.lines().any(|l| l == *line), "no `{line}` in {table}");
        }
    }
}

/// Without NVRTC on the library path, `engc cuda-check` says so; where a system-wide NVRTC is
/// found instead, the kernels must compile.
#[test]
fn missing_nvrtc_is_a_clear_error() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "cuda-missing");
    let b = compile_fixture("tiny-llama", &dir, 1, None);
    let o = cuda_check(&[b.to_str().unwrap()], None);
    if o.status.success() {
        assert!(String::from_utf8_lossy(&o.stdout).starts_with("compiled"), "{}", stderr(&o));
    } else {
        assert!(stderr(&o).contains("NVRTC library (libnvrtc.so) was not found"), "{}", stderr(&o));
    }
}

/// `engrun logits ... -o OUT` on CUDA either fails with one of the `clear` messages (no GPU, as
/// in CI) or succeeds with logits equal to the CPU backend's (bf16 tolerance): never passes
/// without looking at the result.
fn cuda_logits_or_clear_error(
    o: &std::process::Output,
    bundle: &std::path::Path,
    out: &std::path::Path,
    clear: &[&str],
) {
    if !o.status.success() {
        let e = stderr(o);
        assert!(clear.iter().any(|c| e.contains(c)), "{e}");
        return;
    }
    let cpu = out.with_extension("cpu.safetensors");
    let c = run(
        "engrun",
        &["logits", bundle.to_str().unwrap(), "--device", "cpu", "--ids", "1,2", "-o", cpu.to_str().unwrap()],
    );
    assert!(c.status.success(), "{}", stderr(&c));
    let ((gs, got), (ws, want)) = (read_f32(out, "logits"), read_f32(&cpu, "logits"));
    assert_eq!(gs, ws);
    assert!(rel_err(&got, &want) < 3e-2, "CUDA logits differ from the CPU's by {}", rel_err(&got, &want));
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
    cuda_logits_or_clear_error(&o, &b, &out, &["CUDA driver (libcuda.so) was not found", "no usable GPU"]);
}

fn plan(shape: &str, tp: usize) -> ir::Plan {
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(repo().join(format!("tests/configs/{shape}.json"))).unwrap())
            .unwrap();
    compiler::plan_for_config(&repo().join("models/qwen2.yaml"), &config, tp, ir::DType::BF16).unwrap()
}

/// The launches of a step of `t` tokens (and `t` logit rows).
/// Kernel `name`'s `extern "C"` line in the program's source and how many parameters it takes
/// (those after the name: a `__launch_bounds__(..)` before it is not a parameter list).
fn kernel_params<'a>(p: &'a codegen_cuda::Program, name: &str) -> (&'a str, usize) {
    let src = p.source.lines().find(|s| s.contains(&format!(" {name}("))).unwrap();
    let params = src.split_once(&format!(" {name}(")).unwrap().1.split_once(')').unwrap().0;
    (src, params.split(',').count())
}

fn launches(p: &codegen_cuda::Program, t: usize) -> Vec<&codegen_cuda::Launch> {
    p.steps
        .iter()
        .flat_map(|s| match s {
            codegen_cuda::Step::Kernels { variants, .. } => {
                variants.iter().find(|(max, _)| t <= *max).map(|(_, l)| l.iter().collect()).unwrap_or_default()
            }
            codegen_cuda::Step::AllReduce { .. } | codegen_cuda::Step::AllGather { .. } => vec![],
        })
        .collect()
}

/// The schedule's fusions and buffer plan on the Qwen2.5 shapes: eight launches per layer at
/// batch 1 (add+norm, q/k/v, RoPE+KV write, attention, o, add+norm, gate/up+silu·mul, down),
/// buffers reused across layers, and every launch's arguments matching its kernel's parameters.
#[test]
fn cuda_schedule_fuses_and_reuses_buffers() {
    for (shape, layers) in [("qwen2.5-0.5b", 24), ("qwen2.5-7b", 28)] {
        for tp in [1, 2] {
            let plan = plan(shape, tp);
            let p = codegen_cuda::emit(&plan).unwrap();
            let one = launches(&p, 1);
            // Up to NORM_IN_GEMV_ROWS tokens, the GEMVs of launches streaming at most 24 MB
            // apply the layers' norms themselves: all of the 0.5B shape's; of the 7B shape's,
            // only a rank's QKV at tp=2 (the final norm feeds the logits' gather). Above, each
            // norm is its own launch.
            let norms = |t| launches(&p, t).iter().filter(|l| l.key.name().contains("rms_norm")).count();
            let left = match (shape, tp) {
                ("qwen2.5-0.5b", _) => 0,
                (_, 1) => 2,
                _ => 1,
            };
            assert_eq!(norms(codegen_cuda::NORM_IN_GEMV_ROWS), left * layers + 1, "{shape} tp{tp}");
            assert_eq!(norms(codegen_cuda::NORM_IN_GEMV_ROWS + 1), 2 * layers + 1, "{shape} tp{tp}");
            assert!(one.len() <= (5 + left) * layers + 5, "{shape} tp{tp}: {} launches at batch 1", one.len());
            assert!(p.buffers.len() <= 16, "{shape} tp{tp}: {} buffers", p.buffers.len());
            let allreduces = p.steps.iter().filter(|s| matches!(s, codegen_cuda::Step::AllReduce { .. })).count();
            assert_eq!(allreduces, if tp > 1 { 2 * layers } else { 0 }, "{shape} tp{tp}");
            // The 7B shape's own lm_head is split by vocabulary (the 0.5B's is the embedding).
            let gathers = p.steps.iter().filter(|s| matches!(s, codegen_cuda::Step::AllGather { .. })).count();
            assert_eq!(gathers, usize::from(tp > 1 && shape == "qwen2.5-7b"), "{shape} tp{tp}");
            let skinny = *codegen_cuda::SKINNY_ROWS.last().unwrap();
            for t in [1, 3, 8, 16, 40, 64, 65, 128, 129, 4096] {
                let kinds: Vec<String> = launches(&p, t).iter().map(|l| l.key.name()).collect();
                let want = match t {
                    0..=codegen_cuda::GEMV_MAX_ROWS => "gemv_",
                    t if t <= skinny => "gemm_skinny_",
                    _ => "gemm_k",
                };
                assert!(kinds.iter().any(|k| k.starts_with(want)), "{shape} t={t}: {kinds:?}");
                for l in launches(&p, t) {
                    let (src, params) = kernel_params(&p, &l.key.name());
                    assert_eq!(params, l.args.len(), "{}: {src}", l.key.name());
                    for a in &l.args {
                        match *a {
                            codegen_cuda::Arg::Buf(b) => assert!(b < p.buffers.len()),
                            codegen_cuda::Arg::BufAt(b, at) => assert!(at < p.buffers[b].row_bytes),
                            codegen_cuda::Arg::Weight(w) => {
                                assert!(matches!(plan.nodes[w].op, ir::Op::Weight { .. }), "{}", l.key.name())
                            }
                            codegen_cuda::Arg::Const(c) => assert!(c < p.constants.len()),
                            _ => {}
                        }
                    }
                }
            }
        }
    }
}

/// A launch of several linears (q, k, v; gate and up) writes one packed matrix: the first
/// linear's output at the buffer's start, the next ones from their column offsets, rows of all
/// their columns; rope_kv reads q, k and v there with that row stride, glu_mul gate and up.
#[test]
fn linears_of_one_launch_write_one_packed_matrix() {
    use codegen_cuda::{Arg, KernelKey};
    for tp in [1, 2] {
        let plan = plan("qwen2.5-7b", tp);
        let p = codegen_cuda::emit(&plan).unwrap();
        for t in [1, 3, 16, 64, 200] {
            let ls = launches(&p, t);
            let (mut qkv, mut glu) = (0, 0);
            for (i, l) in ls.iter().enumerate() {
                let n = match l.key {
                    KernelKey::Gemv { n, .. } | KernelKey::GemmSkinny { n, .. } | KernelKey::Gemm { n, .. } => n,
                    _ => continue,
                };
                if n[1] == 0 {
                    continue;
                }
                // The arguments end with (weight, bias, output) of each linear, then T.
                let o = |g: usize| l.args[l.args.len() - 8 + 3 * g];
                let Arg::Buf(out) = o(0) else { panic!("{}: output {:?}", l.key.name(), o(0)) };
                let ntot: usize = n.iter().sum();
                assert!(p.buffers[out].row_bytes >= 4 * ntot, "{}", l.key.name());
                assert_eq!(o(1), Arg::BufAt(out, 4 * n[0]), "{}", l.key.name());
                let outs: Vec<Arg> = if n[2] > 0 {
                    assert_eq!(o(2), Arg::BufAt(out, 4 * (n[0] + n[1])), "{}", l.key.name());
                    vec![o(0), o(1), o(2)]
                } else {
                    vec![o(0), o(1)]
                };
                let next = ls[i + 1..].iter().find(|r| outs.iter().all(|o| r.args.contains(o))).unwrap();
                match next.key {
                    KernelKey::RopeKv { rope, .. } => {
                        assert_eq!(rope.ld, [ntot; 3]);
                        assert_eq!(next.args[..3], outs[..]);
                        // Steps of 64 rows and more run decode attention on tensor cores, which
                        // rotates the rows alone in their sequence itself from the same q, k
                        // and v, so rope_kv has nothing of a decode step's.
                        let dec = ls[i + 1..].iter().find(|l| matches!(l.key, KernelKey::AttentionDec(_)));
                        let dec = dec.filter(|d| d.args[..3] == outs[..]);
                        assert_eq!(dec.is_some(), t >= 2, "t={t}: {}", next.key.name());
                        assert_eq!(next.idle_in_decode, t >= 2, "t={t}: {}", next.key.name());
                        if let Some(dec) = dec {
                            assert!(matches!(dec.key, KernelKey::AttentionDec(a) if a.rope == Some(rope)));
                        }
                        qkv += 1;
                    }
                    KernelKey::GluMul { n: half, .. } => {
                        assert_eq!(2 * half, ntot);
                        assert_eq!(next.args[..2], outs[..]);
                        glu += 1;
                    }
                    KernelKey::AttentionRope1 { .. } if t == 1 => {
                        assert_eq!(next.args[..3], outs[..]);
                        qkv += 1;
                    }
                    _ => panic!("t={t}: {} reads {}", next.key.name(), l.key.name()),
                }
            }
            assert_eq!(qkv, 28, "tp{tp} t={t}: q/k/v launches");
            // Gate and up: the GEMV with the product fused up to its rows, then GEMM + glu_mul.
            assert_eq!(glu, if t <= codegen_cuda::GEMV_MAX_ROWS { 0 } else { 28 }, "tp{tp} t={t}: gate/up launches");
        }
    }
}

/// A mixture of 16-bit experts (the Qwen3-30B-A3B shape) runs the direct kernels up to
/// `MOE_DIRECT_TOKENS` tokens (the routing inside gate/up, no sort, no separate routing
/// launch) and the grouped kernels above (the pairs sorted by expert, one grid row per
/// possible tile), never the per-pair ones: a warp per feature up to 8 pairs an expert on
/// average (128 tokens of 128 experts choosing 8), tensor cores above; each launch's arguments
/// match its kernel.
#[test]
fn cuda_moe_schedule_groups_pairs_above_the_direct_tokens() {
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(repo().join("tests/configs/qwen3-30b-a3b.json")).unwrap())
            .unwrap();
    let plan = compiler::plan_for_config(&repo().join("models/qwen3_moe.yaml"), &config, 1, ir::DType::BF16).unwrap();
    let p = codegen_cuda::emit(&plan).unwrap();
    let rows = codegen_cuda::moe_rows_max(128, 8);
    assert_eq!(rows, 128);
    for t in [1, 2, 3, 4, rows, rows + 1, 4096] {
        let ls = launches(&p, t);
        let has = |prefix: &str| ls.iter().any(|l| l.key.name().starts_with(prefix));
        let direct = t <= codegen_cuda::MOE_DIRECT_TOKENS;
        let kinds = (has("moe_up_h"), has("moe_up_direct_"), has("moe_up_rows_"), has("moe_up_grouped_"));
        assert_eq!(kinds, (false, direct, !direct && t <= rows, t > rows), "t={t}");
        assert_eq!((has("moe_route_"), has("moe_sort_"), has("moe_combine_")), (!direct, !direct, !direct), "t={t}");
        for l in ls.iter().filter(|l| l.key.name().starts_with("moe_")) {
            let (src, params) = kernel_params(&p, &l.key.name());
            assert_eq!(params, l.args.len(), "{}: {src}", l.key.name());
            if l.key.name().starts_with("moe_up_grouped_") || l.key.name().starts_with("moe_up_rows_") {
                // 128 experts, 8 a token: at most ceil(8t / 64) + min(128, 8t) tiles.
                let tiles = l.grid[1].size(|_| t);
                assert_eq!(tiles, (8 * t).div_ceil(codegen_cuda::MOE_TILE) + (8 * t).min(128), "t={t}");
            }
        }
    }
}

#[test]
fn unsupported_head_dim_is_a_clear_error() {
    let config: serde_json::Value = serde_json::json!({
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 216, "intermediate_size": 512,
        "num_attention_heads": 3, "num_key_value_heads": 1, "num_hidden_layers": 1, "vocab_size": 1000,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": true
    });
    let plan = compiler::plan_for_config(&repo().join("models/qwen2.yaml"), &config, 1, ir::DType::BF16).unwrap();
    let e = codegen_cuda::emit(&plan).unwrap_err().to_string();
    assert!(e.contains("head_dim 72") && e.contains("multiples of 16"), "{e}");
}

/// Without `--device`, a bundle runs on the GPU when one is usable and on the CPU otherwise;
/// `--mem-fraction` outside (0, 1] is refused.
#[test]
fn auto_device_and_mem_fraction() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "cuda-auto");
    let b = compile_fixture("tiny-llama", &dir, 1, None);
    let out = dir.join("logits.safetensors");
    let o = run("engrun", &["logits", b.to_str().unwrap(), "--ids", "1,2", "-o", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains(" on Cpu in ") || stderr(&o).contains(" on Cuda in "), "{}", stderr(&o));
    let o = run("engrun", &["bench", b.to_str().unwrap(), "--num-prompts", "1", "--mem-fraction", "1.5"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("mem-fraction must be in (0, 1], got 1.5"), "{}", stderr(&o));
}

/// A tp=2 bundle on CUDA needs one GPU per rank: `--devices` naming the wrong number of GPUs
/// is refused before anything loads; without a GPU the error says so; on the CPU it runs.
#[test]
fn tp_bundle_placement_errors() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "cuda-tp");
    let b = compile_fixture("tiny-qwen2", &dir, 2, None);
    let out = dir.join("logits.safetensors");
    let args = |extra: &[&'static str]| {
        let mut a = vec!["logits", b.to_str().unwrap(), "--ids", "1,2", "-o", out.to_str().unwrap()];
        a.extend_from_slice(extra);
        run("engrun", &a)
    };
    let o = args(&["--device", "cuda", "--devices", "0"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--devices names 1 GPU(s) but the bundle has tp=2"), "{}", stderr(&o));
    let o = args(&["--device", "cuda"]);
    let clear = ["CUDA driver (libcuda.so) was not found", "this machine has", "NCCL", "no usable GPU"];
    cuda_logits_or_clear_error(&o, &b, &out, &clear);
    let o = args(&["--device", "cpu"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// What runs is what the bundle carries: the CUDA generated at load must be the bundle's
/// `kernels/model.cu` byte for byte, and a bundle whose source another `engc` wrote (here: one
/// line changed) is refused, naming the line and the remedy.
#[test]
fn the_bundle_carries_the_cuda_that_runs() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "cuda-carried");
    let b = bundle::Bundle::open(&compile_fixture("tiny-qwen2", &dir, 1, None)).unwrap();
    let carried = b.kernel_source().unwrap().expect("engc writes kernels/model.cu");
    let program = codegen_cuda::emit_for_bundle(&b.plan, Some(&carried)).unwrap();
    assert_eq!(program.source, carried);
    let mut lines: Vec<&str> = carried.lines().collect();
    lines[3] = "// written by another engc";
    let other = lines.join("\n");
    let e = codegen_cuda::emit_for_bundle(&b.plan, Some(&other)).unwrap_err().to_string();
    assert!(e.contains("line 4") && e.contains("engc compile"), "{e}");
}

/// Fusion works for the ops Gemma 2 adds: its batch-1 decode step has at most 1.3 times
/// Qwen2's launches per layer (issue 18), on the 9B and 7B shapes (no weights needed: the
/// programs of their plans).
#[test]
fn gemma2_launches_per_layer_are_within_qwen2s() {
    let per_layer = |model: &str, config: &str| {
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(repo().join(config)).unwrap()).unwrap();
        let plan = compiler::plan_for_config(&repo().join(model), &cfg, 1, ir::DType::BF16).unwrap();
        let p = codegen_cuda::emit(&plan).unwrap();
        p.launches(1) as f64 / plan.kv.layers as f64
    };
    let gemma = per_layer("models/gemma2.yaml", "tests/configs/gemma-2-9b.json");
    let qwen = per_layer("models/qwen2.yaml", "tests/configs/qwen2.5-7b.json");
    assert!(gemma <= 1.3 * qwen, "Gemma-2-9B {gemma:.2} launches per layer, Qwen2.5-7B {qwen:.2}");
    // With the GLU's activation and the norm + add + norm fused, the two are the same (a
    // missing fusion of either kind shows here before it reaches the 1.3 bound).
    assert!(gemma <= qwen + 0.1, "Gemma-2-9B {gemma:.2} launches per layer, Qwen2.5-7B {qwen:.2}");
    assert!(qwen < 7.5, "Qwen2.5-7B: {qwen:.2} launches per layer (7.1 when its fusions apply)");
}
