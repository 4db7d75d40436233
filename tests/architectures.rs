//! The architectures written in YAML alone (`models/gemma2.yaml`, `gemma3.yaml`,
//! `mistral.yaml`, `phi3.yaml`, and the mixtures of experts `qwen3_moe.yaml`, `mixtral.yaml`,
//! `gpt_oss.yaml`) under tensor parallelism on the CPU: `--tp 2` gives tp 1's logits for a
//! prompt longer than their sliding windows (48 in the fixtures), prefill and decode. Against
//! HF: `tests/long_reference.rs`; NVRTC: `tests/cuda.rs`.

use e2e::*;
use ir::Op;

/// (fixture, model YAML).
const MODELS: [(&str, &str); 7] = [
    ("tiny-gemma2", "gemma2"),
    ("tiny-gemma3", "gemma3"),
    ("tiny-mistral", "mistral"),
    ("tiny-phi3", "phi3"),
    ("tiny-qwen3-moe", "qwen3_moe"),
    ("tiny-mixtral", "mixtral"),
    ("tiny-gpt-oss", "gpt_oss"),
];

/// Each rank holds half of every split weight, Phi-3's parts of its fused tensors included
/// (rows of `qkv_proj` cut per part, then per rank), and the logits of a 120-token prompt and
/// four decode steps equal tp 1's within 1e-4.
#[test]
fn tp2_matches_tp1_on_the_cpu() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "architectures-tp");
    for (fixture, model) in MODELS {
        let ckpt = repo_fixture(fixture);
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(ckpt.join("reference.json")).unwrap()).unwrap();
        let prompt = ids(&meta["prompt"])[..120].to_vec();
        let one = compile_checkpoint(model, &ckpt, &dir.join(model), 1, None);
        let two = compile_checkpoint(model, &ckpt, &dir.join(model), 2, None);
        let plan = bundle::Bundle::open(&two).unwrap().plan;
        let heads: Vec<(usize, usize)> = plan
            .nodes
            .iter()
            .filter_map(|n| match n.op {
                Op::Attention { heads, kv_heads, .. } => Some((heads, kv_heads)),
                _ => None,
            })
            .collect();
        assert!(heads.iter().all(|&h| h == (2, 1)), "{model}: per-rank heads {heads:?}");
        let decode = [11, 400, 7, 123];
        let want = prefill_then_decode(&mut cpu_sequences(&one), &prompt, &decode);
        let got = prefill_then_decode(&mut cpu_sequences(&two), &prompt, &decode);
        for (step, (g, w)) in got.iter().zip(&want).enumerate() {
            let err = rel_err(g, w);
            assert!(err < 1e-4, "{model} tp=2 step {step}: rel err {err}");
        }
        eprintln!("{model}: tp 2 = tp 1 over {} steps", want.len());
    }
}

/// Phi-3's q, k and v are rows of one checkpoint tensor: the plan names each part by its rows,
/// and a part that runs past the tensor is refused with the tensor's name.
#[test]
fn fused_tensor_parts_are_named_by_their_rows() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "architectures-rows");
    let b = compile_checkpoint("phi3", &repo_fixture("tiny-phi3"), &dir, 1, None);
    let plan = bundle::Bundle::open(&b).unwrap().plan;
    let names: Vec<&str> = plan.weights().map(|(n, _, _)| n).filter(|n| n.starts_with("model.layers.0.")).collect();
    for part in [
        "model.layers.0.self_attn.qkv_proj.weight[0:128]",
        "model.layers.0.self_attn.qkv_proj.weight[128:192]",
        "model.layers.0.self_attn.qkv_proj.weight[192:256]",
        "model.layers.0.mlp.gate_up_proj.weight[0:128]",
        "model.layers.0.mlp.gate_up_proj.weight[128:256]",
    ] {
        assert!(names.contains(&part), "{part} not in {names:?}");
    }
    let yaml = std::fs::read_to_string(repo().join("models/phi3.yaml")).unwrap();
    let bad = dir.join("bad.yaml");
    std::fs::write(
        &bad,
        yaml.replace("rows: [intermediate, 2 * intermediate]", "rows: [2 * intermediate, 3 * intermediate]"),
    )
    .unwrap();
    let opts = compiler::CompileOptions {
        model: bad,
        checkpoint: repo_fixture("tiny-phi3"),
        tp: 1,
        dtype: None,
        tokenizer: None,
        out: dir.join("bad.bundle"),
        dump_after: None,
        quant: None,
        lm_head: compiler::LmHead::default(),
    };
    let err = compiler::compile(&opts).unwrap_err().to_string();
    assert!(err.contains("gate_up_proj.weight[256:384]") && err.contains("[384, 128]"), "{err}");
}
