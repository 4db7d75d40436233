//! compile → bundle → inspect / generate / logits, end to end through the CLIs.

use e2e::*;
use std::path::Path;

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn compile_cli(fixture_name: &str, out: &Path, extra: &[&str]) {
    let ck = fixture(fixture_name);
    let yaml = model_yaml(fixture_name);
    let mut args = vec!["compile", s(&yaml), "--checkpoint", s(&ck), "-o", s(out)];
    args.extend_from_slice(extra);
    let o = run("engc", &args);
    assert!(o.status.success(), "engc compile failed: {}", stderr(&o));
}

/// The tokens `params` may sample from `row` by the textbook rule: probabilities at the
/// temperature, sorted, the smallest most likely set holding `top_p` of the mass, less those
/// below `min_p` times the top one.
fn kept_by_sorting(row: &[f32], params: &runtime::SamplingParams) -> Vec<u32> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut p: Vec<(u32, f64)> = row
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, ((l as f64 - max) / params.temperature as f64).exp()))
        .collect();
    p.sort_by(|a, b| b.1.total_cmp(&a.1));
    let total: f64 = p.iter().map(|x| x.1).sum();
    let (mut acc, mut keep) = (0.0, 0);
    while keep < p.len() && acc < params.top_p as f64 * total {
        acc += p[keep].1;
        keep += 1;
    }
    p.truncate(keep);
    p.retain(|x| x.1 >= params.min_p as f64);
    p.into_iter().map(|x| x.0).collect()
}

#[test]
fn qwen2_compile_inspect_generate_logits() {
    let dir = tempfile::tempdir().unwrap();
    let b = dir.path().join("q.bundle");
    compile_cli("tiny-qwen2", &b, &[]);

    let o = run("engc", &["inspect", s(&b)]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && text.contains("qwen2") && text.contains("eos ids [976]"), "{text}");
    assert!(text.contains("fusions    add_norm x4, glu x2, linears x6, rope_attention x2"), "{text}");
    assert!(text.contains("cuda       14 launches per batch-1 decode step (7.0 per layer)"), "{text}");

    let gen = |extra: &[&str]| {
        let mut args =
            vec!["generate", s(&b), "--prompt", "What is the capital of France?", "--chat", "--max-tokens", "6"];
        args.extend_from_slice(extra);
        let o = run("engrun", &args);
        assert!(o.status.success(), "generate failed: {}", stderr(&o));
        assert!(stderr(&o).contains("generated"), "stats go to stderr");
        String::from_utf8(o.stdout).expect("generated text is UTF-8")
    };
    let greedy = gen(&["--temperature", "0"]);
    assert!(!greedy.trim().is_empty());
    assert_eq!(greedy, gen(&["--temperature", "0"]), "greedy is deterministic");
    let sampled = gen(&["--temperature", "1", "--seed", "5"]);
    assert_eq!(sampled, gen(&["--temperature", "1", "--seed", "5"]), "same seed, same text");
    // The random model's distribution is nearly flat: at temperature 1 a seed's six tokens
    // are practically never the greedy ones, nor another seed's (fixed seeds: no flakiness).
    assert_ne!(sampled, greedy, "a temperature samples");
    assert_ne!(sampled, gen(&["--temperature", "1", "--seed", "6"]), "the seed matters");

    // logits of the 5-token reference prompt through the CLI, against HF
    let prompt = ids(&goldens("tiny-qwen2")["prompts"][1]["ids"]);
    let list: Vec<String> = prompt.iter().map(u32::to_string).collect();
    let out = dir.path().join("logits.safetensors");
    let o = run("engrun", &["logits", s(&b), "--ids", &list.join(","), "--device", "ref", "-o", s(&out)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (shape, got) = read_f32(&out, "logits");
    let (_, want) = read_f32(&fixture("tiny-qwen2").join("reference/logits.safetensors"), "all_logits.5");
    assert_eq!(shape, vec![5, 1024]);
    assert!(rel_err(&got, &want) < 1e-4);

    // With a temperature every row is also sampled: on the host only here (no device, so no
    // comparison is reported), each row's number from a generator seeded 0.
    let sampled = ["--temperature", "0.8", "--top-p", "0.5", "--min-p", "0.01", "-o", s(&out)];
    let o = run("engrun", &[&["logits", s(&b), "--ids", &list.join(","), "--device", "ref"][..], &sampled].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let tokens = ids(&report["host_tokens"]);
    assert_eq!(
        report,
        serde_json::json!({"sampled_rows": 5, "on_device": false, "device_equal_host": null, "host_tokens": tokens})
    );
    let params = runtime::SamplingParams { temperature: 0.8, top_p: 0.5, min_p: 0.01, ..Default::default() };
    let mut gen0 = runtime::Sampler::new(params.clone()).unwrap();
    for (row, &t) in got.chunks_exact(1024).zip(&tokens) {
        assert_eq!(t, runtime::pick(row, &gen0.row()), "the host's rule with the generator seeded 0");
        assert!(kept_by_sorting(row, &params).contains(&t), "{t} is outside the top-p / min-p set");
    }
    let o = run("engrun", &["logits", s(&b), "--ids", "1", "--temperature", "1", "--top-p", "0", "-o", s(&out)]);
    assert!(!o.status.success() && stderr(&o).contains("top_p must be in (0, 1]"), "{}", stderr(&o));
}

#[test]
fn llama_with_borrowed_tokenizer_generates() {
    let dir = tempfile::tempdir().unwrap();
    let b = dir.path().join("l.bundle");
    let tok = fixture("tiny-llama").join("tokenizer");
    compile_cli("tiny-llama", &b, &["--tokenizer", s(&tok), "--dtype", "f32"]);
    let o = run("engrun", &["generate", s(&b), "--prompt", "Hello", "--chat", "--max-tokens", "4"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// `--tp 2` shards per rank; the per-rank weights concatenate back to the originals.
#[test]
fn tp2_shards_concatenate_back() {
    let dir = tempfile::tempdir().unwrap();
    let b = dir.path().join("q2.bundle");
    compile_cli("tiny-qwen2", &b, &["--tp", "2"]);
    let bundle = bundle::Bundle::open(&b).unwrap();
    assert_eq!(bundle.manifest.tp, 2);
    assert!(bundle.plan.nodes.iter().any(|n| matches!(n.op, ir::Op::AllReduce)));
    let ranks = [bundle.weights(0).unwrap(), bundle.weights(1).unwrap()];
    let orig = fixture("tiny-qwen2").join("model.safetensors");
    let bytes = std::fs::read(&orig).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut kinds = std::collections::BTreeMap::new();
    for name in ranks[0].names().unwrap() {
        let full = st.tensor(&name).unwrap();
        let shape = full.shape().to_vec();
        let (_, s0, d0) = ranks[0].raw(&name).unwrap();
        let (_, _s1, d1) = ranks[1].raw(&name).unwrap();
        let kind = if s0 == shape {
            assert_eq!(d0, full.data(), "{name} replicated on rank 0");
            assert_eq!(d1, full.data(), "{name} replicated on rank 1");
            "replicated"
        } else if s0[0] * 2 == shape[0] {
            assert_eq!([d0, d1].concat(), full.data(), "{name}: column shards");
            "column"
        } else {
            let (rows, half) = (shape[0], s0[1] * 2);
            assert_eq!(half, shape[1]);
            let row_bytes = s0[1] * 2;
            let mut joined = Vec::new();
            for r in 0..rows {
                joined.extend_from_slice(&d0[r * row_bytes..(r + 1) * row_bytes]);
                joined.extend_from_slice(&d1[r * row_bytes..(r + 1) * row_bytes]);
            }
            assert_eq!(joined, full.data(), "{name}: row shards");
            "row"
        };
        kinds.insert(name.clone(), kind);
    }
    assert_eq!(kinds["model.layers.0.self_attn.q_proj.weight"], "column");
    assert_eq!(kinds["model.layers.0.self_attn.k_proj.weight"], "replicated", "1 KV head is replicated on 2 ranks");
    assert_eq!(kinds["model.layers.0.mlp.down_proj.weight"], "row");
    assert_eq!(kinds["model.layers.1.self_attn.o_proj.weight"], "row");
}

/// A checkpoint split into `model-0000K-of-00002.safetensors` with an index compiles to the same
/// weights as the single file, and a tensor the model does not use is reported as a warning.
#[test]
fn sharded_checkpoint_loads_and_unused_tensors_warn() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixture("tiny-qwen2");
    let ck = dir.path().join("sharded");
    std::fs::create_dir_all(&ck).unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), ck.join(f)).unwrap();
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().cloned().collect();
    names.sort();
    let extra = vec![0u8; 16];
    let mut weight_map = serde_json::Map::new();
    for (k, part) in names.chunks(names.len() / 2 + 1).enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", k + 1);
        let mut views: Vec<(String, safetensors::tensor::TensorView)> =
            part.iter().map(|n| (n.clone(), st.tensor(n).unwrap())).collect();
        if k == 1 {
            views.push((
                "model.extra.weight".into(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![4], &extra).unwrap(),
            ));
        }
        for (n, _) in &views {
            weight_map.insert(n.clone(), file.clone().into());
        }
        safetensors::serialize_to_file(views, &None, &ck.join(&file)).unwrap();
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(ck.join("model.safetensors.index.json"), index.to_string()).unwrap();

    let b = dir.path().join("sharded.bundle");
    let yaml = model_yaml("tiny-qwen2");
    let o = run("engc", &["compile", s(&yaml), "--checkpoint", s(&ck), "-o", s(&b)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("warning: 1 checkpoint tensor(s) unused") && stderr(&o).contains("model.extra.weight"),
        "{}",
        stderr(&o)
    );
    let single = compile_fixture("tiny-qwen2", dir.path(), 1, None);
    let (a, b) = (bundle::Bundle::open(&single).unwrap(), bundle::Bundle::open(&b).unwrap());
    let (wa, wb) = (a.weights(0).unwrap(), b.weights(0).unwrap());
    let mut na = wa.names().unwrap();
    na.sort();
    assert_eq!(na.len(), 26);
    for n in na {
        assert_eq!(wa.raw(&n).unwrap(), wb.raw(&n).unwrap(), "{n}");
    }
}

/// `engrun bench --json` prints one JSON object with the agreed fields.
#[test]
fn bench_reports_json() {
    let dir = tempfile::tempdir().unwrap();
    let b = compile_fixture("tiny-llama", dir.path(), 1, None);
    let o = run(
        "engrun",
        &[
            "bench",
            s(&b),
            "--num-prompts",
            "3",
            "--input-len",
            "9",
            "--output-len",
            "4",
            "--random-range-ratio",
            "0.5",
            "--json",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    for key in ["requests", "input_tokens", "output_tokens", "duration_s", "output_tok_s", "ttft_ms_p50", "tpot_ms_p50"]
    {
        assert!(v.get(key).is_some(), "missing {key}: {v}");
    }
    assert_eq!(v["requests"], 3);
    // The decode step's roofline: the CPU measures no matmul rate, so the bound is the bytes'
    // time, and its fraction is the bandwidth fraction.
    let f = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k}: {v}"));
    assert!(f("decode_step_ms") > 0.0 && f("decode_memory_ms") > 0.0, "{v}");
    assert!(v["decode_compute_ms"].is_null() && v["matmul_tflop_s"].is_null(), "{v}");
    let (roof, bw) = (f("decode_roofline_fraction"), f("decode_bandwidth_fraction"));
    assert!(roof > 0.0 && (roof - bw).abs() <= 1e-9 * bw, "{v}");
    let out = v["output_tokens"].as_u64().unwrap();
    assert!((6..=12).contains(&out), "output lengths uniform in [2, 4]: {out}");
    let o = run("engrun", &["bench", s(&b), "--num-prompts", "0"]);
    assert!(!o.status.success() && stderr(&o).contains("num-prompts"));
    // --output-tokens: every request's tokens, the same for the same seed, not for another.
    let tokens = |seed: &str, name: &str| {
        let f = dir.path().join(name);
        let args =
            ["bench", s(&b), "--num-prompts", "3", "--input-len", "9", "--output-len", "5", "--temperature", "0.9"];
        let o = run("engrun", &[&args[..], &["--seed", seed, "--output-tokens", s(&f)]].concat());
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_str::<Vec<Vec<u32>>>(&std::fs::read_to_string(f).unwrap()).unwrap()
    };
    let (a, b2, c) = (tokens("4", "a.json"), tokens("4", "b.json"), tokens("5", "c.json"));
    assert_eq!(a.len(), 3);
    assert!(a.iter().all(|t| t.len() == 5), "{a:?}");
    assert_eq!(a, b2, "the same seed gives the same tokens");
    assert_ne!(a, c, "another seed other tokens");
    let o = run("engrun", &["bench", s(&b), "--num-prompts", "1", "--output-tokens", "/nonexistent/dir/t.json"]);
    assert!(!o.status.success() && stderr(&o).contains("/nonexistent/dir/t.json"), "{}", stderr(&o));
    // A shared prefix is computed once and then served from the radix cache (one prompt per
    // step; without overlap each step is planned after the previous one's prefix is cached).
    let args = ["bench", s(&b), "--num-prompts", "4", "--input-len", "40", "--output-len", "2", "--json"];
    let shared = [
        &args[..],
        &["--shared-prefix-len", "32", "--page-size", "1", "--max-prefill-tokens", "40", "--disable-overlap"],
    ]
    .concat();
    let o = run("engrun", &shared);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    assert_eq!(v["cached_tokens"], 3 * 32, "{v}");
    let o = run("engrun", &[&shared[..], &["--disable-radix-cache"]].concat());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    assert_eq!(v["cached_tokens"], 0, "{v}");
}

/// `engrun bench --regex` / `--json-schema`: every request carries the format, and every
/// generated token is one the format allows (checked again after the run); a format that does
/// not compile is an error naming it.
#[test]
fn bench_with_an_output_format() {
    let dir = tempfile::tempdir().unwrap();
    let b = compile_fixture("tiny-qwen2", dir.path(), 1, None);
    let schema = dir.path().join("schema.json");
    std::fs::write(
        &schema,
        r#"{"type": "array", "minItems": 100, "items": {"type": "integer", "minimum": 0, "maximum": 99}}"#,
    )
    .unwrap();
    let args = [
        "bench",
        s(&b),
        "--num-prompts",
        "6",
        "--input-len",
        "8",
        "--output-len",
        "24",
        "--temperature",
        "1.0",
        "--json",
    ];
    for format in [&["--regex", "[a-z]{5000}"][..], &["--json-schema", s(&schema)]] {
        let o = run("engrun", &[&args[..], format].concat());
        assert!(o.status.success(), "{format:?}: {}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
        assert_eq!((v["output_tokens"].as_u64(), v["format_violations"].as_u64()), (Some(6 * 24), Some(0)), "{v}");
    }
    let o = run("engrun", &[&args[..], &["--regex", "(unclosed"]].concat());
    assert!(!o.status.success() && stderr(&o).contains("output format"), "{}", stderr(&o));
}
