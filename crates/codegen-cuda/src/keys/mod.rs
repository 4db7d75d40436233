//! [`KernelKey`]: one specialised kernel, its symbol and the `extern "C"` instance that
//! instantiates its template from `kernels/`.

use crate::a8::{
    a8_blocks, a8_cluster, a8_grid, a8_row_bytes, a8_slots, A8_FEATURES, A8_GROUP_BYTES, A8_ROWS, A8_SMEM, A8_STAGES,
};
use crate::{CodegenError, WFormat};
use attention::{attention_params, ROPE_HEAD_ARGS};
pub use attention::{DecAttention, HeadNorm, Mask, RopeShape};

mod attention;
use ir::DType;

/// One specialised kernel. Shapes are compile-time constants of the instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelKey {
    /// Rows of an embedding table of width `h` (f32 out).
    Embedding {
        /// Row width.
        h: usize,
        /// Table dtype.
        w: DType,
    },
    /// Rows of an embedding table of GGUF blocks (`rows` rows of `h`, in the device layout of
    /// [`crate::block_device_layout`]), f32 out.
    EmbeddingBlocks {
        /// Row width.
        h: usize,
        /// Rows of the table (its run parameters follow all rows' codes).
        rows: usize,
        /// The table's format (one of GGUF's).
        wf: WFormat,
    },
    /// Optional residual add, then RMS norm over rows of `h` (one block each; a norm over
    /// groups of a wider row, per head, runs over the groups as rows).
    AddRmsNorm {
        /// Row (or group) width.
        h: usize,
        /// Weight dtype.
        w: DType,
        /// With the residual add (writes the sum too).
        add: bool,
        /// Output dtype.
        out: DType,
    },
    /// RMS norm of `b` (weight `pw`), added to `a` (the sum written), then RMS norm of the sum
    /// over rows of `h`: a `norm_add_norm` fusion.
    NormAddRmsNorm {
        /// Row width.
        h: usize,
        /// The second norm's weight dtype.
        w: DType,
        /// The first norm's weight dtype.
        pw: DType,
        /// Output dtype.
        out: DType,
    },
    /// Up to three linears sharing a 16-bit input, for at most `rows` rows (memory-bound GEMV).
    Gemv {
        /// Input features.
        k: usize,
        /// Output features of each group (0: absent).
        n: [usize; 3],
        /// Rows per launch (1, 2, 4 or 8).
        rows: usize,
        /// The RMS norm it applies to its input rows itself, if any.
        norm: Option<NormIn>,
        /// The weights' format.
        wf: WFormat,
        /// f32 biases (GGUF files store them so; GGUF weights only) rather than 16-bit ones.
        b32: bool,
    },
    /// Gate and up projections with act(gate)·up, 16-bit out, for at most `rows` rows.
    GemvGlu {
        /// Input features.
        k: usize,
        /// Output features.
        n: usize,
        /// Rows per launch.
        rows: usize,
        /// The RMS norm it applies to its input rows itself, if any.
        norm: Option<NormIn>,
        /// The activation as CUDA C over `x0` (interned).
        act: &'static str,
        /// The weights' format.
        wf: WFormat,
    },
    /// Up to three linears sharing a 16-bit input, for at most `8 * tiles` rows (tensor cores,
    /// split K; every `n` a multiple of 16).
    GemmSkinny {
        /// Input features.
        k: usize,
        /// Output features of each group (0: absent).
        n: [usize; 3],
        /// Tiles of 8 rows.
        tiles: usize,
        /// The weights' format.
        wf: WFormat,
        /// f32 biases (GGUF files store them so; GGUF weights only) rather than 16-bit ones.
        b32: bool,
    },
    /// Up to three linears sharing a 16-bit input, any row count (tensor-core GEMM).
    Gemm {
        /// Input features.
        k: usize,
        /// Output features of each group (0: absent).
        n: [usize; 3],
        /// The weights' format (E4M3 and GGUF's converted to 16 bits, times their scales, as the
        /// tiles are staged).
        wf: WFormat,
        /// f32 biases (GGUF files store them so; GGUF weights only) rather than 16-bit ones.
        b32: bool,
    },
    /// The fallback linear: 16-bit input, any weight dtype and `k`.
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
    /// act(a)·b to the 16-bit float, a and b the two halves of each row of one packed
    /// `[t, 2n]` f32 matrix (the gate/up launch's).
    GluMul {
        /// The activation as CUDA C over `x0` (interned).
        act: &'static str,
        /// Output features.
        n: usize,
    },
    /// f32 to the 16-bit float.
    ToH16,
    /// Small-batch linear on Hopper's `wgmma` (sm_90a: [`KernelKey::arch`]; up to [`A8_ROWS`]
    /// rows) over [`a8_grid`] blocks, every `n` a multiple of [`A8_FEATURES`]: W8A8 (`wf`
    /// E4M3: `GemmSkinny` of E4M3 weights over an input quantized by
    /// [`KernelKey::QuantE4M3`], 128-column groups), or 16-bit (`wf` H16: the 16-bit input
    /// and weights as they are). The runtime times it against the other GEMMs at load, and in
    /// the decode graph.
    GemmSkinnyA8 {
        /// Input features.
        k: usize,
        /// Output features of each group (0: absent).
        n: [usize; 3],
        /// The blocks of a tile's thread-block cluster ([`a8_cluster`]), or 0: stream-K over
        /// all the units ([`a8_blocks`]).
        cl: usize,
        /// The weights' format: [`WFormat::E4m3`] or [`WFormat::H16`].
        wf: WFormat,
    },
    /// 16-bit rows to E4M3 codes with one f32 scale per row and `group` columns: the
    /// activations of an E4M3-weight linear run on FP8 tensor cores through cuBLASLt (the
    /// runtime launches it before the matmul; `kernels/fast.cuh`'s `quant_e4m3`).
    QuantE4M3,
    /// Rotate-half RoPE over heads of `d` in rows of `cols` (a RoPE not feeding attention).
    Rope {
        /// Row width.
        cols: usize,
        /// Head size.
        d: usize,
        /// Features rotated at the start of each head.
        rot: usize,
    },
    /// RoPE on q and k, k and v written into the 16-bit paged cache.
    RopeKv {
        /// Query heads.
        heads: usize,
        /// KV heads.
        kv_heads: usize,
        /// Head size.
        d: usize,
        /// How the rows rotate, normalise and lie.
        rope: RopeShape,
    },
    /// Causal GQA attention over the 16-bit paged cache, a block per query row and group of
    /// `per_block` query heads of one kv head (each K and V row read once per block).
    Attention {
        /// Query heads.
        heads: usize,
        /// KV heads.
        kv_heads: usize,
        /// Head size.
        d: usize,
        /// Query heads per block (dividing heads / kv_heads): all of a kv head's for many rows,
        /// one for few (more blocks).
        per_block: usize,
        /// Output dtype.
        out: DType,
        /// Only the rows [`KernelKey::AttentionFa`] leaves (groups of 16 spanning sequences).
        mixed_only: bool,
        /// Sliding window and score soft-capping.
        mask: Mask,
    },
    /// A step of one token: RoPE, the KV-cache write and attention in one kernel.
    AttentionRope1 {
        /// Query heads.
        heads: usize,
        /// KV heads.
        kv_heads: usize,
        /// Head size.
        d: usize,
        /// Features rotated at the start of each head.
        rot: usize,
        /// Output dtype.
        out: DType,
        /// Whether q is rotated.
        rope_q: bool,
        /// Whether k is rotated.
        rope_k: bool,
        /// Per-head norms of q and k before the rotation.
        norm: HeadNorm,
        /// Sliding window and score soft-capping.
        mask: Mask,
    },
    /// Causal GQA attention on tensor cores for groups of 16 rows of one sequence.
    AttentionFa {
        /// Query heads.
        heads: usize,
        /// KV heads.
        kv_heads: usize,
        /// Head size (at most 128).
        d: usize,
        /// Output dtype.
        out: DType,
        /// Sliding window and score soft-capping.
        mask: Mask,
    },
    /// Decode attention on tensor cores: a block per row and kv head (and split of the row's
    /// keys), whose query heads (at most 16) are the rows of the mma tiles, for rows of any
    /// sequences.
    AttentionDec(DecAttention),
    /// The splits of the [`KernelKey::AttentionDec`] of the same shape merged into its output.
    AttentionDecMerge(DecAttention),
    /// `a + b` (f32).
    Add,
    /// `a * b` (f32).
    Mul,
    /// `silu(a)` (f32).
    Silu,
    /// An elementwise map (`ir::Op::Map`), rendered from `templates/map.cu`: f32 out, up to
    /// [`MAP_INPUTS`] inputs.
    Map {
        /// The expression as CUDA C over `x0, x1, ...` (interned: one copy per expression).
        expr: &'static str,
        /// The inputs' dtypes (f32 activations, or a weight's dtype).
        ins: [DType; MAP_INPUTS],
        /// How many inputs.
        arity: usize,
        /// Bit `j` set: input `j` is a `[cols]` vector applied to every row.
        bcast: u8,
        /// Row width (0 when nothing broadcasts).
        cols: usize,
    },
    /// A mixture of experts' routing (`kernels/moe.cuh`): each token's `k` experts of `e` and
    /// their weights.
    MoeRoute {
        /// Experts.
        e: usize,
        /// Experts per token.
        k: usize,
        /// Softmax over the chosen experts only.
        norm: bool,
        /// The router logits' dtype.
        logits: DType,
    },
    /// A mixture of experts' router linear: each token's logits over `e` experts computed in
    /// f32 from its f32 input of `h` (f32 out).
    MoeRouterLogits {
        /// Input features.
        h: usize,
        /// Experts.
        e: usize,
        /// The router weight's dtype.
        w: DType,
        /// The router bias's dtype, where it has one.
        bias: Option<DType>,
        /// The RMS norm it applies to its input itself (at one token: `RouterNorm`), writing
        /// the normalised rows for the experts.
        norm: Option<NormIn>,
    },
    /// The gate and up projections of each (token, chosen expert) with the activation.
    MoeUp {
        /// Hidden size.
        h: usize,
        /// Each expert's intermediate size.
        i: usize,
        /// Experts per token.
        k: usize,
        /// The experts' weight dtype.
        w: DType,
        /// The biases' dtype, where there are biases.
        bias: Option<DType>,
        /// `act(x0 = gate, x1 = up)` as CUDA C (interned).
        act: &'static str,
    },
    /// Each token's chosen experts' down projections, weighted and summed.
    MoeDown {
        /// Hidden size.
        h: usize,
        /// Each expert's intermediate size.
        i: usize,
        /// Experts per token.
        k: usize,
        /// The experts' weight dtype.
        w: DType,
        /// The bias's dtype, where there is one.
        bias: Option<DType>,
    },
    /// How many of a step's (token, chosen expert) pairs chose each expert.
    MoeCount,
    /// The pairs sorted by expert, and the tiles of the grouped expert kernels.
    MoeSort {
        /// Experts.
        e: usize,
    },
    /// Gate and up with the activation over tiles of pairs sorted by expert (16-bit input and
    /// output): on tensor cores, or (`rows`) a warp per feature looping over the tile's pairs.
    MoeUpGrouped {
        /// A warp per feature (few pairs a tile) instead of tensor cores.
        rows: bool,
        /// Hidden size.
        h: usize,
        /// Each expert's intermediate size.
        i: usize,
        /// Experts per token.
        k: usize,
        /// The biases' dtype, where there are biases.
        bias: Option<DType>,
        /// `act(x0 = gate, x1 = up)` as CUDA C (interned).
        act: &'static str,
    },
    /// The down projections over tiles of pairs sorted by expert, times the routing weights
    /// (f32 out, one row per pair); `rows` as for [`KernelKey::MoeUpGrouped`].
    MoeDownGrouped {
        /// A warp per feature (few pairs a tile) instead of tensor cores.
        rows: bool,
        /// Hidden size.
        h: usize,
        /// Each expert's intermediate size.
        i: usize,
        /// The bias's dtype, where there is one.
        bias: Option<DType>,
    },
    /// The routing from f32 router logits, then gate and up with the activation, for each
    /// (token, chosen expert) in token order (16-bit experts, input f32, output 16-bit): the
    /// direct path of a step of few tokens, no sort.
    MoeUpDirect {
        /// Hidden size.
        h: usize,
        /// Each expert's intermediate size.
        i: usize,
        /// Experts per token.
        k: usize,
        /// Experts.
        e: usize,
        /// Softmax over the chosen experts only.
        norm: bool,
        /// The biases' dtype, where there are biases.
        bias: Option<DType>,
        /// `act(x0 = gate, x1 = up)` as CUDA C (interned).
        act: &'static str,
    },
    /// Each token's chosen experts' down projections weighted and summed (f32 out), after
    /// [`KernelKey::MoeUpDirect`].
    MoeDownDirect {
        /// Hidden size.
        h: usize,
        /// Each expert's intermediate size.
        i: usize,
        /// Experts per token.
        k: usize,
        /// Experts (it chooses them again from the router logits, as `MoeUpDirect` does).
        e: usize,
        /// Softmax over the chosen experts only.
        norm: bool,
        /// The bias's dtype, where there is one.
        bias: Option<DType>,
    },
    /// Each token's weighted expert outputs summed.
    MoeCombine {
        /// Hidden size.
        h: usize,
        /// Experts per token.
        k: usize,
    },
    /// The rows whose logits are wanted.
    Gather {
        /// Row width.
        h: usize,
        /// Input dtype.
        x: DType,
        /// Output dtype.
        out: DType,
    },
    /// Sampling (greedy, temperature, top-k, top-p, min-p) over rows of `vocab` logits.
    Sample {
        /// Vocabulary size.
        vocab: usize,
    },
    /// Per-token changes to rows of `vocab` logits before a choice (penalties, `logit_bias`,
    /// bans: `runtime::sampler::Adjust`), one thread per change.
    AdjustLogits {
        /// Vocabulary size.
        vocab: usize,
    },
    /// Structured outputs: the logits of tokens a row's constraint does not allow set to -inf,
    /// from a mask of `ceil(vocab / 32)` words per masked row, each block over [`MASK_SPAN`]
    /// tokens of one row.
    MaskLogits {
        /// Vocabulary size.
        vocab: usize,
    },
    /// A pipelined step's token ids that name a row of the step before (`-1 - row`) replaced
    /// by the token chosen there, on the device (`kernels/sample.cuh`'s `feed_tokens`).
    FeedTokens,
    /// Greedy sampling of every row: the argmax of each row of `vocab` logits, split over
    /// `blocks` blocks per row ([`argmax_blocks`]).
    Argmax {
        /// Vocabulary size.
        vocab: usize,
        /// Blocks a row.
        blocks: usize,
    },
    /// One-shot all-reduce of a small f32 message over peer memory between `ranks` GPUs
    /// (`kernels/comm.cuh`); the runtime launches it in place of NCCL where peers can reach
    /// each other.
    AllReduce {
        /// Ranks (2 to 8).
        ranks: usize,
    },
    /// One-shot all-gather of f32 logit rows over peer memory (`kernels/comm.cuh`): rank 0
    /// joins every rank's column block; the runtime launches it in place of NCCL where peers
    /// can reach each other.
    AllGather {
        /// Ranks (2 to 8).
        ranks: usize,
    },
}

/// An RMS norm (optionally after a residual add) that a decode GEMV applies to its f32 input
/// rows itself (`XNorm` in `kernels/fast.cuh`) instead of reading the norm's 16-bit output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NormIn {
    /// Norm weight dtype.
    pub w: DType,
    /// With the residual add (the GEMV writes the sum too).
    pub add: bool,
}

impl NormIn {
    fn suffix(&self) -> String {
        format!("_{}norm_{}", if self.add { "add" } else { "" }, self.w)
    }
}

/// A GEMV's input parameters and the value (`X16` or `XNorm` in `kernels/fast.cuh`) it reads
/// them through.
fn gemv_input(norm: Option<NormIn>) -> Result<(String, String), CodegenError> {
    let Some(n) = norm else { return Ok(("const h16_t* x".into(), "X16{x}".into())) };
    let t = ctype(n.w)?;
    Ok((
        format!("const float* a, const float* b, float* s, const {t}* nw, float eps"),
        format!("XNorm<{t}, {}>{{a, b, s, nw, eps}}", n.add),
    ))
}

/// The most blocks per row of the split argmax (`argmax_rows` in `kernels/sample.cuh`): the
/// runtime gives it this many partial results per row.
pub const ARGMAX_BLOCKS: usize = 128;

/// The fewest blocks per row of the split argmax.
const ARGMAX_MIN_BLOCKS: usize = 8;

/// Split argmax blocks a step of all rows make together: about what an H100 / H200 runs at
/// once (eight blocks of 256 threads an SM of 132), so many rows do not queue thousands of
/// short blocks.
const ARGMAX_STEP_BLOCKS: usize = 1024;

/// Blocks per row of the split argmax at `rows` greedy rows: a power of two from
/// `ARGMAX_MIN_BLOCKS` (8) to [`ARGMAX_BLOCKS`], the most whose blocks stay within
/// `ARGMAX_STEP_BLOCKS` (1,024) (one row: all of them, for a row alone would wait on one block).
pub fn argmax_blocks(rows: usize) -> usize {
    let mut b = ARGMAX_BLOCKS;
    while b > ARGMAX_MIN_BLOCKS && rows * b > ARGMAX_STEP_BLOCKS {
        b /= 2;
    }
    b
}

/// Every block count [`argmax_blocks`] gives, fewest first.
pub fn argmax_block_counts() -> impl Iterator<Item = usize> {
    std::iter::successors(Some(ARGMAX_MIN_BLOCKS), |b| Some(b * 2)).take_while(|&b| b <= ARGMAX_BLOCKS)
}

/// Tokens of a row one block of `mask_logits` (`kernels/sample.cuh`) covers.
pub const MASK_SPAN: usize = 4096;

/// The most blocks a one-shot all-reduce launches (`AR_MAXB` in `kernels/comm.cuh`).
pub const ALL_REDUCE_MAX_BLOCKS: usize = 32;

/// Three sizes in a kernel name, the zeros left out: `a_b_c`.
fn n3(n: [usize; 3]) -> String {
    n.iter().filter(|&&x| x > 0).map(|x| x.to_string()).collect::<Vec<_>>().join("_")
}

/// Kernel-name suffix of a RoPE over the leading `rot` of `d` features (none for whole heads).
fn rot_suffix(d: usize, rot: usize) -> String {
    if rot == d {
        String::new()
    } else {
        format!("_r{rot}")
    }
}

/// The most inputs of a [`KernelKey::Map`].
pub const MAP_INPUTS: usize = 4;

/// The template of a map kernel's body.
const MAP_TEMPLATE: &str = include_str!("../../../../templates/map.cu");

impl KernelKey {
    /// The body of a [`KernelKey::Map`] kernel: `templates/map.cu` with its loads and
    /// expression (empty for other keys).
    fn map_body(&self) -> String {
        let KernelKey::Map { expr, arity, bcast, cols, .. } = *self else { return String::new() };
        let loads: String = (0..arity)
            .map(|j| {
                let at = if bcast & (1 << j) != 0 { format!("i % {cols}") } else { "i".into() };
                format!("  const float x{j} = to_f32(a{j}[{at}]);\n")
            })
            .collect();
        let body: String = MAP_TEMPLATE.lines().filter(|l| !l.starts_with("//")).collect::<Vec<_>>().join("\n");
        body.replace("{loads}", &loads).replace("{expr}", expr)
    }
}

/// One shared copy of a map's CUDA expression (keys are `Copy`).
pub(crate) fn intern(s: String) -> &'static str {
    static SEEN: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&e) = seen.iter().find(|&&e| e == s) {
        return e;
    }
    let e: &'static str = Box::leak(s.into_boxed_str());
    seen.push(e);
    e
}

/// A GLU activation in a kernel's name: `silu`, or a hash of its expression.
fn act_tag(act: &str) -> String {
    let silu = ir::fusion::glu_activation(&ir::Op::Silu).map(|s| s.to_cuda());
    if silu.as_deref() == Some(act) {
        "silu".into()
    } else {
        format!("a{:08x}", fnv(act) as u32)
    }
}

/// A GLU activation as the device lambda the templates take.
fn act_lambda(act: &str) -> String {
    format!("[](float x0) {{ return {act}; }}")
}

/// FNV-1a, for names of generated kernels.
fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// The C type of an optional pointer's pointee: `float` where there is none (it is null).
fn opt_ctype(d: Option<DType>) -> Result<&'static str, CodegenError> {
    d.map_or(Ok("float"), ctype)
}

/// The C type of a dtype the kernels take. Both 16-bit floats are `h16_t`: a program has one
/// of them (`Program::half`, the source's `H16_F16`), and the schedule rejects a plan that mixes
/// them.
pub(crate) fn ctype(d: DType) -> Result<&'static str, CodegenError> {
    match d {
        DType::F32 => Ok("float"),
        DType::BF16 | DType::F16 => Ok("h16_t"),
        other => Err(CodegenError::Unsupported(format!("{other} weights (compile with --dtype bf16, f16 or f32)"))),
    }
}

/// The weights (of type `wt`), biases and outputs of up to three linears sharing an input.
/// The weights, biases and outputs of a linear launch's three groups (weights of C type `wt`,
/// biases f32 where `b32`, else 16-bit).
fn out_params(wt: &str, b32: bool) -> String {
    let bt = if b32 { "float" } else { "h16_t" };
    format!(
        "const {wt}* w0, const {bt}* b0, float* o0, const {wt}* w1, const {bt}* b1, float* o1, const {wt}* w2, \
         const {bt}* b2, float* o2, int T"
    )
}

/// The name suffix of a linear launch with f32 biases.
fn b32_suffix(b32: bool) -> &'static str {
    if b32 {
        "_b32"
    } else {
        ""
    }
}
const OUT_ARGS: &str = "w0, b0, o0, w1, b1, o1, w2, b2, o2, T";

/// Whether `arch` (`sm_90`, or `compute_90` for PTX) is Hopper's, whose own target (`sm_90a`)
/// runs the `wgmma` of [`KernelKey::GemmSkinnyA8`].
pub fn hopper(arch: &str) -> bool {
    arch == "sm_90" || arch == "compute_90"
}

/// The grouped MoE kernels' variant: a warp per feature (`rows`) or tensor-core tiles.
fn grouped_kind(rows: bool) -> &'static str {
    if rows {
        "rows"
    } else {
        "grouped"
    }
}

/// Warps that share one output of the GEMV: enough that each streams at most 2048 weights of
/// a row (a few memory round trips), at most 8.
pub fn gemv_split(k: usize) -> usize {
    let mut s = 1;
    while k / s > 2048 && s < 8 {
        s *= 2;
    }
    s
}

impl KernelKey {
    /// The kernel's symbol in the generated source.
    pub fn name(&self) -> String {
        match *self {
            KernelKey::Embedding { h, w } => format!("embedding_h{h}_{w}"),
            KernelKey::EmbeddingBlocks { h, rows, wf } => format!("embedding_h{h}_v{rows}{}", wf.suffix()),
            KernelKey::AddRmsNorm { h, w, add, out } => {
                format!("{}rms_norm_h{h}_{w}_to_{out}", if add { "add_" } else { "" })
            }
            KernelKey::NormAddRmsNorm { h, w, pw, out } => format!("norm_add_rms_norm_h{h}_{pw}_{w}_to_{out}"),
            KernelKey::Gemv { k, n, rows, norm, wf, b32 } => {
                let norm = norm.map_or(String::new(), |m| m.suffix());
                format!("gemv_k{k}_n{}_r{rows}{norm}{}{}", n3(n), wf.suffix(), b32_suffix(b32))
            }
            KernelKey::GemvGlu { k, n, rows, norm, act, wf } => format!(
                "gemv_glu_k{k}_n{n}_r{rows}{}_{}{}",
                norm.map_or(String::new(), |m| m.suffix()),
                act_tag(act),
                wf.suffix()
            ),
            KernelKey::Gemm { k, n, wf, b32 } => format!("gemm_k{k}_n{}{}{}", n3(n), wf.suffix(), b32_suffix(b32)),
            KernelKey::GemmSkinny { k, n, tiles, wf, b32 } => {
                format!("gemm_skinny_k{k}_n{}_t{tiles}{}{}", n3(n), wf.suffix(), b32_suffix(b32))
            }
            KernelKey::Linear { k, n, w, bias } => format!("linear_k{k}_n{n}_{w}{}", if bias { "_bias" } else { "" }),
            KernelKey::GluMul { act, n } => format!("glu_mul_n{n}_to_h16_{}", act_tag(act)),
            KernelKey::ToH16 => "f32_to_h16_rows".into(),
            KernelKey::QuantE4M3 => "quant_e4m3_rows".into(),
            KernelKey::GemmSkinnyA8 { k, n, cl, wf } => {
                let kind = if wf == WFormat::E4m3 { "a8" } else { "w16" };
                let cl = if cl == 0 { String::new() } else { format!("_cl{cl}") };
                format!("gemm_skinny_{kind}_k{k}_n{}{cl}", n3(n))
            }
            KernelKey::Rope { cols, d, rot } => format!("rope_c{cols}_d{d}{}", rot_suffix(d, rot)),
            KernelKey::RopeKv { heads, kv_heads, d, rope } => {
                format!("rope_kv_h{heads}_kv{kv_heads}_d{d}{}", rope.suffix(heads, kv_heads, d))
            }
            KernelKey::Attention { heads, kv_heads, d, per_block, out, mixed_only, mask } => format!(
                "attention_h{heads}_kv{kv_heads}_d{d}_g{per_block}_to_{out}{}{}",
                if mixed_only { "_mixed" } else { "" },
                mask.suffix()
            ),
            KernelKey::AttentionFa { heads, kv_heads, d, out, mask } => {
                format!("attention_fa_h{heads}_kv{kv_heads}_d{d}_to_{out}{}", mask.suffix())
            }
            KernelKey::AttentionDec(a) => format!("attention_dec_{}", a.suffix()),
            KernelKey::AttentionDecMerge(a) => format!("attention_dec_merge_{}", a.suffix()),
            KernelKey::AttentionRope1 { heads, kv_heads, d, rot, out, rope_q, rope_k, norm, mask } => format!(
                "attention_rope1_h{heads}_kv{kv_heads}_d{d}{}_to_{out}_{}{}{}{}",
                rot_suffix(d, rot),
                u8::from(rope_q),
                u8::from(rope_k),
                norm.suffix(),
                mask.suffix()
            ),
            KernelKey::Add => "add_f32".into(),
            KernelKey::Mul => "mul_f32".into(),
            KernelKey::Silu => "silu_f32".into(),
            KernelKey::Map { ins, arity, .. } => {
                format!("map_{:016x}", fnv(&format!("{:?}{}", &ins[..arity], self.map_body())))
            }
            KernelKey::MoeRoute { e, k, norm, logits } => format!("moe_route_e{e}_k{k}_{}_{logits}", u8::from(norm)),
            KernelKey::MoeRouterLogits { h, e, w, bias, norm } => format!(
                "moe_router_logits_h{h}_e{e}_{w}{}{}",
                bias.map_or(String::new(), |b| format!("_b{b}")),
                norm.map_or(String::new(), |n| n.suffix())
            ),
            KernelKey::MoeUp { h, i, k, w, bias, act } => format!(
                "moe_up_h{h}_i{i}_k{k}_{w}{}_a{:08x}",
                bias.map_or(String::new(), |b| format!("_b{b}")),
                fnv(act) as u32
            ),
            KernelKey::MoeDown { h, i, k, w, bias } => {
                format!("moe_down_h{h}_i{i}_k{k}_{w}{}", bias.map_or(String::new(), |b| format!("_b{b}")))
            }
            KernelKey::MoeCount => "moe_count_pairs".into(),
            KernelKey::MoeSort { e } => format!("moe_sort_e{e}"),
            KernelKey::MoeUpGrouped { rows, h, i, k, bias, act } => format!(
                "moe_up_{}_h{h}_i{i}_k{k}{}_a{:08x}",
                grouped_kind(rows),
                bias.map_or(String::new(), |b| format!("_b{b}")),
                fnv(act) as u32
            ),
            KernelKey::MoeDownGrouped { rows, h, i, bias } => {
                format!("moe_down_{}_h{h}_i{i}{}", grouped_kind(rows), bias.map_or(String::new(), |b| format!("_b{b}")))
            }
            KernelKey::MoeUpDirect { h, i, k, e, norm, bias, act } => format!(
                "moe_up_direct_h{h}_i{i}_k{k}_e{e}_{}{}_a{:08x}",
                u8::from(norm),
                bias.map_or(String::new(), |b| format!("_b{b}")),
                fnv(act) as u32
            ),
            KernelKey::MoeDownDirect { h, i, k, e, norm, bias } => format!(
                "moe_down_direct_h{h}_i{i}_k{k}_e{e}_{}{}",
                u8::from(norm),
                bias.map_or(String::new(), |b| format!("_b{b}"))
            ),
            KernelKey::MoeCombine { h, k } => format!("moe_combine_h{h}_k{k}"),
            KernelKey::Gather { h, x, out } => format!("gather_h{h}_{x}_to_{out}"),
            KernelKey::Sample { vocab } => format!("sample_v{vocab}"),
            KernelKey::AdjustLogits { vocab } => format!("adjust_logits_v{vocab}"),
            KernelKey::MaskLogits { vocab } => format!("mask_logits_v{vocab}"),
            KernelKey::FeedTokens => "feed_tokens".into(),
            KernelKey::Argmax { vocab, blocks } => format!("argmax_v{vocab}_{blocks}blocks"),
            KernelKey::AllReduce { ranks } => format!("all_reduce_r{ranks}"),
            KernelKey::AllGather { ranks } => format!("all_gather_r{ranks}"),
        }
    }

    /// The arguments a launch of this kernel need not read where every row is a sequence of its
    /// own (a decode step), by index: decode attention that rotates those rows itself reads
    /// `rope_kv`'s rotated queries ([`DecAttention::ROTATED_Q_ARG`]) only for the others. What
    /// the profile leaves out of the bytes a launch must move.
    pub fn unread_in_decode(&self) -> &'static [usize] {
        match self {
            KernelKey::AttentionDec(DecAttention { rope: Some(_), .. }) => &[DecAttention::ROTATED_Q_ARG],
            _ => &[],
        }
    }

    /// Whether the kernel waits for the previous one itself (`pdl_enter`, or `pdl_trigger` then
    /// `pdl_wait` after the weight loads of a GEMV or a norm, or decode attention's first copies
    /// of cached keys: `kernels/prelude.cuh`), so the runtime may launch
    /// it as a programmatic dependent launch: every kernel of the forward step; not the one-shot
    /// collectives (their blocks wait on other GPUs) nor sampling.
    pub fn pdl(&self) -> bool {
        !matches!(
            self,
            KernelKey::AllReduce { .. }
                | KernelKey::AllGather { .. }
                | KernelKey::Sample { .. }
                | KernelKey::AdjustLogits { .. }
                | KernelKey::MaskLogits { .. }
                | KernelKey::FeedTokens
                | KernelKey::Argmax { .. }
        )
    }

    /// The dynamic shared memory of one of its blocks, in bytes (0: static only).
    pub fn dyn_smem(&self) -> usize {
        match *self {
            KernelKey::GemmSkinnyA8 { .. } => A8_SMEM,
            KernelKey::AttentionDec(a) => crate::schedule::dec_smem(a.warps, a.d),
            KernelKey::AttentionFa { d, .. } => crate::schedule::fa_smem(d),
            _ => 0,
        }
    }

    /// A tensor-core linear of E4M3 weights (`Gemm` or `GemmSkinny` of [`WFormat::E4m3`]): what cuBLASLt
    /// may run as W8A8 after [`KernelKey::QuantE4M3`].
    pub fn w8_tensor_core(&self) -> bool {
        matches!(self, KernelKey::Gemm { wf: WFormat::E4m3, .. } | KernelKey::GemmSkinny { wf: WFormat::E4m3, .. })
    }

    /// The tiled GEMM that may stand in for this launch (a `GemmSkinny`: the kernel the schedule
    /// runs past the last small-batch row count, `crate::tiled`).
    pub fn tiled(&self) -> Option<KernelKey> {
        match *self {
            KernelKey::GemmSkinny { k, n, wf, b32, .. } => Some(KernelKey::Gemm { k, n, wf, b32 }),
            _ => None,
        }
    }

    /// The `wgmma` small-batch kernel that may stand in for this launch (a `GemmSkinny` of E4M3
    /// or 16-bit weights, rows of whole 128-byte groups, every output count a multiple of
    /// [`A8_FEATURES`]), stream-K.
    pub fn a8(&self) -> Option<KernelKey> {
        match *self {
            KernelKey::GemmSkinny { k, n, tiles, wf: wf @ (WFormat::E4m3 | WFormat::H16), b32: false }
                if tiles * 8 <= A8_ROWS
                    && a8_row_bytes(k, wf).is_multiple_of(A8_GROUP_BYTES)
                    && n.iter().all(|c| c % A8_FEATURES == 0) =>
            {
                Some(KernelKey::GemmSkinnyA8 { k, n, cl: 0, wf })
            }
            _ => None,
        }
    }

    /// The same `wgmma` kernel with a thread-block cluster a tile, where the shape has one
    /// ([`a8_cluster`]).
    pub fn a8_clustered(&self) -> Option<KernelKey> {
        match self.a8()? {
            KernelKey::GemmSkinnyA8 { k, n, wf, .. } => match a8_cluster(a8_row_bytes(k, wf), n.iter().sum()) {
                0 => None,
                cl => Some(KernelKey::GemmSkinnyA8 { k, n, cl, wf }),
            },
            _ => None,
        }
    }

    /// The grid of a [`KernelKey::GemmSkinnyA8`] launch ([`a8_grid`]) and the slots of split
    /// sums its tiles take ([`a8_slots`]); `None` for any other kernel.
    pub fn a8_split(&self) -> Option<(usize, usize)> {
        match *self {
            KernelKey::GemmSkinnyA8 { k, n, cl, wf } => {
                let (kb, n) = (a8_row_bytes(k, wf), n.iter().sum());
                Some((a8_grid(kb, n, cl), a8_slots(kb, n)))
            }
            _ => None,
        }
    }

    /// The target NVRTC compiles this kernel for on a device of `arch` (`sm_90`, or
    /// `compute_90` for PTX): Hopper's own (`sm_90a`) for the `wgmma` of
    /// [`KernelKey::GemmSkinnyA8`], the device's for every other kernel.
    pub fn arch(&self, arch: &str) -> String {
        match self {
            KernelKey::GemmSkinnyA8 { .. } if hopper(arch) => format!("{arch}a"),
            _ => arch.to_string(),
        }
    }

    /// The `extern "C"` wrapper that instantiates the template.
    pub(crate) fn instance(&self) -> Result<String, CodegenError> {
        let name = self.name();
        let (params, call) = match *self {
            KernelKey::EmbeddingBlocks { h, rows, wf } => (
                format!("const int* ids, const {}* table, float* out", wf.ctype()),
                format!("embedding_blocks<{h}, {rows}, {}>(ids, table, out)", wf.ctype()),
            ),
            KernelKey::Embedding { h, w } => {
                let t = ctype(w)?;
                (
                    format!("const int* ids, const {t}* table, float* out"),
                    format!("embedding<{h}, {t}>(ids, table, out)"),
                )
            }
            KernelKey::NormAddRmsNorm { h, w, pw, out } => {
                let (t, p, o) = (ctype(w)?, ctype(pw)?, ctype(out)?);
                (
                    format!(
                        "const float* a, const float* b, float* s, const {t}* w, {o}* out, float eps, const {p}* pw, \
                         float peps"
                    ),
                    format!("norm_add_rms_norm<{h}, {t}, {p}, {o}>(a, b, s, w, out, eps, pw, peps)"),
                )
            }
            KernelKey::AddRmsNorm { h, w, add, out } => {
                let (t, o) = (ctype(w)?, ctype(out)?);
                (
                    format!("const float* a, const float* b, float* s, const {t}* w, {o}* out, float eps"),
                    format!("add_rms_norm<{h}, {t}, {add}, {o}>(a, b, s, w, out, eps)"),
                )
            }
            KernelKey::Gemv { k, n, rows, norm, wf, b32 } => {
                let (input, x) = gemv_input(norm)?;
                let wt = wf.ctype();
                (
                    format!("{input}, {}", out_params(wt, b32)),
                    format!(
                        "gemv<{k}, {}, {}, {}, {rows}, {}, {wt}>({x}, {OUT_ARGS})",
                        n[0],
                        n[1],
                        n[2],
                        gemv_split(k)
                    ),
                )
            }
            KernelKey::GemvGlu { k, n, rows, norm, act, wf } => {
                let (input, x) = gemv_input(norm)?;
                let wt = wf.ctype();
                (
                    format!("{input}, const {wt}* wg, const {wt}* wu, h16_t* out, int T"),
                    format!(
                        "gemv_glu<{k}, {n}, {rows}, {}, {wt}>({x}, wg, wu, out, T, {})",
                        gemv_split(k),
                        act_lambda(act)
                    ),
                )
            }
            KernelKey::Gemm { k, n, wf, b32 } => (
                format!("const h16_t* x, {}", out_params(wf.ctype(), b32)),
                format!("gemm<{k}, {}, {}, {}, {}>(x, {OUT_ARGS})", n[0], n[1], n[2], wf.ctype()),
            ),
            KernelKey::GemmSkinny { k, n, tiles, wf, b32 } => (
                format!("const h16_t* x, {}", out_params(wf.ctype(), b32)),
                format!("gemm_skinny<{k}, {}, {}, {}, {tiles}, {}>(x, {OUT_ARGS})", n[0], n[1], n[2], wf.ctype()),
            ),
            KernelKey::Linear { k, n, w, bias } => {
                let t = ctype(w)?;
                (
                    format!("const h16_t* x, const {t}* w, const {t}* bias, float* out, int T"),
                    format!("linear<{k}, {n}, h16_t, {t}, {bias}>(x, w, bias, out, T)"),
                )
            }
            KernelKey::GluMul { act, n } => (
                "const float* a, const float* b, h16_t* out, long n".into(),
                format!("glu_mul<{n}>(a, b, out, n, {})", act_lambda(act)),
            ),
            KernelKey::ToH16 => ("const float* a, h16_t* out, long n".into(), "to_h16(a, out, n)".into()),
            KernelKey::GemmSkinnyA8 { k, n, cl, wf } => (
                format!(
                    "const __grid_constant__ TmaMap mx, const float* xs, {}, float* part, unsigned* count, int T, \
                     const __grid_constant__ TmaMap mw0, const __grid_constant__ TmaMap mw1, \
                     const __grid_constant__ TmaMap mw2",
                    out_params(wf.ctype(), false).trim_end_matches(", int T")
                ),
                format!(
                    "gemm_skinny_a8<{}, {k}, {}, {}, {}, {}, {}, {A8_STAGES}, {}>(&mx, xs, {}, part, count, T, &mw0, \
                     &mw1, &mw2)",
                    wf.ctype(),
                    n[0],
                    n[1],
                    n[2],
                    a8_blocks(a8_row_bytes(k, wf), n.iter().sum()),
                    a8_slots(a8_row_bytes(k, wf), n.iter().sum()),
                    cl,
                    OUT_ARGS.trim_end_matches(", T")
                ),
            ),
            KernelKey::QuantE4M3 => (
                "const h16_t* x, unsigned char* q, float* s, int K, int group".into(),
                "quant_e4m3(x, q, s, K, group)".into(),
            ),
            KernelKey::Rope { cols, d, rot } => (
                "const float* x, const int* pos, const float* inv_freq, float scale, float* out".into(),
                format!("rope<{cols}, {d}, {rot}>(x, pos, inv_freq, scale, out)"),
            ),
            KernelKey::RopeKv { heads, kv_heads, d, rope } => (
                format!("{}, float* qo, h16_t* kc, h16_t* vc", rope.norm.rope_head_params()?),
                format!("rope_kv<{heads}, {kv_heads}, {d}, {}>({ROPE_HEAD_ARGS}, qo, kc, vc)", rope.args()?),
            ),
            KernelKey::Attention { heads, kv_heads, d, per_block, out, mixed_only, mask } => {
                let o = ctype(out)?;
                (
                    format!("{}, {}", attention_params(o), mask.sinks_param()?),
                    format!(
                        "attention_gqa<{heads}, {kv_heads}, {d}, {per_block}, {o}, {mixed_only}, {}>(q, kc, vc, slots, seq_off, \
                         pos, scale, out, T, sinks)",
                        mask.args()?
                    ),
                )
            }
            KernelKey::AttentionRope1 { heads, kv_heads, d, rot, out, rope_q, rope_k, norm, mask } => {
                let o = ctype(out)?;
                (
                    format!(
                        "{}, h16_t* kc, h16_t* vc, const int* slots, const int* seq_off, float scale, {o}* out, {}",
                        norm.rope_head_params()?,
                        mask.sinks_param()?
                    ),
                    format!(
                        "attention_rope1<{heads}, {kv_heads}, {d}, {rot}, {o}, {rope_q}, {rope_k}, {}, {}>(\
                         {ROPE_HEAD_ARGS}, kc, vc, slots, seq_off, scale, out, sinks)",
                        norm.args()?,
                        mask.args()?
                    ),
                )
            }
            KernelKey::AttentionFa { heads, kv_heads, d, out, mask } => {
                let o = ctype(out)?;
                (
                    format!("{}, {}", attention_params(o), mask.sinks_param()?),
                    format!(
                        "attention_fa<{heads}, {kv_heads}, {d}, {o}, {}>(q, kc, vc, slots, seq_off, pos, scale, out, T, \
                         sinks)",
                        mask.args()?
                    ),
                )
            }
            KernelKey::AttentionDec(a) => a.params_and_call()?,
            KernelKey::AttentionDecMerge(DecAttention {
                heads, kv_heads, d, out, mixed_only, mask, splits, ..
            }) => {
                let o = ctype(out)?;
                (
                    format!("const int* seq_off, const int* pos, {o}* out, int T, {}, const float* part", mask.sinks_param()?),
                    format!(
                        "attention_dec_merge<{heads}, {kv_heads}, {d}, {o}, {mixed_only}, {}, {}, {splits}>(seq_off, pos, \
                         out, T, sinks, part)",
                        mask.window,
                        opt_ctype(mask.sink)?
                    ),
                )
            }
            KernelKey::Add => ("const float* a, const float* b, float* out, long n".into(), "add(a, b, out, n)".into()),
            KernelKey::Mul => ("const float* a, const float* b, float* out, long n".into(), "mul(a, b, out, n)".into()),
            KernelKey::Silu => ("const float* a, float* out, long n".into(), "silu(a, out, n)".into()),
            KernelKey::Map { ins, arity, .. } => {
                let params = ins[..arity]
                    .iter()
                    .enumerate()
                    .map(|(j, &d)| Ok(format!("const {}* a{j}", ctype(d)?)))
                    .collect::<Result<Vec<_>, CodegenError>>()?;
                (format!("{}, float* out, long n", params.join(", ")), self.map_body())
            }
            KernelKey::MoeRoute { e, k, norm, logits } => {
                let l = ctype(logits)?;
                (
                    format!("const {l}* logits, int* ids, float* weights"),
                    format!("moe_route<{e}, {k}, {norm}, {l}>(logits, ids, weights)"),
                )
            }
            KernelKey::MoeRouterLogits { h, e, w, bias, norm } => {
                let (t, b) = (ctype(w)?, opt_ctype(bias)?);
                let call = |rows: &str| format!("moe_router_logits<{h}, {e}, {t}, {b}>(x, w, bias, logits, {rows})");
                let rest = format!("const {t}* w, const {b}* bias, float* logits");
                match norm {
                    None => (format!("const float* x, {rest}"), call("RouterX{}")),
                    Some(n) => {
                        let tn = ctype(n.w)?;
                        (
                            format!(
                                "const float* a, const float* b, float* s, const {tn}* nw, float eps, float* x, {rest}"
                            ),
                            call(&format!("RouterNorm<{tn}, {}>{{a, b, s, nw, eps, x}}", n.add)),
                        )
                    }
                }
            }
            KernelKey::MoeUp { h, i, k, w, bias, act } => {
                let (t, b) = (ctype(w)?, opt_ctype(bias)?);
                (
                    format!(
                        "const float* x, const int* ids, const {t}* gate, const {t}* up, const {b}* gb, const {b}* ub, \
                         float* a"
                    ),
                    format!(
                        "moe_up<{h}, {i}, {k}, {t}, {b}>(x, ids, gate, up, gb, ub, a, [](float x0, float x1) {{ return \
                         {act}; }})"
                    ),
                )
            }
            KernelKey::MoeDown { h, i, k, w, bias } => {
                let (t, b) = (ctype(w)?, opt_ctype(bias)?);
                (
                    format!("const float* a, const int* ids, const float* weights, const {t}* down, const {b}* db, float* out"),
                    format!("moe_down<{h}, {i}, {k}, {t}, {b}>(a, ids, weights, down, db, out)"),
                )
            }
            KernelKey::MoeCount => ("const int* ids, long P, int* cnt".into(), "moe_count(ids, P, cnt)".into()),
            KernelKey::MoeSort { e } => (
                "const int* ids, long P, const int* cnt, int* perm, int* pos_of, int* tiles".into(),
                format!("moe_sort<{e}>(ids, P, cnt, perm, pos_of, tiles)"),
            ),
            KernelKey::MoeUpGrouped { rows, h, i, k, bias, act } => {
                let (b, f) = (opt_ctype(bias)?, grouped_kind(rows));
                (
                    format!(
                        "const h16_t* x, const int* perm, const int* tiles, const h16_t* gate, const h16_t* up, \
                         const {b}* gb, const {b}* ub, h16_t* a"
                    ),
                    format!(
                        "moe_up_{f}<{h}, {i}, {k}, {b}>(x, perm, tiles, gate, up, gb, ub, a, [](float x0, float x1) \
                         {{ return {act}; }})"
                    ),
                )
            }
            KernelKey::MoeDownGrouped { rows, h, i, bias } => {
                let (b, f) = (opt_ctype(bias)?, grouped_kind(rows));
                (
                    format!(
                        "const h16_t* a, const int* perm, const int* tiles, const float* weights, const h16_t* down, \
                         const {b}* db, float* y"
                    ),
                    format!("moe_down_{f}<{h}, {i}, {b}>(a, perm, tiles, weights, down, db, y)"),
                )
            }
            KernelKey::MoeUpDirect { h, i, k, e, norm, bias, act } => {
                let b = opt_ctype(bias)?;
                (
                    format!(
                        "const float* x, const float* logits, const h16_t* gate, const h16_t* up, const {b}* gb, \
                         const {b}* ub, h16_t* a"
                    ),
                    format!(
                        "moe_up_direct<{h}, {i}, {k}, {e}, {norm}, {b}>(x, logits, gate, up, gb, ub, a, \
                         [](float x0, float x1) {{ return {act}; }})"
                    ),
                )
            }
            KernelKey::MoeDownDirect { h, i, k, e, norm, bias } => {
                let b = opt_ctype(bias)?;
                (
                    format!("const float* logits, const h16_t* a, const h16_t* down, const {b}* db, float* out"),
                    format!("moe_down_direct<{h}, {i}, {k}, {e}, {norm}, {b}>(logits, a, down, db, out)"),
                )
            }
            KernelKey::MoeCombine { h, k } => (
                "const float* y, const int* pos_of, float* out".into(),
                format!("moe_combine<{h}, {k}>(y, pos_of, out)"),
            ),
            KernelKey::Gather { h, x, out } => {
                let (t, o) = (ctype(x)?, ctype(out)?);
                (format!("const {t}* x, const int* rows, {o}* out"), format!("gather<{h}, {t}, {o}>(x, rows, out)"))
            }
            KernelKey::Argmax { vocab, blocks } => (
                "const float* logits, float* part_v, int* part_i, unsigned* done, int* out".into(),
                format!("argmax_rows<{vocab}, {blocks}>(logits, part_v, part_i, done, out)"),
            ),
            KernelKey::Sample { vocab } => (
                "const float* logits, const float* params, int* out".into(),
                format!("sample<{vocab}>(logits, params, out)"),
            ),
            KernelKey::AdjustLogits { vocab } => (
                "float* logits, const float* adjust, int n".into(),
                format!("adjust_logits<{vocab}>(logits, adjust, n)"),
            ),
            KernelKey::FeedTokens => {
                ("int* ids, const int* tokens, int n".into(), "feed_from_step_before(ids, tokens, n)".into())
            }
            KernelKey::MaskLogits { vocab } => (
                "float* logits, const unsigned* masks, int m, int words".into(),
                format!("mask_logits<{vocab}, {MASK_SPAN}>(logits, masks, m, words)"),
            ),
            KernelKey::AllReduce { ranks } => (
                "float* x, long n, const unsigned long long* table, int rank, long cap, unsigned* counters".into(),
                format!("all_reduce_oneshot<{ranks}>(x, n, table, rank, cap, counters)"),
            ),
            KernelKey::AllGather { ranks } => (
                "const float* x, float* out, long rows, long cols, const unsigned long long* table, int rank, \
                 long cap, unsigned* counters"
                    .into(),
                format!("all_gather_oneshot<{ranks}>(x, out, rows, cols, table, rank, cap, counters)"),
            ),
        };
        // The GEMVs, the norms and the small-batch wgmma GEMM wait for the previous kernel themselves, after
        // loading weights; decode attention (and one-token attention) after its first copies
        // or loads of cached keys; the router after loading its rows.
        let enter = match self {
            _ if !self.pdl() => "",
            KernelKey::Gemv { .. }
            | KernelKey::GemvGlu { .. }
            | KernelKey::GemmSkinnyA8 { .. }
            | KernelKey::MoeRouterLogits { .. }
            | KernelKey::AddRmsNorm { .. }
            | KernelKey::NormAddRmsNorm { .. }
            | KernelKey::AttentionDec(_)
            | KernelKey::AttentionRope1 { .. }
            | KernelKey::MoeDownDirect { .. } => "pdl_trigger(); ",
            // Its dependent (moe_down_direct) reads the router logits before its own wait:
            // they are complete once every block of this launch has waited.
            KernelKey::MoeUpDirect { .. } => "pdl_wait(); pdl_trigger(); ",
            _ => "pdl_enter(); ",
        };
        // The direct down projection's loads of a token's experts fit 128 registers: two blocks
        // an SM, so a batch-1 launch (H / 8 blocks) runs in one wave.
        let bounds = match *self {
            KernelKey::GemmSkinnyA8 { cl, .. } => match cl {
                0 => "__launch_bounds__(128, 1) ".into(),
                cl => format!("__launch_bounds__(128, 1) __cluster_dims__({cl}, 1, 1) "),
            },
            KernelKey::MoeDownDirect { .. } => "__launch_bounds__(256, 2) ".into(),
            _ => String::new(),
        };
        Ok(format!("extern \"C\" __global__ void {bounds}{name}({params}) {{ {enter}{call}; }}\n"))
    }
}

#[cfg(test)]
mod tests {
    use super::{
        argmax_block_counts, argmax_blocks, DecAttention, HeadNorm, KernelKey, Mask, RopeShape, ARGMAX_BLOCKS,
    };
    use ir::DType;

    /// A decode attention with a rope takes `rope_kv`'s rotated queries where
    /// `ROTATED_Q_ARG` says, and only that one is left out of its bytes in a decode step.
    #[test]
    fn the_rotated_queries_are_where_the_profile_looks() {
        let rope = RopeShape { rot: 64, rope_q: true, rope_k: true, norm: HeadNorm::default(), ld: [256, 64, 64] };
        let a = |rope| DecAttention {
            heads: 4,
            kv_heads: 1,
            d: 64,
            out: DType::BF16,
            mixed_only: true,
            mask: Mask::default(),
            splits: 1,
            warps: 4,
            rope,
        };
        let (params, _) = a(Some(rope)).params_and_call().unwrap();
        let params: Vec<&str> = params.split(',').map(str::trim).collect();
        assert_eq!(params[DecAttention::ROTATED_Q_ARG], "const float* qo");
        assert_eq!(KernelKey::AttentionDec(a(Some(rope))).unread_in_decode(), [DecAttention::ROTATED_Q_ARG]);
        assert!(KernelKey::AttentionDec(a(None)).unread_in_decode().is_empty());
    }

    /// One row splits over every block; many rows over fewer each, never past the scratch the
    /// runtime gives a row nor below the fewest, and always a count the program has a kernel for.
    #[test]
    fn the_split_argmax_takes_fewer_blocks_a_row_at_more_rows() {
        let got: Vec<usize> = [1, 8, 16, 64, 128, 256].into_iter().map(argmax_blocks).collect();
        assert_eq!(got, [128, 128, 64, 16, 8, 8]);
        let counts: Vec<usize> = argmax_block_counts().collect();
        assert_eq!(counts, [8, 16, 32, 64, 128]);
        assert!((1..1000).map(argmax_blocks).all(|b| counts.contains(&b) && b <= ARGMAX_BLOCKS));
    }
}
