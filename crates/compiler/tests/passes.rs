//! Text-in/text-out tests of single passes. `tests/passes/PASS.CASE.in.txt` is a plan as
//! `Plan::to_text` prints it (read by `ir::text::parse`); the pass named `PASS` (looked up in
//! `compiler::passes::PIPELINE`) runs on it, the graph is verified and printed again, and the
//! text must equal `PASS.CASE.out.txt`. `BLESS=1 cargo test -p compiler --test passes` writes
//! the `.out.txt` files instead (read each one before committing it).
//!
//! Each case also checks that running the pass again on its output changes nothing (passes
//! find what is left to do, so a second run has nothing left), and the folder must hold a case
//! for every pass of the pipeline but `tensor_parallel` and no stray files.

use compiler::passes::{self, LmHead, PassCtx};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/passes")
}

/// A model to hand the passes (those tested here do not read it): `models/qwen2.yaml` bound
/// to a tiny Qwen2 config.
fn bound_model() -> spec::BoundModel {
    let yaml = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/qwen2.yaml");
    let spec = spec::ModelSpec::load(&yaml).unwrap_or_else(|e| panic!("{}: {e}", yaml.display()));
    let config = serde_json::json!({
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 192,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "vocab_size": 151936, "max_position_embeddings": 4096, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": true
    });
    spec::bind(&spec, &config).unwrap_or_else(|e| panic!("binding qwen2.yaml: {e}"))
}

/// A line diff of `want` and `got` (longest common subsequence): ` ` both, `-` only in
/// `want`, `+` only in `got`.
fn diff(want: &str, got: &str) -> String {
    let (a, b): (Vec<&str>, Vec<&str>) = (want.lines().collect(), got.lines().collect());
    // lcs[i][j]: the longest common subsequence of a[i..] and b[j..].
    let mut lcs = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for i in (0..a.len()).rev() {
        for j in (0..b.len()).rev() {
            lcs[i][j] = if a[i] == b[j] { lcs[i + 1][j + 1] + 1 } else { lcs[i + 1][j].max(lcs[i][j + 1]) };
        }
    }
    let (mut i, mut j, mut out) = (0, 0, String::new());
    while i < a.len() || j < b.len() {
        if i < a.len() && j < b.len() && a[i] == b[j] {
            out += &format!("    {}\n", a[i]);
            (i, j) = (i + 1, j + 1);
        } else if i < a.len() && (j == b.len() || lcs[i + 1][j] >= lcs[i][j + 1]) {
            out += &format!("  - {}\n", a[i]);
            i += 1;
        } else {
            out += &format!("  + {}\n", b[j]);
            j += 1;
        }
    }
    out
}

/// Runs the pass `name` on the plan `text`; the printed result, or what went wrong.
fn run_pass(name: &str, text: &str, model: &spec::BoundModel) -> Result<String, String> {
    let (_, pass) = passes::PIPELINE.iter().find(|(n, _)| *n == name).ok_or_else(|| {
        let names: Vec<&str> = passes::PIPELINE.iter().map(|(n, _)| *n).collect();
        format!("no pass `{name}` in compiler::passes::PIPELINE (it has {})", names.join(", "))
    })?;
    let g = ir::text::parse(text).map_err(|e| format!("parsing: {e}"))?;
    g.verify().map_err(|e| format!("verifying the input: {e}"))?;
    let ctx = PassCtx { tp: g.tp, model, lm_head: LmHead::Vocab, quant: Some(compiler::Quant::Fp8) };
    let g = pass(g, &ctx).map_err(|e| format!("running {name}: {e}"))?;
    g.verify().map_err(|e| format!("verifying after {name}: {e}"))?;
    Ok(g.to_plan().map_err(|e| format!("printing after {name}: {e}"))?.to_text())
}

/// Checks the case `stem` (`PASS.CASE`), or with `bless` writes its `.out.txt`; says whether
/// it blessed.
fn case(stem: &str, model: &spec::BoundModel, bless: bool) -> Result<bool, String> {
    let pass = stem.split('.').next().unwrap_or(stem);
    let input = std::fs::read_to_string(dir().join(format!("{stem}.in.txt"))).map_err(|e| e.to_string())?;
    let got = run_pass(pass, &input, model)?;
    let out = dir().join(format!("{stem}.out.txt"));
    let again = run_pass(pass, &got, model).map_err(|e| format!("on its own output: {e}"))?;
    if again != got {
        return Err(format!(
            "a second run of {pass} changes its output (- first run, + second):\n{}",
            diff(&got, &again)
        ));
    }
    let want = match std::fs::read_to_string(&out) {
        Ok(want) => Some(want),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(format!("{}: {e}", out.display())),
    };
    if want.as_deref() == Some(got.as_str()) {
        return Ok(false);
    }
    if bless {
        std::fs::write(&out, &got).map_err(|e| format!("{}: {e}", out.display()))?;
        return Ok(true);
    }
    match want {
        None => Err(format!("{stem}.out.txt is missing: run with BLESS=1 to write it, then read it")),
        Some(want) => Err(format!(
            "the output differs from {stem}.out.txt (- expected, + got; BLESS=1 rewrites it):\n{}",
            diff(&want, &got)
        )),
    }
}

#[test]
fn each_pass_turns_its_inputs_into_the_expected_outputs() {
    let bless = std::env::var_os("BLESS").is_some_and(|v| v == "1");
    let model = bound_model();
    let mut names: Vec<String> = std::fs::read_dir(dir())
        .unwrap_or_else(|e| panic!("{}: {e}", dir().display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut failures = Vec::new();
    let mut stems = Vec::new();
    for name in &names {
        if let Some(stem) = name.strip_suffix(".in.txt") {
            stems.push(stem.to_string());
        } else if let Some(stem) = name.strip_suffix(".out.txt") {
            if !names.contains(&format!("{stem}.in.txt")) {
                failures.push(format!("{name}: no {stem}.in.txt beside it"));
            }
        } else {
            failures.push(format!("{name}: not PASS.CASE.in.txt or PASS.CASE.out.txt"));
        }
    }
    let mut blessed = 0;
    for stem in &stems {
        match case(stem, &model, bless) {
            Ok(b) => blessed += usize::from(b),
            Err(e) => failures.push(format!("{stem}.in.txt: {e}")),
        }
    }
    if bless {
        eprintln!("BLESS=1: wrote {blessed} .out.txt files");
    }
    let tested: BTreeSet<&str> = stems.iter().map(|s| s.split('.').next().unwrap_or(s)).collect();
    for (pass, _) in passes::PIPELINE.iter().filter(|(n, _)| *n != "tensor_parallel") {
        if !tested.contains(pass) {
            failures.push(format!("the pass {pass} has no case ({pass}.CASE.in.txt)"));
        }
    }
    eprintln!("{} cases", stems.len());
    assert!(failures.is_empty(), "{} failures:\n\n{}", failures.len(), failures.join("\n\n"));
}
