//! Offline throughput benchmark (`engrun bench`): random prompts, eos ignored, all requests
//! run as one static batch (prefill together, then decode together until each has its output
//! length). Continuous batching replaces the static batch once the scheduler exists.

use crate::{Backend, RuntimeError, Sampler, SamplingParams, SeqChunk};
use std::time::Instant;

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Number of requests.
    pub num_prompts: usize,
    /// Input length (the maximum when `range_ratio < 1`).
    pub input_len: usize,
    /// Output length (the maximum when `range_ratio < 1`).
    pub output_len: usize,
    /// Lengths are uniform in `[len * ratio, len]`, as SGLang's bench_serving does.
    pub range_ratio: f64,
    /// Seed of the prompts.
    pub seed: u64,
}

/// What was measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchReport {
    /// Requests run.
    pub requests: usize,
    /// Prompt tokens.
    pub input_tokens: usize,
    /// Generated tokens.
    pub output_tokens: usize,
    /// Wall time of the whole run.
    pub duration_s: f64,
    /// Generated tokens per second over the whole run.
    pub output_tok_s: f64,
    /// Prompt tokens per second during the prefill step.
    pub prefill_tok_s: f64,
    /// Generated tokens per second during decode steps.
    pub decode_tok_s: f64,
    /// Median time to first token.
    pub ttft_ms_p50: f64,
    /// Median time per output token after the first.
    pub tpot_ms_p50: f64,
    /// Measured copy bandwidth of the machine (bytes read + written per second).
    pub bandwidth_gb_s: f64,
    /// Decode: (weight + KV bytes read per step) / step time / bandwidth.
    pub decode_bandwidth_fraction: f64,
}

/// Best-of-5 memcpy bandwidth over 256 MiB, counting bytes read and written.
pub fn copy_bandwidth() -> f64 {
    let n = 256 << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&mut dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * n as f64 / best
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs the benchmark. `weight_bytes` and `kv_bytes_per_token` (all layers, K and V) size the
/// decode traffic.
pub fn run(
    backend: &mut dyn Backend,
    opts: &BenchOptions,
    weight_bytes: usize,
    kv_bytes_per_token: usize,
) -> Result<BenchReport, RuntimeError> {
    if opts.num_prompts == 0 || opts.input_len == 0 || opts.output_len == 0 || !(0.0..=1.0).contains(&opts.range_ratio)
    {
        return Err(RuntimeError::Invalid(
            "bench needs num-prompts, input-len, output-len >= 1 and a range ratio in [0, 1]".into(),
        ));
    }
    let mut rng = Sampler::new(SamplingParams { temperature: 1.0, seed: opts.seed, ..Default::default() })?;
    let vocab = backend.vocab();
    let len = |rng: &mut Sampler, max: usize| {
        let lo = ((max as f64 * opts.range_ratio).ceil() as usize).max(1);
        lo + (rng.uniform() * (max - lo + 1) as f64) as usize % (max - lo + 1)
    };
    let prompts: Vec<(Vec<u32>, usize)> = (0..opts.num_prompts)
        .map(|_| {
            let n = len(&mut rng, opts.input_len);
            let out = len(&mut rng, opts.output_len);
            ((0..n).map(|_| (rng.uniform() * vocab as f64) as u32 % vocab as u32).collect(), out)
        })
        .collect();
    let bandwidth = copy_bandwidth();
    let start = Instant::now();
    let rows: Vec<[usize; 1]> = prompts.iter().map(|(p, _)| [p.len() - 1]).collect();
    let chunks: Vec<SeqChunk> = prompts
        .iter()
        .zip(&rows)
        .enumerate()
        .map(|(i, ((p, _), r))| SeqChunk { seq: i as u64, tokens: p, rows: r })
        .collect();
    let logits = backend.forward_batch(&chunks)?;
    let prefill_s = start.elapsed().as_secs_f64();
    let mut next: Vec<u32> = logits.chunks(vocab).map(Sampler::argmax).collect();
    let mut produced = vec![1usize; prompts.len()];
    let mut decode_s = 0.0;
    let mut decode_tokens = 0;
    let mut bytes_read = 0.0;
    let mut cached: Vec<usize> = prompts.iter().map(|(p, _)| p.len()).collect();
    loop {
        let live: Vec<usize> = (0..prompts.len()).filter(|&i| produced[i] < prompts[i].1).collect();
        if live.is_empty() {
            break;
        }
        let toks: Vec<[u32; 1]> = live.iter().map(|&i| [next[i]]).collect();
        let batch: Vec<SeqChunk> =
            live.iter().zip(&toks).map(|(&i, t)| SeqChunk { seq: i as u64, tokens: t, rows: &[0] }).collect();
        let t = Instant::now();
        let logits = backend.forward_batch(&batch)?;
        decode_s += t.elapsed().as_secs_f64();
        bytes_read += (weight_bytes + live.iter().map(|&i| cached[i] + 1).sum::<usize>() * kv_bytes_per_token) as f64;
        for (&i, row) in live.iter().zip(logits.chunks(vocab)) {
            next[i] = Sampler::argmax(row);
            produced[i] += 1;
            cached[i] += 1;
            decode_tokens += 1;
        }
    }
    let duration = start.elapsed().as_secs_f64();
    for i in 0..prompts.len() {
        backend.release(i as u64);
    }
    let output_tokens: usize = produced.iter().sum();
    let steps_per_request: Vec<f64> = produced.iter().map(|&p| p as f64).collect();
    let tpot =
        if decode_tokens > 0 { decode_s / steps_per_request.iter().copied().fold(0.0, f64::max).max(1.0) } else { 0.0 };
    Ok(BenchReport {
        requests: prompts.len(),
        input_tokens: prompts.iter().map(|(p, _)| p.len()).sum(),
        output_tokens,
        duration_s: duration,
        output_tok_s: output_tokens as f64 / duration,
        prefill_tok_s: prompts.iter().map(|(p, _)| p.len()).sum::<usize>() as f64 / prefill_s,
        decode_tok_s: if decode_s > 0.0 { decode_tokens as f64 / decode_s } else { 0.0 },
        ttft_ms_p50: median(vec![prefill_s * 1e3; prompts.len()]),
        tpot_ms_p50: tpot * 1e3,
        bandwidth_gb_s: bandwidth / 1e9,
        decode_bandwidth_fraction: if decode_s > 0.0 { bytes_read / decode_s / bandwidth } else { 0.0 },
    })
}
