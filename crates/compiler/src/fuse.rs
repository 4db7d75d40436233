//! Elementwise passes: chains of `map` nodes fused into one (`fuse_elementwise`), and maps of a
//! single weight computed at compile time (`fold_weights`).

use crate::passes::PassCtx;
use crate::CompileError;
use ir::{DType, Derived, Graph, NodeIndex, Op, Scalar};

/// Fuses a `map` into the `map` that is its only reader: `m(.., p(a, b), ..)` becomes one map
/// over `m`'s other inputs and `p`'s, its expression `m`'s with `p`'s substituted. Repeats
/// until no map reads a single-use map.
pub fn fuse_elementwise(g: Graph, _: &PassCtx) -> Result<Graph, CompileError> {
    fuse(g)
}

fn fuse(mut g: Graph) -> Result<Graph, CompileError> {
    while let Some((m, j)) = next_pair(&g) {
        let ins = g.inputs(m);
        let p = ins[j];
        let (Op::Map { expr: outer }, Op::Map { expr: inner }) = (&g.node(m).op, &g.node(p).op) else {
            unreachable!("next_pair returns maps")
        };
        let mut inputs: Vec<NodeIndex> = ins.iter().enumerate().filter(|&(k, _)| k != j).map(|(_, &n)| n).collect();
        let slot = |inputs: &mut Vec<NodeIndex>, n: NodeIndex| Scalar::Arg(input_slot(inputs, n));
        let inner_args: Vec<Scalar> = g.inputs(p).into_iter().map(|n| slot(&mut inputs, n)).collect();
        let inner = inner.substitute(&inner_args);
        let outer_args: Vec<Scalar> =
            ins.iter().enumerate().map(|(k, &n)| if k == j { inner.clone() } else { slot(&mut inputs, n) }).collect();
        let expr = outer.substitute(&outer_args);
        let label = g.node(m).label.clone();
        let fused = g.add(Op::Map { expr }, &inputs, label).map_err(|e| pass_err("fuse_elementwise", e))?;
        g.replace_uses(m, fused, fused);
        g.remove(m);
        g.remove(p);
    }
    Ok(g)
}

/// The index of `n` among a map's `inputs`, appending it when it is not one yet (a map reads
/// each node once, however often its expression uses it).
pub(crate) fn input_slot(inputs: &mut Vec<NodeIndex>, n: NodeIndex) -> usize {
    inputs.iter().position(|&x| x == n).unwrap_or_else(|| {
        inputs.push(n);
        inputs.len() - 1
    })
}

/// A map `m` and the slot of an input that is a map read by `m` alone.
fn next_pair(g: &Graph) -> Option<(NodeIndex, usize)> {
    g.nodes().into_iter().filter(|&m| matches!(g.node(m).op, Op::Map { .. })).find_map(|m| {
        let ins = g.inputs(m);
        let j = ins
            .iter()
            .position(|&p| matches!(g.node(p).op, Op::Map { .. }) && g.users(p).len() == 1 && g.output != Some(p))?;
        Some((m, j))
    })
}

/// Replaces each `map` whose one input is a checkpoint weight (Gemma's `1 + w` norm weights)
/// by a weight the compiler computes (`Op::Weight` with `derived`, stored in f32).
pub fn fold_weights(g: Graph, _: &PassCtx) -> Result<Graph, CompileError> {
    fold(g)
}

fn fold(mut g: Graph) -> Result<Graph, CompileError> {
    for m in g.nodes() {
        // A source weight removed below may come later in the walk.
        if !g.contains(m) {
            continue;
        }
        let Op::Map { expr } = &g.node(m).op else { continue };
        let ins = g.inputs(m);
        let [w] = ins.as_slice() else { continue };
        let Op::Weight { name, shape, derived: None, .. } = &g.node(*w).op else { continue };
        let op = Op::Weight {
            name: format!("{name} @ {expr}"),
            shape: shape.clone(),
            dtype: DType::F32,
            derived: Some(Derived { source: name.clone(), expr: expr.clone() }),
        };
        let label = g.node(m).label.clone();
        let folded = g.add(op, &[], label).map_err(|e| pass_err("fold_weights", e))?;
        g.replace_uses(m, folded, folded);
        g.remove(m);
        if g.users(*w).is_empty() && g.output != Some(*w) {
            g.remove(*w);
        }
    }
    Ok(g)
}

fn pass_err(pass: &str, e: ir::IrError) -> CompileError {
    CompileError::Pass { pass: pass.into(), source: e }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir::{Dim, Fun};

    fn call(name: &str, args: Vec<Scalar>) -> Scalar {
        Scalar::Call(Fun::named(name).unwrap(), args)
    }

    fn map(g: &mut Graph, expr: Scalar, ins: &[NodeIndex], label: &str) -> NodeIndex {
        g.add(Op::Map { expr }, ins, label).unwrap()
    }

    fn weight(g: &mut Graph, name: &str, shape: Vec<usize>) -> NodeIndex {
        g.add(Op::Weight { name: name.into(), shape, dtype: DType::BF16, derived: None }, &[], name).unwrap()
    }

    /// x = embedding; a = x / 8; b = tanh(a); c = b * x; d = a + c; e = a + d (an `add`);
    /// logits of rms_norm(e, 1 + norm): b, c and d fuse into one map over a and x; a, read by
    /// the `add` too, stays.
    fn graph() -> (Graph, NodeIndex) {
        let mut g = Graph::new(DType::F32);
        let (table, norm) = (weight(&mut g, "table", vec![16, 8]), weight(&mut g, "norm", vec![8]));
        let t = g.add(Op::Tokens, &[], "tokens").unwrap();
        let x = g.add(Op::Embedding, &[t, table], "x").unwrap();
        let a = map(&mut g, call("/", vec![Scalar::Arg(0), Scalar::Const(8.0)]), &[x], "a");
        let b = map(&mut g, call("tanh", vec![Scalar::Arg(0)]), &[a], "b");
        let c = map(&mut g, call("*", vec![Scalar::Arg(0), Scalar::Arg(1)]), &[b, x], "c");
        let d = map(&mut g, call("+", vec![Scalar::Arg(0), Scalar::Arg(1)]), &[a, c], "d");
        let w = map(&mut g, call("+", vec![Scalar::Const(1.0), Scalar::Arg(0)]), &[norm], "w");
        let e = g.add(Op::Add, &[a, d], "e").unwrap();
        let n = g.add(Op::RmsNorm { eps: 1e-6 }, &[e, w], "n").unwrap();
        let l = g.add(Op::Logits, &[n, table], "logits").unwrap();
        g.output = Some(l);
        (g, l)
    }

    fn text(g: &Graph) -> String {
        g.to_plan().unwrap().to_text()
    }

    #[test]
    fn chains_of_single_use_maps_become_one() {
        let (g, _) = graph();
        let fused = fuse(g).unwrap();
        let t = text(&fused);
        // a (read twice) stays; b, c and d become one map over a and x.
        assert!(t.contains("map{expr=(x0 / 8)}"), "{t}");
        assert!(t.contains("map{expr=(x0 + (tanh(x0) * x1))}"), "{t}");
        assert_eq!(t.matches("= map").count(), 3, "a, the fused d, and the weight's map: {t}");
        // Same values: the fused expression evaluated against the chain.
        let x = [0.7f32, -3.0];
        let a = x[0] / 8.0;
        let want = a + a.tanh() * x[1];
        let d = fused.nodes().into_iter().find(|&n| fused.node(n).label == "d").unwrap();
        let Op::Map { expr } = &fused.node(d).op else { panic!("d is a map") };
        assert_eq!(expr.eval(&[a, x[1]]), want);
    }

    #[test]
    fn maps_of_one_weight_fold_into_derived_weights() {
        let (g, _) = graph();
        let folded = fold(g).unwrap();
        let plan = folded.to_plan().unwrap();
        let derived: Vec<_> = plan
            .nodes
            .iter()
            .filter_map(|n| match &n.op {
                Op::Weight { name, dtype, derived: Some(d), .. } => Some((name.clone(), *dtype, d.source.clone())),
                _ => None,
            })
            .collect();
        assert_eq!(derived, [("norm @ (1 + x0)".to_string(), DType::F32, "norm".to_string())]);
        assert!(plan.weights().all(|(name, _, _)| name != "norm"), "the source weight is dead");
        // Maps of activations stay.
        assert_eq!(plan.nodes.iter().filter(|n| matches!(n.op, Op::Map { .. })).count(), 4);
        assert!(plan.nodes.iter().all(|n| n.ty.shape.first() != Some(&Dim::R) || matches!(n.op, Op::Logits)));
    }
}
