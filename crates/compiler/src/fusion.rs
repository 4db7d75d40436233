//! Kernel fusion passes: each finds the node sets one kernel can compute and records them as
//! [`ir::Fusion`]s of one kind. A pass proposes; [`ir::fusion::check`], the kind's rule that
//! the verifier also applies, decides, so what a kind means is written once. Backends render
//! each fusion as one kernel where their hardware path takes it (`docs/modules.md`, "The passes").

use crate::passes::PassCtx;
use crate::CompileError;
use ir::{Fusion, FusionKind, Graph, NodeIndex, Op};

/// Adds `nodes` as a fusion of `kind` when none of them is in one yet and the kind's rule
/// holds; says whether it did.
fn propose(g: &mut Graph, kind: FusionKind, nodes: Vec<NodeIndex>) -> bool {
    if nodes.iter().any(|&n| g.fusion_of(n).is_some()) {
        return false;
    }
    let f = Fusion { kind, nodes };
    if ir::fusion::check(g, &f).is_err() {
        return false;
    }
    g.fusions.push(f);
    true
}

fn of(g: &Graph, pred: impl Fn(&Op) -> bool) -> Vec<NodeIndex> {
    g.nodes().into_iter().filter(|&n| pred(&g.node(n).op)).collect()
}

/// RoPE into attention: the ropes of an attention's q and k that only it reads
/// ([`FusionKind::RopeAttention`]); where q's and k's ropes differ, q's alone.
pub fn fuse_rope_attention(g: Graph, _: &PassCtx) -> Result<Graph, CompileError> {
    Ok(rope_attention(g))
}

fn rope_attention(mut g: Graph) -> Graph {
    for a in of(&g, |op| matches!(op, Op::Attention { .. })) {
        let ins = g.inputs(a);
        let ropes: Vec<NodeIndex> =
            ins[..2].iter().copied().filter(|&r| matches!(g.node(r).op, Op::Rope { .. })).collect();
        let tries = [ropes.clone(), ropes.iter().take(1).copied().collect(), ropes.iter().skip(1).copied().collect()];
        for t in tries.into_iter().filter(|t| !t.is_empty()) {
            if propose(&mut g, FusionKind::RopeAttention, [t, vec![a]].concat()) {
                break;
            }
        }
    }
    g
}

/// Gated MLPs: `silu(gate) * up` with gate and up linears of one input
/// ([`FusionKind::Glu`]).
pub fn fuse_glu(g: Graph, _: &PassCtx) -> Result<Graph, CompileError> {
    Ok(glu(g))
}

fn glu(mut g: Graph) -> Graph {
    for m in of(&g, |op| matches!(op, Op::Mul)) {
        let ins = g.inputs(m);
        for (s, u) in [(ins[0], ins[1]), (ins[1], ins[0])] {
            if matches!(g.node(s).op, Op::Silu) {
                let gate = g.inputs(s)[0];
                if propose(&mut g, FusionKind::Glu, vec![gate, u, s, m]) {
                    break;
                }
            }
        }
    }
    g
}

/// Linears of one input, three at a time in graph order ([`FusionKind::Linears`]): q, k and
/// v. Linears already in a fusion (a GLU's) stay out.
pub fn group_linears(g: Graph, _: &PassCtx) -> Result<Graph, CompileError> {
    Ok(linears(g))
}

fn linears(mut g: Graph) -> Graph {
    for x in g.nodes() {
        let mut readers: Vec<NodeIndex> = g
            .users(x)
            .into_iter()
            .filter(|&l| matches!(g.node(l).op, Op::Linear { .. }) && g.inputs(l)[0] == x && g.fusion_of(l).is_none())
            .collect();
        readers.sort();
        readers.dedup();
        for chunk in readers.chunks(3) {
            propose(&mut g, FusionKind::Linears, chunk.to_vec());
        }
    }
    g
}

/// Residual add + RMS norm: an add and the first RMS norm of it ([`FusionKind::AddNorm`]).
pub fn fuse_add_norm(g: Graph, _: &PassCtx) -> Result<Graph, CompileError> {
    Ok(add_norm(g))
}

fn add_norm(mut g: Graph) -> Graph {
    for a in of(&g, |op| matches!(op, Op::Add)) {
        let mut norms: Vec<NodeIndex> =
            g.users(a).into_iter().filter(|&n| matches!(g.node(n).op, Op::RmsNorm { .. })).collect();
        norms.sort();
        for n in norms {
            if propose(&mut g, FusionKind::AddNorm, vec![a, n]) {
                break;
            }
        }
    }
    g
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir::{DType, RopeScaling};

    fn weight(g: &mut Graph, name: &str, shape: Vec<usize>) -> NodeIndex {
        g.add(Op::Weight { name: name.into(), shape, dtype: DType::BF16, derived: None }, &[], name).unwrap()
    }

    fn linear(g: &mut Graph, x: NodeIndex, name: &str, n: usize) -> NodeIndex {
        let w = weight(g, name, vec![n, 32]);
        g.add(Op::Linear { bias: false }, &[x, w], name).unwrap()
    }

    /// One Llama layer, 32 wide: norm, q/k/v, rope, attention, o, add + norm, a SwiGLU MLP
    /// whose product is `act(gate) * up` (`act` a silu, or a map), add, final norm, logits.
    fn layer(act: Option<ir::Scalar>) -> Graph {
        let mut g = Graph::new(DType::BF16);
        let table = weight(&mut g, "table", vec![16, 32]);
        let (t, pos) = (g.add(Op::Tokens, &[], "t").unwrap(), g.add(Op::Positions, &[], "p").unwrap());
        let x = g.add(Op::Embedding, &[t, table], "x").unwrap();
        let norm = |g: &mut Graph, x, name: &str| {
            let w = weight(g, name, vec![32]);
            g.add(Op::RmsNorm { eps: 1e-6 }, &[x, w], name).unwrap()
        };
        let h = norm(&mut g, x, "n1");
        let (q, k, v) = (linear(&mut g, h, "q", 32), linear(&mut g, h, "k", 16), linear(&mut g, h, "v", 16));
        let rope = Op::Rope { head_dim: 16, theta: 1e4, scaling: RopeScaling::Default, rotary_dim: None };
        let q = g.add(rope.clone(), &[q, pos], "rq").unwrap();
        let k = g.add(rope, &[k, pos], "rk").unwrap();
        let attn =
            Op::Attention { heads: 2, kv_heads: 1, head_dim: 16, scale: 0.25, layer: 0, window: None, softcap: None };
        let a = g.add(attn, &[q, k, v], "a").unwrap();
        let o = linear(&mut g, a, "o", 32);
        let x = g.add(Op::Add, &[x, o], "x1").unwrap();
        let h = norm(&mut g, x, "n2");
        let (gate, up) = (linear(&mut g, h, "gate", 64), linear(&mut g, h, "up", 64));
        let s = match act {
            None => g.add(Op::Silu, &[gate], "s").unwrap(),
            Some(expr) => g.add(Op::Map { expr }, &[gate], "s").unwrap(),
        };
        let m = g.add(Op::Mul, &[s, up], "m").unwrap();
        let down = weight(&mut g, "down", vec![32, 64]);
        let d = g.add(Op::Linear { bias: false }, &[m, down], "d").unwrap();
        let x = g.add(Op::Add, &[x, d], "x2").unwrap();
        let h = norm(&mut g, x, "n3");
        g.output = Some(g.add(Op::Logits, &[h, table], "logits").unwrap());
        g
    }

    fn fused(g: Graph) -> Vec<(FusionKind, Vec<String>)> {
        let g = add_norm(linears(glu(rope_attention(g))));
        g.verify().unwrap();
        g.fusions.iter().map(|f| (f.kind, f.nodes.iter().map(|&n| g.node(n).label.clone()).collect())).collect()
    }

    fn labels(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_llama_layer_has_seven_fusions() {
        let want = vec![
            (FusionKind::RopeAttention, labels(&["rq", "rk", "a"])),
            (FusionKind::Glu, labels(&["gate", "up", "s", "m"])),
            (FusionKind::Linears, labels(&["q", "k", "v"])),
            (FusionKind::Linears, labels(&["o"])),
            (FusionKind::Linears, labels(&["d"])),
            (FusionKind::AddNorm, labels(&["x1", "n2"])),
            (FusionKind::AddNorm, labels(&["x2", "n3"])),
        ];
        assert_eq!(fused(layer(None)), want);
    }

    /// The plan prints each fusion as a block of consecutive nodes.
    #[test]
    fn plans_print_fusions_as_blocks() {
        let g = add_norm(linears(glu(rope_attention(layer(None)))));
        let t = g.to_plan().unwrap().to_text();
        assert!(t.contains("fuse glu {\n  %"), "{t}");
        assert_eq!(t.matches("fuse ").count(), 7, "{t}");
        assert_eq!(t.matches("\n}\n").count(), 7, "{t}");
    }

    /// A GLU whose up projection is read by another node too is not fused (the kernel never
    /// writes up); its gate and up are still one launch of linears.
    #[test]
    fn a_glu_needs_its_linears_to_itself() {
        let mut g = layer(None);
        let find = |g: &Graph, label: &str| {
            g.nodes().into_iter().find(|&n| g.node(n).label == label && !matches!(g.node(n).op, Op::Weight { .. }))
        };
        let (up, m) = (find(&g, "up").unwrap(), find(&g, "m").unwrap());
        let extra = g.add(Op::Silu, &[up], "extra").unwrap();
        let mm = g.add(Op::Mul, &[m, extra], "mm").unwrap();
        g.replace_uses(m, mm, mm);
        let f = fused(g);
        assert!(!f.iter().any(|(k, _)| *k == FusionKind::Glu), "{f:?}");
        assert!(f.contains(&(FusionKind::Linears, labels(&["gate", "up"]))), "{f:?}");
    }

    /// Two ropes that differ: only q's is fused; k's runs on its own.
    #[test]
    fn different_ropes_fuse_only_q() {
        let mut g = layer(None);
        let rk = g.nodes().into_iter().find(|&n| g.node(n).label == "rk").unwrap();
        if let Op::Rope { theta, .. } = &mut g.node_mut(rk).op {
            *theta = 1e6;
        }
        let f = fused(g);
        assert_eq!(f[0], (FusionKind::RopeAttention, labels(&["rq", "a"])));
    }
}
