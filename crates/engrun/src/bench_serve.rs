//! `engrun bench-serve`: the online benchmark of an OpenAI-compatible server, with the flags and
//! result keys of `sglang.bench_serving` / `vllm bench serve`. Random token-id prompts (the
//! offline `engrun bench`'s rule, `runtime::bench::requests`, so the two measure the same
//! workload) go to `/v1/completions` as streaming requests, arriving as a Poisson process at
//! `--request-rate` with at most `--max-concurrency` in flight; each request's first token
//! (TTFT), the gaps between its later chunks (ITL), its time per output token (TPOT) and its
//! end-to-end latency are timed on the client. Works against any server that takes token-id
//! prompts, `stream_options.include_usage` and (to keep the output lengths) `ignore_eos`, as
//! vLLM and SGLang do. Plain HTTP only.

use clap::Args;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The flags (names as sglang.bench_serving and vllm bench serve spell them).
#[derive(Args, Debug, Clone)]
pub struct ServeBenchArgs {
    /// The server, e.g. http://127.0.0.1:30000.
    #[arg(long, default_value = "http://127.0.0.1:30000")]
    base_url: String,
    /// The model name to send (default: the first of the server's `/v1/models`).
    #[arg(long)]
    model: Option<String>,
    /// The prompts: `random` (random token ids).
    #[arg(long, default_value = "random")]
    dataset_name: String,
    /// Number of requests.
    #[arg(long, default_value_t = 1000)]
    num_prompts: usize,
    /// Prompt length (the maximum, with --random-range-ratio).
    #[arg(long, default_value_t = 1024)]
    random_input_len: usize,
    /// Output length (the maximum, with --random-range-ratio).
    #[arg(long, default_value_t = 1024)]
    random_output_len: usize,
    /// Lengths uniform in [len * ratio, len].
    #[arg(long, default_value_t = 0.0)]
    random_range_ratio: f64,
    /// Prompt token ids are drawn below this (default: the size of --tokenizer's vocabulary).
    #[arg(long)]
    random_vocab_size: Option<usize>,
    /// A directory with the server model's `tokenizer.json` (a bundle will do), for the
    /// vocabulary size.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Most requests in flight (default: no limit).
    #[arg(long)]
    max_concurrency: Option<usize>,
    /// Requests per second, arriving as a Poisson process (default: all at once).
    #[arg(long, default_value_t = f64::INFINITY)]
    request_rate: f64,
    /// Seed of the prompts and the arrival times.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Append the results as one JSON line to this file.
    #[arg(long)]
    output_file: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    disable_tqdm: bool,
}

/// One request's timing, as the client saw it.
#[derive(Debug, Clone, Default)]
struct Outcome {
    ok: bool,
    error: String,
    prompt_len: usize,
    output_len: usize,
    ttft: f64,
    itl: Vec<f64>,
    latency: f64,
}

/// Runs the benchmark; prints the summary table and returns the results (also appended to
/// `--output-file`).
pub fn run(a: &ServeBenchArgs) -> Result<Value, String> {
    if a.dataset_name != "random" {
        return Err(format!("--dataset-name {}: only `random` is supported", a.dataset_name));
    }
    if a.request_rate.is_nan() || a.request_rate <= 0.0 || a.max_concurrency == Some(0) {
        return Err("--request-rate and --max-concurrency must be positive".into());
    }
    let base = a.base_url.trim_end_matches('/').to_string();
    let agent = ureq::AgentBuilder::new().timeout_connect(Duration::from_secs(10)).build();
    let model = match &a.model {
        Some(m) => m.clone(),
        None => first_model(&agent, &base)?,
    };
    let vocab = match (a.random_vocab_size, &a.tokenizer) {
        (Some(v), _) => v,
        (None, Some(dir)) => {
            // A bundle keeps its tokenizer in `tokenizer/`.
            let dir = if dir.join("tokenizer/tokenizer.json").is_file() { dir.join("tokenizer") } else { dir.clone() };
            text::Tokenizer::load(&dir).map_err(|e| e.to_string())?.vocab_size()
        }
        (None, None) => return Err("give --tokenizer DIR or --random-vocab-size N (prompt ids are random)".into()),
    };
    let opts = runtime::bench::BenchOptions {
        num_prompts: a.num_prompts,
        input_len: a.random_input_len,
        output_len: a.random_output_len,
        range_ratio: a.random_range_ratio,
        shared_prefix_len: 0,
        seed: a.seed,
        warmup: 0,
        sampling: runtime::SamplingParams::default(),
        constraints: None,
    };
    let reqs = runtime::bench::requests(&opts, vocab).map_err(|e| e.to_string())?;
    let bodies: Vec<(usize, Value)> = reqs
        .iter()
        .map(|r| {
            let body = json!({
                "model": model, "prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0.0,
                "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true},
            });
            (r.prompt.len(), body)
        })
        .collect();
    let bar = progress(bodies.len(), a.disable_tqdm);
    let start = Instant::now();
    let outcomes = drive(&agent, &format!("{base}/v1/completions"), bodies, a, &bar);
    let duration = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let result = summary(&outcomes, duration, a, &model);
    print_table(&result);
    if let Some(path) = &a.output_file {
        append_line(path, &result)?;
    }
    Ok(result)
}

fn progress(n: usize, hidden: bool) -> indicatif::ProgressBar {
    if hidden {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(n as u64);
    if let Ok(style) = indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} requests [{elapsed_precise}]") {
        bar.set_style(style);
    }
    bar
}

/// The first model `GET /v1/models` lists.
fn first_model(agent: &ureq::Agent, base: &str) -> Result<String, String> {
    let v: Value = agent
        .get(&format!("{base}/v1/models"))
        .call()
        .map_err(|e| format!("{base}/v1/models: {e}"))?
        .into_string()
        .map_err(|e| e.to_string())
        .and_then(|s| serde_json::from_str(&s).map_err(|e| e.to_string()))?;
    v["data"][0]["id"].as_str().map(str::to_string).ok_or_else(|| format!("{base}/v1/models lists no model: {v}"))
}

/// Sends every body as its arrival time comes (exponential gaps at the request rate), with
/// at most `max_concurrency` requests in flight (one worker thread each).
fn drive(
    agent: &ureq::Agent,
    url: &str,
    bodies: Vec<(usize, Value)>,
    a: &ServeBenchArgs,
    bar: &indicatif::ProgressBar,
) -> Vec<Outcome> {
    let n = bodies.len();
    let workers = a.max_concurrency.unwrap_or(n).min(n).min(2048);
    let (tx, rx) = mpsc::channel::<(usize, usize, Value)>();
    let rx = Arc::new(Mutex::new(rx));
    let results = Arc::new(Mutex::new(vec![Outcome::default(); n]));
    std::thread::scope(|s| {
        for _ in 0..workers {
            let (rx, results, agent) = (rx.clone(), results.clone(), agent.clone());
            s.spawn(move || loop {
                let job = rx.lock().map_err(|_| ()).and_then(|r| r.recv().map_err(|_| ()));
                let Ok((i, prompt_len, body)) = job else { break };
                let o = one(&agent, url, &body, prompt_len);
                if let Ok(mut r) = results.lock() {
                    r[i] = o;
                }
                bar.inc(1);
            });
        }
        let mut rng = runtime::Sampler::new(runtime::SamplingParams { seed: a.seed, ..Default::default() }).ok();
        for (i, (len, body)) in bodies.into_iter().enumerate() {
            if a.request_rate.is_finite() {
                let u = rng.as_mut().map_or(0.5, |r| r.uniform());
                std::thread::sleep(Duration::from_secs_f64(-(1.0 - u).ln() / a.request_rate));
            }
            if tx.send((i, len, body)).is_err() {
                break;
            }
        }
        drop(tx);
    });
    Arc::try_unwrap(results).map(|m| m.into_inner().unwrap_or_default()).unwrap_or_default()
}

/// One streaming request: the time of its first chunk with text, of each later one, and its
/// output length from the usage the stream ends with (else its chunks).
fn one(agent: &ureq::Agent, url: &str, body: &Value, prompt_len: usize) -> Outcome {
    let mut o = Outcome { prompt_len, ..Outcome::default() };
    let t0 = Instant::now();
    let resp = match agent.post(url).set("Content-Type", "application/json").send_string(&body.to_string()) {
        Ok(r) => r,
        Err(ureq::Error::Status(code, r)) => {
            o.error = format!("HTTP {code}: {}", r.into_string().unwrap_or_default());
            return o;
        }
        Err(e) => {
            o.error = e.to_string();
            return o;
        }
    };
    let (mut last, mut chunks, mut usage) = (None::<f64>, 0usize, None::<usize>);
    for line in BufReader::new(resp.into_reader()).lines() {
        let line = match line {
            Ok(l) => l,
            Err(e) => {
                o.error = e.to_string();
                return o;
            }
        };
        let Some(data) = line.strip_prefix("data:").map(str::trim) else { continue };
        if data == "[DONE]" {
            break;
        }
        let Ok(v) = serde_json::from_str::<Value>(data) else { continue };
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            usage = Some(n as usize);
        }
        let text = v["choices"][0]["text"].as_str().unwrap_or("");
        if v["choices"].as_array().is_some_and(|c| !c.is_empty()) && (!text.is_empty() || chunks == 0) {
            let now = t0.elapsed().as_secs_f64();
            match last {
                None => o.ttft = now,
                Some(prev) => o.itl.push(now - prev),
            }
            last = Some(now);
            chunks += 1;
        }
    }
    o.latency = t0.elapsed().as_secs_f64();
    o.output_len = usage.unwrap_or(chunks);
    o.ok = last.is_some();
    if !o.ok {
        o.error = "the stream ended without a token".into();
    }
    o
}

/// `p`-th percentile (0-100) with linear interpolation, as numpy's default.
fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let pos = p / 100.0 * (s.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    s[lo] + (s[hi] - s[lo]) * (pos - lo as f64)
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// The result keys of sglang.bench_serving / vllm bench serve.
fn summary(outcomes: &[Outcome], duration: f64, a: &ServeBenchArgs, model: &str) -> Value {
    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.ok).collect();
    let ms = |f: &dyn Fn(&Outcome) -> Vec<f64>| ok.iter().flat_map(|o| f(o)).map(|s| s * 1e3).collect::<Vec<f64>>();
    let ttft = ms(&|o| vec![o.ttft]);
    let itl = ms(&|o| o.itl.clone());
    let tpot = ms(&|o| if o.output_len > 1 { vec![(o.latency - o.ttft) / (o.output_len - 1) as f64] } else { vec![] });
    let e2e = ms(&|o| vec![o.latency]);
    let input: usize = ok.iter().map(|o| o.prompt_len).sum();
    let output: usize = ok.iter().map(|o| o.output_len).sum();
    let mut r = json!({
        "backend": "openai", "dataset_name": a.dataset_name, "model_id": model, "base_url": a.base_url,
        "num_prompts": a.num_prompts, "random_input_len": a.random_input_len,
        "random_output_len": a.random_output_len, "random_range_ratio": a.random_range_ratio,
        "request_rate": if a.request_rate.is_finite() { json!(a.request_rate) } else { json!("inf") },
        "max_concurrency": a.max_concurrency, "seed": a.seed,
        "duration": duration, "completed": ok.len(), "failed": outcomes.len() - ok.len(),
        "total_input_tokens": input, "total_output_tokens": output,
        "request_throughput": ok.len() as f64 / duration,
        "input_throughput": input as f64 / duration, "output_throughput": output as f64 / duration,
        "total_token_throughput": (input + output) as f64 / duration,
        "concurrency": e2e.iter().sum::<f64>() / 1e3 / duration,
    });
    for (name, v) in [("ttft", &ttft), ("itl", &itl), ("tpot", &tpot), ("e2e_latency", &e2e)] {
        r[format!("mean_{name}_ms")] = json!(mean(v));
        r[format!("median_{name}_ms")] = json!(percentile(v, 50.0));
        r[format!("p99_{name}_ms")] = json!(percentile(v, 99.0));
    }
    if let Some(e) = outcomes.iter().find(|o| !o.ok) {
        r["first_error"] = json!(e.error);
    }
    r
}

fn print_table(r: &Value) {
    let num = |k: &str| r[k].as_f64().unwrap_or(0.0);
    println!("{:=^60}", " Serving Benchmark Result ");
    println!("{:<44}{:>16}", "Successful requests:", r["completed"]);
    println!("{:<44}{:>16}", "Failed requests:", r["failed"]);
    println!("{:<44}{:>16.2}", "Benchmark duration (s):", num("duration"));
    println!("{:<44}{:>16}", "Total input tokens:", r["total_input_tokens"]);
    println!("{:<44}{:>16}", "Total generated tokens:", r["total_output_tokens"]);
    println!("{:<44}{:>16.2}", "Request throughput (req/s):", num("request_throughput"));
    println!("{:<44}{:>16.2}", "Output token throughput (tok/s):", num("output_throughput"));
    println!("{:<44}{:>16.2}", "Total token throughput (tok/s):", num("total_token_throughput"));
    println!("{:<44}{:>16.2}", "Concurrency:", num("concurrency"));
    for (title, key) in [
        ("End-to-end Latency", "e2e_latency"),
        ("Time to First Token", "ttft"),
        ("Time per Output Token (excl. 1st token)", "tpot"),
        ("Inter-token Latency", "itl"),
    ] {
        println!("{:-^60}", format!(" {title} "));
        for stat in ["mean", "median", "p99"] {
            let label =
                format!("{} {} (ms):", stat[..1].to_uppercase() + &stat[1..], key.replace('_', " ").to_uppercase());
            println!("{:<44}{:>16.2}", label, num(&format!("{stat}_{key}_ms")));
        }
    }
    println!("{}", "=".repeat(60));
    if let Some(e) = r["first_error"].as_str() {
        println!("first error: {e}");
    }
}

fn append_line(path: &PathBuf, r: &Value) -> Result<(), String> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    writeln!(f, "{r}").map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_as_numpy() {
        let v = [4.0, 1.0, 3.0, 2.0];
        assert_eq!(percentile(&v, 50.0), 2.5);
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 100.0), 4.0);
        assert!((percentile(&v, 99.0) - 3.97).abs() < 1e-12);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }
}
