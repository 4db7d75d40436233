//! The reference interpreter against HF transformers (fixtures' reference/), and prefill
//! against token-by-token decode.

use e2e::*;
use runtime::{Backend, RefBackend};

fn backend(name: &str, dir: &std::path::Path) -> RefBackend {
    let path = compile_fixture(name, dir, 1, Some(ir::DType::F32));
    RefBackend::new(&bundle::Bundle::open(&path).expect("bundle opens")).expect("backend loads")
}

fn check_against_hf(name: &str) {
    let dir = tempfile::tempdir().unwrap();
    let mut b = backend(name, dir.path());
    let vocab = b.vocab();
    let g = goldens(name);
    let refs = fixture(name).join("reference/logits.safetensors");
    for (i, p) in g["prompts"].as_array().unwrap().iter().enumerate() {
        let prompt = ids(&p["ids"]);
        let rows: Vec<usize> = (0..prompt.len()).collect();
        let logits = b.forward(i as u64, &prompt, &rows).unwrap();
        let (_, last) = read_f32(&refs, &format!("last_logits.{i}"));
        let got_last = &logits[(prompt.len() - 1) * vocab..];
        let err = rel_err(got_last, &last);
        assert!(err < 1e-4, "{name} prompt {i}: last-position logits rel err {err}");
        eprintln!("{name} prompt {i} ({} tokens): last-position rel err {err:.2e}", prompt.len());
        if prompt.len() == 5 {
            let (shape, all) = read_f32(&refs, "all_logits.5");
            assert_eq!(shape, vec![5, vocab]);
            let err = rel_err(&logits, &all);
            assert!(err < 1e-4, "{name}: all-position logits rel err {err}");
        }
        // argmax per position where the top-2 margin is clear
        let scale = last.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (pos, want) in ids(&p["argmax_each_position"]).iter().enumerate() {
            let (got, margin) = top2(&logits[pos * vocab..(pos + 1) * vocab]);
            if margin > 1e-4 * scale {
                assert_eq!(got, *want, "{name} prompt {i} position {pos}");
            }
        }
        // greedy continuation, compared while every step's margin is clear
        let mut next_logits = got_last.to_vec();
        let mut compared = 0;
        for (step, want) in ids(&p["greedy_16"]).iter().enumerate() {
            let (got, margin) = top2(&next_logits);
            if margin <= 1e-4 * scale {
                break;
            }
            compared += 1;
            assert_eq!(got, *want, "{name} prompt {i} greedy step {step}");
            next_logits = b.forward(i as u64, &[got], &[0]).unwrap();
        }
        eprintln!("{name} prompt {i}: {compared} of 16 greedy tokens compared (clear margins)");
        assert!(compared > 0 || i > 0, "no greedy token had a clear margin");
        b.release(i as u64);
    }
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
