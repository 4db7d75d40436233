//! `codegen-cuda`: a plan's kernels as CUDA C. Every kernel the plan needs is a template from
//! `kernels/` (hand-written building blocks) instantiated with the model's shapes as
//! compile-time constants under a name derived from its [`KernelKey`], so the runtime finds
//! kernels by key, never by a name assembled at the call site. The source includes no CUDA
//! toolkit header: NVRTC alone compiles it. `engc compile` writes it into the bundle as
//! `kernels/model.cu`; `engc cuda-check` compiles it with NVRTC.
#![deny(missing_docs)]

pub mod nvrtc;

use ir::{DType, Op, Plan};
use std::fmt::Write;

/// The prelude and the kernel templates.
const PRELUDE: &str = include_str!("../../../kernels/prelude.cuh");
const BASIC: &str = include_str!("../../../kernels/basic.cuh");

/// Errors of code generation.
#[derive(Debug, thiserror::Error)]
pub enum CodegenError {
    /// The plan needs something the CUDA kernels do not support.
    #[error("CUDA codegen: {0}")]
    Unsupported(String),
}

/// One specialised kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelKey {
    /// Rows of an embedding table of width `h`.
    Embedding {
        /// Row width.
        h: usize,
        /// Table dtype.
        w: DType,
    },
    /// RMS norm over rows of `h`.
    RmsNorm {
        /// Row width.
        h: usize,
        /// Weight dtype.
        w: DType,
    },
    /// `x [T, k] · w [n, k]ᵀ (+ bias)`.
    Linear {
        /// Input features.
        k: usize,
        /// Output features.
        n: usize,
        /// Weight dtype.
        w: DType,
        /// With a bias.
        bias: bool,
    },
    /// Rotate-half RoPE over heads of `d` in rows of `cols`.
    Rope {
        /// Row width.
        cols: usize,
        /// Head size.
        d: usize,
    },
    /// The step's K/V rows into the paged cache.
    KvWrite {
        /// Floats per K (or V) row.
        row: usize,
    },
    /// Causal GQA attention over the paged cache.
    Attention {
        /// Query heads.
        heads: usize,
        /// KV heads.
        kv_heads: usize,
        /// Head size.
        d: usize,
    },
    /// `a + b`.
    Add,
    /// `a * b`.
    Mul,
    /// `silu(a)`.
    Silu,
    /// The rows whose logits are wanted.
    GatherRows {
        /// Row width.
        h: usize,
    },
    /// Greedy sampling over rows of `vocab` logits.
    Argmax {
        /// Vocabulary size.
        vocab: usize,
    },
}

fn ctype(d: DType) -> Result<&'static str, CodegenError> {
    match d {
        DType::F32 => Ok("float"),
        DType::BF16 => Ok("bf16_t"),
        other => Err(CodegenError::Unsupported(format!("{other} weights (compile with --dtype bf16 or f32)"))),
    }
}

impl KernelKey {
    /// The kernel's symbol in the generated source.
    pub fn name(&self) -> String {
        match *self {
            KernelKey::Embedding { h, w } => format!("embedding_h{h}_{w}"),
            KernelKey::RmsNorm { h, w } => format!("rms_norm_h{h}_{w}"),
            KernelKey::Linear { k, n, w, bias } => format!("linear_k{k}_n{n}_{w}{}", if bias { "_bias" } else { "" }),
            KernelKey::Rope { cols, d } => format!("rope_c{cols}_d{d}"),
            KernelKey::KvWrite { row } => format!("kv_write_r{row}"),
            KernelKey::Attention { heads, kv_heads, d } => format!("attention_h{heads}_kv{kv_heads}_d{d}"),
            KernelKey::Add => "add_f32".into(),
            KernelKey::Mul => "mul_f32".into(),
            KernelKey::Silu => "silu_f32".into(),
            KernelKey::GatherRows { h } => format!("gather_rows_h{h}"),
            KernelKey::Argmax { vocab } => format!("argmax_v{vocab}"),
        }
    }

    /// The `extern "C"` wrapper that instantiates the template.
    fn instance(&self) -> Result<String, CodegenError> {
        let name = self.name();
        let (params, call) = match *self {
            KernelKey::Embedding { h, w } => {
                let t = ctype(w)?;
                (
                    format!("const int* ids, const {t}* table, float* out"),
                    format!("embedding<{h}, {t}>(ids, table, out)"),
                )
            }
            KernelKey::RmsNorm { h, w } => {
                let t = ctype(w)?;
                (
                    format!("const float* x, const {t}* w, float* out, float eps"),
                    format!("rms_norm<{h}, {t}>(x, w, out, eps)"),
                )
            }
            KernelKey::Linear { k, n, w, bias } => {
                let t = ctype(w)?;
                (
                    format!("const float* x, const {t}* w, const {t}* bias, float* out, int T"),
                    format!("linear<{k}, {n}, {t}, {bias}>(x, w, bias, out, T)"),
                )
            }
            KernelKey::Rope { cols, d } => (
                "const float* x, const int* pos, const float* inv_freq, float scale, float* out".into(),
                format!("rope<{cols}, {d}>(x, pos, inv_freq, scale, out)"),
            ),
            KernelKey::KvWrite { row } => (
                "const float* k, const float* v, float* kc, float* vc, const int* slot_of".into(),
                format!("kv_write<{row}>(k, v, kc, vc, slot_of)"),
            ),
            KernelKey::Attention { heads, kv_heads, d } => (
                "const float* q, const float* kc, const float* vc, const int* slots, const int* seq_off, \
                 const int* pos, float scale, float* out"
                    .into(),
                format!("attention<{heads}, {kv_heads}, {d}>(q, kc, vc, slots, seq_off, pos, scale, out)"),
            ),
            KernelKey::Add => ("const float* a, const float* b, float* out, long n".into(), "add(a, b, out, n)".into()),
            KernelKey::Mul => ("const float* a, const float* b, float* out, long n".into(), "mul(a, b, out, n)".into()),
            KernelKey::Silu => ("const float* a, float* out, long n".into(), "silu(a, out, n)".into()),
            KernelKey::GatherRows { h } => {
                ("const float* x, const int* rows, float* out".into(), format!("gather_rows<{h}>(x, rows, out)"))
            }
            KernelKey::Argmax { vocab } => {
                ("const float* logits, int* out".into(), format!("argmax<{vocab}>(logits, out)"))
            }
        };
        Ok(format!("extern \"C\" __global__ void {name}({params}) {{ {call}; }}\n"))
    }
}

/// A plan's CUDA program.
#[derive(Debug, Clone, PartialEq)]
pub struct Program {
    /// The CUDA C source.
    pub source: String,
    /// Every kernel in it, in first-use order.
    pub kernels: Vec<KernelKey>,
    /// The kernels each plan node launches, in order.
    pub nodes: Vec<Vec<KernelKey>>,
}

/// The kernels plan node `i` launches.
fn node_kernels(plan: &Plan, i: usize) -> Vec<KernelKey> {
    let n = &plan.nodes[i];
    let cols = n.ty.last().unwrap_or(0);
    let in_cols = |j: usize| plan.nodes[n.inputs[j]].ty.last().unwrap_or(0);
    let wdtype = |j: usize| match &plan.nodes[n.inputs[j]].op {
        Op::Weight { dtype, .. } => *dtype,
        _ => DType::F32,
    };
    match &n.op {
        Op::Tokens | Op::Positions | Op::Weight { .. } | Op::AllReduce => vec![],
        Op::Embedding => vec![KernelKey::Embedding { h: cols, w: wdtype(1) }],
        Op::Linear { bias } => vec![KernelKey::Linear { k: in_cols(0), n: cols, w: wdtype(1), bias: *bias }],
        Op::RmsNorm { .. } => vec![KernelKey::RmsNorm { h: cols, w: wdtype(1) }],
        Op::Rope { head_dim, .. } => vec![KernelKey::Rope { cols, d: *head_dim }],
        Op::Attention { heads, kv_heads, head_dim, .. } => vec![
            KernelKey::KvWrite { row: kv_heads * head_dim },
            KernelKey::Attention { heads: *heads, kv_heads: *kv_heads, d: *head_dim },
        ],
        Op::Silu => vec![KernelKey::Silu],
        Op::Mul => vec![KernelKey::Mul],
        Op::Add => vec![KernelKey::Add],
        Op::Logits => vec![
            KernelKey::GatherRows { h: in_cols(0) },
            KernelKey::Linear { k: in_cols(0), n: cols, w: wdtype(1), bias: false },
        ],
    }
}

/// Generates the CUDA program of `plan` (one rank; a tensor-parallel plan already has per-rank
/// shapes).
pub fn emit(plan: &Plan) -> Result<Program, CodegenError> {
    let nodes: Vec<Vec<KernelKey>> = (0..plan.nodes.len()).map(|i| node_kernels(plan, i)).collect();
    let mut kernels: Vec<KernelKey> = Vec::new();
    for k in nodes.iter().flatten().copied().chain([KernelKey::Argmax { vocab: plan.vocab }]) {
        if !kernels.contains(&k) {
            kernels.push(k);
        }
    }
    let mut source = String::new();
    let _ = writeln!(
        source,
        "// Generated by engc from the plan: {} nodes, {} kernels, tp={}, vocab {}.\n",
        plan.nodes.len(),
        kernels.len(),
        plan.tp,
        plan.vocab
    );
    source += PRELUDE;
    source += "\n";
    source += BASIC;
    source += "\n// ---- instances ----\n";
    for k in &kernels {
        source += &k.instance()?;
    }
    Ok(Program { source, kernels, nodes })
}
