//! `codegen-cuda`: a plan lowered to CUDA. [`schedule`] fuses the plan's ops into launches of
//! kernels from `kernels/` (hand-written templates) and assigns device buffers by liveness;
//! every kernel is a template instantiated with the model's shapes as compile-time constants
//! under a name derived from its [`KernelKey`], so the runtime finds kernels by key, never by a
//! name assembled at the call site. The source includes no CUDA toolkit header: NVRTC alone
//! compiles it. `engc compile` writes it into the bundle as `kernels/model.cu`; `engc
//! cuda-check` compiles it with NVRTC.
#![deny(missing_docs)]

mod a8;
mod formats;
mod fp8;
mod keys;
mod lower;
pub mod nvrtc;
pub mod schedule;

pub use a8::{
    a8_blocks, a8_cluster, a8_grid, a8_row_bytes, a8_slots, A8_BLOCKS, A8_BLOCKS_PER_SM, A8_FEATURES, A8_ROWS, A8_SMEM,
};
pub use formats::{block_device_layout, WFormat};
pub use fp8::fp8_device_layout;
pub use keys::{
    argmax_blocks, hopper, DecAttention, HeadNorm, KernelKey, Mask, NormIn, RopeShape, ALL_REDUCE_MAX_BLOCKS,
    ARGMAX_BLOCKS, MAP_INPUTS, MASK_SPAN,
};
pub use lower::tiled;
pub use schedule::{
    moe_rows_max, Arg, Buffer, Count, Dim, Input, Launch, Step, GEMV_MAX_ROWS, GEMV_ROWS, MOE_DIRECT_TOKENS,
    MOE_ROWS_PAIRS, MOE_TILE, NORM_IN_GEMV_ROWS, SKINNY_ROWS, W8_GROUP,
};

use ir::Plan;
use std::fmt::Write;

/// The prelude and the kernel templates.
const PRELUDE: &str = include_str!("../../../kernels/prelude.cuh");
const BASIC: &str = include_str!("../../../kernels/basic.cuh");
const FORMATS: &str = include_str!("../../../kernels/formats.cuh");
const FAST: &str = include_str!("../../../kernels/fast.cuh");
const GEMM: &str = include_str!("../../../kernels/gemm.cuh");
const ATTENTION: &str = include_str!("../../../kernels/attention.cuh");
const COMM: &str = include_str!("../../../kernels/comm.cuh");
const SAMPLE: &str = include_str!("../../../kernels/sample.cuh");
const MOE: &str = include_str!("../../../kernels/moe.cuh");

/// Runs `f` with panics silenced and caught: cudarc loads the CUDA libraries at run time and
/// panics when one is missing, which callers turn into a clear error. `None`: it panicked.
pub fn without_panic<T>(f: impl FnOnce() -> T + std::panic::UnwindSafe) -> Option<T> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = std::panic::catch_unwind(f);
    std::panic::set_hook(hook);
    r.ok()
}

/// Errors of code generation.
#[derive(Debug, thiserror::Error)]
pub enum CodegenError {
    /// The plan needs something the CUDA kernels do not support.
    #[error("CUDA codegen: {0}")]
    Unsupported(String),
    /// The CUDA a bundle carries is not what this build generates for its plan.
    #[error(
        "the bundle's kernels/model.cu differs from the CUDA this build generates for its plan (first at line \
         {line}): it was compiled by another engc; compile it again with this one (engc compile ...)"
    )]
    Stale {
        /// The first line that differs (1-based).
        line: usize,
    },
}

/// A plan's CUDA program: the source and the schedule that runs it.
#[derive(Debug, Clone, PartialEq)]
pub struct Program {
    /// The CUDA C source.
    pub source: String,
    /// Every kernel in it, in first-use order.
    pub kernels: Vec<KernelKey>,
    /// The forward step as launches.
    pub steps: Vec<Step>,
    /// Device buffers the steps use.
    pub buffers: Vec<Buffer>,
    /// Constant f32 arrays (RoPE frequencies) the runtime uploads.
    pub constants: Vec<Vec<f32>>,
    /// The buffer that holds the logits (`[R, vocab]` f32).
    pub output: usize,
    /// The buffer that holds the final hidden state of the logit rows (`[R, hidden]` in
    /// `half`: the logits op's gathered input), what embeddings read; `None` without a
    /// `logits` op.
    pub hidden: Option<usize>,
    /// The 16-bit float of activations feeding linears, 16-bit weights and the KV cache
    /// (`BF16`, or `F16` for an f16 plan): the source's `h16_t`.
    pub half: ir::DType,
}

impl Program {
    /// Kernel launches of one forward step of `count` tokens (and as many logit rows): at 1,
    /// a batch-1 decode step's (sampling not counted).
    pub fn launches(&self, count: usize) -> usize {
        launches_at(&self.steps, count)
    }

    /// The launches of a forward step of `tokens` tokens, one logit row each (a decode step of
    /// that batch; sampling not counted), in order, one line each: the kernel's name, its
    /// blocks (grid x times y), threads a block and dynamic shared memory a block (bytes), tab
    /// separated, and `idle` where a decode graph leaves the launch out ([`Launch`]'s
    /// `idle_in_decode`). The small-batch linears' launches are the schedule's own (the runtime
    /// may time another GEMM in their place). What `scripts/kernel-sass.py --waves` reads.
    pub fn launch_table(&self, tokens: usize) -> String {
        let count = |_: Count| tokens;
        let mut out = String::new();
        for l in self.steps.iter().flat_map(|s| s.launches(tokens, tokens)) {
            let blocks = l.grid[0].size(count) * l.grid[1].size(count);
            let idle = if l.idle_in_decode { "\tidle" } else { "" };
            out += &format!("{}\t{blocks}\t{}\t{}{idle}\n", l.key.name(), l.block, l.key.dyn_smem());
        }
        out
    }
}

fn launches_at(steps: &[Step], count: usize) -> usize {
    steps
        .iter()
        .map(|st| match st {
            Step::Kernels { variants, .. } => {
                variants.iter().find(|(bound, _)| *bound >= count).map_or(0, |(_, launches)| launches.len())
            }
            Step::AllReduce { .. } | Step::AllGather { .. } => 0,
        })
        .sum()
}

/// The program a bundle runs: [`emit`]'s, which must be the very source the bundle carries
/// (`kernels/model.cu`, written by `engc compile`) when it carries one, so that what runs is
/// what the bundle holds.
pub fn emit_for_bundle(plan: &Plan, carried: Option<&str>) -> Result<Program, CodegenError> {
    let program = emit(plan)?;
    if let Some(src) = carried {
        if src != program.source {
            let line = src.lines().zip(program.source.lines()).take_while(|(a, b)| a == b).count() + 1;
            return Err(CodegenError::Stale { line });
        }
    }
    Ok(program)
}

/// Generates the CUDA program of `plan` (one rank; a tensor-parallel plan already has per-rank
/// shapes).
pub fn emit(plan: &Plan) -> Result<Program, CodegenError> {
    let s = schedule::schedule(plan)?;
    let mut kernels: Vec<KernelKey> = Vec::new();
    let launched = s.steps.iter().flat_map(|st| match st {
        Step::Kernels { variants, .. } => variants.iter().flat_map(|(_, ls)| ls.iter().map(|l| l.key)).collect(),
        Step::AllReduce { .. } | Step::AllGather { .. } => vec![],
    });
    let one_shot = (plan.tp > 1).then_some(KernelKey::AllReduce { ranks: plan.tp });
    let gather = s.steps.iter().any(|st| matches!(st, Step::AllGather { .. }));
    let gather = gather.then_some(KernelKey::AllGather { ranks: plan.tp });
    let argmax = keys::argmax_block_counts().map(|blocks| KernelKey::Argmax { vocab: plan.vocab, blocks });
    let sampling = [
        KernelKey::Sample { vocab: plan.vocab },
        KernelKey::AdjustLogits { vocab: plan.vocab },
        KernelKey::MaskLogits { vocab: plan.vocab },
        KernelKey::FeedTokens,
    ]
    .into_iter()
    .chain(argmax);
    // E4M3-weight tensor-core linears may run as W8A8 through cuBLASLt, their input quantized first.
    let w8 = s.steps.iter().any(|st| match st {
        Step::Kernels { variants, .. } => variants.iter().flat_map(|(_, ls)| ls).any(|l| l.key.w8_tensor_core()),
        _ => false,
    });
    let quant = w8.then_some(KernelKey::QuantE4M3);
    let a8: Vec<KernelKey> = s
        .steps
        .iter()
        .flat_map(|st| match st {
            Step::Kernels { variants, .. } => variants
                .iter()
                .flat_map(|(_, ls)| ls.iter().flat_map(|l| l.key.a8().into_iter().chain(l.key.a8_clustered())))
                .collect(),
            _ => vec![],
        })
        .collect();
    for k in launched.chain(sampling).chain(one_shot).chain(gather).chain(quant).chain(a8) {
        if !kernels.contains(&k) {
            kernels.push(k);
        }
    }
    let launches = launches_at(&s.steps, 1);
    let mut source = String::new();
    let _ = writeln!(
        source,
        "// Generated by engc from the plan: {} nodes, {} steps, {launches} launches at batch 1, {} kernels, \
         {} buffers, tp={}, vocab {}.\n",
        plan.nodes.len(),
        s.steps.len(),
        kernels.len(),
        s.buffers.len(),
        plan.tp,
        plan.vocab
    );
    let _ = writeln!(source, "#define H16_F16 {}", u8::from(s.half == ir::DType::F16));
    let _ = writeln!(source, "#define MOE_TILE {}", schedule::MOE_TILE);
    let _ = writeln!(
        source,
        "#define DEC_STAGES {}\n#define DEC_SPLIT_MIN {}\n#define FA_KEYS {}\n#define FA_STAGES {}\n#define FA_WARPS {}\n",
        schedule::DEC_STAGES,
        schedule::DEC_SPLIT_MIN,
        schedule::FA_KEYS,
        schedule::FA_STAGES,
        schedule::FA_WARPS
    );
    for part in [PRELUDE, BASIC, FORMATS, FAST, GEMM, ATTENTION, MOE, COMM, SAMPLE] {
        source += part;
        source += "\n";
    }
    source += nvrtc::INSTANCES;
    source += "\n";
    for k in &kernels {
        source += &k.instance()?;
    }
    Ok(Program {
        source,
        kernels,
        steps: s.steps,
        buffers: s.buffers,
        constants: s.constants,
        output: s.output,
        hidden: s.hidden,
        half: s.half,
    })
}
