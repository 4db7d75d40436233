//! Offline throughput benchmark (`engrun bench`): random prompts (optionally sharing a
//! prefix), eos ignored, all queued at once and served by the [`Engine`] with continuous
//! batching; reports TTFT, TPOT, prefill and decode rates, cache hits, and decode's share of
//! the measured memory bandwidth.

use crate::{Constraint, Engine, Event, ReqId, Request, RuntimeError, Sampler, SamplingParams};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// Makes a fresh constraint for each request (an output format every request carries).
#[derive(Clone)]
pub struct Constraints(pub Arc<dyn Fn() -> Result<Constraint, String> + Send + Sync>);

impl std::fmt::Debug for Constraints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constraints")
    }
}

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
    /// Every prompt starts with the same this many tokens (counted in the input length).
    pub shared_prefix_len: usize,
    /// Seed of the prompts.
    pub seed: u64,
    /// Untimed passes of the same workload, with other prompts, before the timed one.
    pub warmup: usize,
    /// How every request samples (request i with seed `sampling.seed + i`).
    pub sampling: SamplingParams,
    /// The output format every request follows, if any (eos then ends a request only where
    /// the format allows it: choose one that outlasts the output length).
    pub constraints: Option<Constraints>,
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
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
    /// `cached_tokens / input_tokens`.
    pub cache_hit_rate: f64,
    /// Wall time of the whole run.
    pub duration_s: f64,
    /// Generated tokens per second over the whole run.
    pub output_tok_s: f64,
    /// Extend tokens per second of worker time in steps that extend.
    pub prefill_tok_s: f64,
    /// Decoded tokens per second of worker time in decode-only steps.
    pub decode_tok_s: f64,
    /// Median time to first token.
    pub ttft_ms_p50: f64,
    /// Median time per output token after the first.
    pub tpot_ms_p50: f64,
    /// Requests retracted for lack of KV pages.
    pub retractions: usize,
    /// Measured copy bandwidth of the machine (bytes read + written per second).
    pub bandwidth_gb_s: f64,
    /// Decode-only steps: (weight + KV bytes read) / worker time / bandwidth; the weight bytes
    /// of a mixture of experts those of the experts chosen (`ir::WeightUse::at`).
    pub decode_bandwidth_fraction: f64,
    /// The weight bytes one token reads (a mixture of experts: its chosen experts only), MB.
    pub active_weight_mb: f64,
    /// Linear-layer FLOPs per second of extend steps (2 · linear parameters · extend tokens;
    /// attention not counted).
    pub prefill_tflop_s: f64,
    /// The decode steps against their roofline ([`Roofline`]).
    #[serde(flatten)]
    pub roofline: Roofline,
}

/// A decode step's roofline: the time its bytes take at the copy bandwidth against the time
/// its matmul FLOPs take at the measured matmul rate; the step cannot beat the larger.
/// Means over the decode-only steps of the run.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Roofline {
    /// The measured dense matmul rate used (`Backend::matmul_rate`; `None`: not measured, the
    /// compute side is then left out).
    pub matmul_tflop_s: Option<f64>,
    /// Worker time of a decode step.
    pub decode_step_ms: f64,
    /// (weight + KV bytes read) / copy bandwidth.
    pub decode_memory_ms: f64,
    /// 2 · (linear + lm_head multiply-adds per token) · sequences / matmul rate.
    pub decode_compute_ms: Option<f64>,
    /// Σ max(memory, compute) / Σ step time: 1.0 is a step at the hardware's limit.
    pub decode_roofline_fraction: f64,
}

/// The host's copy bandwidth (one thread, 256 MiB, best of 5; bytes read and written): see
/// [`crate::probe::host_copy_bandwidth`].
pub fn copy_bandwidth() -> Result<f64, RuntimeError> {
    crate::probe::host_copy_bandwidth(256 << 20, 5)
}

/// The median of `v` (its upper middle for an even count; 0 when empty).
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The benchmark's requests: random token ids, greedy, eos ignored (with a format: each request
/// its own constraint).
pub fn requests(opts: &BenchOptions, vocab: usize) -> Result<Vec<Request>, RuntimeError> {
    if opts.num_prompts == 0
        || opts.input_len == 0
        || opts.output_len == 0
        || !(0.0..=1.0).contains(&opts.range_ratio)
        || opts.shared_prefix_len >= opts.input_len.max(1)
    {
        return Err(RuntimeError::Invalid(
            "bench needs num-prompts, input-len, output-len >= 1, a range ratio in [0, 1] and a shared prefix \
             shorter than the input"
                .into(),
        ));
    }
    let mut rng = Sampler::new(SamplingParams { temperature: 1.0, seed: opts.seed, ..Default::default() })?;
    let token = |rng: &mut Sampler| (rng.uniform() * vocab as f64) as u32 % vocab as u32;
    let prefix: Vec<u32> = (0..opts.shared_prefix_len).map(|_| token(&mut rng)).collect();
    let len = |rng: &mut Sampler, max: usize, min: usize| {
        let lo = ((max as f64 * opts.range_ratio).ceil() as usize).max(min).min(max);
        lo + (rng.uniform() * (max - lo + 1) as f64) as usize % (max - lo + 1)
    };
    opts.sampling.validate()?;
    (0..opts.num_prompts)
        .map(|i| {
            let n = len(&mut rng, opts.input_len, prefix.len() + 1);
            let out = len(&mut rng, opts.output_len, 1);
            let mut prompt = prefix.clone();
            prompt.extend((prefix.len()..n).map(|_| token(&mut rng)));
            let sampling = SamplingParams { seed: opts.sampling.seed.wrapping_add(i as u64), ..opts.sampling.clone() };
            let constraint = match &opts.constraints {
                Some(make) => Some(make.0().map_err(RuntimeError::Invalid)?),
                None => None,
            };
            Ok(Request { ignore_eos: constraint.is_none(), sampling, constraint, ..Request::greedy(prompt, out) })
        })
        .collect()
}

/// What the model moves and computes, for the fractions of the hardware limits.
#[derive(Debug, Clone)]
pub struct ModelCost {
    /// The weight bytes decode steps read (a mixture of experts' stacks: the chosen experts').
    pub weights: ir::WeightUse,
    /// Parameters of the linear layers (2 FLOPs each per token).
    pub matmul_params: usize,
    /// Parameters of the lm_head (2 FLOPs each per logits row: once per decoded token).
    pub logits_params: usize,
    /// The device's copy bandwidth if it is not the host's.
    pub bandwidth: Option<f64>,
    /// The device's dense matmul rate (FLOP/s), where measured.
    pub matmul_rate: Option<f64>,
}

/// Runs `opts.warmup` untimed passes of the workload, each with its own prompts (so the timed
/// pass finds none of them in the prefix cache).
fn warm_up(engine: &mut Engine, opts: &BenchOptions) -> Result<(), RuntimeError> {
    for pass in 1..=opts.warmup as u64 {
        let seed = opts.seed.wrapping_add(pass.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let reqs = requests(&BenchOptions { seed, ..opts.clone() }, engine.vocab())?;
        let mut left = reqs.len();
        for r in reqs {
            engine.submit(r)?;
        }
        while left > 0 {
            left -= engine.step()?.iter().filter(|(_, e)| matches!(e, Event::Finished(_))).count();
        }
    }
    Ok(())
}

/// Runs the benchmark on `engine`: the warm-up passes, then the timed one. Returns the report
/// and the tokens each request generated, in the order of [`requests`].
pub fn run(
    engine: &mut Engine,
    opts: &BenchOptions,
    cost: ModelCost,
) -> Result<(BenchReport, Vec<Vec<u32>>), RuntimeError> {
    let reqs = requests(opts, engine.vocab())?;
    warm_up(engine, opts)?;
    let input_tokens = reqs.iter().map(|r| r.prompt.len()).sum();
    let bandwidth = match cost.bandwidth {
        Some(b) => b,
        None => copy_bandwidth()?,
    };
    let before = engine.stats();
    engine.take_records();
    engine.record_steps();
    let start = Instant::now();
    let ids = reqs.into_iter().map(|r| engine.submit(r)).collect::<Result<Vec<ReqId>, _>>()?;
    let mut times: HashMap<ReqId, (f64, f64, usize)> = HashMap::new();
    let mut tokens: HashMap<ReqId, Vec<u32>> = HashMap::new();
    let mut finished = 0;
    let mut cached_tokens = 0;
    while finished < ids.len() {
        let events = engine.step()?;
        let now = start.elapsed().as_secs_f64();
        for (id, e) in events {
            match e {
                Event::Token { id: token, .. } => {
                    tokens.entry(id).or_default().push(token);
                    let t = times.entry(id).or_insert((now, now, 0));
                    t.1 = now;
                    t.2 += 1;
                }
                Event::Finished(f) => {
                    finished += 1;
                    cached_tokens += f.cached_tokens;
                }
                Event::Embedding(_) => {}
            }
        }
    }
    let duration = start.elapsed().as_secs_f64();
    let records = engine.take_records();
    let stats = engine.stats();
    let (mut prefill_s, mut extend, mut decode_s, mut decoded, mut bytes) = (0.0, 0, 0.0, 0, 0.0);
    let (mut steps, mut memory_s, mut compute_s, mut bound_s) = (0, 0.0, 0.0, 0.0);
    for r in &records {
        if r.extend_tokens > 0 {
            prefill_s += r.elapsed.as_secs_f64();
            extend += r.extend_tokens;
        } else {
            decode_s += r.elapsed.as_secs_f64();
            decoded += r.seqs;
            let step_bytes = cost.weights.at(r.seqs) + (r.kv_positions * engine.kv_slot_bytes()) as f64;
            bytes += step_bytes;
            let flops = 2.0 * (cost.matmul_params + cost.logits_params) as f64 * r.seqs as f64;
            let (memory, compute) = (step_bytes / bandwidth, cost.matmul_rate.map_or(0.0, |m| flops / m));
            steps += 1;
            memory_s += memory;
            compute_s += compute;
            bound_s += memory.max(compute);
        }
    }
    let output_tokens: usize = times.values().map(|t| t.2).sum();
    let rate = |n: f64, s: f64| if s > 0.0 { n / s } else { 0.0 };
    let report = BenchReport {
        requests: ids.len(),
        input_tokens,
        output_tokens,
        cached_tokens,
        cache_hit_rate: rate(cached_tokens as f64, input_tokens as f64),
        duration_s: duration,
        output_tok_s: output_tokens as f64 / duration,
        prefill_tok_s: rate(extend as f64, prefill_s),
        decode_tok_s: rate(decoded as f64, decode_s),
        ttft_ms_p50: median(times.values().map(|t| t.0 * 1e3).collect()),
        tpot_ms_p50: median(times.values().filter(|t| t.2 > 1).map(|t| (t.1 - t.0) * 1e3 / (t.2 - 1) as f64).collect()),
        retractions: stats.retractions - before.retractions,
        bandwidth_gb_s: bandwidth / 1e9,
        decode_bandwidth_fraction: rate(bytes, decode_s) / bandwidth,
        active_weight_mb: cost.weights.at(1) / 1e6,
        prefill_tflop_s: rate(2.0 * cost.matmul_params as f64 * extend as f64, prefill_s) / 1e12,
        roofline: Roofline {
            matmul_tflop_s: cost.matmul_rate.map(|m| m / 1e12),
            decode_step_ms: rate(decode_s, steps as f64) * 1e3,
            decode_memory_ms: rate(memory_s, steps as f64) * 1e3,
            decode_compute_ms: cost.matmul_rate.map(|_| rate(compute_s, steps as f64) * 1e3),
            decode_roofline_fraction: rate(bound_s, decode_s),
        },
    };
    Ok((report, ids.iter().map(|id| tokens.remove(id).unwrap_or_default()).collect()))
}
