//! Fusions: sets of nodes that one kernel computes. The compiler's fusion passes make them
//! (`compiler::fusion`), the verifier checks each against its kind's rule ([`check`]), plans
//! carry them with their members contiguous, and backends render each fusion as one kernel
//! (or, where the hardware path cannot take it, as its members one by one; the reference
//! interpreter always runs the members). A fusion keeps every member node and value, so a
//! fused kernel that writes several results (the residual sum and its norm) needs no tuple
//! types, and a plan printed with its fusions still reads as the model's ops.

use crate::op::Op;
use crate::scalar::{Fun, Scalar};
use serde::{Deserialize, Serialize};

/// What a fusion computes, and so which members it has. Each kind's semantics are those of
/// its members; the kind says which kernel computes them together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FusionKind {
    /// `[add, rms_norm]`: `s = x + y; out = rms_norm(s, w)` with the norm over whole rows or
    /// groups. One pass over each row writes the sum (the residual stream) and its norm.
    AddNorm,
    /// `[rms_norm, add, rms_norm]`: `s = x + rms_norm(y, w1); out = rms_norm(s, w2)`, both
    /// norms over whole rows of one width, the first read only by the add (Gemma's norm of each
    /// sublayer's output before the residual add, then the next sublayer's input norm): one
    /// pass over each row.
    NormAddNorm,
    /// `[linear; 1..=3]`, every one reading the same input (q, k and v): one launch.
    Linears,
    /// `[gate, up, act, mul]`: `act(x·gateᵀ) * (x·upᵀ)`, gate and up being linears without
    /// bias of the same input and the same width, `act` a `silu` or a one-input `map` of the
    /// gate (Gemma's `gelu_tanh`; [`glu_activation`]), each read only by the next member: one
    /// launch that never writes gate or up.
    Glu,
    /// `[(rms_norm,)* rope, (rope,) attention]`: RoPE of the attention's q and/or k, applied
    /// while the attention writes the KV cache; each rope is read only by the attention, two
    /// ropes are the same op. A rope's input may be a member too: an RMS norm over each head
    /// (weight of the attention's head size: Qwen3's and Gemma 3's q/k norms) read only by
    /// that rope, applied before the rotation.
    RopeAttention,
    /// `[linear, moe]`: a mixture of experts' router, a linear of the moe's own input read
    /// only by the moe as its router logits: the routing kernel computes the logits itself
    /// (in f32, from the input as it is).
    MoeRouter,
}

impl FusionKind {
    /// The kind's name in printed plans.
    pub fn name(self) -> &'static str {
        match self {
            FusionKind::AddNorm => "add_norm",
            FusionKind::NormAddNorm => "norm_add_norm",
            FusionKind::Linears => "linears",
            FusionKind::Glu => "glu",
            FusionKind::RopeAttention => "rope_attention",
            FusionKind::MoeRouter => "moe_router",
        }
    }

    /// The kind named `s` in printed plans.
    pub fn parse(s: &str) -> Option<FusionKind> {
        [
            FusionKind::AddNorm,
            FusionKind::NormAddNorm,
            FusionKind::Linears,
            FusionKind::Glu,
            FusionKind::RopeAttention,
            FusionKind::MoeRouter,
        ]
        .into_iter()
        .find(|k| k.name() == s)
    }
}

/// One fusion: its kind and member nodes (`N` is a graph's `NodeIndex` or a plan's index), in
/// the order its kind lists them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fusion<N> {
    /// What it computes.
    pub kind: FusionKind,
    /// Its nodes.
    pub nodes: Vec<N>,
}

/// The activation a GLU's third member applies to the gate, as an expression of `x0`: a
/// `silu`, or a map of one input.
pub fn glu_activation(op: &Op) -> Option<Scalar> {
    match op {
        Op::Silu => Fun::named("silu").map(|f| Scalar::call(f, vec![Scalar::Arg(0)])),
        Op::Map { expr } if expr.arity() == 1 => Some(expr.clone()),
        _ => None,
    }
}

/// What [`check`] reads of a graph or plan.
pub trait View<N: Copy + PartialEq> {
    /// The op of node `n`.
    fn op(&self, n: N) -> &Op;
    /// The inputs of `n`, in slot order.
    fn ins(&self, n: N) -> Vec<N>;
    /// The distinct nodes that read `n`.
    fn readers(&self, n: N) -> Vec<N>;
    /// The size of `n`'s last dimension.
    fn width(&self, n: N) -> usize;
}

/// Checks `f` against its kind's rule (the "shape rule" of a fusion); the message says what
/// does not fit.
pub fn check<N: Copy + PartialEq, V: View<N>>(v: &V, f: &Fusion<N>) -> Result<(), String> {
    let ok = |c: bool, what: &str| if c { Ok(()) } else { Err(format!("{}: {what}", f.kind.name())) };
    let only_read_by = |n: N, r: N| v.readers(n) == [r];
    match (f.kind, &f.nodes[..]) {
        (FusionKind::AddNorm, &[a, n]) => ok(
            matches!(v.op(a), Op::Add) && matches!(v.op(n), Op::RmsNorm { .. }) && v.ins(n)[0] == a,
            "needs an add and an rms_norm of it",
        ),
        (FusionKind::NormAddNorm, &[n1, a, n2]) => {
            let (ai, whole) = (v.ins(a), |n: N| v.width(v.ins(n)[1]) == v.width(n));
            ok(
                matches!(v.op(n1), Op::RmsNorm { .. })
                    && matches!(v.op(a), Op::Add)
                    && matches!(v.op(n2), Op::RmsNorm { .. })
                    && ai.contains(&n1)
                    && ai[0] != ai[1]
                    && only_read_by(n1, a)
                    && v.ins(n2)[0] == a
                    && whole(n1)
                    && whole(n2),
                "needs a whole-row rms_norm read only by an add, the add, and a whole-row rms_norm of it",
            )
        }
        (FusionKind::Linears, ls) if (1..=3).contains(&ls.len()) => {
            let x = v.ins(ls[0]).first().copied();
            ok(
                ls.iter().all(|&l| matches!(v.op(l), Op::Linear { .. }) && v.ins(l).first().copied() == x),
                "needs linears of one input",
            )
        }
        (FusionKind::Glu, &[g, u, s, m]) => {
            let linear = |l: N| matches!(v.op(l), Op::Linear { bias: false });
            let (gi, ui, mi) = (v.ins(g), v.ins(u), v.ins(m));
            ok(
                linear(g)
                    && linear(u)
                    && gi[0] == ui[0]
                    && glu_activation(v.op(s)).is_some()
                    && v.ins(s) == [g]
                    && matches!(v.op(m), Op::Mul)
                    && (mi == [s, u] || mi == [u, s])
                    && only_read_by(g, s)
                    && only_read_by(s, m)
                    && only_read_by(u, m),
                "needs gate and up linears (no bias) of one input, an activation of the gate, and their product",
            )
        }
        (FusionKind::RopeAttention, [pre @ .., a]) => {
            let Op::Attention { head_dim, .. } = *v.op(*a) else {
                return ok(false, "ends with an attention");
            };
            let ai = v.ins(*a);
            let (ropes, norms): (Vec<N>, Vec<N>) = pre.iter().partition(|&&r| matches!(v.op(r), Op::Rope { .. }));
            let rope_fits = |r: N| only_read_by(r, *a) && (ai[0] == r) != (ai[1] == r) && ai[2] != r;
            let norm_fits = |n: N| {
                matches!(v.op(n), Op::RmsNorm { .. })
                    && v.width(v.ins(n)[1]) == head_dim
                    && ropes.iter().any(|&r| v.ins(r)[0] == n && only_read_by(n, r))
            };
            let fits = (1..=2).contains(&ropes.len())
                && ropes.iter().all(|&r| rope_fits(r) && v.op(r) == v.op(ropes[0]))
                && (ropes.len() == 1 || ropes[0] != ropes[1])
                && norms.len() <= ropes.len()
                && norms.iter().all(|&n| norm_fits(n))
                && (norms.len() < 2 || norms[0] != norms[1]);
            ok(
                fits,
                "needs ropes of q and/or k (the same op) read only by the attention, and per-head rms_norms read \
                 only by them",
            )
        }
        (FusionKind::MoeRouter, &[r, m]) => {
            let mi = v.ins(m);
            ok(
                matches!(v.op(r), Op::Linear { .. })
                    && matches!(v.op(m), Op::Moe { .. })
                    && mi[1] == r
                    && v.ins(r)[0] == mi[0]
                    && only_read_by(r, m),
                "needs a linear of the moe's input read only by the moe as its router logits",
            )
        }
        _ => Err(format!("{}: wrong number of nodes ({})", f.kind.name(), f.nodes.len())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, Graph, NodeIndex};

    /// x = embedding; s = x + x; n = rms_norm(s); logits of n.
    fn graph() -> (Graph, NodeIndex, NodeIndex) {
        let mut g = Graph::new(DType::F32);
        let w = |g: &mut Graph, name: &str, shape: Vec<usize>| {
            g.add(Op::Weight { name: name.into(), shape, dtype: DType::F32, derived: None }, &[], name).unwrap()
        };
        let (table, nw) = (w(&mut g, "table", vec![8, 4]), w(&mut g, "norm", vec![4]));
        let t = g.add(Op::Tokens, &[], "t").unwrap();
        let x = g.add(Op::Embedding, &[t, table], "x").unwrap();
        let s = g.add(Op::Add, &[x, x], "s").unwrap();
        let n = g.add(Op::RmsNorm { eps: 1e-6 }, &[s, nw], "n").unwrap();
        g.output = Some(g.add(Op::Logits, &[n, table], "logits").unwrap());
        (g, s, n)
    }

    #[test]
    fn the_verifier_applies_each_kinds_rule() {
        let (mut g, s, n) = graph();
        g.fusions.push(Fusion { kind: FusionKind::AddNorm, nodes: vec![s, n] });
        g.verify().unwrap();
        g.fusions[0].nodes = vec![n, s];
        let e = g.verify().unwrap_err().to_string();
        assert!(e.contains("add_norm: needs an add and an rms_norm of it"), "{e}");
        g.fusions[0] = Fusion { kind: FusionKind::Linears, nodes: vec![s] };
        let e = g.verify().unwrap_err().to_string();
        assert!(e.contains("linears: needs linears of one input"), "{e}");
        // A node without inputs is refused, not indexed.
        let t = g.nodes().into_iter().find(|&n| matches!(g.node(n).op, Op::Tokens)).unwrap();
        g.fusions[0] = Fusion { kind: FusionKind::Linears, nodes: vec![t] };
        let e = g.verify().unwrap_err().to_string();
        assert!(e.contains("linears: needs linears of one input"), "{e}");
    }

    #[test]
    fn a_node_is_in_one_fusion_at_most() {
        let (mut g, s, n) = graph();
        g.fusions.push(Fusion { kind: FusionKind::AddNorm, nodes: vec![s, n] });
        g.fusions.push(Fusion { kind: FusionKind::AddNorm, nodes: vec![s, n] });
        let e = g.verify().unwrap_err().to_string();
        assert!(e.contains("`s` is in two fusions"), "{e}");
    }
}
