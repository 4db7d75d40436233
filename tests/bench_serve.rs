//! `engrun bench-serve` against our own server on the CPU (tiny-qwen2): 40 streaming requests
//! at concurrency 8 all complete with exactly the workload's tokens (the offline bench's
//! prompt rule), the result keys of sglang.bench_serving are there and consistent
//! (percentiles ordered, TPOT and ITL within the end-to-end latency, throughputs over the
//! duration), `--request-rate` spaces the arrivals, the JSON lines are appended to
//! --output-file, and a dead server is a clear error.

use e2e::*;
use serde_json::Value;
use std::process::Command;

fn bench_serve(args: &[&str]) -> std::process::Output {
    Command::new(bin("engrun")).arg("bench-serve").args(args).output().expect("run engrun bench-serve")
}

#[test]
fn forty_requests_at_concurrency_8_complete_with_consistent_numbers() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "bench-serve");
    let b = compile_fixture("tiny-qwen2", &dir, 1, None);
    let server = Server::start(&b, &[]);
    let out_file = dir.join("results.jsonl");
    let _ = std::fs::remove_file(&out_file);
    let url = format!("http://{}", server.addr);
    let args = [
        "--base-url",
        &url,
        "--dataset-name",
        "random",
        "--num-prompts",
        "40",
        "--random-input-len",
        "48",
        "--random-output-len",
        "12",
        "--random-range-ratio",
        "0.5",
        "--max-concurrency",
        "8",
        "--seed",
        "7",
        "--tokenizer",
        b.to_str().unwrap(),
        "--output-file",
        out_file.to_str().unwrap(),
        "--disable-tqdm",
    ];
    let o = bench_serve(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let table = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(table.contains("Serving Benchmark Result") && table.contains("Median TTFT (ms):"), "{table}");
    let text = std::fs::read_to_string(&out_file).unwrap();
    assert_eq!(text.lines().count(), 1, "one JSON line appended");
    let r: Value = serde_json::from_str(text.trim()).unwrap();
    let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("no `{k}` in {r}"));

    // The same workload as the offline bench's rule makes.
    let vocab = text::Tokenizer::load(&b.join("tokenizer")).unwrap().vocab_size();
    let opts = runtime::bench::BenchOptions {
        num_prompts: 40,
        input_len: 48,
        output_len: 12,
        range_ratio: 0.5,
        shared_prefix_len: 0,
        seed: 7,
        warmup: 0,
        sampling: runtime::SamplingParams::default(),
        constraints: None,
    };
    let reqs = runtime::bench::requests(&opts, vocab).unwrap();
    let input: usize = reqs.iter().map(|q| q.prompt.len()).sum();
    let output: usize = reqs.iter().map(|q| q.max_tokens).sum();
    assert_eq!((f("completed"), f("failed")), (40.0, 0.0), "{r}");
    assert_eq!((f("total_input_tokens"), f("total_output_tokens")), (input as f64, output as f64), "{r}");

    let d = f("duration");
    assert!(
        (f("request_throughput") - 40.0 / d).abs() < 1e-9 && (f("output_throughput") - output as f64 / d).abs() < 1e-6
    );
    for m in ["ttft", "itl", "tpot", "e2e_latency"] {
        let (mean, median, p99) = (f(&format!("mean_{m}_ms")), f(&format!("median_{m}_ms")), f(&format!("p99_{m}_ms")));
        assert!(median > 0.0 && median <= p99 && mean <= p99, "{m}: mean {mean} median {median} p99 {p99}");
    }
    assert!(f("p99_ttft_ms") <= f("p99_e2e_latency_ms") && f("mean_tpot_ms") <= f("mean_e2e_latency_ms"), "{r}");
    assert!(f("p99_e2e_latency_ms") <= d * 1e3, "{r}");
    // One token per chunk here: the gaps between chunks average about a request's TPOT.
    assert!(f("mean_itl_ms") <= 3.0 * f("mean_tpot_ms") + 1.0, "{r}");
    // All at once but at most 8 in flight: the mean concurrency (total latency over the
    // duration) stays below 8.
    assert!(f("concurrency") <= 8.0 + 1e-9 && f("concurrency") > 1.0, "{r}");

    // At 20 requests a second, 10 requests arrive over about half a second (each gap
    // exponential): the run lasts at least a fifth of a second, far longer than 10 tiny
    // requests at once would.
    let o = bench_serve(&[
        "--base-url",
        &url,
        "--num-prompts",
        "10",
        "--random-input-len",
        "16",
        "--random-output-len",
        "4",
        "--request-rate",
        "20",
        "--random-vocab-size",
        "500",
        "--disable-tqdm",
        "--output-file",
        out_file.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&out_file).unwrap();
    let r: Value = serde_json::from_str(text.lines().nth(1).unwrap()).unwrap();
    assert_eq!(r["completed"], 10, "{r}");
    assert!(r["duration"].as_f64().unwrap() > 0.2, "{r}");

    // A server that is not there: every request fails, said on stdout, and nothing crashes.
    drop(server);
    let o = bench_serve(&[
        "--base-url",
        &url,
        "--model",
        "m",
        "--num-prompts",
        "2",
        "--random-vocab-size",
        "100",
        "--disable-tqdm",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("first error") && out.contains("Failed requests:"), "{out}");
}
