//! `engrun`: runs bundles. `engrun generate` prints a completion; `engrun logits` writes the
//! logits of every position of a token sequence.

use bundle::Bundle;
use clap::{Parser, Subcommand};
use runtime::{Device, GenerateRequest, SamplingParams};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "engrun", version, about = "Run plan bundles compiled by engc")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
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
        /// Sampling temperature (0 = greedy).
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        /// Top-k (0 = off).
        #[arg(long, default_value_t = 0)]
        top_k: usize,
        /// Top-p.
        #[arg(long, default_value_t = 1.0)]
        top_p: f32,
        /// Random seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Keep generating past eos tokens.
        #[arg(long)]
        ignore_eos: bool,
        /// cpu (Cranelift JIT, the default without a GPU), ref (reference interpreter) or cuda.
        #[arg(long, default_value = "cpu")]
        device: Device,
    },
    /// Offline throughput: random prompts, eos ignored, run as one batch; reports TTFT, TPOT,
    /// prefill and decode tokens/s and decode's fraction of the measured memory bandwidth.
    Bench {
        /// The bundle directory.
        bundle: PathBuf,
        /// cpu (Cranelift JIT, the default without a GPU), ref (reference interpreter) or cuda.
        #[arg(long, default_value = "cpu")]
        device: Device,
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
        /// Seed of the random prompts.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Write the f32 logits of every position of `--ids` to a safetensors file (tensor
    /// `logits`, shape [n, vocab]).
    Logits {
        /// The bundle directory.
        bundle: PathBuf,
        /// Comma-separated token ids.
        #[arg(long)]
        ids: String,
        /// cpu (Cranelift JIT, the default without a GPU), ref (reference interpreter) or cuda.
        #[arg(long, default_value = "cpu")]
        device: Device,
        /// Output file.
        #[arg(short, long)]
        out: PathBuf,
    },
}

fn main() -> ExitCode {
    let result = match Cli::parse().cmd {
        Cmd::Generate {
            bundle,
            prompt,
            chat,
            system,
            max_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            ignore_eos,
            device,
        } => {
            let sampling = SamplingParams { temperature, top_k, top_p, seed, ..Default::default() };
            let args = GenArgs { prompt, chat, system, max_tokens, sampling, ignore_eos, device };
            generate(&bundle, &args)
        }
        Cmd::Logits { bundle, ids, device, out } => logits(&bundle, &ids, device, &out),
        Cmd::Bench { bundle, device, num_prompts, input_len, output_len, random_range_ratio, seed, json } => {
            let opts = runtime::bench::BenchOptions {
                num_prompts,
                input_len,
                output_len,
                range_ratio: random_range_ratio,
                seed,
            };
            bench(&bundle, device, &opts, json)
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

struct GenArgs {
    prompt: String,
    chat: bool,
    system: Option<String>,
    max_tokens: usize,
    sampling: SamplingParams,
    ignore_eos: bool,
    device: Device,
}

fn open(path: &Path, device: Device) -> Result<(Bundle, Box<dyn runtime::Backend>), String> {
    let t = std::time::Instant::now();
    let b = Bundle::open(path).map_err(|e| e.to_string())?;
    let backend = runtime::load(&b, device).map_err(|e| e.to_string())?;
    eprintln!(
        "loaded {} ({} tp={} {}) on {device:?} in {:.2}s",
        path.display(),
        b.manifest.model,
        b.manifest.tp,
        b.manifest.dtype,
        t.elapsed().as_secs_f64()
    );
    Ok((b, backend))
}

fn generate(path: &Path, a: &GenArgs) -> Result<(), String> {
    let (b, mut backend) = open(path, a.device)?;
    let dir = b.tokenizer_dir().ok_or_else(|| {
        format!("{} has no tokenizer; compile it with --tokenizer DIR, or use `engrun logits`", path.display())
    })?;
    let tok = text::Tokenizer::load(&dir).map_err(|e| e.to_string())?;
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
    let gen = b.generation_config().map_err(|e| e.to_string())?;
    let max_context =
        b.manifest.params.get("max_positions").and_then(|v| v.as_u64()).map_or(usize::MAX, |v| v as usize);
    let req = GenerateRequest {
        prompt,
        max_tokens: a.max_tokens,
        stop_ids: if a.ignore_eos { vec![] } else { gen.eos_token_id },
        sampling: a.sampling.clone(),
        max_context,
    };
    let mut detok = text::IncrementalDecoder::new(true);
    let mut out = std::io::stdout().lock();
    let mut failed = None;
    let res = runtime::generate(backend.as_mut(), 0, &req, |id| match detok.push(&tok, id) {
        Ok(piece) => {
            let _ = out.write_all(piece.as_bytes());
            let _ = out.flush();
        }
        Err(e) => failed = Some(e.to_string()),
    })
    .map_err(|e| e.to_string())?;
    if let Some(e) = failed {
        return Err(e);
    }
    let rest = detok.flush(&tok).map_err(|e| e.to_string())?;
    let _ = writeln!(out, "{rest}");
    let n = res.ids.len();
    eprintln!(
        "prompt {} tokens, generated {n} ({:?}); prefill {:.1} ms, decode {:.1} tok/s",
        req.prompt.len(),
        res.finish,
        res.prefill.as_secs_f64() * 1e3,
        if n > 1 { (n - 1) as f64 / res.decode.as_secs_f64() } else { 0.0 }
    );
    Ok(())
}

fn logits(path: &Path, ids: &str, device: Device, out: &Path) -> Result<(), String> {
    let ids: Vec<u32> = ids
        .split(',')
        .map(|s| {
            s.trim()
                .parse::<u32>()
                .map_err(|_| format!("--ids: `{s}` is not a token id (expected comma-separated non-negative integers)"))
        })
        .collect::<Result<_, _>>()?;
    if ids.is_empty() {
        return Err("--ids is empty".into());
    }
    let (_, mut backend) = open(path, device)?;
    let rows: Vec<usize> = (0..ids.len()).collect();
    let logits = backend.forward(0, &ids, &rows).map_err(|e| e.to_string())?;
    let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![ids.len(), backend.vocab()], &bytes)
        .map_err(|e| e.to_string())?;
    safetensors::serialize_to_file([("logits", view)], &None, out).map_err(|e| format!("{}: {e}", out.display()))?;
    eprintln!("wrote logits [{}, {}] to {}", ids.len(), backend.vocab(), out.display());
    Ok(())
}

fn bench(path: &Path, device: Device, opts: &runtime::bench::BenchOptions, json: bool) -> Result<(), String> {
    let (b, mut backend) = open(path, device)?;
    let weight_bytes: usize = b.plan.weights().map(|(_, s, d)| s.iter().product::<usize>() * d.size()).sum();
    let kv = b.plan.kv;
    let kv_bytes = 2 * kv.layers * kv.row() * 4;
    let r = runtime::bench::run(backend.as_mut(), opts, weight_bytes, kv_bytes).map_err(|e| e.to_string())?;
    if json {
        println!("{}", serde_json::to_string(&r).map_err(|e| e.to_string())?);
    } else {
        println!(
            "requests {}  input tokens {}  output tokens {}  in {:.2} s",
            r.requests, r.input_tokens, r.output_tokens, r.duration_s
        );
        println!("output      {:.1} tok/s", r.output_tok_s);
        println!("prefill     {:.1} tok/s   (TTFT p50 {:.1} ms)", r.prefill_tok_s, r.ttft_ms_p50);
        println!("decode      {:.1} tok/s   (TPOT p50 {:.2} ms)", r.decode_tok_s, r.tpot_ms_p50);
        println!(
            "bandwidth   {:.1} GB/s measured copy; decode reads {:.0}% of it ({:.1} MB weights + KV per step)",
            r.bandwidth_gb_s,
            r.decode_bandwidth_fraction * 100.0,
            weight_bytes as f64 / 1e6
        );
    }
    Ok(())
}
