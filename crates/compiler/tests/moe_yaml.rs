//! Mixtures of experts in model YAML: what the compiler refuses (each a clear error naming what
//! and where, never a panic) and what it makes of `models/qwen3_moe.yaml` at the Qwen3-30B-A3B
//! shape under tensor parallelism.

use compiler::{CompileError, CompileOptions};
use ir::{DType, Op, Plan};
use serde_json::json;
use std::path::{Path, PathBuf};

/// A one-layer mixture of experts, each expert one checkpoint tensor (`{e}`).
const PER_EXPERT: &str = r#"name: tiny_moe
architectures: [TinyMoeForCausalLM]
params:
  layers: num_hidden_layers
  hidden: hidden_size
  inter: moe_intermediate_size
  vocab: vocab_size
  experts: num_experts
  top_k: num_experts_per_tok
weights:
  embed: { name: embed.weight, shape: [vocab, hidden] }
  per_layer:
    router: { name: "layers.{i}.router.weight", shape: [experts, hidden] }
    gate_exps: { name: "layers.{i}.experts.{e}.gate.weight", experts: experts, shape: [experts, inter, hidden], shard: column }
    up_exps: { name: "layers.{i}.experts.{e}.up.weight", experts: experts, shape: [experts, inter, hidden], shard: column }
    down_exps: { name: "layers.{i}.experts.{e}.down.weight", experts: experts, shape: [experts, hidden, inter], shard: row }
    gate_b: { name: "layers.{i}.experts.gate_bias", experts: experts, shape: [experts, inter], shard: column }
    up_b: { name: "layers.{i}.experts.up_bias", experts: experts, shape: [experts, inter], shard: column }
    down_b: { name: "layers.{i}.experts.down_bias", experts: experts, shape: [experts, hidden] }
graph:
  - x = embedding(tokens, embed)
  - per_layer:
    - x = x + moe(x, linear(x, router), gate_exps, up_exps, down_exps, top_k=top_k, norm_topk=true, act=silu(gate) * up)
  - logits = logits(x, embed)
"#;

/// The MoE statement of [`PER_EXPERT`], for replacing.
const MOE: &str =
    "moe(x, linear(x, router), gate_exps, up_exps, down_exps, top_k=top_k, norm_topk=true, act=silu(gate) * up)";

/// The same model with the experts stacked in one tensor per projection.
fn stacked() -> String {
    PER_EXPERT
        .replace(".{e}.gate.weight", ".gate")
        .replace(".{e}.up.weight", ".up")
        .replace(".{e}.down.weight", ".down")
}

const HIDDEN: usize = 8;
const INTER: usize = 4;
const EXPERTS: usize = 4;
const VOCAB: usize = 16;

fn config() -> serde_json::Value {
    json!({
        "architectures": ["TinyMoeForCausalLM"], "num_hidden_layers": 1, "hidden_size": HIDDEN,
        "moe_intermediate_size": INTER, "vocab_size": VOCAB, "num_experts": EXPERTS, "num_experts_per_tok": 2
    })
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The plan of `yaml` (written as `bad.yaml`) for `config`, at `tp` ranks.
fn plan(yaml: &str, config: &serde_json::Value, tp: usize) -> Result<Plan, CompileError> {
    let dir = tempfile::tempdir().expect("a temp dir");
    let path = dir.path().join("bad.yaml");
    std::fs::write(&path, yaml).expect("writing the YAML");
    compiler::plan_for_config(&path, config, tp, DType::F32)
}

/// The error of compiling `yaml` for [`config`]; it must contain every needle.
fn fails(yaml: &str, needles: &[&str]) {
    let err = match plan(yaml, &config(), 1) {
        Ok(_) => panic!("compiled, but should have failed with {needles:?}"),
        Err(e) => e.to_string(),
    };
    for n in needles {
        assert!(err.contains(n), "error lacks `{n}`: {err}");
    }
}

#[test]
fn the_tiny_model_compiles_per_expert_and_stacked() {
    for yaml in [PER_EXPERT.to_string(), stacked()] {
        let p = plan(&yaml, &config(), 1).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(p.nodes.iter().filter(|n| matches!(n.op, Op::Moe { bias: false, .. })).count(), 1);
    }
}

#[test]
fn moe_without_act() {
    fails(&PER_EXPERT.replace(", act=silu(gate) * up)", ")"), &["bad.yaml:", "moe(", "needs the attribute `act=EXPR`"]);
}

#[test]
fn moe_with_some_expert_biases() {
    let one = PER_EXPERT.replace("down_exps, top_k", "down_exps, gate_b, top_k");
    fails(&one, &["bad.yaml:", "gate_b", "biases all three or none"]);
    let two = PER_EXPERT.replace("down_exps, top_k", "down_exps, gate_b, up_b, top_k");
    fails(&two, &["bad.yaml:", "up_b", "biases all three or none"]);
    // All three are one op with biases.
    let three = plan(&PER_EXPERT.replace("down_exps, top_k", "down_exps, gate_b, up_b, down_b, top_k"), &config(), 1);
    assert!(three.unwrap_or_else(|e| panic!("{e}")).nodes.iter().any(|n| matches!(n.op, Op::Moe { bias: true, .. })));
}

#[test]
fn act_reading_other_names() {
    // A variable of the graph is not the gate or the up projection.
    fails(&PER_EXPERT.replace("act=silu(gate) * up", "act=silu(gate) * x"), &["bad.yaml:", "`act`", "`x`"]);
    fails(&PER_EXPERT.replace("act=silu(gate) * up", "act=silu(gate) * down"), &["bad.yaml:", "`act`", "`down`"]);
    // Params are numbers: they fold to constants.
    let p = plan(&PER_EXPERT.replace("act=silu(gate) * up", "act=silu(gate) * up * top_k"), &config(), 1);
    let p = p.unwrap_or_else(|e| panic!("{e}"));
    let act = p.nodes.iter().find_map(|n| match &n.op {
        Op::Moe { act, .. } => Some(act.to_string()),
        _ => None,
    });
    assert!(act.as_deref().is_some_and(|a| a.contains('2') && a.contains("x1")), "{act:?}");
}

#[test]
fn top_k_beyond_the_experts() {
    fails(&PER_EXPERT.replace("top_k=top_k", "top_k=5"), &["bad.yaml:", "moe", "top_k 5", "4 experts"]);
    fails(&PER_EXPERT.replace("top_k=top_k", "top_k=0"), &["bad.yaml:", "top_k 0"]);
}

#[test]
fn expert_index_without_experts() {
    let yaml = PER_EXPERT
        .replace(r#""layers.{i}.experts.{e}.up.weight", experts: experts,"#, r#""layers.{i}.experts.{e}.up.weight","#);
    fails(&yaml, &["bad.yaml:", "up_exps", "`{e}`", "experts: COUNT"]);
}

#[test]
fn experts_not_the_first_dimension() {
    let yaml = PER_EXPERT.replace(
        "experts: experts, shape: [experts, inter, hidden], shard: column }\n    up_exps",
        "experts: experts - 1, shape: [experts, inter, hidden], shard: column }\n    up_exps",
    );
    fails(&yaml, &["bad.yaml:", "gate_exps", "stack of 3 experts", "[4, 4, 8]"]);
}

#[test]
fn transposed_on_a_non_matrix() {
    let yaml = PER_EXPERT.replace(
        r#""layers.{i}.experts.gate_bias", experts: experts,"#,
        r#""layers.{i}.experts.gate_bias", experts: experts, transposed: true,"#,
    );
    fails(&yaml, &["bad.yaml:", "gate_b", "`transposed` needs a matrix", "[4, 4]"]);
    let yaml = PER_EXPERT.replace(
        r#"embed: { name: embed.weight, shape: [vocab, hidden] }"#,
        r#"embed: { name: embed.weight, shape: [vocab, hidden] }
  norm: { name: norm.weight, shape: [hidden], transposed: true }"#,
    );
    fails(&yaml, &["bad.yaml:", "norm", "`transposed` needs a matrix", "[8]"]);
}

#[test]
fn rows_with_step_zero_or_the_wrong_count() {
    let with_rows = |rows: &str| {
        PER_EXPERT.replace(
            r#""layers.{i}.experts.{e}.up.weight", experts: experts,"#,
            &format!(r#""layers.{{i}}.experts.{{e}}.up.weight", experts: experts, rows: {rows},"#),
        )
    };
    fails(&with_rows("[0, 64, 0]"), &["bad.yaml:", "up_exps", "rows [0, 64, 0]", "step must be at least 1"]);
    fails(&with_rows("[4, 4]"), &["bad.yaml:", "up_exps", "rows [4, 4, 1]", "end past the start"]);
    // 8 rows of every other: 4, as the shape says.
    assert!(plan(&with_rows("[0, 8, 2]"), &config(), 1).is_ok());
    fails(&with_rows("[0, 8, 3]"), &["bad.yaml:", "up_exps", "rows [0, 8, 3] are 3 rows", "[4, 4, 8] has 4"]);
    fails(&with_rows("[0, 5]"), &["bad.yaml:", "up_exps", "rows [0, 5, 1] are 5 rows", "dimension 1"]);
}

#[test]
fn per_layer_if_not_a_bool() {
    let guarded = |cond: &str| {
        PER_EXPERT.replace(
            &format!("    - x = x + {MOE}\n"),
            &format!("    - if: {cond}\n      then:\n        - x = x + {MOE}\n      else:\n        - x = x + x\n"),
        )
    };
    // Each layer lowers the branch its condition picks.
    let mut two = config();
    two["num_hidden_layers"] = json!(2);
    for (cond, moes) in [("i == 0", 1), ("i >= 0", 2), ("i > 1", 0)] {
        let p = plan(&guarded(cond), &two, 1).unwrap_or_else(|e| panic!("{cond}: {e}"));
        assert_eq!(p.nodes.iter().filter(|n| matches!(n.op, Op::Moe { .. })).count(), moes, "{cond}");
    }
    fails(&guarded("i + 1"), &["bad.yaml:", "`if: i + 1` is 1, not a bool"]);
    fails(&guarded("top_k > oops"), &["bad.yaml:", "`if: top_k > oops`", "oops"]);
    fails(&guarded("i == == 0"), &["bad.yaml:", "per_layer.if", "`i == == 0`"]);
}

/// The f32 values of the `k`-th tensor of a [`checkpoint`], `n` of them.
fn values(k: usize, n: usize) -> Vec<u8> {
    (0..n).flat_map(|i| (k as f32 + i as f32 * 0.01).to_le_bytes()).collect()
}

/// A tiny checkpoint of [`config`]'s shapes, as `tensors` gives them (name, shape), in `dir`.
fn checkpoint(dir: &Path, tensors: &[(String, Vec<usize>)]) {
    std::fs::write(dir.join("config.json"), config().to_string()).expect("config.json");
    let data: Vec<(String, Vec<usize>, Vec<u8>)> =
        tensors.iter().enumerate().map(|(k, (n, s))| (n.clone(), s.clone(), values(k, s.iter().product()))).collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = data
        .iter()
        .map(|(n, s, d)| {
            (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, &None, &dir.join("model.safetensors")).expect("writing the checkpoint");
}

/// The tensors of [`PER_EXPERT`] (`per_expert`) or [`stacked`].
fn tensors(per_expert: bool) -> Vec<(String, Vec<usize>)> {
    let mut t = vec![
        ("embed.weight".to_string(), vec![VOCAB, HIDDEN]),
        ("layers.0.router.weight".into(), vec![EXPERTS, HIDDEN]),
        ("layers.0.experts.gate_bias".into(), vec![EXPERTS, INTER]),
        ("layers.0.experts.up_bias".into(), vec![EXPERTS, INTER]),
        ("layers.0.experts.down_bias".into(), vec![EXPERTS, HIDDEN]),
    ];
    for (p, shape) in [("gate", [INTER, HIDDEN]), ("up", [INTER, HIDDEN]), ("down", [HIDDEN, INTER])] {
        if per_expert {
            t.extend((0..EXPERTS).map(|e| (format!("layers.0.experts.{e}.{p}.weight"), shape.to_vec())));
        } else {
            t.push((format!("layers.0.experts.{p}"), [vec![EXPERTS], shape.to_vec()].concat()));
        }
    }
    t
}

/// Compiles `yaml` with the checkpoint of `tensors` into a temp dir.
fn compile(yaml: &str, tensors: &[(String, Vec<usize>)]) -> Result<compiler::CompileReport, CompileError> {
    let dir = tempfile::tempdir().expect("a temp dir");
    let ck = dir.path().join("ckpt");
    std::fs::create_dir_all(&ck).expect("checkpoint dir");
    checkpoint(&ck, tensors);
    let model = dir.path().join("bad.yaml");
    std::fs::write(&model, yaml).expect("writing the YAML");
    compiler::compile(&CompileOptions {
        model,
        checkpoint: ck,
        tp: 2,
        dtype: Some(DType::F32),
        tokenizer: None,
        out: dir.path().join("out.bundle"),
        dump_after: None,
        lm_head: Default::default(),
        quant: None,
    })
}

#[test]
fn checkpoint_missing_one_expert() {
    let yaml = PER_EXPERT.replace("down_exps, top_k", "down_exps, gate_b, up_b, down_b, top_k");
    compile(&yaml, &tensors(true)).unwrap_or_else(|e| panic!("the whole checkpoint: {e}"));
    let t: Vec<_> = tensors(true).into_iter().filter(|(n, _)| n != "layers.0.experts.2.up.weight").collect();
    let err = compile(&yaml, &t).map(|_| ()).expect_err("one expert missing").to_string();
    for n in ["bad.yaml:", "up_exps", "`layers.0.experts.2.up.weight`", "missing from the checkpoint"] {
        assert!(err.contains(n), "error lacks `{n}`: {err}");
    }
}

#[test]
fn checkpoint_stack_of_the_wrong_shape() {
    let yaml = stacked();
    compile(&yaml, &tensors(false)).unwrap_or_else(|e| panic!("the whole checkpoint: {e}"));
    let mut t = tensors(false);
    let down = t.iter_mut().find(|(n, _)| n == "layers.0.experts.down").expect("the down stack");
    down.1 = vec![EXPERTS, INTER, HIDDEN];
    let err = compile(&yaml, &t).map(|_| ()).expect_err("a transposed down stack").to_string();
    for n in ["bad.yaml:", "`layers.0.experts.down`", "[4, 4, 8]", "expects [4, 8, 4]"] {
        assert!(err.contains(n), "error lacks `{n}`: {err}");
    }
}

fn qwen3_30b() -> serde_json::Value {
    let path = repo().join("tests/configs/qwen3-30b-a3b.json");
    serde_json::from_str(&std::fs::read_to_string(&path).expect("the config")).expect("JSON")
}

/// The layer of a weight named `model.layers.{i}.…`.
fn layer_of(name: &str) -> usize {
    let rest = name.strip_prefix("model.layers.").unwrap_or_else(|| panic!("not a layer's weight: {name}"));
    rest.split('.').next().and_then(|i| i.parse().ok()).unwrap_or_else(|| panic!("no layer in {name}"))
}

/// The layers of the plan's MoE nodes, each checked to be followed by one `all_reduce` (its
/// only reader) when `tp` > 1, and its expert stacks' per-rank shapes.
fn moe_layers(p: &Plan, tp: usize, stacks: [&[usize]; 3]) -> Vec<usize> {
    let mut layers = Vec::new();
    for (i, n) in p.nodes.iter().enumerate() {
        if !matches!(n.op, Op::Moe { .. }) {
            continue;
        }
        let shapes: Vec<&[usize]> = n.inputs[2..5]
            .iter()
            .map(|&w| match &p.nodes[w].op {
                Op::Weight { shape, .. } => shape.as_slice(),
                other => panic!("{}: an expert stack is {other:?}", n.label),
            })
            .collect();
        assert_eq!(shapes, stacks, "{}", n.label);
        let readers: Vec<&Op> = p.nodes.iter().filter(|m| m.inputs.contains(&i)).map(|m| &m.op).collect();
        if tp > 1 {
            assert!(matches!(readers.as_slice(), [Op::AllReduce]), "{}: read by {readers:?}", n.label);
        } else {
            assert!(!readers.iter().any(|o| matches!(o, Op::AllReduce)), "{}", n.label);
        }
        let Op::Weight { name, .. } = &p.nodes[n.inputs[2]].op else { unreachable!("checked above") };
        layers.push(layer_of(name));
    }
    layers
}

#[test]
fn qwen3_30b_a3b_at_tp2() {
    let yaml = repo().join("models/qwen3_moe.yaml");
    let p = compiler::plan_for_config(&yaml, &qwen3_30b(), 2, DType::BF16).unwrap_or_else(|e| panic!("{e}"));
    let layers = moe_layers(&p, 2, [&[128, 384, 2048], &[128, 384, 2048], &[128, 2048, 384]]);
    assert_eq!(layers, (0..48).collect::<Vec<_>>());
    assert!(!p.weights().any(|(n, _, _)| n.contains("mlp.gate_proj")), "no dense MLP");
    // At tp 1 the stacks are whole and nothing is summed.
    let p = compiler::plan_for_config(&yaml, &qwen3_30b(), 1, DType::BF16).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(moe_layers(&p, 1, [&[128, 768, 2048], &[128, 768, 2048], &[128, 2048, 768]]).len(), 48);
}

#[test]
fn qwen3_moe_dense_layers_by_list_and_step() {
    let mut cfg = qwen3_30b();
    cfg["mlp_only_layers"] = json!([0, 5]);
    cfg["decoder_sparse_step"] = json!(2);
    let yaml = repo().join("models/qwen3_moe.yaml");
    let p = compiler::plan_for_config(&yaml, &cfg, 2, DType::BF16).unwrap_or_else(|e| panic!("{e}"));
    let sparse: Vec<usize> = (0..48).filter(|i| (i + 1) % 2 == 0 && ![0, 5].contains(i)).collect();
    assert_eq!(sparse.len(), 23);
    assert_eq!(moe_layers(&p, 2, [&[128, 384, 2048], &[128, 384, 2048], &[128, 2048, 384]]), sparse);
    // The others have the dense MLP (column-split gate of 6144 / 2) and no router.
    let dense: Vec<usize> = p
        .weights()
        .filter(|(n, s, _)| n.ends_with("mlp.gate_proj.weight") && *s == [3072, 2048])
        .map(|(n, _, _)| layer_of(n))
        .collect();
    assert_eq!(dense, (0..48).filter(|i| !sparse.contains(i)).collect::<Vec<_>>());
    let routers: Vec<usize> =
        p.weights().filter(|(n, _, _)| n.ends_with("mlp.gate.weight")).map(|(n, _, _)| layer_of(n)).collect();
    assert_eq!(routers, sparse);
}

/// A weight stored as the plan's dtype is copied from the checkpoint as it is (per-expert
/// tensors one after the other, in the experts' order): the bundle's f32 stack holds the
/// checkpoint's bytes (at tp 2 rank 0 its slice of them), and a bf16 compile (which
/// converts) their bf16 roundings.
#[test]
fn weights_of_the_checkpoint_dtype_are_copied_as_stored() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let ck = dir.path().join("ckpt");
    std::fs::create_dir_all(&ck).expect("checkpoint dir");
    checkpoint(&ck, &tensors(true));
    let model = dir.path().join("m.yaml");
    std::fs::write(&model, PER_EXPERT).expect("writing the YAML");
    let gate = |dtype: DType, tp: usize| -> Vec<u8> {
        let out = dir.path().join(format!("{dtype}-{tp}.bundle"));
        let opts = CompileOptions {
            model: model.clone(),
            checkpoint: ck.clone(),
            tp,
            dtype: Some(dtype),
            tokenizer: None,
            out: out.clone(),
            dump_after: None,
            lm_head: Default::default(),
            quant: None,
        };
        compiler::compile(&opts).unwrap_or_else(|e| panic!("compiling {dtype}: {e}"));
        let bytes = std::fs::read(out.join("weights/rank0.safetensors")).expect("the bundle's weights");
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("a safetensors file");
        st.tensor("layers.0.experts.*.gate.weight").expect("the gate stack").data().to_vec()
    };
    let at = |e: usize| tensors(true).iter().position(|(n, _)| *n == format!("layers.0.experts.{e}.gate.weight"));
    let stored: Vec<u8> = (0..EXPERTS).flat_map(|e| values(at(e).expect("expert e's gate"), INTER * HIDDEN)).collect();
    let f32_stack = gate(DType::F32, 1);
    assert_eq!(f32_stack, stored);
    let bf16 = DType::BF16.from_f32(&DType::F32.to_f32(&f32_stack));
    assert_eq!(gate(DType::BF16, 1), bf16);
    // Rank 0 of 2 holds the first half of each expert's rows (a column-parallel stack).
    let half = INTER / 2 * HIDDEN * 4;
    let rank0: Vec<u8> = stored.chunks(2 * half).flat_map(|e| e[..half].to_vec()).collect();
    assert_eq!(gate(DType::F32, 2), rank0);
}
