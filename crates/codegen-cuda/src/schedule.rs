//! The launch schedule: a plan lowered to kernel launches, one kernel per fusion of the plan
//! (residual add + RMS norm and Gemma's norm + add + norm, the linears of one input, gate/up +
//! act·mul, RoPE + the paged KV write + attention: the compiler's fusion passes chose them)
//! and per lone node. What is left here are hardware choices: each linear has variants by row count (GEMV specialised to 1, 2,
//! 4, 8 rows, the tensor-core GEMM above); at one row, a small GEMV launch applies the RMS norm
//! feeding it itself ([`NORM_IN_GEMV_ROWS`]). Values get device buffers by liveness, so
//! buffers are reused across layers. The runtime only resolves arguments and launches; it
//! knows no op.

use crate::keys::{KernelKey, NormIn};
use crate::{CodegenError, WFormat};
use ir::{DType, Op, Plan};

/// What a per-step size counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Count {
    /// Tokens of the step.
    Tokens,
    /// Rows whose logits are wanted.
    Rows,
}

/// A step input the runtime uploads (i32 arrays).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Input {
    /// Token ids `[T]`.
    Ids,
    /// Positions `[T]`.
    Pos,
    /// KV slot of each token `[T]`.
    SlotOf,
    /// Offset of each token's sequence into `Slots` `[T]`.
    SeqOff,
    /// Logit rows `[R]`.
    Rows,
    /// Slots of every position of every sequence.
    Slots,
}

/// One kernel argument.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    /// A device buffer of [`Program::buffers`](crate::Program::buffers).
    Buf(usize),
    /// A device buffer from a byte offset on: the columns of one linear in the packed output
    /// of a launch of several (`Builder::packed`).
    BufAt(usize, usize),
    /// The weight of plan node `i`.
    Weight(usize),
    /// A null pointer (an absent bias or table).
    Null,
    /// A constant array of [`Program::constants`](crate::Program::constants) (f32).
    Const(usize),
    /// The K cache of a layer (16-bit).
    KCache(usize),
    /// The V cache of a layer (16-bit).
    VCache(usize),
    /// A step input.
    Input(Input),
    /// An f32 scalar.
    F32(f32),
    /// A count as i32.
    Count(Count),
    /// A count times a width, as i64 (elementwise kernels).
    Elems(Count, usize),
}

/// A grid dimension: fixed, `ceil(count * mul / div)`, or a bound on tiles of groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    /// A fixed size.
    Fixed(usize),
    /// `ceil(count * mul / div)`.
    Per(Count, usize, usize),
    /// `Groups(c, per, tile, groups)`: the most tiles of `tile` items that `count * per` items
    /// split into at most `groups` groups can need, each group tiled apart:
    /// `ceil(n / tile) + min(groups, n)` for `n = count * per`.
    Groups(Count, usize, usize, usize),
}

impl Dim {
    /// The size for a step of `count` (what `c` gives a [`Count`]).
    pub fn size(&self, count: impl Fn(Count) -> usize) -> usize {
        match *self {
            Dim::Fixed(n) => n,
            Dim::Per(c, mul, div) => (count(c) * mul).div_ceil(div),
            Dim::Groups(c, per, tile, groups) => {
                let n = count(c) * per;
                n.div_ceil(tile) + groups.min(n)
            }
        }
    }
}

/// One kernel launch.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    /// The kernel.
    pub key: KernelKey,
    /// Its arguments, in order.
    pub args: Vec<Arg>,
    /// Grid x and y.
    pub grid: [Dim; 2],
    /// Threads per block.
    pub block: u32,
    /// Whether it has nothing to do in a step whose every row is a sequence of its own (a
    /// decode graph's, padding rows included), so the runtime may leave it out of such steps:
    /// extend attention (it takes only groups of 16 rows of one sequence, `fa_row` of
    /// `kernels/attention.cuh`), and `rope_kv` where decode attention rotates such rows itself.
    pub idle_in_decode: bool,
}

/// One step of the schedule.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Launches; the first variant whose bound is `>= count` runs.
    Kernels {
        /// What selects the variant.
        by: Count,
        /// (largest count, launches), bounds increasing; the last is unbounded.
        variants: Vec<(usize, Vec<Launch>)>,
    },
    /// Sum a buffer of f32 rows over the tensor-parallel ranks, in place.
    AllReduce {
        /// The buffer.
        buf: usize,
        /// Floats per token.
        cols: usize,
    },
    /// Join the ranks' column blocks of f32 logit rows (`src`, `cols` per row) into `dst`
    /// (`cols * ranks` per row, rank r's block at column `r * cols`), on rank 0 at least.
    AllGather {
        /// This rank's block.
        src: usize,
        /// The whole rows.
        dst: usize,
        /// Floats per row of one rank's block.
        cols: usize,
    },
}

impl Step {
    /// What selects this step's variant in a forward step of `tokens` tokens and `rows` logit
    /// rows: the one its `by` names (tokens for a collective).
    pub fn count(&self, tokens: usize, rows: usize) -> usize {
        match self {
            Step::Kernels { by: Count::Rows, .. } => rows,
            _ => tokens,
        }
    }

    /// The launches this step runs in a forward step of `tokens` tokens and `rows` logit rows
    /// (the first variant whose bound holds its [`Step::count`]); none for a collective.
    pub fn launches(&self, tokens: usize, rows: usize) -> &[Launch] {
        let Step::Kernels { variants, .. } = self else { return &[] };
        let c = self.count(tokens, rows);
        variants.iter().find(|(max, _)| c <= *max).map_or(&[], |v| &v.1[..])
    }
}

/// A device buffer: `row_bytes` per token (or per logit row).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buffer {
    /// Bytes per row.
    pub row_bytes: usize,
    /// Rows counted by.
    pub per: Count,
}

/// Row counts that have their own GEMV instance.
pub const GEMV_ROWS: [usize; 4] = [1, 2, 4, 8];

/// Row counts of the small-batch tensor-core kernel; above the last, the GEMM runs.
pub const SKINNY_ROWS: [usize; 5] = [8, 16, 32, 64, 128];

/// The most rows the GEMV takes where the small-batch tensor-core kernel can (every output
/// count a multiple of 16): above it, the GEMV's per-row FMAs cost more than the tensor cores'
/// one pass over the weights. Measured on an H200, Qwen2.5-7B shape, GEMV at 4 rows 7.19 ms a
/// step, at 8 rows 13.5 ms, against 5.06 ms at 16 rows on tensor cores (docs/perf.md).
pub const GEMV_MAX_ROWS: usize = 2;

/// The GEMV row variants of linears with output counts `n` over `k` inputs in format `wf`: up
/// to [`GEMV_MAX_ROWS`] where the small-batch kernel takes the rest ([`skinny_takes`]), all of
/// [`GEMV_ROWS`] otherwise.
pub(crate) fn gemv_rows(n: &[usize], k: usize, wf: WFormat) -> Vec<usize> {
    let skinny = skinny_takes(n, k, wf);
    GEMV_ROWS.into_iter().filter(|&r| !skinny || r <= GEMV_MAX_ROWS).collect()
}

/// Whether the small-batch tensor-core kernel takes linears of output counts `n` over `k`
/// inputs in format `wf`: every count a multiple of 16, four chunks of `wf` dividing `k`.
pub(crate) fn skinny_takes(n: &[usize], k: usize, wf: WFormat) -> bool {
    n.iter().all(|c| c % 16 == 0) && wf.skinny_takes(k)
}

/// Columns per scale of an E4M3 weight on the device (`W8_GROUP` of `kernels/fast.cuh`; the
/// layout is [`crate::fp8_device_layout`]'s).
pub const W8_GROUP: usize = 128;

/// Pairs of (token, chosen expert) per tile of the grouped MoE kernels (`MOE_TILE` of
/// `kernels/moe.cuh`, defined by the generated source from this).
pub const MOE_TILE: usize = 64;

/// Warps of a decode attention block while a step's blocks fit the GPU at once
/// ([`dec_warps_rows`]; `WARPS` of `kernels/attention.cuh`'s `attention_dec`), each taking the
/// row's key tiles in turn.
pub const DEC_WARPS: usize = 4;

/// Warps of a decode attention block past [`dec_warps_rows`]: twice the blocks an SM, so a step
/// whose four-warp blocks would run in two waves runs in one.
pub const DEC_WARPS_PAST_WAVE: usize = 2;

/// The SMs of the GPU the block counts of decode attention and the direct MoE kernels are
/// reckoned for (an H100 SXM / H200).
const GPU_SMS: usize = 132;

/// Shared memory an SM of an H100 / H200 gives its blocks (228 KB).
const SM_SMEM: usize = 228 * 1024;

/// Shared memory a decode attention block takes beside its stages, at most: its static arrays
/// (the own row's queries, key, value and rotation, the warps' maxima and sums: under 6 KB at head
/// size 128 with 16 query heads) and the 1 KB the driver keeps a block.
const DEC_SMEM_BESIDE: usize = 7 * 1024;

/// Blocks of [`DEC_WARPS`] warps an H100 / H200 holds at once: as many an SM as their shared
/// memory allows at head size 128 ([`dec_smem`]; two with three stages, three with two). Their
/// registers allow three or more (the 16-row form 168 a thread, the transposed one 128).
fn dec_wave() -> usize {
    GPU_SMS * (SM_SMEM / (dec_smem(DEC_WARPS, 128) + DEC_SMEM_BESIDE))
}

/// The most unsplit decode rows of `kv_heads` kv heads whose blocks of [`DEC_WARPS`] warps fit
/// the GPU at once; more rows take [`DEC_WARPS_PAST_WAVE`] warps a block.
pub fn dec_warps_rows(kv_heads: usize) -> usize {
    dec_wave() / kv_heads.max(1)
}

/// Key tiles (16 keys) each decode attention warp stages (`DEC_STAGES`): two in flight while it
/// uses a third. H200, 4-layer Qwen2.5-7B (docs/perf.md, 2026-11-29, fourth session): a call
/// at 256 rows of 800 keys 102.6 us against 109.3 with two stages, 64 x 1024 47.1 against
/// 48.8, 128 rows of ~160 keys 19.8 against 20.7 a layer.
pub const DEC_STAGES: usize = 3;

/// The fewest key tiles of a split of a decode row's keys (`DEC_SPLIT_MIN`): eight a warp of a
/// [`DEC_WARPS`] block (512 keys), so a split's fixed costs (its queries, the warps' merge, the
/// partial state written and merged again) stay small against its reads.
pub const DEC_SPLIT_MIN: usize = 8 * DEC_WARPS;

/// Decode attention blocks a step should have (two an SM of an H100 / H200): a row's keys split
/// into as many blocks as it takes to reach it ([`dec_splits`]). Measured on an H200
/// (docs/perf.md): splitting to a thousand blocks was slower at 64 rows of the 7B shape (four kv
/// heads, 256 blocks unsplit) and at 256 rows of the 0.5B shape (two kv heads); only rows that
/// leave SMs idle gain from it.
const DEC_BLOCKS: usize = 2 * GPU_SMS;

/// The most blocks a decode row's keys split into.
const DEC_MAX_SPLITS: usize = 8;

/// The splits of each decode row's keys at up to `rows` rows of `kv_heads` kv heads: the power
/// of two that brings the blocks nearest `DEC_BLOCKS` (264, two an SM) from below, 1 to
/// `DEC_MAX_SPLITS` (8). A row's keys split only where they are more than [`DEC_SPLIT_MIN`]
/// tiles a split.
pub fn dec_splits(rows: usize, kv_heads: usize) -> usize {
    let mut s = 1;
    while s < DEC_MAX_SPLITS && rows * kv_heads * s * 2 <= DEC_BLOCKS {
        s *= 2;
    }
    s
}

/// Keys a tile of extend attention (`attention_fa`, `FA_KEYS`): copied once into shared memory
/// for the block's [`FA_WARPS`] warps (16 query rows each, of one head and sequence).
pub const FA_KEYS: usize = 64;

/// Key tiles an extend attention block has in flight (`FA_STAGES`): the next tile's copies are
/// issued before the current one is used.
pub const FA_STAGES: usize = 2;

/// Warps of an extend attention block (`FA_WARPS`), 16 query rows each.
pub const FA_WARPS: usize = 4;

/// The query rows of an extend attention block.
pub const FA_ROWS: usize = 16 * FA_WARPS;

/// The dynamic shared memory of an extend attention block of head size `d`: [`FA_STAGES`]
/// stages of a K and a V tile of [`FA_KEYS`] keys, rows of `d + 8` 16-bit values, or where more,
/// each warp's K and V tiles of 16 keys (the blocks that span sequences).
pub fn fa_smem(d: usize) -> usize {
    (FA_STAGES * 2 * FA_KEYS).max(FA_WARPS * 2 * 16) * (d + 8) * 2
}

/// The dynamic shared memory of a decode attention block of `warps` warps and head size `d`:
/// every warp's stages of a K and a V tile of 16 keys, rows of `d + 8` 16-bit values. At the end
/// the same space holds every warp's 16 x `d` f32 outputs, summed over the warps: they fit,
/// since a warp's stages take 2 * `DEC_STAGES` * (`d` + 8) 16-bit values a row.
pub fn dec_smem(warps: usize, d: usize) -> usize {
    warps * DEC_STAGES * 2 * 16 * (d + 8) * 2
}

/// Up to this many (token, chosen expert) pairs an expert on average, the grouped experts run
/// a warp per feature looping over each tile's pairs; above, on tensor cores (measured on the
/// Qwen3-30B-A3B and gpt-oss-20b shapes, docs/perf.md).
pub const MOE_ROWS_PAIRS: usize = 8;

/// Warps of a `moe_up_rows` block (a warp per feature): at Qwen3-30B-A3B's shape its 168
/// registers a thread fit three 4-warp blocks an SM (12 warps) where they fit one 8-warp block
/// (8 warps), so more of its weight rows are in flight and the blocks' loads and sums overlap
/// (measured on an H200, docs/perf.md: a batch-64 step 2.96 -> 2.59 ms, batch 16 1.64 -> 1.42).
/// It must divide the experts' intermediate size: the grouped path runs only where that is a
/// multiple of 32 (`lower::moe::direct`).
pub const MOE_UP_ROWS_WARPS: usize = 4;

/// The most tokens a step of a mixture of 16-bit experts runs the direct kernels (pairs in
/// token order, no sort: `moe_up_direct` / `moe_down_direct`); above, the grouped ones.
pub const MOE_DIRECT_TOKENS: usize = 1;

/// Blocks along the features of a direct step's `moe_up_direct` (of `inter` / 8 at most, eight
/// warps each): two an SM of [`GPU_SMS`] over the `k` pairs of [`MOE_DIRECT_TOKENS`] token, so
/// the step's blocks run at once (their registers allow two an SM) and pay the routing every
/// block does first once, not once a wave; the warps take the features in turn.
pub fn moe_up_direct_blocks(inter: usize, k: usize) -> usize {
    (2 * GPU_SMS / (k * MOE_DIRECT_TOKENS).max(1)).min(inter / 8).max(1)
}

/// The most tokens a step of a mixture of `experts` choosing `k` a token runs the grouped
/// experts a warp per feature ([`MOE_ROWS_PAIRS`] pairs an expert on average).
pub fn moe_rows_max(experts: usize, k: usize) -> usize {
    (MOE_ROWS_PAIRS * experts / k.max(1)).max(1)
}

/// Steps of at most this many tokens leave an RMS norm that only feeds the linears of one
/// launch to those GEMVs ([`NormIn`]): one kernel less per norm, for every block normalising
/// the rows again (reading them from L2 while its weight loads are in flight). Measured on an
/// H200 (docs/perf.md): it saves 2% of a 0.5B batch-1 step and costs 2-8% at 2 and 4 rows.
pub const NORM_IN_GEMV_ROWS: usize = 1;

/// A norm that the decode GEMVs reading it apply themselves.
#[derive(Clone)]
pub(crate) struct FusedNorm {
    /// The arguments that replace the GEMV's input: a, b, s, the norm weight, eps.
    pub args: [Arg; 5],
    /// Its part of the GEMV's key.
    pub key: NormIn,
}

/// A value before buffer assignment.
#[derive(Clone, Copy)]
struct Val {
    row_bytes: usize,
    per: Count,
    dtype: DType,
    /// A column range of another value: that value and the range's byte offset in a row.
    view: Option<(usize, usize)>,
}

pub(crate) struct Builder<'p> {
    pub plan: &'p Plan,
    pub consumers: Vec<Vec<usize>>,
    /// The plan fusion each node belongs to.
    pub fusion_of: Vec<Option<usize>>,
    vals: Vec<Val>,
    pub node_val: Vec<Option<usize>>,
    /// The program's 16-bit float ([`half_dtype`]).
    pub half: DType,
    half_of: Vec<Option<usize>>,
    /// Norm nodes the decode GEMVs apply themselves.
    pub fused_norm: Vec<Option<FusedNorm>>,
    /// Whether norms may fuse into GEMVs (`ENGINE_NORM_IN_GEMV=0`: never, for measurements).
    pub fuse_norms: bool,
    pub steps: Vec<Step>,
    pub constants: Vec<Vec<f32>>,
    /// The logits op's gathered input rows (the final hidden state, `half`), once lowered.
    pub hidden: Option<usize>,
}

/// The 16-bit float of `plan`'s program (activations that feed linears, 16-bit weights, the KV
/// cache): f16 for an f16 plan, else bf16 (an f32 plan's fast paths also round to bf16). A plan
/// holding weights of the other 16-bit type is rejected: one program has one `h16_t`.
pub(crate) fn half_dtype(plan: &Plan) -> Result<DType, CodegenError> {
    let half = if plan.act_dtype == DType::F16 { DType::F16 } else { DType::BF16 };
    for (name, _, dtype) in plan.weights() {
        if !(dtype == DType::F32 || dtype == half || dtype.is_block()) {
            return Err(CodegenError::Unsupported(format!(
                "weight `{name}` is {dtype} in a plan whose 16-bit type is {half} (compile with one --dtype)"
            )));
        }
    }
    Ok(half)
}

pub(crate) fn one(launch: Launch) -> Step {
    Step::Kernels { by: Count::Tokens, variants: vec![(usize::MAX, vec![launch])] }
}

/// The launch converting value `v` (f32 rows of `cols`) into `b` in the 16-bit float.
pub(crate) fn to_h16(v: usize, b: usize, cols: usize) -> Launch {
    launch(
        KernelKey::ToH16,
        vec![Arg::Buf(v), Arg::Buf(b), Arg::Elems(Count::Tokens, cols)],
        [per_token(cols, 256), ONE],
        256,
    )
}

pub(crate) fn launch(key: KernelKey, args: Vec<Arg>, grid: [Dim; 2], block: u32) -> Launch {
    Launch { key, args, grid, block, idle_in_decode: false }
}

pub(crate) const ONE: Dim = Dim::Fixed(1);

pub(crate) fn per_token(mul: usize, div: usize) -> Dim {
    Dim::Per(Count::Tokens, mul, div)
}

impl<'p> Builder<'p> {
    pub(crate) fn cols(&self, node: usize) -> usize {
        self.plan.nodes[node].ty.last().unwrap_or(0)
    }

    pub(crate) fn wdtype(&self, node: usize) -> DType {
        match &self.plan.nodes[node].op {
            Op::Weight { dtype, .. } => *dtype,
            _ => DType::F32,
        }
    }

    pub(crate) fn new_val(&mut self, cols: usize, dtype: DType, per: Count) -> usize {
        self.vals.push(Val { row_bytes: cols * dtype.size(), per, dtype, view: None });
        self.vals.len() - 1
    }

    /// Per-token f32 values of `cols` columns each that are consecutive column ranges of one
    /// packed value (rows of their sum): the outputs of one linear launch of several, which the
    /// kernels write as one matrix (one cuBLASLt matmul where the weights are adjacent). Their
    /// readers take the packed row as the stride ([`Builder::row_stride`]).
    pub(crate) fn packed(&mut self, cols: &[usize]) -> Vec<usize> {
        let base = self.new_val(cols.iter().sum(), DType::F32, Count::Tokens);
        let mut at = 0;
        cols.iter()
            .map(|&c| {
                let v = self.new_val(c, DType::F32, Count::Tokens);
                self.vals[v].view = Some((base, at * DType::F32.size()));
                at += c;
                v
            })
            .collect()
    }

    /// Floats from one row of value `v` to the next: its width, or its packed value's.
    pub(crate) fn row_stride(&self, v: usize) -> usize {
        let w = self.vals[v].view.map_or(v, |(base, _)| base);
        self.vals[w].row_bytes / self.vals[w].dtype.size()
    }

    /// The value of node `i`, created with `dtype` on first use.
    pub(crate) fn out(&mut self, node: usize, dtype: DType) -> usize {
        if let Some(v) = self.node_val[node] {
            return v;
        }
        let v = self.new_val(self.cols(node), dtype, Count::Tokens);
        self.node_val[node] = Some(v);
        v
    }

    pub(crate) fn val(&self, node: usize) -> Result<usize, CodegenError> {
        self.node_val[node].ok_or_else(|| {
            CodegenError::Unsupported(format!(
                "node {node} ({}) is used before it is computed",
                self.plan.nodes[node].label
            ))
        })
    }

    /// The f32 value of node `i` (an error where a fused kernel left it in 16 bits).
    pub(crate) fn f32_val(&self, node: usize) -> Result<usize, CodegenError> {
        let v = self.val(node)?;
        if self.vals[v].dtype != DType::F32 {
            return Err(CodegenError::Unsupported(format!(
                "{} reads a 16-bit value where f32 is needed",
                self.plan.nodes[node].label
            )));
        }
        Ok(v)
    }

    /// The dtype of value `v`.
    pub(crate) fn vals_dtype(&self, v: usize) -> DType {
        self.vals[v].dtype
    }

    /// Whether every consumer of `node` reads it as the input of a linear (so 16 bits serve).
    pub(crate) fn feeds_linears(&self, node: usize) -> bool {
        let c = &self.consumers[node];
        !c.is_empty()
            && c.iter().all(|&j| {
                let n = &self.plan.nodes[j];
                matches!(n.op, Op::Linear { .. } | Op::Logits) && n.inputs[0] == node
            })
    }

    pub(crate) fn act_dtype(&self, node: usize) -> DType {
        if self.feeds_linears(node) {
            self.half
        } else {
            DType::F32
        }
    }

    /// Node `i`'s value in the 16-bit float, converting (once) when it is f32.
    pub(crate) fn half_input(&mut self, node: usize) -> Result<usize, CodegenError> {
        let v = self.val(node)?;
        if self.vals[v].dtype == self.half {
            return Ok(v);
        }
        if let Some(b) = self.half_of[node] {
            return Ok(b);
        }
        let cols = self.cols(node);
        let b = self.new_val(cols, self.half, Count::Tokens);
        self.half_of[node] = Some(b);
        self.steps.push(one(to_h16(v, b, cols)));
        Ok(b)
    }

    /// Whether linear node `i` can take the fast (GEMV / GEMM) kernels.
    pub(crate) fn fast_linear(&self, i: usize) -> bool {
        self.fast_format(i).is_some()
    }

    /// The weight format in which the fast kernels take linear node `i`: the program's 16-bit
    /// float, E4M3 (`k` a multiple of [`W8_GROUP`]) or one of GGUF's blocks; `None` where only
    /// the fallback kernel can (any bias must be 16-bit, or f32 beside GGUF weights).
    pub(crate) fn fast_format(&self, i: usize) -> Option<WFormat> {
        let n = &self.plan.nodes[i];
        let k = self.plan.nodes[n.inputs[0]].ty.last().unwrap_or(0);
        let wf = WFormat::of(self.wdtype(n.inputs[1]), self.half)?;
        let weight = wf != WFormat::E4m3 || k.is_multiple_of(W8_GROUP);
        let bias = n.inputs[2..].iter().all(|&b| self.wdtype(b) == self.half) || self.bias_f32(i) && wf.gguf();
        (weight && bias && k.is_multiple_of(32) && k > 0).then_some(wf)
    }

    /// Whether linear node `i` has an f32 bias (GGUF files store biases so; the fast kernels
    /// take them beside GGUF weights).
    pub(crate) fn bias_f32(&self, i: usize) -> bool {
        self.plan.nodes[i].inputs.get(2).is_some_and(|&b| self.wdtype(b) == DType::F32)
    }
}

/// A lowered plan: steps, buffers and constants.
pub(crate) struct Schedule {
    pub steps: Vec<Step>,
    pub buffers: Vec<Buffer>,
    pub constants: Vec<Vec<f32>>,
    pub output: usize,
    /// The buffer of the logit rows' final hidden state (kept live to the end of the step).
    pub hidden: Option<usize>,
    /// The program's 16-bit float ([`half_dtype`]).
    pub half: DType,
}

/// Lowers `plan` to fused launches with buffers assigned.
pub(crate) fn schedule(plan: &Plan) -> Result<Schedule, CodegenError> {
    let n = plan.nodes.len();
    let mut consumers = vec![vec![]; n];
    for (i, node) in plan.nodes.iter().enumerate() {
        for &j in &node.inputs {
            if !consumers[j].contains(&i) {
                consumers[j].push(i);
            }
        }
    }
    let mut fusion_of = vec![None; n];
    for (f, fusion) in plan.fusions.iter().enumerate() {
        for &m in &fusion.nodes {
            match fusion_of.get_mut(m) {
                Some(slot @ None) => *slot = Some(f),
                _ => return Err(CodegenError::Unsupported(format!("plan fusion {f} names node {m} twice or none"))),
            }
        }
    }
    let mut b = Builder {
        plan,
        consumers,
        fusion_of,
        vals: vec![],
        node_val: vec![None; n],
        half: half_dtype(plan)?,
        half_of: vec![None; n],
        fused_norm: vec![None; n],
        fuse_norms: std::env::var("ENGINE_NORM_IN_GEMV").map_or(true, |v| v != "0"),
        steps: vec![],
        constants: vec![],
        hidden: None,
    };
    quantized_readers(&b)?;
    for i in 0..n {
        match b.fusion_of[i] {
            // A fusion is lowered at its first member (members are consecutive in a plan).
            Some(f) if plan.fusions[f].nodes.iter().min() == Some(&i) => crate::lower::fusion(&mut b, f)?,
            Some(_) => {}
            None => crate::lower::node(&mut b, i)?,
        }
    }
    let out = b.val(plan.output)?;
    Ok(assign(b.steps, &b.vals, (out, b.hidden), b.constants, b.half))
}

/// Every reader of an E4M3 or GGUF block weight must be a kernel that reads its format: a
/// linear the fast kernels take with it, or for GGUF's blocks an embedding or the logits
/// (tables and lm_heads are blocks in GGUF files too).
fn quantized_readers(b: &Builder) -> Result<(), CodegenError> {
    for (w, node) in b.plan.nodes.iter().enumerate() {
        let Op::Weight { dtype, .. } = node.op else { continue };
        let Some(wf) = WFormat::of(dtype, b.half).filter(|f| *f != WFormat::H16) else { continue };
        for &r in &b.consumers[w] {
            let reader = &b.plan.nodes[r];
            let ok = match reader.op {
                Op::Linear { .. } => reader.inputs[1] == w && b.fast_format(r) == Some(wf),
                Op::Embedding | Op::Logits => wf.gguf() && reader.inputs[1] == w,
                _ => false,
            };
            if !ok {
                return Err(CodegenError::Unsupported(format!(
                    "weight `{}` is {dtype}: the CUDA kernels read it only as a linear's weight over a multiple of {} \
                     input features with a 16-bit{} bias{} (`{}` reads it)",
                    node.label,
                    if wf == WFormat::E4m3 { W8_GROUP } else { 32 },
                    if wf.gguf() { " or f32" } else { "" },
                    if wf.gguf() {
                        ", an embedding table or an lm_head; `engc compile --dtype bf16` dequantizes it"
                    } else {
                        ""
                    },
                    reader.label
                )));
            }
        }
    }
    Ok(())
}

/// Gives every value a device buffer, reusing the buffers of values no longer live; the
/// output and the hidden rows stay live to the end.
fn assign(
    mut steps: Vec<Step>,
    vals: &[Val],
    (output, hidden): (usize, Option<usize>),
    constants: Vec<Vec<f32>>,
    half: DType,
) -> Schedule {
    // A view lives in its packed value's buffer.
    let base = |v: usize| vals[v].view.map_or(v, |(b, _)| b);
    let mut first = vec![usize::MAX; vals.len()];
    let mut last = vec![0; vals.len()];
    for (s, step) in steps.iter().enumerate() {
        for v in step_vals(step).into_iter().map(base) {
            first[v] = first[v].min(s);
            last[v] = s;
        }
    }
    last[output] = usize::MAX;
    if let Some(h) = hidden {
        last[h] = usize::MAX;
    }
    let mut buffers: Vec<Buffer> = vec![];
    let mut free: Vec<usize> = vec![];
    let mut phys = vec![usize::MAX; vals.len()];
    for s in 0..steps.len() {
        for v in (0..vals.len()).filter(|&v| first[v] == s) {
            let need = vals[v];
            let fit = free
                .iter()
                .enumerate()
                .filter(|(_, &p)| buffers[p].per == need.per)
                .min_by_key(|(_, &p)| buffers[p].row_bytes.abs_diff(need.row_bytes))
                .map(|(i, _)| i);
            let p = match fit {
                Some(i) => free.swap_remove(i),
                None => {
                    buffers.push(Buffer { row_bytes: 0, per: need.per });
                    buffers.len() - 1
                }
            };
            buffers[p].row_bytes = buffers[p].row_bytes.max(need.row_bytes);
            phys[v] = p;
        }
        free.extend((0..vals.len()).filter(|&v| last[v] == s && phys[v] != usize::MAX).map(|v| phys[v]));
    }
    let arg = |v: usize| match vals[v].view {
        Some((b, 0)) => Arg::Buf(phys[b]),
        Some((b, at)) => Arg::BufAt(phys[b], at),
        None => Arg::Buf(phys[v]),
    };
    for step in &mut steps {
        map_bufs(
            step,
            |v| {
                debug_assert!(vals[v].view.is_none(), "collectives read whole values");
                phys[v]
            },
            arg,
        );
    }
    Schedule { steps, buffers, constants, output: phys[output], hidden: hidden.map(|h| phys[h]), half }
}

fn step_vals(step: &Step) -> Vec<usize> {
    match step {
        Step::AllReduce { buf, .. } => vec![*buf],
        Step::AllGather { src, dst, .. } => vec![*src, *dst],
        Step::Kernels { variants, .. } => variants
            .iter()
            .flat_map(|(_, ls)| ls.iter().flat_map(|l| l.args.iter()))
            .filter_map(|a| if let Arg::Buf(v) = a { Some(*v) } else { None })
            .collect(),
    }
}

/// Values to buffers: `f` for the collectives' values, `arg` for the kernels' (views to a
/// packed buffer from an offset).
fn map_bufs(step: &mut Step, f: impl Fn(usize) -> usize, arg: impl Fn(usize) -> Arg) {
    match step {
        Step::AllReduce { buf, .. } => *buf = f(*buf),
        Step::AllGather { src, dst, .. } => {
            *src = f(*src);
            *dst = f(*dst);
        }
        Step::Kernels { variants, .. } => {
            for a in variants.iter_mut().flat_map(|(_, ls)| ls.iter_mut().flat_map(|l| l.args.iter_mut())) {
                if let Arg::Buf(v) = a {
                    *a = arg(*v);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{
        dec_smem, dec_wave, fa_smem, launch, moe_rows_max, moe_up_direct_blocks, Count, Dim, Step, DEC_STAGES,
        DEC_WARPS, FA_KEYS, FA_STAGES, FA_WARPS, GPU_SMS, MOE_DIRECT_TOKENS, MOE_TILE, ONE,
    };
    use crate::keys::KernelKey;

    /// A step runs the first variant whose bound holds its count (tokens or logit rows, as the
    /// step says); a collective has no launches.
    #[test]
    fn a_step_runs_the_first_variant_its_count_fits() {
        let l = |k| launch(k, vec![], [ONE, ONE], 32);
        let (a, b) = (l(KernelKey::ToH16), l(KernelKey::Argmax { vocab: 8, blocks: 1 }));
        let step =
            |by| Step::Kernels { by, variants: vec![(1, vec![a.clone()]), (usize::MAX, vec![b.clone(), a.clone()])] };
        assert_eq!(step(Count::Tokens).launches(1, 9), std::slice::from_ref(&a));
        assert_eq!(step(Count::Tokens).launches(2, 1), [b.clone(), a.clone()]);
        assert_eq!(step(Count::Rows).launches(9, 1), std::slice::from_ref(&a));
        assert!(Step::AllReduce { buf: 0, cols: 4 }.launches(1, 1).is_empty());
    }

    /// Extend attention's dynamic shared memory holds its stages of block-wide K and V tiles, also
    /// every warp's own two 16-key tiles of a block spanning sequences, at every head size it
    /// takes (16 to 128), within what one block of an sm_90 GPU may have (227 KB), and leaves room
    /// for two blocks an SM at heads of 128.
    #[test]
    fn extend_attention_tiles_fit_shared_memory() {
        for d in (16..=128).step_by(16) {
            let row = (d + 8) * 2;
            assert!(fa_smem(d) >= FA_STAGES * 2 * FA_KEYS * row, "d {d}");
            assert!(fa_smem(d) >= FA_WARPS * 2 * 16 * row && fa_smem(d) <= 227 * 1024, "d {d}");
        }
        assert!(2 * fa_smem(128) <= 228 * 1024);
        assert_eq!(FA_KEYS % 16, 0, "keys in mma tiles of 16");
    }

    /// Decode attention's four-warp blocks: two an SM with three key stages of head size 128
    /// (102 KB each), so 264 fit an H200 at once.
    #[test]
    fn decode_attention_wave_follows_its_stages() {
        assert_eq!(dec_smem(DEC_WARPS, 128), DEC_WARPS * DEC_STAGES * 8704);
        assert_eq!((DEC_STAGES, dec_wave()), (3, 264));
    }

    /// A direct step's `moe_up_direct` blocks all fit the GPU at once (two an SM), take at most
    /// one block a group of eight features, and at least one: Qwen3-30B-A3B (768 features, 8
    /// experts a token), gpt-oss-20b (2,880, 4), a tiny fixture's 64 features, a top-1 router.
    #[test]
    fn direct_moe_up_blocks_fit_one_wave() {
        for (inter, k, want) in [(768, 8, 33), (2880, 4, 66), (64, 2, 8), (32768, 1, 264), (8, 64, 1)] {
            let b = moe_up_direct_blocks(inter, k);
            assert_eq!(b, want, "inter {inter} k {k}");
            assert!(b * k * MOE_DIRECT_TOKENS <= 2 * GPU_SMS || b == 1, "inter {inter} k {k}");
            assert!((1..=inter / 8).contains(&b), "inter {inter} k {k}");
        }
    }

    /// `Dim::Groups` bounds the tiles of splits of `count * per` items into at most `groups`
    /// groups (the grouped MoE kernels' grid): all in one group, even, and pseudo-random ones.
    #[test]
    fn groups_bound_the_tiles_of_any_split() {
        let tiles = |sizes: &[usize]| sizes.iter().map(|c| c.div_ceil(MOE_TILE)).sum::<usize>();
        let mut seed = 12345u64;
        for (t, per, groups) in [(1, 8, 128), (3, 8, 128), (64, 8, 128), (513, 4, 32), (4096, 8, 128)] {
            let n = t * per;
            let bound = Dim::Groups(Count::Tokens, per, MOE_TILE, groups).size(|_| t);
            assert_eq!(bound, n.div_ceil(MOE_TILE) + groups.min(n), "t={t}");
            let used = groups.min(n);
            let even: Vec<usize> = (0..used).map(|g| n / used + usize::from(g < n % used)).collect();
            assert!(tiles(&even) <= bound && tiles(&[n]) <= bound, "t={t}");
            for _ in 0..200 {
                let mut sizes = vec![0; groups];
                for _ in 0..n {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    sizes[(seed >> 33) as usize % groups] += 1;
                }
                assert!(tiles(&sizes) <= bound, "t={t}: {sizes:?}");
            }
        }
        assert_eq!(Dim::Per(Count::Tokens, 3, 2).size(|_| 5), 8);
    }

    /// A warp per feature up to 8 pairs an expert on average, at least for one token.
    #[test]
    fn rows_up_to_eight_pairs_an_expert() {
        assert_eq!(moe_rows_max(128, 8), 128);
        assert_eq!(moe_rows_max(32, 4), 64);
        assert_eq!(moe_rows_max(8, 2), 32);
        assert_eq!(moe_rows_max(4, 4), 8);
        assert_eq!(moe_rows_max(1, 16), 1);
    }
}
