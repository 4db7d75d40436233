//! Text golden tests for the compiler: `engc inspect --graph` of a model + fixture against a
//! checked-in expected text. `BLESS=1 cargo test -p e2e --test golden` rewrites them.

use e2e::*;

fn golden(fixture_name: &str, tp: usize) {
    let dir = tempfile::tempdir().unwrap();
    let b = compile_fixture(fixture_name, dir.path(), tp, None);
    let o = run("engc", &["inspect", b.to_str().unwrap(), "--graph"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let got = String::from_utf8(o.stdout).unwrap();
    let path = repo().join(format!("tests/golden/{fixture_name}.tp{tp}.graph.txt"));
    if std::env::var_os("BLESS").is_some() {
        std::fs::write(&path, &got).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run with BLESS=1 to create it)", path.display()));
    if got != want {
        let line = got
            .lines()
            .zip(want.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(got.lines().count().min(want.lines().count()));
        panic!(
            "{} differs at line {}:\n  got:  {}\n  want: {}\n(run with BLESS=1 to accept)",
            path.display(),
            line + 1,
            got.lines().nth(line).unwrap_or("<end>"),
            want.lines().nth(line).unwrap_or("<end>")
        );
    }
}

#[test]
fn qwen2_tiny_graph() {
    golden("tiny-qwen2", 1);
}

#[test]
fn qwen2_tiny_tp2_graph() {
    golden("tiny-qwen2", 2);
}

#[test]
fn llama_tiny_graph() {
    golden("tiny-llama", 1);
}
