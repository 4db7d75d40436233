//! Embeddings: the engine's embedding requests (final hidden state after the model's norm,
//! pooled over the prompt's last token or all its tokens, L2-normalised) against HF
//! transformers through the lm_head (logits are `W · h`, linear in `h`, so `W · e` must be
//! proportional to HF's logits at the last position, or to their mean over the positions),
//! chunked and batched beside generation requests that stay as they were; `--tp 2` equals
//! tp 1; `POST /v1/embeddings` answers in OpenAI's shape and refuses what it does not do.

use e2e::*;
use runtime::{CpuBackend, Engine, EngineConfig, Pooling, Request, TpCpuBackend};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// The fixture's lm_head as f32 rows (`[vocab, hidden]`).
fn lm_head(name: &str) -> (Vec<f32>, usize) {
    let path = fixture(name).join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("lm_head.weight").or_else(|_| st.tensor("model.embed_tokens.weight")).unwrap();
    let dtype = match t.dtype() {
        safetensors::Dtype::BF16 => ir::DType::BF16,
        safetensors::Dtype::F16 => ir::DType::F16,
        _ => ir::DType::F32,
    };
    (dtype.to_f32(t.data()), t.shape()[1])
}

/// `W · e` for each row of `W`.
fn project(w: &[f32], hidden: usize, e: &[f32]) -> Vec<f32> {
    assert_eq!(e.len(), hidden, "embedding width");
    w.chunks_exact(hidden).map(|row| row.iter().zip(e).map(|(a, b)| a * b).sum()).collect()
}

/// The relative error of `got` against `want` after the best scale of `got` (an embedding is
/// the hidden state divided by its norm).
fn proportional_err(got: &[f32], want: &[f32]) -> f32 {
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum::<f64>();
    let scale = (dot(got, want) / dot(got, got)) as f32;
    rel_err(&got.iter().map(|x| x * scale).collect::<Vec<_>>(), want)
}

fn norm(v: &[f32]) -> f32 {
    v.iter().map(|x| x * x).sum::<f32>().sqrt()
}

fn bundle_dir(name: &str) -> PathBuf {
    scratch(env!("CARGO_TARGET_TMPDIR"), name)
}

/// An engine on the CPU with chunks of 4 tokens and 8 prompt tokens a step: every prompt
/// longer than 4 tokens is computed in several steps, and several requests share a step.
fn engine(bundle: &Path) -> Engine {
    let b = bundle::Bundle::open(bundle).unwrap();
    let backend: Box<dyn runtime::Backend> =
        if b.plan.tp > 1 { Box::new(TpCpuBackend::new(&b).unwrap()) } else { Box::new(CpuBackend::new(&b).unwrap()) };
    let cfg = EngineConfig {
        kv_slots: Some(2048),
        chunked_prefill_size: 4,
        max_prefill_tokens: 8,
        ..EngineConfig::for_bundle(&b).unwrap()
    };
    Engine::new(backend, cfg).unwrap()
}

/// The golden prompts' embeddings (last token each; the 5-token prompt's mean too), submitted
/// together with two generation requests.
fn embed_goldens(bundle: &Path) -> (Vec<Vec<f32>>, Vec<f32>, Vec<Vec<u32>>) {
    let g = goldens("tiny-llama");
    let prompts: Vec<Vec<u32>> = g["prompts"].as_array().unwrap().iter().map(|p| ids(&p["ids"])).collect();
    let gen = |p: &Vec<u32>| Request { ignore_eos: true, ..Request::greedy(p.clone(), 8) };
    let mut reqs = vec![gen(&prompts[3])];
    reqs.extend(prompts.iter().map(|p| Request::embedding(p.clone(), Pooling::Last)));
    reqs.push(Request::embedding(prompts[1].clone(), Pooling::Mean));
    reqs.push(gen(&prompts[2]));
    let mut out = engine(bundle).generate(reqs).unwrap();
    let generated = vec![out.remove(0).tokens, out.pop().unwrap().tokens];
    let mean = out.pop().unwrap().embedding;
    let last = out.into_iter().map(|o| o.embedding).collect();
    (last, mean, generated)
}

#[test]
fn pooled_hidden_states_match_hf_through_the_lm_head() {
    let b = compile_fixture("tiny-llama", &bundle_dir("embed-tp1"), 1, None);
    let (last, mean, generated) = embed_goldens(&b);
    let (w, hidden) = lm_head("tiny-llama");
    let refs = fixture("tiny-llama").join("reference/logits.safetensors");
    for (i, e) in last.iter().enumerate() {
        assert!((norm(e) - 1.0).abs() < 1e-5, "prompt {i}: |e| = {}", norm(e));
        let (_, want) = read_f32(&refs, &format!("last_logits.{i}"));
        let err = proportional_err(&project(&w, hidden, e), &want);
        assert!(err < 1e-4, "prompt {i}: W·e against HF's last logits: rel err {err}");
    }
    // The mean of the hidden states gives the mean of the logits.
    let (shape, all) = read_f32(&refs, "all_logits.5");
    let vocab = shape[1];
    let want: Vec<f32> = (0..vocab).map(|v| (0..shape[0]).map(|t| all[t * vocab + v]).sum::<f32>() / 5.0).collect();
    assert!((norm(&mean) - 1.0).abs() < 1e-5);
    let err = proportional_err(&project(&w, hidden, &mean), &want);
    assert!(err < 1e-4, "mean pooling against HF's mean logits: rel err {err}");
    let (_, last5) = read_f32(&refs, "last_logits.1");
    assert!(proportional_err(&project(&w, hidden, &mean), &last5) > 1e-2, "the mean differs from the last token's");
    // The generation requests that shared the engine are what they are alone.
    let g = goldens("tiny-llama");
    let prompts: Vec<Vec<u32>> = g["prompts"].as_array().unwrap().iter().map(|p| ids(&p["ids"])).collect();
    let mut e = engine(&b);
    let alone = e
        .generate(vec![
            Request { ignore_eos: true, ..Request::greedy(prompts[3].clone(), 8) },
            Request { ignore_eos: true, ..Request::greedy(prompts[2].clone(), 8) },
        ])
        .unwrap();
    assert_eq!(generated, alone.into_iter().map(|o| o.tokens).collect::<Vec<_>>());
    // A prompt whose prefix the cache holds now: a mean still reads every token's state.
    let embed = |e: &mut Engine| e.generate(vec![Request::embedding(prompts[3].clone(), Pooling::Mean)]).unwrap();
    assert_eq!(embed(&mut e)[0].embedding, embed(&mut engine(&b))[0].embedding);
}

#[test]
fn tp2_embeddings_equal_tp1() {
    let one = embed_goldens(&compile_fixture("tiny-llama", &bundle_dir("embed-a"), 1, None));
    let two = embed_goldens(&compile_fixture("tiny-llama", &bundle_dir("embed-b"), 2, None));
    for (a, b) in one.0.iter().chain([&one.1]).zip(two.0.iter().chain([&two.1])) {
        let diff = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
        assert!(diff < 1e-5, "tp 2 differs from tp 1 by {diff}");
    }
    assert_eq!(one.2, two.2);
}

fn post(server: &Server, body: &Value) -> (u16, Value) {
    let (status, text) = http(&server.addr, "POST", "/v1/embeddings", Some(&body.to_string()), &[]);
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}")))
}

#[test]
fn the_endpoint_answers_in_openais_shape_and_refuses_what_it_does_not_do() {
    let b = compile_fixture("tiny-llama", &bundle_dir("embed-server"), 1, None);
    let server = Server::start(&b, &["--served-model-name", "tiny", "--pooling", "mean"]);
    let (status, r) = post(&server, &json!({"model": "tiny", "input": ["hello world", "hello world", "a dragon"]}));
    assert_eq!(status, 200, "{r}");
    assert_eq!((r["object"].as_str(), r["model"].as_str()), (Some("list"), Some("tiny")), "{r}");
    let vecs: Vec<Vec<f32>> = r["data"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, d)| {
            assert_eq!((d["object"].as_str(), d["index"].as_u64()), (Some("embedding"), Some(i as u64)));
            d["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
        })
        .collect();
    assert_eq!(vecs[0], vecs[1], "identical inputs");
    assert!(vecs[0] != vecs[2], "different inputs");
    assert!(vecs.iter().all(|v| (norm(v) - 1.0).abs() < 1e-5 && v.len() == 64));
    let tokens = r["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(tokens > 3 && r["usage"]["total_tokens"].as_u64() == Some(tokens), "{r}");
    // Token ids as input: the same vector as the text they encode.
    let (_, t) = http(&server.addr, "POST", "/tokenize", Some(r#"{"prompt": "hello world"}"#), &[]);
    let ids: Value = serde_json::from_str::<Value>(&t).unwrap()["tokens"].clone();
    let (_, by_ids) = post(&server, &json!({"input": ids}));
    let v: Vec<f32> =
        by_ids["data"][0]["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
    assert_eq!(v, vecs[0]);
    let cases = [
        (json!({"input": "hi", "foo": 1}), 400, "foo"),
        (json!({"input": "hi", "encoding_format": "hex"}), 400, "encoding_format"),
        (json!({"input": "hi", "dimensions": 8}), 400, "dimensions"),
        (json!({"input": ""}), 400, "input"),
        (json!({"input": [[]]}), 400, "input"),
        (json!({"input": [1, 99999999]}), 400, "input"),
        (json!({"input": 5}), 400, "input"),
        (json!({}), 400, "input"),
        (json!({"input": "hi", "model": "other"}), 404, "model"),
    ];
    for (body, want, param) in cases {
        let (status, r) = post(&server, &body);
        assert_eq!((status, r["error"]["param"].as_str()), (want, Some(param)), "{body}: {r}");
        assert!(r["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{r}");
    }
    // Still serving.
    assert_eq!(post(&server, &json!({"input": "hi", "dimensions": 64})).0, 200);
}

/// The reference interpreter's hidden states (`--device ref`) equal the CPU backend's.
#[test]
fn the_interpreter_returns_the_same_hidden_states() {
    use runtime::{Backend, RefBackend, StepSeq};
    let b = bundle::Bundle::open(&compile_fixture("tiny-llama", &bundle_dir("embed-ref"), 1, None)).unwrap();
    let prompt = ids(&goldens("tiny-llama")["prompts"][2]["ids"]);
    let slots: Vec<u32> = (0..prompt.len() as u32).collect();
    let rows: Vec<usize> = (0..prompt.len()).collect();
    let hidden = |mut backend: Box<dyn Backend>| {
        backend.alloc_kv(64).unwrap();
        assert_eq!(backend.hidden_size(), 64);
        backend.forward_hidden(&[StepSeq { tokens: &prompt, slots: &slots, rows: &rows }]).unwrap()
    };
    let (cpu, refr) = (hidden(Box::new(CpuBackend::new(&b).unwrap())), hidden(Box::new(RefBackend::new(&b).unwrap())));
    assert_eq!(cpu.len(), prompt.len() * 64);
    assert!(rel_err(&cpu, &refr) < 1e-5, "{}", rel_err(&cpu, &refr));
}
