//! `engc`: the compiler CLI. `engc compile` turns a model YAML and a checkpoint into a bundle;
//! `engc inspect` describes a bundle.

use bundle::Bundle;
use clap::{Parser, Subcommand};
use compiler::{CompileOptions, LmHead, Quant};
use ir::{DType, Op};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "engc", version, about = "Compile model architectures (YAML) + checkpoints into plan bundles")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Compile MODEL.yaml with a checkpoint into a bundle directory.
    Compile {
        /// The model architecture (models/*.yaml). Default: the YAML whose `architectures` names
        /// the checkpoint's, from $ENGINE_MODELS_DIR, ./models or the source tree's models/.
        model: Option<PathBuf>,
        /// Checkpoint directory (config.json + safetensors) or GGUF file.
        #[arg(long)]
        checkpoint: PathBuf,
        /// Tensor-parallel ranks to shard the weights for.
        #[arg(long, default_value_t = 1)]
        tp: usize,
        /// Weight dtype: bf16, f16 or f32 (default: the checkpoint's; a GGUF's block tensors, Q8_0,
        /// Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K, then stay in their blocks, and an FP8
        /// checkpoint's linears stay E4M3; the CPU and CUDA backends read both).
        #[arg(long, value_parser = parse_dtype)]
        dtype: Option<DType>,
        /// Directory with tokenizer.json / tokenizer_config.json (default: a GGUF's own
        /// tokenizer and chat template, else the checkpoint directory).
        #[arg(long)]
        tokenizer: Option<PathBuf>,
        /// Output bundle directory.
        #[arg(short, long)]
        out: PathBuf,
        /// Print the graph after this pass (lower, tensor_parallel) on stdout.
        #[arg(long)]
        dump_after: Option<String>,
        /// With --tp above 1, how the ranks hold an lm_head the model marks column-parallel:
        /// vocab (each computes its share of the vocabulary, the logits are gathered) or
        /// replicated (each computes all the logits).
        #[arg(long, default_value = "vocab", value_parser = parse_lm_head)]
        lm_head: LmHead,
        /// Quantize the linears' weights (not embeddings, norms or the lm_head): fp8 (E4M3,
        /// one f32 scale per output channel; the CPU backends dequantize it at load, the CUDA
        /// kernels read it as E4M3 with 16-bit activations).
        #[arg(long, value_parser = parse_quant)]
        quant: Option<Quant>,
    },
    /// Compile the CUDA kernels of a bundle (or of a model shape: --model and --config) with
    /// NVRTC, to check them without a GPU.
    CudaCheck {
        /// A bundle directory (its kernels/model.cu).
        bundle: Option<PathBuf>,
        /// The model architecture (with --config instead of a bundle).
        #[arg(long, requires = "config", conflicts_with = "bundle")]
        model: Option<PathBuf>,
        /// A config.json of the shape to check.
        #[arg(long, requires = "model")]
        config: Option<PathBuf>,
        /// Tensor-parallel ranks (with --config).
        #[arg(long, default_value_t = 1)]
        tp: usize,
        /// Weight and activation dtype (with --config): bf16, f16 or f32.
        #[arg(long, value_parser = parse_dtype, default_value = "bf16")]
        dtype: DType,
        /// Quantize the linears' weights (with --config) as `compile --quant` does: fp8.
        #[arg(long, value_parser = parse_quant, requires = "config")]
        quant: Option<Quant>,
        /// Target virtual architecture.
        #[arg(long, default_value = "compute_90")]
        arch: String,
        /// Also write the CUDA source checked to this file (for `scripts/kernel-sass.py`).
        #[arg(long)]
        emit: Option<PathBuf>,
        /// Also write the launches of a step of this many tokens (one logit row each) to the
        /// file of --launches-to: kernel, blocks, threads, dynamic shared memory (for
        /// `scripts/kernel-sass.py --waves`).
        #[arg(long, requires = "launches_to")]
        launches: Option<usize>,
        /// Where --launches writes.
        #[arg(long, requires = "launches")]
        launches_to: Option<PathBuf>,
    },
    /// Describe a bundle.
    Inspect {
        /// The bundle directory.
        bundle: PathBuf,
        /// Print the lowered graph (the plan) as text.
        #[arg(long)]
        graph: bool,
    },
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    DType::parse_float(s).ok_or_else(|| format!("unknown dtype `{s}` (expected bf16, f16 or f32)"))
}

fn parse_quant(s: &str) -> Result<Quant, String> {
    Quant::parse(s).ok_or_else(|| format!("unknown quantization `{s}` (expected fp8)"))
}

fn parse_lm_head(s: &str) -> Result<LmHead, String> {
    LmHead::parse(s).ok_or_else(|| format!("unknown lm_head layout `{s}` (expected vocab or replicated)"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Compile { model, checkpoint, tp, dtype, tokenizer, out, dump_after, lm_head, quant } => {
            match model.map_or_else(|| pick_model(&checkpoint), Ok) {
                Ok(model) => {
                    let opts =
                        CompileOptions { model, checkpoint, tp, dtype, tokenizer, out, dump_after, lm_head, quant };
                    compile(&opts)
                }
                Err(e) => Err(e),
            }
        }
        Cmd::Inspect { bundle, graph } => inspect(&bundle, graph),
        Cmd::CudaCheck { bundle, model, config, tp, dtype, quant, arch, emit, launches, launches_to } => {
            cuda_check(bundle, model, config, (tp, dtype, quant), arch, emit, launches.zip(launches_to))
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

/// The model YAML for a checkpoint compiled without one.
fn pick_model(checkpoint: &std::path::Path) -> Result<PathBuf, String> {
    let model = compiler::find_model(&compiler::model_dirs(), checkpoint).map_err(|e| e.to_string())?;
    eprintln!("model: {} (its architectures name the checkpoint's)", model.display());
    Ok(model)
}

fn cuda_check(
    bundle: Option<PathBuf>,
    model: Option<PathBuf>,
    config: Option<PathBuf>,
    (tp, dtype, quant): (usize, DType, Option<Quant>),
    arch: String,
    emit: Option<PathBuf>,
    launches: Option<(usize, PathBuf)>,
) -> Result<(), String> {
    // A bundle's own source (what it runs), its plan only where the launches are asked for.
    let (source, program) = match (bundle, model, config) {
        (Some(b), None, None) => {
            let p = b.join("kernels/model.cu");
            let source = std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?;
            let program = match launches {
                Some(_) => {
                    let plan = Bundle::open(&b).map_err(|e| e.to_string())?.plan;
                    Some(codegen_cuda::emit_for_bundle(&plan, Some(&source)).map_err(|e| e.to_string())?)
                }
                None => None,
            };
            (source, program)
        }
        (None, Some(m), Some(c)) => {
            let text = std::fs::read_to_string(&c).map_err(|e| format!("{}: {e}", c.display()))?;
            let cfg: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| format!("{}: invalid JSON: {e}", c.display()))?;
            let plan = compiler::plan_for_config_quant(&m, &cfg, (tp, dtype), quant).map_err(|e| e.to_string())?;
            let program = codegen_cuda::emit(&plan).map_err(|e| e.to_string())?;
            (program.source.clone(), Some(program))
        }
        _ => return Err("give a bundle, or --model and --config".into()),
    };
    if let Some(f) = &emit {
        std::fs::write(f, &source).map_err(|e| format!("{}: {e}", f.display()))?;
    }
    if let (Some((tokens, f)), Some(program)) = (&launches, &program) {
        std::fs::write(f, program.launch_table(*tokens)).map_err(|e| format!("{}: {e}", f.display()))?;
    }
    let arch: &'static str = Box::leak(arch.into_boxed_str());
    let t = std::time::Instant::now();
    let ptx = codegen_cuda::nvrtc::compile_ptx(&source, arch).map_err(|e| e.to_string())?;
    let kernels = ptx.matches(".entry").count();
    println!("compiled {kernels} kernels ({} bytes of PTX) for {arch} in {:.2}s", ptx.len(), t.elapsed().as_secs_f64());
    // The small-batch kernels' wgmma is compiled only for Hopper's own target
    // (`KernelKey::arch`), and PTX leaves inline assembly unchecked: assemble them for it too.
    if let Some(own) = codegen_cuda::hopper(arch).then(|| codegen_cuda::nvrtc::hopper_source(&source)).flatten() {
        codegen_cuda::nvrtc::compile_ptx(&own, "sm_90a").map_err(|e| format!("sm_90a: {e}"))?;
        println!("assembled for sm_90a (wgmma)");
    }
    Ok(())
}

fn compile(opts: &CompileOptions) -> Result<(), String> {
    let started = std::time::Instant::now();
    let report = compiler::compile(opts).map_err(|e| e.to_string())?;
    for w in &report.warnings {
        eprintln!("warning: {w}");
    }
    if let Some(text) = &report.dump {
        print!("{text}");
    }
    eprintln!(
        "wrote {} ({} plan nodes, {} weights per rank) in {:.2}s",
        report.out.display(),
        report.plan.nodes.len(),
        report.plan.weights().count(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn inspect(path: &std::path::Path, graph: bool) -> Result<(), String> {
    let b = Bundle::open(path).map_err(|e| e.to_string())?;
    if graph {
        print!("{}", b.plan.to_text());
        return Ok(());
    }
    let m = &b.manifest;
    println!("bundle     {}", path.display());
    println!("model      {} (format {}, engine {})", m.model, m.format_version, m.engine_version);
    println!("tp         {}", m.tp);
    println!("dtype      {}", m.dtype);
    println!("params");
    for (k, v) in &m.params {
        println!("  {k:<16} {v}");
    }
    let mut ops: BTreeMap<&str, usize> = BTreeMap::new();
    for n in &b.plan.nodes {
        if !matches!(n.op, Op::Weight { .. }) {
            *ops.entry(n.op.name()).or_default() += 1;
        }
    }
    let ops: Vec<String> = ops.iter().map(|(k, v)| format!("{k} x{v}")).collect();
    println!("plan       {} nodes: {}", b.plan.nodes.len(), ops.join(", "));
    let mut fusions: BTreeMap<&str, usize> = BTreeMap::new();
    for f in &b.plan.fusions {
        *fusions.entry(f.kind.name()).or_default() += 1;
    }
    let fusions: Vec<String> = fusions.iter().map(|(k, v)| format!("{k} x{v}")).collect();
    println!("fusions    {}", if fusions.is_empty() { "none".into() } else { fusions.join(", ") });
    match codegen_cuda::emit(&b.plan) {
        Ok(p) => {
            let (n, layers) = (p.launches(1), b.plan.kv.layers.max(1));
            let per = n as f64 / layers as f64;
            println!(
                "cuda       {n} launches per batch-1 decode step ({per:.1} per layer), {} kernels",
                p.kernels.len()
            );
        }
        Err(e) => println!("cuda       not runnable: {e}"),
    }
    let kv = b.plan.kv;
    println!(
        "kv cache   {} layers x {} kv heads x {} head_dim per rank ({} bytes/token in f32)",
        kv.layers,
        kv.kv_heads,
        kv.head_dim,
        2 * kv.layers * kv.row() * 4
    );
    let bytes: usize = b.plan.weight_bytes();
    println!("weights    {} tensors, {:.1} MiB per rank", b.plan.weights().count(), bytes as f64 / (1 << 20) as f64);
    let gen = b.generation_config().map_err(|e| e.to_string())?;
    match b.tokenizer_dir() {
        Some(_) => println!("tokenizer  yes (eos ids {:?})", gen.eos_token_id),
        None => println!("tokenizer  none (logits only)"),
    }
    println!("files");
    for f in m.files.keys() {
        println!("  {f}");
    }
    Ok(())
}
