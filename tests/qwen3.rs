//! Qwen3 by `models/qwen3.yaml` alone: its per-head q/k RMS norms (a `[head_dim]` weight on
//! `[T, heads · head_dim]`) through tensor parallelism on the CPU (`--tp 2` and `--tp 4` give
//! tp 1's logits on `tests/fixtures/tiny-qwen3`), configs of transformers 4.x and 5.x binding
//! to one plan, and the CUDA schedule normalising each head (one block per head, never folded
//! into a GEMV's whole-row norm). Against HF: `tests/long_reference.rs`; NVRTC: `tests/cuda.rs`.

use codegen_cuda::{Count, Dim, KernelKey, Step};
use e2e::*;
use ir::{DType, Op, Plan};

/// Prefill of a prompt (every position), then four decode steps, as logits.
fn run(s: &mut runtime::Sequences, prompt: &[u32]) -> Vec<Vec<f32>> {
    prefill_then_decode(s, prompt, &[11, 400, 7, 123])
}

/// The q and k norms of `plan`: (features normalised per token, group size), by weight name.
fn head_norms(plan: &Plan) -> Vec<(String, usize, usize)> {
    plan.nodes
        .iter()
        .filter(|n| matches!(n.op, Op::RmsNorm { .. }))
        .filter_map(|n| match &plan.nodes[n.inputs[1]].op {
            Op::Weight { name, shape, .. } if name.contains("q_norm") || name.contains("k_norm") => {
                Some((name.clone(), n.ty.last().unwrap_or(0), shape[0]))
            }
            _ => None,
        })
        .collect()
}

/// tp 2 splits the 4 query / 2 KV heads of 32 into 2 / 1 per rank, tp 4 into 1 / 1 (a KV head
/// replicated): every rank normalises its own heads with the whole `[32]` norm weights, and the
/// logits (prefill and decode) are tp 1's.
#[test]
fn tp_bundles_match_tp1_on_the_cpu() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "qwen3-tp");
    let ckpt = repo_fixture("tiny-qwen3");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("reference.json")).unwrap()).unwrap();
    let prompt = ids(&meta["prompt"])[..48].to_vec();
    let want = run(&mut cpu_sequences(&compile_checkpoint("qwen3", &ckpt, &dir, 1, None)), &prompt);
    for (tp, q, k) in [(2, 64, 32), (4, 32, 32)] {
        let path = compile_checkpoint("qwen3", &ckpt, &dir, tp, None);
        let norms = head_norms(&bundle::Bundle::open(&path).unwrap().plan);
        assert_eq!(norms.len(), 4, "tp={tp}: two layers' q and k norms: {norms:?}");
        for (name, cols, group) in &norms {
            let per_rank = if name.contains("q_norm") { q } else { k };
            assert_eq!((*cols, *group), (per_rank, 32), "tp={tp} {name}");
        }
        let got = run(&mut cpu_sequences(&path), &prompt);
        for (step, (g, w)) in got.iter().zip(&want).enumerate() {
            let err = rel_err(g, w);
            assert!(err < 1e-4, "tp={tp} step {step}: rel err {err}");
            eprintln!("qwen3 tp={tp} step {step}: rel err {err:.1e}");
        }
    }
}

/// Qwen3-8B's config as transformers 4.x wrote it (`tests/configs/qwen3-8b.json`).
fn qwen3_8b() -> serde_json::Value {
    let text = std::fs::read_to_string(repo().join("tests/configs/qwen3-8b.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn plan(config: &serde_json::Value, tp: usize) -> Plan {
    compiler::plan_for_config(&repo().join("models/qwen3.yaml"), config, tp, DType::BF16).unwrap()
}

/// The 4.x config (`rope_theta`, `rope_scaling: null`) and its 5.x form (`rope_parameters`)
/// give one plan: RoPE base 1e6 (not the YAML's default), 32 query / 8 KV heads of 128 with
/// per-head norms of 128 on q's 4096 and k's 1024 features.
#[test]
fn transformers_4_and_5_configs_bind_alike() {
    let v4 = qwen3_8b();
    let mut v5 = v4.clone();
    let o = v5.as_object_mut().unwrap();
    let theta = o.remove("rope_theta").unwrap();
    o.remove("rope_scaling");
    o.insert("rope_parameters".into(), serde_json::json!({ "rope_type": "default", "rope_theta": theta }));
    o.insert("transformers_version".into(), "5.23.0".into());
    let p4 = plan(&v4, 1);
    assert_eq!(p4, plan(&v5, 1), "4.x and 5.x configs bind differently");
    let rope = p4.nodes.iter().find_map(|n| match &n.op {
        Op::Rope { theta, head_dim, .. } => Some((*theta, *head_dim)),
        _ => None,
    });
    assert_eq!(rope, Some((1e6, 128)));
    let attention = p4.nodes.iter().find(|n| matches!(n.op, Op::Attention { .. })).unwrap();
    assert!(matches!(attention.op, Op::Attention { heads: 32, kv_heads: 8, head_dim: 128, .. }), "{:?}", attention.op);
    let norms = head_norms(&p4);
    assert_eq!(norms.len(), 72, "36 layers' q and k norms");
    for (name, cols, group) in norms {
        let want = if name.contains("q_norm") { 4096 } else { 1024 };
        assert_eq!((cols, group), (want, 128), "{name}");
    }
}

/// On CUDA the per-head q/k norms run inside the RoPE + KV-write kernels (the rope_attention
/// fusion takes them: no norm launch of a head's width is left, and every layer's one-token
/// and multi-token RoPE kernels normalise both q and k), while the layer norms stay one block
/// per token (and the tiny shape's batch-1 GEMVs still apply them themselves): the 8B shape
/// and the tiny fixture's, tp 1 and 2.
#[test]
fn cuda_normalises_each_head_inside_the_rope_kernels() {
    let tiny = std::fs::read_to_string(repo_fixture("tiny-qwen3").join("config.json")).unwrap();
    let tiny: serde_json::Value = serde_json::from_str(&tiny).unwrap();
    // config, layers, hidden, head_dim, whether batch-1 GEMVs must apply a layer norm (the 8B
    // shape's weights are mostly above NORM_MAX_WEIGHT_BYTES)
    for (config, layers, hidden, d, fused) in [(qwen3_8b(), 36, 4096, 128, false), (tiny, 2, 64, 32, true)] {
        for tp in [1, 2] {
            let program = codegen_cuda::emit(&plan(&config, tp)).unwrap();
            let (mut normed_ropes, mut fused_gemvs) = (0, 0);
            let launches = program.steps.iter().flat_map(|s| match s {
                Step::Kernels { variants, .. } => variants.clone(),
                _ => vec![],
            });
            for l in launches.flat_map(|(_, ls)| ls) {
                match l.key {
                    KernelKey::AddRmsNorm { h, .. } if h == d => panic!("{hidden} tp={tp}: a head norm launch"),
                    KernelKey::AddRmsNorm { h, .. } => {
                        assert_eq!((h, l.grid[0]), (hidden, Dim::Per(Count::Tokens, 1, 1)), "{hidden} tp={tp}")
                    }
                    KernelKey::RopeKv { rope: codegen_cuda::RopeShape { norm, .. }, .. }
                    | KernelKey::AttentionRope1 { norm, .. } => {
                        assert!(norm.q.is_some() && norm.k.is_some(), "{hidden} tp={tp}: {:?}", l.key);
                        normed_ropes += 1
                    }
                    // Decode attention normalises and rotates the rows alone in their sequence
                    // with the same norms.
                    KernelKey::AttentionDec(a) => {
                        let norm = a.rope.map(|r| r.norm).unwrap_or_default();
                        assert!(norm.q.is_some() && norm.k.is_some(), "{hidden} tp={tp}: {:?}", l.key);
                    }
                    KernelKey::Gemv { norm: Some(_), .. } | KernelKey::GemvGlu { norm: Some(_), .. } => {
                        fused_gemvs += 1
                    }
                    _ => {}
                }
            }
            // Each layer: the one-token kernel, and rope_kv in every multi-token variant (per-row
            // attention, and tensor-core attention at each decode split count: heads of at most
            // 128).
            assert!(normed_ropes >= 3 * layers, "{hidden} tp={tp}: {normed_ropes} RoPE kernels that normalise");
            assert!(fused_gemvs > 0 || !fused, "{hidden} tp={tp}: no GEMV applies a layer norm");
        }
    }
}
