//! The reference interpreter against HF transformers (fixtures' reference/), and prefill
//! against token-by-token decode.

use e2e::*;
use runtime::{RefBackend, Sequences};

fn backend(name: &str, dir: &std::path::Path) -> Sequences {
    let path = compile_fixture(name, dir, 1, Some(ir::DType::F32));
    seqs(RefBackend::new(&bundle::Bundle::open(&path).expect("bundle opens")).expect("backend loads"))
}

fn check_against_hf(name: &str) {
    let dir = tempfile::tempdir().unwrap();
    let mut b = backend(name, dir.path());
    check_backend_against_hf(name, &mut b, 1e-4);
}

#[test]
fn tiny_qwen2_matches_hf() {
    check_against_hf("tiny-qwen2");
}

#[test]
fn tiny_llama_matches_hf() {
    check_against_hf("tiny-llama");
}

/// Prefill of a whole prompt and token-by-token decode give the same logits.
#[test]
fn prefill_equals_token_by_token_decode() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["tiny-qwen2", "tiny-llama"] {
        let mut b = backend(name, dir.path());
        let vocab = b.vocab();
        let prompt = ids(&goldens(name)["prompts"][2]["ids"]);
        let rows: Vec<usize> = (0..prompt.len()).collect();
        let whole = b.forward(1, &prompt, &rows).unwrap();
        let mut stepwise = Vec::new();
        for &t in &prompt {
            stepwise.extend(b.forward(2, &[t], &[0]).unwrap());
        }
        assert_eq!(b.seq_len(2), prompt.len());
        let err = rel_err(&stepwise, &whole);
        assert!(err < 1e-5, "{name}: decode vs prefill rel err {err}");
        // and a prefill split in two chunks
        let half = prompt.len() / 2;
        let mut chunked = b.forward(3, &prompt[..half], &(0..half).collect::<Vec<_>>()).unwrap();
        chunked.extend(b.forward(3, &prompt[half..], &(0..prompt.len() - half).collect::<Vec<_>>()).unwrap());
        assert!(rel_err(&chunked, &whole) < 1e-5, "{name}: chunked prefill differs");
        assert_eq!(whole.len(), prompt.len() * vocab);
    }
}
