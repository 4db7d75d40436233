//! The Cranelift CPU backend against the reference interpreter (property test over random
//! prompts, prefill then decode) and against HF on the fixtures.

use e2e::*;
use proptest::prelude::*;
use runtime::{CpuBackend, RefBackend};
use std::path::PathBuf;
use std::sync::OnceLock;

/// The fixture bundles, compiled once per run into cargo's scratch directory for tests.
fn bundles() -> &'static [(PathBuf, usize)] {
    static B: OnceLock<Vec<(PathBuf, usize)>> = OnceLock::new();
    B.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cpu-tests");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        vec![(compile_fixture("tiny-qwen2", &dir, 1, None), 1024), (compile_fixture("tiny-llama", &dir, 1, None), 1024)]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Random prompts: prefill of every position, then three decode steps, agree within 1e-4.
    #[test]
    fn cpu_matches_reference(model in 0usize..2, seed in any::<u64>(), len in 1usize..48) {
        let (path, vocab) = &bundles()[model];
        let b = bundle::Bundle::open(path).unwrap();
        let (mut r, mut c) = (seqs(RefBackend::new(&b).unwrap()), seqs(CpuBackend::new(&b).unwrap()));
        let mut s = seed | 1;
        let mut next = || { s ^= s << 13; s ^= s >> 7; s ^= s << 17; (s % *vocab as u64) as u32 };
        let prompt: Vec<u32> = (0..len).map(|_| next()).collect();
        let rows: Vec<usize> = (0..len).collect();
        let want = r.forward(1, &prompt, &rows).unwrap();
        let got = c.forward(1, &prompt, &rows).unwrap();
        prop_assert!(rel_err(&got, &want) < 1e-4, "prefill rel err {}", rel_err(&got, &want));
        for _ in 0..3 {
            let t = next();
            let want = r.forward(1, &[t], &[0]).unwrap();
            let got = c.forward(1, &[t], &[0]).unwrap();
            prop_assert!(rel_err(&got, &want) < 1e-4, "decode rel err {}", rel_err(&got, &want));
        }
        prop_assert_eq!(c.seq_len(1), len + 3);
    }
}

#[test]
fn cpu_matches_hf_on_fixtures() {
    for (name, i) in [("tiny-qwen2", 0), ("tiny-llama", 1)] {
        let b = bundle::Bundle::open(&bundles()[i].0).unwrap();
        check_backend_against_hf(name, &mut seqs(CpuBackend::new(&b).unwrap()), 1e-4);
    }
}

#[test]
fn cpu_rejects_bad_ids() {
    let b = bundle::Bundle::open(&bundles()[0].0).unwrap();
    let mut c = seqs(CpuBackend::new(&b).unwrap());
    assert!(c.forward(1, &[999_999_999], &[0]).unwrap_err().to_string().contains("outside the vocabulary"));
    assert!(c.forward(1, &[1, 2], &[5]).unwrap_err().to_string().contains("logit row 5"));
    assert_eq!(c.seq_len(1), 0, "a failed step leaves the cache as it was");
}

/// A batched step over sequences of different lengths equals running each alone.
#[test]
fn batched_steps_equal_single_sequences() {
    use runtime::SeqChunk;
    let b = bundle::Bundle::open(&bundles()[1].0).unwrap();
    let (mut r, mut c) = (seqs(RefBackend::new(&b).unwrap()), seqs(CpuBackend::new(&b).unwrap()));
    let prompts: Vec<Vec<u32>> = vec![(1..12).collect(), vec![400, 17], (100..131).collect()];
    let rows: Vec<Vec<usize>> = prompts.iter().map(|p| vec![0, p.len() - 1]).collect();
    let chunks: Vec<SeqChunk> = prompts
        .iter()
        .zip(&rows)
        .enumerate()
        .map(|(i, (p, r))| SeqChunk { seq: i as u64, tokens: p, rows: r })
        .collect();
    let got = c.forward_batch(&chunks).unwrap();
    let want: Vec<f32> = chunks.iter().flat_map(|ch| r.forward(ch.seq, ch.tokens, ch.rows).unwrap()).collect();
    assert!(rel_err(&got, &want) < 1e-4, "batched prefill rel err {}", rel_err(&got, &want));
    let next = [[5u32], [6], [7]];
    let decode: Vec<SeqChunk> =
        next.iter().enumerate().map(|(i, t)| SeqChunk { seq: i as u64, tokens: t, rows: &[0] }).collect();
    let got = c.forward_batch(&decode).unwrap();
    let want: Vec<f32> = decode.iter().flat_map(|ch| r.forward(ch.seq, ch.tokens, ch.rows).unwrap()).collect();
    assert!(rel_err(&got, &want) < 1e-4, "batched decode rel err {}", rel_err(&got, &want));
    assert_eq!((c.seq_len(0), c.seq_len(1), c.seq_len(2)), (12, 3, 32));
    let dup = [SeqChunk { seq: 0, tokens: &[1], rows: &[0] }, SeqChunk { seq: 0, tokens: &[2], rows: &[0] }];
    assert!(c.forward_batch(&dup).unwrap_err().to_string().contains("appears twice"));
    assert_eq!(c.seq_len(0), 12, "a rejected batch changes nothing");
}

/// An f16 bundle (`--dtype f16`: weights rounded to IEEE halves) runs on the CPU backend (its
/// weights widened to f32 at load) and stays within f16 rounding of HF's logits.
#[test]
fn cpu_runs_f16_bundles() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "cpu-f16");
    let path = compile_fixture("tiny-qwen2", &dir, 1, Some(ir::DType::F16));
    let b = bundle::Bundle::open(&path).unwrap();
    assert_eq!(b.plan.act_dtype, ir::DType::F16);
    // The fixture's weights are bf16 values, which f16 holds exactly at their magnitudes.
    check_backend_against_hf("tiny-qwen2", &mut seqs(CpuBackend::new(&b).unwrap()), 1e-4);
}

/// `engrun bench --verify-alone` (what the GPU check runs on CUDA): the engine's greedy tokens
/// over chunked prefills, shared prefixes and continuous batching equal each request run alone
/// on the CPU; a sampled workload is refused (the check needs greedy tokens).
#[test]
fn bench_verify_alone_passes_on_the_cpu() {
    let path = bundles()[0].0.to_str().unwrap();
    let args = [
        "bench",
        path,
        "--device",
        "cpu",
        "--num-prompts",
        "6",
        "--input-len",
        "150",
        "--output-len",
        "12",
        "--random-range-ratio",
        "0.3",
        "--shared-prefix-len",
        "40",
        "--chunked-prefill-size",
        "64",
        "--warmup",
        "0",
        "--json",
    ];
    let o = run("engrun", &[&args[..], &["--verify-alone", "0"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let a = &r["alone"];
    assert_eq!((a["requests"].as_u64(), a["pass"].as_bool()), (Some(6), Some(true)), "{r}");
    assert_eq!(a["equal"], a["tokens"], "the CPU backend is batch-invariant: {r}");
    assert_eq!(a["tokens"].as_u64(), r["output_tokens"].as_u64(), "{r}");
    assert!(r["cached_tokens"].as_u64().unwrap() > 0, "the shared prefix came from the cache: {r}");
    let o = run("engrun", &[&args[..], &["--verify-alone", "0", "--temperature", "1"]].concat());
    assert!(!o.status.success() && stderr(&o).contains("needs greedy requests"), "{}", stderr(&o));
}
