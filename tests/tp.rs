//! Tensor parallelism on the CPU: `--tp N` bundles run one rank per thread with an in-process
//! all-reduce (and all-gather of a vocab-parallel lm_head's logits), and give tp=1's logits
//! (prefill and decode) with either lm_head layout; the server runs on a tp=2 bundle.

use compiler::LmHead;
use e2e::*;

/// Prefill of a prompt (every position), then four decode steps, as logits.
fn run(s: &mut runtime::Sequences, prompt: &[u32]) -> Vec<Vec<f32>> {
    prefill_then_decode(s, prompt, &[11, 1023, 7, 123])
}

#[test]
fn tp_bundles_match_tp1_on_the_cpu() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "tp-cpu");
    for (name, tps) in [("tiny-qwen2", &[2][..]), ("tiny-llama", &[2, 4][..])] {
        let prompt = ids(&goldens(name)["prompts"][2]["ids"]);
        let want = run(&mut cpu_sequences(&compile_fixture(name, &dir, 1, None)), &prompt);
        for &tp in tps {
            for lm_head in [LmHead::Vocab, LmHead::Replicated] {
                let path = compile_fixture_with(name, &dir, tp, None, lm_head);
                // tiny-llama's own lm_head splits by vocabulary unless asked not to; tiny-qwen2's
                // is the (replicated) embedding either way.
                let plan = bundle::Bundle::open(&path).unwrap().plan;
                let gathered = plan.nodes.iter().any(|n| matches!(n.op, ir::Op::AllGather { .. }));
                assert_eq!(gathered, name == "tiny-llama" && lm_head == LmHead::Vocab, "{name} tp={tp} {lm_head:?}");
                let got = run(&mut cpu_sequences(&path), &prompt);
                for (step, (g, w)) in got.iter().zip(&want).enumerate() {
                    let err = rel_err(g, w);
                    assert!(err < 1e-4, "{name} tp={tp} {lm_head:?} step {step}: rel err {err}");
                    eprintln!("{name} tp={tp} {lm_head:?} step {step}: rel err {err:.1e}");
                }
            }
        }
    }
}

#[test]
fn server_runs_on_a_tp2_bundle() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "tp-server");
    let b = compile_fixture("tiny-qwen2", &dir, 2, None);
    let server = Server::start(&b, &[]);
    let body = r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0}"#;
    let (status, text) = http(&server.addr, "POST", "/v1/chat/completions", Some(body), &[]);
    assert_eq!(status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() > 0, "{v}");
}
