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

/// RoPE into attention: the ropes of an attention's q and k that only it reads, with the
/// per-head RMS norms they rotate ([`FusionKind::RopeAttention`]); where q's and k's ropes
/// differ, q's alone.
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
            // The per-head norms the ropes rotate join where the rule takes them: both, either,
            // or none.
            let norms: Vec<NodeIndex> =
                t.iter().map(|&r| g.inputs(r)[0]).filter(|&n| matches!(g.node(n).op, Op::RmsNorm { .. })).collect();
            let mut subsets = vec![norms.clone()];
            if norms.len() == 2 {
                subsets.extend([vec![norms[0]], vec![norms[1]]]);
            }
            if !norms.is_empty() {
                subsets.push(vec![]);
            }
            let fused = subsets
                .into_iter()
                .any(|n| propose(&mut g, FusionKind::RopeAttention, [n, t.clone(), vec![a]].concat()));
            if fused {
                break;
            }
        }
    }
    g
}

/// A mixture of experts' router: the linear of the moe's input that gives its logits
/// ([`FusionKind::MoeRouter`]).
pub fn fuse_moe_router(mut g: Graph, _: &PassCtx) -> Result<Graph, CompileError> {
    for m in of(&g, |op| matches!(op, Op::Moe { .. })) {
        let r = g.inputs(m)[1];
        propose(&mut g, FusionKind::MoeRouter, vec![r, m]);
    }
    Ok(g)
}

/// Gated MLPs: `act(gate) * up` with gate and up linears of one input and `act` a silu or a
/// map of the gate ([`FusionKind::Glu`]).
pub fn fuse_glu(g: Graph, _: &PassCtx) -> Result<Graph, CompileError> {
    Ok(glu(g))
}

fn glu(mut g: Graph) -> Graph {
    for m in of(&g, |op| matches!(op, Op::Mul)) {
        let ins = g.inputs(m);
        for (s, u) in [(ins[0], ins[1]), (ins[1], ins[0])] {
            if ir::fusion::glu_activation(&g.node(s).op).is_some() {
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

/// Residual add + RMS norm: an add and the first RMS norm of it ([`FusionKind::AddNorm`]), with
/// the RMS norm of the add's other input when only the add reads it
/// ([`FusionKind::NormAddNorm`]: Gemma's sandwich norms).
pub fn fuse_add_norm(g: Graph, _: &PassCtx) -> Result<Graph, CompileError> {
    Ok(add_norm(g))
}

fn add_norm(mut g: Graph) -> Graph {
    for a in of(&g, |op| matches!(op, Op::Add)) {
        let mut norms: Vec<NodeIndex> =
            g.users(a).into_iter().filter(|&n| matches!(g.node(n).op, Op::RmsNorm { .. })).collect();
        norms.sort();
        let pre: Vec<NodeIndex> =
            g.inputs(a).into_iter().filter(|&p| matches!(g.node(p).op, Op::RmsNorm { .. })).collect();
        for n in norms {
            let sandwich = pre.iter().any(|&p| propose(&mut g, FusionKind::NormAddNorm, vec![p, a, n]));
            if sandwich || propose(&mut g, FusionKind::AddNorm, vec![a, n]) {
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
        let attn = Op::Attention {
            heads: 2,
            kv_heads: 1,
            head_dim: 16,
            scale: 0.25,
            layer: 0,
            window: None,
            softcap: None,
            sinks: false,
        };
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

    /// The node labelled `label` that is not a weight (weights are labelled by name).
    fn find(g: &Graph, label: &str) -> NodeIndex {
        let n = g.nodes().into_iter().find(|&n| g.node(n).label == label && !matches!(g.node(n).op, Op::Weight { .. }));
        n.unwrap_or_else(|| panic!("no node `{label}`"))
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
        let (up, m) = (find(&g, "up"), find(&g, "m"));
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
        let rk = find(&g, "rk");
        if let Op::Rope { theta, .. } = &mut g.node_mut(rk).op {
            *theta = 1e6;
        }
        let f = fused(g);
        assert_eq!(f[0], (FusionKind::RopeAttention, labels(&["rq", "a"])));
    }

    /// Gemma's GLU: `gelu_tanh(gate) * up` fuses as SwiGLU does.
    #[test]
    fn a_glu_takes_any_one_input_activation() {
        let gelu = ir::Scalar::call(ir::Fun::named("gelu_tanh").unwrap(), vec![ir::Scalar::Arg(0)]);
        let f = fused(layer(Some(gelu)));
        assert!(f.contains(&(FusionKind::Glu, labels(&["gate", "up", "s", "m"]))), "{f:?}");
        // A map of two inputs is no activation.
        let two = ir::Scalar::call(ir::Fun::named("*").unwrap(), vec![ir::Scalar::Arg(0), ir::Scalar::Arg(0)]);
        assert!(ir::fusion::glu_activation(&Op::Map { expr: two }).is_some(), "x0 * x0 reads one input");
        let sum = ir::Scalar::call(ir::Fun::named("+").unwrap(), vec![ir::Scalar::Arg(0), ir::Scalar::Arg(1)]);
        assert!(ir::fusion::glu_activation(&Op::Map { expr: sum }).is_none());
    }

    /// Gemma's sandwich: `x + rms_norm(o)` then the next norm is one norm_add_norm; the
    /// residual add of a layer without a post-norm stays an add_norm.
    #[test]
    fn a_norm_of_the_added_sublayer_output_joins_the_add() {
        let mut g = layer(None);
        let (x1, o) = (find(&g, "x1"), find(&g, "o"));
        let w = weight(&mut g, "post", vec![32]);
        let post = g.add(Op::RmsNorm { eps: 1e-6 }, &[o, w], "post").unwrap();
        g.replace_uses(o, post, post);
        assert_eq!(g.inputs(x1)[1], post);
        let f = fused(g);
        assert!(f.contains(&(FusionKind::NormAddNorm, labels(&["post", "x1", "n2"]))), "{f:?}");
        assert!(f.contains(&(FusionKind::AddNorm, labels(&["x2", "n3"]))), "{f:?}");
    }
}
