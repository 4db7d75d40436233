//! `engrun`: runs bundles. `engrun generate` prints a completion; `engrun logits` writes the
//! logits of every position of a token sequence.

mod bench_serve;

use bundle::Bundle;
use clap::{Args, Parser, Subcommand};
use runtime::{Device, Engine, EngineConfig, Event, Policy, Request, SamplingParams};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "engrun", version, about = "Run plan bundles compiled by engc")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

/// How the engine schedules and sizes its KV pool (SGLang's flag names).
#[derive(Args, Clone)]
struct EngineArgs {
    /// Token slots in the KV pool (default: as many as 1 GiB holds on the CPU, or
    /// --mem-fraction of the GPU's free memory after the weights).
    #[arg(long)]
    max_total_tokens: Option<usize>,
    /// Share of the GPU's free memory after the weights that the KV pool takes.
    #[arg(long, default_value_t = 0.85)]
    mem_fraction: f64,
    /// Token slots per KV page.
    #[arg(long, default_value_t = 16)]
    page_size: usize,
    /// Most requests running at once.
    #[arg(long, default_value_t = 256)]
    max_running_requests: usize,
    /// Longest prompt chunk of one request per step (default: 8192 on a GPU, 64 on the CPU).
    #[arg(long)]
    chunked_prefill_size: Option<usize>,
    /// Most prompt tokens per step (default: 16384 on a GPU, 64 on the CPU).
    #[arg(long)]
    max_prefill_tokens: Option<usize>,
    /// fcfs or lpm (longest cached prefix first).
    #[arg(long, default_value = "fcfs")]
    schedule_policy: Policy,
    /// Do not reuse cached prefixes.
    #[arg(long)]
    disable_radix_cache: bool,
    /// Do not plan step N+1 while step N runs.
    #[arg(long)]
    disable_overlap: bool,
}

impl EngineArgs {
    /// The engine's settings on `device` (resolved): the flags given, the device's defaults
    /// for the rest.
    fn config(&self, b: &Bundle, device: runtime::Device) -> Result<EngineConfig, String> {
        let d = EngineConfig::for_device(b, device).map_err(|e| e.to_string())?;
        Ok(EngineConfig {
            page_size: self.page_size,
            kv_slots: self.max_total_tokens,
            mem_fraction: self.mem_fraction,
            max_running_requests: self.max_running_requests,
            chunked_prefill_size: self.chunked_prefill_size.unwrap_or(d.chunked_prefill_size),
            max_prefill_tokens: self.max_prefill_tokens.unwrap_or(d.max_prefill_tokens),
            policy: self.schedule_policy,
            radix_cache: !self.disable_radix_cache,
            overlap: !self.disable_overlap,
            ..d
        })
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate a completion for a prompt; only the generated text goes to stdout.
    Generate {
        /// The bundle directory.
        bundle: PathBuf,
        /// The prompt text.
        #[arg(long)]
        prompt: String,
        /// Wrap the prompt as a user message in the bundle's chat template.
        #[arg(long)]
        chat: bool,
        /// A system message (with --chat).
        #[arg(long, requires = "chat")]
        system: Option<String>,
        /// Most new tokens.
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        #[command(flatten)]
        sampling: SamplingArgs,
        /// Random seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Keep generating past eos tokens.
        #[arg(long)]
        ignore_eos: bool,
        #[command(flatten)]
        device: DeviceArgs,
        #[command(flatten)]
        engine: EngineArgs,
    },
    /// Offline throughput: random prompts, eos ignored, all queued at once and served with
    /// continuous batching; reports TTFT, TPOT, prefill and decode tokens/s, cache hits and
    /// decode's fraction of the measured memory bandwidth.
    Bench {
        /// The bundle directory.
        bundle: PathBuf,
        #[command(flatten)]
        device: DeviceArgs,
        /// Number of requests.
        #[arg(long, default_value_t = 8)]
        num_prompts: usize,
        /// Prompt length (maximum, with --random-range-ratio).
        #[arg(long, default_value_t = 128)]
        input_len: usize,
        /// Output length (maximum, with --random-range-ratio).
        #[arg(long, default_value_t = 128)]
        output_len: usize,
        /// Lengths uniform in [len * ratio, len].
        #[arg(long, default_value_t = 1.0)]
        random_range_ratio: f64,
        /// Every prompt starts with the same this many tokens.
        #[arg(long, default_value_t = 0)]
        shared_prefix_len: usize,
        /// Seed of the random prompts (request i samples with seed + i).
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Untimed passes of the same workload (other prompts) before the timed one, so that
        /// clocks, caches and allocations are warm.
        #[arg(long, default_value_t = 1)]
        warmup: usize,
        #[command(flatten)]
        sampling: SamplingArgs,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// Then run every request again alone (a fresh backend, one sequence at a time, fed the
        /// engine's tokens) and compare each greedy token with the lone run's argmax; a different
        /// token is allowed only where the lone run's top two logits are within TOL of the row's
        /// largest magnitude. Exits non-zero on any other difference.
        #[arg(long, value_name = "TOL")]
        verify_alone: Option<f32>,
        /// Then write every request's generated token ids to this file, one JSON array of
        /// arrays in request order (for comparing runs: a seed gives every request the same
        /// tokens whatever the settings that must not change them).
        #[arg(long, value_name = "FILE")]
        output_tokens: Option<PathBuf>,
        /// Every request's output follows this regular expression (SGLang's `regex`; choose
        /// one that outlasts --output-len, such as `[a-z]{5000}`).
        #[arg(long, conflicts_with_all = ["json_schema", "verify_alone"])]
        regex: Option<String>,
        /// Every request's output is JSON valid under the schema in this file (choose one that
        /// outlasts --output-len).
        #[arg(long, value_name = "FILE", conflicts_with = "verify_alone")]
        json_schema: Option<PathBuf>,
        #[command(flatten)]
        engine: EngineArgs,
    },
    /// Serve the bundle over an OpenAI-compatible HTTP API (chat, completions, SGLang's
    /// /generate, models, health, metrics) until SIGTERM.
    Serve {
        /// The bundle directory.
        bundle: PathBuf,
        /// Address to bind.
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        /// Port (0: any free port; the chosen one is printed).
        #[arg(long, default_value_t = 30000)]
        port: u16,
        #[command(flatten)]
        device: DeviceArgs,
        /// Require `Authorization: Bearer KEY`.
        #[arg(long)]
        api_key: Option<String>,
        /// The model name clients use (default: the bundle's directory name).
        #[arg(long)]
        served_model_name: Option<String>,
        /// Seconds a shutdown (SIGTERM, Ctrl-C) waits for the requests in flight before it
        /// aborts them (`finish_reason: abort`); a second signal aborts them at once.
        #[arg(long, default_value_t = 60.0)]
        graceful_shutdown_timeout: f64,
        /// How /v1/embeddings pools an input's final hidden states: `last` (the last token's)
        /// or `mean`; either is L2-normalised.
        #[arg(long, default_value = "last")]
        pooling: runtime::Pooling,
        #[command(flatten)]
        engine: EngineArgs,
    },
    /// Online benchmark of an OpenAI-compatible server (ours, vLLM's, SGLang's): streaming
    /// requests of random token-id prompts at a request rate and concurrency, timed on the
    /// client (TTFT, ITL, TPOT, end-to-end), flags and result keys as sglang.bench_serving's.
    BenchServe(bench_serve::ServeBenchArgs),
    /// Measure the machine's limits that docs/perf.md divides by: host copy bandwidth (one
    /// thread, and all cores) and, with --device cuda, each GPU's device-to-device copy bandwidth
    /// and cuBLASLt bf16 and f16 matmul rate. Copies count bytes read + written; each figure is
    /// the best of --reps runs.
    Probe {
        /// cpu (the host only) or cuda (also the GPUs of --devices).
        #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
        device: String,
        /// The GPUs to probe with --device cuda (default: 0).
        #[arg(long, value_delimiter = ',')]
        devices: Vec<usize>,
        /// MiB of the host copy's source (and destination) buffer.
        #[arg(long, default_value_t = 1024)]
        host_mib: usize,
        /// MiB of the device copy's source (and destination) buffer.
        #[arg(long, default_value_t = 1024)]
        device_mib: usize,
        /// m = n = k of the matmul.
        #[arg(long, default_value_t = 8192)]
        matmul_size: usize,
        /// Timed runs of each measurement (the best is reported, the mean beside it).
        #[arg(long, default_value_t = 10)]
        reps: usize,
        /// Untimed runs before the timed ones on a GPU (the host copies run one).
        #[arg(long, default_value_t = 10)]
        warmup: usize,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Write the f32 logits of every position of `--ids` to a safetensors file (tensor
    /// `logits`, shape [n, vocab]; several sequences' rows one after the other).
    Logits {
        /// The bundle directory.
        bundle: PathBuf,
        /// Comma-separated token ids; several sequences separated by `;` run as one batch.
        #[arg(long)]
        ids: String,
        /// Tokens of each sequence run in the first (prefill) step; the rest are fed one token
        /// per step, every sequence that still has tokens in the same decode batch. Default: all.
        #[arg(long)]
        prefill: Option<usize>,
        #[command(flatten)]
        device: DeviceArgs,
        /// With a temperature: also choose a token from every logits row on the device (each
        /// row's number from a generator seeded 0) and on the host, and print how many agree.
        #[command(flatten)]
        sampling: SamplingArgs,
        /// Output file.
        #[arg(short, long)]
        out: PathBuf,
    },
}

fn main() -> ExitCode {
    let result = match Cli::parse().cmd {
        Cmd::Generate { bundle, prompt, chat, system, max_tokens, sampling, seed, ignore_eos, device, engine } => {
            let sampling = sampling.params(seed);
            let args = GenArgs { prompt, chat, system, max_tokens, sampling, ignore_eos, device, engine };
            generate(&bundle, &args)
        }
        Cmd::Logits { bundle, ids, prefill, device, sampling, out } => {
            logits(&bundle, &ids, prefill, device, &sampling.params(0), &out)
        }
        Cmd::Serve {
            bundle,
            host,
            port,
            device,
            api_key,
            served_model_name,
            graceful_shutdown_timeout,
            pooling,
            engine,
        } => match std::time::Duration::try_from_secs_f64(graceful_shutdown_timeout) {
            Ok(timeout) => {
                let opts = server::ServeOptions {
                    host,
                    port,
                    api_key,
                    model: served_model_name.unwrap_or_default(),
                    max_context: 0,
                    graceful_shutdown_timeout: timeout,
                    pooling,
                    grammars: None,
                };
                serve(&bundle, device, &engine, opts)
            }
            Err(_) => Err(format!(
                "--graceful-shutdown-timeout must be a non-negative number of seconds, got {graceful_shutdown_timeout}"
            )),
        },
        Cmd::Bench {
            bundle,
            device,
            num_prompts,
            input_len,
            output_len,
            random_range_ratio,
            shared_prefix_len,
            seed,
            warmup,
            sampling,
            json,
            verify_alone,
            output_tokens,
            regex,
            json_schema,
            engine,
        } => {
            let opts = runtime::bench::BenchOptions {
                num_prompts,
                input_len,
                output_len,
                range_ratio: random_range_ratio,
                shared_prefix_len,
                seed,
                warmup,
                sampling: sampling.params(seed),
                constraints: None,
            };
            let after = After { verify_alone, output_tokens };
            bench_format(regex, json_schema)
                .and_then(|format| bench(&bundle, device, &engine, opts, format, json, &after))
        }
        Cmd::BenchServe(args) => bench_serve::run(&args).map(|_| ()),
        Cmd::Probe { device, devices, host_mib, device_mib, matmul_size, reps, warmup, json } => {
            let gpus = match (device.as_str(), devices.is_empty()) {
                ("cuda", true) => vec![0],
                ("cuda", false) => devices,
                _ => vec![],
            };
            let mib =
                |flag: &str, m: usize| m.checked_mul(1 << 20).ok_or_else(|| format!("{flag}: {m} MiB is too large"));
            match (mib("--host-mib", host_mib), mib("--device-mib", device_mib)) {
                (Ok(host_bytes), Ok(device_bytes)) => {
                    let opts =
                        runtime::probe::ProbeOptions { host_bytes, device_bytes, matmul_size, reps, warmup, gpus };
                    probe(&opts, json)
                }
                (Err(e), _) | (_, Err(e)) => Err(e),
            }
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// How tokens are chosen (greedy by default).
#[derive(clap::Args, Debug, Clone)]
struct SamplingArgs {
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Keep the most likely tokens holding this much of the probability.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Drop tokens less likely than this times the most likely one.
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Divide positive logits of tokens already seen by this, multiply negative ones (1 = off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Subtract this times a token's count so far from its logit.
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// Subtract this from the logit of every token generated so far.
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    /// Add to tokens' logits: `ID:VALUE` pairs, comma-separated (VALUE in [-100, 100]).
    #[arg(long, value_parser = parse_bias, value_delimiter = ',')]
    logit_bias: Vec<(u32, f32)>,
}

fn parse_bias(s: &str) -> Result<(u32, f32), String> {
    let (id, v) = s.split_once(':').ok_or_else(|| format!("`{s}`: expected ID:VALUE"))?;
    let id = id.trim().parse().map_err(|_| format!("`{id}` is not a token id"))?;
    let v = v.trim().parse().map_err(|_| format!("`{v}` is not a number"))?;
    Ok((id, v))
}

impl SamplingArgs {
    fn params(&self, seed: u64) -> SamplingParams {
        let s = self.clone();
        SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            seed,
            repetition_penalty: s.repetition_penalty,
            frequency_penalty: s.frequency_penalty,
            presence_penalty: s.presence_penalty,
            logit_bias: s.logit_bias,
            ..Default::default()
        }
    }
}

/// Where the model runs.
#[derive(clap::Args, Debug, Clone)]
struct DeviceArgs {
    /// auto (cuda when there is a usable GPU for every rank and the bundle runs there, else
    /// cpu), cpu (Cranelift JIT), cuda, or ref (the reference interpreter).
    #[arg(long, default_value = "auto")]
    device: Device,
    /// The GPUs of the ranks, one per rank (`--devices 0,1` for a tp=2 bundle; default: the
    /// first tp GPUs).
    #[arg(long, value_delimiter = ',')]
    devices: Vec<usize>,
}

struct GenArgs {
    prompt: String,
    chat: bool,
    system: Option<String>,
    max_tokens: usize,
    sampling: SamplingParams,
    ignore_eos: bool,
    device: DeviceArgs,
    engine: EngineArgs,
}

fn open(path: &Path, d: &DeviceArgs) -> Result<(Bundle, Box<dyn runtime::Backend>, runtime::Device), String> {
    let t = std::time::Instant::now();
    let b = Bundle::open(path).map_err(|e| e.to_string())?;
    let opened = t.elapsed().as_secs_f64();
    let device = runtime::resolve(&b, d.device, &d.devices);
    let backend = runtime::load(&b, device, &d.devices).map_err(|e| e.to_string())?;
    eprintln!(
        "loaded {} ({} tp={} {}) on {device:?} in {:.2}s (bundle checked in {opened:.2}s)",
        path.display(),
        b.manifest.model,
        b.manifest.tp,
        b.manifest.dtype,
        t.elapsed().as_secs_f64()
    );
    Ok((b, backend, device))
}

fn generate(path: &Path, a: &GenArgs) -> Result<(), String> {
    let (b, backend, dev) = open(path, &a.device)?;
    let tok = tokenizer(&b, path)?;
    let prompt = if a.chat {
        let mut messages = Vec::new();
        if let Some(s) = &a.system {
            messages.push(serde_json::json!({"role": "system", "content": s}));
        }
        messages.push(serde_json::json!({"role": "user", "content": a.prompt}));
        tok.encode_chat(&serde_json::Value::Array(messages), true)
    } else {
        tok.encode(&a.prompt, true)
    }
    .map_err(|e| e.to_string())?;
    let cfg = a.engine.config(&b, dev)?;
    let mut engine = Engine::new(backend, cfg).map_err(|e| e.to_string())?;
    let req =
        Request { sampling: a.sampling.clone(), ignore_eos: a.ignore_eos, ..Request::greedy(prompt, a.max_tokens) };
    let prompt_len = req.prompt.len();
    let start = std::time::Instant::now();
    engine.submit(req).map_err(|e| e.to_string())?;
    let mut detok = text::IncrementalDecoder::new(true);
    let mut out = std::io::stdout().lock();
    let (mut first, mut n, mut finish) = (None, 0usize, None);
    while finish.is_none() {
        for (_, e) in engine.step().map_err(|e| e.to_string())? {
            match e {
                Event::Token { id, .. } => {
                    first.get_or_insert_with(|| start.elapsed());
                    n += 1;
                    let piece = detok.push(&tok, id).map_err(|e| e.to_string())?;
                    let _ = out.write_all(piece.as_bytes());
                    let _ = out.flush();
                }
                Event::Finished(f) => finish = Some(f.reason),
                Event::Embedding(_) => {}
            }
        }
    }
    let rest = detok.flush(&tok).map_err(|e| e.to_string())?;
    let _ = writeln!(out, "{rest}");
    let ttft = first.unwrap_or_default();
    let decode = start.elapsed().saturating_sub(ttft).as_secs_f64();
    eprintln!(
        "prompt {prompt_len} tokens, generated {n} ({:?}); prefill {:.1} ms, decode {:.1} tok/s",
        finish.expect("finished"),
        ttft.as_secs_f64() * 1e3,
        if n > 1 { (n - 1) as f64 / decode } else { 0.0 }
    );
    Ok(())
}

fn tokenizer(b: &Bundle, path: &Path) -> Result<text::Tokenizer, String> {
    let dir = b.tokenizer_dir().ok_or_else(|| {
        format!("{} has no tokenizer; compile it with --tokenizer DIR, or use `engrun logits`", path.display())
    })?;
    text::Tokenizer::load(&dir).map_err(|e| e.to_string())
}

fn serve(path: &Path, device: DeviceArgs, args: &EngineArgs, mut opts: server::ServeOptions) -> Result<(), String> {
    let (b, backend, dev) = open(path, &device)?;
    let tok = tokenizer(&b, path)?;
    let cfg = args.config(&b, dev)?;
    opts.max_context = cfg.max_context;
    let eos = cfg.eos_ids.clone();
    let engine = Engine::new(backend, cfg).map_err(|e| e.to_string())?;
    opts.grammars = grammars(&b, &eos, engine.vocab());
    if opts.model.is_empty() {
        let stem = path.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        opts.model = stem.trim_end_matches(".bundle").to_string();
    }
    server::serve(engine, tok, opts)
}

/// The grammar engine over the bundle's tokenizer, for output formats; without it the server
/// still runs and refuses them.
fn grammars(b: &Bundle, eos: &[u32], vocab: usize) -> Option<std::sync::Arc<grammar::Grammars>> {
    let path = b.tokenizer_dir()?.join("tokenizer.json");
    let loaded =
        std::fs::read(&path).map_err(|e| e.to_string()).and_then(|json| grammar::Grammars::load(&json, eos, vocab));
    match loaded {
        Ok(g) => Some(std::sync::Arc::new(g)),
        Err(e) => {
            eprintln!("warning: {}: no constrained decoding (output formats get a 400): {e}", path.display());
            None
        }
    }
}

fn parse_ids(ids: &str) -> Result<Vec<Vec<u32>>, String> {
    let seqs: Vec<Vec<u32>> = ids
        .split(';')
        .map(|seq| {
            seq.split(',')
                .map(|s| {
                    s.trim().parse::<u32>().map_err(|_| {
                        format!("--ids: `{s}` is not a token id (expected comma-separated non-negative integers)")
                    })
                })
                .collect::<Result<Vec<u32>, String>>()
        })
        .collect::<Result<_, _>>()?;
    if seqs.iter().any(|s| s.is_empty()) {
        return Err("--ids has an empty sequence".into());
    }
    Ok(seqs)
}

fn logits(
    path: &Path,
    ids: &str,
    prefill: Option<usize>,
    device: DeviceArgs,
    sampling: &SamplingParams,
    out: &Path,
) -> Result<(), String> {
    let mut check = SampleCheck::new(sampling)?;
    let seqs = parse_ids(ids)?;
    let longest = seqs.iter().map(Vec::len).max().unwrap_or(0);
    let prefill = prefill.unwrap_or(longest).max(1);
    let (_, backend, _) = open(path, &device)?;
    let total: usize = seqs.iter().map(Vec::len).sum();
    let mut runner = runtime::Sequences::new(backend, total + 16 * seqs.len()).map_err(|e| e.to_string())?;
    let vocab = runner.vocab();
    let mut rows_out: Vec<Vec<f32>> = vec![vec![]; seqs.len()];
    // Step 0 prefills the first `prefill` tokens of each sequence; step k > 0 feeds token
    // prefill + k - 1 of every sequence that has it.
    for step in 0..=longest.saturating_sub(prefill) {
        let range =
            |s: &Vec<u32>| if step == 0 { 0..prefill.min(s.len()) } else { (prefill + step - 1)..(prefill + step) };
        let live: Vec<usize> = (0..seqs.len()).filter(|&i| range(&seqs[i]).end <= seqs[i].len()).collect();
        let rows: Vec<Vec<usize>> = live.iter().map(|&i| (0..range(&seqs[i]).len()).collect()).collect();
        let batch: Vec<runtime::SeqChunk> = live
            .iter()
            .zip(&rows)
            .map(|(&i, r)| runtime::SeqChunk { seq: i as u64, tokens: &seqs[i][range(&seqs[i])], rows: r })
            .collect();
        let logits = runner.forward_batch(&batch).map_err(|e| e.to_string())?;
        check.step(&mut runner, &logits)?;
        let mut at = 0;
        for (&i, r) in live.iter().zip(&rows) {
            rows_out[i].extend_from_slice(&logits[at..at + r.len() * vocab]);
            at += r.len() * vocab;
        }
    }
    let bytes: Vec<u8> = rows_out.iter().flatten().flat_map(|v| v.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![total, vocab], &bytes)
        .map_err(|e| e.to_string())?;
    safetensors::serialize_to_file([("logits", view)], &None, out).map_err(|e| format!("{}: {e}", out.display()))?;
    eprintln!("wrote logits [{total}, {vocab}] of {} sequences to {}", seqs.len(), out.display());
    check.report();
    Ok(())
}

/// `engrun logits` with a temperature: every logits row's token chosen on the host and, where
/// the backend samples on its device, on the device too, from the same logits, numbers and
/// adjustments (penalties over the host's tokens so far, `logit_bias`: every row of a step
/// takes the adjustments of the tokens chosen before the step).
struct SampleCheck {
    sampler: Option<runtime::RequestSampler>,
    /// The host's choice of every row so far.
    host: Vec<u32>,
    /// Rows where the device's choice equals the host's.
    equal: usize,
    /// The backend sampled on its device (it does in every step or in none).
    on_device: bool,
}

impl SampleCheck {
    fn new(params: &SamplingParams) -> Result<SampleCheck, String> {
        let sampler = (params.temperature > 0.0).then(|| runtime::RequestSampler::new(params.clone(), &[])).transpose();
        Ok(SampleCheck { sampler: sampler.map_err(|e| e.to_string())?, host: vec![], equal: 0, on_device: false })
    }

    fn step(&mut self, runner: &mut runtime::Sequences, logits: &[f32]) -> Result<(), String> {
        let Some(s) = &mut self.sampler else { return Ok(()) };
        let vocab = runner.vocab();
        let rows: Vec<runtime::RowSampling> = (0..logits.len() / vocab).map(|_| s.row()).collect();
        let adjust = vec![s.adjustments(); rows.len()];
        let host: Vec<u32> = logits
            .chunks_exact(vocab)
            .zip(&rows)
            .map(|(l, r)| runtime::pick(&runtime::adjusted(l, &adjust[0]), r))
            .collect();
        for &t in &host {
            s.record(t);
        }
        if let Some(device) = runner.resample(&rows, &adjust).map_err(|e| e.to_string())? {
            self.on_device = true;
            self.equal += host.iter().zip(&device).filter(|(h, d)| h == d).count();
        }
        self.host.extend(host);
        Ok(())
    }

    /// Prints `{"sampled_rows", "on_device", "device_equal_host", "host_tokens"}`;
    /// `device_equal_host` is null where no device sampled (nothing was compared).
    fn report(&self) {
        if self.sampler.is_some() {
            println!(
                "{}",
                serde_json::json!({
                    "sampled_rows": self.host.len(),
                    "on_device": self.on_device,
                    "device_equal_host": self.on_device.then_some(self.equal),
                    "host_tokens": self.host,
                })
            );
        }
    }
}

/// What `engrun bench` does with the requests' outputs after the run.
struct After {
    /// `--verify-alone`: the tolerance of the lone runs' check.
    verify_alone: Option<f32>,
    /// `--output-tokens`: where the tokens go.
    output_tokens: Option<PathBuf>,
}

fn bench(
    path: &Path,
    device: DeviceArgs,
    args: &EngineArgs,
    mut opts: runtime::bench::BenchOptions,
    format: Option<grammar::Spec>,
    json: bool,
    after: &After,
) -> Result<(), String> {
    let (b, mut backend, dev) = open(path, &device)?;
    if let Some(spec) = format {
        opts.constraints = Some(constraints(&b, args, dev, backend.vocab(), spec)?);
    }
    let opts = &opts;
    let bandwidth = backend.copy_bandwidth();
    let matmul_rate = backend.matmul_rate();
    let cost = runtime::bench::ModelCost {
        weights: b.plan.weight_use(),
        matmul_params: b.plan.matmul_params(),
        logits_params: b.plan.logits_params(),
        bandwidth,
        matmul_rate,
    };
    let cfg = EngineConfig { eos_ids: vec![], ..args.config(&b, dev)? };
    let mut engine = Engine::new(backend, cfg).map_err(|e| e.to_string())?;
    let (r, outs) = runtime::bench::run(&mut engine, opts, cost).map_err(|e| e.to_string())?;
    drop(engine);
    if let Some(f) = &after.output_tokens {
        let text = serde_json::to_string(&outs).map_err(|e| e.to_string())?;
        std::fs::write(f, text + "\n").map_err(|e| format!("writing the output tokens to {}: {e}", f.display()))?;
    }
    let alone = after.verify_alone.map(|tol| verify(path, &device, opts, &outs, tol)).transpose()?;
    let violations = opts.constraints.as_ref().map(|c| format_violations(c, &outs)).transpose()?;
    if json {
        let mut v = serde_json::to_value(&r).map_err(|e| e.to_string())?;
        v["alone"] = serde_json::to_value(&alone).map_err(|e| e.to_string())?;
        v["format_violations"] = serde_json::to_value(violations).map_err(|e| e.to_string())?;
        println!("{v}");
    } else {
        println!(
            "requests {}  input tokens {} ({} cached, {:.0}%)  output tokens {}  in {:.2} s  ({} retractions)",
            r.requests,
            r.input_tokens,
            r.cached_tokens,
            r.cache_hit_rate * 100.0,
            r.output_tokens,
            r.duration_s,
            r.retractions
        );
        println!("output      {:.1} tok/s", r.output_tok_s);
        println!("prefill     {:.1} tok/s   (TTFT p50 {:.1} ms)", r.prefill_tok_s, r.ttft_ms_p50);
        println!("decode      {:.1} tok/s   (TPOT p50 {:.2} ms)", r.decode_tok_s, r.tpot_ms_p50);
        println!(
            "bandwidth   {:.1} GB/s measured copy; decode reads {:.0}% of it ({:.1} MB weights per token + KV)",
            r.bandwidth_gb_s,
            r.decode_bandwidth_fraction * 100.0,
            r.active_weight_mb
        );
        let f = &r.roofline;
        let compute = f.decode_compute_ms.map_or("not measured".into(), |c| format!("{c:.3} ms"));
        println!(
            "roofline    decode step {:.3} ms: bytes {:.3} ms at the copy rate, matmuls {compute}; {:.0}% of the limit",
            f.decode_step_ms,
            f.decode_memory_ms,
            f.decode_roofline_fraction * 100.0
        );
        if let Some(a) = &alone {
            println!(
                "alone       {}/{} tokens equal to the lone runs, {} near ties, {} clear mismatches (tol {})",
                a.equal, a.tokens, a.near_ties, a.clear_mismatches, a.tol
            );
        }
        if let Some(n) = violations {
            println!("format      {n} tokens the output format forbids");
        }
    }
    if violations.is_some_and(|n| n > 0) {
        return Err(format!("{violations:?} generated tokens break the output format"));
    }
    match alone {
        Some(a) if !a.pass => {
            Err(format!("the engine's tokens differ from the lone runs: first at {:?}", a.first_clear))
        }
        _ => Ok(()),
    }
}

/// The output format of `bench --regex` / `--json-schema`, if any.
fn bench_format(regex: Option<String>, json_schema: Option<PathBuf>) -> Result<Option<grammar::Spec>, String> {
    Ok(match (regex, json_schema) {
        (Some(rx), _) => Some(grammar::Spec::Regex(rx)),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            let schema = serde_json::from_str(&text).map_err(|e| format!("{}: not JSON: {e}", path.display()))?;
            Some(grammar::Spec::JsonSchema(schema))
        }
        (None, None) => None,
    })
}

/// `bench --regex` / `--json-schema`: a fresh constraint of `spec` per request, over the
/// bundle's tokenizer with the model's end-of-sequence tokens (checked once here: a spec that
/// does not compile is an error naming it).
fn constraints(
    b: &Bundle,
    args: &EngineArgs,
    dev: Device,
    vocab: usize,
    spec: grammar::Spec,
) -> Result<runtime::bench::Constraints, String> {
    let eos = args.config(b, dev)?.eos_ids;
    let path = b.tokenizer_dir().ok_or("the bundle has no tokenizer: output formats need one")?.join("tokenizer.json");
    let json = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let g = grammar::Grammars::load(&json, &eos, vocab)?;
    g.compile(&spec).map_err(|e| format!("the output format: {e}"))?;
    Ok(runtime::bench::Constraints(std::sync::Arc::new(move || g.compile(&spec))))
}

/// The tokens of `outs` that a fresh constraint of the format, fed each output in turn, does
/// not allow.
fn format_violations(make: &runtime::bench::Constraints, outs: &[Vec<u32>]) -> Result<usize, String> {
    let mut n = 0;
    for out in outs {
        let c = make.0()?;
        for &t in out {
            let allowed = c.allowed();
            n += usize::from(!runtime::allows(&allowed, t));
            c.accept(t);
        }
    }
    Ok(n)
}

/// `bench --verify-alone`: the workload's requests run alone on a fresh backend.
fn verify(
    path: &Path,
    device: &DeviceArgs,
    opts: &runtime::bench::BenchOptions,
    outs: &[Vec<u32>],
    tol: f32,
) -> Result<runtime::alone::AloneReport, String> {
    let (_, backend, _) = open(path, device)?;
    let reqs = runtime::bench::requests(opts, backend.vocab()).map_err(|e| e.to_string())?;
    let longest = reqs.iter().zip(outs).map(|(r, o)| r.prompt.len() + o.len()).max().unwrap_or(0);
    let mut seqs = runtime::Sequences::new(backend, longest + 16).map_err(|e| e.to_string())?;
    runtime::alone::against_alone(&mut seqs, &reqs, outs, tol).map_err(|e| e.to_string())
}

/// `engrun probe`: the measurements, as text or one JSON object on stdout.
fn probe(opts: &runtime::probe::ProbeOptions, json: bool) -> Result<(), String> {
    let report = runtime::probe::run(opts).map_err(|e| e.to_string())?;
    if json {
        println!("{}", serde_json::to_string(&report).map_err(|e| e.to_string())?);
    } else {
        print!("{report}");
    }
    Ok(())
}
