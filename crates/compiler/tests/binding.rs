//! Binding models/*.yaml to configs of both transformers styles, and lowering what they say
//! about RoPE, head_dim and tied embeddings.

use ir::{DType, Op, RopeScaling};
use serde_json::json;
use std::path::Path;

fn spec(name: &str) -> spec::ModelSpec {
    spec::ModelSpec::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models").join(name)).unwrap()
}

fn llama_config(extra: serde_json::Value) -> serde_json::Value {
    let mut c = json!({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 100, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096
    });
    c.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    c
}

fn ropes(cfg: serde_json::Value) -> Vec<(f64, RopeScaling, usize)> {
    let m = spec::bind(&spec("llama.yaml"), &cfg).unwrap();
    let g = compiler::lower::lower(&m, DType::F32, DType::BF16, &Default::default()).unwrap();
    g.verify().unwrap();
    g.nodes()
        .into_iter()
        .filter_map(|n| match &g.node(n).op {
            Op::Rope { theta, scaling, head_dim, .. } => Some((*theta, scaling.clone(), *head_dim)),
            _ => None,
        })
        .collect()
}

#[test]
fn transformers_4_and_5_styles_bind_alike() {
    let v4 = ropes(llama_config(json!({"rope_theta": 500000.0})));
    let v5 = ropes(llama_config(json!({"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}})));
    assert_eq!(v4, v5);
    assert_eq!(v4.len(), 4);
    assert_eq!(v4[0], (500000.0, RopeScaling::Default, 16), "head_dim derived as hidden / heads");
    let defaulted = ropes(llama_config(json!({})));
    assert_eq!(defaulted[0].0, 10000.0, "rope_theta default");
}

#[test]
fn head_dim_given_overrides_derivation() {
    let m = spec::bind(&spec("llama.yaml"), &llama_config(json!({"head_dim": 32}))).unwrap();
    assert_eq!(m.param("head_dim"), Some(&spec::Value::Int(32)));
    let q = m.weight("q_proj", Some(1)).unwrap();
    assert_eq!(q.shape, vec![4 * 32, 64]);
    assert_eq!(q.name, "model.layers.1.self_attn.q_proj.weight");
}

#[test]
fn rope_scaling_types_from_both_styles() {
    let llama3 = ropes(llama_config(
        json!({"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
    ));
    assert!(
        matches!(llama3[0].1, RopeScaling::Llama3 { factor, original_max_positions, .. } if factor == 8.0 && original_max_positions == 8192.0)
    );
    let linear = ropes(llama_config(json!({"rope_scaling": {"type": "linear", "factor": 2.0}})));
    assert_eq!(linear[0].1, RopeScaling::Linear { factor: 2.0 });
    let yarn = ropes(llama_config(
        json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 1024}}),
    ));
    assert_eq!(yarn[0].0, 1e6);
    assert!(
        matches!(yarn[0].1, RopeScaling::Yarn { factor, original_max_positions, beta_fast, .. } if factor == 4.0 && original_max_positions == 1024.0 && beta_fast == 32.0)
    );
    let m = spec::bind(
        &spec("llama.yaml"),
        &llama_config(json!({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})),
    )
    .unwrap();
    let err = compiler::lower::lower(&m, DType::F32, DType::F32, &Default::default()).unwrap_err().to_string();
    assert!(err.contains("unsupported rope scaling type `dynamic`") && err.contains("llama.yaml:"), "{err}");
}

#[test]
fn smollm2_config_binds_tied_and_biasless() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/smollm2-135m/config.json");
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let m = spec::bind(&spec("llama.yaml"), &cfg).unwrap();
    assert_eq!(m.layers, 30);
    assert_eq!(m.param("rope_theta"), Some(&spec::Value::Float(100000.0)));
    assert_eq!(m.weight("lm_head", None).unwrap().name, "model.embed_tokens.weight", "tied lm_head is the embedding");
    assert!(m.weight("q_bias", Some(0)).is_none(), "no attention bias");
    let g = compiler::lower::lower(&m, DType::F32, DType::F32, &Default::default()).unwrap();
    g.verify().unwrap();
    let plan = g.to_plan().unwrap();
    assert_eq!(plan.kv.layers, 30);
    assert_eq!((plan.kv.kv_heads, plan.kv.head_dim), (3, 64));
    assert_eq!(plan.weights().count(), 2 + 30 * 9);
}

#[test]
fn statement_errors_name_the_line() {
    let src = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/llama.yaml")).unwrap();
    let lower = |text: &str| {
        let s = spec::ModelSpec::parse(text, "bad.yaml").unwrap();
        let m = spec::bind(&s, &llama_config(json!({}))).unwrap();
        compiler::lower::lower(&m, DType::F32, DType::F32, &Default::default()).unwrap_err().to_string()
    };
    let err = lower(&src.replace("rms_norm(x, attn_norm, eps=eps)", "rms_norm(x, attn_norm, epsilon=eps)"));
    assert!(err.contains("bad.yaml:") && err.contains("no attribute `epsilon`"), "{err}");
    let err = lower(&src.replace("silu(linear(h, gate_proj, gate_bias))", "silu(linear(h, gate_proj, gate_bias), h)"));
    assert!(err.contains("`silu` takes 1 argument(s), got 2"), "{err}");
    let err = lower(&src.replace("x = x + linear(a, o_proj, o_bias)", "x = x + linear(a, o_projection, o_bias)"));
    assert!(err.contains("unknown name `o_projection`"), "{err}");
}
