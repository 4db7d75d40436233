//! Every plan the compiler prints reads back (`ir::text::parse`) as the same graph: printed
//! again, the text is identical. Over every `models/*.yaml` with every config of
//! `tests/fixtures/*/config.json` and `tests/configs/*.json` that binds, at tp 1 and 2, in each
//! activation dtype: the final plan (`plan_for_config`) and the graph after every pass (what
//! `engc compile --dump-after PASS` prints).

use compiler::passes::{self, LmHead, PassCtx};
use ir::DType;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The files `dir/*/name` (with `name`) or `dir/*.json` (without), sorted.
fn files(dir: &str, name: Option<&str>) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(repo().join(dir))
        .unwrap_or_else(|e| panic!("{dir}: {e}"))
        .map(|e| e.unwrap().path())
        .filter_map(|p| match name {
            Some(n) => Some(p.join(n)).filter(|p| p.is_file()),
            None => Some(p).filter(|p| p.extension().is_some_and(|e| e == "json" || e == "yaml")),
        })
        .collect();
    v.sort();
    v
}

/// Parses `text` and prints it again; panics with `what` on any difference.
fn round_trip(text: &str, what: &str) {
    let graph = ir::text::parse(text).unwrap_or_else(|e| panic!("{what}: {e}\n{text}"));
    let again = graph.to_plan().unwrap_or_else(|e| panic!("{what}: {e}\n{text}")).to_text();
    if again != text {
        let line = text.lines().zip(again.lines()).position(|(a, b)| a != b).unwrap_or(0);
        panic!(
            "{what}: printed differently after parsing, first at line {}:\n  was  {}\n  now  {}",
            line + 1,
            text.lines().nth(line).unwrap_or(""),
            again.lines().nth(line).unwrap_or("")
        );
    }
}

#[test]
fn every_plan_the_compiler_prints_reads_back() {
    let models = files("models", None);
    let mut configs = files("tests/fixtures", Some("config.json"));
    configs.extend(files("tests/configs", None));
    assert!(models.len() >= 7 && configs.len() >= 16, "{models:?} {configs:?}");
    let mut plans = 0;
    let mut dumps = 0;
    let mut bound_models = BTreeSet::new();
    let mut seen = String::new();
    for model in &models {
        let spec = spec::ModelSpec::load(model).unwrap();
        for config in &configs {
            let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(config).unwrap()).unwrap();
            let Ok(bound) = spec::bind(&spec, &cfg) else { continue };
            bound_models.insert(model.file_name().unwrap().to_string_lossy().to_string());
            for tp in [1, 2] {
                for dtype in [DType::BF16, DType::F16, DType::F32] {
                    let what = format!("{} with {} at tp {tp}, {dtype}", model.display(), config.display());
                    let Ok(plan) = compiler::plan_for_config(model, &cfg, tp, dtype) else { continue };
                    let text = plan.to_text();
                    round_trip(&text, &what);
                    seen += &text;
                    plans += 1;
                    for lm_head in [LmHead::Vocab, LmHead::Replicated] {
                        let graph = compiler::lower::lower(&bound, dtype, dtype, &Default::default()).unwrap();
                        let ctx = PassCtx { tp, model: &bound, lm_head, quant: None };
                        passes::run(graph, &ctx, |pass, g| {
                            let text = g.to_plan().unwrap().to_text();
                            round_trip(&text, &format!("{what}, {lm_head:?} lm_head, after {pass}"));
                            dumps += 1;
                        })
                        .unwrap();
                    }
                }
            }
        }
    }
    let names: BTreeSet<String> = models.iter().map(|m| m.file_name().unwrap().to_string_lossy().to_string()).collect();
    assert_eq!(bound_models, names, "every model binds to some config");
    eprintln!("{plans} plans and {dumps} graphs after passes read back");
    assert!(plans >= 100 && dumps >= 1000, "{plans} plans, {dumps} dumps");
    // What the texts exercised: every fusion kind, derived weights, every op's attributes.
    for part in [
        "fuse add_norm {",
        "fuse norm_add_norm {",
        "fuse linears {",
        "fuse glu {",
        "fuse rope_attention {",
        " f32 = map{expr=",
        "all_gather{ranks=2}",
        "all_reduce(",
        "window=",
        "softcap=",
        "rotary_dim=",
        "\"type\":\"longrope\"",
        "\"type\":\"yarn\"",
        "\"type\":\"llama3\"",
        "\"type\":\"linear\"",
        "act=f16",
    ] {
        assert!(seen.contains(part), "no plan has `{part}`");
    }
}
