//! Prompts past 512 tokens and every RoPE scaling type (linear, llama3, yarn, longrope with its
//! long and its short factors), Qwen3 (per-head q/k norms, `models/qwen3.yaml`), Gemma 2
//! (elementwise maps, `(1 + w)` norms, soft-capping, alternating sliding windows), Gemma 3
//! (per-head `(1 + w)` q/k norms, a RoPE per layer type), Mistral (a sliding window on every
//! layer) and Phi-3 (fused qkv / gate-up tensors, RoPE on half of each head, longrope), against HF
//! transformers, on the fixtures of `tests/fixtures/` (scripts/make-references.py made them):
//! the reference interpreter and the CPU backend at the recorded positions and along HF's
//! greedy continuation, and the engine (chunked prefill of 128 tokens over the paged KV cache)
//! by the log-probabilities and greedy tokens it returns.

use e2e::*;
use runtime::{CpuBackend, Engine, EngineConfig, RefBackend, Request};
use std::path::PathBuf;
use std::sync::OnceLock;

/// Relative tolerance against HF's float32 logits.
const TOL: f32 = 1e-4;

/// One fixture's HF reference (see scripts/make-references.py).
struct Reference {
    name: &'static str,
    prompt: Vec<u32>,
    /// Prompt positions whose logits HF recorded, one row of `logits` each.
    positions: Vec<usize>,
    logits: Vec<f32>,
    /// HF's greedy tokens after the prompt.
    greedy: Vec<u32>,
    /// The logits each greedy token was picked from (row 0: the prompt's last position).
    greedy_logits: Vec<f32>,
    vocab: usize,
}

impl Reference {
    fn load(name: &'static str) -> Reference {
        let dir = repo_fixture(name);
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).expect("reference.json"))
                .expect("valid JSON");
        let st = dir.join("reference.safetensors");
        let (shape, logits) = read_f32(&st, "logits");
        let (gshape, greedy_logits) = read_f32(&st, "greedy_logits");
        let positions: Vec<usize> = ids(&meta["positions"]).into_iter().map(|p| p as usize).collect();
        let greedy = ids(&meta["greedy"]);
        assert_eq!((shape[0], gshape[0]), (positions.len(), greedy.len()), "{name}: reference shapes");
        Reference { name, prompt: ids(&meta["prompt"]), positions, logits, greedy, greedy_logits, vocab: shape[1] }
    }

    fn row(&self, i: usize) -> &[f32] {
        &self.logits[i * self.vocab..(i + 1) * self.vocab]
    }

    fn greedy_row(&self, i: usize) -> &[f32] {
        &self.greedy_logits[i * self.vocab..(i + 1) * self.vocab]
    }
}

/// Whether HF's top-1 token of `row` wins by a margin no f32 implementation can flip.
fn clear(row: &[f32]) -> bool {
    let scale = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    top2(row).1 > 10.0 * TOL * scale
}

const FIXTURES: [&str; 14] = [
    "long-plain",
    "rope-linear",
    "rope-llama3",
    "rope-yarn",
    "rope-longrope",
    "rope-longrope-short",
    "tiny-qwen3",
    "tiny-gemma2",
    "tiny-gemma3",
    "tiny-mistral",
    "tiny-phi3",
    "tiny-qwen3-moe",
    "tiny-mixtral",
    "tiny-gpt-oss",
];

/// The model YAML of a fixture: `tiny-NAME` is `models/NAME.yaml` (`-` as `_`), the rest Llama.
fn model(name: &str) -> String {
    name.strip_prefix("tiny-").unwrap_or("llama").replace('-', "_")
}

/// The fixture bundles (f32), compiled once per test binary.
fn bundle_path(name: &str) -> PathBuf {
    static B: OnceLock<Vec<PathBuf>> = OnceLock::new();
    let all = B.get_or_init(|| {
        let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "long-reference");
        let f32 = Some(ir::DType::F32);
        FIXTURES.iter().map(|n| compile_checkpoint(&model(n), &repo_fixture(n), &dir, 1, f32)).collect()
    });
    all[FIXTURES.iter().position(|n| *n == name).expect("a known fixture")].clone()
}

fn bundle(name: &str) -> bundle::Bundle {
    bundle::Bundle::open(&bundle_path(name)).expect("bundle opens")
}

/// The prompt in one prefill: logits at the recorded positions within [`TOL`]; then HF's
/// greedy tokens fed one by one: each step's logits within [`TOL`] and its argmax HF's token
/// where the margin is clear.
fn check_sequences(r: &Reference, s: &mut runtime::Sequences, what: &str) {
    let got = s.forward(0, &r.prompt, &r.positions).unwrap();
    let mut worst = 0.0f32;
    for (i, &pos) in r.positions.iter().enumerate() {
        let err = rel_err(&got[i * r.vocab..(i + 1) * r.vocab], r.row(i));
        assert!(err < TOL, "{what} {}: logits at position {pos} rel err {err}", r.name);
        worst = worst.max(err);
    }
    let mut next = got[(r.positions.len() - 1) * r.vocab..].to_vec();
    for (step, &want) in r.greedy.iter().enumerate() {
        let hf = r.greedy_row(step);
        let err = rel_err(&next, hf);
        assert!(err < TOL, "{what} {}: greedy step {step} logits rel err {err}", r.name);
        worst = worst.max(err);
        if clear(hf) {
            assert_eq!(top2(&next).0, want, "{what} {}: greedy step {step}", r.name);
        }
        next = s.forward(0, &[want], &[0]).unwrap();
    }
    s.release(0);
    eprintln!("{what} {} ({} tokens): worst rel err {worst:.2e}", r.name, r.prompt.len());
}

#[test]
fn reference_interpreter_matches_hf_past_512_tokens() {
    for name in FIXTURES {
        let r = Reference::load(name);
        check_sequences(&r, &mut seqs(RefBackend::new(&bundle(name)).unwrap()), "ref");
    }
}

#[test]
fn cpu_backend_matches_hf_past_512_tokens() {
    for name in FIXTURES {
        let r = Reference::load(name);
        check_sequences(&r, &mut seqs(CpuBackend::new(&bundle(name)).unwrap()), "cpu");
    }
}

/// `log_softmax(row)[token]`, in f64.
fn logprob(row: &[f32], token: u32) -> f32 {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let lse = max + row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
    (row[token as usize] as f64 - lse) as f32
}

/// The engine's top log-probabilities of one step against HF's logits of that step.
fn check_logprobs(r: &Reference, got: &runtime::Logprobs, hf: &[f32], at: &str) {
    let scale = hf.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for &(token, lp) in &got.top {
        let want = logprob(hf, token);
        // A log-probability is a logit less the log-sum-exp: two logits' errors at most.
        assert!((lp - want).abs() < 2.0 * TOL * scale, "{} {at}: logprob of {token} {lp}, HF {want}", r.name);
    }
    if clear(hf) {
        assert_eq!(got.top[0].0, top2(hf).0, "{} {at}: most likely token", r.name);
    }
}

/// Through the engine, prefill in chunks of 128 tokens over pages of 16: the whole prompt's
/// greedy continuation (tokens while HF's margins are clear, and every step's log-probabilities
/// up to there) and, for each recorded position, a request whose prompt ends there (its first
/// token's log-probabilities against HF's logits at that position).
#[test]
fn engine_with_chunked_prefill_matches_hf_past_512_tokens() {
    for name in FIXTURES {
        let r = Reference::load(name);
        let b = bundle(name);
        let cfg = EngineConfig {
            kv_slots: Some(16384),
            chunked_prefill_size: 128,
            max_prefill_tokens: 512,
            ..EngineConfig::for_bundle(&b).unwrap()
        };
        let mut engine = Engine::new(Box::new(CpuBackend::new(&b).unwrap()), cfg).unwrap();
        let ask = |prompt: &[u32], max_tokens| Request {
            logprobs: Some(20),
            ignore_eos: true,
            ..Request::greedy(prompt.to_vec(), max_tokens)
        };
        let mut reqs = vec![ask(&r.prompt, r.greedy.len())];
        reqs.extend(r.positions.iter().map(|&p| ask(&r.prompt[..=p], 1)));
        let out = engine.generate(reqs).unwrap();
        let whole = &out[0];
        let mut compared = 0;
        for (step, &want) in r.greedy.iter().enumerate() {
            let hf = r.greedy_row(step);
            check_logprobs(&r, &whole.logprobs[step], hf, &format!("greedy step {step}"));
            if !clear(hf) {
                break;
            }
            assert_eq!(whole.tokens[step], want, "{name}: engine greedy step {step}");
            compared += 1;
        }
        assert!(compared > 0, "{name}: no greedy step had a clear margin");
        for (i, (&p, o)) in r.positions.iter().zip(&out[1..]).enumerate() {
            check_logprobs(&r, &o.logprobs[0], r.row(i), &format!("position {p}"));
        }
        eprintln!("engine {name}: {compared} greedy tokens, {} positions compared", r.positions.len());
    }
}
