//! `engc compile`: model YAML + checkpoint → bundle, as one readable sequence of stages.

use crate::checkpoint::Checkpoint;
use crate::passes::{self, LmHead, PassCtx, Quant};
use crate::{arrange, lower, shard, CompileError};
use bundle::{BundleWriter, GenerationConfig, TensorEntry};
use ir::{DType, Plan};
use spec::{BoundModel, ModelSpec};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What to compile.
#[derive(Debug, Clone)]
pub struct CompileOptions {
    /// The model YAML.
    pub model: PathBuf,
    /// The checkpoint directory.
    pub checkpoint: PathBuf,
    /// Tensor-parallel ranks.
    pub tp: usize,
    /// Weight dtype; the checkpoint's when `None`.
    pub dtype: Option<DType>,
    /// Where the tokenizer files are; when `None`, built from a GGUF checkpoint's metadata
    /// (`gguf_tokenizer`), else the checkpoint directory.
    pub tokenizer: Option<PathBuf>,
    /// The bundle directory to write.
    pub out: PathBuf,
    /// Return the graph as text after this pass (`lower`, or a pipeline pass name).
    pub dump_after: Option<String>,
    /// How a tensor-parallel bundle holds the lm_head.
    pub lm_head: LmHead,
    /// A quantization of the linears' weights (`--quant`).
    pub quant: Option<Quant>,
}

/// What a successful compile produced.
#[derive(Debug)]
pub struct CompileReport {
    /// The bundle written.
    pub out: PathBuf,
    /// The plan in it.
    pub plan: Plan,
    /// Things worth telling the user (unused tensors, missing tokenizer).
    pub warnings: Vec<String>,
    /// The graph text requested with `dump_after`.
    pub dump: Option<String>,
}

/// Tokenizer files copied into the bundle when present.
const TOKENIZER_FILES: [&str; 4] =
    ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"];

/// Compiles a model into a bundle.
pub fn compile(opts: &CompileOptions) -> Result<CompileReport, CompileError> {
    if opts.tp == 0 {
        return Err(CompileError::Usage("--tp must be at least 1".into()));
    }
    let spec = ModelSpec::load(&opts.model)?;
    let ckpt = Checkpoint::open(&opts.checkpoint)?;
    let model = spec::bind(&spec, &ckpt.config)?;
    let mut warnings = validate_checkpoint(&model, &ckpt)?;
    warnings.extend(ckpt.warnings());
    let dtype = opts.dtype.or_else(|| config_dtype(&ckpt.config)).or_else(|| ckpt.main_dtype()).unwrap_or(DType::BF16);
    let kept = kept_blocks(&model, &ckpt, opts.dtype);
    let ctx = (opts.tp, opts.lm_head, opts.quant);
    let (plan, dump) = build_plan(&model, (dtype, &kept), ctx, opts.dump_after.as_deref())?;

    let mut w = BundleWriter::create(&opts.out)?;
    let plan_json = serde_json::to_string_pretty(&plan).map_err(|e| CompileError::Usage(e.to_string()))?;
    w.write_file("plan.json", plan_json.as_bytes())?;
    match codegen_cuda::emit(&plan) {
        Ok(program) => w.write_file("kernels/model.cu", program.source.as_bytes())?,
        Err(e) => warnings.push(format!("no CUDA kernels in the bundle: {e}")),
    }
    for rank in 0..opts.tp {
        write_rank_weights(&mut w, (&plan, &kept), &model, &ckpt, rank, opts.tp)?;
    }
    // A GGUF carries its tokenizer: without --tokenizer, its files are built from the metadata.
    let from_gguf = match opts.tokenizer {
        Some(_) => None,
        None => crate::gguf_tokenizer::for_checkpoint(&ckpt.path)?,
    };
    let tok_dir = opts
        .tokenizer
        .clone()
        .or_else(|| from_gguf.as_ref().map(|d| d.path().to_path_buf()))
        .unwrap_or_else(|| ckpt.dir.clone());
    warnings.extend(write_tokenizer(&mut w, &tok_dir, &ckpt)?);
    let params: BTreeMap<String, serde_json::Value> =
        model.params.iter().map(|(k, v)| (k.clone(), v.to_json())).collect();
    let out = w.finish(&spec.name, params, opts.tp, dtype)?;
    Ok(CompileReport { out, plan, warnings, dump })
}

/// The weights that stay in their checkpoint's block type (GGUF's Q8_0 / Q4_0 / Q4_1 / Q5_0 /
/// Q5_1 and k-quants, an FP8 checkpoint's weights as `F8_E4M3`), by name: all of them unless `--dtype`
/// asks for dequantized weights. (Of FP8 weights, only those read as linears' weights stay
/// FP8 in the plan: [`fp8_in_linears_only`].)
fn kept_blocks(model: &BoundModel, ckpt: &Checkpoint, dtype: Option<DType>) -> BTreeMap<String, DType> {
    if dtype.is_some() {
        return BTreeMap::new();
    }
    // Only whole tensors or row ranges of them: a stack, a transposed or interleaved part is
    // read as f32.
    let plain = |w: &spec::BoundWeight| w.experts.is_none() && !w.transposed && w.rows.is_none_or(|r| r.step == 1);
    model
        .weights
        .iter()
        .filter(|w| plain(w))
        .filter_map(|w| Some((w.name.clone(), ckpt.info(&w.tensor)?.block()?)))
        .collect()
}

/// Lowers a bound model (weights in `dtype`, or the block type `kept` names) and runs the
/// pass pipeline; returns the plan and, with `dump_after`, the graph text after that pass.
fn build_plan(
    model: &BoundModel,
    (dtype, kept): (DType, &BTreeMap<String, DType>),
    (tp, lm_head, quant): (usize, LmHead, Option<Quant>),
    dump_after: Option<&str>,
) -> Result<(Plan, Option<String>), CompileError> {
    let graph = fp8_in_linears_only(lower::lower(model, dtype, dtype, kept)?, dtype)?;
    let ctx = PassCtx { tp, model, lm_head, quant };
    let mut dump = None;
    let graph = passes::run(graph, &ctx, |name, g| {
        if dump_after == Some(name) {
            dump = Some(g.to_plan().map_or_else(|e| format!("<{e}>"), |p| p.to_text()));
        }
    })?;
    if let Some(p) = dump_after {
        if dump.is_none() {
            let names: Vec<&str> = std::iter::once("lower").chain(passes::PIPELINE.iter().map(|(n, _)| *n)).collect();
            return Err(CompileError::Usage(format!("no pass named `{p}`; passes: {}", names.join(", "))));
        }
    }
    let plan = graph.to_plan().map_err(|e| CompileError::Pass { pass: "plan".into(), source: e })?;
    Ok((plan, dump))
}

/// Turns the FP8 weights kept from the checkpoint that are not read only as linears' weights
/// (an embedding, an lm_head, a norm) into `dtype`: they are written dequantized.
fn fp8_in_linears_only(mut g: ir::Graph, dtype: DType) -> Result<ir::Graph, CompileError> {
    let linear = passes::linear_weights(&g);
    for n in g.nodes() {
        if let ir::Op::Weight { dtype: d @ DType::F8_E4M3, .. } = &mut g.node_mut(n).op {
            if !linear.contains(&n) {
                *d = dtype;
            }
        }
    }
    g.reinfer().map_err(|e| CompileError::Pass { pass: "lower".into(), source: e })?;
    Ok(g)
}

/// The plan of `model_yaml` bound to a `config.json` alone (no weights): for checking the
/// kernels of a model shape without its checkpoint.
pub fn plan_for_config(
    model_yaml: &std::path::Path,
    config: &serde_json::Value,
    tp: usize,
    dtype: DType,
) -> Result<Plan, CompileError> {
    plan_for_config_quant(model_yaml, config, (tp, dtype), None)
}

/// [`plan_for_config`] with the linears' weights quantized as `--quant` would (their dtype in
/// the plan; no weights are read).
pub fn plan_for_config_quant(
    model_yaml: &std::path::Path,
    config: &serde_json::Value,
    (tp, dtype): (usize, DType),
    quant: Option<Quant>,
) -> Result<Plan, CompileError> {
    if tp == 0 {
        return Err(CompileError::Usage("--tp must be at least 1".into()));
    }
    let spec = ModelSpec::load(model_yaml)?;
    let model = spec::bind(&spec, config)?;
    Ok(build_plan(&model, (dtype, &BTreeMap::new()), (tp, LmHead::default(), quant), None)?.0)
}

/// Checks that every tensor the model names exists with its shape and a supported dtype.
/// Returns a warning naming the checkpoint tensors the model does not use.
fn validate_checkpoint(model: &BoundModel, ckpt: &Checkpoint) -> Result<Vec<String>, CompileError> {
    for w in &model.weights {
        let at = model.spec.locate(&format!("{}:", w.key));
        for tensor in arrange::tensors(w) {
            let info = ckpt.info(&tensor).ok_or_else(|| CompileError::MissingTensor {
                name: tensor.clone(),
                key: w.key.clone(),
                at: at.clone(),
                checkpoint: ckpt.path.display().to_string(),
            })?;
            if !arrange::fits(w, &info.shape) {
                let expected = arrange::stored_shape(w).0;
                // The part a model takes of a fused tensor by its plan name; one expert's
                // tensor by its own.
                let name = if w.experts.is_some_and(|(_, per)| per) { tensor } else { w.name.clone() };
                return Err(CompileError::ShapeMismatch { name, at, expected, found: info.shape.clone() });
            }
            if !info.readable {
                return Err(CompileError::UnsupportedDtype { name: tensor, dtype: info.dtype_name.clone() });
            }
        }
    }
    let used: std::collections::HashSet<String> = model.weights.iter().flat_map(arrange::tensors).collect();
    let unused: Vec<&str> = ckpt.names().filter(|n| !used.contains(*n)).collect();
    Ok(match unused.len() {
        0 => vec![],
        n => vec![format!(
            "{n} checkpoint tensor(s) unused by {}: {}{}",
            model.spec.origin,
            unused.iter().take(8).copied().collect::<Vec<_>>().join(", "),
            if n > 8 { ", ..." } else { "" }
        )],
    })
}

fn config_dtype(config: &serde_json::Value) -> Option<DType> {
    ["torch_dtype", "dtype"].iter().find_map(|k| config.get(*k).and_then(|v| v.as_str()).and_then(DType::parse_float))
}

/// Writes one rank's weights: a weight the plan keeps in its checkpoint's block type as its
/// blocks ([`read_blocks`]), one `--quant fp8` made FP8 quantized ([`quantize_fp8`]), one
/// stored in the plan's dtype and taken whole copied as stored ([`arrange::read_stored`], a
/// rank's slice cut from its bytes), the rest read as f32 (FP8 and block weights dequantized)
/// and converted to the plan's dtype.
fn write_rank_weights(
    w: &mut BundleWriter,
    (plan, kept): (&Plan, &BTreeMap<String, DType>),
    model: &BoundModel,
    ckpt: &Checkpoint,
    rank: usize,
    tp: usize,
) -> Result<(), CompileError> {
    let weights: Vec<(&str, &[usize], DType, Option<&ir::Derived>)> = plan
        .nodes
        .iter()
        .filter_map(|n| match &n.op {
            ir::Op::Weight { name, shape, dtype, derived } => {
                Some((name.as_str(), shape.as_slice(), *dtype, derived.as_ref()))
            }
            _ => None,
        })
        .collect();
    let entries: Vec<TensorEntry> = weights
        .iter()
        .map(|(name, shape, dtype, _)| TensorEntry { name: name.to_string(), dtype: *dtype, shape: shape.to_vec() })
        .collect();
    let mut failure = None;
    let result = w.write_safetensors(&format!("weights/rank{rank}.safetensors"), &entries, |i| {
        let (name, shape, dtype, derived) = weights[i];
        let source = derived.map_or(name, |d| d.source.as_str());
        let data = model
            .weights
            .iter()
            .find(|bw| bw.name == source)
            .ok_or_else(|| CompileError::Usage(format!("plan weight `{source}` is not in the model")))
            .and_then(|bw| {
                if kept.get(source) == Some(&dtype) {
                    return read_blocks(ckpt, bw, dtype, (shape, tp, rank));
                }
                if dtype == DType::F8_E4M3 {
                    return quantize_fp8(ckpt, bw, (shape, tp, rank));
                }
                // The plan's shape says whether this rank holds a slice (a replicated lm_head
                // keeps its whole shape even where the model marks it column-parallel).
                let whole = shape == bw.shape;
                if let Some(bytes) = derived.is_none().then(|| arrange::read_stored(ckpt, bw, dtype)).flatten() {
                    return if whole { Ok(bytes) } else { shard::cut_bytes(bw, &bytes, dtype.size(), tp, rank) };
                }
                let data = arrange::read(ckpt, bw)?;
                let data = if whole { data } else { shard::cut(bw, &data, tp, rank)? };
                let data = match derived {
                    Some(d) => data.iter().map(|&x| d.expr.eval(&[x])).collect(),
                    None => data,
                };
                check_range(name, dtype, &data)?;
                Ok(dtype.from_f32(&data))
            });
        data.map_err(|err| {
            let msg = err.to_string();
            failure = Some(err);
            bundle::BundleError::Malformed { path: name.to_string(), message: msg }
        })
    });
    match (result, failure) {
        (Err(_), Some(err)) => Err(err),
        (r, _) => Ok(r?),
    }
}

/// A weight kept in its block type: its blocks, this rank's slice of them.
fn read_blocks(
    ckpt: &Checkpoint,
    bw: &spec::BoundWeight,
    dtype: DType,
    (shape, tp, rank): (&[usize], usize, usize),
) -> Result<Vec<u8>, CompileError> {
    let (stored, bytes) = ckpt.read_blocks(&bw.tensor)?;
    if stored != dtype {
        return Err(CompileError::Usage(format!(
            "weight `{}` is {stored} in the checkpoint, the plan says {dtype}",
            bw.name
        )));
    }
    let bytes = match bw.rows {
        None => bytes,
        Some(spec::Rows { start, end, .. }) => {
            let row = bytes.len() / ckpt.info(&bw.tensor).map_or(1, |t| t.shape[0].max(1));
            bytes[start * row..end * row].to_vec()
        }
    };
    rank_blocks(bw, bytes, dtype, (shape, tp, rank))
}

/// This rank's part of a block-type weight's blocks (all of them where the plan's shape is the
/// whole tensor's).
fn rank_blocks(
    bw: &spec::BoundWeight,
    bytes: Vec<u8>,
    dtype: DType,
    (shape, tp, rank): (&[usize], usize, usize),
) -> Result<Vec<u8>, CompileError> {
    if shape == bw.shape {
        Ok(bytes)
    } else {
        shard::cut_blocks(bw, &bytes, dtype, tp, rank)
    }
}

/// A linear's weight quantized by `--quant fp8`: the whole tensor, one scale per output
/// channel, then this rank's blocks of it (a row-parallel slice keeps its rows' scales).
fn quantize_fp8(
    ckpt: &Checkpoint,
    bw: &spec::BoundWeight,
    (shape, tp, rank): (&[usize], usize, usize),
) -> Result<Vec<u8>, CompileError> {
    let k = bw.shape.last().copied().unwrap_or(0);
    let bytes = ir::quant::quantize_fp8_rows(&arrange::read(ckpt, bw)?, k);
    rank_blocks(bw, bytes, DType::F8_E4M3, (shape, tp, rank))
}

/// The largest finite f16 value.
const F16_MAX: f32 = 65504.0;

/// A weight converted to f16 must fit its range (bf16 and f32 reach 3.4e38): a larger value
/// would turn into infinity and every logit into NaN.
fn check_range(name: &str, dtype: DType, data: &[f32]) -> Result<(), CompileError> {
    if dtype != DType::F16 {
        return Ok(());
    }
    match data.iter().copied().filter(|v| v.is_finite()).map(f32::abs).reduce(f32::max) {
        Some(max) if max > F16_MAX => Err(CompileError::Usage(format!(
            "weight `{name}` holds {max:e}, beyond f16's largest value ({F16_MAX}): compile with --dtype bf16"
        ))),
        _ => Ok(()),
    }
}

/// The id of `tokenizer_config.json`'s `eos_token` among `tokenizer.json`'s added tokens in
/// `dir`, if both say.
fn tokenizer_eos(dir: &Path) -> Option<u32> {
    let read = |f: &str| -> Option<serde_json::Value> {
        serde_json::from_str(&std::fs::read_to_string(dir.join(f)).ok()?).ok()
    };
    let eos = read("tokenizer_config.json")?.get("eos_token").cloned()?;
    let eos = eos.get("content").cloned().unwrap_or(eos);
    let eos = eos.as_str()?;
    let tokenizer = read("tokenizer.json")?;
    let added = tokenizer.get("added_tokens")?.as_array()?;
    let t = added.iter().find(|t| t.get("content").and_then(|c| c.as_str()) == Some(eos))?;
    t.get("id")?.as_u64().and_then(|id| u32::try_from(id).ok())
}

/// Copies the tokenizer files and writes `generation_config.json` with the eos ids (the
/// checkpoint's, and the tokenizer's `eos_token`).
fn write_tokenizer(w: &mut BundleWriter, dir: &Path, ckpt: &Checkpoint) -> Result<Vec<String>, CompileError> {
    let mut warnings = Vec::new();
    if !dir.is_dir() {
        return Err(CompileError::Checkpoint {
            path: dir.display().to_string(),
            message: "tokenizer directory does not exist".into(),
        });
    }
    if !dir.join("tokenizer.json").is_file() {
        warnings.push(format!(
            "no tokenizer.json in {}: the bundle can compute logits from ids but not generate text (pass --tokenizer DIR)",
            dir.display()
        ));
    }
    for f in TOKENIZER_FILES {
        let p = dir.join(f);
        if p.is_file() {
            let bytes = std::fs::read(&p)
                .map_err(|e| CompileError::Checkpoint { path: p.display().to_string(), message: e.to_string() })?;
            w.write_file(&format!("tokenizer/{f}"), &bytes)?;
        }
    }
    let gen_file = ckpt.dir.join("generation_config.json");
    let gen_cfg: Option<serde_json::Value> =
        std::fs::read_to_string(&gen_file).ok().and_then(|t| serde_json::from_str(&t).ok());
    let pick = |key: &str| gen_cfg.as_ref().and_then(|g| g.get(key)).or_else(|| ckpt.config.get(key)).cloned();
    let ids = |v: Option<serde_json::Value>| -> Vec<u32> {
        match v {
            Some(serde_json::Value::Array(a)) => a.iter().filter_map(|x| x.as_u64().map(|x| x as u32)).collect(),
            Some(v) => v.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
            None => vec![],
        }
    };
    let mut cfg = GenerationConfig {
        eos_token_id: ids(pick("eos_token_id")),
        bos_token_id: ids(pick("bos_token_id")).first().copied(),
    };
    // The tokenizer's own eos (what its chat template ends a turn with) stops generation too,
    // as in vLLM, which stops at it and at the generation config's ids.
    if let Some(id) = tokenizer_eos(dir).filter(|id| !cfg.eos_token_id.contains(id)) {
        cfg.eos_token_id.push(id);
    }
    if cfg.eos_token_id.is_empty() {
        warnings.push("no eos_token_id in the checkpoint config: generation stops only at --max-tokens".into());
    }
    let text = serde_json::to_string_pretty(&cfg).map_err(|e| CompileError::Usage(e.to_string()))?;
    w.write_file("tokenizer/generation_config.json", text.as_bytes())?;
    Ok(warnings)
}
