//! The pass pipeline: named `Graph -> Result<Graph>` functions run top to bottom, the verifier
//! after each.

use crate::{fuse, fusion, shard, CompileError};
use ir::{Fun, Graph, NodeIndex, Op, Scalar};
use spec::{BoundModel, ShardKind};

/// What passes may read besides the graph.
pub struct PassCtx<'a> {
    /// Tensor-parallel ranks.
    pub tp: usize,
    /// The bound model (weight shard kinds).
    pub model: &'a BoundModel,
    /// How a column-parallel lm_head is held.
    pub lm_head: LmHead,
    /// The quantization asked for the linears' weights (`quantize_linears`).
    pub quant: Option<Quant>,
}

/// A quantization of the linears' weights, made by the compiler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quant {
    /// FP8 E4M3 with one f32 scale per output channel (`ir::DType::F8_E4M3`).
    Fp8,
}

impl Quant {
    /// Parses `fp8`.
    pub fn parse(s: &str) -> Option<Quant> {
        (s == "fp8").then_some(Quant::Fp8)
    }
}

/// How the ranks of a tensor-parallel bundle hold an lm_head that the model YAML marks
/// `shard: column`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LmHead {
    /// Split by vocabulary: each rank computes its share of the logits, an all-gather joins
    /// them (when tp divides the vocabulary; else replicated).
    #[default]
    Vocab,
    /// Whole on every rank: each computes all the logits, nothing to join.
    Replicated,
}

impl LmHead {
    /// Parses `vocab` or `replicated`.
    pub fn parse(s: &str) -> Option<LmHead> {
        match s {
            "vocab" => Some(LmHead::Vocab),
            "replicated" => Some(LmHead::Replicated),
            _ => None,
        }
    }
}

/// A pass.
pub type Pass = fn(Graph, &PassCtx) -> Result<Graph, CompileError>;

/// The pipeline, in order.
pub const PIPELINE: &[(&str, Pass)] = &[
    ("tensor_parallel", tensor_parallel),
    ("quantize_linears", quantize_linears),
    ("fuse_elementwise", fuse::fuse_elementwise),
    ("fold_weights", fuse::fold_weights),
    ("fuse_rope_attention", fusion::fuse_rope_attention),
    ("fuse_glu", fusion::fuse_glu),
    ("fuse_moe_router", fusion::fuse_moe_router),
    ("group_linears", fusion::group_linears),
    ("fuse_add_norm", fusion::fuse_add_norm),
];

/// Runs every pass of [`PIPELINE`], verifying after each; `observe(name, graph)` sees the graph
/// after each pass (for `--dump-after` and tests).
pub fn run(mut g: Graph, ctx: &PassCtx, mut observe: impl FnMut(&str, &Graph)) -> Result<Graph, CompileError> {
    g.verify().map_err(|e| CompileError::Pass { pass: "lower".into(), source: e })?;
    observe("lower", &g);
    for (name, pass) in PIPELINE {
        g = pass(g, ctx)?;
        g.verify().map_err(|e| CompileError::Pass { pass: name.to_string(), source: e })?;
        observe(name, &g);
    }
    Ok(g)
}

/// Megatron-style tensor parallelism: weights take their per-rank shapes, attention ops their
/// per-rank head counts (KV heads replicated when tp exceeds them), an `all_reduce` follows
/// every linear whose weight is row-parallel, and an `all_gather` follows the logits of a
/// vocab-parallel (column-split) lm_head. A mixture of experts splits each expert's
/// intermediate size and sums like a row-parallel linear.
pub fn tensor_parallel(mut g: Graph, ctx: &PassCtx) -> Result<Graph, CompileError> {
    let tp = ctx.tp;
    if tp == 1 {
        return Ok(g);
    }
    let ir_err = |e: ir::IrError| CompileError::Pass { pass: "tensor_parallel".into(), source: e };
    // Heads first, so that a tp that does not divide them is reported as such rather than as
    // the first weight that cannot be split.
    for n in g.nodes() {
        if let Op::Attention { heads, kv_heads, .. } = &mut g.node_mut(n).op {
            if *heads % tp != 0 {
                return Err(CompileError::TpHeads { tp, heads: *heads });
            }
            *heads /= tp;
            *kv_heads = if *kv_heads >= tp {
                if *kv_heads % tp != 0 {
                    return Err(CompileError::TpHeads { tp, heads: *kv_heads });
                }
                *kv_heads / tp
            } else {
                1
            };
        }
    }
    // The lm_head splits by vocabulary only when asked and when tp divides the vocabulary;
    // otherwise every rank holds all of it.
    let lm_heads: Vec<_> = g.nodes().into_iter().filter(|&n| matches!(g.node(n).op, Op::Logits)).collect();
    let lm_head_weights: Vec<_> = lm_heads.iter().filter_map(|&n| g.inputs(n).get(1).copied()).collect();
    let mut row_weights = Vec::new();
    for n in g.nodes() {
        let lm_head = lm_head_weights.contains(&n);
        if let Op::Weight { name, shape, dtype, .. } = &mut g.node_mut(n).op {
            let w = ctx.model.weights.iter().find(|w| &w.name == name).ok_or_else(|| CompileError::Tp {
                weight: name.clone(),
                message: "is not declared by the model".into(),
            })?;
            if !(lm_head && (ctx.lm_head == LmHead::Replicated || shard::shape(w, tp).is_err())) {
                *shape = shard::shape(w, tp)?;
                shard::check_blocks(w, shape, *dtype, tp)?;
            }
            if w.shard == ShardKind::Row {
                row_weights.push(n);
            }
        }
    }
    g.reinfer().map_err(ir_err)?;
    for n in lm_heads {
        let split = g.inputs(n).get(1).is_some_and(|&w| match &g.node(w).op {
            Op::Weight { name, shape, .. } => ctx.model.weights.iter().any(|b| &b.name == name && &b.shape != shape),
            _ => false,
        });
        if split {
            let label = format!("{}.all_gather", g.node(n).label);
            let r = g.add(Op::AllGather { ranks: tp }, &[n], label).map_err(ir_err)?;
            g.replace_uses(n, r, r);
        }
    }
    for n in g.nodes() {
        let down = match g.node(n).op {
            Op::Linear { .. } => 1,
            Op::Moe { .. } => 4,
            _ => continue,
        };
        if g.inputs(n).get(down).is_some_and(|w| row_weights.contains(w)) {
            sum_ranks(&mut g, n, tp).map_err(ir_err)?;
        }
    }
    g.tp = tp;
    Ok(g)
}

/// Sums a row-parallel node's partial results over the ranks: an `all_reduce` after it. A bias
/// is added once: a linear's after the sum, a mixture of experts' down bias shared out (each
/// rank adds `1/tp` of it, exact for a power-of-two tp; the `fold_weights` pass makes the
/// share a weight).
fn sum_ranks(g: &mut Graph, n: NodeIndex, tp: usize) -> Result<(), ir::IrError> {
    let label = g.node(n).label.clone();
    let ins = g.inputs(n);
    let call = |f: &str, b: Scalar| Fun::named(f).map(|f| Scalar::call(f, vec![Scalar::Arg(0), b]));
    match g.node(n).op {
        Op::Linear { bias: true } => {
            let plus = call("+", Scalar::Arg(1)).ok_or_else(|| ir::IrError::Verify("no `+`".into()))?;
            let l = g.add(Op::Linear { bias: false }, &ins[..2], label.clone())?;
            let r = g.add(Op::AllReduce, &[l], format!("{label}.all_reduce"))?;
            let s = g.add(Op::Map { expr: plus }, &[r, ins[2]], format!("{label}.bias"))?;
            g.replace_uses(n, s, s);
            g.remove(n);
            return Ok(());
        }
        Op::Moe { bias: true, .. } => {
            let share =
                call("*", Scalar::Const(1.0 / tp as f32)).ok_or_else(|| ir::IrError::Verify("no `*`".into()))?;
            let b = g.add(Op::Map { expr: share }, &[ins[7]], format!("{label}.down_b_share"))?;
            g.replace_uses(ins[7], b, b);
        }
        _ => {}
    }
    let r = g.add(Op::AllReduce, &[n], format!("{label}.all_reduce"))?;
    g.replace_uses(n, r, r);
    Ok(())
}

/// The nodes read only as a linear's weight (its second input), by nothing else.
pub fn linear_weights(g: &Graph) -> std::collections::HashSet<NodeIndex> {
    let mut uses: std::collections::HashMap<NodeIndex, bool> = std::collections::HashMap::new();
    for n in g.nodes() {
        let linear = matches!(g.node(n).op, Op::Linear { .. });
        for (slot, &i) in g.inputs(n).iter().enumerate() {
            let only_linear = uses.entry(i).or_insert(true);
            *only_linear &= linear && slot == 1;
        }
    }
    uses.into_iter().filter_map(|(n, only)| only.then_some(n)).collect()
}

/// With `--quant fp8`: every weight read only as a linear's weight (not embeddings, norms or
/// the lm_head, which `logits` reads), dense, `[n, k]` with `k` whole blocks of 32 on its rank,
/// becomes `f8_e4m3` (the compiler writes it with one scale per output channel); the others
/// stay as they are.
pub fn quantize_linears(mut g: Graph, ctx: &PassCtx) -> Result<Graph, CompileError> {
    let Some(Quant::Fp8) = ctx.quant else {
        return Ok(g);
    };
    for w in linear_weights(&g) {
        if let Op::Weight { shape, dtype, derived: None, .. } = &mut g.node_mut(w).op {
            if dtype.is_float() && shape.len() == 2 && shape[1].is_multiple_of(ir::BLOCK) {
                *dtype = ir::DType::F8_E4M3;
            }
        }
    }
    g.reinfer().map_err(|e| CompileError::Pass { pass: "quantize_linears".into(), source: e })?;
    Ok(g)
}
